"""What the proxy and the admin API share, one copy of it: per pool the index, predictor,
policy, tokenizer and replicas (with their load, connections and event subscribers).

This module knows neither face: :mod:`router.server.app` builds the state and hands it to the
proxy, the admin API and the scraper. Each replica's :class:`AsyncSubscriber` feeds the index
from the serving loop (:mod:`router.server.ingest`); with ``policy.speculative_insert`` a pool
routes over index + the :mod:`router.core.speculative` overlay, which the subscribers' items
retire.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from events.stream import StreamSpec, StreamStats
from events.subscriber import AsyncSubscriber, SubscriberError
from router.config import PoolConfig, ReplicaConfig, RouterConfig
from router.core.affinity import PrefixHomes
from router.core.eviction_forecast import EvictionForecast, Ticket
from router.core.health import ReplicaHealth
from router.core.index import KVIndex, ReplicaKey
from router.core.policy import (
    Candidate,
    Decision,
    KVCostPolicy,
    LeastLoadPolicy,
    Policy,
    make_policy,
    queued_tokens,
    request_load,
)
from router.core.predict import Prediction, Predictor, ReplicaHit, body_request_keys
from router.core.pressure import DecayingSum
from router.core.shared_tier import SharedTier
from router.core.shortlist import LoadBook, choose_shortlist
from router.core.snapshot import SNAPSHOT_VERSION, IndexSnapshot, PoolSnapshot
from router.core.speculative import SpeculativeOverlay
from router.core.tokenize import RequestTokenizer, make_tokenizer
from router.server.decisions import DecisionLog
from router.server.ingest import IndexFeeder
from router.server.logs import kv
from router.server.metrics import RouterMetrics
from router.server.side_get import BodyTooLarge, side_get
from router.server.upstream import UpstreamPool
from router.server.vllm_metrics import MAX_PAGE_BYTES, parse_start_time, restarted

__all__ = [
    "DiscoveryStatus",
    "PoolState",
    "ReplicaState",
    "RouteChoice",
    "RouterState",
    "ShortlistMismatch",
]

log = logging.getLogger("kvrouter.serve")


_WATCHED = frozenset({"drained", "others_running", "others_waiting", "kv_usage"})
"""ReplicaState fields the kv cost reads, replaced whole when they change (drain, scrape)."""


@dataclass
class ReplicaState:
    """One replica as the proxy sees it: its client, load and health."""

    cfg: ReplicaConfig
    client: httpx.AsyncClient
    """For ``/metrics`` scrapes (off the hot path)."""
    upstream: UpstreamPool
    """Keep-alive connections the proxy forwards requests on (router.server.upstream)."""
    ranks: list[int]
    health: ReplicaHealth
    """Probe and request outcomes: whether it is in rotation (router.core.health)."""
    drained: bool = False
    in_flight: dict[int, int] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)
    """Requests sent per rank since the router started (the eviction-order proof tells its
    own from other clients' by it: router.core.eviction_order)."""
    finished: dict[int, float] = field(default_factory=dict)
    """``vllm:request_success_total`` per engine at the last scrape (empty if not exported)."""
    pending_prefill: dict[int, int] = field(default_factory=dict)
    written: dict[int, DecayingSum] = field(default_factory=dict)
    """New (uncached) prompt tokens the router sent lately, per rank: cache pressure
    (router.core.pressure)."""
    running: dict[int, float] = field(default_factory=dict)
    waiting: dict[int, float] = field(default_factory=dict)
    """As the last ``/metrics`` scrape read them (per engine; -1: unlabelled)."""
    others_running: dict[int, float] = field(default_factory=dict)
    others_waiting: dict[int, float] = field(default_factory=dict)
    """The scraped counts minus the router's own requests at the scrape: load from other
    clients. The routing load is these plus the router's in-flight count *now*, so a request
    that finished after the scrape stops weighing on the replica at once instead of up to a
    scrape interval later (a stale count pushed sequential requests off the replica that had
    just cached their prefix)."""
    kv_usage: dict[int, float] = field(default_factory=dict)
    num_gpu_blocks: dict[int, float] = field(default_factory=dict)
    """Per rank, the blocks of its KV cache (``vllm:cache_config_info``): with ``kv_usage``
    the free blocks the eviction forecast starts from (router.core.eviction_forecast)."""
    scraped_at: float | None = None
    scraped_mono: float | None = None
    """``scraped_at`` on the monotonic clock (the eviction forecast's ``since``)."""
    scrape_error: str | None = None
    started_at: float | None = None
    """The replica's ``process_start_time_seconds`` (its epoch; router.server.scrape)."""
    restarts: int = 0
    """Restarts seen from a changed start time (its streams were read anew each time)."""
    last_error: str | None = None
    """The latest proxy failure on this replica, with its address (kept out of client errors)."""
    subscriber: AsyncSubscriber | None = None
    streams: dict[str, ReplicaKey] = field(default_factory=dict)
    feeder: IndexFeeder | None = None
    source: str = "static"
    """Who added it: ``static`` (the config file), ``admin`` (``POST /admin/replicas``) or
    ``kubernetes`` (pod discovery, router.server.discovery)."""
    on_change: Callable[[str], None] | None = None
    """Set by its pool: told (:meth:`touch`) whenever what the kv cost reads of this replica
    changes, so the pool's load-ordered book (router.core.shortlist) follows."""

    @property
    def name(self) -> str:
        return self.cfg.name

    def touch(self) -> None:
        """Its load, drain or health changed: whoever changes the in-flight counts or the
        health calls this; setting one of :data:`_WATCHED` calls it by itself."""
        if self.on_change is not None:
            self.on_change(self.cfg.name)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _WATCHED:
            self.touch()

    def request_started(self, rank: int, pending: int) -> None:
        """A request was sent to ``rank``; ``pending``: the uncached prompt tokens it owes."""
        self.in_flight[rank] = self.in_flight.get(rank, 0) + 1
        self.sent[rank] = self.sent.get(rank, 0) + 1
        self.pending_prefill[rank] = self.pending_prefill.get(rank, 0) + pending
        self.touch()

    def release_pending(self, rank: int, pending: int) -> None:
        """The request's first byte arrived (or it ended): its prefill is owed no more."""
        if pending:
            self._owe_less(rank, pending)
            self.touch()

    def request_finished(self, rank: int, pending: int) -> None:
        """The request left ``rank`` (answered, failed or cancelled)."""
        if pending:
            self._owe_less(rank, pending)
        self.in_flight[rank] -= 1
        self.touch()

    def _owe_less(self, rank: int, pending: int) -> None:
        self.pending_prefill[rank] = max(0, self.pending_prefill.get(rank, 0) - pending)

    def as_dict(self) -> dict[str, Any]:
        now, wall = time.monotonic(), time.time()
        return {
            "name": self.name,
            "source": self.source,
            "url": self.cfg.url,
            "dp_ranks": self.ranks,
            "drained": self.drained,
            "in_flight": sum(self.in_flight.values()),
            "pending_prefill_tokens": sum(self.pending_prefill.values()),
            "recent_new_tokens": round(sum(w.value(now) for w in self.written.values())),
            "running": self.running or None,
            "waiting": self.waiting or None,
            "others_running": self.others_running or None,
            "others_waiting": self.others_waiting or None,
            "kv_usage": self.kv_usage or None,
            "scraped_at": self.scraped_at,
            "scrape_error": self.scrape_error,
            "health": self.health.as_dict(now, wall),
            "started_at": self.started_at,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "streams": {s: f"{k[0]}/dp{k[1]}" for s, k in self.streams.items()},
        }


@dataclass
class DiscoveryStatus:
    """What a pool's pod watcher (router.server.discovery) last saw, for ``/admin/discovery``:
    written by the watcher only, read by the admin API."""

    namespace: str
    label_selector: str
    api_server: str
    connected: bool = False
    """A watch stream is open now."""
    resource_version: str | None = None
    """The last resourceVersion seen (list, event or bookmark): where a watch resumes."""
    last_error: str | None = None
    last_error_at: float | None = None
    """Wall-clock time of ``last_error``."""
    relists: int = 0
    pods: dict[str, str] = field(default_factory=dict)
    """Every pod the selector matches, by name: ``ready``, ``refused: ...`` or why it is not
    ready."""
    draining: dict[str, float] = field(default_factory=dict)
    """Discovered replicas being drained, with their removal deadline (monotonic)."""

    def as_dict(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "namespace": self.namespace,
            "label_selector": self.label_selector,
            "api_server": self.api_server or "in-cluster",
            "connected": self.connected,
            "resource_version": self.resource_version,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "relists": self.relists,
            "pods": dict(sorted(self.pods.items())),
            "draining": {n: max(0.0, round(d - now, 3)) for n, d in self.draining.items()},
        }


@dataclass
class RouteChoice:
    """A routing decision with what it was based on (kept for the error loop and headers)."""

    pool: PoolState
    decision: Decision
    prediction: Prediction | None
    num_tokens: int
    token_ids: list[int] | None
    reason: str | None
    body: dict[str, Any] | None = None
    """The request body (cache salt, prompt_logprobs: what an explained re-prediction needs)."""
    speculative: Prediction | None = None
    """Hits over index + speculative overlay, when the overlay could change them (the policy
    ranked with these; ``prediction`` stays the events-only one)."""
    insertion: Any = None
    """This request's speculative entries (withdrawn if it fails over elsewhere)."""
    homed: list[int] | None = None
    """The prefix chunks this decision homed on the chosen replica (withdrawn on failover)."""
    cached_tokens: int | None = None
    """What the replica's answer reported as ``cached_tokens``, once it is in (the proxy's
    prediction check; the last decisions show it, router.server.decisions)."""
    sent_at: float = 0.0
    """When (monotonic) the request was last sent upstream (the eviction-order proof)."""
    admission: ReplicaHit | None = None
    """The chosen replica's hit once the requests queued ahead there have evicted what the
    forecast says they will (router.core.eviction_forecast); None: the forecast changes
    nothing (the admission-time hit is the speculative, else the events-only one)."""
    ticket: Ticket | None = None
    """Its place in the forecast's queue of allocations ahead (until its answer begins)."""

    def expected_hit(self, key: ReplicaKey) -> ReplicaHit | None:
        """The admission-time hit on ``key``: what vLLM will find when it admits the request
        (events, plus the requests routed ahead, minus what their allocations evict)."""
        if self.admission is not None and self.admission.replica == key:
            return self.admission
        return self.in_flight_hit(key)

    def in_flight_hit(self, key: ReplicaKey) -> ReplicaHit | None:
        """The hit over events plus the requests routed ahead, before any eviction."""
        for pred in (self.speculative, self.prediction):
            if pred is not None:
                with contextlib.suppress(KeyError):
                    return pred.hit(key)
        return None


class ShortlistMismatch(RuntimeError):
    """The shortlist decision differed from the full scan's (only raised when
    ``PoolState.check_shortlist`` is on, as the test suite turns it on): a bug, or a change
    to a replica's load that did not call :meth:`ReplicaState.touch`."""


class PoolState:
    """One served model: its index, predictor, policy, tokenizer and replicas.

    Decisions take the shortlist path (router.core.shortlist; docs/decision-cost.md) where
    it applies and the full scan otherwise; both choose the same replica."""

    check_shortlist = False
    """Run the full scan beside every shortlist decision and raise :class:`ShortlistMismatch`
    when they differ (tests/conftest.py turns it on for the whole suite)."""

    def __init__(self, cfg: PoolConfig, router: RouterState) -> None:
        self.cfg = cfg
        self.router = router
        self.name = cfg.model
        self.index = KVIndex(cfg.layout, limits=router.config.index.limits(), pool=cfg.model)
        for t in cfg.shared_tiers:
            self.index.share_tier(
                SharedTier(
                    t.medium,
                    ttl_s=t.ttl_s,
                    capacity_blocks=t.capacity_blocks,
                    load_cost=t.load_cost,
                )
            )
        self.predictor = Predictor(self.index)
        self._attempts = itertools.count()
        """Numbers the requests sent to partial replicas (router.core.eviction_order)."""
        self.speculative: SpeculativeOverlay | None = None
        if cfg.policy.speculative_insert and cfg.policy.name in ("kv", "prefix_group_blind"):
            self.speculative = SpeculativeOverlay(
                self.index,
                self.predictor,
                cfg.policy.speculative_ttl_s,
                hold_s=cfg.policy.speculative_hold_s,
            )
        self.forecast: EvictionForecast | None = None
        if cfg.policy.eviction_forecast:
            self.forecast = EvictionForecast(self.predictor)
        self.homes: PrefixHomes | None = None
        if cfg.policy.affinity_weight > 0 and cfg.policy.name == "kv":
            self.homes = PrefixHomes(cfg.policy.affinity_chunk_tokens, cfg.policy.affinity_capacity)
        self.eviction_forecasts: dict[ReplicaKey, int] = {}
        """Routed requests whose admission-time hit the eviction forecast lowered, by replica
        (metric ``kvrouter_eviction_forecasts``)."""
        self.fair_share_overrides: dict[ReplicaKey, int] = {}
        """Routed requests whose home lost its credit to the fair share, by home
        (``policy.affinity_fair_share``; metric ``kvrouter_affinity_fair_share_overrides``)."""
        self.policy: Policy = make_policy(cfg.policy)
        self.fallback = LeastLoadPolicy(cfg.policy)
        self.replicas: dict[str, ReplicaState] = {}
        self.discovery: DiscoveryStatus | None = None
        """Set when the pool's replicas are also discovered (``discovery = "kubernetes"``)."""
        self.tokenizer: RequestTokenizer = make_tokenizer(
            cfg.tokenizer, model=cfg.model, urls=self.live_urls
        )
        self._book = LoadBook(
            churn_order=cfg.policy.load_band_tokens > 0,
            family_order=cfg.policy.family_spread_tokens > 0 and self.homes is not None,
        )
        """Replicas the shortlist may stand for by load alone (:meth:`_refresh_book`)."""
        self._irregular: set[ReplicaKey] = set()
        """Replicas (and DP ranks) of the pool not in the book: always scored one by one."""
        self._book_keys: dict[str, list[ReplicaKey]] = {}
        self._dirty: set[str] = set()
        """Replicas whose load, drain or health changed since the book was refreshed."""

    def live_urls(self) -> list[str]:
        """Where a remote tokenizer may call: replicas neither drained, down nor ejected."""
        now = time.monotonic()
        return [
            r.cfg.url
            for r in self.replicas.values()
            if not r.drained and r.health.state(now) in ("healthy", "half_open")
        ]

    def rotation(self, now: float) -> tuple[list[ReplicaState], bool]:
        """The replicas a new request may go to, and whether the pool is *panicking*.

        Routable replicas (router.core.health: not down, not ejected, no half-open trial in
        flight) that are not drained. When there is none but some are merely unhealthy, the
        pool panics rather than answer 503: it returns those, in the order to try them
        (:meth:`ReplicaHealth.panic_rank`: the ones whose ``/health`` answers first, then the
        one out of rotation longest), and requests go to the first not yet tried. The
        health view may be wrong (probes time out under load, the router's own network
        hiccups) and every outcome feeds it back; a dead pool still fails, after
        ``server.max_attempts`` quick attempts (connections refused) or connect timeouts."""
        reps = [r for r in self.replicas.values() if not r.drained]
        live = [r for r in reps if r.health.routable(now)]
        if live or not reps:
            return live, False
        return sorted(reps, key=lambda r: r.health.panic_rank()), True

    def holds(self, rep: ReplicaState) -> bool:
        """``rep`` is still this pool's: not removed, nor replaced by a replica re-added under
        its name, while a probe, scrape or other await that started with it ran."""
        return self.replicas.get(rep.name) is rep

    def distrust_replica(self, rep: ReplicaState, detail: str) -> None:
        """``rep`` left rotation (down or ejected): what the index holds for it may be stale
        by the time it is back (KVIndex.seen_down), and so are its speculative entries and
        prefix homes."""
        if not self.holds(rep):
            return  # removed meanwhile
        for r in rep.ranks:
            key = (rep.name, r)
            self._forget_routing(key)
            if rep.streams:
                self.index.seen_down(key, detail)

    # -------------------------------------------------------------- replicas

    async def add_replica(
        self,
        rcfg: ReplicaConfig,
        restored: dict[str, int] | None = None,
        started_at: float | None = None,
        *,
        source: str = "static",
    ) -> ReplicaState:
        """Connect a replica. ``restored``: its state was loaded from a snapshot, and maps each
        of its streams to the last batch applied there (the ring is asked from the next);
        ``started_at`` is the process start time that state belongs to; ``source`` who adds
        it (:attr:`ReplicaState.source`)."""
        if rcfg.name in self.replicas:
            raise ValueError(f"replica {rcfg.name!r} already exists in pool {self.name!r}")
        s = self.router.config.server
        upstream = UpstreamPool(
            rcfg.url, connect_timeout=s.connect_timeout_s, read_timeout=s.read_timeout_s
        )
        client = httpx.AsyncClient(
            base_url=rcfg.url,
            timeout=httpx.Timeout(s.read_timeout_s, connect=s.connect_timeout_s),
            transport=httpx.AsyncHTTPTransport(
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            ),
        )
        rep = ReplicaState(
            rcfg,
            client,
            upstream,
            rcfg.ranks(),
            ReplicaHealth(self.router.config.health),
            started_at=started_at,
            source=source,
        )
        for r in rep.ranks:
            rep.in_flight[r] = 0
            rep.pending_prefill[r] = 0
            self.index.add_replica(rcfg.name, r)
        try:
            await self._open_streams(rep, restored)
        except Exception:
            await client.aclose()
            await upstream.aclose()
            for r in rep.ranks:
                self.index.remove_replica(rcfg.name, r)
            raise
        self.replicas[rcfg.name] = rep
        rep.on_change = self._dirty.add
        rep.touch()
        return rep

    async def _open_streams(self, rep: ReplicaState, restored: dict[str, int] | None) -> None:
        """Subscribe to the replica's event streams, from its ring's start or, for state
        restored from a snapshot, after the last batch applied there."""
        rcfg = rep.cfg
        specs = []
        for sc in rcfg.stream_list():
            sname = f"{self.name}/{rcfg.name}/dp{sc.dp_rank}"
            rep.streams[sname] = (rcfg.name, sc.dp_rank)
            specs.append(
                StreamSpec(
                    sname,
                    sc.endpoint,
                    sc.replay_endpoint,
                    topic=rcfg.topic,
                    dp_rank=sc.dp_rank,
                    bind=rcfg.bind,
                    replay_from_start=True,
                    resume_from=(restored[sname] + 1 if restored and sname in restored else None),
                    lazy_token_ids=True,
                )
            )
        if specs:
            feeder = IndexFeeder(self.index, rep.streams)
            if restored:
                feeder.applied.update(restored)
            rep.feeder = feeder
            on_item: Any = feeder
            followers = [f for f in (self.speculative, self.forecast) if f is not None]
            if followers:
                streams = rep.streams

                def on_item(item: Any) -> None:
                    feeder(item)
                    for f in followers:
                        f.on_item(streams[item.stream], item)

            sub = AsyncSubscriber(
                specs, on_item=on_item, replay_timeout=self.router.config.index.replay_timeout_s
            )
            await sub.start()
            rep.subscriber = sub
        else:
            for r in rep.ranks:
                self.index.mark_untrusted(
                    (rcfg.name, r), "no event endpoint configured: routed by load only"
                )

    async def replica_restarted(self, name: str, why: str) -> None:
        """The replica is a new process (vLLM restarts with an empty cache, its sequence
        numbers from 0, and says nothing, spec §5 item 14). Its state is wiped and its streams
        are read again from the new process's ring start, so a restart is noticed even when
        the new process has already published past the old sequence number."""
        rep = self.replicas.get(name)
        if rep is None:
            return
        log.warning(
            "replica %s restarted: its index state is read anew",
            name,
            extra=kv(pool=self.name, replica=name, reason=why),
        )
        rep.restarts += 1
        if rep.subscriber is not None:
            sub, rep.subscriber = rep.subscriber, None
            try:
                await sub.close()
            except SubscriberError:
                log.exception("event subscriber of replica %r had failed", name)
        for r in rep.ranks:
            self._forget_routing((name, r))
            self.index.reset_replica((name, r))
        rep.touch()
        await self._open_streams(rep, None)

    async def remove_replica(self, name: str) -> None:
        rep = self.replicas.pop(name)
        rep.touch()
        if rep.subscriber is not None:
            try:
                await rep.subscriber.close()
            except SubscriberError:  # its reader had died; the rest must still be released
                log.exception("event subscriber of replica %r had failed", name)
        for r in rep.ranks:
            self._forget_routing((name, r))
            if self.forecast is not None:
                self.forecast.drop((name, r))
        self.index.remove_replica(name)
        self.router.metrics.forget_replica(self.name, name)
        await rep.client.aclose()
        await rep.upstream.aclose()

    def sending_to(
        self, key: ReplicaKey, token_ids: list[int] | None, body: dict[str, Any]
    ) -> int | None:
        """A request is about to be sent to ``key``. On a partial replica the eviction-order
        proof (router.core.eviction_order) notes its prompt's blocks in the first
        full-attention group: maybe in use until it ends. Returns the attempt's number for
        :meth:`sent_done` (None: not partial, nothing to report)."""
        if self.index.trust(key) != "partial":
            return None
        tracked = None
        try:
            if token_ids is not None:
                req, _ = body_request_keys(body, self.cfg.lora_adapters)
                tracked = self.predictor.group_keys(token_ids, req, self.predictor.tracked_group())
        except Exception:  # None ends the proof: it must know every key
            log.exception("could not compute the keys of a request to %s", key[0])
            tracked = None
        attempt = next(self._attempts)
        self.index.witness_sending(key, attempt, tracked)
        return attempt

    def sent_done(self, key: ReplicaKey, attempt: int | None, finished: bool) -> None:
        """The request :meth:`sending_to` numbered left the router; ``finished``: its answer
        was read whole (else it failed or was cancelled)."""
        if attempt is not None:
            self.index.witness_ended(key, attempt, time.monotonic(), finished)

    def scraped(self, rep: ReplicaState, mine: dict[int, int]) -> None:
        """A scrape of ``rep`` read its load (``mine``: the router's in-flight requests per
        rank at the scrape): tell each partial rank's eviction-order proof whether the router
        is its only client (router.core.eviction_order)."""
        partial = {k for k in self.index.partial_replicas() if k[0] == rep.name}
        if not partial:
            return
        now = time.monotonic()
        for key in partial:
            rank = key[1]
            # a rank's own counts, or (unlabelled metrics: -1) the whole replica's
            own = rank in rep.others_running or rank in rep.others_waiting
            lab = rank if own else -1
            others = rep.others_running.get(lab, 0.0) + rep.others_waiting.get(lab, 0.0)
            finished = rep.finished.get(lab)
            if own:
                sent, inflight = rep.sent.get(rank, 0), mine.get(rank, 0)
            else:
                sent, inflight = sum(rep.sent.values()), sum(mine.values())
            self.index.witness_scrape(key, now, others, finished, sent, inflight)

    def answered(
        self,
        key: ReplicaKey,
        token_ids: list[int],
        body: dict[str, Any],
        cached_tokens: int,
        sent_at: float,
        *,
        learn: bool,
    ) -> int:
        """vLLM reported ``cached_tokens`` for a request sent at ``sent_at`` (monotonic) to a
        *partial* replica. The keys its hit rule needed were touched then, so a copy of each
        was freed after (router.core.eviction_order). With ``learn`` (it reported more than
        predicted) they are also recorded as held, whether or not an event said so (cached
        before the router attached), so the next request with that prefix is predicted
        exactly; window keys removed since ``sent_at`` are not (KVIndex.infer). Nothing on
        other replicas, nor where a connector tier is indexed (``cached_tokens`` then counts
        loaded tokens the GPU does not hold). Returns how many keys were learned."""
        if self.index.trust(key) != "partial" or self.index.tiers_in_use() not in ([], ["GPU"]):
            return 0
        req, _ = body_request_keys(body, self.cfg.lora_adapters)
        behind = self.predictor.keys_behind(token_ids, req, cached_tokens)
        self.index.witness_touched(key, behind, sent_at)
        return self.index.infer(key, behind, sent_at=sent_at) if learn else 0

    def imply_partial(self, token_ids: list[int], body: dict[str, Any]) -> int:
        """Before a decision: record what each partial replica holds of this request's
        chain by vLLM's cache structure (Predictor.implied_keys), so a prefix cached before
        attach is predicted once any of its descendants is known. Returns the keys added."""
        partial = self.index.partial_replicas()
        if not partial:
            return 0
        keys, _ = body_request_keys(body, self.cfg.lora_adapters)
        implied = self.predictor.implied_keys(token_ids, keys, partial)
        return sum(self.index.infer(r, ks, "implied_blocks") for r, ks in implied.items())

    def stream_stats(self) -> dict[str, StreamStats]:
        out: dict[str, StreamStats] = {}
        for rep in self.replicas.values():
            if rep.subscriber is not None:
                out.update(rep.subscriber.stats())
        return out

    # --------------------------------------------------------------- routing

    def candidates(
        self,
        prediction: Prediction | None,
        exclude: set[ReplicaKey],
        homed: dict[ReplicaKey, int] | None = None,
        now: float | None = None,
    ) -> list[Candidate]:
        """Every replica (and DP rank) a request may go to, with its hit and load: the full
        scan's candidates."""
        hits = {h.replica: h for h in prediction.replicas} if prediction is not None else {}
        homed = homed or {}
        out = []
        if now is None:
            now = time.monotonic()
        reps, panic = self.rotation(now)
        if panic:  # one at a time, in panic order (rotation)
            reps = [r for r in reps if any((r.name, k) not in exclude for k in r.ranks)][:1]
        for rep in reps:
            for r in rep.ranks:
                key = (rep.name, r)
                if key not in exclude:
                    fam = self.homes.families(key) if self.homes is not None else 0
                    out.append(_candidate(rep, r, hits.get(key), homed.get(key, 0), now, fam))
        return out

    # ----------------------------------------------------- the shortlist path

    def _refresh_book(self, now: float) -> None:
        """Re-file the replicas touched since the last decision: in the book (by their
        ``queued`` term) when a no-hit, no-home request's cost there is ``prefill + queued``
        and they are routable whatever the time (healthy, not drained), else irregular."""
        pressure = self.cfg.policy.pressure_weight > 0
        cfg = self.policy.cfg if isinstance(self.policy, KVCostPolicy) else self.cfg.policy
        book, irregular = self._book, self._irregular
        homes = self.homes if book.family_order else None
        for name in self._dirty:
            for key in self._book_keys.pop(name, ()):
                book.discard(key)
                irregular.discard(key)
            rep = self.replicas.get(name)
            if rep is None:
                continue
            keys = self._book_keys[name] = [(name, r) for r in rep.ranks]
            regular = not rep.drained and rep.health.state(now) == "healthy"
            for key in keys:
                cand = _candidate(rep, key[1], None, 0, now)
                q = queued_tokens(cand, cfg)
                if regular and math.isfinite(q) and not (pressure and key[1] in rep.written):
                    fam = homes.families(key) if homes is not None else 0
                    book.put(key, q, rep.written.get(key[1]), request_load(cand), fam)
                else:
                    irregular.add(key)
        self._dirty.clear()

    def _decide_shortlist(
        self,
        token_ids: list[int],
        body: dict[str, Any],
        exclude: set[ReplicaKey],
        homed: dict[ReplicaKey, int] | None,
        now: float | None = None,
    ) -> tuple[Decision, Prediction] | None:
        """The kv policy's decision scoring only the replicas that can differ from the
        rest (router.core.shortlist; docs/decision-cost.md), and the prediction of those
        (with the chosen replica's). None: it does not apply; decide by the full scan.
        With :attr:`check_shortlist` the full scan runs too and must agree."""
        policy = self.policy
        if type(policy) is not KVCostPolicy or self.speculative is not None:
            return None
        if now is None:
            now = time.monotonic()
        if self._book.family_order and self.homes is not None:
            # a family formed or went: its replica's place in the family order moved (without
            # that order nothing reads families from the book: no re-filing)
            self._dirty.update(key[0] for key in self.homes.take_family_changes())
        if self._dirty:
            self._refresh_book(now)
        if not len(self._book):  # nothing surely routable: the full scan (and its panic)
            return None
        keys, skip = body_request_keys(body, self.cfg.lora_adapters)
        short = self.predictor.shortlist(token_ids, keys, skip_reading=skip)
        if short is None:
            return None
        homed = homed or {}
        held = short.held
        reported = dict(held)
        explicit = []
        book = self._book
        skipped = {k for k in exclude if k in book}
        for key in {**held, **homed, **dict.fromkeys(self._irregular)}:
            if key in book:
                skipped.add(key)
            if key in exclude:
                continue
            rep = self.replicas.get(key[0])
            if (
                rep is None
                or rep.drained
                or key[1] not in rep.ranks
                or not rep.health.routable(now)
            ):
                continue
            h = held.get(key)
            if h is None:
                h = reported[key] = self.predictor.absent_hit(short, key)
            fam = self.homes.families(key) if self.homes is not None else 0
            explicit.append(_candidate(rep, key[1], h, homed.get(key, 0), now, fam))
        rng_before = policy.rng.getstate() if self.check_shortlist else None
        decision = choose_shortlist(policy, len(token_ids), explicit, book, skipped, now=now)
        if decision is None:
            return None
        chosen = decision.chosen.key
        if chosen not in reported:
            reported[chosen] = self.predictor.absent_hit(short, chosen)
        base = short.prediction
        pred = Prediction(base.num_tokens, base.hashed, base.layout, tuple(reported.values()))
        if rng_before is not None:
            self._check_shortlist(token_ids, body, exclude, homed, now, rng_before, decision, pred)
        return decision, pred

    def _check_shortlist(
        self,
        token_ids: list[int],
        body: dict[str, Any],
        exclude: set[ReplicaKey],
        homed: dict[ReplicaKey, int] | None,
        now: float,
        rng_before: object,
        fast: Decision,
        fast_pred: Prediction,
    ) -> None:
        """:attr:`check_shortlist`: the full scan, from the RNG state the shortlist started
        with, must choose the same replica with the same scores and tie count, and leave the
        RNG where the shortlist left it."""
        policy = self.policy
        rng = policy.rng  # type: ignore[attr-defined]
        after = rng.getstate()
        rng.setstate(rng_before)
        pred = self.predict(token_ids, body)
        ref = policy.choose(len(token_ids), self.candidates(pred, exclude, homed, now))
        problems = []
        if rng.getstate() != after:
            problems.append("the RNG was consumed differently")
            rng.setstate(after)
        if ref.crowded != fast.crowded:
            problems.append(f"fair share overrode {fast.crowded}, the full scan {ref.crowded}")
        if ref.chosen.key != fast.chosen.key or ref.tied != fast.tied:
            problems.append(
                f"chose {fast.chosen.key} ({fast.tied} tied), the full scan "
                f"{ref.chosen.key} ({ref.tied} tied)"
            )
        scores = {s.key: s for s in ref.ranked}
        problems += [
            f"scored {s} where the full scan scored {scores.get(s.key)}"
            for s in fast.ranked
            if scores.get(s.key) != s
        ]
        hits = {h.replica: h for h in pred.replicas}
        problems += [
            f"predicted {h} where the full scan predicted {hits.get(h.replica)}"
            for h in fast_pred.replicas
            if hits.get(h.replica) != h
        ]
        if problems:
            raise ShortlistMismatch(f"pool {self.name!r}: " + "; ".join(problems))

    def _forget_routing(self, key: ReplicaKey) -> None:
        """What the router's own decisions recorded about ``key`` (speculative entries, prefix
        homes) no longer says where its cache is: it restarted, left rotation or is gone."""
        if self.speculative is not None:
            self.speculative.forget_replica(key)
        if self.forecast is not None:
            self.forecast.forget(key)
        if self.homes is not None:
            self.homes.forget_replica(key)

    def failed_over(self, choice: RouteChoice) -> None:
        """``choice``'s replica failed before its first byte: what the decision recorded there
        (speculative entries, prefix homes) did not happen."""
        if self.speculative is not None:
            self.speculative.discard(choice.insertion)
        self.ended(choice)
        if self.homes is not None and choice.homed:
            self.homes.withdraw(choice.homed, choice.decision.chosen.key)

    def answering(self, choice: RouteChoice) -> None:
        """``choice``'s answer began: vLLM admitted it (its allocation is no longer ahead of
        anyone, router.core.eviction_forecast)."""
        if self.forecast is not None:
            self.forecast.admitted(choice.ticket)

    def ended(self, choice: RouteChoice) -> None:
        """``choice``'s request left its replica (answered, failed or cancelled)."""
        if self.forecast is not None:
            self.forecast.ended(choice.ticket)
            choice.ticket = None

    def _admission(
        self, key: ReplicaKey, token_ids: list[int], keys: Any, hit: ReplicaHit | None
    ) -> ReplicaHit | None:
        """The admission-time hit on ``key`` once the requests queued ahead there have evicted
        what the forecast says they will (None: the hit stands). Called before the overlay
        records this request: its own future blocks must not count."""
        forecast = self.forecast
        if forecast is None or hit is None or not hit.trusted or hit.hit_tokens <= 0:
            return None
        view = self.speculative.view if self.speculative is not None else self.index
        bit = self.index.slot_bit(key)
        after = forecast.predict(view, key, bit, token_ids, keys, *self._scraped(key))
        return after if after is not None and after.hit_tokens < hit.hit_tokens else None

    def forecast_explained(
        self, key: ReplicaKey, token_ids: list[int] | None, body: dict[str, Any], hit: Any
    ) -> dict[str, Any] | None:
        """What explain shows of the eviction forecast on ``key``: the blocks queued ahead,
        the free blocks, the cached keys the model has as free, how many the queue ahead
        evicts and the hit left (``hit_tokens``, None when it stands); None when off."""
        forecast = self.forecast
        if forecast is None:
            return None
        scraped = self._scraped(key)
        free = scraped[0]
        q = forecast.queues.get(key)
        admission = None
        if token_ids:
            keys = body_request_keys(body, self.cfg.lora_adapters)[0]
            admission = self._admission(key, token_ids, keys, hit)
        return {
            "ahead_blocks": forecast.ahead(key),
            "free_blocks": free[0] if free is not None else None,
            "free_cached_keys": q.free_cached if q is not None else 0,
            "evicted_keys": len(forecast.evicted(key, *scraped)),
            "hit_tokens": admission.hit_tokens if admission is not None else None,
        }

    def _scraped(
        self, key: ReplicaKey
    ) -> tuple[tuple[int, int] | None, float | None, float | None]:
        """What the forecast reads of ``key``'s last scrape: ``(free, usable)`` KV blocks
        (None: its metrics do not say), its waiting requests and when (monotonic)."""
        rep = self.replicas.get(key[0])
        if rep is None or rep.scraped_mono is None:
            return None, None, None
        blocks = None
        usage, total = _get(rep.kv_usage, key[1]), _get(rep.num_gpu_blocks, key[1])
        if usage is not None and total is not None and 0.0 <= usage <= 1.0 and total >= 2:
            usable = int(total) - 1  # vLLM's usage leaves its null block out (get_usage)
            blocks = round((1.0 - usage) * usable), usable
        return blocks, _get(rep.waiting, key[1]), rep.scraped_mono

    def _queue_ticket(self, choice: RouteChoice, keys: Any) -> None:
        """The request joins the forecast's queue ahead on its replica."""
        forecast = self.forecast
        token_ids = choice.token_ids
        if forecast is None or not token_ids:
            return
        key = choice.decision.chosen.key
        hit = choice.expected_hit(key)
        hasher = self.predictor.hasher()
        chain = hasher.lazy_chain(token_ids, keys) if hasher is not None else None
        choice.ticket = forecast.routed(
            key,
            self.index.layout,
            chain,
            len(token_ids),
            hit.hit_tokens if hit is not None else 0,
            time.monotonic(),
        )

    def wrote(self, rep: ReplicaState, rank: int, new_tokens: int) -> None:
        """A request with ``new_tokens`` uncached prompt tokens was sent to ``rep``: they
        will take cache blocks there (cache pressure, router.core.pressure)."""
        if new_tokens > 0:
            w = rep.written.get(rank)
            if w is None:
                w = rep.written[rank] = DecayingSum(self.cfg.policy.pressure_half_life_s)
            w.add(new_tokens, time.monotonic())
            rep.touch()  # the book orders replicas by it (router.core.shortlist, load band)

    def predict(
        self,
        token_ids: list[int],
        body: dict[str, Any],
        explain: bool = False,
        replicas: list[ReplicaKey] | None = None,
    ) -> Prediction:
        """The events-only prediction for every replica (or ``replicas``)."""
        keys, skip = body_request_keys(body, self.cfg.lora_adapters)
        if self.index.shared_tiers():
            self.index.expire_shared(time.monotonic())
        return self.predictor.predict(
            token_ids,
            keys,
            skip_reading=skip,
            replicas=replicas,
            explain=explain,
            blind=explain or self.policy.needs_blind,
        )

    def decide(
        self,
        token_ids: list[int] | None,
        body: dict[str, Any],
        exclude: set[ReplicaKey] = frozenset(),  # type: ignore[assignment]
        *,
        explain: bool = False,
        reason: str | None = None,
    ) -> RouteChoice:
        pred = spec = insertion = new_homes = admission = req_keys = None
        if token_ids:
            self.imply_partial(token_ids, body)
            overlay = self.speculative
            homes = self.homes
            home_keys = homes.keys(token_ids) if homes is not None else []
            homed = homes.homed(home_keys) if homes is not None else None
            fast = None if explain else self._decide_shortlist(token_ids, body, exclude, homed)
            if fast is not None:
                decision, pred = fast
            else:
                pred = self.predict(token_ids, body, explain)
                if overlay is not None:
                    keys, skip = body_request_keys(body, self.cfg.lora_adapters)
                    try:
                        spec = overlay.predict(
                            token_ids,
                            keys,
                            skip_reading=skip,
                            explain=explain,
                            blind=explain or self.policy.needs_blind,
                        )
                    except Exception:  # speculation is an optimisation: never fail a request
                        log.exception("speculative prediction failed; routing on events only")
                basis = spec if spec is not None and self.cfg.policy.speculative_routing else pred
                decision = self.policy.choose(
                    len(token_ids), self.candidates(basis, exclude, homed), commit=not explain
                )
            if homes is not None and not explain:
                new_homes = homes.record(home_keys, decision.chosen.key)
                for key in decision.crowded:
                    self.fair_share_overrides[key] = self.fair_share_overrides.get(key, 0) + 1
            if self.forecast is not None and not explain:
                chosen = decision.chosen.key
                try:
                    row = None
                    with contextlib.suppress(KeyError):
                        row = (spec if spec is not None else pred).hit(chosen)
                    req_keys = body_request_keys(body, self.cfg.lora_adapters)[0]
                    admission = self._admission(chosen, token_ids, req_keys, row)
                    if admission is not None:
                        n = self.eviction_forecasts.get(chosen, 0)
                        self.eviction_forecasts[chosen] = n + 1
                except Exception:  # a forecast refines a report: never fail a request
                    log.exception("eviction forecast failed")
            if overlay is not None and not explain:
                chosen = decision.chosen.key
                hit = None  # the admission-time hit there: where its junction will be
                with contextlib.suppress(KeyError):
                    hit = (admission or (spec if spec is not None else pred).hit(chosen)).result
                try:
                    insertion = overlay.record(chosen, token_ids, keys, hit)
                except Exception:
                    log.exception("speculative insert failed")
        else:
            decision = self.fallback.choose(0, self.candidates(None, exclude), commit=not explain)
        choice = RouteChoice(
            self,
            decision,
            pred,
            len(token_ids) if token_ids else 0,
            token_ids,
            reason,
            body,
            spec,
            insertion,
            new_homes,
        )
        choice.admission = admission
        if self.forecast is not None and token_ids and not explain:
            try:
                self._queue_ticket(choice, req_keys)
            except Exception:  # a forecast refines a report: never fail a request
                log.exception("eviction forecast failed")
        return choice


async def _start_times(replicas: list[ReplicaConfig], router: RouterState) -> dict[str, float]:
    """Each replica's current process start time (router.server.scrape), read once before a
    snapshot is loaded; replicas that cannot be read are left out."""
    timeout = router.config.server.connect_timeout_s

    async def one(rcfg: ReplicaConfig) -> tuple[str, float | None]:
        if rcfg.metrics_path is None:
            return rcfg.name, None
        try:
            async with httpx.AsyncClient(base_url=rcfg.url, timeout=timeout) as client:
                answer = await side_get(
                    client, rcfg.metrics_path, deadline_s=timeout, max_bytes=MAX_PAGE_BYTES
                )
        except (httpx.HTTPError, TimeoutError, BodyTooLarge):
            return rcfg.name, None
        if answer.status >= 400:
            return rcfg.name, None
        return rcfg.name, parse_start_time(answer.body)

    found = await asyncio.gather(*(one(r) for r in replicas))
    return {name: t for name, t in found if t is not None}


def _candidate(
    rep: ReplicaState,
    r: int,
    h: ReplicaHit | None,
    home_tokens: int,
    now: float,
    families: int = 0,
) -> Candidate:
    """What the policy knows about ``rep``'s rank ``r`` for one request (``h``: its hit)."""
    res = h.result if h is not None else None
    mine = rep.in_flight.get(r, 0)
    others = _get(rep.others_running, r)
    return Candidate(
        (rep.name, r),
        hit_tokens=h.hit_tokens if h is not None else 0,
        fa_prefix_tokens=res.longest if res is not None else 0,
        tier_hits=h.tier_hits if h is not None else {},
        load_cost_tokens=h.load_cost_tokens if h is not None else 0.0,
        blind_hit_tokens=h.blind_hit_tokens if h is not None else None,
        replay_tokens=res.replay_tokens if res is not None else 0,
        trusted=h.trusted if h is not None else False,
        in_flight=mine,
        pending_prefill_tokens=rep.pending_prefill.get(r, 0),
        recent_new_tokens=w.value(now) if (w := rep.written.get(r)) else 0.0,
        home_tokens=home_tokens,
        families=families,
        running=None if others is None else mine + others,
        waiting=_get(rep.others_waiting, r),
        kv_usage=_get(rep.kv_usage, r, avg=True),
    )


def _get(d: dict[int, float], rank: int, avg: bool = False) -> Any:
    if not d:
        return None
    if rank in d:
        return d[rank]
    return d.get(-1)


class RouterState:
    """Everything the proxy and the admin API share (one copy of the state)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pools: dict[str, PoolState] = {}
        self.models: dict[str, PoolState] = {}
        self.metrics = RouterMetrics(self.snapshot)
        self.mismatches: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=config.server.mismatch_log_size
        )
        self.decisions = DecisionLog()
        """The last routing decisions (``GET /admin/decisions``), recorded as requests end."""
        self.started = False

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "pool": p.name,
                "entries": p.index.entries,
                "bytes": p.index.nbytes(),
                "wipes": {
                    "deferred": p.index.wipes,
                    "sync": p.index.sync_wipes,
                    "sweep_steps": p.index.sweep_steps,
                    "sweep_passes": p.index.sweep_passes,
                    "swept_keys": p.index.swept,
                    "dead_slots": p.index.dead_slots(),
                },
                "hash_memo": (h.memo_stats if (h := p.index.hasher()) is not None else None),
                "prefix_homes": p.homes.homes_by_replica() if p.homes is not None else None,
                "prefix_families": (p.homes.families_by_replica() if p.homes is not None else None),
                "fair_share_overrides": dict(p.fair_share_overrides),
                "eviction_forecasts": dict(p.eviction_forecasts),
                "replica_stats": p.index.stats(),
                "layout": p.index.layout_state(),
                "stream_stats": p.stream_stats(),
                "stream_keys": {s: k for r in p.replicas.values() for s, k in r.streams.items()},
                "health": [
                    {
                        "replica": r.name,
                        "up": r.health.probe_up,
                        "ejected": r.health.state(now) == "ejected",
                        "routable": not r.drained and r.health.routable(now),
                        "ejections": r.health.ejections,
                        "probe_failures": r.health.probe_failures_total,
                    }
                    for r in p.replicas.values()
                ],
            }
            for p in self.pools.values()
        ]

    def pool_for(self, model: Any) -> PoolState | None:
        p = self.models.get(model) if isinstance(model, str) else None
        if p is None and model is None and len(self.pools) == 1:
            return next(iter(self.pools.values()))
        return p

    async def start(self, snapshot: IndexSnapshot | None = None) -> None:
        """Build the pools and connect their replicas; a ``snapshot`` (router.core.snapshot)
        restores each configured replica it holds, whose streams then resume after it."""
        saved = {p.model: p for p in snapshot.pools} if snapshot is not None else {}
        for pcfg in self.config.pools:
            pool = PoolState(pcfg, self)
            self.pools[pcfg.model] = pool
            for name in (pcfg.model, *pcfg.aliases, *pcfg.lora_adapters):
                self.models[name] = pool
            psnap = saved.get(pcfg.model)
            by_key = {(r.name, r.dp_rank): r for r in psnap.replicas} if psnap else {}
            saved_names = {name for name, _ in by_key}
            now = await _start_times([r for r in pcfg.replicas if r.name in saved_names], self)
            for rcfg in pcfg.replicas:
                restored: dict[str, int] = {}
                started_at = now.get(rcfg.name)
                for rank in rcfg.ranks():
                    rsnap = by_key.get((rcfg.name, rank))
                    if rsnap is None or psnap is None:
                        continue
                    if restarted(rsnap.started_at, started_at):
                        log.warning(
                            "replica %s restarted since the snapshot (process start %.0f, now "
                            "%.0f): its saved state is not loaded, its ring is read instead",
                            rcfg.name, rsnap.started_at, started_at,
                        )  # fmt: skip
                        continue
                    if started_at is None:
                        # unreachable now: keep the saved epoch, the first scrape checks it
                        started_at = rsnap.started_at
                    pool.index.import_replica(
                        rsnap,
                        learned=psnap.learned_groups,
                        source=psnap.layout_source == f"{rcfg.name}/dp{rank}",
                    )
                    restored.update(rsnap.streams)
                await pool.add_replica(rcfg, restored or None, started_at)
        self.started = True

    def index_snapshot(self) -> IndexSnapshot:
        """Every pool's index with the last batch applied per stream (router.core.snapshot)."""
        pools = []
        for p in self.pools.values():
            groups, source = p.index.learned_layout()
            reps = []
            for rep in p.replicas.values():
                applied = rep.feeder.applied if rep.feeder is not None else {}
                for sname, key in rep.streams.items():
                    snap = p.index.export_replica(key)
                    snap.started_at = rep.started_at
                    if sname in applied:
                        snap.streams = {sname: applied[sname]}
                    reps.append(snap)
            pools.append(PoolSnapshot(p.name, groups, source, reps))
        return IndexSnapshot(SNAPSHOT_VERSION, time.time(), pools)

    async def stop(self) -> None:
        for pool in self.pools.values():
            for name in list(pool.replicas):
                await pool.remove_replica(name)
            await pool.tokenizer.aclose()

    def record_mismatch(self, entry: dict[str, Any]) -> None:
        self.mismatches.append(entry)
