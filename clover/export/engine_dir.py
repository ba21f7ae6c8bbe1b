"""Build a self-contained engine directory (DESIGN §3).

Layout::

    ENGINE_DIR/
      engine.json                  contract version, tensor table, configs, tree defaults, dtype, limits
      target.onnx(.data)           target + Augmenting Block
      draft_step.onnx(.data)       one regressive draft step (absent for a vanilla-only engine)
      target.plan, draft_step.plan TensorRT plans (--backend tensorrt only)
      tokenizer files

The build writes into a temporary sibling directory and renames it at the end,
so a failed or interrupted build leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from clover.config import ConfigError, TreeConfig, read_json_file
from clover.engine import CONTRACT_VERSION

ENGINE_FILE = "engine.json"


def _default_progress(message: str) -> None:
    print(f"[build_engine] {message}", flush=True)


def build_engine(output: str | Path, target: str | None = "demo", drafter: str | None = None, *,
                 backend: str = "onnxruntime", dtype: str = "fp32", attention: str | None = None,
                 max_batch: int = 32, max_tree: int = 32, max_seq: int = 2048, draft_top_k: int = 8,
                 num_heads: int = 3, cache_dir: str | None = None, overwrite: bool = False,
                 calibrate: bool = False, calibrate_max_tokens: int | None = None, draft_int8: bool = False,
                 progress: Callable[[str], None] = _default_progress,
                 on_layer: Callable[[int, int], None] | None = None) -> Path:
    """Compile target (+ Augmenting Block) and draft step into ``output``.

    Args:
        target: Hugging Face checkpoint directory, or ``demo``.
        drafter: trained heads directory; ``demo-clover`` / ``demo-medusa`` the
            heads shipped for the demo target; ``None``: the shipped Clover heads
            on the demo target, else untrained Clover heads initialised from the
            target (``"untrained"`` forces those); ``"none"``: a vanilla-only engine.
        backend: ``onnxruntime`` or ``tensorrt`` (also writes TensorRT plans).
        attention: ``standard`` (ONNX ops) or ``plugin`` (``clover.TreeAttention``
            nodes); default standard for onnxruntime, plugin for tensorrt.
        calibrate: time the built engine's ``target`` and ``draft_step`` for several
            token counts (up to ``calibrate_max_tokens``, default ``max_batch * (1 + max_tree)``
            capped at 256) and store the cost model in ``engine.json`` under
            ``"cost_model"`` (adaptive trees use it; :mod:`clover.adaptive`).
        draft_int8: int8 weights for the draft step's MatMuls (:mod:`clover.export.quantize`;
            onnxruntime, fp32 only): faster drafting on CPU; the target is untouched, so decoding
            stays lossless.
        progress: receives a message at the start of each build step.
        on_layer: ``(done, total)`` after each exported target layer (a progress bar).
    """
    import torch

    from clover.demo import resolve_drafter, resolve_target
    from clover.drafters import Drafter, load_drafter
    from clover.export.onnx_graph import DTYPES, export_draft_step, export_target
    from clover.target import load_target, load_tokenizer, target_fingerprint

    if backend not in ("onnxruntime", "tensorrt"):
        raise ConfigError(f"unknown backend {backend!r}; choose onnxruntime or tensorrt")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPES)}")
    attention = attention or ("plugin" if backend == "tensorrt" else "standard")
    if draft_int8 and (backend != "onnxruntime" or dtype != "fp32"):
        raise ConfigError("draft_int8 (int8 draft-step weights) is for onnxruntime fp32 engines")
    if backend == "tensorrt":
        from clover.backends.tensorrt import require_tensorrt

        require_tensorrt()
    output = Path(output)
    if output.exists() and not overwrite:
        raise ConfigError(f"{output} already exists; pass --overwrite to replace it")
    parent = output.parent if str(output.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"cannot write the engine to {output}: {exc.strerror or exc}") from exc

    try:
        progress("loading the target")
        target_dir = resolve_target(target, cache_dir)
        model = load_target(target_dir)
        tokenizer = load_tokenizer(target_dir)
        cfg = model.config
        heads = None
        drafter = resolve_drafter(drafter, target)
        if drafter == "none":
            progress("no drafter: vanilla-only engine")
        elif drafter is None:
            progress("no --drafter: untrained Clover heads initialised from the target (lossless, little speed-up)")
            heads = Drafter.untrained(model, "clover", num_heads)
        else:
            progress(f"heads: {drafter}")
            heads = load_drafter(drafter, model)
        torch_dtype = DTYPES[dtype][2]
        model.to(torch_dtype)
        if heads is not None:
            heads.to(torch_dtype)

        progress(f"writing target.onnx ({attention} attention, {dtype})")
        target_tensors = export_target(model, heads, tmp / "target.onnx", dtype, attention, on_layer,
                                       max_positions=min(max_seq, cfg.max_position_embeddings))
        draft_tensors, draft_quantization = None, None
        if heads is not None:
            progress("writing draft_step.onnx")
            draft_tensors = export_draft_step(model, heads, tmp / "draft_step.onnx", draft_top_k, dtype)
            if draft_int8:
                from clover.export.quantize import quantize_draft_step

                progress("quantizing the draft step's weights to int8")
                draft_quantization = quantize_draft_step(tmp / "draft_step.onnx")
        tokenizer.save_pretrained(str(tmp))
        files = {"target": "target.onnx", "draft_step": "draft_step.onnx" if heads is not None else None}
        if backend == "tensorrt":
            from clover.export.tensorrt_build import build_plans

            progress("building TensorRT plans (minutes)")
            files.update(build_plans(tmp, dtype=dtype, max_batch=max_batch, max_tree=max_tree, max_seq=max_seq,
                                     has_draft=heads is not None, hidden_size=cfg.hidden_size,
                                     num_kv_layers=cfg.num_layers + (heads is not None and heads.augment is not None),
                                     num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
        meta = {
            "contract_version": CONTRACT_VERSION,
            "backend": backend,
            "dtype": dtype,
            "attention": attention,
            "files": files,
            "tensors": {"target": target_tensors, "draft_step": draft_tensors},
            "num_kv_layers": cfg.num_layers + int(heads is not None and heads.augment is not None),
            "draft_top_k": draft_top_k,
            "draft_quantization": draft_quantization,
            "limits": {"max_batch": max_batch, "max_tree": max_tree, "max_seq": min(max_seq, cfg.max_position_embeddings)},
            "tree_defaults": TreeConfig().to_dict(),
            "target_config": cfg.to_dict(),
            "target_fingerprint": target_fingerprint(model.to(torch.float32)),
            "drafter_config": heads.config.to_dict() if heads is not None else None,
            "source": {"target": str(target_dir), "drafter": str(drafter) if drafter not in (None, "none") else drafter},
        }
        (tmp / ENGINE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if calibrate:
            progress("calibrating the cost model (step time against tokens in flight)")
            meta["cost_model"] = calibrate_engine_dir(tmp, calibrate_max_tokens)
            (tmp / ENGINE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        progress("finalising")
        if output.exists():
            shutil.rmtree(output)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"engine written to {output}")
    return output


def calibrate_engine_dir(engine_dir: str | Path, max_tokens: int | None = None, repeats: int = 5) -> dict:
    """Measure the cost model of the engine in ``engine_dir`` (its own backend); returns it as a dict.

    ``max_tokens``: the most tokens in flight measured; default ``max_batch * (1 + max_tree)`` capped at 256.
    """
    import platform

    from clover.adaptive import calibrate

    meta = json.loads((Path(engine_dir) / ENGINE_FILE).read_text())
    limits = meta["limits"]
    max_tokens = max_tokens or min(256, limits["max_batch"] * (1 + limits["max_tree"]))
    if meta.get("backend") == "tensorrt":
        from clover.backends.tensorrt import TensorRTEngine

        engine = TensorRTEngine(engine_dir)
    else:
        from clover.backends.onnxruntime import OnnxRuntimeEngine

        engine = OnnxRuntimeEngine(engine_dir)
    source = f"{meta.get('backend')} {meta.get('dtype')} on {platform.machine()} {platform.processor() or ''}".strip()
    return calibrate(engine, max_tokens=max_tokens, repeats=repeats, source=source).to_dict()


def recalibrate_engine_dir(engine_dir: str | Path, max_tokens: int | None = None,
                           progress: Callable[[str], None] = _default_progress) -> dict:
    """Measure and store a new cost model in an existing engine (step times belong to a machine:
    recalibrate after moving an engine, or once the machine is idle). Returns the cost model dict."""
    engine_dir = Path(engine_dir)
    meta = read_engine_meta(engine_dir)
    progress(f"calibrating the cost model of {engine_dir} (step time against tokens in flight)")
    meta["cost_model"] = calibrate_engine_dir(engine_dir, max_tokens)
    tmp = engine_dir / (ENGINE_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, engine_dir / ENGINE_FILE)  # an interrupted run leaves the old metadata intact
    progress(f"cost model stored in {engine_dir / ENGINE_FILE}")
    return meta["cost_model"]


def engine_cost_model(meta: dict):
    """The :class:`~clover.adaptive.CostModel` stored in an engine's metadata, or None."""
    from clover.adaptive import CostModel

    data = meta.get("cost_model")
    return CostModel.from_dict(data) if data else None


def read_engine_meta(engine_dir: str | Path) -> dict:
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_FILE
    meta = read_json_file(path, f"{engine_dir}: not an engine directory (no {ENGINE_FILE}); "
                                "build one with export/build_engine.py")
    if meta.get("contract_version") != CONTRACT_VERSION:
        raise ConfigError(f"{path}: engine contract version {meta.get('contract_version')} is not "
                          f"{CONTRACT_VERSION}; rebuild the engine")
    for key in ("files", "target_config", "limits", "num_kv_layers"):
        if key not in meta:
            raise ConfigError(f"{path}: missing {key!r}; rebuild the engine")
    return meta


def engine_spec(meta: dict, device: str = "cpu"):
    """The :class:`~clover.engine.EngineSpec` an engine directory describes."""
    import torch

    from clover.config import TargetConfig
    from clover.engine import EngineSpec

    cfg = TargetConfig.from_dict(meta["target_config"])
    drafter = meta.get("drafter_config")
    return EngineSpec(
        num_kv_layers=meta["num_kv_layers"],
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        max_seq_len=meta["limits"]["max_seq"],
        draft_top_k=meta.get("draft_top_k", 8),
        num_draft_heads=drafter["num_heads"] if drafter else 0,
        drafter_method=drafter["method"] if drafter else None,
        dtype={"fp32": torch.float32, "fp16": torch.float16}[meta.get("dtype", "fp32")],
        device=device,
    )
