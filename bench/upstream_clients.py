"""The proxy's upstream client swapped for httpx or aiohttp, for the A/B in bench/proxy_bench.py.

``router.server.proxy`` forwards on ``rep.upstream``, a ``router.server.upstream.UpstreamPool``
(``post(path, body, headers)`` -> a response with ``status``, ``headers`` (lower-cased names),
``read()``, async iteration over body chunks and ``aclose()``; failures raise
``UpstreamError``). :class:`HttpxPool` and :class:`AiohttpPool` are the smallest adapters that
give the proxy the same interface on each library, used the way its documentation shows
(one client/session per replica, keep-alive pooling, streamed responses, raw bodies passed
through undecoded), so the A/B compares the clients and not adapters of different effort.

Run as the router process: ``python -m bench.upstream_clients {own,httpx,aiohttp} serve
--config FILE`` patches ``router.server.state.UpstreamPool`` (``own`` leaves it) and then runs
``router.cli.main`` with the remaining arguments.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from router.server.upstream import UpstreamConfigError, UpstreamError

try:
    import aiohttp
except ImportError:  # only the aiohttp variant needs it: pip install -e '.[dev]'
    aiohttp = None  # type: ignore[assignment]

__all__ = ["CLIENTS", "AiohttpPool", "HttpxPool", "main"]


def _check_url(url: str) -> str:
    if urlsplit(url).scheme != "http":
        raise UpstreamConfigError(f"replica url {url!r}: use http://host:port")
    return url.rstrip("/")


def _failed(exc: BaseException, *, received: bool) -> UpstreamError:
    return UpstreamError(f"{type(exc).__name__}: {exc}", received=received)


# --------------------------------------------------------------------------- httpx


class _HttpxResponse:
    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.headers = [(k.lower(), v) for k, v in resp.headers.raw]

    async def read(self) -> bytes:
        return b"".join([c async for c in self])

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_raw():  # as received: no content decoding
                yield chunk
        except httpx.HTTPError as exc:
            raise _failed(exc, received=True) from None

    async def aclose(self) -> None:
        await self._resp.aclose()


class HttpxPool:
    """One ``httpx.AsyncClient`` per replica (its connection pool keeps connections alive)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 600.0,
        max_idle: int = 256,
    ) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_idle)
        self._client = httpx.AsyncClient(
            base_url=_check_url(url),
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            transport=httpx.AsyncHTTPTransport(
                limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            ),
        )

    async def post(
        self,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
        *,
        ttfb_timeout: float | None = None,  # not mapped: the A/B measures answered requests
    ) -> _HttpxResponse:
        client = self._client
        request = client.build_request("POST", path, content=body, headers=list(headers))
        try:
            resp = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _failed(exc, received=False) from None
        return _HttpxResponse(resp)

    async def aclose(self) -> None:
        await self._client.aclose()


# --------------------------------------------------------------------------- aiohttp


class _AiohttpResponse:
    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = [(k.lower(), v) for k, v in resp.raw_headers]

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _failed(exc, received=True) from None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _failed(exc, received=True) from None

    async def aclose(self) -> None:
        self._resp.release()  # back to the pool if read to the end, else closed


class AiohttpPool:
    """One ``aiohttp.ClientSession`` per replica, made on first use (it needs a running loop)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 600.0,
        max_idle: int = 256,
    ) -> None:
        self._base = _check_url(url)
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._session: aiohttp.ClientSession | None = None

    async def post(
        self,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
        *,
        ttfb_timeout: float | None = None,  # not mapped: the A/B measures answered requests
    ) -> _AiohttpResponse:
        session = self._session
        if session is None:
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=self._timeout,
                auto_decompress=False,
            )
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        try:
            resp = await session.post(self._base + path, data=body, headers=hdrs)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _failed(exc, received=False) from None
        return _AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


CLIENTS: dict[str, type[Any] | None] = {"own": None, "httpx": HttpxPool, "aiohttp": AiohttpPool}
"""Bench name -> the class standing in for UpstreamPool (None: the router's own)."""


def main(argv: Sequence[str]) -> int:
    """``CLIENT kvrouter-args...``: run the kvrouter CLI with CLIENT as the upstream client."""
    if not argv or argv[0] not in CLIENTS:
        print(f"usage: upstream_clients {{{','.join(CLIENTS)}}} serve ...", file=sys.stderr)
        return 2
    if argv[0] == "aiohttp" and aiohttp is None:
        print(
            "upstream_clients: aiohttp is not installed (pip install -e '.[dev]')",
            file=sys.stderr,
        )
        return 2
    pool_cls = CLIENTS[argv[0]]
    if pool_cls is not None:
        from router.server import state

        state.UpstreamPool = pool_cls  # type: ignore[misc]
    from router.cli import main as cli_main

    return cli_main(list(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
