"""The shortlist decision (router.core.shortlist, PoolState._decide_shortlist) equals the full
scan's: same replica, same tie count, same scores for what it reports, same RNG use.

Two properties: the pure one (``choose_shortlist`` against ``KVCostPolicy.choose`` on random
candidates, big tied runs included) and the pool one (random pools -- replicas and DP ranks,
loads, cache pressure, prefix homes, exclusions, trust and health states, drains, random index
contents in both groups and a lower tier, random prompts -- several decisions in a row)."""

from __future__ import annotations

import math
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.decide_bench import pool_from_toml
from events.schema import BlockStored
from router.config import PolicyConfig
from router.core.policy import (
    Candidate,
    KVCostPolicy,
    NoCandidates,
    new_prefix,
    queued_tokens,
    request_load,
)
from router.core.pressure import DecayingSum
from router.core.shortlist import LoadBook, choose_shortlist
from router.server.state import PoolState, ShortlistMismatch

KEYS = [(f"r{i:02d}", r) for i in range(40) for r in (0, 1)]
NOW = 1000.0


def _same(fast, ref) -> None:  # type: ignore[no-untyped-def]
    assert fast.chosen.key == ref.chosen.key
    assert fast.tied == ref.tied
    assert fast.crowded == ref.crowded  # the fair share overrode the same homes
    scores = {s.key: s for s in ref.ranked}
    for s in fast.ranked:
        assert scores[s.key] == s
    # every candidate with a hit is reported (decision reasons read the best hit off ranked)
    assert max(s.hit_tokens for s in fast.ranked) == max(s.hit_tokens for s in ref.ranked)


@st.composite
def pure_case(draw: st.DrawFn) -> tuple:
    affinity = draw(st.sampled_from([0.0, 2.0]))
    cfg = PolicyConfig(
        tie_tokens=draw(st.sampled_from([0.0, 0.5, 100.0])),
        affinity_weight=affinity,
        pressure_weight=draw(st.sampled_from([0.0, 0.5])),
        load_band_tokens=draw(st.sampled_from([0.0, 0.0, 300.0, 4096.0])),
        family_spread_tokens=draw(st.sampled_from([0.0, 256.0, 300.0])) if affinity else 0.0,
        affinity_fair_share=draw(st.sampled_from([0.0, 1.0, 2.0])),
    )
    families = st.sampled_from([0, 0, 1, 3])
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=60, unique=True))
    loads = st.sampled_from([0, 0, 0, 100, 256, 300])
    n_explicit = draw(st.integers(0, min(6, len(keys))))
    explicit = []
    for key in keys[:n_explicit]:
        hit = draw(st.sampled_from([0, 0, 16, 512, 992]))
        trusted = draw(st.booleans())
        explicit.append(
            Candidate(
                key,
                hit_tokens=hit if trusted else 0,
                fa_prefix_tokens=hit + draw(st.sampled_from([0, 16])) if trusted else 0,
                trusted=trusted,
                in_flight=draw(st.integers(0, 2)),
                pending_prefill_tokens=draw(loads),
                recent_new_tokens=draw(st.sampled_from([0.0, 0.0, 50.0])),
                home_tokens=draw(st.sampled_from([0, 0, 64, 128])),
                families=draw(families),
                waiting=draw(st.sampled_from([None, None, 0, 2])),
            )
        )
    book_members = {}
    churns = {}
    for key in keys[n_explicit:]:
        # cache churn (the band's tie-break): none, or new tokens some seconds before NOW;
        # 50 at NOW reads 50.0 exactly, as an explicit candidate's may
        w = None
        if cfg.pressure_weight == 0:  # (with pressure, a written replica is never in the book)
            adds = draw(st.sampled_from([(), (), ((50, 0.0),), ((50, 10.0),), ((3000, 40.0),),
                                         ((3000, 200.0),), ((80, 5.0), (50, 0.0))]))  # fmt: skip
            if adds:
                w = DecayingSum(30.0)
                for amount, ago in adds:
                    w.add(amount, NOW - ago)
        churns[key] = w
        book_members[key] = Candidate(
            key,
            trusted=draw(st.booleans()),
            in_flight=draw(st.integers(0, 1)),
            pending_prefill_tokens=draw(loads),
            recent_new_tokens=w.value(NOW) if w is not None else 0.0,
            families=draw(families),
        )
    # the book may also hold explicit replicas (then skipped) and excluded ones
    also = [c.key for c in explicit if draw(st.booleans())]
    excluded = [k for k in book_members if draw(st.integers(0, 9)) == 0]
    seed = draw(st.integers(0, 2**16))
    return cfg, explicit, book_members, churns, also, excluded, seed


@settings(max_examples=400, deadline=None)
@given(pure_case())
def test_choose_shortlist_equals_the_full_scan(case: tuple) -> None:
    cfg, explicit, members, churns, also, excluded, seed = case
    book = LoadBook(churn_order=cfg.load_band_tokens > 0, family_order=cfg.family_spread_tokens > 0)
    for key, c in members.items():
        book.put(key, queued_tokens(c, cfg), churns[key], request_load(c), c.families)
    for key in also:  # (a skipped member's load and families must not count either)
        book.put(key, 256.0, load=5, families=2)
    fast_policy = KVCostPolicy(cfg, random.Random(seed))
    ref_policy = KVCostPolicy(cfg, random.Random(seed))
    n = 1024
    cands = explicit + [c for k, c in members.items() if k not in excluded]
    skip = [*excluded, *also]
    try:
        ref = ref_policy.choose(n, cands)
    except NoCandidates:
        ref = None
    # a new prefix under the family spread with a load band (every replica's families count,
    # which the band's walk does not read) is declined before anything else is looked at
    spread_declines = cfg.load_band_tokens > 0 and new_prefix(cfg, explicit)
    if ref is None:
        if spread_declines:
            assert choose_shortlist(fast_policy, n, explicit, book, skip, now=NOW) is None
            return
        with pytest.raises(NoCandidates):
            choose_shortlist(fast_policy, n, explicit, book, skip, now=NOW)
        return
    fast = choose_shortlist(fast_policy, n, explicit, book, skip, now=NOW)
    if fast is None:
        # only the band's tie-break (book replicas of equal churn: same sums) and the spread
        assert cfg.load_band_tokens > 0 or spread_declines
        assert fast_policy.rng.getstate() == random.Random(seed).getstate()  # nothing drawn
        return
    _same(fast, ref)
    assert fast_policy.rng.getstate() == ref_policy.rng.getstate()


def test_a_big_idle_tie_is_decided_without_listing_it() -> None:
    """256 idle replicas tie: one draw over all of them, the pick located by bisection (a new
    prefix under the default family spread: one segment, no family anywhere)."""
    cfg = PolicyConfig()
    book = LoadBook(family_order=True)
    keys = [(f"r{i:03d}", 0) for i in range(256)]
    for key in keys:
        book.put(key, 0.0)
    for seed in range(20):
        fast = choose_shortlist(KVCostPolicy(cfg, random.Random(seed)), 2048, [], book, [])
        ref = KVCostPolicy(cfg, random.Random(seed)).choose(2048, [Candidate(k) for k in keys])
        assert fast is not None
        _same(fast, ref)
        assert fast.tied == 256 and len(fast.ranked) == 1


class _CountingPolicy(KVCostPolicy):
    """Counts the scores a decision computes (what the shortlist exists to keep few)."""

    scores = 0

    def score_queued(self, num_tokens: int, c: Candidate, queued: float):  # type: ignore[no-untyped-def]
        self.scores += 1
        return super().score_queued(num_tokens, c, queued)


def test_a_new_prefix_under_the_family_spread_scores_one_run_per_family_count() -> None:
    """256 replicas with 0-3 families each and a few queue lengths: a new prefix pays
    ``spread · families`` everywhere, and the book's family order finds the cheapest without
    scoring each replica (one run per family count, and those past the best stop at once)."""
    cfg = PolicyConfig(family_spread_tokens=2048.0)
    book = LoadBook(family_order=True)
    rng = random.Random(3)
    cands = []
    for i in range(256):
        key = (f"r{i:03d}", 0)
        c = Candidate(
            key,
            pending_prefill_tokens=rng.choice([0, 512, 4096]),
            families=rng.choice([0, 1, 2, 3]),
        )
        book.put(key, queued_tokens(c, cfg), families=c.families)
        cands.append(c)
    for seed in range(10):
        policy = _CountingPolicy(cfg, random.Random(seed))
        fast = choose_shortlist(policy, 2048, [], book, [])
        ref = KVCostPolicy(cfg, random.Random(seed)).choose(2048, cands)
        assert fast is not None
        _same(fast, ref)
        assert policy.rng.getstate() != random.Random(seed).getstate()  # one draw among the tied
        assert fast.chosen.spread == 0.0 and fast.chosen.queued == 0.0
        # the families-0 segment: its floor, the idle run and the next (beyond the best); then
        # the families-1 floor is beyond it too, and the walk ends without reading 2 and 3
        assert policy.scores == 4


def test_runs_of_one_cost_in_different_family_counts_tie_as_the_full_scan_ties_them() -> None:
    """A family more and a queue shorter by the spread cost the same float: the tied replicas
    come from two segments of the family order, and each is scored with its own terms."""
    cfg = PolicyConfig(family_spread_tokens=300.0)
    book = LoadBook(family_order=True)
    cands = []
    for i, (queued, families) in enumerate([(300, 0), (0, 1), (300, 0), (0, 1), (600, 0)]):
        key = (f"r{i}", 0)
        cands.append(Candidate(key, pending_prefill_tokens=queued, families=families))
        book.put(key, float(queued), families=families)
    chosen = set()
    for seed in range(40):
        fast = choose_shortlist(KVCostPolicy(cfg, random.Random(seed)), 1000, [], book, [])
        ref = KVCostPolicy(cfg, random.Random(seed)).choose(1000, cands)
        assert fast is not None and fast.tied == 4
        _same(fast, ref)
        chosen.add(fast.chosen.key)
    assert chosen == {("r0", 0), ("r1", 0), ("r2", 0), ("r3", 0)}


def test_a_banded_fleet_goes_to_its_least_churned_replica_without_listing_it() -> None:
    """With a load band every idle replica ties; the full scan takes the one whose cache
    turned over least. The shortlist finds it in the book's churn order: it reports only the
    chosen one and draws nothing (one replica is lightest)."""
    cfg = PolicyConfig(load_band_tokens=4096, family_spread_tokens=0.0)  # (no family walk)
    book = LoadBook(churn_order=True)
    cands = []
    rng = random.Random(7)
    for i in range(256):
        key = (f"r{i:03d}", 0)
        w = DecayingSum(30.0)
        w.add(rng.randint(1, 5000), NOW - rng.uniform(0, 60))
        q = float(rng.choice([0, 256, 512, 8000]))
        book.put(key, q, w)
        cands.append(Candidate(key, pending_prefill_tokens=int(q), recent_new_tokens=w.value(NOW)))
    for seed in range(5):
        policy = KVCostPolicy(cfg, random.Random(seed))
        fast = choose_shortlist(policy, 2048, [], book, [], now=NOW)
        ref = KVCostPolicy(cfg, random.Random(seed)).choose(2048, cands)
        assert fast is not None
        _same(fast, ref)
        assert len(fast.ranked) == 1 and fast.tied > 100
        assert policy.rng.getstate() == random.Random(seed).getstate()
        inside = [c for c in cands if c.pending_prefill_tokens <= 4096]
        assert fast.chosen.key == min(inside, key=lambda c: c.recent_new_tokens).key


def test_an_excluded_replica_with_the_same_churn_is_never_chosen() -> None:
    """Equal churn sums (the same writes at the same times) share an order key: an excluded
    replica filed before the lightest eligible one is inside its group and must be taken out
    of the draw. (Found by the property above: the shortlist once routed to ("r00", 1), the
    excluded replica.)"""
    cfg = PolicyConfig(load_band_tokens=300.0, family_spread_tokens=0.0)
    book = LoadBook(churn_order=True)
    sums = {}
    for key in [("r00", 1), ("r01", 0)]:
        w = DecayingSum(30.0)
        w.add(50, NOW)
        sums[key] = w
        book.put(key, 0.0, w)
    explicit = [Candidate(("r00", 0), trusted=False, recent_new_tokens=50.0)]
    cands = [*explicit, Candidate(("r01", 0), trusted=False, recent_new_tokens=50.0)]
    chosen = set()
    for seed in range(16):
        fast = choose_shortlist(
            KVCostPolicy(cfg, random.Random(seed)), 1024, explicit, book, [("r00", 1)], now=NOW
        )
        ref = KVCostPolicy(cfg, random.Random(seed)).choose(1024, cands)
        assert fast is not None
        _same(fast, ref)
        chosen.add(fast.chosen.key)
    assert chosen == {("r00", 0), ("r01", 0)}


def test_a_write_alone_reorders_the_banded_book() -> None:
    """``PoolState.wrote`` re-files the replica: the band's tie-break reads churn off the book,
    and a stale order would pick as if nothing had been written (tests/conftest.py checks
    every shortlist decision against the full scan, which would raise here)."""
    pool = _pool("seed = 1\nload_band_tokens = 4096.0", [("a", 1), ("b", 1)], swa=False)
    pool.decide(list(range(100, 400)), {})  # files both replicas in the book
    pool.wrote(pool.replicas["a"], 0, 1000)
    pool.wrote(pool.replicas["b"], 0, 10)
    for i in range(3):
        got = pool.decide(list(range(1000 + 500 * i, 1300 + 500 * i)), {})
        assert got.decision.chosen.key == ("b", 0)


def test_it_declines_what_it_cannot_decide_exactly() -> None:
    book = LoadBook()
    book.put(("a", 0), 0.0)
    for cfg in (
        PolicyConfig(temperature=1.0),
        PolicyConfig(load_band_tokens=float("inf")),
        PolicyConfig(),  # a new prefix under the family spread, and a book without families
        PolicyConfig(load_band_tokens=300.0),  # ... and one with a band (its walk reads none)
    ):
        policy = KVCostPolicy(cfg, random.Random(1))
        state = policy.rng.getstate()
        assert choose_shortlist(policy, 100, [], book, []) is None
        assert policy.rng.getstate() == state  # nothing consumed
    # with the families kept and no band, a new prefix is the shortlist's
    families = LoadBook(family_order=True)
    families.put(("a", 0), 0.0, families=1)
    assert choose_shortlist(KVCostPolicy(PolicyConfig()), 100, [], families, []) is not None
    with pytest.raises(ValueError, match="finite"):
        book.put(("b", 0), float("nan"))


# ------------------------------------------------------------------- pools


def _pool(cfg_lines: str, replicas: list[tuple[str, int]], swa: bool) -> PoolState:
    groups = '{kind = "full_attention", block_size = 16}'
    if swa:
        groups += ', {kind = "sliding_window", block_size = 16, sliding_window = 64}'
    toml = f"""
[server]
metrics_scrape_interval_s = 0
[[pools]]
model = "m"
[pools.layout]
groups = [{groups}]
[pools.policy]
{cfg_lines}
"""
    for name, ranks in replicas:
        dp = ", ".join(str(r) for r in range(ranks))
        toml += f'[[pools.replicas]]\nname = "{name}"\nurl = "http://127.0.0.1:9"\n'
        toml += f"dp_ranks = [{dp}]\n"
    return pool_from_toml(toml)


def _store(pool: PoolState, key: tuple[str, int], tokens: list[int], groups, medium="GPU"):  # type: ignore[no-untyped-def]
    wire = pool.index.hasher().wire_chain(tokens)
    pool.index.apply_events(
        key,
        [
            BlockStored(block_hashes=wire[lo:hi], parent_block_hash=wire[lo - 1] if lo else None,
                        token_ids=tokens[lo * 16 : hi * 16], block_size=16, lora_id=None,
                        medium=medium, lora_name=None, group_idx=g)
            for g, lo, hi in groups if hi > lo
        ],
    )  # fmt: skip


@st.composite
def pool_case(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 9))
    reps = [(f"r{i}", draw(st.sampled_from([1, 1, 2]))) for i in range(n)]
    swa = draw(st.booleans())
    affinity = draw(st.sampled_from([0.0, 2.0, 2.0]))
    spread = draw(st.sampled_from([0.0, 256.0, 300.0])) if affinity else 0.0
    cfg = "\n".join(
        [
            f"seed = {draw(st.integers(0, 1000))}",
            f"tie_tokens = {draw(st.sampled_from([0.0, 0.5, 200.0]))}",
            f"pressure_weight = {draw(st.sampled_from([0.0, 0.0, 0.5]))}",
            f"affinity_weight = {affinity}",
            f"family_spread_tokens = {spread}",
            f"affinity_fair_share = {draw(st.sampled_from([0.0, 1.0, 2.0]))}",
            f"per_request_tokens = {draw(st.sampled_from([0.0, 256.0]))}",
            f"load_band_tokens = {draw(st.sampled_from([0.0, 0.0, 300.0, 4096.0]))}",
            "lower_tier_weights = {CPU = 0.5}",
        ]
    )
    return {"reps": reps, "swa": swa, "cfg": cfg, "seed": draw(st.integers(0, 2**20))}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool_case())
def test_pool_shortlist_equals_the_full_scan(case: dict) -> None:
    pool = _pool(case["cfg"], case["reps"], case["swa"])
    rng = random.Random(case["seed"])
    keys = pool.index.replicas()
    prompts = [
        [rng.randrange(7, 4000) for _ in range(rng.choice([40, 200, 500]))] for _ in range(4)
    ]
    for tokens in prompts:  # random holders, random group coverage, sometimes the CPU tier
        n_blocks = len(tokens) // 16
        for key in rng.sample(keys, rng.randint(0, len(keys))):
            fa = rng.choice([0, 1, n_blocks // 2, n_blocks])
            groups = [(0, 0, fa)]
            if case["swa"]:
                lo = rng.randint(0, n_blocks)
                groups.append((1, lo, min(n_blocks, lo + rng.randint(0, 6))))
            _store(pool, key, tokens, groups, rng.choice(["GPU", "GPU", "CPU"]))
    now = time.monotonic()
    for key in keys:  # trust
        roll = rng.random()
        if roll < 0.1:
            pool.index.mark_untrusted(key, "test")
        elif roll < 0.2:
            pool.index.attached_late(key, "test")
    for rep in pool.replicas.values():  # health, drain, load, pressure
        roll = rng.random()
        if roll < 0.08:
            rep.drained = True
        elif roll < 0.14:
            for _ in range(pool.router.config.health.eject_after_failures):
                rep.health.failed(now, "test")
        elif roll < 0.2:
            rep.health.ejected_until = now - 1  # back-off over: half-open
            rep.health.trial_in_flight = rng.random() < 0.5
        elif roll < 0.24:
            rep.health.probe_up = False
        rep.touch()
        for r in rep.ranks:
            rep.in_flight[r] = rng.choice([0, 0, 1, 3])
            rep.pending_prefill[r] = rng.choice([0, 0, 0, 100, 512])
            if rng.random() < 0.3:
                pool.wrote(rep, r, rng.randint(1, 4000))
        if rng.random() < 0.3:
            rep.others_running = {-1: float(rng.choice([0, 2]))}
            rep.others_waiting = {-1: float(rng.choice([0, 1]))}
            rep.kv_usage = {-1: rng.choice([0.1, 0.97])}
        rep.touch()
    if pool.homes is not None:
        for tokens in prompts[:2]:
            for _ in range(rng.choice([1, 2])):  # carried twice: a family (its spread counts)
                pool.homes.record(pool.homes.keys(tokens), rng.choice(keys))
    policy = pool.policy
    assert isinstance(policy, KVCostPolicy)
    took = servable = 0
    for _ in range(6):
        # read the clock after every write, as PoolState.decide does: a churn sum read at a
        # time before its last add reads at that add's time, so sums written after ``now``
        # would be read at different times and need not order as their order keys do
        now = time.monotonic()
        p = rng.choice(prompts)
        kind = rng.random()
        if kind < 0.3:
            p = p + [rng.randrange(7, 4000) for _ in range(rng.randint(0, 100))]
        elif kind < 0.45:
            p = [rng.randrange(7, 4000) for _ in range(rng.choice([5, 16, 300]))]
        elif kind < 0.55:
            p = p[: rng.randint(1, len(p))]
        exclude = {k for k in keys if rng.random() < 0.15}
        home_keys = pool.homes.keys(p) if pool.homes is not None else []
        homed = pool.homes.homed(home_keys) if pool.homes is not None else None
        before = policy.rng.getstate()
        cands = pool.candidates(pool.predict(p, {}), exclude, homed, now)
        try:
            ref = policy.choose(len(p), cands)
        except NoCandidates:
            ref = None
        # with the family spread and a load band on, a prefix no candidate is home to is the
        # full scan's (the band's walk does not read families): declined by design
        if policy.cfg.load_band_tokens == 0 or not new_prefix(policy.cfg, cands):
            servable += ref is not None
        after = policy.rng.getstate()
        policy.rng.setstate(before)
        if ref is None:
            try:
                fast = pool._decide_shortlist(p, {}, exclude, homed, now)
            except NoCandidates:
                fast = None
            assert fast is None
            continue
        fast = pool._decide_shortlist(p, {}, exclude, homed, now)
        if fast is None:
            policy.rng.setstate(after)
            continue
        took += 1
        decision, pred = fast
        _same(decision, ref)
        assert policy.rng.getstate() == after
        full = {h.replica: h for h in pool.predict(p, {}).replicas}
        for h in pred.replicas:
            assert full[h.replica] == h
        assert decision.chosen.key in {h.replica for h in pred.replicas}
        # the request goes there: load and homes change, as the proxy changes them
        key = decision.chosen.key
        rep = pool.replicas[key[0]]
        rep.in_flight[key[1]] += 1
        rep.pending_prefill[key[1]] += len(p) - decision.chosen.hit_tokens
        rep.touch()
        pool.wrote(rep, key[1], len(p) - decision.chosen.hit_tokens)
        if pool.homes is not None:
            pool.homes.record(home_keys, key)
    regular = [
        rep for rep in pool.replicas.values()
        if not rep.drained and rep.health.state(now) == "healthy"
    ]  # fmt: skip
    if regular and pool.cfg.policy.pressure_weight == 0:
        assert took or not servable, "the shortlist declined every decision of a pool it serves"


def test_the_suite_catches_a_load_change_that_bypasses_touch() -> None:
    """tests/conftest.py turns PoolState.check_shortlist on: a change to the load the book
    was not told about makes the decision differ from the full scan's, and it raises."""
    assert PoolState.check_shortlist
    pool = _pool("seed = 1", [("a", 1), ("b", 1)], swa=False)
    prompt = list(range(100, 400))
    first = pool.decide(prompt, {})
    assert len(first.prediction.replicas) == 1  # no holder: only the chosen one reported
    rep = pool.replicas[first.decision.chosen.key[0]]
    rep.in_flight[0] = 10  # the proxy would call rep.touch() here
    other = list(range(500, 800))  # no home yet: the book stands for both replicas
    with pytest.raises(ShortlistMismatch, match="full scan"):
        pool.decide(other, {})
    rep.touch()
    again = pool.decide(other, {})
    assert again.decision.chosen.key != first.decision.chosen.key


@pytest.mark.parametrize("churn_order", [False, True])
def test_a_moved_replica_is_filed_once_in_each_order(churn_order: bool) -> None:
    """Re-putting a replica moves it: no stale place is left in the load order nor, with a
    band, in the churn order (a stale place would stand for a load it no longer has)."""
    book = LoadBook(churn_order=churn_order)
    w = DecayingSum(30.0)
    book.put(("a", 0), 100.0)
    book.put(("b", 0), 50.0)
    book.put(("a", 0), 10.0)
    w.add(500.0, 1.0)
    book.put(("b", 0), 50.0, w)  # a write alone moves it in the churn order
    book.put(("b", 0), 60.0, w)
    assert [(q, hi - lo) for q, lo, hi in book.runs()] == [(10.0, 1), (60.0, 1)]
    assert [book.key_at(i) for i in range(2)] == [("a", 0), ("b", 0)]
    expected = [(-math.inf, 10.0, ("a", 0)), (w.order_key(), 60.0, ("b", 0))]
    assert list(book.by_churn()) == (expected if churn_order else [])
    book.discard(("a", 0))
    assert book.keys() == [("b", 0)] and [q for q, _, _ in book.runs()] == [60.0]
    assert len(book.by_churn()) == (1 if churn_order else 0)
