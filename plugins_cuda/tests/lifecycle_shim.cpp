// Test shim for tests/test_ngram_plugin.py: drives the NGramRepeatBlock plugin through its C++
// interfaces the way TensorRT does (getCreators -> creator -> createPlugin -> capabilities -> clone ...)
// and returns plain C data that ctypes can read.  Built by `tools/build_plugin.py --target shim`,
// linked against libelx_ngram_plugin.so.  No TensorRT library and no GPU are needed except for
// shim_enqueue, which needs device pointers.

#include "ngram_plugin.h"

#include <cstdio>
#include <cstring>

using namespace nvinfer1;

#define SHIM_EXPORT extern "C" __attribute__((visibility("default")))

namespace
{

void copyString(char* dst, size_t size, char const* src)
{
    std::snprintf(dst, size, "%s", src != nullptr ? src : "(null)");
}

IPluginCreatorV3One* firstCreator()
{
    int32_t count = -1;
    IPluginCreatorInterface* const* creators = getCreators(count);
    if (creators == nullptr || count < 1 || creators[0] == nullptr)
    {
        return nullptr;
    }
    // TensorRT identifies the creator flavour by its interface kind, then casts.
    if (std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0)
    {
        return nullptr;
    }
    return static_cast<IPluginCreatorV3One*>(creators[0]);
}

IPluginV3* asPlugin(void* p)
{
    return static_cast<IPluginV3*>(p);
}

IPluginV3OneBuild* build(void* p)
{
    return static_cast<IPluginV3OneBuild*>(asPlugin(p)->getCapabilityInterface(PluginCapabilityType::kBUILD));
}

IPluginV3OneRuntime* runtime(void* p)
{
    return static_cast<IPluginV3OneRuntime*>(asPlugin(p)->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}

// Stand-ins for TensorRT's symbolic dimension objects: the plugin only copies the pointers.
struct FakeDim : public IDimensionExpr
{
    FakeDim()
    {
        mImpl = nullptr;
    }
};

struct FakeExprBuilder : public IExprBuilder
{
    FakeExprBuilder()
    {
        mImpl = nullptr;
    }
};

DynamicPluginTensorDesc makeDesc(int32_t rank, int64_t d0, int64_t d1, DataType type, TensorFormat format)
{
    DynamicPluginTensorDesc desc{};
    desc.desc.dims.nbDims = rank;
    if (rank > 0)
        desc.desc.dims.d[0] = d0;
    if (rank > 1)
        desc.desc.dims.d[1] = d1;
    for (int32_t i = 2; i < rank; ++i)
        desc.desc.dims.d[i] = 1;
    desc.desc.type = type;
    desc.desc.format = format;
    desc.desc.scale = 1.0F;
    desc.min = desc.desc.dims;
    desc.max = desc.desc.dims;
    desc.opt = desc.desc.dims;
    return desc;
}

} // namespace

struct ShimCreatorInfo
{
    int32_t nbCreators;
    char kind[64];
    int32_t kindMajor;
    char name[64];
    char version[16];
    char pluginNamespace[64];
    int32_t nbFieldNames;
    char fieldName[64];
    int32_t fieldType;
    int32_t fieldLength;
};

struct ShimPluginInfo
{
    char kind[64];
    int32_t kindMajor;
    char coreKind[64];
    char buildKind[64];
    char runtimeKind[64];
    char name[64];
    char version[16];
    char pluginNamespace[64];
    int32_t nbOutputs;
    int32_t nbFields;
    char fieldName[64];
    int32_t fieldType;
    int32_t fieldLength;
    int32_t fieldValue;
    int64_t workspace;
};

SHIM_EXPORT int shim_creator_info(ShimCreatorInfo* out)
{
    std::memset(out, 0, sizeof(*out));
    int32_t count = -1;
    IPluginCreatorInterface* const* creators = getCreators(count);
    out->nbCreators = count;
    if (creators == nullptr || count < 1 || creators[0] == nullptr)
    {
        return -1;
    }
    InterfaceInfo const info = creators[0]->getInterfaceInfo();
    copyString(out->kind, sizeof(out->kind), info.kind);
    out->kindMajor = info.major;
    IPluginCreatorV3One* creator = firstCreator();
    if (creator == nullptr)
    {
        return -2;
    }
    copyString(out->name, sizeof(out->name), creator->getPluginName());
    copyString(out->version, sizeof(out->version), creator->getPluginVersion());
    copyString(out->pluginNamespace, sizeof(out->pluginNamespace), creator->getPluginNamespace());
    PluginFieldCollection const* fields = creator->getFieldNames();
    if (fields == nullptr)
    {
        return -3;
    }
    out->nbFieldNames = fields->nbFields;
    if (fields->nbFields > 0)
    {
        copyString(out->fieldName, sizeof(out->fieldName), fields->fields[0].name);
        out->fieldType = static_cast<int32_t>(fields->fields[0].type);
        out->fieldLength = fields->fields[0].length;
    }
    return 0;
}

// Creates a plugin from a field collection holding one field `fieldName` of PluginFieldType
// `fieldType` (kINT32 = 5, kINT64 = 10, kFLOAT32 = 1) with value `value`; withField = 0 passes an
// empty collection.  phase: 0 = kBUILD, 1 = kRUNTIME.  Returns nullptr on failure.
SHIM_EXPORT void* shim_create(char const* fieldName, int32_t fieldType, int64_t value, int32_t withField, int32_t phase)
{
    IPluginCreatorV3One* creator = firstCreator();
    if (creator == nullptr)
    {
        return nullptr;
    }
    int32_t v32 = static_cast<int32_t>(value);
    int64_t v64 = value;
    float vf = static_cast<float>(value);
    void const* data = &v32;
    PluginFieldType type = static_cast<PluginFieldType>(fieldType);
    if (type == PluginFieldType::kINT64)
        data = &v64;
    else if (type == PluginFieldType::kFLOAT32)
        data = &vf;
    PluginField field(fieldName, data, type, 1);
    PluginFieldCollection fc{};
    fc.nbFields = withField ? 1 : 0;
    fc.fields = withField ? &field : nullptr;
    return creator->createPlugin("ngram_test", &fc, phase ? TensorRTPhase::kRUNTIME : TensorRTPhase::kBUILD);
}

SHIM_EXPORT int shim_plugin_info(void* p, ShimPluginInfo* out)
{
    std::memset(out, 0, sizeof(*out));
    IPluginV3* plugin = asPlugin(p);
    InterfaceInfo const info = plugin->getInterfaceInfo();
    copyString(out->kind, sizeof(out->kind), info.kind);
    out->kindMajor = info.major;
    IPluginCapability* core = plugin->getCapabilityInterface(PluginCapabilityType::kCORE);
    IPluginCapability* buildCap = plugin->getCapabilityInterface(PluginCapabilityType::kBUILD);
    IPluginCapability* runtimeCap = plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME);
    if (core == nullptr || buildCap == nullptr || runtimeCap == nullptr)
    {
        return -1;
    }
    copyString(out->coreKind, sizeof(out->coreKind), core->getInterfaceInfo().kind);
    copyString(out->buildKind, sizeof(out->buildKind), buildCap->getInterfaceInfo().kind);
    copyString(out->runtimeKind, sizeof(out->runtimeKind), runtimeCap->getInterfaceInfo().kind);
    auto* c = static_cast<IPluginV3OneCore*>(core);
    copyString(out->name, sizeof(out->name), c->getPluginName());
    copyString(out->version, sizeof(out->version), c->getPluginVersion());
    copyString(out->pluginNamespace, sizeof(out->pluginNamespace), c->getPluginNamespace());
    auto* b = static_cast<IPluginV3OneBuild*>(buildCap);
    out->nbOutputs = b->getNbOutputs();
    DynamicPluginTensorDesc io[3] = {makeDesc(2, 4, 7, DataType::kINT64, TensorFormat::kLINEAR),
        makeDesc(2, 4, 11, DataType::kFLOAT, TensorFormat::kLINEAR),
        makeDesc(2, 4, 11, DataType::kFLOAT, TensorFormat::kLINEAR)};
    out->workspace = static_cast<int64_t>(b->getWorkspaceSize(io, 2, io + 2, 1));
    PluginFieldCollection const* fc = static_cast<IPluginV3OneRuntime*>(runtimeCap)->getFieldsToSerialize();
    if (fc == nullptr)
    {
        return -2;
    }
    out->nbFields = fc->nbFields;
    if (fc->nbFields > 0)
    {
        PluginField const& f = fc->fields[0];
        copyString(out->fieldName, sizeof(out->fieldName), f.name);
        out->fieldType = static_cast<int32_t>(f.type);
        out->fieldLength = f.length;
        out->fieldValue = (f.type == PluginFieldType::kINT32 && f.data != nullptr) ? *static_cast<int32_t const*>(f.data) : -999;
    }
    return 0;
}

SHIM_EXPORT void* shim_clone(void* p)
{
    return asPlugin(p)->clone();
}

SHIM_EXPORT void* shim_attach(void* p)
{
    return runtime(p)->attachToContext(nullptr);
}

// What TensorRT does when deserializing an engine: feed getFieldsToSerialize() back into the creator.
SHIM_EXPORT void* shim_recreate_from_serialized(void* p)
{
    IPluginCreatorV3One* creator = firstCreator();
    if (creator == nullptr)
    {
        return nullptr;
    }
    return creator->createPlugin("ngram_test", runtime(p)->getFieldsToSerialize(), TensorRTPhase::kRUNTIME);
}

SHIM_EXPORT void shim_destroy(void* p)
{
    delete asPlugin(p);
}

// Data types are nvinfer1::DataType values (kFLOAT 0, kHALF 1, kINT8 2, kINT32 3, kINT64 8, kBF16 7).
SHIM_EXPORT int shim_output_type(void* p, int32_t in0, int32_t in1, int32_t* out0)
{
    DataType in[2] = {static_cast<DataType>(in0), static_cast<DataType>(in1)};
    DataType out = DataType::kBOOL;
    int const status = build(p)->getOutputDataTypes(&out, 1, in, 2);
    *out0 = static_cast<int32_t>(out);
    return status;
}

SHIM_EXPORT int shim_supports(void* p, int32_t pos, int32_t t0, int32_t t1, int32_t t2, int32_t linear)
{
    TensorFormat const fmt = linear ? TensorFormat::kLINEAR : TensorFormat::kCHW32;
    DynamicPluginTensorDesc io[3] = {makeDesc(2, -1, -1, static_cast<DataType>(t0), fmt),
        makeDesc(2, -1, -1, static_cast<DataType>(t1), fmt), makeDesc(2, -1, -1, static_cast<DataType>(t2), fmt)};
    return build(p)->supportsFormatCombination(pos, io, 2, 1) ? 1 : 0;
}

// Returns 1 if output 0 got exactly the dimension expressions of input 1, 0 if not, < 0 on error status.
SHIM_EXPORT int shim_output_shapes(void* p, int32_t rank0, int32_t rank1)
{
    static FakeDim dims[2][Dims::MAX_DIMS];
    FakeExprBuilder builder;
    DimsExprs in[2];
    in[0].nbDims = rank0;
    in[1].nbDims = rank1;
    for (int32_t i = 0; i < Dims::MAX_DIMS; ++i)
    {
        in[0].d[i] = &dims[0][i];
        in[1].d[i] = &dims[1][i];
    }
    DimsExprs out{};
    int const status = build(p)->getOutputShapes(in, 2, nullptr, 0, &out, 1, builder);
    if (status != 0)
    {
        return -1;
    }
    if (out.nbDims != rank1)
    {
        return 0;
    }
    for (int32_t i = 0; i < rank1; ++i)
    {
        if (out.d[i] != in[1].d[i])
        {
            return 0;
        }
    }
    return 1;
}

SHIM_EXPORT int shim_configure(void* p, int32_t rank0, int32_t rank1, int64_t rows0, int64_t rows1)
{
    DynamicPluginTensorDesc in[2] = {makeDesc(rank0, rows0, 9, DataType::kINT64, TensorFormat::kLINEAR),
        makeDesc(rank1, rows1, 13, DataType::kFLOAT, TensorFormat::kLINEAR)};
    DynamicPluginTensorDesc out = in[1];
    return build(p)->configurePlugin(in, 2, &out, 1);
}

SHIM_EXPORT int shim_shape_change(void* p, int64_t rows0, int64_t curLen, int64_t rows1, int64_t vocab)
{
    PluginTensorDesc in[2] = {makeDesc(2, rows0, curLen, DataType::kINT64, TensorFormat::kLINEAR).desc,
        makeDesc(2, rows1, vocab, DataType::kFLOAT, TensorFormat::kLINEAR).desc};
    PluginTensorDesc out = in[1];
    return runtime(p)->onShapeChange(in, 2, &out, 1);
}

// Runs enqueue on device pointers (GPU tests only).  tokenType / scoreType are DataType values.
SHIM_EXPORT int shim_enqueue(void* p, int32_t tokenType, void const* history, int64_t rows, int64_t curLen,
    int32_t scoreType, void const* scores, void* output, int64_t vocab, void* stream)
{
    PluginTensorDesc in[2] = {makeDesc(2, rows, curLen, static_cast<DataType>(tokenType), TensorFormat::kLINEAR).desc,
        makeDesc(2, rows, vocab, static_cast<DataType>(scoreType), TensorFormat::kLINEAR).desc};
    PluginTensorDesc out = in[1];
    void const* inputs[2] = {history, scores};
    void* outputs[1] = {output};
    return runtime(p)->enqueue(in, &out, inputs, outputs, nullptr, static_cast<cudaStream_t>(stream));
}

SHIM_EXPORT char const* shim_last_error()
{
    return elxNgramPluginLastError();
}
