"""The physical block pool of the simulated KV cache (vLLM 0.32's ``v1/core/block_pool.py``).

One free queue and one prefix-cache map shared by all KV-cache groups. A block id belongs to
one group at a time. Freed cached blocks go to the tail of the free queue, freed uncached
ones (a sliding window's blocks behind the window, a partial tail) to its head, to be reused
first; allocation takes the head, and a cached block taken from the head is evicted there
and then (lazy LRU eviction), emitting one ``BlockRemoved`` per key with that key's
``group_idx`` (spec §2.2). Callers free a request's blocks tail first (vLLM's
``reversed(req_blocks)``), group 0 first, so the tail of a sequence is evicted before its
head. tests/test_block_pool_vs_vllm.py holds the queue order to vLLM's own ``BlockPool``.

This module knows blocks and keys only: which blocks a group needs is
:mod:`gpu_emitter.managers`' business, and the hit is :mod:`gpu_emitter.coordinator`'s, which
probe the map through :meth:`BlockPoolCore.get_cached_block` exactly as vLLM's managers probe
``BlockPool.get_cached_block``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from events.layout import SLIDING_KINDS, GroupSpec
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from gpu_emitter.request import Request

__all__ = ["NULL_BLOCK", "BlockPoolCore", "KVEvent", "PoolExhausted"]

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

#: Block id of vLLM's null block: a placeholder position that holds no KV.
NULL_BLOCK = 0


class PoolExhausted(RuntimeError):
    """More blocks were asked for than are free: the caller skipped its capacity check (a bug)."""


class BlockPoolCore:
    """vLLM's ``BlockPool``: free queue (LRU), prefix-cache map with copies, events.

    Block 0 is the null block: never free, never cached. ``cache[g]`` maps a wire hash to the
    ids of the physical blocks of group ``g`` keyed by it, in insertion order (copies are
    not deduplicated, spec §0.7). ``hash_block_size`` is H, the granularity of the request
    hash chains the managers probe with (spec §1.4).
    """

    def __init__(
        self,
        num_blocks: int,
        num_groups: int,
        emit: Callable[[KVEvent], None],
        hash_block_size: int,
    ) -> None:
        self.num_blocks = num_blocks
        self.hash_block_size = hash_block_size
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.key: list[Any] = [None] * num_blocks
        self.key_group = [-1] * num_blocks
        self.epoch = [0] * num_blocks
        """Bumped on every allocation: tells a block's current tenant from an earlier one."""
        self.cache: list[dict[Any, dict[int, None]]] = [{} for _ in range(num_groups)]
        self.emit = emit

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, wire: Any, group_ids: Sequence[int]) -> list[int] | None:
        """The first cached copy of ``wire`` in each of ``group_ids``, or None if any group
        lacks it: one joint lookup of a spec group (spec §4.2), as vLLM's does."""
        out = []
        cache = self.cache
        for g in group_ids:
            copies = cache[g].get(wire)
            if not copies:
                return None
            out.append(next(iter(copies)))
        return out

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, evicting their keys."""
        if n > len(self.free_queue):
            raise PoolExhausted(f"asked for {n} blocks with {len(self.free_queue)} free")
        out = [self.free_queue.popitem(last=False)[0] for _ in range(n)]
        for bid in out:
            if self.key[bid] is not None:
                self._evict(bid)
            self.ref[bid] = 1
            self.epoch[bid] += 1
        return out

    def _evict(self, bid: int) -> None:
        g, wire = self.key_group[bid], self.key[bid]
        copies = self.cache[g][wire]
        del copies[bid]
        if not copies:
            del self.cache[g][wire]
        self.key[bid] = None
        self.key_group[bid] = -1
        self.emit(BlockRemoved(block_hashes=[wire], medium="GPU", group_idx=g))

    def touch(self, blocks: Iterable[int]) -> None:
        """Protect hit blocks: a free one leaves the free queue."""
        for bid in blocks:
            if bid == NULL_BLOCK:
                continue
            if self.ref[bid] == 0:
                del self.free_queue[bid]
            self.ref[bid] += 1

    def free_blocks(self, ordered: Iterable[int]) -> None:
        """Release blocks in the given order: the cached ones no request holds join the tail
        (LRU), the uncached ones go to the head, to be reused first (0.32's ``free_blocks``:
        ``prepend_n``, keeping their order)."""
        blocks = [b for b in ordered if b != NULL_BLOCK]
        for bid in blocks:
            self.ref[bid] -= 1
        first = []
        for bid in blocks:
            if self.ref[bid] == 0:
                if self.key[bid] is None:
                    first.append(bid)
                else:
                    self.free_queue[bid] = None
        for bid in reversed(first):
            self.free_queue[bid] = None
            self.free_queue.move_to_end(bid, last=False)

    def insert(self, bid: int, group: int, wire: Any) -> None:
        """Key block ``bid`` of ``group`` by ``wire`` (no event: see :meth:`cache_full_blocks`)."""
        self.key[bid] = wire
        self.key_group[bid] = group
        self.cache[group].setdefault(wire, {})[bid] = None

    def cache_full_blocks(
        self,
        req: Request,
        blocks: list[int],
        lo: int,
        hi: int,
        inserted: list[int],
        group: int,
        spec: GroupSpec,
    ) -> None:
        """Key the ``inserted`` blocks of range ``[lo, hi)`` and emit the range's event.

        One ``BlockStored`` per call covers the whole newly full range (its ``token_ids``),
        with hashes only for the inserted blocks, possibly none (spec §2.4's block mask).
        """
        b = spec.block_size
        k = b // self.hash_block_size
        wires = req.wires
        hashes = []
        extras = []
        for j in inserted:
            unit = (j + 1) * k - 1
            wire = wires[unit]
            self.insert(blocks[j], group, wire)
            hashes.append(wire)
            extras.append(req.event_extras(unit))
        self.emit(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=wires[lo * k - 1] if lo > 0 else None,
                token_ids=req.tokens[lo * b : hi * b],
                block_size=b,
                lora_id=None,
                medium="GPU",
                lora_name=req.keys.lora_name if req.keys is not None else None,
                extra_keys=extras if hashes else None,
                group_idx=group,
                kv_cache_spec_kind=str(spec.kind),
                kv_cache_spec_sliding_window=(
                    spec.sliding_window if spec.kind in SLIDING_KINDS else None
                ),
            )
        )

    def reset(self) -> bool:
        """Drop every key if no block is in use (vLLM's ``reset_prefix_cache``)."""
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        for table in self.cache:
            table.clear()
        self.key = [None] * self.num_blocks
        self.key_group = [-1] * self.num_blocks
        self.emit(AllBlocksCleared())
        return True
