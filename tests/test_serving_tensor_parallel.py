"""``clover serve --backend torch --tensor-parallel 2`` through tritonserver (docs/serving.md#tensor-parallel):
8 concurrent streams equal each prompt alone; a dead rank stops the server (exit 1) within 10 s; Ctrl-C stops
every rank. No process or /dev/shm region is left behind. Skipped where tritonserver or tritonclient is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed: pip install -e '.[serve]'")

from clover.client import GrpcClient, collect  # noqa: E402
from clover.serving.server import ServerError, find_tritonserver, free_ports, shm_regions  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["hello there", "abc abc abc abc", "x", "The quick brown fox", "1 2 3 4 1 2 3 4", "tensor", "zz", "Ok."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    try:
        find_tritonserver()
    except ServerError as exc:
        pytest.skip(f"no Triton server here: {exc}")
    path = tmp_path_factory.mktemp("tiny3kv")
    write_tiny_checkpoint(path, num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=96)
    return path


def _command_lines() -> dict[int, list[bytes]]:
    lines = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
    return lines


def _ranks_of(port: int) -> list[int]:
    """Pids of the follower ranks meeting at ``port``."""
    return [pid for pid, line in _command_lines().items()
            if b"clover.lockstep" in line and str(port).encode() in line]


def _left_regions(before: set[str]) -> set[str]:
    """New /dev/shm regions no live stub names: ours, left behind (another server's may come and go meanwhile)."""
    held = {arg.decode(errors="replace") for line in _command_lines().values() for arg in line}
    return shm_regions() - before - held


def _serve(checkpoint: Path, tmp_path: Path):
    http, grpc, metrics, master = free_ports(4)
    proc = subprocess.Popen([sys.executable, "-m", "clover.cli", "serve", "--engine", str(checkpoint), "--backend",
                             "torch", "--tensor-parallel", "2", "--master-port", str(master), "--http-port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--drain-timeout", "2",
                             "--log-file", str(tmp_path / "serve.log")], cwd=REPO)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2).status == 200:
                return proc, grpc, master
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail("clover serve --tensor-parallel 2 did not become ready")


def _answer(port: int, prompt: str) -> list[int]:
    client = GrpcClient(f"127.0.0.1:{port}", "clover")
    try:
        return collect(client.stream(prompt, 24, chat_template=False)).token_ids
    finally:
        client.close()


def test_eight_streams_equal_solo_and_ctrl_c_stops_every_rank(checkpoint, tmp_path):
    regions = shm_regions()
    proc, grpc, master = _serve(checkpoint, tmp_path)
    try:
        assert len(_ranks_of(master)) == 1
        solo = [_answer(grpc, p) for p in PROMPTS]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: _answer(grpc, p), PROMPTS))
        assert together == solo
        assert all(len(tokens) == 24 for tokens in solo)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    time.sleep(0.5)
    assert _ranks_of(master) == []
    assert not _left_regions(regions)


def test_a_dead_rank_stops_the_server_within_10_s(checkpoint, tmp_path):
    regions = shm_regions()
    proc, grpc, master = _serve(checkpoint, tmp_path)
    try:
        (follower,) = _ranks_of(master)
        os.kill(follower, signal.SIGKILL)
        start = time.monotonic()
        assert proc.wait(10) == 1
        assert time.monotonic() - start < 10
    finally:
        proc.kill()
    time.sleep(0.5)
    assert _ranks_of(master) == []
    assert not _left_regions(regions)
