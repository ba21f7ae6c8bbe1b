"""Teacher-forced accuracy of heads on a training-data source: the training forward
(:func:`training.forward.run_batch`) without the backward.

Shared by ``training/train.py`` (the held-out curve) and ``training/evaluate.py`` (the report), so neither imports
the other.
"""

from __future__ import annotations

import torch

from training.batches import collate
from training.forward import head_weights, run_batch
from training.hidden_cache import HiddenCache


def _batches(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    indices = sorted(indices, key=lambda i: (lengths[i], i))
    out, current = [], []
    for i in indices:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            out.append(current)
            current = []
        current.append(i)
    return out + ([current] if current else [])


def teacher_forced(drafter, target, cache: HiddenCache, *, batch_tokens: int = 4096, row_chunk: int = 1024,
                   device="cpu", topk=(1, 5), max_conversations: int | None = None, loss: dict | None = None) -> dict:
    """Per-head top-k accuracy, overall and per category (counts and hits included).

    ``overall["loss"]``: the training loss on these conversations, head weights 1 (``loss``: the run's other
    loss settings, :func:`training.forward.run_batch`'s keywords), batches weighted by their head-1 labels.
    """
    drafter = drafter.float().to(device).eval()
    weight = target.lm_head.weight.detach().float().to(device)
    num_heads = drafter.config.num_heads
    lengths = [c["length"] for c in cache.conversations]
    by_cat: dict[str, list[int]] = {}
    count = len(cache.conversations)
    stride = max(1, count // max_conversations) if max_conversations else 1  # spread over the length-sorted cache
    for i in list(range(0, count, stride))[:max_conversations]:
        by_cat.setdefault(cache.conversations[i].get("category", ""), []).append(i)

    def empty():
        return {"count": [0] * num_heads, "hits": {k: [0] * num_heads for k in topk},
                "agree": {k: [0] * num_heads for k in topk}, "loss": 0.0}

    totals, per_cat = empty(), {}
    for cat, indices in sorted(by_cat.items()):
        acc = per_cat.setdefault(cat, empty())
        for batch_indices in _batches(indices, lengths, batch_tokens):
            batch = collate(cache, batch_indices, drafter.augment is not None, True, device)
            with torch.no_grad():
                stats = run_batch(drafter, target, weight, batch, row_chunk=row_chunk,
                                  weights=head_weights(num_heads, 1.0), train=False, topk=topk, **(loss or {}))
            for target_acc in (acc, totals):
                _add_counts(target_acc, stats, topk)
    return {"overall": _finish(totals, topk), "by_category": {c: _finish(a, topk) for c, a in per_cat.items()}}


def _add_counts(acc: dict, stats: dict, topk) -> None:
    acc["loss"] += stats["loss"] * stats["count"][0]
    for i in range(len(acc["count"])):
        acc["count"][i] += stats["count"][i]
        for k in topk:
            acc["hits"][k][i] += stats["hits"][k][i]
            acc["agree"][k][i] += stats["agree"][k][i]


def _finish(acc: dict, topk) -> dict:
    """top-k: the head ranks the text's token in its top k; agree-k: the target's own top-1 (what
    greedy verification accepts; on the target's greedy answers the two are the same)."""
    out = {"count": acc["count"], "loss": acc["loss"] / acc["count"][0] if acc["count"][0] else 0.0}
    for k in topk:
        out[f"top{k}"] = [h / c if c else 0.0 for h, c in zip(acc["hits"][k], acc["count"])]
        out[f"agree{k}"] = [h / c if c else 0.0 for h, c in zip(acc["agree"][k], acc["count"])]
    return out
