"""Turns a pool's events into published batches, one per engine step, like vLLM's scheduler.

vLLM queues GPU events in its block pool and ``Scheduler.update_from_output`` publishes them
once per engine step as one ``KVEventBatch``; a step that produced nothing publishes nothing
(spec §2.2, §2.5). :class:`PublisherHook` is that step buffer: pass it as the pool's
``hook=`` (it receives every event as it happens), then call :meth:`PublisherHook.end_step`
once per engine step. A pool without a hook can feed it with :meth:`PublisherHook.extend`
(``hook.extend(pool.take_events()); hook.end_step()``).

Example::

    pub = EventPublisher("tcp://*:5557")
    hook = PublisherHook(pub)
    pool = HybridBlockPool(layout, 4096, hook=hook)
    ...                       # admit / append_tokens / finish for this step
    seq = hook.end_step()     # None when the step produced no event
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from events.hashing import to_wire
from events.publisher import EventPublisher
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch

__all__ = ["HashFormError", "PublisherHook"]


class HashFormError(ValueError):
    """A uint64 wire hash reached a hook told to publish raw digests: the digest is gone."""


class PublisherHook:
    """Buffers one engine step's events and publishes them as one batch.

    Args:
        publisher: where batches go (its DP rank fills ``data_parallel_rank``).
        legacy: encode events as pre-#42892 positional arrays (spec §2.1) instead of the
            0.32 tagged maps, to exercise old-format consumers.
        int_hashes: publish uint64 wire hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``,
            vLLM's default). Raw digests from a pool whose layout sets
            ``hash.int_block_hashes = false`` are converted exactly as vLLM's
            ``maybe_convert_block_hash`` does (low 8 bytes, big-endian). With ``False`` hashes
            pass through unchanged and must be bytes: give such a hook a pool whose layout
            says ``int_block_hashes = false`` (or use :meth:`for_pool`).
    """

    def __init__(
        self, publisher: EventPublisher, *, legacy: bool = False, int_hashes: bool = True
    ) -> None:
        self.publisher = publisher
        self.legacy = legacy
        self.int_hashes = int_hashes
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self.batches = 0
        self.events = 0

    @classmethod
    def for_pool(cls, publisher: EventPublisher, pool: Any, *, legacy: bool = False):
        """A hook whose hash form follows ``pool.layout.hash.int_block_hashes``."""
        return cls(publisher, legacy=legacy, int_hashes=pool.layout.hash.int_block_hashes)

    # -- receiving -----------------------------------------------------------------

    def _wire(self, h: Any) -> Any:
        if self.int_hashes:
            return to_wire(h, True) if isinstance(h, bytes) else h
        if not isinstance(h, bytes):
            raise HashFormError(
                f"hash {h!r} is already a uint64 wire hash but this hook publishes raw digests "
                "(int_hashes=False): set hash.int_block_hashes = false in the pool's layout, "
                "or build the hook with int_hashes=True"
            )
        return h

    def _convert(self, ev: Any) -> Any:
        if type(ev) is BlockStored:
            parent = ev.parent_block_hash
            return msgspec.structs.replace(
                ev,
                block_hashes=[self._wire(h) for h in ev.block_hashes],
                parent_block_hash=None if parent is None else self._wire(parent),
            )
        if type(ev) is BlockRemoved:
            return msgspec.structs.replace(
                ev, block_hashes=[self._wire(h) for h in ev.block_hashes]
            )
        if type(ev) is AllBlocksCleared:
            return ev
        raise TypeError(
            f"not a KV event: {ev!r}; expected BlockStored/BlockRemoved/AllBlocksCleared"
        )

    def _add(self, ev: Any) -> None:
        ev = self._convert(ev)
        with self._lock:
            self._pending.append(ev)

    def on_stored(self, ev: BlockStored) -> None:
        self._add(ev)

    def on_removed(self, ev: BlockRemoved) -> None:
        self._add(ev)

    def on_cleared(self, ev: AllBlocksCleared) -> None:
        """A reset is queued now and goes out with the next step's batch (spec §2.5)."""
        self._add(ev)

    def extend(self, events: Iterable[Any]) -> None:
        """Add events drained from a pool without a hook (``pool.take_events()``)."""
        for ev in events:
            self._add(ev)

    @property
    def pending(self) -> int:
        """Events waiting for :meth:`end_step`."""
        return len(self._pending)

    # -- publishing ----------------------------------------------------------------

    def end_step(self) -> int | None:
        """Publish this step's events as one batch; returns its seq, or None if empty."""
        with self._lock:
            events, self._pending = self._pending, []
        if not events:
            return None
        pub = self.publisher
        batch = KVEventBatch(time.time(), events, pub.data_parallel_rank)
        if self.legacy and not pub.legacy:
            seq = pub.publish_raw(encode_batch(batch, legacy=True))
        else:
            seq = pub.publish(batch)
        self.batches += 1
        self.events += len(events)
        return seq
