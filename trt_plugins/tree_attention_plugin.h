// Clover TreeAttention TensorRT plugin (IPluginV3, TensorRT 10 API).
//
// Plugin "TreeAttention", version "1", namespace "clover". Inputs, in order:
//   0 q [B,T,Hq,D]  1 k [B,T,Hkv,D]  2 v [B,T,Hkv,D]  3 k_cache [B,Hkv,S,D]
//   4 v_cache [B,Hkv,S,D]  5 past_lengths int32 [B]  6 packed_mask int32 [B,T,W]
// Output 0: [B,T,Hq,D], dtype of q. Attributes (plugin fields): num_q_heads,
// num_kv_heads, head_dim (int32) and scale (float32, <= 0 or absent: 1/sqrt(D)).
// The semantics are those of clover.attention.tree_attention; see OP_SPEC.md.
// The maths is all in clover/kernels/tree_attention_kernel.cu; this class only checks shapes,
// types and formats and forwards to launchTreeAttention().
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace clover
{
namespace trt
{

constexpr char const* kTREE_ATTENTION_NAME = "TreeAttention";
constexpr char const* kTREE_ATTENTION_VERSION = "1";
constexpr char const* kTREE_ATTENTION_NAMESPACE = "clover";
constexpr int32_t kTREE_ATTENTION_NB_INPUTS = 7;
constexpr int32_t kTREE_ATTENTION_NB_OUTPUTS = 1;

struct TreeAttentionAttrs
{
    int32_t num_q_heads{0};
    int32_t num_kv_heads{0};
    int32_t head_dim{0};
    float scale{0.F}; // <= 0: 1 / sqrt(head_dim)
};

//! Read plugin fields into attrs and validate them. False (and a message) on error.
bool parseTreeAttentionFields(
    nvinfer1::PluginFieldCollection const* fc, TreeAttentionAttrs& attrs, std::string& error) noexcept;

class TreeAttentionPlugin final : public nvinfer1::IPluginV3,
                                  public nvinfer1::IPluginV3OneCore,
                                  public nvinfer1::IPluginV3OneBuild,
                                  public nvinfer1::IPluginV3OneRuntime
{
public:
    explicit TreeAttentionPlugin(TreeAttentionAttrs const& attrs);
    ~TreeAttentionPlugin() override = default;
    TreeAttentionPlugin(TreeAttentionPlugin const&) = delete;
    TreeAttentionPlugin& operator=(TreeAttentionPlugin const&) = delete;

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
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    //! Checks ranks and the dims that the attributes fix; -1 (unknown) passes. 0 if fine.
    int32_t checkDims(nvinfer1::Dims const* dims, int32_t nbInputs, int32_t nbOutputs) const noexcept;

    TreeAttentionAttrs mAttrs;
    std::vector<nvinfer1::PluginField> mSerialFields;
    nvinfer1::PluginFieldCollection mSerialFc{};
};

class TreeAttentionPluginCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    TreeAttentionPluginCreator();
    ~TreeAttentionPluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFc{};
};

} // namespace trt
} // namespace clover

#define CLOVER_TRT_EXPORT __attribute__((visibility("default")))

extern "C"
{
    //! Entry points of a TensorRT "plugin shared library": IPluginRegistry::loadLibrary(),
    //! trtexec --dynamicPlugins and plugins serialized into version-compatible engines use these.
    CLOVER_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
    CLOVER_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

    //! Registers the creators with getPluginRegistry() under namespace "clover" (used by
    //! trt_plugins/loader.py after ctypes loading). Idempotent; false on failure.
    CLOVER_TRT_EXPORT bool cloverRegisterTrtPlugins();
}
