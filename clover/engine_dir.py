"""Read a built engine directory: its typed metadata (cost model included) and contract spec.

This is the one place that knows the layout of ``engine.json`` (docs/engine-contract.md#engine-directory).
It is low-level on purpose: the backends read their directory through it, :mod:`clover.export.builder`
writes what :class:`EngineMeta` describes, and neither imports the other.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from clover.adaptive import CostModel
from clover.config import ConfigError, DrafterConfig, TargetConfig, TreeConfig, read_json_file
from clover.engine_contract import CONTRACT_VERSION, EngineSpec

ENGINE_FILE = "engine.json"
SUPPORTED_CONTRACT_VERSIONS = tuple(range(1, CONTRACT_VERSION + 1))  # engine.json versions this code reads
BACKENDS = ("onnxruntime", "tensorrt")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """Largest shapes the engine was built for (TensorRT profiles; KV cache length)."""

    max_batch: int
    max_tree: int
    max_seq: int


@dataclasses.dataclass
class EngineMeta:
    """Everything ``engine.json`` records about an engine (docs/engine-contract.md#engine-directory).

    ``files`` maps roles (``target``, ``draft_step``, ``draft_prefill`` for a drafter with its own KV cache,
    and ``target_plan`` / ``draft_step_plan`` / ``draft_prefill_plan`` for TensorRT) to file names in the
    directory; ``draft_step`` is None for a vanilla-only engine. ``num_draft_kv_layers``: layers of that
    drafter's KV cache (0: none, and ``engine.json`` leaves the key out). ``contract_version`` defaults to
    the oldest contract that runs the engine (:func:`contract_version_for`), so engines without
    ``draft_prefill`` keep version 1.
    """

    backend: str
    dtype: str
    attention: str
    files: dict[str, str | None]
    tensors: dict[str, Any]
    num_kv_layers: int
    limits: EngineLimits
    target_config: TargetConfig
    target_fingerprint: str = ""
    drafter_config: DrafterConfig | None = None
    draft_top_k: int = 8
    draft_quantization: dict | None = None
    target_quantization: dict | None = None  # quantized target weights (docs/quantized-target.md); None: fp32/fp16
    tree_defaults: TreeConfig = dataclasses.field(default_factory=TreeConfig)
    source: dict[str, str | None] = dataclasses.field(default_factory=dict)
    cost_model: CostModel | None = None  # None unless calibrated (clover build, --recalibrate)
    contract_version: int | None = None
    num_draft_kv_layers: int = 0

    def __post_init__(self) -> None:
        if self.contract_version is None:
            self.contract_version = contract_version_for(self.num_draft_kv_layers, self.attention)

    @property
    def runtimes(self) -> dict[str, str]:
        """What runs each part of a step (written into ``engine.json`` for its readers; derived, never read):
        the target in Clover's exact int8 CPU kernel where the engine holds its weights (onnxruntime's
        ``target.onnx`` only where that kernel cannot run), everything else on the backend."""
        target = "clover-cpu-int8" if self.files.get("target_native") else self.backend
        return {"target": target, **{role: self.backend for role in ("draft_step", "draft_prefill") if self.files.get(role)}}

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["runtimes"] = self.runtimes
        if not self.num_draft_kv_layers:
            del data["num_draft_kv_layers"]  # engine.json of a contract-v1 engine stays as it was
        if self.target_quantization is None:
            del data["target_quantization"]  # so does an fp32 engine's
        for name in ("limits", "target_config", "drafter_config", "tree_defaults", "cost_model"):
            value = data[name]
            data[name] = dataclasses.asdict(value) if value is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = ENGINE_FILE) -> "EngineMeta":
        version = data.get("contract_version")
        needed = contract_version_for(data.get("num_draft_kv_layers", 0), data.get("attention", "standard"))
        if version not in SUPPORTED_CONTRACT_VERSIONS or version < needed:
            raise ConfigError(f"{where}: engine contract version {version} is not one this Clover runs "
                              f"({', '.join(map(str, SUPPORTED_CONTRACT_VERSIONS))}; version 2 for a drafter with "
                              "its own KV cache, 3 for gqa attention); rebuild the engine with "
                              "clover build")
        for key in ("backend", "files", "target_config", "limits", "num_kv_layers"):
            if key not in data:
                raise ConfigError(f"{where}: missing {key!r}; rebuild the engine")
        known = {f.name for f in dataclasses.fields(cls)}
        data = {key: value for key, value in data.items() if key in known}
        try:
            return cls(**{
                **data,
                "limits": EngineLimits(**data["limits"]),
                "target_config": TargetConfig.from_dict(data["target_config"]),
                "drafter_config": _optional(DrafterConfig, data.get("drafter_config")),
                "tree_defaults": _optional(TreeConfig, data.get("tree_defaults")) or TreeConfig(),
                "cost_model": _optional(CostModel, data.get("cost_model")),
            })
        except (TypeError, ConfigError) as exc:
            raise ConfigError(f"{where}: {exc}; rebuild the engine") from exc

    def write(self, engine_dir: str | Path) -> None:
        """Write ``engine.json`` atomically: an interrupted write leaves the old file intact."""
        path = Path(engine_dir) / ENGINE_FILE
        tmp = path.with_name(ENGINE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)


def contract_version_for(num_draft_kv_layers: int, attention: str = "standard") -> int:
    """The oldest engine contract that runs an engine: 3 for a target that writes its KV cache in place
    (``gqa`` attention), 2 (``draft_prefill``) for a drafter with its own KV cache, else 1
    (docs/engine-contract.md#engine-directory)."""
    if attention == "gqa":
        return 3
    return 2 if num_draft_kv_layers else 1


def _optional(config_type, data):
    return config_type.from_dict(data) if data else None


def read_engine_meta(engine_dir: str | Path) -> EngineMeta:
    """The metadata of ``engine_dir``; :class:`ConfigError` naming the problem if it is not a usable engine."""
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_FILE
    data = read_json_file(path, f"{engine_dir}: not an engine directory (no {ENGINE_FILE}); "
                                "build one with clover build")
    return EngineMeta.from_dict(data, where=str(path))


def engine_spec(meta: EngineMeta, device: str = "cpu") -> EngineSpec:
    """The :class:`~clover.engine_contract.EngineSpec` an engine directory describes."""
    cfg, drafter = meta.target_config, meta.drafter_config
    return EngineSpec(
        num_kv_layers=meta.num_kv_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        max_seq_len=meta.limits.max_seq,
        draft_top_k=meta.draft_top_k,
        num_draft_heads=drafter.num_heads if drafter else 0,
        drafter_method=drafter.method if drafter else None,
        num_draft_kv_layers=meta.num_draft_kv_layers,
        dtype=TORCH_DTYPES[meta.dtype],
        device=device,
    )
