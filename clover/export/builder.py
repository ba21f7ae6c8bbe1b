"""Build a self-contained engine directory (docs/engine-contract.md#engine-directory).

Layout::

    ENGINE_DIR/
      engine.json                  contract version, tensor table, configs, tree defaults, dtype, limits
      target.onnx(.data)           target + Augmenting Block
      draft_step.onnx(.data)       one regressive draft step (absent for a vanilla-only engine)
      draft_prefill.onnx(.data)    Clover-2 only (contract v2): its Augmenting Block with its own KV cache
      target.plan, draft_step.plan TensorRT plans (--backend tensorrt only; draft_prefill.plan for Clover-2)
      tokenizer files

This module only writes engines; :mod:`clover.engine_dir` reads them. The build writes into a temporary
sibling directory and renames it at the end (:func:`atomic_directory`), so a failed or interrupted build
leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from clover.config import ConfigError, DrafterConfig, TreeConfig
from clover.engine_dir import BACKENDS, TORCH_DTYPES, EngineLimits, EngineMeta, read_engine_meta


def _default_progress(message: str) -> None:
    print(f"[clover] {message}", flush=True)


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How to compile an engine; see :func:`build_engine` for each field."""

    backend: str = "onnxruntime"
    dtype: str = "fp32"
    attention: str | None = None
    max_batch: int = 32
    max_tree: int = 32
    max_seq: int = 2048
    draft_top_k: int = 8
    num_heads: int = 3
    draft_int8: bool = False
    draft_vocab: int | None = None
    target_weights: str = "fp32"
    target_compute: str | None = None
    proposer: str | None = None  # engine.json tree_defaults.proposer (None: suffix for dynamic trees)

    def validated(self) -> "BuildOptions":
        """These options with the attention default filled in; ConfigError for an impossible combination."""
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; choose {' or '.join(BACKENDS)}")
        if self.dtype not in TORCH_DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose {', '.join(TORCH_DTYPES)}")
        if self.draft_int8 and (self.backend != "onnxruntime" or self.dtype != "fp32"):
            raise ConfigError("draft_int8 (int8 draft-step weights) is for onnxruntime fp32 engines")
        TreeConfig(proposer=self.proposer)  # ConfigError for an unknown proposer, before anything is built
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise ConfigError(f"draft_vocab must be >= 0 (0: the full vocabulary), not {self.draft_vocab}")
        attention = self.attention or default_attention(self.backend, self.dtype)
        return dataclasses.replace(self, attention=attention, target_compute=self._checked_target_compute())

    def _checked_target_compute(self) -> str | None:
        """The target's MatMul compute for quantized weights (None for fp32 weights); ConfigError naming what is
        supported for an impossible combination (docs/quantized-target.md)."""
        from clover.export.target_weights import TARGET_COMPUTE, TARGET_WEIGHTS

        if self.target_weights not in TARGET_WEIGHTS:
            raise ConfigError(f"unknown target weights {self.target_weights!r}; choose {', '.join(TARGET_WEIGHTS)}")
        if self.target_weights == "fp32":
            if self.target_compute not in (None, "fp32"):
                raise ConfigError("--target-compute is for quantized target weights (--target-weights q4 or int8)")
            return None
        if self.backend != "onnxruntime" or self.dtype != "fp32":
            raise ConfigError(f"--target-weights {self.target_weights} is for onnxruntime fp32 engines (onnxruntime's "
                              f"MatMulNBits); --backend {self.backend} --dtype {self.dtype} supports --target-weights "
                              "fp32 only")
        compute = self.target_compute or default_target_compute(self.target_weights)
        if compute not in TARGET_COMPUTE:
            raise ConfigError(f"unknown target compute {compute!r}; choose {', '.join(TARGET_COMPUTE)}")
        if compute == "int8-exact" and self.target_weights != "q4":
            raise ConfigError("--target-compute int8-exact runs Q4_1 / Q8_0 blocks: use it with --target-weights q4")
        if self.target_weights == "int8" and compute != "int8":
            raise ConfigError("--target-weights int8 runs with --target-compute int8 (onnxruntime's 8-bit MatMulNBits "
                              "has no fp32-activation kernel); --target-weights q4 supports both")
        return compute


def default_attention(backend: str, dtype: str = "fp32") -> str:
    """``plugin`` (``clover.TreeAttention``) for TensorRT; for onnxruntime fp32 ``gqa``: its fused
    GroupQueryAttention with the KV cache written in place (docs/engine-contract.md#in-place-kv). fp16 onnxruntime
    engines (not a CPU speed path) keep ``standard`` with unfused norms, the numerics their tests hold them to
    (tests/test_export.py::test_fp16_engine_decodes_the_fp32_reference_up_to_fp16_near_ties)."""
    if backend == "tensorrt":
        return "plugin"
    return "gqa" if dtype == "fp32" else "standard"


def _attention_for(options: BuildOptions, cfg, chosen: str | None, progress: Callable[[str], None]) -> BuildOptions:
    """``options`` with an attention variant the target's shape allows: onnxruntime's GroupQueryAttention
    takes head sizes that are multiples of 16 only, so other targets get ``standard`` unless gqa was asked for."""
    if options.attention != "gqa" or cfg.head_dim % 16 == 0:
        return options
    if chosen == "gqa":
        raise ConfigError(f"--attention gqa needs a head size that is a multiple of 16 (onnxruntime's "
                          f"GroupQueryAttention); this target's is {cfg.head_dim}: use --attention standard")
    progress(f"head size {cfg.head_dim} is not a multiple of 16: standard attention instead of gqa")
    return dataclasses.replace(options, attention="standard")


def _native_compute_for(options: BuildOptions, models: _LoadedModels, chosen: str | None,
                        progress: Callable[[str], None]) -> BuildOptions:
    """``options`` with a target compute this model allows: the exact int8 kernel holds Llama layers without
    biases and head sizes that are multiples of 16; other models get fp32 compute unless int8-exact was asked
    for."""
    from clover.export.native_target import native_target_supported

    if options.target_compute != "int8-exact":
        return options
    reason = native_target_supported(models.model.config, {}, models.heads)
    if reason is None:
        return options
    if chosen == "int8-exact":
        raise ConfigError(f"--target-compute int8-exact: {reason}; use --target-compute fp32")
    progress(f"{reason}: fp32 compute instead of int8-exact")
    return dataclasses.replace(options, target_compute="fp32")


# The demo engine's target: the GGUF's own 4-bit blocks with int8 activations in Clover's own CPU kernel, which
# computes a token's row the same whatever else the pass holds, so speculative decoding reproduces its vanilla
# decoding bit for bit. Not onnxruntime's int8-compute MatMulNBits: it gives a token other logits (by up to 1.2)
# depending on the other rows of the pass (docs/quantized-target.md#the-default).
DEMO_TARGET_WEIGHTS, DEMO_TARGET_COMPUTE = "q4", "int8-exact"


def default_target_compute(target_weights: str) -> str:
    """``int8-exact`` for q4 weights (Clover's own kernel: int8 activations, and the same numbers whatever else the
    pass holds), ``int8`` for int8 weights (their only kernel) and int4 blocks (already approximate);
    onnxruntime's int8 activations make a token's logits depend on the other rows of the pass
    (docs/quantized-target.md#the-default)."""
    return "int8-exact" if target_weights == "q4" else "int8"


def default_target_weights(target: str | None, backend: str = "onnxruntime", dtype: str = "fp32") -> str:
    """``q4`` for an onnxruntime fp32 engine of the demo target (the GGUF's own blocks:
    docs/quantized-target.md#the-default), else ``fp32``."""
    demo = target in (None, "demo") and backend == "onnxruntime" and dtype == "fp32"
    return DEMO_TARGET_WEIGHTS if demo else "fp32"


def default_draft_int8(backend: str, dtype: str) -> bool:
    """Whether an engine gets int8 draft weights unless told otherwise: onnxruntime fp32 engines do (only the
    proposals change, so output stays lossless; drafting costs about half on CPU, docs/results/README.md)."""
    return backend == "onnxruntime" and dtype == "fp32"


@contextlib.contextmanager
def atomic_directory(output: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields a temporary sibling of ``output`` that replaces ``output`` only if the block completes.

    On any error (or Ctrl-C) the temporary directory is removed and ``output`` is left as it was.
    """
    output = Path(output)
    if output.exists() and not overwrite:
        raise ConfigError(f"{output} already exists; pass --overwrite to replace it")
    parent = output.parent if str(output.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"cannot write to {output}: {exc.strerror or exc}") from exc
    try:
        yield tmp
        if output.exists():
            shutil.rmtree(output)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclasses.dataclass
class _LoadedModels:
    target_dir: Path
    model: object  # clover.target.LlamaTarget
    tokenizer: object
    heads: object | None  # clover.drafters.Drafter; None for a vanilla-only engine
    drafter_source: str | None
    gguf: Path | None = None  # the demo target's GGUF: its own blocks for --target-weights q4


def _load_models(target: str | None, drafter: str | None, options: BuildOptions, cache_dir: str | None,
                 progress: Callable[[str], None]) -> _LoadedModels:
    """Target, tokenizer and heads, in the engine's dtype. ``drafter`` as in :func:`build_engine`."""
    from clover.demo import resolve_drafter, resolve_target
    from clover.drafters import Drafter, draft_vocab_of, load_drafter
    from clover.target import load_target, load_tokenizer

    progress("loading the target")
    target_dir = resolve_target(target, cache_dir)
    model, tokenizer = load_target(target_dir), load_tokenizer(target_dir)
    drafter = resolve_drafter(drafter, target)
    heads = None
    if drafter == "none":
        progress("no drafter: vanilla-only engine")
    elif drafter is None:
        progress("no --drafter: untrained Clover heads initialised from the target (lossless, little speed-up)")
        heads = Drafter.untrained(model, "clover", options.num_heads)
    else:
        progress(f"heads: {drafter}")
        heads = load_drafter(drafter, model, draft_vocab_size=options.draft_vocab)
    if options.draft_vocab and (heads is None or draft_vocab_of(heads) is None):
        raise ConfigError("--draft-vocab needs trained heads with a draft vocabulary (training/draft_vocab.py)")
    if heads is not None and heads.config.draft_vocab_size:
        if heads.config.draft_vocab_size < options.draft_top_k:
            raise ConfigError(f"a draft vocabulary of {heads.config.draft_vocab_size} tokens cannot give the "
                              f"draft top {options.draft_top_k}")
        progress(f"draft vocabulary: the {heads.config.draft_vocab_size} most frequent tokens")
    source = str(drafter) if drafter not in (None, "none") else drafter
    gguf = None
    if target in (None, "demo") and options.target_weights == "q4":  # int4 re-quantises the checkpoint's weights
        from clover.demo import find_demo_gguf

        gguf = find_demo_gguf()
    return _LoadedModels(target_dir, model, tokenizer, heads, source, gguf)


def _target_weights(models: _LoadedModels, options: BuildOptions, progress: Callable[[str], None]):
    """(stored target weights or None, ``engine.json``'s ``target_quantization`` or None)."""
    from clover.export.target_weights import describe, target_weights_for

    if options.target_weights == "fp32":
        return None, None
    if models.gguf is not None:
        progress(f"reading the target's own Q4_1 / Q8_0 blocks from {models.gguf.name}")
        source = f"{models.gguf.name}: its own blocks"
    else:
        progress(f"quantizing the target's linear weights ({options.target_weights})")
        source = {"q4": "quantized per block (gguf Q4_1, LM head Q8_0)",
                  "int4": "quantized per block of 32 (4-bit, symmetric, MatMulNBits' own layout)",
                  "int8": "quantized per output channel (int8, symmetric)"}[options.target_weights]
    if options.target_compute == "int8" and models.heads is not None:  # onnxruntime's MatMulNBits
        progress("note: int8 activations make a token's logits depend on the shape of the pass, so speculative "
                 "decoding on this engine can part from its vanilla decoding at near-ties "
                 "(docs/quantized-target.md); --target-compute fp32 keeps it token-exact")
    weights = target_weights_for(models.model, options.target_weights, models.gguf)
    return weights, describe(weights, options.target_weights, options.target_compute, source)


def _export_graphs(out: Path, models: _LoadedModels, options: BuildOptions, progress: Callable[[str], None],
                   on_layer: Callable[[int, int], None] | None) -> tuple[dict, dict | None, dict | None]:
    """Write target.onnx (and draft_step.onnx, and draft_prefill.onnx for a drafter with its own KV cache);
    returns the tensor table, the draft quantization and the target quantization."""
    from clover.export.onnx_graph import export_draft_prefill, export_draft_step, export_target

    model, heads = models.model, models.heads
    torch_dtype = TORCH_DTYPES[options.dtype]
    model.to(torch_dtype)
    if heads is not None:
        heads.to(torch_dtype)
    weights, target_quantization = _target_weights(models, options, progress)
    precision = options.dtype if weights is None else f"{options.target_weights} weights, {options.target_compute} compute"
    progress(f"writing target.onnx ({options.attention} attention, {precision})")
    graph_compute = "fp32" if options.target_compute in (None, "int8-exact") else options.target_compute
    target_options = dict(max_positions=_max_seq(options, model), target_weights=weights, compute=graph_compute)
    tensors = {"target": export_target(model, heads, out / "target.onnx", options.dtype, options.attention,
                                       on_layer, **target_options),
               "draft_step": None}
    if options.attention == "gqa":  # for what GroupQueryAttention cannot run: several trees after a past
        progress("writing target_batched.onnx (standard attention, for trees of several sequences)")
        tensors["target_batched"] = export_target(model, heads, out / "target_batched.onnx", options.dtype,
                                                  "standard", **target_options)
    if options.target_compute == "int8-exact":
        from clover.export.native_target import FILE, write_native_target

        progress(f"writing {FILE} (the exact int8 CPU target's blocks; target.onnx runs where it cannot)")
        write_native_target(out, model, heads, weights, _max_seq(options, model))
    quantization = None
    if heads is not None:
        progress("writing draft_step.onnx")
        tensors["draft_step"] = export_draft_step(model, heads, out / "draft_step.onnx", options.draft_top_k,
                                                  options.dtype)
        if options.draft_int8:
            from clover.export.quantize import quantize_draft_step

            progress("quantizing the draft step's weights to int8")
            quantization = quantize_draft_step(out / "draft_step.onnx")
    if _has_draft_prefill(models):
        # kept in its dtype even with draft_int8 (why: docs/engine-contract.md#draft_prefill-in-the-engine-directory)
        progress("writing draft_prefill.onnx")
        tensors["draft_prefill"] = export_draft_prefill(model, heads, out / "draft_prefill.onnx", options.dtype,
                                                        options.attention, max_positions=_max_seq(options, model))
    return tensors, quantization, target_quantization


def _has_draft_prefill(models: _LoadedModels) -> bool:
    """The drafter keeps its own KV cache (Clover-2, engine contract v2): the engine gets ``draft_prefill``."""
    return models.heads is not None and models.heads.config.has_draft_prefill


def _num_draft_kv_layers(models: _LoadedModels) -> int:
    return models.heads.num_kv_layers if _has_draft_prefill(models) else 0


def _max_seq(options: BuildOptions, model) -> int:
    return min(options.max_seq, model.config.max_position_embeddings)


def _num_kv_layers(models: _LoadedModels) -> int:
    """The target's layers, plus one for an Augmenting Block (it keeps its own KV cache)."""
    heads = models.heads
    return models.model.config.num_layers + int(heads is not None and heads.augment is not None)


def _build_plans(out: Path, models: _LoadedModels, options: BuildOptions) -> dict[str, str]:
    """TensorRT plans beside the ONNX graphs; returns their file roles."""
    from clover.export.tensorrt_build import build_plans

    cfg = models.model.config
    return build_plans(out, dtype=options.dtype, max_batch=options.max_batch, max_tree=options.max_tree,
                       max_seq=options.max_seq, has_draft=models.heads is not None, hidden_size=cfg.hidden_size,
                       num_kv_layers=_num_kv_layers(models), num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       num_draft_kv_layers=_num_draft_kv_layers(models))


def _engine_meta(models: _LoadedModels, options: BuildOptions, files: dict, tensors: dict,
                 quantization: dict | None, target_quantization: dict | None = None) -> EngineMeta:
    import torch

    from clover.target import target_fingerprint

    model, heads = models.model, models.heads
    return EngineMeta(
        backend=options.backend, dtype=options.dtype, attention=options.attention, files=files, tensors=tensors,
        num_kv_layers=_num_kv_layers(models), num_draft_kv_layers=_num_draft_kv_layers(models),
        limits=EngineLimits(options.max_batch, options.max_tree, _max_seq(options, model)),
        target_config=model.config,
        target_fingerprint=target_fingerprint(model.to(torch.float32)),
        drafter_config=heads.config if heads is not None else None,
        draft_top_k=options.draft_top_k, draft_quantization=quantization, tree_defaults=TreeConfig(proposer=options.proposer),
        target_quantization=target_quantization,
        source={"target": str(models.target_dir), "drafter": models.drafter_source,
                "drafter_sha256": heads_digest(models.drafter_source)},
    )


def heads_digest(heads_dir: str | None) -> str | None:
    """sha256 of a heads directory's weights file (None without one): engines record it, so an engine built
    from heads that changed since (new shipped heads after an update) is known to be stale."""
    import hashlib

    from clover.drafters import WEIGHTS_FILE

    path = Path(heads_dir) / WEIGHTS_FILE if heads_dir not in (None, "none") else None
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.exists() else None


def build_engine(output: str | Path, target: str | None = "demo", drafter: str | None = None, *,
                 cache_dir: str | None = None, overwrite: bool = False, calibrate: bool = False,
                 calibrate_max_tokens: int | None = None, progress: Callable[[str], None] = _default_progress,
                 on_layer: Callable[[int, int], None] | None = None, **build_options) -> Path:
    """Compile target (+ Augmenting Block) and draft step (+ Clover-2's draft prefill) into ``output``.

    Args:
        target: Hugging Face checkpoint directory, or ``demo``.
        drafter: trained heads directory; ``demo-clover`` / ``demo-medusa`` the
            heads shipped for the demo target; ``None``: the shipped Clover heads
            on the demo target, else untrained Clover heads initialised from the
            target (``"untrained"`` forces those); ``"none"``: a vanilla-only engine.
        build_options: the fields of :class:`BuildOptions`:
            ``backend`` (``onnxruntime``, or ``tensorrt``, which also writes TensorRT plans);
            ``dtype`` (``fp32``/``fp16``); ``attention`` (``gqa``: onnxruntime's GroupQueryAttention writing
            the KV cache in place, plus ``target_batched.onnx`` with standard attention; ``standard`` ONNX ops;
            or ``plugin`` ``clover.TreeAttention`` nodes; default gqa for onnxruntime, plugin for tensorrt);
            ``max_batch``, ``max_tree``, ``max_seq`` (limits); ``draft_top_k``; ``num_heads`` (untrained
            heads only); ``draft_int8`` (int8 weights for the draft step's MatMuls,
            :mod:`clover.export.quantize`; onnxruntime fp32 only; the target is untouched, so decoding
            stays lossless); ``draft_vocab`` (the draft step scores only that many most frequent tokens of
            the heads' ``draft_vocab.safetensors``, 0 all of them; default: the heads' own
            ``draft_vocab_size``; docs/drafter.md#draft-vocabulary; lossless too); ``target_weights``
            (``fp32``, ``q4``: 4-bit MatMulNBits over Q4_1 blocks, the demo GGUF's own, ``int8``: per channel;
            onnxruntime fp32 engines; :mod:`clover.export.target_weights`, docs/quantized-target.md) and
            ``target_compute`` (``int8-exact``: int8 activations in Clover's pass-shape-invariant CPU kernel, q4
            only, ``fp32`` or ``int8`` activations in onnxruntime's MatMulNBits; default int8-exact for q4, int8
            for int8).
        calibrate: time the built engine's ``target`` and ``draft_step`` (and ``draft_prefill``) for several
            token counts (up to ``calibrate_max_tokens``, default ``max_batch * (1 + max_tree)`` capped at 256)
            and store the cost model in ``engine.json`` (adaptive trees use it; :mod:`clover.adaptive`).
        progress: receives a message at the start of each build step.
        on_layer: ``(done, total)`` after each exported target layer (a progress bar).
    """
    options = BuildOptions(**build_options).validated()
    if options.backend == "tensorrt":
        from clover.backends.tensorrt import require_tensorrt  # fail before minutes of export

        require_tensorrt()
    with atomic_directory(output, overwrite) as tmp:
        models = _load_models(target, drafter, options, cache_dir, progress)
        options = _attention_for(options, models.model.config, chosen=build_options.get("attention"), progress=progress)
        options = _native_compute_for(options, models, chosen=build_options.get("target_compute"), progress=progress)
        tensors, quantization, target_quantization = _export_graphs(tmp, models, options, progress, on_layer)
        models.tokenizer.save_pretrained(str(tmp))
        files = {"target": "target.onnx", "draft_step": "draft_step.onnx" if models.heads is not None else None}
        if "target_batched" in tensors:
            files["target_batched"] = "target_batched.onnx"
        if _has_draft_prefill(models):
            files["draft_prefill"] = "draft_prefill.onnx"
        if options.target_compute == "int8-exact":
            from clover.export.native_target import FILE

            files["target_native"] = FILE
        if options.backend == "tensorrt":
            progress("building TensorRT plans (minutes)")
            files.update(_build_plans(tmp, models, options))
        meta = _engine_meta(models, options, files, tensors, quantization, target_quantization)
        meta.write(tmp)
        if calibrate:
            progress("calibrating the cost model (step time against tokens in flight)")
            meta.cost_model = calibrate_engine_dir(tmp, calibrate_max_tokens)
            meta.write(tmp)
        progress("finalising")
    progress(f"engine written to {output}")
    return Path(output)


def calibrate_engine_dir(engine_dir: str | Path, max_tokens: int | None = None, repeats: int = 5):
    """Measure the :class:`~clover.adaptive.CostModel` of the engine in ``engine_dir`` on its own backend.

    ``max_tokens``: the most tokens in flight measured; default ``max_batch * (1 + max_tree)`` capped at 256.
    """
    from clover.adaptive import busy_machine_warning, calibrate
    from clover.backends import load_engine

    warn = busy_machine_warning()
    if warn:
        print(f"[clover] warning: {warn}", file=sys.stderr, flush=True)
    engine = load_engine(engine_dir)
    meta, limits = engine.meta, engine.meta.limits
    max_tokens = max_tokens or min(256, limits.max_batch * (1 + limits.max_tree))
    quantized = meta.target_quantization
    precision = f"{quantized['weights']} weights, {quantized['compute']} compute" if quantized else meta.dtype
    runs = f"{engine.describe_runtimes()}, " if hasattr(engine, "describe_runtimes") else ""
    source = f"{meta.backend} {precision}, {runs}on {platform.machine()} {platform.processor() or ''}".strip()
    return calibrate(engine, max_tokens=max_tokens, repeats=repeats, source=source)


def recalibrate_engine_dir(engine_dir: str | Path, max_tokens: int | None = None,
                           progress: Callable[[str], None] = _default_progress):
    """Measure and store a new cost model in an existing engine (step times belong to a machine:
    recalibrate after moving an engine, or once the machine is idle). Returns the cost model."""
    engine_dir = Path(engine_dir)
    meta = read_engine_meta(engine_dir)
    progress(f"calibrating the cost model of {engine_dir} (step time against tokens in flight)")
    meta.cost_model = calibrate_engine_dir(engine_dir, max_tokens)
    meta.write(engine_dir)  # atomic: an interrupted run leaves the old metadata intact
    progress(f"cost model stored in {engine_dir / 'engine.json'}")
    return meta.cost_model


def demo_engine_is_current(engine_dir: str | Path) -> bool:
    """True when ``engine_dir`` holds a demo engine built the default way: the shipped heads as they are now
    (same weights, same draft vocabulary), a cost model, the default target weights and compute."""
    from clover.demo import resolve_drafter

    try:
        meta = read_engine_meta(engine_dir)
    except (ConfigError, FileNotFoundError):
        return False
    heads = resolve_drafter(None, "demo")
    if meta.source.get("drafter") != heads or meta.cost_model is None or meta.attention != default_attention("onnxruntime"):
        return False
    quantized = meta.target_quantization or {}
    if (quantized.get("weights", "fp32"), quantized.get("compute")) != (DEMO_TARGET_WEIGHTS, DEMO_TARGET_COMPUTE):
        return False  # built before the quantized default, or with other --target-weights
    if meta.source.get("drafter_sha256") != heads_digest(heads):  # the shipped heads changed since the build
        return False
    native = meta.files.get("target_native")
    if native and not _native_layout_is_current(Path(engine_dir) / native):
        return False  # built for an older layout of the exact int8 kernel's weights
    shipped_vocab = DrafterConfig.load(Path(heads) / "config.json").draft_vocab_size if heads else 0
    return (meta.drafter_config.draft_vocab_size if meta.drafter_config else 0) == shipped_vocab


def _native_layout_is_current(path: Path) -> bool:
    from clover.export.native_target import native_config
    from clover.kernels.cpu_target import LAYOUT_VERSION

    try:
        return native_config(path)["layout_version"] == LAYOUT_VERSION
    except (OSError, ValueError, KeyError):
        return False


def heads_engine_dir(heads_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the demo target's engine for the heads in ``heads_dir`` is cached: ``engines/`` of the cache
    (:func:`clover.demo.cache_root`), named by a hash of the heads' files and the demo build options, so changed
    heads get an engine of their own."""
    import hashlib

    from clover.demo import cache_root
    from clover.kernels.cpu_target import LAYOUT_VERSION

    options = f"{DEMO_TARGET_WEIGHTS} {DEMO_TARGET_COMPUTE} {default_attention('onnxruntime')} layout {LAYOUT_VERSION}"
    digest = hashlib.sha256(options.encode())
    for path in sorted(p for p in Path(heads_dir).iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return cache_root(cache_dir) / "engines" / f"demo-heads-{digest.hexdigest()[:16]}"


def ensure_heads_engine(heads_dir: str | Path, cache_dir: str | Path | None = None,
                        progress: Callable[[str], None] = _default_progress) -> Path:
    """The demo target's engine for the heads in ``heads_dir`` (as the demo engine, with these heads), built once
    into :func:`heads_engine_dir` where it is missing."""
    engine_dir = heads_engine_dir(heads_dir, cache_dir)
    if not (engine_dir / "engine.json").exists():
        progress(f"no engine for the heads in {heads_dir} yet: building one into {engine_dir} (once for these heads: "
                 "about a minute on idle cores, several on busy ones; --backend torch decodes without it, slowly)")
        build_engine(engine_dir, "demo", str(heads_dir), cache_dir=cache_dir, overwrite=True, calibrate=True,
                     progress=progress, target_weights=DEMO_TARGET_WEIGHTS, target_compute=DEMO_TARGET_COMPUTE,
                     draft_int8=default_draft_int8("onnxruntime", "fp32"))
    return engine_dir


def ensure_demo_engine(engine_dir: str | Path | None = None,
                       progress: Callable[[str], None] = _default_progress) -> Path:
    """The demo engine directory (default :func:`clover.demo.default_engine_dir`), built first where it is
    missing, or, for the default directory, where it predates the shipped heads or the default build flags.

    The defaults are the ones that cannot lose: a calibrated cost model (decoding picks each step's
    budget, vanilla steps included) and int8 draft weights (docs/results/README.md).
    """
    from clover.demo import default_engine_dir, demo_engine_build_reason

    default = engine_dir is None
    engine_dir = Path(engine_dir) if engine_dir is not None else default_engine_dir()
    exists = (engine_dir / "engine.json").exists()
    if not exists or (default and not demo_engine_is_current(engine_dir)):
        progress(f"{demo_engine_build_reason(engine_dir, exists, default)}: building it (once: about a minute on idle "
                 "cores, several on busy ones)")
        build_engine(engine_dir, "demo", overwrite=True, calibrate=True, progress=progress,
                     target_weights=DEMO_TARGET_WEIGHTS, target_compute=DEMO_TARGET_COMPUTE,
                     draft_int8=default_draft_int8("onnxruntime", "fp32"))
    return engine_dir
