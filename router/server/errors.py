"""Every error the router answers is an OpenAI error, whatever the path and whatever broke.

Clients of an OpenAI-compatible server (the ``openai`` SDK, vLLM's benchmarks, LangChain)
read ``{"error": {"message", "type", "param", "code"}}`` and raise a typed exception from the
status; a plain-text 500 or FastAPI's ``{"detail": ...}`` gives them nothing to read. So:

* :func:`error_body` / :func:`send_error` write one, for the raw-ASGI faces (the proxy and
  the doors of :mod:`router.server.doors`);
* :func:`install_error_handlers` makes the FastAPI side (``/v1/models``, ``/health``,
  ``/admin``, unknown paths, wrong methods, validation failures) answer the same shape;
* :func:`json_errors` wraps the whole app, so a bug anywhere still answers a JSON 500 (when
  no response byte has gone yet) and is logged once, not as an unhandled ASGI exception.

``type`` is the name the ``openai`` SDK gives the status (``BadRequestError``,
``AuthenticationError``, ...; vLLM uses the same names); ``code`` is the HTTP status, as vLLM
sends it; ``param`` names the offending body field when there is one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

__all__ = [
    "ApiError",
    "error_body",
    "error_type",
    "install_error_handlers",
    "json_errors",
    "send_error",
]

log = logging.getLogger("kvrouter.errors")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
}
_encode = msgspec.json.encode

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class ApiError(HTTPException):
    """An error a FastAPI handler raises to answer ``status`` with ``message`` (and the body
    field ``param`` it is about)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, headers)
        self.param = param


def error_type(status: int) -> str:
    """The OpenAI SDK's exception name for ``status`` (``MethodNotAllowedError`` for 405)."""
    known = _TYPES.get(status)
    if known is not None:
        return known
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    return "".join(w[:1].upper() + w[1:] for w in phrase.replace("-", " ").split()) + "Error"


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The JSON bytes of an OpenAI error."""
    err = {"message": message, "type": error_type(status), "param": param, "code": status}
    return _encode({"error": err})


async def send_error(
    send: Any,
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Answer a raw-ASGI request with an OpenAI error (and close it: no body to come)."""
    body = error_body(status, message, param)
    out = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


def _response(status: int, message: str, param: str | None, headers: Any = None) -> Response:
    return Response(
        error_body(status, message, param),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _param(loc: Iterable[Any]) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or None


def install_error_handlers(
    api: FastAPI, count: Callable[[str], None] = lambda reason: None
) -> None:
    """Make every FastAPI error an OpenAI error; ``count(reason)`` is called for each."""

    async def http_error(request: Request, exc: HTTPException) -> Response:
        status = exc.status_code
        if isinstance(exc, ApiError):
            message, param = exc.detail, exc.param
        elif exc.detail and exc.detail != HTTPStatus(status).phrase:
            message, param = str(exc.detail), None
        elif status == 404:
            message, param = f"no such path: {request.url.path}", None
        elif status == 405:
            allow = exc.headers.get("Allow", "") if exc.headers else ""
            message, param = f"method {request.method} not allowed here (allowed: {allow})", None
        else:
            message, param = HTTPStatus(status).phrase, None
        if status == 400 and exc.__cause__ is not None and not isinstance(exc, ApiError):
            message = f"the body is not valid JSON ({type(exc.__cause__).__name__})"
        count(f"http_{status}")
        return _response(status, message, param, exc.headers)

    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            count("http_400")
            return _response(400, "the body is not valid JSON", None)
        text = "; ".join(
            f"{_param(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}" for e in errors
        )
        count("http_422")
        return _response(422, text or "invalid request", _param(errors[0].get("loc", ())))

    async def server_error(request: Request, exc: Exception) -> Response:
        # Starlette's ServerErrorMiddleware calls this, then re-raises to json_errors (which
        # logs it once).
        return _response(500, "internal error in the router; see its log", None)

    api.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    api.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    api.add_exception_handler(Exception, server_error)


def json_errors(app: ASGIApp) -> ASGIApp:
    """``app``, answering a JSON 500 for any exception it lets out before its response
    started (and ending the response cleanly if it had). Logged here, once."""

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await app(scope, receive, tracked)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                with contextlib.suppress(Exception):  # the client may be gone too
                    await send_error(send, 500, "internal error in the router; see its log")

    return guarded
