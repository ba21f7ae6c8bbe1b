"""The step scheduler (clover/scheduling.py, issue 62): under ``max_step_tokens`` a burst is prefilled a chunk of
prompts per step, in arrival order; each request's first token goes out when its own prompt pass ends, and the
requests already running decode between the chunks. Checked by the order of events (the engine's passes and the
updates delivered, on one thread), never by time (docs/testing.md)."""

from __future__ import annotations

import threading

import pytest

from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.prompts import encode_prompt
from clover.scheduling import prompts_to_admit
from clover.serving.batcher import InflightBatcher
from clover.serving.warmup import warm_up, warm_up_prompt
from tests.serving_support import PROMPTS, reference, tiny_engine_dir  # noqa: F401  (fixtures)

MAX_TOKENS = 6


def test_prompts_are_admitted_in_arrival_order_within_the_cap():
    assert prompts_to_admit([10, 10, 10, 10], room=8, decoding_rows=0, max_step_tokens=25) == 2
    assert prompts_to_admit([10, 10, 10], room=8, decoding_rows=6, max_step_tokens=25) == 1  # decoding rows count
    # a short prompt behind one that does not fit waits its turn: no overtaking
    assert prompts_to_admit([10, 20, 1], room=8, decoding_rows=0, max_step_tokens=25) == 1
    assert prompts_to_admit([10, 15, 1], room=8, decoding_rows=0, max_step_tokens=25) == 2  # exactly the cap fits


def test_the_oldest_prompt_goes_in_alone_over_the_cap_and_free_rows_bound_every_step():
    assert prompts_to_admit([100, 1], room=8, decoding_rows=3, max_step_tokens=25) == 1  # never split, never starved
    assert prompts_to_admit([1] * 10, room=3, decoding_rows=0, max_step_tokens=1000) == 3
    assert prompts_to_admit([5, 5], room=0, decoding_rows=16, max_step_tokens=1000) == 0
    assert prompts_to_admit([], room=4, decoding_rows=0, max_step_tokens=10) == 0
    assert prompts_to_admit([50] * 6, room=4, decoding_rows=0, max_step_tokens=None) == 4


@pytest.fixture(scope="module")
def ort_engine(tiny_engine_dir):
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.target import load_tokenizer

    return OnnxRuntimeEngine(tiny_engine_dir, threads=1), load_tokenizer(tiny_engine_dir)


class _LoggedEngine:
    """The engine, each target pass logged as ("prompt", rows) (no past: a prompt pass) or ("decode", rows); a
    ``gate`` holds the first pass until the test has submitted a whole burst."""

    def __init__(self, engine, log: list) -> None:
        self.engine, self.log, self.gate = engine, log, threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def target(self, input_ids, position_ids, past_lengths, *rest):
        assert self.gate.wait(60), "the test never opened the gate"
        self.log.append(("decode" if int(past_lengths.max()) > 0 else "prompt", input_ids.shape[0]))
        return self.engine.target(input_ids, position_ids, past_lengths, *rest)


def _burst(tokenizer, count: int) -> list[GenerationRequest]:
    return [GenerationRequest(encode_prompt(tokenizer, PROMPTS[i]), max_new_tokens=MAX_TOKENS) for i in range(count)]


def _cap(requests: list[GenerationRequest]) -> int:
    """Room for the burst's two longest prompts: a first step of two prompts or more, and several steps."""
    longest = sorted(len(r.prompt_ids) for r in requests)
    return longest[-1] + longest[-2]


def _step_with_log(decoder, log: list, outputs: dict) -> list[int]:
    """One step; logs each prompt pass's first tokens as ("first", seq ids); returns the seq ids it prefilled."""
    prefilled = []

    def first_tokens(events):
        log.append(("first", sum(e.finished for e in events)))  # how many ended at their first token
        prefilled.extend(e.seq_id for e in events)
        for e in events:
            outputs[e.seq_id] = list(e.new_token_ids)

    for e in decoder.step(on_prefill=first_tokens):
        outputs[e.seq_id] += e.new_token_ids
    return prefilled


def test_a_burst_is_prefilled_in_arrival_order_under_the_cap_with_decode_steps_between(ort_engine, reference):
    engine, tokenizer = ort_engine
    log, outputs = [], {}
    requests = _burst(tokenizer, 10)
    cap = _cap(requests)
    decoder = SpeculativeDecoder(_LoggedEngine(engine, log), "clover", tokenizer=tokenizer, max_batch_size=16,
                                 max_step_tokens=cap)
    ids = [decoder.submit(r) for r in requests]
    chunks = []
    while decoder.has_work:
        decoding = decoder.num_running
        log.append(("step", decoding))
        prefilled = _step_with_log(decoder, log, outputs)
        if prefilled:
            chunks.append(sorted(prefilled))
            tokens = sum(len(requests[ids.index(i)].prompt_ids) for i in prefilled)
            assert len(prefilled) == 1 or tokens + decoding <= cap, (prefilled, tokens, decoding, cap)
    assert [i for chunk in chunks for i in chunk] == ids  # every request once, in arrival order
    assert len(chunks) >= 2 and len(chunks[0]) >= 2  # the cap chunked the burst, several prompts a chunk
    _check_first_tokens_before_each_steps_decode_pass(log)
    for i, request in zip(ids, requests):
        assert outputs[i] == reference(PROMPTS[ids.index(i)], MAX_TOKENS).token_ids  # each equals its solo answer


def _check_first_tokens_before_each_steps_decode_pass(log: list) -> None:
    """In every step: prompt passes, each followed at once by its first tokens, then the decode pass of every
    running row, those just prefilled included; and a later chunk's step decodes the rows of earlier ones."""
    steps = _split_steps(log)
    for decoding, entries in steps:
        kinds = [entry[0] for entry in entries]
        assert kinds == ["prompt", "first"] * kinds.count("prompt") + ["decode"] * ("decode" in kinds), entries
        if "decode" in kinds:
            joined = sum(rows for kind, rows in entries if kind == "prompt") - sum(n for kind, n in entries
                                                                                  if kind == "first")
            assert entries[-1] == ("decode", decoding + joined)
    assert any(decoding and any(kind == "prompt" for kind, _ in entries) for decoding, entries in steps)


def _split_steps(log: list) -> list[tuple[int, list]]:
    steps = []
    for entry in log:
        if entry[0] == "step":
            steps.append((entry[1], []))
        else:
            steps[-1][1].append(entry)
    return steps


def test_the_first_request_of_a_burst_streams_before_the_last_ones_prompt_pass(ort_engine, reference):
    engine, tokenizer = ort_engine
    log = []
    logged = _LoggedEngine(engine, log)
    requests = _burst(tokenizer, 8)
    got = {i: [] for i in range(len(requests))}
    done = [threading.Event() for _ in requests]

    def collector(i):
        def on_update(update):
            if not got[i] and update.token_ids:
                log.append(("first token of", i))
            got[i] += update.token_ids
            if update.finished:
                done[i].set()
        return on_update

    cap = _cap(requests)
    logged.gate.clear()  # every request is waiting before the first pass: a burst, whatever the machine's load
    with InflightBatcher(lambda: SpeculativeDecoder(logged, "clover", tokenizer=tokenizer, max_batch_size=16,
                                                    max_step_tokens=cap)) as batcher:
        for i, request in enumerate(requests):
            batcher.submit(request, collector(i))
        logged.gate.set()
        assert all(event.wait(60) for event in done)
    first_token = log.index(("first token of", 0))
    # out before its step's decode pass (not held back to the end of the step) ...
    assert first_token < next(i for i, entry in enumerate(log) if entry[0] == "decode")
    # ... and before the burst's last prompt pass (not after the whole burst is prefilled)
    assert first_token < max(i for i, entry in enumerate(log) if entry[0] == "prompt")
    for i in range(len(requests)):
        assert got[i] == reference(PROMPTS[i], MAX_TOKENS).token_ids


def test_the_warm_up_still_runs_every_batch_size_when_the_cap_admits_a_few_prompts_a_step(ort_engine):
    engine, tokenizer = ort_engine
    prompt = warm_up_prompt(tokenizer)
    decoder = SpeculativeDecoder(engine, engine.spec.default_method, engine.meta.tree_defaults, tokenizer,
                                 max_batch_size=5, max_step_tokens=2 * len(prompt) + 4)
    done = warm_up(decoder, prompt)
    assert done.prefill_rows == 2  # the cap: two prompts a step at most
    assert done.batch_sizes[-5:] == [5, 4, 3, 2, 1] and set(done.batch_sizes) == {1, 2, 3, 4, 5}
    assert not decoder.has_work and decoder.num_running == 0
