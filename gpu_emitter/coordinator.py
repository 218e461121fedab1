"""The KV-cache coordinator of the simulated pool (vLLM 0.32's ``v1/core/kv_cache_coordinator.py``).

It owns one manager per KV-cache group (:mod:`gpu_emitter.managers`), merges groups with an
identical spec into spec groups that are looked up jointly (spec §4.2), and combines their
per-type hits into the request's hit:

- one group: :class:`UnitaryCoordinator`, a single lookup aligned to the block size;
- several: :class:`HybridCoordinator`, the fixed-point loop of spec §4.5. The candidate starts
  at ``num_tokens - 1`` (§4.1); every spec group, full-attention types first, either accepts
  it or lowers it; a lowered candidate restarts the pass, until a pass leaves it unchanged
  (one pass only for full attention plus one other spec group). Full attention is
  downward-closed, so its first answer is reused, truncated, on later passes. Hits are
  aligned to the LCM of the group block sizes (§4.3).

It also runs the per-group steps of a request (free skipped blocks, allocate, hash full
blocks, free) in group order, as vLLM's coordinator does. Nothing here comes from the router:
this is the replica's own rule, which the router's prediction is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import NamedTuple

from events.layout import GroupSpec
from gpu_emitter.block_pool import BlockPoolCore
from gpu_emitter.managers import (
    ChunkedLocalManager,
    FineHashes,
    FullAttentionManager,
    MambaManager,
    SingleTypeManager,
    SlidingWindowManager,
    manager_for,
)
from gpu_emitter.request import Request

__all__ = [
    "CacheHit",
    "HitCheckError",
    "HybridCoordinator",
    "KVCacheCoordinator",
    "SpecGroup",
    "UnitaryCoordinator",
    "UnmodelledGroup",
    "make_coordinator",
]


class HitCheckError(RuntimeError):
    """``check_maximal``: the hit is not the largest length every spec group accepts."""


class UnmodelledGroup(ValueError):
    """A group kind with no manager here (the pool's layout check should have caught it)."""


@dataclass(frozen=True, slots=True)
class CacheHit:
    """What the coordinator found for one request (vLLM's ``find_longest_cache_hit`` result)."""

    hit_tokens: int
    """The hit in tokens: what ``get_computed_blocks`` reports as ``num_cached_tokens``."""
    blocks: tuple[list[int], ...]
    """Hit blocks per KV-cache group (null block where the group needs none; empty for no hit)."""
    longest: int
    """The largest single-spec-group hit seen in the loop (vLLM's ``longest_hit_length``)."""
    num_uncached: int
    """``longest - hit_tokens``: when > 0 the request pins ``shared_prefix_boundary =
    longest`` and caches checkpoints there (spec §4.1, §4.7)."""
    passes: int
    """Passes of the fixed-point loop (1 for the unitary coordinator, 0 when skipped)."""
    spec_group_hits: tuple[int, ...] = ()
    """Per spec group, what it alone serves at ``num_tokens - 1`` (only when explained)."""


class SpecGroup(NamedTuple):
    """Groups with one identical spec and manager, looked up jointly (spec §4.2)."""

    spec: GroupSpec
    group_ids: tuple[int, ...]
    manager_cls: type[SingleTypeManager]


def _split_spec_groups(
    groups: Sequence[GroupSpec], managers: Sequence[SingleTypeManager]
) -> tuple[SpecGroup, ...]:
    """vLLM's ``verify_and_split_kv_cache_groups``: merge equal specs, full attention first."""
    merged: dict[GroupSpec, list[int]] = {}
    for gi, spec in enumerate(groups):
        if spec.prefix_cacheable:
            merged.setdefault(spec, []).append(gi)
    out = [SpecGroup(spec, tuple(ids), type(managers[ids[0]])) for spec, ids in merged.items()]
    # Stable: full-attention types first, each side in order of first group index.
    out.sort(key=lambda sg: not issubclass(sg.manager_cls, FullAttentionManager))
    return tuple(out)


class KVCacheCoordinator:
    """One manager per group over a shared pool; subclasses say how hits combine."""

    def __init__(
        self,
        pool: BlockPoolCore,
        groups: Sequence[GroupSpec],
        retention: int | None,
    ) -> None:
        self.pool = pool
        self.groups = tuple(groups)
        self.scheduler_block_size = reduce(math.lcm, (g.block_size for g in self.groups))
        self.alignment = self._alignment()
        managers: list[SingleTypeManager] = []
        for gi, spec in enumerate(self.groups):
            cls = manager_for(spec)
            if cls is None:
                raise UnmodelledGroup(f"groups[{gi}]: no manager for kind {spec.kind!s}")
            managers.append(cls(pool, gi, spec, self.alignment, retention))
        self.managers = tuple(managers)
        self.spec_groups = _split_spec_groups(self.groups, self.managers)

    def _alignment(self) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ hits

    def find_longest_cache_hit(self, block_hashes: FineHashes, max_length: int) -> CacheHit:
        """The request's hit of at most ``max_length`` tokens (``num_tokens - 1``)."""
        raise NotImplementedError

    def _lookup(
        self, sg: SpecGroup, block_hashes: FineHashes, max_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        return sg.manager_cls.find_longest_cache_hit(
            block_hashes, max_length, sg.group_ids, self.pool, sg.spec, self.alignment
        )

    def spec_group_hits(self, block_hashes: FineHashes, max_length: int) -> tuple[int, ...]:
        """Each spec group's hit on its own (vLLM's ``find_longest_cache_hit_per_group``):
        shows which group limits a hybrid hit."""
        return tuple(self._lookup(sg, block_hashes, max_length)[1] for sg in self.spec_groups)

    def check_maximal(self, block_hashes: FineHashes, max_length: int, hit: int) -> None:
        """Declarative cross-check of the greedy loop (a debugging aid): ``hit`` is accepted
        by every spec group and no longer aligned length up to ``max_length`` is. Raises
        :class:`HitCheckError`. Costs a scan of the chain per candidate length."""
        a = self.alignment
        top = min(max_length, len(block_hashes) * self.pool.hash_block_size) // a * a
        if not self._all_accept(block_hashes, hit):
            raise HitCheckError(f"hit {hit} is not accepted by every spec group")
        for length in range(top, hit, -a):
            if self._all_accept(block_hashes, length):
                raise HitCheckError(f"hit {hit} but every spec group accepts {length}")

    def _all_accept(self, block_hashes: FineHashes, length: int) -> bool:
        return length == 0 or all(
            _accepts(sg, self.pool, block_hashes, length) for sg in self.spec_groups
        )

    # --------------------------------------------------------- request steps

    def remove_skipped_blocks(self, req: Request, num_computed: int) -> None:
        """Free what left every group's attention span, group by group."""
        for m, st in zip(self.managers, req.groups, strict=True):
            m.remove_skipped(st, num_computed)

    def allocate_slots(self, req: Request, end: int) -> list[tuple[int, int, int]]:
        """Give every group slots up to ``end`` tokens: the new ``(group, position, block)``."""
        out: list[tuple[int, int, int]] = []
        for gi, (m, st) in enumerate(zip(self.managers, req.groups, strict=True)):
            out.extend((gi, pos, bid) for pos, bid in m.allocate(st, end))
        return out

    def num_new_blocks(self, req: Request, end: int) -> int:
        return sum(
            m.num_new_blocks(st, end) for m, st in zip(self.managers, req.groups, strict=True)
        )

    def cacheable_tokens(self, num_tokens: int) -> int:
        """Tokens a future hit could match, so worth hashing (spec §4.7)."""
        return num_tokens

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Hash every group's newly full blocks up to ``num_tokens`` (one event per group)."""
        cacheable = self.cacheable_tokens(num_tokens)
        for m, st in zip(self.managers, req.groups, strict=True):
            m.cache_blocks(req, st, cacheable)

    def free(self, req: Request) -> None:
        """Free the request's blocks group by group, each tail first."""
        for m, st in zip(self.managers, req.groups, strict=True):
            m.free(st)


class UnitaryCoordinator(KVCacheCoordinator):
    """One KV-cache group: its manager's hit, aligned to its block size (spec §4.2)."""

    def _alignment(self) -> int:
        return self.groups[0].block_size

    def find_longest_cache_hit(self, block_hashes: FineHashes, max_length: int) -> CacheHit:
        if not self.spec_groups:
            return CacheHit(0, ([],), 0, 0, 0)
        blocks, hit = self._lookup(self.spec_groups[0], block_hashes, max_length)
        return CacheHit(hit, blocks, hit, 0, 1)


class HybridCoordinator(KVCacheCoordinator):
    """Several KV-cache groups: the fixed-point loop across spec groups (spec §4.5)."""

    def _alignment(self) -> int:
        # Partial hits (alignment H) are rejected by the pool, so hits sit on multiples of
        # the scheduler block size S = lcm of the block sizes (spec §4.3).
        return self.scheduler_block_size

    def cacheable_tokens(self, num_tokens: int) -> int:
        # vLLM's `_align_cacheable`: a hit can only end on a multiple of S.
        s = self.scheduler_block_size
        return num_tokens // s * s

    def find_longest_cache_hit(self, block_hashes: FineHashes, max_length: int) -> CacheHit:
        by_group: list[list[int] | None] = [None] * len(self.groups)
        fa_hit: dict[int, int] = {}
        """Full-attention spec groups looked up already: index -> their hit."""
        sgs = self.spec_groups
        simple = len(sgs) == 2 and issubclass(sgs[0].manager_cls, FullAttentionManager)
        candidate = max_length
        longest = 0
        passes = 0
        while True:
            passes += 1
            cur = candidate
            for i, sg in enumerate(sgs):
                if i in fa_hit:
                    # Full attention is downward-closed: any length up to its first answer is
                    # served, so it is looked up once and only caps later passes.
                    cur = min(cur, fa_hit[i])
                    continue
                blocks, cur = self._lookup(sg, block_hashes, cur)
                for gi, lst in zip(sg.group_ids, blocks, strict=True):
                    by_group[gi] = lst
                if issubclass(sg.manager_cls, FullAttentionManager):
                    fa_hit[i] = cur
                longest = max(longest, cur)
            if cur >= candidate:
                break
            candidate = cur
            if simple:
                # FA first, then one other type: the other's answer is one FA serves too.
                break
        for i in fa_hit:
            sg = sgs[i]
            keep = -(-candidate // sg.spec.block_size)
            for gi in sg.group_ids:
                lst = by_group[gi]
                if lst is not None:
                    del lst[keep:]
        blocks = tuple(lst if lst is not None else [] for lst in by_group)
        return CacheHit(candidate, blocks, longest, longest - candidate, passes)


def make_coordinator(
    pool: BlockPoolCore, groups: Sequence[GroupSpec], retention: int | None
) -> KVCacheCoordinator:
    """vLLM's ``get_kv_cache_coordinator`` (prefix caching on): unitary for one group."""
    cls = UnitaryCoordinator if len(groups) == 1 else HybridCoordinator
    return cls(pool, groups, retention)


def _accepts(sg: SpecGroup, pool: BlockPoolCore, block_hashes: FineHashes, length: int) -> bool:
    """Declarative: spec group ``sg`` can serve exactly ``length`` tokens (``length > 0``).

    Stated as "which blocks must be cached" per kind, not as a scan, so that it checks the
    managers' greedy scans from a different angle.
    """
    spec = sg.spec
    b = spec.block_size
    if length % b:
        return False
    k = b // pool.hash_block_size
    top = length // b

    def cached(j: int) -> bool:
        return pool.get_cached_block(block_hashes.wire((j + 1) * k - 1), sg.group_ids) is not None

    cls = sg.manager_cls
    if issubclass(cls, FullAttentionManager):
        return all(cached(j) for j in range(top))
    if issubclass(cls, SlidingWindowManager):
        need = max(1, -(-((spec.sliding_window or 1) - 1) // b))
        return all(cached(j) for j in range(max(0, top - need), top))
    if issubclass(cls, ChunkedLocalManager):
        chunk = spec.attention_chunk_size or b
        return all(cached(j) for j in range(length // chunk * chunk // b, top))
    if issubclass(cls, MambaManager):
        return cached(top - 1)  # one state block ending exactly at `length`
    raise UnmodelledGroup(f"no acceptance rule for {cls.__name__}")
