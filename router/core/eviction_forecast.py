"""What the requests queued ahead of a request will evict before vLLM admits it.

Under load a request waits in vLLM's queue behind others routed to the same replica. When each
of those is admitted its prefill takes blocks from the head of the free queue, evicting the
cached blocks there (spec §2.2), so a prefix the events still show may be gone when this
request's turn comes: on two real vLLM replicas at ~20 requests/s (18 in flight on average)
21 of 300 admission-time predictions were too high for that reason (``bench/real_vllm/load.py
--rate 20``; issue 17 item 2).

The forecast, per replica (spec §5.4 says why it can only be a model):

* ``free``: the replica's free blocks, ``(1 - vllm:kv_cache_usage_perc) x num_gpu_blocks``
  from its ``/metrics`` (``vllm:cache_config_info``); of those, the ones the model does not
  know as cached (:class:`router.core.free_queue.FreeQueue`) are uncached, and vLLM 0.32
  keeps those at the head of its queue (``free_blocks`` prepends them), to be taken first;
* ``ahead``: the requests routed there and not answered yet, in the order they were routed,
  less those vLLM has admitted already: of the ones routed before its last scrape, only as
  many as ``vllm:num_requests_waiting`` said were waiting (the latest routed; vLLM admits
  in order). Each one's admission takes its uncached prompt blocks in every group from the head
  (:func:`allocation`): the uncached free blocks first, then cached ones, evicted. A step
  later the sliding-window blocks behind its window that it will not keep come back to the
  head, uncached, and the next admission takes those first;
* the cached keys at the head that this walk evicts are gone when this request is admitted:
  its hit is computed again without them (vLLM's rule on what is left, so a lost
  sliding-window block cuts the hit where vLLM cuts it).

Decode allocations of the requests already running are not counted (errs high), nor requests
from other clients. The forecast never routes: it refines the admission-time prediction
(``x-kvrouter-expected-hit``) and is reported against vLLM's ``cached_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from events.hashing import BlockHasher, LazyChain, RequestKeys
from events.layout import FA_TYPE_KINDS, SLIDING_KINDS, GroupKind, ResolvedLayout
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from events.stream import StreamBatch, StreamItem
from router.core.free_queue import FreeQueue, Key
from router.core.index import ReplicaKey
from router.core.predict import Predictor, ReplicaHit

__all__ = ["EvictionForecast", "Ticket", "allocation", "hit_keys"]


def allocation(layout: ResolvedLayout, num_tokens: int, hit_tokens: int) -> tuple[int, int]:
    """``(taken, returned)``: the blocks a prefill of ``num_tokens`` with a hit of
    ``hit_tokens`` takes from the head of the free queue over every group (they share one
    pool), and how many of them come back to the head uncached a step later.

    Every attention group allocates the blocks past its hit, a sliding-window group too: it
    frees the blocks behind its window only at its next step. Of those it keeps the window
    (``ceil((window - 1) / B)`` blocks, plus the one being filled) and, cached, the
    checkpoints its retention stores (at most a window at each of two boundaries, spec §4.7);
    the rest return. A Mamba group takes one state block. Full-attention groups hold theirs
    to the end."""
    taken = returned = 0
    for sg in layout.spec_groups:
        spec = sg.spec
        B = spec.block_size
        n = len(sg.group_ids)
        if spec.kind is GroupKind.MAMBA:
            taken += n
            continue
        new = max(0, -(-num_tokens // B) - hit_tokens // B)
        taken += new * n
        if spec.kind in SLIDING_KINDS and spec.sliding_window:
            window = -(-(spec.sliding_window - 1) // B)
            returned += max(0, new - 3 * window - 1) * n
    return taken, returned


def hit_keys(
    layout: ResolvedLayout, chain: LazyChain, hit_tokens: int
) -> tuple[list[Key], list[Key]]:
    """The cached keys a hit of ``hit_tokens`` touches at admission, as vLLM lets them go:
    ``(at the end, after prefill)``.

    Full-attention-type groups hold every hit block until the request ends and free them
    group after group, each group's blocks last first (the first of the list is evicted
    first); a sliding-window group touches only the window before the hit point and lets it
    go as the prefill passes. Only hashes the prediction has computed are read (the chain up
    to the hit), so this costs no hashing; the blocks the request stores past its hit are
    recognised in its replica's events instead (:meth:`EvictionForecast.on_events`)."""
    H = layout.hash_block_size
    end: list[Key] = []
    early: list[Key] = []
    n_fine = len(chain)
    memo: dict[int, list[object]] = {}
    for sg in sorted(layout.spec_groups, key=lambda s: min(s.group_ids)):
        spec = sg.spec
        B = spec.block_size
        if B % H or not (spec.kind in FA_TYPE_KINDS or spec.kind in SLIDING_KINDS):
            continue
        k = B // H
        count = min(hit_tokens // B, n_fine // k)
        if spec.kind in FA_TYPE_KINDS:
            lo, out = 0, end
        else:
            lo, out = max(0, count - -(-((spec.sliding_window or 1) - 1) // B)), early
        hashes = memo.get(k)
        if hashes is None:
            hashes = memo[k] = [chain.block_wire(j, k) for j in range(count)]
        for g in sorted(sg.group_ids):
            out.extend((g, h) for h in reversed(hashes[lo:count]))
    return end, early


def _links(layout: ResolvedLayout, chain: LazyChain, num_tokens: int, hit_tokens: int) -> list[Key]:
    """The full-attention keys a request's first store starts at (the block past its hit)
    or names as its parent (the last hit block), in every full-attention group. The block
    past the hit is the one vLLM's hit rule found missing, so the prediction hashed it."""
    H = layout.hash_block_size
    out: list[Key] = []
    for sg in layout.spec_groups:
        spec = sg.spec
        B = spec.block_size
        if spec.kind not in FA_TYPE_KINDS or B % H:
            continue
        k, j = B // H, hit_tokens // B
        for jj in (j - 1, j):
            if 0 <= jj < num_tokens // B and (jj + 1) * k <= len(chain):
                h = chain.block_wire(jj, k)
                out.extend((g, h) for g in sg.group_ids)
    return out


@dataclass(slots=True)
class Ticket:
    """One routed request, from the decision until its answer ends."""

    key: ReplicaKey
    taken: int
    """What its admission takes from the head of the free queue (:func:`allocation`)."""
    returned: int
    """What comes back to the head, uncached, a step later."""
    routed_at: float = 0.0
    """When it was routed (the caller's clock, as the ``since`` of :meth:`evicted`)."""
    end: list[Key] = field(default_factory=list)
    """Its hit's full-attention keys, freed when it ends (first given, first evicted)."""
    early: list[Key] = field(default_factory=list)
    """Its hit's sliding-window keys, back in the queue right after its prefill."""
    stored: list[Key] = field(default_factory=list)
    """Full-attention keys its events stored (prefill and decode), held until it ends."""
    links: list[Key] = field(default_factory=list)
    """Keys a ``BlockStored`` of its own names (as its first block or parent)."""
    admitted: bool = False
    done: bool = False


class _Minus:
    """A GPU table with one replica's bit cleared for the hashes that will be gone."""

    __slots__ = ("base", "bit", "gone")

    def __init__(self, base: object, bit: int, gone: set[object]) -> None:
        self.base = base
        self.bit = bit
        self.gone = gone

    def get(self, h: object, default: int = 0) -> int:
        m = self.base.get(h, 0)  # type: ignore[attr-defined]
        return m & ~self.bit if h in self.gone else m


class _Without:
    """An index view (the index, or the speculative overlay's) minus the forecast's evictions
    on one replica; everything but the GPU tables reads through."""

    def __init__(self) -> None:
        self.base: object = None
        self.bit = 0
        self.gone: dict[int, set[object]] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.base, name)

    @property
    def layout(self) -> ResolvedLayout | None:
        return self.base.layout  # type: ignore[attr-defined]

    @property
    def live_bits(self) -> int:
        return self.base.live_bits  # type: ignore[attr-defined]

    def table(self, tier: str, group: int) -> object:
        base = self.base.table(tier, group)  # type: ignore[attr-defined]
        gone = self.gone.get(group) if tier == "GPU" else None
        return _Minus(base, self.bit, gone) if gone else base


class EvictionForecast:
    """One pool's forecast (module docstring). Single-threaded, like the index."""

    def __init__(self, predictor: Predictor) -> None:
        self._base = predictor
        self._view = _Without()
        self._predictor = Predictor(self._view)  # type: ignore[arg-type]
        # the pool's hasher and its memo: the chain is hashed once per request
        self._predictor.hasher = predictor.hasher  # type: ignore[method-assign]
        self.queues: dict[ReplicaKey, FreeQueue] = {}
        self._ahead: dict[ReplicaKey, dict[int, Ticket]] = {}
        """Per replica, the routed requests not admitted yet, in routing order."""
        self._owner: dict[ReplicaKey, dict[Key, Ticket]] = {}
        """Per replica, the full-attention keys a request in flight will store next to (the
        block past its hit, the last it stored): a ``BlockStored`` that starts at one, or
        whose parent is one, is that request's."""

    def queue(self, key: ReplicaKey) -> FreeQueue:
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = FreeQueue()
        return q

    def ahead(self, key: ReplicaKey) -> int:
        """Blocks the requests queued ahead on ``key`` will take at their admission."""
        return sum(t.taken for t in self._ahead.get(key, {}).values())

    # ----------------------------------------------------------------- events

    def on_events(self, key: ReplicaKey, events: Iterable[object]) -> None:
        q = self.queue(key)
        owners = self._owner.get(key)
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                q.clear()
            elif isinstance(ev, (BlockStored, BlockRemoved)) and ev.medium in (None, "GPU"):
                g = ev.group_idx or 0
                keys = [(g, h) for h in ev.block_hashes]
                if isinstance(ev, BlockStored):
                    if keys and owners:
                        self._attribute(owners, g, ev.parent_block_hash, keys, q)
                    q.stored(keys)
                else:
                    q.removed(keys)

    @staticmethod
    def _attribute(
        owners: dict[Key, Ticket], g: int, parent: object, keys: list[Key], q: FreeQueue
    ) -> None:
        """A store that continues a request in flight (from its hit, or from its last store)
        is that request's: it holds the blocks until it ends (vLLM frees them then)."""
        t = owners.get(keys[0])
        if t is None and parent is not None:
            t = owners.get((g, parent))
        if t is None or t.done:
            return
        q.hold(keys)
        t.stored.extend(keys)
        owners[keys[-1]] = t
        t.links.append(keys[-1])

    def on_item(self, key: ReplicaKey, item: StreamItem) -> None:
        """A stream item the index applied: batches update the queue; a reset or a loss of
        events (the index wipes or distrusts the replica) leaves nothing known cached."""
        if type(item) is StreamBatch:
            self.on_events(key, item.batch.events)
        else:
            self.forget(key)

    def forget(self, key: ReplicaKey) -> None:
        q = self.queues.get(key)
        if q is not None:
            q.clear()

    def drop(self, key: ReplicaKey) -> None:
        """The replica left the pool: nothing of it is kept (its requests still in flight end
        without a queue to free into)."""
        self.queues.pop(key, None)
        self._ahead.pop(key, None)
        self._owner.pop(key, None)

    # ----------------------------------------------------------------- requests

    def routed(
        self,
        key: ReplicaKey,
        layout: ResolvedLayout | None,
        chain: LazyChain | None,
        num_tokens: int,
        hit_tokens: int,
        now: float = 0.0,
    ) -> Ticket | None:
        """A request was routed to ``key`` at ``now`` with an expected hit of ``hit_tokens``:
        until it is admitted its allocation is ahead of every request routed there after it."""
        if layout is None:
            return None
        t = Ticket(key, *allocation(layout, num_tokens, hit_tokens), routed_at=now)
        if chain is not None:
            if hit_tokens > 0:
                t.end, t.early = hit_keys(layout, chain, hit_tokens)
            t.links = _links(layout, chain, num_tokens, hit_tokens)
            owners = self._owner.setdefault(key, {})
            for k in t.links:
                owners[k] = t
        self._ahead.setdefault(key, {})[id(t)] = t
        return t

    def _unqueue(self, t: Ticket) -> None:
        queued = self._ahead.get(t.key)
        if queued is not None:
            queued.pop(id(t), None)
            if not queued:
                del self._ahead[t.key]

    def admitted(self, t: Ticket | None) -> None:
        """Its answer began: vLLM admitted and prefilled it, so it holds its full-attention
        blocks until it ends and the other groups' blocks are back in the queue."""
        if t is None or t.admitted or t.done:
            return
        t.admitted = True
        self._unqueue(t)
        q = self.queues.get(t.key)
        if q is not None:  # none: no event from that replica yet, or it left the pool
            q.hold(t.end)  # its hit: touched at admission
            q.touch(t.early)

    def ended(self, t: Ticket | None) -> None:
        """Its answer ended (or it failed, or was cancelled): what it held is freed."""
        if t is None or t.done:
            return
        t.done = True
        if not t.admitted:
            self._unqueue(t)
        owners = self._owner.get(t.key)
        if owners is not None:
            for k in t.links:
                if owners.get(k) is t:
                    del owners[k]
            if not owners:
                del self._owner[t.key]
        # vLLM frees group after group, each group's blocks last first: its stores, then its hit
        end = t.end if t.admitted else []
        order = [k for g in sorted({k[0] for k in (*t.stored, *end)})
                 for k in (*(x for x in reversed(t.stored) if x[0] == g),
                           *(x for x in end if x[0] == g))]  # fmt: skip
        q = self.queues.get(t.key)
        if q is not None:
            q.release(order)

    # ----------------------------------------------------------------- forecast

    def evicted(
        self,
        key: ReplicaKey,
        blocks: tuple[int, int] | None,
        waiting: float | None = None,
        since: float | None = None,
    ) -> list[Key]:
        """The cached keys the allocations ahead will evict before a request routed to
        ``key`` now is admitted. ``blocks``: its free blocks and all its usable ones (None:
        unknown, no forecast); ``waiting``: its waiting requests at its last scrape, at
        ``since`` (module docstring)."""
        q = self.queues.get(key)
        queued = self._ahead.get(key)
        if q is None or blocks is None or not queued:
            return []
        tickets = list(queued.values())
        if waiting is not None and since is not None and waiting >= 0:
            later = sum(1 for t in tickets if t.routed_at > since)
            keep = int(waiting) + later
            tickets = tickets[len(tickets) - keep :] if keep < len(tickets) else tickets
        free, total = blocks
        # the uncached free blocks, taken first: at most the blocks no cached key names (a
        # bound, as the model cannot tell which of its cached keys running requests hold)
        uncached = max(0, min(free, total - len(q)))
        evict = 0
        for t in tickets:
            evict += max(0, t.taken - uncached)
            uncached = max(0, uncached - t.taken) + t.returned
        return list(q.head(evict))

    def predict(
        self,
        view: object,
        key: ReplicaKey,
        bit: int,
        token_ids: Sequence[int],
        keys: RequestKeys | None,
        blocks: tuple[int, int] | None,
        waiting: float | None = None,
        since: float | None = None,
    ) -> ReplicaHit | None:
        """``key``'s hit once the allocations ahead evicted what they will, over ``view``
        (the index, or index + speculative overlay, before this request's own entries); None
        when they evict nothing the request's chain has (the hit stands)."""
        gone = self.evicted(key, blocks, waiting, since)
        if not gone:
            return None
        hasher: BlockHasher | None = self._base.hasher()
        if hasher is None:
            return None
        chain = hasher.lazy_chain(token_ids, keys)
        mine = {chain.wire(i) for i in range(len(chain))}
        by_group: dict[int, set[object]] = {}
        for g, h in gone:
            if h in mine:
                by_group.setdefault(g, set()).add(h)
        if not by_group:
            return None
        v = self._view
        v.base, v.bit, v.gone = view, bit, by_group
        try:
            hit = self._predictor.predict(token_ids, keys, replicas=[key]).hit(key)
        finally:
            v.base, v.gone = None, {}
        return hit

    def snapshot(self) -> Mapping[str, object]:
        """For explain and ``/admin``: per replica, the blocks ahead and the queue's size."""
        return {
            "replicas": {
                f"{k[0]}/{k[1]}": {
                    "ahead_blocks": self.ahead(k),
                    "cached": len(q),
                    "free_cached": q.free_cached,
                }
                for k, q in self.queues.items()
            },
        }
