"""A replica that drips its ``/health`` and ``/metrics`` cannot hold the router's rounds.

A real HTTP/1.1 server on 127.0.0.1 drips: ``/health`` gets a 200 whose header grows by a byte
every 50 ms, every other GET a 200 and then one byte of a chunked body every 50 ms, for 20 s
(it stops by itself): never silent long enough for httpx's per-operation timeouts. Before
router.server.side_get such a replica held every health-probe and metrics-scrape round (each
waits for all replicas) for the whole drip, so a dead replica beside it stayed in rotation.
Checked here: the bounded GET alone (deadline, body cap, status only), and through a real
router whose pool holds the dripping replica next to three simulated ones, one of which is
then stopped.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from router.config import RouterConfig, parse_config
from router.server.persist import load_snapshot
from router.server.scrape import scrape_replica
from router.server.side_get import BodyTooLarge, side_get
from router.server.state import RouterState
from tests.sim_cluster import MODEL, SimCluster
from tests.zmq_helpers import wait_for

DRIP_S = 20.0


class Dripper:
    """``GET /health``: a 200 whose header gets a byte every 50 ms for ``DRIP_S``; any other
    GET: 200, then one chunked body byte every 50 ms for ``DRIP_S`` (or ``size`` bytes at
    once, then the end, when ``size`` is set)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.accepted = 0
        """Connections taken so far (read by tests to know a GET is under way)."""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(4096)
                if not got:
                    return
                data += got
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
            end = time.monotonic() + DRIP_S
            if data.startswith(b"GET /health "):  # the header itself, a byte at a time
                conn.sendall(head + b"x-drip: ")
                while time.monotonic() < end and not self.stop.is_set():
                    conn.sendall(b"#")
                    self.stop.wait(0.05)  # the drip's pace, not a synchronisation
                conn.sendall(b"\r\ncontent-length: 0\r\n\r\n")
                return
            if self.size is not None:
                conn.sendall(head + b"content-length: %d\r\n\r\n" % self.size + b"x" * self.size)
                return
            conn.sendall(head + b"transfer-encoding: chunked\r\n\r\n")
            while time.monotonic() < end and not self.stop.is_set():
                conn.sendall(b"1\r\n#\r\n")
                self.stop.wait(0.05)  # the drip's pace, not a synchronisation
            conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the router gave up on it: what the test wants
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture()
def dripper() -> Iterator[Dripper]:
    d = Dripper()
    try:
        yield d
    finally:
        d.close()


def _get(url: str, path: str, deadline_s: float, max_bytes: int) -> tuple[object, float]:
    async def go() -> object:
        async with httpx.AsyncClient(base_url=url, timeout=deadline_s) as client:
            try:
                return await side_get(client, path, deadline_s=deadline_s, max_bytes=max_bytes)
            except (TimeoutError, BodyTooLarge) as exc:
                return exc

    t0 = time.monotonic()
    out = asyncio.run(go())
    return out, time.monotonic() - t0


def test_a_dripping_body_ends_at_the_deadline(dripper: Dripper) -> None:
    out, took = _get(dripper.url, "/metrics", 0.5, 1 << 20)
    assert isinstance(out, TimeoutError)
    assert took < DRIP_S / 4, took  # httpx alone waits for the whole drip
    # the status alone needs no body: answered at the header
    out, took = _get(dripper.url, "/metrics", 0.5, 0)
    assert getattr(out, "status", None) == 200 and out.body == b""  # type: ignore[attr-defined]
    # a header that never ends ends at the deadline too
    out, took = _get(dripper.url, "/health", 0.5, 0)
    assert isinstance(out, TimeoutError) and took < DRIP_S / 4, took


def test_a_body_over_the_cap_is_refused_and_one_under_it_read_whole() -> None:
    big = Dripper(size=3 << 20)
    try:
        out, _ = _get(big.url, "/metrics", 5.0, 1 << 20)
        assert isinstance(out, BodyTooLarge)
        out, _ = _get(big.url, "/metrics", 5.0, 4 << 20)
        assert getattr(out, "body", b"") == b"x" * (3 << 20)
    finally:
        big.close()


PROBES = """
[health]
probe_interval_s = 0.05
probe_timeout_s = 0.5
unhealthy_threshold = 2
healthy_threshold = 2
"""
WINDOW = 2 * (0.05 + 0.5)
"""router.config.HealthConfig.window_s for PROBES."""


def _add(cluster: SimCluster, url: str, verify: bool) -> httpx.Response:
    spare = socket.create_server(("127.0.0.1", 0))  # an event endpoint nobody publishes on
    try:
        return cluster.client.post(
            "/admin/replicas",
            headers=cluster.admin,
            json={
                "pool": MODEL,
                "replica": {
                    "name": "drip",
                    "url": url,
                    "event_endpoint": f"tcp://127.0.0.1:{spare.getsockname()[1]}",
                },
                "verify_model": verify,
            },
            timeout=30,
        )
    finally:
        spare.close()


def test_a_dripping_replica_does_not_hold_the_others_probes_or_scrapes(dripper: Dripper) -> None:
    cluster = SimCluster(160, extra_toml=PROBES)
    big = Dripper(size=9 << 20)
    try:
        # adding it: its /v1/models is read within a deadline, and not past 8 MiB
        t0 = time.monotonic()
        r = _add(cluster, dripper.url, verify=True)
        assert r.status_code == 409 and "no whole answer" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < DRIP_S / 2
        r = _add(cluster, big.url, verify=True)
        assert r.status_code == 409 and "BodyTooLarge" in r.json()["error"]["message"], r.text
        r = _add(cluster, dripper.url, verify=False)
        assert r.status_code == 201, r.text
        wait_for(lambda: cluster.health("drip")["state"] == "down", 10, "the dripper down")
        assert "no answer within 0.5 s" in cluster.health("drip")["probe"]["last_error"]

        t0 = time.monotonic()
        cluster.replicas["c"].stop_http()
        wait_for(lambda: cluster.health("c")["state"] == "down", WINDOW + 2.0, "c down")
        print(f"\nc out of rotation after {(time.monotonic() - t0) * 1000:.0f} ms beside a drip")

        # the scrape of the others goes on; the dripper's is a counted timeout
        a_before = cluster.replica_row("a")["scraped_at"]
        wait_for(lambda: cluster.replica_row("a")["scraped_at"] != a_before, 5, "a scraped")
        wait_for(
            lambda: cluster.metric(
                "kvrouter_metrics_scrape_failures_total", pool=MODEL, reason="timeout",
                replica="drip",  # labels in the order the exposition prints them
            ) >= 1,
            10,
            "the dripper's scrape counted as a timeout",
        )  # fmt: skip
        assert cluster.replica_row("drip")["scrape_error"].startswith("no whole answer within")
    finally:
        big.close()
        cluster.close()


def _scrape_failures(state: RouterState, replica: str) -> float:
    return sum(
        s.value
        for m in state.metrics.scrape_failures.collect()
        for s in m.samples
        if s.labels.get("replica") == replica and s.name.endswith("_total")
    )


def test_a_scrape_of_a_replica_removed_meanwhile_records_nothing(dripper: Dripper) -> None:
    """``remove_replica`` drops the replica's series and closes its client while a scrape
    round may still be reading it: the scrape then ends quietly, without bringing a failure
    series back for a replica that no longer exists or raising out of the round (httpx's
    "client has been closed" for a scrape that starts after the removal)."""
    toml = f'[[pools]]\nmodel = "m"\n[[pools.replicas]]\nname = "d"\nurl = "{dripper.url}"\n'

    async def go() -> None:
        state = RouterState(parse_config(toml))
        await state.start()
        try:
            pool = state.pools["m"]
            rep = pool.replicas["d"]
            task = asyncio.create_task(scrape_replica(pool, rep, timeout=10.0))
            deadline = time.monotonic() + 5
            while dripper.accepted == 0:  # the GET is under way, its body dripping
                assert time.monotonic() < deadline, "the scrape never connected"
                await asyncio.sleep(0.01)
            await pool.remove_replica("d")
            await asyncio.wait_for(task, 5)  # ended by the closed client, not the 10 s deadline
            assert _scrape_failures(state, "d") == 0
            assert rep.scrape_error is None
            await scrape_replica(pool, rep, timeout=1.0)  # a round's stale copy: no raise
            assert _scrape_failures(state, "d") == 0
        finally:
            await state.stop()

    asyncio.run(go())


def _peer_config(url: str, **index: object) -> RouterConfig:
    knobs = "".join(f"{k} = {v}\n" for k, v in index.items())
    return parse_config(
        f"[index]\nbootstrap_peer = '{url}'\n{knobs}"
        '[[pools]]\nmodel = "m"\n[[pools.replicas]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )


def test_a_peer_dripping_its_snapshot_cannot_hold_the_start(
    dripper: Dripper, caplog: pytest.LogCaptureFixture
) -> None:
    """``index.bootstrap_peer``'s snapshot GET ends at ``bootstrap_timeout_s`` whatever the
    peer sends (this one drips for 20 s); the router then starts by replaying the rings."""
    cfg = _peer_config(dripper.url, bootstrap_timeout_s=1.0)
    with caplog.at_level("WARNING", logger="kvrouter.snapshot"):
        assert asyncio.run(asyncio.wait_for(load_snapshot(cfg), 10)) is None
    assert "bootstrap_timeout_s = 1 s" in caplog.text and "replaying the rings" in caplog.text


def test_a_peer_snapshot_over_the_cap_is_refused_unread(caplog: pytest.LogCaptureFixture) -> None:
    big = Dripper(size=5000)
    try:
        cfg = _peer_config(big.url, bootstrap_max_bytes=4096)
        with caplog.at_level("WARNING", logger="kvrouter.snapshot"):
            assert asyncio.run(load_snapshot(cfg)) is None
        assert "bootstrap_max_bytes = 4096" in caplog.text
        # under the cap the body is read whole and refused for what it is: not a snapshot
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvrouter.snapshot"):
            assert asyncio.run(load_snapshot(_peer_config(big.url))) is None
        assert "SnapshotError" in caplog.text
    finally:
        big.close()
