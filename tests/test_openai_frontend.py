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
import urllib.request

import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="uvicorn is not installed: pip install -e '.[serve]'")

from clover.prompts import encode_prompt  # noqa: E402
from clover.serving.openai_frontend import (  # noqa: E402
    ChatCompletionRequest, CompletionRequest, FrontendProcess, FrontendSettings, OpenAIError, chat_request,
    completion_request, create_app, model_error, parse_body, render_chat)
from clover.serving.server import ServerError, find_tritonserver, free_port  # noqa: E402
from tests.serving_support import PROMPTS, reference, tiny_engine_dir  # noqa: E402,F401  (fixtures)

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


def test_one_user_message_is_sent_for_the_model_to_template(tokenizer):
    request = _chat(tokenizer, max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, stop="\n", seed=11, stream=True,
                    stream_options={"include_usage": True})
    assert request.fields == {"text_input": "hello", "max_tokens": 7, "stream": True, "temperature": 0.5, "top_k": 3,
                              "top_p": 0.9, "stop_words": ["\n"], "random_seed": 11, "return_perf_metrics": True,
                              "apply_chat_template": True}
    assert request.prompt_tokens == len(encode_prompt(tokenizer, "hello", True))
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
    assert request.fields["apply_chat_template"] is False and request.fields["stop_words"] == ["a", "b"]
    assert encode_prompt(tokenizer, request.fields["text_input"], False) == list(expected_ids)
    assert request.prompt_tokens == len(expected_ids)


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
    assert request.fields["text_input"] == "hello" and request.fields["apply_chat_template"] is False
    assert request.prompt_tokens == len(tokenizer.encode("hello"))
    with pytest.raises(OpenAIError, match="one prompt per request"):
        completion_request(parse_body(CompletionRequest, b'{"model": "clover", "prompt": ["a", "b"]}'),
                           tokenizer, CONTEXT)


@pytest.mark.parametrize("body, param, message", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "Field required"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"max_tokens": 2**40}, "max_tokens", "less than or equal"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
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


def test_model_refusals_name_the_parameter():
    params = {"prompt": "messages", "max_tokens": "max_completion_tokens"}
    cases = {"max_new_tokens must be >= 1, got 0": "max_completion_tokens",
             "temperature must be >= 0 (got temperature=-1, top_p=1)": "temperature",
             "top_p must be in (0, 1] (got temperature=0, top_p=2)": "top_p",
             "the prompt is empty": "messages", "the prompt is 300 tokens and does not fit": "messages"}
    for message, param in cases.items():
        error = model_error(message, params)
        assert (error.status, error.param) == (400, param) and message in error.message
    assert model_error("the server is shutting down; the request was cancelled", params).status == 503


# -- a real clover serve ---------------------------------------------------------------------------

class Served:
    """A running ``clover serve --openai-port`` and what its output says."""

    def __init__(self, proc, lines, ports) -> None:
        self.proc, self.lines = proc, lines
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = ports

    @property
    def output(self) -> str:
        return "".join(self.lines)

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
def served(tiny_engine_dir):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed: pip install -e '.[serve]'")
    pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[test]'")
    try:
        find_tritonserver()
    except ServerError as exc:
        pytest.skip(f"no Triton server here: {exc}")
    ports = [free_port() for _ in range(4)]
    cmd = [sys.executable, "-m", "clover.cli", "serve", "--engine", str(tiny_engine_dir), "--host", "127.0.0.1",
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3]), "--threads", "1", "--max-batch", "16", "--startup-timeout", str(STARTUP_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
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


def test_chat_equals_tritonclient_token_for_token(served, client, tokenizer):
    prompt = PROMPTS[2]
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
    assert stats["decode_steps"] == expected.perf["num_decode_steps"] and 0 <= stats["acceptance_rate"] <= 1
    assert stats["tokens_per_step"] == pytest.approx(expected.tokens_per_step)


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
    assert stats["decode_steps"] == expected.perf["num_decode_steps"]


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


def test_a_conversation_equals_solo_greedy_decoding_of_its_template(served, client, reference):
    from clover.decode import GenerationRequest, SpeculativeDecoder

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    decoder = SpeculativeDecoder(reference.engine, "vanilla", tokenizer=reference.tokenizer)
    expected = decoder.generate([GenerationRequest(list(ids), max_new_tokens=20)])[0]
    answer = client.chat.completions.create(model="clover", messages=messages, max_tokens=20,
                                            extra_body={"return_token_ids": True})
    assert answer.choices[0].model_extra["token_ids"] == expected.token_ids
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
        ({"messages": user, "temperature": -1}, "temperature", "temperature must be >= 0"),
        ({"messages": user, "top_p": 1.5}, "top_p", r"top_p must be in \(0, 1\]"),
        ({"messages": user, "max_tokens": 0}, "max_tokens", "must be >= 1"),
        ({"messages": user, "max_completion_tokens": 100000}, "max_completion_tokens", "larger than the engine"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages", "the prompt is empty"),
        ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages", "does not fit"),
        ({"messages": [], "max_tokens": 5}, "messages", "at least 1 item"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content", "only text parts"),
        ({"messages": user, "n": 2}, "n", "only n=1"),
        ({"messages": user, "seed": -5}, "seed", "greater than or equal to 0"),
        ({"messages": user, "extra_body": {"temperature": "hot"}}, "temperature", "valid number"),
        ({"messages": user, "stream": True, "max_tokens": 0}, "max_tokens", "must be >= 1"),  # before the stream
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


def test_ctrl_c_stops_the_frontend_and_tritonserver(served, client):
    """Last: it stops the module's server."""
    triton_pid, frontend_pid = served.pid_after("ready"), served.pid_after("OpenAI-compatible endpoint ready")
    assert _alive(triton_pid) and _alive(frontend_pid)
    stream = client.chat.completions.create(model="clover", messages=[{"role": "user", "content": "a"}],
                                            max_tokens=200, stream=True)
    next(iter(stream))  # a stream is open when Ctrl-C comes
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(90) == 0, served.output
    _wait_until(lambda: "stopped (exit code 0)" in served.output, 10)
    assert "stopped the OpenAI frontend (exit code 0)" in served.output, served.output[-3000:]
    assert not _alive(triton_pid) and not _alive(frontend_pid)
