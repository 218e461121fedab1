"""Cache pressure (router.core.pressure) and its term in the kv cost model: hand-derived
numbers, and the property that more pressure never makes a replica more attractive."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import PolicyConfig
from router.core.policy import Candidate, KVCostPolicy
from router.core.pressure import ORDER_KEY_SLACK, DecayingSum


def test_a_decaying_sum_halves_every_half_life() -> None:
    s = DecayingSum(10.0)
    s.add(1000, now=100.0)
    assert s.value(100.0) == 1000
    assert math.isclose(s.value(110.0), 500)
    s.add(500, now=110.0)  # 500 left of the first + 500 new
    assert math.isclose(s.value(130.0), 250)  # two half-lives later
    assert s.value(120.0) == s.value(130.0)  # a clock that went back reads the last value


_ADDS = st.lists(
    st.tuples(st.integers(1, 100_000), st.floats(0, 3600, allow_nan=False)), max_size=4
)


@given(st.lists(_ADDS, min_size=2, max_size=6), st.floats(0, 7200), st.floats(1.0, 1e6))
def test_the_order_key_orders_sums_as_their_values_at_any_later_time(
    histories: list[list[tuple[int, float]]], later: float, clock: float
) -> None:
    """router.core.shortlist sorts replicas by ``order_key`` between decisions and reads
    values only near the front: keys further apart than the slack must read in that order at
    every time after the adds (a monotonic clock up to 1e6 s here), and a never-added sum
    (key -inf) reads 0.0."""
    sums = []
    for adds in histories:
        s = DecayingSum(30.0)
        for amount, at in sorted(adds, key=lambda a: a[1]):
            s.add(amount, clock + at)
        sums.append(s)
    now = clock + 3600 + later
    for a in sums:
        if a.order_key() == -math.inf:
            assert a.value(now) == 0.0
        for b in sums:
            if a.order_key() + ORDER_KEY_SLACK < b.order_key():
                assert a.value(now) < b.value(now) or a.value(now) == 0.0 == b.value(now)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_a_half_life_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        DecayingSum(bad)


def cand(name: str, hit: int = 0, pressure: float = 0.0) -> Candidate:
    return Candidate((name, 0), hit_tokens=hit, fa_prefix_tokens=hit, recent_new_tokens=pressure)


def test_a_new_prefix_goes_where_the_cache_turns_over_slowest() -> None:
    policy = KVCostPolicy(PolicyConfig(pressure_weight=0.1))
    d = policy.choose(1500, [cand("a", pressure=30_000), cand("b", pressure=20_000)])
    assert d.chosen.key == ("b", 0)
    assert d.chosen.pressure == 2000.0 and d.ranked[1].pressure == 3000.0
    # without the term the two tie
    assert KVCostPolicy(PolicyConfig()).choose(1500, [cand("a"), cand("b")]).tied == 2


def test_a_real_hit_outweighs_a_smaller_pressure_gap() -> None:
    # cost = (n - hit) - w_ahead * hit + 0.1 * pressure: a hit of 600 with look-ahead 2 is
    # worth 1800 tokens; a 10,000-token pressure gap costs 1000: it stays
    policy = KVCostPolicy(PolicyConfig(pressure_weight=0.1, lookahead_weight=2.0))
    d = policy.choose(1000, [cand("a", hit=600, pressure=30_000), cand("b", pressure=20_000)])
    assert d.chosen.key == ("a", 0)
    assert d.chosen.cost == 1000 - 600 - 1200 + 3000
    # a 20,000-token gap (2000) outweighs it
    d = policy.choose(1000, [cand("a", hit=600, pressure=40_000), cand("b", pressure=20_000)])
    assert d.chosen.key == ("b", 0)


@given(st.integers(0, 2000), st.floats(0, 1e6), st.floats(0, 1e6))
def test_more_pressure_never_costs_less(hit: int, p: float, extra: float) -> None:
    policy = KVCostPolicy(PolicyConfig(pressure_weight=0.05))
    low = policy.score(2000, cand("a", hit=hit, pressure=p))
    high = policy.score(2000, cand("a", hit=hit, pressure=p + extra))
    assert high.cost >= low.cost
