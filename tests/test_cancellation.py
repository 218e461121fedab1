"""Cancellation and time limits end to end: a client that leaves, a replica that hangs, a
prompt that takes long to tokenize.

A router in front of three fake replicas (real uvicorn servers on 127.0.0.1, real ZeroMQ
events), driven by raw sockets so a test controls exactly when the client's connection
closes. The fakes record when the router closed a request before its answer was complete
(``FakeReplica.disconnects``): what vLLM sees when it aborts a request.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from fake_replica import MODEL, FakeReplica
from test_proxy import Cluster, _knobs, words  # noqa: F401  (_knobs: autouse, on this cluster)
from zmq_helpers import wait_for

TTFB_STREAM = 0.3
TTFB_JSON = 0.6
ATTEMPTS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(
        ttfb_timeout_s=TTFB_STREAM,
        ttfb_timeout_nonstream_s=TTFB_JSON,
        read_timeout_s=30.0,
        max_attempts=ATTEMPTS,
    ) as c:
        yield c


def fakes(cluster: Cluster) -> list[FakeReplica]:
    return [f for f, _ in cluster.fakes.values()]


def open_request(cluster: Cluster, body: dict[str, Any]) -> socket.socket:
    """A client connection with ``POST /v1/completions`` sent in full."""
    data = msgspec.json.encode(body)
    s = socket.create_connection(("127.0.0.1", cluster.router.port), timeout=10)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: kvrouter\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(data), data)
    )
    return s


def read_until(s: socket.socket, count: int, needle: bytes) -> bytes:
    """What the router sent until ``needle`` occurred ``count`` times (socket timeout 10 s)."""
    got = b""
    while got.count(needle) < count:
        chunk = s.recv(65536)
        assert chunk, f"the router closed the connection; got {got!r}"
        got += chunk
    return got


def header(head: bytes, name: bytes) -> str:
    for line in head.split(b"\r\n"):
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip().decode()
    raise AssertionError(f"no {name!r} header in {head!r}")


def close_seen_after(cluster: Cluster, before: list[int], t0: float) -> float:
    """Seconds from ``t0`` (the client's close) until the replica holding the request saw
    its connection closed: waits until every fake released its requests."""
    wait_for(lambda: all(f.held == 0 for f in fakes(cluster)), 10, "the upstream to see the close")
    seen = [t for f, n in zip(fakes(cluster), before, strict=True) for t in f.disconnects[n:]]
    assert seen, "no replica saw a request closed"
    return max(seen) - t0


def test_client_disconnect_mid_stream_closes_the_upstream_at_once(cluster: Cluster) -> None:
    """The replica streams a token every 20 ms (2,000 of them: 40 s); the client reads two
    events and hangs up; the replica's stream is cancelled within 0.5 s."""
    for f in fakes(cluster):
        f.token_interval_s = 0.02
    waiting = cluster.sample("kvrouter_client_disconnects_total", pool=MODEL, phase="streaming")
    before = [len(f.disconnects) for f in fakes(cluster)]
    body = {"model": MODEL, "prompt": words(41, 64), "stream": True, "max_tokens": 2000}
    with open_request(cluster, body) as s:
        got = read_until(s, 2, b"data: ")
        assert got.startswith(b"HTTP/1.1 200")
        replica = header(got.split(b"\r\n\r\n")[0], b"x-kvrouter-replica")
        t0 = time.monotonic()
    latency = close_seen_after(cluster, before, t0)
    print(f"\nmid-stream disconnect: the replica saw the close {latency * 1000:.1f} ms later")
    assert latency < 0.5
    assert cluster.fake(replica).disconnects[before[list(cluster.fakes).index(replica)] :]
    wait_for(
        lambda: (
            cluster.sample("kvrouter_client_disconnects_total", pool=MODEL, phase="streaming")
            == waiting + 1
        ),
        5,
        "the disconnect counted",
    )
    wait_for(lambda: cluster.sample("kvrouter_in_flight", replica=replica) == 0, 5, "in flight 0")


def test_client_disconnect_while_waiting_for_a_json_answer(cluster: Cluster) -> None:
    """A non-streaming request held by the replica (vLLM answers only when done): the
    client's close reaches the replica within 0.5 s, and nothing is failed over."""
    for f in fakes(cluster):
        f.stall = True
    counted = cluster.sample("kvrouter_client_disconnects_total", pool=MODEL, phase="waiting")
    failovers = sum(
        cluster.sample("kvrouter_failovers_total", pool=MODEL, replica=n) for n in cluster.fakes
    )
    before = [len(f.disconnects) for f in fakes(cluster)]
    requests = [f.requests for f in fakes(cluster)]
    with open_request(cluster, {"model": MODEL, "prompt": words(42, 64)}):
        wait_for(lambda: sum(f.held for f in fakes(cluster)) == 1, 10, "a replica holding it")
        t0 = time.monotonic()
    latency = close_seen_after(cluster, before, t0)
    print(f"\ndisconnect while waiting: the replica saw the close {latency * 1000:.1f} ms later")
    assert latency < 0.5
    wait_for(
        lambda: (
            cluster.sample("kvrouter_client_disconnects_total", pool=MODEL, phase="waiting")
            == counted + 1
        ),
        5,
        "the disconnect counted",
    )
    assert sum(f.requests for f in fakes(cluster)) == sum(requests) + 1  # no failover
    assert (
        sum(
            cluster.sample("kvrouter_failovers_total", pool=MODEL, replica=n) for n in cluster.fakes
        )
        == failovers
    )


def owned_prompt(cluster: Cluster, seed: int) -> tuple[str, str]:
    """A prompt whose prefix one replica holds (the router will try that one first)."""
    prompt = words(seed, 200)
    first = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    owner = first.headers["x-kvrouter-replica"]
    cluster.wait_hits(prompt + " w9", lambda h: h[owner] > 0, "owner indexed")
    return prompt + " w9", owner


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_hung_replica_times_out_and_the_request_fails_over(
    cluster: Cluster, stream: bool
) -> None:
    prompt, owner = owned_prompt(cluster, 43 + stream)
    hung = cluster.fake(owner)
    hung.stall = True
    closed = len(hung.disconnects)
    failovers = cluster.sample("kvrouter_failovers_total", pool=MODEL, replica=owner)
    t0 = time.monotonic()
    r = cluster.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "stream": stream}
    )
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.headers["x-kvrouter-replica"] != owner
    ttfb = TTFB_STREAM if stream else TTFB_JSON
    assert ttfb <= took < ttfb + 10  # it waited for the owner first, not read_timeout_s (30 s)
    assert cluster.sample("kvrouter_failovers_total", pool=MODEL, replica=owner) == failovers + 1
    # the router closed the hung request (no connection left waiting on the replica)
    wait_for(lambda: len(hung.disconnects) == closed + 1 and hung.held == 0, 5, "closed")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_all_replicas_hung_gives_a_504_after_max_attempts_ttfb(
    cluster: Cluster, stream: bool
) -> None:
    """Every replica accepts and never answers: after ``max_attempts`` TTFB limits (each
    replica once), an OpenAI-style 504, long before ``read_timeout_s`` (30 s)."""
    for f in fakes(cluster):
        f.stall = True
    ttfb = TTFB_STREAM if stream else TTFB_JSON
    t0 = time.monotonic()
    r = cluster.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": words(45, 64), "stream": stream}
    )
    took = time.monotonic() - t0
    print(f"\nall hung ({'stream' if stream else 'json'}): 504 after {took:.2f} s")
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["code"] == 504 and err["type"] == "GatewayTimeoutError"
    assert "no replica answered in time" in err["message"]  # causes (addresses) stay in the log
    assert ATTEMPTS * ttfb <= took < ATTEMPTS * ttfb + 10
    wait_for(lambda: all(f.held == 0 for f in fakes(cluster)), 5, "every hung request closed")


class _TimedTokenizer:
    """The pool's own tokenizer, with the times each ``tokenize`` call began and ended."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.strategy = inner.strategy
        self.spans: list[tuple[float, float]] = []

    async def tokenize(self, kind: Any, body: dict[str, Any]) -> Any:
        t0 = time.monotonic()
        try:
            return await self.inner.tokenize(kind, body)
        finally:
            self.spans.append((t0, time.monotonic()))

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_the_router_answers_health_while_it_tokenizes_a_huge_prompt(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4 MB prompt takes the builtin tokenizer ~0.4 s; meanwhile ``/health`` (polled one
    request at a time) is answered several times. Tokenizing on the event loop, at most one
    answer could arrive inside that span (the one sent before it began)."""
    pool = cluster.router.server.config.app.state.router.pools[MODEL]
    timed = _TimedTokenizer(pool.tokenizer)
    monkeypatch.setattr(pool, "tokenizer", timed)
    for f in fakes(cluster):
        f.fail_status = 503  # answer at once: only the router's own work matters here
    prompt = " ".join(f"x{i:09d}" for i in range(400_000))
    result: list[int] = []
    done = threading.Event()

    def big() -> None:
        try:
            with httpx.Client(base_url=cluster.router.url, timeout=60) as c:
                result.append(
                    c.post("/v1/completions", json={"model": MODEL, "prompt": prompt}).status_code
                )
        finally:
            done.set()

    answered: list[float] = []
    thread = threading.Thread(target=big)
    thread.start()
    try:
        while not done.is_set():
            assert cluster.http.get("/health").status_code == 200
            answered.append(time.monotonic())
    finally:
        thread.join(60)
    assert result == [503]
    ((start, end),) = timed.spans
    inside = [t for t in answered if start < t < end]
    took = end - start
    print(f"\n4 MB prompt tokenized in {took:.2f} s; /health answered {len(inside)} times then")
    assert len(inside) >= 2
