"""The logic of the Triton Python-backend model (``triton_repo/clover/1/model.py`` forwards here).

The ``pb_utils`` module (``triton_python_backend_utils``, only importable inside
Triton's Python stub) is passed in, so this module imports without Triton and
the unit tests drive it with a stand-in.

Decoupled mode: :meth:`CloverTritonModel.execute` validates each request,
hands it to the :class:`~clover.serving.batcher.InflightBatcher` and returns at
once; the decode thread sends the responses. A bad request gets an error
response of its own; the other requests and the server carry on. Errors carry
Triton codes: a bad request INVALID_ARG (HTTP 400), a server that is shutting
down UNAVAILABLE (503), anything else INTERNAL (500).

Shutdown: when ``clover.serving.server.TritonServer`` writes the drain file
(``$CLOVER_DRAIN_FILE``), :class:`_DrainWatch` starts the batcher's drain
(docs/serving.md#shutdown-faults-and-security).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from clover.config import ConfigError
from clover.decode import SpeculativeDecoder
from clover.serving.batcher import BatcherMetrics, InflightBatcher, ShuttingDown, Update
from clover.serving.served_engine import load_serving_engine, resolve_engine_dir
from clover.serving.warmup import warm_up_throwaway
from clover.serving.protocol import (DRAIN_FILE_ENV, RequestLimits, model_parameters, parse_request,
                                     refuse_unknown_parameters, response_tensors)

log = logging.getLogger(__name__)


def _int_param(params: dict, name: str, default: int | None) -> int | None:
    value = params.get(name, "")
    if value in ("", None):
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"model parameter {name}={value!r} is not an integer") from None


def _step_token_cap(params: dict) -> int | None:
    """The decoder's ``max_step_tokens`` from the model parameter of that name (0: no cap, None)."""
    value = _int_param(params, "max_step_tokens", 0)
    if value < 0:
        raise ConfigError(f"model parameter max_step_tokens must be >= 0 (0: no cap), got {value}")
    return value or None


def _describe_cap(max_step_tokens: int | None) -> str:
    return f"{max_step_tokens} tokens a step at most" if max_step_tokens else "no cap on a step's tokens"


def _auto_bool_param(params: dict, name: str) -> bool | None:
    """A boolean parameter where ``auto`` (or empty) means None: the library default decides."""
    if str(params.get(name, "")).strip().lower() in ("", "auto"):
        return None
    return _bool_param(params, name)


def _bool_param(params: dict, name: str) -> bool:
    value = str(params.get(name, "")).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"model parameter {name}={value!r} is not a boolean")


class CloverTritonModel:
    """What ``TritonPythonModel`` does, given the ``pb_utils`` module and Triton's ``initialize`` args."""

    def __init__(self, pb_utils, args: dict) -> None:
        self.pb = pb_utils
        config = json.loads(args["model_config"])
        self.name = args.get("model_name", "clover")
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ConfigError(f"model {self.name}: config.pbtxt must set model_transaction_policy {{ decoupled: true }}")
        params = model_parameters(config)
        max_step_tokens = _step_token_cap(params)  # checked before the engine's load, which takes a while
        model_dir = Path(args.get("model_repository", "."))
        engine_dir = resolve_engine_dir(params["engine_dir"], model_dir.parent.parent)
        start = time.perf_counter()
        try:
            loaded = load_serving_engine(engine_dir, params["backend"] or "auto", params["method"] or "auto",
                                         _int_param(params, "max_batch", 0), _int_param(params, "tree_budget", None),
                                         _int_param(params, "threads", 0), _auto_bool_param(params, "adaptive"),
                                         params["proposer"] or "auto", params["dtype"] or "auto",
                                         _int_param(params, "tensor_parallel", 1), params["rendezvous"])
        except ConfigError as exc:
            raise ConfigError(f"model {self.name}: cannot load the engine (parameter engine_dir={engine_dir}): "
                              f"{exc}") from None
        self.loaded = loaded
        self.limits = RequestLimits(loaded.engine.spec.max_seq_len, loaded.engine.spec.vocab_size,
                                    _bool_param(params, "apply_chat_template"),
                                    _int_param(params, "max_stop_words", RequestLimits.max_stop_words),
                                    _int_param(params, "max_stop_chars", RequestLimits.max_stop_chars))
        labels = {"model": self.name, "version": str(args.get("model_version", "1"))}
        self.prometheus = _PrometheusMetrics(pb_utils, labels) if hasattr(pb_utils, "MetricFamily") else None

        made = []

        def make_decoder() -> SpeculativeDecoder:
            decoder_class = SpeculativeDecoder
            if loaded.tensor_parallel > 1:
                if made:  # a step failed: the ranks are out of step, and clover serve stops them all
                    raise RuntimeError("a tensor-parallel step failed; the ranks cannot go on")
                from clover.lockstep import LockstepDecoder as decoder_class
            made.append(True)
            return decoder_class(loaded.engine, loaded.method, loaded.tree, loaded.tokenizer,
                                 max_batch_size=loaded.max_batch, max_step_tokens=max_step_tokens)

        # before Triton reports the model ready: readiness means ready at speed (docs/serving.md#warm-up); not with
        # tensor-parallel ranks, which follow the one decoder rank 0 steps (a throwaway one would leave them behind)
        warm = _bool_param(params, "warm_up") and loaded.tensor_parallel == 1
        self.warm_up = warm_up_throwaway(make_decoder, loaded.tokenizer) if warm else None
        on_step = self.prometheus.update if self.prometheus is not None else None
        self.batcher = InflightBatcher(make_decoder, on_step=on_step)
        self.drain_watch = _DrainWatch(os.environ.get(DRAIN_FILE_ENV), self.batcher.begin_drain)
        warmed = (f"; {self.warm_up.describe()}" if self.warm_up is not None else
                  "; no warm-up (tensor parallel)" if loaded.tensor_parallel > 1 else "; no warm-up (warm_up=false)")
        self._log(f"clover: {self.name} serves {loaded.description} with {loaded.method} decoding, "
                  f"in-flight batch up to {loaded.max_batch}, {_describe_cap(max_step_tokens)}, "
                  f"context {self.limits.max_seq_len} tokens "
                  f"(loaded in {time.perf_counter() - start:.1f} s{warmed})")

    def _log(self, message: str) -> None:
        logger = getattr(self.pb, "Logger", None)
        if logger is not None:
            logger.log_info(message)
        else:
            print(message, flush=True)

    def execute(self, requests) -> None:
        for request in requests:
            self._start(request)
        return None

    def _start(self, request) -> None:
        sender = request.get_response_sender()

        def get(name):
            tensor = self.pb.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        try:
            parameters = getattr(request, "parameters", None)
            refuse_unknown_parameters(parameters() if callable(parameters) else None)
            parsed = parse_request(get, self.loaded.tokenizer, self.limits, request_id=request.request_id())
            responder = _Responder(self.pb, sender, parsed.stream, parsed.return_perf_metrics)
            is_cancelled = getattr(sender, "is_cancelled", None) or getattr(request, "is_cancelled", None)
            # parse_request ran the request check: the batcher and the decoder do not repeat it
            self.batcher.submit(parsed.generation, responder, is_cancelled, validated=True)
        except Exception as exc:  # RequestError / ValueError: bad input; anything else: still this request only
            if self.prometheus is not None:
                self.prometheus.rejected()
            if isinstance(exc, ValueError):
                error = _error(self.pb, str(exc), "INVALID_ARG")
            elif isinstance(exc, ShuttingDown):
                error = _error(self.pb, str(exc), "UNAVAILABLE")
            else:
                log.exception("clover: request failed")
                error = _error(self.pb, f"internal error: {type(exc).__name__}: {exc}", "INTERNAL")
            sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        self.drain_watch.stop()
        self.batcher.shutdown()
        if self.loaded.tensor_parallel > 1:
            from clover.lockstep import leave

            leave()  # the other ranks stop with it (docs/serving.md#tensor-parallel)


def _error(pb, message: str, code: str):
    """A TritonError with Triton's error code ``code`` (HTTP: INVALID_ARG 400, UNAVAILABLE 503, INTERNAL 500)."""
    value = getattr(getattr(pb, "TritonError", None), code, None)
    return pb.TritonError(message) if value is None else pb.TritonError(message, value)


class _DrainWatch:
    """Polls for the drain file ``clover serve`` writes before it stops tritonserver, then starts the
    batcher's drain with the seconds written in it. Triton tells a Python model nothing before its exit
    timeout has passed, too late to end long requests cleanly (docs/serving.md#shutdown-faults-and-security)."""

    POLL_S = 0.1

    def __init__(self, path: str | None, begin_drain) -> None:
        self.path, self.begin_drain = path, begin_drain
        self._stopped = threading.Event()
        if path:
            threading.Thread(target=self._run, name="clover-drain-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stopped.wait(self.POLL_S):
            try:
                text = Path(self.path).read_text()
            except OSError:
                continue
            try:
                seconds = float(text.strip())
            except ValueError:
                seconds = 0.0
            self.begin_drain(seconds)
            return

    def stop(self) -> None:
        self._stopped.set()


class _Responder:
    """Turns :class:`Update` objects into Triton responses: one per step when streaming, else one at the end."""

    def __init__(self, pb, sender, stream: bool, perf: bool) -> None:
        self.pb, self.sender, self.stream, self.perf = pb, sender, stream, perf
        self.text: list[str] = []
        self.token_ids: list[int] = []

    def __call__(self, update: Update) -> None:
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if update.error is not None:  # finish reason cancelled with an error: the server stopped under it
            code = "UNAVAILABLE" if update.finish_reason == "cancelled" else "INTERNAL"
            self.sender.send(self.pb.InferenceResponse(error=_error(self.pb, update.error, code)), flags=final)
            return
        if self.stream:
            text, ids = update.text, update.token_ids
        else:
            self.text.append(update.text)
            self.token_ids.extend(update.token_ids)
            if not update.finished:
                return
            text, ids = "".join(self.text), self.token_ids
        tensors = response_tensors(text, ids, update.finish_reason if update.finished else None, update.stats,
                                   self.perf)
        response = self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(k, v) for k, v in tensors.items()])
        self.sender.send(response, flags=final if update.finished else 0)


class _PrometheusMetrics:
    """Custom metrics beside Triton's own (``/metrics``), labelled with the model and version."""

    def __init__(self, pb, labels: dict) -> None:
        family = pb.MetricFamily
        self.labels = labels

        def make(name, description, kind):
            return family(name=name, description=description, kind=kind)

        self._requests = make("clover_requests_total",
                              "Clover requests finished, by reason: stop, length, cancelled, error, rejected",
                              family.COUNTER)
        self._request_metrics = {}
        counters = {
            "output_tokens": ("clover_output_tokens_total", "Tokens generated"),
            "batch_steps": ("clover_batch_steps_total", "Decode steps of the in-flight batch (target passes)"),
            "sequence_steps": ("clover_sequence_steps_total", "Decode steps summed over the sequences in the batch"),
            "accepted_draft_tokens": ("clover_accepted_draft_tokens_total", "Draft tokens the target accepted"),
            "draft_tokens": ("clover_draft_tokens_total", "Draft tokens proposed (tree nodes)"),
        }
        gauges = {
            "acceptance_rate": ("clover_acceptance_rate", "Accepted draft tokens / draft tokens, since start"),
            "tokens_per_step": ("clover_tokens_per_step", "Tokens per sequence per decode step, since start"),
            "active_batch_size": ("clover_active_batch_size", "Sequences in the in-flight batch now"),
            "pending_requests": ("clover_pending_requests", "Requests waiting for a batch slot now"),
        }
        self._families = [self._requests]
        self._counters, self._gauges = {}, {}
        for key, (name, description) in counters.items():
            fam = make(name, description, family.COUNTER)
            self._families.append(fam)
            self._counters[key] = fam.Metric(labels=labels)
        for key, (name, description) in gauges.items():
            fam = make(name, description, family.GAUGE)
            self._families.append(fam)
            self._gauges[key] = fam.Metric(labels=labels)
        self._last = BatcherMetrics()
        self._rejected = 0

    def _request_metric(self, reason: str):
        if reason not in self._request_metrics:
            self._request_metrics[reason] = self._requests.Metric(labels={**self.labels, "reason": reason})
        return self._request_metrics[reason]

    def rejected(self) -> None:
        self._request_metric("rejected").increment(1)

    def update(self, metrics: BatcherMetrics) -> None:
        last = self._last
        for key, metric in self._counters.items():
            delta = getattr(metrics, key) - getattr(last, key)
            if delta:
                metric.increment(delta)
        for reason, count in metrics.requests_finished.items():
            delta = count - last.requests_finished.get(reason, 0)
            if delta:
                self._request_metric(reason).increment(delta)
        for key, metric in self._gauges.items():
            metric.set(float(getattr(metrics, key)))
        self._last = metrics
