"""The benchmark command: ``python -m clover.bench --engine DIR [--medusa-engine DIR] --output results/bench``.

Sweeps (each one measured interleaved in one run: every repeat runs every
configuration of the sweep once, in a rotated order, so drifts in machine
load hit all of them alike; the report gives the median and min–max):

* ``batch``: tokens/s against batch size (1, 2, 4, 8, 16, 32) for vanilla,
  medusa (with ``--medusa-engine``), clover at the fixed budget ``--budget``,
  clover at other fixed budgets (``--fixed-budgets``), adaptive clover
  (the budget chosen per step from the engine's cost model, calibrated here
  when the engine has none) and any ``--extra-engine LABEL=DIR``.
* ``budget``: tokens/step and tokens/s against tree budget (1..32) at batch
  ``--sweep-batch``.
* ``heads``: tokens/step and tokens/s against the number of heads used (tree
  depth 1..K of the engine's K heads; build the engine with ``--num-heads 5``
  for 1..5).
* ``hf``: transformers ``generate()`` at batch 1 (greedy, and prompt lookup)
  on the engine's target checkpoint, against vanilla and clover on the engine.
* ``llamacpp`` (only when named in ``--sweeps``; optional extra ``llamacpp``):
  llama.cpp on the demo GGUF at batch 1, greedy and with its prompt-lookup
  decoding, on the same prompt token ids and ``--threads``, against vanilla and
  the ``clover generate`` defaults on the engine, and vanilla on any
  ``--vanilla-engine LABEL=DIR`` (e.g. the fp32 engine): docs/quantized-target.md.

Outputs in ``--output``: ``bench.json`` (every sample), ``bench.md`` (tables,
ratios against the issue's aims, the hardware, the command) and one PNG per
sweep. ``--quick`` runs small sweeps (a smoke test, not evidence).

* ``peers`` (only when named in ``--sweeps``; optional extras ``bench`` and ``llamacpp``): the runtimes a CPU
  user would compare, at batch 1 on the same prompt token ids and ``--threads``, interleaved: vanilla and the
  ``clover generate`` defaults on the engine (and vanilla on any ``--vanilla-engine``), onnxruntime-genai
  greedy on its model builder's CPU int4 graph of the engine's own target checkpoint (:mod:`clover.bench.genai`), and
  llama.cpp greedy on the demo GGUF. Each peer that is not installed is left out with a note.
* ``passes`` (only when named in ``--sweeps``): one target pass of T = 1, 2, 4, 8, 16, 32 new tokens after
  ``--pass-past`` cached ones at batch 1, on the engine, each ``--vanilla-engine`` and the builder's graph
  (``genai-graph``): where the decode speed comes from.

* ``triton``: the real Triton server (one model per method on these engines,
  started for this sweep only), 1..32 concurrent gRPC streams
  (``--concurrency``), 2 requests per stream: output tokens/s, time to first
  token and inter-token latency p50/p99. Skipped with a note where no
  ``tritonserver`` is found.

Not here: per-category extra tokens/step (``training/evaluate.py`` measures it
with trained heads and the prompt data).

Resuming: every sample is appended to ``--output``/``samples.jsonl`` (one JSON
line, flushed) as soon as it is measured, and ``bench_progress.json`` beside it
records the run key (every setting that changes what is measured: engines,
sweeps, sizes, budgets, repeats, new tokens, prompts, threads; not
``--output`` or ``--silent``), the prompts' token ids (a digest) and any cost
model calibrated by the run. A run that was killed loses at most the sample in
flight: rerun the same command and it measures only the (sweep, configuration,
x, repeat) samples still missing, in the same interleaved order (a configuration
is warmed up once per process, and only if it has something left to measure),
then writes the reports from all samples. A run with other settings on the same
``--output`` stops with an error: pass ``--fresh`` to discard the samples there
and start over, or choose another ``--output``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from clover.bench.cli import OPTIONAL_SWEEPS, SWEEPS, parse_args
from clover.bench.report import METRICS, VANILLA_LINE, aims, markdown, plot, step_costs, summarize
from clover.bench.samples import PROGRESS_FILE, SAMPLES_FILE, SampleStore, run_key, sample_key
from clover.config import ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.progress import progress_bar
from clover.stats import tokens_per_step

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, with a small Python example.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for writing clear technical documentation.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarise the water cycle for a ten-year-old.",
    "How do I read a CSV file with the csv module in Python?",
    "Describe a peaceful morning in a small fishing village.",
]
PASS_TOKENS = (1, 2, 4, 8, 16, 32)
X_LABELS = {"batch": "batch size", "budget": "tree budget (draft nodes)", "heads": "heads used (tree depth)",
            "hf": "batch", "triton": "concurrent streams", "llamacpp": "batch", "peers": "batch",
            "passes": "new tokens in the pass (T)"}
MEDUSA_ENGINE = "medusa"  # the loaded engine of --medusa-engine (``engines`` key, Config.engine)


@dataclasses.dataclass
class Config:
    """One measured configuration of a sweep: ``x`` is the sweep's variable."""

    sweep: str
    x: int
    name: str  # the line in the figure (method label)
    method: str  # decode method, or hf-greedy / hf-prompt-lookup
    batch: int
    tree: TreeConfig | None = None
    engine: str = "clover"  # which loaded engine: clover or MEDUSA_ENGINE


# -- measuring ---------------------------------------------------------------


class TimedEngine:
    """Wraps an engine to split a decode's wall time into target passes, draft steps and host work.

    The target and draft seconds are the engine's own work: the time inside onnxruntime's run calls where the
    engine counts it (``run_seconds``), else the whole call. Host work is the rest: the decode loop and the
    backend's glue around its run calls (docs/results/host-overhead/README.md).
    """

    def __init__(self, inner) -> None:
        self.inner, self.spec = inner, inner.spec
        self.cost_model = getattr(inner, "cost_model", None)
        self.target_seconds = self.draft_seconds = 0.0
        self.target_calls = 0

    def target(self, *args):
        result, own = self._timed(self.inner.target, args)
        self.target_calls += 1
        self.target_seconds += own
        return result

    def draft_step(self, *args):
        result, own = self._timed(self.inner.draft_step, args)
        self.draft_seconds += own
        return result

    def draft_prefill(self, *args):
        """Clover-2's block (engine contract v2): drafting work, counted with the draft steps."""
        result, own = self._timed(self.inner.draft_prefill, args)
        self.draft_seconds += own
        return result

    def totals(self) -> tuple[float, int, float, float]:
        """(now, target calls, target seconds, draft seconds): :func:`step_split` takes two."""
        return time.perf_counter(), self.target_calls, self.target_seconds, self.draft_seconds

    def _timed(self, fn, args) -> tuple[Any, float]:
        """(result, the engine's own seconds in the call)."""
        counted = getattr(self.inner, "run_seconds", None)
        start = time.perf_counter()
        result = fn(*args)
        wall = time.perf_counter() - start
        return result, wall if counted is None else self.inner.run_seconds - counted


def step_split(before: tuple, after: tuple) -> dict:
    """target_ms, draft_ms and host_ms per target pass between two :meth:`TimedEngine.totals`.

    :func:`run_decode` measures from the end of the first step (the prompt pass, the KV cache's allocation
    and a first decode step: once per decode, not per step) to the end of the decode.
    """
    seconds, calls, target, draft = (a - b for a, b in zip(after, before))
    calls = max(calls, 1)
    return {"target_ms": 1000 * target / calls, "draft_ms": 1000 * draft / calls,
            "host_ms": 1000 * (seconds - target - draft) / calls}


def run_decode(engine, config: Config, prompts: list[list[int]], max_new: int, cost_model=None,
               first_prompt: int = 0) -> dict:
    """One timed generation of ``config.batch`` prompts at once (fixed length: no stop tokens).

    Sequence i gets ``prompts[(first_prompt + i) % len(prompts)]``; the caller rotates
    ``first_prompt`` with the repeat, so small batches do not all measure one prompt.
    """
    engine = TimedEngine(engine)
    decoder = SpeculativeDecoder(engine, config.method, config.tree, max_batch_size=config.batch,
                                 cost_model=cost_model)
    requests = [GenerationRequest(prompts[(first_prompt + i) % len(prompts)], max_new_tokens=max_new,
                                  stop_token_ids=()) for i in range(config.batch)]
    first_step: list[tuple] = []  # the totals when the first step has run

    def after_first_step(_event) -> None:
        if not first_step:
            first_step.append(engine.totals())

    start = engine.totals()
    results = decoder.generate(requests, after_first_step)
    end = engine.totals()
    seconds = end[0] - start[0]
    tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.stats.num_steps for r in results)
    deepest = sum(sum(r.stats.depth_tried) for r in results)  # depth_tried[d]: steps whose tree reached d+1
    sample = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
              # no decode step at all (one token per prompt): reported as vanilla's 1 token per step
              "tokens_per_step": tokens_per_step(tokens, steps, len(results)) if steps else 1.0,
              "tree_depth": deepest / steps if steps else 0.0,
              # where the time goes, per decode step after the first (over the whole decode if it had one step)
              **step_split(first_step[0] if end[1] > first_step[0][1] else start, end)}
    if decoder.suffix_on:  # the suffix proposals' host time per decode step, and each source's acceptance
        sample["proposer_ms"] = 1000 * decoder.proposer_seconds / max(steps / len(results), 1)
        sample["source_counts"] = decoder.source_counts
    if decoder.adaptive is not None:
        budgets = [b for _, b in decoder.adaptive.history]
        sample["budgets"] = {str(b): budgets.count(b) for b in sorted(set(budgets))}
    return sample


def run_hf(model, prompt_ids: list[int], max_new: int, lookup: int | None) -> dict:
    """transformers ``generate()`` at batch 1, greedy, exactly ``max_new`` new tokens."""
    ids = torch.tensor([prompt_ids])
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0, **extra)
        seconds = time.perf_counter() - start
    tokens = out.shape[1] - ids.shape[1]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tokens_per_step": None}


class TritonSweep:
    """A tritonserver with one model per measured method, all on the bench's engines.

    The heads' lines pin ``proposer: none`` as the batch sweep's do, so they measure the heads alone;
    ``default-clover`` is what a user gets with no parameters (suffix candidates included).
    ``models`` maps the figure's method label to its Triton model name.
    """

    def __init__(self, args, engines: dict, workdir: Path, log) -> None:
        from clover.serving.repository import write_repository
        from clover.serving.server import TritonServer

        clover_dir = str(engines["clover"].engine_dir)
        engine_method = engines["clover"].spec.default_method  # clover, or clover2 for Clover-2 heads
        models = {"vanilla": ("vanilla", {"engine_dir": clover_dir, "method": "vanilla"}),
                  "clover": ("clover", {"engine_dir": clover_dir, "method": engine_method,
                                        "tree_budget": str(args.budget),
                                        "adaptive": "false", "proposer": "none"}),
                  # the model a user gets with no parameters: adaptive where the engine stores a cost model
                  "default-clover": ("clover_default", {"engine_dir": clover_dir})}
        if MEDUSA_ENGINE in engines:
            models["medusa"] = ("medusa", {"engine_dir": str(engines[MEDUSA_ENGINE].engine_dir), "method": "medusa",
                                           "tree_budget": str(args.budget), "adaptive": "false",
                                           "proposer": "none"})
        if engines["clover"].cost_model is not None:  # the server's adaptive model needs a stored one
            models["adaptive-clover"] = ("clover_adaptive", {"engine_dir": clover_dir, "method": engine_method,
                                                             "adaptive": "true", "proposer": "none",
                                                             "tree_budget": str(args.adaptive_max_budget)})
        for _, params in models.values():
            params["max_batch"] = str(max(args.concurrency))
            if args.threads:
                params["threads"] = str(args.threads)
        self.models = {label: name for label, (name, _) in models.items()}
        repo = write_repository(workdir / "model_repository", dict(models.values()), overwrite=True)
        self.server = TritonServer(repo, 0, 0, 0, host="127.0.0.1", log_file=workdir / "tritonserver.log")
        self.startup_timeout_s, self.log = args.triton_startup_timeout, log

    def start(self) -> None:
        """Started only when its sweep begins, so its processes sit in no other sweep's measurements."""
        self.log(f"starting tritonserver with models {', '.join(self.models.values())} "
                 f"(log: {self.server.log_file})")
        self.server.start()
        self.server.wait_ready(self.startup_timeout_s)

    def close(self) -> None:
        self.server.stop()


def run_triton(triton: TritonSweep, config: Config, texts: list[str], repeat: int, max_new: int) -> dict:
    """``config.x`` concurrent gRPC streams, 2 requests per stream, through the running server."""
    from clover.client import GrpcClient, run_load

    url, model = triton.server.grpc_url, triton.models[config.name]
    rotated = texts[repeat % len(texts):] + texts[: repeat % len(texts)]
    report = run_load(lambda: GrpcClient(url, model), rotated, config.x, num_requests=2 * config.x,
                      max_tokens=max_new)
    if report["errors"]:
        raise RuntimeError(f"triton sweep, {config.name} at {config.x} streams: {report['errors']} requests "
                           f"failed: {report['first_errors']}")
    ttft, itl = report["time_to_first_token"], report["inter_token_latency"]
    return {"tokens": report["output_tokens"], "seconds": report["wall_seconds"],
            "tokens_per_s": report["output_tokens_per_second"], "tokens_per_step": report["tokens_per_step"] or None,
            "ttft_p50_ms": ttft.get("p50_ms"), "ttft_p99_ms": ttft.get("p99_ms"),
            "itl_p50_ms": itl.get("p50_ms"), "itl_p99_ms": itl.get("p99_ms")}


def _rotated(rows: list, repeat: int) -> list:
    shift = repeat % max(len(rows), 1)
    return rows[shift:] + rows[:shift]


def measure_sweeps(configs: dict[str, list[Config]], repeats: int, max_new: int, measure, store: SampleStore,
                   log, progress: bool = True, before_sweep=None) -> list[dict]:
    """Measures every (configuration, repeat) of ``configs`` not yet in ``store``, adding each sample to it
    as soon as it is taken; returns all the store's samples.

    Each repeat of a sweep runs its configurations in an order rotated by the repeat (interleaved), the
    samples already stored left out. ``measure(config, repeat, max_new)`` measures one; before a sweep's
    first measurement, every configuration with something left to measure is warmed up once with
    ``measure(config, 0, min(4, max_new))`` (sessions, allocations, first-call costs; not recorded).
    ``before_sweep(sweep)`` runs before that, for sweeps with something left to measure.
    """
    done = {sample_key(s) for s in store.samples}
    todo = {sweep: [(repeat, config) for repeat in range(repeats) for config in _rotated(rows, repeat)
                    if (sweep, config.name, config.x, repeat) not in done] for sweep, rows in configs.items()}
    total = sum(map(len, todo.values()))
    if store.samples or store.dropped:
        log(f"resumed {len(store.samples)} samples from {store.path}"
            + (f" ({store.dropped} cut or repeated lines ignored)" if store.dropped else "")
            + f"; {total} left to measure")
    with progress_bar(total=total, unit="sample", enabled=progress, dynamic_ncols=True) as bar:
        for sweep, work in todo.items():
            log(f"sweep {sweep}: {len(configs[sweep])} configurations x {repeats} repeats, "
                f"{len(work)} to measure" + (" (+ warm-up)" if work else ""))
            if not work:
                continue
            if before_sweep is not None:
                before_sweep(sweep)
            pending = {(config.name, config.x) for _, config in work}
            for config in configs[sweep]:
                if (config.name, config.x) in pending:
                    bar.set_description(f"{sweep} {config.name} x={config.x} warm-up")
                    measure(config, 0, min(4, max_new))
            for repeat, config in work:
                bar.set_description(f"{sweep} {config.name} x={config.x} repeat {repeat}")
                sample = measure(config, repeat, max_new)
                store.add({"sweep": sweep, "x": config.x, "method": config.name, "batch": config.batch,
                           "repeat": repeat, **sample})
                bar.update()
    return store.samples


# -- the run ------------------------------------------------------------------


def build_configs(args, spec, has_medusa: bool, triton_models: tuple[str, ...] = (),
                  extra_engines: dict[str, str] | None = None, peers=(), passes=()) -> dict[str, list[Config]]:
    """The configurations of every sweep; ``extra_engines`` maps a label to its decode method; ``peers`` /
    ``passes`` name the peer runtimes' decode and pass lines that can run here (:func:`_load_peers`).

    The ``clover`` lines run the main engine's own method (``clover``, or ``clover2`` for Clover-2 heads) with the
    heads alone (proposer ``none``); ``clover+suffix`` merges the suffix index's candidates into the same fixed
    tree, ``suffix`` decodes with them alone (docs/trees.md#model-free-candidates); ``default-clover`` is what
    ``clover generate`` does with no flags (suffix candidates included), ``default-heads`` the same without
    them and ``default-suffix`` what ``--method suffix`` does with no other flag."""
    extra_engines = extra_engines or {}
    heads, engine_method = spec.num_draft_heads, spec.default_method
    configs: dict[str, list[Config]] = {}
    if "batch" in args.sweeps:
        rows = []
        for batch in args.batch_sizes:
            rows.append(Config("batch", batch, VANILLA_LINE, "vanilla", batch))
            if has_medusa:
                rows.append(Config("batch", batch, "medusa", "medusa", batch, _fixed(args.budget), MEDUSA_ENGINE))
            rows.append(Config("batch", batch, "clover", engine_method, batch, _fixed(args.budget)))
            for budget in args.fixed_budgets:
                if budget != args.budget:
                    rows.append(Config("batch", batch, f"clover-b{budget}", engine_method, batch, _fixed(budget)))
            rows.append(Config("batch", batch, "clover+suffix", engine_method, batch, _fixed(args.budget, "suffix")))
            rows.append(Config("batch", batch, "suffix", "suffix", batch, _fixed(args.budget, "suffix")))
            rows.append(Config("batch", batch, "adaptive-clover", engine_method, batch,
                               TreeConfig(budget=args.adaptive_max_budget, adaptive=True)))
            # what `clover generate` does with no flags: adaptive where the engine stores a cost model
            rows.append(Config("batch", batch, "default-clover", engine_method, batch, TreeConfig(budget=args.budget)))
            rows.append(Config("batch", batch, "default-heads", engine_method, batch,
                               TreeConfig(budget=args.budget, proposer="none")))
            # what `clover generate --method suffix` does: adaptive where the engine stores a cost model, so only
            # candidates whose calibrated acceptance pays for their share of the target pass are verified
            rows.append(Config("batch", batch, "default-suffix", "suffix", batch, TreeConfig(budget=args.budget)))
            for label, method in extra_engines.items():
                rows.append(Config("batch", batch, label, method, batch, _fixed(args.budget), label))
        configs["batch"] = rows
    if "budget" in args.sweeps:
        rows = []
        for budget in args.budgets:
            rows.append(Config("budget", budget, "clover", engine_method, args.sweep_batch, _fixed(budget)))
            rows.append(Config("budget", budget, "clover+suffix", engine_method, args.sweep_batch, _fixed(budget, "suffix")))
            if has_medusa:
                rows.append(Config("budget", budget, "medusa", "medusa", args.sweep_batch, _fixed(budget),
                                   MEDUSA_ENGINE))
        configs["budget"] = rows
    if "heads" in args.sweeps:
        configs["heads"] = [Config("heads", k, "clover", engine_method, args.sweep_batch,
                                   TreeConfig(budget=args.budget, depth=k, adaptive=False, proposer="none"))
                            for k in range(1, heads + 1)]
    if "hf" in args.sweeps:
        configs["hf"] = [Config("hf", 1, VANILLA_LINE, "vanilla", 1),
                         Config("hf", 1, "clover", engine_method, 1, _fixed(args.budget)),
                         Config("hf", 1, "hf-greedy", "hf-greedy", 1),
                         Config("hf", 1, "hf-prompt-lookup", "hf-prompt-lookup", 1)]
    if "llamacpp" in args.sweeps:
        configs["llamacpp"] = llamacpp_configs(args, engine_method)
    if "peers" in args.sweeps:
        configs["peers"] = [Config("peers", 1, VANILLA_LINE, "vanilla", 1),
                            Config("peers", 1, "default-clover", engine_method, 1, TreeConfig(budget=args.budget)),
                            *[Config("peers", 1, f"vanilla-{label}", "vanilla", 1, engine=f"vanilla-{label}")
                              for label, _ in args.vanilla_engine],
                            *[Config("peers", 1, name, name, 1) for name in peers]]
    if "passes" in args.sweeps:
        lines = ["clover", *[f"vanilla-{label}" for label, _ in args.vanilla_engine], *passes]
        configs["passes"] = [Config("passes", t, name, "pass", 1, engine=name) for t in PASS_TOKENS for name in lines]
    if "triton" in args.sweeps:
        configs["triton"] = [Config("triton", c, label, label, c) for c in args.concurrency for label in triton_models]
    return configs


def llamacpp_configs(args, engine_method: str) -> list[Config]:
    """The ``llamacpp`` sweep at batch 1: vanilla and the ``clover generate`` defaults on the engine, vanilla on
    each ``--vanilla-engine``, llama.cpp greedy and prompt lookup on the same GGUF."""
    rows = [Config("llamacpp", 1, VANILLA_LINE, "vanilla", 1),
            Config("llamacpp", 1, "default-clover", engine_method, 1, TreeConfig(budget=args.budget))]
    rows += [Config("llamacpp", 1, f"vanilla-{label}", "vanilla", 1, engine=f"vanilla-{label}")
             for label, _ in args.vanilla_engine]
    return rows + [Config("llamacpp", 1, "llamacpp-greedy", "llamacpp-greedy", 1),
                   Config("llamacpp", 1, "llamacpp-prompt-lookup", "llamacpp-prompt-lookup", 1)]


def _load_llamacpp(args, engine, notes: list[str]) -> dict:
    """llama.cpp instances for the ``llamacpp`` sweep (greedy, prompt lookup), or {} with a note where it
    cannot run: llama-cpp-python missing, or the engine's target is not the demo GGUF's model."""
    from clover.demo import DEMO_NAME
    from clover.bench.llamacpp import build_info, load_llama, wait_policy

    if Path(str(engine.meta.source.get("target"))).name != DEMO_NAME:  # the demo checkpoint's cache directory
        notes.append("llama.cpp sweep skipped: the engine's target is not the demo GGUF's model.")
        return {}
    try:
        llamas = {"llamacpp-greedy": load_llama(threads=args.threads or os.cpu_count()),
                  "llamacpp-prompt-lookup": load_llama(threads=args.threads or os.cpu_count(),
                                                       prompt_lookup=args.llamacpp_lookup)}
    except ConfigError as exc:
        notes.append(f"llama.cpp sweep skipped: {exc}")
        return {}
    info = build_info()
    notes.append(f"llama.cpp: llama-cpp-python {info['llama_cpp_python']} ({info['system_info']}), "
                 f"{args.threads or os.cpu_count()} threads, prompt lookup {args.llamacpp_lookup} tokens, "
                 f"OMP_WAIT_POLICY {wait_policy()} (PASSIVE: set it when starting the bench, docs/quantized-target.md).")
    return llamas


def _load_peers(args, engine, notes: list[str]) -> tuple[dict, dict]:
    """(decode lines, pass lines) of the peer runtimes that can run here, as callables
    ``(prompt ids, max_new) -> sample`` and ``(tokens, past) -> None``; a note for each left out."""
    import functools

    from clover.bench.genai import BuilderGraphPass, build_genai_model, load_genai, run_genai

    decoders, passes, threads = {}, {}, args.threads or os.cpu_count()
    if "peers" in args.sweeps:
        llamas = _load_llamacpp(args, engine, notes)
        if "llamacpp-greedy" in llamas:
            decoders["llamacpp-greedy"] = functools.partial(run_llamacpp_sample, llamas["llamacpp-greedy"])
    checkpoint = engine.meta.source.get("target")
    if not checkpoint or not Path(checkpoint).is_dir():
        notes.append(f"onnxruntime-genai left out: the engine's target checkpoint {checkpoint!r} is not here.")
        return decoders, passes
    try:
        model_dir = build_genai_model(checkpoint, Path(args.output) / "genai-int4")
    except ConfigError as exc:
        notes.append(f"onnxruntime-genai left out: {exc}")
        return decoders, passes
    notes.append(f"onnxruntime-genai {_version('onnxruntime-genai')}: its model builder's CPU graph "
                 f"(-p int4 -e cpu) of {checkpoint}, {threads} threads, no spin-waiting.")
    if "peers" in args.sweeps:
        decoders["genai-greedy"] = functools.partial(run_genai, load_genai(model_dir, threads))
    if "passes" in args.sweeps:
        passes["genai-graph"] = BuilderGraphPass(model_dir, threads)
    return decoders, passes


def run_llamacpp_sample(llama, prompt: list[int], max_new: int) -> dict:
    from clover.bench.llamacpp import run_llamacpp

    return run_llamacpp(llama, prompt, max_new)


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def run_pass(run, tokens: int, past: int, calls: int = 5) -> dict:
    """The median of ``calls`` passes of ``run(tokens, past)`` (after one untimed), in ms; ``tokens_per_s``:
    the pass's new tokens per second, so paired ratios compare pass speeds."""
    run(tokens, past)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run(tokens, past)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"target_ms": 1000 * seconds, "tokens_per_s": tokens / seconds, "tokens_per_step": None}


def engine_pass(engine):
    """``(tokens, past) -> None``: one batch-1 target pass of ``engine`` over a full-size cache, as the decode loop
    allocates it (a chain of ``tokens`` after ``past`` cached positions)."""
    from clover.attention import causal_packed_mask
    from clover.kv_cache import KVCache

    spec = engine.spec
    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, spec.dtype)
    cache.add_rows(1)

    def run(tokens: int, past: int) -> None:
        ids = torch.randint(0, spec.vocab_size, (1, tokens))
        engine.target(ids, torch.arange(past, past + tokens)[None], torch.tensor([past], dtype=torch.int32),
                      causal_packed_mask(1, tokens), *cache.views())

    return run


def _fixed(budget: int, proposer: str = "none") -> TreeConfig:
    """A fixed tree of ``budget`` nodes: the heads alone, or with ``proposer``'s candidates merged in."""
    return TreeConfig(budget=budget, adaptive=False, proposer=proposer)


def hardware() -> dict:
    import onnxruntime

    info = {"machine": platform.machine(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "torch_threads": torch.get_num_threads()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["lscpu"] = _lscpu()
    info["cpu_target_kernel"] = _cpu_target_kernel()
    return info


def _lscpu() -> str | None:
    """``lscpu``'s report (the CPU varies between machines: record it with every measurement)."""
    import subprocess

    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_target_kernel() -> str:
    """Which path of the exact int8 CPU target runs here (docs/quantized-target.md#the-exact-int8-engine)."""
    from clover.kernels import cpu_target

    try:
        return cpu_target.unavailable_reason() or cpu_target.kernel_path()
    except cpu_target.NativeUnavailable as exc:
        return str(exc)


def bench_prompts(source: str, notes: list[str]) -> list[str]:
    """The prompt texts: MT-bench's 80 first turns (``mtbench``, the speculative-decoding papers' evaluation
    set, interleaved across its categories), the built-in list (``builtin``), MT-bench where it is
    installed (``auto``), or the copy workload (``copy``: fix / comment / rewrite prompts built from HumanEval,
    clover.prompts.copy_prompts; report it apart from MT-bench)."""
    from clover.prompts import copy_prompts, mtbench_first_turns

    if source == "copy":
        notes.append("Prompts: the copy workload (fix / comment / rewrite prompts built from HumanEval, "
                     "clover.prompts.copy_prompts), not MT-bench.")
        return [row["prompt"] for row in copy_prompts()]
    if source in ("auto", "mtbench"):
        try:
            return [row["prompt"] for row in mtbench_first_turns()]
        except ConfigError as exc:
            if source == "mtbench":
                raise
            notes.append(f"Built-in prompts, not MT-bench: {exc}")
    return list(PROMPTS)


def _encoded_prompts(args, spec, notes: list[str]) -> tuple[list[str], list[list[int]]]:
    """(texts, token ids) of the prompts that fit the engine's context with ``--max-new-tokens`` new tokens."""
    from transformers import AutoTokenizer

    from clover.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(args.engine)
    texts = bench_prompts(args.prompts, notes)[: args.num_prompts]
    encoded = [(t, encode_prompt(tokenizer, t)) for t in texts]
    fitting = [(t, ids) for t, ids in encoded if len(ids) + args.max_new_tokens <= spec.max_seq_len]
    if not fitting:
        raise ConfigError(f"no prompt fits the engine's context of {spec.max_seq_len} tokens with "
                          f"{args.max_new_tokens} new tokens")
    if len(fitting) < len(encoded):
        notes.append(f"{len(encoded) - len(fitting)} of {len(encoded)} prompts left out: longer than the engine's "
                     f"context ({spec.max_seq_len} tokens) minus {args.max_new_tokens} new tokens.")
    return [t for t, _ in fitting], [ids for _, ids in fitting]


def _cost_model(args, engine, store: SampleStore, notes: list[str], log):
    """The engine's cost model; without one (and a batch sweep), one calibrated now, or by the run resumed."""
    from clover.adaptive import CostModel, calibrate

    if engine.cost_model is not None or "batch" not in args.sweeps:
        return engine.cost_model
    if store.progress.get("cost_model"):
        notes.append("The engine had no stored cost model; adaptive clover used one calibrated at the start of "
                     f"this run (kept in {PROGRESS_FILE} for its resumed parts).")
        return CostModel.from_dict(store.progress["cost_model"])
    log("the engine has no cost model (build_engine --calibrate); calibrating now")
    cost_model = calibrate(engine, max_tokens=min(256, max(args.batch_sizes) * (1 + args.adaptive_max_budget)),
                           repeats=3, source="calibrated by clover.bench")
    store.remember("cost_model", cost_model.to_dict())
    notes.append("The engine had no stored cost model; adaptive clover used one calibrated at the start of this run.")
    return cost_model


def _log(message: str) -> None:
    tqdm.write(f"[bench] {message}", file=sys.stderr)  # above the progress bar, not through it


def run(args) -> dict:
    from clover.backends.onnxruntime import OnnxRuntimeEngine

    key = run_key(args)  # before the sweeps that cannot run here are taken out of args.sweeps
    log = (lambda m: None) if args.silent else _log
    engines = {"clover": OnnxRuntimeEngine(args.engine, threads=args.threads)}
    if args.medusa_engine:
        engines[MEDUSA_ENGINE] = OnnxRuntimeEngine(args.medusa_engine, threads=args.threads)
    for label, directory in args.extra_engine:
        if label in engines or label in (VANILLA_LINE, "adaptive-clover"):
            raise ConfigError(f"--extra-engine {label}: the label is taken; choose another")
        engines[label] = OnnxRuntimeEngine(directory, threads=args.threads)
        if not engines[label].spec.num_draft_heads:
            raise ConfigError(f"--extra-engine {label}={directory}: the engine has no draft heads")
    spec = engines["clover"].spec
    if not spec.num_draft_heads:
        raise ConfigError(f"{args.engine}: the engine has no draft heads; build it with a drafter")
    notes = []
    texts, prompts = _encoded_prompts(args, spec, notes)
    key["prompt_token_ids_sha256"] = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    store = SampleStore(Path(args.output), key, fresh=args.fresh)
    cost_model = _cost_model(args, engines["clover"], store, notes, log)

    hf_model = None
    if "hf" in args.sweeps:
        from transformers import AutoModelForCausalLM

        source = engines["clover"].meta.source.get("target")
        if source and Path(source).is_dir():
            hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        else:
            notes.append(f"transformers baseline skipped: the engine's target checkpoint {source!r} is not here.")
            args.sweeps = [s for s in args.sweeps if s != "hf"]

    triton = None
    if "triton" in args.sweeps:
        from clover.serving.server import ServerError, find_tritonserver

        try:
            find_tritonserver()
        except ServerError as exc:
            notes.append(f"Triton sweep skipped: {exc}")
            args.sweeps = [s for s in args.sweeps if s != "triton"]
        else:
            if engines["clover"].cost_model is None:
                notes.append("Triton sweep without adaptive clover: the engine has no stored cost model "
                             "(build_engine --calibrate).")
            triton = TritonSweep(args, engines, Path(args.output) / "triton", log)
    for label, directory in args.vanilla_engine:
        engines[f"vanilla-{label}"] = OnnxRuntimeEngine(directory, threads=args.threads)
    if "llamacpp" in args.sweeps:
        engines["llamacpp"] = _load_llamacpp(args, engines["clover"], notes)
        if not engines["llamacpp"]:
            args.sweeps = [s for s in args.sweeps if s != "llamacpp"]
    engines["peers"], engines["passes"] = ({}, {})
    if {"peers", "passes"} & set(args.sweeps):
        engines["peers"], engines["passes"] = _load_peers(args, engines["clover"], notes)
    try:
        return _measure_all(args, engines, cost_model, prompts, texts, hf_model, triton, store, notes, log)
    finally:
        if triton is not None:
            triton.close()


def _measure_all(args, engines, cost_model, prompts, texts, hf_model, triton, store, notes, log) -> dict:
    extra = {label: engines[label].spec.default_method
             for label, _ in args.extra_engine}
    configs = build_configs(args, engines["clover"].spec, MEDUSA_ENGINE in engines,
                            tuple(triton.models) if triton is not None else (), extra, tuple(engines["peers"]),
                            tuple(engines["passes"]))
    pass_runs = {**{name: engine_pass(engines[name]) for name in ["clover", *[f"vanilla-{label}" for label, _ in
                                                                            args.vanilla_engine]]},
                 **engines["passes"]}
    if args.lines:  # only the named lines (every sweep keeps its own order)
        known = {c.name for rows in configs.values() for c in rows}
        if set(args.lines) - known:
            raise ConfigError(f"--lines {','.join(sorted(set(args.lines) - known))}: no such line in these sweeps; "
                              f"choose from {', '.join(sorted(known))}")
        configs = {sweep: [c for c in rows if c.name in args.lines] for sweep, rows in configs.items()}

    def measure(config: Config, repeat: int, max_new: int) -> dict:
        if config.sweep == "passes":
            return run_pass(pass_runs[config.engine], config.x, args.pass_past)
        if config.method in engines["peers"]:
            return engines["peers"][config.method](prompts[repeat % len(prompts)], max_new)
        if config.method.startswith("llamacpp-"):
            from clover.bench.llamacpp import run_llamacpp

            return run_llamacpp(engines["llamacpp"][config.method], prompts[repeat % len(prompts)], max_new)
        if config.method.startswith("hf-"):
            lookup = args.prompt_lookup if config.method == "hf-prompt-lookup" else None
            return run_hf(hf_model, prompts[repeat % len(prompts)], max_new, lookup)
        if config.sweep == "triton":
            return run_triton(triton, config, texts, repeat, max_new)
        model = cost_model if config.tree is not None and config.tree.adaptive else None
        return run_decode(engines[config.engine], config, prompts, max_new, model, first_prompt=repeat)

    def before_sweep(sweep: str) -> None:
        if sweep == "triton":  # started only for a sweep with something left to measure
            triton.start()

    started = time.time()
    stored = measure_sweeps(configs, args.repeats, args.max_new_tokens, measure, store, log,
                            progress=not args.silent, before_sweep=before_sweep)
    log(f"measured in {time.time() - started:.0f} s")
    # samples of this run's configurations (not of a sweep that cannot run here now, e.g. without tritonserver)
    wanted = {(sweep, config.name, config.x) for sweep, rows in configs.items() for config in rows}
    samples = [s for s in stored if sample_key(s)[:3] in wanted]

    sweeps: dict[str, Any] = {}
    for sweep, rows in configs.items():
        methods: dict[str, Any] = {}
        for config in rows:
            entry = methods.setdefault(config.name, {"x": [], **{key: [] for key in METRICS[sweep]}})
            mine = [s for s in samples if s["sweep"] == sweep and s["x"] == config.x and s["method"] == config.name]
            entry["x"].append(config.x)
            for key in METRICS[sweep]:
                entry[key].append(summarize(mine, key))
        sweeps[sweep] = {"x_label": X_LABELS[sweep], "methods": methods}
    notes.append("Per-category extra tokens/step is measured by training/evaluate.py with trained heads "
                 "(docs/results/eval.md), not here.")
    return {
        "command": "python -m clover.bench " + " ".join(shlex.quote(a) for a in args.argv),
        "hardware": hardware(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("argv",)},
        "engines": {name: str(e.engine_dir) for name, e in engines.items() if hasattr(e, "engine_dir")},
        "cost_model": cost_model.to_dict() if cost_model is not None else None,
        "step_costs": step_costs(cost_model, args.batch_sizes, args.budget, engines["clover"].spec.num_draft_heads,
                                 engines["clover"].spec.draft_top_k) if cost_model is not None else None,
        "sweeps": sweeps,
        "aims": aims(samples),
        "notes": notes,
        "samples": samples,
    }


# -- command line: clover.bench.cli parses it (without torch, so --help is quick) --------------------


def main(argv=None) -> int:
    return run_command(parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command: measure, then write bench.json, bench.md and the PNGs; the exit code."""
    try:
        report = run(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"clover.bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"clover.bench: interrupted; the samples measured so far, if any, are in {Path(args.output) / SAMPLES_FILE}: "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (output / "bench.md").write_text(markdown(report))
    pngs = plot(report, output)
    print(f"wrote {output / 'bench.json'}, {output / 'bench.md'}, " + ", ".join(p.name for p in pngs))
    return 0

