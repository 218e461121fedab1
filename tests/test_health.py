"""Replica health through a real router in front of simulated vLLM replicas (issue 13 item 1).

Real loopback HTTP and ZeroMQ (tests/sim_cluster.py): a replica's HTTP server is stopped (the
port refuses connections), its ``/health`` made to answer 503 (vLLM's engine dead under a
live API server), or the whole replica killed and restarted on the same ports with an empty
cache and sequence numbers from 0. The router's probes, ejections, explain, ``/ready`` and
metrics are read over HTTP; every wait polls with a deadline. Each test has its own cluster.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.sim_cluster import MODEL, SimCluster, words
from tests.zmq_helpers import wait_for

B = 16
NUM_BLOCKS = 160
INTERVAL, TIMEOUT, DOWN_AFTER = 0.05, 0.5, 2
PROBES = f"""
[health]
probe_interval_s = {INTERVAL}
probe_timeout_s = {TIMEOUT}
unhealthy_threshold = {DOWN_AFTER}
healthy_threshold = 2
eject_after_failures = 2
eject_base_s = 0.5
eject_max_s = 4.0
"""
WINDOW = DOWN_AFTER * (INTERVAL + TIMEOUT)
"""router.config.HealthConfig.window_s for PROBES."""
SLACK = 2.0
"""On top of the window: a loaded 2-core machine's scheduling, and the admin polling."""
PASSIVE = """
[health]
probe_interval_s = 0
eject_after_failures = 2
eject_base_s = 1.0
eject_max_s = 8.0
"""
"""1 s: the checks made while the first ejection lasts take a few HTTP round trips."""


@pytest.fixture()
def probed() -> Iterator[SimCluster]:
    c = SimCluster(NUM_BLOCKS, extra_toml=PROBES)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture()
def passive() -> Iterator[SimCluster]:
    c = SimCluster(NUM_BLOCKS, extra_toml=PASSIVE)
    try:
        yield c
    finally:
        c.close()


def complete(client: httpx.Client, prompt: str, status: int = 200) -> httpx.Response:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == status, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def state(cluster: SimCluster, name: str) -> str:
    return cluster.health(name)["state"]


def trust(cluster: SimCluster, name: str) -> str:
    r = cluster.client.get("/admin/replicas", headers=cluster.admin)
    (rep,) = [x for x in r.json()["replicas"] if x["name"] == name]
    return rep["trust"]["dp0"]


def drain(cluster: SimCluster, *names: str, undo: bool = False) -> None:
    for n in names:
        verb = "undrain" if undo else "drain"
        r = cluster.client.post(f"/admin/replicas/{n}/{verb}", headers=cluster.admin)
        assert r.status_code == 200, r.text


def warm(cluster: SimCluster, name: str, prompt: str) -> None:
    """Cache ``prompt`` on ``name`` directly and wait until the router predicts its hit."""
    r = cluster.direct(name).post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    want = (len(prompt.split()) + 1 - 1) // B * B  # BOS + words, the last token recomputed
    wait_for(
        lambda: cluster.rows(prompt=prompt + " w1")[name]["hit_tokens"] == want,
        20,
        f"{name}'s blocks indexed",
    )


def excluded(explain: dict[str, Any]) -> dict[str, str]:
    return {row["replica"]: row["reason"] for row in explain["excluded"]}


def pool_sample(cluster: SimCluster, metric: str, name: str) -> float:
    return cluster.metric(metric, pool=MODEL, replica=name)


# -- active probes ---------------------------------------------------------------------------


def test_a_killed_replica_leaves_rotation_within_the_window_and_comes_back(
    probed: SimCluster,
) -> None:
    cluster, dead = probed, "c"
    rng = random.Random("killed")
    prefix = words(rng, 10 * B)
    warm(cluster, dead, prefix)
    ask = prefix + " " + words(rng, 20)
    assert cluster.explain(prompt=ask)["chosen"]["replica"] == dead  # the best by cache
    wait_for(lambda: cluster.client.get("/ready").status_code == 200, 10, "ready")

    t0 = time.monotonic()
    cluster.replicas[dead].stop_http()
    wait_for(lambda: state(cluster, dead) == "down", WINDOW + SLACK, f"{dead} down")
    latency = time.monotonic() - t0
    print(f"\nkilled replica out of rotation after {latency * 1000:.0f} ms (window {WINDOW} s)")

    health = cluster.health(dead)
    assert health["probe"]["status"] == "down" and "ConnectError" in health["probe"]["last_error"]
    assert not health["routable"]
    ex = cluster.explain(prompt=ask)
    assert ex["chosen"]["replica"] != dead and not ex["panic"]
    assert dead not in {row["replica"] for row in ex["replicas"]}
    assert excluded(ex) == {dead: "down"}
    assert pool_sample(cluster, "kvrouter_replica_up", dead) == 0
    assert pool_sample(cluster, "kvrouter_replica_routable", dead) == 0
    assert pool_sample(cluster, "kvrouter_replica_probe_failures_total", dead) >= DOWN_AFTER
    assert pool_sample(cluster, "kvrouter_replica_up", "a") == 1
    # Its blocks are dropped: it may come back restarted (empty).
    assert trust(cluster, dead) == "untrusted"

    # No request tries it: not one failed attempt there, every answer from another.
    failovers = cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead)
    for _ in range(10):
        r = complete(cluster.client, prefix + " " + words(rng, 20))
        assert r.headers["x-kvrouter-replica"] != dead
    assert cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead) == failovers
    assert cluster.health(dead)["consecutive_failures"] == 0
    assert cluster.client.get("/ready").status_code == 200  # a and b serve

    # Back on the same port (cache and publisher intact): half-open, then in rotation.
    cluster.replicas[dead].start_http()
    wait_for(lambda: state(cluster, dead) != "down", WINDOW + SLACK, f"{dead} back")
    drain(cluster, "a", "b")
    try:
        r = complete(cluster.client, words(rng, 40))
        assert r.headers["x-kvrouter-replica"] == dead
        assert state(cluster, dead) == "healthy"
        # Its stream went on without a restart: partial (a lower bound), not untrusted.
        wait_for(lambda: trust(cluster, dead) == "partial", 10, f"{dead} partial")
    finally:
        drain(cluster, "a", "b", undo=True)
    assert pool_sample(cluster, "kvrouter_replica_up", dead) == 1


def test_a_replica_whose_health_fails_gets_no_request_until_it_passes(probed: SimCluster) -> None:
    """``/health`` 503 while the API server still answers (vLLM's engine died): the replica
    is down, and it receives no request at all (counted on the replica itself)."""
    cluster, sick = probed, "b"
    rng = random.Random("sick")
    prefix = words(rng, 10 * B)
    warm(cluster, sick, prefix)
    rep = cluster.replicas[sick]
    rep.sick = True
    wait_for(lambda: state(cluster, sick) == "down", WINDOW + SLACK, f"{sick} down")
    assert cluster.health(sick)["probe"]["last_error"] == "HTTP 503"
    received = sum(rep.received.values())
    for _ in range(10):
        r = complete(cluster.client, prefix + " " + words(rng, 20))
        assert r.headers["x-kvrouter-replica"] != sick
    assert sum(rep.received.values()) == received

    rep.sick = False
    wait_for(lambda: state(cluster, sick) != "down", WINDOW + SLACK, f"{sick} back")
    drain(cluster, "a", "c")
    try:
        r = complete(cluster.client, words(rng, 40))
        assert r.headers["x-kvrouter-replica"] == sick
        assert sum(rep.received.values()) == received + 1
    finally:
        drain(cluster, "a", "c", undo=True)


# -- passive ejection ------------------------------------------------------------------------


def test_failed_attempts_eject_with_a_growing_back_off_and_a_trial_decides(
    passive: SimCluster,
) -> None:
    """No probes: only requests tell. Two failures in a row eject the replica for 1 s; it
    is then half-open, and a failed trial ejects it for 2 s; with nothing else routable the
    pool still tries it (panic) rather than answer 503; once it serves, a trial puts it back."""
    cluster, dead = passive, "c"
    rng = random.Random("passive")
    prefixes = [words(rng, 10 * B) for _ in range(2)]
    for p in prefixes:
        warm(cluster, dead, p)
    cluster.replicas[dead].stop_http()
    failovers = cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead)

    # Each of these has its best hit on the dead replica: tried first, failed over.
    for i, p in enumerate(prefixes):
        assert cluster.explain(prompt=p + " w7")["chosen"]["replica"] == dead
        r = complete(cluster.client, p + " w7")
        assert r.headers["x-kvrouter-replica"] != dead
        now = cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead)
        assert now == failovers + i + 1
    health = cluster.health(dead)
    assert health["state"] == "ejected" and health["ejections"] == 1
    assert "ConnectError" in health["last_error"] and health["consecutive_failures"] == 2
    assert health["ejected_until"] > time.time()
    assert pool_sample(cluster, "kvrouter_replica_ejected", dead) == 1
    assert pool_sample(cluster, "kvrouter_replica_ejections_total", dead) == 1

    # Ejected: not a candidate (not in the ranking at all), no attempt while it lasts.
    ex = cluster.explain(prompt=words(rng, 30))
    assert excluded(ex) == {dead: "ejected"}
    assert {row["replica"] for row in ex["replicas"]} == {"a", "b"}
    for _ in range(6):
        if state(cluster, dead) != "ejected":
            break
        complete(cluster.client, words(rng, 30))
    assert cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead) == failovers + 2

    # Half-open after 1 s; the only candidate left, its trial fails: ejected for 2 s.
    wait_for(lambda: state(cluster, dead) == "half_open", 5, "half-open")
    drain(cluster, "a", "b")
    try:
        complete(cluster.client, words(rng, 30), status=502)
        health = cluster.health(dead)
        assert health["state"] == "ejected" and health["ejections"] == 2
        assert 1.0 < health["ejected_until"] - time.time() <= 2.0
        assert health["next_backoff_s"] == 4.0

        # Nothing routable: the pool panics and tries it anyway (a 502, not a 503).
        ex = cluster.explain(prompt=words(rng, 30))
        assert ex["panic"] and ex["chosen"]["replica"] == dead
        before = cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead)
        complete(cluster.client, words(rng, 30), status=502)
        assert cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead) == before + 1
        assert cluster.health(dead)["ejections"] == 2  # failures while ejected don't extend

        # It serves again: the first request after the back-off is the trial, and decides.
        cluster.replicas[dead].start_http()
        wait_for(lambda: state(cluster, dead) == "half_open", 5, "half-open again")
        r = complete(cluster.client, words(rng, 30))
        assert r.headers["x-kvrouter-replica"] == dead
        health = cluster.health(dead)
        assert health["state"] == "healthy" and health["consecutive_failures"] == 0
        assert health["next_backoff_s"] == 1.0
        assert pool_sample(cluster, "kvrouter_replica_ejected", dead) == 0
    finally:
        drain(cluster, "a", "b", undo=True)


# -- restart detection -----------------------------------------------------------------------


def test_a_restarted_replica_s_stale_blocks_are_not_predicted(probed: SimCluster) -> None:
    """Killed (HTTP and event publisher) and restarted on the same ports with an empty
    cache and batches numbered from 0 again: vLLM sends no event for that, so without the
    probe the router would predict the old blocks until the first new batch (issue 13: one
    request predicted 192, got 0)."""
    cluster, name = probed, "c"
    rng = random.Random("restart")
    prefix = words(rng, 10 * B)
    warm(cluster, name, prefix)
    ask = prefix + " " + words(rng, 20)
    assert cluster.rows(prompt=ask)[name]["hit_tokens"] == 10 * B

    cluster.replicas[name].kill()
    wait_for(lambda: state(cluster, name) == "down", WINDOW + SLACK, f"{name} down")
    cluster.replicas[name].restart()
    wait_for(lambda: state(cluster, name) != "down", WINDOW + SLACK, f"{name} back")
    # Its new event stream is connected (what /ready checks), so its first batch is seen.
    wait_for(
        lambda: name in cluster.client.get("/ready").json()["pools"][MODEL]["ready"],
        10,
        f"{name}'s events connected",
    )
    assert cluster.rows(prompt=ask)[name]["hit_tokens"] == 0

    drain(cluster, "a", "b")
    try:
        r = complete(cluster.client, prefix)  # the stale index would predict 160 here
        assert r.headers["x-kvrouter-replica"] == name
        assert r.headers["x-kvrouter-predicted-hit"] == "0"
        assert cached(r) == 0  # restarted empty
        # Its first batch is numbered below the last one seen: a restart, exact again.
        wait_for(lambda: trust(cluster, name) == "exact", 10, f"{name} exact after the reset")
        again = prefix + " " + words(rng, 20)
        wait_for(lambda: cluster.rows(prompt=again)[name]["hit_tokens"] == 10 * B, 10, "new blocks")
        r = complete(cluster.client, again)
        assert r.headers["x-kvrouter-replica"] == name
        assert cached(r) == int(r.headers["x-kvrouter-predicted-hit"]) == 10 * B
    finally:
        drain(cluster, "a", "b", undo=True)
    # Noticed by one of two paths, whichever comes first: the stream's first batch numbered
    # below the last one seen (a stream reset), or the metrics scrape's new process start time
    # (the replica's streams reopened, so the new stream's own reset count starts at 0).
    events = cluster.client.get("/admin/events", headers=cluster.admin).json()["streams"]
    (stream,) = [s for s in events if s["replica"] == name]
    replicas = cluster.client.get("/admin/replicas", headers=cluster.admin).json()["replicas"]
    (row,) = [x for x in replicas if x["name"] == name]
    assert stream["stream_stats"]["resets"] + row["restarts"] >= 1, (stream, row)


# -- /health and /ready ----------------------------------------------------------------------


def test_ready_says_what_is_missing_and_health_stays_ok(probed: SimCluster) -> None:
    cluster = probed

    def ready() -> tuple[int, dict[str, Any]]:
        r = cluster.client.get("/ready")
        return r.status_code, r.json()

    # every replica ready once its event stream has connected
    body = wait_for(
        lambda: (r := ready()) and len(r[1]["pools"][MODEL]["ready"]) == 3 and r[1], 10, "ready"
    )
    assert body["status"] == "ready" and sorted(body["pools"][MODEL]["ready"]) == ["a", "b", "c"]
    assert body["pools"][MODEL]["not_ready"] == {} and "missing" not in body

    for rep in cluster.replicas.values():
        rep.stop_http()
    wait_for(lambda: ready()[0] == 503, WINDOW + SLACK, "not ready")
    wait_for(lambda: len(ready()[1]["pools"][MODEL]["not_ready"]) == 3, WINDOW + SLACK, "all down")
    body = ready()[1]
    assert body["status"] == "not_ready"
    assert body["pools"][MODEL] == {"ready": [], "not_ready": dict.fromkeys("abc", "down")}
    (missing,) = body["missing"]
    assert MODEL in missing and "a: down" in missing
    h = cluster.client.get("/health")
    assert (h.status_code, h.json()) == (200, {"status": "ok"})  # liveness: the process serves

    cluster.replicas["c"].start_http()
    wait_for(lambda: ready()[0] == 200, WINDOW + SLACK, "ready with c")
    assert ready()[1]["pools"][MODEL]["ready"] == ["c"]

    # c serves HTTP but its event stream is gone: not ready either.
    cluster.replicas["c"].stop_events()
    wait_for(lambda: ready()[0] == 503, 10, "not ready without c's events")
    assert "event stream not connected" in ready()[1]["pools"][MODEL]["not_ready"]["c"]
