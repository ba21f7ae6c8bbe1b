"""Adaptive speculation: pick the tree budget per decode step from a measured cost model.

Speculation pays while verifying a tree costs about as much as one vanilla
step (the memory-bound part of the roofline, docs/results/README.md#cpu-roofline). With many live
sequences the target pass becomes compute-bound and a tree of ``b`` draft
nodes per sequence costs up to ``1 + b`` times a vanilla step, so the best
budget shrinks with the batch, down to 0 (vanilla: no draft steps at all).

* :class:`CostModel`: measured seconds of one ``target`` pass against tokens
  in flight (batch × tree size), of one ``draft_step`` against frontier
  nodes, and for Clover-2 of one ``draft_prefill`` against accepted positions;
  piecewise-linear interpolation; JSON round-trip. :func:`calibrate`
  measures one on an engine (``build_engine(..., calibrate=True)`` stores it in
  ``engine.json`` under ``"cost_model"``).
* :class:`AcceptanceModel`: expected tokens per step against budget, from a
  conservative prior, updated online from the decoder's own acceptance (an
  exponential moving average per budget).
* :func:`choose_budget`: the pure chooser. It maximises expected tokens/s::

      B * E / (target_time(B * (1 + b)) + draft_time(B, b) + prefill_time(B * E)),  E = E[tokens/step | b]

  Budget 0 is vanilla (E = 1, no draft time), so it is always a candidate. The
  prefill term is Clover-2's ``draft_prefill`` over the accepted positions (0
  for other drafters); the decode loop runs it after vanilla steps too, to keep
  the drafter's KV cache in step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Iterable, Sequence

import numpy as np
import torch

from clover.config import ConfigError, JsonMixin
from clover.stats import StepOutcome
from clover.timing import median_seconds

DEFAULT_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
VANILLA_PROBE_AFTER = 4  # speculative steps of a batch size before its first timed vanilla step


def _interpolate(points: Sequence[Sequence[float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x); below the first point: proportional to x
    (never below 0); beyond the last: the last segment's slope (at least flat).
    The y values are made non-decreasing first (a measurement never says more work is cheaper)."""
    if not points:
        return 0.0
    xs = [float(p[0]) for p in points]
    ys, top = [], 0.0
    for p in points:
        top = max(top, float(p[1]))
        ys.append(top)
    if x <= xs[0]:
        return ys[0] * max(x, 0.0) / xs[0] if xs[0] > 0 else ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            frac = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + frac * (ys[i] - ys[i - 1])
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return ys[-1] + slope * (x - xs[-1])


@dataclasses.dataclass
class CostModel(JsonMixin):
    """Measured step times of one engine on one machine.

    ``target``: ``[tokens_in_flight, seconds]`` pairs for one ``target`` pass
    (tokens in flight = batch × (1 + tree budget)), sorted by tokens.
    ``draft``: ``[nodes, seconds]`` pairs for one ``draft_step`` over that many
    frontier nodes (empty for an engine without a drafter).
    ``draft_prefill``: ``[positions, seconds]`` pairs for one ``draft_prefill`` over that many new positions,
    all sequences together (Clover-2, engine contract v2; empty for other engines).
    """

    target: list[list[float]]
    draft: list[list[float]] = dataclasses.field(default_factory=list)
    source: str = ""  # what was measured (engine, machine), for reports
    draft_prefill: list[list[float]] = dataclasses.field(default_factory=list)
    # trees of several sequences, where an engine runs them apart from everything else (a gqa engine's
    # target_batched.onnx: docs/engine-contract.md#in-place-kv); empty: ``target`` prices them too
    target_batched: list[list[float]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("target", "draft", "draft_prefill", "target_batched"):
            points = [[float(x), float(y)] for x, y in getattr(self, name)]
            if any(x <= 0 or y < 0 for x, y in points):
                raise ConfigError(f"cost model {name}: token counts must be > 0 and seconds >= 0")
            setattr(self, name, sorted(points))
        if not self.target:
            raise ConfigError("cost model needs at least one target measurement")

    def target_time(self, tokens_in_flight: float) -> float:
        """Seconds of one target pass over ``tokens_in_flight`` new tokens (all sequences together)."""
        return _interpolate(self.target, tokens_in_flight)

    def pass_time(self, batch: int, tokens: float) -> float:
        """Seconds of one target pass of ``batch`` sequences of ``tokens`` new tokens each: trees of several
        sequences on their own curve where the engine measured one (``target_batched``)."""
        if batch > 1 and tokens > 1 and self.target_batched:
            return _interpolate(self.target_batched, batch * tokens)
        return self.target_time(batch * tokens)

    def draft_step_time(self, nodes: float) -> float:
        """Seconds of one draft step over ``nodes`` frontier nodes."""
        return _interpolate(self.draft, nodes)

    def draft_prefill_time(self, positions: float) -> float:
        """Seconds of one ``draft_prefill`` over ``positions`` new positions (0 for an engine without one)."""
        return _interpolate(self.draft_prefill, positions)

    def draft_time(self, batch: int, budget: int, depth: int, top_k: int = 8) -> float:
        """Seconds of tree building: one draft step per level, at most ``depth`` levels.

        Level 0 expands the ``batch`` roots; level d expands at most
        ``min(budget, top_k ** d)`` nodes per sequence. Budget 0 builds no tree.
        An upper bound: :func:`clover.tree.build_trees` may stop early.
        """
        if budget <= 0 or depth <= 0:
            return 0.0
        levels = min(depth, budget)
        return sum(self.draft_step_time(batch * min(budget, top_k**d)) for d in range(levels))

    def step_time(self, batch: int, budget: int, tokens_per_step: float, depth: int, top_k: int = 8,
                  tree_tokens: float | None = None) -> float:
        """Seconds of one decode step of ``batch`` sequences at ``budget`` (0: vanilla) that accepts
        ``tokens_per_step`` per sequence: the target pass over every tree, the tree's draft steps, and Clover-2's
        ``draft_prefill`` over the accepted positions (0 for other engines). The one step-time rule of the
        chooser, its time correction and ``benchmarks/chooser_replay.py``. ``tree_tokens``: the tokens per
        sequence of the pass (the batch's widest tree, as every row is padded to it) when it is not ``1 + budget``
        (model-free candidates merged in, docs/trees.md#model-free-candidates)."""
        tokens = 1 + budget if tree_tokens is None else tree_tokens
        return (self.pass_time(batch, tokens) + self.draft_time(batch, budget, depth, top_k)
                + self.draft_prefill_time(batch * tokens_per_step))


def prior_tokens_per_step(budget: int, depth: int) -> float:
    """A conservative prior for E[tokens/step | budget]: 1 + (1 - 0.8^min(budget, 4·depth)) · 0.4 · depth.

    Budget 4 with 3 heads gives about 1.7 tokens/step, well under what trained
    Clover heads reach (the paper: above 2.5), so the chooser speculates only
    where verification is nearly free until the decoder has measured better.
    """
    if budget <= 0 or depth <= 0:
        return 1.0
    return 1.0 + (1.0 - 0.8 ** min(budget, 4 * depth)) * 0.4 * depth


@dataclasses.dataclass
class AcceptanceModel:
    """Expected tokens per step (accepted draft tokens + 1) against tree budget.

    Starts from :func:`prior_tokens_per_step` (or ``prior``, budget -> tokens);
    :meth:`observe` folds each step's mean tokens/step at the budget used into
    an exponential moving average, one update per sequence-step. Its ``decay``
    trades how fast useless heads are caught against how often a few unlucky
    steps of good heads flip a batch-1 decoder to vanilla steps, where nothing
    is measured until it explores again: replayed on measured MT-bench
    acceptance (``benchmarks/chooser_replay.py``, docs/trees.md#adaptive-tree-budget),
    0.95 kept 99% of the best fixed budget's speed and 0.965x vanilla with
    useless heads; 0.9 gave 95% and 0.981x. A budget never observed borrows the ratio
    observed/prior of extra tokens at the nearest observed budget, so one good
    measurement lifts the whole curve and the chooser can move to other budgets.
    """

    depth: int = 3
    decay: float = 0.95  # EMA weight of the past, per sequence-step
    prior: dict[int, float] | None = None
    ema: dict[int, float] = dataclasses.field(default_factory=dict)
    counts: dict[int, int] = dataclasses.field(default_factory=dict)

    def prior_value(self, budget: int) -> float:
        if budget <= 0:
            return 1.0
        if self.prior is not None and budget in self.prior:
            return float(self.prior[budget])
        return prior_tokens_per_step(budget, self.depth)

    def expected(self, budget: int) -> float:
        if budget <= 0:
            return 1.0
        if budget in self.ema:
            return self.ema[budget]
        observed = [b for b in self.ema if b > 0]
        prior = self.prior_value(budget)
        if not observed:
            return prior
        nearest = min(observed, key=lambda b: (abs(math.log(b / budget)), b))
        base_extra = self.prior_value(nearest) - 1.0
        scale = (self.ema[nearest] - 1.0) / base_extra if base_extra > 0 else 1.0
        return 1.0 + max(0.0, (prior - 1.0) * scale)

    def observe(self, budget: int, tokens_per_step: float, weight: int = 1) -> None:
        """Fold in ``weight`` sequence-steps that averaged ``tokens_per_step`` at ``budget``."""
        if budget <= 0 or weight <= 0:
            return
        keep = self.decay**weight
        old = self.ema.get(budget, self.expected(budget))
        self.ema[budget] = keep * old + (1.0 - keep) * float(tokens_per_step)
        self.counts[budget] = self.counts.get(budget, 0) + weight


def expected_throughput(batch: int, budget: int, cost: CostModel, tokens_per_step: float, depth: int,
                        top_k: int = 8) -> float:
    """Expected tokens/s of one decode step: ``batch * tokens_per_step / step seconds``."""
    seconds = cost.step_time(batch, budget, tokens_per_step, depth, top_k)
    return batch * tokens_per_step / seconds if seconds > 0 else math.inf


def choose_budget(batch: int, cost: CostModel, expected_tokens, budgets: Iterable[int] = DEFAULT_BUDGETS,
                  depth: int = 3, top_k: int = 8, max_budget: int | None = None) -> int:
    """The tree budget (0 = vanilla) that maximises expected tokens/s for ``batch`` live sequences.

    Args:
        expected_tokens: ``budget -> E[tokens/step]`` (a callable such as
            :meth:`AcceptanceModel.expected`, or a dict).
        budgets: candidates; 0 is always added. ``max_budget`` caps them.
        depth: draft levels (heads used); top_k: candidates per node.
    Ties go to the smaller budget.
    """
    if batch < 1:
        raise ValueError("batch must be >= 1")
    lookup = expected_tokens.__getitem__ if isinstance(expected_tokens, dict) else expected_tokens
    rates = {0: expected_throughput(batch, 0, cost, 1.0, depth, top_k)}
    for budget in set(budgets):
        if budget > 0 and (max_budget is None or budget <= max_budget):
            rates[budget] = expected_throughput(batch, budget, cost, float(lookup(budget)), depth, top_k)
    return best_budget(rates)


def best_budget(rates: dict[int, float]) -> int:
    """The budget of the highest expected tokens/s; within 1e-9 (relative) of it, the smaller budget."""
    best = None
    for budget in sorted(rates):
        if best is None or rates[budget] > rates[best] * (1 + 1e-9):
            best = budget
    return best


class AdaptiveBudget:
    """Per-decoder chooser state: the cost model, the acceptance estimates, the candidates.

    ``explore_every``: when the choice is vanilla, every that many steps try the
    best speculative budget once anyway, so acceptance keeps being measured
    (lossless either way; 0 disables it).
    ``step_timing``: correct the cost model with the decode loop's measured step times
    (:meth:`observe_time`); False trusts the model alone (tests that emulate a machine with it).
    """

    def __init__(self, cost: CostModel, depth: int, top_k: int, max_budget: int,
                 budgets: Iterable[int] = DEFAULT_BUDGETS, acceptance: AcceptanceModel | None = None,
                 explore_every: int = 64, step_timing: bool = True) -> None:
        self.step_timing = step_timing
        self.cost, self.depth, self.top_k = cost, depth, top_k
        self.budgets = sorted({b for b in (*budgets, max_budget) if 0 <= b <= max_budget})
        self.acceptance = acceptance or AcceptanceModel(depth=depth)
        self.explore_every = explore_every
        self.history: list[tuple[int, int]] = []  # (batch, budget) per decode step
        self._vanilla_run = 0
        self._choices: dict[int, int] = {}  # batch -> budget, until the acceptance or time estimates change
        # (batch, budget) -> measured step seconds / the cost model's, an EMA: the calibration times one sequence
        # of batch x tree tokens, which can miss what a real batch costs (docs/results/defaults, 2026-12-02)
        self._time_ratio: dict[tuple[int, int], float] = {}
        self._untimed_steps: dict[int, int] = {}  # batch -> speculative steps since its last vanilla step

    def choose(self, batch: int) -> int:
        budget = self._choices.get(batch)
        if budget is None:
            budget = best_budget(self._rates(batch, self.budgets))
            self._choices[batch] = budget
        if budget == 0:
            self._untimed_steps[batch] = 0
            budget = self._probe_speculative(batch)
        else:
            self._vanilla_run = 0
            budget = self._probe_vanilla(batch, budget)
        self.history.append((batch, budget))
        return budget

    def _probe_speculative(self, batch: int) -> int:
        """Vanilla was chosen: every ``explore_every`` such steps try the best tree once, so acceptance keeps
        being measured."""
        self._vanilla_run += 1
        if self.explore_every and self._vanilla_run >= self.explore_every:
            self._vanilla_run = 0
            rates = self._rates(batch, [b for b in self.budgets if b > 0])
            if rates:
                return best_budget(rates)
        return 0

    def _probe_vanilla(self, batch: int, budget: int) -> int:
        """A tree was chosen: after a few such steps, and then every ``explore_every`` of them, run one vanilla
        step instead, to time the yardstick the trees' measured times are weighed against. Without it a uniformly
        slow machine and relatively costly trees look the same, and once load comes or goes (another job on the
        other core) the yardstick would stay what it was (docs/trees.md#adaptive-budget-under-load)."""
        if not self.step_timing or not self.explore_every:
            return budget
        since = self._untimed_steps[batch] = self._untimed_steps.get(batch, 0) + 1
        due = self.explore_every if (batch, 0) in self._time_ratio else VANILLA_PROBE_AFTER
        if since <= due:
            return budget
        self._untimed_steps[batch] = 0
        return 0

    def _rates(self, batch: int, budgets: Iterable[int]) -> dict[int, float]:
        """Expected tokens/s per budget: the cost model's, scaled by what steps of that batch and budget took."""
        return {b: expected_throughput(batch, b, self.cost, self.acceptance.expected(b), self.depth, self.top_k)
                / self._ratio(batch, b) for b in budgets}

    def _ratio(self, batch: int, budget: int) -> float:
        """Measured ÷ modelled step time for this batch and budget; for a budget not yet run at this batch, that
        of the nearest one that was (the machine's speed, with the model's relative costs), else 1."""
        observed = [b for (n, b) in self._time_ratio if n == batch]
        if (batch, budget) in self._time_ratio or not observed:
            return self._time_ratio.get((batch, budget), 1.0)
        return self._time_ratio[(batch, min(observed, key=lambda b: (abs(b - budget), b)))]

    def observe_time(self, batch: int, budget: int, seconds: float, tokens_per_step: float = 1.0,
                     decay: float = 0.8, tree_tokens: float | None = None) -> None:
        """One decode step of ``batch`` sequences at ``budget`` took ``seconds`` (drafting, verification, Clover-2's
        draft prefill over the ``tokens_per_step`` accepted per sequence, and host work): folded into that pair's
        correction of the cost model, so a budget the model rates too cheap on this machine stops being chosen
        after a few steps. Vanilla steps are corrected the same way. ``tree_tokens``: the pass's tokens per
        sequence (the widest tree) when it is not ``1 + budget``."""
        predicted = self.cost.step_time(batch, budget, tokens_per_step, self.depth, self.top_k, tree_tokens)
        if predicted <= 0 or seconds <= 0:
            return
        key, ratio = (batch, budget), seconds / predicted
        old = self._time_ratio.get(key)
        self._time_ratio[key] = ratio if old is None else decay * old + (1.0 - decay) * ratio
        self._choices.pop(batch, None)

    def tree_step_seconds(self, batch: int, budget: int, max_nodes: int) -> np.ndarray:
        """Modelled seconds of one step of ``batch`` sequences whose heads draft at ``budget`` and whose trees are
        padded to k draft nodes, for k = 0..``max_nodes`` (``[max_nodes + 1]``): the target pass runs every
        sequence at the batch's widest tree, so what one more node per tree costs depends on the batch and the
        engine's pass curve (docs/trees.md#model-free-candidates)."""
        step = self.cost.step_time(batch, budget, self.acceptance.expected(budget), self.depth, self.top_k)
        others = step - self.cost.pass_time(batch, 1 + budget)  # drafting, Clover-2's draft prefill
        return np.array([others + self.cost.pass_time(batch, 1 + k) for k in range(max_nodes + 1)])

    def observe_step(self, step: StepOutcome, seconds: float) -> None:
        """A decode step, observed: the heads' acceptance at the budget it ran (:meth:`observe`) and, with
        ``step_timing``, what it took (:meth:`observe_time`)."""
        self.observe(step.budget, step.heads_accepted)
        if self.step_timing:
            self.observe_time(len(step.tokens), step.budget, seconds, step.mean_tokens, tree_tokens=step.tree_tokens)

    def observe(self, budget: int, accepted_per_sequence: Sequence[int]) -> None:
        """One step's accepted draft tokens per sequence at ``budget``."""
        if accepted_per_sequence and budget > 0:
            mean = 1.0 + sum(accepted_per_sequence) / len(accepted_per_sequence)
            self.acceptance.observe(budget, mean, weight=len(accepted_per_sequence))
            self._choices.clear()


# -- calibration ----------------------------------------------------------


def token_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to ``max_tokens`` (which is included)."""
    counts, n = [], 1
    while n < max_tokens:
        counts.append(n)
        n *= 2
    return counts + [max_tokens]


def calibrate(engine, max_tokens: int = 64, repeats: int = 5, past: int = 32, source: str = "",
              retries: int = 2) -> CostModel:
    """Time ``engine.target``, ``engine.draft_step`` (and Clover-2's ``engine.draft_prefill``) on synthetic inputs.

    Target: one sequence of n new tokens (a causal chain) after ``past``
    cached tokens, for n = 1, 2, 4, ... ``max_tokens``; a batch of B trees of
    size T does about the same weight traffic and arithmetic as one row of
    B·T tokens. Draft: n frontier nodes at head 0. Draft prefill (engines with
    ``spec.num_draft_kv_layers``): like the target, n new positions after
    ``past`` in the drafter's own cache. Median of ``repeats`` after one
    warm-up. Takes seconds on a small engine. ``retries``: re-timings of unstable points (0 under tensor
    parallelism: every rank must run the same calls, docs/serving.md#tensor-parallel).
    """
    spec = engine.spec
    max_tokens = max(1, min(max_tokens, spec.max_seq_len))
    past = max(0, min(past, spec.max_seq_len - max_tokens))  # positions must stay inside the engine's context
    gen = torch.Generator().manual_seed(0)
    counts = token_counts(max_tokens)
    jobs = {("target", n): job for n, job in _chain_jobs(
        engine.target, spec, spec.num_kv_layers, counts, past,
        lambda n: (torch.randint(0, spec.vocab_size, (1, n), generator=gen),))}
    if getattr(engine, "runs_batched_trees_apart", False):
        jobs.update({("target_batched", n): job for n, job in _batched_tree_jobs(engine, spec, counts, past, gen)})
    if spec.num_draft_heads:
        for n in counts:
            hidden = torch.randn(n, spec.hidden_size, generator=gen).to(spec.dtype)
            token = torch.randint(0, spec.vocab_size, (n,), generator=gen)
            jobs["draft", n] = functools.partial(engine.draft_step, hidden, token, 0)
    if spec.num_draft_kv_layers:
        jobs.update({("draft_prefill", n): job for n, job in _chain_jobs(
            engine.draft_prefill, spec, spec.num_draft_kv_layers, counts, past,
            lambda n: (torch.randn(1, n, spec.hidden_size, generator=gen).to(spec.dtype),
                       torch.randint(0, spec.vocab_size, (1, n), generator=gen)))})
    seconds = _steady_seconds(jobs, repeats, spec.device, retries)
    points = {kind: monotone_fit([[n, t] for (k, n), t in sorted(seconds.items()) if k == kind])
              for kind in ("target", "draft", "draft_prefill", "target_batched")}
    return CostModel(points["target"], points["draft"], source=source, draft_prefill=points["draft_prefill"],
                     target_batched=points["target_batched"])


UNSTABLE = 1.1  # a point measured over 10% dearer than a larger one is noise (more work never costs less)


def _steady_seconds(jobs: dict, repeats: int, device: str, retries: int = 2) -> dict:
    """:func:`median_seconds`, then the points that break monotonicity (a count timed over :data:`UNSTABLE`
    times a larger one of the same kind) measured again, up to ``retries`` times, keeping each point's fastest
    median: load on a shared machine only ever adds time (a new user's build once stored 2 target tokens at
    63 ms, 4 at 50, 8 at 88, 16 at 76)."""
    seconds = median_seconds(jobs, repeats, device)
    for _ in range(retries):
        unstable = _unstable_points(seconds)
        if not unstable:
            break
        again = median_seconds({key: jobs[key] for key in unstable}, repeats, device)
        seconds.update({key: min(seconds[key], t) for key, t in again.items()})
    return seconds


def _unstable_points(seconds: dict) -> set:
    """Keys ``(kind, n)`` of each pair of points where the smaller count took over :data:`UNSTABLE` times longer."""
    unstable = set()
    for (kind, n), t in seconds.items():
        for (other_kind, m), u in seconds.items():
            if other_kind == kind and m > n and t > UNSTABLE * u:
                unstable |= {(kind, n), (kind, m)}
    return unstable


def monotone_fit(points: list[list[float]]) -> list[list[float]]:
    """``[x, seconds]`` points (sorted by x) made non-decreasing by pooling adjacent violators (isotonic
    regression): a pair measured in the wrong order is replaced by its mean, rather than the noisy point
    stretching the curve up to it."""
    blocks: list[list[float]] = []  # [sum of seconds, count] per pooled run of points
    for _, t in points:
        blocks.append([t, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [mean for total, count in blocks for mean in [total / count] * count]
    return [[x, t] for (x, _), t in zip(points, fitted)]


def busy_machine_warning() -> str | None:
    """A warning when the load average exceeds the cores (step times measured now would mislead the adaptive
    chooser: docs/trees.md#adaptive-tree-budget), else None."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None
    cores = os.cpu_count() or 1
    if load <= cores:
        return None
    return (f"the machine is busy (load average {load:.1f} on {cores} cores): step times measured now make the "
            "adaptive tree budget misjudge what speculation costs here. Recalibrate when it is idle: "
            "clover build --output ENGINE_DIR --recalibrate")


def _batched_tree_jobs(engine, spec, counts: list[int], past: int, gen):
    """``(n, job)`` per even n of ``counts``: one target pass of 2 sequences with n/2 new tokens each (a causal
    chain) after ``past`` cached ones: how an engine that runs several sequences' trees apart prices them."""
    from clover.attention import causal_packed_mask
    from clover.kv_cache import KVCache

    cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, past + max(counts), spec.dtype,
                    capacity=2, device=spec.device)
    cache.add_rows(2)
    k_cache, v_cache = cache.views()
    lengths = torch.tensor([past, past], dtype=torch.int32)
    jobs = []
    for n in (n for n in counts if n >= 2 and n % 2 == 0):
        width = n // 2
        ids = torch.randint(0, spec.vocab_size, (2, width), generator=gen)
        positions = torch.arange(past, past + width).expand(2, -1).contiguous()
        jobs.append((n, functools.partial(engine.target, ids, positions, lengths, causal_packed_mask(2, width),
                                          k_cache, v_cache)))
    return jobs


def _chain_jobs(call, spec, num_layers: int, counts: list[int], past: int, first_inputs):
    """``(n, job)`` per n of ``counts``: ``call(*first_inputs(n), position_ids, past_lengths, packed_mask, k_cache,
    v_cache)`` over one causal chain of n new positions after ``past`` cached ones (the calls read the cache,
    never write it, so they share one)."""
    from clover.attention import causal_packed_mask
    from clover.kv_cache import KVCache

    cache = KVCache(num_layers, spec.num_kv_heads, spec.head_dim, past + max(counts), spec.dtype, device=spec.device)
    cache.add_rows(1)
    k_cache, v_cache = cache.views()
    lengths = torch.tensor([past], dtype=torch.int32)
    return [(n, functools.partial(call, *first_inputs(n), torch.arange(past, past + n)[None], lengths,
                                  causal_packed_mask(1, n), k_cache, v_cache)) for n in counts]


@dataclasses.dataclass
class SourceCalibration:
    """How far each candidate source's raw probabilities are from its measured acceptance, per tree depth
    (docs/trees.md#model-free-candidates): the factor that puts the heads' and the suffix index's candidates on
    one scale when they share a tree.

    Rows: 0 the heads (raw: the joint path probability of their draft), 1..4 suffix candidates whose matched
    suffix was 1, 2, 3, >= 4 tokens long (raw: count ÷ occurrences). Per row and depth, factor = EMA(accepted
    nodes) ÷ EMA(sum of raw probabilities of the nodes proposed), from ``prior`` with ``prior_weight`` pseudo
    nodes. The suffix prior is conservative (a 1-token match says little), and the heads' is 1 (their draft
    probability as it is) until measured.
    """

    max_depth: int
    decay: float = 0.9  # per decode step
    prior: tuple[float, ...] = (1.0, 0.25, 0.45, 0.65, 0.85)
    prior_weight: float = 2.0
    predicted: np.ndarray = dataclasses.field(init=False)
    accepted: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.predicted = np.full((len(self.prior), self.max_depth + 1), self.prior_weight)
        self.accepted = self.predicted * np.asarray(self.prior)[:, None]

    def factors(self) -> np.ndarray:
        """float ``[rows, max_depth + 1]``: accepted ÷ predicted."""
        return self.accepted / self.predicted

    def observe(self, depths: np.ndarray, bits: np.ndarray, raw: np.ndarray, keys: np.ndarray,
                on_path: np.ndarray) -> None:
        """One step's trees: depths int ``[B, T]``, bits ``[B, T]`` (bit 0 heads, bit 1 suffix), raw ``[B, T, 2]``
        each source's raw probability, keys ``[B]`` each sequence's suffix row, on_path bool ``[B, T]`` the
        accepted nodes. Nodes proposed by both sources count for both."""
        shape = self.predicted.shape
        depth = depths.clip(0, shape[1] - 1)
        predicted, accepted = np.zeros(shape), np.zeros(shape)
        for column, rows in ((0, np.zeros_like(keys)), (1, keys)):
            proposed = ((bits >> column) & 1).astype(bool) & (depths > 0)
            b, t = np.nonzero(proposed)
            np.add.at(predicted, (rows[b], depth[b, t]), raw[b, t, column])
            np.add.at(accepted, (rows[b], depth[b, t]), on_path[b, t])
        seen = predicted > 0
        self.predicted[seen] = self.decay * self.predicted[seen] + predicted[seen]
        self.accepted[seen] = self.decay * self.accepted[seen] + accepted[seen]
