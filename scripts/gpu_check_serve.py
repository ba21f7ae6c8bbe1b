"""The GPU check's serving step (docs/gpu-engine.md#serving): Clover's Triton model on the torch backend, which on a
GPU is the device engine, here in fp32 so that answers are exact.

A tiny random checkpoint (untrained Clover heads) is served through the tritonserver of the nvidia-pytriton wheel;
8 requests run concurrently, half of them streamed; each must equal the same prompt's solo answer from the same
server and transformers ``generate()`` on the CPU. In a dry run the same runs on the CPU (the torch reference
engine). Skipped, with the reason, where no tritonserver is found.
"""

from __future__ import annotations

import threading
import time

from scripts import gpu_check_report as report
from scripts.gpu_check_common import Skip

CONCURRENT = 8
NEW_TOKENS = 24
PROMPTS = ["hello there", "write a poem about the sea", "1 2 3 4", "What is 2+2?", "The quick brown fox",
           "tell me a story about a dragon", "speculative decoding", "in-flight batching"]
STARTUP_S = 600
# Triton's Python backend declares a stub dead when its health thread (every 300 ms) has not reported within about
# 2 s while the model loads, a window no option changes; on a starved CPU that happened once (issue 62), so a server
# that failed that way is started once more, and the report says so.
UNHEALTHY_STUB = "is not healthy"


def _serve_tiny_checkpoint(root, install) -> tuple:
    """A started TritonServer on a tiny random checkpoint (backend torch, fp32), the checkpoint's path, and the
    errors of failed starts (a stub that missed its health window: started again once)."""
    from clover.serving.repository import write_repository
    from clover.serving.server import ServerError
    from tests.conftest import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(root / "checkpoint")
    repo = write_repository(root / "repo", {"clover": {"engine_dir": str(checkpoint), "backend": "torch",
                                                       "dtype": "fp32", "max_batch": str(CONCURRENT)}})
    try:
        return _started_server(repo, root, install), checkpoint, []
    except ServerError as exc:
        if UNHEALTHY_STUB not in str(exc):
            raise
        return _started_server(repo, root, install), checkpoint, [next(line for line in str(exc).splitlines() if UNHEALTHY_STUB in line)[:300]]


def _started_server(repo, root, install):
    from clover.serving.server import TritonServer

    server = TritonServer(repo, 0, 0, 0, host="127.0.0.1", log_file=root / "tritonserver.log", install=install)
    server.start()
    try:
        server.wait_ready(STARTUP_S)
    except Exception:
        server.stop(timeout_s=60)
        raise
    return server


def _concurrent(url: str) -> tuple[dict, list[str]]:
    """Every prompt at once (odd ones streamed): {index: token ids}, errors. Triton's HTTP generate endpoints
    (clover.client.HttpClient, standard library only: a GPU machine without tritonclient can run it)."""
    from clover.client import HttpClient

    results, errors, barrier = {}, [], threading.Barrier(CONCURRENT)

    def run(i: int) -> None:
        try:
            client = HttpClient(url)
            barrier.wait()
            if i % 2:
                results[i] = [t for chunk in client.stream(PROMPTS[i], NEW_TOKENS) for t in chunk.token_ids]
            else:
                results[i] = client.generate(PROMPTS[i], NEW_TOKENS).token_ids
        except Exception as exc:  # reported in the step's result
            errors.append(f"request {i}: {exc!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CONCURRENT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results, errors


def _rows(server, checkpoint, concurrent: dict) -> list[list]:
    """[prompt, concurrent == solo, solo == generate(), tokens] per prompt."""
    from clover.client import HttpClient
    from clover.prompts import encode_prompt
    from clover.target import load_tokenizer
    from tests.helpers import hf_greedy

    tokenizer = load_tokenizer(checkpoint)
    client, rows = HttpClient(server.http_url), []
    for i, prompt in enumerate(PROMPTS):
        solo = client.generate(prompt, NEW_TOKENS).token_ids
        expected = hf_greedy(checkpoint, [encode_prompt(tokenizer, prompt, True)], NEW_TOKENS,
                             stop_token_ids=(tokenizer.eos_token_id,))[0]
        rows.append([prompt, concurrent.get(i) == solo, solo == expected, len(solo)])
    return rows


def gpu_serve(ctx) -> dict:
    from clover.serving.server import ServerError, find_tritonserver

    try:
        install = find_tritonserver()
    except ServerError as exc:
        raise Skip(f"no tritonserver here ({exc}); stage the nvidia-pytriton wheel "
                   "(docs/gpu-engine.md#serving)") from None
    root = ctx.out / "serve"
    started = time.monotonic()
    server, checkpoint, failed_starts = _serve_tiny_checkpoint(root, install)
    load_s = time.monotonic() - started
    try:
        concurrent, errors = _concurrent(server.http_url)
        rows = _rows(server, checkpoint, concurrent)
    finally:
        server.stop(timeout_s=60)
    where = "the device engine on the GPU" if ctx.device.type == "cuda" else "the torch reference on the CPU"
    tables = [report.table(f"{CONCURRENT} concurrent requests (odd ones streamed) through tritonserver, torch backend "
                           f"in fp32 ({where}); {NEW_TOKENS} new tokens",
                           ["prompt", "concurrent == solo", "solo == generate()", "tokens"], rows)]
    data = {"rows": rows, "errors": errors, "server_ready_s": round(load_s, 1), "tritonserver": str(install.binary),
            "failed_starts": failed_starts}
    failed = errors + [f"{r[0]!r}: {'concurrent differs from solo' if not r[1] else 'differs from generate()'}"
                       for r in rows if not (r[1] and r[2])]
    if failed:
        return report.outcome("fail", "; ".join(failed)[:2000], data=data, tables=tables)
    restarted = f" (the server was started {1 + len(failed_starts)} times: {failed_starts})" if failed_starts else ""
    return report.outcome("pass", f"{CONCURRENT} concurrent answers equal their solo answers and generate()"
                          + restarted, data=data, tables=tables)
