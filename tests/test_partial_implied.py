"""What a *partial* replica holds without an event saying so (docs/live-fleet.md §1).

After a late attach the index knows only what the ring and vLLM's answers showed. Two things
vLLM's cache structure lets it add, checked here on real block hashes against hand-derived
hits (full attention 16 + sliding window 48 with 16-token blocks: a hit needs every
full-attention block and the 3 window blocks ending there):

- a ``BlockStored``'s parent is a block the storing request held (a *witness*);
- a held full-attention block implies its ancestors, and a sliding-window block that vLLM
  stored (or named as a parent) implies its window, unless one of them was removed since.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import BlockHasher
from events.layout import GroupKind, GroupSpec, ModelLayout
from events.schema import BlockRemoved, BlockStored
from router.core.hybrid import implied_by_held
from router.core.index import IndexLimits, KVIndex
from router.core.predict import Predictor
from tests.test_predict import stored as stored_in

FA = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)
SWA = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48)
LAYOUT = ModelLayout(groups=(FA, SWA))
A, B = ("A", 0), ("B", 0)
SYSTEM = list(range(1000, 1096))  # 6 blocks


def chain(tokens: list[int]) -> list[int]:
    return BlockHasher(LAYOUT.hash, 16).wire_chain(tokens)


def stored(group: int, hashes: list[int], parent: int | None) -> BlockStored:
    return stored_in(group, hashes, (FA, SWA)[group], parent)


def removed(group: int, hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=group)


def fresh(**limits: int) -> KVIndex:
    index = KVIndex(LAYOUT, verify_hashes=False, limits=IndexLimits(**limits))
    index.add_replica("A")
    index.add_replica("B")
    index.attached_late(A, "test")
    return index


def hits(index: KVIndex, tokens: list[int]) -> dict[tuple[str, int], int]:
    """Imply first (as the router does before each decision), then predict."""
    predictor = Predictor(index)
    for key, keys in predictor.implied_keys(tokens, None, index.partial_replicas()).items():
        index.infer(key, keys, "implied_blocks")
    return {h.replica: h.hit_tokens for h in predictor.predict(tokens).replicas}


def served(index: KVIndex, tokens: list[int], hit_blocks: int) -> None:
    """A's request over ``tokens`` hit ``hit_blocks`` blocks cached before attach and stored
    the rest, as vLLM publishes it (one store per group, parent = the last hit block)."""
    c = chain(tokens)
    parent = c[hit_blocks - 1] if hit_blocks else None
    index.apply_events(A, [stored(g, c[hit_blocks:], parent) for g in (0, 1)])


def test_a_stores_parent_proves_the_prefix_cached_before_attach() -> None:
    index = fresh()
    first = SYSTEM + list(range(40))  # 8 blocks: 6 cached before attach, 2 stored now
    served(index, first, 6)
    (a,) = [s for s in index.stats() if s.replica == "A"]
    assert a.witnessed_parents == 2  # block 5, in each group
    c = chain(SYSTEM + list(range(500, 520)))
    keys = Predictor(index).implied_keys(SYSTEM + list(range(500, 520)), None, [A])
    # full attention: blocks 0-4 below the witnessed 5; window: 3 and 4 before the anchor 5
    assert sorted(keys[A]) == sorted([(0, c[j]) for j in range(5)] + [(1, c[3]), (1, c[4])])
    # vLLM's rule on what A holds: 6 full-attention blocks, window blocks 3-5: 96 tokens
    assert hits(index, SYSTEM + list(range(500, 520))) == {A: 96, B: 0}
    # the first request's own blocks: 8 blocks, window 5-7
    assert hits(index, [*first, 7]) == {A: 128, B: 0}


def test_a_window_block_removed_since_attach_is_not_implied() -> None:
    index = fresh()
    served(index, SYSTEM + list(range(40)), 6)
    c = chain(SYSTEM)
    index.apply_events(A, [removed(1, [c[4]])])  # a key the index never held: remembered
    other = SYSTEM + list(range(500, 520))
    keys = Predictor(index).implied_keys(other, None, [A])
    assert (1, c[4]) not in keys[A] and (1, c[3]) in keys[A]
    # the window at 96 lacks block 4; no 3 window blocks end lower: no hit
    assert hits(index, other) == {A: 0, B: 0}
    # stored again: known, and its window is held again
    index.apply_events(A, [stored(1, [c[4]], c[3])])
    assert hits(index, other)[A] == 96


def test_past_its_bound_of_removals_a_replica_implies_no_window() -> None:
    """``gone`` is bounded (memory per partial replica): past it nothing is implied through
    windows, since an unrecorded removal could make an implied block a lie; full attention
    needs no record and goes on."""
    index = fresh(max_partial_removals=3)
    served(index, SYSTEM + list(range(40)), 6)
    index.apply_events(A, [removed(1, [10**6 + i]) for i in range(3)])
    assert index.gone(A) is not None and len(index.gone(A)) == 3
    index.apply_events(A, [removed(1, [10**6 + 3])])
    assert index.gone(A) is None
    other = SYSTEM + list(range(500, 520))
    c = chain(other)
    keys = Predictor(index).implied_keys(other, None, [A])
    assert sorted(keys[A]) == sorted((0, c[j]) for j in range(5))  # no window block
    assert hits(index, other) == {A: 0, B: 0}  # the window at 96 lacks blocks 3 and 4


def test_an_implied_window_block_implies_nothing_itself() -> None:
    """Block 4 of the window is held because the anchor 5 implied it: nothing says the
    request that stored 6 and 7 held blocks 2 and 3's window, so a prompt sharing only 5
    blocks gets no window (a hit of 80 would need block 2)."""
    index = fresh()
    served(index, SYSTEM + list(range(40)), 6)
    assert hits(index, SYSTEM + list(range(500, 520)))[A] == 96  # implies 0-4, window 3, 4
    shorter = SYSTEM[:80] + list(range(600, 640))
    assert hits(index, shorter) == {A: 0, B: 0}


def test_a_parent_removed_later_in_its_batch_is_not_held() -> None:
    """Sliding window (full attention would keep it: a held child proves its parent)."""
    index = fresh()
    c = chain(SYSTEM + list(range(40)))
    index.apply_events(A, [stored(1, c[6:], c[5]), removed(1, [c[5]])])
    assert not index.copies(A, 1, c[5])
    index.apply_events(A, [removed(1, [c[5]]), stored(1, c[6:], c[5])])
    assert index.copies(A, 1, c[5]) == 1  # the store after the removal: proved again


def test_an_exact_replica_takes_no_witness() -> None:
    index = fresh()
    c = chain(SYSTEM + list(range(40)))
    index.apply_events(B, [stored(0, c[6:], c[5])])
    assert index.trust(B) == "exact" and not index.copies(B, 0, c[5])
    assert index.partial_replicas() == [A]


def reference_implied(
    index: KVIndex, tokens: list[int], replicas: list[tuple[str, int]]
) -> dict[tuple[str, int], set[tuple[int, int]]]:
    """implied_keys, replica by replica from the pure rule (:func:`implied_by_held`)."""
    c = chain(tokens)
    out: dict[tuple[str, int], set[tuple[int, int]]] = {}
    for r in replicas:
        bit = index.slot_bit(r)
        for g, spec in enumerate((FA, SWA)):
            held = [bool(index.table("GPU", g).get(w, 0) & bit) for w in c]
            if g == 0:
                implied = implied_by_held(spec, held)
            else:
                gone, anchors = index.gone(r), index.anchors(r)
                if gone is None:
                    continue
                anchored = [h and (1, w) in anchors for h, w in zip(held, c, strict=True)]
                implied = [
                    j
                    for j in implied_by_held(spec, anchored)
                    if not held[j] and (1, c[j]) not in gone
                ]
            if implied:
                out.setdefault(r, set()).update((g, c[j]) for j in implied)
    return out


runs = st.tuples(st.integers(0, 11), st.integers(1, 6), st.booleans())


@settings(max_examples=150, deadline=None)
@given(
    stores=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), runs), max_size=12),
    removals=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 11))),
    learned=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 11))),
)
def test_implied_keys_equal_the_rule_replica_by_replica(stores, removals, learned) -> None:
    """The one-pass implication (all partial replicas at once) against the pure rule applied
    to each replica: random stores (runs of the chain, with or without their parent), keys
    learned from answers (held, no anchor) and removals on four partial replicas and an exact
    one."""
    index = KVIndex(LAYOUT, verify_hashes=False)
    keys = [index.add_replica(f"r{i}") for i in range(5)]
    for key in keys[:4]:
        index.attached_late(key, "test")
    tokens = list(range(200, 200 + 12 * 16))
    c = chain(tokens)
    for who, g, (start, length, with_parent) in stores:
        parent = c[start - 1] if start and with_parent else None
        index.apply_events(keys[who], [stored(g, c[start : start + length], parent)])
    for who, g, j in learned:
        index.infer(keys[who], [(g, c[j])])
    for who, g, j in removals:
        index.apply_events(keys[who], [removed(g, [c[j]])])
    partial = index.partial_replicas()
    got = Predictor(index).implied_keys(tokens, None, partial)
    assert {r: set(ks) for r, ks in got.items()} == reference_implied(index, tokens, partial)
    for ks in got.values():  # full-attention keys in chain order (the index links them)
        fa = [c.index(h) for g, h in ks if g == 0]
        assert fa == sorted(fa)


@given(
    held=st.lists(st.booleans(), max_size=24),
    window=st.integers(min_value=1, max_value=80),
    kind=st.sampled_from([GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA]),
)
def test_implied_by_held_matches_its_definition(held: list[bool], window: int, kind) -> None:
    spec = GroupSpec(
        kind=kind,
        block_size=16,
        sliding_window=window if kind == GroupKind.SLIDING_WINDOW else None,
    )
    got = implied_by_held(spec, held)
    n = len(held)
    if kind == GroupKind.FULL_ATTENTION:
        want = [j for j in range(n) if not held[j] and any(held[j + 1 :])]
    elif kind == GroupKind.SLIDING_WINDOW:
        need = max(1, -(-(window - 1) // 16))  # blocks a hit ending at a held block needs
        want = [j for j in range(n) if not held[j] and any(held[j + 1 : j + need])]
    else:
        want = []
    assert got == want


def test_an_answer_does_not_teach_a_window_block_removed_since_its_request_was_sent() -> None:
    """vLLM's answer proves the hit's blocks were there at admission. A window block behind
    the hit leaves the request's window as it computes, is freed at once and may be evicted
    before the answer (found by tests/test_eviction_order.py's model): a window key removed
    after the request was sent is not learned; a full-attention one (held by the request
    until it ends) is."""
    import time

    index = fresh()
    c = chain(SYSTEM)
    sent = time.monotonic()
    index.apply_events(A, [removed(1, [c[4]])])  # after the request was sent
    assert index.infer(A, [(0, c[4]), (1, c[4])], sent_at=sent) == 1
    assert index.copies(A, 0, c[4]) == 1 and index.copies(A, 1, c[4]) == 0
    (a,) = [s for s in index.stats() if s.replica == "A"]
    assert a.answer_keys_skipped == 1
    # a removal before the request was sent says nothing about the copy its answer shows
    later = time.monotonic() + 1e-6
    assert index.infer(A, [(1, c[4])], sent_at=later) == 1
