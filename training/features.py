"""Where a training step's hidden states come from, and what it costs in memory.

``train.py --features cache`` (the default) reads the target's hidden states from a
hidden-state cache (:mod:`training.hidden_cache`). ``--features online`` runs the frozen
target inside the training step instead, on the padded batch of token ids, in
``torch.inference_mode`` (no autograd graph, activations freed layer by layer) and in the
checkpoint's own bf16/fp16 on a GPU, fp32 on a CPU. Both give the same two arrays
(:func:`training.hidden_cache.target_hidden_states`: the input of the target's last layer and
its output), so the loss and the data order are the same
(training/README.md#several-processes-features-on-the-fly-issue-17).

Every rank holds the whole target (plain replication, not FSDP): the reasons are in
docs/train-your-own.md#memory.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch

from clover.config import ConfigError
from training.hidden_cache import target_hidden_states

FEATURE_SOURCES = ("cache", "online")
TARGET_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def online_target_dtype(name: str, device: torch.device, stored: str | torch.dtype | None = None) -> torch.dtype:
    """The dtype the target runs in for ``--features online``.

    ``auto``: fp32 on a CPU; on a GPU the checkpoint's own dtype (``stored``: its ``torch_dtype``, or
    a loaded target's dtype) when it is bf16 or fp16, so that loading it changes no weight and the
    heads record the target fingerprint an engine build computes; else bf16.
    """
    if name != "auto":
        if name not in TARGET_DTYPES:
            raise ConfigError(f"target dtype {name!r}: use auto, {', '.join(TARGET_DTYPES)}")
        return TARGET_DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    halves = {"bfloat16": torch.bfloat16, "float16": torch.float16, torch.bfloat16: torch.bfloat16,
              torch.float16: torch.float16}
    return halves.get(stored, torch.bfloat16)


def stored_dtype(checkpoint: str | Path) -> str | None:
    """The ``torch_dtype`` (``dtype`` in newer files) a Hugging Face ``config.json`` declares, if any."""
    path = Path(checkpoint) / "config.json"
    if not path.exists():
        return None
    hf = json.loads(path.read_text())
    return hf.get("torch_dtype") or hf.get("dtype")


def online_hidden_states(target, tokens: torch.Tensor, need_input: bool, need_last: bool,
                         capture_layers=()) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(last_layer_input, last_hidden) fp32 ``[B, T, H]`` of the frozen target for ``tokens`` int64 ``[B, T]``;
    with ``capture_layers`` the first is the inputs of those layers, ``[B, T, k*H]`` (multi-layer features).

    Right padding (token 0 after a conversation's end) changes nothing at the real positions: the
    pass is causal. The results are fresh tensors made outside inference mode, so the drafter's
    autograd may save them.
    """
    limit = target.config.max_position_embeddings
    if tokens.shape[1] > limit:
        raise ConfigError(f"a batch holds a conversation of {tokens.shape[1]} tokens; this target attends "
                          f"exactly up to {limit} (max_position_embeddings or sliding window): lower --max-len "
                          "when distilling")
    with torch.inference_mode(), torch.autocast(tokens.device.type, enabled=False):
        last_input, last_hidden = target_hidden_states(target, tokens, capture_layers)
    fresh = (lambda x, needed: x.to(torch.float32, copy=True) if needed else None)
    return fresh(last_input, need_input), fresh(last_hidden, need_last)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since the last call: allocated GPU memory on CUDA (then reset), else the
    process's peak resident set size (``ru_maxrss``; it never goes down)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return round(peak / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: kilobytes


def enable_gradient_checkpointing(drafter) -> int:
    """Recompute the drafter's decoder layers (the Augmenting Block; Clover-2's block) in the backward pass
    instead of keeping their activations; returns how many layers. Weights and state dict are untouched."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    from clover.target import DecoderLayer

    layers = [m for m in drafter.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.forward = partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)
    return len(layers)
