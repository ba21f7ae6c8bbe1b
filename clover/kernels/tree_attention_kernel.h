// Clover TreeAttention CUDA kernel: public interface (no TensorRT dependency).
//
// Semantics: clover.attention.tree_attention (clover/attention.py) and
// trt_plugins/OP_SPEC.md. Token t of sequence b attends to cache positions
// [0, past_lengths[b]) and to the in-flight tokens j whose bit j % 32 of word
// j / 32 is set in packed_mask[b, t, :] (LSB first). GQA maps query head h to
// KV head h / (Hq / Hkv). A row that sees nothing outputs zeros.
//
// Tensors (all contiguous, row-major):
//   q            [B, T, Hq, D]    fp32 / fp16 / bf16
//   k, v         [B, T, Hkv, D]   same dtype as q
//   k_cache,
//   v_cache      [B, Hkv, S, D]   same dtype as q; only [:, :, :past_lengths[b]] is read
//   past_lengths [B]              int32 (clamped to [0, S] on the device)
//   packed_mask  [B, T, W]        int32, W >= ceil(T / 32) (W is the row stride)
//   out          [B, T, Hq, D]    same dtype as q
//
// Work decomposition (mirrored line by line by trt_plugins/tiling_model.py):
//   * a "row" is one (token t, query head h) pair of one (sequence b, KV head g);
//     within (b, g), row r = t * group + (h - g * group), group = Hq / Hkv;
//   * a thread block owns kBlockM rows of one (b, g) and one split of the keys;
//   * the cache range [0, P_b) is cut into num_splits chunks of
//     round_up(ceil(P_b / num_splits), kBlockN) keys; the last split also owns
//     the T in-flight ("tree") keys;
//   * a block's key range is cut into tiles of kBlockN = 32 keys (one key per
//     lane); tile i goes to warp i % kNumWarps; cache tiles come first, then tree
//     tiles, which start at multiples of 32 so one mask word covers a tile;
//   * each warp runs an online softmax (base 2, q pre-scaled by scale * log2(e))
//     per row, then the warps of a block are merged in shared memory;
//   * with num_splits > 1 each block writes (m, l, unnormalised acc) to the
//     workspace and a second kernel merges the splits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
namespace clover
{
namespace tree_attention
{
// Tiling constants. tests/test_trt_plugins.py parses these lines and checks them
// against trt_plugins/tiling_model.py; keep the "constexpr int kName = value;" form.
constexpr int kWarpSize = 32;
constexpr int kBlockN = 32;          // keys per tile (one key per lane)
constexpr int kNumWarps = 4;         // warps per thread block
constexpr int kBlockM = 16;          // query rows per thread block
constexpr int kTargetBlocks = 256;   // split-K aims for about this many blocks
constexpr int kMinKeysPerSplit = 256; // no split gets fewer allocated cache slots than this
constexpr int kMaxSplits = 32;       // upper bound on the number of splits
} // namespace tree_attention
} // namespace clover
#endif

#ifdef __cplusplus
extern "C"
{
#endif

typedef enum CloverDataType
{
    CLOVER_DTYPE_FP32 = 0,
    CLOVER_DTYPE_FP16 = 1,
    CLOVER_DTYPE_BF16 = 2
} CloverDataType;

typedef struct TreeAttentionParams
{
    int32_t batch;        // B
    int32_t num_tokens;   // T, in-flight tokens per sequence
    int32_t num_q_heads;  // Hq
    int32_t num_kv_heads; // Hkv, divides Hq
    int32_t head_dim;     // D, 64 or 128
    int32_t max_seq_len;  // S, the cache's allocated length (dim 2 of k_cache)
    int32_t mask_words;   // W, the last dim of packed_mask, >= ceil(T / 32)
    float scale;          // softmax scale; <= 0 (or NaN) means 1 / sqrt(D)
    CloverDataType dtype; // dtype of q, k, v, k_cache, v_cache and out
} TreeAttentionParams;

// 0 when the parameters are supported, else a cudaError_t (cudaErrorInvalidValue).
int treeAttentionValidate(TreeAttentionParams const* params);

// Number of key splits the launcher uses for these shapes (1: no combine pass).
// Depends on shapes only, never on device data or the device.
int treeAttentionNumSplits(TreeAttentionParams const* params);

// Exact workspace bytes launchTreeAttention wants for these shapes (0 if one split).
size_t treeAttentionWorkspaceSize(TreeAttentionParams const* params);

// Shape-independent upper bound of treeAttentionWorkspaceSize for a head_dim:
// the split heuristic keeps B * T * Hq * num_splits < 2 * kBlockM * kTargetBlocks.
// A TensorRT plugin can reserve this once for every shape.
size_t treeAttentionWorkspaceBound(int32_t head_dim);

// Enqueue the kernel(s) on `stream`. k, v, k_cache and v_cache must be 16-byte
// aligned (cudaErrorMisalignedAddress otherwise). `workspace` may be null when
// workspace_bytes is 0; if the workspace is smaller than
// treeAttentionWorkspaceSize, fewer splits are used (never an overflow).
// Returns 0 (cudaSuccess) or a cudaError_t; launch errors are reported, errors
// inside the kernel surface at the next synchronisation as usual.
int launchTreeAttention(TreeAttentionParams const* params, void const* q, void const* k, void const* v,
    void const* k_cache, void const* v_cache, int32_t const* past_lengths, int32_t const* packed_mask, void* out,
    void* workspace, size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
} // extern "C"
#endif
