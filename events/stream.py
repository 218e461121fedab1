"""Per-stream sequencing and dispatch of vLLM KV-event batches, with no I/O (spec §3).

One *stream* is one publisher: one replica and DP rank. vLLM numbers its batches 0, 1, 2, ...
per publisher start, keeps the last ``buffer_steps`` of them in a replay ring, and restarts
at 0 without any other signal. Everything a subscriber must decide about that numbering
lives here, as plain objects that take frames and return what to deliver, so the decisions
can be tested exhaustively and the socket layer (:mod:`events.subscriber`, one asyncio core
behind both the sync and the asyncio API) stays thin:

* :class:`Sequencer` orders raw payloads by sequence number: accepts the first one, detects
  gaps and asks for a replay, holds live messages while a replay runs, detects restarts.
* :class:`StreamProcessor` parses frames, drives a :class:`Sequencer`, decodes what it
  releases (:func:`events.schema.decode_batch`), checks the DP rank, keeps
  :class:`StreamStats`, and produces the items a consumer receives:
  :class:`StreamBatch` or one of the typed signals.

Decisions (documented here because consumers depend on them):

* A gap (``seq > expected``) asks for a replay from ``expected``; live messages that arrive
  meanwhile are held and applied after it, in order. Replayed batches with
  ``expected <= seq < s`` are applied; later ones are ignored because the held live messages
  cover them. The replay ends as soon as it has delivered up to the first held live message
  (an attach replay too), without waiting for the ring's end marker, and only replies that
  move it on push its idle deadline: an endpoint that repeats old batches, or a ring that
  never ends, cannot hold the live stream back.
* What the ring no longer holds, a replay that times out, or a stream without a replay
  endpoint gives :class:`GapUnrecoverable` once per hole, then the stream goes on with the
  next batch it has (replayed batches the ring still holds are applied: a partial view is
  better than none, and the signal already says the state is incomplete).
* A sequence going backwards gives :class:`StreamReset` (vLLM restarted: its cache is empty
  and no ``AllBlocksCleared`` is sent). The new run is then treated as expected from seq 0:
  if the first batch seen after the restart is ``s > 0``, batches ``0..s-1`` are asked from
  the (new) replay ring, or reported as :class:`GapUnrecoverable` when they cannot be had.
  A restart whose first visible batch is numbered at or above ``expected`` cannot be told
  apart from a continuation, nor can a replay answered by a publisher that restarted after
  the request: vLLM 0.32 has no publisher epoch.
* A batch whose ``data_parallel_rank`` differs from the stream's expected rank is not
  delivered: :class:`RankMismatch` is, and it is counted. It comes from a misconfigured
  endpoint, and applying another rank's events would corrupt this rank's view. A batch
  without a rank (2-element legacy batch) is accepted.
* A message whose frames are broken gives :class:`MalformedMessage` and is counted. When its
  sequence frame is readable it still takes its place in the sequence (replaying it would
  return the same broken bytes), so it never triggers a gap.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Literal

import msgspec

from events.schema import BatchDecodeError, DecodedBatch, decode_batch

__all__ = [
    "END_SEQ",
    "GapReason",
    "GapUnrecoverable",
    "MalformedMessage",
    "RankMismatch",
    "Sequencer",
    "StreamBatch",
    "StreamItem",
    "StreamProcessor",
    "StreamReset",
    "StreamSignal",
    "StreamSpec",
    "StreamStats",
]

#: Sequence number of the replay end marker: -1 as a signed 8-byte integer (spec §3).
END_SEQ = 0xFFFF_FFFF_FFFF_FFFF

_SEQ = struct.Struct(">Q")

GapReason = Literal[
    "no_replay_endpoint", "ring_overflow", "replay_timeout", "replay_failed", "replay_dropped"
]


class StreamSpec(msgspec.Struct, frozen=True):
    """Where one publisher (one replica and DP rank) is and what to expect from it.

    ``endpoint`` is the publisher's PUB address (connected to, or bound when ``bind`` is
    true: vLLM's PUB *connects* when its endpoint has no ``*``/``::``, so the subscriber must
    bind). ``replay_endpoint`` is its ROUTER address; without it a gap is unrecoverable.
    ``dp_rank`` is the ``data_parallel_rank`` the batches must carry (``None``: not
    checked). ``replay_from_start`` asks the ring for everything since seq 0 as the stream
    opens (and again at the first batch if that request failed): the full state of a
    publisher younger than its ring, else ``GapUnrecoverable(0, oldest, "ring_overflow")``
    followed by what the ring still holds, so a consumer can tell a late attach apart.
    """

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int | None = None
    bind: bool = False
    replay_from_start: bool = False
    resume_from: int | None = None
    """Ask the ring from this sequence as the stream opens (a consumer restoring a saved
    state whose last applied batch was ``resume_from - 1``); a ring that no longer reaches
    back that far gives ``GapUnrecoverable(resume_from, oldest, "ring_overflow")`` first."""
    lazy_token_ids: bool = False
    """Deliver stores as :class:`~events.schema.LazyTokensBlockStored` (token ids decoded
    on demand): for consumers that key state by hash, like the router's index."""


class StreamBatch(msgspec.Struct, frozen=True, gc=False):
    """A decoded batch, delivered in sequence order for its stream."""

    stream: str
    seq: int
    batch: DecodedBatch
    replayed: bool
    """True when it came from the replay ring rather than the live PUB socket."""
    received_at: float
    """``time.time()`` when the message was read from its socket."""


class GapUnrecoverable(msgspec.Struct, frozen=True, gc=False):
    """Batches ``expected .. got-1`` are lost for good: the consumer's view of this stream
    misses their events and should be treated as untrusted (spec §3, §5.4)."""

    stream: str
    expected: int
    got: int
    reason: GapReason


class StreamReset(msgspec.Struct, frozen=True, gc=False):
    """The sequence went backwards: the publisher restarted with an empty cache (spec §6.14).
    Drop all state of this stream; the batches that follow belong to the new run."""

    stream: str
    expected: int
    got: int


class MalformedMessage(msgspec.Struct, frozen=True, gc=False):
    """A message that could not be used; ``seq`` is ``None`` when it was unreadable."""

    stream: str
    seq: int | None
    reason: str
    replayed: bool = False


class RankMismatch(msgspec.Struct, frozen=True, gc=False):
    """A batch carried another ``data_parallel_rank`` than the stream's; it was dropped."""

    stream: str
    seq: int
    expected_rank: int
    got_rank: int


StreamSignal = GapUnrecoverable | StreamReset | MalformedMessage | RankMismatch
StreamItem = StreamBatch | GapUnrecoverable | StreamReset | MalformedMessage | RankMismatch


class StreamStats(msgspec.Struct):
    """Counters of one stream. :meth:`copy` gives a snapshot safe to keep."""

    batches: int = 0
    """Batches delivered (live and replayed)."""
    replayed_batches: int = 0
    events: int = 0
    events_by_type: dict[str, int] = msgspec.field(default_factory=dict)
    unknown_events: int = 0
    """Entries of delivered batches that decoded as :class:`UnknownEvent`."""
    legacy_events: int = 0
    """Events in the pre-#42892 positional-array encoding."""
    gaps: int = 0
    """Forward jumps in the sequence (each one asks for a replay when possible)."""
    replays: int = 0
    """Replay requests issued."""
    held: int = 0
    """Live messages held back while a replay ran."""
    unrecoverable_gaps: int = 0
    lost_batches: int = 0
    """Sum of ``got - expected`` over unrecoverable gaps."""
    resets: int = 0
    malformed: int = 0
    rank_mismatches: int = 0
    ignored_replayed: int = 0
    """Replayed batches not needed (already applied, or covered by held live ones)."""
    disconnects: int = 0
    """Times the connection to a publisher the subscriber connects to dropped: a publisher
    restart, the network, or a frame over ``max_message_bytes`` (libzmq drops the
    connection rather than allocate it). The subscriber reconnects; what was lost is a gap."""
    connected: bool | None = None
    """Whether the subscriber holds a connection to the publisher now: its ZMTP handshake
    succeeded and the connection has not dropped since (a stream whose SUB connects;
    ``None`` where it cannot tell: a bound SUB, ``inproc://``)."""
    replay_drops: int = 0
    """Replays whose connection dropped before they ended (a reply over
    ``max_message_bytes``, or the publisher gone): each is reported at once as a
    ``GapUnrecoverable`` with reason ``replay_dropped``."""
    consumer_errors: int = 0
    """Exceptions raised by the consumer's callback (logged, then delivery goes on)."""
    last_seq: int | None = None
    last_ts: float | None = None
    """``ts`` of the last delivered batch (the engine's ``time.time()`` at publish)."""
    lag_s: float | None = None
    """Receive time minus ``ts`` of the last live batch."""
    max_lag_s: float = 0.0
    replaying: bool = False

    def copy(self) -> StreamStats:
        return msgspec.structs.replace(self, events_by_type=dict(self.events_by_type))


class _Apply:
    """A payload the sequencer released, in order."""

    __slots__ = ("payload", "received_at", "replayed", "seq")

    def __init__(self, seq: int, payload: bytes, replayed: bool, received_at: float) -> None:
        self.seq = seq
        self.payload = payload
        self.replayed = replayed
        self.received_at = received_at


class _Pending:
    __slots__ = ("attach", "held", "start", "target")

    def __init__(
        self,
        start: int,
        target: int,
        held: list[tuple[int, bytes, float]],
        *,
        attach: bool = False,
    ) -> None:
        self.start = start
        self.target = target
        self.held = held
        self.attach = attach
        """An attach replay (``Sequencer.attach``): open-ended, ends at the ring's end marker,
        and live messages it holds may repeat batches the ring already delivered."""


_OPEN = 1 << 63
"""The target of an attach replay: everything the ring holds."""


Output = _Apply | GapUnrecoverable | StreamReset


class Sequencer:
    """The sequence-number state machine of one stream (spec §3, subscriber algorithm).

    Feed it live messages (:meth:`live`) and replay replies (:meth:`replayed`,
    :meth:`replay_done`, :meth:`replay_failed`); each call appends to ``out`` what is now
    in order (``_Apply`` entries and gap/reset signals) and returns the start sequence of
    a replay to request, or ``None``. Payloads are opaque here.
    """

    __slots__ = ("_pending", "can_replay", "expected", "replay_from_start", "resume_from", "stream")

    def __init__(
        self,
        stream: str,
        *,
        can_replay: bool,
        replay_from_start: bool = False,
        resume_from: int | None = None,
    ) -> None:
        self.stream = stream
        self.can_replay = can_replay
        self.replay_from_start = replay_from_start
        self.resume_from = resume_from
        self.expected: int | None = None
        """Next sequence number to apply; ``None`` until the first message."""
        self._pending: _Pending | None = None

    @property
    def replaying(self) -> bool:
        return self._pending is not None

    def attach(self) -> int | None:
        """Ask the ring for everything from seq 0 now, before any live message: a subscriber
        that attaches to an idle publisher then knows its state (and whether the ring still
        starts at 0) without waiting for traffic. Returns 0 (the replay to request) or None
        when there is nothing to ask (no ``replay_from_start``, no ring, already started)."""
        start = self.resume_from if self.resume_from is not None else 0
        wanted = self.replay_from_start or self.resume_from is not None
        if not (wanted and self.can_replay) or self.expected is not None:
            return None
        if self._pending is not None:
            return None
        self.expected = start
        self._pending = _Pending(start, _OPEN, [], attach=True)
        return start

    @property
    def held(self) -> int:
        """Live messages waiting for the running replay."""
        return len(self._pending.held) if self._pending is not None else 0

    def live(self, seq: int, payload: bytes, received_at: float, out: list[Output]) -> int | None:
        if self._pending is not None:
            self._pending.held.append((seq, payload, received_at))
            return None
        if seq == self.expected:  # the common case first
            self.expected = seq + 1
            out.append(_Apply(seq, payload, False, received_at))
            return None
        return self._accept(seq, payload, received_at, out)

    def _accept(self, seq: int, payload: bytes, t: float, out: list[Output]) -> int | None:
        expected = self.expected
        if expected is None:
            if self.resume_from is not None:
                expected = self.resume_from  # a lower seq: the publisher restarted since
            elif not self.replay_from_start or seq == 0:
                self.expected = seq + 1
                out.append(_Apply(seq, payload, False, t))
                return None
            else:
                expected = 0
        elif seq < expected:
            out.append(StreamReset(self.stream, expected, seq))
            expected = 0
        if seq == expected:
            self.expected = seq + 1
            out.append(_Apply(seq, payload, False, t))
            return None
        # seq > expected: a hole.
        if not self.can_replay:
            out.append(GapUnrecoverable(self.stream, expected, seq, "no_replay_endpoint"))
            self.expected = seq + 1
            out.append(_Apply(seq, payload, False, t))
            return None
        self.expected = expected
        self._pending = _Pending(expected, seq, [(seq, payload, t)])
        return expected

    def replayed(self, seq: int, payload: bytes, received_at: float, out: list[Output]) -> bool:
        """One batch from the replay ring; returns whether it was applied."""
        p = self._pending
        if p is None or self.expected is None:
            return False
        if seq < self.expected or seq >= p.target:
            return False
        if seq > self.expected:
            out.append(GapUnrecoverable(self.stream, self.expected, seq, "ring_overflow"))
        self.expected = seq + 1
        out.append(_Apply(seq, payload, True, received_at))
        return True

    @property
    def replay_complete(self) -> bool:
        """The running replay has delivered every batch up to the first live one it held
        back (for a gap's replay: the one that showed the gap), so the held live messages
        take over and the rest of the ring's answer would only be ignored. An attach replay
        ends there too, which bounds what it holds back even if its ring never ends."""
        p, expected = self._pending, self.expected
        if p is None or expected is None:
            return False
        if not p.attach:
            return expected >= p.target
        return bool(p.held) and expected >= p.held[0][0]

    def replay_done(self, out: list[Output]) -> int | None:
        """The end marker arrived; whatever is still missing is gone."""
        return self._finish("ring_overflow", out)

    def replay_failed(self, reason: GapReason, out: list[Output]) -> int | None:
        """The replay timed out or its socket failed."""
        return self._finish(reason, out)

    def _finish(self, reason: GapReason, out: list[Output]) -> int | None:
        p = self._pending
        if p is None:
            return None
        self._pending = None
        if p.attach:
            p.target = self.expected if self.expected is not None else 0
            # Live messages held meanwhile may repeat what the ring delivered.
            p.held = [h for h in p.held if h[0] >= p.target]
            if reason != "ring_overflow" and not p.held and self.expected == p.start:
                self.expected = None  # nothing known: the first live message decides
        if self.expected is not None and self.expected < p.target:
            out.append(GapUnrecoverable(self.stream, self.expected, p.target, reason))
            self.expected = p.target
        held = p.held
        for i, (seq, payload, t) in enumerate(held):
            if seq == self.expected:
                self.expected = seq + 1
                out.append(_Apply(seq, payload, False, t))
                continue
            start = self._accept(seq, payload, t, out)
            pending = self._pending
            if pending is not None:
                # A new hole among the held messages: the rest wait for its replay.
                pending.held.extend(held[i + 1 :])
                return start
        return None


class StreamProcessor:
    """Frames in, consumer items out, for one stream: parse, sequence, decode, check, count.

    The socket layer calls :meth:`on_live` with the frames of every message read from the
    stream's SUB socket and :meth:`on_replay` with those read from its replay DEALER. Each
    returns the start sequence of a replay to request now (replacing any replay socket
    still open for this stream), or ``None``; :attr:`replaying` says whether a replay
    socket is still needed.
    """

    def __init__(
        self,
        spec: StreamSpec,
        *,
        decode: Callable[[bytes], DecodedBatch] | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.stats = StreamStats()
        self.sequencer = Sequencer(
            spec.name,
            can_replay=spec.replay_endpoint is not None,
            replay_from_start=spec.replay_from_start,
            resume_from=spec.resume_from,
        )
        if decode is None:
            decode = functools.partial(decode_batch, lazy_token_ids=spec.lazy_token_ids)
        self._decode = decode
        self._outputs: list[Output] = []
        self.replay_replies = 0
        """Replay replies that moved a replay on (a batch it needed, its end marker): the
        socket layer's sign that a replay is progressing, which pushes its idle deadline.
        Well-formed replies that bring nothing do not, so an endpoint repeating old batches
        cannot hold a replay, and the live messages behind it, open for good."""

    @property
    def replaying(self) -> bool:
        return self.sequencer.replaying

    def attach(self) -> int | None:
        """The replay to request as the stream opens (:meth:`Sequencer.attach`), or None."""
        return self.sequencer.attach()

    # -- inputs -------------------------------------------------------------------------

    def on_live(self, frames: list[bytes], now: float, out: list[StreamItem]) -> int | None:
        """A message from the PUB socket: ``[topic, seq (8 bytes, big-endian), payload]``."""
        if len(frames) != 3:
            self._malformed(None, f"expected 3 frames, got {len(frames)}", False, out)
            return None
        seq_frame = frames[1]
        if len(seq_frame) != 8:
            self._malformed(
                None, f"sequence frame is {len(seq_frame)} bytes, expected 8", False, out
            )
            return None
        seq = _SEQ.unpack(seq_frame)[0]
        was_replaying = self.sequencer.replaying
        outputs = self._outputs
        start = self.sequencer.live(seq, frames[2], now, outputs)
        if was_replaying:
            self.stats.held += 1
        return self._after(start, outputs, out)

    def on_replay(self, frames: list[bytes], now: float, out: list[StreamItem]) -> int | None:
        """A message from the replay DEALER: ``[b"", topic, seq8, payload]`` or the end
        marker ``[b"", b"", END_SEQ, b""]``."""
        if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
            self._malformed(None, _replay_frame_error(frames), True, out)
            return None
        seq = _SEQ.unpack(frames[2])[0]
        outputs = self._outputs
        if seq == END_SEQ and frames[3] == b"":
            self.replay_replies += 1
            start = self.sequencer.replay_done(outputs)
            return self._after(start, outputs, out)
        if not self.sequencer.replayed(seq, frames[3], now, outputs):
            self.stats.ignored_replayed += 1
            return self._after(None, outputs, out)
        self.replay_replies += 1
        start = None
        if self.sequencer.replay_complete:  # the held live messages go on now
            start = self.sequencer.replay_done(outputs)
        return self._after(start, outputs, out)

    def on_replay_failed(self, reason: GapReason, out: list[StreamItem]) -> int | None:
        """The replay timed out (``"replay_timeout"``), could not be sent or its connection
        dropped (``"replay_dropped"``)."""
        outputs = self._outputs
        start = self.sequencer.replay_failed(reason, outputs)
        return self._after(start, outputs, out)

    # -- dispatch -----------------------------------------------------------------------

    def _after(self, start: int | None, outputs: list[Output], out: list[StreamItem]) -> int | None:
        if outputs:
            for o in outputs:
                if type(o) is _Apply:
                    self._dispatch(o, out)
                else:
                    self._signal(o, out)
            outputs.clear()
        stats = self.stats
        if start is not None:
            stats.gaps += 1
            stats.replays += 1
        stats.replaying = self.sequencer.replaying
        return start

    def _signal(self, sig: GapUnrecoverable | StreamReset, out: list[StreamItem]) -> None:
        if type(sig) is GapUnrecoverable:
            self.stats.unrecoverable_gaps += 1
            self.stats.lost_batches += sig.got - sig.expected
            if sig.reason == "no_replay_endpoint":
                self.stats.gaps += 1  # the other holes were counted when their replay began
        else:
            self.stats.resets += 1
        out.append(sig)

    def _dispatch(self, a: _Apply, out: list[StreamItem]) -> None:
        stats = self.stats
        try:
            batch = self._decode(a.payload)
        except BatchDecodeError as exc:
            self._malformed(a.seq, str(exc), a.replayed, out)
            stats.last_seq = a.seq
            return
        except Exception as exc:
            # decode_batch raises nothing else, but a custom ``decode`` may, and a payload
            # must never stop the stream: whatever decoding raises is this message's fault.
            self._malformed(a.seq, f"{type(exc).__name__}: {exc}", a.replayed, out)
            stats.last_seq = a.seq
            return
        want = self.spec.dp_rank
        got = batch.data_parallel_rank
        if want is not None and got is not None and got != want:
            stats.rank_mismatches += 1
            stats.last_seq = a.seq
            out.append(RankMismatch(self.name, a.seq, want, got))
            return
        stats.batches += 1
        stats.last_seq = a.seq
        stats.last_ts = batch.ts
        if a.replayed:
            stats.replayed_batches += 1
        else:
            lag = a.received_at - batch.ts
            stats.lag_s = lag
            if lag > stats.max_lag_s:
                stats.max_lag_s = lag
        events = batch.events
        stats.events += len(events)
        by_type = stats.events_by_type
        if len(events) == 1:
            name = type(events[0]).__name__
            by_type[name] = by_type.get(name, 0) + 1
        elif events:
            # Batches are usually runs of one type (an eviction burst, a prefill's stores):
            # count runs, not single events.
            prev = type(events[0])
            run = 0
            for ev in events:
                t = type(ev)
                if t is prev:
                    run += 1
                else:
                    by_type[prev.__name__] = by_type.get(prev.__name__, 0) + run
                    prev = t
                    run = 1
            by_type[prev.__name__] = by_type.get(prev.__name__, 0) + run
        if batch.unknown:
            stats.unknown_events += batch.unknown
        if batch.legacy:
            stats.legacy_events += batch.legacy
        out.append(StreamBatch(self.name, a.seq, batch, a.replayed, a.received_at))

    def _malformed(
        self, seq: int | None, reason: str, replayed: bool, out: list[StreamItem]
    ) -> None:
        self.stats.malformed += 1
        out.append(MalformedMessage(self.name, seq, reason, replayed))


def _replay_frame_error(frames: list[bytes]) -> str:
    if len(frames) != 4:
        return f"replay reply has {len(frames)} frames, expected 4"
    if frames[0] != b"":
        return "replay reply does not start with the empty delimiter frame"
    return f"replay sequence frame is {len(frames[2])} bytes, expected 8"
