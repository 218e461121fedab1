"""Prefix homes (router.core.affinity) against a reference that keys whole prefixes instead of
hash chains, and the affinity term of the kv cost model with hand-derived numbers."""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import native_chain
from router.config import PolicyConfig
from router.core import affinity
from router.core.affinity import PrefixHomes
from router.core.policy import (
    Candidate,
    KVCostPolicy,
    crowded_homes,
    new_prefix,
    request_load,
)
from router.server.metrics import RouterMetrics

A, B = ("a", 0), ("b", 0)


def test_the_first_request_to_carry_a_prefix_gives_it_its_home() -> None:
    homes = PrefixHomes(chunk_tokens=4)
    system = list(range(100, 112))  # three chunks
    # the trailing 2 tokens are no chunk
    assert len(homes.record(homes.keys([*system, 1, 2]), A)) == 3
    # a second conversation over the same system prompt, routed elsewhere, keeps the home
    assert len(homes.record(homes.keys([*system, 7, 7, 7, 7]), B)) == 1
    assert homes.homed(homes.keys([*system, 9, 9, 9, 9, 9])) == {A: 12}
    assert homes.homed(homes.keys([*system, 7, 7, 7, 7, 5])) == {A: 12, B: 4}
    # the walk stops at the first chunk nobody carried, even if a later one matches by chance
    assert homes.homed(homes.keys([100, 101, 102, 103, 0, 0, 0, 0, *system[8:]])) == {A: 4}
    assert homes.homed(homes.keys([1, 2, 3])) == {}


def test_least_recently_routed_chunks_leave_first() -> None:
    homes = PrefixHomes(chunk_tokens=2, capacity=4)
    homes.record(homes.keys([1, 1, 2, 2]), A)  # chunks k1, k12
    homes.record(homes.keys([3, 3, 4, 4]), B)  # k3, k34
    homes.record(homes.keys([1, 1]), A)  # refresh k1: k12 is now the oldest
    homes.record(homes.keys([5, 5]), B)  # over capacity: k12 goes
    assert len(homes) == 4
    assert homes.homes_by_replica() == {A: 1, B: 3}
    assert homes.homed(homes.keys([1, 1, 2, 2])) == {A: 2}
    assert homes.homed(homes.keys([3, 3, 4, 4])) == {B: 4}


def test_forgetting_a_replica_frees_its_prefixes_for_a_new_home() -> None:
    homes = PrefixHomes(chunk_tokens=2)
    homes.record(homes.keys([1, 1, 2, 2]), A)
    homes.record(homes.keys([1, 1, 3, 3]), B)
    assert homes.homes_by_replica() == {A: 2, B: 1}
    assert homes.forget_replica(A) == 2
    assert homes.homed(homes.keys([1, 1, 3, 3])) == {}  # its first chunk was A's
    homes.record(homes.keys([1, 1, 3, 3]), B)
    assert homes.homed(homes.keys([1, 1, 3, 3])) == {B: 4}


def test_a_failed_over_request_takes_back_only_the_homes_it_made() -> None:
    homes = PrefixHomes(chunk_tokens=2)
    homes.record(homes.keys([1, 1]), A)
    new = homes.record(homes.keys([1, 1, 2, 2, 3, 3]), B)  # [1, 1] was A's already
    assert len(new) == 2
    homes.withdraw(new, B)  # B failed before its first byte; the proxy goes on to A
    assert homes.homed(homes.keys([1, 1, 2, 2, 3, 3])) == {A: 2}
    assert homes.homes_by_replica() == {A: 1}
    homes.record(homes.keys([1, 1, 2, 2, 3, 3]), A)
    assert homes.homed(homes.keys([1, 1, 2, 2, 3, 3])) == {A: 6}


def test_a_first_chunk_a_second_request_carries_makes_a_family() -> None:
    homes = PrefixHomes(chunk_tokens=2)
    system = [9, 9, 8, 8]
    homes.record(homes.keys([*system, 1, 1]), A)
    homes.record(homes.keys([5, 5, 6, 6]), B)  # a one-off
    assert homes.families_by_replica() == {}  # nothing carried twice yet
    homes.record(homes.keys([*system, 2, 2]), B)  # the prompt's second conversation, sent to B
    assert homes.families_by_replica() == {A: 1}  # the family is where its first chunk is
    homes.record(homes.keys([*system, 3, 3]), A)
    homes.record(homes.keys([9, 9]), A)  # a family counts once, however often carried
    assert homes.families(A) == 1 and homes.families(B) == 0
    homes.record(homes.keys([7]), B)  # shorter than a chunk: carries nothing
    assert homes.families_by_replica() == {A: 1}
    homes.record(homes.keys([5, 5]), A)  # the one-off's opening, carried again: a family on B
    assert homes.families_by_replica() == {A: 1, B: 1}
    assert homes.forget_replica(B) == 3
    assert homes.families_by_replica() == {A: 1}
    homes.record(homes.keys([5, 5]), A)  # homed afresh on A: a first carrier, not a family
    assert homes.families_by_replica() == {A: 1}


def test_a_family_leaves_with_its_first_chunk() -> None:
    """Each change of a replica's family count is also reported once by
    ``take_family_changes`` (the shortlist re-files the replica by it)."""
    homes = PrefixHomes(chunk_tokens=2, capacity=3)
    homes.record(homes.keys([1, 1]), A)
    assert homes.take_family_changes() == set()  # a first carrier is no family
    homes.record(homes.keys([1, 1, 2, 2]), A)  # a family on A
    assert homes.families_by_replica() == {A: 1}
    assert homes.take_family_changes() == {A} and homes.take_family_changes() == set()
    homes.record(homes.keys([3, 3, 4, 4]), B)  # over capacity: [1, 1] is the oldest
    assert homes.families_by_replica() == {}
    assert homes.take_family_changes() == {A}
    new = homes.record(homes.keys([3, 3]), A)  # a family on B; the home is B's, nothing new
    assert new == [] and homes.families_by_replica() == {B: 1}
    assert homes.take_family_changes() == {B}
    # a request that failed over withdraws the chunks it homed, a family's first among them
    made = homes.record(homes.keys([6, 6]), B)
    homes.record(homes.keys([6, 6]), B)
    assert homes.families_by_replica() == {B: 2}
    homes.take_family_changes()
    homes.withdraw(made, B)
    assert homes.families_by_replica() == {B: 1}
    assert homes.take_family_changes() == {B}
    homes.forget_replica(A)  # no family there: nothing to re-file
    assert homes.take_family_changes() == set()
    homes.forget_replica(B)
    assert homes.take_family_changes() == {B}


@pytest.mark.parametrize(("chunk", "capacity"), [(0, 10), (4, 0)])
def test_bad_sizes_are_refused(chunk: int, capacity: int) -> None:
    with pytest.raises(ValueError, match="chunk_tokens >= 1 and capacity >= 1"):
        PrefixHomes(chunk, capacity)


def test_the_config_refuses_what_prefix_homes_cannot_hold() -> None:
    with pytest.raises(ValueError, match="affinity_weight must be >= 0"):
        PolicyConfig(affinity_weight=-1.0)
    with pytest.raises(ValueError, match="affinity_chunk_tokens"):
        PolicyConfig(affinity_chunk_tokens=0)


class ReferenceHomes:
    """The same contract keyed by whole prefixes (tuples), without hashing; least recently
    routed out first past ``capacity``, one at a time."""

    def __init__(self, chunk: int, capacity: int = 10**9) -> None:
        self.chunk = chunk
        self.capacity = capacity
        self.homes: collections.OrderedDict[tuple[int, ...], tuple[str, int]] = (
            collections.OrderedDict()
        )
        self.reused: set[tuple[int, ...]] = set()  # first chunks carried twice while homed

    def prefixes(self, toks: list[int]) -> list[tuple[int, ...]]:
        n = len(toks) // self.chunk
        return [tuple(toks[: (i + 1) * self.chunk]) for i in range(n)]

    def record(self, toks: list[int], rep: tuple[str, int]) -> list[tuple[int, ...]]:
        ps = self.prefixes(toks)
        if ps and ps[0] in self.homes:
            self.reused.add(ps[0])
        new = [p for p in ps if p not in self.homes]
        for p in ps:
            self.homes.setdefault(p, rep)
            self.homes.move_to_end(p)
        while len(self.homes) > self.capacity:
            self.reused.discard(self.homes.popitem(last=False)[0])
        return new

    def withdraw(self, new: list[tuple[int, ...]], rep: tuple[str, int]) -> None:
        for p in new:
            if self.homes.get(p) == rep:
                del self.homes[p]
                self.reused.discard(p)

    def families(self) -> dict[tuple[str, int], int]:
        return dict(collections.Counter(self.homes[p] for p in self.reused))

    def homed(self, toks: list[int]) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for p in self.prefixes(toks):
            if p not in self.homes:
                break
            out[self.homes[p]] = out.get(self.homes[p], 0) + self.chunk
        return out


ops = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "ask", "withdraw", "forget"]),
        st.lists(st.integers(0, 2), max_size=14),  # a small alphabet: prefixes collide
        st.sampled_from([A, B, ("c", 1)]),
    ),
    max_size=40,
)


@settings(max_examples=300)
@given(st.integers(1, 4), st.sampled_from([1, 2, 3, 5, 100_000]), ops)
def test_prefix_homes_agree_with_whole_prefix_keys(chunk: int, capacity: int, steps: list) -> None:
    """Homes, their walk, families and the per-replica counts, with evictions (one request
    evicting several chunks at a small capacity) and without, failovers and forgotten
    replicas."""
    homes, ref = PrefixHomes(chunk, capacity), ReferenceHomes(chunk, capacity)
    last: tuple = ([], [], A)  # the last record's new chunks (both sides) and replica
    for op, toks, rep in steps:
        if op == "record":
            last = (homes.record(homes.keys(toks), rep), ref.record(toks, rep), rep)
            assert len(last[0]) == len(last[1])
        elif op == "ask":
            got = homes.homed(homes.keys(toks))
            assert got == ref.homed(toks)
            assert sum(got.values()) <= len(toks)
        elif op == "withdraw":  # the last request failed over
            homes.withdraw(last[0], last[2])
            ref.withdraw(last[1], last[2])
            last = ([], [], A)
        else:
            gone = [p for p, r in ref.homes.items() if r == rep]
            assert homes.forget_replica(rep) == len(gone)
            for p in gone:
                del ref.homes[p]
                ref.reused.discard(p)
        assert homes.homes_by_replica() == dict(collections.Counter(ref.homes.values()))
        assert homes.families_by_replica() == ref.families()


token = st.one_of(
    st.integers(0, 70_000),
    st.sampled_from([2**61 - 2, 2**61 - 1, 2**61, 2**63, 2**64, -1, -2, -(2**61), True, False]),
    st.integers(),
    st.floats(allow_nan=False),
)


@pytest.mark.skipif(native_chain() is None, reason="events._chain not built or switched off")
@settings(max_examples=400)
@given(st.lists(token, max_size=300), st.integers(1, 70), st.booleans())
def test_chunk_keys_in_c_are_the_python_keys(toks: list, chunk: int, as_tuple: bool) -> None:
    """events._chain.chunk_chain (PrefixHomes.keys where it is in use) computes exactly
    Python's hash((h, tuple(chunk))) chain: ints past 2**61 and 2**64, negative ints, bools
    and floats included (hashed by their own __hash__, as a tuple does). Where the extension
    is in use its check at import must have passed too."""
    assert affinity._chunk_chain is not None
    seq = tuple(toks) if as_tuple else toks
    assert affinity._chunk_chain(seq, chunk) == affinity.chunk_keys(seq, chunk)
    assert PrefixHomes(chunk).keys(seq) == affinity.chunk_keys(seq, chunk)


@pytest.mark.skipif(native_chain() is None, reason="events._chain not built or switched off")
def test_a_token_whose_hash_empties_the_list_leaves_the_keys_to_python() -> None:
    """Hostile tokens: the C keys read a list's items in place, so a ``__hash__`` that
    changes the list must hand the work back (None), never read past its end."""

    class Emptying(int):
        def __hash__(self) -> int:
            toks.clear()
            return 5

    toks = [1, 2, Emptying(3), 4, 5, 6]
    assert affinity._chunk_chain(toks, 2) is None
    toks = [1, 2, Emptying(3), 4, 5, 6]
    assert PrefixHomes(2).keys(toks) == []  # Python's keys of what the C call left of it


def test_chunk_keys_stay_in_python_where_c_disagrees_or_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    toks = list(range(300))
    assert PrefixHomes(64).keys(range(300)) == affinity.chunk_keys(toks, 64)  # not a list

    class Wrong:
        @staticmethod
        def chunk_chain(seq: object, chunk: int) -> list[int]:
            return [0]

    monkeypatch.setattr(affinity, "native_chain", lambda: Wrong)
    assert affinity._load_chunk_chain() is None
    monkeypatch.setattr(affinity, "native_chain", lambda: None)
    assert affinity._load_chunk_chain() is None
    monkeypatch.setattr(affinity, "_chunk_chain", None)
    assert PrefixHomes(64).keys(toks) == affinity.chunk_keys(toks, 64)


def cand(name: str, hit: int = 0, home: int = 0, queued: int = 0, trusted: bool = True):
    return Candidate(
        (name, 0),
        hit_tokens=hit,
        fa_prefix_tokens=hit,
        home_tokens=home,
        pending_prefill_tokens=queued,
        trusted=trusted,
    )


def test_the_home_wins_the_tie_a_shared_prefix_leaves() -> None:
    # a 600-token system prompt cached on both replicas; the home 'a' has 400 more tokens
    # queued. cost = (1000 - 600) + queued - 2 * 600 - 1.0 * home
    policy = KVCostPolicy(PolicyConfig(affinity_weight=1.0, lookahead_weight=2.0))
    d = policy.choose(1000, [cand("a", 600, home=576, queued=400), cand("b", 600)])
    assert d.chosen.key == ("a", 0)
    assert d.chosen.cost == 400 + 400 - 1200 - 576
    assert d.chosen.affinity == 576 and d.ranked[1].affinity == 0
    assert d.chosen.as_dict()["affinity"] == 576
    # a queue gap beyond the credit moves it
    d = policy.choose(1000, [cand("a", 600, home=576, queued=600), cand("b", 600)])
    assert d.chosen.key == ("b", 0)
    # without the term the queue decides at once
    no_term = KVCostPolicy(PolicyConfig(affinity_weight=0.0))
    d = no_term.choose(1000, [cand("a", 600, 576, 1), cand("b", 600)])
    assert d.chosen.key == ("b", 0)


def test_the_credit_is_bounded_so_a_shared_prefix_cannot_hold_all_traffic() -> None:
    # every request starts with the same 4,000-token agent prompt, homed on 'a': the credit
    # stops at affinity_max_tokens (1000), so a queue gap above it moves the request
    policy = KVCostPolicy(PolicyConfig(affinity_weight=2.0, affinity_max_tokens=1000.0))
    d = policy.choose(5000, [cand("a", 4000, home=4000, queued=999), cand("b", 4000)])
    assert d.chosen.key == ("a", 0) and d.chosen.affinity == 1000
    d = policy.choose(5000, [cand("a", 4000, home=4000, queued=1001), cand("b", 4000)])
    assert d.chosen.key == ("b", 0)
    with pytest.raises(ValueError, match="affinity_max_tokens must be >= 0"):
        PolicyConfig(affinity_max_tokens=-1.0)


def test_a_home_never_outbids_a_longer_exact_hit_elsewhere() -> None:
    # 'b' came back from a failure with the prefix cached (hit 160); 'a' served the family
    # meanwhile and is its home, with the full-attention prefix but no checkpoint (hit 0)
    policy = KVCostPolicy(PolicyConfig(affinity_weight=2.0))
    a = Candidate(("a", 0), hit_tokens=0, fa_prefix_tokens=160, home_tokens=128)
    b = Candidate(("b", 0), hit_tokens=160, fa_prefix_tokens=160)
    d = policy.choose(400, [a, b])
    assert d.chosen.key == ("b", 0)
    assert [s.affinity for s in d.ranked] == [0, 0]
    # scored alone, the home's credit (256) would have outbid the hit (160)
    assert policy.score(400, a).cost < policy.score(400, b).cost
    # with equal hits the home keeps it
    a_hit = dataclasses.replace(a, hit_tokens=160)
    d = policy.choose(400, [a_hit, b])
    assert d.chosen.key == ("a", 0) and d.chosen.affinity == 256


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 2000)),
        min_size=1,
        max_size=5,
    )
)
def test_the_chosen_replica_always_has_the_longest_hit_or_no_credit(rows: list) -> None:
    policy = KVCostPolicy(PolicyConfig(affinity_weight=2.0, seed=1))
    cands = [
        Candidate((f"r{i}", 0), hit_tokens=64 * h, fa_prefix_tokens=64 * h,
                  home_tokens=64 * home, pending_prefill_tokens=q)
        for i, (h, home, q) in enumerate(rows)
    ]  # fmt: skip
    d = policy.choose(1000, cands)
    best = max(c.hit_tokens for c in cands)
    for s in d.ranked:
        assert s.affinity == 0 or s.hit_tokens == best


def test_an_untrusted_replica_gets_no_affinity() -> None:
    policy = KVCostPolicy(PolicyConfig(affinity_weight=1.0))
    # 'a' is attaching: its homes say nothing about a cache the router cannot see
    d = policy.choose(1000, [cand("a", home=1000, trusted=False), cand("b", home=0)])
    assert d.tied == 2
    assert [s.affinity for s in d.ranked] == [0, 0]


@given(st.integers(0, 4000), st.integers(0, 4000), st.integers(0, 4000))
def test_more_home_never_costs_more(home: int, extra: int, queued: int) -> None:
    policy = KVCostPolicy(PolicyConfig(affinity_weight=1.5, affinity_max_tokens=1e9))
    lo = policy.score(4000, cand("a", home=home, queued=queued))
    hi = policy.score(4000, cand("a", home=home + extra, queued=queued))
    assert hi.cost == lo.cost - 1.5 * extra
    capped = KVCostPolicy(PolicyConfig(affinity_weight=1.5, affinity_max_tokens=3000.0))
    lo, hi = (capped.score(4000, cand("a", home=h, queued=queued)) for h in (home, home + extra))
    assert hi.cost <= lo.cost and lo.affinity <= 3000 and hi.affinity <= 3000


HOMES_X8 = {"affinity_weight": 8.0, "affinity_max_tokens": 8192.0}


def _fleet(loads: list[int], home: str = "r0") -> list[Candidate]:
    """A 600-token system prompt cached on every replica (hits and look-ahead tie), homed on
    ``home``; replica ``ri`` has ``loads[i]`` requests in flight."""
    return [
        Candidate((f"r{i}", 0), hit_tokens=600, fa_prefix_tokens=600, in_flight=n,
                  home_tokens=576 if f"r{i}" == home else 0)
        for i, n in enumerate(loads)
    ]  # fmt: skip


def test_a_home_past_twice_its_fair_share_loses_its_credit() -> None:
    policy = KVCostPolicy(PolicyConfig(**HOMES_X8, affinity_fair_share=2.0, seed=0))
    # four replicas, eight requests in flight in all: the mean is 2, the home holds four of
    # them (= 2 x the mean, not above): the credit stands and outbids its 1,024-token queue
    d = policy.choose(1000, _fleet([4, 2, 1, 1]))
    assert d.chosen.key == ("r0", 0) and d.chosen.affinity == 8 * 576 and d.crowded == ()
    # five of nine (5 x 4 > 2 x 9): no credit; the least loaded replica with the same hit
    d = policy.choose(1000, _fleet([5, 2, 1, 1]))
    assert d.chosen.key in {("r2", 0), ("r3", 0)}
    assert all(s.affinity == 0 for s in d.ranked)
    assert d.crowded == (("r0", 0),)  # named, so the service counts the override
    assert d.chosen.cost == 400 + 256 - 2 * 600  # prefill + one request queued - look-ahead
    # off: the credit holds the home through the same crowd
    off = KVCostPolicy(PolicyConfig(**HOMES_X8, affinity_fair_share=0.0))
    assert off.choose(1000, _fleet([5, 2, 1, 1])).chosen.key == ("r0", 0)
    # below one request per replica the mean counts as one: a quiet fleet's home holds two
    assert policy.choose(1000, _fleet([2, 0, 0, 0])).chosen.key == ("r0", 0)
    assert all(s.affinity == 0 for s in policy.choose(1000, _fleet([3, 0, 0, 0])).ranked)
    # the bound counts vLLM's waiting requests, and its running ones where they exceed the
    # router's own (another client's): one in flight and two waiting are three requests
    crowd = _fleet([1, 0, 0, 0])
    assert policy.choose(1000, crowd).chosen.key == ("r0", 0)
    crowd[0] = dataclasses.replace(crowd[0], waiting=2)
    assert all(s.affinity == 0 for s in policy.choose(1000, crowd).ranked)


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.none() | st.integers(0, 40),
                       st.none() | st.integers(0, 40)), min_size=1, max_size=2),
    st.floats(2.0, 64.0),
)  # fmt: skip
def test_with_two_replicas_a_fair_share_of_two_or_more_never_binds(
    loads: list[tuple[int, int | None, int | None]], fair: float
) -> None:
    # a replica's load is at most the sum of both, which is 2 x the mean: the bound only
    # matters in a larger fleet, and the two-replica benchmark runs exactly as without it
    cands = [
        Candidate((f"r{i}", 0), hit_tokens=64, in_flight=f, running=r, waiting=w,
                  home_tokens=64)
        for i, (f, r, w) in enumerate(loads)
    ]  # fmt: skip
    cfg = PolicyConfig(**HOMES_X8, affinity_fair_share=fair)
    assert crowded_homes(cfg, cands) == frozenset()
    assert KVCostPolicy(cfg).choose(1000, cands).crowded == ()


def test_a_scraped_count_becomes_whole_requests() -> None:
    c = Candidate(("a", 0), in_flight=2)
    assert request_load(c) == 2
    assert request_load(dataclasses.replace(c, running=5, waiting=1)) == 6
    assert request_load(dataclasses.replace(c, running=1, waiting=0)) == 2  # router's own
    # a hostile or broken /metrics: NaN counts nothing, inf and 1e300 are capped, never raise
    nan = dataclasses.replace(c, running=math.nan, waiting=math.nan)  # type: ignore[arg-type]
    assert request_load(nan) == 2
    big = dataclasses.replace(c, running=math.inf, waiting=1e300)  # type: ignore[arg-type]
    assert request_load(big) == 2 * (1 << 40)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="affinity_fair_share"):
            PolicyConfig(affinity_fair_share=bad)


def test_a_new_prefix_goes_where_fewer_families_live() -> None:
    # two idle-ish replicas, no hit, no home: 'a' hosts three families and has 500 tokens less
    # queued. cost = 1000 (prefill) + queued + 400 * families
    cfg = PolicyConfig(affinity_weight=2.0, family_spread_tokens=400.0)
    a = Candidate(("a", 0), pending_prefill_tokens=0, families=3)
    b = Candidate(("b", 0), pending_prefill_tokens=500, families=1)
    d = KVCostPolicy(cfg).choose(1000, [a, b])
    assert d.chosen.key == ("b", 0)
    assert d.chosen.cost == 1000 + 500 + 400 and d.ranked[1].cost == 1000 + 0 + 1200
    assert d.chosen.as_dict()["spread"] == 400 and d.ranked[1].spread == 1200
    # a queue gap beyond the families' difference (2 x 400) still decides
    d = KVCostPolicy(cfg).choose(1000, [a, dataclasses.replace(b, pending_prefill_tokens=801)])
    assert d.chosen.key == ("a", 0)
    # off: the queue decides at once
    d = KVCostPolicy(PolicyConfig(family_spread_tokens=0.0)).choose(1000, [a, b])
    assert d.chosen.key == ("a", 0) and [s.spread for s in d.ranked] == [0, 0]
    # the default where prefix homes are on: 2048 per family, so two families outweigh 500
    d = KVCostPolicy(PolicyConfig()).choose(1000, [a, b])
    assert d.chosen.key == ("b", 0) and [s.spread for s in d.ranked] == [2048, 6144]
    # without prefix homes there are no families to count: the unset spread is off
    assert PolicyConfig(affinity_weight=0.0).family_spread_tokens == 0.0


def test_a_prefix_cached_without_a_home_is_not_pushed_off_its_cache() -> None:
    """Another client sent the prefix straight to 'a' (so the router homed it nowhere): its
    160-token hit there decides, whatever 'a' hosts. An untrusted replica's claim is no hit,
    and the request is then a new prefix like any other."""
    a = Candidate(("a", 0), hit_tokens=160, fa_prefix_tokens=160, families=3)
    b = Candidate(("b", 0))
    cfg = PolicyConfig()
    assert not new_prefix(cfg, [a, b])
    d = KVCostPolicy(cfg).choose(1000, [a, b])
    assert d.chosen.key == ("a", 0) and [s.spread for s in d.ranked] == [0, 0]
    offloaded = dataclasses.replace(a, hit_tokens=0, fa_prefix_tokens=0, tier_hits={"CPU": 160})
    assert not new_prefix(cfg, [offloaded, b])  # a lower tier holds it: not new either
    guess = [dataclasses.replace(a, trusted=False), b]
    assert new_prefix(cfg, guess)
    d = KVCostPolicy(cfg).choose(1000, guess)
    assert d.chosen.key == ("b", 0) and d.ranked[1].spread == 3 * 2048


def test_a_request_with_a_home_anywhere_pays_no_spread() -> None:
    # a family's later request, homed on 'a' (which hosts more families): it must not be
    # pushed off, and a replica that is not its home pays nothing either
    cfg = PolicyConfig(affinity_weight=2.0, family_spread_tokens=400.0)
    a = Candidate(("a", 0), hit_tokens=0, home_tokens=64, pending_prefill_tokens=100, families=5)
    b = Candidate(("b", 0), families=1)
    d = KVCostPolicy(cfg).choose(1000, [a, b])
    assert d.chosen.key == ("a", 0)
    assert [s.spread for s in d.ranked] == [0, 0]
    assert d.chosen.cost == 1000 + 100 - 128


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3000)), min_size=2, max_size=6))
def test_the_spread_only_ever_moves_a_new_prefix_toward_fewer_families(rows: list) -> None:
    """Against the queue alone: where the choice differs, the replica it went to hosts fewer
    families and has more queued, and the difference in queue is within the spread's."""
    cands = [
        Candidate((f"r{i}", 0), pending_prefill_tokens=q, families=f)
        for i, (f, q) in enumerate(rows)
    ]
    with_spread = KVCostPolicy(PolicyConfig(affinity_weight=2.0, family_spread_tokens=300.0))
    queue_only = KVCostPolicy(PolicyConfig(affinity_weight=2.0, family_spread_tokens=0.0))
    got = with_spread.choose(500, cands).chosen
    plain = queue_only.choose(500, cands)
    by_key = {c.key: c for c in cands}
    g, p = by_key[got.key], by_key[plain.chosen.key]
    if plain.tied == 1 and g.key != p.key:
        assert g.families < p.families
        gap = g.pending_prefill_tokens - p.pending_prefill_tokens
        assert 0 <= gap <= 300 * (p.families - g.families)


def test_the_config_refuses_a_spread_without_prefix_homes() -> None:
    with pytest.raises(ValueError, match="affinity_weight > 0 or family_spread_tokens = 0"):
        PolicyConfig(affinity_weight=0.0, family_spread_tokens=100.0)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="family_spread_tokens"):
            PolicyConfig(family_spread_tokens=bad)


def test_the_pool_counts_each_fair_share_override_by_home() -> None:
    """Four replicas, no events (every hit 0): the first request homes its prefix where it
    goes. Hand-derived: with the home at 2 requests in flight and the rest idle, 4 x 2 is not
    above 2 x max(2, 4), so the home keeps the request; at 3 (12 > 8) it loses the credit, the
    request goes to an idle replica and the pool counts one override for the home, which the
    metrics snapshot carries."""
    from bench.decide_bench import make_pool

    pool = make_pool(["a", "b", "c", "d"], speculative=False)
    assert pool.cfg.policy.affinity_fair_share == 2.0  # the default
    prompt = list(range(500, 756))  # four whole 64-token chunks
    home = pool.decide(prompt, {}).decision.chosen.key
    rep = pool.replicas[home[0]]
    for _ in range(2):
        rep.request_started(home[1], 0)
    d = pool.decide(prompt, {}).decision
    assert d.chosen.key == home and d.crowded == () and d.chosen.affinity == 8 * 256
    assert pool.fair_share_overrides == {}
    rep.request_started(home[1], 0)
    d = pool.decide(prompt, {}).decision
    assert d.chosen.key != home and d.crowded == (home,)
    assert pool.fair_share_overrides == {home: 1}
    # explain asks without counting
    assert pool.decide(prompt, {}, explain=True).decision.crowded == (home,)
    assert pool.fair_share_overrides == {home: 1}
    pool.router.pools[pool.name] = pool
    text = RouterMetrics(pool.router.snapshot).render().decode()
    want = (
        f'kvrouter_affinity_fair_share_overrides_total{{dp_rank="{home[1]}",pool="m",'
        f'replica="{home[0]}"}} 1.0'
    )
    assert want in text.splitlines()
