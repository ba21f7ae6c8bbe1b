"""The TensorRT backend (NVIDIA GPUs): runs ``target.plan`` and ``draft_step.plan`` (and Clover-2's
``draft_prefill.plan``).

Written against TensorRT 10's Python API (``execute_async_v3`` with tensor
addresses). TensorRT cannot be installed on the development machines, so this
module is import-guarded and has not run there; docs/status.md says what has
run where. The KV cache lives on the GPU (``EngineSpec.device``); small inputs
are copied in, logits and ``h0`` come back to the host for the decode loop.
"""

from __future__ import annotations

from pathlib import Path

import torch

from clover.config import ConfigError
from clover.engine_contract import (DraftPrefillResult, DraftResult, TargetResult, cache_input_names,
                                    draft_cache_input_names, draft_present_output_names, present_output_names)
from clover.engine_dir import EngineMeta, engine_spec, read_engine_meta

TENSORRT_MISSING = ("TensorRT is not installed (`import tensorrt` failed); the tensorrt backend needs an NVIDIA GPU "
                    "host with TensorRT 10 (pip install tensorrt) and the plugin built from trt_plugins/")


def require_tensorrt():
    """The ``tensorrt`` module, or a :class:`ConfigError` saying why not."""
    try:
        import tensorrt
    except ImportError as exc:
        raise ConfigError(TENSORRT_MISSING) from exc
    if not torch.cuda.is_available():
        raise ConfigError("the tensorrt backend needs a CUDA GPU; none is visible to torch")
    return tensorrt


def load_tree_attention_plugin() -> None:
    """Register the ``clover.TreeAttention`` plugin creator with TensorRT."""
    try:
        from trt_plugins.loader import load_plugin_library
    except ImportError as exc:
        raise ConfigError("trt_plugins is not importable; run from a Clover checkout or pip install -e .") from exc
    load_plugin_library()


_TRT_TO_TORCH = {"FLOAT": torch.float32, "HALF": torch.float16, "INT32": torch.int32, "INT64": torch.int64,
                 "BF16": torch.bfloat16, "BOOL": torch.bool}


class _Plan:
    """One deserialized plan and its execution context."""

    def __init__(self, trt, runtime, path: Path) -> None:
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise ConfigError(f"{path}: TensorRT could not deserialize this plan (built for another TensorRT/GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def __call__(self, inputs: dict[str, torch.Tensor], stream: torch.cuda.Stream) -> dict[str, torch.Tensor]:
        for name, tensor in inputs.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in self.outputs:
            dtype = _TRT_TO_TORCH[self.engine.get_tensor_dtype(name).name]
            out = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=dtype, device="cuda")
            self.context.set_tensor_address(name, out.data_ptr())
            outputs[name] = out
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return outputs


class TensorRTEngine:
    """The contract callables on TensorRT plans of an engine directory (``draft_prefill``: contract v2)."""

    def __init__(self, engine_dir: str | Path, meta: EngineMeta | None = None) -> None:
        trt = require_tensorrt()
        load_tree_attention_plugin()
        self.engine_dir = Path(engine_dir)
        meta = meta or read_engine_meta(self.engine_dir)
        self.meta = meta
        files = meta.files
        if not files.get("target_plan"):
            raise ConfigError(f"{engine_dir}: no TensorRT plans; build with --backend tensorrt")
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.target_plan = _Plan(trt, runtime, self.engine_dir / files["target_plan"])
        self.draft_plan = _Plan(trt, runtime, self.engine_dir / files["draft_step_plan"]) if files.get("draft_step_plan") else None
        prefill = files.get("draft_prefill_plan")
        self.prefill_plan = _Plan(trt, runtime, self.engine_dir / prefill) if prefill else None
        self.stream = torch.cuda.Stream()
        self.spec = engine_spec(meta, device="cuda")
        self.cost_model = meta.cost_model  # None unless calibrated
        num_kv = self.spec.num_kv_layers
        self._cache_names = cache_input_names(num_kv)
        self._present_names = present_output_names(num_kv)
        self._draft_cache_names = draft_cache_input_names(self.spec.num_draft_kv_layers)
        self._draft_present_names = draft_present_output_names(self.spec.num_draft_kv_layers)

    def target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        inputs = {
            "input_ids": input_ids.cuda(), "position_ids": position_ids.cuda(),
            "past_lengths": past_lengths.to(torch.int32).cuda(), "spec_decoding_packed_mask": packed_mask.cuda(),
        }
        for i, (k, v) in enumerate(zip(k_cache, v_cache)):  # already on the GPU: no copy
            inputs[self._cache_names[2 * i]], inputs[self._cache_names[2 * i + 1]] = k, v
        out = self.target_plan(inputs, self.stream)
        presents = [out[n] for n in self._present_names]
        return TargetResult(out["logits"].float().cpu(), out["h0"].cpu(), presents[0::2], presents[1::2])

    def draft_step(self, hidden, token, head: int) -> DraftResult:
        if self.draft_plan is None:
            raise RuntimeError("this engine was built without a drafter; use method 'vanilla'")
        out = self.draft_plan({"hidden": hidden.to(self.spec.dtype).cuda(), "token": token.cuda(),
                               "head": torch.tensor(head, dtype=torch.int64, device="cuda")}, self.stream)
        return DraftResult(out["next_hidden"].cpu(), out["topk_logprobs"].cpu(), out["topk_ids"].cpu())

    def draft_prefill(self, hidden, next_token, position_ids, past_lengths, packed_mask, k_cache,
                      v_cache) -> DraftPrefillResult:
        if self.prefill_plan is None:
            raise RuntimeError("this engine's drafter keeps no KV cache (engine contract v1): no draft_prefill")
        inputs = {
            "hidden": hidden.to(self.spec.dtype).cuda(), "next_token": next_token.cuda(),
            "position_ids": position_ids.cuda(), "past_lengths": past_lengths.to(torch.int32).cuda(),
            "spec_decoding_packed_mask": packed_mask.cuda(),
        }
        for i, (k, v) in enumerate(zip(k_cache, v_cache)):  # the draft cache lives on the GPU too: no copy
            inputs[self._draft_cache_names[2 * i]], inputs[self._draft_cache_names[2 * i + 1]] = k, v
        out = self.prefill_plan(inputs, self.stream)
        presents = [out[n] for n in self._draft_present_names]
        return DraftPrefillResult(out["state"].cpu(), presents[0::2], presents[1::2])
