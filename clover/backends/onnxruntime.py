"""The onnxruntime backend: the CPU speed path (docs/results/README.md#cpu-roofline).

Inputs are handed to onnxruntime as numpy views of the torch tensors the
decode loop owns (no copy); the KV cache stays in the decode loop's
:class:`~clover.kv_cache.KVCache`, and only the new tokens' K/V come back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from clover.config import ConfigError
from clover.engine_contract import (DRAFT_OUTPUTS, TARGET_OUTPUTS, DraftResult, TargetResult, cache_input_names,
                                    present_output_names)
from clover.engine_dir import EngineMeta, engine_spec, read_engine_meta


def _session(path: Path, threads: int | None):
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


class OnnxRuntimeEngine:
    """Runs ``target.onnx`` and ``draft_step.onnx`` of an engine directory."""

    def __init__(self, engine_dir: str | Path, threads: int | None = None, meta: EngineMeta | None = None) -> None:
        self.engine_dir = Path(engine_dir)
        meta = meta or read_engine_meta(self.engine_dir)
        if meta.attention == "plugin":
            raise ConfigError(f"{engine_dir}: built with --attention plugin (TensorRT); onnxruntime needs "
                              "--attention standard")
        self.meta = meta
        files = meta.files
        for name in filter(None, (files.get("target"), files.get("draft_step"))):
            if not (self.engine_dir / name).exists():
                raise ConfigError(f"{engine_dir}: {name} is missing; rebuild the engine")
        self.target_session = _session(self.engine_dir / files["target"], threads)
        self.draft_session = _session(self.engine_dir / files["draft_step"], threads) if files.get("draft_step") else None
        self.spec = engine_spec(meta)
        self.cost_model = meta.cost_model  # None unless calibrated
        num_kv = self.spec.num_kv_layers
        self._cache_names = cache_input_names(num_kv)
        self._present_names = present_output_names(num_kv)
        self._target_outputs = [*TARGET_OUTPUTS, *self._present_names]

    def target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        feeds = {
            "input_ids": input_ids.contiguous().numpy(),
            "position_ids": position_ids.contiguous().numpy(),
            "past_lengths": past_lengths.to(torch.int32).contiguous().numpy(),
            "spec_decoding_packed_mask": packed_mask.contiguous().numpy(),
        }
        for i, (k, v) in enumerate(zip(k_cache, v_cache)):
            feeds[self._cache_names[2 * i]] = k.numpy()  # views of the decode loop's cache rows: no copy
            feeds[self._cache_names[2 * i + 1]] = v.numpy()
        outputs = [torch.from_numpy(o) for o in self.target_session.run(self._target_outputs, feeds)]
        presents = outputs[2:]
        return TargetResult(outputs[0], outputs[1], presents[0::2], presents[1::2])

    def draft_step(self, hidden, token, head: int) -> DraftResult:
        if self.draft_session is None:
            raise RuntimeError("this engine was built without a drafter; use method 'vanilla'")
        feeds = {"hidden": hidden.contiguous().numpy(), "token": token.contiguous().numpy(),
                 "head": torch.tensor(head, dtype=torch.long).numpy()}
        next_hidden, logprobs, ids = self.draft_session.run(list(DRAFT_OUTPUTS), feeds)
        return DraftResult(torch.from_numpy(next_hidden), torch.from_numpy(logprobs), torch.from_numpy(ids))
