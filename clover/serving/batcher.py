"""In-flight batching: one background thread drives :class:`~clover.decode.SpeculativeDecoder`.

Requests arrive from any thread (:meth:`InflightBatcher.submit`). The decode
thread hands them to the decoder between steps, so a new request joins the
running batch at the next step without waiting for the others (a burst joins
a chunk of prompts per step, in arrival order, where the decoder has a
``max_step_tokens`` cap: :mod:`clover.scheduling`); each request's first
token goes out as soon as its prompt pass ends; finished and cancelled
requests leave at once. After every step each request's callback receives an
:class:`Update` with its new tokens and the new text (text that can still
change, such as a partial UTF-8 character or the start of a stop string, is
held back until it is settled).

The :class:`~clover.decode.SpeculativeDecoder` is only ever touched by the
decode thread.

Shutdown is a drain (docs/serving.md#shutdown-faults-and-security):
:meth:`InflightBatcher.begin_drain` refuses new requests at once, lets those in
flight run until its deadline, then cancels them (each gets its final update,
finish reason ``cancelled``), so the server can exit inside Triton's exit
timeout.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable

from clover.stats import tokens_per_step
from clover.decode import GenerationRequest, SpeculativeDecoder, StepEvent
from clover.text import TextStream

log = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down; the request was cancelled"
REFUSED_MESSAGE = "the server is shutting down; it takes no new requests"


class ShuttingDown(RuntimeError):
    """A request submitted while the batcher drains or after it stopped (a server state, not a bad request)."""


@dataclasses.dataclass
class RequestStats:
    """Counters of one request. ``draft_tokens``: draft tree nodes proposed, summed over its steps."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    decode_steps: int = 0
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.output_tokens, self.decode_steps)


@dataclasses.dataclass
class Update:
    """What a request's callback receives after a step.

    ``token_ids`` / ``text``: new since the previous update (concatenated, they give the
    whole answer). ``error`` is set when the request failed; it is then ``finished``.
    """

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stats: RequestStats
    error: str | None = None


@dataclasses.dataclass
class BatcherMetrics:
    """Totals since start, plus the current batch. Read a copy with :meth:`InflightBatcher.metrics`."""

    requests_submitted: int = 0
    requests_finished: dict[str, int] = dataclasses.field(default_factory=dict)  # by finish reason, and "error"
    output_tokens: int = 0
    decode_tokens: int = 0  # output tokens that came from decode steps (all but each request's first)
    batch_steps: int = 0  # decoder.step() calls that ran the engine
    sequence_steps: int = 0  # target passes summed over sequences
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0
    active_batch_size: int = 0
    pending_requests: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.decode_tokens / self.sequence_steps if self.sequence_steps else 0.0

    @property
    def mean_batch_size(self) -> float:
        return self.sequence_steps / self.batch_steps if self.batch_steps else 0.0

    def copy(self) -> "BatcherMetrics":
        return dataclasses.replace(self, requests_finished=dict(self.requests_finished))


class RequestHandle:
    """Returned by :meth:`InflightBatcher.submit`; :meth:`cancel` stops the request at the next step."""

    def __init__(self, batcher: "InflightBatcher", entry: "_Entry") -> None:
        self._batcher, self._entry = batcher, entry

    @property
    def id(self) -> int:
        return self._entry.id

    @property
    def done(self) -> bool:
        return self._entry.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._entry.done.wait(timeout)

    def cancel(self) -> None:
        self._batcher._cancel(self._entry)


class _Entry:
    def __init__(self, entry_id: int, request: GenerationRequest, on_update: Callable[[Update], None],
                 is_cancelled: Callable[[], bool] | None, tokenizer) -> None:
        self.id, self.request = entry_id, request
        self.on_update, self.is_cancelled = on_update, is_cancelled
        self.text = TextStream(tokenizer, request.stop_strings)
        self.stats = RequestStats(prompt_tokens=len(request.prompt_ids))
        self.seq_id: int | None = None
        self.cancel_requested = False
        self.last_poll = 0.0
        self.done = threading.Event()


class InflightBatcher:
    """Decodes concurrent requests together on a background thread.

    Args:
        make_decoder: builds the :class:`SpeculativeDecoder` (called once at start, and
            again to start afresh if a decode step raises).
        on_step: called on the decode thread with a :class:`BatcherMetrics` copy after each
            step (e.g. to export Prometheus metrics).
        cancel_poll_s: how often each live request's ``is_cancelled`` is asked at most.
    """

    def __init__(self, make_decoder: Callable[[], SpeculativeDecoder],
                 on_step: Callable[[BatcherMetrics], None] | None = None,
                 cancel_poll_s: float = 0.05, name: str = "clover-decode") -> None:
        self._make_decoder = make_decoder
        self.decoder = make_decoder()
        self.tokenizer = self.decoder.tokenizer
        self.max_seq_len = self.decoder.engine.spec.max_seq_len
        # the decoder's request check, run on the caller's thread: it reads only the engine's spec and the
        # tokenizer, which every decoder make_decoder builds shares
        self._validate = self.decoder.validate
        self.on_step = on_step
        self.cancel_poll_s = cancel_poll_s
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._inbox: list[_Entry] = []
        self._cancels: list[_Entry] = []
        self._live: dict[int, _Entry] = {}  # by decoder seq_id
        self._stopping = False
        self._drain_deadline: float | None = None  # time.monotonic() when the drain cancels what still runs
        self._metrics = BatcherMetrics()
        self._metrics_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------

    def submit(self, request: GenerationRequest, on_update: Callable[[Update], None],
               is_cancelled: Callable[[], bool] | None = None, validated: bool = False) -> RequestHandle:
        """Queue a request; it joins the batch at the next step.

        ``on_update`` runs on the decode thread after each step that produced something for
        this request, and once with ``finished=True``. If it raises, the request is cancelled.
        ``is_cancelled`` (polled by the decode thread) lets the caller's transport cancel it.
        Raises ConfigError (a ValueError) for a request the decoder would refuse, :class:`ShuttingDown`
        while draining or after shutdown. ``validated``: the caller already ran
        :meth:`GenerationRequest.validate` against this engine (the server's request parser does).
        """
        if not validated:  # this request's one check, before it is queued; the decoder does not repeat it
            self._validate(request)
        entry = _Entry(next(self._ids), request, on_update, is_cancelled, self.tokenizer)
        with self._cond:
            if self._stopping or self._drain_deadline is not None or not self._thread.is_alive():
                raise ShuttingDown(REFUSED_MESSAGE)
            self._inbox.append(entry)
            self._cond.notify()
        with self._metrics_lock:
            self._metrics.requests_submitted += 1
        return RequestHandle(self, entry)

    def metrics(self) -> BatcherMetrics:
        with self._metrics_lock:
            return self._metrics.copy()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def begin_drain(self, seconds: float) -> None:
        """Refuse new requests from now on; cancel those still running ``seconds`` from now (their final
        update has finish reason ``cancelled``). A second call keeps the first deadline."""
        with self._cond:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + max(0.0, seconds)
                self._cond.notify()

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """Stop the decode thread; requests still running get a final error update. Short by default: it runs
        inside Triton's exit timeout, after the drain has ended the requests."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> "InflightBatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _cancel(self, entry: _Entry) -> None:
        with self._cond:
            self._cancels.append(entry)
            self._cond.notify()

    # -- decode thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._cancels or self._stopping or self.decoder.has_work):
                        self._cond.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                for entry in cancels:
                    entry.cancel_requested = True
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    for entry in [*inbox, *self._live.values()]:
                        entry.cancel_requested = True  # the drain is over: end them now, each with its final update
                for entry in inbox:
                    self._admit(entry)
                self._poll_cancellations()
                if self.decoder.has_work:
                    self._step()
        except BaseException as exc:  # never leave clients waiting on a dead thread
            log.exception("clover decode thread crashed")
            self._fail_all(f"internal error in the decode loop: {exc}")
            raise
        finally:
            with self._cond:
                self._stopping = True
                leftover, self._inbox = self._inbox, []
            for entry in leftover:
                self._finish(entry, [], "cancelled", SHUTDOWN_MESSAGE)
            self._fail_all(SHUTDOWN_MESSAGE, "cancelled")
            self._publish()

    def _admit(self, entry: _Entry) -> None:
        if entry.cancel_requested:
            self._finish(entry, [], "cancelled")
            return
        try:
            entry.seq_id = self.decoder.submit(entry.request, validated=True)  # submit() checked it
        except ValueError as exc:
            self._finish(entry, [], None, str(exc))
            return
        self._live[entry.seq_id] = entry

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        for entry in self._live.values():
            cancelled = entry.cancel_requested
            if not cancelled and entry.is_cancelled is not None and now - entry.last_poll >= self.cancel_poll_s:
                entry.last_poll = now
                try:
                    cancelled = bool(entry.is_cancelled())
                except Exception:  # the transport is gone: nobody is listening any more
                    cancelled = True
            if cancelled:
                entry.cancel_requested = True
                self.decoder.cancel(entry.seq_id)

    def _step(self) -> None:
        try:  # first tokens go out as each prompt pass ends, before the step's decode pass (issue 62)
            events = self.decoder.step(on_prefill=self._take_events)
        except Exception as exc:
            log.exception("clover decode step failed")
            self._fail_all(f"decode step failed: {type(exc).__name__}: {exc}")
            self.decoder = self._make_decoder()
            self._publish()
            return
        decoded = self._take_events(events)
        with self._metrics_lock:
            self._metrics.batch_steps += int(decoded)
        self._publish()

    def _take_events(self, events: list[StepEvent]) -> bool:
        """Count and deliver one batch of the decoder's events; whether any came from a decode step."""
        live = [(self._live[event.seq_id], event) for event in events if event.seq_id in self._live]
        for entry, event in live:  # a request has one event per batch: its prompt pass's or its decode step's
            self._count_decode_step(entry, event)
            self._count_output(entry, event.new_token_ids)
            if event.finished:
                del self._live[event.seq_id]
                self._finish(entry, event.new_token_ids, event.finish_reason)
            elif event.new_token_ids:
                self._deliver(entry, event.new_token_ids, finished=False, reason=None)
        return any(event.decode_step for _, event in live)

    def _count_decode_step(self, entry: _Entry, event: StepEvent) -> None:
        """Add the event's decode step, if it has one, to the request's stats and the totals."""
        if not event.decode_step:
            return
        stats = entry.stats
        stats.decode_steps += 1
        stats.draft_tokens += event.draft_tokens
        stats.accepted_draft_tokens += event.accepted_draft_tokens
        with self._metrics_lock:
            self._metrics.sequence_steps += 1
            self._metrics.draft_tokens += event.draft_tokens
            self._metrics.accepted_draft_tokens += event.accepted_draft_tokens

    def _count_output(self, entry: _Entry, new_ids: list[int]) -> None:
        from_prompt_pass = 1 if entry.stats.output_tokens == 0 and new_ids else 0  # a request's first token
        entry.stats.output_tokens += len(new_ids)
        with self._metrics_lock:
            self._metrics.output_tokens += len(new_ids)
            self._metrics.decode_tokens += len(new_ids) - from_prompt_pass

    def _deliver(self, entry: _Entry, new_ids: list[int], finished: bool, reason: str | None,
                 error: str | None = None) -> None:
        text = entry.text.push(new_ids, finished) if error is None else ""
        update = Update(list(new_ids), text, finished, reason, dataclasses.replace(entry.stats), error)
        try:
            entry.on_update(update)
        except Exception:
            log.warning("clover: a response callback failed; cancelling that request", exc_info=True)
            if not finished and entry.seq_id is not None:
                entry.cancel_requested = True
                self.decoder.cancel(entry.seq_id)

    def _finish(self, entry: _Entry, new_ids: list[int], reason: str | None, error: str | None = None) -> None:
        if entry.done.is_set():
            return
        self._deliver(entry, new_ids, True, reason if error is None else (reason or "error"), error)
        entry.done.set()
        key = "error" if error is not None and reason != "cancelled" else (reason or "error")
        with self._metrics_lock:
            self._metrics.requests_finished[key] = self._metrics.requests_finished.get(key, 0) + 1

    def _fail_all(self, message: str, reason: str | None = None) -> None:
        live, self._live = self._live, {}
        for entry in live.values():
            self._finish(entry, [], reason, message)

    def _publish(self) -> None:
        with self._metrics_lock:
            self._metrics.active_batch_size = self.decoder.num_running
            self._metrics.pending_requests = len(self._live) - self.decoder.num_running + len(self._inbox)
            snapshot = self._metrics.copy()
        if self.on_step is not None:
            try:
                self.on_step(snapshot)
            except Exception:
                log.warning("clover: the metrics callback failed", exc_info=True)
