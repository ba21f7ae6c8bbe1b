// Clover TreeAttention CUDA kernel (no TensorRT dependency).
//
// See tree_attention_kernel.h for the op, the tensor layouts and the work
// decomposition. trt_plugins/tiling_model.py is a NumPy transcription of the two
// kernels below; keep the two files in step (same loops, same names).
#include "tree_attention_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace clover
{
namespace tree_attention
{
namespace
{

static_assert(kBlockN == kWarpSize, "one key per lane");
static_assert(kBlockN == 32, "a tile of tree keys must be exactly one 32-bit mask word");

constexpr int kThreads = kNumWarps * kWarpSize;
constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------- conversions
template <typename T>
struct Cvt;

template <>
struct Cvt<float>
{
    __device__ __forceinline__ static float toFloat(float x)
    {
        return x;
    }
    __device__ __forceinline__ static float fromFloat(float x)
    {
        return x;
    }
};

template <>
struct Cvt<__half>
{
    __device__ __forceinline__ static float toFloat(__half x)
    {
        return __half2float(x);
    }
    __device__ __forceinline__ static __half fromFloat(float x)
    {
        return __float2half_rn(x);
    }
};

template <>
struct Cvt<__nv_bfloat16>
{
    __device__ __forceinline__ static float toFloat(__nv_bfloat16 x)
    {
        return __bfloat162float(x);
    }
    __device__ __forceinline__ static __nv_bfloat16 fromFloat(float x)
    {
        return __float2bfloat16_rn(x);
    }
};

// N contiguous elements read as one vector load (N * sizeof(T) bytes, which is a
// power of two dividing 16; rows start at multiples of D elements, so aligned).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack
{
    T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void loadAsFloat(T const* ptr, float (&out)[N])
{
    Pack<T, N> const p = *reinterpret_cast<Pack<T, N> const*>(ptr);
#pragma unroll
    for (int e = 0; e < N; ++e)
    {
        out[e] = Cvt<T>::toFloat(p.v[e]);
    }
}

// Butterfly reductions: every lane ends with the same (bitwise) value.
__device__ __forceinline__ float warpMax(float x)
{
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    {
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    }
    return x;
}

__device__ __forceinline__ float warpSum(float x)
{
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    {
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    }
    return x;
}

__host__ __device__ __forceinline__ int ceilDiv(int a, int b)
{
    return (a + b - 1) / b;
}

struct KernelArgs
{
    void const* q;
    void const* k;
    void const* v;
    void const* k_cache;
    void const* v_cache;
    int32_t const* past_lengths;
    int32_t const* packed_mask;
    void* out;
    float* ws_acc; // [num_splits, total_rows, D]
    float* ws_m;   // [num_splits, total_rows]
    float* ws_l;   // [num_splits, total_rows]
    int batch;
    int num_tokens;
    int num_q_heads;
    int num_kv_heads;
    int max_seq_len;
    int mask_words;
    int group;      // Hq / Hkv
    int row_tiles;  // ceil(T * group / kBlockM)
    int num_splits;
    int total_rows; // B * T * Hq
    float q_scale;  // scale * log2(e): scores come out in base-2 log space
};

template <int D>
struct SmemLayout
{
    // Main loop: q tile (pre-scaled, fp32) and one probability tile per warp.
    static constexpr int kQ = kBlockM * D;
    static constexpr int kP = kNumWarps * kBlockM * kBlockN;
    static constexpr int kMain = kQ + kP;
    // Warp merge (reuses the same storage after a __syncthreads).
    static constexpr int kAcc = kNumWarps * kBlockM * D;
    static constexpr int kMerge = kAcc + 2 * kNumWarps * kBlockM;
    static constexpr int kFloats = kMain > kMerge ? kMain : kMerge;
};

// ------------------------------------------------------------ main kernel
// grid.x = B * Hkv * row_tiles (row tile fastest), grid.y = num_splits.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) treeAttentionKernel(KernelArgs const args)
{
    constexpr int kDimsPerLane = D / kWarpSize; // output dims owned by a lane
    constexpr int kKVec = 16 / sizeof(T);       // key elements per 16-byte load
    static_assert(D % kWarpSize == 0 && D % kKVec == 0 && kKVec % 4 == 0, "head dim");
    using L = SmemLayout<D>;
    __shared__ __align__(16) float smem[L::kFloats];
    float* const q_s = smem;          // [kBlockM][D]
    float* const p_s = smem + L::kQ;  // [kNumWarps][kBlockM][kBlockN]

    T const* const q = static_cast<T const*>(args.q);
    T const* const k = static_cast<T const*>(args.k);
    T const* const v = static_cast<T const*>(args.v);
    T const* const k_cache = static_cast<T const*>(args.k_cache);
    T const* const v_cache = static_cast<T const*>(args.v_cache);

    int const T_ = args.num_tokens;
    int const Hq = args.num_q_heads;
    int const Hkv = args.num_kv_heads;
    int const S = args.max_seq_len;
    int const group = args.group;

    int const tile_id = blockIdx.x % args.row_tiles;
    int const bg = blockIdx.x / args.row_tiles;
    int const b = bg / Hkv;
    int const g = bg % Hkv;
    int const split = blockIdx.y;
    int const warp = threadIdx.x / kWarpSize;
    int const lane = threadIdx.x % kWarpSize;

    int const row0 = tile_id * kBlockM;
    int const nrows = min(kBlockM, T_ * group - row0); // >= 1

    // ---- q tile -> shared memory, pre-scaled; padded rows are zero and never read.
    for (int idx = threadIdx.x; idx < kBlockM * D; idx += kThreads)
    {
        int const r = idx / D;
        int const d = idx % D;
        float val = 0.f;
        if (r < nrows)
        {
            int const rr = row0 + r;
            int const t = rr / group;
            int const h = g * group + rr % group;
            val = Cvt<T>::toFloat(q[((size_t) (b * T_ + t) * Hq + h) * D + d]) * args.q_scale;
        }
        q_s[idx] = val;
    }

    // ---- this block's keys: cache chunk [c0, c1), plus the tree keys on the last split.
    int const past = min(max(args.past_lengths[b], 0), S);
    int const chunk = ceilDiv(ceilDiv(past, args.num_splits), kBlockN) * kBlockN;
    int const c0 = min(split * chunk, past);
    int const c1 = min(c0 + chunk, past);
    int const n_cache_tiles = ceilDiv(c1 - c0, kBlockN);
    int const n_tree_tiles = (split == args.num_splits - 1) ? ceilDiv(T_, kBlockN) : 0;
    int const n_tiles = n_cache_tiles + n_tree_tiles;

    // ---- per-warp online-softmax state for every row of the tile.
    float m[kBlockM];
    float l[kBlockM];
    float acc[kBlockM][kDimsPerLane];
#pragma unroll
    for (int r = 0; r < kBlockM; ++r)
    {
        m[r] = -INFINITY;
        l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < kDimsPerLane; ++e)
        {
            acc[r][e] = 0.f;
        }
    }
    __syncthreads();

    for (int tile = warp; tile < n_tiles; tile += kNumWarps)
    {
        bool const is_tree = tile >= n_cache_tiles;
        int key0;
        int nkeys;
        size_t key_stride; // elements between consecutive keys
        T const* kbase;
        T const* vbase;
        if (!is_tree)
        {
            key0 = c0 + tile * kBlockN;
            nkeys = min(kBlockN, c1 - key0);
            key_stride = D;
            size_t const off = ((size_t) (b * Hkv + g) * S + key0) * D;
            kbase = k_cache + off;
            vbase = v_cache + off;
        }
        else
        {
            key0 = (tile - n_cache_tiles) * kBlockN; // a multiple of 32: one mask word
            nkeys = min(kBlockN, T_ - key0);
            key_stride = (size_t) Hkv * D;
            size_t const off = ((size_t) (b * T_ + key0) * Hkv + g) * D;
            kbase = k + off;
            vbase = v + off;
        }
        bool const key_ok = lane < nkeys; // lane's key exists (no read past the range)

        // -- scores: lane j holds s[r] = (q_r * scale * log2 e) . k_j for every row r.
        float s[kBlockM];
#pragma unroll
        for (int r = 0; r < kBlockM; ++r)
        {
            s[r] = 0.f;
        }
        if (key_ok)
        {
            T const* const krow = kbase + (size_t) lane * key_stride;
#pragma unroll 2
            for (int d0 = 0; d0 < D; d0 += kKVec)
            {
                float kf[kKVec];
                loadAsFloat<T, kKVec>(krow + d0, kf);
#pragma unroll
                for (int r = 0; r < kBlockM; ++r)
                {
                    if (r < nrows)
                    {
#pragma unroll
                        for (int e4 = 0; e4 < kKVec; e4 += 4)
                        {
                            float4 const qv = *reinterpret_cast<float4 const*>(&q_s[r * D + d0 + e4]);
                            s[r] = fmaf(qv.x, kf[e4 + 0], s[r]);
                            s[r] = fmaf(qv.y, kf[e4 + 1], s[r]);
                            s[r] = fmaf(qv.z, kf[e4 + 2], s[r]);
                            s[r] = fmaf(qv.w, kf[e4 + 3], s[r]);
                        }
                    }
                }
            }
        }

        // -- visibility: cache keys are visible to every real row; tree key j is
        //    visible to row r when bit (j % 32) of word (j / 32) of its mask row is set.
#pragma unroll
        for (int r = 0; r < kBlockM; ++r)
        {
            bool visible = key_ok && r < nrows;
            if (is_tree && visible)
            {
                int const t = (row0 + r) / group;
                uint32_t const word = static_cast<uint32_t>(
                    __ldg(args.packed_mask + ((size_t) b * T_ + t) * args.mask_words + key0 / 32));
                visible = ((word >> lane) & 1u) != 0u;
            }
            s[r] = visible ? s[r] : -INFINITY;
        }

        // -- online softmax update (base 2).
        bool any_visible = false; // warp-uniform
#pragma unroll
        for (int r = 0; r < kBlockM; ++r)
        {
            if (r < nrows)
            {
                float const tile_max = warpMax(s[r]);
                float const m_new = fmaxf(m[r], tile_max);
                float p;
                float alpha;
                if (m_new == -INFINITY)
                {
                    p = 0.f; // nothing visible yet: keep the state as it is
                    alpha = 1.f;
                }
                else
                {
                    alpha = exp2f(m[r] - m_new); // 0 when m[r] == -inf
                    p = exp2f(s[r] - m_new);     // 0 for a hidden key
                }
                l[r] = l[r] * alpha + warpSum(p);
                m[r] = m_new;
#pragma unroll
                for (int e = 0; e < kDimsPerLane; ++e)
                {
                    acc[r][e] *= alpha;
                }
                p_s[(warp * kBlockM + r) * kBlockN + lane] = p;
                any_visible = any_visible || tile_max != -INFINITY;
            }
        }
        __syncwarp();

        // -- acc[r][:] += sum_j p[r][j] * v_j ; lane owns dims [lane * kDimsPerLane, +kDimsPerLane).
        if (any_visible)
        {
            T const* const vcol = vbase + lane * kDimsPerLane;
            for (int j = 0; j < nkeys; ++j)
            {
                float vf[kDimsPerLane];
                loadAsFloat<T, kDimsPerLane>(vcol + (size_t) j * key_stride, vf);
#pragma unroll
                for (int r = 0; r < kBlockM; ++r)
                {
                    if (r < nrows)
                    {
                        float const p = p_s[(warp * kBlockM + r) * kBlockN + j];
#pragma unroll
                        for (int e = 0; e < kDimsPerLane; ++e)
                        {
                            acc[r][e] = fmaf(p, vf[e], acc[r][e]);
                        }
                    }
                }
            }
        }
        __syncwarp(); // p_s is rewritten by the next tile
    }

    // ---- merge the warps of the block (shared memory reused).
    __syncthreads();
    float* const acc_s = smem;                          // [kNumWarps][kBlockM][D]
    float* const m_s = smem + L::kAcc;                  // [kNumWarps][kBlockM]
    float* const l_s = smem + L::kAcc + kNumWarps * kBlockM; // [kNumWarps][kBlockM]
#pragma unroll
    for (int r = 0; r < kBlockM; ++r)
    {
        if (r < nrows)
        {
#pragma unroll
            for (int e = 0; e < kDimsPerLane; ++e)
            {
                acc_s[(warp * kBlockM + r) * D + lane * kDimsPerLane + e] = acc[r][e];
            }
            if (lane == 0)
            {
                m_s[warp * kBlockM + r] = m[r];
                l_s[warp * kBlockM + r] = l[r];
            }
        }
    }
    __syncthreads();

    for (int idx = threadIdx.x; idx < nrows * D; idx += kThreads)
    {
        int const r = idx / D;
        int const d = idx % D;
        float m_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < kNumWarps; ++w)
        {
            m_max = fmaxf(m_max, m_s[w * kBlockM + r]);
        }
        float l_sum = 0.f;
        float a_sum = 0.f;
#pragma unroll
        for (int w = 0; w < kNumWarps; ++w)
        {
            float const mw = m_s[w * kBlockM + r];
            if (mw != -INFINITY)
            {
                float const f = exp2f(mw - m_max);
                l_sum += l_s[w * kBlockM + r] * f;
                a_sum += acc_s[(w * kBlockM + r) * D + d] * f;
            }
        }
        int const rr = row0 + r;
        int const t = rr / group;
        int const h = g * group + rr % group;
        size_t const orow = (size_t) (b * T_ + t) * Hq + h;
        if (args.num_splits == 1)
        {
            // A row that saw nothing has l_sum == 0 and gets zeros (the reference's nan_to_num).
            static_cast<T*>(args.out)[orow * D + d] = Cvt<T>::fromFloat(l_sum > 0.f ? a_sum / l_sum : 0.f);
        }
        else
        {
            size_t const wrow = (size_t) split * args.total_rows + orow;
            args.ws_acc[wrow * D + d] = a_sum;
            if (d == 0)
            {
                args.ws_m[wrow] = m_max;
                args.ws_l[wrow] = l_sum;
            }
        }
    }
}

// ------------------------------------------------------------ split merge
// One warp per output row (b, t, h); grid.x = ceil(total_rows / kNumWarps).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) treeAttentionCombineKernel(KernelArgs const args)
{
    constexpr int kDimsPerLane = D / kWarpSize;
    int const warp = threadIdx.x / kWarpSize;
    int const lane = threadIdx.x % kWarpSize;
    int const row = blockIdx.x * kNumWarps + warp;
    if (row >= args.total_rows)
    {
        return;
    }
    float m_max = -INFINITY;
    for (int s = 0; s < args.num_splits; ++s)
    {
        m_max = fmaxf(m_max, args.ws_m[(size_t) s * args.total_rows + row]);
    }
    float l_sum = 0.f;
    float a_sum[kDimsPerLane];
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e)
    {
        a_sum[e] = 0.f;
    }
    for (int s = 0; s < args.num_splits; ++s)
    {
        size_t const wrow = (size_t) s * args.total_rows + row;
        float const ms = args.ws_m[wrow];
        if (ms != -INFINITY)
        {
            float const f = exp2f(ms - m_max);
            l_sum += args.ws_l[wrow] * f;
#pragma unroll
            for (int e = 0; e < kDimsPerLane; ++e)
            {
                a_sum[e] += args.ws_acc[wrow * D + lane * kDimsPerLane + e] * f;
            }
        }
    }
    T* const out = static_cast<T*>(args.out) + (size_t) row * D + lane * kDimsPerLane;
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e)
    {
        out[e] = Cvt<T>::fromFloat(l_sum > 0.f ? a_sum[e] / l_sum : 0.f);
    }
}

template <typename T, int D>
cudaError_t launchTyped(KernelArgs const& args, cudaStream_t stream)
{
    dim3 const grid(static_cast<unsigned>(args.batch) * args.num_kv_heads * args.row_tiles, args.num_splits);
    treeAttentionKernel<T, D><<<grid, kThreads, 0, stream>>>(args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || args.num_splits == 1)
    {
        return err;
    }
    treeAttentionCombineKernel<T, D><<<ceilDiv(args.total_rows, kNumWarps), kThreads, 0, stream>>>(args);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launchForDim(KernelArgs const& args, int head_dim, cudaStream_t stream)
{
    switch (head_dim)
    {
    case 64: return launchTyped<T, 64>(args, stream);
    case 128: return launchTyped<T, 128>(args, stream);
    default: return cudaErrorInvalidValue;
    }
}

int64_t rowTiles(TreeAttentionParams const& p)
{
    int64_t const group = p.num_q_heads / p.num_kv_heads;
    return (static_cast<int64_t>(p.num_tokens) * group + kBlockM - 1) / kBlockM;
}

size_t bytesPerSplit(TreeAttentionParams const& p)
{
    size_t const total_rows = static_cast<size_t>(p.batch) * p.num_tokens * p.num_q_heads;
    return total_rows * (static_cast<size_t>(p.head_dim) + 2) * sizeof(float);
}

} // namespace
} // namespace tree_attention
} // namespace clover

using namespace clover::tree_attention;

extern "C" int treeAttentionValidate(TreeAttentionParams const* p)
{
    if (p == nullptr || p->batch < 0 || p->num_tokens < 0 || p->num_q_heads <= 0 || p->num_kv_heads <= 0
        || p->num_q_heads % p->num_kv_heads != 0 || (p->head_dim != 64 && p->head_dim != 128) || p->max_seq_len < 0)
    {
        return cudaErrorInvalidValue;
    }
    if (p->dtype != CLOVER_DTYPE_FP32 && p->dtype != CLOVER_DTYPE_FP16 && p->dtype != CLOVER_DTYPE_BF16)
    {
        return cudaErrorInvalidValue;
    }
    if (p->num_tokens > 0 && p->mask_words < (p->num_tokens + 31) / 32)
    {
        return cudaErrorInvalidValue;
    }
    // Grid limits and 32-bit index products used by the kernels.
    int64_t const blocks = static_cast<int64_t>(p->batch) * p->num_kv_heads * rowTiles(*p);
    int64_t const rows = static_cast<int64_t>(p->batch) * p->num_tokens * p->num_q_heads;
    int64_t const cache_rows = static_cast<int64_t>(p->batch) * p->num_kv_heads * p->max_seq_len;
    if (blocks > INT32_MAX || rows > INT32_MAX || cache_rows > INT32_MAX
        || static_cast<int64_t>(p->batch) * p->num_tokens * p->mask_words > INT32_MAX)
    {
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

extern "C" int treeAttentionNumSplits(TreeAttentionParams const* p)
{
    if (treeAttentionValidate(p) != cudaSuccess || p->batch == 0 || p->num_tokens == 0 || p->max_seq_len == 0)
    {
        return 1;
    }
    int64_t const base = static_cast<int64_t>(p->batch) * p->num_kv_heads * rowTiles(*p);
    if (base >= kTargetBlocks)
    {
        return 1;
    }
    int64_t const want = (kTargetBlocks + base - 1) / base;
    int64_t const by_len = (static_cast<int64_t>(p->max_seq_len) + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
    int64_t n = want < by_len ? want : by_len;
    n = n < kMaxSplits ? n : kMaxSplits;
    return n < 1 ? 1 : static_cast<int>(n);
}

extern "C" size_t treeAttentionWorkspaceSize(TreeAttentionParams const* p)
{
    int const n = treeAttentionNumSplits(p);
    return n > 1 ? static_cast<size_t>(n) * bytesPerSplit(*p) : 0;
}

extern "C" size_t treeAttentionWorkspaceBound(int32_t head_dim)
{
    size_t const d = head_dim > 0 ? static_cast<size_t>(head_dim) : 0;
    return static_cast<size_t>(2) * kBlockM * kTargetBlocks * (d + 2) * sizeof(float);
}

extern "C" int launchTreeAttention(TreeAttentionParams const* p, void const* q, void const* k, void const* v,
    void const* k_cache, void const* v_cache, int32_t const* past_lengths, int32_t const* packed_mask, void* out,
    void* workspace, size_t workspace_bytes, cudaStream_t stream)
{
    int const status = treeAttentionValidate(p);
    if (status != cudaSuccess)
    {
        return status;
    }
    if (p->batch == 0 || p->num_tokens == 0)
    {
        return cudaSuccess;
    }
    // Keys and values are read with 16-byte vector loads.
    for (void const* ptr : {k, v, k_cache, v_cache})
    {
        if (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
        {
            return cudaErrorMisalignedAddress;
        }
    }
    if (q == nullptr || out == nullptr || past_lengths == nullptr || packed_mask == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    int num_splits = treeAttentionNumSplits(p);
    size_t const per_split = bytesPerSplit(*p);
    if (num_splits > 1)
    {
        size_t const fits = workspace == nullptr ? 0 : workspace_bytes / per_split;
        if (fits < static_cast<size_t>(num_splits))
        {
            num_splits = fits > 1 ? static_cast<int>(fits) : 1;
        }
    }

    KernelArgs args{};
    args.q = q;
    args.k = k;
    args.v = v;
    args.k_cache = k_cache;
    args.v_cache = v_cache;
    args.past_lengths = past_lengths;
    args.packed_mask = packed_mask;
    args.out = out;
    size_t const total_rows = static_cast<size_t>(p->batch) * p->num_tokens * p->num_q_heads;
    if (num_splits > 1)
    {
        float* const ws = static_cast<float*>(workspace);
        args.ws_acc = ws;
        args.ws_m = ws + static_cast<size_t>(num_splits) * total_rows * p->head_dim;
        args.ws_l = args.ws_m + static_cast<size_t>(num_splits) * total_rows;
    }
    args.batch = p->batch;
    args.num_tokens = p->num_tokens;
    args.num_q_heads = p->num_q_heads;
    args.num_kv_heads = p->num_kv_heads;
    args.max_seq_len = p->max_seq_len;
    args.mask_words = p->mask_words;
    args.group = p->num_q_heads / p->num_kv_heads;
    args.row_tiles = static_cast<int>(rowTiles(*p));
    args.num_splits = num_splits;
    args.total_rows = static_cast<int>(total_rows);
    float const scale = (p->scale > 0.f) ? p->scale : 1.f / std::sqrt(static_cast<float>(p->head_dim));
    args.q_scale = scale * kLog2e;

    switch (p->dtype)
    {
    case CLOVER_DTYPE_FP32: return launchForDim<float>(args, p->head_dim, stream);
    case CLOVER_DTYPE_FP16: return launchForDim<__half>(args, p->head_dim, stream);
    case CLOVER_DTYPE_BF16: return launchForDim<__nv_bfloat16>(args, p->head_dim, stream);
    }
    return cudaErrorInvalidValue;
}
