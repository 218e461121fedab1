"""router.server.upstream against real loopback servers answering what each test scripts."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from router.server.upstream import UpstreamConfigError, UpstreamError, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""Serves one request on a connection (the int counts requests on it); False closes it."""


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return lines[0], headers, body


class Server:
    """An asyncio TCP server on 127.0.0.1 running a scripted handler per request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[bytes, dict[bytes, bytes], bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                try:
                    req = await read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self.requests.append(req)
                try:
                    keep = await self.handler(reader, writer, n)
                    await writer.drain()
                except ConnectionError:  # the client hung up first (a test's point)
                    return
                n += 1
                if not keep:
                    return
        finally:
            writer.close()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def answer(body: bytes) -> Handler:
    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(ok(body, b"X-Custom: Yes\r\n"))
        return True

    return h


def test_content_length_and_keep_alive_reuse() -> None:
    async def main() -> None:
        async with Server(await answer(b'{"ok":true}')) as srv:
            pool = UpstreamPool(srv.url + "/base/")
            for i in range(3):
                resp = await pool.post("/v1/x", b"body%d" % i, [(b"x-request-id", b"r%d" % i)])
                assert resp.status == 200
                assert (b"x-custom", b"Yes") in resp.headers  # names lower-cased
                assert await resp.read() == b'{"ok":true}'
                await resp.aclose()
            assert pool.connects == 1 and srv.connections == 1
            line, headers, body = srv.requests[2]
            assert line == b"POST /base/v1/x HTTP/1.1"
            assert headers[b"host"] == srv.url.removeprefix("http://").encode()
            assert headers[b"x-request-id"] == b"r2" and body == b"body2"
            await pool.aclose()

    run(main())


def test_chunked_stream_arrives_in_pieces_and_concurrent_requests_use_own_connections() -> None:
    gate: asyncio.Event

    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata: \r\n")
        await writer.drain()
        await gate.wait()
        writer.write(b"5\r\nhello\r\n0\r\n\r\n")
        return True

    async def main() -> None:
        nonlocal gate
        gate = asyncio.Event()
        async with Server(h) as srv:
            pool = UpstreamPool(srv.url)
            r1 = await pool.post("/s", b"a")
            r2 = await pool.post("/s", b"b")
            it = r1.__aiter__()
            assert await it.__anext__() == b"data: "  # before the rest exists
            gate.set()
            rest = [c async for c in it]
            assert b"".join(rest) == b"hello"
            assert await r2.read() == b"data: hello"
            await r1.aclose()
            await r2.aclose()
            assert pool.connects == 2 and len(pool._idle) == 2
            await pool.aclose()

    run(main())


def test_body_until_close_is_read_and_connection_not_reused() -> None:
    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        return False

    async def main() -> None:
        async with Server(h) as srv:
            pool = UpstreamPool(srv.url)
            for _ in range(2):
                resp = await pool.post("/", b"")
                assert await resp.read() == b"all of it"
                await resp.aclose()
            assert pool.connects == 2 and not pool._idle

    run(main())


def test_connect_error_and_read_timeout() -> None:
    async def main() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, not listening: connection refused
            pool = UpstreamPool(f"http://127.0.0.1:{port}", connect_timeout=2)
            with pytest.raises(UpstreamError, match="ConnectError") as ei:
                await pool.post("/", b"x")
            assert not ei.value.received

        never = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int):
            await never.wait()
            return False

        async with Server(silent) as srv:
            pool = UpstreamPool(srv.url, read_timeout=0.2)
            # no ttfb_timeout: the wait for the first byte is bounded by read_timeout
            with pytest.raises(UpstreamError, match=r"TTFBTimeout.* 0\.2 s") as ei:
                await pool.post("/", b"x")
            assert ei.value.timeout and not ei.value.received
            assert not pool._idle and not pool._busy
            never.set()

    run(main())


def test_ttfb_timeout_is_separate_from_the_idle_timeout() -> None:
    """``ttfb_timeout`` bounds the wait for the first byte; after it ``read_timeout`` bounds
    each silence: a replica that answers at once and then pauses longer than the TTFB limit
    (but less than the idle limit) is fine, a silent one fails after the TTFB limit."""
    never = asyncio.Event()

    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 1:
            await never.wait()  # the second request gets no answer at all
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)  # the scripted replica pauses 0.5 s (> ttfb_timeout)
        writer.write(b"3\r\ndef\r\n0\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(h) as srv:
            pool = UpstreamPool(srv.url, read_timeout=10)
            loop = asyncio.get_running_loop()
            resp = await pool.post("/", b"1", ttfb_timeout=0.2)
            assert [c async for c in resp] == [b"abc", b"def"]
            await resp.aclose()
            t0 = loop.time()
            with pytest.raises(UpstreamError, match=r"TTFBTimeout.* 0\.2 s") as ei:
                await pool.post("/", b"2", ttfb_timeout=0.2)
            assert ei.value.timeout and not ei.value.received
            assert 0.2 <= loop.time() - t0 < 5  # not the 10 s read_timeout
            assert not pool._idle and not pool._busy  # the silent connection is closed
            never.set()

    run(main())


def test_ttfb_timeout_covers_a_replica_that_does_not_read_the_request() -> None:
    """A listener that never accepts (a stopped process: the kernel completes the handshake
    and buffers what it can): writing a body larger than the socket buffers blocks, and the
    TTFB limit ends that wait too."""

    async def main() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as s:
            s.bind(("127.0.0.1", 0))
            s.listen(8)
            pool = UpstreamPool(f"http://127.0.0.1:{s.getsockname()[1]}", read_timeout=30)
            with pytest.raises(UpstreamError, match="TTFBTimeout") as ei:
                await pool.post("/", b"x" * (64 << 20), ttfb_timeout=0.3)
            assert ei.value.timeout
            assert not pool._busy and not pool._idle

    run(main())


def test_idle_connection_closed_by_server_is_replaced_transparently() -> None:
    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 1:  # the keep-alive race: the server drops the reused connection unanswered
            return False
        writer.write(ok(b"fine"))
        return True

    async def main() -> None:
        async with Server(h) as srv:
            pool = UpstreamPool(srv.url)
            resp = await pool.post("/", b"1")
            await resp.read()
            await resp.aclose()
            assert len(pool._idle) == 1
            resp = await pool.post("/", b"2")
            assert await resp.read() == b"fine"
            await resp.aclose()
            assert pool.connects == 2
            assert [r[2] for r in srv.requests] == [b"1", b"2", b"2"]

    run(main())


def test_timeout_on_reused_connection_is_not_retried() -> None:
    never = asyncio.Event()

    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 1:
            await never.wait()
        writer.write(ok(b"x"))
        return True

    async def main() -> None:
        async with Server(h) as srv:
            pool = UpstreamPool(srv.url, read_timeout=0.2)
            resp = await pool.post("/", b"1")
            await resp.read()
            await resp.aclose()
            with pytest.raises(UpstreamError, match="TTFBTimeout"):
                await pool.post("/", b"2")
            assert len(srv.requests) == 2  # sent once: a slow server is not a closed one
            never.set()

    run(main())


def test_death_mid_body_and_malformed_response() -> None:
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        return False

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int):
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        return False

    async def main() -> None:
        async with Server(dies) as srv:
            pool = UpstreamPool(srv.url)
            resp = await pool.post("/", b"")
            got = []
            with pytest.raises(UpstreamError, match="mid-response") as ei:
                async for chunk in resp:
                    got.append(chunk)
            assert ei.value.received and b"".join(got) == b"partial"
            await resp.aclose()
            assert not pool._idle
        async with Server(garbage) as srv:
            pool = UpstreamPool(srv.url)
            with pytest.raises(UpstreamError, match="malformed") as ei:
                await pool.post("/", b"")
            assert ei.value.received

    run(main())


def test_interim_response_large_body_and_unread_body_not_pooled() -> None:
    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(ok(b"z" * 3_000_000))
        return True

    async def main() -> None:
        async with Server(h) as srv:
            pool = UpstreamPool(srv.url)
            big = b"y" * 5_000_000
            resp = await pool.post("/", big)
            assert resp.status == 200
            assert await resp.read() == b"z" * 3_000_000
            await resp.aclose()
            assert srv.requests[0][2] == big
            resp = await pool.post("/", b"")
            await resp.aclose()  # not read to the end: the connection cannot be reused
            assert not pool._idle

    run(main())


def test_bad_url() -> None:
    with pytest.raises(UpstreamConfigError, match="plain HTTP"):
        UpstreamPool("https://example.invalid")
