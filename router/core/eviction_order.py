"""Which removals of a *partial* replica's blocks provably took a copy cached before attach.

A router attached to a replica that has run for a while does not know how many physical copies
of a block the replica held at attach: vLLM stores a full-attention block again after a shorter
hybrid hit and a sliding-window checkpoint again when a later request recomputes it (spec §0.7,
§6.15), and nothing in 0.32's events counts copies. The index learns one copy of such a key
(an answer, a witness, a store since attach) and drops the key at its first ``BlockRemoved``,
while the replica may still serve it from another copy: the next request on that prefix is
predicted short. On the late-attach test (tests/test_late_attach.py) every miss left after
the other partial rules was one of those.

vLLM's free queue is an LRU (spec §2.1): blocks join its tail when their last request frees
them, a hit takes a block out (``touch``), and an allocation evicts from the head. So the
blocks it evicts come in order of the time they were last freed, and a block that is free is
evicted before every block freed after it. Two proofs follow, both resting on one premise:
from a moment ``T`` on the router is the replica's only client (every request running at
``T`` has finished, none came from elsewhere since), so every block freed after ``T`` was
freed by a request the router sent, and the router knows which keys each could touch (its
prompt's blocks in every group, noted as it is sent) and when it ended.

- **An unknown eviction.** A block whose key the router never knew since attach (no event
  stored or named it, no request the router sent had it in its prompt) was last freed before
  ``T``. When one is evicted, every eviction before it took a block freed before ``T`` too: a
  key with a copy freed after ``T`` (one a request sent after ``T`` hit, or an event stored)
  still holds that copy, whatever removals the index applied on the way.
- **An older block still held.** The router bounds when each block of the first
  full-attention group was last freed: by the end of the last request that had it in its
  prompt (vLLM frees a finished request's blocks before its last byte), or of every request in
  flight when an event stored it (a decode block); never for one a cancelled or failed
  request had (vLLM frees it when it gets to the abort). A block the index holds, that no
  request in flight may be using, freed before a request sent at ``s`` hit key K, is in the
  free queue ahead of K's copy, which that request freed after ``s``: a removal of K while it
  is held took another copy. Such keys are held again (``KVIndex``, ``older_copy_evicted``).

``T`` is read from the replica's own metrics: two scrapes in a row (one scrape interval
apart, so the events of anything that ran before are in) that show no request but the
router's. Any later scrape that shows another client's request (running or waiting, or
``vllm:request_success_total`` growing by more than the router sent and had in flight) turns
the proofs off for the rest of the partial period: their premise is gone, so the keys they
kept since the last clean scrape are retired and predictions stay the plain lower bound. The
gate sees another client up to a scrape interval late: a proof made in that interval may be
wrong until then (the price of reading the premise from metrics).

Measured (``KVROUTER_LATE_ATTACH_SEED=N pytest -s tests/test_late_attach.py -k converges``):
seeds 5-24, 2,999 of 3,000 requests exact once the proofs armed (the miss: a first touch);
seeds 5-12 without them 1,180 of 1,200, with the unknown-eviction proof alone 1,186.

Everything here is pure: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

__all__ = ["NAMED", "REMOVED", "STORED", "EvictionWitness", "Key", "Scan"]

Key = tuple[int, object]
"""``(group, wire hash)`` of a GPU block."""

REMOVED, STORED, NAMED = 0, 1, 2
"""What a batch's event did to a key (:meth:`EvictionWitness.scan`): a ``BlockRemoved``, a
``BlockStored`` of it, or a store naming it as parent (only known: which copy is unsaid)."""


@dataclass(slots=True)
class EvictionWitness:
    """One partial replica's record for the eviction-order proofs (module docstring)."""

    max_keys: int
    """Keys ``seen`` (and, likewise, the bounds of the older-block proof) may hold; past it
    the proofs are off (an unknown key could no longer be told from a forgotten one)."""
    max_quiet_removals: int
    """Removals without an unknown one after which the first proof stops: the blocks cached
    before attach are then all evicted or in use, so it has nothing more to prove."""
    seen: set[Key] = field(default_factory=set)
    """Every key the router knew on this replica since attach (stored, named, sent, hit)."""
    live: dict[Key, float] = field(default_factory=dict)
    """Keys with a copy last freed after ``armed_at``, each with a time its copy was freed
    after (the send time of the request that hit it, or ``clean_at`` for a store)."""
    pending: set[Key] = field(default_factory=set)
    """Live keys removed since the last unknown eviction: proved kept by the next one."""
    clean_at: float | None = None
    """The first of the scrapes in a row that showed no other client (None: none yet)."""
    armed_at: float | None = None
    """``T``: from then on the router is the replica's only client (None: not yet)."""
    off: str | None = None
    """Why the proofs are off for the rest of the partial period (None: they are not)."""
    quiet: int | None = 0
    """Removals since the last unknown one (or since arming); None once the first proof
    stopped (``max_quiet_removals``)."""
    recent: set[Key] = field(default_factory=set)
    """Keys the proofs made the index hold since the last clean scrape: the ones to retire
    if the next scrape shows another client (the premise may have failed since then)."""
    _base: tuple[float | None, int, int] | None = None
    """At the first clean scrape: the replica's finished count, the router's sent count and
    its requests in flight (:meth:`scrape`)."""
    # the older-block proof: bounds on when each tracked block was last freed
    _inflight: dict[int, list[Key]] = field(default_factory=dict)
    """Per request in flight (its attempt number): its tracked keys."""
    _next: int = 0
    """One past the highest attempt number sent to this replica."""
    _busy: dict[Key, int] = field(default_factory=dict)
    """Tracked keys in the prompt of a request in flight (maybe in use: no bound)."""
    _last: dict[Key, float] = field(default_factory=dict)
    """Per tracked key: every copy of it was last freed before this time (or before ``T``)."""
    _never: set[Key] = field(default_factory=set)
    """Keys a request that did not finish had in its prompt: vLLM frees those blocks when
    it gets to the abort, at a time the router does not see; never bounded again."""
    _taints: list[tuple[int, int, Key]] = field(default_factory=list)
    """Heap of stored keys waiting for every request in flight at the store to end
    (``(attempt bound, tie, key)``): the store was one of theirs (a decode block)."""
    _tainted: dict[Key, int] = field(default_factory=dict)
    _heap: list[tuple[float, int, Key]] = field(default_factory=list)
    """Bounded keys by bound, oldest first; an entry is current while ``_entry`` has it."""
    _entry: dict[Key, tuple[float, int]] = field(default_factory=dict)
    _tie: int = 0

    @property
    def armed(self) -> bool:
        return self.armed_at is not None and self.off is None

    def scrape(
        self,
        now: float,
        others: float,
        finished: float | None = None,
        sent: int = 0,
        mine: int = 0,
    ) -> None:
        """A scrape of the replica's metrics at ``now``: ``others`` requests running or
        waiting that the router did not send; ``finished`` the replica's count of finished
        requests (``vllm:request_success_total``, None if it does not export it), ``sent``
        the requests the router has sent it so far and ``mine`` those in flight now.

        Two clean scrapes in a row arm the proofs (the later one's time is ``T``: every
        batch emitted before the first is in by then). Another client shows as a request
        running or waiting, or, between scrapes, as more requests finished since the first
        clean scrape than the router sent or had in flight then. Before arming that starts
        over; after, it turns the proofs off."""
        if self.off is not None:
            return
        foreign = others > 0
        base = self._base
        if not foreign and finished is not None and base is not None and base[0] is not None:
            foreign = finished - base[0] > (sent - base[1]) + base[2]
        if foreign:
            if self.armed_at is not None:
                self.turn_off("another client sends it requests")
            self.clean_at = self._base = None
            return
        self.recent.clear()
        if self.armed_at is not None:
            return
        if self.clean_at is None:
            self.clean_at, self._base = now, (finished, sent, mine)
        elif now > self.clean_at:
            self.armed_at = now
            self.quiet = 0

    def turn_off(self, reason: str) -> None:
        self.off = reason
        self.seen.clear()
        self.live.clear()
        self.pending.clear()
        self._inflight.clear()
        self._busy.clear()
        self._last.clear()
        self._never.clear()
        self._taints.clear()
        self._tainted.clear()
        self._heap.clear()
        self._entry.clear()

    def sending(self, attempt: int, keys: Iterable[Key], tracked: Iterable[Key] = ()) -> None:
        """A request (``attempt``: a number that grows with each request the router sends)
        is being sent. ``keys``: every key it could touch or store at admission (its prompt's
        blocks in every group), known from now on whatever its answer (a request that fails
        or is cancelled never reports what it hit, but its blocks are freed). ``tracked``:
        those of them the older-block proof bounds (one group's)."""
        if self.off is not None:
            return
        self.seen.update(keys)
        tracked = list(tracked)
        self._inflight[attempt] = tracked
        self._next = max(self._next, attempt + 1)
        busy, entry = self._busy, self._entry
        for k in tracked:
            busy[k] = busy.get(k, 0) + 1
            entry.pop(k, None)
        self._bound()

    def ended(self, attempt: int, now: float, finished: bool) -> None:
        """The request ``attempt`` left the router at ``now``; ``finished``: its answer was
        read whole (vLLM frees a finished request's blocks before its last byte), else it
        failed or was cancelled (freed later, when vLLM gets to it)."""
        keys = self._inflight.pop(attempt, None)
        if keys is None or self.off is not None:
            return
        busy = self._busy
        for k in keys:
            n = busy[k] - 1
            if n:
                busy[k] = n
            else:
                del busy[k]
            if finished:
                self._last[k] = now
            else:
                self._never.add(k)
                self._entry.pop(k, None)
            self._push(k)
        low = min(self._inflight) if self._inflight else self._next
        taints, tainted = self._taints, self._tainted
        while taints and taints[0][0] <= low:  # every request that could have stored it ended
            _, _, k = heapq.heappop(taints)
            n = tainted[k] - 1
            if n:
                tainted[k] = n
            else:
                del tainted[k]
            self._last[k] = now
            self._push(k)
        self._bound()

    def _push(self, k: Key) -> None:
        if k in self._busy or k in self._tainted or k in self._never or k not in self._last:
            return
        self._tie += 1
        e = self._last[k]
        self._entry[k] = (e, self._tie)
        heapq.heappush(self._heap, (e, self._tie, k))

    def touched(self, keys: Iterable[Key], sent_at: float) -> None:
        """Keys a request sent at ``sent_at`` hit (the blocks vLLM's hit rule needed for its
        ``cached_tokens``): vLLM touched a copy of each, freed when the request ended."""
        if self.off is not None:
            return
        keys = list(keys)
        self.seen.update(keys)
        if self.armed_at is not None and sent_at >= self.armed_at:
            live = self.live
            for k in keys:
                if live.get(k, sent_at) <= sent_at:
                    live[k] = sent_at
        self._bound()

    def scan(self, events: Iterable[tuple[int, Key]]) -> Scan:
        """One applied batch's GPU events in order, ``(what, key)`` with ``what`` one of
        :data:`REMOVED`, :data:`STORED`, :data:`NAMED`: what the proofs make of it."""
        out = Scan()
        if self.off is not None:
            return out
        seen, live, pending = self.seen, self.live, self.pending
        armed, first = self.armed, self.quiet is not None
        proved, touched = out.proved, out.touched
        for what, key in events:
            touched.add(key)
            if what:
                seen.add(key)
                if what == STORED:
                    if armed:  # the storing request frees it after T
                        live[key] = max(live.get(key, 0.0), self.clean_at or 0.0)
                    self._tie += 1  # one of the requests in flight stored it: no bound yet
                    heapq.heappush(self._taints, (self._next, self._tie, key))
                    self._tainted[key] = self._tainted.get(key, 0) + 1
                    self._entry.pop(key, None)
                continue
            if not armed:
                seen.add(key)
                continue
            if key in live:
                out.removed_live.add(key)
            if not first:
                continue
            self.quiet += 1  # type: ignore[operator]
            if key in live:
                pending.add(key)
                proved.discard(key)
            elif key not in seen:
                proved |= pending
                pending.clear()
                self.quiet = 0
        if first and self.quiet > self.max_quiet_removals:  # type: ignore[operator]
            self.quiet = None  # the first proof is done; the older-block one goes on
            self.seen.clear()
            self.pending.clear()
        self._bound()
        return out

    def oldest_held(self, held: Callable[[Key], bool], skip: AbstractSet[Key]) -> float | None:
        """The bound of the oldest tracked block the replica still holds (``held``: the index
        says so) and that ``skip`` (the batch's keys) leaves alone: a block freed before that
        time is in the free queue, so no copy freed after it was evicted. None if none."""
        heap, entry = self._heap, self._entry
        put_back = []
        found = None
        while heap:
            e, t, k = heap[0]
            if entry.get(k) != (e, t):
                heapq.heappop(heap)
            elif k in skip:
                put_back.append(heapq.heappop(heap))
            elif not held(k):
                heapq.heappop(heap)
                del entry[k]
            else:
                found = e
                break
        for item in put_back:
            heapq.heappush(heap, item)
        return found

    def _bound(self) -> None:
        if len(self.seen) > self.max_keys or len(self._last) > self.max_keys:
            self.turn_off(f"over {self.max_keys} keys known since attach")


@dataclass(slots=True)
class Scan:
    """What :meth:`EvictionWitness.scan` made of a batch."""

    proved: set[Key] = field(default_factory=set)
    """Live keys removed before an unknown eviction and not removed again after it: still
    held (the first proof)."""
    removed_live: set[Key] = field(default_factory=set)
    """Live keys the batch removed: still held if a block freed before their copy is (the
    older-block proof, :meth:`EvictionWitness.oldest_held`)."""
    touched: set[Key] = field(default_factory=set)
    """Every key the batch named."""
