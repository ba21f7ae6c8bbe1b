// PyTorch binding of launchTreeAttention (tree_attention_kernel.cu): the GPU
// engine's attention op (clover/backends/attention_choice.py) and the GPU checks.
// Built on the fly by clover/kernels/tree_attention.py with
// torch.utils.cpp_extension.load; TensorRT is not involved.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cuda_runtime_api.h>

#include "tree_attention_kernel.h"

namespace
{

CloverDataType toCloverType(at::ScalarType type)
{
    switch (type)
    {
    case at::kFloat: return CLOVER_DTYPE_FP32;
    case at::kHalf: return CLOVER_DTYPE_FP16;
    case at::kBFloat16: return CLOVER_DTYPE_BF16;
    default: TORCH_CHECK(false, "tree_attention: q must be float32, float16 or bfloat16, got ", type);
    }
}

void checkTensor(torch::Tensor const& t, char const* name, torch::Tensor const& q, int64_t rank)
{
    TORCH_CHECK(t.is_cuda(), "tree_attention: ", name, " must be a CUDA tensor");
    TORCH_CHECK(t.device() == q.device(), "tree_attention: ", name, " is on another device than q");
    TORCH_CHECK(t.is_contiguous(), "tree_attention: ", name, " must be contiguous");
    TORCH_CHECK(t.dim() == rank, "tree_attention: ", name, " must have rank ", rank, ", got ", t.dim());
}

TreeAttentionParams makeParams(torch::Tensor const& q, torch::Tensor const& k, torch::Tensor const& v,
    torch::Tensor const& k_cache, torch::Tensor const& v_cache, torch::Tensor const& past_lengths,
    torch::Tensor const& packed_mask, double scale)
{
    checkTensor(q, "q", q, 4);
    checkTensor(k, "k", q, 4);
    checkTensor(v, "v", q, 4);
    checkTensor(k_cache, "k_cache", q, 4);
    checkTensor(v_cache, "v_cache", q, 4);
    checkTensor(past_lengths, "past_lengths", q, 1);
    checkTensor(packed_mask, "packed_mask", q, 3);
    for (auto const* t : {&k, &v, &k_cache, &v_cache})
    {
        TORCH_CHECK(t->scalar_type() == q.scalar_type(), "tree_attention: k, v and the caches must have q's dtype");
    }
    TORCH_CHECK(past_lengths.scalar_type() == at::kInt, "tree_attention: past_lengths must be int32");
    TORCH_CHECK(packed_mask.scalar_type() == at::kInt, "tree_attention: packed_mask must be int32");
    int64_t const B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
    int64_t const Hkv = k.size(2), S = k_cache.size(2);
    TORCH_CHECK(k.sizes() == torch::IntArrayRef({B, T, Hkv, D}) && v.sizes() == k.sizes(),
        "tree_attention: k and v must be [B, T, Hkv, D]");
    TORCH_CHECK(k_cache.sizes() == torch::IntArrayRef({B, Hkv, S, D}) && v_cache.sizes() == k_cache.sizes(),
        "tree_attention: k_cache and v_cache must be [B, Hkv, S, D]");
    TORCH_CHECK(past_lengths.size(0) == B, "tree_attention: past_lengths must be [B]");
    TORCH_CHECK(packed_mask.size(0) == B && packed_mask.size(1) == T, "tree_attention: packed_mask must be [B, T, W]");
    TreeAttentionParams p{};
    p.batch = static_cast<int32_t>(B);
    p.num_tokens = static_cast<int32_t>(T);
    p.num_q_heads = static_cast<int32_t>(Hq);
    p.num_kv_heads = static_cast<int32_t>(Hkv);
    p.head_dim = static_cast<int32_t>(D);
    p.max_seq_len = static_cast<int32_t>(S);
    p.mask_words = static_cast<int32_t>(packed_mask.size(2));
    p.scale = static_cast<float>(scale);
    p.dtype = toCloverType(q.scalar_type());
    int const status = treeAttentionValidate(&p);
    TORCH_CHECK(status == 0, "tree_attention: unsupported shapes (head_dim must be 64 or 128, Hkv must divide Hq, "
                             "packed_mask needs ceil(T/32) words)");
    return p;
}

torch::Tensor treeAttention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
    torch::Tensor v_cache, torch::Tensor past_lengths, torch::Tensor packed_mask, double scale)
{
    TreeAttentionParams const p = makeParams(q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale);
    c10::cuda::CUDAGuard const guard(q.device());
    torch::Tensor out = torch::empty_like(q);
    size_t const ws_bytes = treeAttentionWorkspaceSize(&p);
    torch::Tensor workspace;
    if (ws_bytes > 0)
    {
        workspace = torch::empty({static_cast<int64_t>(ws_bytes)}, q.options().dtype(at::kByte));
    }
    int const status = launchTreeAttention(&p, q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), past_lengths.data_ptr<int32_t>(), packed_mask.data_ptr<int32_t>(), out.data_ptr(),
        ws_bytes > 0 ? workspace.data_ptr() : nullptr, ws_bytes, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(status == 0, "launchTreeAttention failed: ", cudaGetErrorString(static_cast<cudaError_t>(status)));
    return out;
}

int64_t numSplits(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor past_lengths, torch::Tensor packed_mask)
{
    TreeAttentionParams const p = makeParams(q, k, v, k_cache, v_cache, past_lengths, packed_mask, 0.0);
    return treeAttentionNumSplits(&p);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("tree_attention", &treeAttention, "Clover TreeAttention CUDA kernel (scale <= 0: 1/sqrt(D))",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("past_lengths"),
        py::arg("packed_mask"), py::arg("scale") = 0.0);
    m.def("num_splits", &numSplits, "key splits the launcher picks for these inputs");
}
