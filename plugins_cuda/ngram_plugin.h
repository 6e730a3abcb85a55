// TensorRT IPluginV3 plugin "NGramRepeatBlock" (version "1"): n-gram repeat blocking.
//
// Inputs:  0 = token history [rows, cur_len], int64 or int32, linear.
//          1 = scores [rows, vocab], float32 or float16, linear.
// Output:  0 = scores with every banned token set to -inf (same shape and type as input 1).
// Field:   ngram_size (int32, >= 1, required).
//
// Semantics: see ngram_repeat_block.h (= transformers' NoRepeatNGramLogitsProcessor and
// com.microsoft.NGramRepeatBlock of ONNX Runtime).
#ifndef ELX_NGRAM_PLUGIN_H
#define ELX_NGRAM_PLUGIN_H

#include "ngram_repeat_block.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

#ifndef ELX_NGRAM_PLUGIN_NAMESPACE
#define ELX_NGRAM_PLUGIN_NAMESPACE ""
#endif

namespace elx
{

constexpr char const* kNGramPluginName = "NGramRepeatBlock";
constexpr char const* kNGramPluginVersion = "1";
constexpr char const* kNGramFieldName = "ngram_size";

class NGramRepeatBlockPlugin : public nvinfer1::IPluginV3,
                               public nvinfer1::IPluginV3OneCore,
                               public nvinfer1::IPluginV3OneBuild,
                               public nvinfer1::IPluginV3OneRuntime
{
public:
    NGramRepeatBlockPlugin(int32_t ngramSize, std::string pluginNamespace);
    NGramRepeatBlockPlugin(NGramRepeatBlockPlugin const& other);
    NGramRepeatBlockPlugin& operator=(NGramRepeatBlockPlugin const&) = delete;
    ~NGramRepeatBlockPlugin() override = default;

    int32_t ngramSize() const noexcept
    {
        return mNgramSize;
    }

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    void initFields() noexcept;

    int32_t mNgramSize;
    std::string mNamespace;
    nvinfer1::PluginField mField;
    nvinfer1::PluginFieldCollection mFieldCollection;
};

class NGramRepeatBlockCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    NGramRepeatBlockCreator();
    ~NGramRepeatBlockCreator() override = default;

    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    std::string mNamespace;
    nvinfer1::PluginField mFieldNames[1];
    nvinfer1::PluginFieldCollection mFieldCollection;
};

} // namespace elx

extern "C"
{
    // Entry points looked up by IPluginRegistry::loadLibrary (trtexec --dynamicPlugins).
    ELX_NGRAM_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
    ELX_NGRAM_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder);

    // Last error message reported by this library in the calling thread ("" if none); for tests and
    // for users without a TensorRT logger.
    ELX_NGRAM_EXPORT char const* elxNgramPluginLastError();
}

#endif // ELX_NGRAM_PLUGIN_H
