"""router.core._keytable.leading_walk (the C walk of a request's chain) against the Python walk.

``_Masks.walk_python`` (router/core/predict.py) is the reference: on random tables (KeyTables
and dicts, the index's two kinds, mixed as a demoted table mixes them), random chains, keys
absent or present, masks of any width (past 64 bits, shared objects, 0, int subclasses,
negative ints the index never stores), every mode (one table, AND over groups, OR for the
group-blind walk), every stride and an empty or partial ``alive``, the C walk returns the same
``(stopped, walked)`` and hashes the chain exactly as far. The prediction tests
(tests/test_predict.py, tests/test_shortlist.py, tests/conftest.py's shortlist check) run on
whichever walk is in use; tests/test_keytable.py runs them again with the extension off, and
checks that the Python walk is then the one used.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import BlockHasher
from events.layout import HashSettings
from router.core import index as index_mod
from router.core.predict import _Masks

REQUIRED = os.environ.get("KVROUTER_REQUIRE_NATIVE", "") == "1"

try:
    from router.core._keytable import KeyTable, leading_walk  # type: ignore[import-not-found]
except ImportError:  # not built: skip, unless CI requires it
    KeyTable = leading_walk = None

needs_native = pytest.mark.skipif(
    index_mod.leading_walk is None and not REQUIRED,
    reason=f"router.core._keytable not built, or {index_mod.NATIVE_INDEX_ENV}=0",
)

HASHER = BlockHasher(HashSettings(), 4, memo_entries=0)
"""H = 4 tokens, no memo: how far a walk hashed is then a pure function of the walk."""


class BigMask(int):
    """An int subclass: read through Python's operators, never in place."""


class _Index:
    """What _Masks reads of a KVIndex: its tables."""

    def __init__(self, tables: list) -> None:
        self.tables = tables

    def table(self, tier: str, group: int) -> object:
        return self.tables[group]


def _masks(tables: list, tokens: list[int], alive: int, native: bool) -> _Masks:
    chain = HASHER.lazy_chain(tokens)
    return _Masks(_Index(tables), "GPU", len(tables), chain, alive, native=native)  # type: ignore[arg-type]


@st.composite
def walks(draw: st.DrawFn) -> tuple[list, list[int], int, tuple[int, ...] | None, int]:
    """Tables, a prompt, alive, the groups walked and the stride."""
    n_tables = draw(st.integers(1, 3))
    units = draw(st.integers(0, 70))
    tokens = draw(st.lists(st.integers(0, 50), min_size=4 * units, max_size=4 * units + 3))
    wires = HASHER.wire_chain(tokens)
    width = draw(st.sampled_from([3, 8, 64, 65, 200, 300]))
    slots = draw(st.lists(st.integers(0, width - 1), min_size=1, max_size=6, unique=True))
    bits = [1 << s for s in slots]
    alive = draw(st.sampled_from([0, sum(bits), sum(bits[: len(bits) // 2 + 1])]))
    shared = draw(st.sampled_from(bits))  # one object many keys hold, as the index shares it
    extra = draw(st.integers(0, (1 << width) - 1))

    def mask_at(j: int, p_keep: int) -> int | None:
        kind = draw(st.integers(0, 99))
        if kind < p_keep:
            return sum(bits) | extra  # every replica, and more
        if kind < p_keep + 8:
            return None  # absent
        if kind < p_keep + 14:
            return shared
        if kind < p_keep + 17:
            return BigMask(draw(st.sampled_from([sum(bits), *bits])))
        if kind < p_keep + 19:
            return draw(st.sampled_from([-(1 << width), -1, 0]))
        return draw(st.sampled_from(bits)) | draw(st.sampled_from(bits))

    tables = []
    p_keep = draw(st.sampled_from([30, 70, 95]))
    for _ in range(n_tables):
        compact = KeyTable is not None and draw(st.booleans())
        t = KeyTable(seed=draw(st.integers(0, 2**64 - 1))) if compact else {}
        for j, h in enumerate(wires):
            m = mask_at(j, p_keep)
            if m is not None:
                t[h] = m
        for h in draw(st.lists(st.integers(0, 2**64 - 1), max_size=5)):  # keys no walk meets
            t[h] = sum(bits)
        tables.append(t)
    groups = draw(
        st.sampled_from([None, tuple(range(n_tables)), (0,), (n_tables - 1,), (), (0, 0)])
    )
    return tables, tokens, alive, groups, draw(st.integers(1, 4))


@needs_native
@settings(max_examples=400, deadline=None)
@given(walks())
def test_native_walk_is_the_python_walk(case: tuple) -> None:
    tables, tokens, alive, groups, k = case
    ref = _masks(tables, tokens, alive, native=False)
    fast = _masks(tables, tokens, alive, native=True)
    assert fast.native and not ref.native
    want = ref.leading_runs(groups, k)
    got = fast.leading_runs(groups, k)
    assert got == want
    assert {type(b) for b in got[0]} <= {int}
    assert fast.chain.hashed == ref.chain.hashed  # hashed exactly as far


@needs_native
def test_walk_stops_where_the_last_replica_drops_and_hashes_no_further() -> None:
    """A long prompt two replicas hold for 10 and 25 blocks: the walk stops at block 25 and
    hashes 32 units (the chain's read-ahead), not the 1,000 of the prompt."""
    tokens = list(range(4000))
    wires = HASHER.wire_chain(tokens)
    a, b = 1 << 70, 1 << 3
    t = KeyTable()
    for j, h in enumerate(wires[:25]):
        t[h] = a | b if j < 10 else b
    m = _masks([t], tokens, a | b, native=True)
    assert m.leading_runs((0,), 1) == ({a: 10, b: 25}, 25)
    assert m.chain.hashed == 32


@needs_native
def test_walk_refuses_bad_arguments() -> None:
    t = KeyTable()
    with pytest.raises(TypeError):
        leading_walk((), 0, 1, (t,), False, 1, {}, 0)  # wires not a list
    with pytest.raises(TypeError):
        leading_walk([], 0, 1, (t,), False, 1, {})  # 7 arguments
    for i, k, tables, j in [(-1, 1, (t,), 0), (0, 0, (t,), 0), (0, 1, (), 0), (0, 1, (t,), -1)]:
        with pytest.raises(ValueError):
            leading_walk([1], i, k, tables, False, 1, {}, j)


@needs_native
def test_table_errors_propagate() -> None:
    """A table whose lookup raises (neither a KeyTable nor a dict: read through ``get``)."""

    class Broken:
        def get(self, key: object, default: object) -> int:
            raise RuntimeError("broken table")

    with pytest.raises(RuntimeError, match="broken table"):
        leading_walk([1, 2], 0, 1, (Broken(),), False, 3, {}, 0)
