"""Issue 12, SDK half: no frame can kill, freeze or poison the event SDK.

~20,000 seeded hostile frames (:class:`bench.fuzz_frames.FrameFuzzer`) go through
``decode_batch`` in both ``lazy_token_ids`` modes, a few thousand through a
:class:`StreamProcessor`, and a smaller share through a real PUB socket on 127.0.0.1 into a
real :class:`Subscriber` and :class:`AsyncSubscriber`. Only ``BatchDecodeError`` may leave
``decode_batch``; every bad message is counted; the subscriber is alive at the end (a final
valid batch is delivered) and never raised :class:`SubscriberError`. The long run is
``bench/fuzz_frames.py --frames 1000000``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fuzz_frames import FrameFuzzer, classify  # noqa: E402
from events.schema import BatchDecodeError, BlockRemoved, decode_batch  # noqa: E402
from events.stream import (  # noqa: E402
    MalformedMessage,
    RankMismatch,
    StreamBatch,
    StreamProcessor,
    StreamSpec,
)
from tests.zmq_helpers import HARNESSES, SEQ, RawPub, prime, wait_for  # noqa: E402

BULK = 20_000


def test_decode_batch_lets_only_batch_decode_error_out() -> None:
    fz = FrameFuzzer(seed=12)
    outcomes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for _ in range(BULK):
        kind, payload = fz.payload()
        kinds[kind.removesuffix("+raw")] += 1
        for lazy in (False, True):
            outcomes[classify(payload, lazy=lazy)] += 1
    escaped = {k: v for k, v in outcomes.items() if k.startswith("escaped")}
    assert escaped == {}
    # The generator reaches every outcome and every way of making a frame.
    assert {"ok", "ok_unknown", "batch_error"} <= set(outcomes)
    assert set(kinds) >= {
        "random_bytes",
        "truncated",
        "byte_flips",
        "valid",
        "envelope",
        "event_replaced",
        "unknown_tag",
        "key",
        "list_item",
        "field",
    }


def expected_item(payload: bytes, *, lazy: bool, rank: int) -> type:
    """What the stream must make of a seq-consuming message with ``payload``."""
    try:
        batch = decode_batch(payload, lazy_token_ids=lazy)
    except BatchDecodeError:
        return MalformedMessage
    got = batch.data_parallel_rank
    return RankMismatch if got is not None and got != rank else StreamBatch


def fuzz_messages(seed: int, start: int, n: int, *, lazy: bool) -> tuple[list[Any], Counter]:
    """``n`` messages from seq ``start`` (no holes: bad frames take no seq) and the count of
    each item type they must produce."""
    fz = FrameFuzzer(seed)
    msgs: list[list[bytes]] = []
    expect: Counter[type] = Counter()
    seq = start
    for _ in range(n):
        if fz.rng.random() < 0.2:
            msgs.append(fz.bad_frames())
            expect[MalformedMessage] += 1
            continue
        _, payload = fz.payload()
        msgs.append([b"", SEQ.pack(seq), payload])
        expect[expected_item(payload, lazy=lazy, rank=0)] += 1
        seq += 1
    return msgs, expect


@pytest.mark.parametrize("lazy", [False, True])
def test_processor_counts_every_hostile_message(lazy: bool) -> None:
    p = StreamProcessor(StreamSpec("f", "tcp://h:1", dp_rank=0, lazy_token_ids=lazy))
    msgs, expect = fuzz_messages(7, 0, 3_000, lazy=lazy)
    out: list[Any] = []
    for m in msgs:
        assert p.on_live(m, 1.0, out) is None
    assert Counter(type(i) for i in out) == expect
    st_ = p.stats
    assert st_.malformed == expect[MalformedMessage]
    assert st_.rank_mismatches == expect[RankMismatch]
    assert st_.batches == expect[StreamBatch]
    assert st_.gaps == st_.resets == st_.unrecoverable_gaps == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_subscriber_survives_hostile_frames_over_a_socket(mode: str) -> None:
    lazy = mode == "async"  # both decode modes, one per frontend
    with RawPub() as raw:
        spec = StreamSpec("f", raw.endpoint, dp_rank=0, lazy_token_ids=lazy)
        h = HARNESSES[mode]([spec])
        try:
            n = iter(range(10**6))
            ok = [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)]
            first = prime(lambda: (raw.send_batch(s := next(n), ok), s)[1], h)
            before = len(h.items)
            base = h.stats()["f"]
            msgs, expect = fuzz_messages(2026, first + 1, 1_500, lazy=lazy)
            for m in msgs:
                raw.send(m)
            last = first + 1 + sum(1 for m in msgs if len(m) == 3 and len(m[1]) == 8)
            raw.send_batch(last, ok)  # the subscriber is alive: this one arrives
            h.wait_seq(last, timeout=30)
            wait_for(lambda: len(h.items) == before + len(msgs) + 1, what="every item")
            got = Counter(type(i) for i in h.items[before:-1])
            assert got == expect
            st_ = h.stats()["f"]
            assert st_.malformed - base.malformed == expect[MalformedMessage]
            assert st_.rank_mismatches - base.rank_mismatches == expect[RankMismatch]
            assert st_.batches - base.batches == expect[StreamBatch] + 1
            assert st_.gaps == st_.resets == 0
            assert h.sub._core.failure is None
        finally:
            h.close()  # raises SubscriberError if the core had died
