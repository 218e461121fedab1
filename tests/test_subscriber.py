"""The subscriber: the pure sequencing rules (properties) and real-socket scenarios (spec §3).

Socket scenarios run twice, against the threaded :class:`Subscriber` (callback API) and the
asyncio :class:`AsyncSubscriber` (``async for``), through the harnesses of ``zmq_helpers``.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from events.publisher import EndpointError, EventPublisher
from events.schema import (
    AllBlocksCleared,
    BatchDecodeError,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    UnknownEvent,
    decode_batch,
    encode_batch,
)
from events.stream import (
    END_SEQ,
    GapUnrecoverable,
    MalformedMessage,
    RankMismatch,
    Sequencer,
    StreamBatch,
    StreamProcessor,
    StreamReset,
    StreamSpec,
    _Apply,
)
from events.subscriber import AsyncSubscriber, Subscriber, SubscriberError, dp_stream_specs
from tests.zmq_helpers import (
    HARNESSES,
    LOOPBACK,
    SEQ,
    GatedReplayProxy,
    Harness,
    LossyForwarder,
    RawPub,
    dp_publishers,
    last_endpoint,
    prime,
    publish_until,
    try_publisher,
    wait_for,
)

# ---------------------------------------------------------------------------------------
# Pure sequencer: a simulated publisher (runs, ring, drops, replay latency) as the oracle.
# ---------------------------------------------------------------------------------------


@dataclass
class Sim:
    ring_size: int
    can_replay: bool
    replay_from_start: bool = False
    applied: list[tuple[int, int, bool]] = field(default_factory=list)  # (run, seq, replayed)
    signals: list[Any] = field(default_factory=list)
    delivered_live: set[tuple[int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.seq = Sequencer(
            "s", can_replay=self.can_replay, replay_from_start=self.replay_from_start
        )

    def collect(self, out: list[Any]) -> None:
        for o in out:
            if isinstance(o, _Apply):
                run, seq = (int(x) for x in o.payload.decode().split(":"))
                assert seq == o.seq
                self.applied.append((run, seq, o.replayed))
            else:
                self.signals.append(o)
        out.clear()


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_sequencer_against_simulated_publisher(data: st.DataObject) -> None:
    runs = data.draw(st.lists(st.integers(1, 25), min_size=1, max_size=3), label="runs")
    ring_size = data.draw(st.integers(0, 30), label="ring")
    can_replay = data.draw(st.booleans(), label="can_replay")
    from_start = data.draw(st.booleans(), label="replay_from_start")
    sim = Sim(ring_size, can_replay, from_start)
    out: list[Any] = []
    pending: list[Any] = []  # [replies, remaining_live_before_answer, timed_out]
    sent_live: list[tuple[int, int]] = []

    def answer() -> None:
        replies, _, timed_out = pending.pop()
        nxt = None
        if timed_out:
            nxt = sim.seq.replay_failed("replay_timeout", out)
        else:
            for r_seq, payload in replies:
                sim.seq.replayed(r_seq, payload, 0.0, out)
            nxt = sim.seq.replay_done(out)
        sim.collect(out)
        if nxt is not None:
            request(nxt)

    def request(start: int) -> None:
        # The ring as it is when the request is served (same run).
        replies = [(s, p) for s, p in ring if s >= start]
        delay = data.draw(st.integers(0, 3), label="replay delay")
        timed_out = data.draw(st.integers(0, 9), label="timeout?") == 0
        pending.append([replies, delay, timed_out])
        if delay == 0:
            answer()

    for run, length in enumerate(runs):
        ring: list[tuple[int, bytes]] = []
        for s in range(length):
            payload = f"{run}:{s}".encode()
            ring.append((s, payload))
            if ring_size == 0:
                ring.clear()
            del ring[: max(0, len(ring) - ring_size)]
            if data.draw(st.integers(0, 3), label="drop?") == 0:
                continue
            sent_live.append((run, s))
            start = sim.seq.live(s, payload, 0.0, out)
            sim.collect(out)
            if start is not None:
                assert can_replay, "a replay was asked for without a replay endpoint"
                request(start)
            elif pending:
                pending[-1][1] -= 1
                if pending[-1][1] <= 0:
                    answer()
        while pending:  # the run ends: outstanding replies arrive
            answer()
    while pending:
        answer()
    assert not sim.seq.replaying

    applied = [(r, s) for r, s, _ in sim.applied]
    # Nothing twice, and every live message that arrived is applied.
    assert len(applied) == len(set(applied))
    assert set(sent_live) <= set(applied)
    # Order: by run, then by seq.
    assert applied == sorted(applied)
    # Replayed batches only when a replay endpoint exists.
    if not can_replay:
        assert not any(rep for _, _, rep in sim.applied)
    # Every hole inside what a run delivered is declared by a GapUnrecoverable.
    gaps = [g for g in sim.signals if isinstance(g, GapUnrecoverable)]
    for run in range(len(runs)):
        seqs = sorted(s for r, s in applied if r == run)
        if not seqs:
            continue
        for missing in set(range(seqs[0], seqs[-1] + 1)) - set(seqs):
            assert any(g.expected <= missing < g.got for g in gaps), (run, missing)
    resets = [r for r in sim.signals if isinstance(r, StreamReset)]
    assert len(resets) <= len(runs) - 1
    for r in resets:
        assert r.got < r.expected


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(2, 40),
    drops=st.sets(st.integers(0, 39)),
    delays=st.lists(st.integers(0, 4), min_size=40, max_size=40),
    from_start=st.booleans(),
)
def test_sequencer_complete_when_ring_covers(
    length: int, drops: set[int], delays: list[int], from_start: bool
) -> None:
    """One run, a ring larger than the run, replies that always come: nothing is lost."""
    seqr = Sequencer("s", can_replay=True, replay_from_start=from_start)
    out: list[Any] = []
    applied: list[int] = []
    sent: list[int] = []
    waiting: list[tuple[int, int]] = []  # (start, live messages before the answer)

    def flush_answer() -> None:
        start, _ = waiting.pop()
        for s in range(start, len(sent_all)):
            seqr.replayed(s, b"%d" % s, 0.0, out)
        nxt = seqr.replay_done(out)
        if nxt is not None:
            waiting.append((nxt, delays[nxt % 40]))

    sent_all: list[int] = []
    for s in range(length):
        sent_all.append(s)
        if s in drops and s != length - 1:  # the last one arrives, so the tail is known
            continue
        sent.append(s)
        nxt = seqr.live(s, b"%d" % s, 0.0, out)
        if nxt is not None:
            waiting.append((nxt, delays[s]))
        elif waiting:
            start, left = waiting[-1]
            waiting[-1] = (start, left - 1)
        while waiting and waiting[-1][1] <= 0:
            flush_answer()
    while waiting:
        flush_answer()
    for o in out:
        if isinstance(o, _Apply):
            applied.append(o.seq)
        else:
            raise AssertionError(f"unexpected signal {o}")
    first = 0 if from_start else sent[0]
    assert applied == list(range(first, length))


def test_sequencer_basic_rules() -> None:
    out: list[Any] = []
    s = Sequencer("a", can_replay=False)
    assert s.live(7, b"7", 0.0, out) is None  # first message accepted whatever its number
    assert s.live(8, b"8", 0.0, out) is None
    assert s.live(11, b"11", 0.0, out) is None  # hole, no replay endpoint
    assert s.live(3, b"3", 0.0, out) is None  # backwards: restart
    kinds = [(type(o).__name__, getattr(o, "seq", None)) for o in out]
    assert kinds == [
        ("_Apply", 7),
        ("_Apply", 8),
        ("GapUnrecoverable", None),
        ("_Apply", 11),
        ("StreamReset", None),
        ("GapUnrecoverable", None),  # 0..2 of the new run are lost too
        ("_Apply", 3),
    ]
    assert out[2] == GapUnrecoverable("a", 9, 11, "no_replay_endpoint")
    assert out[4] == StreamReset("a", 12, 3)
    assert out[5] == GapUnrecoverable("a", 0, 3, "no_replay_endpoint")


def test_sequencer_holds_live_messages_during_replay() -> None:
    out: list[Any] = []
    s = Sequencer("a", can_replay=True)
    s.live(0, b"0", 0.0, out)
    assert s.live(3, b"3", 0.0, out) == 1
    assert s.replaying
    for n in (4, 5):
        assert s.live(n, str(n).encode(), 0.0, out) is None
    assert s.held == 3 and [o.seq for o in out] == [0]
    for n in range(1, 6):  # the ring also returns what is held: ignored
        s.replayed(n, str(n).encode(), 0.0, out)
    assert s.replay_done(out) is None
    assert [(o.seq, o.replayed) for o in out] == [
        (0, False),
        (1, True),
        (2, True),
        (3, False),
        (4, False),
        (5, False),
    ]


def test_sequencer_second_hole_among_held_messages() -> None:
    out: list[Any] = []
    s = Sequencer("a", can_replay=True)
    s.live(0, b"0", 0.0, out)
    assert s.live(2, b"2", 0.0, out) == 1
    s.live(5, b"5", 0.0, out)  # another hole, while the first replay runs
    s.replayed(1, b"1", 0.0, out)
    assert s.replay_done(out) == 3  # the held 5 asks for 3..4
    s.live(6, b"6", 0.0, out)
    s.replayed(3, b"3", 0.0, out)
    s.replayed(4, b"4", 0.0, out)
    assert s.replay_done(out) is None
    assert [o.seq for o in out] == [0, 1, 2, 3, 4, 5, 6]


def test_sequencer_ring_overflow_and_timeout() -> None:
    out: list[Any] = []
    s = Sequencer("a", can_replay=True)
    s.live(0, b"0", 0.0, out)
    assert s.live(10, b"10", 0.0, out) == 1
    for n in (7, 8, 9, 10):  # the ring starts at 7
        s.replayed(n, str(n).encode(), 0.0, out)
    s.replay_done(out)
    assert out[1] == GapUnrecoverable("a", 1, 7, "ring_overflow")
    assert [o.seq for o in out if isinstance(o, _Apply)] == [0, 7, 8, 9, 10]
    out.clear()
    assert s.live(13, b"13", 0.0, out) == 11
    assert s.replay_failed("replay_timeout", out) is None
    assert out[0] == GapUnrecoverable("a", 11, 13, "replay_timeout")
    assert out[1].seq == 13


# ---------------------------------------------------------------------------------------
# Processor: frames in, items and counters out.
# ---------------------------------------------------------------------------------------


def payload(rank: int | None = 0, n: int = 1, ts: float = 1.0) -> bytes:
    return encode_batch(KVEventBatch(ts, [BlockRemoved(block_hashes=[i]) for i in range(n)], rank))


def test_processor_counts_everything() -> None:
    p = StreamProcessor(StreamSpec("a", "tcp://h:1", dp_rank=0))
    out: list[Any] = []
    p.on_live([b"", SEQ.pack(0), payload(n=3)], 5.0, out)
    p.on_live([b"", SEQ.pack(1), payload(rank=1)], 5.0, out)
    p.on_live([b"", SEQ.pack(2), b"\xc1"], 5.0, out)
    p.on_live([b"", b"123", b""], 5.0, out)
    p.on_live([b"only one"], 5.0, out)
    mixed = encode_batch(KVEventBatch(1.0, [AllBlocksCleared()], None))
    mixed = mixed[:-1] + b"\xc0"  # rank nil: accepted unchecked
    p.on_live([b"", SEQ.pack(3), mixed], 5.0, out)
    assert [type(i).__name__ for i in out] == [
        "StreamBatch",
        "RankMismatch",
        "MalformedMessage",
        "MalformedMessage",
        "MalformedMessage",
        "StreamBatch",
    ]
    assert out[1] == RankMismatch("a", 1, 0, 1)
    assert out[2].seq == 2 and out[3].seq is None and "3 frames" in out[4].reason
    st_ = p.stats
    assert (st_.batches, st_.events, st_.rank_mismatches, st_.malformed) == (2, 4, 1, 3)
    assert st_.events_by_type == {"BlockRemoved": 3, "AllBlocksCleared": 1}
    assert st_.last_seq == 3 and st_.lag_s == pytest.approx(4.0) and st_.gaps == 0


def test_processor_turns_any_decode_exception_into_malformed() -> None:
    """Whatever decoding raises (not only BatchDecodeError) costs one counted message."""

    def decode(raw: bytes) -> Any:
        if raw.startswith(b"boom"):
            raise UnicodeDecodeError("utf-8", raw, 0, 1, "invalid start byte")
        if raw.startswith(b"bug"):
            raise RuntimeError("a decoder bug")
        return decode_batch(raw)

    p = StreamProcessor(StreamSpec("a", "tcp://h:1"), decode=decode)
    out: list[Any] = []
    p.on_live([b"", SEQ.pack(0), payload()], 1.0, out)
    p.on_live([b"", SEQ.pack(1), b"boom"], 1.0, out)
    p.on_live([b"", SEQ.pack(2), b"bug"], 1.0, out)
    non_utf8 = encode_batch(KVEventBatch(1.0, [removed(7), removed(8)], 0))
    non_utf8 = non_utf8.replace(b"GPU", b"\xff\xfeU", 1)
    p.on_live([b"", SEQ.pack(3), non_utf8], 1.0, out)
    assert [type(i).__name__ for i in out] == [
        "StreamBatch",
        "MalformedMessage",
        "MalformedMessage",
        "StreamBatch",
    ]
    assert out[1].seq == 1 and "UnicodeDecodeError" in out[1].reason
    assert out[2].seq == 2 and "RuntimeError" in out[2].reason
    assert out[3].batch.unknown == 1 and out[3].batch.events[1] == removed(8)
    st_ = p.stats
    assert (st_.malformed, st_.batches, st_.unknown_events, st_.last_seq) == (2, 2, 1, 3)
    assert st_.gaps == 0


def valid_events(rng: random.Random) -> list[Any]:
    evs: list[Any] = []
    for _ in range(rng.randint(0, 4)):
        k = rng.random()
        if k < 0.4:
            evs.append(BlockRemoved(block_hashes=[rng.getrandbits(64)], medium="GPU", group_idx=0))
        elif k < 0.8:
            n = rng.randint(0, 3)
            evs.append(
                BlockStored(
                    block_hashes=[rng.getrandbits(64) for _ in range(n)],
                    token_ids=[rng.randint(0, 50000) for _ in range(4 * n)],
                    block_size=4,
                    medium="GPU",
                    group_idx=rng.randint(0, 2),
                )
            )
        else:
            evs.append(AllBlocksCleared())
    return evs


def bad_payload(rng: random.Random) -> bytes:
    """Bytes that are not a KV-event batch, checked with decode_batch itself."""
    while True:
        kind = rng.randrange(5)
        good = encode_batch(KVEventBatch(1.0, valid_events(rng) or [AllBlocksCleared()], 0))
        if kind == 0:
            raw = good[: rng.randrange(len(good))]
        elif kind == 1:
            raw = rng.randbytes(rng.randint(0, 40))
        elif kind == 2:
            raw = msgspec.msgpack.encode(rng.choice(["str", {"ts": 1}, 5, None, [1.0], []]))
        elif kind == 3:
            raw = msgspec.msgpack.encode(["not a float", [], 0])
        else:
            raw = msgspec.msgpack.encode([1.0, {"events": 1}, "rank"])
        try:
            decode_batch(raw)
        except BatchDecodeError:
            return raw


def fuzz_messages(rng: random.Random, start: int, n: int) -> tuple[list[list[bytes]], list[Any]]:
    """``n`` messages from seq ``start`` on: valid ones, bad frames (no seq consumed) and bad
    payloads (seq consumed). Returns the frames and the expected outcome of each."""
    msgs: list[list[bytes]] = []
    expect: list[Any] = []
    seq = start
    for _ in range(n):
        r = rng.random()
        if r < 0.55:
            evs = valid_events(rng)
            if rng.random() < 0.1:  # an unknown event inside a valid batch
                raw = encode_batch(KVEventBatch(1.0, evs, 0))
                evs_raw = msgspec.msgpack.decode(raw)
                evs_raw[1].append({"type": "FutureEvent", "x": 1})
                body = msgspec.msgpack.encode(evs_raw)
                expect.append(("ok", seq, len(evs) + 1, 1))
            else:
                body = encode_batch(KVEventBatch(1.0, evs, 0), legacy=rng.random() < 0.3)
                expect.append(("ok", seq, len(evs), 0))
            msgs.append([b"", SEQ.pack(seq), body])
            seq += 1
        elif r < 0.7:
            count = rng.choice([0, 1, 2, 4, 5])
            msgs.append([rng.randbytes(rng.randint(0, 9)) for _ in range(count)] or [b""])
            expect.append(("bad", None))
        elif r < 0.8:
            bad_len = rng.choice([0, 1, 4, 7, 9, 16])
            msgs.append([b"", rng.randbytes(bad_len), payload()])
            expect.append(("bad", None))
        else:
            msgs.append([b"", SEQ.pack(seq), bad_payload(rng)])
            expect.append(("bad", seq))
            seq += 1
    return msgs, expect


def check_fuzz(items: list[Any], expect: list[Any], stream: str) -> None:
    items = [i for i in items if i.stream == stream]
    assert len(items) == len(expect)
    for item, exp in zip(items, expect, strict=True):
        if exp[0] == "ok":
            assert type(item) is StreamBatch, item
            assert item.seq == exp[1] and not item.replayed
            assert len(item.batch.events) == exp[2] and item.batch.unknown == exp[3]
        else:
            assert type(item) is MalformedMessage, item
            assert item.seq == exp[1]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_processor_fuzz(seed: int) -> None:
    rng = random.Random(seed)
    p = StreamProcessor(StreamSpec("a", "tcp://h:1", replay_endpoint="tcp://h:2"))
    out: list[Any] = []
    p.on_live([b"", SEQ.pack(100), payload()], 1.0, out)
    msgs, expect = fuzz_messages(rng, 101, 60)
    for m in msgs:
        assert p.on_live(m, 1.0, out) is None  # never a gap, never a replay
    check_fuzz(out[1:], expect, "a")
    bad = sum(1 for e in expect if e[0] == "bad")
    assert p.stats.malformed == bad
    assert p.stats.unknown_events == sum(e[3] for e in expect if e[0] == "ok")


def test_processor_malformed_replay_frames() -> None:
    p = StreamProcessor(StreamSpec("a", "tcp://h:1", replay_endpoint="tcp://h:2"))
    out: list[Any] = []
    p.on_live([b"", SEQ.pack(0), payload()], 1.0, out)
    assert p.on_live([b"", SEQ.pack(2), payload()], 1.0, out) == 1
    assert p.on_replay([b"", b"", b"short", b""], 1.0, out) is None
    assert p.on_replay([b"x", b"", SEQ.pack(1), payload()], 1.0, out) is None
    assert p.on_replay([b""], 1.0, out) is None
    assert p.replaying and p.stats.malformed == 3
    p.on_replay([b"", b"", SEQ.pack(1), payload()], 1.0, out)
    p.on_replay([b"", b"", SEQ.pack(END_SEQ), b""], 1.0, out)
    assert not p.replaying
    assert [(i.seq, i.replayed) for i in out if type(i) is StreamBatch] == [
        (0, False),
        (1, True),
        (2, False),
    ]


# ---------------------------------------------------------------------------------------
# Real sockets, sync and asyncio.
# ---------------------------------------------------------------------------------------

modes = pytest.mark.parametrize("mode", ["sync", "async"])


def removed(i: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[i], medium="GPU", group_idx=0)


def make(mode: str, specs: list[StreamSpec], **kw: Any) -> Harness:
    return HARNESSES[mode](specs, **kw)


@modes
def test_in_order_delivery_and_stats(mode: str) -> None:
    with EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub:
        spec = StreamSpec("a", pub.endpoint, pub.replay_endpoint, dp_rank=0)
        with make(mode, [spec]) as h:
            first = prime(lambda: pub.publish([removed(0)]), h)
            for i in range(50):
                pub.publish([removed(i), AllBlocksCleared()])
            h.wait_seq(first + 50)
            seqs = h.seqs()
            assert seqs == list(range(seqs[0], first + 51))
            assert not h.signals()
            st_ = h.stats()["a"]
            assert st_.batches == len(seqs) and st_.last_seq == first + 50
            assert st_.events_by_type["AllBlocksCleared"] == 50
            assert st_.gaps == st_.replays == st_.malformed == 0
            assert st_.lag_s is not None and 0 <= st_.lag_s < 10


@modes
def test_gap_is_repaired_by_replay(mode: str) -> None:
    with (
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub,
        LossyForwarder(pub.endpoint) as fwd,
    ):
        spec = StreamSpec("a", fwd.endpoint, pub.replay_endpoint)
        with make(mode, [spec]) as h:
            k = prime(lambda: pub.publish([removed(0)]), h)
            fwd.drop |= {k + 2, k + 3, k + 5}
            for i in range(1, 8):
                pub.publish([removed(k + i)])
            h.wait_seq(k + 7)
            got = [(b.seq, b.replayed) for b in h.batches() if b.seq > k]
            assert got == [(k + i, k + i in fwd.drop) for i in range(1, 8)]
            assert [b.batch.events[0].block_hashes[0] for b in h.batches() if b.seq > k] == [
                k + i for i in range(1, 8)
            ]
            st_ = h.stats()["a"]
            assert st_.gaps == 2 and st_.replays == 2 and st_.replayed_batches == 3
            assert st_.unrecoverable_gaps == 0 and not st_.replaying
            assert sorted(fwd.dropped) == sorted(fwd.drop)
            assert not h.signals()


@modes
def test_live_messages_during_replay_are_held(mode: str) -> None:
    with (
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub,
        LossyForwarder(pub.endpoint) as fwd,
        GatedReplayProxy(pub.replay_endpoint) as proxy,
    ):
        spec = StreamSpec("a", fwd.endpoint, proxy.endpoint)
        with make(mode, [spec]) as h:
            k = prime(lambda: pub.publish([removed(0)]), h)
            fwd.drop.add(k + 2)
            for i in range(1, 4):
                pub.publish([removed(k + i)])
            wait_for(lambda: proxy.requests == [k + 2], what="the replay request")
            for i in range(4, 9):
                pub.publish([removed(k + i)])
            # k+3 (the trigger) and k+4..k+8 wait behind the replay.
            wait_for(lambda: h.stats()["a"].held == 5, what="held live messages")
            assert h.seqs()[-1] == k + 1
            proxy.gate.set()
            h.wait_seq(k + 8)
            got = [(b.seq, b.replayed) for b in h.batches() if b.seq > k]
            assert got == [(k + i, i == 2) for i in range(1, 9)]
            st_ = h.stats()["a"]
            # the ring also sends k+3..k+8, but the replay ends at the batch it needed: the
            # held live messages go on at once and the rest of the answer is not read
            assert st_.ignored_replayed == 0
            assert st_.replayed_batches == 1 and not st_.replaying
            assert not h.signals()


@modes
def test_ring_overflow_is_unrecoverable(mode: str) -> None:
    with (
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=3) as pub,
        LossyForwarder(pub.endpoint) as fwd,
    ):
        spec = StreamSpec("a", fwd.endpoint, pub.replay_endpoint)
        with make(mode, [spec]) as h:
            k = prime(lambda: pub.publish([removed(0)]), h)
            fwd.drop |= set(range(k + 1, k + 6))
            for i in range(1, 7):
                pub.publish([removed(k + i)])
            h.wait_seq(k + 6)
            # The ring holds k+4..k+6 when asked from k+1.
            assert h.signals() == [GapUnrecoverable("a", k + 1, k + 4, "ring_overflow")]
            got = [(b.seq, b.replayed) for b in h.batches() if b.seq > k]
            assert got == [(k + 4, True), (k + 5, True), (k + 6, False)]
            st_ = h.stats()["a"]
            assert st_.unrecoverable_gaps == 1 and st_.lost_batches == 3


@modes
def test_no_replay_endpoint_is_unrecoverable(mode: str) -> None:
    with (
        EventPublisher(LOOPBACK) as pub,
        LossyForwarder(pub.endpoint) as fwd,
        make(mode, [StreamSpec("a", fwd.endpoint)]) as h,
    ):
        k = prime(lambda: pub.publish([removed(0)]), h)
        fwd.drop.add(k + 1)
        pub.publish([removed(1)])
        pub.publish([removed(2)])
        h.wait_seq(k + 2)
        assert h.signals() == [GapUnrecoverable("a", k + 1, k + 2, "no_replay_endpoint")]
        assert h.seqs()[-1] == k + 2 and (k + 1) not in h.seqs()
        st_ = h.stats()["a"]
        assert st_.gaps == 1 and st_.replays == 0 and st_.unrecoverable_gaps == 1


@modes
def test_replay_timeout_is_unrecoverable(mode: str) -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts requests, never answers
    silent.bind(LOOPBACK)
    try:
        with EventPublisher(LOOPBACK) as pub, LossyForwarder(pub.endpoint) as fwd:
            spec = StreamSpec("a", fwd.endpoint, last_endpoint(silent))
            with make(mode, [spec], replay_timeout=0.3) as h:
                k = prime(lambda: pub.publish([removed(0)]), h)
                fwd.drop.add(k + 1)
                pub.publish([removed(1)])
                pub.publish([removed(2)])
                h.wait_seq(k + 2)
                assert h.signals() == [GapUnrecoverable("a", k + 1, k + 2, "replay_timeout")]
                assert silent.poll(1000)
                assert silent.recv_multipart()[1:] == [b"", SEQ.pack(k + 1)]
    finally:
        silent.close(0)


class StaleReplayEndpoint(threading.Thread):
    """A replay endpoint that answers every request with batch ``seq`` every ``tick`` seconds
    and never the end marker (the pace is the scenario, not a synchronisation). With
    ``step = 0`` the same batch, one the subscriber has already applied: well-formed replies
    that bring nothing; with ``step = 1`` a ring that never ends, each batch the next one."""

    def __init__(self, seq: int, tick: float, step: int = 0) -> None:
        super().__init__(daemon=True)
        self.seq, self.tick, self.step = seq, tick, step
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(LOOPBACK)
        self.endpoint = last_endpoint(self.sock)
        self.stop = threading.Event()
        self.sent = 0

    def run(self) -> None:
        payload = encode_batch(KVEventBatch(ts=1.0, events=[removed(0)]))
        idents: list[bytes] = []
        try:
            while not self.stop.is_set():
                while self.sock.poll(0):
                    idents.append(self.sock.recv_multipart()[0])
                for ident in idents:
                    self.sock.send_multipart([ident, b"", b"", SEQ.pack(self.seq), payload])
                    self.sent += 1
                    self.seq += self.step
                self.stop.wait(self.tick)
        finally:
            self.sock.close(0)

    def __enter__(self) -> StaleReplayEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(5)


@modes
def test_a_replay_that_only_repeats_what_was_applied_times_out(mode: str) -> None:
    """Replies that bring no needed batch do not push the idle deadline: a replay endpoint
    repeating an old batch four times per timeout, forever, would otherwise hold the live
    messages behind the hole (and the index's view of the replica) for as long as it runs."""
    timeout = 0.3
    with EventPublisher(LOOPBACK) as pub, LossyForwarder(pub.endpoint) as fwd:
        k = None
        with StaleReplayEndpoint(0, timeout / 4) as stale:
            spec = StreamSpec("a", fwd.endpoint, stale.endpoint)
            with make(mode, [spec], replay_timeout=timeout) as h:
                k = prime(lambda: pub.publish([removed(0)]), h)
                stale.seq = k  # applied already
                fwd.drop.add(k + 1)
                pub.publish([removed(1)])
                pub.publish([removed(2)])
                h.wait_seq(k + 2, timeout=10)
                assert h.signals() == [GapUnrecoverable("a", k + 1, k + 2, "replay_timeout")]
                assert stale.sent > 0  # it did keep answering
                assert h.stats()["a"].ignored_replayed > 0


@modes
def test_an_attach_replay_that_never_ends_stops_at_the_live_stream(mode: str) -> None:
    """An attach replay (``replay_from_start``) hands over to the live messages it held back
    once it reaches the first of them: a ring that never sends its end marker cannot hold
    them (and their memory) for good."""
    with EventPublisher(LOOPBACK) as pub:
        for i in range(30):  # before anyone listens: the ring's part
            pub.publish([removed(i)])
        with StaleReplayEndpoint(0, 0.02, step=1) as ring:
            spec = StreamSpec("a", pub.endpoint, ring.endpoint, replay_from_start=True)
            with make(mode, [spec], replay_timeout=5.0) as h:
                # live batches keep coming (held while the replay runs) until one is applied
                publish_until(
                    lambda: pub.publish([removed(0)]),
                    lambda: any(not b.replayed for b in h.batches()),
                )
                last = pub.publish([removed(0)])
                h.wait_seq(last, timeout=20)
                sent = ring.sent
                seqs = h.seqs()
                assert seqs == list(range(last + 1)), seqs  # ring then live, no gap
                assert not h.stats()["a"].replaying
                assert not h.signals()
                wait_for(lambda: ring.sent > sent + 5, what="the ring still sending")
                assert h.seqs() == seqs  # and nothing of it is read any more


@modes
def test_publisher_restart_gives_stream_reset(mode: str) -> None:
    pub = EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    ep, rep = pub.endpoint, pub.replay_endpoint
    spec = StreamSpec("a", ep, rep)
    try:
        with make(mode, [spec]) as h:
            prime(lambda: pub.publish([removed(0)]), h)
            for i in range(200):
                last_old = pub.publish([removed(i)])
            h.wait_seq(last_old)
            pub.close()
            # The old listener is released asynchronously by libzmq: retry the bind.
            pub = wait_for(lambda: try_publisher(ep, replay_endpoint=rep, bind=True))
            publish_until(
                lambda: pub.publish([removed(1)]),
                lambda: any(type(s) is StreamReset for s in h.signals()),
            )
            last_new = pub.publish([removed(2)])
            reset = next(s for s in h.signals() if type(s) is StreamReset)
            assert reset.expected == last_old + 1 and reset.got < reset.expected
            # After the reset, the new run is delivered from 0, the missed start replayed.
            wait_for(lambda: h.stats()["a"].last_seq == last_new, what="new run caught up")
            items = h.items
            after = items[items.index(reset) + 1 :]
            assert [b.seq for b in after] == list(range(last_new + 1))
            assert all(b.replayed == (b.seq < reset.got) for b in after)
            assert h.stats()["a"].resets == 1
            assert [s for s in h.signals() if type(s) is not StreamReset] == []
    finally:
        pub.close()


@modes
def test_rank_mismatch_is_reported_and_dropped(mode: str) -> None:
    with (
        EventPublisher(LOOPBACK, data_parallel_rank=1) as pub,
        make(mode, [StreamSpec("a", pub.endpoint, dp_rank=0)]) as h,
    ):
        publish_until(lambda: pub.publish([removed(0)]), h.signals)
        last = pub.publish(KVEventBatch(1.0, [removed(1)], 0))  # right rank, explicit
        h.wait_seq(last)
        mism = h.signals()
        assert all(type(s) is RankMismatch and s.expected_rank == 0 for s in mism)
        assert {s.got_rank for s in mism} == {1}
        assert h.seqs() == [last]
        wait_for(lambda: h.stats()["a"].rank_mismatches == len(h.signals()))


@modes
def test_streams_are_isolated_from_malformed_neighbours(mode: str) -> None:
    with EventPublisher(LOOPBACK) as pub, RawPub() as raw:
        specs = [StreamSpec("good", pub.endpoint), StreamSpec("junk", raw.endpoint)]
        with make(mode, specs) as h:
            prime(lambda: pub.publish([removed(0)]), h, "good")
            n = iter(range(10**6))
            prime(lambda: (raw.send_batch(s := next(n), [removed(0)]), s)[1], h, "junk")
            seq = h.seqs("junk")[-1] + 1
            start = pub.next_seq
            for i in range(30):
                pub.publish([removed(i)])
                kind = i % 5
                if kind == 0:
                    raw.send([b"x"])
                elif kind == 1:
                    raw.send([b"", b"1234", payload()])
                elif kind == 2:
                    raw.send([b"a", b"b", b"c", b"d"])
                else:  # readable seq, broken payload: the seq is used up
                    raw.send([b"", SEQ.pack(seq), b"\xc1\xc1" if kind == 3 else b"\xa4nope"])
                    seq += 1
            raw.send_batch(seq, [removed(1)])
            h.wait_seq(start + 29, "good")
            h.wait_seq(seq, "junk")
            assert [s for s in h.seqs("good") if s >= start] == list(range(start, start + 30))
            assert h.signals("good") == []
            junk = h.signals("junk")
            assert len(junk) == 30 and all(type(s) is MalformedMessage for s in junk)
            stats = h.stats()
            assert stats["junk"].malformed == 30 and stats["good"].malformed == 0
            assert stats["junk"].gaps == 0


@modes
def test_fuzzed_frames_over_sockets(mode: str) -> None:
    rng = random.Random(20260512)
    with RawPub() as raw, make(mode, [StreamSpec("f", raw.endpoint, dp_rank=0)]) as h:
        n = iter(range(10**6))
        first = prime(lambda: (raw.send_batch(s := next(n), [removed(0)]), s)[1], h)
        msgs, expect = fuzz_messages(rng, first + 1, 400)
        before = len(h.items)
        for m in msgs:
            raw.send(m)
        total = before + len(expect)
        wait_for(lambda: len(h.items) >= total, what="every fuzz message handled")
        check_fuzz(h.items[before:], expect, "f")
        st_ = h.stats()["f"]
        assert st_.malformed == sum(1 for e in expect if e[0] == "bad")
        assert st_.unknown_events == sum(e[3] for e in expect if e[0] == "ok")
        assert st_.gaps == st_.resets == 0


@modes
def test_oversize_message_is_dropped_and_seen_as_a_gap(mode: str) -> None:
    """ZMQ_MAXMSGSIZE drops a frame over the bound before allocating it (and the connection
    with it); the stream sees the hole like any other, asks the ring, and reports it."""
    limit = 4096
    huge = BlockStored(block_hashes=[1], token_ids=list(range(10_000)), block_size=16)
    with EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub:
        spec = StreamSpec("a", pub.endpoint, pub.replay_endpoint)
        # a long idle deadline: the drop must be reported long before it
        with make(mode, [spec], max_message_bytes=limit, replay_timeout=60) as h:
            k = prime(lambda: pub.publish([removed(0)]), h)
            big = pub.publish([huge])
            assert big == k + 1 and len(encode_batch(KVEventBatch(1.0, [huge], 0))) > limit
            # The SUB reconnects (libzmq does it, ~100 ms): publish until a later batch comes.
            publish_until(lambda: pub.publish([removed(1)]), lambda: any(s > big for s in h.seqs()))
            last = pub.publish([removed(2)])
            h.wait_seq(last)
            wait_for(lambda: h.signals(), what="the gap signal")
            assert big not in h.seqs()
            after = [b for b in h.batches() if b.seq > big]
            first_live = after[0].seq
            # The ring's answer starts with the same oversize batch, so the replay DEALER's
            # connection is dropped too: the hole is reported at once, not at the deadline.
            assert h.signals() == [GapUnrecoverable("a", big, first_live, "replay_dropped")]
            assert [b.seq for b in after] == list(range(first_live, last + 1))
            st_ = h.stats()["a"]
            assert st_.replays == 1 and st_.malformed == 0 and not st_.replaying
            assert st_.replay_drops == 1
            assert st_.disconnects >= 1  # the SUB dropped the connection; it was re-opened


class PacedReplayProxy(GatedReplayProxy):
    """A replay endpoint that relays the upstream ring's answer ``per_tick`` replies every
    ``tick`` seconds, the first chunk as soon as it is in: a replay that lasts long but is
    never silent for more than a tick (the pace is the scenario, not a synchronisation).
    (Fetching the whole answer before the first chunk made the wait for it as long as the
    fetch: on a loaded CI machine past the idle timeout, and the replay was given up.)
    The gate is not used."""

    def __init__(self, upstream: str, per_tick: int, tick: float) -> None:
        self.per_tick, self.tick = per_tick, tick  # before the thread starts
        super().__init__(upstream)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._ctl_r, zmq.POLLIN)
        try:
            while self._ctl_r not in dict(poller.poll()):
                ident, _, seq8 = self._front.recv_multipart()
                back = self._ctx.socket(zmq.DEALER)
                back.connect(self._upstream)
                back.send_multipart([b"", seq8])
                chunk: list[list[bytes]] = []
                paused = False  # the first chunk goes as soon as it is in: no silence before it
                while True:
                    more = back.poll(5000)
                    end = False
                    if more:
                        chunk.append(back.recv_multipart())
                        end = SEQ.unpack(chunk[-1][2])[0] == END_SEQ
                    if chunk and (len(chunk) == self.per_tick or end or not more):
                        if paused and self._ctl_r.poll(int(self.tick * 1000)):
                            back.close(0)
                            return  # closed meanwhile
                        for frames in chunk:
                            self._front.send_multipart([ident, *frames])
                        chunk, paused = [], True
                    if end or not more:
                        break
                back.close(0)
        finally:
            self._front.close(0)
            self._ctl_r.close(0)


@modes
def test_long_replay_that_keeps_delivering_is_not_cut_short(mode: str) -> None:
    """The replay deadline is an idle one: a 400-batch replay lasting ~4x the timeout, never
    quiet for more than a quarter of it, completes without a gap."""
    timeout, n = 0.4, 400
    with (
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub,
        LossyForwarder(pub.endpoint) as fwd,
        PacedReplayProxy(pub.replay_endpoint, per_tick=25, tick=timeout / 4) as proxy,
    ):
        spec = StreamSpec("a", fwd.endpoint, proxy.endpoint)
        with make(mode, [spec], replay_timeout=timeout) as h:
            k = prime(lambda: pub.publish([removed(0)]), h)
            fwd.drop |= set(range(k + 1, k + 1 + n))
            for i in range(1, n + 2):
                pub.publish([removed(k + i)])
            h.wait_seq(k + n + 1, timeout=30)
            replayed = [b for b in h.batches() if b.replayed]
            assert [b.seq for b in replayed] == list(range(k + 1, k + 1 + n))
            assert replayed[-1].received_at - replayed[0].received_at > timeout
            assert h.seqs()[-n - 2 :] == list(range(k, k + n + 2))
            assert not h.signals()
            st_ = h.stats()["a"]
            assert st_.replays == 1 and st_.unrecoverable_gaps == 0 and not st_.replaying


def test_subscriber_binds_for_a_connecting_publisher() -> None:
    with Subscriber([StreamSpec("a", "tcp://127.0.0.1:0", bind=True)]) as sub:
        ep = sub.endpoints["a"]
        assert not ep.endswith(":0")
        with EventPublisher(ep) as pub:  # no '*': vLLM's publisher connects
            assert not pub.binds
            deadline = time.monotonic() + 10
            while (item := sub.get(timeout=0.05)) is None:
                pub.publish([removed(0)])
                assert time.monotonic() < deadline
            assert type(item) is StreamBatch


def test_iterator_api_and_clean_close() -> None:
    with EventPublisher(LOOPBACK) as pub:
        sub = Subscriber([StreamSpec("a", pub.endpoint)])
        deadline = time.monotonic() + 10
        while sub.get(timeout=0.05) is None:
            pub.publish([removed(0)])
            assert time.monotonic() < deadline
        last = pub.publish([removed(9)])
        got = None
        for item in sub:
            if isinstance(item, StreamBatch) and item.seq == last:
                got = item
                break
        assert got is not None and got.batch.events == [removed(9)]
        sub.close()
        assert not sub._thread.is_alive()
        assert list(sub) == [] or all(isinstance(i, StreamBatch) for i in sub)
        assert sub.get(timeout=0.01) is None


def test_callback_errors_are_counted_not_fatal() -> None:
    seen: list[Any] = []

    def boom(item: Any) -> None:
        seen.append(item)
        if len(seen) == 1:
            raise RuntimeError("consumer bug")

    with EventPublisher(LOOPBACK) as pub, Subscriber([StreamSpec("a", pub.endpoint)], boom) as sub:
        publish_until(lambda: pub.publish([removed(0)]), lambda: len(seen) >= 3)
        assert sub.stats()["a"].consumer_errors == 1


def test_dp_stream_specs_follow_vllm_offsets() -> None:
    specs = dp_stream_specs("r", "tcp://127.0.0.9:5557", "tcp://127.0.0.9:5600", ranks=range(3))
    assert [(s.name, s.endpoint, s.replay_endpoint, s.dp_rank) for s in specs] == [
        ("r/dp0", "tcp://127.0.0.9:5557", "tcp://127.0.0.9:5600", 0),
        ("r/dp1", "tcp://127.0.0.9:5558", "tcp://127.0.0.9:5601", 1),
        ("r/dp2", "tcp://127.0.0.9:5559", "tcp://127.0.0.9:5602", 2),
    ]


def test_dp_ranks_in_one_subscriber() -> None:
    base, pubs = dp_publishers(2)
    try:
        specs = dp_stream_specs("r", f"tcp://127.0.0.1:{base}", ranks=range(2))
        with make("sync", specs) as h:
            for r, pub in enumerate(pubs):
                prime(lambda pub=pub, r=r: pub.publish([removed(r)]), h, f"r/dp{r}")
            assert {b.stream for b in h.batches()} == {"r/dp0", "r/dp1"}
            assert all(b.batch.data_parallel_rank == int(b.stream[-1]) for b in h.batches())
            assert not h.signals()
    finally:
        for p in pubs:
            p.close()


def test_bad_specs_raise_clear_errors() -> None:
    with pytest.raises(EndpointError, match="tcp://HOST:PORT"):
        Subscriber([StreamSpec("a", "foo")])
    with pytest.raises(ValueError, match="used twice"):
        Subscriber([StreamSpec("a", "tcp://127.0.0.1:1"), StreamSpec("a", "tcp://127.0.0.1:2")])
    with pytest.raises(ValueError, match="at least one"):
        Subscriber([])
    with pytest.raises(EndpointError, match="replay_endpoint"):
        Subscriber([StreamSpec("a", "tcp://127.0.0.1:1", replay_endpoint="tcp://x:y")])
    # a Unicode digit that int() refuses ('¹'.isdigit() is True): the same clear error
    with pytest.raises(EndpointError, match="the port must be a number"):
        Subscriber([StreamSpec("a", "tcp://127.0.0.1:\u00b9")])


def test_unknown_events_are_delivered_and_counted() -> None:
    p = StreamProcessor(StreamSpec("a", "tcp://h:1"))
    raw = msgspec.msgpack.encode(
        [1.0, [{"type": "Future", "a": 1}, {"type": "AllBlocksCleared"}], 0]
    )
    out: list[Any] = []
    p.on_live([b"", SEQ.pack(0), raw], 1.0, out)
    (item,) = out
    assert type(item.batch.events[0]) is UnknownEvent and item.batch.unknown == 1
    assert p.stats.unknown_events == 1 and p.stats.events_by_type["UnknownEvent"] == 1


# ---------------------------------------------------------------------------------------
# The sync Subscriber as a wrapper of the asyncio core: errors, close, threads, sockets.
# ---------------------------------------------------------------------------------------


def first_item(sub: Subscriber, pub: EventPublisher) -> Any:
    """Publish until ``sub.get`` returns an item (past the slow joiner); return it."""
    deadline = time.monotonic() + 10
    while (item := sub.get(timeout=0.05)) is None:
        pub.publish([removed(0)])
        assert time.monotonic() < deadline, "nothing arrived within 10s"
    return item


def _fail_on_live(monkeypatch: pytest.MonkeyPatch) -> type[Exception]:
    """Make every stream's processor raise on its first live message: a bug in the core."""

    class InjectedCoreBug(Exception):
        pass

    def on_live(self: StreamProcessor, frames: Any, now: float, out: list[Any]) -> None:
        raise InjectedCoreBug("injected")

    monkeypatch.setattr(StreamProcessor, "on_live", on_live)
    return InjectedCoreBug


def test_core_error_reaches_the_iterating_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    bug = _fail_on_live(monkeypatch)
    with EventPublisher(LOOPBACK) as pub:
        sub = Subscriber([StreamSpec("a", pub.endpoint)])
        with pytest.raises(SubscriberError, match="create a new one") as info:
            first_item(sub, pub)
        assert type(info.value.__cause__) is bug
        with pytest.raises(SubscriberError):  # every later read says so too
            list(sub)
        sub.close()  # already raised to the caller: close() does not raise it again
        assert not sub._thread.is_alive()


def test_core_error_reaches_a_callback_caller_at_close(monkeypatch: pytest.MonkeyPatch) -> None:
    bug = _fail_on_live(monkeypatch)
    with EventPublisher(LOOPBACK) as pub:
        sub = Subscriber([StreamSpec("a", pub.endpoint)], on_item=lambda item: None)
        publish_until(lambda: pub.publish([removed(0)]), lambda: sub._core.failure is not None)
        with pytest.raises(SubscriberError) as info:
            sub.close()
        assert type(info.value.__cause__) is bug
        assert not sub._thread.is_alive()
        sub.close()  # idempotent, and the error was reported once


def test_core_error_reaches_the_async_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    bug = _fail_on_live(monkeypatch)

    async def main() -> None:
        with EventPublisher(LOOPBACK) as pub:
            async with AsyncSubscriber([StreamSpec("a", pub.endpoint)]) as sub:
                deadline = time.monotonic() + 10
                with pytest.raises(SubscriberError) as info:
                    while await sub.get(timeout=0.05) is None:
                        pub.publish([removed(0)])
                        assert time.monotonic() < deadline
                assert type(info.value.__cause__) is bug

    asyncio.run(main())


@pytest.mark.parametrize("backlog", [False, True], ids=["idle", "queue-full"])
def test_close_from_another_thread_while_iterating(backlog: bool) -> None:
    """A reader blocked in ``for item in sub`` (waiting, or with the core waiting for queue
    space) ends promptly when another thread closes the subscriber; nothing queued is lost."""
    with EventPublisher(LOOPBACK) as pub:
        sub = Subscriber([StreamSpec("a", pub.endpoint)], max_pending=4)
        got: list[Any] = []
        gate = threading.Event()  # the reader takes one item, then waits for the test

        def read() -> None:
            for item in sub:
                got.append(item)
                if len(got) == 1:
                    gate.wait(10)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        publish_until(lambda: pub.publish([removed(0)]), lambda: got)
        if backlog:  # publish until the queue is full and the core waits for space
            handoff = sub._handoff
            assert handoff is not None
            publish_until(lambda: pub.publish([removed(1)]), lambda: handoff._space is not None)
        else:
            gate.set()
            wait_for(lambda: sub.stats()["a"].last_seq == pub.next_seq - 1, what="caught up")
        t0 = time.monotonic()
        sub.close()
        assert time.monotonic() - t0 < 2.0
        gate.set()
        reader.join(5)
        assert not reader.is_alive() and not sub._thread.is_alive()
        seqs = [i.seq for i in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # nothing skipped
        if not backlog:
            assert seqs[-1] == pub.next_seq - 1


def test_max_pending_backpressure_loses_nothing() -> None:
    """With a tiny queue and a consumer that reads late, the core waits instead of dropping."""
    with EventPublisher(LOOPBACK) as pub:
        sub = Subscriber([StreamSpec("a", pub.endpoint)], max_pending=3)
        try:
            first_item(sub, pub)
            handoff = sub._handoff
            assert handoff is not None
            start = pub.next_seq
            # Fill the queue until the core waits for space, then pile more up behind it.
            publish_until(lambda: pub.publish([removed(1)]), lambda: handoff._space is not None)
            for i in range(300):
                last = pub.publish([removed(i)])
            seqs = []
            while not seqs or seqs[-1] < last:
                nxt = sub.get(timeout=10)
                assert nxt is not None, "the core stopped delivering"
                seqs.append(nxt.seq)
            tail = [s for s in seqs if s >= start]
            assert tail == list(range(start, last + 1))
            assert sub.stats()["a"].gaps == 0
        finally:
            sub.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled(baseline_threads: set[threading.Thread], baseline_fds: int) -> bool:
    return set(threading.enumerate()) <= baseline_threads and _fds() <= baseline_fds


def test_no_thread_or_socket_leaks_after_close() -> None:
    """Subscribers opened and closed every way (queue, callback, failed start, failed core)
    leave no thread and no file descriptor behind (sockets, the loop's selector)."""
    spec = StreamSpec("a", "tcp://127.0.0.1:0", bind=True)
    Subscriber([spec]).close()  # warm up the context's I/O threads
    threads, fds = set(threading.enumerate()), _fds()
    blocker = zmq.Context.instance().socket(zmq.PUB)
    blocker.bind("tcp://127.0.0.1:*")
    taken = last_endpoint(blocker)
    try:
        for _ in range(5):
            with Subscriber([spec]) as sub:
                assert sub.get(timeout=0.01) is None
            with Subscriber([spec], on_item=lambda item: None):
                pass
            with pytest.raises(EndpointError, match="cannot bind"):
                Subscriber([spec, StreamSpec("b", taken, bind=True)])
    finally:
        blocker.close(0)
    wait_for(lambda: _settled(threads, fds), what="threads and descriptors released")


def test_close_from_the_callback_is_refused() -> None:
    holder: list[Subscriber] = []
    errors: list[BaseException] = []

    def on_item(item: Any) -> None:
        try:
            holder[0].close()
        except RuntimeError as exc:
            errors.append(exc)

    with EventPublisher(LOOPBACK) as pub:
        holder.append(Subscriber([StreamSpec("a", pub.endpoint)], on_item=on_item))
        publish_until(lambda: pub.publish([removed(0)]), lambda: errors)
        assert "from another thread" in str(errors[0])
        holder[0].close()
        assert not holder[0]._thread.is_alive()


def test_inproc_stream_shares_the_default_context() -> None:
    """The sync core runs on an asyncio shadow of ``zmq.Context.instance()``, so an
    ``inproc://`` publisher on the default context is reachable as before."""
    with EventPublisher("inproc://kvrouter-test-subscriber") as pub:
        assert pub.binds
        with Subscriber([StreamSpec("a", pub.endpoint)]) as sub:
            assert type(first_item(sub, pub)) is StreamBatch


def test_async_close_with_a_full_queue_still_ends_iteration() -> None:
    """The end mark cannot go into a full queue at close(); it follows once a reader frees a
    slot, so ``async for`` drains what was queued and ends instead of waiting forever."""

    async def main() -> None:
        with EventPublisher(LOOPBACK) as pub:
            sub = AsyncSubscriber([StreamSpec("a", pub.endpoint)], max_pending=2)
            await sub.start()
            deadline = time.monotonic() + 10
            while sub._queue is None or not sub._queue.full():
                pub.publish([removed(0)])
                assert time.monotonic() < deadline, "the queue never filled"
                await asyncio.sleep(0.01)  # poll: let the reader task run
            await sub.close()

            async def drain() -> list[Any]:
                return [item async for item in sub]

            items = await asyncio.wait_for(drain(), 5)
            assert len(items) == 2 and all(type(i) is StreamBatch for i in items)
            assert await sub.get(timeout=0.01) is None

    asyncio.run(main())


@modes
def test_connected_follows_the_publisher(mode: str) -> None:
    """``StreamStats.connected``: False before a publisher listens, True once the SUB holds a
    connection, False when the publisher goes away, True again when one binds the port anew
    (a restarted replica). ``GET /ready`` of the router reads it."""
    with EventPublisher(LOOPBACK) as first:
        endpoint = first.endpoint  # a port known to be free now
    spec = StreamSpec("c", endpoint)
    with make(mode, [spec]) as h:
        assert h.stats()["c"].connected is False
        pub = None
        try:
            pub = wait_for(lambda: try_publisher(endpoint, bind=True), what="the port bound")
            wait_for(lambda: h.stats()["c"].connected, what="connected")
            pub.close()
            wait_for(lambda: h.stats()["c"].connected is False, what="disconnected")
            assert h.stats()["c"].disconnects >= 1
            pub = wait_for(lambda: try_publisher(endpoint, bind=True), what="the port rebound")
            wait_for(lambda: h.stats()["c"].connected, what="connected again")
        finally:
            if pub is not None:
                pub.close()
    # a publisher already there when the subscriber connects: seen too
    with EventPublisher(LOOPBACK) as pub, make(mode, [StreamSpec("d", pub.endpoint)]) as h:
        wait_for(lambda: h.stats()["d"].connected, what="connected at once")
    # a bound SUB cannot tell
    with make(mode, [StreamSpec("b", LOOPBACK, bind=True)]) as h:
        assert h.stats()["b"].connected is None
