"""The index as a file: what a router writes on shutdown (and periodically) and what a peer
serves at ``GET /admin/index/snapshot``, so a router that starts can be exact at once instead
of waiting for replicas' rings (which keep only their last ``buffer_steps`` batches).

One msgspec schema, versioned. Per replica: its trust state, its learned view of the groups,
every ``(tier, group, hash)`` it holds with its copy count, and per event stream the last
applied sequence number, from which the loading router asks each replica's ring to replay. If a
ring no longer reaches back that far, the replica is partial (events between are unknown),
exactly as on a late attach.
"""

from __future__ import annotations

import msgspec

from events.layout import GroupSpec

__all__ = [
    "SNAPSHOT_VERSION",
    "IndexSnapshot",
    "PoolSnapshot",
    "ReplicaSnapshot",
    "SnapshotError",
    "decode_snapshot",
    "encode_snapshot",
]

SNAPSHOT_VERSION = 1


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded; the message says why and what to do."""


class ReplicaSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    dp_rank: int
    trusted: bool
    untrusted_reason: str | None
    recoverable: bool
    partial_reason: str | None
    group_aware: bool | None
    learned: dict[int, GroupSpec]
    tiers: dict[str, list[list[tuple[int | bytes, int]]]]
    """Per tier, per group index: ``(wire hash, copies)`` of every key held."""
    streams: dict[str, int] = {}
    """Event stream name -> last applied sequence number (filled by the server)."""
    started_at: float | None = None
    """The replica's ``process_start_time_seconds`` when the snapshot was taken: its epoch.
    Sequence numbers restart at 0 with the process, so a replica that restarted since and has
    published past the saved sequence would otherwise look continuous."""


class PoolSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    learned_groups: list[GroupSpec]
    """The pool's layout learned from events (empty when declared or not learned yet)."""
    layout_source: str | None
    """``name/dpN`` of the replica the learned layout follows."""
    replicas: list[ReplicaSnapshot]


class IndexSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    created: float
    pools: list[PoolSnapshot]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IndexSnapshot)


def encode_snapshot(snap: IndexSnapshot) -> bytes:
    return _encoder.encode(snap)


def decode_snapshot(data: bytes, *, source: str = "snapshot") -> IndexSnapshot:
    """Decode and check a snapshot; a wrong version or shape is a :class:`SnapshotError`."""
    try:
        snap = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError(
            f"{source}: not a kvrouter index snapshot ({exc}); delete it or point the router "
            f"at a snapshot written by this version"
        ) from None
    if snap.version != SNAPSHOT_VERSION:
        raise SnapshotError(
            f"{source}: snapshot version {snap.version}, this router reads {SNAPSHOT_VERSION}; "
            f"start without it (the replicas' rings are replayed instead)"
        )
    return snap
