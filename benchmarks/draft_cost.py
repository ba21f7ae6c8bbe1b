#!/usr/bin/env python
"""Draft-step cost against the draft vocabulary size V' (FR-Spec; docs/results/draft-cost/README.md).

    python -m benchmarks.draft_cost --engine engines/demo --heads outputs/draft-cost/heads \\
        --cache outputs/data/cache/sharegpt-eval --prompts outputs/data/sharegpt/prompts_eval.jsonl \\
        --work outputs/draft-cost --output docs/results/draft-cost

For the heads on the demo target, per precision (fp32, int8) and V' (the full vocabulary and ``--sizes``), it
exports the draft step (``--heads`` must rank at least max(--sizes) tokens: training/draft_vocab.py --keep)
and times, interleaved in random order and repeated ``--repeats`` times, for N frontier nodes (1 and 4 are
batch 1's first levels at budget 4; 8 and 32 batch 8's):

* ``full``: the draft step graph in an onnxruntime session with the engine's own options;
* ``to_feature``: the same graph cut before the LM head (Attention Decoder, ResBlock, norm);
* ``to_next_hidden``: cut after the Attention Decoder;
* ``empty``: a two-node graph with the same inputs and outputs: the onnxruntime call overhead;
* the engine's target step for batch 1 and 8: root + budget-4 tree (T = 5) and vanilla (T = 1), 256 cached.

so that LM head (+ LogSoftmax, TopK) = full - to_feature, ResBlock + norm = to_feature - to_next_hidden,
Attention Decoder = to_next_hidden - empty. Acceptance per V': the share of the target's own top-1 tokens
(what greedy verification accepts) outside the vocabulary on a held-out hidden-state cache, and tokens per
step decoding held-out prompts with each int8 variant (greedy, budget 4, fixed). Writes draft_cost.json
and draft_cost.md to ``--output``; exported graphs stay in ``--work`` (a rerun reuses them).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

TOP_K = 8
PARTS = ("full", "to_feature", "to_next_hidden")
# frontier nodes per draft level with a budget-4 tree and top-k 8: the root, then at most 4 nodes per sequence
LEVEL_NODES = {1: (1, 4, 4), 8: (8, 32, 32)}


def variant_name(precision: str, size: int, vocab_size: int) -> str:
    return f"{precision}-V{size or vocab_size}"


def export_variant(work: Path, target, heads: Path, precision: str, size: int) -> Path:
    """``work/<variant>/draft_step.onnx``, exported (and int8-quantized) once; reused when present."""
    from clover.drafters import load_drafter
    from clover.export.onnx_graph import export_draft_step
    from clover.export.quantize import quantize_draft_step

    out = work / variant_name(precision, size, target.config.vocab_size)
    if (out / "draft_step.onnx").exists():
        return out / "draft_step.onnx"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    export_draft_step(target, load_drafter(heads, target, draft_vocab_size=size), tmp / "draft_step.onnx", TOP_K)
    if precision == "int8":
        quantize_draft_step(tmp / "draft_step.onnx")
    os.replace(tmp, out)
    return out / "draft_step.onnx"


def lm_head_input(model) -> str:
    """The tensor the draft LM head multiplies: the normed head feature ``[N, H]``."""
    producers = {out: node for node in model.graph.node for out in node.output}

    def source(name: str) -> str:  # through a Transpose of the weight
        node = producers.get(name)
        return node.input[0] if node is not None and node.op_type == "Transpose" else name

    for node in model.graph.node:
        if node.op_type in ("MatMul", "MatMulInteger") and "lm_head" in source(node.input[1]):
            x = node.input[0]
            return producers[x].input[0] if node.op_type == "MatMulInteger" else x  # DynamicQuantizeLinear's input
    raise ValueError("no LM-head MatMul in the draft graph")


def cut_graph(full: Path, part: str) -> Path:
    """``full`` cut to the sub-graph that computes ``part`` (``to_feature`` or ``to_next_hidden``)."""
    import onnx
    from onnx import TensorProto, helper

    path = full.with_name(f"{part}.onnx")
    if path.exists():
        return path
    model = onnx.load(str(full))
    output = lm_head_input(model) if part == "to_feature" else "next_hidden"
    needed, kept = {output}, []
    for node in reversed(model.graph.node):  # topological order: walk back from the output
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(node.input)
    initializers = [t for t in model.graph.initializer if t.name in needed]
    inputs = [i for i in model.graph.input if i.name in needed]
    graph = helper.make_graph(kept[::-1], f"draft_step_{part}", inputs,
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)], initializers)
    sub = helper.make_model(graph, opset_imports=model.opset_import)
    sub.ir_version = model.ir_version
    onnx.save(sub, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


def empty_graph(work: Path, hidden_size: int) -> Path:
    """Inputs and outputs of the draft step, nearly no work: Identity and a TopK over the hidden state."""
    import onnx
    from onnx import TensorProto, helper

    path = work / "empty.onnx"
    inputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["nodes", hidden_size]),
              helper.make_tensor_value_info("token", TensorProto.INT64, ["nodes"]),
              helper.make_tensor_value_info("head", TensorProto.INT64, [])]
    outputs = [helper.make_tensor_value_info("next_hidden", TensorProto.FLOAT, ["nodes", hidden_size]),
               helper.make_tensor_value_info("topk_logprobs", TensorProto.FLOAT, ["nodes", TOP_K]),
               helper.make_tensor_value_info("topk_ids", TensorProto.INT64, ["nodes", TOP_K])]
    k = helper.make_tensor("k", TensorProto.INT64, [1], [TOP_K])
    nodes = [helper.make_node("Identity", ["hidden"], ["next_hidden"]),
             helper.make_node("TopK", ["hidden", "k"], ["topk_logprobs", "topk_ids"], axis=-1)]
    graph = helper.make_graph(nodes, "empty_draft_step", inputs, outputs, [k])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def draft_call(session, nodes: int, hidden_size: int, vocab_size: int):
    gen = torch.Generator().manual_seed(nodes)
    names = {i.name for i in session.get_inputs()}
    feeds = {"hidden": torch.randn(nodes, hidden_size, generator=gen).numpy(),
             "token": torch.randint(0, vocab_size, (nodes,), generator=gen).numpy(),
             "head": np.array(1, dtype=np.int64)}
    feeds = {k: v for k, v in feeds.items() if k in names}
    return lambda: session.run(None, feeds)


def target_call(engine, batch: int, tokens: int, past: int = 256):
    """One target pass: ``tokens`` new tokens per sequence (causal among them) after ``past`` cached ones."""
    from clover.attention import causal_packed_mask

    spec = engine.spec
    shape = (batch, spec.num_kv_heads, past + tokens, spec.head_dim)
    caches = [torch.randn(shape) for _ in range(spec.num_kv_layers)]
    args = (torch.randint(0, spec.vocab_size, (batch, tokens)), torch.arange(past, past + tokens).expand(batch, -1),
            torch.full((batch,), past, dtype=torch.int32), causal_packed_mask(batch, tokens), caches, caches)
    return lambda: engine.target(*args)


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def decode_step_job(target, draft_calls: list):
    """A decode step's engine calls in the decode loop's order: the target pass, then one draft call per
    level (level 1 right after the target pass has streamed its weights through the caches). Returns the
    seconds of each call: ``{"target", "level1", ...}``."""
    def run() -> dict[str, float]:
        times = {"target": _timed(target)}
        times.update({f"level{i}": _timed(call) for i, call in enumerate(draft_calls, 1)})
        return times
    return run


def timing_rounds(jobs: dict, repeats: int, calls: int, seed: int = 0) -> dict[str, list[float]]:
    """Each round runs every job ``calls`` times (after one warm-up), jobs in a fresh random order each round so
    load hits all alike; one sample per round and timed call: the median of its ``calls`` times."""
    from clover.progress import progress_bar

    samples: dict[str, list[float]] = {}
    order = list(jobs)
    rng = random.Random(seed)
    with progress_bar(total=repeats * len(jobs), desc="timing", unit="job") as bar:
        for _ in range(repeats):
            rng.shuffle(order)
            for name in order:
                jobs[name]()
                runs = [jobs[name]() for _ in range(calls)]
                for key in runs[0]:
                    samples.setdefault(f"{name}/{key}", []).append(statistics.median(r[key] for r in runs))
                bar.update()
    return samples


def target_top1(target, cache_dir: Path, work: Path) -> np.ndarray:
    """The target's greedy token at every answer position of the cache (cached in ``work``)."""
    from training.hidden_cache import HiddenCache

    path = work / "eval_target_top1.npy"
    if path.exists():
        return np.load(path)
    cache, found = HiddenCache(cache_dir), []
    for i in range(len(cache.conversations)):
        item = cache.conversation(i)
        rows = np.nonzero(item["assistant_mask"][1:])[0]  # positions whose next token is an answer token
        hidden = torch.from_numpy(np.asarray(item["last_hidden"][rows], dtype=np.float32))
        with torch.no_grad():
            found.append(target.lm_head(target.norm(hidden)).argmax(-1).numpy())
    top1 = np.concatenate(found)
    np.save(path, top1)
    return top1


def eval_prompts(path: Path, tokenizer, count: int, max_tokens: int = 512) -> list[list[int]]:
    """The first ``count`` first-turn prompts of a held-out ``prompts_*.jsonl`` that fit ``max_tokens``."""
    prompts = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if len(record["messages"]) == 1:
            ids = list(tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True,
                                                     return_dict=False))
            if len(ids) <= max_tokens:
                prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def tokens_per_step(base_engine, session, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """Greedy decoding of ``prompts`` with the base engine's target and ``session`` as its draft step."""
    from clover.decode import GenerationRequest, SpeculativeDecoder
    from clover.stats import tokens_per_step as per_step

    engine = copy.copy(base_engine)
    engine.draft_session = session
    decoder = SpeculativeDecoder(engine, "clover", _fixed_tree(), max_batch_size=8)
    results = decoder.generate([GenerationRequest(p, max_new_tokens=new_tokens, stop_token_ids=()) for p in prompts])
    new = sum(len(r.token_ids) for r in results)
    return per_step(new, sum(r.stats.num_steps for r in results), len(results)), [r.token_ids for r in results]


def _fixed_tree():
    from clover.config import TreeConfig

    return TreeConfig(budget=4, adaptive=False)


def summarize(samples: list[float]) -> dict:
    ms = [s * 1e3 for s in samples]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "samples_ms": ms}


def machine() -> dict:
    def run(command: str) -> str:
        return subprocess.run(command, shell=True, capture_output=True, text=True).stdout.strip()

    import onnxruntime

    return {"cpu": run("lscpu | grep 'Model name'").partition(":")[2].strip(), "cores": os.cpu_count(),
            "uptime_start": run("uptime"),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": onnxruntime.__version__}


def build_jobs(args, target, base_engine, work: Path) -> tuple[dict, dict]:
    """Timing jobs (name -> call) and the full draft-step sessions by variant."""
    from clover.backends.onnxruntime import open_session as engine_session  # the engine's own session options

    cfg = target.config
    graphs, sessions = {}, {}
    for precision in ("fp32", "int8"):
        for size in (0, *args.sizes):
            full = export_variant(work, target, Path(args.heads), precision, size)
            name = variant_name(precision, size, cfg.vocab_size)
            sessions[name] = graphs[f"{name}/full"] = engine_session(full, args.threads)
            if size == 0:  # the cut graphs do not depend on V'
                graphs.update({f"{name}/{part}": engine_session(cut_graph(full, part), args.threads)
                               for part in PARTS[1:]})
    graphs["empty"] = engine_session(empty_graph(work, cfg.hidden_size), args.threads)
    jobs = {}
    for batch, level_nodes in LEVEL_NODES.items():
        tree_pass = target_call(base_engine, batch, 5)
        for name, session in graphs.items():
            calls = [draft_call(session, nodes, cfg.hidden_size, cfg.vocab_size) for nodes in level_nodes]
            jobs[f"{name}/B{batch}"] = decode_step_job(tree_pass, calls)
        jobs[f"vanilla/B{batch}"] = decode_step_job(target_call(base_engine, batch, 1), [])
    return jobs, sessions


def acceptance(args, target, base_engine, sessions: dict, work: Path) -> dict:
    """Per V': the target's top-1 outside the vocabulary (held-out cache) and tokens/step (int8 variants)."""
    from clover.drafters import read_draft_vocab
    from clover.target import load_tokenizer

    saved, key = work / "acceptance.json", [args.heads, args.cache, args.prompts, args.num_prompts, args.new_tokens]
    if saved.exists() and json.loads(saved.read_text())["key"] == key:  # greedy decoding: the same every run
        out = json.loads(saved.read_text())["result"]
        return {**out, "outside": {int(k): v for k, v in out["outside"].items()},
                "tokens_per_step": {int(k): v for k, v in out["tokens_per_step"].items()}}
    top1 = target_top1(target, Path(args.cache), work)
    ranking = read_draft_vocab(args.heads, max(args.sizes)).numpy()
    out = {"positions": int(len(top1)), "outside": {}, "tokens_per_step": {}}
    for size in args.sizes:
        out["outside"][size] = float(1.0 - np.isin(top1, ranking[:size]).mean())
    prompts = eval_prompts(Path(args.prompts), load_tokenizer(base_engine.engine_dir), args.num_prompts)
    out["prompts"], reference = len(prompts), None
    for size in (0, *args.sizes):
        name = variant_name("int8", size, target.config.vocab_size)
        print(f"decoding {len(prompts)} held-out prompts with {name}", file=sys.stderr, flush=True)
        out["tokens_per_step"][size], tokens = tokens_per_step(base_engine, sessions[name], prompts, args.new_tokens)
        reference = reference or tokens
        assert tokens == reference, f"{name}: output differs from the full-vocabulary draft (not lossless)"
    saved.write_text(json.dumps({"key": key, "result": out}) + "\n")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/demo", help="built demo engine: its target step (default: engines/demo)")
    p.add_argument("--heads", required=True, help="heads directory whose draft_vocab.safetensors ranks max(--sizes)")
    p.add_argument("--cache", required=True, help="held-out hidden-state cache (target top-1 coverage)")
    p.add_argument("--prompts", required=True, help="held-out prompts_*.jsonl (tokens per step)")
    p.add_argument("--work", default="outputs/draft-cost", help="exported graphs (reused by a rerun)")
    p.add_argument("--output", required=True, help="directory for draft_cost.json and draft_cost.md")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768], help="V' values")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds (default: 7)")
    p.add_argument("--calls", type=int, default=9, help="decode steps per job per round; their median is the sample")
    p.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: its choice)")
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts decoded per V' (default: 16)")
    p.add_argument("--new-tokens", type=int, default=96, help="new tokens per prompt (default: 96)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.demo import resolve_target
    from clover.target import load_target

    work, output = Path(args.work), Path(args.output)
    work.mkdir(parents=True, exist_ok=True)
    output.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "command": " ".join(sys.argv), "top_k": TOP_K}
    target = load_target(resolve_target("demo"))
    base_engine = OnnxRuntimeEngine(args.engine, threads=args.threads)
    jobs, sessions = build_jobs(args, target, base_engine, work)
    samples = timing_rounds(jobs, args.repeats, args.calls)
    report["timings"] = {name: summarize(values) for name, values in samples.items()}
    report["acceptance"] = acceptance(args, target, base_engine, sessions, work)
    report["machine"]["uptime_end"] = subprocess.run("uptime", capture_output=True, text=True).stdout.strip()
    (output / "draft_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    (output / "draft_cost.md").write_text(markdown(report, args, target.config.vocab_size))
    print(f"wrote {output / 'draft_cost.json'} and {output / 'draft_cost.md'}", file=sys.stderr)
    return 0


def _cell(timing: dict) -> str:
    return f"{timing['median_ms']:.2f} [{timing['min_ms']:.2f}–{timing['max_ms']:.2f}]"


def _pooled_target(report: dict, batch: int) -> dict:
    """The tree pass (T = 5) of every job at ``batch``, pooled."""
    samples = [s for name, t in report["timings"].items() if name.endswith(f"/B{batch}/target")
               and not name.startswith("vanilla") for s in t["samples_ms"]]
    return summarize([s / 1e3 for s in samples])


def _timing_tables(report: dict, variants: list[str]) -> list[str]:
    t = report["timings"]
    targets = {b: _pooled_target(report, b) for b in LEVEL_NODES}
    head = " | ".join(f"B{b} level {lv} (N={n})" for b, nodes in LEVEL_NODES.items() for lv, n in enumerate(nodes, 1))
    lines = [f"| variant | {head} | share B1 L1 | share B1 L2 | share B8 L1 | share B8 L2 |", "|---" * 11 + "|"]
    for name in variants:
        cells = [_cell(t[f"{name}/full/B{b}/level{lv}"]) for b in LEVEL_NODES for lv in (1, 2, 3)]
        shares = [t[f"{name}/full/B{b}/level{lv}"]["median_ms"] / targets[b]["median_ms"]
                  for b in LEVEL_NODES for lv in (1, 2)]
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(f"{x:.1%}" for x in shares) + " |")
    lines += ["", "Target step, ms (256 cached tokens; the tree pass pooled over every job's decode steps):", "",
              "| batch | T=1 (vanilla) | T=5 (root + budget-4 tree) |", "|---|---|---|"]
    lines += [f"| {b} | {_cell(t[f'vanilla/B{b}/target'])} | {_cell(targets[b])} |" for b in LEVEL_NODES]
    return lines


def _breakdown_table(report: dict, variants: list[str], vocab_size: int) -> list[str]:
    med = {name: t["median_ms"] for name, t in report["timings"].items()}
    lines = ["| variant | batch | level | onnxruntime call | Attention Decoder | ResBlock + norm | "
             "LM head, LogSoftmax, TopK |", "|---|---|---|---|---|---|---|"]
    for name in variants:
        body = name.split("-")[0] + f"-V{vocab_size}"
        for b in LEVEL_NODES:
            for lv in (1, 2):
                key = f"/B{b}/level{lv}"
                empty, reg = med[f"empty{key}"], med[f"{body}/to_next_hidden{key}"]
                feature, full = med[f"{body}/to_feature{key}"], med[f"{name}/full{key}"]
                lines.append(f"| {name} | {b} | {lv} | {empty:.3f} | {reg - empty:.3f} | {feature - reg:.3f} | "
                             f"{full - feature:.3f} |")
    return lines


def markdown(report: dict, args, vocab_size: int) -> str:
    variants = [variant_name(p, s, vocab_size) for p in ("fp32", "int8") for s in (0, *args.sizes)]
    lines = [f"Draft step per level of a decode step, ms: median [min–max] of {args.repeats} interleaved rounds "
             f"(each the median of {args.calls} decode steps). Level 1 runs right after the target pass, each "
             "further level right after the one before; N frontier nodes (budget 4, top-k 8). Share: median draft "
             "step / median tree pass (T = 5) at that batch.", ""]
    lines += _timing_tables(report, variants)
    lines += ["", "Where the draft step's time goes, ms (differences of medians: LM head = full − to_feature, "
              "ResBlock + norm = to_feature − to_next_hidden, Attention Decoder = to_next_hidden − empty, "
              "onnxruntime call = empty):", ""]
    lines += _breakdown_table(report, variants, vocab_size)
    acc = report["acceptance"]
    lines += ["", f"Acceptance: target top-1 tokens outside the vocabulary ({acc['positions']} held-out answer "
              f"positions); tokens per step, int8 draft, greedy, budget 4, {acc['prompts']} held-out prompts "
              f"× {args.new_tokens} new tokens (outputs identical for every V').", "",
              "| V' | top-1 outside | tokens/step |", "|---|---|---|",
              f"| {vocab_size} (full) | 0 | {acc['tokens_per_step'][0]:.3f} |"]
    lines += [f"| {s} | {acc['outside'][s]:.2%} | {acc['tokens_per_step'][s]:.3f} |" for s in args.sizes]
    m = report["machine"]
    lines += ["", f"Machine: {m['cpu']}, {m['cores']} cores; {m['date']}; load at start `{m['uptime_start']}`, "
              f"at end `{m['uptime_end']}`; Python {m['python']}, torch {m['torch']}, onnxruntime {m['onnxruntime']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
