"""The proxied routes as ``/openapi.json`` describes them.

``POST /v1/completions`` and ``/v1/chat/completions`` are served by the raw-ASGI proxy
(:mod:`router.server.proxy`), which FastAPI never sees; without these declarations the
schema would not show the router's main API at all, and a schema-driven client or fuzzer
(tests/test_api_fuzz.py) would never call it. The bodies list the fields the router reads
(and refuses with 400 when their type is wrong); every other OpenAI field is allowed and
passed to the replica untouched. The handlers declared here only answer if a request could
reach FastAPI on these paths, which the dispatcher in :mod:`router.server.app` prevents.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from router.server.errors import ApiError

__all__ = ["ChatCompletionRequest", "CompletionRequest", "ErrorResponse", "document_proxied"]


class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="the openai SDK's exception name for the status")
    param: str | None = Field(description="the body field at fault, if one is")
    code: int = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """Every error the router answers (router.server.errors)."""

    error: ErrorInfo


class CompletionRequest(BaseModel):
    """An OpenAI completion request; the fields the router reads, any others passed on."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="selects the pool; optional with one pool")
    prompt: str | list[str] | list[int] | list[list[int]] | None = Field(
        None, description="text or token ids; several prompts are routed by load"
    )
    stream: bool | None = False
    cache_salt: str | None = None
    add_special_tokens: bool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """An OpenAI chat completion request; the fields the router reads, any others passed on."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="selects the pool; optional with one pool")
    messages: list[ChatMessage]
    stream: bool | None = False
    cache_salt: str | None = None


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "malformed body: invalid JSON or UTF-8, too deep, a field of the wrong type, "
              "or no model named while the router serves several"),
        (401, "server.api_key is set and the request does not carry it"),
        (404, "no pool serves this model"),
        (413, "body larger than server.max_body_bytes"),
        (502, "no replica could answer (the replicas' addresses are in the log and /admin)"),
        (503, "every replica of the pool is drained or removed"),
        ("4XX", "any other refusal (405 for another method), as an OpenAI error"),
    )
}  # fmt: skip
_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the replica's answer: JSON, or server-sent events with stream = true; "
        "headers x-kvrouter-replica, x-kvrouter-predicted-hit and x-kvrouter-expected-hit say "
        "where it went, the hit the events confirm and the hit expected at admission (with "
        "the requests routed there ahead of it)"
    }
}


def document_proxied(api: FastAPI) -> None:
    """Declare the proxied routes on ``api`` for its schema (and its 405 for other methods)."""

    async def unreachable() -> None:
        raise ApiError(500, "this route is served by the proxy; the dispatcher should have")

    async def completions(body: CompletionRequest) -> None:
        await unreachable()

    async def chat_completions(body: ChatCompletionRequest) -> None:
        await unreachable()

    for path, endpoint, summary in (
        ("/v1/completions", completions, "Completion, routed to the replica with the best hit"),
        ("/v1/chat/completions", chat_completions, "Chat completion, routed likewise"),
    ):
        api.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            summary=summary,
            tags=["openai"],
            responses={**_OK, **_ERRORS},
            response_model=None,
        )
