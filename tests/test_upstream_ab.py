"""The A/B adapters of bench/upstream_clients.py do the proxy's work as router.server.upstream
does (tests/test_upstream.py holds the same cases for it), so bench/proxy_bench.py
--upstream-client compares clients doing the same thing; and the behaviour difference that
router/server/upstream.py's docstring cites is real."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from test_upstream import Server, answer, run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("aiohttp", reason="aiohttp comes with the dev extra: pip install -e .[dev]")

from bench.upstream_clients import AiohttpPool, HttpxPool  # noqa: E402
from router.server.upstream import UpstreamError  # noqa: E402

POOLS = [HttpxPool, AiohttpPool]


@pytest.mark.parametrize("pool_cls", POOLS, ids=lambda c: c.__name__)
def test_json_post_headers_and_reuse(pool_cls: Any) -> None:
    async def main() -> None:
        async with Server(await answer(b'{"ok":true}')) as srv:
            pool = pool_cls(srv.url + "/base/")
            for i in range(3):
                resp = await pool.post("/v1/x?a=1", b"body%d" % i, [(b"x-request-id", b"r%d" % i)])
                assert resp.status == 200
                assert (b"x-custom", b"Yes") in resp.headers  # names lower-cased, bytes
                assert await resp.read() == b'{"ok":true}'
                await resp.aclose()
            assert srv.connections == 1  # kept alive
            line, headers, body = srv.requests[2]
            assert line == b"POST /base/v1/x?a=1 HTTP/1.1"
            assert headers[b"x-request-id"] == b"r2" and body == b"body2"
            await pool.aclose()

    run(main())


@pytest.mark.parametrize("pool_cls", POOLS, ids=lambda c: c.__name__)
def test_stream_chunks_arrive_before_the_end_and_undecoded(pool_cls: Any) -> None:
    gate = asyncio.Event()

    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        # content-encoding is passed through: the proxy forwards bodies as received
        writer.write(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-encoding: gzip\r\n\r\n"
        )
        writer.write(b"6\r\ndata: \r\n")
        await writer.drain()
        await gate.wait()
        writer.write(b"5\r\nhello\r\n0\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(h) as srv:
            pool = pool_cls(srv.url)
            resp = await pool.post("/s", b"a")
            it = resp.__aiter__()
            assert await it.__anext__() == b"data: "
            gate.set()
            assert b"".join([c async for c in it]) == b"hello"
            await resp.aclose()
            await pool.aclose()

    run(main())


@pytest.mark.parametrize("pool_cls", POOLS, ids=lambda c: c.__name__)
def test_errors_are_upstream_errors(pool_cls: Any) -> None:
    never = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await never.wait()
        return False

    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        return False

    async def main() -> None:
        async with Server(silent) as srv:
            pool = pool_cls(srv.url, read_timeout=0.2)
            with pytest.raises(UpstreamError):
                await pool.post("/", b"x")
            await pool.aclose()
            never.set()
        async with Server(dies) as srv:
            pool = pool_cls(srv.url)
            resp = await pool.post("/", b"")
            with pytest.raises(UpstreamError) as ei:
                await resp.read()
            assert ei.value.received
            await resp.aclose()
            await pool.aclose()

    run(main())


@pytest.mark.parametrize("pool_cls", POOLS, ids=lambda c: c.__name__)
def test_post_on_a_reused_connection_the_server_closed_fails(pool_cls: Any) -> None:
    # UpstreamPool sends such a request once more on a fresh connection (test_upstream.py:
    # test_idle_connection_closed_by_server_is_replaced_transparently); both libraries fail
    # the POST, and the proxy would fail over to another replica.
    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nfine")
        return n == 0  # the second request's (reused) connection is dropped unanswered

    async def main() -> None:
        async with Server(h) as srv:
            pool = pool_cls(srv.url)
            resp = await pool.post("/", b"1")
            assert await resp.read() == b"fine"
            await resp.aclose()
            with pytest.raises(UpstreamError) as ei:
                await pool.post("/", b"2")
            assert not ei.value.received
            assert [r[2] for r in srv.requests] == [b"1", b"2"]
            await pool.aclose()

    run(main())
