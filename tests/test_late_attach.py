"""A router attached to replicas that have run for a while (issue: live-fleet ingest).

Two simulated hybrid replicas (FA + SWA 48, real ZeroMQ + HTTP) serve traffic directly before
the router exists, publishing far more batches than their replay ring holds (``buffer_steps``
4). The router then starts: each stream's ring no longer covers seq 0, so each replica must
come up *partial* (routed on, a lower bound), not untrusted. Then 150 sequential requests go
through the router over the same conversations; the replicas' own hit rule (gpu_emitter, not
the router's) says what they cached:

- a prediction never exceeds what the replica reports (partial is a lower bound);
- a request that the replica answers with more than predicted teaches the router the keys
  behind that hit (vLLM's answer is evidence), so misses are only on prefixes cached before
  attach and the ratio of exact predictions stays high (printed);
- a prefix-cache reset makes the replica exact again.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sim_cluster import MODEL, SimCluster
from tests.zmq_helpers import wait_for

NAMES = ("a", "b")
SYSTEMS = 4
"""System prompts (each 96 tokens) shared by the conversations."""
RING = 4
BLOCKS = 200
"""KV blocks per replica: few enough that cached blocks are evicted while a copy is held
twice, which the eviction-order proof is for. The engine reuses uncached freed blocks first,
as vLLM 0.32 does; at 400 nothing cached was evicted and the proof had nothing to prove."""


def words(rng: random.Random, n: int) -> list[str]:
    return [f"w{rng.randrange(2000)}" for _ in range(n)]


@pytest.fixture()
def cluster() -> Iterator[SimCluster]:
    c = SimCluster(BLOCKS, names=NAMES, buffer_steps=RING, router=False)
    try:
        yield c
    finally:
        c.close()


def cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_late_attach_is_partial_learns_from_answers_and_converges(cluster: SimCluster) -> None:
    rng = random.Random(int(os.environ.get("KVROUTER_LATE_ATTACH_SEED", "5")))
    systems = [words(rng, 96) for _ in range(SYSTEMS)]
    # Before the router: each replica serves conversations over every system prompt.
    before_prefixes: set[tuple[str, int]] = set()
    for i in range(60):
        name = NAMES[i % 2]
        s = i % SYSTEMS
        prompt = " ".join([*systems[s], *words(rng, rng.randrange(8, 40))])
        r = cluster.direct(name).post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        before_prefixes.add((name, s))
    for rep in cluster.replicas.values():
        assert rep.publisher.next_seq > 3 * RING, "the ring must have dropped the start"

    cluster.start_router()
    for name in NAMES:
        cluster.sync(name)
    rows = cluster.rows(prompt="w1 w2")
    for name in NAMES:
        assert rows[name]["trust"] == "partial", rows[name]
        assert "attached late" in rows[name]["partial_reason"]
        assert cluster.metric("kvrouter_replica_trust", dp_rank="0", pool=MODEL, replica=name,
                              state="partial") == 1.0  # fmt: skip

    # The eviction-order proof arms once two metrics scrapes in a row show the router is
    # each replica's only client (router.core.eviction_order); a real router gets there a
    # second or two after it starts, this test's 150 requests take about as long.
    wait_for(lambda: _proofs(cluster) == {"armed"}, 10, "the eviction-order proof armed")

    # What each replica held twice at attach (a block vLLM stored again after a shorter
    # hybrid hit): the one kind of state no event and no answer can reveal.
    doubled = {
        (n, s, g, j)
        for n in NAMES
        for s in range(SYSTEMS)
        for g, j, copies in _replica_blocks(cluster, n, systems[s])
        if copies > 1
    }

    # 150 sequential requests through the router over the same system prompts.
    exact = 0
    misses: list[tuple[str, int, int, int, int]] = []
    unexplained: list[tuple[int, set[tuple[int, int]]]] = []
    seen: set[tuple[str, int]] = set()
    first_touches = 0
    for i in range(150):
        s = rng.randrange(SYSTEMS)
        prompt = " ".join([*systems[s], *words(rng, rng.randrange(8, 40))])
        # the blocks each replica holds (its own pool) that the index neither holds nor can
        # imply (a full-attention block below a held one), before the request
        lacking = {n: _lacking(cluster, n, systems[s]) for n in NAMES}
        r = cluster.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        name = r.headers["x-kvrouter-replica"].split("/")[0]
        predicted = int(r.headers["x-kvrouter-predicted-hit"])
        actual = cached(r.json())
        assert predicted <= actual, f"request {i}: a partial replica over-predicted"
        first = (name, s) not in seen
        seen.add((name, s))
        if predicted == actual:
            exact += 1
        else:
            misses.append((name, s, predicted, actual, i))
            first_touches += first
            if not first and not any((name, s, g, j) in doubled for g, j in lacking[name]):
                unexplained.append((i, lacking[name]))
        cluster.sync(name)  # sequential: the next prediction sees this request's events
    for name, s, _, _, i in misses:
        assert (name, s) in before_prefixes, f"request {i}: a miss on a prefix cached after attach"
    # The ring's stores name the blocks they follow (witnesses) and held keys imply their
    # full-attention ancestors and sliding windows, so a prefix cached before attach is
    # predicted from its first request when the ring saw it used. What may remain: the first
    # request of a prefix the ring never saw used, and the removal of one of two copies a
    # replica held at attach that the eviction-order proof could not yet tell from the one
    # vLLM's hits use. Any other miss is a bug.
    assert not unexplained, f"misses not explained by a copy held twice at attach: {unexplained}"
    # issue 12 asks >= 99 %; seeds 5-24: 149-150 (a first touch)
    assert exact >= 149, (exact, misses, _proofs(cluster))

    def ops(outcome: str) -> float:
        return sum(
            cluster.metric(
                "kvrouter_index_block_ops_total",  # labels in the order Prometheus prints them
                dp_rank="0",
                outcome=outcome,
                pool=MODEL,
                replica=n,
            )
            for n in NAMES
        )

    kept = ops("older_copy_evicted")
    print(f"late attach: {exact}/150 exact ({first_touches} first touches, {kept:.0f} keys kept "
          f"by the eviction-order proof), misses {misses}")  # fmt: skip
    # The eviction-order proof keeps keys whose older copy was evicted (without it: 143-150
    # over seeds 5-12, misses on copies held twice at attach). At the default seed it kept
    # some and every request was exact.
    if "KVROUTER_LATE_ATTACH_SEED" not in os.environ:
        assert ops("older_copy_evicted") > 0 and exact == 150

    # Another client's request turns the proof off: its premise (only the router's requests
    # free blocks) no longer holds. Seen by the replica's finished-request count.
    assert cluster.direct("a").post(
        "/v1/completions", json={"model": MODEL, "prompt": "w7 w8 w9", "max_tokens": 1}
    ).status_code == 200  # fmt: skip
    wait_for(
        lambda: _proofs(cluster) == {"armed", "off: another client sends it requests"},
        10,
        "replica a's proof off after another client's request",
    )

    # A prefix-cache reset is a known state: exact again.
    for name in NAMES:
        assert cluster.direct(name).post("/reset_prefix_cache").status_code == 200
        # The engine publishes the AllBlocksCleared with its next step.
        r = cluster.direct(name).post(
            "/v1/completions", json={"model": MODEL, "prompt": "w1 w2", "max_tokens": 1}
        )
        assert r.status_code == 200, r.text
    wait_for(
        lambda: all(row["trust"] == "exact" for row in cluster.rows(prompt="w1").values()),
        10,
        "both replicas exact after their prefix-cache reset",
    )


def _proofs(cluster: SimCluster) -> set[str]:
    streams = cluster.client.get("/admin/events", headers=cluster.admin).json()["streams"]
    return {s["index"]["eviction_proof"] for s in streams}


def _replica_blocks(
    cluster: SimCluster, name: str, system: list[str]
) -> list[tuple[int, int, int]]:
    """``(group, block, copies)`` of the system prompt's whole blocks in replica ``name``'s
    own pool (the simulated vLLM's, not the router's)."""
    from gpu_emitter import tokenizer as bt

    (pool,) = cluster.app.state.router.pools.values()
    tokens = bt.encode(" ".join(system))
    chain = pool.index.hasher().lazy_chain(tokens, None)
    replica = cluster.replicas[name].pool
    return [
        (g, j, replica.cached_count(g, chain.wire(j)))
        for g in (0, 1)
        for j in range(len(tokens) // 16)
    ]


def _lacking(cluster: SimCluster, name: str, system: list[str]) -> set[tuple[int, int]]:
    """The system prompt's blocks replica ``name`` holds that the router's index neither holds
    nor implies (a full-attention block below one it holds, group 0)."""
    from gpu_emitter import tokenizer as bt

    (pool,) = cluster.app.state.router.pools.values()
    chain = pool.index.hasher().lazy_chain(bt.encode(" ".join(system)), None)
    held = {
        (g, j)
        for g, j, _ in _replica_blocks(cluster, name, system)
        if pool.index.copies((name, 0), g, chain.wire(j))
    }
    deepest_fa = max((j for g, j in held if g == 0), default=-1)
    return {
        (g, j)
        for g, j, copies in _replica_blocks(cluster, name, system)
        if copies and (g, j) not in held and not (g == 0 and j < deepest_fa)
    }


def _serve(cluster: SimCluster, rng: random.Random, systems: list[list[str]], n: int) -> None:
    for i in range(n):
        prompt = " ".join([*systems[i % len(systems)], *words(rng, rng.randrange(8, 40))])
        r = cluster.direct(NAMES[i % 2]).post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text


def _exact_run(cluster: SimCluster, rng: random.Random, systems: list[list[str]], n: int) -> int:
    """``n`` sequential requests through the router; how many were predicted exactly."""
    exact = 0
    for _ in range(n):
        prompt = " ".join(
            [*systems[rng.randrange(len(systems))], *words(rng, rng.randrange(8, 40))]
        )
        r = cluster.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        exact += int(r.headers["x-kvrouter-predicted-hit"]) == cached(r.json())
        cluster.sync(r.headers["x-kvrouter-replica"].split("/")[0])
    return exact


def test_a_restart_that_loads_its_snapshot_is_exact_at_once(cluster: SimCluster, tmp_path) -> None:
    rng = random.Random(8)
    systems = [words(rng, 96) for _ in range(SYSTEMS)]
    toml = f"[index]\nsnapshot_path = '{tmp_path / 'index.snap'}'\n"
    cluster.start_router(toml)  # from the start: exact
    _serve(cluster, rng, systems, 16)  # both replicas publish past their ring
    assert _exact_run(cluster, rng, systems, 30) == 30
    cluster.stop_router()  # writes the snapshot
    assert (tmp_path / "index.snap").stat().st_size > 0
    _serve(cluster, rng, systems, 2)  # a batch each while no router runs: within the ring
    for rep in cluster.replicas.values():
        assert rep.publisher.next_seq > 2 * RING, "without the snapshot the ring could not help"
    cluster.start_router(toml)
    for name in NAMES:
        cluster.sync(name)
    assert {row["trust"] for row in cluster.rows(prompt="w1").values()} == {"exact"}
    assert _exact_run(cluster, rng, systems, 30) == 30


def test_a_router_bootstrapped_from_a_peer_is_exact_at_once(cluster: SimCluster) -> None:
    from router.config import parse_config
    from router.server.app import create_app
    from tests.fake_replica import ServerThread
    from tests.sim_cluster import TOKEN, router_toml

    rng = random.Random(9)
    systems = [words(rng, 96) for _ in range(SYSTEMS)]
    cluster.start_router()
    _serve(cluster, rng, systems, 16)  # both replicas publish past their ring
    assert _exact_run(cluster, rng, systems, 30) == 30
    peer = cluster.router.url
    config = parse_config(router_toml(cluster.replicas) + f"[index]\nbootstrap_peer = '{peer}'\n")
    with ServerThread(create_app(config)) as second:
        import httpx

        with httpx.Client(base_url=second.url, timeout=30) as http:
            admin = {"authorization": f"Bearer {TOKEN}"}
            for _ in range(10):
                prompt = " ".join([*systems[rng.randrange(SYSTEMS)], *words(rng, 20)])
                body = {"model": MODEL, "prompt": prompt}
                mine = http.post("/admin/route/explain", json=body, headers=admin).json()
                theirs = cluster.explain(prompt=prompt)
                assert [(r["replica"], r["hit_tokens"], r["trust"]) for r in mine["replicas"]] == [
                    (r["replica"], r["hit_tokens"], r["trust"]) for r in theirs["replicas"]
                ]
                assert {r["trust"] for r in mine["replicas"]} == {"exact"}
                r = http.post("/v1/completions", json={**body, "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert int(r.headers["x-kvrouter-predicted-hit"]) == cached(r.json())
                name = r.headers["x-kvrouter-replica"].split("/")[0]
                cluster.sync(name)
                wait_for(
                    lambda name=name: cluster.caught_up(name, http),
                    10,
                    "the second router to apply the request's events",
                )


def test_a_stream_that_did_not_ask_for_usage_still_teaches_the_router(cluster: SimCluster) -> None:
    """The router asks each streaming request for vLLM's usage event: a partial replica's
    streamed answer teaches the keys behind its hit, and the client's stream has no usage."""
    rng = random.Random(11)
    systems = [words(rng, 96) for _ in range(2)]
    for i in range(24):  # replica a serves both system prompts (the second last), b none
        prompt = " ".join([*systems[i // 12], *words(rng, 20)])
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        assert cluster.direct("a").post("/v1/completions", json=body).status_code == 200
    assert cluster.replicas["a"].publisher.next_seq > 3 * RING
    cluster.start_router()
    for name in NAMES:
        cluster.sync(name)
    # The ring's stores named the second system prompt's last block as their parent: held
    # (a witness), and its full-attention ancestors and window follow from it.
    seen = " ".join([*systems[1], *words(rng, 20)])
    assert cluster.rows(prompt=seen)["a"]["hit_tokens"] == 96
    # Nothing in the ring named the first: unknown until vLLM answers.
    probe = " ".join([*systems[0], *words(rng, 20)])
    assert cluster.rows(prompt=probe)["a"]["hit_tokens"] == 0

    # b drained: the stream goes to a, which holds the system prompt from before attach
    assert cluster.client.post("/admin/replicas/b/drain", headers=cluster.admin).status_code == 200
    body = {"model": MODEL, "prompt": probe, "max_tokens": 2, "stream": True}
    with cluster.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
        assert r.headers["x-kvrouter-replica"] == "a"
    assert b'"usage"' not in raw and raw.endswith(b"data: [DONE]\n\n")
    cluster.sync("a")
    # vLLM's answer (the simulated replica's own hit rule) reported the system prompt's hit;
    # the keys behind it are learned, so the next prompt over that system prompt predicts it
    nxt = " ".join([*systems[0], *words(rng, 20)])
    assert cluster.rows(prompt=nxt)["a"]["hit_tokens"] > 0
    inferred = cluster.metric(
        "kvrouter_index_block_ops_total",
        dp_rank="0",
        outcome="inferred_blocks",
        pool=MODEL,
        replica="a",
    )
    assert inferred > 0
    r = cluster.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": nxt, "max_tokens": 2}
    )
    assert r.headers["x-kvrouter-replica"] == "a"
    assert int(r.headers["x-kvrouter-predicted-hit"]) == cached(r.json()) > 0


def test_a_replica_restarted_since_the_snapshot_is_not_loaded_from_it(
    cluster: SimCluster, tmp_path
) -> None:
    """Sequence numbers restart at 0 with vLLM's process; a replica that restarted while no
    router ran and has since published past the saved sequence looks continuous by seq alone.
    Its process start time (``process_start_time_seconds``, saved with the snapshot) is its
    epoch: the restarted replica's saved state must not be loaded, the other's must."""
    rng = random.Random(12)
    systems = [words(rng, 96) for _ in range(SYSTEMS)]
    toml = f"[index]\nsnapshot_path = '{tmp_path / 'index.snap'}'\n"
    cluster.start_router(toml)
    _serve(cluster, rng, systems, 16)
    for name in NAMES:
        cluster.sync(name)
    probe = " ".join([*systems[0], *words(rng, 20)])
    assert cluster.rows(prompt=probe)["a"]["hit_tokens"] > 0
    saved_seq = cluster.replicas["a"].publisher.next_seq
    cluster.stop_router()

    cluster.replicas["a"].restart()  # empty cache, seq from 0
    for i in range(3 * saved_seq):  # new content only, past the saved sequence
        prompt = " ".join(words(rng, 60 + i % 7))
        r = cluster.direct("a").post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        if cluster.replicas["a"].publisher.next_seq > saved_seq + 1:
            break
    assert cluster.replicas["a"].publisher.next_seq > saved_seq + 1
    r = cluster.direct("b").post(  # b: one batch after the snapshot, well inside its ring
        "/v1/completions",
        json={"model": MODEL, "prompt": " ".join(words(rng, 40)), "max_tokens": 1},
    )
    assert r.status_code == 200

    cluster.start_router(toml)
    for name in NAMES:
        cluster.sync(name)
    rows = cluster.rows(prompt=probe)
    # a holds nothing of the system prompts any more: predicted 0 (stale state would say 96+)
    assert rows["a"]["hit_tokens"] == 0, rows["a"]
    b_row = cluster.rows(prompt=" ".join([*systems[1], *words(rng, 20)]))["b"]
    assert b_row["trust"] == "exact" and b_row["hit_tokens"] > 0  # b's state was loaded
    r = cluster.direct("a").post(
        "/v1/completions", json={"model": MODEL, "prompt": probe, "max_tokens": 2}
    )
    assert cached(r.json()) == 0  # the replica's own answer agrees


def test_a_restart_seen_by_the_scrape_wipes_the_replica(cluster: SimCluster) -> None:
    """While the router runs, a replica process that changes (a new start time) is read
    anew: its old blocks are never predicted again, and the restart is counted."""
    rng = random.Random(13)
    systems = [words(rng, 96) for _ in range(SYSTEMS)]
    cluster.start_router()
    _serve(cluster, rng, systems, 8)
    cluster.sync("a")
    probe = " ".join([*systems[0], *words(rng, 20)])
    assert cluster.rows(prompt=probe)["a"]["hit_tokens"] > 0
    cluster.replicas["a"].restart()

    def restarts() -> int:
        r = cluster.client.get("/admin/replicas", headers=cluster.admin)
        return next(x["restarts"] for x in r.json()["replicas"] if x["name"] == "a")

    wait_for(lambda: restarts() == 1, 20, "the scrape to see a's new start time")
    wait_for(lambda: cluster.rows(prompt=probe)["a"]["hit_tokens"] == 0, 10, "a's old blocks gone")
    # a serves again; the router follows its new stream (its first batch may go out before
    # the new subscription is connected: the second one's gap brings it from the ring)
    _serve(cluster, rng, systems, 4)
    cluster.sync("a")
    row = cluster.rows(prompt=probe)["a"]
    r = cluster.direct("a").post(
        "/v1/completions", json={"model": MODEL, "prompt": probe, "max_tokens": 2}
    )
    assert row["hit_tokens"] == cached(r.json())
