"""Wiping a replica without scanning the index (router.core.index KVIndex._wipe, KVIndex.sweep).

A wipe gives the replica a fresh slot at once; the old bit stays on keys as a *dead* bit that
no prediction reads, cleared by a bounded sweep, and the slot is reused only once no key
carries it. Checked against a reference model (what each replica holds, with copies) through
random stores, removals, clears (also in mid-batch), restarts, removals of replicas and sweep
steps, on KeyTables and dicts, with many replicas (masks past one 30-bit digit) and a small
bound on dead slots (the synchronous fallback):

* presence and copies as predictions read them (``table.get(h) & slot_bit``), and the
  predictions and shortlist themselves, equal those of an index built fresh from the model;
* no key carries a bit that is neither a replica's nor a dead slot's (a free slot is clean,
  so giving it again cannot show another replica's keys);
* the accounts (``entries``, ``extra_entries``, per-replica counts, ``nbytes`` against a
  recount) hold at every step, and once the sweep has run out every dead slot is free.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from events.schema import AllBlocksCleared
from router.core.index import IndexLimits, KVIndex, native_index
from router.core.predict import Predictor
from tests.test_index import FA_SWA, removed, stored

NAMES = [f"r{i:02d}" for i in range(40)]
TIERS = ("GPU", "CPU")
GROUPS = (0, 1)
KIND = {0: "full_attention", 1: "sliding_window"}
BLOCK = 16


def _sequences() -> list[list[int]]:
    """Three prompts of 6 blocks: two share their first 3 blocks, one shares nothing."""
    a = list(range(1, 6 * BLOCK + 1))
    b = a[: 3 * BLOCK] + [7] * (3 * BLOCK)
    c = [9] * (6 * BLOCK)
    return [a, b, c]


SEQS = _sequences()


def _hits(predictor: Predictor, tokens: list[int]) -> dict:
    """Each replica's predicted hit, trust and lower-tier hits. A lower tier whose table holds
    only keys waiting for the sweep is still "in use" (KVIndex.tiers_in_use) and lists a hit
    of 0 there, which scores as an absent one (a lower-tier hit counts only above the GPU
    hit): zeros are left out."""
    return {
        h.replica: (h.hit_tokens, h.trusted, {t: n for t, n in h.tier_hits.items() if n})
        for h in predictor.predict(tokens).replicas
    }


class WipeMachine(RuleBasedStateMachine):
    compact = False

    def __init__(self) -> None:
        super().__init__()
        limits = IndexLimits(max_dead_slots=3, sweep_step=3)
        self.index = KVIndex(FA_SWA, verify_hashes=False, compact=self.compact, limits=limits)
        hasher = self.index.hasher()
        assert hasher is not None
        self.chains = [hasher.lazy_chain(s).wires() for s in SEQS]
        pool = {h for chain in self.chains for h in chain}
        self.hashes = [*sorted(pool), 11, 12, 13, 2**64 - 1]
        self.model: dict[str, dict[tuple[str, int, object], int]] = {}
        self.untrusted: set[str] = set()

    # ------------------------------------------------------------------ rules

    @initialize(n=st.integers(1, 40))
    def start(self, n: int) -> None:
        for name in NAMES[:n]:
            self.index.add_replica(name)
            self.model[name] = {}

    @rule(name=st.sampled_from(NAMES))
    def add(self, name: str) -> None:
        self.index.add_replica(name)
        self.model.setdefault(name, {})

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove_replica(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.index.remove_replica(name)
        del self.model[name]
        self.untrusted.discard(name)

    def _events(self, data: st.DataObject, name: str, *, clear: bool) -> list:
        """Stores and removals (with, when ``clear``, an AllBlocksCleared among them), applied
        to the model as the index applies them: in order."""
        held = self.model[name]
        events = []
        n = data.draw(st.integers(1, 4))
        at_clear = data.draw(st.integers(0, n)) if clear else -1
        for i in range(n + 1):
            if i == at_clear:
                events.append(AllBlocksCleared())
                held.clear()
                self.untrusted.discard(name)
            if i == n:
                break
            tier = data.draw(st.sampled_from(TIERS))
            g = data.draw(st.sampled_from(GROUPS))
            hs = data.draw(st.lists(st.sampled_from(self.hashes), min_size=1, max_size=6))
            if data.draw(st.booleans()):
                events.append(stored(hs, g, KIND[g], medium=tier))
                for h in hs:
                    held[(tier, g, h)] = held.get((tier, g, h), 0) + 1
            else:
                events.append(removed(hs, g, medium=tier))
                for h in hs:
                    c = held.get((tier, g, h), 0)
                    if c > 1:
                        held[(tier, g, h)] = c - 1
                    elif c == 1:
                        del held[(tier, g, h)]
        return events

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def batch(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.index.apply_events((name, 0), self._events(data, name, clear=False))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def batch_with_clear(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.index.apply_events((name, 0), self._events(data, name, clear=True))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.index.reset_replica((name, 0))
        self.model[name].clear()
        self.untrusted.discard(name)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def lose_events(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.index.lost_events((name, 0), "test")
        self.model[name].clear()
        self.untrusted.add(name)

    @rule(budget=st.integers(1, 50))
    def sweep_step(self, budget: int) -> None:
        self.index.sweep(budget)

    @rule()
    def sweep_all(self) -> None:
        self._drain()

    @precondition(lambda self: self.compact and self.model)
    @rule(data=st.data())
    def demote(self, data: st.DataObject) -> None:
        """A bytes hash turns a KeyTable into a dict, maybe in the middle of its sweep."""
        name = data.draw(st.sampled_from(sorted(self.model)))
        g = data.draw(st.sampled_from(GROUPS))
        h = b"\x00bytes"
        self.index.apply_events((name, 0), [stored([h], g, KIND[g])])
        held = self.model[name]
        held[("GPU", g, h)] = held.get(("GPU", g, h), 0) + 1

    # ------------------------------------------------------------- checks

    def _drain(self) -> None:
        steps = 0
        while self.index.sweep():
            steps += 1
            assert steps < 100_000, "the sweep does not end"
        assert self.index.dead_slots() == 0 and self.index.dead_bits == 0

    @invariant()
    def presence_and_copies_match_the_model(self) -> None:
        index = self.index
        for name, held in self.model.items():
            key = (name, 0)
            bit = index.slot_bit(key)
            for tier in TIERS:
                for g in GROUPS:
                    table = index.table(tier, g)
                    for h in [*self.hashes, b"\x00bytes"]:
                        want = held.get((tier, g, h), 0)
                        assert bool(table.get(h, 0) & bit) == bool(want), (name, tier, g, h)
                        assert index.copies(key, g, h, tier) == want, (name, tier, g, h)

    @invariant()
    def no_key_carries_a_free_bit(self) -> None:
        index = self.index
        live = 0
        for key in index.replicas():
            live |= index.slot_bit(key)
        assert live == index.live_bits
        assert not live & index.dead_bits
        assert index.dead_bits.bit_count() == index.dead_slots()
        known = live | index.dead_bits
        for tier in TIERS:
            for g in GROUPS:
                for m in index.table(tier, g).values():
                    assert m and not m & ~known, bin(m)

    @invariant()
    def accounts_hold(self) -> None:
        index = self.index
        assert index.nbytes() == index.recount_bytes()
        stats = {s.replica: s for s in index.stats()}
        for name, held in self.model.items():
            assert stats[name].blocks == len(held), name
            assert stats[name].extra_copies == sum(c - 1 for c in held.values()), name
            assert stats[name].trusted == (name not in self.untrusted)

    @invariant()
    def predictions_match_a_fresh_index(self) -> None:
        fresh = KVIndex(FA_SWA, verify_hashes=False, compact=self.compact)
        for name, held in sorted(self.model.items()):
            key = fresh.add_replica(name)
            fresh.apply_events(
                key, [stored([h] * c, g, KIND[g], medium=t) for (t, g, h), c in held.items()]
            )
            if name in self.untrusted:
                fresh.mark_untrusted(key, "test")
        got, want = Predictor(self.index), Predictor(fresh)
        for tokens in SEQS:
            a, b = _hits(got, tokens), _hits(want, tokens)
            assert a == b, tokens[:4]
            sa, sb = got.shortlist(tokens), want.shortlist(tokens)
            assert sa is not None and sb is not None
            assert set(sa.held) == set(sb.held)

    def teardown(self) -> None:
        """However the run ended, the sweep frees every dead slot and the accounts are those
        of the model's state."""
        self._drain()
        held = [k for h in self.model.values() for k in h]
        assert self.index.entries == len(set(held))
        assert self.index.extra_entries == sum(
            c - 1 for h in self.model.values() for c in h.values()
        )
        assert self.index.nbytes() == self.index.recount_bytes()


class WipeMachineKeyTable(WipeMachine):
    compact = True


SETTINGS = settings(
    max_examples=75,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_wipes_against_the_model_dict_tables() -> None:
    WipeMachine.TestCase.settings = SETTINGS
    WipeMachine.TestCase().runTest()


@pytest.mark.skipif(native_index() is None, reason="router.core._keytable not built or off")
def test_wipes_against_the_model_keytables() -> None:
    WipeMachineKeyTable.TestCase.settings = SETTINGS
    WipeMachineKeyTable.TestCase().runTest()


# ------------------------------------------------------------------ unit cases


def _big(compact: bool | None = None, **limits: int) -> KVIndex:
    """``a`` holds 20,000 keys; ``b`` 100, 50 of them shared with ``a``."""
    index = KVIndex(FA_SWA, verify_hashes=False, compact=compact, limits=IndexLimits(**limits))
    a, b = index.add_replica("a"), index.add_replica("b")
    index.apply_events(
        a, [stored(range(1000 + i, 1000 + i + 1000)) for i in range(0, 20_000, 1000)]
    )
    index.apply_events(b, [stored(range(20_950, 21_050))])
    return index


def _held(index: KVIndex, name: str) -> set[int]:
    bit = index.slot_bit((name, 0))
    return {h for h, m in index.table("GPU", 0).items() if m & bit}  # type: ignore[misc]


@pytest.mark.parametrize("compact", [False, None], ids=["dict", "default"])
@pytest.mark.parametrize(
    "how", ["clear", "restart", "lost_events", "gap_lost", "seen_down", "remove"]
)
def test_every_wipe_hides_the_old_keys_at_once_and_the_sweep_frees_the_slot(
    compact: bool | None, how: str
) -> None:
    index = _big(compact, sweep_step=64)
    b = ("b", 0)
    old_bit = index.slot_bit(b)
    steps = index.sweep_steps
    {
        "clear": lambda: index.apply_events(b, [AllBlocksCleared()]),
        "restart": lambda: index.reset_replica(b),
        "lost_events": lambda: index.lost_events(b, "test"),
        "gap_lost": lambda: index.gap_lost(b, "test"),
        "seen_down": lambda: index.seen_down(b, "test"),
        "remove": lambda: index.remove_replica("b"),
    }[how]()
    # one bounded step ran, not a scan: the old bit is still on most of b's keys
    assert index.sweep_steps <= steps + 2 and index.dead_slots() == 1
    assert index.entries > 20_040 and index.wipes == 1 and index.sync_wipes == 0
    if how != "remove":
        assert index.slot_bit(b) != old_bit and not _held(index, "b")
        index.apply_events(b, [stored([5, 20_999])])  # its new state is its own
        assert _held(index, "b") == {5, 20_999}
    assert len(_held(index, "a")) == 20_000
    while index.sweep():
        pass
    assert index.dead_slots() == 0 and index.dead_bits == 0
    if how == "remove":
        assert not any(m & old_bit for m in index.table("GPU", 0).values())
    assert index.entries == 20_000 + (1 if how != "remove" else 0)
    assert index.nbytes() == index.recount_bytes()
    if how == "remove":  # the slot is free again: the next replica takes it, holding nothing
        c = index.add_replica("c")
        assert index.slot_bit(c) == old_bit and not _held(index, "c")


def test_dead_slots_are_bounded_and_the_fallback_is_counted() -> None:
    index = _big(sweep_step=1, max_dead_slots=2)
    for name in ("c", "d", "e"):
        key = index.add_replica(name)
        index.apply_events(key, [stored([7, 8, 9])])
    for name in ("c", "d", "e"):
        index.lost_events((name, 0), "test")
    assert index.wipes == 2 and index.sync_wipes == 1 and index.dead_slots() == 2
    stats = {s.replica: s for s in index.stats()}
    assert (stats["c"].wipes, stats["e"].sync_wipes, stats["e"].wipes) == (1, 1, 0)
    for name in ("c", "d", "e"):
        assert not _held(index, name)
    while index.sweep():
        pass
    assert index.dead_slots() == 0 and index.sweep_passes >= 1
    assert index.entries == 20_050


def test_a_replica_wiped_again_before_its_sweep_ended() -> None:
    index = _big(sweep_step=8)
    b = ("b", 0)
    index.apply_events(b, [AllBlocksCleared(), stored([1, 2, 3]), AllBlocksCleared(), stored([4])])
    assert index.dead_slots() == 2 and _held(index, "b") == {4}
    index.lost_events(b, "test")
    assert index.dead_slots() == 3 and not _held(index, "b")
    while index.sweep():
        pass
    assert index.dead_slots() == 0 and index.entries == 20_000


def test_a_reclaim_takes_dead_bits_along() -> None:
    """The memory budget's reclaim may drop keys carrying a dead bit: the dead slot's count
    follows, and it is free once none is left."""
    index = _big(sweep_step=1)
    index.lost_events(("b", 0), "test")
    assert index.dead_slots() == 1
    for _ in range(60):
        index._reclaim()
    assert index.entries < 200
    while index.sweep():
        pass
    assert index.dead_slots() == 0
    assert index.nbytes() == index.recount_bytes()
    assert sum(s.blocks for s in index.stats()) == index.entries


def test_a_snapshot_never_writes_a_dead_bit_as_held() -> None:
    index = _big(sweep_step=1)
    b = ("b", 0)
    index.apply_events(b, [AllBlocksCleared(), stored([5])])
    assert index.dead_slots() == 1
    snap = index.export_replica(b)
    assert snap.tiers == {"GPU": [[(5, 1)]]}


def test_the_learned_layout_follows_its_replica_to_a_fresh_slot() -> None:
    from events.layout import ModelLayout

    index = KVIndex(ModelLayout(groups=()), verify_hashes=False, limits=IndexLimits(sweep_step=1))
    a = index.add_replica("a")
    index.apply_events(a, [stored(range(100, 200)), stored([150], 1, "sliding_window")])
    assert index.learned_layout()[1] == "a/dp0"
    index.apply_events(a, [AllBlocksCleared()])
    assert index.dead_slots() == 1
    assert index.learned_layout()[1] == "a/dp0"


def test_the_shortlist_names_no_dead_slot() -> None:
    index = _big(sweep_step=1)
    hasher = index.hasher()
    assert hasher is not None
    tokens = list(range(64))
    chain = hasher.lazy_chain(tokens).wires()
    b = ("b", 0)
    index.apply_events(b, [stored(chain)])
    pred = Predictor(index)
    short = pred.shortlist(tokens)
    assert short is not None and set(short.held) == {b}
    index.apply_events(b, [AllBlocksCleared()])
    assert index.dead_slots() == 1
    short = pred.shortlist(tokens)
    assert short is not None and not short.held
    assert pred.predict(tokens).hit(b).hit_tokens == 0


def test_speculative_entries_leave_with_the_slot_they_were_made_for() -> None:
    """The overlay keys its entries by slot bit: after a wipe the replica has another one,
    and the old one, once swept, may be another replica's; entries made for it must not
    show as that replica's."""
    from tests.test_speculative import PROMPT, overlay_setup

    index, _, ov, _ = overlay_setup()
    a = ("a", 0)
    index.apply_events(a, [stored([1, 2, 3], parent=99)])  # held: a wipe moves its slot
    ov.finish(ov.record(a, PROMPT, None, None))
    spec = ov.predict(PROMPT, None)
    assert spec is not None and spec.hit(a).hit_tokens == 992
    old = index.slot_bit(a)
    index.apply_events(a, [AllBlocksCleared()])  # the overlay is not told (no on_events)
    while index.sweep():
        pass
    c = index.add_replica("c")
    assert index.slot_bit(c) == old
    spec = ov.predict(PROMPT, None)
    assert spec is None or (spec.hit(c).hit_tokens, spec.hit(a).hit_tokens) == (0, 0)
