"""router.core.snapshot: an index written out and read back holds exactly the same state."""

from __future__ import annotations

import pytest
from test_index import FA_SWA, LEARN, A, B, make, present, removed, stored

from router.core.index import KVIndex
from router.core.snapshot import (
    SNAPSHOT_VERSION,
    IndexSnapshot,
    PoolSnapshot,
    SnapshotError,
    decode_snapshot,
    encode_snapshot,
)


def roundtrip(index: KVIndex, layout=FA_SWA) -> KVIndex:
    groups, source = index.learned_layout()
    pool = PoolSnapshot("m", groups, source, [index.export_replica(k) for k in index.replicas()])
    data = encode_snapshot(IndexSnapshot(SNAPSHOT_VERSION, 0.0, [pool]))
    (back,) = decode_snapshot(data).pools
    fresh = KVIndex(layout, verify_hashes=False)
    for snap in back.replicas:
        me = f"{snap.name}/dp{snap.dp_rank}"
        fresh.import_replica(snap, learned=back.learned_groups, source=me == back.layout_source)
    return fresh


def test_state_copies_tiers_and_trust_survive_a_roundtrip() -> None:
    index = make()
    index.apply_events(
        A, [stored([1, 2, 3]), stored([3]), stored([7], group=1, kind="sliding_window")]
    )
    index.apply_events(A, [stored([9], medium="cpu"), stored([5], medium="remote")])
    index.apply_events(B, [stored([2]), stored([4], group=-1)])  # B: refused, untrusted
    index.attached_late(A, "test")
    back = roundtrip(index)
    for key in (A, B):
        assert back.trust(key) == index.trust(key)
        assert back.untrusted_reason(key) == index.untrusted_reason(key)
    for g, h, tier in [
        (0, 1, "GPU"),
        (0, 3, "GPU"),
        (1, 7, "GPU"),
        (0, 9, "CPU"),
        (0, 5, "REMOTE"),
    ]:
        assert present(back, A, g, h, tier)
    assert back.copies(A, 0, 3) == 2 and back.entries == index.entries
    back.apply_events(A, [removed([3])])
    assert present(back, A, 0, 3), "two copies: one removal leaves one"
    back.apply_events(A, [removed([3])])
    assert not present(back, A, 0, 3)


def test_a_learned_layout_and_its_source_survive() -> None:
    index = make(layout=LEARN)
    index.apply_events(A, [stored([1, 2]), stored([2], group=1, kind="sliding_window")])
    back = roundtrip(index, LEARN)
    assert back.layout is not None and back.layout.layout.groups == index.layout.layout.groups
    back.apply_events(B, [stored([5], block_size=32)])  # not the source: cannot grow it
    assert back.trust(B) == "untrusted" and back.trust(A) == "exact"


def test_a_snapshot_of_another_version_or_shape_is_refused_with_the_fix() -> None:
    with pytest.raises(SnapshotError, match="version 99"):
        decode_snapshot(encode_snapshot(IndexSnapshot(99, 0.0, [])))
    with pytest.raises(SnapshotError, match="not a kvrouter index snapshot"):
        decode_snapshot(b"\x93garbage", source="x.snap")
