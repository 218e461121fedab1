"""Speculative insert: what a just-routed request *will* cache, held briefly for routing only.

Events trail requests: a replica publishes a prompt's blocks only once it has computed them,
so for a few hundred milliseconds after routing a prompt the index still says "not cached".
A burst of requests sharing a new prefix (a popular system prompt after a cold start) would
then be spread over every replica by the load terms, and each replica computes the prefix.
With speculation, the blocks a routed request will cache on its replica count as present
for ``ttl_s`` seconds or until that replica's events about them arrive, so the burst lands
together and the prefix is computed once.

What counts as "will cache" follows spec §4.7 (default retention; the rule itself is
:mod:`events.retention`, which the simulated replica runs too) and errs low:

* full-attention-type and chunked-local groups: every full block up to the cached length
  (``num_tokens`` rounded down to S unless partial hits are on);
* sliding-window groups: the ``ceil((window - 1) / B)`` blocks ending at each reachable
  boundary (``floor((num_tokens - 1) / A) * A``, and ``floor(junction / A) * A`` with the
  junction ``hit + num_uncached`` when ``num_uncached > 0``, §4.1) -- or every block when
  ``A % B != 0``;
* Mamba (``align`` mode): the one state block ending at each reachable boundary;
* anything else (EAGLE groups, partial-hit layouts' checkpoints, ``retention_interval`` other
  than 0, Mamba ``all`` mode) adds nothing: a missing entry only makes the speculative hit
  lower, never invents one.

This is an overlay, never index state. :class:`SpeculativeOverlay` keeps its own
``(group, wire hash) -> replica bitmask`` tables (the index's slot bits) and
:meth:`SpeculativeOverlay.predict` runs the ordinary predictor over "index OR overlay". The
reported prediction (the ``x-kvrouter-predicted-hit`` header, the error loop, explain's
``hit_tokens``) stays the events-only one; explain shows the speculative hit separately.

Entries live as long as their request is in flight -- vLLM may keep a request waiting or
prefilling for seconds under load, and until it is scheduled no event can exist -- and then
``ttl_s`` more (:meth:`SpeculativeOverlay.finish`; the events of a finished request are
published by then, this only covers their way here). ``hold_s`` bounds the in-flight part for
an answer that never ends. Entries leave earlier when the replica's events name their hash
(stored: the index has it now; removed: the index is right and the overlay must not contradict
it), when the replica's stream resets or loses events, when the replica is removed, or when the
request failed over before reaching it (:meth:`SpeculativeOverlay.discard`).

The hit over index + overlay is the **admission-time** (expected) hit: what vLLM will find when
it admits the request, with the requests routed ahead of it counted as cached. The events-only
hit is what is already confirmed; the router reports both (``x-kvrouter-predicted-hit`` and
``x-kvrouter-expected-hit``) and counts how often each equals vLLM's ``cached_tokens``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from events.hashing import BlockHasher, RequestKeys
from events.layout import SLIDING_KINDS, GroupKind, ResolvedLayout
from events.retention import reachable_boundaries, retained_blocks
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from events.stream import StreamBatch, StreamItem
from router.core.hybrid import HitResult
from router.core.index import KVIndex, ReplicaKey, UnknownReplica
from router.core.predict import Prediction, Predictor
from router.core.shared_tier import SharedTier

__all__ = ["SpeculativeOverlay", "speculative_blocks"]


def speculative_blocks(
    layout: ResolvedLayout, num_tokens: int, hit: HitResult | None
) -> list[tuple[tuple[int, ...], int, list[int]]]:
    """Blocks a request of ``num_tokens`` prompt tokens will cache (module docstring).

    Returns ``(group_ids, k, block indices)`` per spec group, ``k = B / H`` (block ``j`` of
    the group is the fine chain's hash ``(j + 1) * k - 1``). ``hit`` is the request's hit on
    the chosen replica (for the junction); None means no junction. Which blocks is vLLM's
    retention rule (:mod:`events.retention`, the one the simulated replica runs too); this
    function only decides which groups to trust it for.
    """
    H = layout.hash_block_size
    A = layout.alignment
    S = layout.scheduler_block_size
    cached = num_tokens if layout.partial_hits else num_tokens // S * S
    junction = hit.hit_tokens + hit.num_uncached if hit is not None and hit.num_uncached else None
    reachable = {b for b in reachable_boundaries(num_tokens, junction, A) if b <= cached}
    checkpoints = layout.layout.retention_interval == 0 and not layout.partial_hits
    out = []
    for sg in layout.spec_groups:
        spec = sg.spec
        B = spec.block_size
        if spec.eagle or B % H:
            continue
        if spec.kind in SLIDING_KINDS or spec.kind is GroupKind.MAMBA:
            # Only the default retention's checkpoints are predictable from the prompt alone
            # (and Mamba only in align mode); elsewhere err low.
            if not checkpoints or (spec.kind is GroupKind.MAMBA and spec.mamba_mode != "align"):
                continue
        elif not (spec.is_fa_type or spec.kind is GroupKind.CHUNKED_LOCAL_ATTENTION):
            continue
        blocks = retained_blocks(
            spec, 0, cached // B, alignment=A, retention=0, reachable=reachable
        )
        if blocks:
            out.append((sg.group_ids, B // H, blocks))
    return out


class _Merged:
    """A GPU table seen through the overlay: ``get`` ORs the replica bits of both."""

    __slots__ = ("base", "over")

    def __init__(self, base: dict, over: dict) -> None:
        self.base = base
        self.over = over

    def get(self, h: object, default: int = 0) -> int:
        return self.base.get(h, 0) | self.over.get(h, 0)


class _View:
    """The index as :class:`Predictor` reads it, with the overlay merged into the GPU tier."""

    def __init__(self, index: KVIndex, overlay: SpeculativeOverlay) -> None:
        self._index = index
        self._overlay = overlay

    def hasher(self) -> BlockHasher | None:
        return self._index.hasher()

    @property
    def layout(self) -> ResolvedLayout | None:
        return self._index.layout

    def replicas(self) -> list[ReplicaKey]:
        return self._index.replicas()

    def is_trusted(self, key: ReplicaKey) -> bool:
        return self._index.is_trusted(key)

    def untrusted_reason(self, key: ReplicaKey) -> str | None:
        return self._index.untrusted_reason(key)

    def partial_reason(self, key: ReplicaKey) -> str | None:
        return self._index.partial_reason(key)

    def slot_bit(self, key: ReplicaKey) -> int:
        return self._index.slot_bit(key)

    @property
    def live_bits(self) -> int:
        return self._index.live_bits

    def tiers_in_use(self) -> list[str]:
        return self._index.tiers_in_use()

    def shared_tiers(self) -> dict[str, SharedTier]:
        return self._index.shared_tiers()

    def table(self, tier: str, group: int) -> object:
        base = self._index.table(tier, group)
        over = self._overlay._tables.get(group) if tier == "GPU" else None
        return _Merged(base, over) if over else base


@dataclass(slots=True)
class _Insertion:
    expires: float
    """While in flight: the ``hold_s`` bound; once finished: the end of the ``ttl_s`` grace."""
    key: ReplicaKey
    bit: int
    first: object
    entries: list[tuple[int, object]]
    live: bool = True
    in_flight: bool = True


class SpeculativeOverlay:
    """One pool's speculative entries (module docstring). Single-threaded, like the index."""

    def __init__(
        self,
        index: KVIndex,
        predictor: Predictor,
        ttl_s: float = 2.0,
        *,
        hold_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.ttl_s = ttl_s
        self.hold_s = hold_s
        self._clock = clock
        self._base = predictor
        self._predictor = Predictor(_View(index, self))  # type: ignore[arg-type]
        # share the pool's hasher (and its memo): the chain is hashed once per request
        self._predictor.hasher = predictor.hasher  # type: ignore[method-assign]
        self._tables: dict[int, dict[object, int]] = {}
        self._owner: dict[tuple[int, object, int], _Insertion] = {}
        """(group, hash, bit) -> the latest insertion holding it (it alone may retire it)."""
        self._firsts: collections.Counter[object] = collections.Counter()
        # Two queues, each in expiry order because each has one constant lifetime: requests
        # in flight by start (bound hold_s), finished ones by finish (grace ttl_s).
        self._in_flight: collections.deque[_Insertion] = collections.deque()
        self._fifo: collections.deque[_Insertion] = collections.deque()
        self.inserted = 0
        self.confirmed = 0
        self.expired = 0
        """Insertions retired by a clock (the grace after their answer, or ``hold_s``)."""
        self._moves = index.slot_moves

    def __len__(self) -> int:
        """Live (group, hash, replica) entries."""
        return len(self._owner)

    @property
    def view(self) -> object:
        """The index with the overlay merged in, as :class:`Predictor` reads it (for other
        views to build on: router.core.eviction_forecast)."""
        return self._predictor.index

    # ----------------------------------------------------------------- entries

    def _add(self, g: int, h: object, bit: int, ins: _Insertion) -> None:
        ck = (g, h, bit)
        if ck not in self._owner:
            t = self._tables.setdefault(g, {})
            t[h] = t.get(h, 0) | bit
        self._owner[ck] = ins

    def _drop(self, ck: tuple[int, object, int]) -> None:
        del self._owner[ck]
        g, h, bit = ck
        t = self._tables[g]
        m = t[h] & ~bit
        if m:
            t[h] = m
        else:
            del t[h]
            if not t:
                del self._tables[g]

    def _retire(self, ins: _Insertion) -> None:
        if not ins.live:
            return
        ins.live = False
        owner = self._owner
        for g, h in ins.entries:
            ck = (g, h, ins.bit)
            if owner.get(ck) is ins:
                self._drop(ck)
        ins.entries = []
        self._firsts[ins.first] -= 1
        if self._firsts[ins.first] <= 0:
            del self._firsts[ins.first]

    def expire(self) -> None:
        """Drop insertions past their time (called by every other entry point), and those
        whose replica's slot bit changed since (a wipe gives the replica a fresh one, and the
        old may later be another replica's: router.core.index KVIndex._wipe)."""
        if self.index.slot_moves != self._moves:
            self._moves = self.index.slot_moves
            self._retire_moved()
        now = self._clock()
        for queue in (self._in_flight, self._fifo):
            while queue:
                ins = queue[0]
                if ins.live and (queue is self._fifo or ins.in_flight):
                    if ins.expires > now:
                        break
                    self.expired += 1
                    self._retire(ins)
                queue.popleft()  # retired, or finished (it waits in the other queue)

    def _retire_moved(self) -> None:
        index = self.index
        for queue in (self._in_flight, self._fifo):
            for ins in queue:
                if ins.live:
                    try:
                        moved = index.slot_bit(ins.key) != ins.bit
                    except UnknownReplica:
                        moved = True
                    if moved:
                        self._retire(ins)

    def record(
        self,
        key: ReplicaKey,
        token_ids: Sequence[int],
        keys: RequestKeys | None,
        hit: HitResult | None,
    ) -> _Insertion | None:
        """The request was routed to ``key``: its future blocks count as present there."""
        self.expire()
        layout = self.index.layout
        hasher = self._base.hasher()
        if layout is None or hasher is None or not self.index.is_trusted(key):
            return None
        plan = speculative_blocks(layout, len(token_ids), hit)
        if not plan:
            return None
        chain = hasher.lazy_chain(token_ids, keys)
        bit = self.index.slot_bit(key)
        ins = _Insertion(self._clock() + self.hold_s, key, bit, chain.wire(0), [])
        entries = ins.entries
        for group_ids, k, blocks in plan:
            for j in blocks:
                h = chain.block_wire(j, k)
                for g in group_ids:
                    entries.append((g, h))
                    self._add(g, h, bit, ins)
        self._firsts[ins.first] += 1
        self._in_flight.append(ins)
        self.inserted += 1
        return ins

    def finish(self, ins: _Insertion | None) -> None:
        """The request's answer ended (or broke off after it began): its entries stay
        ``ttl_s`` more, for its last events to arrive, then the events alone speak."""
        if ins is None or not ins.live or not ins.in_flight:
            return
        ins.in_flight = False
        ins.expires = self._clock() + self.ttl_s
        self._fifo.append(ins)

    def discard(self, ins: _Insertion | None) -> None:
        """The request did not reach that replica after all (it failed over)."""
        if ins is not None:
            self._retire(ins)

    def forget_replica(self, key: ReplicaKey) -> None:
        """The replica was removed, reset or lost events: nothing speculative stays."""
        for queue in (self._in_flight, self._fifo):
            for ins in queue:
                if ins.key == key:
                    self._retire(ins)

    def on_events(self, key: ReplicaKey, events: Iterable[object]) -> None:
        """The replica's events arrived: entries they name are the index's business now."""
        if not self._owner:
            return
        bit = self.index.slot_bit(key)
        owner = self._owner
        for ev in events:
            if type(ev) is AllBlocksCleared:
                self.forget_replica(key)
                return
            # only GPU events speak for the GPU cache the overlay stands in for
            if isinstance(ev, (BlockStored, BlockRemoved)) and ev.medium in (None, "GPU"):
                g = ev.group_idx or 0
                for h in ev.block_hashes:
                    ck = (g, h, bit)
                    if ck in owner:
                        self._drop(ck)
                        self.confirmed += 1

    def on_item(self, key: ReplicaKey, item: StreamItem) -> None:
        """Feed a stream item the index just applied (batches confirm, the rest forget)."""
        if type(item) is StreamBatch:
            self.on_events(key, item.batch.events)
        else:
            self.forget_replica(key)

    # --------------------------------------------------------------- routing

    def predict(
        self,
        token_ids: Sequence[int],
        keys: RequestKeys | None,
        *,
        skip_reading: bool = False,
        explain: bool = False,
        blind: bool = False,
    ) -> Prediction | None:
        """Hits over index + overlay, or None when the overlay cannot change any hit (no
        live insertion shares the request's first block -- every chain hash depends on it)."""
        self.expire()
        if not self._firsts or skip_reading:
            return None
        hasher = self._base.hasher()
        if hasher is None or not token_ids:
            return None
        chain = hasher.lazy_chain(token_ids, keys)
        if not len(chain) or chain.wire(0) not in self._firsts:
            return None  # shorter than a block: nothing to hit
        return self._predictor.predict(token_ids, keys, explain=explain, blind=blind)
