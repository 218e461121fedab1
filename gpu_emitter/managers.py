"""Per-KV-cache-type rules of the simulated pool: allocation, skipped blocks, what is cached.

Imitates the split of vLLM 0.32's ``v1/core/single_type_kv_cache_manager.py``: one manager per
KV-cache group, each knowing only its own kind's rules, all sharing one
:class:`gpu_emitter.block_pool.BlockPoolCore` (the free queue and the prefix-cache map).

What each kind does (spec §4.4, §4.7):

- **Full attention** (also MLA and sink): holds a physical block for every position, caches
  every full block (dense).
- **Chunked local attention**: like full attention, but blocks before the current chunk's
  start are skipped (freed) as the request advances; caching is dense.
- **Sliding window**: blocks whose tokens left the window of the next token to compute are
  freed (``remove_skipped_blocks``: ``skipped = num_computed - window + 1``). As in vLLM,
  admission allocates a block for every prompt position from the hit on (a long prompt
  briefly holds all of them, since one prefill step computes them all); the ones outside the
  window are freed at the next step, before its allocation, tail first. Under the
  default ``prefix_cache_retention_interval = 0`` only the ``need = ceil((window-1)/B)``
  blocks ending at each reachable boundary are hashed (the block mask); ``None`` hashes the
  last ``need`` blocks before every ``A`` boundary, ``R > 0`` those before every ``R``
  boundary plus the reachable-boundary tails.
- **Mamba (align mode)**: one state block per scheduling step, at the step's last block; the
  block of the step before stays one more step (it is the copy source) and is then freed.
  Under retention 0 only the state block ending at a reachable boundary is hashed; ``None``
  hashes every state block, ``R > 0`` those at multiples of ``R`` plus the boundaries.

A "reachable boundary" is ``floor(b / A) * A`` for ``b`` in ``{num_prompt_tokens - 1,
shared_prefix_boundary}`` (spec §4.7). Position lists use block id 0, the null block, for
positions a group does not hold.

Not modelled (documented deviations, none visible to hit prediction): partial-tail entries
of full attention with ``B > H`` (they only matter with partial hits, which the pool
rejects), EAGLE groups, non-align Mamba modes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from events.layout import SLIDING_KINDS, GroupKind, GroupSpec

if TYPE_CHECKING:
    from gpu_emitter.block_pool import BlockPoolCore, Request

__all__ = [
    "NULL_BLOCK",
    "ChunkedLocalManager",
    "FullAttentionManager",
    "GroupState",
    "MambaManager",
    "Manager",
    "SlidingWindowManager",
    "manager_for",
    "reachable_boundaries",
]

#: Block id of vLLM's null block: a placeholder position that holds no KV.
NULL_BLOCK = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupState:
    """One request's view of one group: its block per position and caching progress."""

    __slots__ = ("allocated", "blocks", "last_state_idx", "num_cached")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        """Block id per block position (``NULL_BLOCK`` where the group holds nothing)."""
        self.num_cached = 0
        """Positions already handed to caching (vLLM's ``num_cached_block``)."""
        self.last_state_idx: int | None = None
        """Mamba align: the state block of the previous step, freed one step later."""
        self.allocated = False
        """Mamba align: a block was allocated for this request in an earlier step."""


class Manager:
    """Full attention: every position has a block, every full block is hashed."""

    def __init__(
        self,
        core: BlockPoolCore,
        group_id: int,
        spec: GroupSpec,
        hash_block_size: int,
        alignment: int,
        retention: int | None,
    ) -> None:
        self.core = core
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.k = spec.block_size // hash_block_size
        self.alignment = alignment
        self.retention = retention
        self.kind_name = str(spec.kind)
        self.window = spec.sliding_window if spec.kind in SLIDING_KINDS else None

    # ------------------------------------------------------------------ hits

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens the next computed token no longer attends to (their blocks can go)."""
        return 0

    def hit_blocks(self, wires: Callable[[int], object], hit: int) -> list[int]:
        """Block per position ``0 .. hit/B - 1`` for a hit of ``hit`` tokens: the first cached
        copy where the group needs the block, the null block where it does not."""
        n = hit // self.block_size
        first = max(0, self.skipped_tokens(hit)) // self.block_size
        out = [NULL_BLOCK] * min(first, n)
        k = self.k
        for j in range(first, n):
            bid = self.core.first_copy(self.group_id, wires((j + 1) * k - 1))
            if bid is None:
                raise RuntimeError(
                    f"group {self.group_id}: hit block {j} vanished between lookup and "
                    "admission; this is a pool bug"
                )
            out.append(bid)
        return out

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
        ids = self.core.get_new_blocks(n)
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
        self.core.free_blocks([b for _, b in freed])

    def free(self, st: GroupState) -> None:
        """Free all of the request's blocks, tail first (so the tail is evicted first)."""
        self.core.free_blocks(reversed(st.blocks))
        st.blocks = []

    # --------------------------------------------------------------- caching

    def keeps(self, req: Request, j: int) -> bool:
        """Whether block ``j`` (full, non-null) gets hashed: vLLM's block mask."""
        return True

    def cache_blocks(self, req: Request, st: GroupState, num_tokens: int) -> None:
        """Hash the newly full blocks up to ``num_tokens`` (one ``BlockStored`` per call)."""
        num_full = num_tokens // self.block_size
        if st.num_cached >= num_full:
            return
        lo = st.num_cached
        inserted = [
            j for j in range(lo, num_full) if st.blocks[j] != NULL_BLOCK and self.keeps(req, j)
        ]
        self.core.cache_full_blocks(req, self, st.blocks, lo, num_full, inserted)
        st.num_cached = num_full


FullAttentionManager = Manager


class ChunkedLocalManager(Manager):
    """Chunked local attention: dense caching, blocks before the current chunk are freed."""

    def skipped_tokens(self, num_computed: int) -> int:
        chunk = self.spec.attention_chunk_size or self.block_size
        return num_computed // chunk * chunk


def reachable_boundaries(
    num_prompt_tokens: int, shared_prefix_boundary: int | None, alignment: int
) -> frozenset[int]:
    """A request's reachable boundaries (spec §4.7): where its SWA/Mamba checkpoints go."""
    out = {(num_prompt_tokens - 1) // alignment * alignment}
    if shared_prefix_boundary is not None:
        out.add(shared_prefix_boundary // alignment * alignment)
    out.discard(0)
    return frozenset(out)


class SlidingWindowManager(Manager):
    """Sliding window: out-of-window blocks freed, checkpoint tails hashed (spec §4.7)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        window = self.spec.sliding_window or 1
        self.need = max(1, _cdiv(window - 1, self.block_size))

    def skipped_tokens(self, num_computed: int) -> int:
        return num_computed - (self.spec.sliding_window or 1) + 1

    def _before(self, j: int, period_blocks: int) -> bool:
        # Block j is among the `need` blocks before some multiple of `period_blocks` blocks.
        return (period_blocks - 1 - j % period_blocks) < self.need

    def keeps(self, req: Request, j: int) -> bool:
        b = self.block_size
        if self.alignment % b:
            return True
        if self.retention is None:
            return self._before(j, self.alignment // b)
        if self.retention > 0 and self._before(j, self.retention // b):
            return True
        end = (j + 1) * b
        return any(c - self.need * b < end <= c for c in req.reachable)


class MambaManager(Manager):
    """Mamba in align mode: one state block per step, at a block-aligned step end."""

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
        (bid,) = self.core.get_new_blocks(1)
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

    def keeps(self, req: Request, j: int) -> bool:
        end = (j + 1) * self.block_size
        if self.retention is None:
            return True
        if self.retention > 0 and end % self.retention == 0:
            return True
        return end in req.reachable


_BY_KIND: dict[GroupKind, type[Manager]] = {
    GroupKind.FULL_ATTENTION: Manager,
    GroupKind.MLA_ATTENTION: Manager,
    GroupKind.SINK_FULL_ATTENTION: Manager,
    GroupKind.CHUNKED_LOCAL_ATTENTION: ChunkedLocalManager,
    GroupKind.SLIDING_WINDOW: SlidingWindowManager,
    GroupKind.SLIDING_WINDOW_MLA: SlidingWindowManager,
    GroupKind.MAMBA: MambaManager,
}


def manager_for(spec: GroupSpec) -> type[Manager] | None:
    """The manager class of a group kind, or None when the pool cannot model it."""
    return _BY_KIND.get(spec.kind)
