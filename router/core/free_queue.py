"""vLLM's free block queue as the router can reconstruct it: which cached blocks go first.

vLLM keeps every block no running request holds in one queue (spec §2.2, "lazy LRU
eviction"): a request's blocks join the tail when it frees them, in reverse order within each
group, group after group (``free_blocks`` on each manager's ``reversed`` list), a hit takes a
block out of the queue (``touch``), and every allocation takes the head, evicting it if it was
cached (``BlockRemoved``). Frees emit no event (spec §5.4), so the order is not in the events;
but the router saw every request it sent start and end, and the events say which keys exist.
:class:`FreeQueue` orders the cached keys of one replica by that: a key is stamped when it is
stored, and again when the last request the router sent that holds it frees it. Keys held by a
request in flight are out of the queue.

This is a model, not a copy, and it errs in known ways: a block stored during decode is stamped
at its store, not at its request's end; physical copies of one key are one entry; requests
the router did not send are not seen. :mod:`router.core.admission` uses it only to say which
blocks the allocations ahead of a request will evict before vLLM admits it.

Pure: no I/O, no clock (stamps are a counter, because only the order matters).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

from sortedcontainers import SortedDict

__all__ = ["FreeQueue", "Key"]

Key = tuple[int, object]
"""``(group, wire hash)`` of a GPU block."""


class FreeQueue:
    """One replica's cached keys: the free ones in queue order, the held ones apart."""

    __slots__ = ("_cached", "_free", "_held", "_next")

    def __init__(self) -> None:
        self._cached: dict[Key, int | None] = {}
        """Every cached key: its stamp while free, None while a request in flight holds it."""
        self._free: SortedDict = SortedDict()
        """stamp -> key for the free cached keys: the queue, head first."""
        self._held: dict[Key, int] = {}
        """Keys requests in flight hold (cached yet or not), with how many requests."""
        self._next = 0

    def __len__(self) -> int:
        """Cached keys, free or held."""
        return len(self._cached)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached (free or held)."""
        return key in self._cached

    @property
    def free_cached(self) -> int:
        """Cached keys in the queue: the blocks an allocation may evict."""
        return len(self._free)

    def _enqueue(self, key: Key) -> None:
        stamp = self._next
        self._next += 1
        self._cached[key] = stamp
        self._free[stamp] = key

    def stored(self, keys: Iterable[Key]) -> None:
        """Keys a ``BlockStored`` named: new ones join the tail, unless a request in flight
        holds them (its own prefill stored them; they join the queue when it frees them). A
        key already cached is another copy: the model keeps one entry."""
        cached, held = self._cached, self._held
        for key in keys:
            if key in cached:
                continue
            if key in held:
                cached[key] = None
            else:
                self._enqueue(key)

    def removed(self, keys: Iterable[Key]) -> None:
        """Keys a ``BlockRemoved`` named: no longer cached."""
        cached, free = self._cached, self._free
        for key in keys:
            stamp = cached.pop(key, None)
            if stamp is not None:
                del free[stamp]

    def clear(self) -> None:
        """``AllBlocksCleared``, a reset or lost events: nothing is known to be cached. What
        requests in flight hold stays held (they still run)."""
        self._cached.clear()
        self._free.clear()

    def hold(self, keys: Iterable[Key]) -> None:
        """A request holds ``keys`` from now until :meth:`release` (a hit touched them out of
        the queue, or its prefill will store them)."""
        cached, held, free = self._cached, self._held, self._free
        for key in keys:
            n = held.get(key, 0)
            held[key] = n + 1
            if n == 0:
                stamp = cached.get(key)
                if stamp is not None:
                    del free[stamp]
                    cached[key] = None

    def release(self, keys: Iterable[Key]) -> None:
        """A request that :meth:`hold` ``keys`` freed them, in the order given (vLLM's: the
        first given is evicted first). A key nobody else holds joins the tail if cached."""
        cached, held = self._cached, self._held
        for key in keys:
            n = held.get(key, 0)
            if n > 1:
                held[key] = n - 1
                continue
            if n == 1:
                del held[key]
            if key in cached and key not in held:
                stamp = cached[key]
                if stamp is not None:
                    del self._free[stamp]
                self._enqueue(key)

    def touch(self, keys: Iterable[Key]) -> None:
        """``keys`` were taken out and freed again at once (the sliding-window blocks a
        prefill leaves behind its window): they move to the tail, in the order given."""
        keys = list(keys)
        self.hold(keys)
        self.release(keys)

    def head(self, n: int) -> Iterator[Key]:
        """The first ``n`` free cached keys: what ``n`` allocations evict if the queue holds no
        uncached block ahead of them."""
        return islice(self._free.values(), max(0, n))

    def is_held(self, key: Key) -> bool:
        return key in self._held
