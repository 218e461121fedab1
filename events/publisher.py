"""A KV-event publisher that is wire-identical to vLLM 0.32's ``ZmqEventPublisher`` (spec §3).

It lets anything that is not vLLM (the simulated replicas of ``gpu_emitter``, tests,
benchmarks) look like a vLLM replica to any vLLM KV-event consumer, and it is the reference
this project's subscriber is tested against.

Wire behaviour, per spec §3:

* PUB messages ``[topic, seq (8-byte big-endian), msgpack batch]``; ``seq`` starts at 0 when
  the publisher starts and grows by one per batch.
* A ROUTER replay socket serving the last ``buffer_steps`` batches: a request
  ``[identity, b"", start_seq8]`` is answered by ``[identity, b"", topic, seq8, payload]`` for
  every buffered batch with ``seq >= start``, then the end marker
  ``[identity, b"", b"", 0xFFFFFFFFFFFFFFFF, b""]``.
* The PUB socket binds when its endpoint contains ``*`` or ``::`` or is ``ipc://`` or
  ``inproc://``, and otherwise connects (the subscriber binds). Note that an IPv4-mapped
  address such as ``tcp://[::ffff:127.0.0.1]:PORT`` contains ``::`` and therefore binds,
  which is the way to bind to loopback only under vLLM's rule; ``bind=`` overrides the rule.
* Data-parallel ranks: both endpoints are offset by :func:`offset_endpoint_port`.

Example::

    from events import BlockRemoved, EventPublisher

    with EventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558") as pub:
        seq = pub.publish([BlockRemoved(block_hashes=[123], medium="GPU", group_idx=0)])

Like vLLM, batches go through a bounded in-process queue to a publisher thread, which also
serves replay requests; :meth:`EventPublisher.publish` blocks when the queue is full and never
drops a batch.
"""

from __future__ import annotations

import itertools
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from events.endpoints import (
    EndpointError,
    bind_or_connect,
    offset_endpoint_port,
    validate_endpoint,
)
from events.schema import KVEventBatch, encode_batch
from events.stream import END_SEQ

# EndpointError, offset_endpoint_port and validate_endpoint live in events.endpoints, shared
# with the subscriber; they stay importable from here, where callers have always found them.
__all__ = [
    "EndpointError",
    "EventPublisher",
    "PublisherClosedError",
    "offset_endpoint_port",
    "publisher_binds",
    "validate_endpoint",
]

_SEQ = struct.Struct(">Q")
_END = _SEQ.pack(END_SEQ)
_STOP = b"stop"
_ids = itertools.count()


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket (spec §3): bind if the endpoint contains ``*`` or
    ``::`` or is ``ipc://``/``inproc://``, otherwise connect."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class PublisherClosedError(RuntimeError):
    """:meth:`EventPublisher.publish` was called after :meth:`EventPublisher.close`."""


class EventPublisher:
    """Publish KV-event batches exactly like a vLLM 0.32 replica (see the module docstring).

    Args:
        endpoint: PUB address before the DP offset (vLLM's default ``tcp://*:5557``).
        replay_endpoint: ROUTER address before the DP offset, or ``None`` for no replay.
        topic: sent as frame 0 of every message (subscribers filter by prefix).
        buffer_steps: how many recent batches the replay ring keeps.
        hwm: ZeroMQ high-water mark of the PUB socket, in messages; a subscriber that falls
            further behind loses messages (and must replay them).
        max_queue_size: batches that may wait for the publisher thread before
            :meth:`publish` blocks.
        data_parallel_rank: offsets both endpoints and fills ``data_parallel_rank`` in
            batches that leave it unset.
        bind: force binding (``True``) or connecting (``False``) the PUB socket instead of
            vLLM's rule (:func:`publisher_binds`).
        legacy: encode events as pre-#42892 positional arrays, to test old-format consumers.
        context: ZeroMQ context (default: the process-wide instance; ``inproc://`` needs the
            subscriber to share it).
        linger: seconds :meth:`close` may wait for queued messages to reach subscribers.

    Attributes:
        endpoint: the PUB address in use: the resolved address when bound (ephemeral ports
            filled in, e.g. ``tcp://0.0.0.0:41234``), else the connected address.
        replay_endpoint: the resolved ROUTER address, or ``None``.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
        bind: bool | None = None,
        legacy: bool = False,
        context: zmq.Context | None = None,
        linger: float = 1.0,
    ) -> None:
        if buffer_steps < 0:
            raise ValueError(f"buffer_steps must be >= 0, got {buffer_steps}")
        if hwm < 0:
            raise ValueError(f"hwm must be >= 0 (0 = unlimited), got {hwm}")
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {max_queue_size}")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.buffer_steps = buffer_steps
        self.legacy = legacy
        self._topic = topic.encode()
        self._ctx = context if context is not None else zmq.Context.instance()
        self._linger_ms = max(0, int(linger * 1000))

        pub_ep = offset_endpoint_port(endpoint, data_parallel_rank)
        replay_ep = (
            offset_endpoint_port(replay_endpoint, data_parallel_rank)
            if replay_endpoint is not None
            else None
        )
        self.binds = publisher_binds(pub_ep) if bind is None else bind

        self._pub = self._ctx.socket(zmq.PUB)
        self._router: zmq.Socket | None = None
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self.endpoint: str = bind_or_connect(self._pub, pub_ep, bind=self.binds)
            self.replay_endpoint: str | None = None
            if replay_ep is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                # A whole ring must fit in one reply burst: ROUTER drops above its HWM.
                self._router.setsockopt(zmq.SNDHWM, 2 * buffer_steps + 16)
                self.replay_endpoint = bind_or_connect(self._router, replay_ep, bind=True)
            queue_addr = f"inproc://kvrouter-publisher-{id(self)}-{next(_ids)}"
            self._pull.setsockopt(zmq.RCVHWM, 1)
            self._pull.bind(queue_addr)
            self._push.setsockopt(zmq.SNDHWM, max_queue_size)
            self._push.connect(queue_addr)
        except Exception:
            self._close_sockets(0)
            raise

        self._lock = threading.Lock()
        self._next_seq = 0
        self._sent_seq = -1
        self._sent_cond = threading.Condition()
        self._closed = False
        self._ring: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self.replays_served = 0
        self._thread = threading.Thread(
            target=self._run, name=f"kv-event-publisher-dp{data_parallel_rank}", daemon=True
        )
        self._thread.start()

    # -- producer side ----------------------------------------------------------------

    def publish(self, events: KVEventBatch | Sequence[Any], *, ts: float | None = None) -> int:
        """Queue one engine step's events as one batch and return its sequence number.

        ``events`` is a :class:`~events.schema.KVEventBatch` or a list of events (then
        ``ts`` defaults to ``time.time()``). Encoding happens here, so a bad event raises
        in the caller and consumes no sequence number. Blocks while the queue is full.
        """
        if isinstance(events, KVEventBatch):
            batch = events
            if batch.data_parallel_rank is None:
                batch = msgspec.structs.replace(batch, data_parallel_rank=self.data_parallel_rank)
        else:
            batch = KVEventBatch(
                time.time() if ts is None else ts, list(events), self.data_parallel_rank
            )
        try:
            payload = encode_batch(batch, legacy=self.legacy)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"cannot encode KV-event batch: {exc}; events must be BlockStored, "
                "BlockRemoved or AllBlocksCleared from events.schema"
            ) from None
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> int:
        """Queue an already-encoded msgpack batch (used to replay recorded streams)."""
        with self._lock:
            if self._closed:
                raise PublisherClosedError("publisher is closed; create a new EventPublisher")
            seq = self._next_seq
            self._push.send_multipart((_SEQ.pack(seq), payload), copy=False)
            self._next_seq = seq + 1
        return seq

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get."""
        return self._next_seq

    def flush(self, timeout: float | None = 5.0) -> bool:
        """Wait until every queued batch has been sent on the PUB socket and entered the
        replay ring; returns False on timeout."""
        target = self._next_seq - 1
        with self._sent_cond:
            return self._sent_cond.wait_for(lambda: self._sent_seq >= target, timeout)

    # -- publisher thread -------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        pub, pull, router = self._pub, self._pull, self._router
        topic, ring = self._topic, self._ring
        while True:
            ready = dict(poller.poll())
            if router is not None and router in ready:
                self._serve_replay(router)
            if pull not in ready:
                continue
            # Drain a bounded burst so replay requests are served between bursts.
            last = -1
            for _ in range(1024):
                try:
                    frames = pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2:  # the stop message
                    self._mark_sent(last)
                    return
                seq8, payload = frames
                pub.send_multipart((topic, seq8, payload))
                last = _SEQ.unpack(seq8)[0]
                ring.append((last, seq8, payload))
            self._mark_sent(last)

    def _mark_sent(self, seq: int) -> None:
        if seq < 0:
            return
        with self._sent_cond:
            self._sent_seq = seq
            self._sent_cond.notify_all()

    def _serve_replay(self, router: zmq.Socket) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # vLLM answers only well-formed requests: [identity, b"", start_seq8].
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue
            ident = frames[0]
            start = _SEQ.unpack(frames[2])[0]
            for seq, seq8, payload in self._ring:
                if seq >= start:
                    router.send_multipart((ident, b"", self._topic, seq8, payload))
            router.send_multipart((ident, b"", b"", _END, b""))
            self.replays_served += 1

    # -- lifecycle --------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._push.send(_STOP)
        self._thread.join(timeout)
        self._close_sockets(self._linger_ms)

    def _close_sockets(self, linger_ms: int) -> None:
        self._pub.close(linger=linger_ms)
        if self._router is not None:
            self._router.close(linger=0)
        self._push.close(linger=0)
        self._pull.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"EventPublisher(endpoint={self.endpoint!r}, replay_endpoint="
            f"{self.replay_endpoint!r}, dp_rank={self.data_parallel_rank}, "
            f"next_seq={self._next_seq})"
        )
