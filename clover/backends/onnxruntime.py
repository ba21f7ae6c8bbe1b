"""The onnxruntime backend: the CPU speed path (docs/results/README.md#cpu-roofline).

Inputs are handed to onnxruntime as numpy views of the torch tensors the
decode loop owns (no copy); the KV cache stays in the decode loop's
:class:`~clover.kv_cache.KVCache`. A ``gqa`` engine (contract v3,
docs/engine-contract.md#in-place-kv) writes the new tokens' K/V into that
cache itself: its presents are bound to the cache's own memory (I/O binding),
so ``GroupQueryAttention`` updates it in place and nothing is copied. Where
that op cannot run a step (several sequences, a tree each, past context: it
takes one row at a time there), the engine's ``target_batched.onnx``, the same
graph with standard attention, runs it and returns the new tokens' K/V.
Other engines (``standard`` attention) return the new tokens' K/V as numpy
arrays over onnxruntime's own buffers, without a copy.

An engine built with ``--target-compute int8-exact`` also holds ``target_native.safetensors``: its target
passes run in Clover's own CPU kernel (:class:`clover.backends.cpu_int8.CpuInt8Target`), its draft steps here,
and ``target.onnx`` (fp32 compute) only where that kernel cannot run on this machine.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from clover.attention import causal_packed_mask
from clover.config import ConfigError
from clover.engine_contract import (DRAFT_OUTPUTS, DRAFT_PREFILL_OUTPUTS, TARGET_OUTPUTS, DraftPrefillResult,
                                    DraftResult, TargetResult, cache_input_names, draft_cache_input_names,
                                    draft_present_output_names, present_output_names)
from clover.engine_dir import EngineMeta, engine_spec, read_engine_meta


def open_session(path: Path, threads: int | None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # No spin-waiting between ops: the decode loop's Python work runs between engine calls and a
    # spinning worker thread takes its core (measured on 2 cores: 31 vs 36 ms per vanilla step).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ConfigError(f"{path}: onnxruntime cannot load this engine ({exc})") from exc


def _gqa_runs(batch: int, tokens: int, past: np.ndarray, packed_mask: np.ndarray) -> bool:
    """Whether onnxruntime's GroupQueryAttention (CPU, 1.32) computes this step as the contract says: one token
    per sequence; a tree after a past at batch 1 (several sequences with a past: it refuses); a prompt chunk,
    whose mask is causal (with no past it masks causally and ignores the tree bias).
    Measured: tests/test_lean_graph.py::test_gqa_routing_follows_what_onnxruntime_computes."""
    if tokens == 1:
        return True
    if batch == 1 and past[0] > 0:
        return True
    return (batch == 1 or not past.any()) and np.array_equal(packed_mask, _causal_mask(batch, tokens))


@functools.lru_cache(maxsize=64)
def _causal_mask(batch: int, tokens: int) -> np.ndarray:
    return causal_packed_mask(batch, tokens).numpy()


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}


class _Memory:
    """A tensor's memory as a numpy array interface that does not keep the tensor alive (whoever uses it checks
    first that the tensor is: OnnxRuntimeEngine._cache_feeds_of)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        size = tensor.element_size()
        self.__array_interface__ = {"data": (tensor.data_ptr(), False), "shape": tuple(tensor.shape), "version": 3,
                                    "typestr": np.dtype(_NUMPY_DTYPES[tensor.dtype]).str,
                                    "strides": tuple(stride * size for stride in tensor.stride())}


class OnnxRuntimeEngine:
    """Runs ``target.onnx`` and ``draft_step.onnx`` of an engine directory (and Clover-2's ``draft_prefill.onnx``);
    an int8-exact engine's target passes run in Clover's kernel instead (:attr:`native`, a
    :class:`~clover.backends.cpu_int8.CpuInt8Target`)."""

    def __init__(self, engine_dir: str | Path, threads: int | None = None, meta: EngineMeta | None = None) -> None:
        self.engine_dir = Path(engine_dir)
        meta = meta or read_engine_meta(self.engine_dir)
        if meta.attention == "plugin":
            raise ConfigError(f"{engine_dir}: built with --attention plugin (TensorRT); onnxruntime needs "
                              "--attention standard")
        self.meta = meta
        files = meta.files
        for name in filter(None, (files.get(role) for role in ("target", "target_batched", "draft_step", "draft_prefill"))):
            if not (self.engine_dir / name).exists():
                raise ConfigError(f"{engine_dir}: {name} is missing; rebuild the engine")
        self._open_target(files, threads)
        draft = files.get("draft_step")
        self.draft_session = open_session(self.engine_dir / draft, threads) if draft else None
        prefill = files.get("draft_prefill")
        self.prefill_session = open_session(self.engine_dir / prefill, threads) if prefill else None
        self.spec = engine_spec(meta)
        self.cost_model = meta.cost_model  # None unless calibrated
        num_kv = self.spec.num_kv_layers
        self._cache_names = cache_input_names(num_kv)
        self._present_names = present_output_names(num_kv)
        self._target_outputs = [*TARGET_OUTPUTS, *self._present_names]
        self._cache_feeds: tuple[list, dict] = ([], {})  # (weak references to the cache views, their feeds)
        self._binding: tuple[list, object] = ([], None)  # (weak references to the cache views, their I/O binding)
        self._np_dtype = _NUMPY_DTYPES[self.spec.dtype]
        self._head_sizes = (("logits", self.spec.vocab_size), ("h0", self.spec.hidden_size))
        self.run_seconds = 0.0  # spent inside onnxruntime's run calls (clover.bench splits a step with it)
        num_draft_kv = self.spec.num_draft_kv_layers
        self._draft_cache_names = draft_cache_input_names(num_draft_kv)
        self._prefill_outputs = [*DRAFT_PREFILL_OUTPUTS, *draft_present_output_names(num_draft_kv)]

    def _open_target(self, files: dict, threads: int | None) -> None:
        from clover.backends.cpu_int8 import CpuInt8Target

        self.native = CpuInt8Target.open(self.engine_dir, self.meta, threads) if files.get("target_native") else None
        if self.native is not None:  # target.onnx stays the fallback where the kernel cannot run
            # the decode loop's own torch ops are small (argmax, gathers), and torch's OpenMP threads spin after
            # each one (GOMP's default wait policy) on the core the kernel's helper thread needs; the gain is
            # within this machine's noise (docs/results/trees-one-pass/README.md#host-threads)
            torch.set_num_threads(1)
            self.target_session = self.batched_session = None
            self.in_place, self.runs_batched_trees_apart = True, False  # several trees run in one pass
            return
        self.target_session = open_session(self.engine_dir / files["target"], threads)
        self.in_place = self.meta.attention == "gqa"  # contract v3: the target writes the KV cache itself
        # several sequences' trees run in target_batched.onnx: the cost model prices them apart
        self.runs_batched_trees_apart = self.in_place
        batched = files.get("target_batched")
        self.batched_session = open_session(self.engine_dir / batched, threads) if self.in_place and batched else None
        if self.in_place and self.batched_session is None:
            raise ConfigError(f"{self.engine_dir}: a gqa engine needs target_batched.onnx; rebuild the engine")

    def describe_runtimes(self) -> str:
        """What runs each part of a step, in one line."""
        quantized = self.meta.target_quantization or {}
        precision = f"{quantized['weights']} weights, fp32 compute" if quantized else self.spec.dtype
        target = self.native.describe() if self.native is not None else f"onnxruntime ({precision})"
        return f"target: {target}; drafts: onnxruntime"

    def target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        if self.native is not None:
            return self._timed(self.native, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache)
        feeds = {
            "input_ids": input_ids.contiguous().numpy(),
            "position_ids": position_ids.contiguous().numpy(),
            "past_lengths": past_lengths.to(torch.int32).contiguous().numpy(),
            "spec_decoding_packed_mask": packed_mask.contiguous().numpy(),
        }
        if self.in_place:
            batch, tokens = feeds["input_ids"].shape
            past = feeds["past_lengths"]
            # the op writes wherever the lengths point: in place only where the new tokens fit the buffer (a
            # caller's shorter cache, as contract v1 allowed, gets the new tokens' K/V back instead)
            fits = not past.size or int(past.max()) + tokens <= k_cache[0].shape[2]
            if fits and _gqa_runs(batch, tokens, past, feeds["spec_decoding_packed_mask"]):
                binding = self._binding_for(k_cache, v_cache)
                if binding is not None:
                    return self._target_in_place(binding, feeds)
            session = self.batched_session
        else:
            session = self.target_session
        feeds.update(self._cache_feeds_of(k_cache, v_cache))
        outputs = [torch.from_numpy(o) for o in self._run(session, self._target_outputs, feeds)]
        presents = outputs[2:]
        return TargetResult(outputs[0], outputs[1], presents[0::2], presents[1::2])

    def _target_in_place(self, binding, feeds: dict) -> TargetResult:
        """The ``gqa`` graph with each present bound to its past's memory (``binding``: :meth:`_binding_for`): the
        op writes the new tokens' K/V into the decode loop's cache (contract v3); logits and h0 come back in fresh
        arrays."""
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        batch, tokens = feeds["input_ids"].shape
        outputs = {name: np.empty((batch, tokens, size), dtype=self._np_dtype) for name, size in self._head_sizes}
        for name, array in outputs.items():
            binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        self._timed(self.target_session.run_with_iobinding, binding)
        return TargetResult(torch.from_numpy(outputs["logits"]), torch.from_numpy(outputs["h0"]), None, None)

    def _binding_for(self, k_cache, v_cache):
        """An I/O binding with the caches bound as the past inputs and, at the same memory, the present outputs;
        made again only when other cache views come (as :meth:`_cache_feeds_of`). None where the caches cannot be
        written in place: not contiguous CPU memory of the engine's dtype, or one tensor passed for two caches
        (the op would write values over keys)."""
        tensors = [t for pair in zip(k_cache, v_cache) for t in pair]
        refs, binding = self._binding
        if len(refs) == len(tensors) and all(ref() is t for ref, t in zip(refs, tensors)):
            return binding
        if not all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == self.spec.dtype for t in tensors):
            return None
        if len({t.data_ptr() for t in tensors}) < len(tensors):
            return None
        binding = self.target_session.io_binding()
        for past, present, t in zip(self._cache_names, self._present_names, tensors):
            binding.bind_input(past, "cpu", 0, self._np_dtype, list(t.shape), t.data_ptr())
            binding.bind_output(present, "cpu", 0, self._np_dtype, list(t.shape), t.data_ptr())  # the same memory
        self._binding = ([weakref.ref(t) for t in tensors], binding)
        return binding

    def _cache_feeds_of(self, k_cache, v_cache) -> dict:
        """The KV-cache feeds: numpy arrays over the decode loop's cache views (no copy), made again only when other
        view tensors come (:meth:`KVCache.views` hands out the same ones step after step). The arrays do not keep
        the views alive, so a finished decoder's cache is freed; weak references tell whether they are the same."""
        tensors = [t for pair in zip(k_cache, v_cache) for t in pair]  # in the order of the input names
        refs, feeds = self._cache_feeds
        if len(refs) != len(tensors) or any(ref() is not t for ref, t in zip(refs, tensors)):
            if not all(t.dtype in _NUMPY_DTYPES and t.device.type == "cpu" and t.numel() for t in tensors):
                return {name: t.numpy() for name, t in zip(self._cache_names, tensors)}  # not kept
            feeds = {name: np.asarray(_Memory(t)) for name, t in zip(self._cache_names, tensors)}
            self._cache_feeds = ([weakref.ref(t) for t in tensors], feeds)
        return feeds

    def _run(self, session, output_names: list[str], feeds: dict) -> list:
        return self._timed(session.run, output_names, feeds)

    def _timed(self, call, *args):
        """``call(*args)``, its time added to :attr:`run_seconds`."""
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.run_seconds += time.perf_counter() - start

    def draft_step(self, hidden, token, head: int) -> DraftResult:
        if self.draft_session is None:
            raise RuntimeError("this engine was built without a drafter; use method 'vanilla'")
        feeds = {"hidden": hidden.contiguous().numpy(), "token": token.contiguous().numpy(),
                 "head": np.array(head, dtype=np.int64)}
        next_hidden, logprobs, ids = self._run(self.draft_session, list(DRAFT_OUTPUTS), feeds)
        return DraftResult(torch.from_numpy(next_hidden), torch.from_numpy(logprobs), torch.from_numpy(ids))

    def draft_prefill(self, hidden, next_token, position_ids, past_lengths, packed_mask, k_cache,
                      v_cache) -> DraftPrefillResult:
        if self.prefill_session is None:
            raise RuntimeError("this engine's drafter keeps no KV cache (engine contract v1): no draft_prefill")
        feeds = {
            "hidden": hidden.contiguous().numpy(),
            "next_token": next_token.contiguous().numpy(),
            "position_ids": position_ids.contiguous().numpy(),
            "past_lengths": past_lengths.to(torch.int32).contiguous().numpy(),
            "spec_decoding_packed_mask": packed_mask.contiguous().numpy(),
        }
        for i, (k, v) in enumerate(zip(k_cache, v_cache)):
            feeds[self._draft_cache_names[2 * i]] = k.numpy()  # views of the decode loop's draft cache: no copy
            feeds[self._draft_cache_names[2 * i + 1]] = v.numpy()
        outputs = [torch.from_numpy(o) for o in self._run(self.prefill_session, self._prefill_outputs, feeds)]
        presents = outputs[1:]
        return DraftPrefillResult(outputs[0], presents[0::2], presents[1::2])
