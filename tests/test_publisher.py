"""EventPublisher against raw ZeroMQ sockets: frames, sequence, replay protocol (spec §3)."""

from __future__ import annotations

import time

import pytest
import zmq

from events.publisher import (
    EndpointError,
    EventPublisher,
    PublisherClosedError,
    offset_endpoint_port,
    publisher_binds,
    validate_endpoint,
)
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tests.zmq_helpers import LOOPBACK, SEQ, last_endpoint

END = b"\xff" * 8


def removed(h: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)


@pytest.fixture
def ctx() -> zmq.Context:
    return zmq.Context.instance()


def raw_sub(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(endpoint)
    return s


def recv_first(pub: EventPublisher, sub: zmq.Socket) -> list[bytes]:
    """Publish until the raw SUB receives (slow joiner); returns the first message."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish([removed(0)])
        if sub.poll(50):
            return sub.recv_multipart()
    raise AssertionError("SUB never received a message")


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    return d


def recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "no reply"
    return sock.recv_multipart()


def test_live_frames_sequence_and_rank(ctx: zmq.Context) -> None:
    with EventPublisher(LOOPBACK, topic="kv", data_parallel_rank=0) as pub:
        sub = raw_sub(ctx, pub.endpoint)
        try:
            first = recv_first(pub, sub)
            assert len(first) == 3 and first[0] == b"kv" and len(first[1]) == 8
            n0 = SEQ.unpack(first[1])[0]
            seqs = [pub.publish([removed(i)], ts=100.0 + i) for i in range(5)]
            assert seqs == list(range(pub.next_seq - 5, pub.next_seq))
            got = []
            while len(got) < 5:
                frames = recv(sub)
                if SEQ.unpack(frames[1])[0] >= seqs[0]:
                    got.append(frames)
            for i, (topic, seq8, payload) in enumerate(got):
                assert topic == b"kv"
                assert SEQ.unpack(seq8)[0] == seqs[i]
                b = decode_batch(payload)
                assert b.ts == 100.0 + i and b.data_parallel_rank == 0
                assert b.events == [removed(i)]
                # Exactly what encode_batch gives for the same batch: nothing else added.
                assert payload == encode_batch(KVEventBatch(100.0 + i, [removed(i)], 0))
            assert n0 < seqs[0]
        finally:
            sub.close(0)


def test_seq_starts_at_zero_and_replay_protocol(ctx: zmq.Context) -> None:
    with EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="t", buffer_steps=100) as pub:
        payloads = {}
        for i in range(5):
            seq = pub.publish([removed(i)], ts=float(i))
            assert seq == i  # starts at 0, +1 per batch
            payloads[i] = encode_batch(KVEventBatch(float(i), [removed(i)], 0))
        assert pub.flush()
        d = dealer(ctx, pub.replay_endpoint)
        try:
            d.send_multipart([b"", SEQ.pack(2)])
            for seq in (2, 3, 4):
                assert recv(d) == [b"", b"t", SEQ.pack(seq), payloads[seq]]
            assert recv(d) == [b"", b"", END, b""]
            # From 0: everything; past the end: the end marker alone.
            d.send_multipart([b"", SEQ.pack(0)])
            assert [SEQ.unpack(recv(d)[2])[0] for _ in range(5)] == [0, 1, 2, 3, 4]
            assert recv(d) == [b"", b"", END, b""]
            d.send_multipart([b"", SEQ.pack(99)])
            assert recv(d) == [b"", b"", END, b""]
            assert not d.poll(50)
        finally:
            d.close(0)


def test_replay_ring_keeps_last_buffer_steps(ctx: zmq.Context) -> None:
    with EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=3) as pub:
        for i in range(7):
            pub.publish([removed(i)])
        assert pub.flush()
        d = dealer(ctx, pub.replay_endpoint)
        try:
            d.send_multipart([b"", SEQ.pack(0)])
            got = [recv(d) for _ in range(4)]
            assert [SEQ.unpack(f[2])[0] for f in got[:3]] == [4, 5, 6]
            assert got[3] == [b"", b"", END, b""]
        finally:
            d.close(0)


def test_malformed_replay_requests_are_ignored(ctx: zmq.Context) -> None:
    with EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub:
        pub.publish([removed(1)])
        assert pub.flush()
        d = dealer(ctx, pub.replay_endpoint)
        try:
            d.send_multipart([b"", b"\x00" * 4])  # short seq
            d.send_multipart([b"", SEQ.pack(0), b"extra"])  # too many frames
            d.send_multipart([b"x", SEQ.pack(0)])  # no delimiter
            d.send_multipart([b"", SEQ.pack(0)])  # the only valid one
            assert SEQ.unpack(recv(d)[2])[0] == 0
            assert recv(d) == [b"", b"", END, b""]
            assert not d.poll(100)
            assert pub.replays_served == 1
        finally:
            d.close(0)


def test_req_socket_reads_first_reply(ctx: zmq.Context) -> None:
    # A REQ client adds the delimiter itself (spec §3); it can read one reply.
    with EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub:
        pub.publish([removed(1)])
        assert pub.flush()
        r = ctx.socket(zmq.REQ)
        r.connect(pub.replay_endpoint)
        try:
            r.send(SEQ.pack(0))
            frames = recv(r)
            assert frames[1:] == [SEQ.pack(0), encode_batch(decode_to_batch(frames[2]))]
        finally:
            r.close(0)


def decode_to_batch(payload: bytes) -> KVEventBatch:
    d = decode_batch(payload)
    return KVEventBatch(d.ts, list(d.events), d.data_parallel_rank)


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://[::ffff:127.0.0.1]:5557", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router-host:5557", False),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
    ],
)
def test_bind_rule(endpoint: str, binds: bool) -> None:
    assert publisher_binds(endpoint) is binds


def test_connecting_publisher_reaches_a_binding_subscriber(ctx: zmq.Context) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(LOOPBACK)
    try:
        with EventPublisher(last_endpoint(sub)) as pub:
            assert not pub.binds and pub.endpoint == last_endpoint(sub)
            assert SEQ.unpack(recv_first(pub, sub)[1])[0] >= 0
    finally:
        sub.close(0)


def test_ipv4_mapped_endpoint_binds_on_loopback(ctx: zmq.Context) -> None:
    with EventPublisher("tcp://[::ffff:127.0.0.1]:0") as pub:
        assert pub.binds
        port = pub.endpoint.rsplit(":", 1)[1]
        assert int(port) > 0
        sub = raw_sub(ctx, f"tcp://127.0.0.1:{port}")
        try:
            recv_first(pub, sub)
        finally:
            sub.close(0)


def test_bind_override(ctx: zmq.Context) -> None:
    # No '*': vLLM's rule would connect; bind=True binds an ephemeral port instead.
    with EventPublisher("tcp://127.0.0.1:0", bind=True) as pub:
        assert pub.binds and not pub.endpoint.endswith(":0")
        sub = raw_sub(ctx, pub.endpoint)
        try:
            recv_first(pub, sub)
        finally:
            sub.close(0)


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://127.0.0.9:5557", 1, "tcp://127.0.0.9:5558"),
        ("tcp://[::1]:6000", 2, "tcp://[::1]:6002"),
        ("tcp://*:0", 5, "tcp://*:0"),
        ("tcp://127.0.0.1:*", 5, "tcp://127.0.0.1:*"),
        ("inproc://events", 0, "inproc://events_dp0"),
        ("inproc://events", 2, "inproc://events_dp2"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
    ],
)
def test_offset_endpoint_port(endpoint: str, rank: int, expected: str) -> None:
    assert offset_endpoint_port(endpoint, rank) == expected


def test_ipc_cannot_be_offset() -> None:
    with pytest.raises(EndpointError, match="tcp://"):
        offset_endpoint_port("ipc:///tmp/kv", 1)
    with pytest.raises(EndpointError, match="tcp://"):
        EventPublisher("ipc:///tmp/kvrouter-test-never", data_parallel_rank=1)


def test_dp_rank_offsets_both_endpoints_and_fills_rank(ctx: zmq.Context) -> None:
    with EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10) as probe:
        base = int(probe.endpoint.rsplit(":", 1)[1])
        rbase = int(probe.replay_endpoint.rsplit(":", 1)[1])
    ep, rep = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{rbase}"
    with EventPublisher(ep, replay_endpoint=rep, data_parallel_rank=2, bind=True) as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{base + 2}"
        assert pub.replay_endpoint == f"tcp://127.0.0.1:{rbase + 2}"
        pub.publish([removed(1)])  # rank filled in
        pub.publish(KVEventBatch(1.0, [removed(2)], None))  # rank filled in
        pub.publish(KVEventBatch(1.0, [removed(3)], 7))  # an explicit rank is kept
        assert pub.flush()
        d = dealer(ctx, pub.replay_endpoint)
        try:
            d.send_multipart([b"", SEQ.pack(0)])
            ranks = [decode_batch(recv(d)[3]).data_parallel_rank for _ in range(3)]
            assert ranks == [2, 2, 7]
        finally:
            d.close(0)


def test_inproc_publisher(ctx: zmq.Context) -> None:
    with EventPublisher("inproc://kv-test-events", data_parallel_rank=1) as pub:
        assert pub.endpoint == "inproc://kv-test-events_dp1"
        sub = raw_sub(ctx, pub.endpoint)
        try:
            assert decode_batch(recv_first(pub, sub)[2]).data_parallel_rank == 1
        finally:
            sub.close(0)


def test_legacy_encoding_option(ctx: zmq.Context) -> None:
    with EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, legacy=True) as pub:
        ev = BlockStored(block_hashes=[2**64 - 1], token_ids=[1, 2], block_size=2, group_idx=0)
        pub.publish([ev, AllBlocksCleared()], ts=5.0)
        assert pub.flush()
        d = dealer(ctx, pub.replay_endpoint)
        try:
            d.send_multipart([b"", SEQ.pack(0)])
            payload = recv(d)[3]
            assert payload == encode_batch(
                KVEventBatch(5.0, [ev, AllBlocksCleared()], 0), legacy=True
            )
            b = decode_batch(payload)
            assert b.legacy == 2 and b.events == [ev, AllBlocksCleared()]
        finally:
            d.close(0)


def test_hwm_and_queue_options_reach_the_sockets() -> None:
    with EventPublisher(LOOPBACK, hwm=123, max_queue_size=7) as pub:
        assert pub._pub.getsockopt(zmq.SNDHWM) == 123
        assert pub._push.getsockopt(zmq.SNDHWM) == 7


def test_restart_starts_again_at_zero() -> None:
    with EventPublisher(LOOPBACK) as pub:
        assert [pub.publish([removed(i)]) for i in range(3)] == [0, 1, 2]
    with EventPublisher(LOOPBACK) as pub:
        assert pub.publish([removed(0)]) == 0


def test_errors_are_typed_and_name_the_fix() -> None:
    with pytest.raises(EndpointError, match=r"tcp://HOST:PORT"):
        EventPublisher("foo")
    with pytest.raises(EndpointError, match="port must be a number"):
        EventPublisher("tcp://nohost:x")
    with pytest.raises(ValueError, match="buffer_steps"):
        EventPublisher(LOOPBACK, buffer_steps=-1)
    pub = EventPublisher(LOOPBACK)
    with pytest.raises(TypeError, match="BlockStored, BlockRemoved or AllBlocksCleared"):
        pub.publish([object()])
    assert pub.next_seq == 0  # a failed encode consumes no sequence number
    pub.close()
    pub.close()  # idempotent
    with pytest.raises(PublisherClosedError, match="new EventPublisher"):
        pub.publish([removed(1)])


@pytest.mark.parametrize(
    "bad", ["foo", "tcp://nohost:x", "tcp://:5557x", "udp://host:1", "tcp://host:70000", "ipc://"]
)
def test_validate_endpoint_rejects(bad: str) -> None:
    with pytest.raises(EndpointError):
        validate_endpoint(bad)


def test_close_sends_everything_queued_and_stops_the_thread(ctx: zmq.Context) -> None:
    pub = EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    sub = raw_sub(ctx, pub.endpoint)
    try:
        recv_first(pub, sub)
        last = 0
        for i in range(200):
            last = pub.publish([removed(i)])
        pub.close()
        assert not pub._thread.is_alive()
        seq = -1
        while seq != last:
            seq = SEQ.unpack(recv(sub)[1])[0]
    finally:
        sub.close(0)
