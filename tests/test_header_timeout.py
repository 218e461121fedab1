"""Slowloris: the router's HTTP server closes connections whose request headers do not
arrive within ``server.header_timeout_s``, and serves real clients meanwhile; header blocks
over ``server.max_header_bytes`` get 431.

The router runs on the server ``kvrouter serve`` runs (router.server.http_server.make_server,
through tests/fake_replica.py's ServerThread), in front of three fake replicas.
"""

from __future__ import annotations

import selectors
import socket
import statistics
import time
from collections.abc import Iterator

import msgspec
import pytest
from fake_replica import MODEL
from test_proxy import Cluster, words

from router.config import ServerConfig

HEADER_TIMEOUT = 1.5
SLOW = 200
EARLY = 0.01
"""How much earlier than the limit a close may be seen: the server may accept a connection
before the client's clock reading after ``connect``, and uvloop's timers round to 1 ms."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(header_timeout_s=HEADER_TIMEOUT) as c:
        yield c


def connect(cluster: Cluster) -> socket.socket:
    return socket.create_connection(("127.0.0.1", cluster.router.port), timeout=10)


def wait_closed(socks: dict[socket.socket, float], deadline_s: float) -> dict[socket.socket, float]:
    """Seconds from each socket's start time until the router closed it (EOF or reset);
    sockets still open after ``deadline_s`` are left out."""
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + deadline_s
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(4096)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed[s] = time.monotonic() - socks[s]
                    sel.unregister(s)
    return closed


def test_slowloris_connections_are_closed_after_the_header_timeout(cluster: Cluster) -> None:
    counted = cluster.sample("kvrouter_header_refusals_total", reason="timeout")
    socks: dict[socket.socket, float] = {}
    try:
        for i in range(SLOW):
            t = time.monotonic()
            s = connect(cluster)
            socks[s] = t
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: kvrouter\r\nx-slow-%d: " % i)
        # a real client is served while the slow ones are held
        r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": words(51, 40)})
        assert r.status_code == 200
        assert cluster.http.get("/health").status_code == 200
        served = time.monotonic()
        closed = wait_closed(socks, HEADER_TIMEOUT + 20)
        assert len(closed) == SLOW, f"{SLOW - len(closed)} slowloris connections still open"
        times = sorted(closed.values())
        print(
            f"\n{SLOW} slowloris connections closed {times[0]:.2f} / "
            f"{statistics.median(times):.2f} / {times[-1]:.2f} s (min/median/max) after "
            f"opening; header_timeout_s = {HEADER_TIMEOUT}"
        )
        assert times[0] >= HEADER_TIMEOUT - EARLY  # not before the limit
        assert served < min(socks[s] + t for s, t in closed.items())  # served meanwhile
        assert cluster.sample("kvrouter_header_refusals_total", reason="timeout") == counted + SLOW
    finally:
        for s in socks:
            s.close()


def test_a_silent_connection_is_closed_too(cluster: Cluster) -> None:
    t = time.monotonic()
    with connect(cluster) as s:
        closed = wait_closed({s: t}, HEADER_TIMEOUT + 20)
        assert len(closed) == 1 and closed[s] >= HEADER_TIMEOUT - EARLY


def test_a_kept_alive_connection_gets_the_limit_for_each_request(cluster: Cluster) -> None:
    """After a full request and its answer, the next request's headers are limited too
    (uvicorn's own keep-alive timer stops at the first byte of the next request)."""
    with connect(cluster) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: kvrouter\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got or not got.endswith(b"}"):
            chunk = s.recv(4096)
            assert chunk
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
        t = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nhost: kvr")
        closed = wait_closed({s: t}, HEADER_TIMEOUT + 20)
        assert len(closed) == 1 and closed[s] >= HEADER_TIMEOUT - EARLY


def get_health(s: socket.socket) -> None:
    s.sendall(b"GET /health HTTP/1.1\r\nhost: kvrouter\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got or not got.endswith(b"}"):
        chunk = s.recv(4096)
        assert chunk, "the router closed a kept-alive connection"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200")


def test_an_idle_kept_alive_connection_lives_keep_alive_s_then_closes() -> None:
    """``server.keep_alive_s`` reaches uvicorn: the idle connection is reused, and closed
    neither before the setting nor at uvicorn's own 5 s. (Its default, 75 s, is above client
    pools' and load balancers' idle lifetimes, so they close first: router.config.)"""
    keep = 1.0
    assert ServerConfig().keep_alive_s > 60
    with Cluster(keep_alive_s=keep) as c, connect(c) as s:
        get_health(s)
        get_health(s)  # the same connection, kept alive
        t = time.monotonic()
        closed = wait_closed({s: t}, keep + 20)
        assert len(closed) == 1
        assert keep - EARLY <= closed[s] < keep + 2.0, closed[s]
        assert c.sample("kvrouter_header_refusals_total", reason="timeout") == 0


def read_all(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def test_oversized_headers_get_431_and_the_connection_closes(cluster: Cluster) -> None:
    counted = cluster.sample("kvrouter_header_refusals_total", reason="too_large")
    with connect(cluster) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: kvrouter\r\nx-big: " + b"a" * 70_000)
        got = read_all(s)  # until the router closes
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431")
    err = msgspec.json.decode(body)["error"]
    assert err["code"] == 431 and "server.max_header_bytes" in err["message"]
    assert cluster.sample("kvrouter_header_refusals_total", reason="too_large") == counted + 1


def test_large_headers_under_the_limit_and_large_bodies_are_served(cluster: Cluster) -> None:
    """Only the header block counts: 60 KB of headers pass, and a 2 MB body sent with its
    headers in one write is read as a body (the router answers it: not JSON, 400)."""
    r = cluster.http.get("/health", headers={"x-big": "a" * 60_000})
    assert r.status_code == 200
    body = b"x" * (2 << 20)
    with connect(cluster) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: kvrouter\r\nconnection: close\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = read_all(s)
    assert got.startswith(b"HTTP/1.1 400"), got[:200]
