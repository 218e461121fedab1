"""A request's hit on every replica: hash its chain, look it up once, apply vLLM's rule.

This composes the three parts in the one direction data flows (spec §5.3):
:mod:`events.hashing` turns token ids into the request's fine chain of wire hashes (lazily, so
a prompt that misses everywhere costs one memo step of hashing), :mod:`router.core.index` answers
each ``(group, hash)`` lookup with a bitmask of replicas, and :mod:`router.core.hybrid` runs vLLM's
``find_longest_cache_hit`` per replica over those masks.

No lookup is repeated across replicas. The contiguous full-attention run, the part of the
rule that touches every block, is computed for all replicas in one walk over the chain
(a bitmask of replicas still matching, narrowed block by block); the per-replica hybrid loop
then only probes the few sliding-window / Mamba blocks it needs, from a shared mask cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from events.hashing import BlockHasher, LazyChain, RequestKeys
from events.layout import SLIDING_KINDS, ResolvedLayout
from router.core.external import (
    ExternalHit,
    connector_load,
    store_group_ids,
    store_hit,
    store_spec_group_hits,
)
from router.core.hybrid import (
    HitResult,
    blocks_behind_hit,
    find_longest_cache_hit,
    group_blind_hit,
    window_blocks,
)
from router.core.index import KVIndex, ReplicaKey, iter_bits, leading_walk

__all__ = ["Prediction", "Predictor", "ReplicaHit", "Shortlist", "body_request_keys"]


@dataclass(frozen=True, slots=True)
class ReplicaHit:
    """One replica's predicted local hit, with what explains it."""

    replica: ReplicaKey
    hit_tokens: int
    """What vLLM will report as ``cached_tokens`` (0 when the state is untrusted)."""
    trusted: bool
    untrusted_reason: str | None
    result: HitResult | None
    """The hybrid computation on the GPU tier (None when untrusted or no layout yet)."""
    blind_hit_tokens: int | None = None
    """What a group-blind router would predict from the same state (when asked for)."""
    tier_hits: dict[str, int] = field(default_factory=dict)
    """Hybrid hits computed on the lower tiers (CPU, STORAGE) alone, where events exist."""
    partial_reason: str | None = None
    """Set when the replica is partial: ``hit_tokens`` is then a lower bound."""
    external: dict[str, ExternalHit] = field(default_factory=dict)
    """Per shared tier (a store the pool shares, router.core.external): what this replica
    keeps locally and loads from it. With a load, ``hit_tokens`` is local + loaded."""
    load_cost_tokens: float = 0.0
    """The loaded tokens weighted by their tier's ``load_cost`` (for the policy)."""

    @property
    def trust(self) -> str:
        if not self.trusted:
            return "untrusted"
        return "partial" if self.partial_reason is not None else "exact"


@dataclass(frozen=True, slots=True)
class Shortlist:
    """:meth:`Predictor.shortlist`'s answer: the replicas that can have a hit, predicted."""

    prediction: Prediction
    """Over the holders of the first full-attention block only."""
    held: dict[ReplicaKey, ReplicaHit]
    zero: HitResult
    """Every other replica's hybrid result (no hit, nothing probed past the first block)."""
    lower: tuple[str, ...]
    """The lower tiers in use (a trusted replica's ``tier_hits`` names each, at 0)."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """Hits of one request on every replica of a pool."""

    num_tokens: int
    hashed: int
    """Fine hashes computed for the request (lazy: fewer than the chain when it misses)."""
    layout: ResolvedLayout | None
    replicas: tuple[ReplicaHit, ...]
    store_group_hits: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per shared tier, each spec group's hit on the store alone (explain only)."""

    def hit(self, replica: ReplicaKey) -> ReplicaHit:
        for r in self.replicas:
            if r.replica == replica:
                return r
        raise KeyError(replica)

    def as_dict(self) -> dict:
        """A JSON-ready explanation: per replica the hit, each spec group's standalone hit
        and the group that limited it (what ``POST /admin/route/explain`` returns)."""
        spec_groups = self.layout.spec_groups if self.layout is not None else ()
        names = [f"{sg.spec.kind}{list(sg.group_ids)}" for sg in spec_groups]
        out = []
        for r in self.replicas:
            res = r.result
            row: dict = {
                "replica": r.replica[0],
                "dp_rank": r.replica[1],
                "hit_tokens": r.hit_tokens,
                "trusted": r.trusted,
                "trust": r.trust,
                "untrusted_reason": r.untrusted_reason,
                "partial_reason": r.partial_reason,
                "group_blind_hit_tokens": r.blind_hit_tokens,
                "tier_hits": r.tier_hits,
            }
            if r.external:
                row["external"] = {
                    t: {
                        "local_tokens": e.local_tokens,
                        "loaded_tokens": e.external_tokens,
                        "store_hit_tokens": e.store_hit_tokens,
                        "store_spec_group_hits": dict(
                            zip(names, self.store_group_hits.get(t, ()), strict=False)
                        ),
                    }
                    for t, e in r.external.items()
                }
            if res is not None:
                row["spec_group_hits"] = dict(zip(names, res.spec_group_hits, strict=False))
                row["limiting_group"] = (
                    None if res.limiting_group is None else names[res.limiting_group]
                )
                row["num_uncached_common_prefix"] = res.num_uncached
            out.append(row)
        return {"num_tokens": self.num_tokens, "hashed_blocks": self.hashed, "replicas": out}


class _Masks:
    """Replica bitmasks of one tier at the request's fine indices, each fetched once."""

    __slots__ = ("all_bits", "cache", "chain", "native", "runs", "tables")

    def __init__(
        self,
        index: KVIndex,
        tier: str,
        n_groups: int,
        chain: LazyChain,
        all_bits: int,
        *,
        native: bool = True,
    ):
        self.chain = chain
        self.all_bits = all_bits
        self.tables = [index.table(tier, g) for g in range(n_groups)]
        self.cache: list[dict[int, int]] = [{} for _ in range(n_groups)]
        self.runs: dict[object, tuple[dict[int, int], int]] = {}
        #: :meth:`leading_runs` walks in C (router.core._keytable, where it is in use), else
        #: in Python (the reference).
        self.native = native and leading_walk is not None

    def mask(self, g: int, i: int) -> int:
        cache = self.cache[g]
        m = cache.get(i)
        if m is None:
            m = cache[i] = self.tables[g].get(self.chain.wire(i), 0)
        return m

    def leading_runs(self, group_ids: tuple[int, ...] | None, k: int) -> tuple[dict[int, int], int]:
        """For every replica bit, how many leading stride-``k`` blocks are cached in all of
        ``group_ids`` (or in any group when None). Returns ``(run by bit, walked)``: bits
        absent from the dict matched all ``walked`` blocks."""
        key = (group_ids, k)
        got = self.runs.get(key)
        if got is None:
            walk = self.walk_native if self.native else self.walk_python
            got = self.runs[key] = walk(group_ids, k)
        return got

    def walk_python(self, group_ids: tuple[int, ...] | None, k: int) -> tuple[dict[int, int], int]:
        """:meth:`leading_runs` computed in Python: the reference for :meth:`walk_native`."""
        alive = self.all_bits
        stopped: dict[int, int] = {}
        j = 0
        if alive:
            tables = [self.tables[g] for g in (group_ids or range(len(self.tables)))]
            single = tables[0] if len(tables) == 1 else None
            for h in self.chain.iter_block_wires(k):
                if single is not None:
                    m = single.get(h, 0)
                elif group_ids is None:
                    m = 0
                    for t in tables:
                        m |= t.get(h, 0)
                else:
                    m = alive
                    for t in tables:
                        m &= t.get(h, 0)
                dropped = alive & ~m
                if dropped:
                    alive &= m
                    while dropped:
                        low = dropped & -dropped
                        stopped[low] = j
                        dropped ^= low
                    if not alive:
                        break
                j += 1
        return stopped, j

    def walk_native(self, group_ids: tuple[int, ...] | None, k: int) -> tuple[dict[int, int], int]:
        """:meth:`leading_runs` computed by ``router.core._keytable.leading_walk``, a run of
        hashed blocks per call (:meth:`events.hashing.LazyChain.wire_runs`), so the chain is
        hashed exactly as far as :meth:`walk_python` hashes it."""
        walk = leading_walk
        if walk is None:  # not built or switched off (``native`` is then False)
            return self.walk_python(group_ids, k)
        alive = self.all_bits
        stopped: dict[int, int] = {}
        j = 0
        if alive:
            tables = tuple(self.tables[g] for g in (group_ids or range(len(self.tables))))
            any_group = group_ids is None
            for wires, i in self.chain.wire_runs(k):
                alive, j = walk(wires, i, k, tables, any_group, alive, stopped, j)
                if not alive:
                    break
        return stopped, j


class _Presence:
    """One replica's view of :class:`_Masks`, with the hybrid module's fast path."""

    __slots__ = ("bit", "masks")

    def __init__(self, masks: _Masks, bit: int) -> None:
        self.masks = masks
        self.bit = bit

    def __call__(self, group_ids: tuple[int, ...], i: int) -> bool:
        mask, bit = self.masks.mask, self.bit
        return all(mask(g, i) & bit for g in group_ids)

    def leading_run(self, group_ids: tuple[int, ...], k: int, n_max: int) -> int:
        stopped, walked = self.masks.leading_runs(group_ids, k)
        return min(n_max, stopped.get(self.bit, walked))


class _AnyPresence:
    """Group-blind view: a block counts if any group holds it."""

    __slots__ = ("bit", "masks")

    def __init__(self, masks: _Masks, bit: int) -> None:
        self.masks = masks
        self.bit = bit

    def __call__(self, i: int) -> bool:
        mask, bit = self.masks.mask, self.bit
        return any(mask(g, i) & bit for g in range(len(self.masks.tables)))

    def leading_run(self, k: int, n_max: int) -> int:
        stopped, walked = self.masks.leading_runs(None, k)
        return min(n_max, stopped.get(self.bit, walked))


IMPLY_LOOKAHEAD = 64
"""Blocks into a held run :meth:`Predictor.implied_keys` looks for a sliding-window anchor."""


def _imply_ancestors(
    g: int,
    wires: list[object],
    masks: list[int],
    owner: dict[int, ReplicaKey],
    out: dict[ReplicaKey, list[tuple[int, object]]],
) -> None:
    """Full attention: a block a replica lacks below one it holds (from the chain's end
    down, ``after`` = the replicas holding a later block). Emitted in chain order: the
    index links consecutive keys of a replica as parent and descendant."""
    after = 0
    holes: list[tuple[int, int]] = []
    for j in range(len(masks) - 1, -1, -1):
        m = masks[j]
        lack = after & ~m
        if lack:
            holes.append((j, lack))
        after |= m
    for j, lack in reversed(holes):
        for bit in iter_bits(lack):
            out.setdefault(owner[bit], []).append((g, wires[j]))


def _imply_windows(
    index: KVIndex,
    g: int,
    wires: list[object],
    masks: list[int],
    owner: dict[int, ReplicaKey],
    need: int,
    out: dict[ReplicaKey, list[tuple[int, object]]],
) -> None:
    """Sliding window: where a replica's held run starts after a hole, the first anchor in
    the run's first ``need - 1`` blocks implies the window below it (the blocks of the run are
    held already; those below it, down to ``anchor - need + 1``, are the implied ones)."""
    reach = min(need - 1, IMPLY_LOOKAHEAD)
    blocks = len(masks)
    prev = 0
    for j in range(blocks):
        m = masks[j]
        starts = m & ~prev
        prev = m
        if not j or not starts:
            continue
        for bit in iter_bits(starts):
            r = owner[bit]
            gone, anchors = index.gone(r), index.anchors(r)
            if gone is None or not anchors:
                continue
            for q in range(j, min(j + reach, blocks)):
                if not masks[q] & bit:
                    break
                if (g, wires[q]) in anchors:
                    for i in range(max(0, q - need + 1), j):
                        w = wires[i]
                        if not masks[i] & bit and (g, w) not in gone:
                            out.setdefault(r, []).append((g, w))
                    break


class Predictor:
    """Predicts hits for one pool's index (reads it; never writes it)."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._slots: dict[int, ReplicaKey] = {}
        """Slot bit -> replica (:meth:`_key_of`), rebuilt when it is found stale."""

    def hasher(self) -> BlockHasher | None:
        """The index's block hasher (None until the layout is known)."""
        return self.index.hasher()

    def keys_behind(
        self, token_ids: Sequence[int], keys: RequestKeys | None, hit_tokens: int
    ) -> list[tuple[int, object]]:
        """The ``(group, wire hash)`` keys a replica holds if vLLM reported a hit of
        ``hit_tokens`` for this request (:func:`router.core.hybrid.blocks_behind_hit`); empty
        when the layout is unknown or its rule proves nothing simple."""
        layout, hasher = self.index.layout, self.hasher()
        if layout is None or hasher is None or hit_tokens > len(token_ids):
            return []
        fine = blocks_behind_hit(layout, hit_tokens)
        if not fine:
            return []
        chain = hasher.lazy_chain(token_ids, keys)
        return [(g, chain.wire(i)) for g, i in fine if i < len(chain)]

    def group_keys(
        self, token_ids: Sequence[int], keys: RequestKeys | None, group: int | None
    ) -> list[tuple[int, object]] | None:
        """Every ``(group, wire hash)`` key of this request's chain in ``group`` (a superset of
        the blocks vLLM may touch or store there at its admission); None when the layout is
        not known yet or ``group`` is None."""
        hasher = self.hasher()
        if self.index.layout is None or hasher is None or group is None:
            return None
        chain = hasher.lazy_chain(token_ids, keys)
        return [(group, chain.wire(i)) for i in range(len(chain))]

    def tracked_group(self) -> int | None:
        """The group whose keys the eviction-order proof bounds (router.core.eviction_order):
        the first full-attention one, whose blocks every prompt has; None if none."""
        layout = self.index.layout
        if layout is None:
            return None
        return next((sg.group_ids[0] for sg in layout.spec_groups if sg.spec.is_fa_type), None)

    def implied_keys(
        self,
        token_ids: Sequence[int],
        keys: RequestKeys | None,
        replicas: Sequence[ReplicaKey],
    ) -> dict[ReplicaKey, list[tuple[int, object]]]:
        """Per *partial* replica, the GPU ``(group, wire hash)`` keys of this request's chain
        it holds by vLLM's cache structure (:func:`router.core.hybrid.implied_by_held`) but the
        index lacks: blocks cached before attach whose descendants an event, a store's parent
        or an answer showed. Full attention: every block below a held one. Sliding window: the
        window below an *anchor* (``KVIndex.anchors``), except blocks removed since attach
        (``KVIndex.gone``). The caller records them (``KVIndex.infer``), so the prediction
        that follows sees them and their ``BlockRemoved`` retires them.

        The work does not grow with the replicas: one pass over the chain's masks (restricted
        to the partial replicas' bits) finds the holes below held blocks for all of them at
        once, and only a replica with a hole is looked at alone. It reads the whole chain
        (hashing all of the prompt), so it runs only while some replica is partial; nothing
        when the layout is unknown or its rule is not the plain one. A window longer than
        :data:`IMPLY_LOOKAHEAD` blocks is looked for anchors only that far into a run (fewer
        keys implied, never a wrong one)."""
        index = self.index
        layout, hasher = index.layout, self.hasher()
        if layout is None or hasher is None or not replicas or not token_ids:
            return {}
        if layout.partial_hits or any(sg.spec.eagle for sg in layout.spec_groups):
            return {}
        owner = {index.slot_bit(r): r for r in replicas}
        partial = 0
        for bit in owner:
            partial |= bit
        fine = hasher.lazy_chain(token_ids, keys).wires()  # all of it, hashed in runs
        h = layout.hash_block_size
        by_stride: dict[int, list[object]] = {}
        out: dict[ReplicaKey, list[tuple[int, object]]] = {}
        for sg in layout.spec_groups:
            spec = sg.spec
            if not spec.is_fa_type and spec.kind not in SLIDING_KINDS:
                continue
            k = spec.block_size // h
            wires = by_stride.get(k)
            if wires is None:
                wires = by_stride[k] = fine[k - 1 :: k]
            for g in sg.group_ids:
                table = index.table("GPU", g)
                masks = [table.get(w, 0) & partial for w in wires]
                if spec.is_fa_type:
                    _imply_ancestors(g, wires, masks, owner, out)
                else:
                    _imply_windows(index, g, wires, masks, owner, window_blocks(spec), out)
        return out

    def predict(
        self,
        token_ids: Sequence[int],
        keys: RequestKeys | None = None,
        *,
        skip_reading: bool = False,
        replicas: Sequence[ReplicaKey] | None = None,
        explain: bool = False,
        blind: bool = False,
    ) -> Prediction:
        """Each replica's hit for a request of ``token_ids`` (spec §5.3).

        ``skip_reading`` is for requests vLLM serves without reading the cache
        (``prompt_logprobs``, §4.1): every hit is then 0. ``explain`` adds each spec group's
        standalone hit (costs extra lookups); ``blind`` adds the group-blind prediction.
        """
        index = self.index
        layout = index.layout
        targets = list(index.replicas() if replicas is None else replicas)
        hasher = self.hasher()
        n = len(token_ids)
        if layout is None or hasher is None or n == 0:
            hits = tuple(
                ReplicaHit(
                    r, 0, index.is_trusted(r), index.untrusted_reason(r), None, 0 if blind else None
                )
                for r in targets
            )
            return Prediction(n, 0, layout, hits)
        chain = hasher.lazy_chain(token_ids, keys)
        return self._predict(layout, chain, n, targets, skip_reading, explain, blind)

    def _predict(
        self,
        layout: ResolvedLayout,
        chain: LazyChain,
        n: int,
        targets: Sequence[ReplicaKey],
        skip_reading: bool,
        explain: bool,
        blind: bool,
    ) -> Prediction:
        index = self.index
        trusted_bits = 0
        for r in targets:
            if index.is_trusted(r):
                trusted_bits |= index.slot_bit(r)
        n_groups = len(layout.layout.groups)
        gpu = _Masks(index, "GPU", n_groups, chain, trusted_bits)
        lower = [
            (t, _Masks(index, t, n_groups, chain, trusted_bits))
            for t in index.tiers_in_use()
            if t != "GPU"
        ]
        nh = len(chain)
        stores = self._store_hits(layout, n, chain, nh, skip_reading, explain)
        # A replica whose first full-attention block misses gets the same answer as every
        # other such replica (nothing past it is probed), so it is computed once.
        first = layout.spec_groups[0]
        zero_run = None
        if first.spec.is_fa_type and not layout.partial_hits and not explain:
            zero_run = gpu.leading_runs(
                first.group_ids, first.spec.block_size // layout.hash_block_size
            )
        zero_result: HitResult | None = None
        out = []
        for r in targets:
            if not index.is_trusted(r):
                reason = index.untrusted_reason(r)
                out.append(ReplicaHit(r, 0, False, reason, None, 0 if blind else None))
                continue
            bit = index.slot_bit(r)
            shared = zero_run is not None and zero_run[0].get(bit, zero_run[1]) == 0
            if shared and zero_result is not None:
                res = zero_result
            else:
                res = find_longest_cache_hit(
                    layout,
                    n,
                    _Presence(gpu, bit),
                    num_hashes=nh,
                    skip_reading=skip_reading,
                    explain=explain,
                )
                if shared:
                    zero_result = res
            blind_hit = None
            if blind:
                blind_hit = (
                    0
                    if skip_reading
                    else group_blind_hit(layout, n, _AnyPresence(gpu, bit), num_hashes=nh)
                )
            tier_hits = {
                t: find_longest_cache_hit(
                    layout,
                    n,
                    _Presence(m, bit),
                    num_hashes=nh,
                    skip_reading=skip_reading,
                    explain=False,
                ).hit_tokens
                for t, m in lower
            }
            hit, external, cost = res.hit_tokens, {}, 0.0
            for t, (e, load_cost) in stores[0].items():
                ext = external[t] = connector_load(layout, res.hit_tokens, e)
                if ext.external_tokens:
                    hit = ext.cached_tokens
                    cost += load_cost * ext.external_tokens
            out.append(
                ReplicaHit(
                    r,
                    hit,
                    True,
                    None,
                    res,
                    blind_hit,
                    tier_hits,
                    index.partial_reason(r),
                    external,
                    cost,
                )
            )
        return Prediction(n, chain.hashed, layout, tuple(out), stores[1])

    def _store_hits(
        self,
        layout: ResolvedLayout,
        n: int,
        chain: LazyChain,
        nh: int,
        skip_reading: bool,
        explain: bool,
    ) -> tuple[dict[str, tuple[int, float]], dict[str, tuple[int, ...]]]:
        """Per shared tier: the store's hit for this request (the same for every replica, the
        store being the pool's) with the tier's load cost; and, with ``explain``, each spec
        group's hit on the store alone."""
        hits: dict[str, tuple[int, float]] = {}
        groups: dict[str, tuple[int, ...]] = {}
        shared = self.index.shared_tiers()
        if not shared or skip_reading:
            return hits, groups
        to_store = {g: i for i, g in enumerate(store_group_ids(layout))}
        for name, tier in shared.items():  # expired by the caller (KVIndex.expire_shared)
            if not len(tier):
                continue

            def has(group_ids: tuple[int, ...], i: int, tier=tier) -> bool:
                h = chain.wire(i)
                return all(tier.has(to_store[g], h) for g in group_ids)

            hits[name] = (store_hit(layout, n, has, num_hashes=nh), tier.load_cost)
            if explain:
                groups[name] = store_spec_group_hits(layout, n, has, num_hashes=nh)
        return hits, groups

    def shortlist(
        self,
        token_ids: Sequence[int],
        keys: RequestKeys | None = None,
        *,
        skip_reading: bool = False,
    ) -> Shortlist | None:
        """The replicas that can have a hit for this request, predicted, and what every
        other replica's prediction is (router.core.shortlist): those holding the first
        full-attention block in some indexed tier, read off that block's bitmasks (one
        lookup per tier and group, whatever the number of replicas). Each is predicted as
        :meth:`predict` predicts it; every other replica's FA run is 0, so its prediction is
        the one :meth:`predict` shares among such replicas. None where that rule does not
        hold (no layout yet, a first spec group that is not full attention, partial hits):
        predict every replica then."""
        index = self.index
        layout = index.layout
        hasher = self.hasher()
        n = len(token_ids)
        if layout is None or hasher is None or n == 0 or not layout.spec_groups:
            return None
        first = layout.spec_groups[0]
        if not first.spec.is_fa_type or layout.partial_hits:
            return None
        if self.index.shared_tiers():
            # a store the pool shares gives every replica a loadable hit: no replica is
            # "without a hit", so the load-ordered rest would be scored wrong; full scan
            return None
        chain = hasher.lazy_chain(token_ids, keys)
        lower = tuple(t for t in index.tiers_in_use() if t != "GPU")
        held = 0
        for h in chain.iter_block_wires(first.spec.block_size // layout.hash_block_size):
            for tier in ("GPU", *lower):
                m = -1
                for g in first.group_ids:
                    m &= index.table(tier, g).get(h, 0)
                held |= m
            break  # the first block alone
        held &= index.live_bits  # a wiped slot's bit waiting for the sweep names nobody
        holders = []
        for low in iter_bits(held):
            key = self._key_of(low)
            if key is not None:
                holders.append(key)
        prediction = self._predict(layout, chain, n, holders, skip_reading, False, False)
        nobody = _Masks(index, "GPU", len(layout.layout.groups), chain, 0)
        zero = find_longest_cache_hit(
            layout,
            n,
            _Presence(nobody, 0),
            num_hashes=len(chain),
            skip_reading=skip_reading,
            explain=False,
        )
        return Shortlist(prediction, {h.replica: h for h in prediction.replicas}, zero, lower)

    def absent_hit(self, shortlist: Shortlist, key: ReplicaKey) -> ReplicaHit:
        """:meth:`predict`'s answer for a replica ``shortlist`` found holding nothing."""
        index = self.index
        if not index.is_trusted(key):
            return ReplicaHit(key, 0, False, index.untrusted_reason(key), None, None)
        tiers = dict.fromkeys(shortlist.lower, 0)
        partial = index.partial_reason(key)
        return ReplicaHit(key, 0, True, None, shortlist.zero, None, tiers, partial)

    def _key_of(self, bit: int) -> ReplicaKey | None:
        """The replica whose slot bit is ``bit`` (None: no replica has it now)."""
        key = self._slots.get(bit)
        if key is not None:
            try:
                if self.index.slot_bit(key) == bit:
                    return key
            except KeyError:  # removed since
                pass
        index = self.index
        self._slots = {index.slot_bit(k): k for k in index.replicas()}
        return self._slots.get(bit)


def body_request_keys(
    body: dict, lora: Mapping[str, str] | None = None
) -> tuple[RequestKeys | None, bool]:
    """An OpenAI request body's extra hash keys (spec §1.3: the LoRA adapter its ``model``
    names, from ``lora`` (name -> path); the cache salt) and whether vLLM skips reading the
    prefix cache for it (§4.1).

    vLLM 0.32's OpenAI server skips reading exactly when the request's effective
    ``prompt_logprobs`` is set (``SamplingParams.skip_reading_prefix_cache`` defaults to
    that): the body's ``prompt_logprobs``, or with ``echo`` the ``logprobs`` of a completion
    (default None) or the ``top_logprobs`` of a chat (0 when absent or null: a chat with
    ``echo`` always skips). A ``skip_reading_prefix_cache`` key in the body is not a field
    of its OpenAI requests and changes nothing there, so it is ignored here too.
    tests/test_request_flags_vs_vllm.py checks this against vLLM's own request classes."""
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    model = body.get("model")
    path = lora.get(model) if lora and isinstance(model, str) else None
    if path is not None:
        keys: RequestKeys | None = RequestKeys(lora_name=model, lora_path=path, cache_salt=salt)
    else:
        keys = RequestKeys(cache_salt=salt) if salt is not None else None
    skip = body.get("prompt_logprobs") is not None
    if not skip and body.get("echo"):
        skip = "messages" in body or body.get("logprobs") is not None
    return keys, skip
