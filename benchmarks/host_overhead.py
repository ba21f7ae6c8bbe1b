#!/usr/bin/env python
"""Host overhead of a decode step: where the time outside onnxruntime goes (issue 14, part 3).

Runs decode steps on an onnxruntime engine and splits each steady-state step (full batch, after the prompt
pass) into:

* ``native``: inside onnxruntime's ``run`` / ``run_with_iobinding`` (the engine's compute);
* ``glue``: the rest of the backend's ``target`` / ``draft_step`` calls (feeds, bindings, outputs);
* ``loop``: the decode loop outside engine calls: tree building, tree buffers, verification, the cache
  commit, emitting and stop checks, with a per-phase breakdown;
* ``host`` = step wall time - ``native`` = ``glue`` + ``loop``.

With ``--code before=DIR --code after=DIR2`` (copies of ``clover/`` packages, e.g. ``git archive HEAD clover |
tar -x -C DIR``) every repeat runs each code alternately, each in its own process, so both see the
same machine load; the report gives medians and min-max over repeats, next to each wall time the CPU time of the
decoding thread (``cpu_*``: another process's turn is not charged to it), and a digest of every code's output
tokens (they must match). ``--profile`` prints cProfile's top host functions per step instead, in CPU time
(cProfile inflates Python time; use it for where, the timers for how much).

Usage::

    mkdir /tmp/old && git archive HEAD clover | tar -x -C /tmp/old   # the code to compare with
    python -m benchmarks.host_overhead --batches 1 32 --repeats 3 --code before=/tmp/old --code after=.
    python -m benchmarks.host_overhead --engine engines/demo --batches 32 --profile
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# decode-loop functions timed as phases where the code under test has them (old and new code alike)
PHASES = {"clover.decode": ("build_trees", "draft_tree_batch", "batch_trees", "greedy_accept", "sampling_accept"),
          "clover.kv_cache.KVCache": ("commit", "remove_rows")}


class Clock:
    """Seconds accumulated per label: wall time, and CPU time of the calling thread as ``cpu_<label>``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def timed(self, label: str, fn):
        def wrapper(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(label, time.perf_counter() - start, time.thread_time() - cpu)

        return wrapper

    def add(self, label: str, wall: float, cpu: float) -> None:
        self.seconds[label] = self.seconds.get(label, 0.0) + wall
        self.seconds[f"cpu_{label}"] = self.seconds.get(f"cpu_{label}", 0.0) + cpu


class TimedSession:
    """An onnxruntime session whose runs are timed as ``native``."""

    def __init__(self, session, clock: Clock) -> None:
        self._session = session
        self.run = clock.timed("native", session.run)
        self.run_with_iobinding = clock.timed("native", session.run_with_iobinding)

    def __getattr__(self, name):
        return getattr(self._session, name)


def instrument(engine, clock: Clock) -> None:
    import importlib

    for name in ("target_session", "draft_session"):
        if getattr(engine, name, None) is not None:
            setattr(engine, name, TimedSession(getattr(engine, name), clock))
    engine.target = clock.timed("target_engine", engine.target)
    engine.draft_step = clock.timed("draft_engine", engine.draft_step)
    for owner_path, names in PHASES.items():
        module_name, _, cls = owner_path.rpartition(".") if owner_path.endswith("KVCache") else (owner_path, "", "")
        owner = importlib.import_module(module_name)
        owner = getattr(owner, cls) if cls else owner
        for name in names:
            if hasattr(owner, name):
                setattr(owner, name, clock.timed(name, getattr(owner, name)))


def worker(args) -> dict:
    """Decode ``args.batch`` prompts and time each full-batch step after the first (the prompt pass)."""
    import torch
    from transformers import AutoTokenizer

    from clover.backends import load_engine
    from clover.bench import PROMPTS  # the bench's built-in prompts (old and new code both have them)
    from clover.config import TreeConfig
    from clover.decode import GenerationRequest, SpeculativeDecoder
    from clover.prompts import encode_prompt

    torch.manual_seed(0)
    engine = load_engine(args.engine, threads=args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.engine)
    prompts = [encode_prompt(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]
    clock = Clock()
    instrument(engine, clock)
    tree = TreeConfig(budget=args.budget, adaptive=False)
    method = "vanilla" if args.budget == 0 else engine.spec.default_method
    decoder = SpeculativeDecoder(engine, method, tree, max_batch_size=args.batch)
    seq_ids = [decoder.submit(GenerationRequest(ids, max_new_tokens=args.new_tokens, stop_token_ids=()))
               for ids in prompts]
    finished = {i: [] for i in seq_ids}

    def record(events) -> None:
        for event in events:
            finished[event.seq_id] += event.new_token_ids

    record(decoder.step())  # prompt pass and first decode step: not measured
    steps, profiler = [], None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU time: another process's turn is not charged
    while decoder.has_work and decoder.num_running == args.batch:
        clock.seconds.clear()
        if profiler:
            profiler.enable()
        start, cpu = time.perf_counter(), time.thread_time()
        events = decoder.step()
        clock.add("wall", time.perf_counter() - start, time.thread_time() - cpu)
        record(events)
        if profiler:
            profiler.disable()
        steps.append(dict(clock.seconds))
    while decoder.has_work:  # the rest, unmeasured, so that the outputs can be compared across code versions
        record(decoder.step())
    if profiler:
        print_profile(profiler, len(steps))
    # a digest of every sequence's tokens: old and new code must decode the same
    digest = hashlib.sha256(json.dumps([finished[i] for i in seq_ids]).encode()).hexdigest()[:12]
    return {**summarise_steps(steps), "tokens": digest}


def summarise_steps(steps: list[dict]) -> dict:
    """Median ms per step of each part (engine calls subtracted from the phases that make them)."""
    def part(step: dict) -> dict:
        native, engine = step.get("native", 0.0), step.get("target_engine", 0.0) + step.get("draft_engine", 0.0)
        cpu_native = step.get("cpu_native", 0.0)
        cpu_engine = step.get("cpu_target_engine", 0.0) + step.get("cpu_draft_engine", 0.0)
        out = {"step": step["wall"], "native": native, "glue": engine - native, "loop": step["wall"] - engine,
               "host": step["wall"] - native,
               # the same, in CPU time of the decoding thread: less sensitive to other processes on the machine
               "cpu_glue": cpu_engine - cpu_native, "cpu_loop": step["cpu_wall"] - cpu_engine,
               "cpu_host": step["cpu_wall"] - cpu_native}
        for names in PHASES.values():
            for name in names:
                if name in step:
                    out[name], out[f"cpu_{name}"] = step[name], step[f"cpu_{name}"]
        # tree building (old: build_trees, new: draft_tree_batch) includes the draft calls: keep its own work
        for name in ("build_trees", "draft_tree_batch"):
            if name in out:
                out["tree_building"] = out.pop(name) - step.get("draft_engine", 0.0)
                out["cpu_tree_building"] = out.pop(f"cpu_{name}") - step.get("cpu_draft_engine", 0.0)
        return out

    parts = [part(s) for s in steps]
    keys = dict.fromkeys(k for p in parts for k in p)
    return {"steps": len(parts), **{k: 1000 * statistics.median(p.get(k, 0.0) for p in parts) for k in keys}}


def print_profile(profiler, steps: int, top: int = 30) -> None:
    import pstats

    stats = pstats.Stats(profiler)
    print(f"cProfile (CPU time of the decoding thread), {steps} steps; ms per step (tottime, cumtime, calls)",
          file=sys.stderr)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (path, line, name), (_, calls, tottime, cumtime, _) in rows:
        where = f"{Path(path).name}:{line}({name})"
        print(f"  {1000 * tottime / steps:8.3f} {1000 * cumtime / steps:8.3f} {calls / steps:8.1f}/step  {where}",
              file=sys.stderr)


def run_worker(code_dir: str | None, args, batch: int) -> dict:
    env = dict(os.environ)
    # the code under test first on the path (an old package, or this checkout); the engine is the same
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [code_dir or str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--worker", "--engine", args.engine, "--batch", str(batch),
               "--budget", str(args.budget), "--new-tokens", str(args.new_tokens)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"worker failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: dict) -> None:
    for (label, batch), samples in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"\n{label}, batch {batch}: ms per step, median [min-max] of {len(samples)} repeats "
              f"({samples[0]['steps']} steps each)")
        print(f"  output digests: {sorted({s['tokens'] for s in samples})}")
        for key in samples[0]:
            if key in ("steps", "tokens"):
                continue
            values = [s.get(key, 0.0) for s in samples]
            print(f"  {key:16s} {statistics.median(values):8.2f} [{min(values):.2f}-{max(values):.2f}]")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="engines/demo", help="onnxruntime engine directory")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--budget", type=int, default=4, help="fixed tree budget (0: vanilla steps)")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--code", action="append", default=[], metavar="LABEL=DIR",
                        help="compare the clover/ package in DIR under LABEL (repeatable; e.g. before=/tmp/old, "
                             "made with: git archive HEAD clover | tar -x -C /tmp/old); default: this checkout")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions (current code)")
    parser.add_argument("--output", default=None, help="write every sample as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.engine = str(Path(args.engine).resolve())
    if args.worker or args.profile:
        for batch in ([args.batch] if args.worker else args.batches):
            args.batch = batch
            print(json.dumps(worker(args)), flush=True)
        return 0
    code = {label: str(Path(directory).resolve()) for label, _, directory in (c.partition("=") for c in args.code)}
    code = code or {"current": None}
    results: dict = {}
    for repeat in range(args.repeats):
        for batch in args.batches:
            order = list(code.items())[:: 1 if repeat % 2 == 0 else -1]  # alternate who goes first
            for label, directory in order:
                results.setdefault((label, batch), []).append(run_worker(directory, args, batch))
                print(f"repeat {repeat + 1}/{args.repeats} batch {batch} {label} done", file=sys.stderr, flush=True)
    report(results)
    if args.output:
        Path(args.output).write_text(json.dumps([{"code": k[0], "batch": k[1], "samples": v}
                                                 for k, v in results.items()], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
