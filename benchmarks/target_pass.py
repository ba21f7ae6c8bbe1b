#!/usr/bin/env python
"""The onnxruntime target pass against the memory bound (issue 14, part 4; docs/results/target-pass).

Three measurements on engines built by ``clover build``:

``profile``
    onnxruntime's own profiler (``SessionOptions.enable_profiling``) over repeated target passes (T new
    tokens after ``--past`` cached ones, batch 1 and 8 by default): kernel time per op type per pass, and
    the node count of the optimized graph (distinct nodes that ran).
``passes``
    isolated target-pass wall times of several engines, alternating engine by engine inside every round so
    all see the same machine load; medians and min-max over rounds. Also a read-bandwidth measurement and
    the batch-1 pass as a ratio to weight bytes / bandwidth. ``--engine LABEL=torch:bfloat16`` adds the demo
    target's torch reference in that dtype (an fp16 onnxruntime engine takes its own fp16 feeds).
``threads``
    vanilla decode steps in the real decode loop (:class:`clover.decode.SpeculativeDecoder`) with different
    ``intra_op_num_threads``, alternating settings inside every round.

Usage::

    python -m benchmarks.target_pass profile --engine engines/demo --batches 1 8
    python -m benchmarks.target_pass passes --engine old=/tmp/eng-old --engine new=/tmp/eng-new --rounds 7
    python -m benchmarks.target_pass passes --engine ort=engines/demo --engine bf16=torch:bfloat16
    python -m benchmarks.target_pass threads --engine engines/demo --threads 1 2 --batches 1 8 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_speed import PROMPT, read_bandwidth_gbs


def pass_inputs(spec, batch: int, tokens: int, past: int):
    """Feeds of one chain pass: ``tokens`` new tokens after ``past`` cached ones in every row (a full-size cache,
    as the decode loop allocates)."""
    from clover.attention import causal_packed_mask
    from clover.kv_cache import KVCache

    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, spec.dtype, capacity=batch)
    cache.add_rows(batch)
    k, v = cache.views()
    ids = torch.randint(0, spec.vocab_size, (batch, tokens))
    positions = torch.arange(past, past + tokens).expand(batch, -1).contiguous()
    lengths = torch.full((batch,), past, dtype=torch.int32)
    return ids, positions, lengths, causal_packed_mask(batch, tokens), k, v


@torch.inference_mode()
def time_passes(engine, inputs, repeats: int) -> list[float]:
    engine.target(*inputs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.target(*inputs)
        times.append(time.perf_counter() - start)
    return times


def summary(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    median, low, high = (scale * f(values) for f in (statistics.median, min, max))
    return f"{median:.{digits}f} ({low:.{digits}f}–{high:.{digits}f})"


def profile(args) -> dict:
    """Kernel time per op type per pass from onnxruntime's profiler."""
    import onnxruntime as ort

    from clover.backends.onnxruntime import OnnxRuntimeEngine

    engine = OnnxRuntimeEngine(args.engine)
    report = {}
    for batch in args.batches:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the backend runs it
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "target")
        engine.target_session = ort.InferenceSession(str(Path(args.engine) / engine.meta.files["target"]), options,
                                                     providers=["CPUExecutionProvider"])
        inputs = pass_inputs(engine.spec, batch, args.tokens, args.past)
        wall = time_passes(engine, inputs, args.repeats)
        events = json.loads(Path(engine.target_session.end_profiling()).read_text())
        kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        runs = args.repeats + 1  # the warm-up pass is profiled too
        per_op = collections.defaultdict(float)
        nodes = collections.Counter()
        for event in kernels:
            per_op[event["args"]["op_name"]] += event["dur"] / 1000 / runs
            nodes[event["args"]["op_name"]] += 1
        run_ms = statistics.median(e["dur"] / 1000 for e in events if e.get("name") == "model_run")
        total = sum(per_op.values())
        rows = sorted(per_op.items(), key=lambda kv: -kv[1])
        report[batch] = {"wall_ms": [1000 * t for t in wall], "model_run_ms": run_ms, "kernel_ms": total,
                         "nodes": sum(nodes.values()) // runs,
                         "ops": {op: {"ms": ms, "nodes": nodes[op] // runs} for op, ms in rows}}
        print(f"\nbatch {batch}, T={args.tokens}, past={args.past}: wall {summary(wall, 1000)} ms, model_run "
              f"{run_ms:.1f} ms, kernels {total:.1f} ms, {sum(nodes.values()) // runs} nodes")
        print("| op type | nodes | ms/pass | share |\n|---|---|---|---|")
        for op, ms in rows:
            print(f"| {op} | {nodes[op] // runs} | {ms:.2f} | {100 * ms / total:.0f}% |")
    return report


def alternating_rounds(args, engines: dict, measure, key) -> dict[str, list[float]]:
    """``rows[key(label, batch)]``: ``measure(engine, batch)`` per round, every engine and batch in turn inside
    each round (so each sees the same load), and the read bandwidth once per round."""
    rows: dict[str, list[float]] = collections.defaultdict(list)
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
        rows["bandwidth_gbs"].append(read_bandwidth_gbs())
        for batch in args.batches:
            for label, engine in engines.items():
                rows[key(label, batch)].append(measure(engine, batch))
    return rows


def load_pass_engine(path: str, args):
    """An onnxruntime engine directory, or ``torch:DTYPE`` (e.g. ``torch:bfloat16``): the demo target's torch
    reference with weights and KV cache in that dtype (no ONNX Runtime CPU kernel takes bf16 MatMuls:
    docs/results/target-pass/README.md#low-precision)."""
    if not path.startswith("torch:"):
        from clover.backends.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(path)
    from clover.backends.torch import TorchEngine
    from clover.demo import demo_checkpoint
    from clover.target import load_target

    target = load_target(demo_checkpoint(), dtype=getattr(torch, path.split(":", 1)[1]))
    engine = TorchEngine(target, None, max_seq_len=args.torch_max_seq)
    engine.weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    return engine


def target_weight_bytes(engine) -> int:
    """Bytes of the target's weights: the ONNX weight file, or the torch module's parameters."""
    if hasattr(engine, "weight_bytes"):
        return engine.weight_bytes
    return (Path(engine.engine_dir) / (engine.meta.files["target"] + ".data")).stat().st_size


def passes(args) -> dict:
    """Isolated target passes of several engines, alternated inside every round."""
    engines = {label: load_pass_engine(path, args) for label, path in (e.split("=", 1) for e in args.engine)}
    # one set of feeds per cache layout (an fp16 engine takes an fp16 KV cache, a Clover engine one more layer)
    layout = lambda spec: (spec.dtype, spec.num_kv_layers, spec.max_seq_len)  # noqa: E731
    inputs = {(layout(e.spec), b): pass_inputs(e.spec, b, args.tokens, args.past)
              for e in engines.values() for b in args.batches}
    rows = alternating_rounds(args, engines, lambda engine, batch: statistics.median(
        time_passes(engine, inputs[layout(engine.spec), batch], args.repeats)), lambda label, batch: f"{label} b{batch}")
    weight_bytes = {label: target_weight_bytes(e) for label, e in engines.items()}
    best_bw = max(rows["bandwidth_gbs"])
    print(f"\nbatch · T={args.tokens} · past={args.past}: target pass ms, median (min–max) of {args.rounds} rounds, "
          f"each the median of {args.repeats} passes")
    print("| batch | " + " | ".join(engines) + " |\n|---|" + "---|" * len(engines))
    for batch in args.batches:
        print(f"| {batch} | " + " | ".join(summary(rows[f"{label} b{batch}"], 1000) for label in engines) + " |")
    labels = list(engines)
    for label in labels[1:]:  # paired per round: both saw the same load
        for batch in args.batches:
            ratios = [b / a for a, b in zip(rows[f"{labels[0]} b{batch}"], rows[f"{label} b{batch}"])]
            print(f"{label} / {labels[0]}, batch {batch}: {summary(ratios, digits=3)} (per-round ratio)")
    print(f"read bandwidth {summary(rows['bandwidth_gbs'])} GB/s")
    for label in engines:
        bound = weight_bytes[label] / (best_bw * 1e9)
        step = statistics.median(rows[f"{label} b1"]) if 1 in args.batches else float("nan")
        print(f"{label}: weights {weight_bytes[label] / 1e6:.0f} MB, bound {1000 * bound:.1f} ms (best bandwidth); "
              f"batch-1 pass {step / bound:.2f}x the bound")
    return {"raw": dict(rows), "weight_bytes": weight_bytes}


def decode_step_seconds(engine, tokenizer, batch: int, new_tokens: int) -> float:
    """Steady-state seconds per vanilla decode step at ``batch`` (after the prompt pass and the first step)."""
    from clover.decode import GenerationRequest, SpeculativeDecoder
    from clover.prompts import encode_prompt

    ids = encode_prompt(tokenizer, PROMPT)
    decoder = SpeculativeDecoder(engine, "vanilla", tokenizer=tokenizer, max_batch_size=batch)
    for _ in range(batch):
        decoder.submit(GenerationRequest(ids, max_new_tokens=new_tokens, stop_token_ids=()))
    decoder.step()  # prompt pass and first token
    decoder.step()
    start, steps = time.perf_counter(), 0
    while decoder.has_work:
        decoder.step()
        steps += 1
    return (time.perf_counter() - start) / steps


def threads(args) -> dict:
    """Vanilla decode-loop steps per ``intra_op_num_threads`` setting, alternated inside every round."""
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.demo import demo_checkpoint
    from clover.target import load_tokenizer

    tokenizer = load_tokenizer(demo_checkpoint())
    engines = {n: OnnxRuntimeEngine(args.engine, threads=n) for n in args.threads}
    rows = alternating_rounds(args, engines, lambda engine, batch: decode_step_seconds(
        engine, tokenizer, batch, args.new_tokens), lambda n, batch: f"t{n} b{batch}")
    print(f"\nvanilla decode step ms in the decode loop, median (min–max) of {args.rounds} rounds")
    print("| batch | " + " | ".join(f"{n} thread(s)" for n in engines) + " |\n|---|" + "---|" * len(engines))
    for batch in args.batches:
        print(f"| {batch} | " + " | ".join(summary(rows[f't{n} b{batch}'], 1000) for n in engines) + " |")
    first = next(iter(engines.values()))
    weight_bytes = (Path(first.engine_dir) / (first.meta.files["target"] + ".data")).stat().st_size
    bound = weight_bytes / (max(rows["bandwidth_gbs"]) * 1e9)
    print(f"read bandwidth {summary(rows['bandwidth_gbs'])} GB/s; weights {weight_bytes / 1e6:.0f} MB; bound "
          f"{1000 * bound:.1f} ms (best bandwidth)")
    if 1 in args.batches:
        for n in engines:
            step = statistics.median(rows[f"t{n} b1"])
            print(f"{n} thread(s): batch-1 vanilla step {step / bound:.2f}x the bound")
    return {"raw": dict(rows), "weight_bytes": weight_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("profile", "per-op-type profile of one engine"),
                            ("passes", "alternated pass times of engines"),
                            ("threads", "decode-loop vanilla steps per thread count")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--batches", type=int, nargs="+", default=[1, 8])
        s.add_argument("--output", type=Path, help="also write the raw numbers as JSON here")
        if name == "passes":
            s.add_argument("--engine", action="append", required=True,
                           help="LABEL=DIR or LABEL=torch:DTYPE (the demo target's torch reference); repeat to compare")
            s.add_argument("--torch-max-seq", type=int, default=2048,
                           help="KV-cache positions of torch:DTYPE engines (default: 2048, the demo engine's)")
        else:
            s.add_argument("--engine", default="engines/demo", help="engine directory (default: engines/demo)")
        if name == "threads":
            s.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra_op_num_threads settings")
            s.add_argument("--new-tokens", type=int, default=40, help="tokens per sequence (default: 40)")
        else:
            s.add_argument("--tokens", type=int, default=1, help="new tokens T per pass (default: 1)")
            s.add_argument("--past", type=int, default=128, help="cached tokens before them (default: 128)")
            s.add_argument("--repeats", type=int, default=10, help="passes per measurement (default: 10)")
        s.add_argument("--rounds", type=int, default=5, help="alternating rounds (passes, threads; default: 5)")
    args = p.parse_args()
    result = {"profile": profile, "passes": passes, "threads": threads}[args.command](args)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
