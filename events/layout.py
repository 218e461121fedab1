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

    Groups whose specs are equal apart from ``eagle`` are looked up jointly (a hash hits only
    when every member holds it), as vLLM's ``verify_and_split_kv_cache_groups`` merges them.
    """

    kind: GroupKind
    block_size: int
    """Tokens per block as the events and vLLM's "kv cache group sizes" log line show it:
    times ``dcp_world_size`` when the group is DCP-sharded (``resolve_dcp_kv_block_size``)."""
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_mode: Literal["align", "all", "none"] = "align"
    eagle: bool = False
    """An EAGLE/MTP draft group whose hits drop one block (§4.6). A spec group is EAGLE when
    any member is (vLLM ORs ``is_eagle_group`` over merged groups)."""
    prefix_cacheable: bool = True
    """False for circular buffers and the like: they take no part."""
    spec_id: str | None = None
    """What tells apart groups of one kind and block size whose vLLM specs still differ (head
    size, dtype, KV heads): vLLM keeps those as separate spec groups, each probing its own
    entries. Groups with different ``spec_id`` are never merged; events cannot say this, so
    declare it (e.g. ``"head128"`` / ``"head64"``)."""
    dcp_sharded: bool | None = None
    """Whether decode context parallelism shards this group's tokens (vLLM's
    ``KVCacheSpec.dcp_sharded``). None: vLLM's default, True for attention kinds and False
    for Mamba. Set False for a replicated draft group."""
    bounded_replay: bool = False
    """DeepSeek-V4.1 bounded-replay sliding-window MLA (``SlidingWindowMLASpec.bounded_replay``):
    the group takes no part in lookups and the scheduler recomputes the last
    ``sliding_window`` tokens of every hit (``prefix_replay_tokens``)."""

    @property
    def is_fa_type(self) -> bool:
        return self.kind in FA_TYPE_KINDS

    @property
    def is_dcp_sharded(self) -> bool:
        """vLLM's ``dcp_sharded`` with its per-spec default filled in."""
        if self.dcp_sharded is not None:
            return self.dcp_sharded
        return self.kind != GroupKind.MAMBA

    @property
    def prefix_replay_tokens(self) -> int:
        """vLLM's ``KVCacheSpec.prefix_replay_tokens``: the window for bounded replay, else 0."""
        return (self.sliding_window or 0) if self.bounded_replay else 0


class ModelLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything about one served model that the hit depends on and the events do not say."""

    groups: tuple[GroupSpec, ...]
    """Indexed by ``group_idx``."""
    hash: HashSettings = HashSettings()
    prefix_match_unit: int | None = None
    """``--prefix-match-unit``; None lets vLLM derive ``hash_block_size``."""
    dcp_world_size: int = 1
    """``--decode-context-parallel-size`` of the replicas (vLLM's DCP world size). Block sizes
    in ``groups`` already include it; it decides the partial-hit rule and what vLLM refuses."""
    retention_interval: int | Literal["none"] | None = 0
    """``--prefix-cache-retention-interval``: 0 (vLLM's default) caches SWA/Mamba checkpoints
    only, ``None`` densely, ``R > 0`` every R tokens plus checkpoints (§4.7). TOML has no null,
    so files write ``"none"`` for None; it reads back as None."""

    def __post_init__(self) -> None:
        if self.retention_interval == "none":
            msgspec.structs.force_setattr(self, "retention_interval", None)


@dataclass(frozen=True, slots=True)
class SpecGroup:
    """Groups with one spec, looked up jointly (``verify_and_split_kv_cache_groups``).

    ``spec`` is the first member's spec with ``eagle`` ORed over every member."""

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
    prefix_replay_tokens: int = 0
    """The scheduler's bounded-replay window (DeepSeek-V4.1): a hit of at most this many
    tokens is dropped, a longer one has its last this-many tokens recomputed."""
    partial_hits_disabled: str | None = None
    """Why vLLM turned fine-grained hits off although a Mamba block exceeds H (vLLM logs
    "Disabling fine-grained prefix-cache hits ..." and runs with A = S); None otherwise."""

    @property
    def unitary(self) -> bool:
        """One KV-cache group: vLLM uses the unitary coordinator (§4.2)."""
        return len(self.layout.groups) == 1


def _is_cacheable(g: GroupSpec) -> bool:
    return g.prefix_cacheable and not g.bounded_replay and g.kind not in NOT_CACHEABLE_KINDS


#: vLLM's single-type manager class per kind, for the spec-group merge key and messages.
_MANAGER = {
    GroupKind.FULL_ATTENTION: "FullAttentionManager",
    GroupKind.MLA_ATTENTION: "FullAttentionManager",
    GroupKind.SINK_FULL_ATTENTION: "SinkFullAttentionManager",
    GroupKind.SLIDING_WINDOW: "SlidingWindowManager",
    GroupKind.SLIDING_WINDOW_MLA: "SlidingWindowManager",
    GroupKind.CHUNKED_LOCAL_ATTENTION: "ChunkedLocalAttentionManager",
    GroupKind.MAMBA: "MambaManager",
}
#: Managers with ``supports_fine_grained_hash_lookup`` (vLLM 0.32).
_FINE_GRAINED_MANAGERS = frozenset(
    {"FullAttentionManager", "SinkFullAttentionManager", "MambaManager"}
)


def _check_groups(layout: ModelLayout) -> None:
    """Per-group checks, each naming the vLLM rule it mirrors."""
    dcp = layout.dcp_world_size
    if dcp < 1:
        raise LayoutError(
            f"dcp_world_size must be >= 1 (vLLM --decode-context-parallel-size), got {dcp}"
        )
    hybrid = len(layout.groups) > 1
    for i, g in enumerate(layout.groups):
        if g.block_size <= 0:
            raise LayoutError(
                f"groups[{i}].block_size must be positive (vLLM KVCacheSpec.block_size), got "
                f"{g.block_size}"
            )
        if g.kind in SLIDING_KINDS and not g.sliding_window:
            raise LayoutError(
                f"groups[{i}] is {g.kind} but has no sliding_window (vLLM SlidingWindowSpec "
                f"requires it): set it"
            )
        if g.kind == GroupKind.CHUNKED_LOCAL_ATTENTION and not g.attention_chunk_size:
            raise LayoutError(
                f"groups[{i}] is chunked_local_attention but has no attention_chunk_size (vLLM "
                f"ChunkedLocalAttentionSpec requires it): set it"
            )
        if g.bounded_replay and g.kind != GroupKind.SLIDING_WINDOW_MLA:
            raise LayoutError(
                f"groups[{i}] sets bounded_replay but is {g.kind}: vLLM only has it on "
                f"SlidingWindowMLASpec (DeepSeek-V4.1); use kind sliding_window_mla"
            )
        if dcp == 1 or not g.is_dcp_sharded:
            continue
        if g.block_size % dcp:
            raise LayoutError(
                f"groups[{i}].block_size {g.block_size} is not a multiple of dcp_world_size "
                f"{dcp}: a DCP-sharded group's block is its per-rank block times the DCP size "
                f"(vLLM resolve_dcp_kv_block_size); write the size the events show"
            )
        if hybrid and not g.is_fa_type:
            raise LayoutError(
                f"groups[{i}] ({g.kind}) is DCP-sharded with dcp_world_size {dcp}: vLLM's "
                f"HybridKVCacheCoordinator only supports full-attention, Mamba and replicated "
                f"draft groups under DCP; set dcp_sharded: false if the group is replicated"
            )
        if not g.is_fa_type and _is_cacheable(g):
            raise LayoutError(
                f"groups[{i}] ({g.kind}) is DCP-sharded with dcp_world_size {dcp}: vLLM's "
                f"{_MANAGER.get(g.kind, g.kind)}.find_longest_cache_hit asserts "
                f'dcp_world_size == 1 ("DCP not support ...")'
            )


def _check_retention(layout: ModelLayout, scheduler: int) -> None:
    """vLLM's ``_validate_prefix_cache_retention_interval``."""
    r = layout.retention_interval
    if not isinstance(r, int):  # None (dense); "none" became None in __post_init__
        return
    sparse = any(g.kind in SLIDING_KINDS or g.kind == GroupKind.MAMBA for g in layout.groups)
    if not sparse:
        if r == 0:
            return
        raise LayoutError(
            f"retention_interval {r} but no sliding-window or Mamba group: vLLM's "
            f"_validate_prefix_cache_retention_interval rejects it; set it to 0"
        )
    if r < 0 or r % scheduler:
        raise LayoutError(
            f"retention_interval {r} must be non-negative and a multiple of "
            f"scheduler_block_size {scheduler} (vLLM _validate_prefix_cache_retention_interval)"
        )


def _hash_block_size(layout: ModelLayout, cacheable: list[int], scheduler: int) -> int:
    """H as vLLM's ``resolve_kv_cache_block_sizes`` derives it (prefix caching on)."""
    groups = layout.groups
    sizes = [g.block_size for g in groups]
    pmu = layout.prefix_match_unit
    if len(groups) == 1:
        if pmu not in (None, sizes[0]):
            raise LayoutError(
                f"prefix_match_unit {pmu} differs from the only group's block_size {sizes[0]}; "
                f"vLLM resolve_kv_cache_block_sizes rejects this (single-group hits land on "
                f"the block size): drop prefix_match_unit"
            )
        return sizes[0]
    mamba_not_aligned = any(g.kind == GroupKind.MAMBA and g.mamba_mode != "align" for g in groups)
    if mamba_not_aligned:
        h = scheduler  # vLLM backs off to S; its coordinator still asserts divisibility
    else:
        hashing = [sizes[i] for i in cacheable] or sizes
        h = pmu if pmu is not None else reduce(math.gcd, hashing)
        if h <= 0:
            raise LayoutError(
                f"prefix_match_unit must be positive (vLLM --prefix-match-unit), got {h}"
            )
    for i, g in enumerate(groups):
        if (i in cacheable or not cacheable) and g.block_size % h:
            rule = (
                "HybridKVCacheCoordinator asserts every prefix-cacheable block size is a "
                "multiple of hash_block_size (a Mamba group outside align mode sets it to "
                "scheduler_block_size)"
                if mamba_not_aligned
                else "resolve_kv_cache_block_sizes rejects this prefix_match_unit"
            )
            raise LayoutError(
                f"groups[{i}].block_size {g.block_size} is not a multiple of hash_block_size "
                f"{h}: vLLM {rule}; fix prefix_match_unit, the block sizes or mamba_mode"
            )
    return h


def _partial_hits(layout: ModelLayout, cacheable: list[int], h: int) -> tuple[bool, str | None]:
    """vLLM's ``partial_hash_hits_enabled`` with the hybrid coordinator's manager classes:
    (on, why it was switched off although a Mamba block asked for it)."""
    dcp = layout.dcp_world_size
    groups = layout.groups
    wanted = any(
        g.kind == GroupKind.MAMBA
        and g.mamba_mode == "align"
        and (g.block_size > h if dcp == 1 else g.block_size >= h)
        for g in groups
    )
    if not wanted:
        return False, None
    blocking = sorted(
        {
            _MANAGER[groups[i].kind]
            for i in cacheable
            if _MANAGER.get(groups[i].kind) not in _FINE_GRAINED_MANAGERS
            and groups[i].block_size != h
        }
    )
    if blocking:
        return False, (
            f"vLLM partial_hash_hits_enabled: disabling fine-grained prefix-cache hits because "
            f"these KV cache managers require block-aligned lookups: {', '.join(blocking)} "
            f"(hits align to scheduler_block_size)"
        )
    return True, None


def _merge_spec_groups(
    groups: tuple[GroupSpec, ...], cacheable: list[int]
) -> tuple[SpecGroup, ...]:
    """``verify_and_split_kv_cache_groups``: equal specs (the EAGLE flag aside) form one joint
    spec group whose EAGLE flag is the OR of its members'; FA-type first, stable."""
    merged: dict[GroupSpec, tuple[list[int], bool]] = {}
    for i in cacheable:
        g = groups[i]
        key = msgspec.structs.replace(g, eagle=False)
        ids, eagle = merged.setdefault(key, ([], False))
        ids.append(i)
        merged[key] = (ids, eagle or g.eagle)
    out = [
        SpecGroup(tuple(ids), msgspec.structs.replace(groups[ids[0]], eagle=eagle))
        for ids, eagle in merged.values()
    ]
    out.sort(key=lambda sg: (not sg.spec.is_fa_type, sg.group_ids[0]))
    return tuple(out)


def resolve(layout: ModelLayout) -> ResolvedLayout:
    """Validate ``layout`` and derive H, S, A and the spec groups as vLLM 0.32 does.

    Refuses (``LayoutError``, naming the vLLM rule) exactly what vLLM's
    ``resolve_kv_cache_block_sizes``, coordinators and managers refuse for the declared
    fields; where vLLM only switches fine-grained hits off it does the same
    (``partial_hits_disabled`` says why)."""
    groups = layout.groups
    if not groups:
        raise LayoutError(
            "layout has no KV-cache groups (a vLLM KVCacheConfig with prefix caching has at "
            "least one): declare them under `groups`"
        )
    _check_groups(layout)
    cacheable = [i for i, g in enumerate(groups) if _is_cacheable(g)]
    if len(groups) > 1 and not cacheable:
        raise LayoutError(
            "no prefix-cacheable group: vLLM's HybridKVCacheCoordinator requires at least one "
            "cacheable group"
        )
    scheduler = reduce(math.lcm, [g.block_size for g in groups])
    hash_bs = _hash_block_size(layout, cacheable, scheduler)
    _check_retention(layout, scheduler)
    if len(groups) == 1:
        partial, disabled = False, None
        alignment = groups[0].block_size
    else:
        partial, disabled = _partial_hits(layout, cacheable, hash_bs)
        alignment = hash_bs if partial else scheduler
    spec_groups = _merge_spec_groups(groups, cacheable)
    for sg in spec_groups:
        g = sg.spec
        if g.kind == GroupKind.CHUNKED_LOCAL_ATTENTION and (g.block_size != alignment or g.eagle):
            raise LayoutError(
                f"groups{list(sg.group_ids)} chunked_local_attention needs block_size == "
                f"alignment ({alignment}) and no EAGLE: vLLM's ChunkedLocalAttentionManager"
                f".find_longest_cache_hit asserts both"
            )
    windows = {g.prefix_replay_tokens for g in groups if g.prefix_replay_tokens > 0}
    if len(windows) > 1:
        raise LayoutError(
            f"bounded-replay groups declare different windows {sorted(windows)}: vLLM's "
            f'Scheduler asserts "Prefix replay windows should agree"'
        )
    return ResolvedLayout(
        layout=layout,
        hash_block_size=hash_bs,
        scheduler_block_size=scheduler,
        alignment=alignment,
        partial_hits=partial,
        spec_groups=spec_groups,
        prefix_replay_tokens=windows.pop() if windows else 0,
        partial_hits_disabled=disabled,
    )
