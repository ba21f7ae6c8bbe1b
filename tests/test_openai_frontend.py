"""The OpenAI-compatible frontend (``clover serve --openai-port``), with the real ``openai`` client.

Unit tests of the request mapping run without a server. The rest run one real ``clover serve
--openai-port`` (tritonserver from the nvidia-pytriton wheel on the tiny random engine, and the
frontend process) for the whole module and compare its answers with the same requests sent through
tritonclient, token for token (the ``return_token_ids`` extension), also with 16 streams at once.
The last test stops that server with Ctrl-C; a crash of the frontend is reported (exit code 1).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="uvicorn is not installed: pip install -e '.[serve]'")

from clover.prompts import encode_prompt  # noqa: E402
from clover.serving.openai_frontend import (  # noqa: E402
    ChatCompletionRequest, CompletionRequest, FrontendProcess, FrontendSettings, OpenAIError, chat_request,
    completion_request, create_app, model_error, parse_body, render_chat)
from clover.serving.server import ServerError, find_tritonserver, free_port, free_ports  # noqa: E402
from tests.helpers import hf_greedy  # noqa: E402
from tests.serving_support import PROMPTS, long_answer_prompt, reference, tiny_engine_dir  # noqa: E402,F401  (fixtures)

STARTUP_S = 240
CONTEXT = 256  # the tiny engine's


@pytest.fixture(scope="module")
def tokenizer(tiny_engine_dir):
    from clover.target import load_tokenizer

    return load_tokenizer(tiny_engine_dir)


# -- the request mapping, without a server ---------------------------------------------------------

def _chat(tokenizer, **body):
    body = {"model": "clover", "messages": [{"role": "user", "content": "hello"}], **body}
    return chat_request(parse_body(ChatCompletionRequest, json.dumps(body).encode()), tokenizer, CONTEXT)


def test_one_user_message_is_sent_as_the_ids_of_its_chat_template(tokenizer):
    request = _chat(tokenizer, max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, stop="\n", seed=11, stream=True,
                    stream_options={"include_usage": True})
    ids = encode_prompt(tokenizer, "hello", True)  # what clover generate and the model (text_input) encode
    assert request.fields == {"input_ids": ids, "max_tokens": 7, "stream": True, "temperature": 0.5, "top_k": 3,
                              "top_p": 0.9, "stop_words": ["\n"], "random_seed": 11, "return_perf_metrics": True}
    assert request.prompt_tokens == len(ids)
    assert request.stream and request.include_usage
    defaults = _chat(tokenizer)  # no max_tokens: what the context leaves
    assert defaults.fields["max_tokens"] == CONTEXT - defaults.prompt_tokens and not defaults.fields["stream"]
    assert "temperature" not in defaults.fields and "stop_words" not in defaults.fields
    chosen = _chat(tokenizer, max_tokens=3, max_completion_tokens=5)
    assert chosen.fields["max_tokens"] == 5 and chosen.params["max_tokens"] == "max_completion_tokens"


def test_a_conversation_is_rendered_with_the_chat_template(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "yes?"}]}, {"role": "user", "content": "go"}]
    request = _chat(tokenizer, messages=messages, stop=["a", "b"])
    plain = [{**m, "content": "yes?"} if m["role"] == "assistant" else m for m in messages]
    expected_ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, return_dict=False)
    assert "apply_chat_template" not in request.fields and request.fields["stop_words"] == ["a", "b"]
    assert request.fields["input_ids"] == list(expected_ids) and "text_input" not in request.fields
    assert request.prompt_tokens == len(expected_ids)


class CountingTokenizer:
    """The tokenizer, counting the calls that tokenize (``encode``, ``__call__``, a tokenizing chat template)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def encode(self, text, *args, **kwargs):
        self.calls.append(("encode", text))
        return self.inner.encode(text, *args, **kwargs)

    def __call__(self, text, *args, **kwargs):
        self.calls.append(("__call__", text))
        return self.inner(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        if kwargs.get("tokenize", True):
            self.calls.append(("apply_chat_template", messages))
        return self.inner.apply_chat_template(messages, *args, **kwargs)


def _as_triton_parses_it(fields: dict, tokenizer):
    """``fields`` through the gateway's tensor mapping (clover.client.input_array) into the model's parser."""
    from clover.client import input_array
    from clover.serving.protocol import RequestLimits, parse_request

    tensors = {name: input_array(name, value)[0] for name, value in fields.items()}
    return parse_request(tensors.get, tokenizer, RequestLimits(CONTEXT, len(tokenizer))).generation


@pytest.mark.parametrize("kind", ["one user message", "conversation", "completion"])
def test_a_prompt_is_tokenized_once_and_triton_gets_the_cli_s_ids(tokenizer, kind):
    counting = CountingTokenizer(tokenizer)
    if kind == "completion":
        body = parse_body(CompletionRequest, json.dumps({"model": "clover", "prompt": "hello there"}).encode())
        request, text, chat = completion_request(body, counting, CONTEXT), "hello there", False
    else:
        messages = [{"role": "user", "content": "hello there"}]
        if kind == "conversation":
            messages = [{"role": "system", "content": "be brief"}, *messages]
        body = parse_body(ChatCompletionRequest, json.dumps({"model": "clover", "messages": messages}).encode())
        request = chat_request(body, counting, CONTEXT)
        text, chat = ("hello there", True) if kind == "one user message" else (render_chat(tokenizer, messages), False)
    prompt_calls = [c for c in counting.calls if c[1] != ""]  # render_chat's encode("") asks whether BOS is added
    assert len(prompt_calls) == 1, counting.calls
    assert "text_input" not in request.fields
    generation = _as_triton_parses_it(request.fields, counting)
    assert len([c for c in counting.calls if c[1] != ""]) == 1  # the model did not tokenize it again
    assert generation.prompt_ids == encode_prompt(tokenizer, text, chat) == request.fields["input_ids"]
    assert request.prompt_tokens == len(generation.prompt_ids)


def test_render_chat_leaves_bos_to_a_tokenizer_that_adds_it():
    class BosTokenizer:  # a Llama-like tokenizer: encode() adds BOS and the template writes it too
        chat_template, bos_token, bos_token_id = "...", "<s>", 1

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "<s>" + "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

        def encode(self, text):
            return [1] + [ord(c) for c in text]

    assert render_chat(BosTokenizer(), [{"role": "user", "content": "x"}]) == "[user]x[assistant]"


def test_completions_take_one_prompt(tokenizer):
    body = {"model": "clover", "prompt": ["hello"], "max_tokens": 4}
    request = completion_request(parse_body(CompletionRequest, json.dumps(body).encode()), tokenizer, CONTEXT)
    assert request.fields["input_ids"] == tokenizer.encode("hello") and "apply_chat_template" not in request.fields
    assert request.prompt_tokens == len(tokenizer.encode("hello"))
    with pytest.raises(OpenAIError, match="prompt: the prompt is empty"):
        completion_request(parse_body(CompletionRequest, b'{"model": "clover", "prompt": ""}'), tokenizer, CONTEXT)
    with pytest.raises(OpenAIError, match="one prompt per request"):
        completion_request(parse_body(CompletionRequest, b'{"model": "clover", "prompt": ["a", "b"]}'),
                           tokenizer, CONTEXT)


@pytest.mark.parametrize("body, param, message", [
    ({"messages": []}, "messages", "messages: the list is empty; send at least one message, e.g. {"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "Field required"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"temperature": 5}, "temperature", "temperature must be between 0 and 2 (got 5)"),  # OpenAI's range
    ({"temperature": -1}, "temperature", "temperature must be between 0 and 2 (got -1)"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1] (got 1.5)"),
    ({"top_k": -1}, "top_k", f"top_k must be between 0 and {2**31 - 1} (got -1)"),
    ({"seed": -1}, "seed", f"seed must be between 0 and {2**64 - 1} (got -1)"),
    ({"seed": 2**64}, "seed", f"seed must be between 0 and {2**64 - 1} (got {2**64})"),
    ({"stop": [1]}, "stop[0]", "valid string"),
    ({"n": 2}, "n", "only n=1"),
    ({"logprobs": True}, "logprobs", "only logprobs=false"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "valid boolean"),
])
def test_schema_errors_name_the_parameter(body, param, message):
    raw = json.dumps({"model": "clover", "messages": [{"role": "user", "content": "hi"}], **body}).encode()
    with pytest.raises(OpenAIError) as info:
        parse_body(ChatCompletionRequest, raw)
    assert info.value.status == 400 and info.value.param == param and message in info.value.message


def test_the_ends_of_the_ranges_are_accepted():
    for body in ({"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"top_k": 0}, {"seed": 0},
                 {"seed": 2**64 - 1}):
        raw = json.dumps({"model": "clover", "messages": [{"role": "user", "content": "hi"}], **body}).encode()
        parse_body(ChatCompletionRequest, raw)


@pytest.mark.parametrize("raw", [b"", b"  \n"])
def test_an_empty_body_is_called_empty(raw):
    for schema, required in ((ChatCompletionRequest, "model, messages"), (CompletionRequest, "model, prompt")):
        with pytest.raises(OpenAIError) as info:
            parse_body(schema, raw)
        assert info.value.status == 400 and info.value.param is None
        assert info.value.message == f"the request body is empty; send a JSON object with at least {required}"
    with pytest.raises(OpenAIError, match="must be a JSON object with at least model, messages \\(got list\\)"):
        parse_body(ChatCompletionRequest, b"[]")


@pytest.mark.parametrize("value", [0, -5, CONTEXT + 1, 100000, 2**40, 10**12])
def test_max_tokens_out_of_range_is_worded_the_same_whatever_its_size(tokenizer, value):
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(OpenAIError) as info:
            _chat(tokenizer, **{field: value})
        assert (info.value.status, info.value.param) == (400, field)
        assert info.value.message == (f"{field} must be between 1 and {CONTEXT}, the engine's context in tokens "
                                      f"(got {value})")
    with pytest.raises(OpenAIError, match=f"max_tokens must be between 1 and {CONTEXT}, .* \\(got {value}\\)"):
        completion_request(parse_body(CompletionRequest, json.dumps(
            {"model": "clover", "prompt": "hi", "max_tokens": value}).encode()), tokenizer, CONTEXT)
    assert _chat(tokenizer, max_tokens=CONTEXT).fields["max_tokens"] == CONTEXT  # the top end is the model's


def test_model_refusals_name_the_parameter():
    params = {"prompt": "messages", "max_tokens": "max_completion_tokens"}
    cases = {"max_new_tokens must be >= 1, got 0": "max_completion_tokens",
             "temperature must be between 0 and 2 (got temperature=-1, top_p=1)": "temperature",
             "top_p must be in (0, 1] (got temperature=0, top_p=2)": "top_p",
             "the prompt is empty": "messages", "the prompt is 300 tokens and does not fit": "messages"}
    for message, param in cases.items():
        error = model_error(message, params)
        assert (error.status, error.param) == (400, param) and message in error.message
    assert model_error("the server is shutting down; the request was cancelled", params).status == 503
    # the model's input stop_words is the OpenAI API's stop; the server's own settings keep their names
    too_many = model_error("stop_words has 65 strings; this server takes at most 64 (model parameter max_stop_words)",
                           params)
    assert (too_many.param, too_many.message) == (
        "stop", "stop has 65 strings; this server takes at most 64 (model parameter max_stop_words)")
    assert model_error("stop_words must be BYTES (strings)", params).message == "stop must be BYTES (strings)"


# -- shutdown of the frontend, on a stand-in for Triton ---------------------------------------------

class EndlessGateway:
    """Stands in for Triton: answers that never end (a token every 20 ms) until the frontend closes them."""

    def __init__(self, url: str, model: str) -> None:
        self.closed = 0
        self.shutdown = None  # the app's Shutdown, set by the test: chunks are counted by the drain's phase
        self.chunks = {"before": 0, "draining": 0, "expired": 0}

    def _phase(self) -> str:
        if self.shutdown is None or not self.shutdown.started:
            return "before"
        return "expired" if self.shutdown.expired.is_set() else "draining"

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass

    async def generate(self, request):
        import asyncio

        from clover.client import Chunk

        try:
            while True:
                await asyncio.sleep(0.02)
                self.chunks[self._phase()] += 1
                yield Chunk("x", [120], None, None, time.perf_counter())
        finally:
            self.closed += 1


def _sse_events(response) -> list:
    """The ``data:`` payloads of a server-sent-event response, JSON decoded ("[DONE]" as is)."""
    events = []
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _post(port: int, path: str, body: dict):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def _stop_with_two_open_requests(tokenizer, drain_s: float, signals: int) -> dict:
    """A frontend on EndlessGateway with an open stream and an open whole answer, stopped by ``signals``
    stop signals (0.3 s apart, as uvicorn's signal handler calls them): what each client got, how long the
    stop took, the app, uvicorn's errors, whether the server thread still runs."""
    import argparse
    import logging

    from clover.serving.openai_frontend import _server

    port = free_port()
    app = create_app(FrontendSettings("unused:1", CONTEXT, drain_s=drain_s), tokenizer, gateway=EndlessGateway)
    server = _server(app, argparse.Namespace(host="127.0.0.1", port=port, log_level="warning", drain_timeout=drain_s))
    errors: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    results: dict = {"app": app, "errors": errors}
    try:
        _wait_until(lambda: server.started)
        app.state.gateway.shutdown = app.state.shutdown  # the gateway exists from startup on
        chat = {"model": "clover", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}

        def stream():
            results["stream"] = _sse_events(_post(port, "/v1/chat/completions", {
                **chat, "stream": True, "stream_options": {"include_usage": True}}))

        def whole():
            response = _post(port, "/v1/completions", {"model": "clover", "prompt": "hi", "max_tokens": 200})
            results["whole"] = (response.status, json.loads(response.read()))

        clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for client in clients:
            client.start()
        _wait_until(lambda: app.state.shutdown.open_requests == 2)
        _wait_until(lambda: app.state.gateway.chunks["before"] >= 4)  # both have tokens to show
        for number in range(signals):
            time.sleep(0.3 if number else 0)
            server.handle_exit(signal.SIGTERM if number == 0 else signal.SIGINT, None)  # uvicorn's signal handler
        for client in clients:
            client.join(30)
        thread.join(30)
        results["running"] = thread.is_alive()
    finally:
        server.should_exit = True
        thread.join(30)
        logging.getLogger("uvicorn.error").removeHandler(handler)
    return results


def _ended_with_a_final_chunk_and_done(results: dict) -> None:
    events = results["stream"]
    assert events[-1] == "[DONE]", events[-3:]
    final, usage = events[-3], events[-2]
    assert final["choices"][0]["finish_reason"] == "cancelled" and usage["choices"] == []
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert content and set(content) == {"x"} and usage["usage"]["completion_tokens"] == len(content)
    status, body = results["whole"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "cancelled" and body["choices"][0]["text"]
    assert not results["running"] and results["app"].state.gateway.closed == 2  # both Triton requests were closed
    assert not results["errors"], [record.getMessage() for record in results["errors"]]  # "Cancel 2 running task(s)"


def test_shutdown_ends_open_requests_with_a_final_chunk_and_done(tokenizer, capsys):
    """SIGTERM with answers that would never end: after the drain each ends with finish reason
    ``cancelled`` (a stream with its final chunk, the usage chunk and ``data: [DONE]``), uvicorn cancels
    nothing (no traceback), and the frontend says one line."""
    results = _stop_with_two_open_requests(tokenizer, 1.0, signals=1)
    _ended_with_a_final_chunk_and_done(results)
    # by events, not wall time: the answers ran on through the drain (not cut at the signal) and the drain's
    # expiry ended them (finish reason cancelled), not a forced stop
    shutdown, chunks = results["app"].state.shutdown, results["app"].state.gateway.chunks
    assert shutdown.expired.is_set() and chunks["draining"] > 0 and not shutdown.forced, chunks
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert said == ["[clover] OpenAI frontend: shutting down; 2 open request(s) end within 1 s"], said


def test_a_second_stop_signal_ends_open_requests_at_once_still_with_done(tokenizer, capsys):
    """A second signal (the second Ctrl-C that clover serve forwards) ends the open requests now instead of
    after the drain, still each with its final chunk and ``data: [DONE]``; the exit is marked forced
    (the frontend then exits 1)."""
    results = _stop_with_two_open_requests(tokenizer, drain_s=60.0, signals=2)
    _ended_with_a_final_chunk_and_done(results)
    # ended by the second signal: with the 60 s drain running on, the clients (joined for 30 s) would have no answer
    assert results["app"].state.shutdown.forced
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert said[-1] == "[clover] OpenAI frontend: stopping at once; 2 open request(s) end now", said


# -- a real clover serve ---------------------------------------------------------------------------

class Served:
    """A running ``clover serve --openai-port`` and what its output says."""

    def __init__(self, proc, lines, ports) -> None:
        self.proc, self.lines = proc, lines
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = ports

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def log(self) -> str:
        """The server log (tritonserver's and the frontend's), in the file clover serve named."""
        match = re.search(r"\[clover\] server log: (\S+)", self.output)
        assert match, self.output
        return open(match.group(1), errors="replace").read()

    def pid_after(self, text: str) -> int | None:
        match = re.search(re.escape(text) + r"[^\n]*?\(pid (\d+)\)", self.output)
        return int(match.group(1)) if match else None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}/v1"


def _wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _alive(pid: int | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, TypeError):
        return False


@pytest.fixture(scope="module")
def served(tiny_engine_dir, tmp_path_factory):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed: pip install -e '.[serve]'")
    pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[test]'")
    try:
        find_tritonserver()
    except ServerError as exc:
        pytest.skip(f"no Triton server here: {exc}")
    ports = free_ports(4)
    cmd = [sys.executable, "-m", "clover.cli", "serve", "--engine", str(tiny_engine_dir), "--host", "127.0.0.1",
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3]), "--threads", "1", "--max-batch", "16", "--startup-timeout", str(STARTUP_S),
           "--drain-timeout", "0"]  # Ctrl-C cancels what runs (the last test): the stream outlasts the drain
    # a log of its own, named: the default one would go with the clean exit, before the last test reads it
    serve_tmp = tmp_path_factory.mktemp("serve-tmp")
    cmd += ["--log-file", str(serve_tmp / "clover-serve.log")]
    env = {**os.environ, "TMPDIR": str(serve_tmp)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True).start()
    served = Served(proc, lines, ports)
    try:
        _wait_until(lambda: "OpenAI-compatible endpoint ready" in served.output or proc.poll() is not None, STARTUP_S)
        assert proc.poll() is None, served.output
        yield served
    finally:
        pids = [served.pid_after("ready"), served.pid_after("OpenAI-compatible endpoint ready")]
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid in pids:  # whatever clover serve left behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


def _triton(served, prompt: str, max_tokens: int, chat: bool = True, **options):
    from clover.client import GrpcClient, collect

    with GrpcClient(served.grpc_url) as grpc:
        return collect(grpc.stream(prompt, max_tokens, chat_template=chat, **options))


def _streamed(stream):
    """(text, token ids, finish reason, usage, clover stats, chunks with content) of an OpenAI stream."""
    text, ids, reason, tokens, stats, count = [], [], None, None, None, 0
    for chunk in stream:
        tokens = chunk.usage or tokens
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text.append(piece or "")
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
            count += bool(piece)
            reason = choice.finish_reason or reason
        stats = (chunk.model_extra or {}).get("clover") or stats
    return "".join(text), ids, reason, tokens, stats, count


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["clover"]
    assert client.models.retrieve("clover").id == "clover"


def test_health_answers_with_a_status(served):
    with urllib.request.urlopen(f"{served.base_url.removesuffix('/v1')}/health", timeout=30) as response:
        assert response.status == 200
        assert json.loads(response.read()) == {"status": "ok", "model": "clover", "triton": served.grpc_url}


def test_chat_equals_tritonclient_token_for_token(served, client, tokenizer, reference):
    prompt = long_answer_prompt(reference, 30)
    expected = _triton(served, prompt, 30)
    answer = client.chat.completions.create(model="clover", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=30, temperature=0, extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.finish_reason == expected.finish_reason == "length"
    assert answer.usage.completion_tokens == len(expected.token_ids) == 30
    assert answer.usage.prompt_tokens == len(encode_prompt(tokenizer, prompt, True))
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    stats = answer.model_extra["clover"]
    # the request's own counters (not tritonclient's: the server's decoder learns across requests, e.g. the
    # calibration of model-free candidates, so an identical request may take a different number of steps)
    assert 1 <= stats["decode_steps"] <= 29 and 0 <= stats["acceptance_rate"] <= 1
    assert stats["tokens_per_step"] == pytest.approx((30 - 1) / stats["decode_steps"])  # the first token: prefill


def test_chat_stream_equals_tritonclient(served, client):
    prompt = PROMPTS[8]
    expected = _triton(served, prompt, 40)
    stream = client.chat.completions.create(model="clover", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=40, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
    text, ids, reason, tokens, stats, chunks = _streamed(stream)
    assert (text, ids, reason) == (expected.text, expected.token_ids, expected.finish_reason)
    assert chunks > 5  # streamed step by step, not in one piece
    assert tokens.completion_tokens == len(ids) and tokens.total_tokens == tokens.prompt_tokens + len(ids)
    assert stats["tokens_per_step"] == pytest.approx((len(ids) - 1) / stats["decode_steps"])


def test_completions_plain_and_streamed(served, client, tokenizer):
    prompt = "The quick brown fox"  # its greedy answer ends with EOS
    expected = _triton(served, prompt, 100, chat=False)
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 100
    answer = client.completions.create(model="clover", prompt=prompt, max_tokens=100, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert answer.choices[0].text == expected.text and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].model_extra["token_ids"] == expected.token_ids
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert answer.usage.completion_tokens == len(expected.token_ids)
    stream = client.completions.create(model="clover", prompt=prompt, max_tokens=100, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    text, ids, reason, tokens, _, _ = _streamed(stream)
    assert (text, ids, reason) == (expected.text, expected.token_ids, "stop")
    assert tokens.completion_tokens == len(ids)


def test_a_conversation_equals_transformers_greedy_decoding_of_its_template(served, client, reference):
    from clover.decode import GenerationRequest, SpeculativeDecoder

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    greedy = hf_greedy(reference.checkpoint, [list(ids)], 20, stop_token_ids=(reference.tokenizer.eos_token_id,))[0]
    decoder = SpeculativeDecoder(reference.engine, "vanilla", tokenizer=reference.tokenizer)
    expected = decoder.generate([GenerationRequest(list(ids), max_new_tokens=20)])[0]
    assert expected.token_ids == greedy  # so its text is the independent reference's text
    answer = client.chat.completions.create(model="clover", messages=messages, max_tokens=20,
                                            extra_body={"return_token_ids": True})
    assert answer.choices[0].model_extra["token_ids"] == greedy  # transformers, not only clover's own vanilla
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.prompt_tokens == len(ids)


def _stop_string(text: str) -> str:
    """Two characters from the middle of ``text`` (no replacement characters), first found where taken."""
    for start in range(4, len(text) - 2):
        stop = text[start:start + 2]
        if "\ufffd" not in stop and text.find(stop) == start:
            return stop
    pytest.skip("no usable stop string in the greedy answer")


def test_stop_strings(served, client):
    prompt = PROMPTS[0]
    whole = _triton(served, prompt, 40)
    stop = _stop_string(whole.text)
    expected = _triton(served, prompt, 40, stop_words=[stop])
    assert expected.text == whole.text[:whole.text.find(stop)]
    answer = client.chat.completions.create(model="clover", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=40, stop=[stop, "never appears"],
                                            extra_body={"return_token_ids": True})
    assert answer.choices[0].message.content == expected.text and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].model_extra["token_ids"] == expected.token_ids
    assert answer.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(model="clover", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=40, stop=stop, stream=True,
                                            stream_options={"include_usage": True})
    text, _, reason, tokens, _, _ = _streamed(stream)
    assert (text, reason, tokens.completion_tokens) == (expected.text, "stop", len(expected.token_ids))


def _metrics(served) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict = {}
    for line in text.splitlines():
        match = re.match(r"^(clover_\w+)(?:\{(.*)\})? (\S+)$", line)
        if match:
            reason = re.search(r'reason="(\w+)"', match.group(2) or "")
            key = (match.group(1), reason.group(1) if reason else None)
            values[key] = values.get(key, 0.0) + float(match.group(3))
    return values


STREAMS = 16  # the issue's aim: greedy output equal to tritonclient under 16 concurrent streams


def test_sixteen_concurrent_streams_equal_tritonclient(served, client):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)]
    lengths = [24 + 2 * i for i in range(STREAMS)]
    expected = [_triton(served, p, n) for p, n in zip(prompts, lengths)]
    results, errors = {}, []
    barrier = threading.Barrier(STREAMS)
    before = _metrics(served)

    def run(i):
        try:
            barrier.wait()
            stream = client.chat.completions.create(
                model="clover", messages=[{"role": "user", "content": prompts[i]}], max_tokens=lengths[i],
                stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
            results[i] = _streamed(stream)
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors
    for i, want in enumerate(expected):
        text, ids, reason, tokens, _, _ = results[i]
        assert (ids, text, reason) == (want.token_ids, want.text, want.finish_reason), prompts[i]
        assert tokens.completion_tokens == len(want.token_ids)
    after = _metrics(served)
    shared = after[("clover_sequence_steps_total", None)] - before[("clover_sequence_steps_total", None)]
    steps = after[("clover_batch_steps_total", None)] - before[("clover_batch_steps_total", None)]
    assert shared / steps > 1.5  # the streams really ran together (in-flight batching)


def test_a_client_disconnecting_mid_stream_cancels_the_request(served, client, reference):
    prompt = next(p for p in PROMPTS if reference(p, 200, False).finish_reason == "length")
    before = _metrics(served)
    stream = client.completions.create(model="clover", prompt=prompt, max_tokens=200, stream=True)
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].text) if chunk.choices else 0
        if received >= 5:
            break
    stream.close()  # drops the connection

    def cancelled() -> bool:
        key = ("clover_requests_total", "cancelled")
        return _metrics(served).get(key, 0) > before.get(key, 0)

    _wait_until(cancelled)
    after = _metrics(served)
    assert after[("clover_active_batch_size", None)] == 0
    generated = after[("clover_output_tokens_total", None)] - before[("clover_output_tokens_total", None)]
    assert generated < 200  # it really stopped early


def _error_of(call) -> tuple[int, dict]:
    import openai

    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.response.json()


def test_each_bad_input_gets_its_own_openai_error(served, client):
    user = [{"role": "user", "content": "hi"}]
    chat_cases = [
        ({"messages": user, "temperature": -1}, "temperature", r"^temperature must be between 0 and 2 \(got -1\)$"),
        ({"messages": user, "temperature": 5}, "temperature", r"^temperature must be between 0 and 2 \(got 5\)$"),
        ({"messages": user, "top_p": 1.5}, "top_p", r"top_p must be in \(0, 1\]"),
        ({"messages": user, "max_tokens": 0}, "max_tokens", rf"^max_tokens must be between 1 and {CONTEXT}, "),
        ({"messages": user, "max_tokens": 100000}, "max_tokens",
         rf"^max_tokens must be between 1 and {CONTEXT}, the engine's context in tokens \(got 100000\)$"),
        ({"messages": user, "max_tokens": 10**12}, "max_tokens",
         rf"^max_tokens must be between 1 and {CONTEXT}, the engine's context in tokens \(got 1000000000000\)$"),
        ({"messages": user, "max_completion_tokens": 100000}, "max_completion_tokens",
         rf"^max_completion_tokens must be between 1 and {CONTEXT}, "),
        ({"messages": [{"role": "user", "content": ""}]}, "messages", "the prompt is empty"),
        ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages", "does not fit"),
        ({"messages": [], "max_tokens": 5}, "messages", "^messages: the list is empty; send at least one message"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content", "only text parts"),
        ({"messages": user, "n": 2}, "n", "only n=1"),
        ({"messages": user, "seed": -5}, "seed", r"^seed must be between 0 and \d+ \(got -5\)$"),
        ({"messages": user, "extra_body": {"temperature": "hot"}}, "temperature", "valid number"),
        ({"messages": user, "stream": True, "max_tokens": 0}, "max_tokens", "must be between 1 and"),  # before the stream
    ]
    for kwargs, param, message in chat_cases:
        status, body = _error_of(lambda: client.chat.completions.create(model="clover", **kwargs))
        error = body["error"]
        assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param, (kwargs, body)
        assert re.search(message, error["message"]) and set(error) == {"message", "type", "param", "code"}
    status, body = _error_of(lambda: client.completions.create(model="clover", prompt="", max_tokens=3))
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = _error_of(lambda: client.chat.completions.create(model="gpt-4o", messages=user))
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    raw = urllib.request.Request(f"{served.base_url}/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(raw, timeout=30)
    assert info.value.code == 400 and "not valid JSON" in json.loads(info.value.read())["error"]["message"]
    raw = urllib.request.Request(f"{served.base_url}/chat/completions", data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(raw, timeout=30)
    assert info.value.code == 400
    assert json.loads(info.value.read())["error"]["message"].startswith("the request body is empty")
    after = client.chat.completions.create(model="clover", messages=user, max_tokens=3)
    assert after.usage.completion_tokens == 3  # the server keeps serving


def test_triton_unreachable_is_503(tokenizer):
    openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[test]'")
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed: pip install -e '.[serve]'")
    import uvicorn

    port = free_port()
    app = create_app(FrontendSettings(f"127.0.0.1:{free_port()}", CONTEXT), tokenizer)  # nothing listens there
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_until(lambda: server.started)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        for call in (client.models.list, lambda: client.chat.completions.create(
                model="clover", messages=[{"role": "user", "content": "hi"}], max_tokens=3)):
            status, body = _error_of(call)
            assert status == 503 and body["error"]["code"] == "triton_unavailable", body
        with pytest.raises(urllib.error.HTTPError) as info:  # not ready: no "ok" for a load balancer
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30)
        assert info.value.code == 503 and json.loads(info.value.read())["error"]["code"] == "triton_unavailable"
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_frontend_crash_is_reported(served, tiny_engine_dir, tmp_path, capsys):
    from clover.serving.launch import _wait_for_exit

    early = FrontendProcess(tmp_path / "no-engine", served.grpc_url, free_port(), host="127.0.0.1",
                            log_file=tmp_path / "early.log")
    with pytest.raises(ServerError, match="exited with code 1 before it was ready"):
        early.start().wait_ready(120)
    frontend = FrontendProcess(tiny_engine_dir, served.grpc_url, free_port(), host="127.0.0.1").start()
    try:
        frontend.wait_ready(120)
        os.kill(frontend.process.pid, signal.SIGKILL)

        class RunningTriton:  # tritonserver goes on running, its stubs healthy
            def wait(self, timeout=None):
                time.sleep(timeout or 0)

            def dead_stubs(self):
                return []

        assert _wait_for_exit(RunningTriton(), frontend, io.StringIO()) == 1
        assert f"the OpenAI frontend (pid {frontend.process.pid}) exited with code -9" in capsys.readouterr().err
    finally:
        frontend.stop()


def test_the_terminal_shows_clover_s_lines_and_the_server_log_goes_to_a_file(served):
    """Triton's startup log (on CPU with an error line about CUDA) is in the log file clover serve names,
    not in the terminal: as quiet as ``clover serve --demo``."""
    log = served.log
    assert "Started GRPCInferenceService" in log and "Started HTTPService" in log, log[-2000:]
    assert "GRPCInferenceService" not in served.output and "CudaDriverHelper" not in served.output, served.output
    assert not re.search(r"^[IWE]\d{4} \d\d:\d\d", served.output, re.M), served.output  # Triton's log lines


def test_ctrl_c_ends_an_open_stream_with_a_final_chunk_and_done(served, reference):
    """Last: it stops the module's server, with a stream open that would outlast the drain (0 s here):
    the stream ends with its final chunk (finish reason ``cancelled``), the usage chunk and
    ``data: [DONE]``; nothing prints a traceback; both processes are gone."""
    triton_pid, frontend_pid = served.pid_after("ready"), served.pid_after("OpenAI-compatible endpoint ready")
    assert _alive(triton_pid) and _alive(frontend_pid)
    prompt = next(p for p in PROMPTS if reference(p, 200, False).finish_reason == "length")
    response = _post(served.openai_port, "/v1/completions", {
        "model": "clover", "prompt": prompt, "max_tokens": 200, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert response.status == 200
    first = response.readline()  # a stream is open when Ctrl-C comes
    assert first.startswith(b"data: "), first
    served.proc.send_signal(signal.SIGINT)
    events = [json.loads(first[len(b"data: "):])] + _sse_events(response)
    assert served.proc.wait(90) == 0, served.output
    assert events[-1] == "[DONE]", events[-3:]
    final, usage = events[-3], events[-2]
    assert final["choices"][0]["finish_reason"] == "cancelled", final  # the drain's finish reason
    ids = [i for e in events[:-2] for i in e["choices"][0].get("token_ids") or []]
    assert 0 < len(ids) < 200 and ids == reference(prompt, 200, False).token_ids[:len(ids)]  # the greedy answer, cut
    assert usage["usage"]["completion_tokens"] == len(ids)
    _wait_until(lambda: "stopped (exit code 0)" in served.output, 10)
    assert "stopped the OpenAI frontend (exit code 0)" in served.output, served.output[-3000:]
    assert not _alive(triton_pid) and not _alive(frontend_pid)
    for text in (served.output, served.log):
        assert "Traceback" not in text and "timeout graceful shutdown exceeded" not in text, text[-3000:]
    # the frontend's one line (the stream may have ended already, at the model's drain)
    assert re.search(r"\[clover\] OpenAI frontend: shutting down; [01] open request\(s\) end within 2 s", served.log)
