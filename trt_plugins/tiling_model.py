"""CPU model of the CUDA TreeAttention kernel's tiling (NumPy, fp32).

A line-by-line transcription of ``clover/kernels/tree_attention_kernel.cu``: the same grid
(row tiles x key splits), the same per-block key ranges, tiles of 32 keys dealt
round-robin to warps, one key per lane, the packed-mask word read per tile,
the base-2 online softmax with rescaling, the merge of the warps of a block and
the second pass that merges the splits. A thread block becomes a Python loop
iteration, a warp's 32 lanes become the last NumPy axis, and butterfly shuffles
become index permutations. It exists so that tests can check the kernel's
*structure* against :func:`clover.attention.tree_attention` without a GPU.

The constants below must equal the ``constexpr int kName = value;`` lines of
``clover/kernels/tree_attention_kernel.h``; ``tests/test_trt_plugins.py`` parses the header
and checks that they do.
"""

from __future__ import annotations

import math

import numpy as np

# Mirrors of tree_attention_kernel.h (checked by the tests).
WARP_SIZE = 32
BLOCK_N = 32  # keys per tile, one key per lane
NUM_WARPS = 4  # warps per thread block
BLOCK_M = 16  # query rows per thread block
TARGET_BLOCKS = 256
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32

HEADER_CONSTANTS = {
    "kWarpSize": WARP_SIZE,
    "kBlockN": BLOCK_N,
    "kNumWarps": NUM_WARPS,
    "kBlockM": BLOCK_M,
    "kTargetBlocks": TARGET_BLOCKS,
    "kMinKeysPerSplit": MIN_KEYS_PER_SPLIT,
    "kMaxSplits": MAX_SPLITS,
}

LOG2E = np.float32(1.4426950408889634)
NEG_INF = np.float32(-np.inf)
_LANES = np.arange(WARP_SIZE)


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


# ------------------------------------------------------------- host heuristics
def row_tiles(num_tokens: int, group: int) -> int:
    """``rowTiles``: blocks along the rows of one (b, g)."""
    return ceil_div(num_tokens * group, BLOCK_M)


def num_splits(batch: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, max_seq_len: int) -> int:
    """``treeAttentionNumSplits``: key splits for these shapes (shapes only)."""
    if batch == 0 or num_tokens == 0 or max_seq_len == 0:
        return 1
    base = batch * num_kv_heads * row_tiles(num_tokens, num_q_heads // num_kv_heads)
    if base >= TARGET_BLOCKS:
        return 1
    want = ceil_div(TARGET_BLOCKS, base)
    by_len = ceil_div(max_seq_len, MIN_KEYS_PER_SPLIT)
    return max(1, min(want, by_len, MAX_SPLITS))


def workspace_size(
    batch: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, max_seq_len: int, head_dim: int
) -> int:
    """``treeAttentionWorkspaceSize`` in bytes."""
    n = num_splits(batch, num_tokens, num_q_heads, num_kv_heads, max_seq_len)
    return n * batch * num_tokens * num_q_heads * (head_dim + 2) * 4 if n > 1 else 0


def cache_keys_read(num_tokens: int, num_q_heads: int, num_kv_heads: int, past_lengths, max_seq_len: int) -> int:
    """Cache keys (each one K row and one V row of ``D`` elements) the kernel reads in one launch.

    Every row tile of a (b, g) reads that sequence's whole filled cache for its KV head once, whatever the
    number of splits (they partition it), so the cache is read ``row_tiles`` times: the reason the kernel
    slows where T x group outgrows one tile (docs/gpu-engine.md#why-the-kernel-is-slow-at-large-shapes).
    """
    tiles = row_tiles(num_tokens, num_q_heads // num_kv_heads)
    return tiles * num_kv_heads * sum(min(max(int(p), 0), max_seq_len) for p in past_lengths)


def workspace_bound(head_dim: int) -> int:
    """``treeAttentionWorkspaceBound`` in bytes."""
    return 2 * BLOCK_M * TARGET_BLOCKS * (head_dim + 2) * 4


# ------------------------------------------------------------- warp primitives
def warp_max(x: np.ndarray) -> np.ndarray:
    """``warpMax``: xor butterfly with fmaxf over the 32 lanes (last axis)."""
    offset = WARP_SIZE // 2
    while offset > 0:
        x = np.fmax(x, x[..., _LANES ^ offset])
        offset //= 2
    return x


def warp_sum(x: np.ndarray) -> np.ndarray:
    """``warpSum``: xor butterfly sum over the 32 lanes (last axis)."""
    offset = WARP_SIZE // 2
    while offset > 0:
        x = (x + x[..., _LANES ^ offset]).astype(np.float32)
        offset //= 2
    return x


# ------------------------------------------------------------- the kernels
def _main_block(a: dict, block_x: int, split: int, out: np.ndarray, ws_acc, ws_m, ws_l) -> None:
    """``treeAttentionKernel`` for one thread block (blockIdx.x, blockIdx.y)."""
    T_, Hq, Hkv, S, D = a["T"], a["Hq"], a["Hkv"], a["S"], a["D"]
    group, n_splits = a["group"], a["num_splits"]
    q, k, v, k_cache, v_cache = a["q"], a["k"], a["v"], a["k_cache"], a["v_cache"]

    tile_id = block_x % a["row_tiles"]
    bg = block_x // a["row_tiles"]
    b = bg // Hkv
    g = bg % Hkv

    row0 = tile_id * BLOCK_M
    nrows = min(BLOCK_M, T_ * group - row0)

    # q tile -> "shared memory", pre-scaled; padded rows are zero.
    q_s = np.zeros((BLOCK_M, D), np.float32)
    for r in range(nrows):
        rr = row0 + r
        t = rr // group
        h = g * group + rr % group
        q_s[r] = q[b, t, h] * a["q_scale"]

    past = min(max(int(a["past_lengths"][b]), 0), S)
    chunk = ceil_div(ceil_div(past, n_splits), BLOCK_N) * BLOCK_N
    c0 = min(split * chunk, past)
    c1 = min(c0 + chunk, past)
    n_cache_tiles = ceil_div(c1 - c0, BLOCK_N)
    n_tree_tiles = ceil_div(T_, BLOCK_N) if split == n_splits - 1 else 0
    n_tiles = n_cache_tiles + n_tree_tiles

    # per-warp online-softmax state
    m = np.full((NUM_WARPS, BLOCK_M), NEG_INF, np.float32)
    l = np.zeros((NUM_WARPS, BLOCK_M), np.float32)
    acc = np.zeros((NUM_WARPS, BLOCK_M, D), np.float32)
    p_s = np.zeros((NUM_WARPS, BLOCK_M, BLOCK_N), np.float32)

    for warp in range(NUM_WARPS):
        for tile in range(warp, n_tiles, NUM_WARPS):
            is_tree = tile >= n_cache_tiles
            if not is_tree:
                key0 = c0 + tile * BLOCK_N
                nkeys = min(BLOCK_N, c1 - key0)
                keys = k_cache[b, g, key0 : key0 + nkeys]
                vals = v_cache[b, g, key0 : key0 + nkeys]
                a["cache_keys_read"] += nkeys
            else:
                key0 = (tile - n_cache_tiles) * BLOCK_N  # a multiple of 32: one mask word
                nkeys = min(BLOCK_N, T_ - key0)
                keys = k[b, key0 : key0 + nkeys, g]
                vals = v[b, key0 : key0 + nkeys, g]
            assert keys.shape == (nkeys, D) and vals.shape == (nkeys, D), "read outside the key range"
            key_ok = _LANES < nkeys

            # scores: lane j holds s[r] = q_s[r] . k_j (lanes without a key read nothing)
            s = np.zeros((BLOCK_M, WARP_SIZE), np.float32)
            s[:nrows, :nkeys] = q_s[:nrows] @ keys.T

            # visibility: cache keys for every real row; tree key j when its bit is set
            for r in range(BLOCK_M):
                visible = key_ok & (r < nrows)
                if is_tree and r < nrows:
                    t = (row0 + r) // group
                    word = int(a["packed_mask"][b, t, key0 // 32]) & 0xFFFFFFFF  # static_cast<uint32_t>
                    visible = visible & (((word >> _LANES) & 1) != 0)
                s[r] = np.where(visible, s[r], NEG_INF)

            # online softmax update (base 2)
            any_visible = False
            for r in range(nrows):
                tile_max = warp_max(s[r])[0]
                m_new = np.fmax(m[warp, r], tile_max)
                if m_new == NEG_INF:
                    p = np.zeros(WARP_SIZE, np.float32)
                    alpha = np.float32(1.0)
                else:
                    alpha = np.exp2(m[warp, r] - m_new)
                    p = np.exp2(s[r] - m_new)
                l[warp, r] = l[warp, r] * alpha + warp_sum(p)[0]
                m[warp, r] = m_new
                acc[warp, r] *= alpha
                p_s[warp, r] = p
                any_visible = any_visible or tile_max != NEG_INF

            # acc[r] += sum_j p[r, j] * v_j over the nkeys keys of the tile
            if any_visible:
                acc[warp, :nrows] += p_s[warp, :nrows, :nkeys] @ vals

    # merge the warps of the block
    for r in range(nrows):
        m_max = NEG_INF
        for w in range(NUM_WARPS):
            m_max = np.fmax(m_max, m[w, r])
        l_sum = np.float32(0.0)
        a_sum = np.zeros(D, np.float32)
        for w in range(NUM_WARPS):
            if m[w, r] != NEG_INF:
                f = np.exp2(m[w, r] - m_max)
                l_sum = l_sum + l[w, r] * f
                a_sum = a_sum + acc[w, r] * f
        rr = row0 + r
        t = rr // group
        h = g * group + rr % group
        orow = (b * T_ + t) * Hq + h
        if n_splits == 1:
            out[orow] = a_sum / l_sum if l_sum > 0 else 0.0
        else:
            ws_acc[split, orow] = a_sum
            ws_m[split, orow] = m_max
            ws_l[split, orow] = l_sum


def _combine(ws_acc: np.ndarray, ws_m: np.ndarray, ws_l: np.ndarray, out: np.ndarray) -> None:
    """``treeAttentionCombineKernel``: merge the splits of every output row."""
    n_splits, total_rows = ws_m.shape
    for row in range(total_rows):
        m_max = NEG_INF
        for s in range(n_splits):
            m_max = np.fmax(m_max, ws_m[s, row])
        l_sum = np.float32(0.0)
        a_sum = np.zeros(out.shape[1], np.float32)
        for s in range(n_splits):
            if ws_m[s, row] != NEG_INF:
                f = np.exp2(ws_m[s, row] - m_max)
                l_sum = l_sum + ws_l[s, row] * f
                a_sum = a_sum + ws_acc[s, row] * f
        out[row] = a_sum / l_sum if l_sum > 0 else 0.0


def tree_attention_tiled(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    past_lengths: np.ndarray,
    packed_mask: np.ndarray,
    scale: float | None = None,
    splits: int | None = None,
    stats: dict | None = None,
) -> np.ndarray:
    """Run the kernel model; mirrors ``launchTreeAttention``.

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hkv, D]``; k_cache, v_cache:
            ``[B, Hkv, S, D]`` (any float dtype, read as fp32 like the kernel).
        past_lengths: int ``[B]``; packed_mask: int32 ``[B, T, W]``, W >= ceil(T/32).
        scale: softmax scale; None or <= 0 means ``1/sqrt(D)``.
        splits: force the number of key splits (the launcher's clamp to a smaller
            workspace); None uses :func:`num_splits`.
        stats: if given, gets ``cache_keys_read``: the cache keys the blocks read (see :func:`cache_keys_read`).
    Returns:
        fp32 ``[B, T, Hq, D]`` (the kernel then rounds to the I/O dtype).
    """
    B, T_, Hq, D = q.shape
    Hkv = k.shape[2]
    S = k_cache.shape[2]
    assert Hq % Hkv == 0 and D % WARP_SIZE == 0
    assert packed_mask.dtype == np.int32 and packed_mask.shape[:2] == (B, T_)
    assert packed_mask.shape[2] >= ceil_div(T_, 32)
    out = np.zeros((B * T_ * Hq, D), np.float32)
    if B == 0 or T_ == 0:
        return out.reshape(B, T_, Hq, D)
    group = Hq // Hkv
    n = num_splits(B, T_, Hq, Hkv, S) if splits is None else splits
    scale = 1.0 / math.sqrt(D) if scale is None or not scale > 0 else scale
    a = {
        "q": np.asarray(q, np.float32),
        "k": np.asarray(k, np.float32),
        "v": np.asarray(v, np.float32),
        "k_cache": np.asarray(k_cache, np.float32),
        "v_cache": np.asarray(v_cache, np.float32),
        "past_lengths": np.asarray(past_lengths),
        "packed_mask": packed_mask,
        "T": T_,
        "Hq": Hq,
        "Hkv": Hkv,
        "S": S,
        "D": D,
        "group": group,
        "row_tiles": row_tiles(T_, group),
        "num_splits": n,
        "q_scale": np.float32(scale) * LOG2E,
        "cache_keys_read": 0,
    }
    total_rows = B * T_ * Hq
    ws_acc = np.full((n, total_rows, D), np.nan, np.float32)  # uninitialised workspace
    ws_m = np.full((n, total_rows), np.nan, np.float32)
    ws_l = np.full((n, total_rows), np.nan, np.float32)
    for block_x in range(B * Hkv * a["row_tiles"]):
        for split in range(n):
            _main_block(a, block_x, split, out, ws_acc, ws_m, ws_l)
    if n > 1:
        _combine(ws_acc, ws_m, ws_l, out)
    if stats is not None:
        stats["cache_keys_read"] = a["cache_keys_read"]
    return out.reshape(B, T_, Hq, D)
