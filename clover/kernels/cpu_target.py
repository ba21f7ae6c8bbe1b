"""The exact int8 CPU target: ``cpu_target.cpp``, compiled on first use, called once per pass through ctypes.

Why a kernel of our own (docs/quantized-target.md#the-exact-int8-engine): no library computes a token's row
with the same arithmetic whatever else its pass holds at int8 activations (onnxruntime's MatMulNBits takes
another kernel for one row; attention libraries reduce over keys in blocks fixed by their position in the
pass). ``cpu_target.cpp`` runs llama.cpp's one-row Q4_1 / Q8_0 dot products for every row, sharing only the
weight loads, and the TreeAttention contract (docs/engine-contract.md) over the in-place KV cache in each
row's logical key order.

The library is compiled with the system's C++ compiler into ``build_dir`` (one file per source and flags),
with no torch headers: a few seconds. It needs x86-64 with AVX2, FMA and F16C (read from /proc/cpuinfo); on
any other machine :func:`unavailable_reason` says why and the caller keeps onnxruntime's target.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parent / "cpu_target.cpp"
# -ffp-contract=off: a written multiply and add stay two roundings in every instantiation (invariance)
FLAGS = ["-O3", "-std=c++20", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
FORMATS = {"q4_1": 0, "q8_0": 1}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
KERNEL_PATH = "avx2"  # the one path compiled today; AVX-512 VNNI machines run it too (docs/quantized-target.md)


class NativeUnavailable(RuntimeError):
    """The native target cannot run here; the message says why in one line."""


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


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else g++ or c++ on the PATH."""
    for name in filter(None, (os.environ.get("CXX"), "g++", "c++")):
        if shutil.which(name):
            return name
    return None


def unavailable_reason() -> str | None:
    """None where the native target can be built and run here, else why not (one line)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the exact int8 CPU target needs x86-64 with AVX2 (this is {platform.machine()})"
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return f"the exact int8 CPU target needs {', '.join(f.upper() for f in missing)}, which this CPU lacks"
    if compiler() is None:
        return "the exact int8 CPU target is compiled on first use and no C++ compiler was found (install g++)"
    return None


def library_path(build_dir: Path, cxx: str) -> Path:
    """Where the library of this source, these flags and this compiler lives."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cxx, *FLAGS]).encode()).hexdigest()[:16]
    return Path(build_dir) / f"clover_cpu_target-{digest}.so"


def build_library(build_dir: Path) -> Path:
    """Compile the library once into ``build_dir`` (atomic rename: concurrent builders do not clash)."""
    reason = unavailable_reason()
    if reason:
        raise NativeUnavailable(reason)
    cxx = compiler()
    path = library_path(build_dir, cxx)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        staged = Path(tmp) / path.name
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(staged)], capture_output=True, text=True)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeUnavailable(f"the exact int8 CPU target did not compile with {cxx}: {first}")
        os.replace(staged, path)
    return path


@functools.lru_cache(maxsize=None)
def load_library(build_dir: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(Path(build_dir))))
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


def linear(build_dir: str, weight: np.ndarray, fmt: str, n: int, k: int, x: np.ndarray) -> np.ndarray:
    """``int8(x) @ w.T`` for GGUF blocks ``weight`` (uint8 ``[n, k/32 * block bytes]``) and fp32 ``x`` ``[rows, k]``:
    the pass's matmul alone, its activations quantised per row as in a pass."""
    weight, x = np.ascontiguousarray(weight, np.uint8), np.ascontiguousarray(x, np.float32)
    out = np.empty((x.shape[0], n), np.float32)
    load_library(build_dir).clover_linear(_ptr(weight, ctypes.c_uint8), FORMATS[fmt], n, k, _f32p(x), x.shape[0],
                                          _f32p(out))
    return out


def tree_attention(build_dir: str, q, k, v, k_cache, v_cache, past_lengths, packed_mask) -> np.ndarray:
    """The kernel's TreeAttention alone, with :func:`clover.attention.tree_attention`'s contract (fp32 numpy)."""
    arrays = [np.ascontiguousarray(a, np.float32) for a in (q, k, v, k_cache, v_cache)]
    past = np.ascontiguousarray(past_lengths, np.int32)
    mask = np.ascontiguousarray(packed_mask, np.int32)
    batch, tokens, heads, d = arrays[0].shape
    out = np.empty_like(arrays[0])
    load_library(build_dir).clover_tree_attention(*map(_f32p, arrays), _ptr(past, ctypes.c_int32),
                                                  _ptr(mask, ctypes.c_int32), batch, tokens, heads, k.shape[2], d,
                                                  k_cache.shape[2], mask.shape[-1], _f32p(out))
    return out


class NativeTarget:
    """The target of a ``target_native.safetensors`` (:mod:`clover.export.native_target` writes it), run by the
    compiled library: :meth:`forward` is one call per pass."""

    def __init__(self, tensors: dict[str, np.ndarray], config: dict, build_dir: str, threads: int | None = None):
        self._lib = load_library(str(build_dir))
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
