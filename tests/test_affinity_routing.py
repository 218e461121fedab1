"""Prefix homes through the running router: two simulated replicas (their own block pools and
hit rule), real HTTP and ZeroMQ. A family's prefix cached on both replicas ties on hit and
look-ahead; the replica the router first sent it to gets the affinity credit, by the numbers
derived here from the prompt's length, and loses it when it restarts with an empty cache."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.sim_cluster import MODEL, SimCluster, words
from tests.zmq_helpers import wait_for

CHUNK = 64
SYSTEM_WORDS = 320  # with BOS 321 tokens: five whole 64-token chunks


@pytest.fixture(params=[1.0, 0.0], ids=["affinity", "no-affinity"])
def cluster(request: pytest.FixtureRequest) -> Iterator[SimCluster]:
    policy = f"[pools.policy]\naffinity_weight = {request.param}\naffinity_chunk_tokens = {CHUNK}\n"
    c = SimCluster(400, names=("a", "b"), extra_toml=policy)
    c.weight = request.param  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        c.close()


def test_a_shared_prefix_stays_with_the_replica_it_was_first_sent_to(cluster: SimCluster) -> None:
    c = cluster
    weight: float = c.weight  # type: ignore[attr-defined]
    rng = random.Random(11)
    system = words(rng, SYSTEM_WORDS)
    home = c.route(f"{system} {words(rng, 40)}")
    other = "b" if home == "a" else "a"
    # the same family reaches the other replica without the router (another client)
    r = c.direct(other).post(
        "/v1/completions", json={"model": MODEL, "prompt": f"{system} {words(rng, 40)}",
                                 "max_tokens": 2},
    )  # fmt: skip
    assert r.status_code == 200
    c.sync("a")
    c.sync("b")
    probe = f"{system} {words(rng, 40)}"
    out = c.explain(prompt=probe)
    rows = {row["replica"]: row for row in out["replicas"]}
    # the prefix is cached on both: equal hits (0: no window checkpoint where the prompts
    # diverge yet, spec §4.7 Example 2) and equal look-ahead (the full-attention prefix)
    assert rows[home]["hit_tokens"] == rows[other]["hit_tokens"]
    assert rows[home]["score"]["look_ahead"] == rows[other]["score"]["look_ahead"] > 0
    homed = (SYSTEM_WORDS + 1) // CHUNK * CHUNK  # the whole chunks of BOS + system prompt
    assert rows[home]["score"]["affinity"] == weight * homed
    assert rows[other]["score"]["affinity"] == 0
    if weight:
        assert out["chosen"]["replica"] == home and out["tied"] == 1
        assert out["prefix_home_chunks"] >= homed // CHUNK
        assert (
            c.metric("kvrouter_prefix_home_chunks", dp_rank="0", pool=MODEL, replica=home)
            == out["prefix_home_chunks"]
        )
    else:
        assert out["tied"] == 2 and out["prefix_home_chunks"] is None

    # the home restarts: an empty cache, and the router forgets what it sent there
    c.replicas[home].restart()
    wait_for(
        lambda: c.rows(prompt=probe)[home]["score"]["affinity"] == 0,
        20,
        "the restarted replica to lose its homes",
    )


def test_a_request_that_fails_over_is_homed_where_it_went() -> None:
    policy = f"[pools.policy]\naffinity_weight = 1.0\naffinity_chunk_tokens = {CHUNK}\n"
    c = SimCluster(400, names=("a", "b"), extra_toml=policy)
    try:
        rng = random.Random(12)
        system = words(rng, SYSTEM_WORDS)
        home = c.route(f"{system} {words(rng, 40)}")
        other = "b" if home == "a" else "a"
        c.sync(home)
        c.replicas[home].stop_http()  # refuses connections; its events and cache stay
        # the family's home wins the decision, fails before the first byte, fails over
        turn = f"{system} {words(rng, 2 * CHUNK)}"
        assert c.route(turn) == other

        # the system prompt's chunks stay home; the chunks only this request carried belong
        # to the replica that served it: (1 + 320 + 128) // 64 = 7 chunks, 5 of them the
        # system prompt's (the first request's (1 + 320 + 40) // 64 = 5 all were)
        def chunks(name: str) -> float:
            return c.metric("kvrouter_prefix_home_chunks", dp_rank="0", pool=MODEL, replica=name)

        assert (chunks(home), chunks(other)) == (5, 2)
    finally:
        c.close()


def test_a_new_prefix_is_placed_away_from_the_replica_hosting_the_families() -> None:
    """The family spread through the running router: families are counted where the router
    homed them (the metric), and a prompt nobody sent before is charged for each family on a
    replica (the explain's ``spread``), so it goes to the other one."""
    spread = 4096.0  # far above any queue these sequential requests leave
    policy = (
        f"[pools.policy]\naffinity_weight = 1.0\naffinity_chunk_tokens = {CHUNK}\n"
        f"family_spread_tokens = {spread}\n"
    )
    c = SimCluster(400, names=("a", "b"), extra_toml=policy)
    try:
        rng = random.Random(13)

        def families(name: str) -> float | None:
            return c.metric("kvrouter_prefix_families", dp_rank="0", pool=MODEL, replica=name)

        system = words(rng, SYSTEM_WORDS)
        home = c.route(f"{system} {words(rng, 40)}")
        other = "b" if home == "a" else "a"
        assert not families(home)  # carried once: not a family yet
        assert c.route(f"{system} {words(rng, 40)}") == home  # its home keeps it
        assert families(home) == 1 and not families(other)
        out = c.explain(prompt=words(rng, 200))
        rows = {row["replica"]: row for row in out["replicas"]}
        assert rows[home]["score"]["spread"] == spread
        assert rows[other]["score"]["spread"] == 0
        assert out["chosen"]["replica"] == other
        # a family member is homed: nobody pays the spread, the home keeps it
        out = c.explain(prompt=f"{system} {words(rng, 40)}")
        assert [row["score"]["spread"] for row in out["replicas"]] == [0, 0]
        assert out["chosen"]["replica"] == home
        # the second family's first request goes to the other replica
        second = words(rng, SYSTEM_WORDS)
        assert c.route(f"{second} {words(rng, 40)}") == other
        assert c.route(f"{second} {words(rng, 40)}") == other
        assert families(home) == families(other) == 1
    finally:
        c.close()
