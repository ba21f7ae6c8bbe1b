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

An engine built with ``--target-compute int8-exact`` also holds ``target_native.safetensors``: there the
target runs in Clover's own CPU kernel (:mod:`clover.kernels.cpu_target`, one call per pass, in place like
``gqa``), and ``target.onnx`` (fp32 compute) only where that kernel cannot run on this machine.
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


def load_native_target(engine_dir: Path, meta: EngineMeta, threads: int | None):
    """The engine's exact int8 CPU target, or None (with a one-line note on stderr) where this machine cannot run
    it: then ``target.onnx`` (fp32 compute) runs instead (docs/quantized-target.md#the-exact-int8-engine)."""
    from clover.demo import cache_root
    from clover.export.native_target import read_native_target
    from clover.kernels import cpu_target

    try:
        reason = cpu_target.unavailable_reason()
        if reason:
            raise cpu_target.NativeUnavailable(reason)
        tensors, config = read_native_target(engine_dir / meta.files["target_native"])
        return cpu_target.NativeTarget(tensors, config, str(cache_root() / "kernels"), threads)
    except cpu_target.NativeUnavailable as exc:
        print(f"[clover] {exc}; running onnxruntime's target (q4 weights, fp32 compute) instead", file=sys.stderr,
              flush=True)
        return None


class OnnxRuntimeEngine:
    """Runs ``target.onnx`` and ``draft_step.onnx`` of an engine directory (and Clover-2's ``draft_prefill.onnx``)."""

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
        self.target_session = open_session(self.engine_dir / files["target"], threads)
        self.native = load_native_target(self.engine_dir, meta, threads) if files.get("target_native") else None
        self.in_place = meta.attention == "gqa"  # contract v3: the target writes the KV cache itself
        # in target_batched.onnx: the cost model prices them apart (the native target runs them in one pass)
        self.runs_batched_trees_apart = self.in_place and self.native is None
        batched = files.get("target_batched")
        self.batched_session = open_session(self.engine_dir / batched, threads) if self.in_place and batched else None
        if self.in_place and self.batched_session is None:
            raise ConfigError(f"{engine_dir}: a gqa engine needs target_batched.onnx; rebuild the engine")
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

    def target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        if self.native is not None:
            return self._native_target(input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache)
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

    def _native_target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        """The exact int8 target: one native call, the new tokens' K/V written into the cache (contract v3)."""
        ids, positions = input_ids.contiguous().numpy(), position_ids.contiguous().numpy()
        past = past_lengths.to(torch.int32).contiguous().numpy()
        tokens = ids.shape[1]
        fits = not past.size or int(past.max()) + tokens <= k_cache[0].shape[2]
        if not fits and len(set(past.tolist())) > 1:
            raise ValueError("a cache shorter than past + T needs equal past lengths")
        caches = (k_cache, v_cache) if fits else self._room_for(k_cache, v_cache, past, tokens)
        self.native.check_pass(ids, positions, past, caches[0])
        logits, h0 = self._timed(self.native.forward, ids, positions, past, packed_mask.contiguous().numpy(), *caches)
        if fits:
            return TargetResult(torch.from_numpy(logits), torch.from_numpy(h0), None, None)
        # a caller's shorter cache (contract v1 allows it) gets the new tokens' K/V back, as target_batched.onnx does
        presents = [[c[:, :, int(past.max()):] for c in kind] for kind in caches]
        return TargetResult(torch.from_numpy(logits), torch.from_numpy(h0), *presents)

    @staticmethod
    def _room_for(k_cache, v_cache, past: np.ndarray, tokens: int):
        """Copies of the caches with room for ``tokens`` more positions after the longest past."""
        length = (int(past.max()) if past.size else 0) + tokens

        def grown(cache):
            room = torch.zeros(*cache.shape[:2], length, cache.shape[3], dtype=torch.float32)
            room[:, :, : min(length, cache.shape[2])] = cache[:, :, :length]
            return room
        return [grown(c) for c in k_cache], [grown(c) for c in v_cache]

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
