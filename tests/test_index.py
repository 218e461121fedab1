"""router.core.index: presence per (tier, group, hash) with copy counts, applied in stream order."""

from __future__ import annotations

import random

import pytest

from events.layout import GroupKind, GroupSpec, ModelLayout
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, UnknownEvent
from router.core.index import IndexLimits, KVIndex, LayoutConflict, UnknownReplica

FA_SWA = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=64),
    )
)
LEARN = ModelLayout(groups=())
A = ("A", 0)
B = ("B", 0)


def stored(hashes, group=0, kind="full_attention", block_size=16, parent=None, medium="GPU", **kw):
    kw.setdefault("kv_cache_spec_sliding_window", 64 if kind == "sliding_window" else None)
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(range(block_size * max(1, len(hashes)))),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        **kw,
    )


def removed(hashes, group=0, medium="GPU"):
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


def present(index: KVIndex, key, group, h, tier="GPU") -> bool:
    return bool(index.table(tier, group).get(h, 0) & index.slot_bit(key))


def make(layout=FA_SWA, **kw) -> KVIndex:
    kw.setdefault("verify_hashes", False)  # fake hashes: no re-hash check unless a test asks
    index = KVIndex(layout, **kw)
    index.add_replica("A")
    index.add_replica("B")
    return index


def test_swa_removal_keeps_fa_entry_of_same_hash() -> None:
    index = make()
    h = 2**64 - 1  # uint64 above 2**63 is an ordinary hash
    index.apply_events(A, [stored([h], 0), stored([h], 1, "sliding_window")])
    index.apply_events(A, [removed([h], 1)])
    assert present(index, A, 0, h)
    assert not present(index, A, 1, h)


def test_copies_are_counted_not_set() -> None:
    index = make()
    index.apply_events(A, [stored([7]), stored([7]), stored([7])])
    assert index.copies(A, 0, 7) == 3
    index.apply_events(A, [removed([7]), removed([7])])
    assert index.copies(A, 0, 7) == 1 and present(index, A, 0, 7)
    index.apply_events(A, [removed([7])])
    assert index.copies(A, 0, 7) == 0 and not present(index, A, 0, 7)
    assert index.entries == 0 and index.extra_entries == 0


def test_replicas_are_independent_bits() -> None:
    index = make()
    index.apply_events(A, [stored([1, 2])])
    index.apply_events(B, [stored([2, 3])])
    index.apply_events(A, [removed([2])])
    assert not present(index, A, 0, 2) and present(index, B, 0, 2)
    assert present(index, A, 0, 1) and present(index, B, 0, 3)


def test_store_remove_store_in_one_batch_is_applied_in_order() -> None:
    index = make()
    index.apply_events(A, [stored([5]), removed([5]), stored([5])])
    assert index.copies(A, 0, 5) == 1
    index.apply_events(A, [removed([5]), stored([5]), removed([5])])
    assert index.copies(A, 0, 5) == 0


def test_unknown_removal_is_counted_and_ignored() -> None:
    index = make()
    index.apply_events(A, [stored([1])])
    index.apply_events(A, [removed([99]), removed([1], group=1)])
    (a, _) = index.stats()
    assert a.unknown_removals == 2
    assert present(index, A, 0, 1)


def test_empty_block_hashes_store_is_harmless() -> None:
    index = make()
    index.apply_events(A, [stored([], 1, "sliding_window")])
    assert index.entries == 0
    assert index.stats()[0].trusted


def test_all_blocks_cleared_wipes_only_that_replica_and_every_tier() -> None:
    index = make()
    index.apply_events(A, [stored([1, 2]), stored([3], medium="CPU")])
    index.apply_events(B, [stored([1])])
    index.apply_events(A, [AllBlocksCleared()])
    assert not present(index, A, 0, 1) and not present(index, A, 0, 3, "CPU")
    assert present(index, B, 0, 1)
    assert index.entries == 1


def test_a_clear_after_stores_in_the_same_batch_wipes_them() -> None:
    """The wipe skips a replica that holds nothing, so it must see the batch's own stores."""
    index = make()
    index.apply_events(A, [stored([1, 2]), stored([3], medium="CPU"), AllBlocksCleared()])
    assert not present(index, A, 0, 1) and not present(index, A, 0, 3, "CPU")
    assert index.entries == 0 and index.stats()[0].blocks == 0
    index.lost_events(A, "nothing held: nothing to scan")
    assert index.entries == 0 and not index.is_trusted(A)


def test_tiers_are_separate() -> None:
    index = make()
    index.apply_events(A, [stored([1], medium="CPU")])
    assert present(index, A, 0, 1, "CPU") and not present(index, A, 0, 1, "GPU")
    assert index.tiers_in_use() == ["CPU"]


def test_dp_ranks_are_separate_caches() -> None:
    index = make()
    r1 = index.add_replica("A", 1)
    index.apply_events(r1, [stored([1])])
    assert present(index, r1, 0, 1) and not present(index, A, 0, 1)
    index.remove_replica("A")
    with pytest.raises(UnknownReplica):
        index.slot_bit(r1)
    assert index.entries == 0


def test_unknown_replica_error_names_the_fix() -> None:
    index = make()
    with pytest.raises(UnknownReplica, match="add_replica"):
        index.apply_events(("C", 0), [stored([1])])


def test_restart_wipes_and_keeps_trust() -> None:
    index = make()
    index.apply_events(A, [stored([1])])
    index.reset_replica(A)
    assert not present(index, A, 0, 1)
    s = index.stats()[0]
    assert s.trusted and s.resets == 1


def test_lost_events_distrust_until_a_clear() -> None:
    index = make()
    index.apply_events(A, [stored([1])])
    index.lost_events(A, "gap 5..9 not covered by the replay ring")
    assert not index.is_trusted(A)
    assert "reset_prefix_cache" in index.untrusted_reason(A)
    assert not present(index, A, 0, 1)
    index.apply_events(A, [stored([2])])
    assert not index.is_trusted(A)
    index.apply_events(A, [AllBlocksCleared(), stored([3])])
    assert index.is_trusted(A) and present(index, A, 0, 3)


def test_seen_down_wipes_and_distrusts_until_the_stream_shows_its_state() -> None:
    """router.core.health took the replica out of rotation: it may restart meanwhile
    (empty, with no event), so its blocks go and it predicts nothing; a continuing batch
    makes it partial (a lower bound), a restart or a clear exact."""
    index = make()
    index.apply_events(A, [stored([1, 2])])
    index.apply_events(B, [stored([1])])
    index.seen_down(A, "down: 2 consecutive probes failed")
    assert index.trust(A) == "untrusted" and "seen down (down: 2" in index.untrusted_reason(A)
    assert not present(index, A, 0, 1) and present(index, B, 0, 1)  # B untouched
    assert index.stats()[0].ingest_errors == {"replica_down": 1}
    # its stream goes on without a restart: what it stores from now on is known
    index.apply_events(A, [stored([3])])
    assert index.trust(A) == "partial" and present(index, A, 0, 3)
    assert "seen down" in index.partial_reason(A)
    # a restart (the sequence went back) is a known state again: empty
    index.seen_down(A, "ejected")
    index.reset_replica(A)
    assert index.trust(A) == "exact" and not present(index, A, 0, 3)
    index.apply_events(A, [stored([4])])
    assert index.trust(A) == "exact"
    # so is a reset of its prefix cache
    index.seen_down(A, "ejected")
    index.apply_events(A, [AllBlocksCleared(), stored([5])])
    assert index.trust(A) == "exact" and present(index, A, 0, 5)


def test_seen_down_then_lost_events_stays_untrusted() -> None:
    index = make()
    index.seen_down(A, "down")
    index.lost_events(A, "gap 3..5")
    index.apply_events(A, [stored([1])])  # the gap, not the outage, decides now
    assert index.trust(A) == "untrusted"


def test_seen_down_never_clears_a_settings_problem() -> None:
    index = make()
    index.mark_untrusted(A, "hash settings differ", recoverable=False, label="hash_mismatch")
    index.seen_down(A, "down")
    index.apply_events(A, [stored([1])])
    assert index.trust(A) == "untrusted"
    assert index.untrusted_reason(A) == "hash settings differ"


def test_undecodable_event_distrusts() -> None:
    index = make()
    index.apply_events(A, [UnknownEvent(0, "Invalid value 'BlockMoved'", b"\x80")])
    assert not index.is_trusted(A)
    assert index.stats()[0].unknown_events == 1


def test_learns_groups_from_events() -> None:
    index = make(LEARN)
    assert index.layout is None
    index.apply_events(
        A, [stored([1], 0, "sliding_window", 32), stored([1], 1, "full_attention", 32)]
    )
    lay = index.layout
    assert lay is not None
    assert [g.kind for g in lay.layout.groups] == ["sliding_window", "full_attention"]
    assert lay.layout.groups[0].sliding_window == 64
    assert lay.hash_block_size == 32 and lay.alignment == 32
    assert lay.spec_groups[0].group_ids == (1,)  # full attention is looked up first


def test_conflict_between_replicas_names_field_and_values() -> None:
    index = make(LEARN)
    index.apply_events(A, [stored([1], 0, "full_attention", 16)])
    index.apply_events(B, [stored([1], 0, "sliding_window", 16)])
    assert index.is_trusted(A)
    assert not index.is_trusted(B)
    reason = index.untrusted_reason(B)
    assert (
        "kv_cache_spec_kind" in reason and "sliding_window" in reason and "full_attention" in reason
    )


def test_conflict_with_declared_layout() -> None:
    index = make()
    index.apply_events(A, [stored([1], 1, "sliding_window", 16, kv_cache_spec_sliding_window=128)])
    assert not index.is_trusted(A)
    assert "sliding_window" in index.untrusted_reason(A)
    assert "128" in index.untrusted_reason(A) and "64" in index.untrusted_reason(A)
    # a settings problem survives a prefix-cache reset
    index.apply_events(A, [AllBlocksCleared()])
    assert not index.is_trusted(A)


def test_layout_conflict_is_typed() -> None:
    err = LayoutConflict("block_size", 16, 32, "pool p replica A/dp0 group 0")
    assert err.field == "block_size" and err.expected == 16 and err.observed == 32
    assert "block_size" in str(err) and "16" in str(err) and "32" in str(err)


def test_partial_entry_is_counted_and_held() -> None:
    layout = ModelLayout(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=64),
            GroupSpec(kind=GroupKind.MAMBA, block_size=64),
        ),
        prefix_match_unit=16,
    )
    index = make(layout)
    index.apply_events(A, [stored([11], 0, "full_attention", 16, parent=10)])
    assert present(index, A, 0, 11)
    assert index.stats()[0].partial_stores == 1


def test_missing_group_idx_means_group_zero_full_attention() -> None:
    index = make(LEARN)
    ev = BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None)
    assert not ev.group_aware
    index.apply_events(A, [ev])
    assert present(index, A, 0, 1)
    assert index.layout.layout.groups[0].kind == "full_attention"
    assert index.stats()[0].group_aware is False
    index.apply_events(A, [stored([3], 0)])  # now with group_idx: mixing is refused
    assert not index.is_trusted(A)


def test_conformance_mismatch_distrusts_with_both_values() -> None:
    index = make(conformance=lambda tokens, bs, salt: [100 + i for i in range(len(tokens) // bs)])
    index.apply_events(A, [stored([100, 101])])
    assert index.is_trusted(A)
    index.apply_events(B, [stored([100, 555])])
    assert not index.is_trusted(B)
    reason = index.untrusted_reason(B)
    assert "555" in reason and "101" in reason and "hash" in reason
    s = {x.replica: x for x in index.stats()}
    assert s["A"].conformance_checked == 1 and s["B"].conformance_mismatches == 1


def test_conformance_is_sampled_after_the_first_stores() -> None:
    calls = []
    limits = IndexLimits(conformance_first=3, conformance_every=4)
    index = make(limits=limits, conformance=lambda t, bs, salt: calls.append(1) or [1])
    for _ in range(11):
        index.apply_events(A, [stored([1]), removed([1])])
    s = index.stats()[0]
    assert s.conformance_checked == len(calls) == 3 + 2  # roots 1-3, then 7 and 11
    assert s.conformance_skipped == 6


def test_reclaim_keeps_memory_bounded_and_never_adds_presence() -> None:
    budget = 200_000
    index = make(limits=IndexLimits(max_bytes=budget))
    for i in range(100):
        index.apply_events(A, [stored(range(i * 100, i * 100 + 100))])
    assert index.nbytes() <= budget
    assert index.reclaimed > 0
    table = index.table("GPU", 0)
    assert len(table) + index.reclaimed == 10_000 == index.stats()[0].stored_blocks
    assert index.stats()[0].blocks == len(table) == index.entries
    assert all(0 <= h < 10_000 for h in table)
    if index.compact:  # a KeyTable's sweep over hash order, which depends on its seed
        # it shrinks as keys go (a dict does not): the budget holds 5x the dict path's keys
        assert len(table) > 5_000
    else:  # a dict's insertion order
        assert 0 not in table  # the oldest went first
        assert present(index, A, 0, 9999)  # the newest keys survive


def test_random_event_sequences_match_a_counting_model() -> None:
    """Counts per (replica, tier, group, hash) equal a naive multiset model."""
    rng = random.Random(7)
    index = make()
    model: dict[tuple, int] = {}
    for _ in range(3000):
        key = rng.choice([A, B])
        g = rng.randrange(2)
        tier = rng.choice(["GPU", "GPU", "CPU"])
        h = rng.randrange(20)
        kind = "full_attention" if g == 0 else "sliding_window"
        mk = (key, tier, g, h)
        if rng.random() < 0.55:
            index.apply_events(key, [stored([h], g, kind, medium=tier, parent=1)])
            model[mk] = model.get(mk, 0) + 1
        else:
            index.apply_events(key, [removed([h], g, tier)])
            if model.get(mk):
                model[mk] -= 1
    for (key, tier, g, h), c in model.items():
        assert index.copies(key, g, h, tier) == c, (key, tier, g, h)
    assert index.entries == sum(
        1 for tier in ("GPU", "CPU") for g in range(2) for _ in index.table(tier, g)
    )


def test_lazily_decoded_stores_apply_and_conform_like_eager_ones() -> None:
    from events.schema import KVEventBatch, LazyTokensBlockStored, decode_batch, encode_batch

    seen = []
    index = make(conformance=lambda tokens, bs, salt: seen.append(tokens) or [100, 101])
    ev = stored([100, 101])
    payload = encode_batch(KVEventBatch(1.0, [ev, removed([100])], 0))
    lazy = decode_batch(payload, lazy_token_ids=True).events
    assert type(lazy[0]) is LazyTokensBlockStored
    assert lazy[0].tokens() == ev.token_ids == decode_batch(payload).events[0].tokens()
    index.apply_events(A, lazy)
    assert seen == [ev.token_ids]  # the conformance check decoded the tokens on demand
    assert not present(index, A, 0, 100) and present(index, A, 0, 101)
    assert index.is_trusted(A)


def test_layout_files_write_none_retention_as_a_string() -> None:
    import msgspec

    text = b'retention_interval = "none"\n[[groups]]\nkind = "full_attention"\nblock_size = 16\n'
    assert msgspec.toml.decode(text, type=ModelLayout).retention_interval is None
    with pytest.raises(msgspec.ValidationError):
        msgspec.toml.decode(b'retention_interval = "dense"\ngroups = []\n', type=ModelLayout)


def test_incremental_replica_counts_equal_a_full_scan() -> None:
    """stats() keeps per-replica counts as events apply; they must equal a scan of the tables."""
    rng = random.Random(11)
    index = make(limits=IndexLimits(max_bytes=72 * 150))  # small: reclaim runs too
    for _ in range(4000):
        key = rng.choice([A, B])
        g = rng.randrange(2)
        tier = rng.choice(["GPU", "CPU"])
        kind = "full_attention" if g == 0 else "sliding_window"
        h = rng.randrange(300)
        r = rng.random()
        if r < 0.55:
            index.apply_events(key, [stored([h], g, kind, medium=tier, parent=1)])
        elif r < 0.995:
            index.apply_events(key, [removed([h], g, tier)])
        else:
            index.apply_events(key, [AllBlocksCleared()])
    assert index.reclaimed > 0
    for s in index.stats():
        bit = index.slot_bit((s.replica, s.dp_rank))
        slot = bit.bit_length() - 1
        blocks = extra = 0
        for tier in ("GPU", "CPU"):
            for g in range(2):
                blocks += sum(1 for m in index.table(tier, g).values() if m & bit)
                t = index._tiers[tier]
                extra += sum(c - 1 for (sl, _), c in t.extra[g].items() if sl == slot)
        assert (s.blocks, s.extra_copies) == (blocks, extra)


def test_partial_replica_keeps_a_full_attention_parent_while_a_child_is_held() -> None:
    """After a late attach, copy counts are lower bounds: a key learned from an answer holds
    one copy though the replica may hold two. Full attention is ancestor-closed in vLLM's
    cache (a request holds a copy of every ancestor and frees it after the child), so a
    removal that leaves a held child's parent without a copy took a duplicate: kept."""
    index = make()
    index.attached_late(A, "test")
    index.attached_late(B, "test")
    # learned from an answer: blocks 1, 2, 3 in FA (and the SWA window)
    index.infer(A, [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3)])
    index.infer(B, [(0, 1), (0, 2), (0, 3)])
    # A's request stored its own block 4 after the hit; B's did not
    index.apply_events(A, [stored([4], 0, parent=3)])
    # a copy from before attach of each of 1..3 is evicted (tail first), on both
    index.apply_events(A, [removed([3, 2, 1], 0)])
    index.apply_events(B, [removed([3, 2, 1], 0)])
    assert all(present(index, A, 0, h) for h in (1, 2, 3))  # 4 proves 3, 3 proves 2, ...
    assert not any(present(index, B, 0, h) for h in (1, 2, 3))  # nothing proves B's: gone
    (a,) = [s for s in index.stats() if s.replica == "A"]
    assert a.closure_kept == 3
    # the child goes first, then the parent: the last copy, dropped
    index.apply_events(A, [removed([4], 0), removed([3], 0)])
    assert not present(index, A, 0, 3) and present(index, A, 0, 2)
    # SWA is not closed: its removal is taken as it comes
    index.apply_events(A, [removed([3], 1)])
    assert not present(index, A, 1, 3)
    # an exact replica never needs it: counts are exact there
    index.apply_events(A, [AllBlocksCleared(), stored([1], 0), stored([2], 0, parent=1)])
    index.apply_events(A, [removed([1], 0)])
    assert index.trust(A) == "exact" and not present(index, A, 0, 1)
