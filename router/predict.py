"""A request's hit on every replica: hash its chain, look it up once, apply vLLM's rule.

This composes the three pure-ish parts in the one direction data flows (spec §5.3):
:mod:`router.hashing` turns token ids into the request's fine chain of wire hashes (lazily, so
a prompt that misses everywhere costs one or two block hashes), :mod:`router.index` answers
each ``(group, hash)`` lookup with a bitmask of replicas, and :mod:`router.hybrid` runs vLLM's
``find_longest_cache_hit`` per replica over those cached masks. No lookup is repeated across
replicas: the per-replica work is bit tests on masks already fetched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from router.hashing import BlockHasher, LazyChain, RequestKeys, expected_stored_hashes
from router.hybrid import HitResult, find_longest_cache_hit, group_blind_hit
from router.index import KVIndex, ReplicaKey
from router.layout import ResolvedLayout

__all__ = ["Prediction", "Predictor", "ReplicaHit"]


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
    blind_hit_tokens: int
    """What a group-blind router would predict from the same state (for comparison)."""
    tier_hits: dict[str, int] = field(default_factory=dict)
    """Hybrid hits computed on the lower tiers (CPU, STORAGE) alone, where events exist."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """Hits of one request on every replica of a pool."""

    num_tokens: int
    hashed: int
    """Fine hashes computed for the request (lazy: fewer than the chain when it misses)."""
    layout: ResolvedLayout | None
    replicas: tuple[ReplicaHit, ...]

    def hit(self, replica: ReplicaKey) -> ReplicaHit:
        for r in self.replicas:
            if r.replica == replica:
                return r
        raise KeyError(replica)


class _Masks:
    """Replica bitmasks of one tier at the request's fine indices, fetched once each."""

    __slots__ = ("cache", "chain", "tables")

    def __init__(self, index: KVIndex, tier: str, n_groups: int, chain: LazyChain) -> None:
        self.chain = chain
        self.tables = [index.table(tier, g) for g in range(n_groups)]
        self.cache: list[dict[int, int]] = [{} for _ in range(n_groups)]

    def mask(self, g: int, i: int) -> int:
        cache = self.cache[g]
        m = cache.get(i)
        if m is None:
            m = cache[i] = self.tables[g].get(self.chain.wire(i), 0)
        return m

    def presence(self, bit: int):
        mask = self.mask

        def has(group_ids: tuple[int, ...], i: int) -> bool:
            return all(mask(g, i) & bit for g in group_ids)

        return has

    def any_group(self, bit: int):
        mask, groups = self.mask, range(len(self.tables))

        def has_any(i: int) -> bool:
            return any(mask(g, i) & bit for g in groups)

        return has_any


class Predictor:
    """Predicts hits for one pool's index; also serves the index's live conformance check."""

    def __init__(self, index: KVIndex, *, memo_entries: int = 1 << 18) -> None:
        self.index = index
        self._memo_entries = memo_entries
        self._hasher: BlockHasher | None = None
        index.conformance = self._conformance

    def hasher(self) -> BlockHasher | None:
        """The block hasher for the pool's current layout (None until the layout is known)."""
        layout = self.index.layout
        if layout is None:
            return None
        h = self._hasher
        if h is None or h.hash_block_size != layout.hash_block_size:
            h = self._hasher = BlockHasher(
                layout.layout.hash, layout.hash_block_size, memo_entries=self._memo_entries
            )
        return h

    def _conformance(
        self, token_ids: Sequence[int], block_size: int, cache_salt: str | None
    ) -> list | None:
        hasher = self.hasher()
        if hasher is None:
            return None
        keys = RequestKeys(cache_salt=cache_salt) if cache_salt is not None else None
        return expected_stored_hashes(hasher, token_ids, block_size, keys)

    def predict(
        self,
        token_ids: Sequence[int],
        keys: RequestKeys | None = None,
        *,
        skip_reading: bool = False,
        replicas: Sequence[ReplicaKey] | None = None,
    ) -> Prediction:
        """Each replica's hit for a request of ``token_ids`` (spec §5.3).

        ``skip_reading`` is for requests vLLM serves without reading the cache
        (``prompt_logprobs``, §4.1): every hit is then 0.
        """
        index = self.index
        layout = index.layout
        targets = list(index.replicas() if replicas is None else replicas)
        hasher = self.hasher()
        n = len(token_ids)
        if layout is None or hasher is None or n == 0:
            return Prediction(
                n,
                0,
                layout,
                tuple(
                    ReplicaHit(r, 0, index.is_trusted(r), index.untrusted_reason(r), None, 0)
                    for r in targets
                ),
            )
        chain = hasher.lazy_chain(token_ids, keys)
        n_groups = len(layout.layout.groups)
        gpu = _Masks(index, "GPU", n_groups, chain)
        lower = [(t, _Masks(index, t, n_groups, chain)) for t in index.tiers_in_use() if t != "GPU"]
        out = []
        for r in targets:
            bit = index.slot_bit(r)
            trusted = index.is_trusted(r)
            if not trusted:
                out.append(ReplicaHit(r, 0, False, index.untrusted_reason(r), None, 0))
                continue
            res = find_longest_cache_hit(
                layout, n, gpu.presence(bit), num_hashes=len(chain), skip_reading=skip_reading
            )
            blind = 0 if skip_reading else group_blind_hit(layout, n, gpu.any_group(bit))
            tier_hits = {
                t: find_longest_cache_hit(
                    layout, n, m.presence(bit), num_hashes=len(chain), skip_reading=skip_reading
                ).hit_tokens
                for t, m in lower
            }
            out.append(ReplicaHit(r, res.hit_tokens, True, None, res, blind, tier_hits))
        return Prediction(n, chain.hashed, layout, tuple(out))
