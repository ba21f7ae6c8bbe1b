"""The serving library without Triton: request validation, the in-flight batcher, the model logic
(driven through a stand-in for ``triton_python_backend_utils``), the repository and launcher helpers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from clover.config import ConfigError
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.serving.batcher import InflightBatcher
from clover.serving.protocol import (INPUTS, PARAMETERS, RequestError, RequestLimits, model_parameters, parse_request,
                                     render_model_config)
from clover.prompts import encode_prompt
from clover.serving.repository import TEMPLATE_MODEL_PY, write_repository
from clover.serving.warmup import warm_up, warm_up_prompt
from clover.text import StopFinder, TextStream, answer_text, cut_at_stop, stop_prefix_held
from tests.serving_support import PROMPTS, long_answer_prompt, reference, tiny_engine_dir  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parent.parent


# -- config and repository --------------------------------------------------------------------------


def test_committed_config_is_the_rendered_one():
    committed = (REPO / "triton_repo" / "clover" / "config.pbtxt").read_text()
    assert committed == render_model_config(), "regenerate triton_repo/clover/config.pbtxt with render_model_config()"
    for name in ("text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "end_id", "stop_words",
                 "return_perf_metrics", "text_output", "acceptance_rate", "total_accepted_draft_tokens",
                 "total_draft_tokens"):
        assert f'name: "{name}"' in committed
    assert "decoupled: true" in committed


def test_model_py_is_thin_and_the_checkout_serves_the_package_template():
    code = TEMPLATE_MODEL_PY.read_text()
    assert len(code.splitlines()) < 25 and "from clover.serving.triton_model import CloverTritonModel" in code
    # tritonserver --model-repository triton_repo (a checkout) runs the same entry point as clover serve
    assert (REPO / "triton_repo" / "clover" / "1" / "model.py").read_text() == code, \
        "copy clover/serving/triton_template/model.py to triton_repo/clover/1/model.py"


def test_rendered_parameters_and_errors(tmp_path):
    text = render_model_config({"engine_dir": '/a "quoted"\\path', "method": "vanilla"})
    assert 'string_value: "/a \\"quoted\\"\\\\path"' in text and 'string_value: "vanilla"' in text
    with pytest.raises(ConfigError, match="unknown model parameter"):
        render_model_config({"engine": "x"})
    params = model_parameters({"parameters": {"engine_dir": {"string_value": "/e"}}})
    assert params["engine_dir"] == "/e" and params["method"] == PARAMETERS["method"][0]


def test_write_repository_points_models_at_engines(tmp_path):
    repo = write_repository(tmp_path / "repo", {"clover": {"engine_dir": "rel/engine"},
                                                "clover_vanilla": {"engine_dir": "/abs", "method": "vanilla"}})
    config = (repo / "clover" / "config.pbtxt").read_text()
    assert f'string_value: "{(Path.cwd() / "rel" / "engine").resolve()}"' in config
    assert 'string_value: "vanilla"' in (repo / "clover_vanilla" / "config.pbtxt").read_text()
    assert (repo / "clover" / "1" / "model.py").read_text() == TEMPLATE_MODEL_PY.read_text()
    with pytest.raises(ConfigError, match="not empty"):
        write_repository(tmp_path / "repo")


# -- request validation -----------------------------------------------------------------------------


class _Tok:
    """Byte tokenizer with no chat template (enough for parse_request)."""

    chat_template = None

    def encode(self, text):
        return list(text.encode())


LIMITS = RequestLimits(max_seq_len=64, vocab_size=258)


def _get(**inputs):
    defaults = {"text_input": np.array([b"hello"], dtype=object), "max_tokens": np.array([8], dtype=np.int32)}
    defaults.update(inputs)
    return lambda name: defaults.get(name)


def test_parse_request_reads_every_input():
    parsed = parse_request(_get(stream=np.array([True]), temperature=np.array([0.7], np.float32),
                                top_k=np.array([5], np.int32), top_p=np.array([0.9], np.float32),
                                end_id=np.array([7], np.int32), stop_words=np.array([b"\n\n", b"", b"END"], dtype=object),
                                random_seed=np.array([2**63 + 5], np.uint64),
                                return_perf_metrics=np.array([True])), _Tok(), LIMITS, request_id="r1")
    g = parsed.generation
    assert parsed.stream and parsed.return_perf_metrics
    assert g.prompt_ids == list(b"hello") and g.max_new_tokens == 8 and g.request_id == "r1"
    assert (g.sampling.temperature, g.sampling.top_k) == (pytest.approx(0.7), 5)
    assert g.sampling.top_p == pytest.approx(0.9)
    assert g.stop_token_ids == (7,) and g.stop_strings == ("\n\n", "END") and g.seed == 2**63 + 5
    plain = parse_request(_get(), _Tok(), LIMITS)
    assert not plain.stream and not plain.return_perf_metrics and plain.generation.sampling.greedy
    assert plain.generation.stop_token_ids is None


@pytest.mark.parametrize("inputs, message", [
    ({"text_input": None}, "give exactly one of text_input .* and input_ids .*, got neither"),
    ({"input_ids": np.array([104, 105], np.int32)}, "give exactly one of text_input .* and input_ids .*, not both"),
    ({"text_input": None, "input_ids": np.array([5, 258, 7], np.int32)},
     r"prompt token id 258 is outside the vocabulary \[0, 258\)"),
    ({"text_input": None, "input_ids": np.array([-1], np.int32)}, "prompt token id -1 is outside the vocabulary"),
    ({"text_input": None, "input_ids": np.array([], np.int32)}, "the prompt is empty"),
    ({"text_input": None, "input_ids": np.array([1.0], np.float32)}, r"input_ids must be integers \(INT32\)"),
    ({"text_input": None, "input_ids": np.array([1], np.int32), "apply_chat_template": np.array([True])},
     "apply_chat_template applies to text_input"),
    ({"text_input": None, "input_ids": np.array([1] * 64, np.int32)}, "the prompt is 64 tokens"),
    ({"max_tokens": None}, "missing required input 'max_tokens'"),
    ({"text_input": np.array([b"\xff\xfe bad"], dtype=object)}, "not valid UTF-8"),
    ({"text_input": np.array([b""], dtype=object)}, "the prompt is empty"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "exactly one value"),
    ({"text_input": np.array([3], np.int32)}, "must be BYTES"),
    ({"max_tokens": np.array([0], np.int32)}, "max_new_tokens must be >= 1, got 0"),
    ({"max_tokens": np.array([-5], np.int32)}, "max_new_tokens must be >= 1, got -5"),
    ({"max_tokens": np.array([10**6], np.int32)}, "larger than the engine's context of 64"),
    ({"max_tokens": np.array([2.5], np.float32)}, "must be an integer"),
    ({"max_tokens": np.array([[1, 2]], np.int32)}, "exactly one value"),
    ({"text_input": np.array([b"x" * 64], dtype=object)}, "the prompt is 64 tokens"),
    ({"temperature": np.array([-0.5], np.float32)}, "temperature must be between 0 and 2"),
    ({"temperature": np.array([5.0], np.float32)}, "temperature must be between 0 and 2"),  # as the OpenAI endpoint
    ({"temperature": np.array([np.nan], np.float32)}, "finite"),
    ({"top_p": np.array([0.0], np.float32)}, r"top_p must be in \(0, 1\]"),
    ({"top_p": np.array([1.5], np.float32)}, r"top_p must be in \(0, 1\]"),
    ({"top_k": np.array([-1], np.int32)}, "top_k must be between 0 and"),
    ({"end_id": np.array([999], np.int32)}, "outside the vocabulary"),
    ({"stream": np.array([1], np.int32)}, "must be a boolean"),
    ({"stop_words": np.array([b"\xff"], dtype=object)}, "stop_words"),
])
def test_parse_request_rejects_bad_input(inputs, message):
    with pytest.raises(RequestError, match=message):
        parse_request(_get(**inputs), _Tok(), LIMITS)


def test_every_input_has_a_spec_and_only_max_tokens_is_required():
    assert [s.name for s in INPUTS if not s.optional] == ["max_tokens"]  # and one of text_input, input_ids
    ids = next(s for s in INPUTS if s.name == "input_ids")
    assert (ids.dtype, ids.dims) == ("INT32", (-1,)) and "exactly one of text_input and input_ids" in ids.doc


def test_input_ids_are_the_prompt_as_the_text_would_encode_it():
    tok = _ChatTok()
    from_text = parse_request(_get(apply_chat_template=np.array([True])), tok, LIMITS).generation
    ids = np.array(encode_prompt(tok, "hello", True), np.int32)
    from_ids = parse_request(_get(text_input=None, input_ids=ids), tok, LIMITS).generation
    assert from_ids.prompt_ids == from_text.prompt_ids == [1, *b"hello", 2]
    assert all(type(i) is int for i in from_ids.prompt_ids)
    # the same request object the parser checked goes on unchecked: one validate per request


def test_parse_request_checks_values_with_the_one_request_check(monkeypatch):
    calls = []
    real = GenerationRequest.validate

    def counted(self, *args, **kwargs):
        calls.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenerationRequest, "validate", counted)
    parse_request(_get(), _Tok(), LIMITS)
    assert len(calls) == 1
    with pytest.raises(RequestError, match="max_new_tokens 65 is larger than the engine's context of 64 tokens"):
        parse_request(_get(max_tokens=np.array([65], np.int32)), _Tok(), LIMITS)


# -- text streaming ---------------------------------------------------------------------------------


class _ByteTok:
    """Decodes token i as byte i (UTF-8 with replacement), like the byte-level test tokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    stream = TextStream(_ByteTok(), ("STOP",))
    euro = list("€".encode())
    pieces = [stream.push([ord("a")], False), stream.push(euro[:1], False), stream.push(euro[1:], False),
              stream.push([ord("S"), ord("T")], False)]
    assert pieces == ["a", "", "€", ""]  # "ST" could start "STOP"
    assert stream.push([ord("x")], False) == "STx"
    assert stream.push(list(b"yST"), False) == "y"
    assert stream.push(list(b"OPzz"), True) == ""  # cut before the stop string
    assert stream.sent == "a€STxy"


def test_text_stream_flushes_at_the_end():
    stream = TextStream(_ByteTok())
    assert stream.push([0xE2], False) == ""
    assert stream.push([], True) == "\ufffd"


def test_cut_at_stop_ends_the_text_before_the_earliest_stop_string():
    assert cut_at_stop("xabcde", ("cd", "bcde")) == "xa"  # the earliest start wins, whatever the order
    assert cut_at_stop("xabcde", ["de"]) == "xabc"
    assert cut_at_stop("xabcde", ("", "q")) == "xabcde"  # an empty stop string never matches


class _PieceTok:
    """Tokens are the pieces of a table, so one token may hold several characters (or a stop string's middle)."""

    PIECES = ["he", "llo E", "N", "D!", " more", "ENDING"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids)


def test_stop_finder_finds_a_stop_string_split_across_tokens():
    tok = _PieceTok()
    finder = StopFinder(tok.decode, ("END", ""))
    generated = [0, 1]
    assert finder.cut(generated, 0) is None  # "hello E" could still become "hello END": no cut yet
    generated += [2]
    assert finder.cut(generated, 2) is None
    generated += [3, 4]  # "D!" completes "END": the answer keeps the tokens up to and with that one
    assert finder.cut(generated, 3) == 4
    assert answer_text(tok.decode, generated[:4], ("END",)) == "hello "
    # a stop string inside one token: that token's count
    assert StopFinder(tok.decode, ("DING",)).cut([0, 5, 4], 0) == 2


def test_stop_finder_searches_only_the_new_text():
    decoded = []

    def decode(ids, skip_special_tokens=False):
        decoded.append(len(ids))
        return "".join(chr(97 + i % 3) for i in ids)  # "abcabc..."

    finder, ids = StopFinder(decode, ("zz",)), []
    for step in range(50):
        ids += [step * 2, step * 2 + 1]
        assert finder.cut(ids, len(ids) - 2) is None
    assert decoded == [2 * (s + 1) for s in range(50)]  # one decode per step while nothing is found
    assert finder._searched == 100


def test_stop_prefix_held_is_the_longest_end_that_may_still_become_a_stop_string():
    assert stop_prefix_held("say ST", ("STOP",)) == 2
    assert stop_prefix_held("say STO", ("STOP", "O")) == 3
    assert stop_prefix_held("say", ("STOP",)) == 0
    assert stop_prefix_held("abab", ("abac", "bx")) == 2  # "ab" could become "abac" (and "b" "bx"): the longer
    assert stop_prefix_held("x", ("",)) == 0  # an empty stop string holds nothing back


class _RevisingTok:
    """Byte tokens, except that "a" followed by "b" decodes as "X": a later token revises text already shown."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode().replace("ab", "X")


def test_text_stream_never_takes_back_text_a_tokenizer_revises():
    stream = TextStream(_RevisingTok(), ("zz",))
    assert stream.push([ord("a")], False) == "a"
    assert stream.push([ord("b")], False) == ""  # "X" would take back the "a" already sent
    assert stream.push([ord("c")], True) == ""
    assert stream.sent == "a"
    steady = TextStream(_RevisingTok())
    assert [steady.push([c], False) for c in b"cab"] == ["c", "a", ""]


# -- the in-flight batcher --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ort_engine(tiny_engine_dir):
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.target import load_tokenizer

    return OnnxRuntimeEngine(tiny_engine_dir, threads=1), load_tokenizer(tiny_engine_dir)


def _batcher(ort_engine, method="clover", max_batch=16, **kwargs):
    engine, tokenizer = ort_engine
    return InflightBatcher(lambda: SpeculativeDecoder(engine, method, tokenizer=tokenizer, max_batch_size=max_batch),
                           **kwargs)


class _Collector:
    def __init__(self):
        self.updates = []
        self.done = threading.Event()

    def __call__(self, update):
        self.updates.append(update)
        if update.finished:
            self.done.set()

    @property
    def text(self):
        return "".join(u.text for u in self.updates)

    @property
    def token_ids(self):
        return [t for u in self.updates for t in u.token_ids]

    @property
    def final(self):
        return self.updates[-1]


def _wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _request(tokenizer, prompt, max_tokens, **kwargs):
    from clover.prompts import encode_prompt

    return GenerationRequest(encode_prompt(tokenizer, prompt), max_new_tokens=max_tokens, **kwargs)


class _GatedEngine:
    """An engine whose target passes wait until the test opens the gate: requests submitted meanwhile are all
    pending before the first pass ends, whatever the machine's load (an event, not a race with the batcher)."""

    def __init__(self, engine) -> None:
        self.engine, self.gate = engine, threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def target(self, *args, **kwargs):
        assert self.gate.wait(60), "the test never opened the gate"
        return self.engine.target(*args, **kwargs)


def test_concurrent_requests_from_threads_equal_solo_greedy(ort_engine, reference):
    engine, tokenizer = ort_engine
    gated = _GatedEngine(engine)
    lengths = [5 + 3 * i for i in range(len(PROMPTS))]
    collectors = [_Collector() for _ in PROMPTS]
    with _batcher((gated, tokenizer)) as batcher:
        def submit(i):
            batcher.submit(_request(tokenizer, PROMPTS[i], lengths[i]), collectors[i])

        first = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
        for t in first:
            t.start()
        for t in first:
            t.join()
        gated.gate.set()  # all 8 are pending now: at most one of them prefilled alone, the rest share steps
        collectors[0].done.wait(30)  # the rest join a running batch
        for i in range(8, len(PROMPTS)):
            submit(i)
        for c in collectors:
            assert c.done.wait(60)
        metrics = batcher.metrics()
    for i, c in enumerate(collectors):
        expected = reference(PROMPTS[i], lengths[i])
        assert c.token_ids == expected.token_ids, PROMPTS[i]
        assert c.text == expected.text
        assert c.final.finish_reason == expected.finish_reason
        assert c.final.stats.output_tokens == len(expected.token_ids)
        assert 0 <= c.final.stats.accepted_draft_tokens <= c.final.stats.draft_tokens
    assert metrics.mean_batch_size > 1.5  # requests really shared decode steps (the gate makes them)
    assert metrics.output_tokens == sum(len(c.token_ids) for c in collectors)
    assert metrics.requests_finished.get("length", 0) + metrics.requests_finished.get("stop", 0) == len(PROMPTS)
    assert metrics.active_batch_size == 0 and metrics.pending_requests == 0


def _clean_stop(text: str, start: int = 10) -> str:
    """A 3-character stop string of ``text`` at or after ``start`` that first occurs there and holds whole
    characters only (a random byte-level model writes invalid UTF-8, shown as U+FFFD, which no stop string
    should be made of)."""
    return next(text[i:i + 3] for i in range(start, len(text) - 2)
                if "\ufffd" not in text[i:i + 3] and text.index(text[i:i + 3]) == i)


def test_streaming_deltas_and_stop_strings(ort_engine, reference):
    tokenizer = ort_engine[1]
    prompt = long_answer_prompt(reference, 40, at_least=24)
    expected = reference(prompt, 40)
    stop = _clean_stop(expected.text)
    collector = _Collector()
    with _batcher(ort_engine) as batcher:
        batcher.submit(_request(tokenizer, prompt, 40, stop_strings=(stop,)), collector)
        assert collector.done.wait(30)
    assert collector.text == expected.text[: expected.text.index(stop)]
    assert collector.final.finish_reason == "stop"
    assert len(collector.updates) > 3


def test_cancellation_by_handle_and_by_transport(ort_engine, reference):
    tokenizer = ort_engine[1]
    long_request = _request(tokenizer, "a", 200, stop_token_ids=())
    by_handle, by_transport, bystander = _Collector(), _Collector(), _Collector()
    flag = threading.Event()
    with _batcher(ort_engine, cancel_poll_s=0.0) as batcher:
        handle = batcher.submit(long_request, by_handle)
        batcher.submit(long_request, by_transport, is_cancelled=flag.is_set)
        batcher.submit(_request(tokenizer, PROMPTS[0], 30), bystander)
        _wait_until(lambda: len(by_handle.token_ids) >= 3 and len(by_transport.token_ids) >= 3)
        handle.cancel()
        flag.set()
        assert by_handle.done.wait(10) and by_transport.done.wait(10) and bystander.done.wait(30)
        assert handle.done
        metrics = batcher.metrics()
    for c in (by_handle, by_transport):
        assert c.final.finish_reason == "cancelled" and c.final.error is None
        assert 3 <= len(c.token_ids) < 200
    assert bystander.token_ids == reference(PROMPTS[0], 30).token_ids
    assert metrics.requests_finished["cancelled"] == 2 and metrics.active_batch_size == 0


def test_failing_callback_cancels_only_that_request(ort_engine, reference):
    tokenizer = ort_engine[1]
    good = _Collector()

    def broken(update):
        raise BrokenPipeError("client went away")

    with _batcher(ort_engine) as batcher:
        batcher.submit(_request(tokenizer, "a", 100, stop_token_ids=()), broken)
        batcher.submit(_request(tokenizer, PROMPTS[3], 20), good)
        assert good.done.wait(30)
        _wait_until(lambda: batcher.metrics().requests_finished.get("cancelled", 0) >= 1)
        assert batcher.metrics().requests_finished.get("cancelled") == 1
    assert good.token_ids == reference(PROMPTS[3], 20).token_ids


def test_engine_failure_fails_running_requests_and_recovers(ort_engine, reference):
    engine, tokenizer = ort_engine
    calls = {"n": 0}

    class Flaky:
        spec = engine.spec

        def target(self, *args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("device lost")
            return engine.target(*args)

        def draft_step(self, *args):
            return engine.draft_step(*args)

    flaky = Flaky()
    first, second = _Collector(), _Collector()
    batcher = InflightBatcher(lambda: SpeculativeDecoder(flaky, "clover", tokenizer=tokenizer))
    try:
        batcher.submit(_request(tokenizer, PROMPTS[0], 20), first)
        assert first.done.wait(30)
        assert "decode step failed: RuntimeError: device lost" in first.final.error
        batcher.submit(_request(tokenizer, PROMPTS[0], 20), second)
        assert second.done.wait(30)
    finally:
        batcher.shutdown()
    assert second.final.error is None and second.token_ids == reference(PROMPTS[0], 20).token_ids


def test_shutdown_ends_running_requests_with_an_error(ort_engine):
    tokenizer = ort_engine[1]
    running = _Collector()
    batcher = _batcher(ort_engine)
    batcher.submit(_request(tokenizer, "a", 250, stop_token_ids=()), running)
    _wait_until(lambda: running.token_ids)
    batcher.shutdown()
    assert running.done.is_set() and "shutting down" in running.final.error
    assert not batcher.alive
    with pytest.raises(RuntimeError, match="shutting down"):
        batcher.submit(_request(tokenizer, "a", 5), _Collector())


def test_submit_rejects_what_the_decoder_would(ort_engine):
    tokenizer = ort_engine[1]
    with _batcher(ort_engine) as batcher:
        with pytest.raises(ConfigError, match="the prompt is empty"):
            batcher.submit(GenerationRequest([], 5), _Collector())
        with pytest.raises(ValueError, match="max_new_tokens"):
            batcher.submit(GenerationRequest([1], 0), _Collector())
        with pytest.raises(ValueError, match="does not fit"):
            batcher.submit(GenerationRequest([1] * 300, 5), _Collector())
        assert batcher.metrics().requests_submitted == 0


def test_each_path_checks_a_request_once(ort_engine, monkeypatch):
    engine, tokenizer = ort_engine
    calls = []
    real = GenerationRequest.validate
    monkeypatch.setattr(GenerationRequest, "validate", lambda self, *a, **k: (calls.append(a), real(self, *a, **k)))
    SpeculativeDecoder(engine, "clover", tokenizer=tokenizer).submit(_request(tokenizer, "hi", 3))
    assert len(calls) == 1  # a direct library caller: submit() checks
    with _batcher(ort_engine) as batcher:
        for validated, expected in ((False, 2), (True, 2)):  # the batcher checks, the decoder does not repeat it
            done = _Collector()
            batcher.submit(_request(tokenizer, "hi", 3), done, validated=validated)
            assert done.done.wait(60) and done.final.error is None
            assert len(calls) == expected


class _ChatTok(_Tok):
    """Wraps every message in template tokens, as chat templates do: even empty text encodes to tokens."""

    chat_template = "<s>{{ content }}</s>"

    def apply_chat_template(self, messages, add_generation_prompt, return_dict):
        return [1, *messages[0]["content"].encode(), 2]


def test_cli_decoder_batcher_and_server_refuse_an_empty_prompt_alike(ort_engine, tmp_path, capsys):
    from clover.cli import main

    engine, tokenizer = ort_engine
    empty_file = tmp_path / "prompts.jsonl"
    empty_file.write_text('{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": ""}\n')
    cli_errors = []
    for source in (["--prompt", ""], ["--prompts-file", str(empty_file)]):
        # checked before a model is loaded: tmp_path holds none, so any other check would fail differently
        assert main(["generate", "--target", str(tmp_path), *source]) == 2
        cli_errors.append(capsys.readouterr().err.strip())
    assert cli_errors == ["clover: error: the prompt is empty"] * 2

    with pytest.raises(ConfigError) as decoder_error:
        SpeculativeDecoder(engine, "clover", tokenizer=tokenizer).submit(GenerationRequest([], 5))
    with _batcher(ort_engine) as batcher, pytest.raises(ConfigError) as batcher_error:
        batcher.submit(GenerationRequest([], 5), _Collector())
    with pytest.raises(RequestError) as server_error:  # the text is checked, not its chat-template tokens
        parse_request(_get(text_input=np.array([b""], dtype=object)), _ChatTok(), LIMITS)
    messages = {str(e.value) for e in (decoder_error, batcher_error, server_error)}
    assert messages == {"the prompt is empty"}


def test_request_stats_count_the_decoders_steps(ort_engine):
    engine, tokenizer = ort_engine
    request = _request(tokenizer, PROMPTS[2], 30, stop_token_ids=())
    solo = SpeculativeDecoder(engine, "clover", tokenizer=tokenizer).generate([request])[0].stats
    collector = _Collector()
    with _batcher(ort_engine) as batcher:
        batcher.submit(request, collector)
        assert collector.done.wait(30)
        metrics = batcher.metrics()
    first, final = collector.updates[0].stats, collector.final.stats
    # the first update is the prompt pass's token, sent before the step's decode pass (issue 62): no decode step yet
    assert (first.output_tokens, first.decode_steps) == (1, 0)
    counts = (solo.num_steps, solo.num_draft_tokens, sum(solo.accepted_per_step))
    assert (final.decode_steps, final.draft_tokens, final.accepted_draft_tokens) == counts
    assert (metrics.sequence_steps, metrics.draft_tokens, metrics.accepted_draft_tokens) == counts
    assert metrics.batch_steps == solo.num_steps
    assert final.tokens_per_step == pytest.approx(29 / solo.num_steps)


def test_tokens_per_step_leaves_out_each_prompt_pass_token():
    from clover.client import Result
    from clover.stats import tokens_per_step
    from clover.serving.batcher import RequestStats

    assert tokens_per_step(9, 4) == 2.0 and tokens_per_step(12, 4, sequences=4) == 2.0
    assert tokens_per_step(1, 0) == 0.0  # no decode step yet
    assert RequestStats(output_tokens=9, decode_steps=4).tokens_per_step == 2.0
    assert Result("", list(range(9)), "length", {"num_decode_steps": 4}, 1.0, None, 1).tokens_per_step == 2.0
    assert Result("", list(range(9)), "length", None, 1.0, None, 1).tokens_per_step == 0.0  # no perf metrics


# -- the Triton model logic, with a stand-in for triton_python_backend_utils -------------------------


class FakePbUtils:
    """The parts of triton_python_backend_utils the model uses."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError(Exception):
        INTERNAL, INVALID_ARG, UNAVAILABLE = 1, 3, 4  # triton_python_backend_utils' values

        def __init__(self, message, code=None):
            super().__init__(message)
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.outputs = {t.name: t.array for t in output_tensors or []}
            self.error = error

    class MetricFamily:
        COUNTER, GAUGE = "counter", "gauge"
        registry: dict = {}

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind
            FakePbUtils.MetricFamily.registry[name] = self
            self.metrics = []

        def Metric(self, labels):
            metric = FakeMetric(labels)
            self.metrics.append(metric)
            return metric

    @staticmethod
    def get_input_tensor_by_name(request, name):
        value = request.inputs.get(name)
        return None if value is None else FakePbUtils.Tensor(name, value)

    @staticmethod
    def using_decoupled_model_transaction_policy(config):
        return bool(config.get("model_transaction_policy", {}).get("decoupled"))


class FakeMetric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def increment(self, value):
        self.value += value

    def set(self, value):
        self.value = value


class FakeSender:
    def __init__(self):
        self.responses = []
        self.closed = threading.Event()
        self.cancelled = False

    def send(self, response=None, flags=0):
        assert not self.closed.is_set(), "response after the final flag"
        self.responses.append(response)
        if flags & FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.closed.set()

    def is_cancelled(self):
        return self.cancelled


class FakeRequest:
    def __init__(self, **inputs):
        self.inputs = inputs
        self.sender = FakeSender()

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return "req"


def _args(engine_dir, decoupled=True, **params):
    config = {"model_transaction_policy": {"decoupled": decoupled},
              "parameters": {k: {"string_value": v} for k, v in {"engine_dir": str(engine_dir), **params}.items()}}
    return {"model_config": json.dumps(config), "model_name": "clover", "model_version": "1",
            "model_repository": "/nowhere/triton_repo/clover"}


def _text(prompt):
    return np.array([prompt.encode()], dtype=object)


def test_triton_model_logic_streams_batches_and_rejects(tiny_engine_dir, reference):
    from clover.serving.triton_model import CloverTritonModel

    long_prompt = long_answer_prompt(reference, 25, at_least=12)
    model = CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, threads="1"))
    try:
        streamed = FakeRequest(text_input=_text(long_prompt), max_tokens=np.array([25], np.int32),
                               stream=np.array([True]), return_perf_metrics=np.array([True]))
        whole = FakeRequest(text_input=_text(PROMPTS[4]), max_tokens=np.array([30], np.int32))
        bad = FakeRequest(text_input=_text("hi"), max_tokens=np.array([0], np.int32))
        model.execute([streamed, whole, bad])
        for request in (streamed, whole, bad):
            assert request.sender.closed.wait(30)
    finally:
        model.finalize()
    assert len(bad.sender.responses) == 1 and "max_new_tokens must be >= 1" in bad.sender.responses[0].error.message
    assert bad.sender.responses[0].error.code == FakePbUtils.TritonError.INVALID_ARG

    expected = reference(long_prompt, 25)
    outputs = [r.outputs for r in streamed.sender.responses]
    assert len(outputs) > 2 and all(r.error is None for r in streamed.sender.responses)
    assert b"".join(o["text_output"][0] for o in outputs).decode() == expected.text
    assert [int(t) for o in outputs for t in o["output_ids"]] == expected.token_ids
    last = outputs[-1]
    assert last["finish_reason"][0].decode() == expected.finish_reason
    assert int(last["total_draft_tokens"][0]) >= int(last["total_accepted_draft_tokens"][0]) >= 0
    # every step emits its accepted draft tokens and one more (the last may be cut at max tokens); accepted
    # suffix candidates (docs/trees.md#model-free-candidates) can only save steps against vanilla
    steps, accepted = int(last["num_decode_steps"][0]), int(last["total_accepted_draft_tokens"][0])
    assert steps <= len(expected.token_ids) - 1 <= steps + accepted and steps <= expected.stats.num_steps

    assert len(whole.sender.responses) == 1
    only = whole.sender.responses[0].outputs
    assert only["text_output"][0].decode() == reference(PROMPTS[4], 30).text
    assert "acceptance_rate" not in only  # perf metrics only when asked

    families = FakePbUtils.MetricFamily.registry
    for name in ("clover_acceptance_rate", "clover_tokens_per_step", "clover_active_batch_size",
                 "clover_requests_total", "clover_output_tokens_total"):
        assert name in families
    assert families["clover_output_tokens_total"].metrics[0].value == len(expected.token_ids) + len(only["output_ids"])
    reasons = {m.labels["reason"]: m.value for m in families["clover_requests_total"].metrics}
    assert reasons["rejected"] == 1 and sum(reasons.values()) == 3


def test_triton_model_takes_input_ids_and_checks_each_request_once(tiny_engine_dir, reference, monkeypatch):
    from clover.serving.triton_model import CloverTritonModel

    expected = reference(PROMPTS[4], 12)  # before counting: the reference decodes too
    calls = []
    real = GenerationRequest.validate
    model = CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, threads="1"))  # its warm-up checks a request too
    monkeypatch.setattr(GenerationRequest, "validate", lambda self, *a, **k: (calls.append(a), real(self, *a, **k)))
    try:
        ids = encode_prompt(model.loaded.tokenizer, PROMPTS[4], True)  # what the CLI (and text_input) would send
        by_ids = FakeRequest(input_ids=np.array(ids, np.int32), max_tokens=np.array([12], np.int32))
        both = FakeRequest(input_ids=np.array(ids, np.int32), text_input=_text("hi"),
                           max_tokens=np.array([3], np.int32))
        model.execute([by_ids, both])
        for request in (by_ids, both):
            assert request.sender.closed.wait(30)
    finally:
        model.finalize()
    assert by_ids.sender.responses[0].error is None
    assert by_ids.sender.responses[0].outputs["text_output"][0].decode() == expected.text
    assert "not both" in both.sender.responses[0].error.message
    assert len(calls) == 1  # parse_request checked the good request; the batcher and the decoder did not again


def long_stream_request(end_id: int) -> "FakeRequest":
    """A streamed 250-token request for prompt "a" that only ``end_id`` (a token it never emits) could stop."""
    return FakeRequest(text_input=_text("a"), max_tokens=np.array([250], np.int32), stream=np.array([True]),
                       end_id=np.array([end_id], np.int32))


def test_triton_model_cancellation_through_the_sender(tiny_engine_dir, reference):
    from clover.serving.triton_model import CloverTritonModel

    end_id = reference.unused_token("a", 250)
    model = CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, threads="1"))
    try:
        request = long_stream_request(end_id)
        model.execute([request])
        _wait_until(lambda: len(request.sender.responses) >= 3)
        request.sender.cancelled = True
        assert request.sender.closed.wait(10)
    finally:
        model.finalize()
    final = request.sender.responses[-1].outputs
    assert final["finish_reason"][0] == b"cancelled"
    assert sum(len(r.outputs["output_ids"]) for r in request.sender.responses) < 250


def test_triton_model_load_errors_name_the_problem(tmp_path, tiny_engine_dir):
    from clover.serving.triton_model import CloverTritonModel

    with pytest.raises(ConfigError, match=f"engine_dir={tmp_path / 'missing'}.*does not exist"):
        CloverTritonModel(FakePbUtils, _args(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no engine.json"):
        CloverTritonModel(FakePbUtils, _args(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="decoupled"):
        CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, decoupled=False))
    with pytest.raises(ConfigError, match="method="):
        CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, method="fast"))
    with pytest.raises(ConfigError, match="not an integer"):
        CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, max_batch="many"))
    with pytest.raises(ConfigError, match="adaptive='maybe' is not a boolean"):
        CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, adaptive="maybe"))
    with pytest.raises(ConfigError, match="adaptive=true needs a cost model.*--calibrate"):  # built without one
        CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, adaptive="true"))
    with pytest.raises(ConfigError, match="adaptive=true needs draft heads"):
        CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, adaptive="true", method="vanilla"))
    with pytest.raises(ConfigError, match=r"max_step_tokens must be >= 0 \(0: no cap\), got -1"):
        CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, max_step_tokens="-1", warm_up="false"))


@pytest.mark.parametrize("value, cap", [("", int(PARAMETERS["max_step_tokens"][0])), ("0", None), ("40", 40)])
def test_max_step_tokens_reaches_the_serving_decoder(tiny_engine_dir, value, cap):
    from clover.serving.triton_model import CloverTritonModel

    params = {"max_step_tokens": value} if value else {}  # "": the default of PARAMETERS
    model = CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, threads="1", warm_up="false", **params))
    try:
        assert model.batcher.decoder.max_step_tokens == cap
    finally:
        model.finalize()


def test_default_engine_dir(monkeypatch, tmp_path):
    from clover.serving.served_engine import resolve_engine_dir

    monkeypatch.delenv("CLOVER_ENGINE_DIR", raising=False)
    assert resolve_engine_dir("", tmp_path) == tmp_path / "engines" / "demo"
    assert resolve_engine_dir("mine", tmp_path) == tmp_path / "mine"
    assert resolve_engine_dir("/abs/e", tmp_path) == Path("/abs/e")
    monkeypatch.setenv("CLOVER_ENGINE_DIR", str(tmp_path / "env"))
    assert resolve_engine_dir("", tmp_path) == tmp_path / "env"


# -- launcher helpers and CLI -----------------------------------------------------------------------


def test_server_environment_runs_this_python(tmp_path):
    from clover.serving.server import ServerError, TritonServer, find_tritonserver

    try:
        install = find_tritonserver()
    except ServerError as exc:
        pytest.skip(str(exc))
    server = TritonServer(tmp_path, 0, 0, 0, host="127.0.0.1", install=install)
    env = server.environment()
    import sys

    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert str(REPO) in env["PYTHONPATH"].split(":")
    command = server.command(tmp_path / "backends")
    assert "--allow-gpu-metrics=false" in command and "--pinned-memory-pool-byte-size=0" in command
    assert len({server.http_port, server.grpc_port, server.metrics_port}) == 3
    if install.stub is not None:
        assert install.libs.name == "nvidia_pytriton.libs" and install.libs.is_dir()
        assert install.stub.parent.name == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_serve_without_an_engine_says_how_to_build_one(tmp_path, capsys, monkeypatch):
    from clover.cli import main

    assert main(["serve", "--engine", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no engine at" in err and "clover build --output" in err
    monkeypatch.setenv("CLOVER_HOME", str(tmp_path / "home"))  # no engine named: it says what chose the place
    monkeypatch.delenv("CLOVER_ENGINE_DIR", raising=False)
    assert main(["serve", "--backend", "onnxruntime"]) == 2
    assert f"no engine at {tmp_path / 'home' / 'engines' / 'demo'} (engines/demo of $CLOVER_HOME)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_client_without_a_server_says_to_start_one(protocol, capsys):
    from clover.cli import main
    from clover.serving.server import free_port

    if protocol == "grpc":
        pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed: pip install -e '.[serve]'")
    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["client", "--protocol", protocol, "--url", url, "--prompt", "hi", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert f"nothing listens at {url}; start the server first" in err and "clover serve" in err, err
    assert len(err.splitlines()) == 1, err  # not the transport's raw error first


def test_serve_and_client_help(capsys):
    from clover.cli import main

    for command, options in (("serve", ["--engine", "--http-port", "--grpc-port", "--metrics-port", "--demo"]),
                             ("client", ["--url", "--protocol", "--concurrency", "--no-stream", "--max-tokens"])):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        text = capsys.readouterr().out
        for option in options:
            assert option in text


@pytest.mark.parametrize("dtype, expected", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("auto", torch.float32)])
def test_the_torch_backend_serves_a_checkpoint_in_the_dtype_asked(tmp_path, dtype, expected):
    """Model parameter ``dtype`` (clover serve --dtype): the torch backend's weights; auto is fp32 on this CPU."""
    from clover.serving.triton_model import CloverTritonModel
    from tests.conftest import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "checkpoint")
    model = CloverTritonModel(FakePbUtils, _args(checkpoint, backend="torch", dtype=dtype))
    try:
        assert model.loaded.engine.spec.dtype == expected
        assert next(model.loaded.engine.target_step.parameters()).dtype == expected
    finally:
        model.finalize()


def test_dtype_is_refused_for_a_built_engine_and_an_unknown_one(tiny_engine_dir, tmp_path):
    from clover.serving.served_engine import load_serving_engine

    with pytest.raises(ConfigError, match="dtype='bf16' is for backend torch"):
        load_serving_engine(tiny_engine_dir, dtype="bf16")
    with pytest.raises(ConfigError, match="dtype 'fp16': choose auto, fp32, bf16"):
        load_serving_engine("demo", backend="torch", dtype="fp16")

# -- the warm-up at load (clover/serving/warmup.py, issue 57): counted, not timed ---------------------------

WARM_UP_BURST = 4  # the model's max_batch in these tests: every request of a burst can be live at once


def test_warm_up_runs_one_decode_step_at_every_batch_size(ort_engine):
    engine, tokenizer = ort_engine
    decoder = SpeculativeDecoder(engine, engine.spec.default_method, engine.meta.tree_defaults, tokenizer,
                                 max_batch_size=5)
    done = warm_up(decoder, warm_up_prompt(tokenizer))
    assert done.batch_sizes == [5, 4, 3, 2, 1] and done.prefill_rows == 5
    assert not decoder.has_work and decoder.num_running == 0
    assert done.describe() == "warmed up: 5 decode steps at batch sizes 5 to 1, prefill of 5 prompts at once"


class PassShapes:
    """Records the (rows, tokens per row) of each decode-step target pass (a prompt's pass has no past)."""

    def __init__(self, target) -> None:
        self.target, self.seen = target, []

    def __call__(self, engine, input_ids, position_ids, past_lengths, *rest):
        if int(past_lengths.max()) > 0:
            self.seen.append(tuple(input_ids.shape))
        return self.target(engine, input_ids, position_ids, past_lengths, *rest)

    def take(self) -> set[tuple[int, int]]:
        shapes, self.seen = set(self.seen), []
        return shapes


def _burst(model, prompts) -> None:
    requests = [FakeRequest(text_input=_text(prompt), max_tokens=np.array([12], np.int32)) for prompt in prompts]
    model.execute(requests)
    for request in requests:
        assert request.sender.closed.wait(60)
        assert all(response.error is None for response in request.sender.responses)


@pytest.mark.parametrize("warm", ["true", "false"])
def test_a_first_burst_after_load_runs_only_shapes_the_warm_up_ran(tiny_engine_dir, monkeypatch, warm):
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.serving.triton_model import CloverTritonModel

    shapes = PassShapes(OnnxRuntimeEngine.target)
    monkeypatch.setattr(OnnxRuntimeEngine, "target", lambda self, *args: shapes(self, *args))
    # a fixed tree (no adaptive budget, heads alone): each step's width depends on its batch size alone
    model = CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, threads="1", max_batch=str(WARM_UP_BURST),
                                                 adaptive="false", proposer="none", warm_up=warm))
    try:
        at_load = shapes.take()
        _burst(model, PROMPTS[:WARM_UP_BURST])
        first = shapes.take()
        _burst(model, PROMPTS[:WARM_UP_BURST])
        again = shapes.take()
    finally:
        model.finalize()
    assert first and again, "no decode step was recorded"
    if warm == "false":  # the control: nothing ran at load, so the first burst ran its shapes for the first time
        assert model.warm_up is None and not at_load and not first <= at_load
        return
    # max_step_tokens may admit the warm-up's full batch over a few steps; then one step at each size, down to 1
    assert model.warm_up.batch_sizes[-WARM_UP_BURST:] == list(range(WARM_UP_BURST, 0, -1))
    assert {rows for rows, _ in at_load} == set(range(1, WARM_UP_BURST + 1))
    assert first <= at_load and again <= at_load, (sorted(first - at_load), sorted(again - at_load))
