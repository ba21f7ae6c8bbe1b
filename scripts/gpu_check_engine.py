"""The ``gpu_engine`` step of scripts/gpu_check.py: the device engine (clover/backends/device.py,
docs/gpu-engine.md) checked and measured.

1. lossless: the device step in fp32 equals transformers ``generate()`` on a tiny random Llama: random Clover and
   Medusa heads, oracle heads, vanilla; batch 1 and 4; on a GPU from CUDA graphs, and a replay that never
   synchronises.
2. timings at the Llama-3-8B shape in bf16 (random weights, 1,024 cached tokens): the tree-verify pass at
   T 1/8/16/32/64, the vanilla step and the whole Clover step (3 heads, budgets 8 and 32), at batch 1/8/32,
   against the memory bound at the copy rate measured in the same run and against the probe's numbers.
3. demo: SmolLM2-135M with its shipped heads on MT-bench first turns, where the demo model is installed.

``--dry-run`` runs all of it on the CPU at tiny shapes, eagerly (no CUDA graphs there).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from scripts import gpu_check_report as report
from scripts.gpu_check_common import Skip, built_kernel, on_device, require_transformers, shape_name

NEW_TOKENS = 24
# ../shared/probes/gpu_graph_pass.py on one H200, 2026-12-04: a compiled layer + CUDA graph, ms (issue 44)
PROBE_MS = {(1, 1): 4.87, (1, 64): 6.50, (8, 1): 5.37, (8, 16): 8.38, (32, 1): 6.91, (32, 16): 24.0}


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    shape: str
    dtype: torch.dtype
    batches: tuple[int, ...] = (1, 8, 32)
    trees: tuple[int, ...] = (1, 8, 16, 32, 64)
    budgets: tuple[int, ...] = (8, 32)
    past: int = 1024
    max_seq_len: int = 2048
    repeats: int = 20


def plan_for(ctx) -> EnginePlan:
    if ctx.dry_run:
        return EnginePlan("gpu-check-tiny", torch.float32, batches=(1, 4), trees=(1, 8, 16), budgets=(8,), past=16,
                          max_seq_len=128, repeats=2)
    return EnginePlan("llama3-8b", torch.bfloat16)


# -- 1. lossless ------------------------------------------------------------------------------------------


def lossless_rows(ctx) -> list[list]:
    from clover.backends.device import DeviceEngine
    from tests.helpers import DeviceOracleEngine, hf_greedy, random_prompts
    from tests.random_models import make_drafter, make_target

    target = make_target(seed=3, head_dim=64)
    rows = []
    for batch in (1, 4):
        prompts = random_prompts(batch, batch, target.config.vocab_size, 3, 16)
        expected = hf_greedy(target, prompts, NEW_TOKENS)  # transformers on the CPU, fp32
        model = on_device(target, ctx)  # a copy; --inject-fault lossless negates its LM head

        def heads(method, seed):
            return make_drafter(target, method=method, num_heads=3, seed=seed).to(ctx.device)
        cases = {"vanilla": (DeviceEngine(model, None, max_seq_len=128), "vanilla"),
                 "Clover, random heads": (DeviceEngine(model, heads("clover", 11), max_seq_len=128), "clover"),
                 "Medusa, random heads": (DeviceEngine(model, heads("medusa", 12), max_seq_len=128), "medusa"),
                 "Clover, oracle heads": (DeviceOracleEngine(model, prompts, expected), "clover")}
        for name, (engine, method) in cases.items():
            rows.append([name, batch, *_decode_against(engine, method, prompts, expected, ctx)])
        # seeded sampling: each position's draw is a hash of (seed, position), so Clover from graphs must sample
        # what vanilla samples with the same seeds, run eagerly (docs/gpu-engine.md#sampling-seeds)
        eager = DeviceEngine(model, None, max_seq_len=128, cuda_graphs=False)
        sampled = [r.token_ids for r in _decode(eager, "vanilla", prompts, sampled=True)[0]]
        rows.append(["Clover, random heads, sampled (seeded) vs vanilla eager", batch,
                     *_decode_against(cases["Clover, random heads"][0], "clover", prompts, sampled, ctx, True)])
    return rows


def _decode(engine, method, prompts, sampled: bool = False):
    """(results, decoder) of greedy decoding, or sampling at temperature 1 with seed 7 + the prompt's index."""
    from clover.config import SamplingConfig, TreeConfig
    from clover.decode import GenerationRequest, SpeculativeDecoder

    decoder = SpeculativeDecoder(engine, method, TreeConfig(budget=8, adaptive=False), max_batch_size=len(prompts))
    sampling = SamplingConfig(temperature=1.0) if sampled else SamplingConfig()
    return decoder.generate([GenerationRequest(p, max_new_tokens=NEW_TOKENS, stop_token_ids=(), sampling=sampling,
                                               seed=7 + i) for i, p in enumerate(prompts)]), decoder


def _decode_against(engine, method, prompts, expected, ctx, sampled: bool = False) -> list:
    """[status, tokens/step, graphs, detail] of one run against the reference tokens."""
    results, decoder = _decode(engine, method, prompts, sampled)
    got, stepper = [r.token_ids for r in results], decoder.device_stepper
    mismatched = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    detail = f"sequence {mismatched[0]} differs" if mismatched else "equal"
    if not mismatched and ctx.device.type == "cuda":
        detail = _sync_free_replay(stepper)
    per_step = sum(r.tokens_per_step for r in results) / len(results)
    return ["pass" if detail == "equal" else "fail", round(per_step, 3), len(stepper.graphs), detail]


def _sync_free_replay(stepper) -> str:
    """"equal" when replaying a captured step raises no synchronisation error, else why not."""
    if not stepper.graphs:
        return "no step ran from a CUDA graph"
    torch.cuda.set_sync_debug_mode("error")
    try:
        stepper.graphs[0].replay()
    except RuntimeError as exc:
        return f"a graph replay synchronised: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "equal"


# -- 2. timings at the 8B shape -----------------------------------------------------------------------------


def copy_rate(device: torch.device, gib: int = 4) -> float | None:
    """Bytes read + written per second by a large device copy (the probe's measure); None on a CPU."""
    if device.type != "cuda":
        return None
    a = torch.empty(gib * (1 << 29), dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    seconds = timed(lambda: b.copy_(a), 10, device)
    return 2 * a.numel() * a.element_size() / seconds


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median wall seconds of ``fn()`` after a warm-up, the device drained around each run
    (training/experiments/cost_probe.py's measure, so a whole step's host work counts too)."""
    from training.experiments.cost_probe import timed as wall_and_cpu_seconds

    return wall_and_cpu_seconds(fn, repeats, device)[0]


def step_engines(ctx, plan: EnginePlan):
    """(vanilla engine, Clover engine) over one random-weight target of the plan's shape."""
    from clover.backends.device import DeviceEngine
    from clover.drafters import Drafter, new_drafter_config
    from training.experiments import cost_probe

    shape_name(ctx)  # registers the tiny shape
    target = cost_probe.random_target(plan.shape, plan.dtype, ctx.device)
    with torch.device(ctx.device):
        drafter = Drafter.from_target(new_drafter_config("clover", 3, target), target).eval().requires_grad_(False)
    drafter.to(plan.dtype)
    return (DeviceEngine(target, None, max_seq_len=plan.max_seq_len),
            DeviceEngine(target, drafter, max_seq_len=plan.max_seq_len))


def filled_stepper(engine, batch: int, plan: EnginePlan):
    """A stepper over a cache of ``batch`` rows holding ``plan.past`` tokens each."""
    from clover.kv_cache import KVCache

    spec = engine.spec
    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, spec.dtype,
                    capacity=batch, device=str(engine.device))
    cache.add_rows(batch)
    cache.advance([plan.past] * batch)
    return engine.device_stepper(cache, batch)


def step_ms(engine, batch: int, budget: int, plan: EnginePlan, ctx) -> float:
    """One whole step (inputs up, graph replay, the device-to-host copy), ms."""
    stepper = filled_stepper(engine, batch, plan)
    shape = stepper.shape(batch, budget, 3 if budget else 0, 8)
    roots = [1] * batch
    return round(timed(lambda: stepper.step(shape, roots), plan.repeats, ctx.device) * 1e3, 3)


def verify_ms(engine, batch: int, tokens: int, plan: EnginePlan, ctx) -> float:
    """The target pass over a random tree of ``tokens`` (in a CUDA graph on a GPU), ms."""
    from clover.backends.device import kv_bucket
    from clover.device_step import DeviceTree, ancestor_masks, verify

    stepper = filled_stepper(engine, batch, plan)
    stepper.lengths[:batch] = plan.past
    gen = torch.Generator().manual_seed(tokens)
    parents = torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, tokens)]])
    depth = ancestor_masks(parents, tokens).sum(-1) - 1
    tree = DeviceTree(*(t.expand(batch, *t.shape[1:]).to(ctx.device) for t in (
        torch.randint(0, 100, (1, tokens)), depth, parents, ancestor_masks(parents, tokens))), int(depth.max()))
    keys, values = stepper.cache.buffers
    layers, kv_len = keys.shape[0], kv_bucket(plan.past + tokens, plan.max_seq_len)

    def target(ids, positions, attention):
        return engine.device_target(ids, positions, attention, [keys[i, :batch] for i in range(layers)],
                                    [values[i, :batch] for i in range(layers)])

    def run():
        return verify(target, tree, stepper.lengths[:batch], kv_len)

    with torch.inference_mode():
        fn = _graphed(run) if ctx.device.type == "cuda" else run
        return round(timed(fn, plan.repeats, ctx.device) * 1e3, 3)


def _graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def attention_engines(ctx, vanilla, plan: EnginePlan) -> tuple[dict, str | None]:
    """{"sdpa": engine, "kernel": engine} over the vanilla engine's target, each with its attention forced; the
    kernel's only when kernel_build passed in this run (its extension is then loaded, not rebuilt), else why not."""
    from clover.backends.device import DeviceEngine

    engines = {"sdpa": DeviceEngine(vanilla.target_step.target, None, max_seq_len=plan.max_seq_len, attention="sdpa")}
    extension, why_not = built_kernel(ctx)
    if extension is not None:
        engines["kernel"] = DeviceEngine(vanilla.target_step.target, None, max_seq_len=plan.max_seq_len,
                                         attention="kernel")
    return engines, why_not


def chosen_attention(engine, batch: int, tokens: int, plan: EnginePlan) -> str:
    """What the auto attention of ``engine`` took for this verify pass (after it ran)."""
    from clover.backends.device import kv_bucket

    timings = engine.attention.timings.get((batch, tokens, kv_bucket(plan.past + tokens, plan.max_seq_len)))
    return "SDPA (no kernel)" if timings is None else ("kernel" if timings[1] < timings[0] else "SDPA")


SLOW_PATH = (16, 16, 4096)  # batch, tree tokens, cached tokens: the kernel's slow shape (docs/results/gpu)


def slow_path_row(engines: dict, ctx) -> list:
    """[shape, SDPA ms, kernel ms, auto's pick] of one attention call at the kernel's slow shape, timed as the
    auto attention times it at load."""
    from clover.backends.attention_choice import AttentionChoice

    kernel = engines.get("kernel")
    if kernel is None:
        return ["B 16 × T 16 × past 4096", None, None, "SDPA (no kernel)"]
    batch, tokens, past = SLOW_PATH
    choice = AttentionChoice("auto", kernel.attention.kernel, (kernel.attention.num_heads,
                             kernel.attention.num_kv_heads, kernel.attention.head_dim), kernel.spec.dtype, ctx.device)
    choice.kernel_for(batch, tokens, past + tokens)
    sdpa, by_kernel = choice.timings[(batch, tokens, past + tokens)]
    return ["B 16 × T 16 × past 4096", round(sdpa * 1e3, 3), round(by_kernel * 1e3, 3),
            "kernel" if by_kernel < sdpa else "SDPA"]


def verify_rows_for(ctx, vanilla, engines: dict, plan: EnginePlan) -> list[list]:
    """[batch, tree tokens, auto ms, ÷ one-token pass, SDPA ms, kernel ms, probe ms, auto's pick] per shape."""
    rows = []
    for batch in plan.batches:
        one = verify_ms(vanilla, batch, 1, plan, ctx)
        for tokens in plan.trees:
            ms = one if tokens == 1 else verify_ms(vanilla, batch, tokens, plan, ctx)
            forced = {name: verify_ms(engine, batch, tokens, plan, ctx) for name, engine in engines.items()}
            probe = PROBE_MS.get((batch, tokens)) if plan.shape == "llama3-8b" else None
            rows.append([batch, tokens, ms, round(ms / one, 3), forced["sdpa"], forced.get("kernel"), probe,
                         chosen_attention(vanilla, batch, tokens, plan)])
    return rows


def step_rows_for(ctx, vanilla, clover, plan: EnginePlan, bound_ms: float | None) -> list[list]:
    rows = []
    for batch in plan.batches:
        base = step_ms(vanilla, batch, 0, plan, ctx)
        rows.append([batch, "vanilla", base, 1.0, None if bound_ms is None else round(base / bound_ms, 3)])
        for budget in plan.budgets:
            ms = step_ms(clover, batch, budget, plan, ctx)
            rows.append([batch, f"Clover, 3 heads, budget {budget}", ms, round(ms / base, 3), None])
    return rows


def timing_tables(ctx, plan: EnginePlan) -> tuple[list[dict], dict]:
    vanilla, clover = step_engines(ctx, plan)
    engines, why_not = attention_engines(ctx, vanilla, plan)
    rate = copy_rate(ctx.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in vanilla.target_step.parameters())
    bound_ms = round(weight_bytes / rate * 1e3, 3) if rate else None
    verify_rows = verify_rows_for(ctx, vanilla, engines, plan)
    step_rows = step_rows_for(ctx, vanilla, clover, plan, bound_ms)
    slow = slow_path_row(engines, ctx)
    kernel_note = "timed" if "kernel" in engines else why_not
    tables = [report.table("tree-verify pass (target only), ms: attention auto (the default: the faster per shape, "
                           f"timed at load), SDPA, and the TreeAttention kernel ({kernel_note})",
                           ["batch", "tree tokens", "auto ms", "÷ one-token pass", "SDPA ms", "kernel ms",
                            "probe ms", "auto took"], verify_rows),
              report.table("one attention call at the kernel's slow shape, ms (auto's own timing at load)",
                           ["shape", "SDPA ms", "kernel ms", "auto takes"], [slow]),
              report.table("whole decode step (inputs up, graph, one copy back), ms",
                           ["batch", "step", "ms", "÷ vanilla step", "÷ memory bound"], step_rows)]
    tables.append(report.table("aims (issue 44, on one H200)", ["aim", "measured", "target", "met"],
                               aim_rows(verify_rows, step_rows, plan)))
    data = {"copy_bytes_per_s": rate, "weight_bytes": weight_bytes, "bound_ms": bound_ms, "verify": verify_rows,
            "slow_path": slow, "steps": step_rows, "plan": {k: str(v) for k, v in dataclasses.asdict(plan).items()}}
    return tables, data


def aim_rows(verify_rows, step_rows, plan: EnginePlan) -> list[list]:
    """The aims the timings can answer: [aim, measured, target, met]; absent shapes are left out."""
    verify = {(b, t): ratio for b, t, _, ratio, *_ in verify_rows}
    steps = {(b, name): (ms, ratio) for b, name, ms, ratio, _ in step_rows}
    budget = max(plan.budgets)
    wanted = [("vanilla step, batch 1, ms", steps.get((1, "vanilla"), (None,))[0], 4.6),
              ("verify 64 tokens ÷ 1, batch 1", verify.get((1, 64)), 1.25),
              ("verify 16 tokens ÷ 1, batch 8", verify.get((8, 16)), 1.4),
              (f"Clover step (budget {budget}) ÷ vanilla step, batch 1",
               steps.get((1, f"Clover, 3 heads, budget {budget}"), (None, None))[1], 1.5)]
    return [[name, value, f"≤ {limit}", value <= limit] for name, value, limit in wanted if value is not None]


# -- the step ---------------------------------------------------------------------------------------------


def gpu_engine(ctx) -> dict:
    require_transformers()
    rows = lossless_rows(ctx)
    columns = ["case", "batch", "status", "tokens/step", "CUDA graphs", "vs generate()"]
    tables = [report.table(f"device step, {NEW_TOKENS} new tokens, fp32 on {ctx.device.type}; reference: "
                           "transformers generate() on the CPU", columns, rows)]
    plan = plan_for(ctx)
    timing, data = timing_tables(ctx, plan)
    tables += timing
    data["lossless"] = [dict(zip(columns, row)) for row in rows]
    notes = [f"timings: {plan.shape}, {str(plan.dtype).removeprefix('torch.')}, {plan.past} cached tokens, median of "
             f"{plan.repeats}; random weights; attention auto unless named"]
    failed = [f"{r[0]} (batch {r[1]}): {r[5]}" for r in rows if r[2] != "pass"]
    if failed:
        return report.outcome("fail", "; ".join(failed), data=data, tables=tables, notes=notes)
    return report.outcome("pass", f"{len(rows)} device-step runs equal generate(); timings taken", data=data,
                          tables=tables, notes=notes)


# -- 3. the demo model with its shipped heads ---------------------------------------------------------------


DEMO_NEW_TOKENS = 128
DEMO_GENERATE_PROMPTS = 10  # transformers generate() is slow: this many prompts only
DEFAULTS = "Clover's defaults"  # the engine's tree defaults (trees of 32 on a GPU, the budget adaptive)


def demo_inputs(ctx):
    """(target, heads, prompts, what) of the demo run: SmolLM2-135M, its shipped Clover heads and the 80 MT-bench
    first turns; a tiny random model and 4 random prompts in a dry run."""
    if ctx.dry_run:
        from tests.helpers import random_prompts
        from tests.random_models import make_drafter, make_target

        target = make_target(seed=5)
        return target, make_drafter(target, num_heads=3, seed=15), random_prompts(5, 4, 97, 3, 16), "tiny random"
    from clover.config import ConfigError
    from clover.demo import DemoModelMissing, resolve_target, shipped_heads
    from clover.drafters import load_drafter
    from clover.prompts import encode_prompt, mtbench_first_turns
    from clover.target import load_target, load_tokenizer

    try:
        path = resolve_target("demo")
        questions = mtbench_first_turns()
    except (DemoModelMissing, ConfigError) as exc:
        raise Skip(f"{exc} (docs/gpu-engine.md#bringing-the-demo-model-to-a-gpu)") from None
    target, tokenizer = load_target(path), load_tokenizer(path)
    prompts = [encode_prompt(tokenizer, q["prompt"]) for q in questions]
    return target, load_drafter(shipped_heads("clover"), target), prompts, "SmolLM2-135M-Instruct, shipped heads"


def timed_generation(engine, method: str, tree, prompts, batch: int, new_tokens: int):
    """(results, seconds) of one run with ``tree`` (a TreeConfig); the decoder captures its graphs (and, for an
    adaptive tree, times its steps) when it is made, and a first short run (untimed) warms up what remains."""
    from clover.decode import GenerationRequest, SpeculativeDecoder

    decoder = SpeculativeDecoder(engine, method, tree, max_batch_size=batch)

    def run(chosen, tokens):
        return decoder.generate([GenerationRequest(p, max_new_tokens=tokens, stop_token_ids=()) for p in chosen])

    run(prompts[:batch], 8)
    _sync(engine.device)
    began = time.perf_counter()
    results = run(prompts, new_tokens)
    _sync(engine.device)
    return results, time.perf_counter() - began


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_generate_seconds(target, prompts, new_tokens: int, dtype, ctx, static: bool = False) -> float:
    """Seconds of transformers generate() one prompt at a time: eager with its dynamic cache, or (``static``) with
    its static cache, which transformers compiles where it can; a first prompt warms up untimed."""
    from tests.helpers import hf_model

    model = hf_model(target, dtype).to(ctx.device)
    options = {"cache_implementation": "static"} if static else {}

    def run(prompt):
        ids = torch.tensor([prompt], device=ctx.device)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, num_beams=1, **options)

    if static:
        run(prompts[0])
    _sync(ctx.device)
    began = time.perf_counter()
    for prompt in prompts:
        run(prompt)
    _sync(ctx.device)
    return time.perf_counter() - began


def hf_rows(target, prompts, new_tokens: int, dtype, ctx) -> list[list]:
    """[1, what, tokens/s, 1.0] of transformers generate(), eager and with its static cache; a way that fails
    here is a row saying why (the issue asks for it "if it works there")."""
    rows = []
    for name, static in (("eager", False), ("static cache", True)):
        what = f"transformers generate(), {name} ({len(prompts)} prompts)"
        try:
            seconds = hf_generate_seconds(target, prompts, new_tokens, dtype, ctx, static)
        except Exception as exc:  # recorded in the table, the step goes on
            rows.append([1, f"{what}: failed, {type(exc).__name__}: {str(exc)[:120]}", None, None])
            continue
        rows.append([1, what, round(len(prompts) * new_tokens / seconds, 1), 1.0])
    return rows


def demo_aim_rows(rows: list[list]) -> list[list]:
    """[aim, measured, target, met] of the demo's speed aims (issue 44), from the speed rows."""
    rate = {(batch, name): tokens_per_s for batch, name, tokens_per_s, _ in rows}
    eager = next((r for (b, n), r in rate.items() if n.startswith("transformers generate(), eager") and r), None)
    wanted = [("batch 1: Clover's defaults ÷ vanilla", rate.get((1, DEFAULTS)), rate.get((1, "vanilla")), 2.0),
              ("batch 1: Clover's defaults ÷ transformers generate(), eager", rate.get((1, DEFAULTS)), eager, 10.0),
              ("batch 8: Clover's defaults ÷ vanilla", rate.get((8, DEFAULTS)), rate.get((8, "vanilla")), 1.3)]
    return [[name, round(a / b, 3), f"≥ {aim}", a / b >= aim] for name, a, b, aim in wanted if a and b]


def agreement(a, b) -> float:
    """Share of sequences whose tokens are identical."""
    return round(sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / len(a), 3)


def gpu_engine_demo(ctx) -> dict:
    from clover.backends.device import DeviceEngine
    from clover.config import TreeConfig

    target, heads, prompts, what = demo_inputs(ctx)
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    fast = DeviceEngine(copy_to(target, ctx, dtype), copy_to(heads, ctx, dtype), max_seq_len=2048)
    reference = DeviceEngine(copy_to(target, ctx, torch.float32), None, max_seq_len=2048)
    new_tokens = 16 if ctx.dry_run else DEMO_NEW_TOKENS
    rows, runs = [], {}
    trees = {"vanilla": TreeConfig(budget=0, adaptive=False), DEFAULTS: fast.tree_defaults,
             "Clover, budget 8": TreeConfig(budget=8, adaptive=False),
             "Clover, budget 32": TreeConfig(budget=32, adaptive=False)}
    for batch in (1, 8):
        for name, tree in trees.items():
            method = "vanilla" if name == "vanilla" else "clover"
            results, seconds = timed_generation(fast, method, tree, prompts, batch, new_tokens)
            runs[(name, batch)] = results
            tau = sum(r.tokens_per_step for r in results) / len(results)
            rows.append([batch, name, round(len(prompts) * new_tokens / seconds, 1), round(tau, 3)])
    rows += hf_rows(target, prompts[:DEMO_GENERATE_PROMPTS], new_tokens, dtype, ctx)
    fp32, _ = timed_generation(reference, "vanilla", trees["vanilla"], prompts, 8, new_tokens)
    agree = [[name, agreement(runs[(name, 8)], runs[("vanilla", 8)]), agreement(runs[(name, 8)], fp32)]
             for name in trees]
    tables = [report.table(f"{what}, {len(prompts)} prompts, {new_tokens} new tokens, "
                           f"{str(dtype).removeprefix('torch.')} on {ctx.device.type}", ["batch", "decoding", "tokens/s",
                                                                                   "tokens/step"], rows),
              report.table("agreement at batch 8 (share of prompts with identical tokens)",
                           ["decoding", "= vanilla, same precision", "= fp32 vanilla"], agree),
              report.table("aims (issue 44, on one H200)", ["aim", "measured", "target", "met"], demo_aim_rows(rows))]
    data = {"speed": rows, "agreement": agree, "what": what, "new_tokens": new_tokens, "aims": demo_aim_rows(rows)}
    modelled = modelled_8b_rows(ctx.prior("gpu_engine").get("data", {}), rows)
    if modelled:
        tables.append(report.table("MODELLED Llama-3-8B speed: the 8B step times of gpu_engine with the demo's "
                                   "tokens/step (not a measurement of an 8B model)",
                                   ["batch", "decoding", "step ms (8B shape)", "tokens/step (demo)",
                                    "modelled tokens/s per sequence"], modelled))
        data["modelled_8b"] = modelled
    return report.outcome("pass", f"{len(rows)} runs timed; agreement measured", data=data, tables=tables)


def modelled_8b_rows(engine_data: dict, demo_rows: list[list]) -> list[list]:
    """tokens/step of the demo run × 1 / the 8B step time, per batch and decoding both measured; [] without the
    gpu_engine step's timings."""
    steps = {(b, name): ms for b, name, ms, _, _ in engine_data.get("steps", [])}
    rows = []
    for batch, name, _, tau in demo_rows:
        step_name = "vanilla" if name == "vanilla" else f"Clover, 3 heads, {name.split(', ')[-1]}"
        ms = steps.get((batch, step_name))
        if ms:
            rows.append([batch, name, ms, tau, round(tau * 1e3 / ms, 1)])
    return rows


def copy_to(module, ctx, dtype):
    import copy

    return copy.deepcopy(module).to(device=ctx.device, dtype=dtype)


# -- 4. torch.compile of the layers ---------------------------------------------------------------------------


def gpu_engine_compile(ctx) -> dict:
    """The vanilla step and the widest verify pass at batch 1, from CUDA graphs, before and after compiling the
    decoder layers (DeviceEngine(compile_layers=True)), and the compile's time (the first calls after it)."""
    from clover.backends.device import compile_decoder_layers

    plan = plan_for(ctx)
    vanilla, _ = step_engines(ctx, plan)
    widest = max(plan.trees)

    def measure() -> list[float]:
        return [step_ms(vanilla, 1, 0, plan, ctx), verify_ms(vanilla, 1, 1, plan, ctx),
                verify_ms(vanilla, 1, widest, plan, ctx)]

    before = measure()
    compile_decoder_layers(vanilla.target_step)
    began = time.perf_counter()
    with torch.inference_mode():  # the first calls compile: one shape of each kind
        for tokens in (1, widest):
            verify_ms(vanilla, 1, tokens, dataclasses.replace(plan, repeats=1), ctx)
    compile_s = round(time.perf_counter() - began, 1)
    after = measure()
    names = ["vanilla step", "verify, 1 token", f"verify, {widest} tokens"]
    rows = [[name, b, a, round(a / b, 3)] for name, b, a in zip(names, before, after)]
    how = "CUDA graph" if ctx.device.type == "cuda" else "eager (dry run)"
    tables = [report.table(f"batch 1, {plan.shape}, {str(plan.dtype).removeprefix('torch.')}: {how}, without and "
                           f"with compiled layers (compile and first captures: {compile_s} s)",
                           ["what", "ms", "compiled ms", "÷"], rows)]
    data = {"rows": rows, "compile_seconds": compile_s}
    return report.outcome("pass", f"compiled in {compile_s} s; vanilla step {before[0]} -> {after[0]} ms", data=data,
                          tables=tables)
