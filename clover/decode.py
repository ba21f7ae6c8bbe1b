"""The decode loop, written once for every backend and method.

:class:`SpeculativeDecoder` keeps a batch of live sequences with a shared
:class:`~clover.kv_cache.KVCache`. Each :meth:`~SpeculativeDecoder.step`
prefills newly submitted requests (in arrival order, as many as
:func:`~clover.scheduling.prompts_to_admit` lets one step take), then runs one
decode step for every live sequence: propose the token trees (the method's :class:`~clover.proposers.Proposer`),
verify them in one ``target`` pass, accept, write the accepted tokens' K/V, emit
tokens, stop sequences. New requests join between steps (in-flight batching);
finished or cancelled ones leave at once. The loop never asks which method it
runs for its trees: :func:`~clover.proposers.make_proposer` does
(docs/architecture.md#one-decode-step).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Iterable

import torch


from clover.adaptive import AdaptiveBudget, CostModel
from clover.attention import causal_packed_mask
from clover.stats import StepOutcome, tokens_per_step
from clover.text import StopFinder, answer_text
from clover.config import ConfigError, SamplingConfig, TreeConfig, new_tokens_range
from clover.device_loop import DeviceLoop
from clover.engine_contract import Engine
from clover.kv_cache import KVCache
from clover.host_ops import as_numpy, cpu_tensor, take_rows
from clover.prompts import refuse_empty_prompt
from clover.methods import check_method, method_traits, suffix_candidates_on, uses_heads
from clover.proposers import Proposer, make_proposer
from clover.scheduling import prompts_to_admit
from clover.tree import TreeBatch
from clover.verify import Accepted, greedy_accept, sample_token, sampling_accept


@dataclasses.dataclass
class GenerationRequest:
    """One prompt to continue. ``stop_token_ids`` default to the tokenizer's EOS."""

    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    request_id: Any = None

    def validate(self, max_seq_len: int, has_tokenizer: bool, vocab_size: int | None = None,
                 cap_new_tokens: bool = False) -> None:
        """ConfigError for a request a decoder with a ``max_seq_len`` context (and ``vocab_size`` tokens, where
        given) cannot run. ``cap_new_tokens``: also refuse ``max_new_tokens`` beyond the context (a server's
        bound, clover.config.new_tokens_range; the library just stops there). Sampling values are checked
        where they are made (:class:`~clover.config.SamplingConfig`).

        The one check of a request's values, run once per request: by :meth:`SpeculativeDecoder.submit` for
        a direct caller, by :meth:`~clover.serving.batcher.InflightBatcher.submit` for the batcher's callers,
        by :func:`~clover.serving.protocol.parse_request` for the server's (each passes ``validated=True`` on).
        """
        refuse_empty_prompt(self.prompt_ids)
        low, high = new_tokens_range(max_seq_len)
        if self.max_new_tokens < low:
            raise ConfigError(f"max_new_tokens must be >= {low}, got {self.max_new_tokens}")
        if cap_new_tokens and self.max_new_tokens > high:
            raise ConfigError(f"max_new_tokens {self.max_new_tokens} is larger than the engine's context of "
                              f"{high} tokens")
        if len(self.prompt_ids) + 1 > max_seq_len:  # the first new token needs a cache slot as well
            raise ConfigError(f"the prompt is {len(self.prompt_ids)} tokens and does not fit the context of "
                              f"{max_seq_len} tokens; it must be shorter")
        if vocab_size is not None:
            _refuse_outside_vocab("prompt token id", self.prompt_ids, vocab_size)
            _refuse_outside_vocab("stop token id (end_id)", self.stop_token_ids or (), vocab_size)
        if self.stop_strings and not has_tokenizer:
            raise ConfigError("stop strings need a tokenizer")


def _refuse_outside_vocab(what: str, token_ids, vocab_size: int) -> None:
    outside = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise ConfigError(f"{what} {outside} is outside the vocabulary [0, {vocab_size})")


@dataclasses.dataclass
class SequenceStats:
    """num_steps: target passes after the prompt; accepted_per_step: accepted draft
    tokens per step; num_draft_tokens: draft tree nodes proposed, summed over
    steps; depth_tried[d] / depth_accepted[d]: steps whose tree reached depth
    d+1, and steps that accepted a token there."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    accepted_per_step: list[int] = dataclasses.field(default_factory=list)
    depth_tried: list[int] = dataclasses.field(default_factory=list)
    depth_accepted: list[int] = dataclasses.field(default_factory=list)

    def record(self, tree_size: int, depth_reached: int, accepted_depth: int) -> None:
        """Count one decode step of a ``tree_size``-node tree reaching depth ``depth_reached`` that accepted
        ``accepted_depth`` draft tokens."""
        self.num_steps += 1
        self.num_draft_tokens += tree_size - 1
        self.accepted_per_step.append(accepted_depth)
        for d in range(depth_reached):
            if d == len(self.depth_tried):
                self.depth_tried.append(0)
                self.depth_accepted.append(0)
            self.depth_tried[d] += 1
            self.depth_accepted[d] += d < accepted_depth

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepted, self.depth_tried)]


@dataclasses.dataclass
class SequenceResult:
    request_id: Any
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled"
    stats: SequenceStats
    text: str | None = None

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target pass after the prompt (the first token comes from the prompt pass)."""
        return tokens_per_step(len(self.token_ids), self.stats.num_steps)


@dataclasses.dataclass
class StepEvent:
    """New tokens of one sequence from one :meth:`SpeculativeDecoder.step`.

    ``decode_step`` is set when the tokens come from a target pass after the prompt; ``draft_tokens``
    and ``accepted_draft_tokens`` count that pass's draft tree nodes and the ones the target accepted,
    so consumers can keep running totals without reading the decoder's :class:`SequenceStats`.
    """

    seq_id: int
    request_id: Any
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    decode_step: bool = False
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


class _Sequence:
    def __init__(self, seq_id: int, request: GenerationRequest, stop_ids: tuple[int, ...], decode_text,
                 on_emit: Callable[[Any, list[int]], None] | None = None) -> None:
        self.seq_id, self.request = seq_id, request
        self.on_emit = on_emit  # the proposer's hook (its suffix index follows the output)
        self.stop_ids = set(stop_ids)
        self.decode_text = decode_text
        self.generated: list[int] = []
        self.stop_finder = StopFinder(decode_text, request.stop_strings) if request.stop_strings else None
        self.stats = SequenceStats()
        self.finish_reason: str | None = None
        self.generator = torch.Generator().manual_seed(request.seed)
        self.root_token = -1
        self.root_hidden: torch.Tensor | None = None

    def suffix_context(self, width: int = 64) -> list[int]:
        """The last ``width`` tokens of the prompt and the output: what the shared suffix index matches."""
        tail = self.generated[-width:]
        prompt = self.request.prompt_ids
        return prompt[max(0, len(prompt) - (width - len(tail))):] + tail

    def emit(self, tokens: list[int]) -> list[int]:
        """Append tokens, cutting at EOS, max tokens or a stop string; returns what was kept."""
        kept = []
        for token in tokens:
            kept.append(token)
            self.generated.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.generated) >= self.request.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.stop_finder is not None and self.finish_reason != "stop":
            before = len(self.generated) - len(kept)
            cut = self.stop_finder.cut(self.generated, before)
            if cut is not None:  # cut >= before: earlier text had no stop string
                del self.generated[cut:]
                kept = kept[: cut - before]
                self.finish_reason = "stop"
        if self.on_emit is not None:
            self.on_emit(self, kept)
        return kept

    def result(self) -> SequenceResult:
        text = None
        if self.decode_text is not None:
            text = answer_text(self.decode_text, self.generated, self.request.stop_strings)
        return SequenceResult(self.request.request_id, self.request.prompt_ids, list(self.generated),
                              self.finish_reason or "length", self.stats, text)


class SpeculativeDecoder:
    """Batched speculative (or vanilla) decoding on one engine.

    ``clover2`` keeps a second cache, ``draft_cache``, for the drafter's own
    layers (engine contract v2, docs/engine-contract.md#version-2-draft_prefill):
    its rows are added, committed and removed with the target cache's, so both
    always hold the same sequences and the same number of positions.

    Args:
        engine: anything implementing :class:`clover.engine_contract.Engine`.
        method: ``vanilla``, ``medusa``, ``clover``, ``clover2`` or ``suffix``; the head methods need
            an engine whose drafter is of that family; ``suffix`` drafts with the suffix proposer alone.
        tree: tree settings (default: dynamic tree, budget 4, suffix candidates merged into the heads').
        tokenizer: a transformers tokenizer, for EOS, stop strings and text.
        max_batch_size: live sequences at most; later requests wait.
        prefill_chunk_tokens: padded prompt tokens per prefill call at most
            (prompts are grouped by length): bounds the ``[B, T, vocab]``
            logits and the padding waste when many requests join at once.
        max_step_tokens: prompt tokens one step prefills, plus one per sequence already decoding, at most
            (vLLM's ``max_num_batched_tokens``; :mod:`clover.scheduling`): a burst is prefilled a chunk per
            step, with decode steps between. None: every waiting request that has a batch row, in one step.
        cost_model: step times for adaptive trees (``tree.adaptive``); default
            the engine's ``cost_model`` (calibrated by ``build_engine --calibrate``).
        step_timing: let the adaptive chooser correct the cost model with the measured times of its
            own steps (:meth:`clover.adaptive.AdaptiveBudget.observe_time`); False: the model alone.
    """

    def __init__(self, engine: Engine, method: str = "clover", tree: TreeConfig | None = None,
                 tokenizer=None, max_batch_size: int = 64, cost_model: CostModel | None = None,
                 prefill_chunk_tokens: int = 2048, step_timing: bool = True,
                 max_step_tokens: int | None = None) -> None:
        spec = engine.spec
        self.engine, self.method = engine, method
        self.tree = tree or TreeConfig()
        check_method(method, self.tree, spec)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if max_step_tokens is not None and max_step_tokens < 1:
            raise ConfigError(f"max_step_tokens must be >= 1 (or None: no cap), got {max_step_tokens}")
        self.max_step_tokens = max_step_tokens
        self.cache = KVCache(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, spec.max_seq_len, spec.dtype,
                             device=spec.device)
        # model-free candidates, calibrated against the heads' per depth (docs/trees.md#model-free-candidates)
        self.suffix_on = suffix_candidates_on(method, self.tree)
        # an engine that runs whole steps on the device (docs/gpu-engine.md): heads' trees, the suffix proposer's
        # candidates merged in, or vanilla
        self.device_loop = DeviceLoop.create(engine, method, self.tree, self.cache, max_batch_size, self.suffix_on)
        self._ids = itertools.count()
        self._pending: list[_Sequence] = []
        self._running: list[_Sequence] = []  # index == cache row
        self._cancelled: set[int] = set()
        device_costs = self.device_loop.cost_model(self.tree) if self.device_loop is not None else None
        self.adaptive = self._adaptive_budget(cost_model or getattr(engine, "cost_model", None) or device_costs,
                                              step_timing)
        self._heads = uses_heads(method)
        # what each step verifies; it prices suffix candidates with the adaptive chooser's cost model
        self.proposer: Proposer = make_proposer(method, self.tree, engine, self.adaptive)
        self._max_step_tokens = 1 + self.proposer.max_draft_nodes(self.tree)  # the cache room a step may need

    # the suffix proposer's state, for reports, benchmarks and tests (defaults where the method has none)

    @property
    def source_counts(self) -> dict[str, list[int]]:
        """Draft nodes proposed and accepted per source, over the steps with merged trees."""
        return getattr(self.proposer, "source_counts", {"heads": [0, 0], "suffix": [0, 0]})

    @property
    def proposer_seconds(self) -> float:
        """Host time of the suffix proposals, summed over steps."""
        return getattr(self.proposer, "proposer_seconds", 0.0)

    @property
    def draft_cache(self) -> KVCache | None:
        """Clover-2's drafter KV cache (engine contract v2), its rows aligned with ``cache``'s; None otherwise."""
        owner = self.proposer.drafter_cache
        return None if owner is None else owner.kv

    @property
    def calibration(self):
        """The candidate sources' :class:`~clover.adaptive.SourceCalibration`; None without suffix candidates."""
        return getattr(self.proposer, "calibration", None)

    @property
    def device_stepper(self):
        """The engine's :class:`~clover.backends.device.DeviceStepper` this decoder's steps run on, or None."""
        return None if self.device_loop is None else self.device_loop.stepper

    @property
    def shared_suffix(self):
        """The suffix index over earlier requests' outputs (``TreeConfig.shared_suffix_tokens``), or None."""
        return getattr(self.proposer, "shared_suffix", None)

    def _adaptive_budget(self, cost_model: CostModel | None, step_timing: bool) -> AdaptiveBudget | None:
        """The per-step budget chooser, or None for a fixed budget (``tree.adaptive`` False, vanilla, a static
        tree, or no cost model where adaptivity was not required)."""
        wanted, spec = self.tree.adaptive, self.engine.spec
        if wanted is False or not method_traits(self.method).drafts or self.tree.static_choices is not None:
            return None
        if cost_model is None:
            if wanted:
                raise ConfigError("adaptive trees need a cost model: build the engine with calibration (the "
                                  "default of clover build), or pass cost_model (clover.adaptive.calibrate)")
            return None
        if not uses_heads(self.method):  # suffix alone: no heads' budget; the cost model decides which candidates pay
            return AdaptiveBudget(cost_model, 0, 1, 0, step_timing=step_timing)
        depth = min(self.tree.depth or spec.num_draft_heads, spec.num_draft_heads)
        return AdaptiveBudget(cost_model, depth, min(self.tree.top_k, spec.draft_top_k), self.tree.budget,
                              step_timing=step_timing)

    # -- public API -------------------------------------------------------

    def submit(self, request: GenerationRequest, validated: bool = False) -> int:
        """Queue a request; it is prefilled at the next :meth:`step`. Returns its sequence id.

        Raises ConfigError for a request :meth:`GenerationRequest.validate` refuses. ``validated``: the
        caller already ran that check against this decoder's limits (the in-flight batcher, the server's
        request parser), so it is not run twice.
        """
        if not validated:  # a direct library caller: this is the request's one check
            self.validate(request)
        stop_ids = request.stop_token_ids
        if stop_ids is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            stop_ids = () if eos is None else (eos,)
        decode_text = self.tokenizer.decode if self.tokenizer is not None else None
        seq = _Sequence(next(self._ids), request, tuple(stop_ids), decode_text, self.proposer.emitted)
        self._pending.append(seq)
        return seq.seq_id

    def validate(self, request: GenerationRequest) -> None:
        """:meth:`GenerationRequest.validate` against this decoder's engine and tokenizer."""
        request.validate(self.engine.spec.max_seq_len, self.tokenizer is not None, self.engine.spec.vocab_size)

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence; it leaves the batch at the next step."""
        self._cancelled.add(seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self._pending or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Submitted requests not prefilled yet."""
        return len(self._pending)

    def step(self, on_prefill: Callable[[list[StepEvent]], None] | None = None) -> list[StepEvent]:
        """Prefill the waiting requests this step admits, then one decode step for all live sequences.

        ``on_prefill`` receives each prompt pass's events (the admitted requests' first tokens) as soon as that
        pass ends, before the decode step, so a server can stream them at once; those events are then not in
        the list returned. Without it, every event of the step is returned.
        """
        events = self._drop_cancelled()
        for chunk in self._prefill_chunks(self._admit()):
            prefilled = self._prefill(chunk)
            if on_prefill is None:
                events += prefilled
            else:
                on_prefill(prefilled)
        if self._running:
            events += self._decode_step()
        return events

    def _admit(self) -> list[_Sequence]:
        """The waiting requests this step prefills, oldest first (:func:`~clover.scheduling.prompts_to_admit`)."""
        count = prompts_to_admit([len(s.request.prompt_ids) for s in self._pending],
                                 self.max_batch_size - len(self._running), len(self._running), self.max_step_tokens)
        admitted, self._pending = self._pending[:count], self._pending[count:]
        return admitted

    def generate(self, requests: Iterable[GenerationRequest],
                 on_event: Callable[[StepEvent], None] | None = None) -> list[SequenceResult]:
        """Run requests to completion; results in request order."""
        order = [self.submit(r) for r in requests]
        done: dict[int, SequenceResult] = {}
        sequences = {s.seq_id: s for s in self._pending}
        while self.has_work:
            for event in self.step():
                if on_event is not None:
                    on_event(event)
                if event.finished:
                    done[event.seq_id] = sequences[event.seq_id].result()
        return [done[i] for i in order]

    def result(self, seq_id: int) -> SequenceResult:
        for seq in (*self._running, *self._pending):
            if seq.seq_id == seq_id:
                return seq.result()
        raise KeyError(seq_id)

    # -- internals --------------------------------------------------------

    def _drop_cancelled(self) -> list[StepEvent]:
        if not self._cancelled:
            return []
        events = []
        for seq in [s for s in (*self._pending, *self._running) if s.seq_id in self._cancelled]:
            seq.finish_reason = "cancelled"
            events.append(StepEvent(seq.seq_id, seq.request.request_id, [], True, "cancelled"))
        self._pending = [s for s in self._pending if s.seq_id not in self._cancelled]
        self._remove([i for i, s in enumerate(self._running) if s.seq_id in self._cancelled])
        self._cancelled.clear()
        return events

    def _remove(self, rows: list[int]) -> None:
        for row in rows:  # finished outputs feed the shared suffix index
            self.proposer.finished(self._running[row])
        if rows:
            order = self.cache.remove_rows(rows)
            if self.device_loop is not None:  # its root states are per row too
                self.device_loop.reorder(order)
            self.proposer.rows_removed(rows)  # clover2's draft cache: the same compaction
            self._running = [self._running[i] for i in order]

    def _prefill_chunks(self, seqs: list[_Sequence]) -> list[list[_Sequence]]:
        """Admitted sequences grouped by prompt length, at most ``prefill_chunk_tokens`` padded tokens a group."""
        chunks: list[list[_Sequence]] = []
        for seq in sorted(seqs, key=lambda s: len(s.request.prompt_ids)):
            width = len(seq.request.prompt_ids)  # the longest so far, as they are sorted
            if chunks and width * (len(chunks[-1]) + 1) <= self.prefill_chunk_tokens:
                chunks[-1].append(seq)
            else:
                chunks.append([seq])
        return chunks

    def _prefill(self, seqs: list[_Sequence]) -> list[StepEvent]:
        """One causal pass over the new prompts (right-padded); emits each first token."""
        lengths = torch.tensor([len(s.request.prompt_ids) for s in seqs])
        batch, width = len(seqs), int(lengths.max())
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        for i, seq in enumerate(seqs):
            input_ids[i, : lengths[i]] = torch.tensor(seq.request.prompt_ids)
        position_ids = torch.arange(width).expand(batch, -1).contiguous()
        new_rows = self.cache.add_rows(batch)
        rows = slice(new_rows.start, new_rows.stop)
        if self.device_loop is not None:  # on the device: only the first tokens come back
            first = self.device_loop.prefill(rows, input_ids, lengths, seqs)
            result, roots, presents = None, [None] * batch, (None, None)  # the K/V are in the cache already
        else:
            k_cache, v_cache = self.cache.views(rows)
            result = self.engine.target(input_ids, position_ids, torch.zeros(batch, dtype=torch.int32),
                                        causal_packed_mask(batch, width), k_cache, v_cache)
            presents = (result.present_keys, result.present_values)
            last = lengths - 1
            first = [sample_token(result.logits[i, last[i]], s.request.sampling, s.generator)
                     for i, s in enumerate(seqs)]
            roots = [result.h0[i, last[i]].clone() for i in range(batch)]
        self.cache.commit(*presents, torch.arange(width).expand(batch, -1), lengths, rows=rows)
        self._running.extend(seqs)
        events = []
        for seq, token, root in zip(seqs, first, roots):
            seq.root_token, seq.root_hidden = token, root  # root None: the device stepper holds it
            self.proposer.start(seq)
            events.append(self._event(seq, seq.emit([token])))
        if result is not None:
            self.proposer.prefilled(seqs, rows, result.h0, input_ids, lengths)
        self._remove([new_rows.start + i for i, s in enumerate(seqs) if s.finish_reason])
        return events

    def _decode_step(self) -> list[StepEvent]:
        seqs = self._running
        # a sequence whose next tree could overflow the cache ends here
        full = [i for i, length in enumerate(self.cache.lengths_array.tolist())
                if length + self._max_step_tokens > self.cache.max_seq_len]
        events = []
        for i in full:
            seqs[i].finish_reason = "length"
            events.append(self._event(seqs[i], []))
        self._remove(full)
        seqs = self._running
        if not seqs:
            return events

        started = time.perf_counter()
        tree = self.tree
        if self.adaptive is not None:  # this step's heads' budget, from the live batch size (0: no draft steps)
            tree = dataclasses.replace(tree, budget=self.adaptive.choose(len(seqs)))
        step = self.device_loop.step(seqs, tree, self.proposer) if self.device_loop is not None else None
        if step is None:
            if self.device_loop is not None:  # no batch bucket holds the batch: this step runs on the host
                self.device_loop.roots_to_host(seqs)
            step = self._host_decode_step(seqs, tree)
        for seq, tokens, size in zip(seqs, step.tokens, step.tree_sizes):
            events.append(self._event(seq, seq.emit(tokens), (size - 1, len(tokens) - 1)))
        self._observe(seqs, step, time.perf_counter() - started)
        self._remove([i for i, s in enumerate(seqs) if s.finish_reason])
        return events

    def _observe(self, seqs: list[_Sequence], step: StepOutcome, seconds: float) -> None:
        """What observes a step learns from its outcome: each sequence's statistics, and the adaptive budget."""
        for seq, size, depth, tokens in zip(seqs, step.tree_sizes, step.depths, step.tokens):
            seq.stats.record(size, depth, len(tokens) - 1)
        if self.adaptive is not None:
            self.adaptive.observe_step(step, seconds)

    def _host_decode_step(self, seqs: list[_Sequence], tree: TreeConfig) -> StepOutcome:
        """propose → verify → accept → commit on the host loop (any engine); each row's next root."""
        batch = self.proposer.propose(seqs, tree)
        past = self.cache.lengths_array.copy()  # int32 [n]; NumPy: docs/trees.md#host-work-per-step
        k_cache, v_cache = self.cache.views()
        result = self.engine.target(batch.input_ids, torch.from_numpy(past[:, None] + as_numpy(batch.position_offsets)),
                                    torch.from_numpy(past), batch.packed_mask, k_cache, v_cache)
        accepted = self._accept(seqs, result.logits, batch)
        heads_accepted = self.proposer.observe(batch, accepted)
        width = max(len(a.path) for a in accepted)
        source = cpu_tensor([a.path + [0] * (width - len(a.path)) for a in accepted])
        self.cache.commit(result.present_keys, result.present_values, source,
                          cpu_tensor([len(a.path) for a in accepted]))
        # the next roots' states: h0 at each deepest accepted node, one gather for the batch [n, H]
        # (clover2's proposer sets them from its draft_prefill in stepped() instead)
        if self._heads and self.draft_cache is None:
            root_hidden = take_rows(result.h0.flatten(0, 1), [i * result.h0.shape[1] + a.path[-1]
                                                              for i, a in enumerate(accepted)])
            for seq, root in zip(seqs, root_hidden.unbind(0)):  # one op for all rows, not one per row
                seq.root_hidden = root
        for seq, acc in zip(seqs, accepted):
            seq.root_token = acc.tokens[-1]
        self.proposer.stepped(seqs, result.h0, accepted)
        return StepOutcome(tree.budget, batch.input_ids.shape[1], batch.tree_sizes().tolist(),
                           as_numpy(batch.position_offsets).max(1).tolist(), [a.tokens for a in accepted],
                           heads_accepted)  # tree_tokens: every row runs at the widest tree

    @staticmethod
    def _accept(seqs: list[_Sequence], logits: torch.Tensor, batch: TreeBatch) -> list[Accepted]:
        """Each sequence's accepted path: greedy for the whole batch, then tree speculative sampling for the
        sequences that sample (only they need the trees as :class:`~clover.tree.TokenTree` objects)."""
        accepted = greedy_accept(logits, batch)
        sampled = [i for i, seq in enumerate(seqs) if not seq.request.sampling.greedy]
        trees = batch.trees() if sampled else []
        for i in sampled:
            accepted[i] = sampling_accept(logits[i], trees[i], seqs[i].request.sampling, seqs[i].generator)
        return accepted

    @staticmethod
    def _event(seq: _Sequence, tokens: list[int], step_counts: tuple[int, int] | None = None) -> StepEvent:
        """``step_counts``: (drafted, accepted) of the decode step the tokens come from; None for no decode step."""
        drafted, accepted = step_counts or (0, 0)
        return StepEvent(seq.seq_id, seq.request.request_id, tokens, seq.finish_reason is not None, seq.finish_reason,
                         decode_step=step_counts is not None, draft_tokens=drafted, accepted_draft_tokens=accepted)
