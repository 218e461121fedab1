"""The simulated replica's HTTP face: the parts of vLLM's OpenAI-compatible server a router
and its tests talk to, over :class:`gpu_emitter.engine.Engine`.

Routes (request and response shapes follow vLLM 0.32's):

* ``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a one-element
  list of either; ``max_tokens`` (default ``min(16, room left)``), ``stream``,
  ``stream_options.include_usage``, ``add_special_tokens`` (default true),
  ``prompt_logprobs`` (any non-null value makes the request skip reading the prefix cache,
  spec §4.1; no logprobs are computed), ``echo`` (with ``logprobs``: the same), ``return_token_ids``
  (adds ``prompt_token_ids`` and ``token_ids`` to the choice), ``n`` must be 1.
* ``POST /v1/chat/completions``: ``messages`` through the builtin chat template
  (:mod:`gpu_emitter.tokenizer`), ``max_tokens``/``max_completion_tokens``,
  ``add_generation_prompt`` (default true), ``add_special_tokens`` (default false), and the
  same streaming, prefix-cache and token-id options.
* ``usage.prompt_tokens_details.cached_tokens`` is the pool's real local hit for the request
  (what vLLM reports with ``--enable-prompt-tokens-details``).
* ``POST /tokenize`` (``{"prompt": ...}`` or ``{"messages": [...]}``) and ``POST /detokenize``.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's metric names),
  ``POST /reset_prefix_cache`` (409 while requests hold blocks, like vLLM's refusal),
  ``GET /kv_event_sources`` (this replica's publisher endpoints per DP rank).

Errors are vLLM's JSON shape ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status for bad input. Streaming responses are Server-Sent Events (``data: {...}`` chunks, then
``data: [DONE]``); a streaming request is answered only once its first token exists, so a
request that can never be served still gets an HTTP error status.

Generated text is the builtin tokenizer's decoding of the output ids: ``wN`` words joined by
single spaces; stream deltas are ``"w5"``, ``" w17"``, ... so they concatenate to exactly the
non-streaming text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from events.hashing import RequestKeys
from gpu_emitter import tokenizer as tok
from gpu_emitter.engine import Engine, EngineError, RequestHandle

__all__ = ["DEFAULT_MAX_TOKENS", "ApiError", "ReplicaInfo", "create_app", "render_metrics"]

DEFAULT_MAX_TOKENS = 16
"""Output length when a request gives no ``max_tokens`` (vLLM's completions default; vLLM's
chat default is "all the room left", which a simulation does not need)."""

_JSON = "application/json"
_encode = msgspec.json.encode


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, message: str, status: int = 400, type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_


@dataclass
class ReplicaInfo:
    """What the server says about itself (``/v1/models``, ``/metrics``, event sources)."""

    model_name: str = "kvrouter-sim"
    max_model_len: int = 4096
    data_parallel_rank: int = 0
    event_sources: list[dict[str, Any]] = field(default_factory=list)
    """One entry per DP rank: ``data_parallel_rank``, ``endpoint``, ``replay_endpoint``,
    ``topic`` (see :func:`gpu_emitter.cli.event_source`)."""
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.time)
    """The replica's epoch, exported as ``process_start_time_seconds`` as vLLM's API server
    does (Prometheus' process collector): a new replica process is a new value."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """LoRA adapters served besides the base model, name -> path (vLLM's ``--lora-modules
    name=path``): a request naming one hashes its blocks with ``("lora", name, path)``."""


def _error_body(message: str, type_: str, status: int) -> bytes:
    return _encode({"error": {"message": message, "type": type_, "param": None, "code": status}})


def _error_response(err: ApiError) -> Response:
    return Response(_error_body(err.message, err.type, err.status), err.status, media_type=_JSON)


# -- request parsing --------------------------------------------------------------------


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{key}' must be true or false, got {value!r}")
    return value


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_model(body: Mapping[str, Any], info: ReplicaInfo) -> None:
    model = body.get("model")
    if model is not None and model != info.model_name and model not in info.lora_modules:
        raise ApiError(
            f"The model `{model}` does not exist; this replica serves `{info.model_name}`.",
            404,
            "NotFoundError",
        )


# vLLM 0.32's validate_cache_salt (entrypoints/generate/base/protocol.py)
_SALT_FORBIDDEN = frozenset("@/\\\x00")
_SALT_MAX = 128


def _request_keys(body: Mapping[str, Any], info: ReplicaInfo) -> RequestKeys | None:
    """The request's extra hash keys as vLLM derives them: the LoRA adapter its ``model``
    names (name and path) and its ``cache_salt`` (refused as vLLM refuses it)."""
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt or len(salt) > _SALT_MAX:
            raise ApiError(f"'cache_salt' must be a non-empty string of at most {_SALT_MAX} chars")
        if _SALT_FORBIDDEN.intersection(salt):
            raise ApiError("'cache_salt' must not contain '@', '/', '\\' or NUL")
    path = info.lora_modules.get(body.get("model"))  # type: ignore[arg-type]
    if path is None and salt is None:
        return None
    name = body.get("model") if path is not None else None
    return RequestKeys(lora_name=name, lora_path=path, cache_salt=salt)


def _token_list(ids: list[Any]) -> list[int]:
    for t in ids:
        if not _is_int(t) or not 0 <= t < tok.VOCAB_SIZE:
            raise ApiError(
                f"prompt token id {t!r} is not an integer in 0..{tok.VOCAB_SIZE - 1} "
                "(the builtin vocabulary)"
            )
    return ids


def _completion_prompt(body: Mapping[str, Any]) -> list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError("'prompt' is required: a string or a list of token ids")
    prompt = body["prompt"]
    add_special = _bool(body, "add_special_tokens", True)
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        if len(prompt) != 1:
            raise ApiError(
                f"'prompt' holds {len(prompt)} prompts; the simulated replica takes one "
                "prompt per request: send them separately"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_bos=add_special)
    elif isinstance(prompt, list):
        ids = _token_list(prompt)
    else:
        raise ApiError("'prompt' must be a string or a list of token ids")
    if not ids:
        raise ApiError("'prompt' is empty: give at least one token")
    return ids


def _chat_prompt(body: Mapping[str, Any]) -> list[int]:
    if "messages" not in body:
        raise ApiError('\'messages\' is required: a list of {"role", "content"} objects')
    try:
        ids = tok.encode_chat(
            body["messages"],
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
            add_special_tokens=_bool(body, "add_special_tokens", False),
        )
    except tok.TokenizerInputError as exc:
        raise ApiError(str(exc)) from None
    if not ids:
        raise ApiError("the chat renders to no tokens: give at least one message with text")
    return ids


def _max_tokens(body: Mapping[str, Any], prompt_len: int, info: ReplicaInfo, *keys: str) -> int:
    if prompt_len >= info.max_model_len:
        raise ApiError(
            f"This model's maximum context length is {info.max_model_len} tokens. However, "
            f"your request has {prompt_len} input tokens. Please reduce the length of the "
            "input."
        )
    room = info.max_model_len - prompt_len
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise ApiError(f"'{key}' must be an integer >= 1, got {value!r}")
        if value > room:
            raise ApiError(
                f"'{key}' is too large: {value}. This model's maximum context length is "
                f"{info.max_model_len} tokens and your request has {prompt_len} input tokens "
                f"({value} > {info.max_model_len} - {prompt_len})."
            )
        return value
    return min(DEFAULT_MAX_TOKENS, room)


def _common_options(body: Mapping[str, Any], chat: bool) -> tuple[bool, bool, bool, bool]:
    """(stream, include_usage, skip_reading, return_token_ids)

    vLLM 0.32 skips reading the prefix cache when the request's prompt logprobs are asked
    for: ``prompt_logprobs``, or, with ``echo``, a completion's ``logprobs`` or a chat's
    ``top_logprobs`` (which a chat defaults to 0: an echoed chat always skips). Its OpenAI
    request classes have no ``skip_reading_prefix_cache`` field: the key is ignored."""
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(f"'n' must be 1 on the simulated replica, got {n!r}")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError("'stream_options' must be an object")
        if not stream:
            raise ApiError("'stream_options' is only allowed when 'stream' is true")
        include_usage = _bool(opts, "include_usage", False)
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None and _bool(body, "echo", False):
        prompt_logprobs = (body.get("top_logprobs") or 0) if chat else body.get("logprobs")
    skip = prompt_logprobs is not None
    return stream, include_usage, skip, _bool(body, "return_token_ids", False)


# -- responses --------------------------------------------------------------------------


def _usage(req: RequestHandle) -> dict[str, Any]:
    prompt = len(req.prompt_token_ids)
    completion = len(req.output_token_ids)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens or 0},
    }


def _delta_text(index: int, ids: Sequence[int]) -> str:
    text = tok.decode(ids)
    return text if index == 0 or not text else " " + text


class _Kind:
    """What differs between completions and chat completions."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def choice(self, req: RequestHandle, return_ids: bool) -> dict[str, Any]:
        text = tok.decode(req.output_token_ids)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = None
        else:
            choice.update(text=text, logprobs=None, prompt_logprobs=None)
        choice.update(finish_reason=req.finish_reason, stop_reason=None)
        if return_ids:
            choice["prompt_token_ids"] = req.prompt_token_ids
            choice["token_ids"] = req.output_token_ids
        return choice

    def chunk_choice(self, text: str, finish: str | None, role: bool) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }


async def _serve(
    engine: Engine, info: ReplicaInfo, kind: _Kind, body: Mapping[str, Any], ids: list[int]
) -> Response:
    max_tokens = _max_tokens(body, len(ids), info, "max_tokens", "max_completion_tokens")
    stream, include_usage, skip_reading, return_ids = _common_options(body, kind.chat)
    try:
        req = engine.submit(
            ids, max_tokens, skip_reading=skip_reading, keys=_request_keys(body, info)
        )
    except EngineError as exc:
        raise ApiError(str(exc), 503, "ServiceUnavailableError") from None
    rid = kind.id_prefix + uuid.uuid4().hex
    created = int(time.time())
    if not stream:
        try:
            await req.result()
        except EngineError as exc:
            raise ApiError(str(exc)) from None
        finally:
            engine.abort(req)  # no-op once finished; frees blocks if we were cancelled
        payload = {
            "id": rid,
            "object": kind.object,
            "created": created,
            "model": info.model_name,
            "choices": [kind.choice(req, return_ids)],
            "usage": _usage(req),
        }
        return Response(_encode(payload), media_type=_JSON)

    deltas = req.stream()
    try:
        first = await anext(deltas)
    except EngineError as exc:
        raise ApiError(str(exc)) from None
    except StopAsyncIteration:  # aborted before the first token
        raise ApiError("request aborted", 503, "ServiceUnavailableError") from None
    except BaseException:
        engine.abort(req)
        raise
    head = {"id": rid, "object": kind.chunk_object, "created": created, "model": info.model_name}

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body = dict(head, choices=choices)
        if usage is not None:
            body["usage"] = usage
        return b"data: " + _encode(body) + b"\n\n"

    async def events() -> AsyncIterator[bytes]:
        index = 0
        try:
            if kind.chat:
                yield chunk([kind.chunk_choice("", None, role=True)])
            pending: list[int] | None = first
            async for nxt in deltas:
                # Hold one delta back so the last one carries finish_reason.
                if pending is not None:
                    yield chunk([kind.chunk_choice(_delta_text(index, pending), None, False)])
                    index += len(pending)
                pending = nxt
            if pending is not None:
                text = _delta_text(index, pending)
                yield chunk([kind.chunk_choice(text, req.finish_reason, False)])
            if include_usage:
                yield chunk([], _usage(req))
        except EngineError as exc:
            yield b"data: " + _error_body(str(exc), "InternalServerError", 500) + b"\n\n"
        finally:
            engine.abort(req)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# -- metrics ----------------------------------------------------------------------------


def _metric(
    out: list[str], name: str, kind: str, help_: str, samples: list[tuple[str, float]]
) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        out.append(f"{name}{{{labels}}} {float(value)!r}")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(engine: Engine, info: ReplicaInfo) -> str:
    """Prometheus text exposition (format 0.0.4) with vLLM's metric names and labels."""
    st = engine.stats
    base = f'engine="{info.data_parallel_rank}",model_name="{_escape(info.model_name)}"'
    gauges_and_counters: list[tuple[str, str, str, float]] = [
        ("vllm:num_requests_running", "gauge", "Requests in model execution batches.",
         engine.num_running),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.",
         engine.num_waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         engine.pool.usage),
        ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.",
         st.prefix_cache_queries),
        ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.",
         st.prefix_cache_hits),
        ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.",
         st.preemptions),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         st.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         st.generation_tokens),
    ]  # fmt: skip
    out: list[str] = [
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {info.started!r}",
    ]
    for name, kind, help_, value in gauges_and_counters:
        _metric(out, name, kind, help_, [(base, value)])
    success = [
        (f'{base},finished_reason="{reason}"', n)
        for reason, n in sorted(st.finished.items())
        if reason != "error"
    ]
    _metric(out, "vllm:request_success_total", "counter", "Requests finished, by reason.", success)
    # vLLM's info gauge carries the cache config as labels (the router reads num_gpu_blocks)
    cache_info = f'{base},num_gpu_blocks="{engine.pool.num_blocks}"'
    _metric(out, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
            [(cache_info, 1.0)])  # fmt: skip
    h = st.ttft
    name = "vllm:time_to_first_token_seconds"
    out.append(f"# HELP {name} Histogram of time to first token in seconds.")
    out.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
        cumulative += count
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        out.append(f'{name}_bucket{{{base},le="{le}"}} {float(cumulative)!r}')
    out.append(f"{name}_count{{{base}}} {float(h.count)!r}")
    out.append(f"{name}_sum{{{base}}} {float(h.sum)!r}")
    return "\n".join(out) + "\n"


# -- the app ----------------------------------------------------------------------------


def create_app(
    engine: Engine,
    info: ReplicaInfo | None = None,
    *,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """A FastAPI app serving ``engine``; the engine starts and stops with the app's lifespan
    (so it runs on the server's event loop). ``on_shutdown`` runs after the engine stopped
    (the CLI closes the publisher there)."""
    info = info if info is not None else ReplicaInfo()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="kvrouter simulated vLLM replica", lifespan=lifespan)
    app.state.engine = engine
    app.state.info = info

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        msg = f"{exc.detail}: {request.method} {request.url.path}"
        return _error_response(ApiError(msg, exc.status_code, type_))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        _check_model(body, info)
        return await _serve(engine, info, _Kind(chat=False), body, _completion_prompt(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        _check_model(body, info)
        return await _serve(engine, info, _Kind(chat=True), body, _chat_prompt(body))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _json_body(request)
        _check_model(body, info)
        if "messages" in body:
            ids = _chat_prompt(body)
        elif "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ApiError("'prompt' must be a string for /tokenize")
            ids = tok.encode(prompt, add_bos=_bool(body, "add_special_tokens", True))
        else:
            raise ApiError("/tokenize needs 'prompt' (a string) or 'messages' (a chat)")
        payload = {
            "count": len(ids),
            "max_model_len": info.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        return Response(_encode(payload), media_type=_JSON)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _json_body(request)
        _check_model(body, info)
        ids = body.get("tokens")
        if not isinstance(ids, list):
            raise ApiError("'tokens' is required: a list of token ids")
        return Response(_encode({"prompt": tok.decode(_token_list(ids))}), media_type=_JSON)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": info.model_name,
            "object": "model",
            "created": info.created,
            "owned_by": "vllm",
            "root": info.model_name,
            "parent": None,
            "max_model_len": info.max_model_len,
            "permission": [],
        }
        # as vLLM lists adapters (entrypoints/openai/models/serving.py): root is the path
        adapters = [
            {**card, "id": name, "root": path, "parent": info.model_name}
            for name, path in info.lora_modules.items()
        ]
        return Response(_encode({"object": "list", "data": [card, *adapters]}), media_type=_JSON)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            render_metrics(engine, info), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not engine.reset_prefix_cache():
            raise ApiError(
                "the prefix cache was not reset: requests still hold KV blocks; "
                "retry when the replica is idle",
                409,
                "ConflictError",
            )
        return Response(status_code=200)

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        payload = {"data_parallel_size": len(info.event_sources), "sources": info.event_sources}
        return Response(_encode(payload), media_type=_JSON)

    return app
