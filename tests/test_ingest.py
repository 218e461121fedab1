"""publisher -> subscriber -> index -> prediction over real ZeroMQ sockets on 127.0.0.1."""

from __future__ import annotations

import pytest
from zmq_helpers import LossyForwarder, wait_for

from events.hashing import BlockHasher
from events.layout import GroupKind, GroupSpec, ModelLayout
from events.publisher import EventPublisher
from events.schema import BlockRemoved, BlockStored, DecodedBatch
from events.stream import GapUnrecoverable, MalformedMessage, RankMismatch, StreamBatch, StreamSpec
from events.subscriber import Subscriber
from router.core.index import KVIndex
from router.core.predict import Predictor
from router.server.ingest import IndexFeeder, UnknownStream

LAYOUT = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=64),
    )
)
LOOPBACK = "tcp://127.0.0.1:*"


def prompt_events(tokens: list[int]) -> list[BlockStored]:
    """What vLLM stores for a fresh prompt: FA dense, SWA the 4 blocks before its boundary."""
    wire = BlockHasher(LAYOUT.hash, 16).wire_chain(tokens)
    boundary = (len(tokens) - 1) // 16
    common = dict(parent_block_hash=None, lora_id=None, medium="GPU", lora_name=None)
    fa = BlockStored(
        block_hashes=wire,
        token_ids=tokens,
        block_size=16,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        **common,
    )
    swa = BlockStored(
        block_hashes=wire[boundary - 4 : boundary],
        token_ids=tokens,
        block_size=16,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
        **common,
    )
    return [fa, swa]


def test_events_over_zmq_drive_exact_predictions() -> None:
    tokens = list(range(1000, 1200))  # 200 tokens: FA blocks 0..11, SWA tail 8..11
    index = KVIndex(LAYOUT)
    feeder = IndexFeeder(index, {"a": ("A", 0), "b": ("B", 0)})
    predictor = Predictor(index)
    with (
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub_a,
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub_b,
    ):
        specs = [
            StreamSpec(
                "a",
                pub_a.endpoint,
                pub_a.replay_endpoint,
                replay_from_start=True,
                lazy_token_ids=True,
            ),
            StreamSpec("b", pub_b.endpoint, pub_b.replay_endpoint, replay_from_start=True),
        ]
        with Subscriber(specs, on_item=feeder):
            pub_a.publish(prompt_events(tokens))
            # Slow joiner: keep A's stream alive until its first batch was replayed in. Poll the
            # index, not the stream counters: they count a batch before its poll round hands
            # the items to the feeder.
            wait_for(
                lambda: (
                    pub_a.publish([]) is not None
                    and predictor.predict(tokens).hit(("A", 0)).hit_tokens > 0
                ),
                what="A's store applied",
            )
            pred = predictor.predict(tokens)
            assert pred.hit(("A", 0)).hit_tokens == 192  # spec §4.8 example 1
            assert pred.hit(("B", 0)).hit_tokens == 0
            # A sliding-window eviction limits the hit although every FA block remains.
            wire = BlockHasher(LAYOUT.hash, 16).wire_chain(tokens)
            pub_a.publish([BlockRemoved(block_hashes=[wire[9]], medium="GPU", group_idx=1)])
            wait_for(
                lambda: any(s.replica == "A" and s.removed_blocks for s in index.stats()),
                what="A's removal applied",
            )
            pred = predictor.predict(tokens)
            assert pred.hit(("A", 0)).hit_tokens == 0
            assert predictor.predict(tokens, blind=True).hit(("A", 0)).blind_hit_tokens == 192


def test_signals_map_to_trust_changes() -> None:
    index = KVIndex(LAYOUT)
    feeder = IndexFeeder(index, {"a": ("A", 0)})
    batch = DecodedBatch(0.0, prompt_events(list(range(64))), 0)
    feeder(StreamBatch("a", 0, batch, False, 0.0))
    assert index.stats()[0].blocks > 0
    feeder(GapUnrecoverable("a", 1, 5, "ring_overflow"))
    # a mid-stream gap: state dropped, then partial (what follows is known), not untrusted
    assert index.trust(("A", 0)) == "partial"
    assert "1..4" in index.partial_reason(("A", 0))
    assert index.stats()[0].blocks == 0
    index.reset_replica(("A", 0))
    assert index.trust(("A", 0)) == "exact"
    feeder(MalformedMessage("a", 7, "bad msgpack"))
    assert "batch 7" in index.untrusted_reason(("A", 0))
    index.reset_replica(("A", 0))
    feeder(RankMismatch("a", 8, 0, 1))
    assert "DP rank 1" in index.untrusted_reason(("A", 0))
    with pytest.raises(UnknownStream, match="streams mapping"):
        feeder(StreamBatch("zz", 0, batch, False, 0.0))


def test_a_gap_the_ring_cannot_cover_makes_the_replica_partial() -> None:
    """Real sockets: A's batches k+1..k+3 are lost on the way and its ring (2 batches) holds
    only k+3 and k+4 when the gap is seen. Lost removals could leave stale keys, so A's
    state is dropped; everything after the gap is applied and A stays routed on as *partial*
    (a lower bound), not untrusted; B is untouched."""
    x, y, z = (list(range(base, base + 200)) for base in (1000, 5000, 9000))
    index = KVIndex(LAYOUT)
    feeder = IndexFeeder(index, {"a": ("A", 0), "b": ("B", 0)})
    predictor = Predictor(index)
    wire_x = BlockHasher(LAYOUT.hash, 16).wire_chain(x)
    with (
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=2) as pub_a,
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub_b,
        LossyForwarder(pub_a.endpoint) as fwd,
    ):
        specs = [
            StreamSpec("a", fwd.endpoint, pub_a.replay_endpoint),
            StreamSpec("b", pub_b.endpoint, pub_b.replay_endpoint),
        ]
        with Subscriber(specs, on_item=feeder) as sub:
            # Slow joiner: a batch published before the SUB is connected is never seen (and
            # A's ring is short), so each poll publishes the stores again until both applied.
            wait_for(
                lambda: (
                    pub_a.publish(prompt_events(x)) is not None
                    and pub_b.publish(prompt_events(x)) is not None
                    and predictor.predict(x).hit(("A", 0)).hit_tokens == 192
                    and predictor.predict(x).hit(("B", 0)).hit_tokens == 192
                ),
                what="both replicas' stores applied",
            )
            k = pub_a.next_seq - 1
            wait_for(lambda: feeder.applied.get("a") == k, what="A caught up")
            fwd.drop |= {k + 1, k + 2, k + 3}  # the gap shows when k+4 arrives: ring k+3, k+4
            removal = BlockRemoved(block_hashes=[wire_x[9]], medium="GPU", group_idx=1)
            pub_a.publish([removal])  # lost: the index would keep a stale SWA block
            pub_a.publish(prompt_events(y))  # lost
            pub_a.publish([])  # k+3: lost on the way, replayed from the ring
            pub_a.publish(prompt_events(z))  # k+4: its arrival shows the gap
            wait_for(lambda: feeder.applied.get("a") == k + 4, what="A past the gap")
            assert sub.stats()["a"].unrecoverable_gaps == 1
    a = ("A", 0)
    assert index.trust(a) == "partial" and index.is_trusted(a)
    assert f"batches {k + 1}..{k + 2} lost (ring_overflow)" in index.partial_reason(a)
    (sa,) = [s for s in index.stats() if s.replica == "A"]
    assert sa.unrecoverable_gaps == 1 and sa.ingest_errors == {"lost_events": 1}
    pred = predictor.predict(z)
    assert pred.hit(a).hit_tokens == 192 and pred.hit(a).trust == "partial"  # after the gap
    assert predictor.predict(x).hit(a).hit_tokens == 0  # dropped: its removal was lost
    assert predictor.predict(y).hit(a).hit_tokens == 0  # unknown: a lower bound
    assert predictor.predict(x).hit(("B", 0)).hit_tokens == 192
    assert index.trust(("B", 0)) == "exact"
