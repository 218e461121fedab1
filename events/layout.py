"""The static model layout a pool of replicas shares: KV-cache groups, sizes and hash settings.

None of this is in the events except each group's kind, window and full-block size (spec §2.3,
§5.1), so it is declared in config or learned from the first events and then checked. The
derived sizes follow vLLM 0.32 exactly: ``hash_block_size`` H and ``scheduler_block_size`` S
(§1.4), the hit alignment A and partial-hit switch (§4.3), and the joint-lookup spec groups
ordered full-attention first (§4.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import reduce
from typing import Literal

import msgspec

__all__ = [
    "FA_TYPE_KINDS",
    "GroupKind",
    "GroupSpec",
    "HashSettings",
    "LayoutError",
    "ModelLayout",
    "ResolvedLayout",
    "SpecGroup",
    "resolve",
]


class GroupKind(StrEnum):
    """vLLM's ``KVCacheSpecKind`` (spec §2.3)."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


#: Kinds whose manager is a ``FullAttentionManager`` subclass: dense caching, contiguous hit
#: from block 0, looked up first in the hybrid loop (§4.2, §4.4). RSWA reports full_attention.
FA_TYPE_KINDS = frozenset(
    {GroupKind.FULL_ATTENTION, GroupKind.MLA_ATTENTION, GroupKind.SINK_FULL_ATTENTION}
)
SLIDING_KINDS = frozenset({GroupKind.SLIDING_WINDOW, GroupKind.SLIDING_WINDOW_MLA})
#: Kinds that never take part in prefix caching (§4.2, §4.4).
NOT_CACHEABLE_KINDS = frozenset({GroupKind.CROSS_ATTENTION, GroupKind.ENCODER_ONLY_ATTENTION})

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


class LayoutError(ValueError):
    """A layout that vLLM itself would reject or that events contradict."""


class HashSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the replicas hash blocks (§1.1, §1.2, §1.5)."""

    algo: HashAlgo = "sha256"
    """``--prefix-caching-hash-algo`` of the replicas."""
    pythonhashseed: str | None = None
    """``PYTHONHASHSEED`` of the replicas' engine-core processes, if set."""
    int_block_hashes: bool = True
    """``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default 1: uint64 wire hashes)."""


class GroupSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV-cache group as the replica's startup log describes it.

    Two groups with equal specs are looked up jointly (a hash hits only when both hold it).
    """

    kind: GroupKind
    block_size: int
    """Tokens per block (times the DCP factor if the group is DCP-sharded)."""
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_mode: Literal["align", "all", "none"] = "align"
    eagle: bool = False
    """An EAGLE/MTP draft group whose hits drop one block (§4.6)."""
    prefix_cacheable: bool = True
    """False for circular buffers, bounded-replay SWA-MLA and the like: they take no part."""

    @property
    def is_fa_type(self) -> bool:
        return self.kind in FA_TYPE_KINDS


class ModelLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything about one served model that the hit depends on and the events do not say."""

    groups: tuple[GroupSpec, ...]
    """Indexed by ``group_idx``."""
    hash: HashSettings = HashSettings()
    prefix_match_unit: int | None = None
    """``--prefix-match-unit``; None lets vLLM derive ``hash_block_size``."""
    retention_interval: int | Literal["none"] | None = 0
    """``--prefix-cache-retention-interval``: 0 (vLLM's default) caches SWA/Mamba checkpoints
    only, ``None`` densely, ``R > 0`` every R tokens plus checkpoints (§4.7). TOML has no null,
    so files write ``"none"`` for None; it reads back as None."""

    def __post_init__(self) -> None:
        if self.retention_interval == "none":
            msgspec.structs.force_setattr(self, "retention_interval", None)


@dataclass(frozen=True, slots=True)
class SpecGroup:
    """Groups with one identical spec, looked up jointly (``verify_and_split_kv_cache_groups``)."""

    group_ids: tuple[int, ...]
    spec: GroupSpec


@dataclass(frozen=True, slots=True)
class ResolvedLayout:
    """A validated layout with vLLM's derived sizes."""

    layout: ModelLayout
    hash_block_size: int
    """H: the granularity of the request's fine hash chain."""
    scheduler_block_size: int
    """S = lcm of the group block sizes."""
    alignment: int
    """A: every hit is a multiple of it."""
    partial_hits: bool
    """Fine-grained (partial-entry) lookups are on (§4.3)."""
    spec_groups: tuple[SpecGroup, ...]
    """Prefix-cacheable spec groups, FA-type first (stable), as the hybrid loop visits them."""

    @property
    def unitary(self) -> bool:
        """One KV-cache group: vLLM uses the unitary coordinator (§4.2)."""
        return len(self.layout.groups) == 1


def _is_cacheable(g: GroupSpec) -> bool:
    return g.prefix_cacheable and g.kind not in NOT_CACHEABLE_KINDS


def resolve(layout: ModelLayout) -> ResolvedLayout:
    """Validate ``layout`` and derive H, S, A and the spec groups as vLLM 0.32 does."""
    groups = layout.groups
    if not groups:
        raise LayoutError("layout has no KV-cache groups: declare at least one under `groups`")
    for i, g in enumerate(groups):
        if g.block_size <= 0:
            raise LayoutError(f"groups[{i}].block_size must be positive, got {g.block_size}")
        if g.kind in SLIDING_KINDS and not g.sliding_window:
            raise LayoutError(f"groups[{i}] is {g.kind} but has no sliding_window: set it")
        if g.kind == GroupKind.CHUNKED_LOCAL_ATTENTION and not g.attention_chunk_size:
            raise LayoutError(
                f"groups[{i}] is chunked_local_attention but has no attention_chunk_size: set it"
            )
    cacheable = [i for i, g in enumerate(groups) if _is_cacheable(g)]
    sizes = [g.block_size for g in groups]
    scheduler = reduce(math.lcm, sizes)

    if len(groups) == 1:
        hash_bs = sizes[0]
        if layout.prefix_match_unit not in (None, hash_bs):
            raise LayoutError(
                f"prefix_match_unit {layout.prefix_match_unit} differs from the only group's "
                f"block_size {hash_bs}; vLLM rejects this: drop prefix_match_unit"
            )
    elif any(g.kind == GroupKind.MAMBA and g.mamba_mode != "align" for g in groups):
        hash_bs = scheduler
    elif layout.prefix_match_unit is not None:
        hash_bs = layout.prefix_match_unit
    else:
        hash_bs = reduce(math.gcd, [sizes[i] for i in cacheable] or sizes)
    for i in cacheable:
        if sizes[i] % hash_bs:
            raise LayoutError(
                f"groups[{i}].block_size {sizes[i]} is not a multiple of hash_block_size "
                f"{hash_bs}: fix prefix_match_unit or the block sizes"
            )

    partial = any(
        groups[i].kind == GroupKind.MAMBA and groups[i].mamba_mode == "align" and sizes[i] > hash_bs
        for i in cacheable
    )
    if partial:
        for i in cacheable:
            g = groups[i]
            fine_ok = g.is_fa_type or g.kind == GroupKind.MAMBA
            if not fine_ok and sizes[i] != hash_bs:
                raise LayoutError(
                    f"partial hash hits are on (a Mamba group's block exceeds hash_block_size "
                    f"{hash_bs}) but groups[{i}] ({g.kind}, block {sizes[i]}) cannot look up "
                    f"fine-grained: vLLM rejects this layout"
                )
    if len(groups) == 1:
        alignment = sizes[0]
    else:
        alignment = hash_bs if partial else scheduler
    for i in cacheable:
        g = groups[i]
        if g.kind == GroupKind.CHUNKED_LOCAL_ATTENTION and (g.block_size != alignment or g.eagle):
            raise LayoutError(
                f"groups[{i}] chunked_local_attention needs block_size == alignment "
                f"({alignment}) and no EAGLE"
            )

    spec_groups: dict[GroupSpec, list[int]] = {}
    for i in cacheable:
        spec_groups.setdefault(groups[i], []).append(i)
    ordered = sorted(
        (SpecGroup(tuple(ids), spec) for spec, ids in spec_groups.items()),
        key=lambda sg: (not sg.spec.is_fa_type, sg.group_ids[0]),
    )
    return ResolvedLayout(
        layout=layout,
        hash_block_size=hash_bs,
        scheduler_block_size=scheduler,
        alignment=alignment,
        partial_hits=partial,
        spec_groups=tuple(ordered),
    )
