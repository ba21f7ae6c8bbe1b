"""Clover's GPU check: one command that says whether the GPU path works on this machine and how fast it is.

    bash scripts/gpu_check.sh --out DIR            # on a CUDA GPU: under 8 minutes on one H100/H200
    bash scripts/gpu_check.sh --dry-run --out DIR  # on any CPU: the same plumbing at tiny shapes (CI)

Needs torch with CUDA, nvcc (the kernel is JIT-built) and, for the lossless step, transformers; no TensorRT,
no internet, no checkpoints (every model is built here with random weights). Steps, each in its own
process with its own time budget (a CUDA error or a hang in one step cannot take the others down):

  gpu_engine          the device engine (docs/gpu-engine.md): the decode step on the device, from CUDA graphs,
                      token-exact with transformers generate() (random, Medusa and oracle heads, vanilla;
                      batch 1 and 4) and never synchronising; the verify pass and the whole step timed at the
                      Llama-3-8B shape in bf16 against the memory bound measured in the same run.
  gpu_engine_demo     the demo model (SmolLM2-135M, shipped heads) on the device engine in bf16: the 80 MT-bench
                      first turns at batch 1 and 8, tokens/s and tokens/step of vanilla, Clover's defaults and
                      Clover at budgets 8 and 32, transformers generate() (eager, and with its static cache) on
                      10 of them, the speed aims; agreement of bf16 outputs with fp32 vanilla. Skipped where the
                      demo model or MT-bench is not installed.
  gpu_engine_compile  the vanilla step and the verify pass at batch 1 at the 8B shape, from CUDA graphs, before
                      and after torch.compile of the decoder layers, and the compile's time.
  gpu_serve           Clover's Triton model on the torch backend (the device engine, fp32) through the tritonserver of
                      the nvidia-pytriton wheel: 8 concurrent requests, half streamed, each equal to its solo
                      answer and to transformers generate(). Skipped where no tritonserver is found.
  kernel_build        JIT-build the TreeAttention CUDA kernel (clover/kernels) for this GPU.
  kernel_correctness  the kernel against the reference op clover.attention.tree_attention: fixed edge
                      cases and random shapes (B 1-16, T 1-64 so one or two mask words, mixed past lengths
                      in a batch, GQA, D 64/128) in fp32, fp16 and bf16, with per-dtype tolerances; plus
                      op-level timings against torch SDPA.
  lossless_decode     speculative decoding with the torch backend on the device equals transformers
                      generate() on a small random Llama: random Clover and Clover-2 heads, oracle heads,
                      and the CUDA kernel inside the target; batch 1 and 4.
  decode_timings      one decode step at the Llama-3-8B shape in bf16 (random weights): the target pass at
                      batch 1/8/32 with trees of 1/8/32/64 tokens, attention by the kernel, by torch SDPA
                      with a mask, and by the reference op; and the draft step.
  train_step          one online-feature training step at that shape (training/experiments/cost_probe.py).
  distributed_step    a 2-process data-parallel training step over nccl (needs 2 GPUs; gloo in --dry-run).

With --dry-run everything runs on the CPU at tiny shapes and the CUDA-only steps are skipped with their
reason. Output (--out DIR): report.json (raw results of every step), summary.md (tables), steps/*.json,
logs/*.log (each step's own output). Exit status: 0 when no step failed, 1 when a correctness check
failed or a step errored or ran out of time, 2 when the command cannot run (no CUDA without --dry-run).
docs/status.md says what has run where.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scripts import gpu_check_report as report

REPO = Path(__file__).resolve().parents[1]  # each step runs from here as ``python -m scripts.gpu_check``


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the check: run by ``gpu_check_steps.STEP_FUNCTIONS[name]`` in its own process."""

    name: str
    title: str
    gpu_budget_s: int  # estimated need on an H100/H200 plus a margin; the whole run fits --time-limit
    min_budget_s: int = 20  # not started with less time left
    needs_cuda: bool = False
    gpus: int = 1  # GPUs it needs when not a dry run
    needs_steps: tuple[str, ...] = ()

    def budget_s(self, dry_run: bool) -> int:
        return DRY_RUN_STEP_BUDGET_S if dry_run else self.gpu_budget_s


# A dry run's limits only catch a hang: no lent GPU's time is at stake, and on 2 CPU cores shared with other work a
# step took up to 63 s with one core busy (2026-12-07); with the earlier limits (120-200 s a step, 400 s in all) the
# last steps of a run on a busy machine were skipped for lack of time (issue 62).
DRY_RUN_STEP_BUDGET_S = 600
DRY_RUN_TIME_LIMIT_S = 1800.0
GPU_TIME_LIMIT_S = 470.0


STEPS = (
    Step("kernel_build", "JIT-build the TreeAttention CUDA kernel", 300, 60, needs_cuda=True),
    Step("kernel_correctness", "kernel vs clover.attention.tree_attention, fp32/fp16/bf16", 120, 30,
         needs_cuda=True, needs_steps=("kernel_build",)),
    Step("gpu_engine", "the device engine: lossless from CUDA graphs, step timings at the 8B shape", 150, 60),
    Step("gpu_engine_demo", "the demo model on the device engine: MT-bench speed, bf16 agreement", 240, 60),
    Step("gpu_engine_compile", "the device engine's layers compiled: batch-1 step and verify, compile time", 120, 60),
    Step("gpu_serve", "the device engine served through tritonserver: concurrent answers == solo == generate()", 150,
         60),
    Step("lossless_decode", "speculative decoding on the device == transformers generate()", 120, 30),
    Step("decode_timings", "target pass and draft step at the Llama-3-8B shape, bf16", 150, 60),
    Step("train_step", "one online-feature training step at that shape (training/experiments/cost_probe.py)",
         150, 60),
    Step("distributed_step", "2-process data-parallel training step (nccl; gloo in a dry run)", 120, 45,
         gpus=2),
)
FAULTS = ("lossless", "kernel")  # --inject-fault: tests only, proves a failure reaches the exit status
REPORT_RESERVE_S = 10  # kept back from --time-limit to write the report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (created; files in it are replaced)")
    parser.add_argument("--dry-run", action="store_true", help="CPU only, tiny shapes; CUDA steps are skipped")
    parser.add_argument("--steps", default=",".join(s.name for s in STEPS),
                        help="comma-separated steps to run, in the order above (default: all)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole run; a step gets at most its budget and what is left "
                             f"(default {GPU_TIME_LIMIT_S:.0f} on a GPU, {DRY_RUN_TIME_LIMIT_S:.0f} with --dry-run, where "
                             f"each step may take {DRY_RUN_STEP_BUDGET_S} s: a dry run's limits only catch a hang)")
    parser.add_argument("--build-dir", default="/tmp/clover_tree_attention_ext",
                        help="where torch builds the kernel extension (kept between runs: a rebuild is skipped)")
    parser.add_argument("--inject-fault", choices=FAULTS, help=argparse.SUPPRESS)
    parser.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step in this process
    parser.add_argument("--distributed-worker", action="store_true", help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    unknown = set(args.steps.split(",")) - {s.name for s in STEPS}
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {[s.name for s in STEPS]}")
    args.out, args.build_dir = str(Path(args.out).resolve()), str(Path(args.build_dir).resolve())
    if args.time_limit is None:
        args.time_limit = DRY_RUN_TIME_LIMIT_S if args.dry_run else GPU_TIME_LIMIT_S
    return args


def step_command(step: Step, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "scripts.gpu_check", "--step", step.name, "--out", args.out,
               "--build-dir", args.build_dir]
    if args.dry_run:
        command.append("--dry-run")
    if args.inject_fault:
        command += ["--inject-fault", args.inject_fault]
    return command


def run_child(step: Step, args: argparse.Namespace, budget: float) -> dict:
    """Run one step in its own process group (torchrun's workers included), killed when over ``budget``."""
    out = Path(args.out)
    log_path = out / "logs" / f"{step.name}.log"
    result_path = out / "steps" / f"{step.name}.json"
    result_path.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        child = subprocess.Popen(step_command(step, args), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                 start_new_session=True)
        try:
            child.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return report.outcome("timeout", f"over its {budget:.0f} s budget (killed); log: {log_path}",
                                  seconds=time.monotonic() - start)
    if result_path.exists():
        return json.loads(result_path.read_text())
    return report.outcome("error", f"exited {child.returncode} without a result; "
                                   f"last lines of {log_path}:\n{report.tail(log_path)}",
                          seconds=time.monotonic() - start)


def gate(step: Step, results: dict, env: dict, args: argparse.Namespace) -> str | None:
    """Why ``step`` is skipped without starting it, or None."""
    if step.needs_cuda and args.dry_run:
        return "dry run: this step needs a CUDA GPU"
    if step.needs_cuda and not env["cuda_devices"]:
        return "no CUDA device visible to torch"
    if not args.dry_run and len(env["cuda_devices"]) < step.gpus:
        return f"needs {step.gpus} GPUs, {len(env['cuda_devices'])} visible"
    for needed in step.needs_steps:
        status = results.get(needed, {}).get("status")
        if status != "pass":
            return f"needs {needed}, which did not pass ({status or 'not run'})"
    return None


def run_steps(args: argparse.Namespace, env: dict, started: float) -> dict[str, dict]:
    chosen = args.steps.split(",")
    results: dict[str, dict] = {}
    for step in STEPS:
        if step.name not in chosen:
            continue
        left = args.time_limit - (time.monotonic() - started) - REPORT_RESERVE_S
        budget = min(step.budget_s(args.dry_run), left)
        reason = gate(step, results, env, args)
        if reason is None and budget < step.min_budget_s:
            reason = f"time limit: {left:.0f} s left, the step needs at least {step.min_budget_s} s"
        print(f"== {step.name}: {step.title}" + (f" (budget {budget:.0f} s)" if reason is None else ""), flush=True)
        result = report.outcome("skip", reason) if reason else run_child(step, args, budget)
        result.update(name=step.name, title=step.title, budget_s=None if reason else round(budget))
        results[step.name] = result
        print(report.status_line(result), flush=True)
        report.write(Path(args.out), env, results, args.time_limit)  # after each step: a killed run keeps it
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.distributed_worker:
        from scripts.gpu_check_steps import distributed_worker

        return distributed_worker(args)
    if args.step:
        from scripts.gpu_check_steps import run_step

        return run_step(args)
    out = Path(args.out)
    for sub in ("steps", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = report.environment(args, sys.argv[1:] if argv is None else argv)
    print(report.environment_line(env), flush=True)
    if not env["cuda_devices"] and not args.dry_run:
        print("no CUDA device is visible to torch: nothing to check on a GPU here; "
              "`--dry-run` checks the plumbing on the CPU", file=sys.stderr)
        report.write(out, env, {}, args.time_limit)
        return 2
    results = run_steps(args, env, started)
    print(report.text_table(results))
    print(f"report: {out / 'report.json'}  summary: {out / 'summary.md'}")
    return 1 if report.any_failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
