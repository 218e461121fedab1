"""vLLM 0.32's local prefix-cache hit, computed over a presence oracle (spec §4, §5.3).

Pure logic, no I/O. The router asks, per replica and request, "would this replica's
``get_computed_blocks`` hit N tokens?"; the answer must match vLLM exactly, group structure and
all, because a sliding-window or Mamba group usually limits the hit far below what the
full-attention group holds (spec §4.7, §4.8).

The oracle ``has(group_ids, fine_idx)`` stands for vLLM's ``BlockPool.get_cached_block``: it is
True iff *every* group in ``group_ids`` holds the request's fine-chain hash at ``fine_idx``,
i.e. the chain hash at token ``(fine_idx + 1) * H`` (spec §1.4, §4.2). A group block ``j`` of
size ``B = k * H`` is cached iff ``has(group_ids, (j + 1) * k - 1)``. Fine indices inside a
block are partial entries; they are only probed when partial hits are on (spec §4.3).

Every function here probes lazily, in the order vLLM does or in an order proven to give the
same answer (the sliding-window finder skips ahead on a miss), and never builds per-block
structures: the router runs this per replica on chains of thousands of fine hashes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from events.layout import (
    FA_TYPE_KINDS,
    SLIDING_KINDS,
    GroupKind,
    GroupSpec,
    ResolvedLayout,
)

__all__ = [
    "AnyPresence",
    "Finder",
    "HitInputError",
    "HitResult",
    "Presence",
    "blocks_behind_hit",
    "bounded_replay",
    "chunked_local_hit",
    "find_longest_cache_hit",
    "finder_for",
    "full_attention_hit",
    "group_blind_hit",
    "mamba_hit",
    "sliding_window_hit",
]

Presence = Callable[[tuple[int, ...], int], bool]
"""``has(group_ids, fine_idx)``: every group in ``group_ids`` holds the fine hash ``fine_idx``."""

AnyPresence = Callable[[int], bool]
"""``has_any(fine_idx)``: at least one group holds the fine hash ``fine_idx``."""

# Optional fast path. A presence oracle may also offer ``leading_run(group_ids, k, n_max)``
# (and ``has_any`` may offer ``leading_run(k, n_max)``): the number of leading blocks
# ``j < n_max`` of stride ``k`` that are all cached, i.e. exactly what the contiguous
# full-attention loop would count. The router computes it for every replica at once in one
# walk over the chain, instead of one oracle call per block per replica.

Finder = Callable[
    [GroupSpec, tuple[int, ...], int, Presence, int, int, bool, bool, int],
    int,
]
"""``(spec, group_ids, max_length, has, alignment, hash_block_size, drop_eagle_block,
fine_grained, num_hashes) -> hit tokens``: one KV-cache type's rule (spec §4.4)."""


class HitInputError(ValueError):
    """Arguments no request could produce, or a group kind with no known hit rule."""


@dataclass(frozen=True, slots=True)
class HitResult:
    """The predicted local hit and enough of the computation to explain it."""

    hit_tokens: int
    """What vLLM's ``get_computed_blocks`` returns (0 when the request skips reading)."""
    spec_group_hits: tuple[int, ...]
    """Per spec group, in ``layout.spec_groups`` order: what that group alone accepts for this
    request, i.e. its finder called as if it came first in the loop (``max_length =
    num_tokens - 1``, its EAGLE drop and look-ahead applied, spec §4.6). Shows *which* group
    holds how much (Example 2 of spec §4.8: FA 176, SWA 0). Empty when ``explain=False``;
    all zeros when the request skips reading."""
    limiting_group: int | None
    """Index into ``layout.spec_groups`` of the group whose lookup last lowered the running
    candidate (the first pass starts at ``num_tokens - 1``, so a full-attention group that only
    rounds 199 down to block 192 counts). None when nothing lowered it: no spec groups, the
    request skips reading, or the hit is the whole ``num_tokens - 1``."""
    longest: int
    """vLLM's ``longest``: the largest single-group result seen in the loop."""
    num_uncached: int
    """``longest - hit_tokens``. When > 0 vLLM pins ``shared_prefix_boundary = hit +
    num_uncached`` and caches checkpoints there (spec §4.1, §4.7)."""
    passes: int
    """Passes of the hybrid fixed-point loop (1 for the unitary coordinator, 0 when skipped)."""
    replay_tokens: int = 0
    """Bounded replay (``layout.prefix_replay_tokens`` > 0, DeepSeek-V4.1): how many of the
    hit's last tokens the scheduler recomputes (``Scheduler._mark_prefix_replay``). The
    compute saved is ``hit_tokens - replay_tokens``; ``cached_tokens`` still reports
    ``hit_tokens``."""


def full_attention_hit(
    spec: GroupSpec,
    group_ids: tuple[int, ...],
    max_length: int,
    has: Presence,
    alignment: int,
    hash_block_size: int,
    drop_eagle_block: bool,
    fine_grained: bool,
    num_hashes: int,
) -> int:
    """FullAttentionManager's rule (FA, MLA, sink, RSWA; spec §4.4).

    A contiguous run of cached blocks from block 0, at most ``floor(max_length / B)`` blocks.
    Fine-grained (partial hits on and ``A < B``), the first missing block is then probed at its
    inner fine boundaries from the highest down, bounded by ``max_length`` and the request's
    hashes. EAGLE drops ``min(A, B)`` tokens; the result is floored to ``A``.
    """
    b = spec.block_size
    h = hash_block_size
    k = b // h
    limit = min(max_length, num_hashes * h)
    n_max = limit // b
    leading_run = getattr(has, "leading_run", None)
    if leading_run is not None:
        n = leading_run(group_ids, k, n_max)
    else:
        n = 0
        idx = k - 1
        while n < n_max and has(group_ids, idx):
            n += 1
            idx += k
    hit = n * b
    if fine_grained and k > 1:
        # Inner boundaries of block n are n*B + i*H, 0 < i < k; fine index n*k + i - 1.
        top = min(k - 1, (limit - hit) // h)
        base = n * k - 1
        for i in range(top, 0, -1):
            if has(group_ids, base + i):
                hit += i * h
                break
    if drop_eagle_block and hit > 0:
        hit -= min(alignment, b)
    return hit - hit % alignment


def _window_need(spec: GroupSpec, drop_eagle_block: bool) -> int:
    """Cached blocks in a row a sliding-window hit needs: ``ceil((window - 1) / B)``, one more
    with EAGLE. vLLM tests ``run >= need`` only after counting a cached block, so 0 acts as 1."""
    need = -(-((spec.sliding_window or 1) - 1) // spec.block_size)
    return max(need + (1 if drop_eagle_block else 0), 1)


def sliding_window_hit(
    spec: GroupSpec,
    group_ids: tuple[int, ...],
    max_length: int,
    has: Presence,
    alignment: int,
    hash_block_size: int,
    drop_eagle_block: bool,
    fine_grained: bool,
    num_hashes: int,
) -> int:
    """SlidingWindowManager's rule (spec §4.4): ``need`` contiguous blocks ending at the hit.

    vLLM scans blocks right to left from ``floor(max_length / B) - 1`` and returns the right
    edge of the first run of ``need = ceil((window - 1) / B)`` (+1 with EAGLE) cached blocks;
    with ``B != A`` a run may only *start* (on its right) at a block whose right edge — or,
    with EAGLE, left edge, the edge left after the drop — is a multiple of ``A``. That scan
    returns the largest such right edge, so this finder tests candidate right edges from the
    top and, on a miss at block ``x``, jumps straight below ``x``: same answer, fewer probes
    when the cache is sparse. Probing the run's leftmost block first makes the common
    "nothing here" case cost one probe per ``need`` blocks.

    With no full run, only a run reaching block 0 counts (a short prefix needs every block from
    0, spec §4.4), shrunk by whole blocks until aligned. EAGLE then drops one block and
    realigns. ``fine_grained`` is ignored: vLLM rejects partial hits unless ``B == H``
    (spec §4.3).
    """
    b = spec.block_size
    h = hash_block_size
    k = b // h
    need = _window_need(spec, drop_eagle_block)
    n_max = min(max_length, num_hashes * h) // b
    # Right edges allowed to start a run: block r with (r + off) * B % A == 0, i.e. r + off a
    # multiple of `period` (period 1 when B == A, where vLLM applies no such rule).
    off = 0 if drop_eagle_block else 1
    period = 1 if b == alignment else alignment // math.gcd(alignment, b)

    def top_edge(r: int) -> int:
        """Largest run-starting block <= r (may be negative)."""
        if period == 1:
            return r
        return ((r + off) // period) * period - off

    hit = -1
    r = top_edge(n_max - 1)
    while r >= need - 1:
        left = r - need + 1
        if not has(group_ids, (left + 1) * k - 1):
            r = top_edge(left - 1)
            continue
        x = r
        while x > left and has(group_ids, (x + 1) * k - 1):
            x -= 1
        if x == left:
            hit = (r + 1) * b
            break
        r = top_edge(x - 1)
    if hit < 0:
        # No full run: vLLM's leftover run is the one that reaches block 0, started (on the
        # right) at the highest allowed block below the first miss. It is shorter than
        # `need`, so this probes at most about need + A/B blocks.
        m = 0
        while m < n_max and has(group_ids, (m + 1) * k - 1):
            m += 1
        r0 = top_edge(m - 1) if m > 0 else -1
        hit = (r0 + 1) * b if r0 >= 0 else 0
        while hit % alignment:
            hit -= b
        hit = max(hit, 0)
    if drop_eagle_block and hit > 0:
        hit -= b
        hit -= hit % alignment
    return hit


def chunked_local_hit(
    spec: GroupSpec,
    group_ids: tuple[int, ...],
    max_length: int,
    has: Presence,
    alignment: int,
    hash_block_size: int,
    drop_eagle_block: bool,
    fine_grained: bool,
    num_hashes: int,
) -> int:
    """ChunkedLocalAttentionManager's rule (spec §4.4).

    Blocks before the current chunk's start are out of every query's reach, so they count
    without a lookup; the hit extends from there while blocks are cached. vLLM requires
    ``B == A`` and no EAGLE (``resolve`` enforces both), so ``drop_eagle_block`` and
    ``fine_grained`` are ignored. The final floor to ``A`` is a no-op under those rules and
    only keeps the alignment invariant for hand-built layouts.
    """
    b = spec.block_size
    h = hash_block_size
    k = b // h
    chunk = spec.attention_chunk_size or b
    start = (max_length // chunk) * chunk // b
    n_max = min(max_length, num_hashes * h) // b
    j = start
    while j < n_max and has(group_ids, (j + 1) * k - 1):
        j += 1
    hit = j * b
    return hit - hit % alignment


def mamba_hit(
    spec: GroupSpec,
    group_ids: tuple[int, ...],
    max_length: int,
    has: Presence,
    alignment: int,
    hash_block_size: int,
    drop_eagle_block: bool,
    fine_grained: bool,
    num_hashes: int,
) -> int:
    """MambaManager's align-mode rule (spec §4.4): one state block ending exactly at the hit.

    Non-fine-grained: the highest cached block whose end is a multiple of ``A`` (blocks whose
    end is not aligned are never probed: vLLM skips them whatever their presence).
    Fine-grained: the highest cached fine index (full-block or partial key), stepping over
    fine boundaries that are not multiples of ``A`` (none are when ``A == H``).
    Mamba never drops an EAGLE block (spec §4.6). The same rule is applied to the other Mamba
    modes, which the spec does not detail; they force ``H = S`` so it is plain block lookup.
    """
    h = hash_block_size
    limit = min(max_length, num_hashes * h)
    if fine_grained:
        unit = h
        k = 1
    else:
        unit = spec.block_size
        k = unit // h
    period = alignment // math.gcd(alignment, unit)
    j = limit // unit - 1
    j = ((j + 1) // period) * period - 1
    while j >= 0:
        if has(group_ids, (j + 1) * k - 1):
            return (j + 1) * unit
        j -= period
    return 0


_FINDERS: dict[GroupKind, Finder] = {
    **dict.fromkeys(FA_TYPE_KINDS, full_attention_hit),
    **dict.fromkeys(SLIDING_KINDS, sliding_window_hit),
    GroupKind.CHUNKED_LOCAL_ATTENTION: chunked_local_hit,
    GroupKind.MAMBA: mamba_hit,
}


def finder_for(spec: GroupSpec) -> Finder:
    """The per-type rule for ``spec``'s kind; a clear error for kinds with no known rule."""
    try:
        return _FINDERS[spec.kind]
    except KeyError:
        raise HitInputError(
            f"no prefix-cache hit rule for group kind {spec.kind!s}: declare the group's real "
            f"kind in the layout, or set prefix_cacheable: false if it takes no part"
        ) from None


def _check(num_tokens: int, num_hashes: int | None) -> None:
    if num_tokens < 0:
        raise HitInputError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_hashes is not None and num_hashes < 0:
        raise HitInputError(
            f"num_hashes must be >= 0 (or None for num_tokens // H), got {num_hashes}"
        )


def find_longest_cache_hit(
    layout: ResolvedLayout,
    num_tokens: int,
    has: Presence,
    *,
    num_hashes: int | None = None,
    skip_reading: bool = False,
    explain: bool = True,
) -> HitResult:
    """The hit vLLM 0.32 computes for a new request of ``num_tokens`` tokens (spec §4).

    ``num_hashes`` is how many fine hashes the request's chain has (default ``num_tokens //
    H``); it bounds every probe, including the EAGLE look-ahead (spec §4.5). ``skip_reading``
    models ``prompt_logprobs`` and explicit ``skip_reading_prefix_cache``: hit 0 (spec §4.1).
    ``explain=False`` skips the standalone per-group hits, which can cost extra probes (a
    group reached with a lowered candidate is looked up again at ``num_tokens - 1``).
    """
    _check(num_tokens, num_hashes)
    groups = layout.spec_groups
    n_groups = len(groups)
    if skip_reading or n_groups == 0 or num_tokens <= 1:
        # No spec group at all (everything excluded) leaves nothing to hit; vLLM's loop would
        # return its untouched candidate, but such a layout cannot serve a prefix hit.
        return HitResult(0, (0,) * n_groups if explain else (), None, 0, 0, 0)
    h = layout.hash_block_size
    nh = num_tokens // h if num_hashes is None else num_hashes
    a = layout.alignment
    partial = layout.partial_hits
    max_length = num_tokens - 1

    if layout.unitary:
        # UnitaryKVCacheCoordinator (spec §4.2): alignment B, drop = the group is EAGLE, no
        # look-ahead and no loop.
        sg = groups[0]
        spec = sg.spec
        found = finder_for(spec)(spec, sg.group_ids, max_length, has, a, h, spec.eagle, False, nh)
        hit, replay = bounded_replay(layout, found)
        return HitResult(
            hit,
            (found,) if explain else (),
            0 if found < max_length else None,
            found,
            0,
            1,
            replay,
        )

    # HybridKVCacheCoordinator's fixed-point loop (spec §4.5).
    # Reading of §4.5: its pseudocode keeps one `fa_result`; with several FA-type spec groups
    # (e.g. FA block 16 + MLA block 32) each must be looked up once, so the result is kept per
    # spec group — otherwise the second FA-type group would never be probed at all.
    fa_results: list[int] = [-1] * n_groups
    standalone: list[int] = [-1] * n_groups
    eagle_ok = 0  # bit i: spec group i already paid its EAGLE drop
    simple = n_groups == 2 and groups[0].spec.is_fa_type
    top_cap = nh * h
    longest = 0
    limiting: int | None = None
    passes = 0
    cand = max_length
    while True:
        passes += 1
        cur = cand
        for gi in range(n_groups):
            sg = groups[gi]
            spec = sg.spec
            is_fa = spec.kind in FA_TYPE_KINDS
            if is_fa and fa_results[gi] >= 0:
                # FA is downward-closed: truncating its first result is its answer (§4.5).
                if fa_results[gi] < cur:
                    cur = fa_results[gi]
                    limiting = gi
                continue
            b = spec.block_size
            fine = partial and a < b
            drop = spec.eagle and not (eagle_ok >> gi) & 1
            lim = cur
            if drop and spec.kind != GroupKind.MAMBA:
                # Look one block (one hash unit if fine-grained) past the candidate, bounded by
                # the request's hashes, so the drop lands back on the candidate (§4.6).
                lim = min(cur + (h if fine else b), top_cap)
            new = finder_for(spec)(spec, sg.group_ids, lim, has, a, h, drop, fine, nh)
            if passes == 1 and cur == max_length:
                standalone[gi] = new
            if drop:
                eagle_ok |= 1 << gi
            elif new < cur:
                eagle_ok = 0
            if new < cur:
                limiting = gi
            cur = new
            if is_fa:
                fa_results[gi] = new
            if cur > longest:
                longest = cur
        if cur >= cand:
            break
        cand = cur
        if simple:
            break

    hits: tuple[int, ...] = ()
    if explain:
        for gi in range(n_groups):
            if standalone[gi] < 0:
                standalone[gi] = _standalone(layout, gi, max_length, has, nh)
        hits = tuple(standalone)
    hit, replay = bounded_replay(layout, cand)
    return HitResult(hit, hits, limiting, longest, longest - cand, passes, replay)


def bounded_replay(layout: ResolvedLayout, hit_tokens: int) -> tuple[int, int]:
    """The scheduler's DeepSeek-V4.1 bounded replay on a local hit, as vLLM 0.32 applies it
    after ``get_computed_blocks`` (``Scheduler.schedule``, no KV connector): with a replay
    window W, a hit of ``0 < hit <= W`` tokens "would be recomputed in full and save nothing"
    and is dropped to 0; a longer hit is kept (and reported as ``cached_tokens``) but its last
    W tokens are recomputed (``_mark_prefix_replay``). Returns ``(hit, replayed tokens)``."""
    w = layout.prefix_replay_tokens
    if w <= 0 or hit_tokens <= 0:
        return hit_tokens, 0
    if hit_tokens <= w:
        return 0, 0
    return hit_tokens, w


def _standalone(
    layout: ResolvedLayout, gi: int, max_length: int, has: Presence, num_hashes: int
) -> int:
    """Spec group ``gi``'s finder as the first call of the loop would run it."""
    sg = layout.spec_groups[gi]
    spec = sg.spec
    h = layout.hash_block_size
    a = layout.alignment
    fine = layout.partial_hits and a < spec.block_size
    lim = max_length
    if spec.eagle and spec.kind != GroupKind.MAMBA:
        lim = min(max_length + (h if fine else spec.block_size), num_hashes * h)
    return finder_for(spec)(spec, sg.group_ids, lim, has, a, h, spec.eagle, fine, num_hashes)


def group_blind_hit(
    layout: ResolvedLayout,
    num_tokens: int,
    has_any: AnyPresence,
    *,
    num_hashes: int | None = None,
) -> int:
    """The hit a group-blind router would predict, for comparison with the exact one.

    Definition: the pool is treated as one full-attention cache in which a block counts as
    cached if ANY group holds its hash. The block size is that of the first FA-type spec group
    (or ``scheduler_block_size`` when there is none); the hit is the contiguous run from block
    0 of at most ``floor((num_tokens - 1) / B)`` blocks, floored to the alignment ``A``. No
    partial entries, no EAGLE drop — that is what routers that ignore groups compute.
    """
    _check(num_tokens, num_hashes)
    h = layout.hash_block_size
    nh = num_tokens // h if num_hashes is None else num_hashes
    if num_tokens <= 1:
        return 0
    b = layout.scheduler_block_size
    for sg in layout.spec_groups:
        if sg.spec.is_fa_type:
            b = sg.spec.block_size
            break
    k = b // h
    n_max = min(num_tokens - 1, nh * h) // b
    leading_run = getattr(has_any, "leading_run", None)
    if leading_run is not None:
        n = leading_run(k, n_max)
    else:
        n = 0
        idx = k - 1
        while n < n_max and has_any(idx):
            n += 1
            idx += k
    hit = n * b
    return hit - hit % layout.alignment


def blocks_behind_hit(layout: ResolvedLayout, hit_tokens: int) -> list[tuple[int, int]] | None:
    """The ``(group_idx, fine_idx)`` keys a replica must hold for vLLM to report a hit of
    ``hit_tokens`` (spec §4.4): what an answer proves about a cache no event described.

    Per kind: full attention every block up to the hit; sliding window the ``ceil((window -
    1) / B)`` blocks ending there; chunked local the blocks of the hit's chunk before it (none
    at a chunk boundary); Mamba the state block ending there. Block ``j`` of a group with block
    size ``B`` is fine index ``(j + 1) * B / H - 1``. None when the layout's rule is not this
    plain one (EAGLE drops, fine-grained partial hits) or the hit is not a multiple of a
    group's block: nothing is inferred then.
    """
    if hit_tokens <= 0:
        return []
    if layout.partial_hits:
        return None
    h = layout.hash_block_size
    out: list[tuple[int, int]] = []
    for sg in layout.spec_groups:
        spec = sg.spec
        b = spec.block_size
        if spec.eagle or hit_tokens % b:
            return None
        end = hit_tokens // b
        if spec.kind in FA_TYPE_KINDS:
            first = 0
        elif spec.kind in SLIDING_KINDS:
            first = max(0, end - _window_need(spec, False))
        elif spec.kind == GroupKind.CHUNKED_LOCAL_ATTENTION and spec.attention_chunk_size:
            chunk = spec.attention_chunk_size
            first = hit_tokens // chunk * chunk // b  # the scan starts at the hit's chunk
        elif spec.kind == GroupKind.MAMBA:
            first = end - 1
        else:
            return None
        k = b // h
        out.extend((g, (j + 1) * k - 1) for g in sg.group_ids for j in range(first, end))
    return out


def window_blocks(spec: GroupSpec) -> int:
    """Cached blocks in a row a sliding-window hit needs, ending at the hit (no EAGLE)."""
    return _window_need(spec, False)


def implied_by_held(spec: GroupSpec, held: Sequence[bool]) -> list[int]:
    """The blocks of one group a replica holds because of the blocks it holds (``held[j]``:
    block ``j`` of the request's chain is held), not yet in ``held``: what a *partial*
    replica's index may add when a request names them (docs/live-fleet.md).

    Full attention: every ancestor of a held block. vLLM frees a request's blocks tail first
    and a request holds all its full-attention ancestors, so a cached block's parent is
    cached (spec §2.2, §5.4). Sliding window: the ``ceil((window - 1) / B)`` blocks ending
    at a held block, which the request that stored it (or hit it) held then; whether they
    were removed since is for the caller to check. Other kinds imply nothing; neither do
    layouts whose rule is not the plain one (the caller checks ``blocks_behind_hit``).
    """
    last = max((j for j, h in enumerate(held) if h), default=-1)
    if last < 0:
        return []
    if spec.kind in FA_TYPE_KINDS:
        return [j for j in range(last) if not held[j]]
    if spec.kind not in SLIDING_KINDS:
        return []
    need = _window_need(spec, False)
    out: set[int] = set()
    for q in range(last + 1):
        if held[q]:
            out.update(j for j in range(max(0, q + 1 - need), q) if not held[j])
    return sorted(out)
