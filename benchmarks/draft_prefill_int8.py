#!/usr/bin/env python
"""Would int8 weights pay for Clover-2's ``draft_prefill``? (docs/engine-contract.md, "draft_prefill in the engine
directory")

    python -m benchmarks.draft_prefill_int8 --work /tmp/prefill-int8
    python -m benchmarks.draft_prefill_int8 --engine engines/mine-clover2 --work /tmp/prefill-int8 --output out.json

Takes a Clover-2 onnxruntime fp32 engine (``--engine``; default: one built once into ``WORK/engine`` from
paper-initialised Clover-2 heads on the demo target) and a copy of it whose ``draft_prefill.onnx`` has int8
MatMul weights (:func:`clover.export.quantize.quantize_draft_step`, the draft step's quantization), then reports:

* quality: ``draft_prefill`` over a text (the target's ``h0``, the next token at each position) with either
  graph: the relative error of ``state`` per position, and how often the fp32 draft step's head-0 top-1
  from the int8 state equals the one from the fp32 state;
* cost: median milliseconds of one ``draft_prefill`` of B sequences × T positions after 100 cached ones,
  fp32 and int8 interleaved, against one vanilla target step (T = 1) of the same batch; ``--repeats`` rounds.

Timings are only meaningful on an idle machine; the quality numbers do not depend on load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

TEXT = ("Speculative decoding lets a small draft model propose several tokens that the large target model then "
        "verifies in one pass. The output is unchanged, but fewer target passes are needed. ") * 3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine", type=Path, help="a Clover-2 onnxruntime fp32 engine (default: build WORK/engine)")
    p.add_argument("--work", type=Path, required=True, help="where the int8 copy (and the default engine) go")
    p.add_argument("--positions", type=int, default=120, help="text positions for the quality check")
    p.add_argument("--shapes", default="1x1,1x3,8x2", help="BxT prefill shapes to time (comma-separated)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (median of their medians)")
    p.add_argument("--calls", type=int, default=30, help="calls per timing (median)")
    p.add_argument("--output", type=Path, help="also write the report as JSON here")
    return p.parse_args(argv)


def engines(engine_dir: Path | None, work: Path):
    """(fp32 engine, int8-prefill engine), building and quantizing what is missing under ``work``."""
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.export.quantize import quantize_draft_step

    if engine_dir is None:
        engine_dir = work / "engine"
        if not (engine_dir / "engine.json").exists():
            from clover.demo import resolve_target
            from clover.drafters import Drafter, save_drafter
            from clover.export.builder import build_engine
            from clover.target import load_target

            save_drafter(Drafter.untrained(load_target(resolve_target("demo", None)), "clover2"), work / "heads")
            build_engine(engine_dir, "demo", str(work / "heads"), max_seq=512, overwrite=True)
    int8_dir = work / "int8-prefill"
    if not (int8_dir / "engine.json").exists():
        shutil.rmtree(int8_dir, ignore_errors=True)
        shutil.copytree(engine_dir, int8_dir)
        quantize_draft_step(int8_dir / "draft_prefill.onnx")
    return OnnxRuntimeEngine(engine_dir), OnnxRuntimeEngine(int8_dir)


def _cache(spec, layers: int, rows: int):
    from clover.kv_cache import KVCache

    cache = KVCache(layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, spec.dtype)
    cache.add_rows(rows)
    return cache.views()


def quality(fp32, int8, positions: int) -> dict:
    """State error and head-0 top-1 agreement of the int8 prefill against the fp32 one, over ``TEXT``."""
    from clover.attention import causal_packed_mask
    from clover.target import load_tokenizer

    spec = fp32.spec
    ids = torch.tensor([load_tokenizer(fp32.engine_dir).encode(TEXT)])[:, :positions]
    n = ids.shape[1]
    no_past, mask, position_ids = torch.zeros(1, dtype=torch.int32), causal_packed_mask(1, n), torch.arange(n)[None]
    target = fp32.target(ids, position_ids, no_past, mask, *_cache(spec, spec.num_kv_layers, 1))
    next_token = torch.zeros_like(ids)
    next_token[:, :-1], next_token[0, -1] = ids[:, 1:], int(target.logits[0, -1].argmax())
    states = [engine.draft_prefill(target.h0, next_token, position_ids, no_past, mask,
                                   *_cache(spec, spec.num_draft_kv_layers, 1)).state[0] for engine in (fp32, int8)]
    error = (states[1] - states[0]).norm(dim=-1) / states[0].norm(dim=-1)
    top1 = [fp32.draft_step(state, next_token[0], 0).topk_ids[:, 0] for state in states]
    return {"positions": n, "state_relative_error_median": float(error.median()),
            "state_relative_error_max": float(error.max()),
            "head0_top1_agreement": float((top1[0] == top1[1]).float().mean())}


def _median_ms(call, calls: int) -> float:
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def cost(fp32, int8, batch: int, tokens: int, calls: int) -> dict:
    """Milliseconds of one draft_prefill (fp32, int8) of batch × tokens and of one vanilla target step."""
    from clover.attention import causal_packed_mask

    spec, gen = fp32.spec, torch.Generator().manual_seed(0)
    past = torch.full((batch,), 100, dtype=torch.int32)
    positions = 100 + torch.arange(tokens).expand(batch, tokens)
    hidden = torch.randn(batch, tokens, spec.hidden_size, generator=gen)
    next_token = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)
    draft_cache = _cache(spec, spec.num_draft_kv_layers, batch)
    row = {name: _median_ms(lambda: engine.draft_prefill(hidden, next_token, positions, past,
                                                         causal_packed_mask(batch, tokens), *draft_cache), calls)
           for name, engine in (("prefill_fp32_ms", fp32), ("prefill_int8_ms", int8))}
    ids = torch.randint(0, spec.vocab_size, (batch, 1), generator=gen)
    target_cache = _cache(spec, spec.num_kv_layers, batch)
    mask = causal_packed_mask(batch, 1)
    row["target_step_ms"] = _median_ms(lambda: fp32.target(ids, past[:, None].long(), past, mask, *target_cache), calls)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    fp32, int8 = engines(args.engine, args.work)
    report = {"engine": str(fp32.engine_dir), "quality": quality(fp32, int8, args.positions), "cost": []}
    for shape in args.shapes.split(","):
        batch, tokens = (int(x) for x in shape.lower().split("x"))
        rounds = [cost(fp32, int8, batch, tokens, args.calls) for _ in range(args.repeats)]
        report["cost"].append({"batch": batch, "tokens": tokens,
                               **{key: statistics.median(r[key] for r in rounds) for key in rounds[0]}})
    print(json.dumps(report, indent=2))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
