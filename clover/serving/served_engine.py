"""Load the engine a served model runs, from its model-config parameters."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from clover.config import PROPOSERS, ConfigError, TreeConfig
from clover.methods import DEFAULT_METHOD, METHOD_CHOICES, method_traits, resolve_method
from clover.demo import default_engine_dir

TORCH_MAX_BATCH = 16  # the torch path has no built-in limit; this keeps a CPU server responsive


def resolve_engine_dir(value: str, repository_parent: str | Path | None = None) -> Path:
    """The ``engine_dir`` parameter as a path: empty means :func:`default_engine_dir`; relative paths
    are taken from ``repository_parent`` (the directory that holds the model repository)."""
    if not value:
        return default_engine_dir(repository_parent)
    if value == "demo":
        return Path(value)
    path = Path(os.path.expanduser(value))
    if not path.is_absolute() and repository_parent is not None:
        path = Path(repository_parent) / path
    return path


@dataclasses.dataclass
class LoadedEngine:
    engine: object
    tokenizer: object
    method: str
    tree: TreeConfig
    max_batch: int
    description: str
    tensor_parallel: int = 1  # ranks in lock step (clover.lockstep): the decoder must be a LockstepDecoder


METHODS = METHOD_CHOICES  # auto: the engine's own drafter family (EngineSpec.default_method)
BACKENDS = ("auto", "onnxruntime", "tensorrt", "torch")


def load_serving_engine(engine_dir: str | Path, backend: str = "auto", method: str = "auto",
                        max_batch: int = 0, tree_budget: int | None = None, threads: int = 0,
                        adaptive: bool | None = None, proposer: str = "auto", dtype: str = "auto",
                        tensor_parallel: int = 1, rendezvous: str = "") -> LoadedEngine:
    """Engine, tokenizer and decode settings for serving. Raises ConfigError naming the problem.

    ``engine_dir`` is a built engine directory, or with ``backend="torch"`` a checkpoint directory (or
    ``demo``). ``adaptive`` as :class:`~clover.config.TreeConfig` reads it: None picks each step's budget (up to
    ``tree_budget``) from the engine's cost model where it has one; True requires one, so an engine without
    one is refused here rather than at the first request; False keeps a fixed budget. ``proposer``: ``auto`` (the
    engine's tree defaults), ``suffix`` or ``none`` (docs/trees.md#model-free-candidates). ``dtype``: the
    torch backend's weights (:func:`clover.backends.load_checkpoint_engine`); a built engine has its own.
    ``tensor_parallel`` > 1: this process is rank 0 of that many, meeting the others at ``rendezvous``
    (``host:port``; docs/serving.md#tensor-parallel)."""
    if method not in METHODS:
        raise ConfigError(f"model parameter method={method!r}: choose {', '.join(METHODS)}")
    if backend not in BACKENDS:
        raise ConfigError(f"model parameter backend={backend!r}: choose {', '.join(BACKENDS)}")
    if proposer not in ("auto", *PROPOSERS):
        raise ConfigError(f"model parameter proposer={proposer!r}: choose auto, {', '.join(PROPOSERS)}")
    if dtype != "auto" and backend != "torch":
        raise ConfigError(f"model parameter dtype={dtype!r} is for backend torch; a built engine has its own precision")
    if tensor_parallel > 1 and backend != "torch":
        raise ConfigError("tensor_parallel > 1 needs backend torch (a Hugging Face checkpoint directory or 'demo')")
    if tensor_parallel > 1:
        loaded = _load_rank_zero(Path(engine_dir), method, dtype, tensor_parallel, rendezvous, threads)
    elif backend == "torch":
        loaded = _load_torch(Path(engine_dir), method, dtype)
    else:
        loaded = _load_built(Path(engine_dir), backend, threads or None)
    method = resolve_method(method, loaded.engine.spec.default_method)
    tree = loaded.tree
    if tree_budget is not None:
        tree = dataclasses.replace(tree, budget=tree_budget)
    if adaptive:
        _check_adaptive(loaded.engine, method, engine_dir)
    tree = dataclasses.replace(tree, adaptive=adaptive)
    if proposer != "auto":
        tree = dataclasses.replace(tree, proposer=proposer)
    if method_traits(method).needs_suffix and not tree.suffix_candidates:
        raise ConfigError("method=suffix drafts with the suffix proposer: set proposer to auto or suffix")
    max_batch = max_batch or loaded.max_batch
    if max_batch < 1:
        raise ConfigError(f"model parameter max_batch must be >= 1, got {max_batch}")
    return dataclasses.replace(loaded, method=method, tree=tree, max_batch=max_batch)


def _load_torch(checkpoint_dir: Path, method: str, dtype: str = "auto") -> LoadedEngine:
    from clover.backends import load_checkpoint_engine
    from clover.target import load_tokenizer

    chosen = resolve_method(method, DEFAULT_METHOD)
    # on a GPU the device engine (docs/gpu-engine.md), on a CPU the torch reference
    engine = load_checkpoint_engine(str(checkpoint_dir), None, chosen, max_seq_len=2048, dtype=dtype)
    tree = getattr(engine, "tree_defaults", TreeConfig())  # the device engine's on a GPU: bigger trees
    return LoadedEngine(engine, load_tokenizer(engine.checkpoint_dir), chosen, tree, TORCH_MAX_BATCH,
                        f"torch engine on {checkpoint_dir}")


def _load_rank_zero(checkpoint_dir: Path, method: str, dtype: str, ranks: int, rendezvous: str,
                    threads: int) -> LoadedEngine:
    """Rank 0 of a tensor-parallel torch engine on the CPU; the other ranks load the same (clover.lockstep)."""
    from clover.lockstep import EngineRecipe, join, load_engine
    from clover.rendezvous import Rendezvous

    host, _, port = rendezvous.rpartition(":")
    shard = join(Rendezvous(ranks, host, int(port)), 0)
    chosen = resolve_method(method, DEFAULT_METHOD)
    recipe = EngineRecipe(str(checkpoint_dir), None, chosen, 2048, None, "bf16" if dtype == "bf16" else "fp32",
                          threads or None)
    engine, tokenizer = load_engine(recipe, shard)
    return LoadedEngine(engine, tokenizer, chosen, TreeConfig(), TORCH_MAX_BATCH,
                        f"torch engine on {checkpoint_dir}, rank 0 of {ranks}", ranks)


def _load_built(engine_dir: Path, backend: str, threads: int | None) -> LoadedEngine:
    from clover.backends import load_engine
    from clover.target import load_tokenizer

    engine = load_engine(engine_dir, backend, threads=threads)
    meta = engine.meta
    return LoadedEngine(engine, load_tokenizer(engine_dir), engine.spec.default_method, meta.tree_defaults,
                        meta.limits.max_batch, f"{meta.backend} engine {engine_dir}")


def _check_adaptive(engine, method: str, engine_dir) -> None:
    if not method_traits(method).drafts:
        raise ConfigError("adaptive=true needs draft heads; this model decodes vanilla")
    if getattr(engine, "cost_model", None) is None:
        raise ConfigError(f"adaptive=true needs a cost model in {engine_dir}; store one with "
                          f"clover build --output {engine_dir} --recalibrate "
                          "(or build with --calibrate)")
