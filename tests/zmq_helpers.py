"""Real-socket test fixtures for the event SDK: loopback only, no sleeps used to synchronise.

* :func:`wait_for` polls a condition with a deadline.
* :class:`LossyForwarder` sits between a publisher and a subscriber and drops chosen seqs.
* :class:`GatedReplayProxy` holds replay requests until the test opens the gate.
* :class:`RawPub` sends arbitrary frames, for malformed-input tests.
* :class:`SyncHarness` / :class:`AsyncHarness` run a :class:`Subscriber` (callback API) or an
  :class:`AsyncSubscriber` (``async for`` on its own ``asyncio.run`` loop) behind one interface,
  so every scenario runs against both.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from events.publisher import EndpointError, EventPublisher
from events.schema import KVEventBatch, encode_batch
from events.stream import (
    END_SEQ,
    GapUnrecoverable,
    MalformedMessage,
    RankMismatch,
    StreamBatch,
    StreamItem,
    StreamReset,
    StreamSpec,
    StreamStats,
)
from events.subscriber import AsyncSubscriber, Subscriber

SEQ = struct.Struct(">Q")
LOOPBACK = "tcp://127.0.0.1:*"


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``cond`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.002)


def last_endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


class _Thread:
    """A helper thread with a control socket, so close() wakes it at once."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        addr = f"inproc://helper-{id(self)}"
        self._ctl_r = ctx.socket(zmq.PAIR)
        self._ctl_r.bind(addr)
        self._ctl_w = ctx.socket(zmq.PAIR)
        self._ctl_w.connect(addr)
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        self._ctl_w.send(b"stop")
        self._thread.join(5)
        if self._thread.is_alive():
            raise AssertionError("helper thread did not stop")
        self._ctl_w.close(0)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LossyForwarder(_Thread):
    """SUB from ``upstream`` and re-PUB on a fresh loopback port, dropping the seqs in
    :attr:`drop` (a set the test may fill at any time)."""

    def __init__(self, upstream: str, drop: Iterable[int] = ()) -> None:
        ctx = zmq.Context.instance()
        super().__init__(ctx)
        self.drop: set[int] = set(drop)
        self.dropped: list[int] = []
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind(LOOPBACK)
        self.endpoint = last_endpoint(self._pub)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._ctl_r, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._ctl_r in ready:
                    return
                frames = self._sub.recv_multipart()
                seq = SEQ.unpack(frames[1])[0]
                if seq in self.drop:
                    self.dropped.append(seq)
                    continue
                self._pub.send_multipart(frames)
        finally:
            for s in (self._sub, self._pub, self._ctl_r):
                s.close(0)


class GatedReplayProxy(_Thread):
    """A replay endpoint that forwards each request to ``upstream`` only once :attr:`gate`
    is set, so a test can make live messages arrive while a replay is outstanding."""

    def __init__(self, upstream: str) -> None:
        ctx = zmq.Context.instance()
        super().__init__(ctx)
        self.gate = threading.Event()
        self.requests: list[int] = []
        self._front = ctx.socket(zmq.ROUTER)
        self._front.bind(LOOPBACK)
        self.endpoint = last_endpoint(self._front)
        self._upstream = upstream
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._ctl_r, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._ctl_r in ready:
                    return
                ident, _, seq8 = self._front.recv_multipart()
                self.requests.append(SEQ.unpack(seq8)[0])
                while not self.gate.wait(0.01):
                    if self._ctl_r.poll(0):
                        return
                back = self._ctx.socket(zmq.DEALER)
                back.connect(self._upstream)
                back.send_multipart([b"", seq8])
                while True:
                    if not back.poll(5000):
                        break
                    frames = back.recv_multipart()
                    self._front.send_multipart([ident, *frames])
                    if SEQ.unpack(frames[2])[0] == END_SEQ:
                        break
                back.close(0)
        finally:
            self._front.close(0)
            self._ctl_r.close(0)


class RawPub:
    """A bare PUB socket on a loopback port, to send any frames at all."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(LOOPBACK)
        self.endpoint = last_endpoint(self.sock)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def send_batch(self, seq: int, events: list[Any], rank: int | None = 0) -> None:
        self.send([b"", SEQ.pack(seq), encode_batch(KVEventBatch(time.time(), events, rank))])

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> RawPub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Harness:
    """Common view of a running subscriber for scenario tests."""

    items: list[StreamItem]

    def stats(self) -> dict[str, StreamStats]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def batches(self, stream: str | None = None) -> list[StreamBatch]:
        return [
            i
            for i in list(self.items)
            if type(i) is StreamBatch and (stream is None or i.stream == stream)
        ]

    def seqs(self, stream: str | None = None) -> list[int]:
        return [b.seq for b in self.batches(stream)]

    def signals(self, stream: str | None = None) -> list[Any]:
        kinds = (GapUnrecoverable, StreamReset, MalformedMessage, RankMismatch)
        return [
            i
            for i in list(self.items)
            if type(i) in kinds and (stream is None or i.stream == stream)
        ]

    def wait_seq(self, seq: int, stream: str | None = None, timeout: float = 10.0) -> None:
        wait_for(lambda: seq in self.seqs(stream), timeout, f"seq {seq} on {stream}")

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncHarness(Harness):
    def __init__(self, specs: list[StreamSpec], **kw: Any) -> None:
        self.items = []
        self.sub = Subscriber(specs, on_item=self.items.append, **kw)
        self.endpoints = self.sub.endpoints

    def stats(self) -> dict[str, StreamStats]:
        return self.sub.stats()

    def close(self) -> None:
        self.sub.close()
        assert not self.sub._thread.is_alive()


class AsyncHarness(Harness):
    """An AsyncSubscriber read with ``async for`` on its own ``asyncio.run`` loop."""

    def __init__(self, specs: list[StreamSpec], **kw: Any) -> None:
        self.items = []
        self._specs, self._kw = specs, kw
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self.sub = AsyncSubscriber(self._specs, **self._kw)
            await self.sub.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self.endpoints = self.sub.endpoints
        self._reader = asyncio.current_task()
        self._ready.set()
        async for item in self.sub:
            self.items.append(item)

    def stats(self) -> dict[str, StreamStats]:
        return self.sub.stats()

    def close(self) -> None:
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self.sub.close(), loop)
            fut.result(5)
        self._thread.join(5)
        assert not self._thread.is_alive(), "async subscriber loop did not stop"


HARNESSES = {"sync": SyncHarness, "async": AsyncHarness}


def publish_until(publish: Callable[[], Any], cond: Callable[[], Any], timeout: float = 15) -> Any:
    """Call ``publish`` until ``cond`` holds, waiting briefly after each call: how a test gets
    past the ZMQ slow-joiner (a SUB misses what is sent before it is connected). Returns the
    last value ``publish`` returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = publish()
        with contextlib.suppress(AssertionError):
            wait_for(cond, 0.05)
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing arrived within {timeout}s")


def prime(publish: Callable[[], int], h: Harness, stream: str | None = None) -> int:
    """Publish until the subscriber sees something, then until it has caught up with the
    last batch published; returns that seq."""
    seq = publish_until(publish, lambda: h.batches(stream))
    h.wait_seq(seq, stream)
    return seq


def try_publisher(endpoint: str, **kw: Any) -> EventPublisher | None:
    try:
        return EventPublisher(endpoint, **kw)
    except EndpointError:
        return None


def dp_publishers(ranks: int) -> tuple[int, list[EventPublisher]]:
    """Publishers for DP ranks 0..ranks-1 on consecutive loopback ports (retried on clash)."""
    for _ in range(20):
        with EventPublisher(LOOPBACK) as probe:
            base = int(probe.endpoint.rsplit(":", 1)[1])
        pubs: list[EventPublisher] = []
        for r in range(ranks):
            p = try_publisher(f"tcp://127.0.0.1:{base}", data_parallel_rank=r, bind=True)
            if p is None:
                break
            pubs.append(p)
        if len(pubs) == ranks:
            return base, pubs
        for p in pubs:
            p.close()
    raise AssertionError("no consecutive free ports found")
