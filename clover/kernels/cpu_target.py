"""The exact int8 CPU target: ``cpu_target.cpp``, compiled on first use, called once per pass through ctypes.

Why a kernel of our own (docs/quantized-target.md#the-exact-int8-engine): no library computes a token's row
with the same arithmetic whatever else its pass holds at int8 activations (onnxruntime's MatMulNBits takes
another kernel for one row; attention libraries reduce over keys in blocks fixed by their position in the
pass). ``cpu_target.cpp`` runs one micro-kernel for every row over weights that :func:`repack` interleaves 8
output columns to a block (integer sums exact, each (row, column)'s float chain fixed), and the TreeAttention
contract (docs/engine-contract.md) over the in-place KV cache in each row's logical key order.

The library is compiled with the system's C++ compiler into ``build_dir`` (one file per source, kernel path
and flags), with no torch headers: a few seconds. Its kernel path is picked by CPU feature (:func:`kernel_path`):
``avx512-vnni`` or ``avx-vnni`` (``vpdpbusd``) where the CPU has it, else ``avx2``; ``$CLOVER_CPU_KERNEL`` forces
one. Every path computes the same bits (they differ only in integer instructions). On a machine without AVX2,
FMA and F16C :func:`unavailable_reason` says why and the caller keeps onnxruntime's target.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

import numpy as np

from clover.kernels.cpu_build import KERNEL_PATHS, REQUIRED_CPU_FLAGS, NativeUnavailable, compiler, library, \
    prebuilt_library

KERNEL_ENV = "CLOVER_CPU_KERNEL"
FORMATS = {"q4_1": 0, "q8_0": 1}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
GROUP = 8  # output columns interleaved per block in the repacked layout (cpu_target.cpp: kGroup)
LAYOUT_VERSION = 2  # 1: GGUF rows as stored (until 2026-12-07); 2: repack()'s interleaved groups


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kernel_path(flags: set[str] | None = None) -> str:
    """The kernel path this CPU runs: ``$CLOVER_CPU_KERNEL`` where set (an unknown or unsupported one is an
    error), else the fastest of :data:`KERNEL_PATHS` whose CPU flags ``flags`` (default: this CPU's) has."""
    flags = cpu_flags() if flags is None else flags
    supported = [name for name, (needs, _) in KERNEL_PATHS.items() if all(f in flags for f in needs)]
    forced = os.environ.get(KERNEL_ENV)
    if forced:
        if forced not in KERNEL_PATHS:
            raise NativeUnavailable(f"${KERNEL_ENV}={forced}: not a kernel path (one of {', '.join(KERNEL_PATHS)})")
        if forced not in supported:
            raise NativeUnavailable(f"${KERNEL_ENV}={forced}: this CPU lacks {', '.join(KERNEL_PATHS[forced][0])}")
        return forced
    return supported[0]


def unavailable_reason() -> str | None:
    """None where the native target can be built and run here, else why not (one line)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the exact int8 CPU target needs x86-64 with AVX2 (this is {platform.machine()})"
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return f"the exact int8 CPU target needs {', '.join(f.upper() for f in missing)}, which this CPU lacks"
    if compiler() is None and not any(prebuilt_library(path) for path in KERNEL_PATHS):
        return "the exact int8 CPU target is compiled on first use and no C++ compiler was found (install g++)"
    return None


def build_library(build_dir: Path, kernel: str) -> Path:
    """Kernel path ``kernel``'s library: the wheel's, else compiled once into ``build_dir``."""
    reason = unavailable_reason()
    if reason:
        raise NativeUnavailable(reason)
    return library(Path(build_dir), kernel)


@functools.lru_cache(maxsize=None)
def load_library(build_dir: str, kernel: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(Path(build_dir), kernel)))
    f32p, u8p, i32p, i64p = (ctypes.POINTER(t) for t in (ctypes.c_float, ctypes.c_uint8, ctypes.c_int32, ctypes.c_int64))
    lib.clover_model_new.restype = ctypes.c_void_p
    lib.clover_model_new.argtypes = [ctypes.POINTER(ModelDesc)]
    lib.clover_model_free.argtypes = [ctypes.c_void_p]
    lib.clover_model_forward.argtypes = [ctypes.c_void_p, i64p, i64p, i32p, i32p, ctypes.c_int32, ctypes.c_int32,
                                         ctypes.c_int32, ctypes.POINTER(f32p), ctypes.POINTER(f32p), ctypes.c_int32,
                                         f32p, f32p]
    lib.clover_linear.argtypes = [u8p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, f32p, ctypes.c_int32, f32p]
    lib.clover_tree_attention.argtypes = [f32p] * 5 + [i32p, i32p] + [ctypes.c_int32] * 7 + [f32p]
    return lib


class LayerDesc(ctypes.Structure):
    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("format", ctypes.c_int32)]


class ModelDesc(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                                                    "layers", "max_positions", "threads")] + [
        ("eps", ctypes.c_float), ("embedding", ctypes.c_void_p), ("lm_head", ctypes.c_void_p),
        ("lm_head_format", ctypes.c_int32), ("final_norm", ctypes.c_void_p), ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p), ("layer", ctypes.POINTER(LayerDesc)), ("has_augment", ctypes.c_int32),
        ("feature_fuse", ctypes.c_void_p), ("num_features", ctypes.c_int32), ("feature_layers", ctypes.c_void_p)]


def _ptr(array: np.ndarray, ctype=ctypes.c_float):
    return array.ctypes.data_as(ctypes.POINTER(ctype))


def _f32p(array: np.ndarray):
    return _ptr(array, ctypes.c_float)


def repack(weight: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    """GGUF blocks ``weight`` (uint8 ``[n, k/32 * block bytes]``: n output columns' rows of Q4_1 or Q8_0 blocks) in
    the kernel's layout (docs/quantized-target.md#the-repacked-layout), flat uint8: columns in groups of 8 (the
    last padded with zero blocks), each group's blocks in input order; a block holds the 8 columns' fp16 scales
    (Q4_1: d, then m) and then chunks of 4 inputs x 8 columns (Q4_1: 4 chunks of the stored nibble bytes 4i..4i+3,
    low nibbles inputs 4i.., high nibbles inputs 16 + 4i..; Q8_0: 8 chunks of inputs 4i..4i+3)."""
    nb, size = k // 32, BLOCK_BYTES[fmt]
    groups = -(-n // GROUP)
    padded = np.zeros((groups * GROUP, nb, size), np.uint8)
    padded[:n] = np.asarray(weight, np.uint8).reshape(n, nb, size)
    blocks = padded.reshape(groups, GROUP, nb, size).transpose(0, 2, 1, 3)  # [group, block, column, bytes]
    scales = 4 if fmt == "q4_1" else 2
    fp16 = [blocks[..., s:s + 2].reshape(groups, nb, 2 * GROUP) for s in range(0, scales, 2)]
    chunks = blocks[..., scales:].reshape(groups, nb, GROUP, -1, 4).transpose(0, 1, 3, 2, 4)  # [.., chunk, column, 4]
    return np.concatenate([*fp16, chunks.reshape(groups, nb, -1)], axis=-1).reshape(-1)


def linear(build_dir: str, weight: np.ndarray, fmt: str, n: int, k: int, x: np.ndarray,
           kernel: str | None = None) -> np.ndarray:
    """``int8(x) @ w.T`` for GGUF blocks ``weight`` (uint8 ``[n, k/32 * block bytes]``) and fp32 ``x`` ``[rows, k]``:
    the pass's matmul alone (on kernel path ``kernel``, default this CPU's), its activations quantised per row as
    in a pass."""
    packed, x = repack(weight, fmt, n, k), np.ascontiguousarray(x, np.float32)
    out = np.empty((x.shape[0], n), np.float32)
    load_library(build_dir, kernel or kernel_path()).clover_linear(_ptr(packed, ctypes.c_uint8), FORMATS[fmt], n, k, _f32p(x), x.shape[0],
                                          _f32p(out))
    return out


def tree_attention(build_dir: str, q, k, v, k_cache, v_cache, past_lengths, packed_mask) -> np.ndarray:
    """The kernel's TreeAttention alone, with :func:`clover.attention.tree_attention`'s contract (fp32 numpy)."""
    arrays = [np.ascontiguousarray(a, np.float32) for a in (q, k, v, k_cache, v_cache)]
    past = np.ascontiguousarray(past_lengths, np.int32)
    mask = np.ascontiguousarray(packed_mask, np.int32)
    batch, tokens, heads, d = arrays[0].shape
    out = np.empty_like(arrays[0])
    load_library(build_dir, kernel_path()).clover_tree_attention(*map(_f32p, arrays), _ptr(past, ctypes.c_int32),
                                                  _ptr(mask, ctypes.c_int32), batch, tokens, heads, k.shape[2], d,
                                                  k_cache.shape[2], mask.shape[-1], _f32p(out))
    return out


class NativeTarget:
    """The target of a ``target_native.safetensors`` (:mod:`clover.export.native_target` writes it), run by the
    compiled library: :meth:`forward` is one call per pass."""

    def __init__(self, tensors: dict[str, np.ndarray], config: dict, build_dir: str, threads: int | None = None,
                 kernel: str | None = None):
        if config.get("layout_version", 1) != LAYOUT_VERSION:
            raise ValueError(f"weights in layout {config.get('layout_version', 1)}, the kernel reads layout "
                             f"{LAYOUT_VERSION}")
        self.kernel_path = kernel or kernel_path()
        self._lib = load_library(str(build_dir), self.kernel_path)
        self.config = config
        self._tensors = {name: np.ascontiguousarray(a) for name, a in tensors.items()}  # owned: the library reads them
        self.threads = threads or os.cpu_count() or 1
        self._desc, self._layers = self._describe()
        self._handle = self._lib.clover_model_new(ctypes.byref(self._desc))
        self._pointer_arrays = ({}, None)

    def _addr(self, name: str) -> int | None:
        array = self._tensors.get(name)
        return None if array is None else array.ctypes.data

    def _describe(self):
        c, t = self.config, self._tensors
        num_kv = c["num_layers"] + bool(c["augment"])
        prefixes = [f"layers.{i}" for i in range(c["num_layers"])] + (["augment"] if c["augment"] else [])
        layers = (LayerDesc * num_kv)(*[
            LayerDesc(*(self._addr(f"{p}.{m}") for m in ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm")),
                      FORMATS[c["formats"][p]]) for p in prefixes])
        self._feature_layers = np.asarray(c.get("feature_layers") or [], np.int32)
        desc = ModelDesc(c["hidden_size"], c["intermediate_size"], c["num_heads"], c["num_kv_heads"], c["head_dim"],
                         c["vocab_size"], c["num_layers"], t["rope_cos"].shape[0], self.threads, c["rms_norm_eps"],
                         self._addr("embedding"), self._addr("lm_head"), FORMATS[c["formats"]["lm_head"]],
                         self._addr("final_norm"), self._addr("rope_cos"), self._addr("rope_sin"), layers,
                         int(bool(c["augment"])), self._addr("feature_fuse"), len(self._feature_layers),
                         self._feature_layers.ctypes.data)
        return desc, layers

    @property
    def max_positions(self) -> int:
        return int(self._tensors["rope_cos"].shape[0])

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, past_lengths: np.ndarray,
                packed_mask: np.ndarray, k_cache: list, v_cache: list) -> tuple[np.ndarray, np.ndarray]:
        """(logits ``[B, T, V]``, h0 ``[B, T, H]``); writes the new tokens' K/V into the caches (contract v3).

        ``k_cache`` / ``v_cache``: per KV layer, contiguous fp32 ``[B, Hkv, S, D]`` tensors (torch or numpy) that
        hold ``past + T`` positions; the caller checks that (:meth:`check_pass`)."""
        c = self.config
        batch, tokens = input_ids.shape
        logits = np.empty((batch, tokens, c["vocab_size"]), np.float32)
        h0 = np.empty((batch, tokens, c["hidden_size"]), np.float32)
        keys, values = self._cache_pointers(k_cache, v_cache)
        i64, i32 = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)
        self._lib.clover_model_forward(self._handle, input_ids.ctypes.data_as(i64), position_ids.ctypes.data_as(i64),
                                       past_lengths.ctypes.data_as(i32), packed_mask.ctypes.data_as(i32), batch, tokens,
                                       packed_mask.shape[-1], keys, values, k_cache[0].shape[2], _f32p(logits),
                                       _f32p(h0))
        return logits, h0

    def _cache_pointers(self, k_cache: list, v_cache: list):
        """Arrays of the caches' data pointers, made again only when the caches move."""
        addresses = tuple(_data_ptr(t) for t in (*k_cache, *v_cache))
        known, arrays = self._pointer_arrays
        if known != addresses:
            _check_caches(k_cache, v_cache, self.config)
            n = len(k_cache)
            arrays = ((ctypes.POINTER(ctypes.c_float) * n)(*[ctypes.cast(a, ctypes.POINTER(ctypes.c_float))
                                                             for a in addresses[:n]]),
                      (ctypes.POINTER(ctypes.c_float) * n)(*[ctypes.cast(a, ctypes.POINTER(ctypes.c_float))
                                                             for a in addresses[n:]]))
            self._pointer_arrays = (addresses, arrays)
        return arrays

    def check_pass(self, input_ids: np.ndarray, position_ids: np.ndarray, past_lengths: np.ndarray, k_cache) -> None:
        """ValueError where a pass would read or write outside its buffers (the library does not check)."""
        c = self.config
        if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= c["vocab_size"]):
            raise ValueError(f"token ids must lie in [0, {c['vocab_size']})")
        if position_ids.size and (position_ids.min() < 0 or position_ids.max() >= self.max_positions):
            raise ValueError(f"positions must lie in [0, {self.max_positions})")
        if k_cache[0].shape[0] < input_ids.shape[0] or len(past_lengths) != input_ids.shape[0]:
            raise ValueError("one past length and one cache row per sequence of the pass")
        if past_lengths.size and int(past_lengths.max()) + input_ids.shape[1] > k_cache[0].shape[2]:
            raise RuntimeError("KV cache overflow: a sequence is longer than max_seq_len")

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.clover_model_free(handle)
            self._handle = None


def _check_caches(k_cache: list, v_cache: list, config: dict) -> None:
    """ValueError unless the caches are what the library writes into: one per KV layer, contiguous fp32 (on the
    CPU) ``[B, Hkv, S, D]``, keys and values of one shape."""
    layers = config["num_layers"] + bool(config["augment"])
    if len(k_cache) != layers or len(v_cache) != layers:
        raise ValueError(f"the exact int8 target needs {layers} KV layers, got {len(k_cache)} and {len(v_cache)}")
    shape = tuple(k_cache[0].shape)
    for t in (*k_cache, *v_cache):
        contiguous = t.is_contiguous() if hasattr(t, "is_contiguous") else t.flags.c_contiguous
        on_cpu = getattr(getattr(t, "device", None), "type", "cpu") == "cpu"
        if not (contiguous and on_cpu and str(t.dtype).endswith("float32") and tuple(t.shape) == shape):
            raise ValueError("the exact int8 target writes the KV cache in place: contiguous fp32 CPU tensors of "
                             "one shape only")
    if shape[1:2] != (config["num_kv_heads"],) or shape[3:] != (config["head_dim"],):
        raise ValueError(f"KV cache of shape {shape}: not [B, {config['num_kv_heads']}, S, {config['head_dim']}]")


def _data_ptr(tensor) -> int:
    return tensor.data_ptr() if hasattr(tensor, "data_ptr") else tensor.ctypes.data
