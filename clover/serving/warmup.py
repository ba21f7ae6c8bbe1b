"""Warm-up at model load: one decode step at every batch size the in-flight batcher can run, before the server
reports ready (docs/serving.md#warm-up).

A first pass at a new shape can cost more than the ones after it (memory allocated for the largest batch, a
step shape the device engine did not capture at load), and a burst of requests right after readiness paid for
them all: issue 57 reports 32 streams waiting a median 26 s for their first token, 9 s once warm. The warm-up runs
on a decoder of its own, thrown away after: its cold step times must not teach the serving decoder's adaptive tree
budget, nor its synthetic answers fill the shared suffix index.

It is counted, not timed: :class:`WarmUp` says which batch sizes ran a decode step, so a test can check that a
first burst runs nothing the warm-up did not.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable

from clover.decode import GenerationRequest, SpeculativeDecoder, StepEvent
from clover.prompts import encode_prompt

# a prompt whose answer is long and ordinary; its tokens are never seen by a client
WARM_UP_PROMPT = "Count from one to two hundred in words, one number per line."


@dataclasses.dataclass
class WarmUp:
    """What a warm-up ran: ``batch_sizes``, the live rows of each decode step in order (up to ``max_batch``, then down
    to 1); ``prefill_rows``, the most prompts one step prefilled (all of ``max_batch`` at once, unless the decoder's
    ``max_step_tokens`` admits fewer per step)."""

    batch_sizes: list[int] = dataclasses.field(default_factory=list)
    prefill_rows: int = 0

    def describe(self) -> str:
        sizes = sorted(set(self.batch_sizes))
        covered = f"{sizes[-1]} to {sizes[0]}" if len(sizes) > 1 else str(sizes[0]) if sizes else "none"
        return (f"warmed up: {len(self.batch_sizes)} decode steps at batch sizes {covered}, "
                f"prefill of {self.prefill_rows} prompts at once")


def warm_up_request(decoder: SpeculativeDecoder, prompt_ids: list[int]) -> GenerationRequest:
    """A greedy request on ``prompt_ids`` that only the warm-up ends: no stop tokens, the whole context to fill."""
    max_seq_len = decoder.engine.spec.max_seq_len
    request = GenerationRequest(list(prompt_ids), max_new_tokens=max(1, max_seq_len - len(prompt_ids)),
                                stop_token_ids=(), request_id="warm-up")
    decoder.validate(request)
    return request


def _hold_batch(decoder: SpeculativeDecoder, live: list[int], size: int, request: GenerationRequest) -> int:
    """Cancel or add sequences so that ``size`` are live at the next step; returns how many were added."""
    while len(live) > size:
        decoder.cancel(live.pop())
    added = size - len(live)
    live += [decoder.submit(request, validated=True) for _ in range(added)]
    return added


def _still_live(live: list[int], events: list[StepEvent]) -> list[int]:
    finished = {event.seq_id for event in events if event.finished}
    return [seq_id for seq_id in live if seq_id not in finished]


def warm_up(decoder: SpeculativeDecoder, prompt_ids: list[int]) -> WarmUp:
    """Decode steps at batch sizes ``decoder.max_batch_size`` down to 1, one each at least, on copies of
    ``prompt_ids``: a full batch is submitted at once (a decoder with a ``max_step_tokens`` cap admits it over
    several steps, which then run at the sizes it passes through), then each step runs one sequence fewer (one that
    ended early, at the context's end, is replaced). Leaves ``decoder`` with nothing to do."""
    request, live, done = warm_up_request(decoder, prompt_ids), [], WarmUp()
    for size in range(decoder.max_batch_size, 0, -1):
        _hold_batch(decoder, live, size, request)
        live = _step_until_admitted(decoder, live, done)
    _hold_batch(decoder, live, 0, request)
    while decoder.has_work:  # drops the cancelled rows
        decoder.step()
    return done


def _step_until_admitted(decoder: SpeculativeDecoder, live: list[int], done: WarmUp) -> list[int]:
    """Steps until no request waits (one step at least), each recorded in ``done``; returns the rows still live."""
    while True:
        prefilled = []
        events = decoder.step(on_prefill=prefilled.extend)
        done.batch_sizes.append(sum(event.decode_step for event in events))
        done.prefill_rows = max(done.prefill_rows, len(prefilled))
        live = _still_live(live, prefilled + events)
        if not decoder.num_waiting:
            return live


def warm_up_prompt(tokenizer) -> list[int]:
    """The warm-up prompt's token ids, as a chat request's would be."""
    return encode_prompt(tokenizer, WARM_UP_PROMPT, chat=True)


def warm_up_throwaway(make_decoder: Callable[[], SpeculativeDecoder], tokenizer) -> WarmUp:
    """:func:`warm_up` on a decoder of its own, freed before this returns: its KV cache (device memory on a GPU)
    is gone before the serving decoder allocates one, even where reference cycles would keep it until a collection."""
    decoder = make_decoder()
    done = warm_up(decoder, warm_up_prompt(tokenizer))
    del decoder
    gc.collect()
    return done
