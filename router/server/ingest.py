"""Feeds a subscriber's stream items into the index: the subscriber -> index edge of the flow.

Every item the event SDK delivers maps to one index operation (spec §3, §5.4):

=====================  =================================================================
``StreamBatch``        apply its events in order to the stream's replica and DP rank
``StreamReset``        the replica restarted empty (vLLM sends nothing for it): wipe, trusted
``GapUnrecoverable``   events lost for good: wipe, then *partial* (what follows is applied,
                       a lower bound); a gap as the stream opens is a late attach (the
                       ring dropped the replica's start, or the batches since a
                       snapshot): *partial* without a wipe
``MalformedMessage``   a batch that could not be read is a lost batch: same as a gap
``RankMismatch``       the batch belonged to another rank's cache and was dropped: same
=====================  =================================================================

The index is not thread-safe: feed it from the thread (or event loop) that also reads it,
e.g. an :class:`~events.subscriber.AsyncSubscriber` in the router's serving loop, or hold a
lock around both.
"""

from __future__ import annotations

from collections.abc import Mapping

from events.stream import (
    GapUnrecoverable,
    MalformedMessage,
    RankMismatch,
    StreamBatch,
    StreamItem,
    StreamReset,
)
from router.core.index import KVIndex, ReplicaKey

__all__ = ["IndexFeeder", "UnknownStream"]


class UnknownStream(KeyError):
    """An item came from a stream the feeder was not told about."""

    def __str__(self) -> str:
        return (
            f"stream {self.args[0]!r} is not mapped to a replica: pass it in IndexFeeder's "
            f"streams mapping"
        )


class IndexFeeder:
    """Callable consumer of stream items (usable as ``Subscriber(on_item=feeder)``).

    ``streams`` maps each stream name to the ``(replica, dp_rank)`` whose cache it describes;
    the replicas are added to the index here.
    """

    def __init__(self, index: KVIndex, streams: Mapping[str, ReplicaKey]) -> None:
        self.index = index
        self.streams = dict(streams)
        self._started: set[str] = set()
        self.applied: dict[str, int] = {}
        """Per stream, the last batch applied to the index: what a snapshot resumes from
        (the subscriber's own counters can run ahead of what reached the index)."""
        """Streams that have delivered anything: after that a gap is a loss, not an attach."""
        for name, dp_rank in self.streams.values():
            index.add_replica(name, dp_rank)

    def __call__(self, item: StreamItem) -> None:
        try:
            key = self.streams[item.stream]
        except KeyError:
            raise UnknownStream(item.stream) from None
        cls = type(item)
        first = item.stream not in self._started
        if first:
            self._started.add(item.stream)
        if cls is GapUnrecoverable and first:
            self.index.attached_late(
                key,
                f"the replay ring starts at batch {item.got}, not {item.expected} ({item.reason})",
            )
        elif cls is StreamBatch:
            self.applied[item.stream] = item.seq
            try:
                self.index.apply_events(key, item.batch.events)
            except Exception as exc:  # one replica's bad batch never stops its stream
                self.index.ingest_failed(key, exc)
        elif cls is StreamReset:
            self.index.reset_replica(key)
        elif cls is GapUnrecoverable:
            self.index.gap_lost(
                key, f"batches {item.expected}..{item.got - 1} lost ({item.reason})"
            )
        elif cls is MalformedMessage:
            where = "an unreadable message" if item.seq is None else f"batch {item.seq}"
            self.index.lost_events(key, f"{where} could not be decoded: {item.reason}")
        elif cls is RankMismatch:
            self.index.lost_events(
                key,
                f"batch {item.seq} came from DP rank {item.got_rank}, not {item.expected_rank}: "
                f"check the stream's endpoint and dp_rank",
            )
        else:
            raise TypeError(f"not a stream item: {item!r}")
