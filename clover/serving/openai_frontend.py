"""OpenAI-compatible HTTP frontend in front of the Clover Triton model (``clover serve --openai-port``).

A thin translation layer that runs in its own process beside tritonserver: ``GET /v1/models``,
``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events when ``stream``), each
mapped onto one request to the ``clover`` model over Triton's gRPC streaming API
(``tritonclient.grpc.aio``, one channel shared by all requests).

This module checks the OpenAI request: its schema (types, fields it cannot honour) and OpenAI's value
ranges (temperature 0-2, top_p, max_tokens from 1 to the engine's context, top_k, seed), each refused in
one wording, "<param> must be between A and B (got X)", whatever the value. The model checks the rest
(the prompt's length, stop words, ...): its refusals come back here and are answered as OpenAI errors
(HTTP 400, ``param`` named).

Shutdown (SIGTERM or SIGINT): no new connections; open requests run on for ``--drain-timeout`` seconds
(``clover serve`` drains the model first, so they normally end with the model's own final response),
then each ends with finish reason ``cancelled``, a stream with its final chunk and ``data: [DONE]``.

Prompts are tokenized once, here: the frontend needs the token ids anyway to count
``usage.prompt_tokens`` (the model does not return it), so it sends them as the model's ``input_ids``
and the model does not encode the text again. A conversation of one user message is encoded through
the chat template as one user turn, exactly as the model encodes ``clover client``'s ``text_input``
(``clover.prompts.encode_prompt``); any other conversation is rendered with the same tokenizer's chat
template and encoded as plain text; a completion's prompt as plain text.

Stand-alone: ``python -m clover.serving.openai_frontend --engine DIR --grpc-url localhost:8001 --port 9000``
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request, imported
# inside create_app so that clover serve imports this module without fastapi) as objects
import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from clover.client import chunk_from_outputs, input_array, request_fields, tokens_per_step  # the model's tensor mapping
from clover.config import ConfigError, new_tokens_range, sampling_range_error
from clover.prompts import encode_prompt, refuse_empty_prompt

MODEL_NAME = "clover"
DEFAULT_PORT = 9000
# the finish reason of a request that shutdown ended (the model's drain uses the same)
CANCELLED = "cancelled"
# seconds uvicorn waits beyond the drain for the requests to send their last chunk, before it cancels them
_SHUTDOWN_MARGIN_S = 5.0
# at a forced stop (a second Ctrl-C), seconds the frontend has to end its streams with [DONE] before SIGKILL
FORCED_STOP_S = 5.0


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, kind="service_unavailable_error", code="triton_unavailable")


# -- request schema ----------------------------------------------------------------

class _Strict(BaseModel):
    # strict: "5" is not an integer, as for OpenAI; extra fields are allowed (clients send many) and
    # the ones that would change the answer are refused by _refuse_unsupported
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None


class _GenerationFields(_Strict):
    # value ranges: _check_ranges, one wording for every value out of range
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's; vLLM and TensorRT-LLM take it
    stop: str | list[str] | None = None
    seed: int | None = None  # the model's random_seed is UINT64
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice (chunk) also carries its token ids


EMPTY_MESSAGES = 'the list is empty; send at least one message, e.g. {"role": "user", "content": "Hello"}'


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    @field_validator("messages")
    @classmethod
    def at_least_one_message(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:  # in words of its own: pydantic's min_length says "List should have at least 1 item ..."
            raise PydanticCustomError("empty_messages", EMPTY_MESSAGES)
        return messages


class CompletionRequest(_GenerationFields):
    prompt: str | list[str]


# OpenAI parameters the model cannot honour: accepted only at the value that changes nothing
_NO_OP_VALUES = {"n": 1, "best_of": 1, "logprobs": False, "top_logprobs": 0, "echo": False, "suffix": "",
                 "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "tools": [], "functions": [],
                 "response_format": {"type": "text"}}
_ROLES = ("system", "developer", "user", "assistant")
_TYPE_TAGS = {"str", "int", "float", "bool"}  # pydantic's union branches in an error's location


def parse_body(schema: type[_GenerationFields], raw: bytes) -> _GenerationFields:
    """The request body as ``schema``; OpenAIError naming the first bad field."""
    required = ", ".join(name for name, field in schema.model_fields.items() if field.is_required())
    if not raw.strip():
        raise OpenAIError(400, f"the request body is empty; send a JSON object with at least {required}")
    try:
        body = schema.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        if errors[0]["type"] == "json_invalid":
            raise OpenAIError(400, f"the request body is not valid JSON ({errors[0]['msg']})") from None
        if not errors[0]["loc"]:  # valid JSON, but a list, a string, a number, ...
            raise OpenAIError(400, f"the request body must be a JSON object with at least {required} "
                                   f"(got {type(json.loads(raw)).__name__})") from None
        # the first field's deepest error: for a union (stop: str | list[str]) the branch that got furthest
        field = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
        error = max(field, key=lambda e: len(_param_path(e["loc"])))
        param = _param_path(error["loc"])
        raise OpenAIError(400, f"{param}: {error['msg']}" if param else error["msg"], param or None) from None
    _refuse_unsupported(body)
    _check_ranges(body)
    return body


def _param_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in _TYPE_TAGS and "[" not in part:
            path += f".{part}" if path else part
    return path


def _out_of_range(param: str, value, low, high, note: str = "") -> OpenAIError:
    return OpenAIError(400, f"{param} must be between {low} and {high}{note} (got {_shown(value)})", param)


def _shown(value) -> str:
    """A number as the client likely wrote it (JSON 5 arrives as 5.0 in a float field)."""
    return str(value).removesuffix(".0") if isinstance(value, float) else str(value)


def _check_ranges(body: _GenerationFields) -> None:
    """The ranges every interface shares (clover.config.SAMPLING_RANGES); max_tokens: _check_max_tokens."""
    for param in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(body, param)
        problem = sampling_range_error(param, value) if value is not None else None
        if problem:
            raise OpenAIError(400, f"{problem} (got {_shown(value)})", param)


def _check_max_tokens(param: str, value: int, context: int) -> None:
    low, high = new_tokens_range(context)  # the model's own bound, checked here to name the parameter
    if not low <= value <= high:
        raise _out_of_range(param, value, low, high, ", the engine's context in tokens")


def _refuse_unsupported(body: _GenerationFields) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in _NO_OP_VALUES and value is not None and value != _NO_OP_VALUES[name]:
            raise OpenAIError(400, f"{name}: only {name}={json.dumps(_NO_OP_VALUES[name])} is supported by "
                                   f"this server (got {json.dumps(value)})", name)


# -- request mapping ---------------------------------------------------------------

@dataclasses.dataclass
class TritonRequest:
    """One OpenAI request as the inputs of the Clover model, and what the answer needs besides."""

    fields: dict  # model inputs by name (clover.client.request_fields)
    prompt_tokens: int
    stream: bool
    include_usage: bool
    params: dict  # model input -> OpenAI parameter, for naming the parameter in the model's refusals
    return_token_ids: bool = False


def chat_request(body: ChatCompletionRequest, tokenizer, context: int) -> TritonRequest:
    messages = [_message(i, m) for i, m in enumerate(body.messages)]
    if len(messages) == 1 and messages[0]["role"] == "user":
        text, template = messages[0]["content"], True  # one user turn: the chat template, as clover client's text
    else:
        text, template = render_chat(tokenizer, messages), False
    max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    return _triton_request(body, prompt_ids(tokenizer, text, template, "messages"), getattr(body, max_param),
                           context, {"prompt": "messages", "max_tokens": max_param})


def completion_request(body: CompletionRequest, tokenizer, context: int) -> TritonRequest:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise OpenAIError(400, f"prompt: send one prompt per request (got a list of {len(prompt)})", "prompt")
        prompt = prompt[0]
    return _triton_request(body, prompt_ids(tokenizer, prompt, False, "prompt"), body.max_tokens, context,
                           {"prompt": "prompt", "max_tokens": "max_tokens"})


def prompt_ids(tokenizer, text: str, template: bool, param: str) -> list[int]:
    """The prompt's token ids, the one tokenization of a request: the model gets them as ``input_ids`` and
    ``usage.prompt_tokens`` counts them. Empty text is refused first (a chat template would wrap it in tokens)."""
    try:
        refuse_empty_prompt(text)
    except ConfigError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param) from None
    return encode_prompt(tokenizer, text, template)


def _triton_request(body: _GenerationFields, ids: list[int], max_tokens: int | None, context: int,
                    params: dict) -> TritonRequest:
    if max_tokens is None:  # OpenAI's default: as many as the context leaves
        max_tokens = max(1, context - len(ids))
    _check_max_tokens(params["max_tokens"], max_tokens, context)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    fields = request_fields(ids, max_tokens, body.stream, temperature=body.temperature, top_k=body.top_k,
                            top_p=body.top_p, stop_words=stop, seed=body.seed, perf=True)
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return TritonRequest(fields, len(ids), body.stream, include_usage, params, body.return_token_ids)


def _message(index: int, message: ChatMessage) -> dict:
    where = f"messages[{index}]"
    if message.role not in _ROLES:
        raise OpenAIError(400, f"{where}.role: {message.role!r} is not supported; use one of {', '.join(_ROLES)}",
                          f"{where}.role")
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise OpenAIError(400, f"{where}.content: only text parts are supported", f"{where}.content")
        content = "".join(part.text for part in content)
    return {"role": message.role, "content": content or ""}


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The conversation through the tokenizer's chat template, as text that ``encode_prompt(.., chat=False)``
    turns into the template's token ids."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "messages: this model has no chat template; send one user message, or use "
                               "/v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # e.g. a template that insists on alternating roles
        raise OpenAIError(400, f"messages: the model's chat template refused them: {exc}", "messages") from None
    bos = tokenizer.bos_token
    # a template that writes BOS itself would get a second one from encode() where the tokenizer adds it
    if bos and text.startswith(bos) and tokenizer.encode("")[:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


# the model's inputs whose OpenAI parameters are named otherwise, as its refusals name them (the model parameters
# max_stop_words / max_stop_chars keep their names: they are the server's settings, not the request's)
_OPENAI_NAMES = {"stop_words": "stop", "random_seed": "seed"}


def _openai_names(message: str) -> str:
    """The model's refusal in the OpenAI API's words: ``stop_words`` is ``stop`` there, ``random_seed`` ``seed``."""
    for model_name, openai_name in _OPENAI_NAMES.items():
        message = re.sub(rf"\b{model_name}\b", openai_name, message)
    return message


def model_error(message: str, params: dict) -> OpenAIError:
    """The model's refusal of a request as an OpenAI error, naming the parameter it is about."""
    if "shutting down" in message or "unknown model" in message or "is not ready" in message:
        return _unavailable(message)
    keywords = (("max_new_tokens", params["max_tokens"]), ("max_tokens", params["max_tokens"]),
                ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("stop", "stop"),
                ("random_seed", "seed"), ("text_input", params["prompt"]), ("input_ids", params["prompt"]),
                ("prompt", params["prompt"]))
    found = [(message.find(word), param) for word, param in keywords if word in message]
    param = min(found)[1] if found else None
    message = _openai_names(message)
    named = param is None or message.startswith(param)
    return OpenAIError(400, message if named else f"{param}: {message}", param)


# -- Triton ------------------------------------------------------------------------

class TritonGateway:
    """One asyncio gRPC channel to tritonserver, shared by all requests (create it inside the event loop)."""

    def __init__(self, url: str, model: str = MODEL_NAME) -> None:
        import tritonclient.grpc.aio as grpcaio

        self._aio = grpcaio
        self.url, self.model = url, model
        self.client = grpcaio.InferenceServerClient(url)

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready() and await self.client.is_model_ready(self.model)
        except Exception:  # unreachable, or not answering yet
            return False

    async def close(self) -> None:
        await self.client.close()

    def _inputs(self, fields: dict) -> list:
        inputs = []
        for name, value in fields.items():
            array, datatype = input_array(name, value)
            tensor = self._aio.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    async def generate(self, request: TritonRequest) -> AsyncIterator:
        """The model's responses (:class:`clover.client.Chunk`) to one request, up to the one with a
        finish reason. Closing the generator before that cancels the request in Triton."""
        import grpc

        async def one_request():
            yield {"model_name": self.model, "inputs": self._inputs(request.fields), "request_id": uuid.uuid4().hex}

        call = self.client.stream_infer(one_request())
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise model_error(error.message(), request.params)
                outputs = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
                chunk = chunk_from_outputs(outputs, time.perf_counter())
                finished = chunk.finish_reason is not None
                yield chunk
                if finished:
                    return
            raise _unavailable("tritonserver ended the response stream before the answer was complete")
        except grpc.RpcError as exc:
            finished = True
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise _unavailable(f"cannot reach tritonserver at {self.url}: {exc.details()}") from None
            raise OpenAIError(500, f"tritonserver: {exc.details()}", kind="server_error") from None
        finally:
            if not finished:  # the client went away (or stopped reading): stop decoding for it
                call.cancel()


# -- responses ---------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def clover_stats(perf: dict | None, completion_tokens: int) -> dict | None:
    """The ``clover`` extension field: the request's speculative-decoding counters."""
    if not perf:
        return None
    steps = perf.get("num_decode_steps") or 0
    return {"acceptance_rate": perf.get("acceptance_rate"),
            "accepted_draft_tokens": perf.get("total_accepted_draft_tokens"),
            "draft_tokens": perf.get("total_draft_tokens"), "decode_steps": steps,
            "tokens_per_step": tokens_per_step(completion_tokens, steps)}


class ResponseShape:
    """What differs between chat and text completions in the response JSON."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, finish_reason: str | None, tokens: dict, stats: dict | None,
              token_ids: list[int] | None = None) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = tokens
        if stats is not None:
            body["clover"] = stats
        return body

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False,
              token_ids: list[int] | None = None) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice["delta"] = delta
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, tokens: dict) -> dict:
        return {**self._envelope("chat.completion.chunk" if self.chat else "text_completion", []), "usage": tokens}


async def whole_answer(chunks: AsyncIterator, request: TritonRequest, shape: ResponseShape) -> dict:
    text, token_ids, reason, perf = [], [], None, None
    async for chunk in chunks:
        text.append(chunk.text)
        token_ids.extend(chunk.token_ids)
        reason, perf = chunk.finish_reason or reason, chunk.perf or perf
    return shape.whole("".join(text), reason, usage(request.prompt_tokens, len(token_ids)),
                       clover_stats(perf, len(token_ids)), token_ids if request.return_token_ids else None)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def stream_events(first, chunks: AsyncIterator, request: TritonRequest, shape: ResponseShape):
    """Server-sent events from the model's first response on; closing this closes ``chunks``."""
    completion_tokens, perf, chunk = 0, None, first
    try:
        if shape.chat:
            yield _sse(shape.chunk("", first=True))
        while True:
            completion_tokens += len(chunk.token_ids)
            perf = chunk.perf or perf
            ids = chunk.token_ids if request.return_token_ids else None
            if chunk.text or chunk.finish_reason or ids:  # tokens whose text is held back send nothing else
                event = shape.chunk(chunk.text, chunk.finish_reason, token_ids=ids)
                if chunk.finish_reason:
                    event["clover"] = clover_stats(perf, completion_tokens)
                if request.include_usage:
                    event["usage"] = None  # OpenAI: null on every chunk but the last
                yield _sse(event)
            if chunk.finish_reason:
                break
            chunk = await chunks.__anext__()
        if request.include_usage:
            yield _sse(shape.usage_chunk(usage(request.prompt_tokens, completion_tokens)))
        yield _sse("[DONE]")
    except OpenAIError as exc:  # the headers are sent: the error goes into the stream, as OpenAI does
        yield _sse(exc.body())
    finally:
        await chunks.aclose()


# -- shutdown ----------------------------------------------------------------------

class Shutdown:
    """The frontend's drain: :meth:`request` (from a signal handler) starts it; ``drain_s`` later
    :attr:`expired` is set and the requests still open end themselves (:func:`until_shutdown`).
    :meth:`force` (a second stop signal) sets it at once: the open requests still end properly, each stream
    with its final chunk and ``data: [DONE]``, and the process exits non-zero (:attr:`forced`)."""

    def __init__(self, drain_s: float) -> None:
        self.drain_s = drain_s
        self.open_requests = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # set at startup
        self.expired = asyncio.Event()
        self.started = False
        self.forced = False

    def request(self) -> None:
        """Start the drain; safe to call from a signal handler or another thread."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._begin)

    def _begin(self) -> None:
        if self.started:
            return
        self.started = True
        # the one line the frontend logs at shutdown
        print(f"[clover] OpenAI frontend: shutting down; {self.open_requests} open request(s) end within "
              f"{self.drain_s:g} s", file=sys.stderr, flush=True)
        self.loop.call_later(self.drain_s, self.expired.set)

    def force(self) -> None:
        """End the open requests now; safe to call from a signal handler or another thread."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._end_now)

    def _end_now(self) -> None:
        if self.forced:
            return
        self._begin()
        self.forced = True
        print(f"[clover] OpenAI frontend: stopping at once; {self.open_requests} open request(s) end now",
              file=sys.stderr, flush=True)
        self.expired.set()


async def until_shutdown(chunks: AsyncIterator, shutdown: Shutdown) -> AsyncIterator:
    """``chunks`` up to the last one or, if the shutdown drain expires first, then a final chunk with finish
    reason ``cancelled`` (``chunks`` is closed either way, which cancels an unfinished Triton request)."""
    from clover.client import Chunk

    shutdown.open_requests += 1
    expired = asyncio.ensure_future(shutdown.expired.wait())
    following = None
    try:
        while True:
            following = asyncio.ensure_future(chunks.__anext__())
            await asyncio.wait({following, expired}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
                yield Chunk("", [], CANCELLED, None, time.perf_counter())
                return
            try:
                chunk = following.result()
            except StopAsyncIteration:
                return
            yield chunk
            if chunk.finish_reason is not None:
                return
    finally:
        shutdown.open_requests -= 1
        expired.cancel()
        # no await here while a cancellation is under way (anyio repeats it at every await): a pending
        # read is cancelled, which ends ``chunks`` in its own task; an idle ``chunks`` closes at once
        if following is not None and not following.done():
            following.cancel()
        else:
            await chunks.aclose()


# -- the app -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FrontendSettings:
    grpc_url: str
    context: int  # the engine's context in tokens (the default max_tokens fills it)
    model: str = MODEL_NAME
    drain_s: float = 10.0  # at shutdown, seconds open requests may still run (Shutdown)


def _streaming_response_class():
    import anyio
    from starlette.responses import StreamingResponse

    class CancellingStream(StreamingResponse):
        """Stops the body (and so the Triton request) as soon as the client disconnects: Starlette itself
        notices that only at the next write under ASGI >= 2.4 servers, and leaves the body unclosed."""

        async def __call__(self, scope, receive, send) -> None:
            try:
                async with anyio.create_task_group() as group:
                    async def stream() -> None:
                        try:
                            await self.stream_response(send)
                        except OSError:  # the client went away during a write
                            pass
                        group.cancel_scope.cancel()

                    group.start_soon(stream)
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()
            finally:
                await self.body_iterator.aclose()

    return CancellingStream


def create_app(settings: FrontendSettings, tokenizer, gateway=TritonGateway):
    """The FastAPI app; it opens its gRPC channel to Triton (``gateway(url, model)``) at startup.
    ``app.state.shutdown.request()`` starts its drain (:class:`Shutdown`)."""
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.gateway = gateway(settings.grpc_url, settings.model)
        app.state.shutdown.loop = asyncio.get_running_loop()
        yield
        await app.state.gateway.close()

    app = FastAPI(title="Clover (OpenAI-compatible)", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.shutdown = Shutdown(settings.drain_s)
    stream_class = _streaming_response_class()

    @app.exception_handler(OpenAIError)
    async def openai_error(request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def unexpected_error(request, exc: Exception):
        error = OpenAIError(500, f"{type(exc).__name__}: {exc}", kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(OpenAIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    async def model_card() -> dict:
        if not await app.state.gateway.ready():
            raise _unavailable(f"model {settings.model!r} is not ready in tritonserver at {settings.grpc_url}")
        return {"id": settings.model, "object": "model", "created": 0, "owned_by": "clover"}

    @app.get("/health")
    async def health():
        """For load balancers and wait_ready: 200 with a status once the model is ready in tritonserver, else
        503 with the OpenAI error body (docs/openai.md#endpoints)."""
        await model_card()
        return {"status": "ok", "model": settings.model, "triton": settings.grpc_url}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        _check_model(model_id, settings.model)
        return await model_card()

    async def complete(request: Request, schema, to_triton, chat: bool):
        body = parse_body(schema, await request.body())
        _check_model(body.model, settings.model)
        triton = to_triton(body, tokenizer, settings.context)
        shape = ResponseShape(chat, settings.model)
        chunks = until_shutdown(app.state.gateway.generate(triton), app.state.shutdown)
        if not triton.stream:
            return await _unless_disconnected(request, whole_answer(chunks, triton, shape))
        first = await chunks.__anext__()  # a refusal comes before the first token: answered as an HTTP error
        return stream_class(stream_events(first, chunks, triton, shape), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, ChatCompletionRequest, chat_request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, CompletionRequest, completion_request, False)

    return app


async def _unless_disconnected(request, work):
    """``await work``, cancelled (and with it the Triton request) if the client disconnects meanwhile."""
    import asyncio

    from starlette.responses import Response

    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=0.25))[0]:
        if await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
    return task.result()


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise OpenAIError(404, f"The model {name!r} does not exist; this server serves {served!r}", "model",
                          code="model_not_found")


# -- process -----------------------------------------------------------------------

def load_text_side(engine_dir: str | Path):
    """The engine's tokenizer and context length: all the frontend needs of the engine."""
    from clover.engine_dir import read_engine_meta
    from clover.target import load_tokenizer

    return load_tokenizer(engine_dir), read_engine_meta(engine_dir).limits.max_seq


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clover.serving.openai_frontend",
                                     description="OpenAI-compatible HTTP frontend for the Clover Triton model")
    parser.add_argument("--engine", type=Path, required=True, help="the served engine directory (tokenizer, context)")
    parser.add_argument("--grpc-url", default="localhost:8001", help="tritonserver's gRPC address")
    parser.add_argument("--model", default=MODEL_NAME, help="the Triton model (also the OpenAI model name)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level (info: one line per request)")
    parser.add_argument("--drain-timeout", type=float, default=10.0,
                        help="at SIGTERM/SIGINT, seconds open requests may still run; then each ends with finish "
                             "reason 'cancelled' (a stream with its final chunk and data: [DONE])")
    args = parser.parse_args(argv)
    if args.drain_timeout < 0:
        parser.error(f"--drain-timeout must be >= 0, got {args.drain_timeout}")

    tokenizer, context = load_text_side(args.engine)
    app = create_app(FrontendSettings(args.grpc_url, context, args.model, args.drain_timeout), tokenizer)
    serving = _server(app, args)
    # Before uvicorn takes over the signals (loading the tokenizer), a stop request exits at once. uvicorn
    # raises the signal again after its shutdown, for the handler it found: then nothing is left to do.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None if serving.started else sys.exit(0))
    serving.run()
    return 1 if app.state.shutdown.forced else 0  # a forced stop cut requests short: not a clean exit


def _server(app, args):
    """uvicorn's server, whose stop signal also starts the app's drain (:class:`Shutdown`): it then waits
    for the open requests, which end within the drain, instead of cancelling them mid-response."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # a second stop signal: not uvicorn's force_exit, which would cut the streams
                app.state.shutdown.force()
                return
            super().handle_exit(sig, frame)
            app.state.shutdown.request()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout + _SHUTDOWN_MARGIN_S)
    return DrainingServer(config)


class FrontendProcess:
    """The frontend as a child process of ``clover serve``: started after tritonserver is ready, stopped first."""

    def __init__(self, engine_dir: str | Path, grpc_url: str, port: int, host: str = "0.0.0.0",
                 model: str = MODEL_NAME, log_file: str | Path | None = None, drain_s: float = 10.0) -> None:
        self.engine_dir, self.grpc_url, self.port, self.host, self.model = engine_dir, grpc_url, port, host, model
        self.drain_s = drain_s
        self.log_file = Path(log_file) if log_file is not None else None
        self.process: subprocess.Popen | None = None
        self._log_handle = None
        self.forced = False  # stop() was cut short by a second Ctrl-C

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "clover.serving.openai_frontend", "--engine", str(self.engine_dir),
                "--grpc-url", self.grpc_url, "--model", self.model, "--host", self.host, "--port", str(self.port),
                "--drain-timeout", str(self.drain_s)]

    def start(self) -> "FrontendProcess":
        from clover.demo import package_parent
        from clover.serving.server import ServerError

        for package in ("fastapi", "uvicorn"):
            if not _importable(package):
                raise ServerError(f"--openai-port needs {package}: pip install -e '.[serve]'")
        env = os.environ.copy()
        root = str(package_parent())
        env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
        if self.log_file is not None:
            self._log_handle = open(self.log_file, "ab")
        # a session of its own, like tritonserver: clover serve forwards Ctrl-C (stop()) in its order
        self.process = subprocess.Popen(self.command(), env=env, stdin=subprocess.DEVNULL, stdout=self._log_handle,
                                        stderr=subprocess.STDOUT if self._log_handle else None,
                                        start_new_session=True)
        return self

    def poll(self) -> int | None:
        from clover.serving.server import reap

        return self.process.returncode if self.process is not None and reap(self.process, 0) else None

    def wait_ready(self, timeout_s: float = 120.0) -> "FrontendProcess":
        """Block until ``/health`` answers 200 (it is up and reaches the model); ServerError if it exits first."""
        from clover.serving.server import ServerError

        deadline = time.monotonic() + timeout_s
        while True:
            if self.poll() is not None:
                raise ServerError(f"the OpenAI frontend exited with code {self.poll()} before it was ready")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"the OpenAI frontend was not ready at {self.url} after {timeout_s:.0f} s")
            time.sleep(0.25)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (the drain: open requests end within ``drain_s``), SIGKILL by PID after ``timeout_s``
        (default: the drain and uvicorn's margin, plus 10 s); at a second Ctrl-C a second SIGTERM (the open
        requests end now, streams with ``[DONE]``: :attr:`forced`), SIGKILL if that takes more than
        FORCED_STOP_S. Returns the exit code."""
        if self.process is None:
            return None
        timeout_s = self.drain_s + _SHUTDOWN_MARGIN_S + 10 if timeout_s is None else timeout_s
        from clover.serving.server import KILL_WAIT_S, reap

        try:
            if not reap(self.process, 0):  # reap, not Popen.wait: see its docstring
                self.process.send_signal(signal.SIGTERM)
                try:
                    exited = reap(self.process, timeout_s)
                except KeyboardInterrupt:  # a second Ctrl-C: the frontend ends its open requests now
                    self.forced = True
                    self.process.send_signal(signal.SIGTERM)
                    exited = reap(self.process, FORCED_STOP_S)
                if not exited:
                    self.process.kill()
                    reap(self.process, KILL_WAIT_S)
            return self.process.returncode
        finally:
            if self._log_handle is not None:
                self._log_handle.close()
                self._log_handle = None


def _importable(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


if __name__ == "__main__":
    sys.exit(main())
