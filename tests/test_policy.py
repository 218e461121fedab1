"""router.core.policy: the cost model's properties, ties, look-ahead and the comparison policies."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import PolicyConfig
from router.core.policy import (
    Candidate,
    KVCostPolicy,
    LeastLoadPolicy,
    NoCandidates,
    PrefixGroupBlindPolicy,
    RoundRobinPolicy,
    make_policy,
)

N = 2000

candidate = st.builds(
    Candidate,
    key=st.tuples(st.sampled_from("abcdef"), st.integers(0, 3)),
    hit_tokens=st.integers(0, N),
    fa_prefix_tokens=st.integers(0, N),
    tier_hits=st.dictionaries(st.sampled_from(["CPU", "STORAGE"]), st.integers(0, N)),
    blind_hit_tokens=st.integers(0, N),
    trusted=st.booleans(),
    in_flight=st.integers(0, 50),
    pending_prefill_tokens=st.integers(0, 100_000),
    running=st.none() | st.integers(0, 50),
    waiting=st.none() | st.integers(0, 50),
    kv_usage=st.none() | st.floats(0, 1),
)
unique_candidates = st.lists(candidate, min_size=1, max_size=8, unique_by=lambda c: c.key)
policy_names = st.sampled_from(["kv", "round_robin", "least_load", "prefix_group_blind"])


@given(unique_candidates, policy_names, st.integers(0, 2**32))
def test_decision_ranks_every_candidate_once(cands, name, seed) -> None:
    d = make_policy(PolicyConfig(name=name), random.Random(seed)).choose(N, cands)
    assert sorted(s.key for s in d.ranked) == sorted(c.key for c in cands)
    assert 1 <= d.tied <= len(cands)


@given(unique_candidates, st.integers(0, 2**32))
def test_kv_chosen_is_within_tie_of_best(cands, seed) -> None:
    d = KVCostPolicy(rng=random.Random(seed)).choose(N, cands)
    best = min(s.cost for s in d.ranked)
    assert d.chosen.cost - best <= PolicyConfig().tie_tokens


@given(candidate, st.integers(1, N))
def test_more_hit_never_costs_more(c, extra) -> None:
    p = KVCostPolicy()
    more = Candidate(**{**_fields(c), "hit_tokens": min(N, c.hit_tokens + extra)})
    assert p.score(N, more).cost <= p.score(N, c).cost


@given(candidate, st.integers(1, 20), st.integers(1, 5000))
def test_more_load_never_costs_less(c, reqs, tokens) -> None:
    p = KVCostPolicy()
    busier = Candidate(
        **{
            **_fields(c),
            "in_flight": c.in_flight + reqs,
            "running": None if c.running is None else c.running + reqs,
            "pending_prefill_tokens": c.pending_prefill_tokens + tokens,
        }
    )
    assert p.score(N, busier).cost > p.score(N, c).cost


@given(candidate)
def test_untrusted_state_counts_as_no_hit(c) -> None:
    p = KVCostPolicy()
    untrusted = Candidate(**{**_fields(c), "trusted": False})
    cold = Candidate(
        **{
            **_fields(c),
            "hit_tokens": 0,
            "fa_prefix_tokens": 0,
            "tier_hits": {},
        }
    )
    s = p.score(N, untrusted)
    assert s.hit_tokens == 0 and s.look_ahead == 0
    assert s.cost == p.score(N, cold).cost


def _fields(c: Candidate) -> dict:
    return {f: getattr(c, f) for f in Candidate.__slots__}


def test_exact_hit_wins_over_group_blind_prefix() -> None:
    # Both hold the full-attention blocks of 1600 tokens; only "kept" kept the window blocks.
    kept = Candidate(("kept", 0), hit_tokens=1600, fa_prefix_tokens=1600, blind_hit_tokens=1600)
    evicted = Candidate(("evicted", 0), hit_tokens=0, fa_prefix_tokens=1600, blind_hit_tokens=1600)
    for seed in range(20):
        d = KVCostPolicy(rng=random.Random(seed)).choose(N, [evicted, kept])
        assert d.chosen.key == ("kept", 0)
    # The group-blind policy cannot tell them apart: it picks either.
    picks = {
        PrefixGroupBlindPolicy(rng=random.Random(s)).choose(N, [evicted, kept]).chosen.key
        for s in range(40)
    }
    assert picks == {("kept", 0), ("evicted", 0)}


def test_look_ahead_breaks_ties_towards_longer_fa_prefix() -> None:
    a = Candidate(("a", 0), hit_tokens=0, fa_prefix_tokens=0)
    b = Candidate(("b", 0), hit_tokens=0, fa_prefix_tokens=608)
    for seed in range(20):
        assert KVCostPolicy(rng=random.Random(seed)).choose(N, [a, b]).chosen.key == ("b", 0)


def test_exact_hit_beats_short_prefix_credit() -> None:
    w = PolicyConfig().lookahead_weight
    exact = Candidate(("exact", 0), hit_tokens=512, fa_prefix_tokens=512)
    prefix = Candidate(("prefix", 0), hit_tokens=0, fa_prefix_tokens=int(512 / w) - 32)
    assert KVCostPolicy().choose(N, [prefix, exact]).chosen.key == ("exact", 0)


def test_load_outweighs_a_small_hit() -> None:
    hot = Candidate(("hot", 0), hit_tokens=64, in_flight=10, pending_prefill_tokens=10_000)
    idle = Candidate(("idle", 0))
    assert KVCostPolicy().choose(N, [hot, idle]).chosen.key == ("idle", 0)


def test_lower_tiers_are_weighted() -> None:
    p = KVCostPolicy()
    gpu = p.score(N, Candidate(("g", 0), hit_tokens=1000))
    cpu = p.score(N, Candidate(("c", 0), hit_tokens=0, tier_hits={"CPU": 1000}))
    assert cpu.effective_hit == pytest.approx(500)
    assert gpu.cost < cpu.cost < p.score(N, Candidate(("n", 0))).cost


def test_a_bounded_replay_tail_saves_no_prefill() -> None:
    # DeepSeek-V4.1-style bounded replay: a 1,000-token hit with a 128-token window reports
    # 1,000 cached tokens but prefills the last 128 again, so it saves 872
    p = KVCostPolicy(PolicyConfig(lookahead_weight=0.0))
    plain = p.score(N, Candidate(("p", 0), hit_tokens=1000))
    replayed = p.score(N, Candidate(("r", 0), hit_tokens=1000, replay_tokens=128))
    assert replayed.hit_tokens == 1000 and replayed.effective_hit == 872
    assert replayed.cost - plain.cost == 128
    shorter = Candidate(("s", 0), hit_tokens=900)  # saves 900 > 872: the better choice
    chosen = p.choose(N, [Candidate(("r", 0), hit_tokens=1000, replay_tokens=128), shorter])
    assert chosen.chosen.key == ("s", 0)


def test_kv_pressure_adds_cost_only_above_threshold() -> None:
    p = KVCostPolicy()
    base = p.score(N, Candidate(("a", 0), kv_usage=0.5)).cost
    assert p.score(N, Candidate(("a", 0), kv_usage=0.9)).cost == base
    assert p.score(N, Candidate(("a", 0), kv_usage=1.0)).cost > base


def test_ties_are_random_but_reproducible() -> None:
    cands = [Candidate((n, 0)) for n in "abc"]
    picks = [KVCostPolicy(rng=random.Random(s)).choose(N, cands).chosen.key for s in range(60)]
    assert set(picks) == {(n, 0) for n in "abc"}
    again = [KVCostPolicy(rng=random.Random(s)).choose(N, cands).chosen.key for s in range(60)]
    assert picks == again
    assert KVCostPolicy().choose(N, cands).tied == 3


def test_temperature_samples_by_cost() -> None:
    cfg = PolicyConfig(temperature=200.0)
    p = KVCostPolicy(cfg, random.Random(7))
    good = Candidate(("good", 0), hit_tokens=1000)
    bad = Candidate(("bad", 0))
    counts = Counter(p.choose(N, [good, bad]).chosen.key[0] for _ in range(2000))
    # exp(-1000 * (1 + w) / 200) is tiny: "bad" is almost never sampled but can be.
    assert counts["good"] > 1900
    cold = KVCostPolicy(PolicyConfig(temperature=1e9), random.Random(7))
    counts = Counter(cold.choose(N, [good, bad]).chosen.key[0] for _ in range(2000))
    assert 800 < counts["good"] < 1200


def test_round_robin_cycles() -> None:
    cands = [Candidate((n, 0), hit_tokens=1000 if n == "a" else 0) for n in "cab"]
    rr = RoundRobinPolicy()
    assert [rr.choose(N, cands).chosen.key[0] for _ in range(6)] == list("abcabc")


def test_least_load_ignores_hits() -> None:
    busy = Candidate(("busy", 0), hit_tokens=1999, in_flight=1)
    free = Candidate(("free", 0))
    assert LeastLoadPolicy().choose(N, [busy, free]).chosen.key == ("free", 0)


@pytest.mark.parametrize("name", ["kv", "round_robin", "least_load", "prefix_group_blind"])
def test_no_candidates_is_a_typed_error(name: str) -> None:
    with pytest.raises(NoCandidates, match="undrain"):
        make_policy(PolicyConfig(name=name)).choose(N, [])


def test_explaining_does_not_move_the_policy() -> None:
    """An explain call (commit=False) must not change what the next request gets."""
    cands = [
        Candidate(key=(k, 0), hit_tokens=0, fa_prefix_tokens=0, tier_hits={}, blind_hit_tokens=0,
                  trusted=True, in_flight=0, pending_prefill_tokens=0, running=None,
                  waiting=None, kv_usage=None)
        for k in "abc"
    ]  # fmt: skip
    rr = make_policy(PolicyConfig(name="round_robin"))
    firsts = []
    for _ in range(4):
        peek = rr.choose(N, cands, commit=False).chosen.key
        real = rr.choose(N, cands).chosen.key
        assert peek == real
        firsts.append(real)
    assert firsts == [("a", 0), ("b", 0), ("c", 0), ("a", 0)]
    kv = KVCostPolicy(rng=random.Random(5))
    for _ in range(20):  # all tied: the pick comes from the RNG
        assert kv.choose(N, cands, commit=False).chosen.key == kv.choose(N, cands).chosen.key


def test_the_load_band_lets_a_cached_prefix_outweigh_a_small_queue_gap() -> None:
    # n = 1000; a holds 600 (look-ahead 2) behind 2,500 queued tokens, b holds nothing behind 500
    a = Candidate(("a", 0), hit_tokens=600, fa_prefix_tokens=600, pending_prefill_tokens=2500)
    b = Candidate(("b", 0), pending_prefill_tokens=500)
    plain = KVCostPolicy(PolicyConfig(lookahead_weight=2.0)).choose(1000, [a, b])
    assert plain.chosen.key == ("b", 0)  # 1000-600+2500-1200 = 1700 > 1000+500
    banded = KVCostPolicy(PolicyConfig(lookahead_weight=2.0, load_band_tokens=1024))
    d = banded.choose(1000, [a, b])
    assert d.chosen.key == ("a", 0)
    assert d.chosen.queued == 500 + (2000 - 1024) and d.chosen.cost == 400 + 1476 - 1200
    # comparison policies ignore the kv knob
    cfg = PolicyConfig(load_band_tokens=1e9)
    assert LeastLoadPolicy(cfg).choose(1000, [a, b]).chosen.key == ("b", 0)


def test_in_the_load_band_a_request_no_replica_holds_goes_where_the_cache_churns_least() -> None:
    # the band makes both queues count as 300 for the cost: tied; the tie goes by real load
    a = Candidate(("a", 0), pending_prefill_tokens=1200)
    b = Candidate(("b", 0), pending_prefill_tokens=300)
    for seed in range(20):
        d = KVCostPolicy(PolicyConfig(load_band_tokens=2048), rng=random.Random(seed)).choose(
            1000, [a, b]
        )
        assert d.tied == 2 and d.chosen.key == ("b", 0)
    # equal real load too: the RNG picks, and both get picked
    c = Candidate(("c", 0), pending_prefill_tokens=300)
    picks = {
        KVCostPolicy(PolicyConfig(load_band_tokens=2048), rng=random.Random(seed))
        .choose(1000, [a, b, c])
        .chosen.key
        for seed in range(40)
    }
    assert picks == {("b", 0), ("c", 0)}
    # the cache that turned over less lately goes first, even a little more queued (in band)
    churned = Candidate(("b", 0), pending_prefill_tokens=300, recent_new_tokens=9000.0)
    calm = Candidate(("a", 0), pending_prefill_tokens=1200, recent_new_tokens=2000.0)
    d = KVCostPolicy(PolicyConfig(load_band_tokens=2048)).choose(1000, [churned, calm])
    assert d.chosen.key == ("a", 0)
    # beyond the band the queue counts in the cost again
    far = Candidate(("a", 0), pending_prefill_tokens=5000, recent_new_tokens=2000.0)
    d = KVCostPolicy(PolicyConfig(load_band_tokens=2048)).choose(1000, [churned, far])
    assert d.tied == 1 and d.chosen.key == ("b", 0)


@given(unique_candidates, st.floats(0, 5000))
def test_the_load_band_never_reorders_equal_hits_by_less_load(
    cands: list[Candidate], band: float
) -> None:
    """Within the band costs only move closer together: a candidate never overtakes one
    with the same hits, trust and look-ahead but less queued work."""
    d = KVCostPolicy(PolicyConfig(load_band_tokens=band)).choose(N, cands, commit=False)
    by_key = {c.key: c for c in cands}
    costs = {s.key: s.cost for s in d.ranked}
    for x in cands:
        for y in cands:
            same = (x.hit_tokens, x.fa_prefix_tokens, x.trusted, dict(x.tier_hits)) == (
                y.hit_tokens,
                y.fa_prefix_tokens,
                y.trusted,
                dict(y.tier_hits),
            )
            if (
                same
                and x.pending_prefill_tokens <= y.pending_prefill_tokens
                and all(
                    getattr(x, f) == getattr(y, f)
                    for f in ("in_flight", "running", "waiting", "kv_usage", "recent_new_tokens")
                )
            ):
                assert costs[x.key] <= costs[y.key], (by_key[x.key], by_key[y.key])
