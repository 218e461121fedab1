"""router.core._keytable.KeyTable against a dict, and the index on both kinds of tables.

The dict is the reference: under random sequences of every operation the index uses (get,
set, delete, contains, len, iteration, items, values, pop_some, scan), growth and shrinking, and
deletions that shift probe runs back, a KeyTable holds and answers exactly what a dict does.
References are counted right (values freed when deleted, overwritten, popped, or with the
table), hostile keys are refused with TypeError/OverflowError and never found, and the index
holds the same state with either kind of table.

``KVROUTER_REQUIRE_NATIVE=1`` (set by .ci/run) turns "extension not built" from a skip into a
failure, so CI proves the README's install builds it.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import tracemalloc
import weakref
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from msgspec.structs import replace

from events.layout import HashSettings
from router.core import index as index_mod
from router.core.index import NATIVE_INDEX_ENV, IndexLimits, KVIndex, native_index
from tests.test_index import FA_SWA, removed, stored
from tests.test_index_memory import _step

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = os.environ.get("KVROUTER_REQUIRE_NATIVE", "") == "1"

try:
    from router.core._keytable import KeyTable  # type: ignore[import-not-found]
except ImportError:  # not built: skip, unless CI requires it
    KeyTable = None


@pytest.fixture(autouse=True)
def _need_native(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("without_native") is not None:
        return
    if KeyTable is None or index_mod._KeyTable is None:
        if REQUIRED:
            pytest.fail(
                "KVROUTER_REQUIRE_NATIVE=1 but router.core._keytable is not in use: the "
                f"extension did not build (see pip's output) or {NATIVE_INDEX_ENV}=0 is set"
            )
        pytest.skip("router.core._keytable not built (no C compiler at install time?)")


without_native = pytest.mark.without_native

U64 = 2**64
#: Keys at the edges of the domain, and a few small ones so random draws meet again.
EDGE_KEYS = [0, 1, 2, 3, 255, 256, 2**30, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63,
             U64 - 2, U64 - 1]  # fmt: skip
keys = st.one_of(st.sampled_from(EDGE_KEYS), st.integers(0, 40), st.integers(0, U64 - 1))


# --------------------------------------------------------------------------- in use


@without_native
def test_native_keytable_in_use_when_required() -> None:
    """CI (.ci/run sets KVROUTER_REQUIRE_NATIVE=1) must index with the extension."""
    if not REQUIRED:
        pytest.skip("KVROUTER_REQUIRE_NATIVE is not set")
    assert native_index() == "router.core._keytable"
    assert KVIndex(FA_SWA, verify_hashes=False).compact


# --------------------------------------------------------------------------- against a dict


class Value:
    """A weakref-able value: the table must free it exactly when a dict would."""

    __slots__ = ("__weakref__", "n")

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"V{self.n}"


class AgainstDict(RuleBasedStateMachine):
    """Every operation on a KeyTable and on a dict; they must agree after each."""

    @initialize(seed=st.sampled_from([0, 1, U64 - 1]) | st.integers(0, U64 - 1))
    def start(self, seed: int) -> None:
        self.t = KeyTable(seed)
        self.d: dict[int, Value] = {}
        self.refs: list[weakref.ref] = []
        self.n = 0

    def _value(self) -> Value:
        self.n += 1
        v = Value(self.n)
        self.refs.append(weakref.ref(v))
        return v

    @rule(k=keys)
    def set(self, k: int) -> None:
        v = self._value()
        self.t[k] = v
        self.d[k] = v

    @rule(ks=st.lists(keys, max_size=60))
    def grow(self, ks: list[int]) -> None:
        for k in ks:
            v = self._value()
            self.t[k] = v
            self.d[k] = v

    @rule(k=keys)
    def delete(self, k: int) -> None:
        if k in self.d:
            del self.t[k]
            del self.d[k]
        else:
            with pytest.raises(KeyError):
                del self.t[k]

    @precondition(lambda self: self.d)
    @rule(data=st.data())
    def delete_held(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.d)))
        del self.t[k]
        del self.d[k]

    @precondition(lambda self: self.d)
    @rule(frac=st.floats(0.1, 1.0))
    def shrink(self, frac: float) -> None:
        """Delete most keys: the table shrinks (and frees its slots at 0)."""
        for k in sorted(self.d)[: max(1, int(len(self.d) * frac))]:
            del self.t[k]
            del self.d[k]

    @rule(k=keys, default=st.sampled_from([None, 0, -1]))
    def get(self, k: int, default: object) -> None:
        assert self.t.get(k, default) is self.d.get(k, default)
        assert self.t.get(k) is self.d.get(k)
        assert (k in self.t) == (k in self.d)
        if k in self.d:
            assert self.t[k] is self.d[k]
        else:
            with pytest.raises(KeyError):
                self.t[k]

    @rule(n=st.integers(0, 30))
    def pop_some(self, n: int) -> None:
        got = self.t.pop_some(n)
        assert len(got) == min(n, len(self.d))
        assert len({k for k, _ in got}) == len(got)
        for k, v in got:
            assert self.d.pop(k) is v

    @rule()
    def overwrite_all(self) -> None:
        """Assigning to every held key while iterating: allowed, as for a dict."""
        for k in self.t:
            v = self._value()
            self.t[k] = v
            self.d[k] = v

    @invariant()
    def same(self) -> None:
        t, d = self.t, self.d
        assert len(t) == len(d)
        assert bool(t) == bool(d)
        assert sorted(t) == sorted(d)
        assert sorted(t.keys()) == sorted(d)
        items = list(t.items())
        assert sorted(items, key=lambda kv: kv[0]) == sorted(d.items())
        assert sorted(v.n for v in t.values()) == sorted(v.n for v in d.values())
        cap = t.capacity
        assert len(t) * 4 <= cap * 3 or cap == len(t) == 0  # never over 3/4 full
        assert cap <= max(8, 4 * len(t))  # nor under 1/4 (it shrinks as keys go)
        assert (cap == 0) == (len(t) == 0)  # an empty table frees its slots
        assert sys.getsizeof(t) == sys.getsizeof(KeyTable()) + 16 * cap
        # no value outlives its last holder: alive == held
        held = {id(v) for v in d.values()}
        alive = [r() for r in self.refs if r() is not None]
        assert {id(v) for v in alive} == held, "a value leaked or was freed early"

    def teardown(self) -> None:
        if not hasattr(self, "t"):
            return
        del self.t
        self.d.clear()
        assert all(r() is None for r in self.refs), "values outlived the table"


AgainstDict.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_keytable_behaves_as_a_dict = AgainstDict.TestCase


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, U64 - 1),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 300)), min_size=1, max_size=3000),
)
def test_churn_on_a_small_key_range(seed: int, ops: list[tuple[bool, int]]) -> None:
    """Long insert/delete churn on few keys: probe runs collide, wrap around the end of the
    array and are shifted back on every delete; the table must still find every key."""
    t, d = KeyTable(seed), {}
    for put, k in ops:
        if put:
            t[k] = d[k] = k
        elif k in d:
            del t[k], d[k]
        assert len(t) == len(d)
    assert all(t.get(k, -1) == d.get(k, -1) for k in range(301))
    assert dict(t.items()) == d


def test_a_run_that_wraps_past_the_end() -> None:
    """Keys sharing the last slot as their home: their run wraps to the array's start.
    Deleting from its start and middle shifts the rest back; every key stays reachable."""
    same = [k for k in range(100_000) if _home(k) == 7][:5]
    t, ref = KeyTable(7), {}
    for k in same:
        t[k] = ref[k] = k
    assert t.capacity == 8 and list(t) == same[1:] + same[:1]  # slots 0-3, then 7
    for k in (same[1], same[0], same[3]):
        del t[k], ref[k]
        assert all(t.get(j) == ref.get(j) for j in same)
        assert dict(t.items()) == ref


def _home(k: int, seed: int = 7, cap: int = 8) -> int:
    """The home slot of ``k`` as the C code computes it (fmix64, then Lemire's reduction)."""
    m = (1 << 64) - 1
    x = k ^ seed
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & m
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & m
    x ^= x >> 33
    return (x * cap) >> 64


def test_home_slot_model_matches_iteration_order() -> None:
    """The Python model of the home slot (used to build colliding keys) is the C one: keys
    with distinct homes in a table of 8 iterate in home order."""
    rng = random.Random(1)
    for _ in range(200):
        ks = rng.sample(range(10_000), 6)
        homes = [_home(k) for k in ks]
        if len(set(homes)) != 6:
            continue
        t = KeyTable(7)
        for k in ks:
            t[k] = 0
        assert t.capacity == 8
        assert list(t) == sorted(ks, key=_home)


# --------------------------------------------------------------------------- references


def test_refcounts_of_a_shared_value() -> None:
    """One object under many keys (a replica's shared bit): each slot holds one reference."""
    v = Value(0)
    base = sys.getrefcount(v)
    t = KeyTable()
    for k in range(1000):
        t[k] = v
    assert sys.getrefcount(v) == base + 1000
    for k in range(0, 1000, 2):
        t[k] = v  # overwrite with itself
    assert sys.getrefcount(v) == base + 1000
    for k in range(500):
        del t[k]
    assert sys.getrefcount(v) == base + 500
    got = t.pop_some(100)
    assert sys.getrefcount(v) == base + 500  # 400 in the table, 100 in the pairs
    del got
    assert sys.getrefcount(v) == base + 400
    assert sys.getrefcount(t.get(999)) == base + 400 + 1  # get returns a new reference
    it = iter(list(t.values()))
    assert sys.getrefcount(v) == base + 800
    del it
    del t
    assert sys.getrefcount(v) == base


def test_values_freed_with_the_table_and_by_gc() -> None:
    t = KeyTable()
    vals = [Value(i) for i in range(100)]
    refs = [weakref.ref(v) for v in vals]
    for i, v in enumerate(vals):
        t[i] = v
    del vals, v
    assert all(r() is not None for r in refs)
    del t
    assert all(r() is None for r in refs)
    # a cycle through the table: collected by the GC (tp_traverse / tp_clear)
    t = KeyTable()
    t[1] = 1
    box = _Box(t)
    t[2] = box
    ref = weakref.ref(box)
    del t, box
    gc.collect()
    assert ref() is None


class _Box:
    """A weakref-able object that points back at the table holding it (a cycle)."""

    def __init__(self, t: object) -> None:
        self.t = t


def test_table_of_ints_stays_out_of_the_gc_until_a_container_is_stored() -> None:
    """Like a dict of ints, a table of masks is not traversed by every full collection."""
    t = KeyTable()
    for k in range(100):
        t[k] = k << 70
    assert not gc.is_tracked(t)
    t[5] = [t]
    assert gc.is_tracked(t)
    del t[5]
    gc.collect()


def test_finalizer_that_uses_the_table() -> None:
    """A value's finalizer runs after its slot is rewritten: it may read or write the table."""
    t = KeyTable()

    class Meddler:
        def __del__(self) -> None:
            t[10**6] = 1
            for k in list(t):
                t.get(k)
            if 3 in t:
                del t[3]

    for k in range(50):
        t[k] = k
    t[0] = Meddler()
    t[0] = 0  # overwrite: the finalizer inserts and deletes
    assert 10**6 in t and 3 not in t
    t[1] = Meddler()
    del t[1]  # delete: likewise
    t[2] = Meddler()
    t.pop_some(len(t))  # the pairs hold the values: finalizers run only when they go
    assert len(t) == 0 or set(t) <= {10**6}


def test_mutation_during_iteration_raises() -> None:
    t = KeyTable()
    for k in range(20):
        t[k] = k
    it = iter(t.items())
    next(it)
    t[100] = 1
    with pytest.raises(RuntimeError, match="changed size"):
        next(it)
    it = iter(t)
    next(it)
    del t[5]
    with pytest.raises(RuntimeError):
        next(it)
    it = iter(t.values())
    next(it)
    t.pop_some(3)
    with pytest.raises(RuntimeError):
        next(it)


# --------------------------------------------------------------------------- hostile keys


HOSTILE = [
    (b"\x00" * 8, TypeError),
    ("1", TypeError),
    (None, TypeError),
    (1.0, TypeError),
    ((1,), TypeError),
    ([1], TypeError),
    (-1, OverflowError),
    (-(2**63), OverflowError),
    (U64, OverflowError),
    (2**200, OverflowError),
    (-(2**200), OverflowError),
]


@pytest.mark.parametrize(("key", "exc"), HOSTILE, ids=[repr(k)[:12] for k, _ in HOSTILE])
def test_hostile_keys_refused_and_never_found(key: object, exc: type[Exception]) -> None:
    t = KeyTable()
    t[1] = 1
    with pytest.raises(exc, match=r"ints in \[0, 2\*\*64\)"):
        t[key] = 2
    assert t.get(key) is None and t.get(key, 7) == 7
    assert key not in t
    with pytest.raises(KeyError):
        del t[key]
    with pytest.raises(KeyError):
        t[key]
    assert dict(t.items()) == {1: 1}


def test_int_subclasses_and_bools_are_their_int_values() -> None:
    class Sneaky(int):
        def __index__(self) -> int:  # never called: the table reads the int itself
            raise AssertionError("called")

        def __hash__(self) -> int:
            raise AssertionError("called")

    t = KeyTable()
    t[Sneaky(5)] = "a"
    t[True] = "b"
    assert t[5] == "a" and t[1] == "b" and type(next(iter(t))) is int


def test_bad_calls() -> None:
    t = KeyTable()
    with pytest.raises(TypeError):
        t.get()
    with pytest.raises(TypeError):
        t.get(1, 2, 3)
    with pytest.raises(ValueError):
        t.pop_some(-1)
    with pytest.raises(TypeError):
        t.pop_some("3")
    with pytest.raises(OverflowError):
        KeyTable(-1)
    with pytest.raises(TypeError):
        hash(t)
    assert t.pop_some(5) == [] and t.pop_some(10**6) == []


# --------------------------------------------------------------------------- memory


def test_sizeof_is_what_tracemalloc_sees() -> None:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t = KeyTable()
        for k in range(100_000):
            t[k * 2654435761 % U64] = 1  # a shared small int: no value object
        traced = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert abs(sys.getsizeof(t) / traced - 1) < 0.01, (sys.getsizeof(t), traced)
    assert sys.getsizeof(t) / len(t) < 33  # 16 bytes a slot at a load of 1/2..3/4


def test_pop_some_sweeps_every_key() -> None:
    """Reclaims resume where the last stopped (a clock over hash order), so while new keys
    keep arriving every old key is still reclaimed within about one sweep; restarting at
    the lowest hashes each time would keep the highest-hash keys forever."""
    t = KeyTable(3)
    for k in range(10_000):
        t[k] = 0
    new = 10_000
    for _ in range(40):  # 20,000 reclaimed, 20,000 stored
        t.pop_some(500)
        for _ in range(500):
            t[new] = 0
            new += 1
    assert len(t) == 10_000
    assert min(t) >= 10_000, "an old key was never reclaimed"


def test_pop_some_shrinks_to_fit() -> None:
    t = KeyTable()
    for k in range(100_000):
        t[k] = 0
    before = sys.getsizeof(t)
    t.pop_some(50_000)
    assert sys.getsizeof(t) <= 0.7 * before  # what a reclaim frees shows at once
    assert t.capacity <= 2 * len(t)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    n=st.sampled_from([0, 1, 7, 60, 700, 3000]),
    step=st.sampled_from([1, 3, 16, 200, 10**6]),
    rnd=st.randoms(use_true_random=False),
)
def test_scan_visits_every_key_present_throughout(seed, n, step, rnd) -> None:
    """KeyTable.scan (the index's sweep of dead bits) returns each key whose value has a bit
    of the mask exactly once, as long as it is in the table from the first call to the last,
    however the table grows, shrinks and shifts runs between calls."""
    mask = 1 << 70 | 2
    values = [1, 2, 3, 4, 6, 1 << 70, 1 << 70 | 1, 1 << 71]
    t, ref = KeyTable(seed), {}
    for _ in range(n):
        k = rnd.getrandbits(64)
        t[k] = ref[k] = rnd.choice(values)
    want = {k for k, v in ref.items() if v & mask}
    seen: list[int] = []
    cursor = 0
    while True:
        pairs, nxt = t.scan(cursor, step, mask)
        for k, v in pairs:
            assert ref[k] is v and v & mask
            seen.append(k)
        for _ in range(rnd.choice([0, 3, 40, 400])):  # churn, some of it resizing the table
            if ref and rnd.random() < 0.55:
                k = rnd.choice(list(ref))
                if k in want and k not in seen:
                    continue  # present throughout: must be found
                del t[k], ref[k]
            else:
                k = rnd.getrandbits(64)
                if k not in ref:
                    t[k] = ref[k] = 1  # new keys carry no bit of the mask
        if nxt is None:
            break
        assert nxt > cursor
        cursor = nxt
    assert sorted(seen) == sorted(want)


def test_scan_refuses_bad_arguments() -> None:
    t = KeyTable()
    t[5] = 1
    assert t.scan(0, 10, 1) == ([(5, 1)], None)
    assert t.scan(0, 10, 2) == ([], None)
    for args in ((-1, 1, 1), (2**64, 1, 1), (0, 0, 1), (0, 1, "1"), ("0", 1, 1)):
        with pytest.raises((ValueError, TypeError, OverflowError)):
            t.scan(*args)
    t[6] = "x"
    with pytest.raises(TypeError, match="int values"):
        t.scan(0, 10, 1)
    assert KeyTable().scan(0, 5, 1) == ([], None)


def test_a_shrink_waits_while_keys_crowd_one_part_of_hash_space() -> None:
    """Deleting keys in hash order (a sweep, a wipe) leaves the survivors in one part of hash
    space: squeezed to a load of 1/2 overall they would overfill it and make one run around
    the table (each delete then shifts it all: 82 s to delete 1M keys). The shrink waits;
    once the keys are spread again it happens."""
    rnd = random.Random(5)
    t = KeyTable(9)
    for _ in range(40_000):
        t[rnd.getrandbits(64)] = 1
    order = list(t)  # slot order, which follows hash order
    for k in order[:36_000]:
        del t[k]
    assert t.capacity > 4 * len(t), "shrunk into a crowded table"
    assert all(t.get(k) == 1 for k in order[36_000:])
    t.shrink()
    assert t.capacity > 4 * len(t)  # still crowded: still waiting
    for _ in range(8_000):  # spread keys again
        t[rnd.getrandbits(64)] = 1
    for k in order[36_000:]:
        del t[k]
    t.shrink()
    assert t.capacity <= 2 * len(t)
    assert len(t) == 8_000


# --------------------------------------------------------------------------- the index


def _export(index: KVIndex) -> dict:
    out = {}
    for key in index.replicas():
        snap = index.export_replica(key)
        out[key] = {t: [sorted(g, key=repr) for g in gs] for t, gs in snap.tiers.items()}
    return out


@pytest.mark.parametrize("seed", range(4))
def test_index_same_state_on_both_kinds_of_table(seed: int) -> None:
    """The same random operations (stores, removals, clears, drops, losses, inferences,
    snapshot round trips) on a compact index and a dict index: the same state throughout."""
    compact = KVIndex(FA_SWA, verify_hashes=False, compact=True)
    plain = KVIndex(FA_SWA, verify_hashes=False, compact=False)
    names = [f"r{r}" for r in range(70)]
    for name in names:
        compact.add_replica(name)
        plain.add_replica(name)
    pool = [random.Random(seed).getrandbits(64) for _ in range(300)]
    rng_a, rng_b = random.Random(seed), random.Random(seed)
    for i in range(400):
        op = _step(compact, rng_a, names, pool)
        assert _step(plain, rng_b, names, pool) == op
        assert compact.entries == plain.entries and compact.mask_bytes == plain.mask_bytes
        assert compact.stats() == plain.stats(), (i, op)
        if i % 50 == 0:
            assert _export(compact) == _export(plain), (i, op)
    assert _export(compact) == _export(plain)
    assert compact.nbytes() == compact.recount_bytes()


def test_index_keeps_a_key_no_keytable_can_hold_in_a_dict() -> None:
    """A replica that sends bytes (or negative) hashes although the pool's are ints: the
    table it stores into becomes a dict, the key is held as the dict path holds it, and
    nothing else changes."""
    index = KVIndex(FA_SWA, verify_hashes=False, compact=True)
    a, b = index.add_replica("A"), index.add_replica("B")
    index.apply_events(a, [stored([1, 2, 3]), stored([7], 1, "sliding_window")])
    before = index.table("GPU", 0)
    assert type(before) is KeyTable
    # a removal of the same table cached before the store in one batch (the ingest's cache)
    index.apply_events(b, [removed([9]), stored([2, b"\x01" * 32, -5, 4]), removed([2, 4])])
    table = index.table("GPU", 0)
    assert type(table) is dict and index.demoted == 1
    assert table == {1: 1, 2: 1, 3: 1, b"\x01" * 32: 2, -5: 2}
    assert type(index.table("GPU", 1)) is KeyTable  # only that table
    assert index.entries == 6 and [s.blocks for s in index.stats()] == [4, 2]
    assert index.nbytes() == index.recount_bytes()
    index.apply_events(b, [removed([b"\x01" * 32, -5])])
    assert [s.blocks for s in index.stats()] == [4, 0]
    # inferred keys (vLLM's answers) take the same way
    index.infer(a, [(1, -3)])
    assert type(index.table("GPU", 1)) is dict and index.demoted == 2


def test_compact_needs_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_mod, "_KeyTable", None)
    with pytest.raises(ValueError, match=r"router\.core\._keytable"):
        KVIndex(FA_SWA, compact=True)
    assert not KVIndex(FA_SWA).compact


def test_bytes_hash_pools_keep_dicts() -> None:
    layout = replace(FA_SWA, hash=HashSettings(int_block_hashes=False))
    index = KVIndex(layout, verify_hashes=False)
    assert not index.compact
    a = index.add_replica("A")
    index.apply_events(a, [stored([b"x" * 32])])
    assert type(index.table("GPU", 0)) is dict and index.demoted == 0


def test_reclaim_on_a_compact_index_frees_memory_proportionally() -> None:
    """A KeyTable shrinks as keys are reclaimed (a dict does not), so a budget holds far more
    keys: between 0.45 and 0.75 of the 16-byte slots it pays for (docs/index-memory.md)."""
    held = {}
    for compact in (True, False):
        index = KVIndex(
            FA_SWA, verify_hashes=False, limits=IndexLimits(max_bytes=400_000), compact=compact
        )
        a = index.add_replica("A")
        for i in range(400):
            index.apply_events(a, [stored(range(i * 100, i * 100 + 100))])
            assert index.nbytes() <= 400_000
        assert index.reclaimed > 0
        assert index.stats()[0].blocks == index.entries
        held[compact] = index.entries
    assert held[True] > 0.45 * 400_000 * 0.9 / 16, held
    assert held[True] > 2 * held[False], held


# --------------------------------------------------------------------------- fallback

INDEX_TESTS = [
    "tests/test_index.py",
    "tests/test_index_wipe.py",
    "tests/test_index_memory.py",
    "tests/test_index_hostile.py",
    "tests/test_snapshot.py",
    "tests/test_predict.py",
    "tests/test_shortlist.py",
    "tests/test_speculative.py",
    "tests/test_late_attach.py",
    "tests/test_external_tiers.py",
]


@without_native
def test_index_suite_passes_with_dict_tables() -> None:
    """The index's own tests, and those of every reader of its tables, with the extension
    switched off: the dict path stays the working reference. (The main run covers the
    compact path, where the extension is built.)"""
    env = dict(os.environ, **{NATIVE_INDEX_ENV: "0"}, PYTHONPATH=str(ROOT))
    env.pop("KVROUTER_REQUIRE_NATIVE", None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *INDEX_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout


CHILD = """
import sys
{prelude}
from router.core.index import KVIndex, leading_walk, native_index
from tests.test_index import FA_SWA, stored
from tests.test_leading_walk import _masks
index = KVIndex(FA_SWA, verify_hashes=False)
a = index.add_replica("A")
index.apply_events(a, [stored([1, 2, 2**64 - 1])])
t = index.table("GPU", 0)
print(native_index(), index.compact, type(t).__name__, sorted(t), "torch" in sys.modules)
print(leading_walk, _masks([t], list(range(64)), 1, native=True).native)  # the Python walk
"""


@without_native
@pytest.mark.parametrize(
    ("prelude", "env"),
    [
        ("", {NATIVE_INDEX_ENV: "0"}),
        ("sys.modules['router.core._keytable'] = None  # as if it never built", {}),
    ],
    ids=["switched-off", "not-built"],
)
def test_dict_fallback_when_extension_missing_or_off(prelude: str, env: dict[str, str]) -> None:
    full = {k: v for k, v in os.environ.items() if k != NATIVE_INDEX_ENV} | env
    full["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(prelude=prelude)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "False", "dict", "[1,", "2,", "18446744073709551615]",
                                  "False", "None", "False"]  # fmt: skip
