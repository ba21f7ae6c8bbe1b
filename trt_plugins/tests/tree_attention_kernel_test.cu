// Standalone GPU test of launchTreeAttention against a naive CPU implementation
// of the op (double precision, written from the op's definition, not from the
// kernel). Built by trt_plugins/CMakeLists.txt; exits 77 (ctest "skipped")
// when there is no CUDA device, 1 on a mismatch, 0 when all cases pass.
#include "tree_attention_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace
{

#define CHECK_CUDA(call)                                                                                               \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t const e_ = (call);                                                                                 \
        if (e_ != cudaSuccess)                                                                                         \
        {                                                                                                              \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));                 \
            std::exit(1);                                                                                              \
        }                                                                                                              \
    } while (0)

struct Case
{
    int B, T, Hq, Hkv, D, S;
    CloverDataType dtype;
    int max_past; // past_lengths drawn from [0, max_past]
    float scale;  // <= 0: default
};

template <typename T>
T fromFloat(float x);
template <>
float fromFloat<float>(float x)
{
    return x;
}
template <>
__half fromFloat<__half>(float x)
{
    return __float2half_rn(x);
}
template <>
__nv_bfloat16 fromFloat<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

template <typename T>
float toFloat(T x);
template <>
float toFloat<float>(float x)
{
    return x;
}
template <>
float toFloat<__half>(__half x)
{
    return __half2float(x);
}
template <>
float toFloat<__nv_bfloat16>(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

// Random tree: token 0 is the root, token i > 0 hangs under a random earlier token;
// a row sees itself and its ancestors. Rows listed in `empty` see no tree token.
std::vector<int32_t> packTree(int B, int T, int W, std::mt19937& rng, std::vector<uint8_t>& visible)
{
    std::vector<int32_t> packed(static_cast<size_t>(B) * T * W, 0);
    visible.assign(static_cast<size_t>(B) * T * T, 0);
    for (int b = 0; b < B; ++b)
    {
        std::vector<int> parent(T, -1);
        for (int i = 1; i < T; ++i)
        {
            parent[i] = static_cast<int>(rng() % i);
        }
        for (int i = 0; i < T; ++i)
        {
            bool const empty_row = (b == B - 1 && i == T - 1 && T > 1); // one padded row per case
            for (int j = i; j >= 0 && !empty_row; j = parent[j])
            {
                visible[(static_cast<size_t>(b) * T + i) * T + j] = 1;
                uint32_t word = static_cast<uint32_t>(packed[(static_cast<size_t>(b) * T + i) * W + j / 32]);
                word |= 1u << (j % 32);
                packed[(static_cast<size_t>(b) * T + i) * W + j / 32] = static_cast<int32_t>(word);
            }
        }
    }
    return packed;
}

template <typename T>
bool runCase(Case const& c, std::mt19937& rng, int index)
{
    int const W = (c.T + 31) / 32;
    size_t const nq = static_cast<size_t>(c.B) * c.T * c.Hq * c.D;
    size_t const nk = static_cast<size_t>(c.B) * c.T * c.Hkv * c.D;
    size_t const nc = static_cast<size_t>(c.B) * c.Hkv * c.S * c.D;
    std::normal_distribution<float> normal(0.f, 1.f);
    auto fill = [&](std::vector<T>& host, size_t n) {
        host.resize(n);
        for (auto& x : host)
        {
            x = fromFloat<T>(normal(rng));
        }
    };
    std::vector<T> q, k, v, kc, vc;
    fill(q, nq);
    fill(k, nk);
    fill(v, nk);
    fill(kc, nc);
    fill(vc, nc);
    std::vector<int32_t> past(c.B);
    for (int b = 0; b < c.B; ++b)
    {
        past[b] = c.max_past > 0 ? static_cast<int32_t>(rng() % (c.max_past + 1)) : 0;
    }
    past[0] = c.max_past; // the longest context
    if (c.B > 1)
    {
        past[c.B - 1] = 0; // the padded row of the last sequence then sees nothing at all
    }
    std::vector<uint8_t> visible;
    std::vector<int32_t> mask = packTree(c.B, c.T, W, rng, visible);
    // Poison the cache beyond past_lengths: the kernel must never read it.
    for (int b = 0; b < c.B; ++b)
        for (int g = 0; g < c.Hkv; ++g)
            for (int s = past[b]; s < c.S; ++s)
                for (int d = 0; d < c.D; ++d)
                {
                    size_t const i = ((static_cast<size_t>(b) * c.Hkv + g) * c.S + s) * c.D + d;
                    kc[i] = fromFloat<T>(NAN);
                    vc[i] = fromFloat<T>(NAN);
                }

    // CPU reference in double.
    double const scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.D));
    int const group = c.Hq / c.Hkv;
    std::vector<double> ref(nq, 0.0);
    for (int b = 0; b < c.B; ++b)
        for (int t = 0; t < c.T; ++t)
            for (int h = 0; h < c.Hq; ++h)
            {
                int const g = h / group;
                std::vector<double> scores;
                std::vector<T const*> values;
                T const* qrow = &q[((static_cast<size_t>(b) * c.T + t) * c.Hq + h) * c.D];
                auto add = [&](T const* krow, T const* vrow) {
                    double s = 0;
                    for (int d = 0; d < c.D; ++d)
                        s += static_cast<double>(toFloat(qrow[d])) * toFloat(krow[d]);
                    scores.push_back(s * scale);
                    values.push_back(vrow);
                };
                for (int s = 0; s < past[b]; ++s)
                {
                    size_t const off = ((static_cast<size_t>(b) * c.Hkv + g) * c.S + s) * c.D;
                    add(&kc[off], &vc[off]);
                }
                for (int j = 0; j < c.T; ++j)
                {
                    if (visible[(static_cast<size_t>(b) * c.T + t) * c.T + j])
                    {
                        size_t const off = ((static_cast<size_t>(b) * c.T + j) * c.Hkv + g) * c.D;
                        add(&k[off], &v[off]);
                    }
                }
                double* out = &ref[((static_cast<size_t>(b) * c.T + t) * c.Hq + h) * c.D];
                if (scores.empty())
                    continue; // zeros
                double mx = scores[0];
                for (double s : scores)
                    mx = std::fmax(mx, s);
                double sum = 0;
                for (double& s : scores)
                {
                    s = std::exp(s - mx);
                    sum += s;
                }
                for (size_t i = 0; i < scores.size(); ++i)
                    for (int d = 0; d < c.D; ++d)
                        out[d] += scores[i] / sum * toFloat(values[i][d]);
            }

    // GPU.
    TreeAttentionParams p{c.B, c.T, c.Hq, c.Hkv, c.D, c.S, W, c.scale, c.dtype};
    size_t const ws_bytes = treeAttentionWorkspaceSize(&p);
    T *dq, *dk, *dv, *dkc, *dvc, *dout;
    int32_t *dpast, *dmask;
    void* dws = nullptr;
    CHECK_CUDA(cudaMalloc(&dq, nq * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&dk, nk * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&dv, nk * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&dkc, nc * sizeof(T) + 16));
    CHECK_CUDA(cudaMalloc(&dvc, nc * sizeof(T) + 16));
    CHECK_CUDA(cudaMalloc(&dout, nq * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&dpast, c.B * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&dmask, mask.size() * sizeof(int32_t)));
    if (ws_bytes > 0)
        CHECK_CUDA(cudaMalloc(&dws, ws_bytes));
    CHECK_CUDA(cudaMemcpy(dq, q.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dk, k.data(), nk * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dv, v.data(), nk * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dkc, kc.data(), nc * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dvc, vc.data(), nc * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dpast, past.data(), c.B * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dmask, mask.data(), mask.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout, 0xff, nq * sizeof(T))); // NaN pattern: every element must be written
    int const status = launchTreeAttention(&p, dq, dk, dv, dkc, dvc, dpast, dmask, dout, dws, ws_bytes, 0);
    CHECK_CUDA(static_cast<cudaError_t>(status));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> out(nq);
    CHECK_CUDA(cudaMemcpy(out.data(), dout, nq * sizeof(T), cudaMemcpyDeviceToHost));
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dkc);
    cudaFree(dvc);
    cudaFree(dout);
    cudaFree(dpast);
    cudaFree(dmask);
    cudaFree(dws);

    double const tol = c.dtype == CLOVER_DTYPE_FP32 ? 1e-4 : (c.dtype == CLOVER_DTYPE_FP16 ? 4e-3 : 3e-2);
    double max_err = 0;
    size_t bad = 0;
    for (size_t i = 0; i < nq; ++i)
    {
        double const got = toFloat(out[i]);
        double const err = std::fabs(got - ref[i]);
        if (!(err <= tol * (1.0 + std::fabs(ref[i]))))
            ++bad;
        if (!(err <= max_err))
            max_err = err; // NaN propagates
    }
    std::printf("case %2d B=%d T=%d Hq=%d Hkv=%d D=%d S=%d dtype=%d splits=%d max_err=%.3g %s\n", index, c.B, c.T,
        c.Hq, c.Hkv, c.D, c.S, static_cast<int>(c.dtype), treeAttentionNumSplits(&p), max_err, bad ? "FAIL" : "ok");
    return bad == 0;
}

} // namespace

int main()
{
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    {
        std::printf("no CUDA device: skipped\n");
        return 77;
    }
    std::mt19937 rng(1234);
    Case const cases[] = {
        {1, 1, 4, 4, 64, 64, CLOVER_DTYPE_FP32, 0, 0.f},
        {2, 5, 9, 3, 64, 512, CLOVER_DTYPE_FP32, 500, 0.f},
        {3, 33, 8, 2, 128, 1024, CLOVER_DTYPE_FP16, 1000, 0.f},
        {2, 40, 4, 1, 128, 4096, CLOVER_DTYPE_BF16, 4096, 0.f},
        {4, 17, 12, 4, 64, 300, CLOVER_DTYPE_FP16, 299, 0.3f},
        {1, 64, 16, 16, 128, 8192, CLOVER_DTYPE_FP32, 8000, 0.f},
        {16, 9, 8, 8, 128, 2048, CLOVER_DTYPE_BF16, 2048, 0.f},
    };
    bool ok = true;
    int index = 0;
    for (Case const& c : cases)
    {
        switch (c.dtype)
        {
        case CLOVER_DTYPE_FP32: ok = runCase<float>(c, rng, index) && ok; break;
        case CLOVER_DTYPE_FP16: ok = runCase<__half>(c, rng, index) && ok; break;
        case CLOVER_DTYPE_BF16: ok = runCase<__nv_bfloat16>(c, rng, index) && ok; break;
        }
        ++index;
    }
    // Parameter validation.
    TreeAttentionParams bad{1, 40, 6, 4, 64, 16, 1, 0.f, CLOVER_DTYPE_FP16}; // Hq % Hkv != 0, W too small
    if (treeAttentionValidate(&bad) == 0)
    {
        std::printf("validation accepted bad parameters: FAIL\n");
        ok = false;
    }
    std::printf(ok ? "ALL PASSED\n" : "FAILED\n");
    return ok ? 0 : 1;
}
