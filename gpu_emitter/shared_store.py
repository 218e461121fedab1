"""A KV store shared by simulated replicas, and each replica's connector to it (vLLM 0.32's
``MooncakeStoreConnector``, store side of ``distributed/kv_transfer/kv_connector/v1/mooncake``).

:class:`SharedStore` plays the Mooncake master and its memory: a set of ``(group, block
hash)`` keys that several replicas read and write. It evicts nothing by itself and publishes
nothing (neither does Mooncake: its evictions are silent); :meth:`SharedStore.evict` drops keys
as the master's own eviction would, for tests of what a consumer of the events cannot know.

:class:`StoreConnector` is one replica's connector, written after vLLM's code, not after the
router's (this package never imports the router):

* **save** (``KVCacheStoreSendingThread._handle_request``): after a prefill, the prompt's blocks
  up to the prompt length floored to the scheduler block S, filtered per group as
  ``MooncakeStoreCoordinator.store_mask`` does (full attention and chunked local: every block;
  sliding window: the tails ``SlidingWindowManager.reachable_block_mask`` keeps for the
  retention interval and the prompt's replay boundary); keys the store already holds are
  skipped (``batch_is_exist``) and each newly put block is published as
  ``BlockStored(medium="cpu", group_idx=g, block_size=B)`` with one hash and its parent;
* **lookup** (``MooncakeStoreWorker.lookup``): the request length floored to S, the keys of
  each group's blocks below it that ``lookup_mask`` keeps, asked of the store at once, then the
  replica's own coordinator (:mod:`gpu_emitter.coordinator`) run over that presence from token
  0 with the lookup length as its bound; a hit covering the whole request is redone below
  ``num_tokens - 1``;
* **matched tokens** (``MooncakeStoreScheduler.get_num_new_matched_tokens``): the store hit
  minus the local hit when positive. The replica then reports ``cached_tokens = local +
  loaded`` (``PrefillStats.set``).

Mamba groups are refused: vLLM's store keeps Mamba state only through boundary-state hand-offs,
which this simulation does not model. Partial hits and EAGLE are refused by the pool already.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from events.layout import SLIDING_KINDS, GroupKind, GroupSpec
from events.schema import BlockStored
from gpu_emitter.coordinator import make_coordinator

__all__ = ["SharedStore", "StoreConnector", "UnsupportedStoreLayout"]


class UnsupportedStoreLayout(ValueError):
    """A layout whose store behaviour this simulation does not model."""


class SharedStore:
    """The store several replicas share: ``(group, wire hash)`` keys, thread-safe."""

    def __init__(self) -> None:
        self._keys: set[tuple[int, Any]] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def exists(self, keys: Sequence[tuple[int, Any]]) -> list[bool]:
        """``batch_is_exist``: which keys the store holds."""
        with self._lock:
            return [k in self._keys for k in keys]

    def put(self, keys: Sequence[tuple[int, Any]]) -> list[bool]:
        """Store ``keys``; True where a key was new (the writer publishes only those)."""
        with self._lock:
            out = []
            for k in keys:
                new = k not in self._keys
                if new:
                    self._keys.add(k)
                out.append(new)
            return out

    def evict(self, keys: Sequence[tuple[int, Any]]) -> None:
        """Drop keys silently, as the master's eviction does (no event anywhere)."""
        with self._lock:
            self._keys.difference_update(keys)


class _Presence:
    """A duck-typed block pool over the keys one lookup found (``ExternalCachedBlockPool``)."""

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.found: set[tuple[int, Any]] = set()

    def get_cached_block(self, wire: Any, group_ids: Sequence[int]) -> list[int] | None:
        if all((g, wire) in self.found for g in group_ids):
            return [1] * len(group_ids)
        return None


def _sliding_need(spec: GroupSpec) -> int:
    """``SlidingWindowManager._contiguous_blocks_for_hit`` without EAGLE."""
    return -(-((spec.sliding_window or 1) - 1) // spec.block_size)


def _sliding_mask(
    spec: GroupSpec, end_block: int, s: int, retention: int | None, replay: Sequence[int]
) -> list[bool] | None:
    """``SlidingWindowManager.reachable_block_mask`` from block 0 (None: every block)."""
    b = spec.block_size
    need = _sliding_need(spec)
    mask = [False] * end_block
    segment = s if retention is None else (retention or None)
    if segment is not None:
        per = segment // b
        if need >= per:
            return None
        for i in range(end_block):
            if i % per >= per - need:
                mask[i] = True
    if retention is not None:
        for boundary in replay:
            end = boundary // s * s // b
            for j in range(max(0, end - need), min(end_block, end)):
                mask[j] = True
    return mask


class StoreConnector:
    """One replica's side of the shared store (module docstring)."""

    def __init__(
        self,
        store: SharedStore,
        groups: Sequence[GroupSpec],
        hash_block_size: int,
        scheduler_block_size: int,
        retention: int | None,
        emit: Callable[[BlockStored], None],
    ) -> None:
        for i, g in enumerate(groups):
            if g.kind == GroupKind.MAMBA:
                raise UnsupportedStoreLayout(
                    f"groups[{i}] is mamba: the shared store keeps Mamba state only through "
                    "boundary-state hand-offs, which the simulated replica does not model"
                )
        self.store = store
        self.groups = tuple(groups)
        self.h = hash_block_size
        self.s = scheduler_block_size
        self.retention = retention
        self.emit = emit
        self._presence = _Presence(hash_block_size)
        self._coordinator = make_coordinator(self._presence, self.groups, retention)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ lookup

    def _lookup_mask(self, g: int, token_len: int) -> list[bool] | None:
        spec = self.groups[g]
        if spec.kind not in SLIDING_KINDS:
            return None
        return _sliding_mask(spec, token_len // spec.block_size, self.s, None, ())

    def lookup(self, wires: Sequence[Any], num_tokens: int) -> int:
        """The store's hit for a request whose fine hashes are ``wires``."""
        s, h = self.s, self.h
        token_len = num_tokens // s * s
        if num_tokens < s or not wires or token_len <= 0:
            return 0
        asked: list[tuple[int, Any]] = []
        for g, spec in enumerate(self.groups):
            k = spec.block_size // h
            mask = self._lookup_mask(g, token_len)
            for j in range(min(len(wires) // k, token_len // spec.block_size)):
                if mask is None or mask[j]:
                    asked.append((g, wires[(j + 1) * k - 1]))
        if not asked:
            return 0
        have = self.store.exists(asked)
        self._presence.found = {key for key, ok in zip(asked, have, strict=True) if ok}
        chain = _Wires(wires)
        hit = self._coordinator.find_longest_cache_hit(chain, token_len).hit_tokens
        if hit >= num_tokens:
            usable = (num_tokens - 1) // s * s
            if usable <= 0:
                return 0
            hit = self._coordinator.find_longest_cache_hit(chain, usable).hit_tokens
        return hit

    def matched_tokens(self, wires: Sequence[Any], num_tokens: int, local_hit: int) -> int:
        """Tokens the replica loads from the store on top of ``local_hit``."""
        found = self.lookup(wires, num_tokens)
        aligned = local_hit - local_hit % self.s
        return found - aligned if found > aligned else 0

    # ------------------------------------------------------------------ save

    def save(self, tokens: Sequence[int], wires: Sequence[Any], num_prompt_tokens: int) -> int:
        """Put the prompt's blocks the store lacks; publish each new one. Returns how many."""
        s, h = self.s, self.h
        token_len = num_prompt_tokens // s * s
        replay = (num_prompt_tokens - 1,)
        todo: list[tuple[int, int, Any]] = []
        for g, spec in enumerate(self.groups):
            b = spec.block_size
            k = b // h
            end = min(token_len // b, len(wires) // k)
            mask = None
            if spec.kind in SLIDING_KINDS:
                mask = _sliding_mask(spec, end, s, self.retention, replay)
            todo.extend(
                (g, j, wires[(j + 1) * k - 1]) for j in range(end) if mask is None or mask[j]
            )
        if not todo:
            return 0
        new = self.store.put([(g, w) for g, _, w in todo])
        count = 0
        for (g, j, w), fresh in zip(todo, new, strict=True):
            if not fresh:
                continue
            b = self.groups[g].block_size
            k = b // h
            self.emit(
                BlockStored(
                    block_hashes=[w],
                    parent_block_hash=wires[j * k - 1] if j > 0 else None,
                    token_ids=list(tokens[j * b : (j + 1) * b]),
                    block_size=b,
                    lora_id=None,
                    medium="cpu",
                    lora_name=None,
                    group_idx=g,
                )
            )
            count += 1
        return count


class _Wires:
    """A request's fine hashes as the managers read them (``len`` and ``wire``)."""

    __slots__ = ("wires",)

    def __init__(self, wires: Sequence[Any]) -> None:
        self.wires = wires

    def __len__(self) -> int:
        return len(self.wires)

    def wire(self, i: int) -> Any:
        return self.wires[i]
