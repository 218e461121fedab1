"""Which removals of a *partial* replica's blocks provably took a copy cached before attach.

A router attached to a replica that has run for a while does not know how many physical copies
of a block the replica held at attach: vLLM stores a full-attention block again after a shorter
hybrid hit and a sliding-window checkpoint again when a later request recomputes it (spec §0.7,
§6.15), and nothing in 0.32's events counts copies. The index learns one copy of such a key
(an answer, a witness, a store since attach) and drops the key at its first ``BlockRemoved``,
while the replica may still serve it from another copy: the next request on that prefix is
predicted short. Measured on the late-attach test (tests/test_late_attach.py): every miss left
after the other partial rules was one of those.

vLLM's free queue is an LRU (spec §2.1): blocks join its tail when their last request frees
them, a hit takes a block out (``touch``), and an allocation evicts from the head. So the
blocks it evicts come in order of the time they were last freed. That order proves things:

- A block whose key the router has never known since attach (no event stored or named it, and
  no request the router sent had it in its prompt, whatever the request hit) was last freed
  before attach, or by a request the router did not send.
- If the router is the replica's only client from some moment ``T`` on (every request running
  at ``T`` finished, none came from elsewhere since), an unknown block was last freed before
  ``T``. A copy freed after ``T`` (a block a request sent after ``T`` hit, or one stored in a
  batch applied after ``T``) sits behind it in the queue.
- Hence when such an unknown block is evicted, every eviction before it took a copy freed
  before ``T``: a key with a copy freed after ``T`` still holds that copy, whatever the index
  dropped on the way. Those keys are held again (``KVIndex``, counter ``older_copy_evicted``).

The proof needs the router to be the only client: a request the router did not send could
have freed the "unknown" block late. ``T`` is set from the replica's own metrics: two scrapes
in a row (one scrape interval apart, so the events of anything that ran before are in) that
show no request but the router's; any later scrape that shows another client's request turns
the rule off for the rest of the partial period (a replica's finished-request count,
``vllm:request_success_total``, also shows one that came and went between two scrapes).
Without the rule predictions are the plain lower bound, never more.

Its limit: the proof is the *next* eviction of an unknown block, which comes with the next
allocation. When the very next request needs the key whose older copy was just evicted, it is
still predicted short (its answer then teaches the key back). On the late-attach test, seeds
5-12, 1,186 of 1,200 requests were exact with the proof and 1,180 without.

Everything here is pure: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["NAMED", "REMOVED", "STORED", "EvictionWitness", "Key"]

Key = tuple[int, object]
"""``(group, wire hash)`` of a GPU block."""

REMOVED, STORED, NAMED = 0, 1, 2
"""What a batch's event did to a key (:meth:`EvictionWitness.scan`): a ``BlockRemoved``, a
``BlockStored`` of it, or a store naming it as parent (only known: which copy is unsaid)."""


@dataclass(slots=True)
class EvictionWitness:
    """One partial replica's record for the eviction-order proof (module docstring)."""

    max_keys: int
    """Keys ``seen`` may hold; past it the rule is off (an unknown key could no longer be told
    from a forgotten one)."""
    max_quiet_removals: int
    """Removals without an unknown one after which the rule turns off: the blocks cached before
    attach are then all evicted or in use, and nothing can prove anything any more."""
    seen: set[Key] = field(default_factory=set)
    """Every key the router knew on this replica since attach (stored, named, hit, held)."""
    live: set[Key] = field(default_factory=set)
    """Keys with a copy last freed after ``armed_at`` (module docstring)."""
    pending: set[Key] = field(default_factory=set)
    """Live keys removed since the last unknown eviction: proved kept by the next one."""
    clean_at: float | None = None
    """The first of the scrapes in a row that showed no other client (None: none yet)."""
    armed_at: float | None = None
    """``T``: from then on the router is the replica's only client (None: not yet)."""
    off: str | None = None
    """Why the rule is off for the rest of the partial period (None: it is not)."""
    quiet: int = 0
    """Removals since the last unknown one (or since arming)."""
    _base: tuple[float | None, int, int] | None = None
    """At the first clean scrape: the replica's finished count, the router's sent count and
    its requests in flight (:meth:`scrape`)."""

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

        Two clean scrapes in a row arm the rule (the later one's time is ``T``: every batch
        emitted before the first is in by then). Another client shows as a request running or
        waiting, or, between scrapes, as more requests finished since the first clean scrape
        than the router sent or had in flight then. Before arming that starts over; after,
        it turns the rule off."""
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

    def sending(self, keys: Iterable[Key]) -> None:
        """Every key a request the router is sending could touch or store at admission (its
        prompt's blocks in every group): known from now on, whatever its answer (a request
        that fails or is cancelled never reports what it hit, but its blocks are freed)."""
        if self.off is None:
            self.seen.update(keys)
            self._bound()

    def touched(self, keys: Iterable[Key], sent_at: float) -> None:
        """Keys a request sent at ``sent_at`` hit (the blocks vLLM's hit rule needed for its
        ``cached_tokens``): vLLM touched a copy of each, freed when the request ended."""
        if self.off is not None:
            return
        keys = list(keys)
        self.seen.update(keys)
        if self.armed_at is not None and sent_at >= self.armed_at:
            self.live.update(keys)
        self._bound()

    def scan(self, events: Iterable[tuple[int, Key]]) -> set[Key]:
        """One applied batch's GPU events in order, ``(what, key)`` with ``what`` one of
        :data:`REMOVED`, :data:`STORED`, :data:`NAMED`. Returns the keys proved still held
        after it: live keys removed before an unknown eviction and not removed again after."""
        proved: set[Key] = set()
        if self.off is not None:
            return proved
        seen, live, pending = self.seen, self.live, self.pending
        armed = self.armed
        for what, key in events:
            if what:
                seen.add(key)
                if armed and what == STORED:  # the storing request frees it after T
                    live.add(key)
                continue
            if not armed:
                seen.add(key)
                continue
            self.quiet += 1
            if key in live:
                pending.add(key)
                proved.discard(key)
            elif key not in seen:
                proved |= pending
                pending.clear()
                self.quiet = 0
        if self.quiet > self.max_quiet_removals:
            self.turn_off(f"{self.max_quiet_removals} removals in a row took known blocks")
        else:
            self._bound()
        return proved

    def _bound(self) -> None:
        if len(self.seen) > self.max_keys:
            self.turn_off(f"over {self.max_keys} keys known since attach")
