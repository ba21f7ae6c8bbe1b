"""Diagnose how draft heads use the token they are given (issue 28; docs/results/heads-token-path).

    python -m training.experiments.diagnose_heads --heads clover=clover/assets/smollm2-135m-instruct/clover \\
        --heads medusa=clover/assets/smollm2-135m-instruct/medusa --output docs/results/heads-token-path

On the target's own greedy answers to MT-bench first turns (evaluation only: never train on them), decoded
by the project's engine (``--engine DIR``: onnxruntime; default the torch reference of ``--target``) and kept
in ``--outputs`` (resumable: a rerun decodes only what is missing), it runs each set of heads teacher forced,
exactly as training does (training/forward.py ``compute_h0`` and ``Drafter.step``), and reports per depth i:

* ``h0``: the root state's norm (median, 90th percentile) and its largest ``|dim|`` (median over roots, max);
* ``delta_raw``: ``||h_i - h_{i-1}||``, how much the token path changes the state, absolute and relative to
  ``||h_{i-1}||``; ``delta_normed``: the same after the heads' ``head_norm`` (as the head sees the state);
* ``token_sensitivity``: how often head i's top-1 changes when its given token is replaced by a random token
  of the draft vocabulary (the state ``h_{i-1}`` kept); 0 means the head ignores its token;
* ``agree``: how often head i's top-1 is the target's greedy token at t+i+1 (the verified token being t+1),
  i.e. what greedy verification would accept along the target's own path.

Writes ``diagnosis.json`` and ``diagnosis.md`` into ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def greedy_outputs(path: Path, engine_dir: str | None, target: str, limit: int | None, max_new_tokens: int,
                   threads: int | None) -> list[dict]:
    """The target's greedy answers to the MT-bench first turns in ``path`` (decoded now where missing)."""
    from training.distill import distill, open_engine, read_jsonl
    from training.evaluate import mtbench_records

    records = mtbench_records(None, limit)
    done = {r["id"] for r in read_jsonl(path)} if path.exists() else set()
    if any(r["id"] not in done for r in records):
        engine, tokenizer = open_engine(engine_dir, None if engine_dir else target, threads, max_seq=1024)
        distill(records, path, engine, tokenizer, max_new_tokens=max_new_tokens, sample_fraction=0.0,
                batch_size=8, length_window=1)
    wanted = {r["id"] for r in records}
    return [r for r in read_jsonl(path) if r["id"] in wanted]


def conversation_batch(target, record: dict):
    """A one-conversation :class:`training.batches.Batch` with the target's hidden states (fp32)."""
    from training.hidden_cache import target_hidden_states
    from training.batches import Batch

    ids = record["prompt_ids"] + record["response_ids"]
    tokens = torch.tensor([ids])
    assistant = torch.zeros_like(tokens, dtype=torch.bool)
    assistant[0, len(record["prompt_ids"]):] = True
    with torch.no_grad():
        x_in, x_last = target_hidden_states(target, tokens)
    return Batch(x_in.float(), x_last.float(), tokens, assistant, torch.tensor([len(ids)]), [record["category"]])


class DepthStats:
    """Per-root measurements of one depth, pooled over conversations."""

    def __init__(self) -> None:
        self.values: dict[str, list[torch.Tensor]] = {}

    def add(self, **named: torch.Tensor) -> None:
        for name, value in named.items():
            self.values.setdefault(name, []).append(value.detach().float().flatten())

    def all(self, name: str) -> torch.Tensor:
        return torch.cat(self.values[name]) if name in self.values else torch.zeros(0)


def _random_tokens(n: int, ids: torch.Tensor | None, vocab: int, generator: torch.Generator) -> torch.Tensor:
    if ids is None:
        return torch.randint(vocab, (n,), generator=generator)
    return ids[torch.randint(len(ids), (n,), generator=generator)]


def measure_conversation(drafter, target, batch, stats: list[DepthStats], h0_stats: DepthStats,
                         generator: torch.Generator) -> None:
    """Teacher-forced chain over one conversation's answer roots; adds each depth's measurements to ``stats``."""
    from clover.drafters import draft_vocab_of
    from training.forward import DraftRows, compute_h0, find_roots

    weight = target.lm_head.weight
    rows = DraftRows.of(drafter, weight)
    roots = find_roots(batch, drafter.config.num_heads)
    h = compute_h0(drafter, target, batch)[roots.b, roots.t]  # [N, H]
    h0_stats.add(norm=h.norm(dim=-1), max_abs=h.abs().amax(dim=-1))
    keep_rows = torch.arange(h.shape[0])
    norm = drafter.head_norm
    for i in range(drafter.config.num_heads):
        keep = roots.valid[keep_rows, i]
        keep_rows, h = keep_rows[keep], h[keep]
        if not len(keep_rows):
            return
        given = roots.tok_in[keep_rows, i]
        random = _random_tokens(len(given), draft_vocab_of(drafter), weight.shape[0], generator)
        h_next, logits = drafter.step(h, given, i, weight, rows.weight)
        _, logits_random = drafter.step(h, random, i, weight, rows.weight)
        top = rows.to_target_ids(logits.argmax(-1))
        delta_normed = (norm(h_next) - norm(h)).norm(dim=-1)
        stats[i].add(norm_prev=h.norm(dim=-1), delta_raw=(h_next - h).norm(dim=-1),
                     rel_raw=(h_next - h).norm(dim=-1) / h.norm(dim=-1),
                     delta_normed=delta_normed, rel_normed=delta_normed / norm(h).norm(dim=-1),
                     changed=(logits.argmax(-1) != logits_random.argmax(-1)),
                     agree=(top == roots.labels[keep_rows, i]))
        h = h_next


def _median(x: torch.Tensor) -> float:
    return float(x.median()) if x.numel() else float("nan")


def summarise(stats: list[DepthStats], h0_stats: DepthStats) -> dict:
    norm, max_abs = h0_stats.all("norm"), h0_stats.all("max_abs")
    out = {"h0": {"roots": int(norm.numel()), "norm_median": _median(norm),
                  "norm_p90": float(norm.quantile(0.9)) if norm.numel() else float("nan"),
                  "max_abs_dim_median": _median(max_abs), "max_abs_dim_max": float(max_abs.max())},
           "depths": []}
    for i, s in enumerate(stats):
        out["depths"].append({
            "head": i + 1, "roots": int(s.all("agree").numel()),
            "norm_prev_median": _median(s.all("norm_prev")),
            "delta_raw_median": _median(s.all("delta_raw")), "rel_raw_median": _median(s.all("rel_raw")),
            "delta_normed_median": _median(s.all("delta_normed")), "rel_normed_median": _median(s.all("rel_normed")),
            "token_sensitivity": float(s.all("changed").mean()), "agree": float(s.all("agree").mean())})
    return out


def diagnose(drafter, target, records: list[dict], seed: int = 0, progress: bool = True) -> dict:
    """:func:`summarise` of :func:`measure_conversation` over every record (a greedy answer of the target)."""
    from clover.progress import progress_bar

    generator = torch.Generator().manual_seed(seed)
    stats = [DepthStats() for _ in range(drafter.config.num_heads)]
    h0_stats = DepthStats()
    with torch.no_grad():
        for record in progress_bar(records, desc="diagnose", unit="answer", enabled=progress, dynamic_ncols=True):
            measure_conversation(drafter, target, conversation_batch(target, record), stats, h0_stats, generator)
    return summarise(stats, h0_stats)


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"Greedy MT-bench answers: {s['answers']} first turns, at most {s['max_new_tokens']} new tokens; "
             f"random tokens drawn from each heads' draft vocabulary (seed {s['seed']}).", "",
             "| heads | roots | median ‖h0‖ | p90 ‖h0‖ | largest \\|dim\\| of h0 (median / max) |", "|---|---|---|---|---|"]
    for name, r in report["heads"].items():
        h0 = r["h0"]
        lines.append(f"| {name} | {h0['roots']} | {h0['norm_median']:.1f} | {h0['norm_p90']:.1f} | "
                     f"{h0['max_abs_dim_median']:.1f} / {h0['max_abs_dim_max']:.1f} |")
    lines += ["", "Per head i (predicts the token i+1 places after the last accepted one; the verified token is "
              "the first):", "",
              "| heads | head | ‖h_{i-1}‖ | ‖h_i − h_{i-1}‖ | relative | after head_norm | relative (normed) | "
              "token sensitivity | agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["heads"].items():
        for d in r["depths"]:
            lines.append(f"| {name} | {d['head']} | {d['norm_prev_median']:.1f} | {d['delta_raw_median']:.3f} | "
                         f"{d['rel_raw_median']:.4f} | {d['delta_normed_median']:.3f} | {d['rel_normed_median']:.4f} | "
                         f"{d['token_sensitivity']:.3f} | {d['agree']:.3f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Numbers are medians over roots unless named otherwise; see the module "
                                            "docstring for each measurement.")
    parser.add_argument("--heads", action="append", required=True, help="NAME=DIR of heads (repeatable)")
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo'")
    parser.add_argument("--engine", help="onnxruntime engine directory that decodes the greedy answers "
                                         "(default: the torch reference of --target)")
    parser.add_argument("--outputs", default="outputs/diagnose/mtbench_greedy.jsonl",
                        help="the target's greedy MT-bench answers (JSONL; decoded where missing, resumable)")
    parser.add_argument("--limit", type=int, default=24, help="MT-bench first turns, round-robin over categories")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="random replacement tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", required=True, help="directory for diagnosis.json and diagnosis.md")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from clover.config import ConfigError
    from clover.demo import resolve_target
    from clover.drafters import load_drafter
    from clover.target import load_target
    from training.evaluate import parse_heads

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.monotonic()
    records = greedy_outputs(Path(args.outputs), args.engine, args.target, args.limit, args.max_new_tokens,
                             args.threads)
    target = load_target(resolve_target(args.target))
    report = {"settings": {"target": args.target, "outputs": args.outputs, "answers": len(records),
                           "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                           "answer_tokens": sum(len(r["response_ids"]) for r in records)}, "heads": {}}
    for name, directory in parse_heads(args.heads).items():
        try:
            drafter = load_drafter(directory, target).float()
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        report["heads"][name] = dict(diagnose(drafter, target, records, args.seed, not args.no_progress),
                                     directory=str(directory), method=drafter.config.method)
    report["settings"]["seconds"] = round(time.monotonic() - start, 1)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnosis.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "diagnosis.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
