"""A running request as the simulated KV cache tracks it (vLLM's ``Request`` + per-group state).

Kept apart from the pool and the managers so that both can depend on it without depending on
each other: :mod:`gpu_emitter.block_pool` reads a request's hashes and extra keys when it
emits ``BlockStored``, :mod:`gpu_emitter.managers` reads its reachable boundaries when it
decides what to hash, and :mod:`gpu_emitter.hybrid_pool` owns the requests.
"""

from __future__ import annotations

from typing import Any

from events.hashing import RequestKeys
from events.retention import reachable_boundaries

__all__ = ["GroupState", "Request"]


class GroupState:
    """One request's view of one group: its block per position and caching progress."""

    __slots__ = ("allocated", "blocks", "last_state_idx", "num_cached")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        """Block id per block position (the null block where the group holds nothing)."""
        self.num_cached = 0
        """Positions already handed to caching (vLLM's ``num_cached_block``)."""
        self.last_state_idx: int | None = None
        """Mamba align: the state block of the previous step, freed one step later."""
        self.allocated = False
        """Mamba align: a block was allocated for this request in an earlier step."""


def _untag(extras: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """vLLM's ``to_event_extra_keys``: the untagged wire form of one block's extra keys."""
    if extras is None:
        return None
    out: list[Any] = []
    for entry in extras:
        tag = entry[0]
        if tag == "mm":
            out.append((entry[1], entry[2]))
        else:  # "lora" -> name (the path is dropped), "cache_salt", "prompt_embeds"
            out.append(entry[1])
    return tuple(out)


class Request:
    """A running request's state in the pool (read-only for callers)."""

    __slots__ = (
        "cum",
        "external",
        "groups",
        "hash_block_size",
        "hit",
        "keys",
        "last_digest",
        "num_computed",
        "num_prompt_tokens",
        "pending",
        "reachable",
        "req_id",
        "shared_prefix_boundary",
        "tokens",
        "wires",
    )

    def __init__(
        self,
        req_id: str,
        tokens: list[int],
        keys: RequestKeys | None,
        hit: int,
        shared_prefix_boundary: int | None,
        alignment: int,
        n_groups: int,
        hash_block_size: int,
    ) -> None:
        self.req_id = req_id
        self.hash_block_size = hash_block_size
        self.tokens = tokens
        self.keys = keys if keys is not None and not keys.empty else None
        self.hit = hit
        """Tokens the admission hit in the prefix cache."""
        self.external = 0
        """Tokens loaded from a shared store on top of ``hit`` (gpu_emitter.shared_store)."""
        self.num_prompt_tokens = len(tokens)
        self.shared_prefix_boundary = shared_prefix_boundary
        """vLLM's pinned junction (``hit + num_uncached``) or None (spec §4.1)."""
        self.reachable = reachable_boundaries(len(tokens), shared_prefix_boundary, alignment)
        """Where this request's SWA/Mamba checkpoints go (spec §4.7)."""
        self.num_computed = hit
        self.wires: list[Any] = []
        self.last_digest: bytes = b""
        self.groups = [GroupState() for _ in range(n_groups)]
        self.cum: list[int] = []
        """Running prefix sums behind the KV values' prefix signature."""
        self.pending: list[tuple[int, int, int, int]] = []
        """``(group, position, block id, epoch)`` allocated at admission, not yet written."""

    def event_extras(self, unit: int) -> tuple[Any, ...] | None:
        """The extra keys ``BlockStored`` carries for fine hash unit ``unit``."""
        if self.keys is None:
            return None
        return _untag(self.keys.unit_extras(unit, self.hash_block_size))
