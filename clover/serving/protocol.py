"""The Triton model's interface: tensor names, request validation, ``config.pbtxt``.

Names follow tensorrtllm_backend where it has one (docs/serving.md#inputs-and-outputs). The model runs
with ``max_batch_size: 0`` (Triton does no batching of its own: the in-flight
batcher does), so every scalar input has shape ``[1]``.

Nothing here imports ``triton_python_backend_utils``: a request is read through
a ``get(name) -> numpy array | None`` callable, so the same code validates
requests in the unit tests and in the server.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Mapping

import numpy as np

from clover.config import ConfigError, SamplingConfig
from clover.decode import GenerationRequest
from clover.prompts import refuse_empty_prompt


# Set by clover.serving.server.TritonServer in tritonserver's environment (the stubs inherit it): the file it
# writes at shutdown with the drain time in seconds (docs/serving.md#shutdown-faults-and-security)
DRAIN_FILE_ENV = "CLOVER_DRAIN_FILE"


class RequestError(ValueError):
    """A bad request: reported to that client only, the server keeps serving."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output of the model; ``dtype`` is Triton's (``TYPE_`` prefix left out)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""


INPUTS = (
    TensorSpec("text_input", "STRING", (1,), True,
               "the prompt, UTF-8 (the chat template is applied by default); give exactly one of text_input and "
               "input_ids"),
    TensorSpec("input_ids", "INT32", (-1,), True,
               "the prompt as token ids; give exactly one of text_input and input_ids"),
    TensorSpec("max_tokens", "INT32", (1,), doc="new tokens at most, 1 .. the engine's context"),
    TensorSpec("stream", "BOOL", (1,), True, "true: one response per decode step with the new text"),
    TensorSpec("temperature", "FP32", (1,), True, "0 (default) is greedy; up to 2 samples"),
    TensorSpec("top_k", "INT32", (1,), True, "sample from the k most likely tokens (0: off)"),
    TensorSpec("top_p", "FP32", (1,), True, "nucleus mass in (0, 1]"),
    TensorSpec("end_id", "INT32", (1,), True, "stop token id (default: the tokenizer's EOS)"),
    TensorSpec("stop_words", "STRING", (-1,), True, "stop strings; the text ends before the first one"),
    TensorSpec("random_seed", "UINT64", (1,), True, "seed for sampling"),
    TensorSpec("return_perf_metrics", "BOOL", (1,), True, "also return the acceptance counters"),
    TensorSpec("apply_chat_template", "BOOL", (1,), True,
               "wrap text_input as one user turn (default: model parameter); not with input_ids"),
)

OUTPUTS = (
    TensorSpec("text_output", "STRING", (-1,), doc="streaming: the new text of this step; else the whole answer"),
    TensorSpec("output_ids", "INT32", (-1,), doc="the token ids that text_output covers"),
    TensorSpec("finish_reason", "STRING", (1,), doc="final response only: stop, length or cancelled"),
    TensorSpec("acceptance_rate", "FP32", (1,), doc="accepted draft tokens / draft tokens (perf metrics)"),
    TensorSpec("total_accepted_draft_tokens", "INT32", (1,), doc="draft tokens the target accepted (perf metrics)"),
    TensorSpec("total_draft_tokens", "INT32", (1,),
               doc="draft tokens proposed (tree nodes), summed over steps"),
    TensorSpec("num_decode_steps", "INT32", (1,), doc="target passes after the prompt (perf metrics)"),
)

# Model-config parameters (string values); "" keeps the default described here.
PARAMETERS = {
    "engine_dir": ("", "engine directory; empty: $CLOVER_ENGINE_DIR, else engines/demo beside the model repository. "
                       "A relative path is taken from the model repository's parent"),
    "backend": ("auto", "auto (the backend engine.json names), onnxruntime, tensorrt, or torch (engine_dir is then "
                        "a Hugging Face checkpoint directory or 'demo')"),
    "method": ("auto", "auto (the family of the engine's draft heads: clover, clover2 or medusa; vanilla "
                       "without heads), clover, clover2, medusa, vanilla, or suffix (model-free candidates from "
                       "the prompt and answer only, also on an engine without heads)"),
    "proposer": ("auto", "model-free candidates merged into the heads' tree: auto (the engine's tree defaults: "
                         "suffix unless its engine.json says otherwise), suffix, or none (the heads alone)"),
    "max_batch": ("0", "sequences decoded together at most; 0: the engine's max_batch"),
    "max_step_tokens": ("256", "prompt tokens one step prefills, plus one per sequence decoding, at most (vLLM's "
                               "max_num_batched_tokens): a burst is prefilled a few prompts per step in arrival "
                               "order, each streaming its first token when its own prompt pass ends, with decode "
                               "steps between; the oldest waiting prompt always goes in (a prompt is not split); "
                               "0: no cap, the whole burst in one step"),
    "tree_budget": ("", "draft tree nodes per step (default: the engine's tree defaults); with adaptive, the "
                        "largest budget a step may use"),
    "adaptive": ("auto", "auto: like true when the engine has a calibrated cost model (clover build "
                         "stores one by default), else a fixed budget; true: choose each step's tree budget from "
                         "the number of live sequences with that cost model, 0 (a vanilla step) where speculation "
                         "does not pay (refused at load without one); false: the fixed tree_budget every step"),
    "threads": ("0", "CPU threads of the engine (0: the backend's default)"),
    "dtype": ("auto", "backend torch only: the weights' precision, auto (bf16 on a GPU, fp32 on a CPU), fp32 "
                      "(token-exact with the fp32 reference) or bf16"),
    "tensor_parallel": ("1", "backend torch only: ranks the target is split over (docs/serving.md#tensor-parallel); "
                             "clover serve starts the others"),
    "rendezvous": ("127.0.0.1:29500", "with tensor_parallel > 1: host:port where the ranks meet (rank 0's)"),
    "apply_chat_template": ("true", "default of the apply_chat_template input"),
    "warm_up": ("true", "before the model reports ready, one decode step at every batch size from max_batch down to "
                        "1 on a throwaway decoder, so the first requests run no shape for the first time; false: "
                        "a faster load"),
    # stop strings are matched on the shared decode thread: these bound one request's share of it
    "max_stop_words": ("64", "stop_words strings one request may send at most"),
    "max_stop_chars": ("4096", "total characters of one request's stop_words at most"),
}

_INT = "integer"
_FLOAT = "number"
_BOOL = "boolean"


def render_model_config(parameters: Mapping[str, str] | None = None, instances: int = 1) -> str:
    """The ``config.pbtxt`` text of the Clover model, with ``parameters`` filled in.

    The committed ``triton_repo/clover/config.pbtxt`` is this text with the defaults.
    """
    values = {name: default for name, (default, _) in PARAMETERS.items()}
    for key, value in (parameters or {}).items():
        if key not in PARAMETERS:
            raise ConfigError(f"unknown model parameter {key!r}; known: {', '.join(PARAMETERS)}")
        values[key] = str(value)

    def tensor(spec: TensorSpec) -> str:
        dims = ", ".join(str(d) for d in spec.dims)
        optional = " optional: true" if spec.optional else ""
        return f'  {{ name: "{spec.name}" data_type: TYPE_{spec.dtype} dims: [ {dims} ]{optional} }}'

    lines = [
        "# Clover speculative decoding (generated by clover.serving.protocol.render_model_config; keep in sync).",
        "# Decoupled Python model: streaming responses, in-flight batching inside the model.",
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        "input [",
        ",\n".join(tensor(s) for s in INPUTS),
        "]",
        "output [",
        ",\n".join(tensor(s) for s in OUTPUTS),
        "]",
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]",
    ]
    for name, (_, doc) in PARAMETERS.items():
        lines.append(f"# {name}: {doc}")
        lines.append(f'parameters: {{ key: "{name}" value: {{ string_value: "{_escape(values[name])}" }} }}')
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def model_parameters(model_config: Mapping) -> dict[str, str]:
    """String parameters of a model config (Triton's JSON form), defaults filled in."""
    values = {name: default for name, (default, _) in PARAMETERS.items()}
    for key, value in (model_config.get("parameters") or {}).items():
        values[key] = value.get("string_value", "") if isinstance(value, Mapping) else str(value)
    return values


@dataclasses.dataclass
class ParsedRequest:
    generation: GenerationRequest
    stream: bool
    return_perf_metrics: bool


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the engine's context and vocabulary."""

    max_seq_len: int
    vocab_size: int
    apply_chat_template: bool = True
    max_stop_words: int = int(PARAMETERS["max_stop_words"][0])
    max_stop_chars: int = int(PARAMETERS["max_stop_chars"][0])


def parse_request(get: Callable[[str], "np.ndarray | None"], tokenizer, limits: RequestLimits,
                  request_id=None) -> ParsedRequest:
    """Read one request's inputs into a :class:`GenerationRequest` and check it.

    ``get(name)`` returns the input as a numpy array, or None when it is absent. Here: what is particular
    to the Triton inputs (presence, types, shapes, UTF-8, the stop-word limits, the prompt as text or ids);
    the values are checked by :meth:`GenerationRequest.validate`, the one request check, whose ConfigError
    becomes the RequestError. Raises :class:`RequestError` with a message for the client.
    """
    for spec in INPUTS:
        if not spec.optional and get(spec.name) is None:
            raise RequestError(f"missing required input '{spec.name}'")
    prompt_ids = _prompt_ids(get, tokenizer, limits)
    max_tokens = _number(get, "max_tokens", _INT, None)
    temperature = _number(get, "temperature", _FLOAT, 0.0)
    top_p = _number(get, "top_p", _FLOAT, 1.0)
    try:
        sampling = SamplingConfig(temperature=float(temperature), top_k=int(_number(get, "top_k", _INT, 0)),
                                  top_p=float(top_p))
    except ConfigError as exc:
        raise RequestError(f"{exc} (got temperature={temperature:g}, top_p={top_p:g})") from None
    end_id = _number(get, "end_id", _INT, None)
    generation = GenerationRequest(prompt_ids, max_new_tokens=int(max_tokens), sampling=sampling,
                                   stop_token_ids=None if end_id is None else (int(end_id),),
                                   stop_strings=tuple(_stop_words(get, limits)),
                                   seed=int(_number(get, "random_seed", _INT, 0)), request_id=request_id)
    try:
        generation.validate(limits.max_seq_len, tokenizer is not None, limits.vocab_size, cap_new_tokens=True)
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    return ParsedRequest(generation, _flag(get, "stream", False), _flag(get, "return_perf_metrics", False))


def _prompt_ids(get, tokenizer, limits: RequestLimits) -> list[int]:
    """The prompt's token ids: ``input_ids`` as sent (validate checks them against the vocabulary), or
    ``text_input`` encoded (clover.prompts.encode_prompt, the chat template per ``apply_chat_template``)."""
    from clover.prompts import encode_prompt

    text, ids = get("text_input"), get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("give exactly one of text_input (the prompt as text) and input_ids (the prompt as "
                           f"token ids), {'not both' if text is not None else 'got neither'}")
    if ids is not None:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise RequestError(f"input_ids must be integers (INT32), got {ids.dtype}")
        if _flag(get, "apply_chat_template", False):
            raise RequestError("apply_chat_template applies to text_input; input_ids are taken as they are")
        return [int(i) for i in ids.reshape(-1)]
    text = _text(_one(get, "text_input"))
    try:
        refuse_empty_prompt(text)  # before encoding, as a chat template turns even empty text into tokens
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    return encode_prompt(tokenizer, text, _flag(get, "apply_chat_template", limits.apply_chat_template))


def _text(raw) -> str:
    if isinstance(raw, (bytes, np.bytes_)):
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"text_input is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if isinstance(raw, str):
        return raw
    raise RequestError(f"text_input must be BYTES (a string), got {type(raw).__name__}")


def refuse_unknown_parameters(parameters: str | Mapping | None) -> None:
    """RequestError for request parameters: the model takes none. Triton 2.51's HTTP generate endpoint turns
    JSON keys that are not inputs into parameters where gRPC refuses an unknown input, so checking here makes
    both protocols refuse a misspelt input (docs/serving.md#input-types-what-triton-251-decides-before-the-model).
    ``triton_``-prefixed keys are Triton's own and pass."""
    if isinstance(parameters, (str, bytes)):
        try:
            parameters = json.loads(parameters or "{}")
        except ValueError:
            return
    unknown = sorted(key for key in (parameters or {}) if not str(key).startswith("triton_"))
    if unknown:
        raise RequestError(f"unknown input{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                           f"the inputs are: {', '.join(spec.name for spec in INPUTS)}")


def _stop_words(get, limits: RequestLimits) -> list[str]:
    """The non-empty stop strings, refused beyond the limits before any of them is decoded."""
    words = get("stop_words")
    if words is None:
        return []
    words = np.asarray(words, dtype=object).reshape(-1)
    if len(words) > limits.max_stop_words:
        raise RequestError(f"stop_words has {len(words)} strings; this server takes at most "
                           f"{limits.max_stop_words} (model parameter max_stop_words)")
    out: list[str] = []
    for word in words:
        if isinstance(word, (bytes, np.bytes_)):
            try:
                word = bytes(word).decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError("stop_words holds a string that is not valid UTF-8") from None
        if not isinstance(word, str):
            raise RequestError("stop_words must be BYTES (strings)")
        if word:
            out.append(word)
    total = sum(len(word) for word in out)
    if total > limits.max_stop_chars:
        raise RequestError(f"stop_words total {total} characters; this server takes at most "
                           f"{limits.max_stop_chars} (model parameter max_stop_chars)")
    return out


def _one(get, name: str):
    value = get(name)
    if value is None:
        return None
    array = np.asarray(value)
    if array.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _number(get, name: str, kind: str, default):
    value = _one(get, name)
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RequestError(f"input '{name}' must be a {kind}, got {type(value).__name__}")
    if kind == _INT:
        if isinstance(value, (float, np.floating)):
            raise RequestError(f"input '{name}' must be an integer, got {value!r}")
        return int(value)
    return float(value)


def _flag(get, name: str, default: bool) -> bool:
    value = _one(get, name)
    if value is None:
        return default
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(f"input '{name}' must be a boolean, got {type(value).__name__}")
    return bool(value)


def response_tensors(text: str, token_ids: list[int], finish_reason: str | None = None, stats=None,
                     perf: bool = False) -> dict[str, np.ndarray]:
    """The output tensors of one response (numpy arrays by output name).

    ``stats``: a :class:`clover.serving.batcher.RequestStats`, needed when ``perf``.
    """
    out = {
        "text_output": np.array([text.encode("utf-8")], dtype=object),
        "output_ids": np.asarray(token_ids, dtype=np.int32).reshape(-1),
    }
    if finish_reason is not None:
        out["finish_reason"] = np.array([finish_reason.encode()], dtype=object)
    if perf and stats is not None:
        out["acceptance_rate"] = np.array([stats.acceptance_rate], dtype=np.float32)
        out["total_accepted_draft_tokens"] = np.array([stats.accepted_draft_tokens], dtype=np.int32)
        out["total_draft_tokens"] = np.array([stats.draft_tokens], dtype=np.int32)
        out["num_decode_steps"] = np.array([stats.decode_steps], dtype=np.int32)
    return out
