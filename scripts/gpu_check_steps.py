"""The steps of scripts/gpu_check.py, each run in its own process by ``gpu_check.py --step NAME``.

A step returns :func:`gpu_check_report.outcome` (pass / fail with tables) or raises :class:`Skip`; any other
exception is recorded as an error. Shapes: the GPU run uses the Llama-3-8B shape of training/experiments/cost_probe.py,
``--dry-run`` a tiny one on the CPU (same code, same tables).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from scripts import gpu_check_engine, gpu_check_serve, gpu_check_report as report
from scripts.gpu_check_common import (REPO, Context, Skip, built_kernel, load_kernel, on_device, require_transformers,
                                      shape_name)
from scripts.gpu_check_attention import attention_variants, gpu_checks_module, kernel_attention, use_attention

LOSSLESS_NEW_TOKENS = 24


def run_step(args) -> int:
    """Run ``args.step`` and write its result to ``OUT/steps/NAME.json``."""
    ctx = Context(args.dry_run, Path(args.out), Path(args.build_dir), args.inject_fault)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons stay in true fp32
    torch.backends.cudnn.allow_tf32 = False
    start = time.monotonic()
    try:
        result = STEP_FUNCTIONS[args.step](ctx)
    except Skip as skip:
        result = report.outcome("skip", str(skip))
    except Exception as exc:  # recorded, with the traceback in the step's log
        traceback.print_exc()
        result = report.outcome("error", f"{type(exc).__name__}: {exc}"[:3000])
    result["seconds"] = round(time.monotonic() - start, 1)
    (ctx.out / "steps" / f"{args.step}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


# -- the kernel --------------------------------------------------------------------------------------------


def kernel_build(ctx: Context) -> dict:
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return report.outcome("error", "nvcc not found (no CUDA_HOME, no nvcc on PATH): the kernel is JIT-built "
                                       "with nvcc (clover/kernels)")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    start = time.monotonic()
    load_kernel(ctx)
    seconds = time.monotonic() - start
    major, minor = torch.cuda.get_device_capability()
    data = {"seconds": round(seconds, 1), "sm": f"{major}{minor}", "cuda_home": cpp_extension.CUDA_HOME,
            "build_dir": str(ctx.build_dir), "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    return report.outcome("pass", f"built (or loaded) for sm_{major}{minor} in {seconds:.0f} s", data=data)


def _kernel_summary(gpu_checks, rows: list[dict]) -> list[list]:
    summary = []
    for dtype, (atol, rtol) in gpu_checks.TOLERANCES.items():
        name = str(dtype).removeprefix("torch.")
        cases = [r for r in rows if r["dtype"] == name]
        summary.append([name, f"{atol:g} + {rtol:g} x |ref|", len(cases), sum(r["T"] > 32 for r in cases),
                        max((r["T"] for r in cases), default=0), sum(not r["ok"] for r in cases),
                        max((r["max_abs_err"] for r in cases), default=0.0)])
    return summary


def kernel_correctness(ctx: Context) -> dict:
    gpu_checks = gpu_checks_module()
    ext = load_kernel(ctx)
    rows = gpu_checks.correctness(ext, ctx.device, num_random=48, seed=0, max_tokens=64)
    bench = gpu_checks.benchmark(ext, ctx.device)
    failed = [r for r in rows if not r["ok"]]
    columns = ["name", "B", "T", "Hq/Hkv", "D", "max_past", "dtype", "splits", "max_abs_err", "ok"]
    bench_columns = list(bench[0]) if bench else []
    tables = [
        report.table("per dtype (tolerance: |kernel - reference| <= atol + rtol x |reference|, elementwise)",
                     ["dtype", "tolerance", "cases", "cases with T > 32", "largest T", "failed", "max abs err"],
                     _kernel_summary(gpu_checks, rows)),
        report.table("every case (the cache beyond past_lengths is NaN for the kernel)", columns,
                     [[r[c] for c in columns] for r in rows]),
        report.table("op-level timing, fp16, median ms (kernel vs SDPA with a mask)", bench_columns,
                     [[r[c] for c in bench_columns] for r in bench]),
    ]
    data = {"cases": rows, "timing": bench,
            "tolerances": {str(k): v for k, v in gpu_checks.TOLERANCES.items()}}
    if failed:
        return report.outcome("fail", f"{len(failed)} of {len(rows)} cases out of tolerance: "
                                      f"{[r['name'] for r in failed][:10]}", data=data, tables=tables)
    return report.outcome("pass", f"all {len(rows)} cases within tolerance", data=data, tables=tables)


# -- lossless decoding -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    name: str
    method: str  # the decoding method
    drafter: str | None = None  # random heads of this method
    oracle: bool = False  # heads that propose the reference continuation (tests/helpers.py OracleEngine)
    kernel: bool = False  # the target's attention through the CUDA kernel

    @property
    def tree(self):
        from clover.config import TreeConfig

        return None if self.method == "vanilla" else TreeConfig(budget=5 if self.oracle else 8)


DECODE_CASES = (
    DecodeCase("vanilla", "vanilla"),
    DecodeCase("Clover, random heads", "clover", drafter="clover"),
    DecodeCase("Clover-2, random heads", "clover2", drafter="clover2"),
    DecodeCase("Clover, oracle heads", "clover", oracle=True),
    DecodeCase("Clover, random heads, CUDA kernel", "clover", drafter="clover", kernel=True),
)


def decode_engine(case: DecodeCase, target, prompts, expected, ctx: Context):
    from clover.backends.torch import TorchEngine
    from tests.helpers import OracleEngine
    from tests.random_models import make_drafter

    if case.oracle:
        return OracleEngine(TorchEngine(on_device(target, ctx), None, max_seq_len=128), prompts, expected, num_heads=3)
    drafter = make_drafter(target, method=case.drafter, num_heads=3, seed=11).to(ctx.device) if case.drafter else None
    return TorchEngine(on_device(target, ctx), drafter, max_seq_len=128)


def first_mismatch(got: list[list[int]], expected: list[list[int]]) -> str:
    for seq, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"sequence {seq}, token {pos}"
    return ""


def decode_case(case: DecodeCase, target, prompts, expected, ctx: Context, kernel) -> list:
    """[case, batch, status, tokens/step, detail] for one decoding run against the reference tokens."""
    from clover.decode import GenerationRequest, SpeculativeDecoder

    ext, why_not = kernel
    if case.kernel and ext is None:
        return [case.name, len(prompts), "skip", None, why_not]
    decoder = SpeculativeDecoder(decode_engine(case, target, prompts, expected, ctx), case.method, case.tree,
                                 max_batch_size=len(prompts))
    requests = [GenerationRequest(p, max_new_tokens=LOSSLESS_NEW_TOKENS, stop_token_ids=()) for p in prompts]
    with use_attention(kernel_attention(ext)) if case.kernel else contextlib.nullcontext():
        results = decoder.generate(requests)
    tokens = [r.token_ids for r in results]
    per_step = sum(r.tokens_per_step for r in results) / len(results)
    detail = first_mismatch(tokens, expected)
    if case.oracle and not detail:  # every step but the last accepts all 3 draft tokens
        short = [r.stats.accepted_per_step[:-1] for r in results if set(r.stats.accepted_per_step[:-1]) - {3}]
        detail = f"oracle drafts rejected: accepted per step {short[0]}" if short else ""
    return [case.name, len(prompts), "fail" if detail else "pass", round(per_step, 3), detail or "equal"]


def lossless_decode(ctx: Context) -> dict:
    require_transformers()
    from tests.helpers import hf_greedy, random_prompts
    from tests.random_models import make_target

    target = make_target(seed=3, head_dim=64)  # D = 64: a head size the kernel supports
    kernel = built_kernel(ctx)
    rows = []
    for batch in (1, 4):
        prompts = random_prompts(batch, batch, target.config.vocab_size, 3, 16)
        expected = hf_greedy(target, prompts, LOSSLESS_NEW_TOKENS)  # transformers on the CPU, fp32
        rows += [decode_case(case, target, prompts, expected, ctx, kernel) for case in DECODE_CASES]
    columns = ["case", "batch", "status", "tokens/step", "vs generate()"]
    tables = [report.table(f"{LOSSLESS_NEW_TOKENS} new tokens per prompt on {ctx.device.type}, fp32, tiny random "
                           "Llama (D = 64, GQA 4/2); reference: transformers generate() on the CPU", columns, rows)]
    data = {"cases": [dict(zip(columns, row)) for row in rows], "target": dataclasses.asdict(target.config)}
    failed = [f"{r[0]} (batch {r[1]}): {r[4]}" for r in rows if r[2] == "fail"]
    if failed:
        return report.outcome("fail", "differs from generate(): " + "; ".join(failed), data=data, tables=tables)
    ran = sum(r[2] == "pass" for r in rows)
    return report.outcome("pass", f"{ran} runs equal generate() token for token", data=data, tables=tables)


# -- decode-step timings -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimingPlan:
    """What decode_timings measures: target passes over ``batches`` x ``trees`` at ``past`` cached tokens,
    draft steps over ``draft_nodes`` nodes, each the median of ``repeats`` after one warm-up."""

    dtype: torch.dtype = torch.bfloat16
    batches: tuple[int, ...] = (1, 8, 32)
    trees: tuple[int, ...] = (1, 8, 32, 64)
    past: int = 1024
    draft_nodes: tuple[int, ...] = (1, 8, 32, 64, 256)
    repeats: int = 5


# by ctx.dry_run; fp32 on the CPU: bf16 matmuls are emulated on CPUs without AVX512-BF16 (10x slower)
TIMING_PLANS = {False: TimingPlan(), True: TimingPlan(dtype=torch.float32, past=16, repeats=1)}


def random_step_inputs(cfg, batch: int, tokens: int, past: int, device: torch.device):
    """input_ids, position_ids, past_lengths and a random tree's packed mask for one target pass."""
    from clover.attention import pack_mask

    visible = gpu_checks_module().random_tree_visible(batch, tokens, random.Random(batch * 100 + tokens))
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), device=device)
    positions = (past + torch.arange(tokens, device=device)).expand(batch, -1).contiguous()
    past_lengths = torch.full((batch,), past, dtype=torch.int32, device=device)
    return ids, positions, past_lengths, pack_mask(visible).to(device)


def timing_models(ctx: Context, plan: TimingPlan):
    """The random-weight target and Clover heads (3, with the Augmenting Block) of this run's shape."""
    from clover.drafters import Drafter, new_drafter_config
    from training.experiments import cost_probe

    target = cost_probe.random_target(shape_name(ctx), plan.dtype, ctx.device)
    with torch.device(ctx.device):
        drafter = Drafter.from_target(new_drafter_config("clover", 3, target), target).eval().requires_grad_(False)
    return target, drafter


def target_pass_row(step, caches, plan: TimingPlan, batch: int, tokens: int, variants: dict, ctx: Context) -> list:
    """[B, T, ms per variant..., max |logit difference| per non-reference variant...] for one pass shape."""
    from training.experiments.cost_probe import timed

    inputs = random_step_inputs(step.target.config, batch, tokens, plan.past, ctx.device)
    keys, values = [c[:batch] for c in caches[0]], [c[:batch] for c in caches[1]]
    times, logits = [], {}
    for name, attend in variants.items():
        with use_attention(attend), torch.inference_mode():
            seconds, _ = timed(lambda: step(*inputs, keys, values), plan.repeats, ctx.device)
            logits[name] = step(*inputs, keys, values).logits[0].float()  # sequence 0's [T, V]
        times.append(round(seconds * 1e3, 3))
    diffs = [float((logits[n] - logits["reference"]).abs().max()) for n in variants if n != "reference"]
    return [batch, tokens, *times, *diffs]


def draft_step_rows(target, drafter, plan: TimingPlan, ctx: Context) -> list[list]:
    from clover.backends.torch import DraftStep
    from training.experiments.cost_probe import timed

    draft = DraftStep(target, drafter, top_k=8).eval()
    rows = []
    for nodes in plan.draft_nodes:
        hidden = torch.randn(nodes, target.config.hidden_size, dtype=plan.dtype, device=ctx.device)
        token = torch.randint(0, target.config.vocab_size, (nodes,), device=ctx.device)
        with torch.inference_mode():
            seconds, _ = timed(lambda: draft(hidden, token, 0), plan.repeats, ctx.device)
        rows.append([nodes, round(seconds * 1e3, 3)])
    return rows


def decode_timings(ctx: Context) -> dict:
    from clover.backends.torch import TargetStep

    plan = TIMING_PLANS[ctx.dry_run]
    target, drafter = timing_models(ctx, plan)
    cfg = target.config
    step = TargetStep(target, drafter).eval()
    ext, why_not = built_kernel(ctx)
    variants = attention_variants(ext)
    shape = (max(plan.batches), cfg.num_kv_heads, plan.past, cfg.head_dim)  # exactly `past` slots: see SdpaAttention
    caches = [[torch.randn(shape, dtype=plan.dtype, device=ctx.device) for _ in range(step.num_kv_layers)]
              for _ in range(2)]
    rows = [target_pass_row(step, caches, plan, b, t, variants, ctx) for b in plan.batches for t in plan.trees]
    others = [n for n in variants if n != "reference"]
    columns = ["batch", "tree tokens", *[f"{n} ms" for n in variants], *[f"max abs logit diff, {n} vs reference" for n in others]]
    where = f"{ctx.device.type}, {str(plan.dtype).removeprefix('torch.')}, {cfg.num_layers} layers + the Augmenting Block"
    notes = [f"shape {shape_name(ctx)}: {json.dumps(dataclasses.asdict(cfg))}",
             f"every sequence has {plan.past} cached tokens; the tree is random; times are the median of "
             f"{plan.repeats} after one warm-up, inputs and caches on the device, logits left there",
             "attention: kernel = the TreeAttention CUDA kernel, sdpa = torch SDPA with a boolean mask built once "
             "per pass, reference = clover.attention.tree_attention (what the torch backend runs)"]
    if ext is None:
        notes.append(f"kernel: not timed ({why_not})")
    tables = [report.table(f"target pass ({where})", columns, rows),
              report.table("draft step (one head: Attention Decoder, ResBlock, LM head, top-8), ms", ["nodes", "ms"],
                           draft_step_rows(target, drafter, plan, ctx))]
    data = {"plan": {k: str(v) for k, v in dataclasses.asdict(plan).items()}, "target_pass": [dict(zip(columns, r)) for r in rows],
            "draft_step": [dict(zip(["nodes", "ms"], r)) for r in tables[1]["rows"]]}
    return report.outcome("pass", f"{len(rows)} target-pass shapes x {len(variants)} attentions timed", data=data,
                          tables=tables, notes=notes)


# -- training ----------------------------------------------------------------------------------------------


def train_step(ctx: Context) -> dict:
    """training/experiments/cost_probe.py with the command docs/train-your-own.md#time gives (smaller in a dry run)."""
    from training.experiments import cost_probe

    shape = shape_name(ctx)
    output = ctx.out / f"cost_probe_{shape.replace('-', '_')}.json"
    sizes = (["--batch-tokens", "128", "--seq-len", "32", "--repeats", "1", "--row-chunk", "16"] if ctx.dry_run
             else ["--batch-tokens", "8192", "--seq-len", "1024", "--repeats", "2"])
    argv = ["--shape", shape, "--device", ctx.device.type, "--autocast", "bf16", "--grad-checkpoint", *sizes,
            "--output", str(output)]
    cost_probe.main(argv)
    result = json.loads(output.read_text())
    rows = [["target forward (online features)", result["target_tokens_per_s"], result["target_forward_s"],
             result["peak_memory_mb"]["target_forward"]],
            ["training step, features given", result["train_tokens_per_s"], result["train_step_s"],
             result["peak_memory_mb"]["train_step"]],
            ["online step (both)", result["online_tokens_per_s"], None, None]]
    tables = [report.table(f"{result['tokens_per_step']} tokens per step, target {result['target_dtype']}, "
                           f"autocast {result['autocast']}", ["part", "tokens/s", "seconds", "peak MB"], rows)]
    notes = [f"command: python -m training.experiments.cost_probe {' '.join(argv)}"]
    return report.outcome("pass", f"{result['online_tokens_per_s']} online tokens/s", data=result, tables=tables,
                          notes=notes)


def distributed_trainer(ctx: Context, dist, device: torch.device):
    """Clover heads' trainer on a random target of this run's shape, and one batch of online features whose
    tokens differ by rank (so the replicas agree only if the gradients really were summed)."""
    from training.experiments import cost_probe
    from training import train as train_mod
    from training.features import online_hidden_states

    torch.manual_seed(0)  # the same target and initial heads on every rank
    target = cost_probe.random_target(shape_name(ctx), torch.float32 if ctx.dry_run else torch.bfloat16, device)
    cfg = train_mod.TrainConfig(method="clover", cache="-", output="-", num_heads=3, autocast="bf16",
                                row_chunk=16 if ctx.dry_run else 1024)
    trainer = train_mod.Trainer(cfg, target, device, dist)
    vocab = target.config.vocab_size
    raw = cost_probe.probe_batch(vocab, 128 if ctx.dry_run else 2048, 32 if ctx.dry_run else 512, device)
    tokens = (raw.tokens + dist.rank) % vocab
    x_in, x_last = online_hidden_states(target, tokens, True, True)
    return trainer, dataclasses.replace(raw, x_in=x_in, x_last=x_last, tokens=tokens)


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in params])


def distributed_worker(args) -> int:
    """One rank of distributed_step (under torchrun): two optimizer steps, then compares the replicas."""
    import torch.distributed as torch_dist
    from training.experiments.cost_probe import timed
    from training.distributed import Distributed, end_torchrun_rank

    ctx = Context(args.dry_run, Path(args.out), Path(args.build_dir), args.inject_fault)
    dist = Distributed.from_env(ctx.device.type)
    device = dist.device(ctx.device)
    trainer, batch = distributed_trainer(ctx, dist, device)
    before = _flat(trainer.params)
    seconds, _ = timed(lambda: trainer.step([batch], 1e-4), 1, device)  # one warm-up step, one timed
    after = _flat(trainer.params)
    rank0 = after.clone()
    torch_dist.broadcast(rank0, src=0)
    spread = torch.tensor([float((after - rank0).abs().max())], device=device)
    torch_dist.all_reduce(spread, op=torch_dist.ReduceOp.MAX)
    if dist.is_main:
        result = {"backend": torch_dist.get_backend(), "world_size": dist.world_size, "step_s": round(seconds, 4),
                  "replica_max_abs_diff": float(spread), "weights_moved": bool((after != before).any()),
                  "trainable_params": after.numel(), "tokens_per_rank": batch.tokens.numel()}
        (ctx.out / "steps" / "distributed_worker.json").write_text(json.dumps(result, indent=1) + "\n")
    dist.barrier()
    dist.close()
    return end_torchrun_rank(0)


def distributed_step(ctx: Context) -> dict:
    result_path = ctx.out / "steps" / "distributed_worker.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "scripts.gpu_check", "--distributed-worker", "--out", str(ctx.out),
               "--build-dir", str(ctx.build_dir), *(["--dry-run"] if ctx.dry_run else [])]
    done = subprocess.run(command, cwd=REPO)  # the parent's budget kills the process group if it hangs
    if done.returncode or not result_path.exists():
        return report.outcome("error", f"torchrun exited {done.returncode} without a result (see this step's log)")
    result = json.loads(result_path.read_text())
    rows = [[result["backend"], result["world_size"], result["tokens_per_rank"], result["step_s"],
             result["replica_max_abs_diff"], result["weights_moved"]]]
    tables = [report.table("one optimizer step of Clover heads, each rank on other tokens",
                           ["backend", "processes", "tokens per rank", "step s", "max abs replica diff",
                            "weights moved"], rows)]
    if result["replica_max_abs_diff"] != 0 or not result["weights_moved"]:
        return report.outcome("fail", "the replicas differ after the step, or the step changed nothing",
                              data=result, tables=tables)
    return report.outcome("pass", f"{result['backend']}: replicas equal after the step", data=result, tables=tables)


# the device engine's steps live in scripts/gpu_check_engine.py (which imports this module's helpers lazily)
STEP_FUNCTIONS = {"gpu_engine": gpu_check_engine.gpu_engine, "gpu_engine_demo": gpu_check_engine.gpu_engine_demo,
                  "gpu_engine_compile": gpu_check_engine.gpu_engine_compile, "gpu_serve": gpu_check_serve.gpu_serve,
                  "kernel_build": kernel_build, "kernel_correctness": kernel_correctness,
                  "lossless_decode": lossless_decode, "decode_timings": decode_timings, "train_step": train_step,
                  "distributed_step": distributed_step}
