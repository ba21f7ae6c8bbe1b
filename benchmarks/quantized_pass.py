#!/usr/bin/env python
"""Target-pass time of engines at 1 and 8 new tokens, interleaved (docs/results/quantized-target).

    python -m benchmarks.quantized_pass qt-fp32 demo qt-q4-int8 qt-int8-int8   # engines/<name>

Batch 1, 100 cached positions, ``--threads`` onnxruntime threads (2). Each round times 10 passes of every
engine in turn (after one untimed pass), so load drifts hit all engines alike; prints the median (min–max) of
``--rounds`` rounds in ms, and the 8-token ÷ 1-token ratio, which is what a tree of 7 nodes costs against a
vanilla step on that engine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from clover.attention import causal_packed_mask
from clover.backends.onnxruntime import OnnxRuntimeEngine

PAST = 100


def pass_inputs(spec, tokens: int) -> tuple:
    """One sequence with ``PAST`` cached positions (random keys/values) and ``tokens`` new causal tokens."""
    ids = torch.randint(0, 1000, (1, tokens))
    positions = torch.arange(PAST, PAST + tokens)[None]
    caches = [torch.randn(1, spec.num_kv_heads, 512, spec.head_dim) for _ in range(spec.num_kv_layers)]
    return (ids, positions, torch.tensor([PAST], dtype=torch.int32), causal_packed_mask(1, tokens),
            caches, [c.clone() for c in caches])


def time_passes(engines: dict, tokens: int, rounds: int) -> dict[str, list[float]]:
    """Milliseconds per pass, one value per round and engine."""
    inputs = {name: pass_inputs(engine.spec, tokens) for name, engine in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            engine.target(*inputs[name])  # untimed: the previous engine's cache traffic is not this one's cost
            started = time.perf_counter()
            for _ in range(10):
                engine.target(*inputs[name])
            times[name].append((time.perf_counter() - started) / 10 * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", nargs="+", help="engine names under engines/")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    engines = {name: OnnxRuntimeEngine(f"engines/{name}", threads=args.threads) for name in args.engines}
    medians = {}
    print("| engine | 1 token (ms) | 8 tokens (ms) | 8 ÷ 1 |\n|---|---|---|---|")
    rows = {tokens: time_passes(engines, tokens, args.rounds) for tokens in (1, 8)}
    for name in engines:
        cells = []
        for tokens in (1, 8):
            values = rows[tokens][name]
            medians[tokens] = statistics.median(values)
            cells.append(f"{medians[tokens]:.2f} ({min(values):.2f}–{max(values):.2f})")
        print(f"| {name} | {cells[0]} | {cells[1]} | {medians[8] / medians[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
