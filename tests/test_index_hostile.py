"""The index under odd and hostile events: what vLLM's connectors send, values outside every
bound, and a batch that raises. Nothing may crash, allocate without bound, poison another
replica or go unnoticed: every refusal is counted and makes only its own replica untrusted."""

from __future__ import annotations

import logging
import tracemalloc

from test_index import LEARN, A, B, make, present, removed, stored

from events.schema import AllBlocksCleared, BlockStored, DecodedBatch
from events.stream import StreamBatch
from router.core.index import IndexLimits, KVIndex
from router.server.ingest import IndexFeeder
from router.server.metrics import RouterMetrics


def trusted(index: KVIndex, key) -> bool:
    return index.is_trusted(key)


def errors(index: KVIndex, key) -> dict[str, int]:
    return next(s.ingest_errors for s in index.stats() if (s.replica, s.dp_rank) == key)


def test_mooncake_store_connector_lower_case_cpu_is_the_cpu_tier() -> None:
    """vLLM 0.32's Mooncake store connector publishes medium="cpu" with a group_idx per group."""
    index = make()
    index.apply_events(
        A, [stored([1, 2]), stored([7], group=1, medium="cpu", kind="sliding_window")]
    )
    assert present(index, A, 0, 1) and present(index, A, 0, 2)
    assert present(index, A, 1, 7, tier="CPU") and not present(index, A, 1, 7)
    assert trusted(index, A) and errors(index, A) == {}


def test_connector_events_without_group_idx_do_not_make_a_hybrid_replica_mixed() -> None:
    """LMCache publishes stores without group_idx in the same batches as the GPU's tagged ones;
    only GPU events decide whether a stream tags groups."""
    index = make()
    untagged_cpu = stored([9], medium="CPU", group=None)
    index.apply_events(A, [stored([1]), untagged_cpu, stored([2], group=1, kind="sliding_window")])
    assert trusted(index, A), index.untrusted_reason(A)
    assert present(index, A, 0, 9, tier="CPU")
    # Untagged and tagged GPU events on one stream are still a contradiction.
    index.apply_events(A, [stored([3], group=None)])
    assert not trusted(index, A) and errors(index, A) == {"mixed_group_idx": 1}


def test_offloading_connector_placeholder_store_is_accepted() -> None:
    """The offloading connector publishes block_size=0 and no token ids."""
    index = make()
    ev = BlockStored(
        block_hashes=[5, 6], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
        medium="cpu", group_idx=0,
    )  # fmt: skip
    index.apply_events(A, [ev])
    assert present(index, A, 0, 5, tier="CPU") and trusted(index, A)


def test_unknown_medium_is_kept_as_its_own_tier_and_never_crashes() -> None:
    index = make(limits=IndexLimits(max_extra_tiers=2))
    index.apply_events(A, [stored([1], medium="remote_ssd"), stored([2], medium="Remote_SSD")])
    assert present(index, A, 0, 1, tier="REMOTE_SSD") and present(index, A, 0, 2, tier="REMOTE_SSD")
    assert not present(index, A, 0, 1) and trusted(index, A)
    index.apply_events(A, [stored([3], medium="t2"), stored([4], medium="t3"), stored([5])])
    assert present(index, A, 0, 3, tier="T2") and not present(index, A, 0, 4, tier="T3")
    assert present(index, A, 0, 5), "the events after a refused one are still applied"
    assert errors(index, A) == {"refused_medium": 1} and not trusted(index, A)
    assert set(index.tiers()) == {"GPU", "CPU", "STORAGE", "REMOTE_SSD", "T2"}


def test_one_replicas_junk_media_leave_anothers_tier_budget_alone() -> None:
    """The budget of extra tiers is per replica. It was pool-wide: byte-flipped media of one
    hostile replica ("CPV", ".PU", ...; tests/test_router_fuzz.py made 8 in 6,000 frames) used
    it up, and another replica's connector store was then refused and that replica untrusted."""
    index = make(limits=IndexLimits(max_extra_tiers=2))
    index.apply_events(A, [stored([1], medium=m) for m in ("CPV", ".PU", "GQU")])
    assert errors(index, A) == {"refused_medium": 1} and not trusted(index, A)
    index.apply_events(B, [stored([2], medium="lmcache"), stored([3], medium="cpv")])
    assert trusted(index, B) and errors(index, B) == {}
    assert present(index, B, 0, 2, tier="LMCACHE") and present(index, B, 0, 3, tier="CPV")


def test_out_of_range_group_idx_is_refused_without_allocating() -> None:
    index = make()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index.apply_events(
            A,
            [
                removed([1], group=2_000_000),
                removed([1], group=-1),
                stored([1], group=-1),
                stored([2], group=64),
                removed([3], group=63),  # in bounds, nothing ever stored there
                stored([4]),
            ],
        )
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes allocated for refused events"
    assert errors(index, A) == {"refused_group_idx": 4}
    assert present(index, A, 0, 4) and not trusted(index, A)
    assert trusted(index, B), "one replica's bad events never touch another's trust"
    index.apply_events(A, [AllBlocksCleared()])
    assert trusted(index, A), "a clear is a known state again"


def test_huge_block_size_is_refused_and_not_learned() -> None:
    """With the layout learned from events, one store announcing a 2**20-token block used to
    become the pool's block size, and every replica then predicted 0."""
    index = make(layout=LEARN)
    index.apply_events(B, [stored([1, 2])])
    index.apply_events(A, [stored([3], block_size=1 << 20)])
    assert errors(index, A) == {"refused_block_size": 1} and not trusted(index, A)
    assert index.layout is not None and index.layout.layout.groups[0].block_size == 16
    assert trusted(index, B)


def test_a_batch_that_raises_distrusts_only_its_replica_and_the_stream_goes_on() -> None:
    index = make()
    feeder = IndexFeeder(index, {"a": A, "b": B})

    def batch(seq: int, *events: object) -> StreamBatch:
        return StreamBatch("a", seq, DecodedBatch(0.0, list(events), 0), False, 0.0)

    feeder(batch(0, stored([1]), "not an event", stored([2])))
    assert not trusted(index, A) and errors(index, A) == {"ingest_exception": 1}
    assert "could not be applied" in (index.untrusted_reason(A) or "")
    assert present(index, A, 0, 1) and trusted(index, B)
    feeder(batch(1, AllBlocksCleared(), stored([5])))
    assert trusted(index, A) and present(index, A, 0, 5) and not present(index, A, 0, 1)


def test_a_replica_that_stays_wrong_warns_once_per_interval_and_counts_all(caplog) -> None:
    index = make()
    with caplog.at_level(logging.WARNING, logger="router.core.index"):
        for _ in range(100):
            index.apply_events(A, [stored([1], group=-5)])
    lines = [r for r in caplog.records if "refused_group_idx" in r.getMessage()]
    assert len(lines) == 1 and errors(index, A) == {"refused_group_idx": 100}


def test_ingest_errors_are_exported_per_replica_and_reason() -> None:
    index = make()
    index.apply_events(A, [stored([1], group=-1), stored([2], block_size=-3)])
    snapshot = [
        {"pool": "p", "entries": 0, "bytes": 0, "replica_stats": index.stats(), "stream_stats": {}}
    ]
    text = RouterMetrics(lambda: snapshot).render().decode()
    head = 'kvrouter_ingest_errors_total{dp_rank="0",pool="p",'
    assert head + 'reason="refused_group_idx",replica="A"} 1.0' in text
    assert head + 'reason="refused_block_size",replica="A"} 1.0' in text
    assert 'replica="B"' not in text.split("kvrouter_ingest_errors_total")[-1]


LEARN3 = [("full_attention", 16), ("sliding_window", 16)]


def hybrid_batch(base: int) -> list:
    return [stored([base, base + 1]), stored([base + 1], group=1, kind="sliding_window")]


def test_one_replicas_stray_group_does_not_unresolve_the_learned_layout() -> None:
    """With groups learned from events, a store at group_idx 3 (a gap) used to unresolve the
    pool's layout, and every replica then predicted 0 while still trusted."""
    index = make(layout=LEARN)
    index.apply_events(A, hybrid_batch(100))
    before = index.layout
    assert before is not None and [g.kind for g in before.layout.groups] == [k for k, _ in LEARN3]
    index.apply_events(B, [*hybrid_batch(200), stored([9], group=3)])
    assert index.layout is before, "the pool's layout stays the source replica's"
    assert trusted(index, A) and trusted(index, B), "running ahead is not a contradiction"
    assert present(index, B, 0, 200) and present(index, B, 3, 9)


def test_a_replica_contradicting_the_learned_layout_is_held_alone() -> None:
    """Two views, one each: contested, the other replica's layout and predictions stay; a
    third replica agreeing with it makes a majority, and the odd one is outvoted."""
    index = make(layout=LEARN)
    index.apply_events(A, hybrid_batch(100))
    before = index.layout
    index.apply_events(
        B, [stored([1], group=1, kind="sliding_window", kv_cache_spec_sliding_window=8)]
    )
    assert not trusted(index, B) and "sliding_window" in (index.untrusted_reason(B) or "")
    assert "layout contested" in (index.untrusted_reason(B) or "")
    assert errors(index, B) == {"layout_contested": 1}
    index.apply_events(B, [stored([2], block_size=32)])  # a bigger block than A showed in full
    assert index.layout is before and trusted(index, A)
    C = index.add_replica("C")
    index.apply_events(C, hybrid_batch(300))
    assert index.layout is before and trusted(index, A) and trusted(index, C)
    assert "layout outvoted" in (index.untrusted_reason(B) or "")
    assert errors(index, B) == {"layout_contested": 1, "layout_conflict": 1}


def test_the_source_replica_extends_the_learned_layout() -> None:
    """The first replica's first store can be partial and its window group can come later."""
    index = make(layout=LEARN)
    index.apply_events(A, [stored([1], block_size=8)])
    assert index.layout is not None and index.layout.layout.groups[0].block_size == 8
    index.apply_events(A, hybrid_batch(100))
    groups = index.layout.layout.groups
    assert [(g.kind, g.block_size) for g in groups] == LEARN3 and trusted(index, A)


def test_unreadable_token_ids_in_a_root_store_are_a_bad_frame_not_bad_settings() -> None:
    """Token ids decode lazily (only when the conformance check re-hashes a root store); bad
    ones there used to read as 'hash settings unusable', a distrust no reset could lift."""
    from events.schema import KVEventBatch, decode_batch, encode_batch

    bad = stored([1, 2])
    bad.token_ids = ["not", "ints"]  # type: ignore[assignment]  # what a broken producer sends
    batch = decode_batch(encode_batch(KVEventBatch(0.0, [bad])), lazy_token_ids=True)
    index = make(verify_hashes=True)
    index.apply_events(A, batch.events)
    assert errors(index, A) == {"refused_token_ids": 1} and index.trust(A) == "untrusted"
    index.apply_events(A, [AllBlocksCleared()])
    assert index.trust(A) == "exact", "a clear lifts it: it was a bad frame, not bad settings"


def test_a_confirmed_layout_does_not_grow_by_the_source_alone() -> None:
    """The source replica (the first to publish) going bad: once another replica's view has
    confirmed the learned layout, one stray group from the source used to make the pool three
    groups, and every other replica then predicted 0 while still trusted. Now its view is one
    of two (contested): the layout stays, and the source alone stops predicting."""
    index = make(layout=LEARN)
    index.apply_events(A, hybrid_batch(100))  # A is the source
    before = index.layout
    index.apply_events(B, hybrid_batch(200))  # B confirms
    assert index.layout is before and index.layout_state().status == "confirmed"
    index.apply_events(A, [stored([7], group=2)])
    assert index.layout is before, "the confirmed layout stays"
    assert not trusted(index, A) and "group count" in (index.untrusted_reason(A) or "")
    assert errors(index, A) == {"layout_contested": 1}
    assert index.layout_state().status == "contested"
    assert trusted(index, B) and present(index, B, 0, 200)


def test_an_unconfirmed_source_still_extends_its_layout() -> None:
    """Alone (no other view yet), the source may still show a group later (a partial first
    store): the rule above only freezes a layout another replica has confirmed."""
    index = make(layout=LEARN)
    index.apply_events(A, [stored([1])])
    assert index.layout is not None and len(index.layout.layout.groups) == 1
    index.apply_events(A, hybrid_batch(100))
    assert len(index.layout.layout.groups) == 2 and trusted(index, A)
