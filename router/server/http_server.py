"""The router's own HTTP server: uvicorn, set up in one place for ``kvrouter serve`` and tests.

Why a module: uvicorn limits neither how long a client may take to send its request line and
headers nor how large they may be. Its keep-alive timer is armed only after a response and
disarmed by any byte received, and nothing is armed when a connection opens; the ASGI app
hears of a request only once its headers are complete. So a client that opens connections and
sends a header line now and then (slowloris) holds each one, and a file descriptor, as long as
it likes: in issue 13's trial 200 such connections were held 40 s, and at a low fd limit they
lock real clients out. And a client may send one endless header (50 MB in 5 s were taken in,
in memory, without complaint).

:class:`HeaderTimeoutProtocol` is uvicorn's httptools protocol (the one ``http="auto"``
picks, httptools being a dependency) with a header timer: armed when the connection opens
and, on a kept-alive connection, at the first byte of each further request; disarmed when
the header block is complete; on expiry the connection is closed. While the timer runs the
bytes received are counted too, and past ``server.max_header_bytes`` the client gets a 431
and the connection is closed. Both are counted in ``kvrouter_header_refusals_total{reason}``.
A slow request *body* is the app's business: the proxy reads it as it comes
(``server.max_body_bytes`` bounds its size).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.config import ServerConfig
from router.server.metrics import RouterMetrics

__all__ = ["HeaderTimeoutProtocol", "make_server"]


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with limits on the time to a complete header block and on
    its size.

    The limits and the refusal hook (called with ``"timeout"`` or ``"too_large"``) are class
    attributes: uvicorn makes one protocol instance per connection from a class, so
    :func:`make_server` makes a subclass per server. The size is counted per chunk read while
    headers are awaited, so a chunk that ends one request and starts a pipelined one counts
    whole against the second (clients seldom pipeline; the limit is meant to be generous).
    """

    header_timeout: ClassVar[float] = 10.0
    max_header_bytes: ClassVar[int] = 1 << 16
    on_refusal: ClassVar[Callable[[str], None] | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is None:  # no header block in progress after this chunk
            return
        self._header_bytes += len(data)
        if self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._disarm()
            self._refuse("too_large")
            body = msgspec.json.encode(
                {
                    "error": {
                        "message": f"request headers exceed {self.max_header_bytes} bytes "
                        "(server.max_header_bytes)",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 431,
                    }
                }
            )
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a further request on a kept-alive connection
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_bytes = 0
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        self._refuse("timeout")
        self.transport.close()

    def _refuse(self, reason: str) -> None:
        hook = type(self).on_refusal
        if hook is not None:
            hook(reason)


def make_server(
    app: Any,
    cfg: ServerConfig,
    *,
    metrics: RouterMetrics | None = None,
    log_level: str | None = None,
) -> uvicorn.Server:
    """The uvicorn server for ``app`` with the settings of ``cfg``.

    ``metrics``: where refused header blocks are counted (the router app's
    ``app.state.router.metrics``). Run it with ``server.run()`` (listening on ``cfg.host`` and
    ``cfg.port``) or ``server.run(sockets=[...])``.
    """
    attrs: dict[str, Any] = {
        "header_timeout": cfg.header_timeout_s,
        "max_header_bytes": cfg.max_header_bytes,
    }
    if metrics is not None:
        refusals = metrics.header_refusals
        attrs["on_refusal"] = staticmethod(lambda reason: refusals.labels(reason).inc())
    protocol = type("RouterHTTPProtocol", (HeaderTimeoutProtocol,), attrs)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=log_level or cfg.log_level,
        # uvicorn's own loggers go through the root handler (router.server.logs: timestamps,
        # the text or JSON format) instead of uvicorn's dictConfig
        log_config=None,
        access_log=False,
        lifespan="on",
        http=protocol,
        loop="auto",  # uvloop (a dependency) over plain asyncio
        proxy_headers=False,  # no X-Forwarded-* rewriting middleware on the hot path
        # above the client pools' idle lifetime, so the client closes first (ServerConfig)
        timeout_keep_alive=cfg.keep_alive_s,  # type: ignore[arg-type]  # a float works
    )
    return uvicorn.Server(config)
