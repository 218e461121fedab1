"""Which full blocks vLLM 0.32 hashes: the retention rule of spec §4.7, in one place.

Both sides of the contract need it. The simulated replica (:mod:`gpu_emitter.managers`) uses
it to decide which of a request's newly full blocks it inserts into its prefix cache and
announces in ``BlockStored``; the router (:mod:`router.core.speculative`) uses it to guess
what a just-routed request *will* store before the events arrive. It is vLLM's documented
caching contract, not a hit rule: the two sides still compute hits independently
(:mod:`router.core.hybrid` and :mod:`gpu_emitter.coordinator`).

The rule (vLLM's ``reachable_block_mask`` per manager):

- full attention, MLA, sink and chunked local attention hash every full block (dense);
- sliding window: all blocks when ``A % B != 0``; otherwise, with ``need = ceil((window - 1)
  / B)``, the ``need`` blocks before every ``A`` boundary (retention ``None``), or before
  every ``R`` boundary plus the ``need`` blocks ending at each reachable boundary (``R >
  0``), or only the latter (``0``, vLLM's default);
- Mamba (align mode): every state block (``None``), the ones ending at a multiple of ``R``
  plus the reachable boundaries (``R > 0``), or only the reachable boundaries (``0``).

A reachable boundary is ``floor(b / A) * A`` for ``b`` in ``{num_prompt_tokens - 1,
shared_prefix_boundary}`` (spec §4.1, §4.7): where a later request replaying this prompt, or
sharing its prefix up to the junction, can resume. EAGLE shifts are not covered (neither side
models EAGLE retention).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from events.layout import SLIDING_KINDS, GroupKind, GroupSpec

__all__ = ["is_retained", "reachable_boundaries", "retained_blocks", "window_tail_blocks"]


def reachable_boundaries(
    num_prompt_tokens: int, shared_prefix_boundary: int | None, alignment: int
) -> frozenset[int]:
    """A request's reachable boundaries in tokens, aligned to ``alignment`` (spec §4.7).

    Boundaries at 0 or below are dropped: no block ends there, and vLLM ignores a zero
    ``shared_prefix_boundary``.
    """
    out = {(num_prompt_tokens - 1) // alignment * alignment}
    if shared_prefix_boundary:
        out.add(shared_prefix_boundary // alignment * alignment)
    return frozenset(b for b in out if b > 0)


def window_tail_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding-window hit needs in a row, ``ceil((window - 1) / B)``: the tail
    retention keeps before a boundary so that a hit can end there (spec §4.4, §4.7)."""
    return -(-(window - 1) // block_size)


def _before_multiple(j: int, period_blocks: int, need: int) -> bool:
    """Block ``j`` is among the ``need`` blocks before a multiple of ``period_blocks``."""
    return period_blocks - 1 - j % period_blocks < need


def is_retained(
    spec: GroupSpec,
    j: int,
    *,
    alignment: int,
    retention: int | None,
    reachable: Collection[int],
) -> bool:
    """Whether full block ``j`` of a group of kind ``spec`` is hashed (module docstring).

    ``alignment`` is the hit alignment A, ``retention`` vLLM's
    ``prefix_cache_retention_interval`` (``None``, 0 or a positive multiple of S) and
    ``reachable`` the request's :func:`reachable_boundaries`. For Mamba, ``j`` must be a block
    the group actually holds (a state block); null positions are never hashed.
    """
    b = spec.block_size
    end = (j + 1) * b
    if spec.kind in SLIDING_KINDS:
        if alignment % b:
            return True  # the mask cannot express a sub-block alignment: dense
        need = window_tail_blocks(spec.sliding_window or 1, b)
        if retention is None:
            return _before_multiple(j, alignment // b, need)
        if retention > 0 and _before_multiple(j, retention // b, need):
            return True
        return any(c - need * b < end <= c for c in reachable)
    if spec.kind == GroupKind.MAMBA:
        if retention is None:
            return True
        if retention > 0 and end % retention == 0:
            return True
        return end in reachable
    return True


def retained_blocks(
    spec: GroupSpec,
    lo: int,
    hi: int,
    *,
    alignment: int,
    retention: int | None,
    reachable: Collection[int],
) -> list[int]:
    """The blocks ``lo <= j < hi`` that :func:`is_retained` keeps, in order.

    Dense kinds keep the whole range, and with the default retention (0) a sliding-window or
    Mamba group keeps only blocks next to a reachable boundary: those are read off the
    boundaries instead of testing every block (a router does this for every request it
    routes, router.core.speculative)."""
    kind = spec.kind
    sparse = kind in SLIDING_KINDS or kind == GroupKind.MAMBA
    if not sparse:
        return list(range(lo, hi))
    b = spec.block_size
    candidates: Iterable[int] = range(lo, hi)
    if retention == 0 and not (kind in SLIDING_KINDS and alignment % b):
        reach = window_tail_blocks(spec.sliding_window or 1, b) if kind in SLIDING_KINDS else 1
        near: set[int] = set()
        for c in reachable:
            near.update(range(max(lo, c // b - reach - 1), min(hi, c // b + 1)))
        candidates = sorted(near)
    return [
        j
        for j in candidates
        if is_retained(spec, j, alignment=alignment, retention=retention, reachable=reachable)
    ]
