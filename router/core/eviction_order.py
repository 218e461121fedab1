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
them, a hit takes a block out (``touch``), and an allocation evicts from the head. So a block
that is free is evicted before every block freed after it. The proof rests on one premise:
from a moment ``T`` on the router is the replica's only client (every request running at
``T`` has finished, none came from elsewhere since), so every block freed after ``T`` was
freed by a request the router sent, and the router knows what each one's prompt was and when
it ended. It then bounds when each block of the first full-attention group was last freed:
by the end of the last request that had it in its prompt (vLLM frees a finished request's
blocks before its last byte), or of every request in flight when an event stored it (a decode
block); never for one a cancelled or failed request had (vLLM frees it when it gets to the
abort, unseen), and a store waits for cancelled requests too, until a clean scrape shows
vLLM runs nothing the router does not count. A block the index holds, that no request in
flight may be using, last freed before a request sent after ``T`` hit key K (or before ``T``,
for a K an event stored after ``T``), is in the free queue ahead of K's newer copy: a removal
of K while that block is still held took another, older copy. Such keys are held again
(``KVIndex``, counter ``older_copy_evicted``).

``T`` is read from the replica's own metrics: two scrapes in a row (one scrape interval
apart, so the events of anything that ran before are in) that show no request but the
router's. Another client's request, seen running or waiting at two scrapes in a row (one
may only show vLLM's count lagging a request the router just saw end) or as
``vllm:request_success_total`` growing by more than the router sent and had in flight, turns
the proof off for the rest of the partial period: its premise is gone, so the keys it kept
since the last clean scrape are retired and predictions stay the plain lower bound. The gate
sees another client up to a scrape interval late: a proof made in that interval may be wrong
until then (the price of reading the premise from metrics).

Measured (``KVROUTER_LATE_ATTACH_SEED=N pytest -s tests/test_late_attach.py -k converges``,
200 blocks per replica): seeds 5-24, 2,999 of 3,000 requests exact once the proof armed (the
miss: a first touch); seeds 5-12 without it 1,173 of 1,200. An earlier second proof (the
eviction of a block no request or event had named proves every eviction before it took a
block freed before ``T``) added nothing on top of this one there and needed a record of every
key seen, so it went.

Everything here is pure: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

__all__ = ["EvictionWitness", "Key"]

Key = tuple[int, object]
"""``(group, wire hash)`` of a GPU block."""


@dataclass(slots=True)
class EvictionWitness:
    """One partial replica's record for the eviction-order proof (module docstring)."""

    max_keys: int
    """Keys it may keep a record for (bounds and newer copies); past it, after dropping those
    the index no longer holds, the proof is off for the partial period."""
    live: dict[Key, float] = field(default_factory=dict)
    """Keys with a copy last freed after ``T``, each with a time that copy was freed after
    (the send time of the request that hit it, or ``clean_at`` for a stored one)."""
    clean_at: float | None = None
    """The first of the scrapes in a row that showed no other client (None: none yet)."""
    armed_at: float | None = None
    """``T``: from then on the router is the replica's only client (None: not yet)."""
    off: str | None = None
    """Why the proof is off for the rest of the partial period (None: it is not)."""
    recent: set[Key] = field(default_factory=set)
    """Keys the proof made the index hold since the last clean scrape: the ones to retire if
    the next scrape shows another client (the premise may have failed since then)."""
    _suspect: bool = False
    """The last scrape showed a request running that the router does not count."""
    _base: tuple[float | None, int, int] | None = None
    """At the first clean scrape: the replica's finished count, the router's sent count and
    its requests in flight (:meth:`scrape`)."""
    group: int | None = None
    """The tracked group (the first ``sending`` names it): only its blocks get bounds, as only
    its keys are known to be in use while a request runs (a hit in another group touches
    blocks no tracked key names)."""
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
    _aborting: dict[int, None] = field(default_factory=dict)
    """Requests that left the router unfinished: vLLM may still run (and store for) them
    until it gets to the abort, which the next clean scrape proves done."""
    _taints: list[tuple[int, int, Key]] = field(default_factory=list)
    """Heap of stored keys waiting for every request in flight at the store to end
    (``(attempt bound, tie, key)``): the store was one of theirs (a decode block). An entry
    is current while ``_tainted`` has its bound for the key (a later store raises it)."""
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

        Two clean scrapes in a row arm the proof (the later one's time is ``T``: every batch
        emitted before the first is in by then). Another client shows as more requests
        finished since the first clean scrape than the router sent or had in flight then, or
        as a request running or waiting the router does not count (after arming: at two
        scrapes in a row, as vLLM's count can lag a request the router just saw end). Before
        arming that starts over; after, it turns the proof off (``recent`` then says what to
        retire: what it kept since the last clean scrape)."""
        if self.off is not None:
            return
        base = self._base
        counted = (  # more requests finished than the router sent: definitive
            finished is not None
            and base is not None
            and base[0] is not None
            and finished - base[0] > (sent - base[1]) + base[2]
        )
        running = others > 0
        if self.armed_at is None and mine > len(self._inflight):
            # a request the router sent before the proof started: it is not tracked, so its
            # blocks may be in use unseen; wait until it is gone
            running = True
        if self.armed_at is not None and running and not counted and not self._suspect:
            # a request running that the router does not count, once: vLLM may not have
            # caught up with one the router just saw end. A second scrape decides (another
            # client's request that ended meanwhile shows in the finished count)
            self._suspect = True
            return
        if counted or running:
            if self.armed_at is not None:
                self.turn_off("another client sends it requests")
            self.clean_at = self._base = None
            return
        self._suspect = False
        self.recent.clear()
        if self._aborting:  # nothing the router did not count runs: the aborts are done
            self._aborting.clear()
            self._release(now)
        if self.armed_at is not None:
            return
        if self.clean_at is None:
            self.clean_at, self._base = now, (finished, sent, mine)
        elif now > self.clean_at:
            self.armed_at = now

    def turn_off(self, reason: str) -> None:
        """Off for the partial period; its records are freed (``recent`` is kept)."""
        self.off = reason
        for d in (
            self.live,
            self._inflight,
            self._busy,
            self._last,
            self._aborting,
            self._tainted,
            self._entry,
        ):
            d.clear()
        self._never.clear()
        self._taints.clear()
        self._heap.clear()

    def sending(self, attempt: int, tracked: Iterable[Key]) -> None:
        """A request (``attempt``: a number that grows with each request the router sends)
        is being sent; ``tracked``: its prompt's blocks in the tracked group, which it may
        touch or store from now until it ends."""
        if self.off is not None:
            return
        tracked = list(tracked)
        if tracked and self.group is None:
            self.group = tracked[0][0]
        self._inflight[attempt] = tracked
        self._next = max(self._next, attempt + 1)
        busy, entry = self._busy, self._entry
        for k in tracked:
            busy[k] = busy.get(k, 0) + 1
            entry.pop(k, None)

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
        if not finished:
            self._aborting[attempt] = None
        self._release(now)

    def _release(self, now: float) -> None:
        """Bound the stored keys whose every possible storer has ended (at ``now``)."""
        pending = (*self._inflight, *self._aborting)
        low = min(pending) if pending else self._next
        taints, tainted = self._taints, self._tainted
        while taints and taints[0][0] <= low:  # every request that could have stored it ended
            bound, _, k = heapq.heappop(taints)
            if tainted.get(k) != bound:
                continue  # a later store of it waits for later requests
            del tainted[k]
            self._last[k] = now
            self._push(k)

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
        armed_at = self.armed_at
        if self.off is not None or armed_at is None or sent_at < armed_at:
            return
        live = self.live
        for k in keys:
            if live.get(k, sent_at) <= sent_at:
                live[k] = sent_at

    def scan(self, events: Iterable[tuple[bool, Key]]) -> tuple[set[Key], set[Key]]:
        """One applied batch's GPU events in order, ``(stored, key)`` (``stored`` False: a
        ``BlockRemoved``). Returns the live keys it removed (held still if an older block is:
        :meth:`oldest_held`) and every key it named."""
        removed: set[Key] = set()
        named: set[Key] = set()
        if self.off is not None:
            return removed, named
        armed, live = self.armed, self.live
        for stored, key in events:
            named.add(key)
            if not stored:
                if armed and key in live:
                    removed.add(key)
                continue
            if armed:  # the storing request frees it after T
                live[key] = max(live.get(key, 0.0), self.clean_at or 0.0)
            if key[0] != self.group:
                continue
            self._tie += 1  # one of the requests in flight stored it: no bound until they end
            heapq.heappush(self._taints, (self._next, self._tie, key))
            self._tainted[key] = self._next
            self._entry.pop(key, None)
        return removed, named

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
                self._last.pop(k, None)
            else:
                found = e
                break
        for item in put_back:
            heapq.heappush(heap, item)
        return found

    def size(self) -> int:
        """Keys it keeps a record for (what :attr:`max_keys` bounds)."""
        return len(self.live) + len(self._last) + len(self._never) + len(self._taints)

    def compact(self, held: Callable[[Key], bool]) -> None:
        """Past :attr:`max_keys`: forget the keys the index no longer holds (their records
        prove nothing until they are hit or stored again); still past it, turn off."""
        if self.off is not None or self.size() <= self.max_keys:
            return
        self.live = {k: t for k, t in self.live.items() if held(k)}
        self._never = {k for k in self._never if held(k) or k in self._busy}
        for k in [k for k in self._last if not held(k)]:
            del self._last[k]
            self._entry.pop(k, None)
        self._heap = [(e, t, k) for k, (e, t) in self._entry.items()]
        heapq.heapify(self._heap)
        self._taints = [(b, i, k) for i, (k, b) in enumerate(self._tainted.items())]
        heapq.heapify(self._taints)
        if self.size() > self.max_keys:
            self.turn_off(f"over {self.max_keys} keys held since attach")
