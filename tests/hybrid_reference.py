"""Deliberately simple, independent references for router.core.hybrid (test-only).

Two kinds:

* ``reference_hit``: declarative. Each spec group *accepts* a length L by a rule read off
  spec §0/§4.4 directly, and the hit is the largest aligned L <= num_tokens - 1 that every spec
  group accepts, found by brute force from the top. No loop, no scanning order, no EAGLE.
* ``literal_*``: line-by-line transcriptions of spec §4.4's pseudocode (linear scans, exactly
  as written), to check that the optimised finders in router.core.hybrid probe in a different
  order but answer the same, EAGLE and ``B != A`` included.

Nothing here is fast; the tests keep sizes small.
"""

from __future__ import annotations

from events.layout import FA_TYPE_KINDS, SLIDING_KINDS, GroupKind, ResolvedLayout, SpecGroup
from router.core.hybrid import Presence


def _cached(has: Presence, ids: tuple[int, ...], b: int, h: int, j: int) -> bool:
    """Block j of a group with block size b (its end hash is fine index (j+1)*b/h - 1)."""
    return has(ids, (j + 1) * (b // h) - 1)


def _window_need(window: int, b: int) -> int:
    return max(1, -(-(window - 1) // b))


def accepts(
    layout: ResolvedLayout,
    sg: SpecGroup,
    length: int,
    has: Presence,
    max_length: int,
    num_hashes: int,
) -> bool:
    """Whether spec group ``sg`` (no EAGLE) accepts a hit of exactly ``length`` tokens."""
    if length == 0:
        return True
    spec, ids = sg.spec, sg.group_ids
    h = layout.hash_block_size
    b = spec.block_size
    fine = layout.partial_hits and layout.alignment < b
    if spec.kind in FA_TYPE_KINDS:
        # Some cached boundary f >= L (f <= max_length, within the hashes) with every full block
        # below it cached: a full-block boundary, or, fine-grained, a partial entry. Any
        # prefix of cached KV is usable, so L itself needs no key of its own.
        for f in range(length, min(max_length, num_hashes * h) + 1):
            if f % h:
                continue
            if not all(_cached(has, ids, b, h, j) for j in range(f // b)):
                continue
            if f % b == 0 or (fine and has(ids, f // h - 1)):
                return True
        return False
    if spec.kind in SLIDING_KINDS:
        if length % b:
            return False
        need = _window_need(spec.sliding_window or 1, b)
        top = length // b
        return all(_cached(has, ids, b, h, j) for j in range(max(0, top - need), top))
    if spec.kind == GroupKind.MAMBA:
        # The state (or, fine-grained, a partial key) ending exactly at L.
        if not fine and length % b:
            return False
        return has(ids, length // h - 1)
    if spec.kind == GroupKind.CHUNKED_LOCAL_ATTENTION:
        if length % b:
            return False
        chunk = spec.attention_chunk_size or b
        start = (length // chunk) * chunk // b
        return all(_cached(has, ids, b, h, j) for j in range(start, length // b))
    raise AssertionError(f"no reference rule for {spec.kind}")


def reference_hit(
    layout: ResolvedLayout, num_tokens: int, has: Presence, num_hashes: int | None = None
) -> int:
    """The largest aligned L <= num_tokens - 1 that every spec group accepts (no EAGLE)."""
    if num_tokens <= 1 or not layout.spec_groups:
        return 0
    h = layout.hash_block_size
    nh = num_tokens // h if num_hashes is None else num_hashes
    a = layout.alignment
    max_length = num_tokens - 1
    for length in range(max_length - max_length % a, -1, -a):
        if all(accepts(layout, sg, length, has, max_length, nh) for sg in layout.spec_groups):
            return length
    return 0


def literal_sliding_window(
    b: int,
    window: int,
    ids: tuple[int, ...],
    max_length: int,
    has: Presence,
    alignment: int,
    h: int,
    drop_eagle_block: bool,
) -> int:
    """Spec §4.4 SlidingWindowManager pseudocode, verbatim (max_length already bounded)."""
    need = -(-(window - 1) // b) + (1 if drop_eagle_block else 0)
    run = 0
    hit = None
    for j in range(max_length // b - 1, -1, -1):
        if _cached(has, ids, b, h, j):
            edge = j if drop_eagle_block else j + 1
            if run == 0 and b != alignment and (edge * b) % alignment != 0:
                continue
            run += 1
            if run >= need:
                hit = (j + run) * b
                break
        else:
            run = 0
    if hit is None:
        hit = run * b
        while hit % alignment:
            hit -= b
    if drop_eagle_block and hit > 0:
        hit -= b
        hit = hit // alignment * alignment
    return hit


def literal_mamba(
    b: int,
    ids: tuple[int, ...],
    max_length: int,
    has: Presence,
    alignment: int,
    h: int,
    fine_grained: bool,
) -> int:
    """Spec §4.4 MambaManager (align) pseudocode, verbatim."""
    if fine_grained:
        for idx in range(max_length // h - 1, -1, -1):
            if has(ids, idx):
                return (idx + 1) * h
        return 0
    for j in range(max_length // b - 1, -1, -1):
        if _cached(has, ids, b, h, j) and ((j + 1) * b) % alignment == 0:
            return (j + 1) * b
    return 0
