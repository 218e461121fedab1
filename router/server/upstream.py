"""A small HTTP/1.1 keep-alive client for the proxy's upstream requests (one pool per replica).

The proxy needs little of a general HTTP client: ``POST`` with a body it already has as bytes,
a status, headers and a body it passes through. This module does that on an
:class:`asyncio.Protocol` with ``httptools``' C response parser (the parser uvicorn uses), so a
request is one ``write`` and a response a few callbacks.

Why not a library: it was A/B-tested against httpx 0.28.1 and aiohttp 3.14.5, each behind a
minimal adapter with this module's interface (``bench/upstream_clients.py``), in one run:
three routers in front of the same two fake backends, same 2,000-token prompts, every cell
measured for each client in an order rotated per repeat, median of 5 repeats (2 shared cores,
Python 3.11, uvloop)::

    bench/proxy_bench.py --upstream-client own,httpx,aiohttp --repeat 5

    router CPU ms/request          added p50 ms (router minus direct)
    mode c    own  httpx aiohttp      own   httpx  aiohttp
    json 1   0.47   1.39   0.58      0.52    1.56     0.68
    json 16  0.42   1.77   0.48      7.13   24.21     7.99
    json 64  0.41   2.23   0.50     28.13  106.61    29.04
    sse  1   0.51   1.71   0.61      0.58    1.68     0.71
    sse  16  0.42   1.95   0.53      6.61   27.56     7.50
    sse  64  0.44   2.34   0.54     27.20  133.17    27.97

This client used the least router CPU in all 30 paired samples (same repeat, same cell):
by the medians 0.06-0.11 ms (13-20 %) less than aiohttp and 3-5x less than httpx (whose pool,
h11 and anyio layers cost more than everything else the router does). A second run of
``--upstream-client aiohttp,own --repeat 5`` agreed: 30 of 30, medians 0.38-0.48 ms against
0.47-0.62 ms. At c=16/64 the router is saturated and added p50 is mostly queueing, so it
follows throughput. Behaviour differs too: when a reused keep-alive connection turns out
closed by the replica before any response byte, this client sends the request once more on a
fresh connection; httpx (RemoteProtocolError) and aiohttp (ServerDisconnectedError) fail the
POST, which the proxy would count as a replica failure and fail over. So the hand-written
client stays.

What it does, and what it deliberately does not:

* Keep-alive connections per pool, reused last-in first-out (warm sockets); a connection goes
  back to the pool only after its response was read to the end and both sides allow
  keep-alive, otherwise it is closed. Idle ones beyond ``max_idle`` are closed.
* Responses framed by ``Content-Length``, chunked transfer coding, or the end of the
  connection. Bodies are passed through as received (no content decoding).
* ``connect_timeout`` bounds the TCP connect. ``post(..., ttfb_timeout=)`` bounds the time
  from writing the request (the write included: a replica that stopped reading cannot block
  it) to the first byte of the response; after that byte, ``read_timeout`` bounds every
  silence (the same meaning as httpx's read timeout). Without ``ttfb_timeout`` the wait for
  the first byte is bounded by ``read_timeout`` too. Either expiry raises
  :class:`UpstreamError` with ``timeout=True``.
* A reused connection that the server closed while idle (keep-alive race) fails before any
  response byte; such a request is sent once more on a fresh connection. Nothing else is
  retried here: failover across replicas is the proxy's job.
* Back-pressure both ways: writing waits while the socket buffer is over its high-water mark;
  reading pauses while more than ``_READ_HIGH`` bytes of a streamed body wait for the consumer.
* No TLS, proxies, redirects, cookies or HTTP/2: replicas are plain-HTTP vLLM servers (a URL
  with ``https://`` is rejected with :class:`UpstreamConfigError` when the pool is made).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

import httptools

__all__ = [
    "UpstreamConfigError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
]

_READ_HIGH = 1 << 20
"""Streamed body bytes buffered for a slow consumer before the socket stops being read."""


class UpstreamConfigError(ValueError):
    """A replica URL this client cannot serve; the message names the fix."""


class UpstreamError(Exception):
    """A request that failed: connect error, timeout, reset, malformed response.

    ``received`` is True once any byte of the response arrived (the request reached the server
    and something came back); before that, the proxy may fail over to another replica.
    ``timeout`` is True when a time limit ended it (the proxy answers 504, not 502, when no
    replica answered in time).
    """

    def __init__(self, message: str, *, received: bool = False, timeout: bool = False) -> None:
        super().__init__(message)
        self.received = received
        self.timeout = timeout


class _Conn(asyncio.Protocol):
    """One connection; the parser's callbacks fill in the current response."""

    __slots__ = (
        "_body",
        "_buffered",
        "_drain",
        "_error",
        "_headers",
        "_loop",
        "_paused_reading",
        "_status",
        "_waiter",
        "closed",
        "done",
        "framed",
        "got_bytes",
        "headers_done",
        "keep_alive",
        "parser",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._drain: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._paused_reading = False
        self.headers_done = False
        self.done = False
        self.keep_alive = False
        self.got_bytes = False
        self.framed = False
        """The response has a Content-Length or chunked coding (else it ends at EOF)."""

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed response from the replica: {exc}", received=True))
            self.close()
            return
        if self._buffered > _READ_HIGH and not self._paused_reading and self.transport:
            self._paused_reading = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._on_end()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_end(exc)
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)  # the writer then finds the error set by _on_end

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # ------------------------------------------------------------ parser callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self.framed = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()
        if 100 <= self._status < 200:  # an interim response: the real one follows
            self._headers = []
            return
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:  # end of an interim (1xx) message
            return
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        self.done = True
        self._wake()

    # ------------------------------------------------------------------ helpers

    def _on_end(self, exc: Exception | None = None) -> None:
        if self.done:
            return
        if self.headers_done and not self.framed and exc is None:
            self.done = True  # a body delimited by the end of the connection
            self._wake()
            return
        why = f"{type(exc).__name__}: {exc}" if exc else "server closed the connection"
        where = "mid-response" if self.headers_done else "before the response"
        self._fail(UpstreamError(f"{why} ({where})", received=self.got_bytes))

    def _fail(self, err: UpstreamError) -> None:
        if self._error is None:
            self._error = err
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float, expired: str | None = None) -> None:
        """Until the parser or the socket has news, at most ``timeout`` seconds (then an
        :class:`UpstreamError` saying ``expired``, or that the replica was silent)."""
        if self._error is not None:
            raise self._error
        fut = self._waiter = self._loop.create_future()
        why = expired or f"ReadTimeout: no data from the replica for {timeout} s"
        handle = self._loop.call_later(timeout, _expire, fut, why)
        try:
            await fut
        finally:
            handle.cancel()
            self._waiter = None
        if self._error is not None and not self._body:
            raise self._error

    def take_body(self) -> bytes:
        body = self._body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._paused_reading and self.transport is not None and not self.closed:
            self._paused_reading = False
            self.transport.resume_reading()
        return data

    async def write(self, data: bytes, timeout: float, expired: str) -> None:
        """Write ``data``; while the socket buffer is full, wait at most ``timeout`` seconds
        for the replica to read (then an :class:`UpstreamError` saying ``expired``)."""
        if self.transport is None or self.closed:
            raise UpstreamError("the connection to the replica is closed", received=False)
        self.transport.write(data)
        drain = self._drain
        if drain is not None and not drain.done():
            handle = self._loop.call_later(timeout, _expire, drain, expired)
            try:
                await drain
            finally:
                handle.cancel()
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(fut: asyncio.Future[None], message: str) -> None:
    if not fut.done():
        fut.set_exception(UpstreamError(message, timeout=True))


class UpstreamResponse:
    """A response being received. Read it with :meth:`read` or iterate its body chunks; then
    :meth:`aclose` (idempotent) returns the connection to the pool or closes it."""

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, pool: UpstreamPool, conn: _Conn) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self.status: int = conn._status
        self.headers: list[tuple[bytes, bytes]] = conn._headers
        """Header names lower-cased, values as received."""

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        async for chunk in self:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (what has arrived since the last one, joined)."""
        conn = self._conn
        if conn is None:
            return
        timeout = self._pool.read_timeout
        while True:
            if conn._body:
                yield conn.take_body()
                continue
            if conn.done:
                return
            await conn.wait(timeout)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn)


class UpstreamPool:
    """Keep-alive connections to one replica (``http://host:port``)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 600.0,
        max_idle: int = 256,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise UpstreamConfigError(
                f"replica url {url!r}: the proxy speaks plain HTTP/1.1; use http://host:port "
                "(terminate TLS in front of the replica if needed)"
            )
        self.host = parts.hostname
        self.port = parts.port or 80
        self.base_path = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_header = (host if parts.port is None else f"{host}:{self.port}").encode()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self.connects = 0
        """Connections opened so far (tests check reuse with it)."""

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(loop), self.host, self.port),
                self.connect_timeout,
            )
        except TimeoutError:
            raise UpstreamError(
                f"ConnectTimeout: {self.host}:{self.port} did not accept within "
                f"{self.connect_timeout} s"
            ) from None
        except OSError as exc:
            raise UpstreamError(f"ConnectError: {self.host}:{self.port}: {exc}") from None
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:
            # Nagle's algorithm + the replica's delayed ACK can hold a small write ~40 ms.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connects += 1
        return conn

    def _acquire_idle(self) -> _Conn | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _release(self, conn: _Conn) -> None:
        self._busy.discard(conn)
        if (
            conn.closed
            or not conn.done
            or conn._body
            or conn._error is not None
            or not conn.keep_alive
            or len(self._idle) >= self.max_idle
        ):
            conn.close()
            return
        conn._reset()
        self._idle.append(conn)

    def head(self, path: str, headers: Sequence[tuple[bytes, bytes]], body_len: int) -> bytes:
        """The request line and headers (``host`` and ``content-length`` are set here)."""
        lines = [
            b"POST ",
            (self.base_path + path).encode("latin-1"),
            b" HTTP/1.1\r\nhost: ",
            self._host_header,
            b"\r\ncontent-length: ",
            str(body_len).encode(),
            b"\r\n",
        ]
        for k, v in headers:
            lines += (k, b": ", v, b"\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def post(
        self,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
        *,
        ttfb_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send ``POST path`` and wait for the response's status and headers.

        ``headers`` must not hold ``host``, ``content-length`` or hop-by-hop headers (the
        proxy drops them). ``ttfb_timeout``: at most this many seconds from the start of the
        write to the response's first byte (default ``read_timeout``). Raises
        :class:`UpstreamError`; ``received`` says whether any response byte came back.
        Cancelled (the client went away), it closes the connection: the replica sees the
        request end, and vLLM aborts it.
        """
        data = self.head(path, headers, len(body)) + body
        ttfb = self.read_timeout if ttfb_timeout is None else ttfb_timeout
        expired = f"TTFBTimeout: no response from the replica within {ttfb} s"
        loop = asyncio.get_running_loop()
        conn = self._acquire_idle()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        while True:
            self._busy.add(conn)
            try:
                deadline = loop.time() + ttfb
                await conn.write(data, ttfb, expired)
                while not conn.headers_done:
                    if conn.got_bytes:  # it answers: now only silences are bounded
                        await conn.wait(self.read_timeout)
                        continue
                    try:
                        await conn.wait(max(0.0, deadline - loop.time()), expired)
                    except UpstreamError as exc:
                        if not (exc.timeout and conn.got_bytes):
                            raise
                return UpstreamResponse(self, conn)
            except UpstreamError:
                self._busy.discard(conn)
                # ended (EOF or reset, not a timeout) before any byte of a response
                ended_early = conn._error is not None and not conn.got_bytes
                conn.close()
                if reused and ended_early:
                    # the server closed this idle keep-alive connection as we reused it
                    reused = False
                    conn = await self._connect()
                    continue
                raise
            except BaseException:
                self._busy.discard(conn)
                conn.close()
                raise

    async def aclose(self) -> None:
        """Close every connection, idle or busy."""
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
