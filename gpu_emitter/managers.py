"""Per-KV-cache-type rules of the simulated pool: hits, allocation, skipped blocks, hashing.

Imitates the split of vLLM 0.32's ``v1/core/single_type_kv_cache_manager.py``: one manager per
KV-cache group, each knowing only its own kind's rules, all sharing one
:class:`gpu_emitter.block_pool.BlockPoolCore` (the free queue and the prefix-cache map).

Each manager class has its own ``find_longest_cache_hit`` (spec §4.4), written the way vLLM
writes it: per block, eagerly, over the pool's own prefix-cache map, returning the hit blocks
per group (the null block where a group needs nothing) and the hit length. It shares no code
with the router's hit rule (:mod:`router.core.hybrid`), so a test that compares the router's
prediction with this pool's hit compares two independent implementations; the layout (sizes,
kinds), the hash chain and the retention rule (:mod:`events.retention`) are the shared
contract.

What each kind does (spec §4.4, §4.7):

- **Full attention** (also MLA and sink): holds a physical block for every position, caches
  every full block (dense). Hit: the leading run of cached blocks, floored to ``A``.
- **Chunked local attention**: like full attention, but blocks before the current chunk's
  start are skipped (freed) as the request advances; caching is dense. Hit: blocks before
  the chunk of ``max_length`` count without a lookup, then the run of cached blocks.
- **Sliding window**: blocks whose tokens left the window of the next token to compute are
  freed (``remove_skipped_blocks``: ``skipped = num_computed - window + 1``). As in vLLM,
  admission allocates a block for every prompt position from the hit on (a long prompt
  briefly holds all of them, since one prefill step computes them all); the ones outside the
  window are freed at the next step, before its allocation, tail first. Which full blocks
  are hashed is :func:`events.retention.is_retained`. Hit: scanning right to left, the first
  run of ``ceil((window - 1) / B)`` cached blocks whose right edge is aligned.
- **Mamba (align mode)**: one state block per scheduling step, at the step's last block; the
  block of the step before stays one more step (it is the copy source) and is then freed.
  Hit: scanning right to left, the first cached state block ending on an aligned boundary.

Position lists use block id 0, the null block, for positions a group does not hold.

Not modelled (documented deviations, none visible to hit prediction): partial-tail entries
of full attention with ``B > H`` and fine-grained lookups (they only matter with partial
hits, which the pool rejects), EAGLE groups and drops, DCP/PCP, non-align Mamba modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from events.layout import GroupKind, GroupSpec
from events.retention import is_retained
from gpu_emitter.block_pool import NULL_BLOCK, BlockPoolCore
from gpu_emitter.request import GroupState, Request

__all__ = [
    "BlockHashes",
    "ChunkedLocalManager",
    "FineHashes",
    "FullAttentionManager",
    "HitBlocks",
    "HitLookup",
    "MambaManager",
    "SingleTypeManager",
    "SlidingWindowManager",
    "manager_for",
]

HitBlocks = tuple[list[int], ...]
"""Hit blocks per member group of a spec group, in ``group_ids`` order."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FineHashes(Protocol):
    """A request's hash chain at ``hash_block_size`` H (:class:`events.hashing.LazyChain`)."""

    def __len__(self) -> int: ...

    def wire(self, i: int) -> Any: ...


class BlockHashes:
    """The request's hashes seen at a group's block size ``B = k * H`` (vLLM's
    ``BlockHashListWithBlockSize``): block ``j`` is keyed by the fine hash at its last H
    boundary, ``(j + 1) * k - 1`` (spec §1.4). Lazy, so a lookup hashes the chain only as
    far as it probes."""

    __slots__ = ("fine", "k")

    def __init__(self, fine: FineHashes, hash_block_size: int, block_size: int) -> None:
        self.fine = fine
        self.k = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.fine) // self.k

    def __getitem__(self, j: int) -> Any:
        return self.fine.wire((j + 1) * self.k - 1)


class HitLookup(NamedTuple):
    """One spec group's probe during a lookup: its hashes at its block size and the pool."""

    hashes: BlockHashes
    group_ids: Sequence[int]
    pool: BlockPoolCore
    block_size: int

    def cached(self, j: int) -> list[int] | None:
        """Block ``j``'s first cached copy in every member group, or None: vLLM's
        ``get_cached_block``, the only way a hit rule reads the cache."""
        return self.pool.get_cached_block(self.hashes[j], self.group_ids)

    def extend_run(self, computed: HitBlocks, start: int, stop: int) -> None:
        """Append blocks ``start, start + 1, ...`` (below ``stop``) to every group's hit
        blocks while they are cached: the left-to-right scan of full and chunked attention."""
        for j in range(start, stop):
            cached = self.cached(j)
            if cached is None:
                return
            for blocks, bid in zip(computed, cached, strict=True):
                blocks.append(bid)


class SingleTypeManager:
    """What every kind shares: allocation, freeing, hashing; the hit rule is per subclass."""

    def __init__(
        self,
        pool: BlockPoolCore,
        group_id: int,
        spec: GroupSpec,
        alignment: int,
        retention: int | None,
    ) -> None:
        self.pool = pool
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.alignment = alignment
        self.retention = retention

    # ------------------------------------------------------------------ hits

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: FineHashes,
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPoolCore,
        spec: GroupSpec,
        alignment: int,
    ) -> tuple[HitBlocks, int]:
        """The longest prefix of at most ``max_length`` tokens that every group in
        ``group_ids`` can serve, as a multiple of ``alignment``: (hit blocks per group, hit
        tokens). A classmethod, as in vLLM, because the coordinator calls it once per spec
        group, not per group (spec §4.2, §4.4)."""
        b = spec.block_size
        q = HitLookup(BlockHashes(block_hashes, pool.hash_block_size, b), group_ids, pool, b)
        return cls._longest_hit(q, max_length, spec, alignment)

    @classmethod
    def _longest_hit(
        cls, q: HitLookup, max_length: int, spec: GroupSpec, alignment: int
    ) -> tuple[HitBlocks, int]:
        """The kind's own rule behind :meth:`find_longest_cache_hit`."""
        raise NotImplementedError(f"{cls.__name__} has no hit rule")

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens the next computed token no longer attends to (their blocks can go)."""
        return 0

    # ------------------------------------------------------------ allocation

    def admission_blocks(self, hit: int, ends: list[int]) -> int:
        """New blocks admission needs over all its steps (frees between steps not credited)."""
        return max(_cdiv(ends[-1], self.block_size) - hit // self.block_size, 0)

    def num_new_blocks(self, st: GroupState, end: int) -> int:
        return max(_cdiv(end, self.block_size) - len(st.blocks), 0)

    def allocate(self, st: GroupState, end: int) -> list[tuple[int, int]]:
        """Allocate blocks so positions up to ``end`` tokens have slots; returns the new
        ``(position, block id)`` pairs."""
        n = self.num_new_blocks(st, end)
        if n <= 0:
            return []
        start = len(st.blocks)
        ids = self.pool.get_new_blocks(n)
        st.blocks.extend(ids)
        return list(zip(range(start, start + n), ids, strict=True))

    def skipped_to_free(self, st: GroupState, num_computed: int) -> list[tuple[int, int]]:
        """``(position, block id)`` that :meth:`remove_skipped` would free, in free order."""
        skipped = self.skipped_tokens(num_computed)
        if skipped <= 0:
            return []
        blocks = st.blocks
        n = min(skipped // self.block_size, len(blocks))
        out = []
        # vLLM walks down from the last skipped block and stops at the first null one: the
        # ones below it were nulled by earlier calls.
        for j in range(n - 1, -1, -1):
            if blocks[j] == NULL_BLOCK:
                break
            out.append((j, blocks[j]))
        return out

    def remove_skipped(self, st: GroupState, num_computed: int) -> None:
        freed = self.skipped_to_free(st, num_computed)
        for j, _ in freed:
            st.blocks[j] = NULL_BLOCK
        self.pool.free_blocks([b for _, b in freed])

    def free(self, st: GroupState) -> None:
        """Free all of the request's blocks, tail first (so the tail is evicted first)."""
        self.pool.free_blocks(reversed(st.blocks))
        st.blocks = []

    # --------------------------------------------------------------- caching

    def keeps(self, req: Request, j: int) -> bool:
        """Whether full block ``j`` (non-null) gets hashed: vLLM's block mask (spec §4.7)."""
        return is_retained(
            self.spec,
            j,
            alignment=self.alignment,
            retention=self.retention,
            reachable=req.reachable,
        )

    def cache_blocks(self, req: Request, st: GroupState, num_tokens: int) -> None:
        """Hash the newly full blocks up to ``num_tokens`` (one ``BlockStored`` per call)."""
        num_full = num_tokens // self.block_size
        if st.num_cached >= num_full:
            return
        lo = st.num_cached
        inserted = [
            j for j in range(lo, num_full) if st.blocks[j] != NULL_BLOCK and self.keeps(req, j)
        ]
        self.pool.cache_full_blocks(
            req, st.blocks, lo, num_full, inserted, self.group_id, self.spec
        )
        st.num_cached = num_full


class FullAttentionManager(SingleTypeManager):
    """Full attention (also MLA and sink): every position has a block, every block is hashed."""

    @classmethod
    def _longest_hit(
        cls, q: HitLookup, max_length: int, spec: GroupSpec, alignment: int
    ) -> tuple[HitBlocks, int]:
        # Chained hashes: once a block misses, every later one misses too, so the hit is the
        # leading run of cached blocks (spec §4.4).
        b = q.block_size
        computed: HitBlocks = tuple([] for _ in q.group_ids)
        q.extend_run(computed, 0, min(max_length // b, len(q.hashes)))
        hit = len(computed[0]) * b
        hit -= hit % alignment
        for blocks in computed:
            del blocks[_cdiv(hit, b) :]
        return computed, hit


class ChunkedLocalManager(SingleTypeManager):
    """Chunked local attention: dense caching, blocks before the current chunk are freed."""

    @classmethod
    def _longest_hit(
        cls, q: HitLookup, max_length: int, spec: GroupSpec, alignment: int
    ) -> tuple[HitBlocks, int]:
        # Tokens before the chunk that holds position `max_length` are outside every later
        # query's reach: they count as computed with null blocks, no lookup (spec §4.4).
        # `resolve` guarantees B == A here, so the result needs no flooring.
        b = q.block_size
        chunk = spec.attention_chunk_size or b
        first = (max_length // chunk * chunk if max_length > 0 else 0) // b
        computed: HitBlocks = tuple([NULL_BLOCK] * first for _ in q.group_ids)
        q.extend_run(computed, first, min(max_length // b, len(q.hashes)))
        return computed, len(computed[0]) * b

    def skipped_tokens(self, num_computed: int) -> int:
        chunk = self.spec.attention_chunk_size or self.block_size
        return num_computed // chunk * chunk


class SlidingWindowManager(SingleTypeManager):
    """Sliding window: out-of-window blocks freed, checkpoint tails hashed (spec §4.7)."""

    @classmethod
    def _longest_hit(
        cls, q: HitLookup, max_length: int, spec: GroupSpec, alignment: int
    ) -> tuple[HitBlocks, int]:
        # A hit of L tokens needs the `need` blocks before L (the window of token L); blocks
        # further left are null. Scan right to left for the first such run; with B != A a run
        # may only start (on its right) at a block whose right edge is aligned (spec §4.4).
        b = q.block_size
        need = _cdiv((spec.sliding_window or 1) - 1, b)
        n_max = min(max_length // b, len(q.hashes))
        computed: HitBlocks = tuple([NULL_BLOCK] * n_max for _ in q.group_ids)
        run = 0
        found = False
        for j in range(n_max - 1, -1, -1):
            cached = q.cached(j)
            if cached is None:
                run = 0
                continue
            if run == 0 and b != alignment and (j + 1) * b % alignment:
                continue
            for blocks, bid in zip(computed, cached, strict=True):
                blocks[j] = bid
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[j + run :]
                found = True
                break
        if not found:
            # No full run: only a run that reaches block 0 serves (a prefix shorter than
            # the window needs every block), shrunk by whole blocks until aligned.
            for blocks in computed:
                del blocks[run:]
            while len(computed[0]) * b % alignment:
                for blocks in computed:
                    blocks.pop()
        return computed, len(computed[0]) * b

    def skipped_tokens(self, num_computed: int) -> int:
        return num_computed - (self.spec.sliding_window or 1) + 1


class MambaManager(SingleTypeManager):
    """Mamba in align mode: one state block per step, at a block-aligned step end."""

    @classmethod
    def _longest_hit(
        cls, q: HitLookup, max_length: int, spec: GroupSpec, alignment: int
    ) -> tuple[HitBlocks, int]:
        # A state block holds everything before its end, so one cached state ending on an
        # aligned boundary is a hit; the highest one wins (spec §4.4).
        b = q.block_size
        for j in range(min(max_length // b, len(q.hashes)) - 1, -1, -1):
            cached = q.cached(j)
            if cached is None or (j + 1) * b % alignment:
                continue
            return tuple([NULL_BLOCK] * j + [bid] for bid in cached), (j + 1) * b
        return tuple([] for _ in q.group_ids), 0

    def skipped_tokens(self, num_computed: int) -> int:
        return num_computed - 1

    def admission_blocks(self, hit: int, ends: list[int]) -> int:
        return len(ends)  # one state block per scheduling step

    def num_new_blocks(self, st: GroupState, end: int) -> int:
        return 1 if _cdiv(end, self.block_size) > len(st.blocks) else 0

    def allocate(self, st: GroupState, end: int) -> list[tuple[int, int]]:
        required = _cdiv(end, self.block_size)
        blocks = st.blocks
        prev = len(blocks)
        if required <= prev:
            return []
        # The block allocated in the previous step (or the hit's state block) becomes the
        # copy source for this step and is freed at the next step.
        if st.allocated or prev > 0:
            st.last_state_idx = prev - 1
        blocks.extend([NULL_BLOCK] * (required - 1 - prev))
        (bid,) = self.pool.get_new_blocks(1)
        blocks.append(bid)
        st.allocated = True
        return [(required - 1, bid)]

    def skipped_to_free(self, st: GroupState, num_computed: int) -> list[tuple[int, int]]:
        out = super().skipped_to_free(st, num_computed)
        last = st.last_state_idx
        if (
            last is not None
            and last < _cdiv(num_computed, self.block_size) - 1
            and st.blocks[last] != NULL_BLOCK
            and all(j != last for j, _ in out)
        ):
            out.append((last, st.blocks[last]))
        return out


_BY_KIND: dict[GroupKind, type[SingleTypeManager]] = {
    GroupKind.FULL_ATTENTION: FullAttentionManager,
    GroupKind.MLA_ATTENTION: FullAttentionManager,
    GroupKind.SINK_FULL_ATTENTION: FullAttentionManager,
    GroupKind.CHUNKED_LOCAL_ATTENTION: ChunkedLocalManager,
    GroupKind.SLIDING_WINDOW: SlidingWindowManager,
    GroupKind.SLIDING_WINDOW_MLA: SlidingWindowManager,
    GroupKind.MAMBA: MambaManager,
}


def manager_for(spec: GroupSpec) -> type[SingleTypeManager] | None:
    """The manager class of a group kind, or None when the pool cannot model it."""
    return _BY_KIND.get(spec.kind)
