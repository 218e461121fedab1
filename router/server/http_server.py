"""The router's own HTTP server: uvicorn, set up in one place for ``kvrouter serve`` and tests.

Why a module: uvicorn has no limit on how long a client may take to send its request line and
headers. Its keep-alive timer is armed only after a response and disarmed by any byte
received, and nothing is armed when a connection opens; the ASGI app hears of a request only
once its headers are complete. So a client that opens connections and sends a header line now
and then (slowloris) holds each one, and a file descriptor, as long as it likes: in issue 13's
trial 200 such connections were held 40 s, and at a low fd limit they lock real clients out.

:class:`HeaderTimeoutProtocol` is uvicorn's httptools protocol (the one ``http="auto"``
picks, httptools being a dependency) with a header timer: armed when the connection opens
and, on a kept-alive connection, at the first byte of each further request; disarmed when
the header block is complete; on expiry the connection is closed and counted in
``kvrouter_header_timeouts_total``. A slow request *body* is the app's business: the proxy
reads it as it comes (``server.max_body_bytes`` bounds it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.config import ServerConfig
from router.server.metrics import RouterMetrics

__all__ = ["HeaderTimeoutProtocol", "make_server"]


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a limit on the time to a complete header block.

    The limit and the expiry hook are class attributes: uvicorn makes one protocol instance
    per connection from a class, so :func:`make_server` makes a subclass per server.
    """

    header_timeout: ClassVar[float] = 10.0
    on_header_timeout: ClassVar[Callable[[], None] | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

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
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        hook = type(self).on_header_timeout
        if hook is not None:
            hook()
        self.transport.close()


def make_server(
    app: Any,
    cfg: ServerConfig,
    *,
    metrics: RouterMetrics | None = None,
    log_level: str | None = None,
) -> uvicorn.Server:
    """The uvicorn server for ``app`` with the settings of ``cfg``.

    ``metrics``: where header timeouts are counted (the router app's
    ``app.state.router.metrics``). Run it with ``server.run()`` (listening on ``cfg.host`` and
    ``cfg.port``) or ``server.run(sockets=[...])``.
    """
    attrs: dict[str, Any] = {"header_timeout": cfg.header_timeout_s}
    if metrics is not None:
        attrs["on_header_timeout"] = staticmethod(metrics.header_timeouts.inc)
    protocol = type("RouterHTTPProtocol", (HeaderTimeoutProtocol,), attrs)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=log_level or cfg.log_level,
        access_log=False,
        lifespan="on",
        http=protocol,
        loop="auto",  # uvloop (a dependency) over plain asyncio
        proxy_headers=False,  # no X-Forwarded-* rewriting middleware on the hot path
    )
    return uvicorn.Server(config)
