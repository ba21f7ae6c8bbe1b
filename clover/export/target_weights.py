"""The target's weights at their stored precision: 4-bit (Q4_1) and 8-bit engines (docs/quantized-target.md).

A decode step at small batch on a CPU is bound by reading the target's weights. The demo target ships as a
GGUF whose decoder layers are Q4_1 blocks and whose tied embedding / LM head is Q8_0; an fp32 engine reads
them dequantised, about 5x the bytes. Here each linear weight is kept as stored and mapped onto
onnxruntime's ``com.microsoft.MatMulNBits``, which reads the packed blocks directly:

- ``q4``: decoder-layer linears as Q4_1 blocks (32 weights: fp16 scale ``d``, fp16 minimum ``m``, 4-bit
  ``q``; ``w = d*q + m``), the LM head as Q8_0 blocks (fp16 ``d``, int8 ``q``; ``w = d*q``). From the demo
  GGUF these are its own bytes (no re-quantisation); other checkpoints are quantised per block by the
  ``gguf`` package's llama.cpp reference quantiser.
- ``int8``: every linear weight (LM head included) int8, symmetric, one scale per output channel.
- ``int4``: every linear weight (LM head included) in MatMulNBits' own symmetric 4-bit blocks of 32 (one
  scale per block, the default zero point), quantised from the fp32 weights, as onnxruntime-genai's model
  builder does (``-p int4``): one MatMulNBits node per linear and nothing beside it, the fastest graph on a
  CPU (docs/results/lean-graph); from the demo GGUF it re-quantises the Q4_1 / Q8_0 values, so it agrees less
  with the fp32 engine than ``q4`` (docs/quantized-target.md).

Embeddings, norms, rotary tables and the Augmenting Block stay as they are: a Gather reads one row per
token (its precision costs nothing per pass; the demo's table holds the Q8_0 values dequantised), norms are
a few kB, and the Augmenting Block belongs to the drafter (it only shapes proposals).

Everything here is numpy; :mod:`clover.export.onnx_graph` writes the nodes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from clover.config import ConfigError

TARGET_WEIGHTS = ("fp32", "int8", "q4", "int4")
# MatMulNBits accuracy_level 1 / 4: activations fp32, or int8 per block; int8-exact: int8 per block in Clover's
# own pass-shape-invariant CPU kernel (clover/kernels/cpu_target.cpp), with target.onnx at fp32 compute where it
# cannot run (docs/quantized-target.md#the-exact-int8-engine)
TARGET_COMPUTE = ("fp32", "int8", "int8-exact")
ACCURACY_LEVEL = {"fp32": 1, "int8": 4, "int8-exact": 1}  # the level of target.onnx
BLOCK = 32  # weights per Q4_1 / Q8_0 block, and the smallest input size a quantized linear may have

# the decoder-layer linears, as clover names them (clover.target) and as a llama GGUF does
LAYER_LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


@dataclasses.dataclass
class StoredWeight:
    """One linear weight ``[N out, K in]`` as stored.

    ``format``: ``q4_1`` / ``q8_0`` (``data``: the GGUF block bytes, uint8 ``[N, K/32 * bytes per block]``),
    ``int8_channel`` (``data``: int8 ``[N, K]``, ``scale``: fp32 ``[N]``) or ``int4_block`` (``data``: uint8
    ``[N, K/32, 16]``, weight ``2i`` in the low nibble of byte ``i``, ``scale``: fp32 ``[N, K/32]``;
    ``w = scale * (q - 8)``).
    """

    format: str
    shape: tuple[int, int]
    data: np.ndarray
    scale: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """fp32 ``[N, K]``: the weight the stored numbers mean (GGUF formats: the ``gguf`` package's own
        dequantiser, the reference llama.cpp's reader uses)."""
        if self.format == "int8_channel":
            return self.data.astype(np.float32) * self.scale[:, None]
        if self.format == "int4_block":
            q = np.stack([self.data & 0x0F, self.data >> 4], axis=-1).reshape(*self.data.shape[:2], BLOCK)
            return ((q.astype(np.float32) - 8) * self.scale[..., None]).reshape(self.shape)
        from gguf import GGMLQuantizationType, quants

        return quants.dequantize(self.data, GGMLQuantizationType[self.format.upper()]).astype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)


def concat_rows(weights: list[StoredWeight]) -> StoredWeight:
    """Several linears of one input as one (``[sum N, K]``): fused q/k/v and gate/up projections."""
    first = weights[0]
    if any(w.format != first.format or w.shape[1] != first.shape[1] for w in weights):
        raise ValueError("only weights of one format and input size can be fused")
    scale = np.concatenate([w.scale for w in weights]) if first.scale is not None else None
    return StoredWeight(first.format, (sum(w.shape[0] for w in weights), first.shape[1]),
                        np.concatenate([w.data for w in weights]), scale)


# -- quantising fp32 weights ------------------------------------------------------------------------------


def quantize_gguf(weight: np.ndarray, fmt: str) -> StoredWeight:
    """fp32 ``[N, K]`` -> Q4_1 or Q8_0 blocks, by the ``gguf`` package (llama.cpp's reference quantiser)."""
    from gguf import GGMLQuantizationType, quants

    weight = np.ascontiguousarray(weight, dtype=np.float32)
    return StoredWeight(fmt, weight.shape, quants.quantize(weight, GGMLQuantizationType[fmt.upper()]))


def quantize_int4_block(weight: np.ndarray) -> StoredWeight:
    """fp32 ``[N, K]`` -> symmetric 4-bit blocks of 32: the value of largest magnitude ``v`` maps to -8 with scale
    ``v / -8`` (as ggml's Q4_0 and onnxruntime's own 4-bit quantiser), the others round to the nearest level."""
    weight = np.asarray(weight, dtype=np.float32)
    n, k = weight.shape
    blocks = weight.reshape(n, k // BLOCK, BLOCK)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]  # [N, K/32]
    scale = peak / np.float32(-8)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint(blocks / safe[..., None]) + 8, 0, 15).astype(np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return StoredWeight("int4_block", (n, k), np.ascontiguousarray(packed), scale.astype(np.float32))


def quantize_int8_channel(weight: np.ndarray) -> StoredWeight:
    """fp32 ``[N, K]`` -> int8 ``[N, K]``, symmetric, scale ``max|w| / 127`` per output channel (row)."""
    weight = np.asarray(weight, dtype=np.float32)
    scale = np.abs(weight).max(axis=1) / np.float32(127)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint(weight / safe[:, None]), -127, 127).astype(np.int8)
    return StoredWeight("int8_channel", weight.shape, q, scale.astype(np.float32))


# -- onnxruntime MatMulNBits -------------------------------------------------------------------------------


@dataclasses.dataclass
class PackedMatMul:
    """The inputs and attributes of one ``com.microsoft.MatMulNBits`` node (no zero-point input: the default
    ``2^(bits-1)``), plus, for Q4_1, the per-block offset that zero point cannot carry.

    ``packed`` uint8 ``[N, K/block_size, block_size*bits/8]``; ``scales`` fp32 ``[N * K/block_size]``;
    ``block_offset`` fp32 ``[K/block_size, N]`` or None: ``y = MatMulNBits(x) + block_sums(x) @ block_offset``
    where ``block_sums(x)`` ``[..., K/block_size]`` sums each block of 32 inputs.
    """

    K: int
    N: int
    bits: int
    block_size: int
    packed: np.ndarray
    scales: np.ndarray
    block_offset: np.ndarray | None = None


def pack_matmul_nbits(weight: StoredWeight) -> PackedMatMul:
    """``weight`` as MatMulNBits inputs that dequantise to the same numbers (docs/quantized-target.md#mapping).

    - Q4_1 ``w = d*q + m`` = ``d*(q - 8) + (m + 8d)``: 4-bit ``q`` with scale ``d`` and the default zero point
      8, plus the block's constant ``m + 8d`` times the sum of its 32 inputs (``block_offset``). A float zero
      point ``-m/d`` would say the same in one input, but onnxruntime 1.32's CPU kernel then dequantises the
      whole matrix at every call (about 30x slower, docs/quantized-target.md).
    - Q8_0 ``w = d*q``: 8-bit ``q + 128`` with scale ``d`` and the default zero point 128: exact.
    - int8 per channel: 8-bit ``q + 128``, each block of 32 in a row carrying the row's scale: exact. (Blocks of
      32, not the whole row: int8 compute quantizes the activations per weight block, and finer is closer.)
    """
    n, k = weight.shape
    if weight.format == "q4_1":
        blocks = weight.data.reshape(n, k // BLOCK, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]  # byte j: weight j (low nibble), weight j + 16 (high nibble)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [N, K/32, 32] in input order
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # MatMulNBits: 2i low, 2i+1 high
        offset = (m + np.float32(8) * d).T  # [K/32, N]
        return PackedMatMul(k, n, 4, BLOCK, np.ascontiguousarray(packed), d.reshape(-1), np.ascontiguousarray(offset))
    if weight.format == "q8_0":
        blocks = weight.data.reshape(n, k // BLOCK, 34)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:].view(np.int8)
        return PackedMatMul(k, n, 8, BLOCK, _offset_binary(q), d.reshape(-1))
    if weight.format == "int4_block":
        return PackedMatMul(k, n, 4, BLOCK, weight.data, weight.scale.reshape(-1))
    if weight.format == "int8_channel":
        q = weight.data.reshape(n, k // BLOCK, BLOCK)
        return PackedMatMul(k, n, 8, BLOCK, _offset_binary(q), np.repeat(weight.scale, k // BLOCK))
    raise ValueError(f"no MatMulNBits mapping for format {weight.format!r}")


def _offset_binary(q: np.ndarray) -> np.ndarray:
    """int8 -> uint8 ``q + 128`` (MatMulNBits' default 8-bit zero point is 128)."""
    return np.ascontiguousarray((q.astype(np.int16) + 128).astype(np.uint8))


# -- which weights, from where -----------------------------------------------------------------------------


def _linear_names(cfg) -> list[str]:
    return [f"layers.{i}.{name}.weight" for i in range(cfg.num_layers) for name in LAYER_LINEARS]


def check_quantizable(cfg, precision: str) -> None:
    """ConfigError naming what is supported when ``precision`` cannot be built for a target of config ``cfg``."""
    if precision not in TARGET_WEIGHTS:
        raise ConfigError(f"unknown target weights {precision!r}; choose {', '.join(TARGET_WEIGHTS)}")
    if precision == "fp32":
        return
    sizes = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_heads * head_dim": cfg.num_heads * cfg.head_dim}
    bad = {name: size for name, size in sizes.items() if size % BLOCK}
    if bad:
        listed = ", ".join(f"{name} {size}" for name, size in bad.items())
        raise ConfigError(f"--target-weights {precision}: this checkpoint has no weights that can be quantized "
                          f"in blocks of {BLOCK} (every linear layer's input size must be a multiple of {BLOCK}; "
                          f"it has {listed}); supported here: --target-weights fp32")


def quantize_target(model, precision: str) -> dict[str, StoredWeight]:
    """The stored weights of ``model``'s linears (clover names, ``lm_head.weight`` included) at ``precision``
    (``q4``, ``int8`` or ``int4``), quantised from its fp32 weights."""
    check_quantizable(model.config, precision)
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    names = _linear_names(model.config) + ["lm_head.weight"]
    if precision == "int8":
        return {name: quantize_int8_channel(state[name]) for name in names}
    if precision == "int4":
        return {name: quantize_int4_block(state[name]) for name in names}
    return {name: quantize_gguf(state[name], "q8_0" if name == "lm_head.weight" else "q4_1") for name in names}


def read_gguf_target(path: str | Path, cfg) -> dict[str, StoredWeight]:
    """The linears of a llama GGUF (``path``) as stored, under clover's names, rows in the Hugging Face order.

    llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` (its rotary layout); transformers'
    reader undoes that on dequantised weights, and so does this on whole rows of blocks (a block runs along
    the input, so a row permutation moves blocks intact). Only Q4_1 / Q8_0 tensors are read.
    """
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    names = {f"layers.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight"
             for i in range(cfg.num_layers) for ours, theirs in LAYER_LINEARS.items()}
    names["lm_head.weight"] = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    out = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise ConfigError(f"{path}: no tensor {theirs}")
        tensor = tensors[theirs]
        fmt = tensor.tensor_type.name.lower()
        if fmt not in ("q4_1", "q8_0"):
            raise ConfigError(f"{path}: {theirs} is {tensor.tensor_type.name}; the native 4-bit engine reads "
                              "Q4_1 and Q8_0 tensors (use --target-weights int8 or fp32)")
        rows = np.asarray(tensor.data)  # [N, bytes per row]
        if ours.endswith("q_proj.weight"):
            rows = _unpermute_rows(rows, cfg.num_heads)
        elif ours.endswith("k_proj.weight"):
            rows = _unpermute_rows(rows, cfg.num_kv_heads)
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists ne0 (the input) first
        out[ours] = StoredWeight(fmt, shape, np.ascontiguousarray(rows))
    return out


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (per head: rows ``[0, 2, 4, ..., 1, 3, ...]`` interleaved)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def check_matches(weights: dict[str, StoredWeight], model, source: str) -> None:
    """ConfigError unless every stored weight dequantises exactly to ``model``'s fp32 weight of that name
    (the demo checkpoint is transformers' dequantisation of the same GGUF)."""
    state = model.state_dict()
    for name, weight in weights.items():
        expected = state[name].detach().float().numpy()
        got = weight.dequantize()
        if got.shape != expected.shape or not np.array_equal(got, expected):
            raise ConfigError(f"{source}: {name} does not dequantise to the checkpoint's weights; "
                              "rebuild the demo checkpoint (delete the cache directory) or use --target-weights fp32")


def target_weights_for(model, precision: str, gguf: str | Path | None = None) -> dict[str, StoredWeight] | None:
    """The stored target weights of an engine: None for ``fp32``; for ``q4`` with a GGUF, that file's own
    blocks (checked against ``model``); else quantised from ``model``."""
    check_quantizable(model.config, precision)
    if precision == "fp32":
        return None
    if precision == "q4" and gguf is not None:
        weights = read_gguf_target(gguf, model.config)
        check_matches(weights, model, str(gguf))
        return weights
    return quantize_target(model, precision)


def describe(weights: dict[str, StoredWeight], precision: str, compute: str, source: str) -> dict:
    """``engine.json``'s ``target_quantization``."""
    formats = sorted({w.format for w in weights.values()})
    lm_head = weights["lm_head.weight"].format
    return {"weights": precision, "compute": compute, "accuracy_level": ACCURACY_LEVEL[compute], "source": source,
            "formats": formats, "lm_head": lm_head if compute == "int8" or lm_head == "int8_channel" else "fp32",
            "quantized_linears": len(weights), "bytes": int(sum(w.nbytes for w in weights.values()))}
