"""What a replica loads from a shared Mooncake store on top of its local hit (vLLM 0.32).

Pure logic, no I/O. vLLM 0.32's ``MooncakeStoreConnector`` decides, per new request, how many
tokens to load from the store; the scheduler then reports ``local + loaded`` as the request's
``cached_tokens``. This module reproduces that decision from the store's presence as the
router knows it (the connector's ``BlockStored(medium="cpu", group_idx=g)`` events), in three
steps, each following one function of vLLM:

1. **The store's own hit** (``store/worker.py: MooncakeStoreWorker.lookup``). The lookup
   length is the request length floored to the store's alignment (the hash unit H with
   partial hits, else the scheduler block S); only the keys below it are asked for, and
   without partial hits only the chunks each group's ``lookup_mask`` keeps (a sliding-window
   group: the blocks ending at an aligned boundary). Over that presence runs
   ``MooncakeStoreCoordinator.find_longest_cache_hit`` (``store/coordinator.py``), the core
   hybrid rule *from token 0* with the per-type finders of :mod:`router.core.hybrid`; two
   differences from the core coordinator: the candidate starts at the lookup length (not
   ``num_tokens - 1``), and one spec group is looked up directly (no EAGLE look-ahead). A hit
   covering the whole request is looked up again below ``num_tokens - 1``.
2. **What is loaded** (``store/scheduler.py: MooncakeStoreScheduler.
   get_num_new_matched_tokens``): ``store_hit - local`` when positive, where ``local`` is the
   local hit floored to S (``v1/core/sched/scheduler.py: Scheduler.schedule`` passes the
   block-aligned local hit).
3. **What is reported** (``Scheduler.schedule``): a local hit with a sub-block tail keeps it
   and loads nothing unless the load reaches past it; ``PrefillStats.set`` then reports
   ``cached_tokens = local + external``. In effect ``max(local hit, store hit)``.

The store is not the replica's: its presence is pool-wide (any replica's events), so the
oracle passed here answers for the store, keyed by layout group id. The connector numbers
groups among the prefix-cacheable ones only (``KVCacheConfig.prefix_cacheable_groups``);
:func:`store_group_ids` gives that numbering.
"""

from __future__ import annotations

from dataclasses import dataclass

from events.layout import FA_TYPE_KINDS, SLIDING_KINDS, GroupKind, ResolvedLayout
from router.core.hybrid import Presence, finder_for

__all__ = [
    "ExternalHit",
    "connector_load",
    "lookup_chunks",
    "store_group_ids",
    "store_hit",
    "store_spec_group_hits",
]


@dataclass(frozen=True, slots=True)
class ExternalHit:
    """One replica's prefix for one request: kept locally, loaded from the store."""

    local_tokens: int
    """Tokens served from the replica's own GPU prefix cache (the local hit, or the local hit
    floored to S when a load supersedes its sub-block tail)."""
    external_tokens: int
    """Tokens loaded from the store (``num_external_computed_tokens``)."""
    store_hit_tokens: int
    """The store's own hit for the request, from token 0 (``MooncakeLookupResult.hit_length``)."""

    @property
    def cached_tokens(self) -> int:
        """What vLLM reports as ``usage.prompt_tokens_details.cached_tokens``."""
        return self.local_tokens + self.external_tokens


def store_group_ids(layout: ResolvedLayout) -> tuple[int, ...]:
    """Layout group ids in the connector's numbering: index ``i`` is the layout group the
    connector's ``group_idx == i`` names (its prefix-cacheable groups, in order)."""
    ids = {g for sg in layout.spec_groups for g in sg.group_ids}
    return tuple(g for g in range(len(layout.layout.groups)) if g in ids)


def _store_alignment(layout: ResolvedLayout) -> int:
    """``MooncakeStoreCoordinator.align_lookup_length``'s unit: H with partial hits, else S."""
    return layout.hash_block_size if layout.partial_hits else layout.scheduler_block_size


def _eagle_groups(layout: ResolvedLayout) -> frozenset[int]:
    return frozenset(g for sg in layout.spec_groups if sg.spec.eagle for g in sg.group_ids)


def lookup_chunks(layout: ResolvedLayout, group: int, token_len: int) -> list[bool] | None:
    """``MooncakeStoreCoordinator.lookup_mask`` for one layout group at ``token_len`` (a
    multiple of S): which of its blocks the lookup asks the store for; None means all.

    Only a sliding-window group is sparse (``SlidingWindowManager.reachable_block_mask`` with
    the scheduler block as segment): the ``need`` blocks ending at each aligned boundary,
    shifted one block up for an EAGLE group. The other managers keep every block."""
    spec = layout.layout.groups[group]
    if spec.kind not in SLIDING_KINDS:
        return None
    s = layout.scheduler_block_size
    b = spec.block_size
    if s % b:
        return None
    eagle = group in _eagle_groups(layout)
    # SlidingWindowManager._contiguous_blocks_for_hit (no floor at 1 here, unlike the finder)
    need = -(-((spec.sliding_window or 1) - 1) // b) + (1 if eagle else 0)
    per_segment = s // b
    if need >= per_segment:
        return None
    shift = 1 if eagle else 0
    return [
        i >= shift and (i - shift) % per_segment >= per_segment - need
        for i in range(token_len // b)
    ]


class _Lookup:
    """The presence the store lookup sees: the store's, cut to the keys it asked for."""

    __slots__ = ("allowed", "fine", "has", "limit")

    def __init__(
        self, layout: ResolvedLayout, token_len: int, num_hashes: int, has: Presence
    ) -> None:
        self.has = has
        h = layout.hash_block_size
        self.fine = layout.partial_hits
        self.limit = min(num_hashes, token_len // h)
        self.allowed: dict[int, tuple[int, list[bool] | None]] = {}
        if not self.fine:
            for g in store_group_ids(layout):
                k = layout.layout.groups[g].block_size // h
                self.allowed[g] = (k, lookup_chunks(layout, g, token_len))

    def __call__(self, group_ids: tuple[int, ...], i: int) -> bool:
        if not 0 <= i < self.limit:
            return False
        if not self.fine:
            for g in group_ids:
                k, mask = self.allowed[g]
                j, r = divmod(i + 1, k)
                if r or (mask is not None and (j - 1 >= len(mask) or not mask[j - 1])):
                    return False
        return self.has(group_ids, i)


def _find(layout: ResolvedLayout, max_length: int, has: Presence, nh: int) -> int:
    """``MooncakeStoreCoordinator._find_hit_blocks``' hit length for ``max_length``."""
    groups = layout.spec_groups
    h = layout.hash_block_size
    a = _store_alignment(layout)
    partial = layout.partial_hits
    if not groups:
        return 0
    if len(groups) == 1:
        sg = groups[0]
        spec = sg.spec
        fine = partial and a < spec.block_size
        return finder_for(spec)(spec, sg.group_ids, max_length, has, a, h, spec.eagle, fine, nh)
    n = len(groups)
    fa_results = [-1] * n
    eagle_ok = 0
    simple = n == 2 and groups[0].spec.is_fa_type
    top_cap = nh * h
    cand = max_length
    while True:
        cur = cand
        for gi, sg in enumerate(groups):
            spec = sg.spec
            is_fa = spec.kind in FA_TYPE_KINDS
            if is_fa and fa_results[gi] >= 0:
                cur = min(cur, fa_results[gi])
                continue
            b = spec.block_size
            fine = partial and a < b
            drop = spec.eagle and not (eagle_ok >> gi) & 1
            lim = cur
            if drop and spec.kind != GroupKind.MAMBA:
                lim = min(cur + (h if fine else b), top_cap)
            new = finder_for(spec)(spec, sg.group_ids, lim, has, a, h, drop, fine, nh)
            if drop:
                eagle_ok |= 1 << gi
            elif new < cur:
                eagle_ok = 0
            cur = new
            if is_fa:
                fa_results[gi] = new
        if cur >= cand:
            break
        cand = cur
        if simple:
            break
    return cand


def store_hit(
    layout: ResolvedLayout, num_tokens: int, has: Presence, *, num_hashes: int | None = None
) -> int:
    """The store's hit for a request of ``num_tokens`` tokens (``MooncakeStoreWorker.lookup``).

    ``has(group_ids, fine_idx)`` answers for the store (every group in ``group_ids`` holds
    the request's fine hash ``fine_idx``); ``num_hashes`` is the length of the request's
    fine chain (default ``num_tokens // H``)."""
    a = _store_alignment(layout)
    nh = num_tokens // layout.hash_block_size if num_hashes is None else num_hashes
    token_len = num_tokens // a * a
    if num_tokens < a or nh <= 0 or token_len <= 0:
        return 0
    seen = _Lookup(layout, token_len, nh, has)
    hit = _find(layout, token_len, seen, nh)
    if hit >= num_tokens:
        usable = (num_tokens - 1) // a * a
        if usable <= 0:
            return 0
        hit = _find(layout, usable, seen, nh)
    return hit


def store_spec_group_hits(
    layout: ResolvedLayout, num_tokens: int, has: Presence, *, num_hashes: int | None = None
) -> tuple[int, ...]:
    """Each spec group's hit on the store alone at the lookup length (in
    ``layout.spec_groups`` order): which group limits :func:`store_hit` (an explanation, not
    a vLLM quantity)."""
    a = _store_alignment(layout)
    nh = num_tokens // layout.hash_block_size if num_hashes is None else num_hashes
    token_len = num_tokens // a * a
    if num_tokens < a or nh <= 0 or token_len <= 0:
        return (0,) * len(layout.spec_groups)
    seen = _Lookup(layout, token_len, nh, has)
    h = layout.hash_block_size
    out = []
    for sg in layout.spec_groups:
        spec = sg.spec
        fine = layout.partial_hits and a < spec.block_size
        lim = min(token_len, (num_tokens - 1) // a * a)
        out.append(finder_for(spec)(spec, sg.group_ids, lim, seen, a, h, spec.eagle, fine, nh))
    return tuple(out)


def connector_load(
    layout: ResolvedLayout, local_hit: int, store_hit_tokens: int, *, skip_reading: bool = False
) -> ExternalHit:
    """What the scheduler does with a local hit and the store's hit (module docstring, steps
    2-3): the tokens kept locally, the tokens loaded, and the store hit itself."""
    if skip_reading:
        return ExternalHit(local_hit, 0, store_hit_tokens)
    s = layout.scheduler_block_size
    tail = local_hit % s
    aligned = local_hit - tail
    ext = store_hit_tokens - aligned if store_hit_tokens > aligned else 0
    if tail and ext > tail:
        return ExternalHit(aligned, ext, store_hit_tokens)
    if tail:
        return ExternalHit(local_hit, 0, store_hit_tokens)
    return ExternalHit(local_hit, ext, store_hit_tokens)
