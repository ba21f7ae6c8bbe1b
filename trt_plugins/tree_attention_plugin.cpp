// Clover TreeAttention TensorRT plugin: see tree_attention_plugin.h.
#include "tree_attention_plugin.h"

#include "tree_attention_kernel.h"

#include <climits>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>

using namespace nvinfer1;

namespace clover
{
namespace trt
{
namespace
{

ILoggerFinder* gLoggerFinder{nullptr};
std::mutex gLoggerMutex;

void logError(char const* message) noexcept
{
    ILogger* logger{nullptr};
    {
        std::lock_guard<std::mutex> lock(gLoggerMutex);
        if (gLoggerFinder != nullptr)
        {
            logger = gLoggerFinder->findLogger();
        }
    }
    std::string const text = std::string("[clover::TreeAttention] ") + message;
    if (logger != nullptr)
    {
        logger->log(ILogger::Severity::kERROR, text.c_str());
    }
    else
    {
        std::fprintf(stderr, "%s\n", text.c_str());
    }
}

enum Input : int32_t
{
    kQ = 0,
    kK = 1,
    kV = 2,
    kKCache = 3,
    kVCache = 4,
    kPastLengths = 5,
    kPackedMask = 6,
};

bool isFloatType(DataType type) noexcept
{
    return type == DataType::kFLOAT || type == DataType::kHALF || type == DataType::kBF16;
}

bool toCloverType(DataType type, CloverDataType& out) noexcept
{
    switch (type)
    {
    case DataType::kFLOAT: out = CLOVER_DTYPE_FP32; return true;
    case DataType::kHALF: out = CLOVER_DTYPE_FP16; return true;
    case DataType::kBF16: out = CLOVER_DTYPE_BF16; return true;
    default: return false;
    }
}

// A dim fixed by an attribute: -1 (not known yet) always matches.
bool dimMatches(int64_t dim, int64_t expected) noexcept
{
    return dim == -1 || dim == expected;
}

// Two dims that must agree, either of which may still be unknown (-1).
bool sameOrUnknown(int64_t a, int64_t b) noexcept
{
    return a == -1 || b == -1 || a == b;
}

bool readInt(PluginField const& field, int32_t& value) noexcept
{
    if (field.data == nullptr || field.length < 1)
    {
        return false;
    }
    switch (field.type)
    {
    case PluginFieldType::kINT32: value = *static_cast<int32_t const*>(field.data); return true;
    case PluginFieldType::kINT64:
    {
        int64_t const wide = *static_cast<int64_t const*>(field.data);
        if (wide < INT32_MIN || wide > INT32_MAX)
        {
            return false;
        }
        value = static_cast<int32_t>(wide);
        return true;
    }
    case PluginFieldType::kINT16: value = *static_cast<int16_t const*>(field.data); return true;
    case PluginFieldType::kINT8: value = *static_cast<int8_t const*>(field.data); return true;
    default: return false;
    }
}

bool readFloat(PluginField const& field, float& value) noexcept
{
    if (field.data == nullptr || field.length < 1)
    {
        return false;
    }
    switch (field.type)
    {
    case PluginFieldType::kFLOAT32: value = *static_cast<float const*>(field.data); return true;
    case PluginFieldType::kFLOAT64: value = static_cast<float>(*static_cast<double const*>(field.data)); return true;
    default: return false;
    }
}

} // namespace

bool parseTreeAttentionFields(PluginFieldCollection const* fc, TreeAttentionAttrs& attrs, std::string& error) noexcept
{
    try
    {
        TreeAttentionAttrs parsed{};
        bool seen_q{false};
        bool seen_kv{false};
        bool seen_d{false};
        if (fc == nullptr || (fc->nbFields > 0 && fc->fields == nullptr))
        {
            error = "no plugin fields";
            return false;
        }
        for (int32_t i = 0; i < fc->nbFields; ++i)
        {
            PluginField const& field = fc->fields[i];
            if (field.name == nullptr)
            {
                continue;
            }
            bool ok{true};
            if (std::strcmp(field.name, "num_q_heads") == 0)
            {
                ok = readInt(field, parsed.num_q_heads);
                seen_q = ok;
            }
            else if (std::strcmp(field.name, "num_kv_heads") == 0)
            {
                ok = readInt(field, parsed.num_kv_heads);
                seen_kv = ok;
            }
            else if (std::strcmp(field.name, "head_dim") == 0)
            {
                ok = readInt(field, parsed.head_dim);
                seen_d = ok;
            }
            else if (std::strcmp(field.name, "scale") == 0)
            {
                ok = readFloat(field, parsed.scale);
            }
            if (!ok)
            {
                error = std::string("bad type or empty data for field ") + field.name;
                return false;
            }
        }
        if (!seen_q || !seen_kv || !seen_d)
        {
            error = "num_q_heads, num_kv_heads and head_dim are required";
            return false;
        }
        if (parsed.num_q_heads <= 0 || parsed.num_kv_heads <= 0 || parsed.num_q_heads % parsed.num_kv_heads != 0)
        {
            error = "num_q_heads must be a positive multiple of num_kv_heads";
            return false;
        }
        if (parsed.head_dim != 64 && parsed.head_dim != 128)
        {
            error = "head_dim must be 64 or 128";
            return false;
        }
        attrs = parsed;
        return true;
    }
    catch (...)
    {
        error = "exception while parsing fields";
        return false;
    }
}

// ------------------------------------------------------------------ plugin
TreeAttentionPlugin::TreeAttentionPlugin(TreeAttentionAttrs const& attrs)
    : mAttrs(attrs)
{
}

IPluginCapability* TreeAttentionPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* TreeAttentionPlugin::clone() noexcept
{
    try
    {
        return new TreeAttentionPlugin(mAttrs);
    }
    catch (...)
    {
        logError("clone failed");
        return nullptr;
    }
}

char const* TreeAttentionPlugin::getPluginName() const noexcept
{
    return kTREE_ATTENTION_NAME;
}

char const* TreeAttentionPlugin::getPluginVersion() const noexcept
{
    return kTREE_ATTENTION_VERSION;
}

char const* TreeAttentionPlugin::getPluginNamespace() const noexcept
{
    return kTREE_ATTENTION_NAMESPACE;
}

int32_t TreeAttentionPlugin::checkDims(Dims const* dims, int32_t nbInputs, int32_t nbOutputs) const noexcept
{
    if (nbInputs != kTREE_ATTENTION_NB_INPUTS || nbOutputs != kTREE_ATTENTION_NB_OUTPUTS)
    {
        logError("expects 7 inputs (q, k, v, k_cache, v_cache, past_lengths, packed_mask) and 1 output");
        return 1;
    }
    Dims const& q = dims[kQ];
    Dims const& k = dims[kK];
    Dims const& v = dims[kV];
    Dims const& kc = dims[kKCache];
    Dims const& vc = dims[kVCache];
    Dims const& past = dims[kPastLengths];
    Dims const& mask = dims[kPackedMask];
    Dims const& out = dims[kTREE_ATTENTION_NB_INPUTS];
    bool ok = q.nbDims == 4 && k.nbDims == 4 && v.nbDims == 4 && kc.nbDims == 4 && vc.nbDims == 4
        && past.nbDims == 1 && mask.nbDims == 3 && out.nbDims == 4;
    if (!ok)
    {
        logError("ranks must be q/k/v/k_cache/v_cache/out 4, past_lengths 1, packed_mask 3");
        return 1;
    }
    int32_t const Hq = mAttrs.num_q_heads;
    int32_t const Hkv = mAttrs.num_kv_heads;
    int32_t const D = mAttrs.head_dim;
    ok = dimMatches(q.d[2], Hq) && dimMatches(q.d[3], D) && dimMatches(k.d[2], Hkv) && dimMatches(k.d[3], D)
        && dimMatches(v.d[2], Hkv) && dimMatches(v.d[3], D) && dimMatches(kc.d[1], Hkv) && dimMatches(kc.d[3], D)
        && dimMatches(vc.d[1], Hkv) && dimMatches(vc.d[3], D) && dimMatches(out.d[2], Hq) && dimMatches(out.d[3], D);
    if (!ok)
    {
        logError("head counts / head_dim of the inputs do not match the attributes");
        return 1;
    }
    int64_t const B = q.d[0];
    int64_t const T = q.d[1];
    ok = sameOrUnknown(k.d[0], B) && sameOrUnknown(v.d[0], B) && sameOrUnknown(kc.d[0], B)
        && sameOrUnknown(vc.d[0], B) && sameOrUnknown(past.d[0], B) && sameOrUnknown(mask.d[0], B)
        && sameOrUnknown(out.d[0], B) && sameOrUnknown(k.d[1], T) && sameOrUnknown(v.d[1], T)
        && sameOrUnknown(mask.d[1], T) && sameOrUnknown(out.d[1], T) && sameOrUnknown(kc.d[2], vc.d[2])
        && (T == -1 || mask.d[2] == -1 || mask.d[2] >= (T + 31) / 32);
    if (!ok)
    {
        logError("batch / token / cache-length dims disagree, or packed_mask has fewer than ceil(T/32) words");
        return 1;
    }
    return 0;
}

int32_t TreeAttentionPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    if (in == nullptr || out == nullptr || nbInputs != kTREE_ATTENTION_NB_INPUTS
        || nbOutputs != kTREE_ATTENTION_NB_OUTPUTS)
    {
        logError("configurePlugin: wrong number of inputs/outputs");
        return 1;
    }
    Dims dims[kTREE_ATTENTION_NB_INPUTS + kTREE_ATTENTION_NB_OUTPUTS];
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims[i] = in[i].desc.dims;
    }
    dims[nbInputs] = out[0].desc.dims;
    return checkDims(dims, nbInputs, nbOutputs);
}

int32_t TreeAttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != kTREE_ATTENTION_NB_OUTPUTS
        || nbInputs != kTREE_ATTENTION_NB_INPUTS || !isFloatType(inputTypes[kQ]))
    {
        logError("getOutputDataTypes: expects 7 inputs with q in fp32/fp16/bf16 and 1 output");
        return 1;
    }
    outputTypes[0] = inputTypes[kQ];
    return 0;
}

int32_t TreeAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& /*exprBuilder*/) noexcept
{
    if (inputs == nullptr || outputs == nullptr || nbInputs != kTREE_ATTENTION_NB_INPUTS
        || nbOutputs != kTREE_ATTENTION_NB_OUTPUTS || inputs[kQ].nbDims != 4)
    {
        logError("getOutputShapes: expects 7 inputs, q of rank 4, and 1 output");
        return 1;
    }
    outputs[0] = inputs[kQ]; // [B, T, Hq, D]
    return 0;
}

bool TreeAttentionPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (inOut == nullptr || nbInputs != kTREE_ATTENTION_NB_INPUTS || nbOutputs != kTREE_ATTENTION_NB_OUTPUTS
        || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    switch (pos)
    {
    case kQ: return isFloatType(desc.type);
    case kPastLengths:
    case kPackedMask: return desc.type == DataType::kINT32;
    default: return desc.type == inOut[kQ].desc.type; // k, v, caches and the output follow q
    }
}

int32_t TreeAttentionPlugin::getNbOutputs() const noexcept
{
    return kTREE_ATTENTION_NB_OUTPUTS;
}

size_t TreeAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    // Shape-independent bound (about 4.3 MB for D = 128): enough for every shape.
    return treeAttentionWorkspaceBound(mAttrs.head_dim);
}

int32_t TreeAttentionPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    if (in == nullptr || out == nullptr || nbInputs != kTREE_ATTENTION_NB_INPUTS
        || nbOutputs != kTREE_ATTENTION_NB_OUTPUTS)
    {
        logError("onShapeChange: wrong number of inputs/outputs");
        return 1;
    }
    Dims dims[kTREE_ATTENTION_NB_INPUTS + kTREE_ATTENTION_NB_OUTPUTS];
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims[i] = in[i].dims;
    }
    dims[nbInputs] = out[0].dims;
    return checkDims(dims, nbInputs, nbOutputs);
}

int32_t TreeAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr)
    {
        return 1;
    }
    Dims const& q = inputDesc[kQ].dims;
    Dims const& kc = inputDesc[kKCache].dims;
    Dims const& mask = inputDesc[kPackedMask].dims;
    TreeAttentionParams params{};
    params.batch = static_cast<int32_t>(q.d[0]);
    params.num_tokens = static_cast<int32_t>(q.d[1]);
    params.num_q_heads = mAttrs.num_q_heads;
    params.num_kv_heads = mAttrs.num_kv_heads;
    params.head_dim = mAttrs.head_dim;
    params.max_seq_len = static_cast<int32_t>(kc.d[2]);
    params.mask_words = static_cast<int32_t>(mask.d[2]);
    params.scale = mAttrs.scale;
    if (!toCloverType(inputDesc[kQ].type, params.dtype) || q.d[2] != params.num_q_heads || q.d[3] != params.head_dim
        || kc.d[0] != q.d[0] || mask.d[0] != q.d[0] || mask.d[1] != q.d[1]
        || inputDesc[kPastLengths].dims.d[0] != q.d[0])
    {
        logError("enqueue: inconsistent input shapes or types");
        return 1;
    }
    int const status = launchTreeAttention(&params, inputs[kQ], inputs[kK], inputs[kV], inputs[kKCache],
        inputs[kVCache], static_cast<int32_t const*>(inputs[kPastLengths]),
        static_cast<int32_t const*>(inputs[kPackedMask]), outputs[0], workspace,
        workspace == nullptr ? 0 : treeAttentionWorkspaceBound(mAttrs.head_dim), stream);
    if (status != 0)
    {
        logError("enqueue: launchTreeAttention failed");
        return 1;
    }
    return 0;
}

IPluginV3* TreeAttentionPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* TreeAttentionPlugin::getFieldsToSerialize() noexcept
{
    try
    {
        mSerialFields.clear();
        mSerialFields.emplace_back("num_q_heads", &mAttrs.num_q_heads, PluginFieldType::kINT32, 1);
        mSerialFields.emplace_back("num_kv_heads", &mAttrs.num_kv_heads, PluginFieldType::kINT32, 1);
        mSerialFields.emplace_back("head_dim", &mAttrs.head_dim, PluginFieldType::kINT32, 1);
        mSerialFields.emplace_back("scale", &mAttrs.scale, PluginFieldType::kFLOAT32, 1);
        mSerialFc.nbFields = static_cast<int32_t>(mSerialFields.size());
        mSerialFc.fields = mSerialFields.data();
        return &mSerialFc;
    }
    catch (...)
    {
        logError("getFieldsToSerialize failed");
        return nullptr;
    }
}

// ------------------------------------------------------------------ creator
TreeAttentionPluginCreator::TreeAttentionPluginCreator()
{
    mFields.emplace_back("num_q_heads", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("num_kv_heads", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("head_dim", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("scale", nullptr, PluginFieldType::kFLOAT32, 1);
    mFc.nbFields = static_cast<int32_t>(mFields.size());
    mFc.fields = mFields.data();
}

char const* TreeAttentionPluginCreator::getPluginName() const noexcept
{
    return kTREE_ATTENTION_NAME;
}

char const* TreeAttentionPluginCreator::getPluginVersion() const noexcept
{
    return kTREE_ATTENTION_VERSION;
}

char const* TreeAttentionPluginCreator::getPluginNamespace() const noexcept
{
    return kTREE_ATTENTION_NAMESPACE;
}

PluginFieldCollection const* TreeAttentionPluginCreator::getFieldNames() noexcept
{
    return &mFc;
}

IPluginV3* TreeAttentionPluginCreator::createPlugin(
    char const* name, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    // Build phase: fc comes from the ONNX node's attributes; runtime phase: from getFieldsToSerialize().
    TreeAttentionAttrs attrs{};
    std::string error;
    if (!parseTreeAttentionFields(fc, attrs, error))
    {
        logError((std::string("createPlugin(") + (name != nullptr ? name : "") + "): " + error).c_str());
        return nullptr;
    }
    try
    {
        return new TreeAttentionPlugin(attrs);
    }
    catch (...)
    {
        logError("createPlugin: allocation failed");
        return nullptr;
    }
}

namespace
{
TreeAttentionPluginCreator& creatorInstance()
{
    static TreeAttentionPluginCreator creator;
    return creator;
}
} // namespace

} // namespace trt
} // namespace clover

extern "C" void setLoggerFinder(ILoggerFinder* finder)
{
    std::lock_guard<std::mutex> lock(clover::trt::gLoggerMutex);
    clover::trt::gLoggerFinder = finder;
}

extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static IPluginCreatorInterface* const creators[] = {&clover::trt::creatorInstance()};
    nbCreators = 1;
    return creators;
}

extern "C" bool cloverRegisterTrtPlugins()
{
    IPluginRegistry* const registry = getPluginRegistry();
    if (registry == nullptr)
    {
        return false;
    }
    using namespace clover::trt;
    static std::mutex mutex;
    static bool registered{false};
    std::lock_guard<std::mutex> lock(mutex);
    if (!registered)
    {
        // registerCreator() fails if the creator is already there (e.g. after loadLibrary()): that is fine too.
        registered = registry->registerCreator(creatorInstance(), kTREE_ATTENTION_NAMESPACE)
            || registry->getCreator(kTREE_ATTENTION_NAME, kTREE_ATTENTION_VERSION, kTREE_ATTENTION_NAMESPACE) != nullptr;
    }
    return registered;
}
