"""ONNX graphs of the engine contract, written op by op from the weights.

Why hand-written rather than traced: the graph must carry exactly the
contract's tensor names and dynamic axes, and the tree attention must come out
either as standard ops or as one ``clover.TreeAttention`` node per layer (the
TensorRT plugin). Writing the graph directly (as TensorRT-LLM's model folders
do) keeps both variants small and lets weights stream into the external-data
file without building a >2 GB protobuf. Parity tests hold it to the torch
modules in :mod:`clover.backends.torch` (1e-4).

Weight mapping: every ``nn.Linear`` weight ``[out, in]`` is stored transposed
as ``[in, out]`` for ``MatMul``; stacked head weights ``[K, out, in]`` as
``[K, in, out]``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from clover.drafters import Drafter, draft_vocab_of
from clover.engine_contract import (cache_input_names, draft_cache_input_names, draft_present_output_names,
                                    present_output_names)
from clover.target import LlamaTarget

OPSET = 18
PLUGIN_DOMAIN = "clover"
PLUGIN_OP = "TreeAttention"


class Residual(NamedTuple):
    """The residual stream between layers, left as ``base + delta`` so the next norm adds it in one fused node
    (``base`` None: ``delta`` is the whole value)."""

    delta: str
    base: str | None = None

    def value(self, g: "GraphWriter") -> str:
        return self.delta if self.base is None else g.op("Add", self.base, self.delta)


class DtypeSpec(NamedTuple):
    """One engine dtype (``engine.json``'s ``dtype``) as numpy and ONNX name it (torch: ``clover.engine_dir``)."""

    np_dtype: type
    onnx_dtype: int  # a TensorProto element type


DTYPES = {"fp32": DtypeSpec(np.float32, TensorProto.FLOAT), "fp16": DtypeSpec(np.float16, TensorProto.FLOAT16)}


class GraphWriter:
    """Collects nodes; big weights go straight to an external-data file."""

    def __init__(self, data_path: Path, dtype: str) -> None:
        self.np_dtype, self.onnx_dtype = DTYPES[dtype].np_dtype, DTYPES[dtype].onnx_dtype
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.data_path = data_path
        self._data = open(data_path, "wb")
        self._count = 0
        # quantized target linears (nn.Linear -> clover.export.target_weights.StoredWeight) and their compute
        self.stored: dict = {}
        self.compute = "fp32"
        # onnxruntime's fused contrib ops (SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization) instead of
        # the standard-op patterns TensorRT parses: per-node dispatch dominates a small model's pass on CPU
        # (docs/results/lean-graph)
        self.fused = False

    def close(self) -> None:
        self._data.close()

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def weight(self, name: str, tensor: torch.Tensor | np.ndarray, cast: bool = True) -> str:
        """A weight initializer; large ones are written to the external-data file."""
        array = tensor.detach().float().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
        if cast and array.dtype.kind == "f":
            array = array.astype(self.np_dtype)
        array = np.ascontiguousarray(array)
        if array.nbytes < 1024:
            self.initializers.append(numpy_helper.from_array(array, name))
            return name
        pad = (-self._data.tell()) % 64  # aligned offsets allow memory-mapping
        self._data.write(b"\0" * pad)
        offset = self._data.tell()
        self._data.write(array.tobytes())
        proto = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.data_path.name), ("offset", str(offset)), ("length", str(array.nbytes))):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(proto)
        return name

    def const(self, value, dtype=None, hint: str = "const") -> str:
        array = np.asarray(value, dtype=dtype)
        return self.weight(self._name(hint), array, cast=dtype is None and array.dtype.kind == "f")

    def op(self, op_type: str, *inputs: str, outputs: int | list[str] = 1, domain: str = "", **attrs):
        names = outputs if isinstance(outputs, list) else [self._name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self._name(op_type), domain=domain, **attrs))
        return names[0] if len(names) == 1 else names

    # -- building blocks --------------------------------------------------

    def linear(self, x: str, layer: torch.nn.Linear, name: str) -> str:
        if layer in self.stored:
            y = self.stored_matmul(x, self.stored[layer], name)
        else:
            y = self.op("MatMul", x, self.weight(f"{name}.weight", layer.weight.T))
        return self.op("Add", y, self.weight(f"{name}.bias", layer.bias)) if layer.bias is not None else y

    def stored_matmul(self, x: str, stored, name: str) -> str:
        """``x @ W.T`` for a quantized weight ``W`` ``[N, K]`` (a ``StoredWeight``): one ``MatMulNBits`` over its
        packed blocks, plus Q4_1's per-block offset times each block's input sum (docs/quantized-target.md#mapping).
        8-bit weights with fp32 compute are a plain MatMul over the dequantised values: onnxruntime's 8-bit kernel
        has no fp32-activation path (it would dequantise the whole matrix at every call)."""
        from clover.export.target_weights import ACCURACY_LEVEL, pack_matmul_nbits

        if self.compute == "fp32" and stored.format != "q4_1":
            return self.op("MatMul", x, self.weight(f"{name}.weight", stored.dequantize().T))
        p = pack_matmul_nbits(stored)
        y = self.op("MatMulNBits", x, self.weight(f"{name}.qweight", p.packed), self.weight(f"{name}.scales", p.scales),
                    domain="com.microsoft", K=p.K, N=p.N, bits=p.bits, block_size=p.block_size,
                    accuracy_level=ACCURACY_LEVEL[self.compute])
        if p.block_offset is None:
            return y
        blocks = self.op("Reshape", x, self.const([0, 0, p.K // p.block_size, p.block_size], np.int64))
        sums = self.op("ReduceSum", blocks, self.const([-1], np.int64), keepdims=0)  # [B, T, K/block]
        return self.op("Add", y, self.op("MatMul", sums, self.weight(f"{name}.block_offset", p.block_offset)))

    def concat_linear(self, x: str, layers: list[torch.nn.Linear], name: str) -> str:
        """``concat([layer(x) for layer in layers], -1)`` as one MatMul over the concatenated weights: one bigger
        GEMM instead of several, fewer nodes and thread-pool dispatches per pass (docs/results/target-pass)."""
        if all(layer in self.stored for layer in layers):
            from clover.export.target_weights import concat_rows

            y = self.stored_matmul(x, concat_rows([self.stored[layer] for layer in layers]), name)
        else:
            y = self.op("MatMul", x, self.weight(f"{name}.weight", torch.cat([layer.weight for layer in layers]).T))
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat([layer.bias if layer.bias is not None else torch.zeros(layer.out_features)
                              for layer in layers])
            y = self.op("Add", y, self.weight(f"{name}.bias", bias))
        return y

    def fused_linear(self, x: str, layers: list[torch.nn.Linear], name: str) -> list[str]:
        """``[layer(x) for layer in layers]``: :meth:`concat_linear`, then a Split."""
        sizes = self.const([layer.out_features for layer in layers], np.int64, hint="split")
        return self.op("Split", self.concat_linear(x, layers, name), sizes, axis=-1, outputs=len(layers))

    def rms_norm(self, x: str, norm, name: str) -> str:
        # Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul: the pattern onnxruntime fuses into one
        # SimplifiedLayerNormalization node (per-node overhead dominates at T = 1 on CPU)
        mean_square = self.op("ReduceMean", self.op("Pow", x, self.const(2.0)), self.const([-1], np.int64), keepdims=1)
        normed = self.op("Div", x, self.op("Sqrt", self.op("Add", mean_square, self.const(norm.eps))))
        return self.op("Mul", normed, self.weight(f"{name}.weight", norm.weight))

    def add_rms_norm(self, stream: "Residual", norm, name: str) -> tuple[str, str]:
        """(``rms_norm(stream)``, the stream's value ``delta + base``): one ``SkipSimplifiedLayerNormalization``
        when fused (its fourth output is the sum), else an Add and the standard-op norm."""
        if not self.fused or stream.base is None:  # onnxruntime fuses a lone norm's pattern itself
            value = stream.value(self)
            return self.rms_norm(value, norm, name), value
        weight = self.weight(f"{name}.weight", norm.weight)
        normed, _, _, value = self.op("SkipSimplifiedLayerNormalization", stream.delta, stream.base, weight,
                                      domain="com.microsoft", epsilon=norm.eps, outputs=4)
        return normed, value

    def silu(self, x: str) -> str:
        return self.op("Mul", x, self.op("Sigmoid", x))


def _rope(g: GraphWriter, position_ids: str, head_dim: int, theta: float):
    """cos, sin ``[B, T, 1, D]`` (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    positions = g.op("Unsqueeze", g.op("Cast", position_ids, to=TensorProto.FLOAT), g.const([-1], np.int64))
    freqs = g.op("Mul", positions, g.const(inv_freq, np.float32))
    emb = g.op("Unsqueeze", g.op("Concat", freqs, freqs, axis=-1), g.const([2], np.int64))
    cos, sin = g.op("Cos", emb), g.op("Sin", emb)
    if g.onnx_dtype != TensorProto.FLOAT:
        cos, sin = g.op("Cast", cos, to=g.onnx_dtype), g.op("Cast", sin, to=g.onnx_dtype)
    return cos, sin


class _RotaryCache:
    """onnxruntime's ``com.microsoft.RotaryEmbedding``: one node per q/k instead of seven.

    cos/sin tables ``[max_positions, D/2]`` are computed in fp32 exactly as
    :func:`clover.target.rope_cos_sin` does.
    """

    def __init__(self, g: GraphWriter, head_dim: int, theta: float, max_positions: int) -> None:
        inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), torch.from_numpy(inv_freq))
        self.cos = g.weight("rope.cos_cache", freqs.cos())
        self.sin = g.weight("rope.sin_cache", freqs.sin())

    def apply(self, g: GraphWriter, x: str, position_ids: str, num_heads: int) -> str:
        """x ``[B, T, heads*D]`` -> same shape, rotated (rotate-half layout)."""
        return g.op("RotaryEmbedding", x, position_ids, self.cos, self.sin, domain="com.microsoft",
                    interleaved=0, num_heads=num_heads)


def _apply_rope(g: GraphWriter, x: str, cos: str, sin: str, head_dim: int) -> str:
    half = head_dim // 2
    axis = g.const([-1], np.int64)
    first = g.op("Slice", x, g.const([0], np.int64), g.const([half], np.int64), axis)
    second = g.op("Slice", x, g.const([half], np.int64), g.const([head_dim], np.int64), axis)
    rotated = g.op("Concat", g.op("Neg", second), first, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


class _AttentionInputs:
    """Per-graph tensors shared by every layer's standard attention."""

    def __init__(self, g: GraphWriter, input_ids: str, past_lengths: str, packed_mask: str, group: int) -> None:
        shape = g.op("Shape", input_ids)
        batch = g.op("Gather", shape, g.const([0], np.int64), axis=0)
        tokens = g.op("Gather", shape, g.const([1], np.int64), axis=0)
        # past_used = max(past_lengths): only that much of each cache is read
        self.past_used = g.op("Cast", g.op("ReduceMax", past_lengths, keepdims=1), to=TensorProto.INT64)  # [1]
        tree_visible = _tree_visible(g, tokens, packed_mask)  # [B, T, T]
        # cache positions [0, past_lengths[b])
        cache_cols = g.op("Range", g.const(0, np.int64), g.op("Squeeze", self.past_used), g.const(1, np.int64))
        lengths = g.op("Unsqueeze", g.op("Cast", past_lengths, to=TensorProto.INT64), g.const([1], np.int64))
        cache_visible = g.op("Less", g.op("Unsqueeze", cache_cols, g.const([0], np.int64)), lengths)  # [B, P]
        cache_visible = g.op("Expand", g.op("Unsqueeze", cache_visible, g.const([1], np.int64)),
                             g.op("Concat", batch, tokens, self.past_used, axis=0))  # [B, T, P]
        visible = g.op("Concat", cache_visible, tree_visible, axis=2)  # [B, T, P+T]
        lowest = float(np.finfo(g.np_dtype).min)
        bias = g.op("Where", visible, g.const(0.0, g.np_dtype), g.const(lowest, g.np_dtype))
        bias = g.op("Unsqueeze", bias, g.const([1], np.int64))  # [B, 1, T, P+T]
        # queries are laid out [B, Hkv, G*T, D]: repeat the bias for the G query heads per KV head
        self.bias = g.op("Concat", *([bias] * group), axis=2) if group > 1 else bias


def _standard_attention(g, shared: _AttentionInputs, q, k, v, past_k, past_v, cfg) -> str:
    """q ``[B, T, Hq, D]``, k/v ``[B, Hkv, T, D]`` -> ``[B, T, Hq*D]`` (GQA: head h uses KV head h // G).

    Cache and new tokens are scored apart and the scores joined: concatenating
    the cache with the new K/V (and transposing the result) would copy every
    cached key and value of every layer at each step, which costs more than
    the attention itself at batch > 1 on CPU. MatMul(q, Transpose(K)) becomes
    one transposed GEMM (onnxruntime fuses it), so the cache is read in place
    after the one Slice to ``past_used``.
    """
    group = cfg.num_heads // cfg.num_kv_heads
    zero, axis2 = g.const([0], np.int64), g.const([2], np.int64)
    cached_k = g.op("Slice", past_k, zero, shared.past_used, axis2)  # [B, Hkv, P, D]
    cached_v = g.op("Slice", past_v, zero, shared.past_used, axis2)
    q = g.op("Reshape", q, g.const([0, 0, cfg.num_kv_heads, group, cfg.head_dim], np.int64))
    q = g.op("Transpose", q, perm=[0, 2, 3, 1, 4])  # [B, Hkv, G, T, D]
    q = g.op("Reshape", q, g.const([0, 0, -1, cfg.head_dim], np.int64))  # [B, Hkv, G*T, D]
    q = g.op("Mul", q, g.const(1.0 / math.sqrt(cfg.head_dim), g.np_dtype))
    transposed = lambda t: g.op("Transpose", t, perm=[0, 1, 3, 2])  # noqa: E731
    scores = g.op("Concat", g.op("MatMul", q, transposed(cached_k)), g.op("MatMul", q, transposed(k)), axis=3)
    probs = g.op("Softmax", g.op("Add", scores, shared.bias), axis=-1)  # [B, Hkv, G*T, P+T]
    axis3, end = g.const([3], np.int64), g.const([np.iinfo(np.int64).max], np.int64)
    out = g.op("Add", g.op("MatMul", g.op("Slice", probs, zero, shared.past_used, axis3), cached_v),
               g.op("MatMul", g.op("Slice", probs, shared.past_used, end, axis3), v))  # [B, Hkv, G*T, D]
    out = g.op("Reshape", out, g.const([0, 0, group, -1, cfg.head_dim], np.int64))
    out = g.op("Transpose", out, perm=[0, 3, 1, 2, 4])  # [B, T, Hkv, G, D]
    return g.op("Reshape", out, g.const([0, 0, -1], np.int64))


def _plugin_attention(g, q, k, v, past_k, past_v, past_lengths, packed_mask, cfg) -> str:
    """One ``clover.TreeAttention`` node; its spec is ``trt_plugins/OP_SPEC.md``."""
    k = g.op("Transpose", k, perm=[0, 2, 1, 3])  # the op takes new K/V as [B, T, Hkv, D]
    v = g.op("Transpose", v, perm=[0, 2, 1, 3])
    out = g.op(PLUGIN_OP, q, k, v, past_k, past_v, past_lengths, packed_mask, domain=PLUGIN_DOMAIN,
               num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
               scale=1.0 / math.sqrt(cfg.head_dim), plugin_namespace=PLUGIN_DOMAIN, plugin_version="1")
    return g.op("Reshape", out, g.const([0, 0, -1], np.int64))


ATTENTIONS = ("gqa", "standard", "plugin")


def _check_attention(attention: str) -> None:
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, not {attention!r}")


class _GqaInputs:
    """Per-graph tensors of onnxruntime's ``GroupQueryAttention`` (the ``gqa`` variant, docs/engine-contract.md#in-place-kv).

    The op writes the new tokens' K/V into the cache at ``[past_lengths[b], past_lengths[b] + T)`` when its past
    and present are one buffer (the backend binds them so), rotates q/k itself at ``position_ids`` (tree depths),
    and masks causally; ``bias`` adds the tree: new token i sees new token j < i only if j is its ancestor.
    """

    def __init__(self, g: GraphWriter, input_ids: str, past_lengths: str, packed_mask: str) -> None:
        tokens = g.op("Gather", g.op("Shape", input_ids), g.const([1], np.int64), axis=0)  # [1] int64
        past = g.op("Cast", past_lengths, to=TensorProto.INT64)  # [B]
        ends = g.op("Add", past, tokens)  # [B]: each row's length after this pass
        self.seqlens_k = g.op("Cast", g.op("Sub", ends, g.const(1, np.int64)), to=TensorProto.INT32)
        total = g.op("ReduceMax", ends, keepdims=0)  # scalar
        self.total_length = g.op("Cast", total, to=TensorProto.INT32)
        tree = g.op("Where", _tree_visible(g, tokens, packed_mask), g.const(0.0, g.np_dtype),
                    g.const(float(np.finfo(g.np_dtype).min), g.np_dtype))  # [B, T, T]
        # column c of row b reads tree column c - past[b] (index + 1 below; index 0: a zero, for the cache)
        tree = g.op("Pad", tree, g.const([0, 0, 1, 0, 0, 0], np.int64))  # [B, T, 1 + T]
        cols = g.op("Unsqueeze", g.op("Range", g.const(0, np.int64), total, g.const(1, np.int64)), g.const([0], np.int64))
        index = g.op("Add", g.op("Sub", cols, g.op("Unsqueeze", past, g.const([1], np.int64))), g.const(1, np.int64))
        index = g.op("Min", g.op("Max", index, g.const(0, np.int64)), g.op("Squeeze", tokens))  # [B, total]
        batch_tokens_total = g.op("Concat", g.op("Shape", past), tokens, g.op("Unsqueeze", total, g.const([0], np.int64)),
                                  axis=0)
        index = g.op("Expand", g.op("Unsqueeze", index, g.const([1], np.int64)), batch_tokens_total)  # [B, T, total]
        bias = g.op("GatherElements", tree, index, axis=2)
        self.bias = g.op("Unsqueeze", bias, g.const([1], np.int64))  # [B, 1, T, total]


def _tree_visible(g: GraphWriter, tokens: str, packed_mask: str) -> str:
    """bool ``[B, T, T]``: new token i may attend to new token j (bit j % 32 of word j // 32 of mask row i)."""
    cols = g.op("Range", g.const(0, np.int64), g.op("Squeeze", tokens), g.const(1, np.int64))
    words = g.op("Gather", g.op("Cast", packed_mask, to=TensorProto.INT64), g.op("Div", cols, g.const(32, np.int64)),
                 axis=2)
    bits = g.op("Gather", g.const([1 << i for i in range(32)], np.int64), g.op("Mod", cols, g.const(32, np.int64)))
    return g.op("Not", g.op("Equal", g.op("BitwiseAnd", words, bits), g.const(0, np.int64)))


class _Attention:
    """One graph's attention, in its variant: what every decoder layer's attention shares (rotary tables, the
    unpacked mask) and the per-layer call. ``names``: the graph's [tokens-shaped int64 ``[B, T]`` input,
    position_ids, past_lengths, packed mask]; ``caches`` / ``presents``: per KV layer (past key, past value) and
    (present key, present value) names.

    - ``gqa``: one ``com.microsoft.GroupQueryAttention`` per layer over the packed q/k/v projection, the cache
      updated in place (its presents are the cache: ``[B, Hkv, S_max, D]``);
    - ``standard``: onnxruntime's RotaryEmbedding and standard attention ops reading the cache in place, the new
      tokens' K/V out (``[B, Hkv, T, D]``);
    - ``plugin``: plain ops and one ``clover.TreeAttention`` node per layer (TensorRT), presents as ``standard``.
    """

    def __init__(self, g: GraphWriter, cfg, variant: str, names: list[str], max_positions: int,
                 caches: list[tuple[str, str]], presents: list[tuple[str, str]]) -> None:
        _check_attention(variant)
        self.cfg, self.variant, self.names, self.caches, self.presents = cfg, variant, names, caches, presents
        if variant == "plugin":
            self.rope = _rope(g, names[1], cfg.head_dim, cfg.rope_theta)
            return
        self.rope = _RotaryCache(g, cfg.head_dim, cfg.rope_theta, max_positions)
        if variant == "gqa":
            self.gqa = _GqaInputs(g, names[0], names[2], names[3])
        else:
            self.shared = _AttentionInputs(g, names[0], names[2], names[3], cfg.num_heads // cfg.num_kv_heads)

    def __call__(self, g: GraphWriter, h: str, attn, name: str, index: int) -> str:
        """Attention of KV layer ``index`` over the normed input ``h`` ``[B, T, H]`` -> ``[B, T, Hq*D]``."""
        cfg, (past_k, past_v), (present_k, present_v) = self.cfg, self.caches[index], self.presents[index]
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        if self.variant == "gqa":
            qkv = g.concat_linear(h, projections, f"{name}.qkv_proj")
            r = self.rope
            out, _, _ = g.op("GroupQueryAttention", qkv, "", "", past_k, past_v, self.gqa.seqlens_k,
                             self.gqa.total_length, r.cos, r.sin, self.names[1], self.gqa.bias, domain="com.microsoft",
                             outputs=[g._name("gqa"), present_k, present_v], num_heads=cfg.num_heads,
                             kv_num_heads=cfg.num_kv_heads, do_rotary=1, rotary_interleaved=0,
                             scale=1.0 / math.sqrt(cfg.head_dim))
            return out
        split = lambda t, heads: g.op("Reshape", t, g.const([0, 0, heads, cfg.head_dim], np.int64))  # noqa: E731
        q, k, v = g.fused_linear(h, projections, f"{name}.qkv_proj")
        if self.variant == "standard":
            q = split(self.rope.apply(g, q, self.names[1], cfg.num_heads), cfg.num_heads)
            k = split(self.rope.apply(g, k, self.names[1], cfg.num_kv_heads), cfg.num_kv_heads)
        else:
            cos, sin = self.rope
            q = _apply_rope(g, split(q, cfg.num_heads), cos, sin, cfg.head_dim)
            k = _apply_rope(g, split(k, cfg.num_kv_heads), cos, sin, cfg.head_dim)
        g.op("Transpose", k, perm=[0, 2, 1, 3], outputs=[present_k])  # [B, Hkv, T, D]
        g.op("Transpose", split(v, cfg.num_kv_heads), perm=[0, 2, 1, 3], outputs=[present_v])
        if self.variant == "plugin":
            return _plugin_attention(g, q, present_k, present_v, past_k, past_v, self.names[2], self.names[3], cfg)
        return _standard_attention(g, self.shared, q, present_k, present_v, past_k, past_v, cfg)


def _fused_norms(attention: str, dtype: str) -> bool:
    """onnxruntime's fused residual-add norms for its graphs (not TensorRT's) in fp32: in fp16 the fused node
    rounds the residual sum to fp16, which moved the tiny test target's logits by 0.073 against 0.055 unfused
    (tests/test_export.py::test_fp16_engine_decodes_the_fp32_reference_up_to_fp16_near_ties holds 0.06)."""
    return attention != "plugin" and dtype == "fp32"


def _decoder_layer(g: GraphWriter, layer, name: str, stream: Residual, attention: _Attention, index: int) -> Residual:
    """One Llama decoder layer on the residual stream; its output is left unsummed for the next fused norm."""
    h, x = g.add_rms_norm(stream, layer.input_layernorm, f"{name}.input_layernorm")
    attended = attention(g, h, layer.self_attn, name, index)
    h, x = g.add_rms_norm(Residual(g.linear(attended, layer.self_attn.o_proj, f"{name}.o_proj"), x),
                          layer.post_attention_layernorm, f"{name}.post_attention_layernorm")
    mlp = layer.mlp
    gate, up = g.fused_linear(h, [mlp.gate_proj, mlp.up_proj], f"{name}.gate_up_proj")
    return Residual(g.linear(g.op("Mul", g.silu(gate), up), mlp.down_proj, f"{name}.down_proj"), x)


def _save(g: GraphWriter, graph: onnx.GraphProto, path: Path, check: bool = True) -> None:
    opsets = [helper.make_opsetid("", OPSET)]
    for domain in sorted({n.domain for n in graph.node} - {""}):
        opsets.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="clover")
    model.ir_version = 9
    g.close()
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    if check:
        onnx.checker.check_model(str(path))  # the path form resolves external data


def _use_stored_weights(g: GraphWriter, target: LlamaTarget, weights: dict | None, compute: str) -> None:
    """Make ``g`` write the target's linears from their stored (quantized) weights: ``weights`` maps clover
    parameter names (``layers.0.mlp.up_proj.weight``, ``lm_head.weight``) to ``StoredWeight``; the
    Augmenting Block's linears are not among them and stay as they are."""
    g.compute = compute
    for name, module in target.named_modules():
        if weights and f"{name}.weight" in weights:
            g.stored[module] = weights[f"{name}.weight"]


def _embedding_table(g: GraphWriter, target: LlamaTarget) -> str:
    """The Gather table: the embedding as is, or for tied embeddings with an LM head stored in GGUF or int8 form,
    the stored LM head dequantised (one table, stored once: the demo GGUF's Q8_0 token_embd serves both); a
    4-bit LM head re-quantised from the checkpoint leaves the embedding in full precision (as
    onnxruntime-genai's builder does)."""
    stored = g.stored.get(target.lm_head)
    if target.config.tie_word_embeddings and stored is not None and stored.format != "int4_block":
        return g.weight("embed_tokens.weight", stored.dequantize())
    return g.weight("embed_tokens.weight", target.embed_tokens.weight)


def _lm_head(g: GraphWriter, target: LlamaTarget, normed: str, embed: str) -> None:
    """``logits`` from the final normed hidden state: the stored LM head, or the (tied) fp32 weight (also for a
    stored 8-bit head with fp32 compute: the tied table holds its values, :func:`_embedding_table`)."""
    tied_fp32 = target.config.tie_word_embeddings and g.compute == "fp32"
    if target.lm_head in g.stored and not tied_fp32:
        g.op("Identity", g.linear(normed, target.lm_head, "lm_head"), outputs=["logits"])
    elif target.config.tie_word_embeddings:
        g.op("MatMul", normed, g.op("Transpose", embed, perm=[1, 0]), outputs=["logits"])
    else:
        g.op("MatMul", normed, g.weight("lm_head.weight", target.lm_head.weight.T), outputs=["logits"])


def export_target(target: LlamaTarget, drafter: Drafter | None, path: Path, dtype: str = "fp32",
                  attention: str = "gqa", on_layer=None, max_positions: int = 2048,
                  target_weights: dict | None = None, compute: str = "fp32") -> dict:
    """Write ``target.onnx`` (+ ``target.onnx.data``): target plus Augmenting Block.

    ``on_layer(done, total)`` is called after each layer is written (progress).
    ``attention``: a variant of :class:`_Attention`; ``gqa`` and ``standard`` use onnxruntime's fused ops
    (rotary tables for ``max_positions`` positions, fused norms), ``plugin`` (TensorRT) plain ops.
    ``target_weights``: quantized linears (:func:`clover.export.target_weights.target_weights_for`), run
    with ``compute`` (``fp32`` or ``int8`` activations; docs/quantized-target.md); None: the fp32 weights.
    Returns the tensor table for ``engine.json``.
    """
    _check_attention(attention)
    cfg = target.config
    augment = drafter.augment if drafter is not None else None
    num_kv = cfg.num_layers + (augment is not None)
    g = GraphWriter(Path(str(path) + ".data"), dtype)
    g.fused = _fused_norms(attention, dtype)
    _use_stored_weights(g, target, target_weights, compute)
    float_type = g.onnx_dtype  # ONNX element type of the float inputs and outputs
    cache_names, present_names = cache_input_names(num_kv), present_output_names(num_kv)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "tokens"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "tokens"]),
        helper.make_tensor_value_info("past_lengths", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("spec_decoding_packed_mask", TensorProto.INT32, ["batch", "tokens", "mask_words"]),
    ] + [helper.make_tensor_value_info(n, float_type, ["batch", cfg.num_kv_heads, "max_seq", cfg.head_dim])
         for n in cache_names]
    present_tokens = "max_seq" if attention == "gqa" else "tokens"  # gqa: the presents are the cache, updated in place
    outputs = [
        helper.make_tensor_value_info("logits", float_type, ["batch", "tokens", cfg.vocab_size]),
        helper.make_tensor_value_info("h0", float_type, ["batch", "tokens", cfg.hidden_size]),
    ] + [helper.make_tensor_value_info(n, float_type, ["batch", cfg.num_kv_heads, present_tokens, cfg.head_dim])
         for n in present_names]
    names = [i.name for i in inputs]
    attend = _Attention(g, cfg, attention, names, max_positions, list(zip(cache_names[0::2], cache_names[1::2])),
                        list(zip(present_names[0::2], present_names[1::2])))
    embed = _embedding_table(g, target)
    stream = Residual(g.op("Gather", embed, "input_ids", axis=0))
    feature_layers = set(drafter.config.feature_layers or ()) if augment is not None else set()
    last_input, layer_inputs = stream, []
    for i, layer in enumerate(target.layers):
        last_input = stream
        if i in feature_layers:
            layer_inputs.append(stream.value(g))
        stream = _decoder_layer(g, layer, f"layers.{i}", stream, attend, i)
        if on_layer is not None:
            on_layer(i + 1, num_kv)
    normed, last_hidden = g.add_rms_norm(stream, target.norm, "norm")
    _lm_head(g, target, normed, embed)
    if augment is not None:  # the Augmenting Block reads the last layer's input (docs/drafter.md)
        if layer_inputs:  # or several layers' inputs, fused (docs/drafter.md#multi-layer-features)
            last_input = Residual(g.linear(g.op("Concat", *layer_inputs, axis=-1), drafter.feature_fuse,
                                           "feature_fuse"))
        last_hidden = _decoder_layer(g, augment, "augment", last_input, attend, cfg.num_layers).value(g)
        if on_layer is not None:
            on_layer(num_kv, num_kv)
    g.op("Identity", last_hidden, outputs=["h0"])
    graph = helper.make_graph(g.nodes, "clover_target", inputs, outputs, g.initializers)
    _save(g, graph, Path(path))
    return {"inputs": _describe(inputs), "outputs": _describe(outputs)}


def _draft_step_io(g: GraphWriter, hidden_size: int, top_k: int) -> tuple[list, list]:
    """The ``draft_step`` graph's inputs and outputs (engine contract, every drafter)."""
    float_type = g.onnx_dtype  # ONNX element type of the float inputs and outputs
    inputs = [
        helper.make_tensor_value_info("hidden", float_type, ["nodes", hidden_size]),
        helper.make_tensor_value_info("token", TensorProto.INT64, ["nodes"]),
        helper.make_tensor_value_info("head", TensorProto.INT64, []),
    ]
    outputs = [
        helper.make_tensor_value_info("next_hidden", float_type, ["nodes", hidden_size]),
        helper.make_tensor_value_info("topk_logprobs", TensorProto.FLOAT, ["nodes", top_k]),
        helper.make_tensor_value_info("topk_ids", TensorProto.INT64, ["nodes", top_k]),
    ]
    return inputs, outputs


def _clamped_l2_length(g: GraphWriter, x: str, eps: float) -> str:
    """``max(||x||, eps)`` over the last axis (kept, size 1): a divisor that is never zero."""
    length = g.op("Sqrt", g.op("ReduceSum", g.op("Mul", x, x), g.const([-1], np.int64), keepdims=1))
    return g.op("Max", length, g.const(eps, g.np_dtype))


def _cosine_gate(g: GraphWriter, normed: str, embedding: str, block, name: str, num_heads: int, hidden_size: int,
                 eps: float, rank: int = 2) -> str:
    """``concat_heads(cos(q_h, k_h) * v_h)``, q from ``normed``, k and v from ``embedding`` (``[..., H]`` of
    ``rank`` dims): the update of Clover's Attention Decoder and Clover-2's cosine-gated blocks (biases where
    ``block``'s projections have them). Cosine as ``torch.nn.functional.cosine_similarity``: each length
    clamped at ``eps``."""
    keep = [0] * (rank - 1)  # Reshape's 0 copies the leading dims
    per_head = g.const([*keep, num_heads, hidden_size // num_heads], np.int64)
    q = g.op("Reshape", g.linear(normed, block.q_proj, f"{name}.q_proj"), per_head)
    k = g.op("Reshape", g.linear(embedding, block.k_proj, f"{name}.k_proj"), per_head)
    v = g.op("Reshape", g.linear(embedding, block.v_proj, f"{name}.v_proj"), per_head)
    dot = g.op("ReduceSum", g.op("Mul", q, k), g.const([-1], np.int64), keepdims=1)
    lengths = g.op("Mul", _clamped_l2_length(g, q, eps), _clamped_l2_length(g, k, eps))
    gate = g.op("Div", dot, lengths)  # cosine similarity
    return g.op("Reshape", g.op("Mul", gate, v), g.const([*keep, hidden_size], np.int64))


def export_draft_step(target: LlamaTarget, drafter: Drafter, path: Path, top_k: int, dtype: str = "fp32") -> dict:
    """Write ``draft_step.onnx``: one regressive step with the top-k inside."""
    if drafter.config.has_draft_prefill:
        return export_clover2_draft_step(target, drafter, path, top_k, dtype)
    cfg = target.config
    g = GraphWriter(Path(str(path) + ".data"), dtype)
    inputs, outputs = _draft_step_io(g, cfg.hidden_size, top_k)
    vocab = draft_vocab_of(drafter)  # [V'] target ids of a draft vocabulary, or None
    lm_head = None  # [V, H]: rows are the regressive embeddings; Medusa with a draft vocabulary needs none
    if vocab is None or (not drafter.is_medusa and drafter.regressive is not None):
        lm_head = g.weight("lm_head.weight", target.lm_head.weight)
    lm_head_t = draft_output_weight(g, target, lm_head, vocab)  # [H, V or V']
    heads_w = g.weight("heads.weight", drafter.heads.weight.transpose(1, 2))  # [K, in, out]
    heads_b = g.weight("heads.bias", drafter.heads.bias)

    def res_block(x: str) -> str:
        y = g.op("Add", g.op("MatMul", x, g.op("Gather", heads_w, "head", axis=0)), g.op("Gather", heads_b, "head", axis=0))
        return g.op("Add", x, g.silu(y))

    hidden = "hidden"
    if drafter.is_medusa:
        g.op("Identity", hidden, outputs=["next_hidden"])
        logits = g.op("MatMul", res_block(g.rms_norm(hidden, drafter.head_norm, "head_norm")), lm_head_t)
    else:
        if drafter.regressive is None:
            next_hidden = hidden
        else:
            next_hidden = _regressive_step(g, drafter, hidden, _token_embedding(g, drafter, lm_head))
        g.op("Identity", next_hidden, outputs=["next_hidden"])
        logits = g.op("MatMul", g.rms_norm(res_block(next_hidden), drafter.head_norm, "head_norm"), lm_head_t)
    return _save_draft_step(g, logits, top_k, vocab, "clover_draft_step", inputs, outputs, path)


def _token_embedding(g: GraphWriter, drafter: Drafter, lm_head: str) -> str:
    """:meth:`clover.drafters.Drafter.embed`: the token's LM-head row, unit-norm, scaled as its token path says."""
    row = g.op("Gather", lm_head, "token", axis=0)
    emb = g.op("Div", row, _clamped_l2_length(g, row, 1e-12))
    scale = drafter.config.token_embedding_scale
    if scale == "rms":
        return g.op("Mul", emb, g.const(drafter.config.hidden_size ** 0.5, g.np_dtype))
    if scale == "learned":  # the Attention Decoder's token_scale, a trained scalar
        return g.op("Mul", emb, g.weight("regressive.token_scale", drafter.regressive.token_scale.detach()))
    return emb


def _regressive_step(g: GraphWriter, drafter: Drafter, hidden: str, emb: str) -> str:
    """``h_i`` from ``h_{i-1}`` and the token embedding: the drafter's ``regressive`` module (docs/drafter.md)."""
    dcfg, reg = drafter.config, drafter.regressive
    if dcfg.normalizes_state:
        hidden = g.rms_norm(hidden, reg.input_norm, "regressive.input_norm")
    if dcfg.regressive == "concat":
        return g.linear(g.op("Concat", hidden, emb, axis=-1), reg.fc, "regressive.fc")
    normed = g.rms_norm(hidden, reg.norm, "regressive.norm")
    if dcfg.regressive == "attention":
        update = _cosine_gate(g, normed, emb, reg, "regressive", dcfg.num_attention_heads, dcfg.hidden_size, 1e-6)
    else:
        up = g.linear(g.op("Concat", normed, emb, axis=-1), reg.up, "regressive.up")
        update = g.linear(g.silu(up), reg.down, "regressive.down")
    return g.op("Add", hidden, update)


def _save_draft_step(g: GraphWriter, logits: str, top_k: int, vocab, name: str, inputs, outputs, path) -> dict:
    """Every draft step's ending: fp32 logits, their top-k (:func:`draft_topk`), the graph written to ``path``;
    returns the tensor table for ``engine.json``."""
    if g.onnx_dtype != TensorProto.FLOAT:
        logits = g.op("Cast", logits, to=TensorProto.FLOAT)
    draft_topk(g, logits, top_k, vocab)
    _save(g, helper.make_graph(g.nodes, name, inputs, outputs, g.initializers), Path(path))
    return {"inputs": _describe(inputs), "outputs": _describe(outputs)}


def export_clover2_draft_step(target: LlamaTarget, drafter, path: Path, top_k: int, dtype: str = "fp32") -> dict:
    """Write Clover-2's ``draft_step.onnx`` (:meth:`clover.drafters.Clover2Drafter.step`; docs/drafter.md#clover-2).

    Head 0 reads ``[root state; root token embedding]`` through ``first_head``; deeper heads mix the node's
    token into the state (``rnn``) and read ``[state; token embedding]`` through ``rnn_head``. The graph computes both and
    selects on ``head == 0`` (``Where``), as the torch step does for a tensor head, so one graph serves
    every depth without control flow.
    """
    cfg = target.config
    g = GraphWriter(Path(str(path) + ".data"), dtype)
    inputs, outputs = _draft_step_io(g, cfg.hidden_size, top_k)
    vocab = draft_vocab_of(drafter)  # [V'] target ids of a draft vocabulary, or None
    lm_head = g.weight("lm_head.weight", target.lm_head.weight)  # [V, H]: its rows are the token embeddings
    lm_head_t = draft_output_weight(g, target, lm_head, vocab)  # [H, V or V']
    embedding = g.op("Gather", lm_head, "token", axis=0)  # [N, H], not normalised (the public code's embedding)
    rnn = drafter.rnn
    update = _cosine_gate(g, g.rms_norm("hidden", rnn.norm, "rnn.norm"), embedding, rnn, "rnn", rnn.num_heads,
                          cfg.hidden_size, rnn.eps)
    deeper_hidden = g.op("Add", "hidden", update)
    deeper = g.linear(g.op("Concat", deeper_hidden, embedding, axis=-1), drafter.rnn_head, "rnn_head")
    first = g.op("Equal", "head", g.const(0, np.int64))  # scalar bool: broadcast by Where
    head0 = g.linear(g.op("Concat", "hidden", embedding, axis=-1), drafter.first_head, "first_head")
    feature = g.op("Where", first, head0, deeper)
    g.op("Where", first, "hidden", deeper_hidden, outputs=["next_hidden"])
    logits = g.op("MatMul", g.rms_norm(feature, drafter.head_norm, "head_norm"), lm_head_t)
    return _save_draft_step(g, logits, top_k, vocab, "clover2_draft_step", inputs, outputs, path)


def _draft_prefill_io(g: GraphWriter, cfg, num_draft_kv_layers: int) -> tuple[list, list]:
    """The ``draft_prefill`` graph's inputs and outputs (engine contract v2, docs/engine-contract.md)."""
    float_type = g.onnx_dtype
    cache = ["batch", cfg.num_kv_heads, "max_seq", cfg.head_dim]
    inputs = [
        helper.make_tensor_value_info("hidden", float_type, ["batch", "tokens", cfg.hidden_size]),
        helper.make_tensor_value_info("next_token", TensorProto.INT64, ["batch", "tokens"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "tokens"]),
        helper.make_tensor_value_info("past_lengths", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("spec_decoding_packed_mask", TensorProto.INT32, ["batch", "tokens", "mask_words"]),
    ] + [helper.make_tensor_value_info(n, float_type, cache) for n in draft_cache_input_names(num_draft_kv_layers)]
    present = ["batch", cfg.num_kv_heads, "tokens", cfg.head_dim]
    outputs = [helper.make_tensor_value_info("state", float_type, ["batch", "tokens", cfg.hidden_size])] + [
        helper.make_tensor_value_info(n, float_type, present) for n in draft_present_output_names(num_draft_kv_layers)]
    return inputs, outputs


def export_draft_prefill(target: LlamaTarget, drafter, path: Path, dtype: str = "fp32", attention: str = "standard",
                         max_positions: int = 2048) -> dict:
    """Write ``draft_prefill.onnx`` (+ ``.data``): Clover-2's token-aware Augmenting Block over the newly accepted
    positions, with its own KV cache (engine contract v2; :class:`clover.backends.torch.DraftPrefill`).

    The target's hidden state, RMS-normalised (``input_norm``), with the token after each position mixed in
    (``token_mixer``), then
    ``block_layers`` decoder layers written like the target's (``clover.TreeAttention`` nodes with
    ``attention="plugin"``; the cache inputs are ``draft_past_*``), then ``block_norm``: the output ``state``.
    Returns the tensor table for ``engine.json``.
    """
    _check_attention(attention)
    cfg = target.config
    g = GraphWriter(Path(str(path) + ".data"), dtype)
    inputs, outputs = _draft_prefill_io(g, cfg, drafter.num_kv_layers)
    cache_names = draft_cache_input_names(drafter.num_kv_layers)
    present_names = draft_present_output_names(drafter.num_kv_layers)
    names = ["next_token", "position_ids", "past_lengths", "spec_decoding_packed_mask"]  # _Attention's roles
    # the drafter's cache keeps contract v2 (presents out), so gqa engines write its block with standard attention
    attend = _Attention(g, cfg, "plugin" if attention == "plugin" else "standard", names, max_positions,
                        list(zip(cache_names[0::2], cache_names[1::2])), list(zip(present_names[0::2], present_names[1::2])))
    g.fused = _fused_norms(attention, dtype)
    embedding = g.op("Gather", g.weight("lm_head.weight", target.lm_head.weight), "next_token", axis=0)  # [B, T, H]
    mixer = drafter.token_mixer
    normed = g.rms_norm("hidden", drafter.input_norm, "input_norm")
    update = _cosine_gate(g, g.rms_norm(normed, mixer.norm, "token_mixer.norm"), embedding, mixer, "token_mixer",
                          mixer.num_heads, cfg.hidden_size, mixer.eps, rank=3)
    stream = Residual(update, normed)
    for i, layer in enumerate(drafter.block):
        stream = _decoder_layer(g, layer, f"block.{i}", stream, attend, i)
    g.op("Identity", g.add_rms_norm(stream, drafter.block_norm, "block_norm")[0], outputs=["state"])
    graph = helper.make_graph(g.nodes, "clover2_draft_prefill", inputs, outputs, g.initializers)
    _save(g, graph, Path(path))
    return {"inputs": _describe(inputs), "outputs": _describe(outputs)}


def draft_output_weight(g: GraphWriter, target: LlamaTarget, lm_head: str | None, vocab: torch.Tensor | None) -> str:
    """The MatMul weight of the draft logits: ``Transpose(lm_head)`` ``[H, V]``, or with a draft vocabulary
    (docs/drafter.md#draft-vocabulary) its V' rows as their own ``[H, V']`` initializer, so int8
    quantization (:mod:`clover.export.quantize`) stores and reads only those."""
    if vocab is None:
        return g.op("Transpose", lm_head, perm=[1, 0])
    return g.weight("draft_lm_head.weight", target.lm_head.weight.detach()[vocab].T)


def draft_topk(g: GraphWriter, logits: str, top_k: int, vocab: torch.Tensor | None) -> None:
    """fp32 logits ``[N, V or V']`` -> the outputs ``topk_logprobs``, ``topk_ids`` ``[N, k]``; a draft
    vocabulary's ranks are mapped back to target token ids (a Gather)."""
    logprobs = g.op("LogSoftmax", logits, axis=-1)
    if vocab is None:
        g.op("TopK", logprobs, g.const([top_k], np.int64), axis=-1, outputs=["topk_logprobs", "topk_ids"])
        return
    _, ranks = g.op("TopK", logprobs, g.const([top_k], np.int64), axis=-1, outputs=["topk_logprobs", "topk_ranks"])
    g.op("Gather", g.weight("draft_vocab", vocab.numpy().astype(np.int64)), ranks, axis=0, outputs=["topk_ids"])


def _describe(infos) -> list[dict]:
    table = []
    for info in infos:
        t = info.type.tensor_type
        dims = [d.dim_param or d.dim_value for d in t.shape.dim]
        table.append({"name": info.name, "dtype": helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims})
    return table
