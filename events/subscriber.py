"""Subscribe to the KV events of any number of vLLM replicas and DP ranks (spec §3).

Each stream is one publisher, described by a :class:`~events.stream.StreamSpec`. For every
stream, items arrive in sequence order: a :class:`~events.stream.StreamBatch` per batch, or a
typed signal when something happened to the stream that a consumer must know about:

* :class:`~events.stream.GapUnrecoverable`: batches were lost and replay could not bring
  them back; the view of that stream is incomplete (mark it untrusted);
* :class:`~events.stream.StreamReset`: the replica restarted with an empty cache;
* :class:`~events.stream.RankMismatch`: the batch came from another DP rank and was dropped;
* :class:`~events.stream.MalformedMessage`: a message could not be used (counted, skipped).

Gaps are repaired transparently from the publisher's replay ring over a DEALER socket; the
rules are in :mod:`events.stream`. Counters per stream: :meth:`Subscriber.stats`.

There is one implementation, an asyncio core that reads every stream's sockets in a single
``zmq.asyncio`` poller. :class:`AsyncSubscriber` runs it on the caller's event loop;
:class:`Subscriber` runs it on a private event loop in a background thread and hands the
items to the caller's thread in whole batches, so the two can never drift apart. If the core
stops on an unexpected error, :class:`SubscriberError` is raised to the consumer (see there).

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
import logging
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from events.endpoints import bind_or_connect, offset_endpoint_port, validate_endpoint
from events.stream import (
    StreamItem,
    StreamProcessor,
    StreamSpec,
    StreamStats,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "AsyncSubscriber",
    "Subscriber",
    "SubscriberError",
    "dp_stream_specs",
]

log = logging.getLogger(__name__)

_SEQ = struct.Struct(">Q")
_LIVE = 0
_REPLAY = 1
_MONITOR = 2  # a connecting SUB's socket monitor (connections and disconnections)
_REPLAY_MONITOR = 3  # a replay DEALER's socket monitor (its connection dropping)
_BURST = 256  # messages read from one socket before looking at the others
#: Seconds :class:`Subscriber` waits for its thread to open the sockets; only a wedged
#: machine takes more than milliseconds.
_START_TIMEOUT = 30.0
#: Default bound on one received frame, in bytes. vLLM's largest batches (a long prefill's
#: stores: token ids and hashes) are a few MiB; a frame far beyond that is hostile or broken.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: Where the core hands each poll round's items when there is no ``on_item`` callback.
Sink = Callable[[list[StreamItem]], Awaitable[None]]
#: The reader task's sockets: asyncio socket -> (stream index, _LIVE or _REPLAY, a plain
#: shadow of the same libzmq socket). The asyncio poller says which are ready; the shadow
#: drains them without a Future per message (the asyncio socket's own non-blocking receive
#: does the same through a private shadow), a few microseconds per message on hot streams.
_Where = dict[Any, tuple[int, int, zmq.Socket]]


class SubscriberError(RuntimeError):
    """The subscriber's reader stopped on an unexpected error, a bug: no more items come.

    Raised to the consumer, never swallowed: by :meth:`Subscriber.get`, iteration and their
    asyncio twins once the items delivered before the failure have been read, and by
    ``close()`` when nothing had raised it before (the only place a callback consumer can
    learn of it). ``__cause__`` is the original exception; its traceback is also logged.
    """


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
    """The asyncio engine behind both subscribers.

    It owns the sockets (a SUB per stream, a DEALER per replay in flight), reads them all in
    one ``zmq.asyncio`` poller, drives each stream's :class:`StreamProcessor`, opens replays
    and times them out, keeps the counters, and closes everything. Items go to ``on_item``
    when one is given, else to ``sink``: the one place where the asyncio and the threaded
    frontends differ (an asyncio queue, or a hand-off to another thread).

    :meth:`open`, :meth:`start` and :meth:`close` run on the loop that runs the reader task;
    :meth:`stats` may be called from any thread (the processors are read and written under
    :attr:`lock`).
    """

    def __init__(
        self,
        specs: list[StreamSpec],
        *,
        replay_timeout: float,
        rcvhwm: int,
        max_message_bytes: int | None,
        context: zmq.asyncio.Context,
        on_item: Callable[[StreamItem], Any] | None,
        sink: Sink | None,
    ) -> None:
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be > 0 seconds, got {replay_timeout}")
        if max_message_bytes is not None and max_message_bytes <= 0:
            raise ValueError(
                f"max_message_bytes must be > 0 (or None for no bound), got {max_message_bytes}"
            )
        self.specs = specs
        self.procs = [StreamProcessor(s) for s in specs]
        self._by_name = {p.name: p for p in self.procs}
        self.replay_timeout = replay_timeout
        self.deadlines: dict[int, float] = {}
        self.lock = threading.Lock()
        self.endpoints: dict[str, str] = {}
        self._rcvhwm = rcvhwm
        # ZMQ_MAXMSGSIZE: libzmq reads a frame's size header before allocating its buffer and
        # drops the connection instead when it is over the bound, so a hostile or corrupt size
        # can never make this process allocate it (-1: no bound). The lost message is a
        # sequence gap like any other. Not enforced on inproc://, where no bytes are decoded.
        self._maxmsgsize = -1 if max_message_bytes is None else max_message_bytes
        self._ctx = context
        self._on_item = on_item
        if on_item is not None:
            self._deliver: Sink = self._call_back
        elif sink is not None:
            self._deliver = sink
        else:  # pragma: no cover - both frontends pass one
            raise TypeError("_Core needs on_item or sink")
        self._subs: list[zmq.asyncio.Socket] = []
        self._monitors: dict[int, zmq.asyncio.Socket] = {}
        self._dealers: dict[int, zmq.asyncio.Socket] = {}
        self._dealer_monitors: dict[int, zmq.asyncio.Socket] = {}
        self._task: asyncio.Task[None] | None = None
        #: The exception the reader task died of, if it did.
        self.failure: BaseException | None = None
        self._failure_raised = False

    # -- lifecycle (on the loop) --------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._task is not None

    def open(self) -> None:
        """Bind or connect every stream's SUB socket; raise (with none left open) if one
        cannot be, so a bad address fails where the subscriber is created."""
        try:
            for spec in self.specs:
                sock = self._ctx.socket(zmq.SUB)
                self._subs.append(sock)
                sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
                sock.setsockopt(zmq.MAXMSGSIZE, self._maxmsgsize)
                sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
                if not spec.bind and not spec.endpoint.startswith("inproc://"):
                    # Before connecting: a connection made at once must not go unseen. A
                    # handshake, not a TCP connect: a loopback connect to a free port can
                    # meet itself (TCP simultaneous open), which no publisher answers.
                    idx = len(self._subs) - 1
                    self._monitors[idx] = sock.get_monitor_socket(
                        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                    )
                    self.procs[idx].stats.connected = False
                self.endpoints[spec.name] = bind_or_connect(sock, spec.endpoint, bind=spec.bind)
        except Exception:
            self._close_sockets()
            raise

    def start(self, on_failure: Callable[[], None] | None = None) -> None:
        """Launch the reader task; ``on_failure`` is called (on the loop) if it dies, after
        :attr:`failure` is set, so the frontend can wake its readers."""
        task = asyncio.get_running_loop().create_task(self._run())

        def finished(t: asyncio.Task[None]) -> None:
            if t.cancelled():
                return
            exc = t.exception()
            if exc is None:  # pragma: no cover - _run only ends by cancellation or error
                return
            self.failure = exc
            log.error("KV-event subscriber stopped on an unexpected error", exc_info=exc)
            if on_failure is not None:
                on_failure()

        task.add_done_callback(finished)
        self._task = task

    async def close(self) -> None:
        """Stop the reader task and close every socket."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # does not raise: a failure is in self.failure
        self._close_sockets()

    def raise_failure(self, *, unless_raised: bool = False) -> None:
        """Raise :class:`SubscriberError` if the reader task died; with ``unless_raised``,
        only if it has not been raised to the consumer yet (what ``close()`` does)."""
        exc = self.failure
        if exc is None or (unless_raised and self._failure_raised):
            return
        self._failure_raised = True
        raise SubscriberError(
            f"the KV-event subscriber stopped on an unexpected error ({exc!r}) and delivers "
            "nothing more; close it and create a new one, and report the traceback logged "
            "by events.subscriber"
        ) from exc

    # -- counters (any thread) ----------------------------------------------------------

    def stats(self) -> dict[str, StreamStats]:
        with self.lock:
            return {p.name: p.stats.copy() for p in self.procs}

    def _count_consumer_error(self, item: StreamItem) -> None:
        proc = self._by_name.get(item.stream)
        if proc is not None:
            with self.lock:
                proc.stats.consumer_errors += 1

    # -- the reader task ----------------------------------------------------------------

    async def _run(self) -> None:
        poller = zmq.asyncio.Poller()
        where: _Where = {}
        for i, sock in enumerate(self._subs):
            poller.register(sock, zmq.POLLIN)
            where[sock] = (i, _LIVE, zmq.Socket.shadow(sock.underlying))
        for i, mon in self._monitors.items():
            poller.register(mon, zmq.POLLIN)
            where[mon] = (i, _MONITOR, zmq.Socket.shadow(mon.underlying))
        out: list[StreamItem] = []
        procs, lock, dealers = self.procs, self.lock, self._dealers
        for idx, proc in enumerate(procs):
            # replay_from_start: read the ring at once, so attaching to an idle replica
            # yields its state (or the news that the ring lost its start) without traffic.
            with lock:
                start = proc.attach()
            if start is not None:
                await self._replay_io(idx, start, poller, where, out)
        while True:
            ready = await poller.poll(self._next_timeout_ms(time.monotonic()))
            for sock, _ in ready:
                key = where.get(sock)
                if key is None:  # a replay socket closed earlier in this round
                    continue
                idx, kind, reader = key
                if kind == _MONITOR:
                    self._on_monitor(idx, reader)
                    continue
                if kind == _REPLAY_MONITOR:
                    if _dropped(reader):
                        start = self._replay_dropped(idx, out)
                        await self._replay_io(idx, start, poller, where, out)
                    continue
                proc = procs[idx]
                for _ in range(_BURST):
                    try:
                        frames = reader.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    now = time.time()
                    with lock:
                        if kind == _LIVE:
                            start = proc.on_live(frames, now, out)
                            replied = False
                        else:
                            replies = proc.replay_replies
                            start = proc.on_replay(frames, now, out)
                            replied = proc.replay_replies != replies
                    if start is not None or idx in dealers:
                        await self._replay_io(idx, start, poller, where, out)
                    if kind == _REPLAY:
                        if dealers.get(idx) is not sock:
                            break  # that socket was just closed
                        if replied:
                            # An idle deadline: a long replay that keeps delivering is healthy
                            # (a 10,000-batch ring takes seconds), only silence means it is
                            # stuck. Malformed replies and batches it did not need do not
                            # count, so junk can't keep a replay (and the live messages it
                            # holds back) alive.
                            self.deadlines[idx] = time.monotonic() + self.replay_timeout
            mono = time.monotonic()
            for idx in [i for i, d in self.deadlines.items() if d <= mono]:
                with lock:
                    start = procs[idx].on_replay_failed("replay_timeout", out)
                await self._replay_io(idx, start, poller, where, out)
            if out:
                await self._deliver(out)  # the sink owns the list from here
                out = []

    def _on_monitor(self, idx: int, monitor: zmq.Socket) -> None:
        """Track a connecting SUB's connection (``StreamStats.connected``: a ZMTP handshake
        succeeded and no drop since) and re-open it when it dropped.

        libzmq reconnects by itself after a network error, but not after a protocol error,
        and a frame over ``max_message_bytes`` is one: without this, one oversize message
        would silence the stream for good. Reconnecting after an ordinary drop too is
        harmless (it only replaces libzmq's own retry). What was lost meanwhile is a
        sequence gap, replayed or reported as usual."""
        drops = 0
        connected: bool | None = None
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # pragma: no cover - libzmq's own two-frame format
                continue
            if event == zmq.EVENT_DISCONNECTED:
                drops += 1
                connected = False
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected = True
        proc = self.procs[idx]
        if not drops:
            if connected is not None:
                with self.lock:
                    proc.stats.connected = connected
            return
        with self.lock:
            proc.stats.disconnects += drops
            proc.stats.connected = False  # until the new connection's handshake
        sock, endpoint = self._subs[idx], self.endpoints[proc.name]
        log.warning(
            "stream %s: connection to %s dropped (publisher gone, or a frame over "
            "max_message_bytes=%d); reconnecting",
            proc.name,
            endpoint,
            self._maxmsgsize,
        )
        with contextlib.suppress(zmq.ZMQError):  # ENOENT: libzmq already forgot it
            sock.disconnect(endpoint)
        sock.connect(endpoint)

    def _replay_dropped(self, idx: int, out: list[StreamItem]) -> int | None:
        """The replay DEALER's connection dropped: the ring's publisher went away, or one of
        its replies was over ``max_message_bytes`` (libzmq then drops the connection, and a
        replay of the same ring would meet the same frame). Nothing more can come on that
        request, so the hole is reported now (``replay_dropped``), not at the idle
        deadline; the live messages it held back go on."""
        proc = self.procs[idx]
        log.warning(
            "stream %s: the replay connection to %s dropped (publisher gone, or a reply over "
            "max_message_bytes=%d); its gap is lost",
            proc.name, proc.spec.replay_endpoint, self._maxmsgsize,
        )  # fmt: skip
        with self.lock:
            proc.stats.replay_drops += 1
            return proc.on_replay_failed("replay_dropped", out)

    def _next_timeout_ms(self, mono: float) -> int | None:
        if not self.deadlines:
            return None
        return max(0, int((min(self.deadlines.values()) - mono) * 1000) + 1)

    async def _replay_io(
        self,
        idx: int,
        start: int | None,
        poller: zmq.asyncio.Poller,
        where: _Where,
        out: list[StreamItem],
    ) -> None:
        """Open, replace or close stream ``idx``'s replay DEALER to match its processor."""
        proc = self.procs[idx]
        while True:
            old = self._dealers.get(idx)
            if old is not None and (start is not None or not proc.replaying):
                # A fresh socket per replay: late replies to an abandoned request can't mix.
                poller.unregister(old)
                del where[old]
                del self._dealers[idx]
                mon = self._dealer_monitors.pop(idx)
                poller.unregister(mon)
                del where[mon]
                old.disable_monitor()
                mon.close(linger=0)
                old.close(linger=0)
                self.deadlines.pop(idx, None)
            if start is None:
                return
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self._maxmsgsize)
            # Before connecting, so a drop is never missed: a reply over MAXMSGSIZE drops the
            # connection, and the replay would otherwise be seen stuck only at its deadline.
            mon = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            replay_ep = proc.spec.replay_endpoint
            try:
                if replay_ep is None:  # unreachable: the sequencer never asks without one
                    raise zmq.ZMQError(msg="no replay endpoint")
                bind_or_connect(dealer, replay_ep, bind=False)
                await dealer.send_multipart((b"", _SEQ.pack(start)))
            except (zmq.ZMQError, ValueError) as exc:
                dealer.disable_monitor()
                mon.close(linger=0)
                dealer.close(linger=0)
                log.warning("replay request to %s failed: %s", replay_ep, exc)
                with self.lock:
                    start = proc.on_replay_failed("replay_failed", out)
                continue
            self._dealers[idx] = dealer
            where[dealer] = (idx, _REPLAY, zmq.Socket.shadow(dealer.underlying))
            poller.register(dealer, zmq.POLLIN)
            self._dealer_monitors[idx] = mon
            where[mon] = (idx, _REPLAY_MONITOR, zmq.Socket.shadow(mon.underlying))
            poller.register(mon, zmq.POLLIN)
            self.deadlines[idx] = time.monotonic() + self.replay_timeout
            return

    async def _call_back(self, items: list[StreamItem]) -> None:
        """Callback mode: a consumer's exception is logged and counted, delivery goes on."""
        cb = self._on_item
        if cb is None:  # pragma: no cover - chosen only when there is a callback
            return
        for item in items:
            try:
                cb(item)
            except Exception:
                log.exception("on_item callback raised for %r", type(item).__name__)
                self._count_consumer_error(item)

    def _close_sockets(self) -> None:
        for i, mon in self._monitors.items():
            self._subs[i].disable_monitor()
            mon.close(linger=0)
        self._monitors.clear()
        for i, mon in self._dealer_monitors.items():
            self._dealers[i].disable_monitor()
            mon.close(linger=0)
        self._dealer_monitors.clear()
        for sock in [*self._subs, *self._dealers.values()]:
            sock.close(linger=0)
        self._dealers.clear()


def _dropped(monitor: zmq.Socket) -> bool:
    """Drain a replay DEALER's monitor; whether its connection dropped."""
    dropped = False
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return dropped
        try:
            dropped |= parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED
        except Exception:  # pragma: no cover - libzmq's own two-frame format
            continue


class _Handoff:
    """Items from the core's event loop thread to the threads that call
    :meth:`Subscriber.get`, bounded, never dropping.

    The core puts each poll round's items as one list, so a burst costs one lock round-trip
    on the producer side rather than one per item. When ``max_items`` are pending the core
    awaits a future that the consumer resolves (thread-safely) as soon as it takes an item:
    the reader task waits without blocking its loop, and :meth:`Subscriber.close` can cancel
    it at once. A batch is accepted whenever fewer than ``max_items`` are pending, so the
    bound may be exceeded by one poll round's items (at most a few hundred). ``max_items``
    of 0 or less means no bound, as for :class:`queue.Queue`.
    """

    def __init__(self, max_items: int, loop: asyncio.AbstractEventLoop) -> None:
        self._max = max_items if max_items > 0 else sys.maxsize
        self._loop = loop
        self._cond = threading.Condition(threading.Lock())
        self._batches: deque[list[StreamItem]] = deque()
        self._pos = 0  # index of the next item in self._batches[0]
        self._pending = 0
        self._space: asyncio.Future[None] | None = None
        self.ended = False

    async def put(self, items: list[StreamItem]) -> None:
        """Queue ``items`` (taking ownership of the list); on the core's loop."""
        while True:
            with self._cond:
                if self._pending < self._max:
                    self._batches.append(items)
                    self._pending += len(items)
                    self._cond.notify_all()
                    return
                space = self._space = self._loop.create_future()
            await space

    def get(self, timeout: float | None) -> StreamItem | None:
        """The next item, or ``None`` after ``timeout`` seconds or once ended and drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._batches:
                if self.ended:
                    return None
                if deadline is None:
                    self._cond.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
            batch = self._batches[0]
            item = batch[self._pos]
            self._pos += 1
            if self._pos == len(batch):
                self._batches.popleft()
                self._pos = 0
            self._pending -= 1
            space = self._space
            if space is not None and self._pending < self._max:
                self._space = None
                # RuntimeError: the loop is closed, so nobody is waiting any more.
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(_resolve, space)
            return item

    def end(self) -> None:
        """No more items will come: wake every reader (they drain what is left)."""
        with self._cond:
            self.ended = True
            self._cond.notify_all()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Subscriber:
    """Receive KV events from many streams on one background thread.

    A thin wrapper: the asyncio core that :class:`AsyncSubscriber` runs on the caller's
    loop runs here on a private event loop in a daemon thread. Items
    (:data:`~events.stream.StreamItem`) are handed to ``on_item`` on that thread when a
    callback is given (an exception it raises is logged and counted in ``consumer_errors``;
    delivery goes on), otherwise they are queued for :meth:`get` and iteration. With
    ``max_pending`` items queued the reader waits for the consumer rather than drop anything;
    the ZeroMQ high-water mark and the replay ring then absorb the backlog.

    Bad addresses raise here, in the constructor, on the caller's thread. If the core stops
    on an unexpected error, :class:`SubscriberError` is raised by :meth:`get` and iteration
    (after the items that came before it), or by :meth:`close` in callback mode.

    Args:
        streams: the publishers to follow (names must be unique).
        on_item: optional callback, called on the subscriber thread (it must not call
            :meth:`close`; signal another thread to do it).
        replay_timeout: seconds a replay may stay silent before its hole is declared
            unrecoverable: an idle deadline, pushed forward by every well-formed reply, so
            a long replay that keeps delivering is never cut short.
        rcvhwm: high-water mark of each SUB socket, in messages.
        max_message_bytes: largest frame accepted from a publisher or its replay ring
            (``ZMQ_MAXMSGSIZE``, checked before the frame is allocated; ``None``: no bound).
            A larger one drops the connection (ZeroMQ reconnects), which the stream sees as
            a gap: replayed, or reported as :class:`~events.stream.GapUnrecoverable`.
        max_pending: queue bound when no callback is given, in items (0: unbounded).
        context: ZeroMQ context (default: the process-wide instance, which ``inproc://``
            publishers share); the core uses an asyncio shadow of it.

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
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
        max_pending: int = 100_000,
        context: zmq.Context | None = None,
    ) -> None:
        specs = _check_specs(streams)
        self._loop = asyncio.new_event_loop()
        self._handoff = None if on_item is not None else _Handoff(max_pending, self._loop)
        ctx = zmq.asyncio.Context.shadow(context if context is not None else zmq.Context.instance())
        try:
            self._core = _Core(
                specs,
                replay_timeout=replay_timeout,
                rcvhwm=rcvhwm,
                max_message_bytes=max_message_bytes,
                context=ctx,
                on_item=on_item,
                sink=self._handoff.put if self._handoff is not None else None,
            )
        except Exception:
            self._loop.close()
            raise
        self.endpoints: dict[str, str] = self._core.endpoints
        self._closed = False
        self._thread = threading.Thread(
            target=self._run_loop, name="kv-event-subscriber", daemon=True
        )
        self._thread.start()
        try:
            started = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
            try:
                started.result(_START_TIMEOUT)
            except TimeoutError:
                raise SubscriberError(
                    f"the subscriber thread did not open its sockets within {_START_TIMEOUT}s; "
                    "the process is starved or a ZeroMQ call is stuck: retry, or check the "
                    "machine's load"
                ) from None
        except BaseException:
            self._closed = True
            self._shut_down(5.0)
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _start(self) -> None:
        self._core.open()
        self._core.start(self._handoff.end if self._handoff is not None else None)

    # -- consumer API -------------------------------------------------------------------

    def stats(self) -> dict[str, StreamStats]:
        """A snapshot of every stream's counters, by stream name."""
        return self._core.stats()

    @property
    def streams(self) -> list[StreamSpec]:
        return list(self._core.specs)

    def get(self, timeout: float | None = None) -> StreamItem | None:
        """The next item, waiting up to ``timeout`` seconds (forever if ``None``); ``None``
        on timeout or once the subscriber is closed and drained. Raises
        :class:`SubscriberError` once drained if the core failed."""
        handoff = self._handoff
        if handoff is None:
            raise RuntimeError("items go to the on_item callback; get() is for queue mode")
        item = handoff.get(timeout)
        if item is None and handoff.ended:
            self._core.raise_failure()
        return item

    def __iter__(self) -> Iterator[StreamItem]:
        while True:
            item = self.get()
            if item is None:
                return
            yield item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket, waiting at most about ``timeout`` seconds
        (a thread that does not stop by then is left behind with a warning, rather than hang
        the caller). Readers blocked in :meth:`get` or iteration return; items already
        queued stay readable. Raises :class:`SubscriberError` if the core had failed and
        nothing raised that yet."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "Subscriber.close() was called from the on_item callback, on the subscriber's "
                "own thread; close it from another thread (e.g. set an Event in the callback)"
            )
        if not self._closed:
            self._closed = True
            self._shut_down(timeout)
        self._core.raise_failure(unless_raised=True)

    def _shut_down(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            done = asyncio.run_coroutine_threadsafe(self._core.close(), self._loop)
            done.result(timeout)
        except TimeoutError:
            log.warning("KV-event subscriber did not close its sockets within %.1fs", timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                log.warning("KV-event subscriber thread did not stop within %.1fs", timeout)
            if self._handoff is not None:
                self._handoff.end()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSubscriber:
    """Receive KV events from many streams on the running asyncio loop (``zmq.asyncio``).

    Use ``async with AsyncSubscriber(specs) as sub: async for item in sub: ...``, or pass
    ``on_item`` (a plain function, called on the event loop). Must be started and closed on
    the same running event loop; :meth:`start` binds and connects (raising for bad
    addresses) and launches the reader task. Same arguments and failure rules as
    :class:`Subscriber`, whose core this is.
    """

    def __init__(
        self,
        streams: Iterable[StreamSpec],
        on_item: Callable[[StreamItem], Any] | None = None,
        *,
        replay_timeout: float = 2.0,
        rcvhwm: int = 100_000,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
        max_pending: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._core = _Core(
            _check_specs(streams),
            replay_timeout=replay_timeout,
            rcvhwm=rcvhwm,
            max_message_bytes=max_message_bytes,
            context=context if context is not None else zmq.asyncio.Context.instance(),
            on_item=on_item,
            sink=self._enqueue,
        )
        self._max_pending = max_pending
        self._queue: asyncio.Queue[StreamItem | None] | None = None
        self._ended = self._end_pending = False
        self._closed = False
        self.endpoints: dict[str, str] = self._core.endpoints

    def stats(self) -> dict[str, StreamStats]:
        """A snapshot of every stream's counters, by stream name."""
        return self._core.stats()

    @property
    def failure(self) -> BaseException | None:
        """The exception the reader task died of (it then delivers nothing more), or None."""
        return self._core.failure

    async def start(self) -> AsyncSubscriber:
        if self._core.started:
            return self
        self._queue = asyncio.Queue(self._max_pending)
        self._core.open()
        self._core.start(self._end)
        return self

    async def get(self, timeout: float | None = None) -> StreamItem | None:
        """The next item, or ``None`` on timeout or after :meth:`close` (raising
        :class:`SubscriberError` instead if the core failed)."""
        q = self._queue
        if q is None:
            raise RuntimeError("call start() (or use 'async with') before reading items")
        try:
            item = await asyncio.wait_for(q.get(), timeout)
        except TimeoutError:
            return None
        if item is None:
            q.put_nowait(None)  # keep the end mark for other readers (its slot was just freed)
            self._core.raise_failure()
        elif self._end_pending:
            self._end()
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
        """Cancel the reader task and close every socket; raises :class:`SubscriberError`
        if the core had failed and nothing raised that yet."""
        if not self._closed:
            self._closed = True
            await self._core.close()
            self._end()
        self._core.raise_failure(unless_raised=True)

    async def __aenter__(self) -> AsyncSubscriber:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _enqueue(self, items: list[StreamItem]) -> None:
        q = self._queue
        if q is None:  # pragma: no cover - start() sets it before the task runs
            return
        for item in items:
            await q.put(item)

    def _end(self) -> None:
        """Queue the end mark after the items; if the queue is full, the next :meth:`get`
        does it once it has freed a slot (so readers never wait for an end that is lost)."""
        q = self._queue
        if q is None or self._ended:  # once is enough: readers put it back for each other
            return
        try:
            q.put_nowait(None)
        except asyncio.QueueFull:
            self._end_pending = True
        else:
            self._ended, self._end_pending = True, False
