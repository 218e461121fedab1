"""The eviction term through the running router: two simulated replicas (their own block
pools), real HTTP and ZeroMQ. A system prompt two requests shared sits on one replica; a
novel prompt long enough to push it past that replica's eviction horizon goes to the other,
by the numbers derived here. The horizon is configured, or read from the replicas'
``vllm:cache_config_info`` (num_gpu_blocks · block_size over the layout's two KV groups)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.sim_cluster import SimCluster, words
from tests.zmq_helpers import wait_for

CHUNK = 64
SYSTEM_WORDS = 320  # with BOS 321 tokens: five whole 64-token chunks shared by two requests
SHARED = 5 * CHUNK


def _cluster(num_blocks: int, policy: str) -> SimCluster:
    return SimCluster(
        num_blocks,
        names=("a", "b"),
        extra_toml=f"[pools.policy]\naffinity_chunk_tokens = {CHUNK}\n{policy}",
    )


@pytest.fixture(params=[1.0, 0.0], ids=["eviction", "no-eviction"])
def fixed(request: pytest.FixtureRequest) -> Iterator[SimCluster]:
    c = _cluster(400, f"eviction_weight = {request.param}\neviction_horizon_tokens = 1000\n")
    c.weight = request.param  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        c.close()


def _family_home(c: SimCluster, rng: random.Random) -> str:
    """Two requests over one system prompt: both on one replica, the prompt's chunks shared."""
    system = words(rng, SYSTEM_WORDS)
    home = c.route(f"{system} {words(rng, 30)}")
    assert c.route(f"{system} {words(rng, 30)}") == home  # look-ahead and affinity
    return home


def test_a_novel_prompt_goes_where_it_evicts_no_shared_prefix(fixed: SimCluster) -> None:
    c = fixed
    weight: float = c.weight  # type: ignore[attr-defined]
    rng = random.Random(5)
    home = _family_home(c, rng)
    other = "b" if home == "a" else "a"
    # 999 new tokens leave the system prompt 999 tokens old on its home: alive (horizon 1000)
    short = words(rng, 998)  # + BOS
    rows = c.rows(prompt=short)
    assert rows[home]["score"]["eviction"] == rows[other]["score"]["eviction"] == 0
    # 1,000 push it out there: its five shared chunks are at risk on the home only
    novel = words(rng, 999)
    rows = c.rows(prompt=novel)
    assert rows[home]["hit_tokens"] == rows[other]["hit_tokens"] == 0
    assert rows[home]["score"]["eviction"] == weight * SHARED
    assert rows[other]["score"]["eviction"] == 0
    out = c.explain(prompt=novel)
    if weight:
        assert out["chosen"]["replica"] == other and out["tied"] == 1
        # routed for real (the shortlist path, checked against the full scan by conftest)
        assert c.route(novel) == other
    else:
        assert out["tied"] == 2


def test_the_horizon_comes_from_the_replicas_metrics() -> None:
    # 100 blocks of 16 tokens, two KV groups: a prefix lives 800 new tokens after its use
    c = _cluster(100, "eviction_weight = 1.0\n")
    try:
        rng = random.Random(8)
        home = _family_home(c, rng)
        other = "b" if home == "a" else "a"
        novel = words(rng, 799)  # 800 tokens with BOS: the horizon exactly
        wait_for(
            lambda: c.rows(prompt=novel)[home]["score"]["eviction"] == SHARED,
            20,
            "the horizon to be read from the replica's /metrics",
        )
        assert c.rows(prompt=words(rng, 798))[home]["score"]["eviction"] == 0
        out = c.explain(prompt=novel)
        rows = {row["replica"]: row for row in out["replicas"]}
        assert rows[other]["score"]["eviction"] == 0
        assert rows[home]["load"]["eviction_horizon_tokens"] == 800
        assert out["chosen"]["replica"] == other  # (explained only: 800 tokens do not fit)
    finally:
        c.close()
