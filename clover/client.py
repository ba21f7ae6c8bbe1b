"""Clients for the Clover Triton model (``triton_repo/clover``), and a load generator.

- :class:`GrpcClient`: tritonclient's gRPC streaming API (``stream_infer``); the
  decoupled model answers with one response per decode step (``stream``) or one
  at the end.
- :class:`HttpClient`: Triton's HTTP ``generate`` and ``generate_stream``
  (server-sent events) endpoints. tritonclient has no API for Triton's
  generate extension, so the POSTs use the standard library; readiness checks
  use ``tritonclient.http``.
- :func:`run_load`: N concurrent streams; throughput, time to first token and
  inter-token latency percentiles.

This module needs only numpy, tritonclient (imported lazily) and :mod:`clover.stats`
(plain Python), not torch or the rest of Clover, so it works on a client machine
with ``pip install --no-deps`` of this package.
"""

from __future__ import annotations

import dataclasses
import http.client
import itertools
import json
import queue
import threading
import time
import uuid
from typing import Callable, Iterator, Sequence

import numpy as np

from clover.stats import tokens_per_step

DEFAULT_MODEL = "clover"


class ClientError(RuntimeError):
    """The server refused or failed a request (the message is the server's)."""


@dataclasses.dataclass
class Chunk:
    """One response: new text and token ids (the whole answer when not streaming)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    perf: dict | None = None  # acceptance_rate, total_accepted_draft_tokens, total_draft_tokens, num_decode_steps
    time: float = 0.0  # time.perf_counter() when it arrived


@dataclasses.dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    perf: dict | None
    seconds: float
    first_token_seconds: float | None
    chunks: int
    last_token_seconds: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """From the server's perf metrics (``num_decode_steps``); 0.0 without them."""
        return tokens_per_step(len(self.token_ids), (self.perf or {}).get("num_decode_steps") or 0)


def collect(chunks: Iterator[Chunk], start: float | None = None) -> Result:
    """Join streamed chunks into a :class:`Result`."""
    start = time.perf_counter() if start is None else start
    text, ids, reason, perf, first, last, count = [], [], None, None, None, None, 0
    for chunk in chunks:
        count += 1
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        if chunk.token_ids:
            last = chunk.time - start
            first = last if first is None else first
        reason = chunk.finish_reason or reason
        perf = chunk.perf or perf
    return Result("".join(text), ids, reason, perf, time.perf_counter() - start, first, count, last)


def request_fields(prompt: str | bytes | Sequence[int], max_tokens: int, stream: bool, *,
                   temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                   end_id: int | None = None, stop_words: Sequence[str] | None = None, seed: int | None = None,
                   perf: bool = True, chat_template: bool | None = None) -> dict:
    """The request's inputs by name (None values left out). ``prompt``: text (``text_input``) or token ids
    (``input_ids``, sent as they are: no chat template)."""
    as_ids = not isinstance(prompt, (str, bytes))
    prompt_field = {"input_ids": [int(i) for i in prompt]} if as_ids else {"text_input": prompt}
    fields = {**prompt_field, "max_tokens": max_tokens, "stream": stream, "temperature": temperature,
              "top_k": top_k, "top_p": top_p, "end_id": end_id, "stop_words": list(stop_words) if stop_words else None,
              "random_seed": seed, "return_perf_metrics": perf, "apply_chat_template": chat_template}
    return {k: v for k, v in fields.items() if v is not None}


_TYPES = {"text_input": ("BYTES", None), "input_ids": ("INT32", np.int32), "stop_words": ("BYTES", None),
          "max_tokens": ("INT32", np.int32), "top_k": ("INT32", np.int32), "end_id": ("INT32", np.int32), "temperature": ("FP32", np.float32),
          "top_p": ("FP32", np.float32), "random_seed": ("UINT64", np.uint64), "stream": ("BOOL", np.bool_),
          "return_perf_metrics": ("BOOL", np.bool_), "apply_chat_template": ("BOOL", np.bool_)}

_PERF_KEYS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_decode_steps")


def input_array(name: str, value) -> tuple[np.ndarray, str]:
    """The Triton input tensor and its datatype for one request field."""
    datatype, dtype = _TYPES[name]
    if datatype == "BYTES":
        values = value if isinstance(value, list) else [value]
        return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=object), datatype
    if isinstance(value, list):  # input_ids: one dimension of any length
        return np.asarray(value, dtype=dtype).reshape(-1), datatype
    return np.array([value], dtype=dtype), datatype


class GrpcClient:
    """tritonclient gRPC: every request goes through a bidirectional stream (decoupled model)."""

    def __init__(self, url: str = "localhost:8001", model: str = DEFAULT_MODEL) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url, self.model = url, model
        self.client = grpcclient.InferenceServerClient(url)
        self._stream_lock = threading.Lock()

    def ready(self) -> bool:
        return self.client.is_server_ready() and self.client.is_model_ready(self.model)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "GrpcClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, prompt: str | bytes | Sequence[int], max_tokens: int = 128, stream: bool = True,
               **options) -> Iterator[Chunk]:
        """Send one request; yield its responses. Leaving the loop early cancels the request on the server."""
        return self.stream_raw(request_fields(prompt, max_tokens, stream, **options))

    def stream_raw(self, fields: dict) -> Iterator[Chunk]:
        """Like :meth:`stream` with the inputs given by name (any dtype, for tests of bad input)."""
        if not self._stream_lock.acquire(blocking=False):
            raise ClientError("this GrpcClient is already streaming; use one client per concurrent stream")
        responses: queue.Queue = queue.Queue()
        finished = False
        try:
            self.client.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())))
            tensors = self._tensors(fields)
            try:
                self.client.async_stream_infer(self.model, tensors, request_id=uuid.uuid4().hex,
                                               enable_empty_final_response=True)
            except Exception as exc:  # tritonclient reports the cause (e.g. unreachable server) via the callback
                finished = True
                try:
                    _, error, _ = responses.get(timeout=5)
                except queue.Empty:
                    error = exc
                raise ClientError(f"{self.url}: {_message(error)}") from None
            while not finished:
                result, error, arrived = responses.get()
                if error is not None:
                    finished = True
                    raise ClientError(_message(error))
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                finished = bool(final and final.bool_param)
                if not response.outputs and finished:
                    break
                outputs = {name: result.as_numpy(name) for name in (o.name for o in response.outputs)}
                yield chunk_from_outputs(outputs, arrived)
        finally:
            # a consumer that stops early cancels the request; a finished stream closes quietly
            self.client.stop_stream(cancel_requests=not finished)
            self._stream_lock.release()

    def _tensors(self, fields: dict) -> list:
        tensors = []
        for name, value in fields.items():
            if isinstance(value, tuple):  # (numpy array, Triton datatype): sent as given
                array, datatype = value
            else:
                array, datatype = input_array(name, value)
            tensor = self._grpc.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    def generate(self, prompt: str | bytes | Sequence[int], max_tokens: int = 128, **options) -> Result:
        """One non-streaming request (one response with the whole answer)."""
        start = time.perf_counter()
        return collect(self.stream(prompt, max_tokens, stream=False, **options), start)


def _message(error) -> str:
    message = error.message() if callable(getattr(error, "message", None)) else None
    return str(message or error)


def chunk_from_outputs(outputs: dict, arrived: float) -> Chunk:
    """One streamed response (the model's output tensors by name) as a Chunk."""
    def scalar(name):
        value = outputs.get(name)
        if value is None:
            return None
        value = np.asarray(value).reshape(-1)
        if not value.size:
            return None
        return value[0].item() if isinstance(value[0], np.generic) else value[0]

    text = outputs.get("text_output")
    if isinstance(text, np.ndarray):
        text = b"".join(t if isinstance(t, bytes) else str(t).encode() for t in text.reshape(-1)).decode("utf-8")
    ids = outputs.get("output_ids")
    ids = [] if ids is None else [int(i) for i in np.asarray(ids).reshape(-1)]
    reason = scalar("finish_reason")
    if isinstance(reason, bytes):
        reason = reason.decode()
    perf = {k: scalar(k) for k in _PERF_KEYS if outputs.get(k) is not None} or None
    return Chunk(text or "", ids, reason, perf, arrived)


class HttpClient:
    """Triton's HTTP generate extension: ``POST /v2/models/<model>/generate`` and ``.../generate_stream``."""

    def __init__(self, url: str = "localhost:8000", model: str = DEFAULT_MODEL, timeout: float = 600.0) -> None:
        self.url, self.model, self.timeout = url.removeprefix("http://"), model, timeout

    def ready(self) -> bool:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.url)
        try:
            return client.is_server_ready() and client.is_model_ready(self.model)
        finally:
            client.close()

    def _post(self, endpoint: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        host, _, port = self.url.partition(":")
        conn = http.client.HTTPConnection(host, int(port or 80), timeout=self.timeout)
        try:
            conn.request("POST", f"/v2/models/{self.model}/{endpoint}", json.dumps(body),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
        except OSError as exc:
            conn.close()
            raise ClientError(f"cannot reach {self.url}: {exc}") from exc
        if response.status != 200:
            payload = response.read().decode(errors="replace")
            conn.close()
            try:
                message = json.loads(payload).get("error", payload)
            except json.JSONDecodeError:
                message = payload
            raise ClientError(f"HTTP {response.status}: {message}")
        return conn, response

    @staticmethod
    def _body(fields: dict) -> dict:
        return {k: (v.decode("utf-8") if isinstance(v, bytes) else v) for k, v in fields.items()}

    def generate(self, prompt: str, max_tokens: int = 128, **options) -> Result:
        start = time.perf_counter()
        return self.generate_raw(request_fields(prompt, max_tokens, False, **options), start)

    def generate_raw(self, body: dict, start: float | None = None) -> Result:
        start = time.perf_counter() if start is None else start
        conn, response = self._post("generate", self._body(body))
        try:
            data = json.loads(response.read())
        finally:
            conn.close()
        return collect(iter([chunk_from_outputs(data, time.perf_counter())]), start)

    def stream(self, prompt: str, max_tokens: int = 128, **options) -> Iterator[Chunk]:
        """Yield server-sent events as chunks. Leaving the loop early closes the connection, which cancels
        the request on the server."""
        conn, response = self._post("generate_stream", self._body(request_fields(prompt, max_tokens, True, **options)))
        try:
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    raise ClientError(data["error"])
                yield chunk_from_outputs(data, time.perf_counter())
        finally:
            conn.close()


# -- load generator -------------------------------------------------------------


def _percentiles(values: Sequence[float]) -> dict:
    if not values:
        return {}
    arr = np.asarray(values, dtype=float) * 1000.0
    return {"p50_ms": float(np.percentile(arr, 50)), "p90_ms": float(np.percentile(arr, 90)),
            "p99_ms": float(np.percentile(arr, 99)), "mean_ms": float(arr.mean())}


def run_load(make_client: Callable[[], object], prompts: Sequence[str], concurrency: int, num_requests: int,
             max_tokens: int = 128, **options) -> dict:
    """``concurrency`` streams at once until ``num_requests`` requests are done (prompts reused in turn).

    Returns throughput (output tokens/s, requests/s), time-to-first-token and
    inter-token-latency percentiles (ITL per request: (last - first token time) / (tokens - 1)),
    and the acceptance rate over all requests.
    """
    counter = itertools.count()
    lock = threading.Lock()
    results: list[Result] = []
    errors: list[str] = []

    def worker() -> None:
        client = make_client()
        try:
            while True:
                index = next(counter)
                if index >= num_requests:
                    return
                start = time.perf_counter()
                chunks = []
                try:
                    for chunk in client.stream(prompts[index % len(prompts)], max_tokens, **options):
                        chunks.append(chunk)
                    result = collect(iter(chunks), start)
                    with lock:
                        results.append(result)
                except ClientError as exc:
                    with lock:
                        errors.append(str(exc))
        finally:
            close = getattr(client, "close", None)
            if close is not None:
                close()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"clover-load-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    ttft = [r.first_token_seconds for r in results if r.first_token_seconds is not None]
    itl = [(r.last_token_seconds - r.first_token_seconds) / (len(r.token_ids) - 1)
           for r in results if r.first_token_seconds is not None and len(r.token_ids) > 1]
    accepted = sum((r.perf or {}).get("total_accepted_draft_tokens") or 0 for r in results)
    drafted = sum((r.perf or {}).get("total_draft_tokens") or 0 for r in results)
    steps = sum((r.perf or {}).get("num_decode_steps") or 0 for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(errors),
        "first_errors": errors[:3],
        "wall_seconds": wall,
        "output_tokens": tokens,
        "output_tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "requests_per_second": len(results) / wall if wall > 0 else 0.0,
        "time_to_first_token": _percentiles(ttft),
        "inter_token_latency": _percentiles(itl),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_step": tokens_per_step(tokens, steps, len(results)),
    }


def format_load_report(report: dict) -> str:
    lines = [f"{report['requests']} requests ({report['errors']} errors), {report['concurrency']} concurrent streams, "
             f"{report['wall_seconds']:.2f} s",
             f"throughput: {report['output_tokens_per_second']:.1f} output tokens/s, "
             f"{report['requests_per_second']:.2f} requests/s",
             f"acceptance rate {report['acceptance_rate']:.3f}, {report['tokens_per_step']:.2f} tokens/step"]
    for key, label in (("time_to_first_token", "time to first token"), ("inter_token_latency", "inter-token latency")):
        p = report[key]
        if p:
            lines.append(f"{label}: p50 {p['p50_ms']:.1f} ms, p90 {p['p90_ms']:.1f} ms, p99 {p['p99_ms']:.1f} ms, "
                         f"mean {p['mean_ms']:.1f} ms")
    for error in report.get("first_errors", []):
        lines.append(f"error: {error}")
    return "\n".join(lines)
