"""The exact int8 CPU target: Clover's own kernel runs the target's pass; onnxruntime runs the drafts.

An engine built with ``--target-compute int8-exact`` (the demo default) holds ``target_native.safetensors``
(docs/quantized-target.md#the-exact-int8-engine). :class:`CpuInt8Target` runs its target there, one native
call per pass (:mod:`clover.kernels.cpu_target`, the kernel path picked by CPU feature), writing the new tokens'
K/V into the decode loop's cache in place (contract v3). :class:`~clover.backends.onnxruntime.OnnxRuntimeEngine`
hands it every target pass and runs the draft steps itself; ``engine.json``'s ``runtimes`` and the engine's
:meth:`describe_runtimes` line say so. Where the kernel cannot run (no AVX2, no compiler), :meth:`CpuInt8Target.open`
says why in one line and the engine runs its ``target.onnx`` at fp32 compute instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from clover.engine_contract import TargetResult
from clover.engine_dir import EngineMeta


class CpuInt8Target:
    """The target pass of an int8-exact engine in :class:`clover.kernels.cpu_target.NativeTarget`."""

    def __init__(self, native) -> None:
        self.native = native

    @classmethod
    def open(cls, engine_dir: Path, meta: EngineMeta, threads: int | None) -> "CpuInt8Target | None":
        """The engine's native target, or None (with a one-line note on stderr) where this machine cannot run it."""
        from clover.demo import cache_root
        from clover.export.native_target import read_native_target
        from clover.kernels import cpu_target

        try:
            reason = cpu_target.unavailable_reason()
            if reason:
                raise cpu_target.NativeUnavailable(reason)
            tensors, config = read_native_target(Path(engine_dir) / meta.files["target_native"])
            return cls(cpu_target.NativeTarget(tensors, config, str(cache_root() / "kernels"), threads))
        except cpu_target.NativeUnavailable as exc:
            print(f"[clover] {exc}; running onnxruntime's target (q4 weights, fp32 compute) instead", file=sys.stderr,
                  flush=True)
            return None

    def describe(self) -> str:
        return f"Clover's exact int8 kernel ({self.native.kernel_path} path, {self.native.threads} threads)"

    def __call__(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        """One native call; the new tokens' K/V written into the cache (contract v3)."""
        ids, positions = input_ids.contiguous().numpy(), position_ids.contiguous().numpy()
        past = past_lengths.to(torch.int32).contiguous().numpy()
        tokens = ids.shape[1]
        fits = not past.size or int(past.max()) + tokens <= k_cache[0].shape[2]
        if not fits and len(set(past.tolist())) > 1:
            raise ValueError("a cache shorter than past + T needs equal past lengths")
        caches = (k_cache, v_cache) if fits else _room_for(k_cache, v_cache, past, tokens)
        self.native.check_pass(ids, positions, past, caches[0])
        logits, h0 = self.native.forward(ids, positions, past, packed_mask.contiguous().numpy(), *caches)
        if fits:
            return TargetResult(torch.from_numpy(logits), torch.from_numpy(h0), None, None)
        # a caller's shorter cache (contract v1 allows it) gets the new tokens' K/V back, as target_batched.onnx does
        presents = [[c[:, :, int(past.max()):] for c in kind] for kind in caches]
        return TargetResult(torch.from_numpy(logits), torch.from_numpy(h0), *presents)


def _room_for(k_cache, v_cache, past: np.ndarray, tokens: int):
    """Copies of the caches with room for ``tokens`` more positions after the longest past."""
    length = (int(past.max()) if past.size else 0) + tokens

    def grown(cache):
        room = torch.zeros(*cache.shape[:2], length, cache.shape[3], dtype=torch.float32)
        room[:, :, : min(length, cache.shape[2])] = cache[:, :, :length]
        return room
    return [grown(c) for c in k_cache], [grown(c) for c in v_cache]
