"""Faults and abuse against the served model (GitHub issue 15; docs/serving.md#shutdown-faults-and-security).

Without a server: stop-word limits, the stop-string search window, the batcher's drain, and
``TritonServer.stop`` on a fake tritonserver that ignores SIGINT and leaves an orphan with a /dev/shm region.
Against the real Triton 2.51 server (nvidia-pytriton wheel) on the tiny engine: admin APIs refused without
the key, a heavy stop-words request refused and not stalling others, integer inputs, HTTP status codes;
and ``clover serve`` under SIGINT / SIGTERM with long requests in flight and under kill -9 of its stub.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.serving.batcher import InflightBatcher, ShuttingDown
from clover.text import TextStream, cut_at_stop, stop_prefix_held
from clover.serving.protocol import RequestError, RequestLimits, parse_request
from clover.serving.launch import HEALTH_POLL_S
from clover.serving.server import SHM_PREFIX, ServerError, TritonInstall, TritonServer, free_port, shm_regions
from tests.serving_support import PROMPTS, reference, tiny_engine_dir  # noqa: F401  (fixtures)
from tests.test_serving import _alive, _children, install  # noqa: F401  (install: a fixture; skips without Triton)

STARTUP_S = 240
STOP_BOUND_S = 15.0  # the longest a stop of clover serve with a 0 s drain may take (docs/serving.md#graceful-drain)


class _ByteTok:
    """One token per character (ids are code points), no special tokens."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)

    def encode(self, text):
        return [ord(c) for c in text]


def _get(**inputs):
    arrays = {k: np.asarray(v, dtype=object if isinstance(v, (list, tuple)) and v and isinstance(v[0], bytes)
                            else None) for k, v in inputs.items()}
    return lambda name: arrays.get(name)


LIMITS = RequestLimits(256, 512, apply_chat_template=False)


# -- fair scheduling: stop words ----------------------------------------------------------------------------


class _CountedWord(bytes):
    """A stop word that counts how often it is read as text (``bytes(word)`` or ``word.decode``): a spy that
    sees work on the stop words whatever the clock says (100k decodes take only ~30 ms)."""

    reads = 0

    def __bytes__(self):
        _CountedWord.reads += 1
        return b"" + self  # plain bytes, without a second count

    def decode(self, *args, **kwargs):
        _CountedWord.reads += 1
        return super().decode(*args, **kwargs)


def test_too_many_or_too_long_stop_words_are_refused_before_decoding():
    tok = _ByteTok()
    base = {"text_input": [b"hi"], "max_tokens": np.array([4], np.int32)}
    _CountedWord.reads = 0
    with pytest.raises(RequestError, match=r"stop_words has 100000 strings; this server takes at most 64"):
        parse_request(_get(**base, stop_words=[_CountedWord(b"stop%d" % i) for i in range(100_000)]), tok, LIMITS)
    assert _CountedWord.reads == 0  # refused on the count, before any of the 100k strings is decoded
    parse_request(_get(**base, stop_words=[_CountedWord(b"stop")] * 3), tok, LIMITS)
    assert _CountedWord.reads == 3  # the spy does see each decode of an accepted word
    with pytest.raises(RequestError, match="at most 64 .model parameter max_stop_words"):
        parse_request(_get(**base, stop_words=[b"w"] * 65), tok, LIMITS)
    with pytest.raises(RequestError, match="total 4097 characters; this server takes at most 4096"):
        parse_request(_get(**base, stop_words=[b"x" * 4000, b"y" * 97]), tok, LIMITS)
    ok = parse_request(_get(**base, stop_words=[b"x" * 64] * 64), tok, LIMITS)
    assert len(ok.generation.stop_strings) == 64
    small = RequestLimits(256, 512, False, max_stop_words=2, max_stop_chars=5)
    with pytest.raises(RequestError, match="at most 2"):
        parse_request(_get(**base, stop_words=[b"a", b"b", b"c"]), tok, small)


def test_stop_prefix_held_equals_the_plain_definition():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        plain = max([k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])],
                    default=0)
        assert stop_prefix_held(text, stops) == plain, (text, stops)


def test_stop_search_covers_only_the_new_text_window_and_finds_the_same_cut(monkeypatch):
    import clover.text as text_module

    windows = []

    def spy(text, stops, start=0):
        windows.append(len(text) - start)
        return cut_at_stop(text, stops, start)

    monkeypatch.setattr(text_module, "cut_at_stop", spy)
    rng = random.Random(1)
    stops = ("abcab", "bbbb", "cacc")
    for trial in range(200):
        answer = "".join(rng.choice("abc") for _ in range(300))
        stream = TextStream(_ByteTok(), stops)
        out, pos = [], 0
        while pos < len(answer):
            n = rng.randint(1, 4)
            out.append(stream.push([ord(c) for c in answer[pos:pos + n]], finished=pos + n >= len(answer)))
            pos += n
            if cut_at_stop(answer[:pos], stops) != answer[:pos]:
                out.append(stream.push([], finished=True))
                break
        assert "".join(out) == cut_at_stop(answer[:pos], stops), trial
    # each search covers at most the longest stop string, the revision slack and the (<= 4) new characters
    assert max(windows) <= 5 + 8 + 4


class _PassClock:
    """A fake ``time`` for the batcher: its ``monotonic`` moves only when a target pass runs (``_SlowEngine``
    with ``clock``), so a drain deadline falls after a fixed number of passes whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _SlowEngine:
    """The engine with a fixed pause per target pass, so a long request surely outlasts a drain deadline
    (the tiny engine alone can finish 250 tokens inside it on a fast machine). With ``clock`` the pause is on
    that fake clock, not slept."""

    def __init__(self, inner, pause_s: float, clock: _PassClock | None = None) -> None:
        self.inner, self.spec, self.pause_s, self.clock = inner, inner.spec, pause_s, clock
        self.cost_model = inner.cost_model

    def target(self, *args):
        if self.clock is None:
            time.sleep(self.pause_s)
        else:
            self.clock.now += self.pause_s
        return self.inner.target(*args)

    def draft_step(self, *args):
        return self.inner.draft_step(*args)


def _decoder(tiny_engine_dir, pause_s: float = 0.0, clock: _PassClock | None = None):
    from clover.backends.onnxruntime import OnnxRuntimeEngine
    from clover.target import load_tokenizer

    engine = OnnxRuntimeEngine(tiny_engine_dir, threads=1)
    if pause_s:
        engine = _SlowEngine(engine, pause_s, clock)
    tokenizer = load_tokenizer(tiny_engine_dir)
    return lambda: SpeculativeDecoder(engine, "clover", tokenizer=tokenizer, max_batch_size=8)


def test_decoder_stop_strings_use_the_window_and_cut_like_the_whole_text(tiny_engine_dir, reference):
    make = _decoder(tiny_engine_dir)
    decoder = make()
    ids = reference.prompt_ids(PROMPTS[8])
    whole = reference(PROMPTS[8], 60).text
    stop = whole[30:34]
    result = decoder.generate([GenerationRequest(ids, max_new_tokens=60, stop_strings=(stop,))])[0]
    assert result.text == cut_at_stop(whole, (stop,)) and result.finish_reason == "stop"


# -- graceful drain in the batcher ------------------------------------------------------------------------------


def test_drain_refuses_new_requests_and_cancels_long_ones_at_the_deadline(tiny_engine_dir, reference, monkeypatch):
    import clover.serving.batcher as batcher_module

    clock = _PassClock()  # the batcher's clock moves 20 ms per target pass: the deadline is counted in passes
    monkeypatch.setattr(batcher_module, "time", clock)
    make = _decoder(tiny_engine_dir, pause_s=0.02, clock=clock)  # 250 tokens take > 0.5 s of passes
    end_id = reference.unused_token("a", 250)
    updates: dict[str, list] = {"long": [], "short": []}
    ended: dict[str, float] = {}

    def collect(name):
        def on_update(update):
            updates[name].append(update)
            if update.finished:
                ended[name] = clock.now
        return on_update

    batcher = InflightBatcher(make)
    try:
        long_ids, short_ids = reference.prompt_ids("a"), reference.prompt_ids(PROMPTS[0])
        long = batcher.submit(GenerationRequest(long_ids, 250, stop_token_ids=(end_id,)), collect("long"))
        while not updates["long"]:
            time.sleep(0.01)
        short = batcher.submit(GenerationRequest(short_ids, 3), collect("short"))
        begin = clock.now
        batcher.begin_drain(0.5)
        with pytest.raises(ShuttingDown, match="shutting down; it takes no new requests"):
            batcher.submit(GenerationRequest(short_ids, 3), lambda u: None)
        assert short.wait(30) and long.wait(30)
        # cancelled at the deadline, not before it and not long after: within the step that crossed it (a step
        # is at most a prefill pass and a decode pass)
        assert 0.5 - 1e-9 <= ended["long"] - begin <= 0.5 + 2 * 0.02 + 1e-9, ended["long"] - begin
        assert updates["short"][-1].finish_reason == "length" and updates["short"][-1].error is None
        last = updates["long"][-1]
        assert last.finished and last.finish_reason == "cancelled" and last.error is None
        assert sum(len(u.token_ids) for u in updates["long"]) < 250
    finally:
        batcher.shutdown()


def test_triton_model_drains_when_the_drain_file_appears(tiny_engine_dir, reference, tmp_path, monkeypatch):
    from clover.serving.protocol import DRAIN_FILE_ENV
    from clover.serving.triton_model import CloverTritonModel
    from tests.test_serving_unit import FakePbUtils, FakeRequest, _args, _text, long_stream_request

    drain = tmp_path / "drain"
    monkeypatch.setenv(DRAIN_FILE_ENV, str(drain))
    end_id = reference.unused_token("a", 250)
    model = CloverTritonModel(FakePbUtils, _args(tiny_engine_dir, threads="1"))
    try:
        running = long_stream_request(end_id)
        # each update takes 10 ms to send (the callback runs on the decode thread), so the stream's 250 tokens
        # outlast the 0.2 s drain on any machine: on a fast CPU the tiny engine decoded them all within it
        send = running.sender.send
        running.sender.send = lambda response=None, flags=0: (time.sleep(0.01), send(response, flags))
        model.execute([running])
        _wait_until(lambda: len(running.sender.responses) >= 2, what="a running stream")
        drain.write_text("0.2\n")  # what TritonServer.request_drain writes
        _wait_until(lambda: model.batcher.draining, what="the drain")
        late = FakeRequest(text_input=_text("hi"), max_tokens=np.array([4], np.int32))
        bad = FakeRequest(text_input=_text("hi"), max_tokens=np.array([0], np.int32))
        model.execute([late, bad])
        assert running.sender.closed.wait(10) and late.sender.closed.wait(10)
    finally:
        model.finalize()
    assert running.sender.responses[-1].outputs["finish_reason"][0] == b"cancelled"
    error = late.sender.responses[0].error
    assert "shutting down" in error.message and error.code == FakePbUtils.TritonError.UNAVAILABLE  # HTTP 503
    assert bad.sender.responses[0].error.code == FakePbUtils.TritonError.INVALID_ARG  # HTTP 400


# -- TritonServer.stop against a tritonserver that will not stop -------------------------------------------------


def _fake_install(tmp_path: Path, region: str) -> TritonInstall:
    """A 'tritonserver' that ignores SIGINT and starts a 'stub' naming a /dev/shm region, which outlives it."""
    script = tmp_path / "tritonserver"
    script.write_text(f"#!{sys.executable}\nimport signal, subprocess, sys, time\n"
                      "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', '/{region}'])\n"
                      "time.sleep(300)\n")
    script.chmod(0o755)
    return TritonInstall(script, "PATH")


def _wait_until(condition, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_stop_kills_a_server_that_ignores_sigint_and_removes_orphans_and_shm(tmp_path):
    region = f"{SHM_PREFIX}clover_test_{os.getpid()}"
    Path(f"/dev/shm/{region}").write_bytes(b"x")
    server = TritonServer(tmp_path, 0, 0, 0, install=_fake_install(tmp_path, region), drain_s=0)
    try:
        server.start()
        _wait_until(lambda: _children(server.pid), what="the fake stub")
        stub = next(p for p in _children(server.pid) if region in Path(f"/proc/{p}/cmdline").read_text())
        drain_file = server.drain_file
        assert server.dead_stubs() == []
        begin = time.monotonic()
        code = server.stop(timeout_s=1.0)
        assert code is not None and code != 0  # killed: not a clean exit
        assert time.monotonic() - begin < 10
        assert not _alive(server.pid) and not _alive(stub), "orphaned stub left running"
        assert not Path(f"/dev/shm/{region}").exists(), "shared-memory region left in /dev/shm"
        assert not drain_file.exists()  # the private directory is gone
    finally:
        server.kill()
        Path(f"/dev/shm/{region}").unlink(missing_ok=True)


def test_stop_reaps_the_server_even_where_an_interrupted_wait_left_popen_s_lock_held(tmp_path):
    """Ctrl-C raised inside Popen.wait / poll can leave Popen's internal lock held (about 1 signal in 200 on an
    idle machine), after which Popen.wait never reaps: tritonserver stayed <defunct> and clover serve reported
    "exit code None" 35 s later. stop() must reap it at once and know its exit code."""
    script = tmp_path / "tritonserver"
    script.write_text(f"#!{sys.executable}\nimport signal, sys, time\n"
                      "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\ntime.sleep(300)\n")
    script.chmod(0o755)
    server = TritonServer(tmp_path, 0, 0, 0, install=TritonInstall(script, "PATH"), drain_s=0)
    try:
        server.start()
        time.sleep(0.5)  # the script's SIGINT handler is in place
        assert server.process._waitpid_lock.acquire(False)  # what the interrupted wait left behind
        begin = time.monotonic()
        assert server.stop(timeout_s=20) == 0
        assert time.monotonic() - begin < 5
        assert not _alive(server.pid)
    finally:
        server.kill()


def test_an_unknown_exit_code_is_reported_as_a_failure(capsys):
    import io

    from clover.serving.launch import _report_stop

    out = io.StringIO()
    assert _report_stop(None, None, out) == 1
    assert "stopped (exit code unknown)" in out.getvalue()
    assert "did not exit cleanly (exit code unknown)" in capsys.readouterr().err
    assert _report_stop(-9, None, io.StringIO()) == 1 and _report_stop(0, None, io.StringIO()) == 0


class _LoggingServer:
    """Stands in for TritonServer in clover serve: writes to its log, then exits with ``code``."""

    code = 0

    def __init__(self, repo, *ports, log_file=None, **kwargs) -> None:
        self.log_file, self.install = log_file, TritonInstall(Path("tritonserver"), "PATH")
        self.host, self.client_host, self.pid = "127.0.0.1", "127.0.0.1", 1
        self.http_port, self.grpc_port, self.metrics_port = ports

    def start(self):
        self.log_file.write_text("I1206 tritonserver log\n")
        return self

    def wait_ready(self, timeout_s) -> None:
        pass

    def wait(self, timeout_s):
        return self.code

    def stop(self, timeout_s=None) -> int:
        return self.code


@pytest.mark.parametrize("code", [0, 1])
def test_the_default_server_log_is_removed_after_a_clean_exit_and_kept_after_a_failure(tmp_path, monkeypatch, capsys,
                                                                                       code):
    import io

    from clover.serving import launch

    default = tmp_path / "clover-serve-test.log"
    monkeypatch.setattr(launch, "default_log_file", lambda: default)
    monkeypatch.setattr(launch, "TritonServer", type("Server", (_LoggingServer,), {"code": code}))
    assert launch.serve(model_repository=tmp_path, out=io.StringIO()) == code
    assert default.exists() == (code != 0)
    assert (f"the server log is kept: {default}" in capsys.readouterr().err) == (code != 0)
    chosen = tmp_path / "mine.log"  # a log the user named stays, whatever the exit
    assert launch.serve(model_repository=tmp_path, log_file=chosen, out=io.StringIO()) == code and chosen.exists()


class _Stopping:
    """Stands in for TritonServer and FrontendProcess in clover serve's stop: records how it was stopped."""

    def __init__(self, code: int, forced: bool = False) -> None:
        self.code, self.forced, self.killed = code, forced, False

    def request_drain(self) -> None:
        pass

    def stop(self, timeout_s: float | None = None) -> int:
        return self.code

    def kill(self) -> None:
        self.killed = True


def test_the_first_ctrl_c_says_how_to_stop_at_once_and_a_forced_stop_exits_non_zero(capsys):
    import io

    from clover.serving.launch import _drain_and_stop

    out = io.StringIO()
    server, frontend = _Stopping(0), _Stopping(0)
    assert _drain_and_stop(server, frontend, 10.0, None, out) == 0 and not server.killed  # the full drain
    assert "requests in flight get 10 s; Ctrl-C again stops at once" in out.getvalue()
    server, frontend = _Stopping(-9), _Stopping(1, forced=True)  # a second Ctrl-C while the frontend drained
    out = io.StringIO()
    assert _drain_and_stop(server, frontend, 10.0, None, out) == 1 and server.killed  # no second drain
    assert "stopped at once (second Ctrl-C)" in out.getvalue() and "clover: error: stopped before the drain ended" \
        in capsys.readouterr().err
    server = _Stopping(-9, forced=True)  # no frontend: the second Ctrl-C came during tritonserver's own stop
    assert _drain_and_stop(server, None, 10.0, None, io.StringIO()) == 1


def test_dead_stubs_reports_a_killed_stub_and_commands_restrict_admin_apis(tmp_path):
    region = f"{SHM_PREFIX}clover_test_dead_{os.getpid()}"
    server = TritonServer(tmp_path, 0, 0, 0, install=_fake_install(tmp_path, region), admin_key="k3y")
    try:
        server.start()
        _wait_until(lambda: server.dead_stubs() == [] and server._stubs, what="the fake stub")
        stub = next(iter(server._stubs))
        os.kill(stub, signal.SIGKILL)
        _wait_until(lambda: server.dead_stubs() == [stub], what="dead_stubs")
        command = server.command(None)
        assert "--http-address=127.0.0.1" in command  # closed by default
        assert not any("k3y" in a for a in command)  # the key goes through a file (clover.serving.hidden_args)
        restricted = server.admin_args()
        assert len(restricted) == 2 and all(a.endswith(":clover-admin-key=k3y") for a in restricted)
        for api in ("shared-memory", "model-repository", "model-config", "statistics", "trace", "logging"):
            assert all(api in a for a in restricted)
        assert all("inference" not in a and "health" not in a and "metadata" not in a for a in restricted)
        assert f"--exit-timeout-secs={server.exit_timeout_s}" in command and server.exit_timeout_s > server.drain_s
    finally:
        server.kill()
    with pytest.raises(ServerError, match="drain time"):
        TritonServer(tmp_path, 0, 0, 0, install=_fake_install(tmp_path, region), drain_s=-1)


def test_a_loading_stub_that_exits_before_readiness_is_not_reported_dead(tmp_path, monkeypatch):
    """Triton runs a short-lived stub per model while loading (config auto-complete), then the serving one:
    only the stubs alive at readiness are watched, or clover serve would stop a healthy server."""
    ready_marker = tmp_path / "ready"
    script = tmp_path / "tritonserver"
    script.write_text(f"#!{sys.executable}\nimport pathlib, subprocess, sys, time\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)']).wait()\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
                      f"pathlib.Path({str(ready_marker)!r}).write_text('')\n"
                      "time.sleep(300)\n")
    script.chmod(0o755)
    server = TritonServer(tmp_path, 0, 0, 0, install=TritonInstall(script, "PATH"), drain_s=0)
    monkeypatch.setattr(server, "is_ready", lambda: ready_marker.exists() and len(_children(server.pid)) == 1)
    try:
        server.start()
        _wait_until(lambda: server.dead_stubs() == [] and len(server._stubs) == 1, what="the loading stub")
        server.wait_ready(timeout_s=30)
        assert server.dead_stubs() == []
        serving = _children(server.pid)
        assert list(server._stubs) == serving
        os.kill(serving[0], signal.SIGKILL)  # the serving stub's death is still detected
        _wait_until(lambda: server.dead_stubs() == serving, what="dead_stubs")
    finally:
        server.kill()


# -- the real server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(install, tiny_engine_dir, tmp_path_factory):
    from clover.serving.repository import write_repository

    root = tmp_path_factory.mktemp("triton-faults")
    repo = write_repository(root / "repo", {"clover": {"engine_dir": str(tiny_engine_dir), "threads": "1"}})
    # a key that occurs nowhere else, so that finding it on a command line means it leaked there
    server = TritonServer(repo, 0, 0, 0, log_file=root / "tritonserver.log", install=install,
                          admin_key=secrets.token_urlsafe(24))
    try:
        server.start().wait_ready(STARTUP_S)
        yield server
    finally:
        server.stop(timeout_s=60)


def _http(server, method: str, path: str, body=None, headers=None) -> tuple[int, str]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_the_admin_key_is_on_no_command_line_and_still_needed(server):
    """ps shows every process's command line to every local user: the key must be on none (issue 62), and the
    admin APIs must still need it."""
    key = server.admin_key.encode()
    on_command_lines = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and key in (entry / "cmdline").read_bytes():
                on_command_lines.append(entry.name)
        except OSError:  # gone meanwhile
            continue
    assert server.is_ready() and not on_command_lines, f"the admin key is on the command line of {on_command_lines}"
    assert not server._hidden_file.exists()  # tritonserver read it (and removed it)
    assert _http(server, "GET", "/v2/models/clover/config")[0] in (401, 403)
    assert _http(server, "GET", "/v2/models/clover/config", headers={"clover-admin-key": "wrong"})[0] in (401, 403)
    assert _http(server, "GET", "/v2/models/clover/config", headers=server.admin_headers)[0] == 200


def test_admin_apis_are_refused_without_the_key_and_inference_stays_open(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    probes = [("GET", "/v2/models/clover/config", None), ("POST", "/v2/repository/index", {}),
              ("POST", "/v2/systemsharedmemory/region/x/register", {"key": "/x", "offset": 0, "byte_size": 8}),
              ("POST", "/v2/systemsharedmemory/unregister", {}), ("GET", "/v2/models/clover/stats", None),
              ("POST", "/v2/repository/models/clover/unload", {}), ("GET", "/v2/logging", None)]
    for method, path, body in probes:
        status, text = _http(server, method, path, body)
        assert status in (401, 403), (path, status, text)
    status, text = _http(server, "GET", "/v2/models/clover/config", headers=server.admin_headers)
    assert status == 200 and '"decoupled":true' in text.replace(" ", "")
    assert _http(server, "GET", "/v2/health/ready")[0] == 200
    assert _http(server, "GET", "/v2/models/clover")[0] == 200  # metadata
    status, text = _http(server, "POST", "/v2/models/clover/generate", {"text_input": "hi", "max_tokens": 4})
    assert status == 200 and "text_output" in text
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for call in (client.get_model_repository_index, lambda: client.get_model_config("clover"),
                     client.get_system_shared_memory_status, lambda: client.unload_model("clover")):
            with pytest.raises(InferenceServerException, match="(?i)restricted|unauthenticated|permission"):
                call()
        assert client.get_model_config("clover", headers=server.grpc_admin_headers) is not None
        assert client.is_server_ready() and client.is_model_ready("clover")
    finally:
        client.close()


def test_heavy_stop_words_are_refused_and_allowed_ones_do_not_stall_others(server, reference):
    """Through the real server: too many stop words are refused on both protocols, and a stream with the most
    stop words allowed runs beside a short request, which still decodes its exact tokens. That the heavy
    stream's cost per step does not grow with its text is shown without a clock by
    test_stop_search_covers_only_the_new_text_window_and_finds_the_same_cut (the search window) and that a
    refusal does no work first by test_too_many_or_too_long_stop_words_are_refused_before_decoding (a spy)."""
    from clover.client import ClientError, GrpcClient, HttpClient, collect

    words = [f"never-{i:06d}" for i in range(100_000)]  # ~1.2 MB of stop words
    status, text = _http(server, "POST", "/v2/models/clover/generate",
                         {"text_input": "hi", "max_tokens": 8, "stop_words": words})
    assert status == 400 and "stop_words has 100000 strings" in text, (status, text[:300])
    with pytest.raises(ClientError, match="stop_words has 100000 strings"):
        with GrpcClient(server.grpc_url) as client:
            collect(client.stream("hi", 8, stop_words=words))

    end_id = reference.unused_token("a", 250)
    heavy = [("z" * 63) + chr(0x4e00 + i) for i in range(64)]  # the limit: 64 strings, 4096 characters
    done, streamed = threading.Event(), threading.Event()

    def heavy_stream():
        with GrpcClient(server.grpc_url) as client:
            while not done.is_set():
                for _ in client.stream("a", 250, end_id=end_id, stop_words=heavy):
                    streamed.set()

    thread = threading.Thread(target=heavy_stream, daemon=True)
    thread.start()
    try:
        assert streamed.wait(60), "the stream with the most stop words allowed produced nothing"
        result = HttpClient(server.http_url).generate(PROMPTS[2], 32)  # beside it, in shared decode steps
        assert result.token_ids == reference(PROMPTS[2], 32).token_ids
    finally:
        done.set()
        thread.join(60)


def test_integer_inputs_are_refused_not_wrapped_where_the_model_sees_them(server):
    from clover.client import ClientError, GrpcClient, collect

    # over gRPC a value outside INT32 cannot be sent as INT32; as INT64 Triton refuses the dtype
    with pytest.raises(ClientError, match="expects 'INT32'"):
        with GrpcClient(server.grpc_url) as client:
            collect(client.stream_raw({"text_input": (np.array([b"hi"], dtype=object), "BYTES"),
                                       "max_tokens": (np.array([2**32 + 8], np.int64), "INT64")}))
    for body, message in [({"text_input": "hi", "max_tokens": 4, "end_id": -1}, "(end_id) -1 is outside"),
                          ({"text_input": "hi", "max_tokens": 0}, "max_new_tokens must be >= 1"),
                          ({"text_input": "hi", "max_tokens": 4, "stop_words": ["w"] * 65}, "at most 64")]:
        status, text = _http(server, "POST", "/v2/models/clover/generate", body)
        assert status == 400 and message in text, (body, status, text)  # a client error, not 500


def test_an_unknown_input_is_refused_over_both_protocols(server):
    from clover.client import ClientError, GrpcClient, collect

    status, text = _http(server, "POST", "/v2/models/clover/generate", {"text_input": "hi", "max_tokens": 4,
                                                                          "max_token": 9})
    assert status == 400 and "unknown input 'max_token'" in text, (status, text)
    with pytest.raises(ClientError, match="unexpected inference input 'max_token'"):
        with GrpcClient(server.grpc_url) as client:
            collect(client.stream_raw({"text_input": (np.array([b"hi"], dtype=object), "BYTES"),
                                       "max_tokens": (np.array([4], np.int32), "INT32"),
                                       "max_token": (np.array([9], np.int32), "INT32")}))


@pytest.mark.xfail(strict=True, reason="Triton 2.51's HTTP JSON parser wraps integers into INT32 before the model "
                                       "sees them (docs/serving.md#shutdown-faults-and-security); strict: a Triton "
                                       "that refuses them turns this into a failure to update the docs")
def test_http_integer_beyond_int32_is_refused(server):
    status, text = _http(server, "POST", "/v2/models/clover/generate", {"text_input": "hi", "max_tokens": 2**32 + 8})
    assert status == 400, (status, text)


# -- clover serve under signals and a dead stub ------------------------------------------------------------------


class _Serve:
    """``clover serve`` in a process of its own on free ports; its output collected line by line."""

    def __init__(self, engine_dir: Path, drain_s: float) -> None:
        self.ports = [free_port() for _ in range(3)]
        cmd = [sys.executable, "-m", "clover.cli", "serve", "--engine", str(engine_dir), "--threads", "1",
               "--http-port", str(self.ports[0]), "--grpc-port", str(self.ports[1]),
               "--metrics-port", str(self.ports[2]), "--drain-timeout", str(drain_s),
               "--startup-timeout", str(STARTUP_S), "--log-file", "-"]  # tritonserver's log in the output: checked
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(line) for line in self.proc.stdout], daemon=True).start()
        _wait_until(lambda: any("ready (pid" in line for line in self.lines) or self.proc.poll() is not None,
                    STARTUP_S, "clover serve")
        assert self.proc.poll() is None, self.output
        self.triton = int(re.search(r"ready \(pid (\d+)\)", self.output).group(1))
        self.stubs = _children(self.triton)
        assert self.stubs, "the Python backend stub should be running"
        # this server's regions (named on its stubs' command lines): other servers may run beside the test
        self.regions = {arg.lstrip("/") for pid in self.stubs
                        for arg in Path(f"/proc/{pid}/cmdline").read_text().split("\0") if SHM_PREFIX in arg}
        assert self.regions

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports[1]}"

    def streams(self, count: int, end_id: int) -> tuple[list[dict], list[threading.Thread]]:
        """``count`` long streams; each state records its chunks, final finish reason or error and when."""
        from clover.client import GrpcClient

        states = [{"chunks": 0} for _ in range(count)]

        def run(state):
            try:
                with GrpcClient(self.grpc_url) as client:
                    for chunk in client.stream("a", 250, end_id=end_id):
                        state["chunks"] += 1
                        state["reason"] = chunk.finish_reason
            except Exception as exc:  # recorded and checked by the test
                state["error"] = str(exc)
            state["ended"] = time.monotonic()

        threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in states]
        for t in threads:
            t.start()
        _wait_until(lambda: all(s["chunks"] >= 2 for s in states), 60, "streams under way")
        return states, threads

    def check_nothing_left(self) -> None:
        assert not _alive(self.triton), "tritonserver still running"
        assert not any(_alive(p) for p in self.stubs), "orphaned Python backend stub"
        assert not (self.regions & shm_regions()), "shared-memory regions left in /dev/shm"

    def close(self) -> None:
        for pid in (self.proc.pid, getattr(self, "triton", None), *getattr(self, "stubs", [])):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)


@pytest.mark.parametrize("signum, drain_s", [(signal.SIGINT, 0.0), (signal.SIGTERM, 1.0)])
def test_clover_serve_drains_on_signal_with_long_requests_in_flight(install, tiny_engine_dir, reference, signum,
                                                                    drain_s):
    from clover.client import ClientError, GrpcClient, collect

    end_id = reference.unused_token("a", 250)
    serve = _Serve(tiny_engine_dir, drain_s)
    try:
        states, threads = serve.streams(4, end_id)
        serve.proc.send_signal(signum)
        # requests after the drain began: refused with a clear error (or no server left to connect to). The drain
        # reaches the model through clover serve's signal handler and the model's 0.1 s poll of the drain file,
        # later on a loaded machine, so a request sent before it took effect may still be served: retry until
        # one is refused, for at most 10 s
        late, accepted, deadline = {}, [], time.monotonic() + 10.0
        while "error" not in late and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                with GrpcClient(serve.grpc_url) as client:
                    accepted.append(collect(client.stream("hi", 4)))
            except (ClientError, Exception) as exc:  # noqa: B014 (tritonclient raises its own types too)
                late["error"] = str(exc)
        assert "error" in late, accepted
        assert all(r.finish_reason in ("length", "cancelled") for r in accepted), accepted  # served whole if at all
        assert serve.proc.wait(drain_s + 40) == 0, serve.output
        for t in threads:
            t.join(30)
        output = serve.output
        assert "Exit timeout expired" not in output and not re.search(r"Signal \((6|11)\)", output), output
        assert "stopped (exit code 0)" in output
        for state in states:  # every stream ended with its final response, none with a dropped socket
            assert "error" not in state and state["reason"] in ("cancelled", "length"), state
        if drain_s == 0:
            assert all(state["reason"] == "cancelled" for state in states)
        serve.check_nothing_left()
    finally:
        serve.close()


# stops of the loop test below: each one starts clover serve (10-20 s on 2 shared cores); CI runs 10, and
# CLOVER_STOP_LOOP=50 runs the 50 of issue 33's aim
STOP_LOOP = int(os.environ.get("CLOVER_STOP_LOOP", "10"))


@pytest.mark.slow  # about 3 min: each stop starts a server
def test_clover_serve_stops_quickly_and_cleanly_every_time_under_a_running_client(install, tiny_engine_dir,
                                                                                reference):
    """SIGINT at a random moment while a stream runs: every stop ends within 15 s with exit code 0, nothing left
    behind (the slow stop was tritonserver left <defunct>: docs/serving.md#graceful-drain)."""
    end_id = reference.unused_token("a", 250)
    rng = random.Random(33)
    for attempt in range(STOP_LOOP):
        serve = _Serve(tiny_engine_dir, 0.0)
        try:
            serve.streams(1, end_id)
            time.sleep(rng.uniform(0.0, HEALTH_POLL_S))  # anywhere in clover serve's health poll
            serve.proc.send_signal(signal.SIGINT)
            begin = time.monotonic()
            try:
                code = serve.proc.wait(STOP_BOUND_S)
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - begin
            assert code == 0 and took < STOP_BOUND_S, f"stop {attempt}: {code} after {took:.1f} s\n{serve.output}"
            assert "stopped (exit code 0)" in serve.output
            serve.check_nothing_left()
        finally:
            serve.close()


def test_kill_9_of_the_stub_fails_in_flight_requests_fast_and_exits_non_zero(install, tiny_engine_dir, reference):
    end_id = reference.unused_token("a", 250)
    serve = _Serve(tiny_engine_dir, 10.0)
    try:
        states, threads = serve.streams(4, end_id)
        killed = time.monotonic()
        os.kill(serve.stubs[0], signal.SIGKILL)
        for t in threads:
            t.join(30)
        for state in states:
            assert "error" in state or state.get("reason") == "length", state
            assert state["ended"] - killed < 5.0, state  # fail fast, not hang
        assert serve.proc.wait(30) == 1, serve.output
        # clover serve's health check saw the dead stub, or (a race seen in CI) Triton 2.51 aborted on its own
        # first; either way the server is down, reported, and exits 1
        detected = "stub (pid" in serve.output and "died" in serve.output
        assert detected or "tritonserver exited with code -" in serve.output, serve.output[-2000:]
        serve.check_nothing_left()
    finally:
        serve.close()
