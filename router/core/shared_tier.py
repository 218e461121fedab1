"""Presence of a store the replicas of a pool share (vLLM 0.32's Mooncake store connector).

Pure state, no I/O: time comes in as an argument. A shared store is one cache, not one per
replica: a block any replica's connector stored is loadable by every replica, so its keys are
held here per ``(group_idx, wire hash)``, without replica bits. The connector's events say
only what was *stored*:

* one ``BlockStored(medium="cpu", group_idx=g)`` per newly put block; a block another replica
  already put is skipped (``batch_is_exist``) and publishes nothing, so per-replica presence
  would credit only the first writer;
* no ``BlockRemoved``: the Mooncake master evicts (memory pressure, leases) without telling
  vLLM, so nothing tells the router either.

The view is therefore bounded, not exact: a key is forgotten ``ttl_s`` after its last store
event, and at most ``capacity_blocks`` keys are held (the oldest stored first out), so a
deployment sets them from the store's size and turnover. A forgotten key can only lower a
prediction; a key the store evicted before its bound predicts a load that does not happen
(reported ``cached_tokens`` then falls short of the prediction, which the outcome metrics
count). A ``BlockRemoved`` for the tier, if a connector ever sends one, removes the key;
``AllBlocksCleared`` from any replica clears the tier (a reset with ``reset_connector``
wipes the store; without it this only forgets, which is safe).

``group_idx`` is the connector's: the index among the prefix-cacheable groups
(:func:`router.core.external.store_group_ids` maps it to the layout's groups).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["SharedTier"]


class SharedTier:
    """One shared tier's keys with their last store time (module docstring)."""

    __slots__ = ("capacity", "expired", "keys", "load_cost", "name", "ttl_s")

    def __init__(self, name: str, *, ttl_s: float, capacity_blocks: int, load_cost: float) -> None:
        if ttl_s <= 0 or capacity_blocks < 1 or not 0 <= load_cost <= 1:
            raise ValueError(
                f"shared tier {name!r}: ttl_s must be > 0, capacity_blocks >= 1 and "
                f"load_cost in 0..1 (got {ttl_s}, {capacity_blocks}, {load_cost})"
            )
        self.name = name
        self.ttl_s = ttl_s
        self.capacity = capacity_blocks
        self.load_cost = load_cost
        """What a loaded token costs the policy, as a share of a prefilled one."""
        self.keys: OrderedDict[tuple[int, object], float] = OrderedDict()
        self.expired = 0
        """Keys dropped by the TTL or the capacity bound (not by an event)."""

    def __len__(self) -> int:
        return len(self.keys)

    def store(self, group: int, hashes: Iterable[object], now: float) -> None:
        keys = self.keys
        for h in hashes:
            k = (group, h)
            keys[k] = now
            keys.move_to_end(k)
        while len(keys) > self.capacity:
            keys.popitem(last=False)
            self.expired += 1

    def remove(self, group: int, hashes: Iterable[object]) -> None:
        for h in hashes:
            self.keys.pop((group, h), None)

    def clear(self) -> None:
        self.keys.clear()

    def expire(self, now: float) -> None:
        """Drop the keys older than the TTL (oldest first: the dict is in store order)."""
        keys, limit = self.keys, now - self.ttl_s
        while keys:
            k, t = next(iter(keys.items()))
            if t >= limit:
                break
            del keys[k]
            self.expired += 1

    def has(self, group: int, h: object) -> bool:
        """Whether the store holds ``h`` in ``group`` (call :meth:`expire` first)."""
        return (group, h) in self.keys
