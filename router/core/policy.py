"""Hit and load in, a ranked choice of replica out. Pure: no I/O, no clock, RNG injected.

The ``kv`` cost model, in prefill-token equivalents (lower is better)::

    effective_hit = hit - load_cost - replay                 (hit: local + loaded from a store)
                    + Σ_tier w_tier · max(0, tier_hit - hit)               (CPU, STORAGE)
    prefill       = num_tokens - effective_hit
    queued        = pending_prefill_tokens
                    + per_request_tokens     · max(router_in_flight, running)
                    + waiting_request_tokens · waiting
                    + kv_pressure_tokens · max(0, kv_usage - threshold) / (1 - threshold)
    look_ahead    = lookahead_weight · fa_prefix_tokens
    pressure      = pressure_weight · recent_new_tokens
    affinity      = min(affinity_max_tokens, affinity_weight · home_tokens)
                    (0 where the home holds more than its fair share of the requests)
    spread        = family_spread_tokens · families     (only for a new prefix: no home, no hit)
    cost          = prefill + queued - look_ahead + pressure - affinity + spread

* ``hit`` is the exact hybrid hit vLLM will report (router.core.predict): the local hit plus
  what a shared store loads (``load_cost``: the loaded tokens at the tier's ``load_cost``, see
  router.core.external); ``replay`` the tail a bounded-replay layout recomputes anyway
  (router.core.hybrid.bounded_replay). An untrusted replica has ``hit = tier hits = fa_prefix
  = 0``: never a guess (ARCHITECTURE decision 3).
* ``pending_prefill_tokens`` are the uncached prompt tokens of the requests the router sent
  there that have not produced a first byte yet: the prefill the replica still owes.
* ``running``/``waiting``/``kv_usage`` come from the replica's ``/metrics`` (None: unknown,
  treated as 0 but ``router_in_flight`` still counts). The service passes ``running`` as its
  own in-flight count now plus other clients' running requests at the last scrape, and
  ``waiting`` as other clients' waiting requests (router.server.scrape.others_load): a raw scraped
  count is up to a scrape interval old and kept pushing sequential requests off the replica
  that had just cached their prefix.
* **Look ahead.** ``fa_prefix_tokens`` is the longest single-group hit (``HitResult.longest``:
  what the full-attention group alone holds). When a request's hit is limited by a sliding
  window group, vLLM pins ``shared_prefix_boundary`` at that junction and stores a window
  checkpoint there (spec §4.1, §4.7): the *next* request with the same prefix then hits on that
  replica. With ``w = 1`` a replica scores its exact hit plus the prefix it holds (the hit now
  plus the hit the next similar request is expected to get there): an exact hit still decides
  between equal prefixes, and a long full-attention prefix beats a short exact hit elsewhere.
  The credit is in prefill tokens, so it also outbids queued work: on the
  routing simulator (bench/routing_sim.py --quick, fa_swa, 3 seeds, load terms 64/256) w 1 -> 16
  raised the cached share (N=4: 19.7 -> 23.9 %) but also imbalance and queueing (N=16: 1.29 ->
  1.62, queue 0.034 -> 0.112 s); 1.0 won the 0.25 / 0.5 / 1.0 sweep. On two real vLLM
  replicas with sequential traffic (bench/real_vllm/through_router.py, 150 requests) kv at
  w = 1 and w = 3 and prefix_group_blind made the same choice at every request under the same
  tie-break seed. Under concurrent load on real vLLM (bench/real_vllm/load.py, issue 17) the
  load terms moved 6-10 % of conversation turns off the replica holding their history at
  w = 1, each losing its whole hit; w = 2 kept them (reuse 58-59 % -> 60-63 %, TTFT mean
  lower) and is the default: the credit is then twice the held prefix, so only a queue that
  outweighs hit and look-ahead together moves a conversation.

* **Cache pressure.** ``recent_new_tokens`` are the uncached prompt tokens the router sent
  the replica lately (a sum decaying with ``pressure_half_life_s``, router.core.pressure):
  how fast it has been evicting. It places a new prefix family or a one-off where the
  cache turns over slowest, so prefixes live longer on both replicas; a request with a
  real hit stays on its replica unless the pressure gap outweighs hit and look-ahead.

* **Affinity.** ``home_tokens`` are the request's leading tokens whose prefix the router first
  sent to this replica (router.core.affinity): a routing fact, not a cache claim. When a
  prefix is cached on several replicas their hits and look-ahead tie and the queue would
  decide, splitting a family of conversations over every replica; the credit keeps it on its
  home unless the queue there outweighs it too. It also holds where no event exists yet (the
  family's first request still in flight). It only breaks ties among the replicas with the
  longest exact hit: a home whose hit is shorter than another replica's gets no credit (a
  replica back from a failure with the prefix cached wins its family back). With
  ``affinity_weight = 8`` a new conversation over a 600-token system prompt cached on both
  replicas (hits and look-ahead tie) leaves the prompt's home only for a queue gap above
  ``8·576 = 4,608`` tokens (nine whole 64-token chunks), or when the home holds more than its
  fair share of the requests (below).
  ``affinity_max_tokens`` bounds the credit, so a prefix every request shares cannot hold all
  traffic on one replica. Measured in ``PolicyConfig.affinity_weight``'s docstring.

* **Fair share.** The credit is a tie-breaker, so it must not become the reason one replica
  carries a fleet: a home with more than ``affinity_fair_share`` times the candidates' mean
  number of requests (``request_load``: in flight or running, plus waiting; the mean counted
  as at least one) gets none, and hit, look-ahead and queue decide as they would without
  homes. The queue alone never stops a prefix every request shares from pulling a quiet
  fleet onto its home, because at light load no queue builds. With two replicas a bound of 2
  or more never binds (a replica's load is at most twice the mean).

* **Family spread.** ``families`` are the prefix families homed on the replica (first chunks a
  second request carried, router.core.affinity). A request no candidate is home to and none
  holds any of (no trusted hit, look-ahead or lower-tier hit) is a new prefix: a one-off, or
  the first request of what may become a family, which then stays where this decision puts
  it. Charging each family already there keeps a passing queue from stacking the families on
  one replica (and the prefill and eviction they bring with them). A request with a home
  anywhere pays nothing, so a family's later requests are not pushed off it, nor is a prefix
  cached without a home (another client's) pushed off its cache. 2048 by default where
  prefix homes are on; ``PolicyConfig`` has the measurements.

* **Load band.** With ``load_band_tokens = b > 0`` a candidate's ``queued`` counts only
  beyond ``b`` tokens more than the least queued candidate's: small, fleeting differences in
  queued work (a burst's in-flight counts change every few milliseconds, and vLLM batches the
  requests it runs) stop deciding against a cached prefix, as vLLM router's ``cache_aware``
  ignores load below its imbalance thresholds.

Candidates whose cost is within ``tie_tokens`` of the best are tied and one is picked with the
injected RNG; with ``temperature > 0`` the choice is sampled from ``softmax(-cost / T)``. The
decision ranks every candidate: the proxy fails over in that order.

The comparison policies: ``round_robin``; ``least_load`` (``queued`` only);
``prefix_group_blind`` (the same cost with the group-blind hit other routers compute, no look
ahead).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router.config import PolicyConfig

__all__ = [
    "NO_CANDIDATES",
    "Candidate",
    "Decision",
    "KVCostPolicy",
    "LeastLoadPolicy",
    "NoCandidates",
    "Policy",
    "PrefixGroupBlindPolicy",
    "RoundRobinPolicy",
    "Scored",
    "crowded_homes",
    "make_policy",
    "new_prefix",
    "placement_terms",
    "queued_tokens",
    "request_load",
    "with_crowded",
]

ReplicaKey = tuple[str, int]


class NoCandidates(RuntimeError):
    """Every replica of the pool is drained, removed or failed for this request."""


NO_CANDIDATES = "no replica can take the request: undrain or add a replica"


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the policy knows about one replica (and DP rank) for one request."""

    key: ReplicaKey
    hit_tokens: int = 0
    """Exact hybrid GPU hit (what vLLM will report)."""
    fa_prefix_tokens: int = 0
    """Longest single-group hit (``HitResult.longest``)."""
    tier_hits: Mapping[str, int] = field(default_factory=dict)
    load_cost_tokens: float = 0.0
    """Tokens of ``hit_tokens`` loaded from a shared store, weighted by their tier's
    ``load_cost`` (router.core.external): what the load costs against a prefill."""
    blind_hit_tokens: int | None = None
    replay_tokens: int = 0
    """Of ``hit_tokens``, the tokens a bounded-replay layout recomputes anyway (the hit is
    reported whole, its last window prefilled again: router.core.hybrid.bounded_replay)."""
    trusted: bool = True
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    recent_new_tokens: float = 0.0
    """Cache pressure: uncached tokens sent lately (router.core.pressure)."""
    home_tokens: int = 0
    """Leading prompt tokens whose prefix the router first sent here (router.core.affinity)."""
    families: int = 0
    """Prefix families homed here (``PrefixHomes.families``): the family spread's count."""
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None


@dataclass(frozen=True, slots=True)
class Scored:
    """One candidate's cost and its terms (for ``/admin/route/explain``)."""

    key: ReplicaKey
    cost: float
    hit_tokens: int
    effective_hit: float
    prefill: float
    queued: float
    look_ahead: float
    pressure: float = 0.0
    affinity: float = 0.0
    spread: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "replica": self.key[0],
            "dp_rank": self.key[1],
            "cost": self.cost,
            "hit_tokens": self.hit_tokens,
            "effective_hit": self.effective_hit,
            "prefill": self.prefill,
            "queued": self.queued,
            "look_ahead": self.look_ahead,
            "pressure": self.pressure,
            "affinity": self.affinity,
            "spread": self.spread,
        }


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen replica first, then the failover order."""

    policy: str
    ranked: tuple[Scored, ...]
    tied: int
    """How many candidates tied for the best cost."""
    crowded: tuple[ReplicaKey, ...] = ()
    """Homes whose affinity credit the fair share took away (``crowded_homes``)."""

    @property
    def chosen(self) -> Scored:
        return self.ranked[0]


class Policy(Protocol):
    name: str
    needs_blind: bool

    def choose(
        self, num_tokens: int, candidates: Sequence[Candidate], *, commit: bool = True
    ) -> Decision:
        """Rank the candidates. ``commit=False`` (explain) leaves the policy's state -- the
        round-robin position, the tie-break RNG -- as it was, so asking never changes what
        the next real request gets."""
        ...


def queued_tokens(c: Candidate, cfg: PolicyConfig) -> float:
    """The ``queued`` term of a candidate (module docstring): the work ahead of a request
    there, in prefill tokens. Request-independent, so router.core.shortlist orders replicas
    by it between requests."""
    running = c.running or 0
    q = (
        c.pending_prefill_tokens
        + cfg.per_request_tokens * max(c.in_flight, running)
        + cfg.waiting_request_tokens * (c.waiting or 0)
    )
    if c.kv_usage is not None and c.kv_usage > cfg.kv_usage_threshold:
        span = max(1e-9, 1.0 - cfg.kv_usage_threshold)
        q += cfg.kv_pressure_tokens * min(1.0, (c.kv_usage - cfg.kv_usage_threshold) / span)
    return q


def _cost(
    prefill: float, queued: float, ahead: float, pressure: float, affinity: float, spread: float
) -> float:
    """The kv cost from its terms, always in this order: scoring and the load band must
    produce the same float for the same terms (router.core.shortlist relies on it)."""
    return prefill + queued - ahead + pressure - affinity + spread


def request_load(c: Candidate) -> int:
    """Requests at the replica: the router's own in flight or vLLM's running count, whichever
    is larger, plus vLLM's waiting ones. The affinity fair share's unit: whole requests, so
    router.core.shortlist's running total over its book equals the full scan's sum exactly."""
    return max(c.in_flight, _whole(c.running)) + _whole(c.waiting)


_MOST_REQUESTS = 1 << 40
"""Where a scraped count stops counting (a replica reporting inf or 1e300 requests is full)."""


def _whole(count: float | None) -> int:
    """A scraped request count as a whole number: missing or NaN is 0, inf is capped."""
    if count is None or not count >= 0:
        return 0
    return int(min(count, _MOST_REQUESTS))


def crowded_homes(
    cfg: PolicyConfig,
    candidates: Sequence[Candidate],
    fleet: tuple[int, int] | None = None,
) -> frozenset[ReplicaKey]:
    """The homes holding more than ``affinity_fair_share`` times the candidates' mean number
    of requests (module docstring: fair share), the mean counted as at least one: an idle
    fleet's home may hold that many requests (a GPU batches them) before its credit goes.
    ``fleet``: ``(Σ request_load, count)`` over every candidate, where ``candidates`` are only
    some of them (router.core.shortlist's explicit ones); None: they are all of them."""
    fair = cfg.affinity_fair_share
    if fair <= 0 or not any(c.home_tokens for c in candidates):
        return frozenset()
    total, count = (
        fleet if fleet is not None else (sum(map(request_load, candidates)), len(candidates))
    )
    limit = fair * max(total, count)
    best = max((c.hit_tokens for c in candidates if c.trusted), default=0)
    return frozenset(  # only homes that would have the credit (trusted, with the best hit)
        c.key
        for c in candidates
        if c.home_tokens and c.trusted and c.hit_tokens >= best
        and count * request_load(c) > limit
    )  # fmt: skip


def new_prefix(cfg: PolicyConfig, candidates: Sequence[Candidate]) -> bool:
    """Whether the family spread charges this request (module docstring): it is on, no
    candidate is home to the request, and no trusted one holds any of it (exact hit,
    look-ahead prefix or a lower tier's hit). A prefix cached somewhere without a home (sent
    by another client, or its home forgotten) is placed by its cache, not pushed off it."""
    return cfg.family_spread_tokens > 0 and not any(
        c.home_tokens
        or (c.trusted and (c.hit_tokens or c.fa_prefix_tokens or any(c.tier_hits.values())))
        for c in candidates
    )


def placement_terms(
    cfg: PolicyConfig,
    candidates: Sequence[Candidate],
    crowded: frozenset[ReplicaKey] = frozenset(),
) -> Sequence[Candidate]:
    """The candidates as the kv cost sees them: a home whose exact hit is shorter than
    another trusted replica's, or that is ``crowded`` (:func:`crowded_homes`), gets no
    affinity credit, and ``families`` count only for a new prefix (:func:`new_prefix`;
    module docstring: affinity, fair share, family spread). Shared by the full scan and
    router.core.shortlist, so both score the same terms."""
    best = max((c.hit_tokens for c in candidates if c.trusted), default=0)
    homed = any(c.home_tokens for c in candidates)
    drop_families = cfg.family_spread_tokens > 0 and not new_prefix(cfg, candidates)
    if not (
        (homed and any(c.home_tokens and c.hit_tokens < best for c in candidates))
        or crowded
        or (drop_families and any(c.families for c in candidates))
    ):
        return candidates
    out = []
    for c in candidates:
        changes: dict[str, int] = {}
        if c.home_tokens and (c.hit_tokens < best or c.key in crowded):
            changes["home_tokens"] = 0
        if drop_families and c.families:
            changes["families"] = 0
        out.append(dataclasses.replace(c, **changes) if changes else c)
    return out


def with_crowded(decision: Decision, crowded: frozenset[ReplicaKey]) -> Decision:
    """``decision`` naming the homes the fair share overrode (in key order)."""
    if not crowded:
        return decision
    return dataclasses.replace(decision, crowded=tuple(sorted(crowded)))


class _CostPolicy:
    """Shared ranking: costs, ties within ``tie_tokens`` at random, optional softmax."""

    name = "kv"
    needs_blind = False
    banded = False
    """Whether ``load_band_tokens`` applies (the kv policy's knob, not the comparisons')."""

    def __init__(self, cfg: PolicyConfig | None = None, rng: random.Random | None = None) -> None:
        self.cfg = cfg or PolicyConfig()
        self.rng = rng if rng is not None else random.Random(self.cfg.seed)

    def score(self, num_tokens: int, c: Candidate) -> Scored:
        raise NotImplementedError

    def tie_rng(self, commit: bool) -> random.Random:
        """The RNG a decision breaks ties with: the policy's own, or (``commit=False``) a
        copy of it, so asking leaves the next real decision's draw as it was."""
        if commit:
            return self.rng
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        return rng

    def _banded(self, scored: list[Scored]) -> list[Scored]:
        """``load_band_tokens``: queued work within the band of the least queued candidate
        counts as equal (module docstring, load band). The comparison policies have none."""
        return scored

    def choose(
        self, num_tokens: int, candidates: Sequence[Candidate], *, commit: bool = True
    ) -> Decision:
        if not candidates:
            raise NoCandidates(NO_CANDIDATES)
        rng = self.tie_rng(commit)
        plain = [self.score(num_tokens, c) for c in candidates]
        scored = sorted(self._banded(plain), key=lambda s: (s.cost, s.key))
        best = scored[0].cost
        tie = self.cfg.tie_tokens
        n_tied = 1
        while n_tied < len(scored) and scored[n_tied].cost - best <= tie:
            n_tied += 1
        temp = self.cfg.temperature
        if temp > 0 and len(scored) > 1:
            weights = [math.exp(-(s.cost - best) / temp) for s in scored]
            pick = rng.choices(range(len(scored)), weights=weights)[0]
        elif n_tied > 1 and self.banded and self.cfg.load_band_tokens > 0:
            # The band made their queues equal for the cost, so nothing the cost sees tells
            # them apart (a request no replica holds, typically). Among the tied, the cache that
            # has turned over slowest lately goes first, then the least queued: what is cached
            # there lives longer (router.core.pressure), and it is never a move away from a hit.
            queued = {s.key: s.queued for s in plain}
            churn = {c.key: c.recent_new_tokens for c in candidates}
            order = {s.key: (churn[s.key], queued[s.key]) for s in scored[:n_tied]}
            least = min(order.values())
            lightest = [i for i in range(n_tied) if order[scored[i].key] == least]
            pick = lightest[rng.randrange(len(lightest))] if len(lightest) > 1 else lightest[0]
        elif n_tied > 1:
            pick = rng.randrange(n_tied)
        else:
            pick = 0
        if pick:
            scored.insert(0, scored.pop(pick))
        return Decision(self.name, tuple(scored), n_tied)


class KVCostPolicy(_CostPolicy):
    """The exact-hybrid-hit cost model with look-ahead (module docstring)."""

    name = "kv"
    banded = True

    def choose(
        self, num_tokens: int, candidates: Sequence[Candidate], *, commit: bool = True
    ) -> Decision:
        crowded = crowded_homes(self.cfg, candidates)
        terms = placement_terms(self.cfg, candidates, crowded)
        return with_crowded(super().choose(num_tokens, terms, commit=commit), crowded)

    def score(self, num_tokens: int, c: Candidate) -> Scored:
        return self.score_queued(num_tokens, c, queued_tokens(c, self.cfg))

    def score_queued(self, num_tokens: int, c: Candidate, queued: float) -> Scored:
        """:meth:`score` with ``queued`` given (``queued_tokens(c, cfg)``): the same float
        operations in the same order, so a replica router.core.shortlist scores from its
        load-ordered book costs exactly what the full scan computes."""
        cfg = self.cfg
        if c.trusted:
            hit = c.hit_tokens
            eff = hit - c.load_cost_tokens - c.replay_tokens
            for tier, th in c.tier_hits.items():
                if th > hit:
                    eff += cfg.lower_tier_weights.get(tier, 0.0) * (th - hit)
            ahead = cfg.lookahead_weight * max(c.fa_prefix_tokens, hit)
            affinity = min(cfg.affinity_max_tokens, cfg.affinity_weight * c.home_tokens)
        else:
            hit, eff, ahead, affinity = 0, 0.0, 0.0, 0.0
        prefill = max(0.0, num_tokens - eff)
        pressure = cfg.pressure_weight * c.recent_new_tokens
        spread = cfg.family_spread_tokens * c.families
        cost = _cost(prefill, queued, ahead, pressure, affinity, spread)
        return Scored(c.key, cost, hit, eff, prefill, queued, ahead, pressure, affinity, spread)

    def band(self, s: Scored, floor: float) -> Scored:
        """``s`` with its ``queued`` seen through the load band above ``floor`` (the least
        queued candidate's), the cost computed again from its terms (:func:`_cost`, as
        :meth:`score_queued` does): every replica inside the band then costs bit for bit the
        same as any other with the same terms, which router.core.shortlist relies on."""
        q = floor + max(0.0, s.queued - floor - self.cfg.load_band_tokens)
        cost = _cost(s.prefill, q, s.look_ahead, s.pressure, s.affinity, s.spread)
        return dataclasses.replace(s, cost=cost, queued=q)

    def _banded(self, scored: list[Scored]) -> list[Scored]:
        if self.cfg.load_band_tokens <= 0 or len(scored) < 2:
            return scored
        floor = min(s.queued for s in scored)
        return [self.band(s, floor) for s in scored]


class PrefixGroupBlindPolicy(_CostPolicy):
    """What group-blind routers do: a hash counts if any group holds it (for comparison)."""

    name = "prefix_group_blind"
    needs_blind = True

    def score(self, num_tokens: int, c: Candidate) -> Scored:
        hit = (c.blind_hit_tokens or 0) if c.trusted else 0
        prefill = float(max(0, num_tokens - hit))
        queued = queued_tokens(c, self.cfg)
        return Scored(c.key, prefill + queued, hit, float(hit), prefill, queued, 0.0)


class LeastLoadPolicy(_CostPolicy):
    """Ignores the cache: the least queued work wins (for comparison, and the fallback)."""

    name = "least_load"

    def score(self, num_tokens: int, c: Candidate) -> Scored:
        queued = queued_tokens(c, self.cfg)
        return Scored(c.key, queued, c.hit_tokens if c.trusted else 0, 0.0, 0.0, queued, 0.0)


class RoundRobinPolicy:
    """Each candidate in turn, by key order (for comparison)."""

    name = "round_robin"
    needs_blind = False

    def __init__(self, cfg: PolicyConfig | None = None, rng: random.Random | None = None) -> None:
        self._next = 0

    def choose(
        self, num_tokens: int, candidates: Sequence[Candidate], *, commit: bool = True
    ) -> Decision:
        if not candidates:
            raise NoCandidates(NO_CANDIDATES)
        order = sorted(candidates, key=lambda c: c.key)
        i = self._next % len(order)
        if commit:
            self._next += 1
        rot = order[i:] + order[:i]
        ranked = tuple(
            Scored(c.key, float(j), c.hit_tokens if c.trusted else 0, 0.0, 0.0, 0.0, 0.0)
            for j, c in enumerate(rot)
        )
        return Decision(self.name, ranked, 1)


_POLICIES: dict[str, type] = {
    "kv": KVCostPolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "prefix_group_blind": PrefixGroupBlindPolicy,
}


def make_policy(cfg: PolicyConfig, rng: random.Random | None = None) -> Policy:
    """The policy named by ``cfg.name``; ``rng`` makes tie-breaks reproducible in tests."""
    return _POLICIES[cfg.name](cfg, rng)
