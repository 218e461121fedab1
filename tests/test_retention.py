"""``events.retention.retained_blocks`` reads sparse groups' blocks off the reachable
boundaries (it runs for every routed request); it must keep exactly the blocks the
block-by-block rule :func:`events.retention.is_retained` keeps (spec §4.7)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from events.layout import GroupKind, GroupSpec
from events.retention import is_retained, reachable_boundaries, retained_blocks

KINDS = [
    GroupKind.FULL_ATTENTION,
    GroupKind.SLIDING_WINDOW,
    GroupKind.CHUNKED_LOCAL_ATTENTION,
    GroupKind.MAMBA,
]


@st.composite
def cases(draw: st.DrawFn) -> tuple[GroupSpec, int, int, int, int | None, list[int]]:
    kind = draw(st.sampled_from(KINDS))
    b = draw(st.sampled_from([1, 4, 16, 32]))
    extra: dict[str, int] = {}
    if kind is GroupKind.SLIDING_WINDOW:
        extra["sliding_window"] = draw(st.integers(1, 300))
    if kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
        extra["attention_chunk_size"] = b * draw(st.integers(1, 4))
    spec = GroupSpec(kind=kind, block_size=b, **extra)
    alignment = draw(st.sampled_from([b, 2 * b, 3 * b, 48, 64]))
    retention = draw(st.sampled_from([None, 0, 0, alignment, 4 * alignment]))
    n = draw(st.integers(1, 2000))
    junction = draw(st.none() | st.integers(1, n))
    reach = sorted(reachable_boundaries(n, junction, alignment))
    lo = draw(st.integers(0, 8))
    hi = draw(st.integers(lo, max(lo, n // b + 2)))
    return spec, alignment, lo, hi, retention, reach


@settings(max_examples=600, deadline=None)
@given(cases())
def test_retained_blocks_equals_the_block_by_block_rule(
    case: tuple[GroupSpec, int, int, int, int | None, list[int]],
) -> None:
    spec, alignment, lo, hi, retention, reach = case
    naive = [
        j
        for j in range(lo, hi)
        if is_retained(spec, j, alignment=alignment, retention=retention, reachable=reach)
    ]
    fast = retained_blocks(spec, lo, hi, alignment=alignment, retention=retention, reachable=reach)
    assert fast == naive
