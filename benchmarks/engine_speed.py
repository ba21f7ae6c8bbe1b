#!/usr/bin/env python
"""Engine speed on the demo target, side by side in one run (issue 3's speed section).

Measures, interleaved and repeated:
  * vanilla greedy tokens/s at batch 1: onnxruntime engine, torch reference, transformers ``generate()``;
  * the onnxruntime target step time for T = 1, 5, 9, 17, 33 new tokens (the roofline);
  * memory bandwidth (a large multi-threaded read), and the vanilla step time as a ratio to
    weight bytes / bandwidth (the physical bound for batch 1).

Usage::

    python -m benchmarks.engine_speed --output docs/results/engine_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

PROMPT = "Write a short story about a robot who learns to paint."


def read_bandwidth_gbs(size_mb: int = 1024, repeats: int = 5) -> float:
    """Best-of read bandwidth: a reduction over a buffer much larger than the caches."""
    buf = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def decode_tokens_per_second(engine, tokenizer, new_tokens: int) -> tuple[float, float]:
    """(tokens/s including the prompt pass, steady-state seconds per decode step after it)."""
    from clover.prompts import encode_prompt
    from clover.decode import GenerationRequest, SpeculativeDecoder

    ids = encode_prompt(tokenizer, PROMPT)
    decoder = SpeculativeDecoder(engine, "vanilla", tokenizer=tokenizer)
    decoder.submit(GenerationRequest(ids, max_new_tokens=new_tokens, stop_token_ids=()))
    start = time.perf_counter()
    decoder.step()  # the prompt pass (and the first decode step)
    after_prompt = time.perf_counter()
    while decoder.has_work:
        decoder.step()
    end = time.perf_counter()
    steps = new_tokens - 2  # vanilla: one token per step after the prompt pass and the first step
    return new_tokens / (end - start), (end - after_prompt) / steps


def hf_tokens_per_second(model, tokenizer, new_tokens: int) -> float:
    from clover.prompts import encode_prompt

    ids = torch.tensor([encode_prompt(tokenizer, PROMPT)])
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) / seconds


def step_seconds(engine, tokens: int, past: int = 128, repeats: int = 10) -> float:
    """Median time of one target pass over ``tokens`` new tokens (a chain) after ``past`` cached tokens."""
    from clover.attention import causal_packed_mask
    from clover.kv_cache import KVCache

    spec = engine.spec
    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, past + tokens, spec.dtype)
    cache.add_rows(1)
    k, v = cache.views()
    ids = torch.randint(0, spec.vocab_size, (1, tokens))
    positions = torch.arange(past, past + tokens)[None]
    lengths = torch.tensor([past], dtype=torch.int32)
    mask = causal_packed_mask(1, tokens)
    engine.target(ids, positions, lengths, mask, k, v)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.target(ids, positions, lengths, mask, k, v)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", default="engines/demo-vanilla", help="vanilla-only demo engine (built if missing)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians and ranges are reported")
    p.add_argument("--output", type=Path, default=Path("docs/results/engine_speed.json"))
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.backends.torch import TorchEngine
    from clover.demo import demo_checkpoint
    from clover.export.builder import build_engine
    from clover.target import load_target, load_tokenizer

    checkpoint = demo_checkpoint()
    engine_dir = Path(args.engine_dir)
    if not (engine_dir / "engine.json").exists():
        build_engine(engine_dir, "demo", "none", max_seq=1024)
    ort_engine = OnnxRuntimeEngine(engine_dir)
    tokenizer = load_tokenizer(checkpoint)
    torch_engine = TorchEngine(load_target(checkpoint), None, max_seq_len=1024)
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    weight_bytes = (engine_dir / "target.onnx.data").stat().st_size

    rows: dict[str, list[float]] = {}
    token_counts = (1, 5, 9, 17, 33)
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
        rows.setdefault("bandwidth_gbs", []).append(read_bandwidth_gbs())
        tps, step = decode_tokens_per_second(ort_engine, tokenizer, args.new_tokens)
        rows.setdefault("onnxruntime_vanilla_tok_s", []).append(tps)
        rows.setdefault("onnxruntime_vanilla_step_s", []).append(step)
        tps, step = decode_tokens_per_second(torch_engine, tokenizer, args.new_tokens)
        rows.setdefault("torch_vanilla_tok_s", []).append(tps)
        rows.setdefault("torch_vanilla_step_s", []).append(step)
        rows.setdefault("transformers_generate_tok_s", []).append(hf_tokens_per_second(hf_model, tokenizer, args.new_tokens))
        for tokens in token_counts:
            rows.setdefault(f"onnxruntime_step_T{tokens}_ms", []).append(1000 * step_seconds(ort_engine, tokens))
            rows.setdefault(f"torch_step_T{tokens}_ms", []).append(1000 * step_seconds(torch_engine, tokens, repeats=3))

    summary = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in rows.items()}
    bound_s = weight_bytes / (summary["bandwidth_gbs"]["median"] * 1e9)
    summary["weight_bytes"] = weight_bytes
    summary["bound_step_ms"] = 1000 * bound_s
    # the physical bound uses the best bandwidth seen; the step is the steady state inside the decode loop
    bound_s = weight_bytes / (summary["bandwidth_gbs"]["max"] * 1e9)
    summary["bound_step_ms"] = 1000 * bound_s
    summary["vanilla_step_over_bound"] = summary["onnxruntime_vanilla_step_s"]["median"] / bound_s
    summary["vanilla_step_over_bound_best"] = summary["onnxruntime_vanilla_step_s"]["min"] / bound_s
    summary["machine"] = {"platform": platform.platform(), "processor": platform.processor(),
                          "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "raw": rows}, indent=2) + "\n")

    def fmt(key, scale=1.0):
        s = summary[key]
        return f"{s['median'] * scale:.1f} ({s['min'] * scale:.1f}–{s['max'] * scale:.1f})"

    print("\n| vanilla, batch 1, demo target fp32 | tokens/s |\n|---|---|")
    print(f"| onnxruntime engine | {fmt('onnxruntime_vanilla_tok_s')} |")
    print(f"| torch reference | {fmt('torch_vanilla_tok_s')} |")
    print(f"| transformers generate() | {fmt('transformers_generate_tok_s')} |")
    print("\n| new tokens T | onnxruntime step ms | torch step ms |\n|---|---|---|")
    for tokens in token_counts:
        print(f"| {tokens} | {fmt(f'onnxruntime_step_T{tokens}_ms')} | {fmt(f'torch_step_T{tokens}_ms')} |")
    print(f"\nread bandwidth {fmt('bandwidth_gbs')} GB/s; weights {weight_bytes / 1e6:.0f} MB; "
          f"bound {1000 * bound_s:.1f} ms/step (best bandwidth)")
    print(f"onnxruntime vanilla step in the decode loop {fmt('onnxruntime_vanilla_step_s', 1000)} ms = "
          f"{summary['vanilla_step_over_bound']:.2f}x the bound (best run {summary['vanilla_step_over_bound_best']:.2f}x)")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
