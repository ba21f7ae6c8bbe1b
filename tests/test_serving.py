"""The real Triton server (2.51, from the nvidia-pytriton wheel on CPU) serving a tiny random engine.

HTTP generate / generate_stream, gRPC streaming, 16 concurrent requests equal to their solo greedy
output, every bad input, cancellation mid-stream, metrics, a bad engine directory, and ``clover serve``
shutting down cleanly on Ctrl-C. Servers run on free ports and are always stopped by PID.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed: pip install -e '.[serve]'")
pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed: pip install -e '.[serve]'")

from clover.client import ClientError, GrpcClient, HttpClient, collect, run_load  # noqa: E402
from clover.serving.repository import write_repository  # noqa: E402
from clover.serving.server import (ServerError, TritonServer, find_tritonserver, free_ports,  # noqa: E402
                                   shm_regions)
from tests.serving_support import PROMPTS, long_answer_prompt, reference, tiny_engine_dir  # noqa: E402,F401  (fixtures)

STARTUP_S = 240


@pytest.fixture(scope="module")
def install():
    try:
        return find_tritonserver()
    except ServerError as exc:
        pytest.skip(f"no Triton server here: {exc}")


@pytest.fixture(scope="module")
def clover2_engine_path(tmp_path_factory):
    """Where test_clover2_engine_serves_greedy_output builds its engine before it loads model ``clover2``
    (explicit model control: the other tests never pay for it)."""
    return tmp_path_factory.mktemp("clover2") / "engine"


@pytest.fixture(scope="module")
def multi_layer_engine_path(tmp_path_factory):
    """Where test_multi_layer_heads_engine_serves_greedy_output builds the engine model ``clover_multilayer`` loads."""
    return tmp_path_factory.mktemp("multi-layer") / "engine"


@pytest.fixture(scope="module")
def q4_engine_path(tmp_path_factory):
    """Where test_a_quantized_engine_serves_its_greedy_output builds its engine before it loads ``clover_q4``."""
    return tmp_path_factory.mktemp("q4") / "engine"


@pytest.fixture(scope="module")
def server(install, tiny_engine_dir, clover2_engine_path, q4_engine_path, multi_layer_engine_path,
           tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    repo = write_repository(root / "repo", {
        "clover": {"engine_dir": str(tiny_engine_dir), "threads": "1", "max_batch": "16"},
        "clover_bad": {"engine_dir": str(root / "no-such-engine")},
        "clover2": {"engine_dir": str(clover2_engine_path), "threads": "1", "max_batch": "4"},
        "suffix_only": {"engine_dir": str(tiny_engine_dir), "threads": "1", "max_batch": "4", "method": "suffix"},
        "clover_q4": {"engine_dir": str(q4_engine_path), "threads": "1", "max_batch": "4"},
        "clover_multilayer": {"engine_dir": str(multi_layer_engine_path), "threads": "1", "max_batch": "4"},
    })
    server = TritonServer(repo, 0, 0, 0, host="127.0.0.1", log_file=root / "tritonserver.log", install=install,
                          extra_args=("--model-control-mode=explicit", "--load-model=clover"))
    try:
        server.start()
        server.wait_ready(STARTUP_S)
        yield server
    finally:
        server.stop(timeout_s=60)  # SIGINT, then SIGKILL by PID


def scrape(server) -> list[tuple[str, dict, float]]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric(samples, name: str, **labels) -> float:
    return sum(v for n, l, v in samples if n == name and all(l.get(k) == w for k, w in labels.items()))


def wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_http_generate(server, reference):
    result = HttpClient(server.http_url).generate(PROMPTS[0], 24)
    expected = reference(PROMPTS[0], 24)
    assert result.text == expected.text and result.token_ids == expected.token_ids
    assert result.finish_reason == expected.finish_reason
    # every decode step emits its accepted draft tokens and one more (the last step may be cut at max tokens);
    # accepted suffix candidates (docs/trees.md#model-free-candidates) can only save steps against vanilla
    steps, accepted = result.perf["num_decode_steps"], result.perf["total_accepted_draft_tokens"]
    assert steps <= len(result.token_ids) - 1 <= steps + accepted and steps <= expected.stats.num_steps
    assert 0 <= result.perf["total_accepted_draft_tokens"] <= result.perf["total_draft_tokens"]
    assert 0.0 <= result.perf["acceptance_rate"] <= 1.0


def test_http_generate_stream(server, reference):
    prompt = long_answer_prompt(reference, 30)
    chunks = list(HttpClient(server.http_url).stream(prompt, 30))
    expected = reference(prompt, 30)
    assert len(chunks) > 5  # one event per decode step
    assert "".join(c.text for c in chunks) == expected.text
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert chunks[-1].finish_reason == expected.finish_reason and all(c.finish_reason is None for c in chunks[:-1])


def test_grpc_streaming_and_single_response(server, reference):
    expected = reference(PROMPTS[8], 40)
    with GrpcClient(server.grpc_url) as client:
        streamed = collect(client.stream(PROMPTS[8], 40))
        whole = client.generate(PROMPTS[8], 40)
        by_ids = client.generate(reference.prompt_ids(PROMPTS[8]), 40)  # input_ids: the prompt as token ids
    assert streamed.chunks > 5 and whole.chunks == 1
    for result in (streamed, whole, by_ids):
        assert result.text == expected.text and result.token_ids == expected.token_ids
        assert result.finish_reason == expected.finish_reason


def test_sixteen_concurrent_requests_equal_their_solo_greedy_output(server, reference):
    lengths = [4 + 4 * i for i in range(16)]
    results: dict[int, object] = {}
    errors = []
    barrier = threading.Barrier(16)
    before = scrape(server)

    def run(i):
        try:
            with GrpcClient(server.grpc_url) as client:
                barrier.wait()
                if i % 2:
                    results[i] = collect(client.stream(PROMPTS[i], lengths[i]))
                else:
                    results[i] = client.generate(PROMPTS[i], lengths[i])
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i in range(16):
        expected = reference(PROMPTS[i], lengths[i])
        assert results[i].token_ids == expected.token_ids, PROMPTS[i]
        assert results[i].text == expected.text
    after = scrape(server)
    batch_steps = metric(after, "clover_batch_steps_total") - metric(before, "clover_batch_steps_total")
    sequence_steps = metric(after, "clover_sequence_steps_total") - metric(before, "clover_sequence_steps_total")
    assert sequence_steps / batch_steps > 2.0  # the requests shared decode steps (in-flight batching)


def _grpc_raw(server, fields):
    with GrpcClient(server.grpc_url) as client:
        return collect(client.stream_raw(fields))


def test_each_bad_input_gets_its_own_error_and_the_server_keeps_serving(server, reference):
    long_prompt, long_tokens = PROMPTS[8], 120
    expected_long = reference(long_prompt, long_tokens)
    survivor = {}

    def stream_meanwhile():
        with GrpcClient(server.grpc_url) as client:
            survivor["result"] = collect(client.stream(long_prompt, long_tokens))

    thread = threading.Thread(target=stream_meanwhile)
    thread.start()

    http = HttpClient(server.http_url)
    http_cases = [
        ({"text_input": "", "max_tokens": 5}, "the prompt is empty"),
        ({"text_input": "hi", "max_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"text_input": "hi", "max_tokens": -3}, "max_new_tokens must be >= 1, got -3"),
        ({"text_input": "hi", "max_tokens": 100000}, "larger than the engine's context"),
        ({"text_input": "x" * 400, "max_tokens": 5}, "the prompt is"),
        ({"text_input": "hi", "max_tokens": 5, "temperature": -1.0}, "temperature must be between 0 and 2"),
        ({"text_input": "hi", "max_tokens": 5, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"text_input": "hi", "max_tokens": 5, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"text_input": "hi"}, "missing required input.*max_tokens"),
        ({"max_tokens": 5}, "give exactly one of text_input .* and input_ids .*got neither"),
        ({"text_input": "hi", "max_tokens": "five"}, "Unable to parse"),  # wrong type: Triton refuses it
        ({"text_input": "hi", "max_tokens": [5, 6]}, "proper shape"),  # wrong shape
    ]
    for body, message in http_cases:
        with pytest.raises(ClientError) as info:
            http.generate_raw(body)
        assert re.search(message, str(info.value))

    text = ("text_input", (np.array([b"hi"], dtype=object), "BYTES"))
    grpc_cases = [
        ({"text_input": (np.array([b"\xff\xfe\xfd"], dtype=object), "BYTES"),
          "max_tokens": (np.array([5], np.int32), "INT32")}, "not valid UTF-8"),
        (dict([text, ("max_tokens", (np.array([5.0], np.float32), "FP32"))]), "expects 'INT32'"),
        (dict([text, ("max_tokens", (np.array([5, 6], np.int32), "INT32"))]), "unexpected shape"),
        ({"max_tokens": (np.array([5], np.int32), "INT32")}, "give exactly one of text_input"),
        (dict([text, ("input_ids", (np.array([1, 2], np.int32), "INT32")),
               ("max_tokens", (np.array([5], np.int32), "INT32"))]), "not both"),
        ({"input_ids": (np.array([1, 10**6], np.int32), "INT32"), "max_tokens": (np.array([5], np.int32), "INT32")},
         r"prompt token id 1000000 is outside the vocabulary"),
        (dict([text, ("max_tokens", (np.array([5], np.int32), "INT32")),
               ("stream", (np.array([1], np.int32), "INT32"))]), "expects 'BOOL'"),
    ]
    for fields, message in grpc_cases:
        with pytest.raises(ClientError) as info:
            _grpc_raw(server, fields)
        assert re.search(message, str(info.value))

    thread.join(120)
    result = survivor["result"]
    assert result.token_ids == expected_long.token_ids and result.text == expected_long.text
    after = HttpClient(server.http_url).generate(PROMPTS[1], 10)
    assert after.token_ids == reference(PROMPTS[1], 10).token_ids
    assert metric(scrape(server), "clover_requests_total", reason="rejected") >= 11


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cancellation_mid_stream(server, reference, protocol):
    end_id = reference.unused_token("a", 250)
    before = scrape(server)
    received = 0
    client = GrpcClient(server.grpc_url) if protocol == "grpc" else HttpClient(server.http_url)
    for chunk in client.stream("a", 250, end_id=end_id):
        received += len(chunk.token_ids)
        if received >= 5:
            break  # leaving the loop cancels the request: gRPC stop_stream(cancel_requests=True), HTTP disconnect
    if protocol == "grpc":
        client.close()

    def cancelled():
        return metric(scrape(server), "clover_requests_total", reason="cancelled") > \
            metric(before, "clover_requests_total", reason="cancelled")

    wait_until(cancelled)
    after = scrape(server)
    assert metric(after, "clover_active_batch_size") == 0
    generated = metric(after, "clover_output_tokens_total") - metric(before, "clover_output_tokens_total")
    assert generated < 250  # it really stopped early
    again = HttpClient(server.http_url).generate(PROMPTS[5], 8)
    assert again.token_ids == reference(PROMPTS[5], 8).token_ids


def test_metrics_endpoint_has_clover_and_triton_metrics(server):
    HttpClient(server.http_url).generate(PROMPTS[3], 12)
    samples = scrape(server)
    labels = {"model": "clover", "version": "1"}
    for name in ("clover_acceptance_rate", "clover_tokens_per_step", "clover_active_batch_size",
                 "clover_pending_requests", "clover_output_tokens_total", "clover_batch_steps_total",
                 "clover_draft_tokens_total", "clover_accepted_draft_tokens_total"):
        assert any(n == name and l == labels for n, l, _ in samples), name
    assert 0.0 <= metric(samples, "clover_acceptance_rate") <= 1.0
    assert metric(samples, "clover_tokens_per_step") >= 1.0
    assert metric(samples, "clover_draft_tokens_total") > 0
    assert metric(samples, "nv_inference_request_success", model="clover") > 0  # Triton's own


def test_bad_engine_dir_fails_the_model_load_with_a_clear_message(server, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="no-such-engine does not exist"):
            client.load_model("clover_bad", headers=server.grpc_admin_headers)  # an admin API: needs the key
        assert not client.is_model_ready("clover_bad") and client.is_model_ready("clover")
    finally:
        client.close()
    assert "build it with clover build" in server.log_tail(20000)


def test_clover2_engine_serves_greedy_output(server, reference, tiny_engine_dir, clover2_engine_path):
    """A Clover-2 engine (engine contract v2: draft_prefill and the drafter's own KV cache) on the same target,
    served by the same model code: concurrent streams and single responses equal the greedy reference."""
    from tests.conftest import make_drafter

    _build_heads_engine(tiny_engine_dir, clover2_engine_path,
                        lambda target: make_drafter(target, method="clover2"), max_batch=4)
    _serves_greedy_output(server, reference, "clover2")
    assert "with clover2 decoding" in server.log_tail(20000)


def test_multi_layer_heads_engine_serves_greedy_output(server, reference, tiny_engine_dir, multi_layer_engine_path):
    """Heads whose Augmenting Block reads two layers' inputs (docs/drafter.md#multi-layer-features), random and
    so useless: served answers equal the greedy reference."""
    from tests.test_feature_layers import multi_layer_drafter

    _build_heads_engine(tiny_engine_dir, multi_layer_engine_path, lambda target: multi_layer_drafter(target, (0, 1)),
                        max_batch=4)
    _serves_greedy_output(server, reference, "clover_multilayer")


def _build_heads_engine(tiny_engine_dir, engine_path, make_heads, max_batch: int) -> None:
    """Build an engine of heads ``make_heads(target)`` over the tiny engine's own checkpoint into ``engine_path``."""
    from clover.drafters import save_drafter
    from clover.export.builder import build_engine
    from clover.target import load_target

    checkpoint = tiny_engine_dir.parent / "checkpoint"  # serving_support.build_tiny_engine's layout
    heads = engine_path.parent / "heads"
    save_drafter(make_heads(load_target(checkpoint)), heads)
    build_engine(engine_path, str(checkpoint), str(heads), max_seq=256, max_batch=max_batch,
                 progress=lambda message: None)


def _serves_greedy_output(server, reference, model: str) -> None:
    """Load ``model``; concurrent streams and single responses equal the greedy reference, and it speculated."""
    import tritonclient.grpc as grpcclient

    admin = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        admin.load_model(model, headers=server.grpc_admin_headers)
        cases = [(PROMPTS[2], 30), (PROMPTS[1], 12), (PROMPTS[8], 40)]
        results: dict[int, object] = {}

        def run(i):
            with GrpcClient(server.grpc_url, model=model) as client:
                prompt, length = cases[i]
                results[i] = collect(client.stream(prompt, length)) if i % 2 == 0 else client.generate(prompt, length)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, (prompt, length) in enumerate(cases):
            expected = reference(prompt, length)
            assert results[i].token_ids == expected.token_ids and results[i].text == expected.text, prompt
            assert results[i].finish_reason == expected.finish_reason
        assert sum(r.perf["total_draft_tokens"] for r in results.values()) > 0  # it did speculate
    finally:
        admin.unload_model(model, headers=server.grpc_admin_headers)
        admin.close()


def test_suffix_method_serves_greedy_output(server, reference):
    """Model parameter method=suffix: the suffix proposer alone (docs/trees.md#model-free-candidates); the model
    "clover" of the other tests merges its candidates into the heads' trees (proposer auto)."""
    import tritonclient.grpc as grpcclient

    admin = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        admin.load_model("suffix_only", headers=server.grpc_admin_headers)
        prompt = PROMPTS[3] + " " + PROMPTS[3]  # repeated text: the index has candidates from the first step
        with GrpcClient(server.grpc_url, model="suffix_only") as client:
            streamed, single = collect(client.stream(prompt, 40)), client.generate(PROMPTS[5], 24)
        for result, (text, length) in ((streamed, (prompt, 40)), (single, (PROMPTS[5], 24))):
            expected = reference(text, length)
            assert result.token_ids == expected.token_ids and result.text == expected.text
    finally:
        admin.unload_model("suffix_only", headers=server.grpc_admin_headers)
        admin.close()
    assert "with suffix decoding" in server.log_tail(20000)


def test_a_quantized_engine_serves_its_greedy_output(server, tiny_engine_dir, q4_engine_path):
    """A 4-bit engine (--target-weights q4, fp32 compute) of the same tiny target, served by the same model code:
    a stream and a single response equal transformers greedy over its weights as stored (dequantised), and the
    same engine's vanilla decoding (docs/quantized-target.md)."""
    import tritonclient.grpc as grpcclient

    from clover.export.builder import build_engine
    from clover.export.target_weights import quantize_target
    from clover.target import load_target
    from tests.helpers import dequantised_target
    from tests.serving_support import Reference

    checkpoint = tiny_engine_dir.parent / "checkpoint"  # serving_support.build_tiny_engine's layout
    engine_dir = q4_engine_path
    build_engine(engine_dir, str(checkpoint), None, max_seq=256, max_batch=4, target_weights="q4",
                 target_compute="fp32", progress=lambda message: None)
    stored = quantize_target(load_target(checkpoint), "q4")  # what the build stored (deterministic)
    reference = Reference(engine_dir, dequantised_target(checkpoint, stored))
    admin = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        admin.load_model("clover_q4", headers=server.grpc_admin_headers)
        with GrpcClient(server.grpc_url, model="clover_q4") as client:
            for i, (prompt, length) in enumerate([(PROMPTS[0], 24), (PROMPTS[4], 16)]):
                got = collect(client.stream(prompt, length)) if i == 0 else client.generate(prompt, length)
                expected = reference(prompt, length)
                assert got.token_ids == expected.token_ids and got.text == expected.text, prompt
    finally:
        admin.unload_model("clover_q4", headers=server.grpc_admin_headers)
        admin.close()


def test_load_generator_reports_percentiles(server):
    report = run_load(lambda: GrpcClient(server.grpc_url), PROMPTS[:4], concurrency=4, num_requests=8, max_tokens=16)
    assert report["requests"] == 8 and report["errors"] == 0
    assert report["output_tokens_per_second"] > 0
    for key in ("time_to_first_token", "inter_token_latency"):
        p = report[key]
        assert 0 < p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"]


def test_clover_client_command(server, reference, tmp_path, capsys):
    from clover.cli import main

    expected = reference(PROMPTS[0], 16)
    assert main(["client", "--url", server.grpc_url, "--prompt", PROMPTS[0], "--max-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected.text + "\n" and "tok/s" in captured.err and "acceptance rate" in captured.err
    assert main(["client", "--protocol", "http", "--url", server.http_url, "--no-stream", "--prompt", PROMPTS[0],
                 "--max-tokens", "16"]) == 0
    assert capsys.readouterr().out == expected.text + "\n"
    report = tmp_path / "load.json"
    assert main(["client", "--url", server.grpc_url, "--concurrency", "2", "--requests", "4", "--max-tokens", "8",
                 "--json", str(report)]) == 0
    assert "time to first token: p50" in capsys.readouterr().out
    assert json.loads(report.read_text())["requests"] == 4
    assert main(["client", "--url", server.grpc_url, "--prompt", "x", "--max-tokens", "100000"]) == 1
    assert "larger than the engine's context" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_clover_serve_prints_endpoints_and_ctrl_c_shuts_down_cleanly(install, tiny_engine_dir, reference, tmp_path):
    ports = free_ports(3)
    shm_before = shm_regions()
    cmd = [sys.executable, "-m", "clover.cli", "serve", "--engine", str(tiny_engine_dir), "--host", "127.0.0.1",
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--threads", "1", "--startup-timeout", str(STARTUP_S)]
    # the default server log goes to the temp directory: the test's own, so the suite leaves nothing in /tmp
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
    reader.start()
    triton_pid = None
    try:
        wait_until(lambda: any("ready (pid" in line for line in lines) or proc.poll() is not None, STARTUP_S)
        output = "".join(lines)
        assert proc.poll() is None, output
        triton_pid = int(re.search(r"ready \(pid (\d+)\)", output).group(1))
        stubs = _children(triton_pid)
        assert stubs, "the Python backend stub should be running"
        assert f"http://127.0.0.1:{ports[0]}" in output and f"127.0.0.1:{ports[1]}" in output
        assert f"http://127.0.0.1:{ports[2]}/metrics" in output

        end_id = reference.unused_token("a", 250)
        stream_state = {"chunks": 0}

        def stream():
            try:
                with GrpcClient(f"127.0.0.1:{ports[1]}") as client:
                    for _ in client.stream("a", 250, end_id=end_id):
                        stream_state["chunks"] += 1
            except Exception as exc:  # the server going away mid-stream is expected
                stream_state["error"] = exc

        thread = threading.Thread(target=stream)
        thread.start()
        wait_until(lambda: stream_state["chunks"] >= 2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C, forwarded to tritonserver
        assert proc.wait(90) == 0
        thread.join(30)
        reader.join(5)
        output = "".join(lines)
        assert "stopped (exit code 0)" in output, output
        log = Path(re.search(r"server log: (\S+)", output).group(1))
        # the log clover serve named itself goes with a clean exit (a failure keeps it: test_serving_faults.py)
        assert log.parent == tmp_path and not log.exists() and "the server log is kept" not in output, output
        assert not _alive(triton_pid) and not any(_alive(p) for p in stubs)
        assert not (shm_regions() - shm_before), "shared-memory regions left in /dev/shm"
    finally:
        for pid in (proc.pid, triton_pid):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(10)


@pytest.mark.slow
def test_demo_end_to_end(install, tmp_path_factory):
    """The whole demo path on the real SmolLM2 engine: build (if needed), serve, stream, compare with vanilla."""
    import io

    from clover.serving.launch import DEMO_PROMPTS, run_demo

    built = Path(__file__).resolve().parent.parent / "engines" / "demo"
    engine = built if (built / "engine.json").exists() else tmp_path_factory.mktemp("demo") / "engine"
    out = io.StringIO()
    code = run_demo(engine, prompts=DEMO_PROMPTS[:2], max_tokens=32, startup_timeout_s=STARTUP_S, out=out)
    text = out.getvalue()
    assert code == 0, text
    assert text.count("same text: yes") == 3, text  # each prompt, and both together
    assert "acceptance rate" in text and "tok/s" in text and "tokens/step" in text
    assert re.search(r"2 prompts through Triton .*\| x\d+\.\d\d \| same text: yes$", text, re.MULTILINE), text
    assert "python -m clover.bench" in text  # where real numbers come from
