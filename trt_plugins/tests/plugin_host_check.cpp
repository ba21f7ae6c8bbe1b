// Host-only check of the built plugin library through TensorRT's own interfaces,
// the way TensorRT calls it: dlopen, getCreators(), createPlugin(), then the
// IPluginV3One{Core,Build,Runtime} methods through their base pointers. Needs the
// TensorRT headers (interfaces only) but neither libnvinfer nor a GPU: the test
// links the library against a stub libnvinfer whose getPluginRegistry() returns
// nullptr. Usage: plugin_host_check /path/to/libclover_trt_plugins.so
#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{
int gFailures = 0;

#define EXPECT(cond)                                                                                                   \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            std::printf("FAIL line %d: %s\n", __LINE__, #cond);                                                        \
            ++gFailures;                                                                                               \
        }                                                                                                              \
    } while (0)

class CapturingLogger : public ILogger
{
public:
    void log(Severity, AsciiChar const* msg) noexcept override
    {
        messages.emplace_back(msg);
    }
    std::vector<std::string> messages;
};

class Finder : public ILoggerFinder
{
public:
    ILogger* findLogger() override
    {
        return &logger;
    }
    CapturingLogger logger;
};

struct FakeExprBuilder : IExprBuilder
{
};

Dims makeDims(std::vector<int64_t> const& d)
{
    Dims dims{};
    dims.nbDims = static_cast<int32_t>(d.size());
    for (size_t i = 0; i < d.size(); ++i)
        dims.d[i] = d[i];
    return dims;
}

struct Shapes
{
    std::vector<Dims> dims; // 7 inputs then the output
    std::vector<DataType> types;
};

Shapes shapesFor(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, DataType type)
{
    int64_t const W = T < 0 ? -1 : (T + 31) / 32;
    Shapes s;
    s.dims = {makeDims({B, T, Hq, D}), makeDims({B, T, Hkv, D}), makeDims({B, T, Hkv, D}), makeDims({B, Hkv, S, D}),
        makeDims({B, Hkv, S, D}), makeDims({B}), makeDims({B, T, W}), makeDims({B, T, Hq, D})};
    s.types = {type, type, type, type, type, DataType::kINT32, DataType::kINT32, type};
    return s;
}

std::vector<DynamicPluginTensorDesc> dynamicDescs(Shapes const& s)
{
    std::vector<DynamicPluginTensorDesc> out(s.dims.size());
    for (size_t i = 0; i < s.dims.size(); ++i)
    {
        out[i].desc.dims = s.dims[i];
        out[i].desc.type = s.types[i];
        out[i].desc.format = TensorFormat::kLINEAR;
        out[i].desc.scale = -1.F;
        out[i].min = s.dims[i];
        out[i].max = s.dims[i];
        out[i].opt = s.dims[i];
    }
    return out;
}

std::vector<PluginTensorDesc> staticDescs(Shapes const& s)
{
    std::vector<PluginTensorDesc> out(s.dims.size());
    for (size_t i = 0; i < s.dims.size(); ++i)
    {
        out[i].dims = s.dims[i];
        out[i].type = s.types[i];
        out[i].format = TensorFormat::kLINEAR;
        out[i].scale = -1.F;
    }
    return out;
}
} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::printf("usage: %s libclover_trt_plugins.so\n", argv[0]);
        return 2;
    }
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr)
    {
        std::printf("dlopen failed: %s\n", dlerror());
        return 2;
    }
    using GetCreators = IPluginCreatorInterface* const* (*) (int32_t&);
    using SetLoggerFinder = void (*)(ILoggerFinder*);
    using Register = bool (*)();
    auto getCreators = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
    auto setLoggerFinder = reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder"));
    auto registerPlugins = reinterpret_cast<Register>(dlsym(lib, "cloverRegisterTrtPlugins"));
    EXPECT(getCreators != nullptr && setLoggerFinder != nullptr && registerPlugins != nullptr);
    if (getCreators == nullptr || setLoggerFinder == nullptr || registerPlugins == nullptr)
        return 1;
    Finder finder;
    setLoggerFinder(&finder);

    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    EXPECT(n == 1 && creators != nullptr && creators[0] != nullptr);
    EXPECT(std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0);
    auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
    EXPECT(std::strcmp(creator->getPluginName(), "TreeAttention") == 0);
    EXPECT(std::strcmp(creator->getPluginVersion(), "1") == 0);
    EXPECT(std::strcmp(creator->getPluginNamespace(), "clover") == 0);
    PluginFieldCollection const* names = creator->getFieldNames();
    EXPECT(names != nullptr && names->nbFields == 4);
    if (names != nullptr && names->nbFields == 4)
    {
        EXPECT(std::strcmp(names->fields[0].name, "num_q_heads") == 0 && names->fields[0].type == PluginFieldType::kINT32);
        EXPECT(std::strcmp(names->fields[1].name, "num_kv_heads") == 0);
        EXPECT(std::strcmp(names->fields[2].name, "head_dim") == 0);
        EXPECT(std::strcmp(names->fields[3].name, "scale") == 0 && names->fields[3].type == PluginFieldType::kFLOAT32);
    }

    // As the ONNX parser passes them: INT attributes as kINT32, FLOAT as kFLOAT32.
    int32_t hq = 9, hkv = 3, d = 64;
    float scale = 0.125F;
    std::vector<PluginField> fields{{"num_q_heads", &hq, PluginFieldType::kINT32, 1},
        {"num_kv_heads", &hkv, PluginFieldType::kINT32, 1}, {"head_dim", &d, PluginFieldType::kINT32, 1},
        {"scale", &scale, PluginFieldType::kFLOAT32, 1}};
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    IPluginV3* plugin = creator->createPlugin("node0", &fc, TensorRTPhase::kBUILD);
    EXPECT(plugin != nullptr);
    if (plugin == nullptr)
        return 1;
    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    EXPECT(core != nullptr && build != nullptr && runtime != nullptr);
    EXPECT(std::strcmp(core->getInterfaceInfo().kind, "PLUGIN_V3ONE_CORE") == 0);
    EXPECT(std::strcmp(build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0);
    EXPECT(std::strcmp(runtime->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0);
    EXPECT(std::strcmp(core->getPluginName(), "TreeAttention") == 0);
    EXPECT(std::strcmp(core->getPluginNamespace(), "clover") == 0);
    EXPECT(std::strcmp(core->getPluginVersion(), "1") == 0);

    // Output count, type and shape.
    EXPECT(build->getNbOutputs() == 1);
    std::vector<DataType> in_types{DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kHALF,
        DataType::kINT32, DataType::kINT32};
    DataType out_type = DataType::kFLOAT;
    EXPECT(build->getOutputDataTypes(&out_type, 1, in_types.data(), 7) == 0 && out_type == DataType::kHALF);
    in_types[0] = DataType::kBF16;
    EXPECT(build->getOutputDataTypes(&out_type, 1, in_types.data(), 7) == 0 && out_type == DataType::kBF16);
    in_types[0] = DataType::kINT32;
    EXPECT(build->getOutputDataTypes(&out_type, 1, in_types.data(), 7) != 0);

    int markers[7][4];
    std::vector<DimsExprs> in_exprs(7);
    for (int i = 0; i < 7; ++i)
    {
        in_exprs[i].nbDims = i == 5 ? 1 : (i == 6 ? 3 : 4);
        for (int j = 0; j < in_exprs[i].nbDims; ++j)
            in_exprs[i].d[j] = reinterpret_cast<IDimensionExpr const*>(&markers[i][j]); // never dereferenced
    }
    DimsExprs out_expr{};
    FakeExprBuilder builder;
    EXPECT(build->getOutputShapes(in_exprs.data(), 7, nullptr, 0, &out_expr, 1, builder) == 0);
    EXPECT(out_expr.nbDims == 4);
    for (int j = 0; j < 4; ++j)
        EXPECT(out_expr.d[j] == in_exprs[0].d[j]);
    EXPECT(build->getOutputShapes(in_exprs.data(), 6, nullptr, 0, &out_expr, 1, builder) != 0);

    // Formats and types.
    for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    {
        auto descs = dynamicDescs(shapesFor(2, 5, 9, 3, 64, 128, t));
        for (int pos = 0; pos < 8; ++pos)
            EXPECT(build->supportsFormatCombination(pos, descs.data(), 7, 1));
        descs[3].desc.type = t == DataType::kFLOAT ? DataType::kHALF : DataType::kFLOAT; // k_cache differs from q
        EXPECT(!build->supportsFormatCombination(3, descs.data(), 7, 1));
        descs[7].desc.type = DataType::kINT32;
        EXPECT(!build->supportsFormatCombination(7, descs.data(), 7, 1));
    }
    {
        auto descs = dynamicDescs(shapesFor(2, 5, 9, 3, 64, 128, DataType::kHALF));
        descs[0].desc.type = DataType::kINT8;
        EXPECT(!build->supportsFormatCombination(0, descs.data(), 7, 1));
        descs[0].desc.type = DataType::kHALF;
        descs[5].desc.type = DataType::kINT64;
        EXPECT(!build->supportsFormatCombination(5, descs.data(), 7, 1));
        descs[5].desc.type = DataType::kINT32;
        descs[6].desc.format = TensorFormat::kCHW32;
        EXPECT(!build->supportsFormatCombination(6, descs.data(), 7, 1));
        EXPECT(!build->supportsFormatCombination(8, descs.data(), 7, 1));
        EXPECT(!build->supportsFormatCombination(0, descs.data(), 6, 1));
    }

    // configurePlugin / onShapeChange / workspace.
    {
        auto dyn = dynamicDescs(shapesFor(-1, -1, 9, 3, 64, -1, DataType::kHALF));
        EXPECT(build->configurePlugin(dyn.data(), 7, dyn.data() + 7, 1) == 0);
        auto wrong = dynamicDescs(shapesFor(-1, -1, 8, 4, 64, -1, DataType::kHALF));
        EXPECT(build->configurePlugin(wrong.data(), 7, wrong.data() + 7, 1) != 0);
        auto wrong_d = dynamicDescs(shapesFor(-1, -1, 9, 3, 128, -1, DataType::kHALF));
        EXPECT(build->configurePlugin(wrong_d.data(), 7, wrong_d.data() + 7, 1) != 0);
        auto concrete = staticDescs(shapesFor(4, 33, 9, 3, 64, 4096, DataType::kHALF));
        EXPECT(runtime->onShapeChange(concrete.data(), 7, concrete.data() + 7, 1) == 0);
        auto bad_rank = concrete;
        bad_rank[6].dims = makeDims({4, 33});
        EXPECT(runtime->onShapeChange(bad_rank.data(), 7, bad_rank.data() + 7, 1) != 0);
        size_t const ws = build->getWorkspaceSize(dyn.data(), 7, dyn.data() + 7, 1);
        EXPECT(ws == static_cast<size_t>(2) * 16 * 256 * (64 + 2) * 4);

        // enqueue: an empty batch is a no-op; inconsistent shapes are refused (no GPU needed for either).
        auto empty = staticDescs(shapesFor(0, 5, 9, 3, 64, 128, DataType::kHALF));
        void const* ins[7] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
        void* outs[1] = {nullptr};
        EXPECT(runtime->enqueue(empty.data(), empty.data() + 7, ins, outs, nullptr, nullptr) == 0);
        auto inconsistent = staticDescs(shapesFor(2, 5, 9, 3, 64, 128, DataType::kHALF));
        inconsistent[6].dims = makeDims({2, 4, 1});
        EXPECT(runtime->enqueue(inconsistent.data(), inconsistent.data() + 7, ins, outs, nullptr, nullptr) != 0);
        auto short_mask = staticDescs(shapesFor(2, 40, 9, 3, 64, 128, DataType::kHALF));
        short_mask[6].dims = makeDims({2, 40, 1}); // W must be >= ceil(40 / 32) = 2
        EXPECT(runtime->enqueue(short_mask.data(), short_mask.data() + 7, ins, outs, nullptr, nullptr) != 0);
    }

    // Serialization round trip (runtime phase), clone, attachToContext.
    PluginFieldCollection const* serial = runtime->getFieldsToSerialize();
    EXPECT(serial != nullptr && serial->nbFields == 4);
    IPluginV3* restored = creator->createPlugin("node0", serial, TensorRTPhase::kRUNTIME);
    EXPECT(restored != nullptr);
    if (restored != nullptr)
    {
        auto* rt = static_cast<IPluginV3OneRuntime*>(restored->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        PluginFieldCollection const* again = rt->getFieldsToSerialize();
        EXPECT(again != nullptr && again->nbFields == 4);
        if (again != nullptr && serial != nullptr && again->nbFields == 4 && serial->nbFields == 4)
        {
            for (int i = 0; i < 4; ++i)
            {
                EXPECT(std::strcmp(again->fields[i].name, serial->fields[i].name) == 0);
                EXPECT(again->fields[i].type == serial->fields[i].type);
                EXPECT(std::memcmp(again->fields[i].data, serial->fields[i].data, 4) == 0);
            }
            EXPECT(*static_cast<int32_t const*>(again->fields[0].data) == 9);
            EXPECT(*static_cast<int32_t const*>(again->fields[1].data) == 3);
            EXPECT(*static_cast<int32_t const*>(again->fields[2].data) == 64);
            EXPECT(*static_cast<float const*>(again->fields[3].data) == 0.125F);
        }
        delete restored;
    }
    IPluginV3* cloned = plugin->clone();
    EXPECT(cloned != nullptr && cloned != plugin);
    delete cloned;
    IPluginV3* attached = runtime->attachToContext(nullptr);
    EXPECT(attached != nullptr && attached != plugin);
    delete attached;
    delete plugin;

    // Attribute variants and errors.
    int64_t hq64 = 8;
    double scale64 = 0.0;
    int32_t hkv2 = 2, d128 = 128, d96 = 96, hkv3 = 3;
    std::vector<PluginField> wide{{"num_q_heads", &hq64, PluginFieldType::kINT64, 1},
        {"num_kv_heads", &hkv2, PluginFieldType::kINT32, 1}, {"head_dim", &d128, PluginFieldType::kINT32, 1},
        {"scale", &scale64, PluginFieldType::kFLOAT64, 1}};
    PluginFieldCollection wide_fc{4, wide.data()};
    IPluginV3* p2 = creator->createPlugin("wide", &wide_fc, TensorRTPhase::kBUILD);
    EXPECT(p2 != nullptr);
    delete p2;
    std::vector<PluginField> no_scale(wide.begin(), wide.begin() + 3);
    PluginFieldCollection no_scale_fc{3, no_scale.data()};
    IPluginV3* p3 = creator->createPlugin("no_scale", &no_scale_fc, TensorRTPhase::kBUILD);
    EXPECT(p3 != nullptr);
    delete p3;
    size_t const logged_before = finder.logger.messages.size();
    std::vector<PluginField> bad_d = wide;
    bad_d[2] = PluginField{"head_dim", &d96, PluginFieldType::kINT32, 1};
    PluginFieldCollection bad_d_fc{4, bad_d.data()};
    EXPECT(creator->createPlugin("bad_d", &bad_d_fc, TensorRTPhase::kBUILD) == nullptr);
    std::vector<PluginField> bad_group = wide;
    bad_group[1] = PluginField{"num_kv_heads", &hkv3, PluginFieldType::kINT32, 1}; // 8 % 3 != 0
    PluginFieldCollection bad_group_fc{4, bad_group.data()};
    EXPECT(creator->createPlugin("bad_group", &bad_group_fc, TensorRTPhase::kBUILD) == nullptr);
    std::vector<PluginField> missing(wide.begin() + 1, wide.end());
    PluginFieldCollection missing_fc{3, missing.data()};
    EXPECT(creator->createPlugin("missing", &missing_fc, TensorRTPhase::kBUILD) == nullptr);
    EXPECT(creator->createPlugin("null", nullptr, TensorRTPhase::kBUILD) == nullptr);
    EXPECT(finder.logger.messages.size() >= logged_before + 4); // errors reach the TensorRT logger

    // The stub libnvinfer has no registry: registration must fail cleanly, not crash.
    EXPECT(!registerPlugins());

    std::printf(gFailures == 0 ? "plugin host check: ALL PASSED\n" : "plugin host check: %d FAILURES\n", gFailures);
    return gFailures == 0 ? 0 : 1;
}
