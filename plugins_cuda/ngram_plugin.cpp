// TensorRT IPluginV3 plugin NGramRepeatBlock; see ngram_plugin.h.
//
// The library deliberately calls no TensorRT function (only virtual methods of objects TensorRT hands
// in), so it needs no libnvinfer at load time; CUDA runtime calls go to the statically linked cudart.

#include "ngram_plugin.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <sstream>
#include <string>

using namespace nvinfer1;

namespace elx
{
namespace
{

std::mutex gLoggerMutex;
ILoggerFinder* gLoggerFinder = nullptr;
thread_local std::string tLastError;

void reportError(std::string const& message) noexcept
{
    try
    {
        std::string const text = std::string(kNGramPluginName) + " plugin: " + message;
        tLastError = text;
        ILogger* logger = nullptr;
        {
            std::lock_guard<std::mutex> lock(gLoggerMutex);
            if (gLoggerFinder != nullptr)
            {
                logger = gLoggerFinder->findLogger();
            }
        }
        if (logger != nullptr)
        {
            logger->log(ILogger::Severity::kERROR, text.c_str());
        }
        else
        {
            std::fprintf(stderr, "%s\n", text.c_str());
        }
    }
    catch (...)
    {
    }
}

bool isTokenType(DataType t) noexcept
{
    return t == DataType::kINT64 || t == DataType::kINT32;
}

bool isScoreType(DataType t) noexcept
{
    return t == DataType::kFLOAT || t == DataType::kHALF;
}

std::string dimsToString(Dims const& d)
{
    std::ostringstream os;
    os << "[";
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        os << (i ? ", " : "") << d.d[i];
    }
    os << "]";
    return os.str();
}

// Shapes of a concrete (runtime) call: both rank 2, same number of rows.
bool checkRuntimeDims(Dims const& history, Dims const& scores) noexcept
{
    try
    {
        if (history.nbDims != 2 || scores.nbDims != 2)
        {
            reportError("expects history [rows, cur_len] and scores [rows, vocab], got history "
                + dimsToString(history) + " and scores " + dimsToString(scores));
            return false;
        }
        if (history.d[0] != scores.d[0])
        {
            reportError("history rows (" + std::to_string(history.d[0]) + ") differ from scores rows ("
                + std::to_string(scores.d[0]) + ")");
            return false;
        }
    }
    catch (...)
    {
        return false;
    }
    return true;
}

} // namespace

// ----------------------------------------------------------------------------------------------------
// NGramRepeatBlockPlugin

NGramRepeatBlockPlugin::NGramRepeatBlockPlugin(int32_t ngramSize, std::string pluginNamespace)
    : mNgramSize(ngramSize)
    , mNamespace(std::move(pluginNamespace))
{
    initFields();
}

NGramRepeatBlockPlugin::NGramRepeatBlockPlugin(NGramRepeatBlockPlugin const& other)
    : IPluginV3(other)
    , IPluginV3OneCore(other)
    , IPluginV3OneBuild(other)
    , IPluginV3OneRuntime(other)
    , mNgramSize(other.mNgramSize)
    , mNamespace(other.mNamespace)
{
    initFields(); // the field must point at this object's member, not the source's
}

void NGramRepeatBlockPlugin::initFields() noexcept
{
    mField = PluginField(kNGramFieldName, &mNgramSize, PluginFieldType::kINT32, 1);
    mFieldCollection.nbFields = 1;
    mFieldCollection.fields = &mField;
}

IPluginCapability* NGramRepeatBlockPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* NGramRepeatBlockPlugin::clone() noexcept
{
    try
    {
        return new NGramRepeatBlockPlugin(*this);
    }
    catch (std::exception const& e)
    {
        reportError(std::string("clone failed: ") + e.what());
    }
    return nullptr;
}

char const* NGramRepeatBlockPlugin::getPluginName() const noexcept
{
    return kNGramPluginName;
}

char const* NGramRepeatBlockPlugin::getPluginVersion() const noexcept
{
    return kNGramPluginVersion;
}

char const* NGramRepeatBlockPlugin::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

int32_t NGramRepeatBlockPlugin::getNbOutputs() const noexcept
{
    return 1;
}

int32_t NGramRepeatBlockPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    if (in == nullptr || out == nullptr || nbInputs != 2 || nbOutputs != 1)
    {
        reportError("expects 2 inputs (history, scores) and 1 output");
        return -1;
    }
    Dims const& h = in[0].desc.dims;
    Dims const& s = in[1].desc.dims;
    if (h.nbDims != 2 || s.nbDims != 2)
    {
        reportError("history and scores must both have rank 2");
        return -1;
    }
    // -1 marks a dimension that is only known at run time.
    if (h.d[0] >= 0 && s.d[0] >= 0 && h.d[0] != s.d[0])
    {
        reportError("history and scores have different numbers of rows");
        return -1;
    }
    return 0;
}

int32_t NGramRepeatBlockPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (outputTypes == nullptr || inputTypes == nullptr || nbInputs != 2 || nbOutputs != 1)
    {
        reportError("expects 2 inputs (history, scores) and 1 output");
        return -1;
    }
    if (!isScoreType(inputTypes[1]))
    {
        reportError("scores (input 1) must be float32 or float16");
        return -1;
    }
    outputTypes[0] = inputTypes[1];
    return 0;
}

int32_t NGramRepeatBlockPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& /*exprBuilder*/) noexcept
{
    if (inputs == nullptr || outputs == nullptr || nbInputs != 2 || nbOutputs != 1)
    {
        reportError("expects 2 inputs (history, scores) and 1 output");
        return -1;
    }
    if (inputs[0].nbDims != 2 || inputs[1].nbDims != 2)
    {
        reportError("history must be [rows, cur_len] and scores [rows, vocab]");
        return -1;
    }
    outputs[0] = inputs[1];
    return 0;
}

bool NGramRepeatBlockPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (inOut == nullptr || nbInputs != 2 || nbOutputs != 1 || pos < 0 || pos > 2)
    {
        return false;
    }
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    switch (pos)
    {
    case 0: return isTokenType(d.type);
    case 1: return isScoreType(d.type);
    default: return d.type == inOut[1].desc.type;
    }
}

size_t NGramRepeatBlockPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0;
}

int32_t NGramRepeatBlockPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    if (in == nullptr || out == nullptr || nbInputs != 2 || nbOutputs != 1)
    {
        reportError("expects 2 inputs (history, scores) and 1 output");
        return -1;
    }
    return checkRuntimeDims(in[0].dims, in[1].dims) ? 0 : -1;
}

int32_t NGramRepeatBlockPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    if (inputDesc == nullptr || inputs == nullptr || outputs == nullptr)
    {
        return -1;
    }
    Dims const& h = inputDesc[0].dims;
    Dims const& s = inputDesc[1].dims;
    if (!checkRuntimeDims(h, s))
    {
        return -1;
    }
    int64_t const rows = s.d[0];
    int64_t const vocab = s.d[1];
    int64_t const curLen = h.d[1];

    int tokenType;
    switch (inputDesc[0].type)
    {
    case DataType::kINT64: tokenType = NGRAM_TOKENS_INT64; break;
    case DataType::kINT32: tokenType = NGRAM_TOKENS_INT32; break;
    default: reportError("history must be int64 or int32"); return -1;
    }
    int scoreType;
    size_t elementSize;
    switch (inputDesc[1].type)
    {
    case DataType::kFLOAT:
        scoreType = NGRAM_SCORES_FLOAT32;
        elementSize = 4;
        break;
    case DataType::kHALF:
        scoreType = NGRAM_SCORES_FLOAT16;
        elementSize = 2;
        break;
    default: reportError("scores must be float32 or float16"); return -1;
    }

    size_t const bytes = static_cast<size_t>(rows) * static_cast<size_t>(vocab) * elementSize;
    if (bytes > 0 && outputs[0] != inputs[1])
    {
        cudaError_t const copyStatus
            = cudaMemcpyAsync(outputs[0], inputs[1], bytes, cudaMemcpyDeviceToDevice, stream);
        if (copyStatus != cudaSuccess)
        {
            reportError(std::string("copying scores failed: ") + cudaGetErrorString(copyStatus));
            return -1;
        }
    }
    int const status = ngramRepeatBlockLaunch(
        inputs[0], tokenType, outputs[0], scoreType, rows, curLen, vocab, mNgramSize, stream);
    if (status != 0)
    {
        reportError(std::string("kernel launch failed: ") + cudaGetErrorString(static_cast<cudaError_t>(status)));
        return -1;
    }
    return 0;
}

IPluginV3* NGramRepeatBlockPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* NGramRepeatBlockPlugin::getFieldsToSerialize() noexcept
{
    initFields();
    return &mFieldCollection;
}

// ----------------------------------------------------------------------------------------------------
// NGramRepeatBlockCreator

NGramRepeatBlockCreator::NGramRepeatBlockCreator()
    : mNamespace(ELX_NGRAM_PLUGIN_NAMESPACE)
{
    mFieldNames[0] = PluginField(kNGramFieldName, nullptr, PluginFieldType::kINT32, 1);
    mFieldCollection.nbFields = 1;
    mFieldCollection.fields = mFieldNames;
}

IPluginV3* NGramRepeatBlockCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    try
    {
        bool found = false;
        int64_t ngramSize = 0;
        if (fc != nullptr && fc->nbFields > 0 && fc->fields == nullptr)
        {
            reportError("PluginFieldCollection has fields == nullptr");
            return nullptr;
        }
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
        {
            PluginField const& f = fc->fields[i];
            if (f.name == nullptr || std::strcmp(f.name, kNGramFieldName) != 0)
            {
                continue; // unknown fields are ignored
            }
            if (f.data == nullptr || f.length != 1)
            {
                reportError("field ngram_size must hold exactly one value");
                return nullptr;
            }
            if (f.type == PluginFieldType::kINT32)
            {
                ngramSize = *static_cast<int32_t const*>(f.data);
            }
            else if (f.type == PluginFieldType::kINT64)
            {
                ngramSize = *static_cast<int64_t const*>(f.data);
            }
            else
            {
                reportError("field ngram_size must be int32 (PluginFieldType::kINT32)");
                return nullptr;
            }
            found = true;
        }
        if (!found)
        {
            reportError("missing required field ngram_size");
            return nullptr;
        }
        if (ngramSize < 1 || ngramSize > INT32_MAX)
        {
            reportError("ngram_size must be >= 1 (and fit int32), got " + std::to_string(ngramSize));
            return nullptr;
        }
        return new NGramRepeatBlockPlugin(static_cast<int32_t>(ngramSize), mNamespace);
    }
    catch (std::exception const& e)
    {
        reportError(std::string("createPlugin failed: ") + e.what());
    }
    return nullptr;
}

PluginFieldCollection const* NGramRepeatBlockCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

char const* NGramRepeatBlockCreator::getPluginName() const noexcept
{
    return kNGramPluginName;
}

char const* NGramRepeatBlockCreator::getPluginVersion() const noexcept
{
    return kNGramPluginVersion;
}

char const* NGramRepeatBlockCreator::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

} // namespace elx

// ----------------------------------------------------------------------------------------------------
// Library entry points

extern "C" ELX_NGRAM_EXPORT IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static elx::NGramRepeatBlockCreator sCreator;
    static IPluginCreatorInterface* const sCreators[] = {&sCreator};
    nbCreators = 1;
    return sCreators;
}

extern "C" ELX_NGRAM_EXPORT void setLoggerFinder(ILoggerFinder* finder)
{
    std::lock_guard<std::mutex> lock(elx::gLoggerMutex);
    elx::gLoggerFinder = finder;
}

extern "C" ELX_NGRAM_EXPORT char const* elxNgramPluginLastError()
{
    return elx::tLastError.c_str();
}

#ifdef ELX_NGRAM_STATIC_REGISTRATION
// Registers the creator when the library is loaded (trtexec --staticPlugins, plain dlopen).  Needs
// getPluginRegistry() from libnvinfer, so such a build must link -lnvinfer, and must not also be
// loaded through IPluginRegistry::loadLibrary (the creator would be registered twice).
namespace elx
{
REGISTER_TENSORRT_PLUGIN(NGramRepeatBlockCreator);
} // namespace elx
#endif
