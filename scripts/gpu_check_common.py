"""What the steps of scripts/gpu_check.py share: the run's :class:`Context`, :class:`Skip`, and the helpers more than
one step module uses (the kernel once built, the target on the device, the shape of the run).

It sits below the step modules: gpu_check_steps.py (the step registry), gpu_check_engine.py and gpu_check_serve.py
import it, and it imports none of them.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TINY_SHAPE_NAME = "gpu-check-tiny"


class Skip(Exception):
    """The step cannot run here; the message says why."""


@dataclasses.dataclass
class Context:
    dry_run: bool
    out: Path
    build_dir: Path
    fault: str | None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry_run else "cuda")

    def prior(self, step: str) -> dict:
        """An earlier step's result in this run ({} if it did not run)."""
        path = self.out / "steps" / f"{step}.json"
        return json.loads(path.read_text()) if path.exists() else {}


def shape_name(ctx: Context) -> str:
    """The cost_probe shape of this run; the tiny one is registered there so cost_probe's CLI accepts it."""
    from training.experiments import cost_probe

    cost_probe.SHAPES.setdefault(TINY_SHAPE_NAME, cost_probe.SHAPES["tiny"])
    return TINY_SHAPE_NAME if ctx.dry_run else "llama3-8b"


class _OffByTolerance:
    """``--inject-fault kernel``: the kernel's output plus 0.1, beyond every dtype's tolerance."""

    def __init__(self, ext) -> None:
        self.ext = ext

    def tree_attention(self, *args):
        return self.ext.tree_attention(*args) + 0.1

    def num_splits(self, *args):
        return self.ext.num_splits(*args)


def load_kernel(ctx: Context):
    from clover.kernels.tree_attention import load_extension

    ext = load_extension(verbose=True, build_directory=str(ctx.build_dir))
    return _OffByTolerance(ext) if ctx.fault == "kernel" else ext


def built_kernel(ctx: Context):
    """(extension, None) when kernel_build passed in this run, else (None, why not)."""
    if ctx.dry_run or not torch.cuda.is_available():
        return None, "no CUDA (dry run)" if ctx.dry_run else "no CUDA device"
    if ctx.prior("kernel_build").get("status") != "pass":
        return None, "kernel_build did not pass in this run"
    return load_kernel(ctx), None


def require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise Skip("transformers is not installed: the reference is transformers generate() (pip install transformers)")


def on_device(target, ctx: Context):
    """A copy of the target on the device; ``--inject-fault lossless`` negates its LM head there."""
    copied = copy.deepcopy(target).to(ctx.device)
    if ctx.fault == "lossless":
        with torch.no_grad():
            copied.lm_head.weight.neg_()
    return copied
