"""Subscribe to the KV events of any number of vLLM replicas and DP ranks (spec §3).

One :class:`Subscriber` (a background thread) or :class:`AsyncSubscriber` (asyncio) reads all
streams in a single ZeroMQ poller. Each stream is one publisher, described by a
:class:`~events.stream.StreamSpec`. For every stream, items arrive in sequence order: a
:class:`~events.stream.StreamBatch` per batch, or a typed signal when something happened to
the stream that a consumer must know about:

* :class:`~events.stream.GapUnrecoverable`: batches were lost and replay could not bring
  them back; the view of that stream is incomplete (mark it untrusted);
* :class:`~events.stream.StreamReset`: the replica restarted with an empty cache;
* :class:`~events.stream.RankMismatch`: the batch came from another DP rank and was dropped;
* :class:`~events.stream.MalformedMessage`: a message could not be used (counted, skipped).

Gaps are repaired transparently from the publisher's replay ring over a DEALER socket; the
rules are in :mod:`events.stream`. Counters per stream: :meth:`Subscriber.stats`.

Minimal example (a callback is also accepted, ``Subscriber(specs, on_item=...)``)::

    from events import StreamBatch, StreamSpec, Subscriber

    spec = StreamSpec("replica-a", "tcp://replica-a:5557", replay_endpoint="tcp://replica-a:5558")
    with Subscriber([spec]) as sub:
        for item in sub:                       # blocks; ends when sub.close() is called
            if isinstance(item, StreamBatch):
                for event in item.batch.events:
                    print(item.stream, item.seq, event)
            else:
                print("signal:", item)

asyncio::

    async with AsyncSubscriber([spec]) as sub:
        async for item in sub:
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import zmq
import zmq.asyncio

from events.endpoints import bind_or_connect, offset_endpoint_port, validate_endpoint
from events.stream import (
    StreamItem,
    StreamProcessor,
    StreamSpec,
    StreamStats,
)

__all__ = ["AsyncSubscriber", "Subscriber", "dp_stream_specs"]

log = logging.getLogger(__name__)

_SEQ = struct.Struct(">Q")
_LIVE = 0
_REPLAY = 1
_BURST = 256  # messages read from one socket before looking at the others
_ids = itertools.count()


def dp_stream_specs(
    name: str,
    endpoint: str,
    replay_endpoint: str | None = None,
    *,
    ranks: Iterable[int],
    topic: str = "",
    bind: bool = False,
) -> list[StreamSpec]:
    """One :class:`StreamSpec` per data-parallel rank of a replica, with the endpoints
    offset the way vLLM offsets them (:func:`~events.endpoints.offset_endpoint_port`) and
    the rank checked. ``endpoint``/``replay_endpoint`` are rank 0's addresses; streams are
    named ``"<name>/dp<rank>"``."""
    return [
        StreamSpec(
            f"{name}/dp{rank}",
            offset_endpoint_port(endpoint, rank),
            offset_endpoint_port(replay_endpoint, rank) if replay_endpoint else None,
            topic=topic,
            dp_rank=rank,
            bind=bind,
        )
        for rank in ranks
    ]


def _check_specs(streams: Iterable[StreamSpec]) -> list[StreamSpec]:
    specs = list(streams)
    if not specs:
        raise ValueError("no streams given; pass at least one StreamSpec")
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, StreamSpec):
            raise TypeError(f"expected StreamSpec, got {type(spec).__name__}")
        if spec.name in seen:
            raise ValueError(f"stream name {spec.name!r} is used twice; names must be unique")
        seen.add(spec.name)
        validate_endpoint(spec.endpoint, what=f"stream {spec.name!r} endpoint")
        if spec.replay_endpoint is not None:
            validate_endpoint(spec.replay_endpoint, what=f"stream {spec.name!r} replay_endpoint")
    return specs


class _Core:
    """What the sync and asyncio subscribers share: the processors, the replay deadlines,
    and the bookkeeping of which socket belongs to which stream. No socket I/O here."""

    def __init__(self, specs: list[StreamSpec], replay_timeout: float) -> None:
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be > 0 seconds, got {replay_timeout}")
        self.specs = specs
        self.procs = [StreamProcessor(s) for s in specs]
        self.replay_timeout = replay_timeout
        self.deadlines: dict[int, float] = {}
        self.lock = threading.Lock()

    def next_timeout_ms(self, mono: float) -> int | None:
        if not self.deadlines:
            return None
        return max(0, int((min(self.deadlines.values()) - mono) * 1000) + 1)

    def expired(self, mono: float) -> list[int]:
        return [i for i, d in self.deadlines.items() if d <= mono]

    def stats(self) -> dict[str, StreamStats]:
        with self.lock:
            return {p.name: p.stats.copy() for p in self.procs}

    def count_consumer_error(self, item: StreamItem) -> None:
        name = item.stream
        for p in self.procs:
            if p.name == name:
                with self.lock:
                    p.stats.consumer_errors += 1
                return


class Subscriber:
    """Receive KV events from many streams on one background thread.

    Items (:data:`~events.stream.StreamItem`) are handed to ``on_item`` on that thread when
    a callback is given (an exception it raises is logged and counted in
    ``consumer_errors``; delivery goes on), otherwise they are queued for :meth:`get` and
    iteration. With a queue of ``max_pending`` items the thread waits for the consumer
    rather than drop anything; the ZeroMQ high-water mark and the replay ring then absorb
    the backlog.

    Args:
        streams: the publishers to follow (names must be unique).
        on_item: optional callback, called on the subscriber thread.
        replay_timeout: seconds to wait for a replay's end marker before declaring the hole
            unrecoverable.
        rcvhwm: high-water mark of each SUB socket, in messages.
        max_pending: queue bound when no callback is given.
        context: ZeroMQ context (default: the process-wide instance).

    Attributes:
        endpoints: stream name -> address in use (resolved when the stream binds).
    """

    def __init__(
        self,
        streams: Iterable[StreamSpec],
        on_item: Callable[[StreamItem], Any] | None = None,
        *,
        replay_timeout: float = 2.0,
        rcvhwm: int = 100_000,
        max_pending: int = 100_000,
        context: zmq.Context | None = None,
    ) -> None:
        specs = _check_specs(streams)
        self._core = _Core(specs, replay_timeout)
        self._on_item = on_item
        self._queue: queue.Queue[StreamItem | None] = queue.Queue(max_pending)
        self._ctx = context if context is not None else zmq.Context.instance()
        self._stopping = threading.Event()
        self._closed = False
        self._subs: list[zmq.Socket] = []
        self._dealers: dict[int, zmq.Socket] = {}
        self.endpoints: dict[str, str] = {}
        ctl_addr = f"inproc://kvrouter-subscriber-{id(self)}-{next(_ids)}"
        self._ctl_recv = self._ctx.socket(zmq.PAIR)
        self._ctl_send = self._ctx.socket(zmq.PAIR)
        try:
            self._ctl_recv.bind(ctl_addr)
            self._ctl_send.connect(ctl_addr)
            for spec in specs:
                sock = self._ctx.socket(zmq.SUB)
                self._subs.append(sock)
                sock.setsockopt(zmq.RCVHWM, rcvhwm)
                sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
                self.endpoints[spec.name] = bind_or_connect(sock, spec.endpoint, bind=spec.bind)
        except Exception:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    # -- consumer API -------------------------------------------------------------------

    def stats(self) -> dict[str, StreamStats]:
        """A snapshot of every stream's counters, by stream name."""
        return self._core.stats()

    @property
    def streams(self) -> list[StreamSpec]:
        return list(self._core.specs)

    def get(self, timeout: float | None = None) -> StreamItem | None:
        """The next item, waiting up to ``timeout`` seconds (forever if ``None``); ``None``
        on timeout or once the subscriber is closed and drained."""
        if self._on_item is not None:
            raise RuntimeError("items go to the on_item callback; get() is for queue mode")
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self._queue.put(None)  # keep the end mark for other readers
        return item

    def __iter__(self) -> Iterator[StreamItem]:
        while True:
            item = self.get()
            if item is None:
                return
            yield item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket. Items already queued stay readable."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        with contextlib.suppress(zmq.ZMQError):
            self._ctl_send.send(b"stop")
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("subscriber thread did not stop within %.1fs", timeout)
            return
        self._close_sockets()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- thread -------------------------------------------------------------------------

    def _run(self) -> None:
        core = self._core
        poller = zmq.Poller()
        poller.register(self._ctl_recv, zmq.POLLIN)
        where: dict[zmq.Socket, tuple[int, int]] = {}
        for i, sock in enumerate(self._subs):
            poller.register(sock, zmq.POLLIN)
            where[sock] = (i, _LIVE)
        out: list[StreamItem] = []
        try:
            while True:
                ready = poller.poll(core.next_timeout_ms(time.monotonic()))
                for sock, _ in ready:
                    if sock is self._ctl_recv:
                        return
                    key = where.get(sock)
                    if key is None:  # a replay socket closed earlier in this round
                        continue
                    idx, kind = key
                    proc = core.procs[idx]
                    for _ in range(_BURST):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        now = time.time()
                        with core.lock:
                            if kind == _LIVE:
                                start = proc.on_live(frames, now, out)
                            else:
                                start = proc.on_replay(frames, now, out)
                        self._replay_io(idx, start, poller, where, out)
                        if kind == _REPLAY and self._dealers.get(idx) is not sock:
                            break  # that socket was just closed
                for idx in core.expired(time.monotonic()):
                    with core.lock:
                        start = core.procs[idx].on_replay_failed("replay_timeout", out)
                    self._replay_io(idx, start, poller, where, out)
                if out:
                    if not self._deliver(out):
                        return
                    out = []
        except Exception:  # pragma: no cover - a bug; do not die silently
            log.exception("KV-event subscriber thread failed")
            raise

    def _replay_io(
        self,
        idx: int,
        start: int | None,
        poller: zmq.Poller,
        where: dict[zmq.Socket, tuple[int, int]],
        out: list[StreamItem],
    ) -> None:
        """Open, replace or close stream ``idx``'s replay DEALER to match its processor."""
        core = self._core
        proc = core.procs[idx]
        while True:
            old = self._dealers.get(idx)
            if old is not None and (start is not None or not proc.replaying):
                # A fresh socket per replay: late replies to an abandoned request can't mix.
                poller.unregister(old)
                del where[old]
                del self._dealers[idx]
                old.close(linger=0)
                core.deadlines.pop(idx, None)
            if start is None:
                return
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 0)
            replay_ep = proc.spec.replay_endpoint
            try:
                if replay_ep is None:  # unreachable: the sequencer never asks without one
                    raise zmq.ZMQError(msg="no replay endpoint")
                bind_or_connect(dealer, replay_ep, bind=False)
                dealer.send_multipart((b"", _SEQ.pack(start)))
            except (zmq.ZMQError, ValueError) as exc:
                dealer.close(linger=0)
                log.warning("replay request to %s failed: %s", replay_ep, exc)
                with core.lock:
                    start = proc.on_replay_failed("replay_failed", out)
                continue
            self._dealers[idx] = dealer
            where[dealer] = (idx, _REPLAY)
            poller.register(dealer, zmq.POLLIN)
            core.deadlines[idx] = time.monotonic() + core.replay_timeout
            return

    def _deliver(self, items: list[StreamItem]) -> bool:
        cb = self._on_item
        if cb is not None:
            for item in items:
                try:
                    cb(item)
                except Exception:
                    log.exception("on_item callback raised for %r", type(item).__name__)
                    self._core.count_consumer_error(item)
            return True
        q = self._queue
        for item in items:
            while True:
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    if self._stopping.is_set():
                        return False
        return True

    def _close_sockets(self) -> None:
        for sock in [*self._subs, *self._dealers.values(), self._ctl_recv, self._ctl_send]:
            sock.close(linger=0)
        self._dealers.clear()


class AsyncSubscriber:
    """The asyncio twin of :class:`Subscriber`, on ``zmq.asyncio`` sockets.

    Use ``async with AsyncSubscriber(specs) as sub: async for item in sub: ...``, or pass
    ``on_item`` (a plain function, called on the event loop). Must be started and closed on
    the same running event loop; :meth:`start` binds and connects (raising for bad
    addresses) and launches the reader task.
    """

    def __init__(
        self,
        streams: Iterable[StreamSpec],
        on_item: Callable[[StreamItem], Any] | None = None,
        *,
        replay_timeout: float = 2.0,
        rcvhwm: int = 100_000,
        max_pending: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        specs = _check_specs(streams)
        self._core = _Core(specs, replay_timeout)
        self._on_item = on_item
        self._rcvhwm = rcvhwm
        self._max_pending = max_pending
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._queue: asyncio.Queue[StreamItem | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._subs: list[zmq.asyncio.Socket] = []
        self._dealers: dict[int, zmq.asyncio.Socket] = {}
        self._closed = False
        self.endpoints: dict[str, str] = {}

    def stats(self) -> dict[str, StreamStats]:
        """A snapshot of every stream's counters, by stream name."""
        return self._core.stats()

    async def start(self) -> AsyncSubscriber:
        if self._task is not None:
            return self
        self._queue = asyncio.Queue(self._max_pending)
        try:
            for spec in self._core.specs:
                sock = self._ctx.socket(zmq.SUB)
                self._subs.append(sock)
                sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
                sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
                self.endpoints[spec.name] = bind_or_connect(sock, spec.endpoint, bind=spec.bind)
        except Exception:
            self._close_sockets()
            raise
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def get(self, timeout: float | None = None) -> StreamItem | None:
        """The next item, or ``None`` on timeout or after :meth:`close`."""
        if self._queue is None:
            raise RuntimeError("call start() (or use 'async with') before reading items")
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        if item is None:
            self._queue.put_nowait(None)
        return item

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StreamItem]:
        while True:
            item = await self.get()
            if item is None:
                return
            yield item

    async def close(self) -> None:
        """Cancel the reader task and close every socket."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._close_sockets()
        if self._queue is not None:
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(None)

    async def __aenter__(self) -> AsyncSubscriber:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self) -> None:
        core = self._core
        poller = zmq.asyncio.Poller()
        where: dict[Any, tuple[int, int]] = {}
        for i, sock in enumerate(self._subs):
            poller.register(sock, zmq.POLLIN)
            where[sock] = (i, _LIVE)
        out: list[StreamItem] = []
        while True:
            ready = await poller.poll(core.next_timeout_ms(time.monotonic()))
            for sock, _ in ready:
                key = where.get(sock)
                if key is None:
                    continue
                idx, kind = key
                proc = core.procs[idx]
                for _ in range(_BURST):
                    try:
                        frames = await sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    now = time.time()
                    with core.lock:
                        if kind == _LIVE:
                            start = proc.on_live(frames, now, out)
                        else:
                            start = proc.on_replay(frames, now, out)
                    await self._replay_io(idx, start, poller, where, out)
                    if kind == _REPLAY and self._dealers.get(idx) is not sock:
                        break
            for idx in core.expired(time.monotonic()):
                with core.lock:
                    start = core.procs[idx].on_replay_failed("replay_timeout", out)
                await self._replay_io(idx, start, poller, where, out)
            if out:
                await self._deliver(out)
                out = []

    async def _replay_io(
        self,
        idx: int,
        start: int | None,
        poller: zmq.asyncio.Poller,
        where: dict[Any, tuple[int, int]],
        out: list[StreamItem],
    ) -> None:
        core = self._core
        proc = core.procs[idx]
        while True:
            old = self._dealers.get(idx)
            if old is not None and (start is not None or not proc.replaying):
                poller.unregister(old)
                del where[old]
                del self._dealers[idx]
                old.close(linger=0)
                core.deadlines.pop(idx, None)
            if start is None:
                return
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 0)
            replay_ep = proc.spec.replay_endpoint
            try:
                if replay_ep is None:
                    raise zmq.ZMQError(msg="no replay endpoint")
                bind_or_connect(dealer, replay_ep, bind=False)
                await dealer.send_multipart((b"", _SEQ.pack(start)))
            except (zmq.ZMQError, ValueError) as exc:
                dealer.close(linger=0)
                log.warning("replay request to %s failed: %s", replay_ep, exc)
                with core.lock:
                    start = proc.on_replay_failed("replay_failed", out)
                continue
            self._dealers[idx] = dealer
            where[dealer] = (idx, _REPLAY)
            poller.register(dealer, zmq.POLLIN)
            core.deadlines[idx] = time.monotonic() + core.replay_timeout
            return

    async def _deliver(self, items: list[StreamItem]) -> None:
        cb = self._on_item
        if cb is not None:
            for item in items:
                try:
                    cb(item)
                except Exception:
                    log.exception("on_item callback raised for %r", type(item).__name__)
                    self._core.count_consumer_error(item)
            return
        q = self._queue
        if q is None:  # pragma: no cover - start() sets it before the task runs
            return
        for item in items:
            await q.put(item)

    def _close_sockets(self) -> None:
        for sock in [*self._subs, *self._dealers.values()]:
            sock.close(linger=0)
        self._dealers.clear()
