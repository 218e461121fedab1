"""The router's Prometheus metrics, in a registry of its own per app (tests run several apps).

Hot-path metrics (requests, latencies, predicted hit, prediction error, in flight) are
updated as requests go; state that already lives elsewhere (index entries and bytes, event
counters, stream lag, trust, health) is read at scrape time by a collector, so the proxy never
keeps a second copy of it (ARCHITECTURE: one state, read by every face).

Labels, the same everywhere: ``pool`` is the pool's model name; ``replica`` the replica's
configured name (never ``name/dpN``); ``dp_rank`` the data-parallel rank, on the series that
are per rank (index, trust, events, prediction checks) and absent from those per HTTP server
(requests, latencies, health, failovers, in flight). ``kvrouter_requests_total`` counts every
request on ``/v1/*`` (router.server.outcome), with ``pool=""`` when it named no pool the
router serves (refused before one was chosen) and ``replica=""`` when no replica answered it
(the router answered: 4xx, 502, 503). No ``*_created`` series: :meth:`RouterMetrics.render`
drops them from this registry whatever prometheus_client's process-wide setting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from router.core.layout_quorum import LAYOUT_STATUSES

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_ERROR_BUCKETS = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 4096)
_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
"""The router's own work: tokenize, predict, choose (a remote tokenizer can take seconds)."""
_TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_TOTAL_BUCKETS = (*_TTFT_BUCKETS, 300.0, 600.0)


class _StateCollector(Collector):
    """Reads the pools' index and stream counters when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], Iterable[dict[str, Any]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Any]:
        entries = GaugeMetricFamily(
            "kvrouter_index_entries", "Keys held by the index", labels=["pool"]
        )
        nbytes = GaugeMetricFamily(
            "kvrouter_index_bytes", "Memory account of the index tables", labels=["pool"]
        )
        memo_steps = GaugeMetricFamily(
            "kvrouter_hash_memo_steps",
            "Chain steps held by the pool's block-hash memo: it grows until its bound"
            " (kvrouter_hash_memo_capacity_steps), which is the router's RSS growth after warm-up",
            labels=["pool"],
        )
        memo_capacity = GaugeMetricFamily(
            "kvrouter_hash_memo_capacity_steps",
            "Bound on the chain steps the block-hash memo holds",
            labels=["pool"],
        )
        wipes = CounterMetricFamily(
            "kvrouter_index_wipes",
            "Replica state wipes: deferred (a fresh slot at once, the old bit swept in steps) or"
            " sync (a scan of the whole index: max_dead_slots were pending)",
            labels=["pool", "mode"],
        )
        sweep_steps = CounterMetricFamily(
            "kvrouter_index_sweep_steps", "Bounded steps of the dead-bit sweep", labels=["pool"]
        )
        sweep_passes = CounterMetricFamily(
            "kvrouter_index_sweeps",
            "Sweep passes over every table that ended (each frees the slots dead at its start)",
            labels=["pool"],
        )
        swept = CounterMetricFamily(
            "kvrouter_index_swept_keys", "Dead bits the sweep cleared from keys", labels=["pool"]
        )
        dead = GaugeMetricFamily(
            "kvrouter_index_dead_slots",
            "Wiped slots whose bit some keys still carry (read by no prediction)",
            labels=["pool"],
        )
        homes = GaugeMetricFamily(
            "kvrouter_prefix_home_chunks",
            "Prompt chunks whose first routing the pool remembers (router.core.affinity; bounded"
            " by policy.affinity_capacity), by home replica",
            labels=["pool", "replica", "dp_rank"],
        )
        families = GaugeMetricFamily(
            "kvrouter_prefix_families",
            "Prefix families homed on each replica: first chunks a second request carried"
            " (router.core.affinity; what policy.family_spread_tokens charges a new prefix)",
            labels=["pool", "replica", "dp_rank"],
        )
        overrides = CounterMetricFamily(
            "kvrouter_affinity_fair_share_overrides",
            "Routed requests whose prefix home held more than policy.affinity_fair_share times"
            " the mean requests per replica and so lost its affinity credit, by home",
            labels=["pool", "replica", "dp_rank"],
        )
        lowered = CounterMetricFamily(
            "kvrouter_eviction_forecasts",
            "Routed requests whose admission-time hit (x-kvrouter-expected-hit) the eviction"
            " forecast lowered: the requests queued ahead on that replica evict part of it",
            labels=["pool", "replica", "dp_rank"],
        )
        rank = ["pool", "replica", "dp_rank"]
        events = CounterMetricFamily(
            "kvrouter_events", "KV events received, by type", labels=[*rank, "type"]
        )
        outcomes = CounterMetricFamily(
            "kvrouter_index_block_ops", "Index block operations by outcome",
            labels=[*rank, "outcome"],
        )  # fmt: skip
        lag = GaugeMetricFamily(
            "kvrouter_stream_lag_seconds", "Receive time minus publish time of the latest batch",
            labels=rank,
        )  # fmt: skip
        gaps = CounterMetricFamily(
            "kvrouter_stream_signals", "Event stream signals by kind", labels=[*rank, "kind"]
        )
        trusted = GaugeMetricFamily(
            "kvrouter_replica_trusted", "1 if the replica's cache state is trusted", labels=rank
        )
        trust_state = GaugeMetricFamily(
            "kvrouter_replica_trust",
            "1 for the replica's trust state: exact, partial (a lower bound) or untrusted",
            labels=[*rank, "state"],
        )
        ingest = CounterMetricFamily(
            "kvrouter_ingest_errors",
            "Refused events and ingest problems that made a replica untrusted, by reason",
            labels=[*rank, "reason"],
        )
        layout_status = GaugeMetricFamily(
            "kvrouter_pool_layout_status",
            "1 for the state of the pool's layout: declared, or when learned from events"
            " unknown, learned (one replica), provisional (one has spoken), confirmed (a strict"
            " majority of at least two agree) or contested (router.core.layout_quorum)",
            labels=["pool", "status"],
        )
        layout_views = GaugeMetricFamily(
            "kvrouter_pool_layout_view_replicas",
            "Replicas holding each view of a learned layout; adopted=1 for the pool's",
            labels=["pool", "view", "adopted"],
        )
        layout_held = GaugeMetricFamily(
            "kvrouter_replica_layout_held",
            "1 while the replica's view of the learned layout keeps it from predicting:"
            " outvoted (quarantined) or contested",
            labels=[*rank, "state"],
        )
        # Replica health (router.core.health), per replica *name*: probes and ejections are
        # per HTTP server, whatever its DP ranks.
        health = [
            (key, cls(f"kvrouter_replica_{key}", doc, labels=["pool", "replica"]))
            for key, cls, doc in (
                ("up", GaugeMetricFamily, "1 while its health probes succeed (or are off)"),
                ("ejected", GaugeMetricFamily, "1 while ejected for failed requests"),
                ("routable", GaugeMetricFamily, "1 if new requests may go to it"),
                ("ejections", CounterMetricFamily, "Ejections for consecutive failed attempts"),
                ("probe_failures", CounterMetricFamily, "Health probes that failed"),
            )
        ]
        for pool in self._snapshot():
            name = pool["pool"]
            for h in pool.get("health", ()):
                for key, family in health:
                    family.add_metric([name, h["replica"]], float(h[key]))
            entries.add_metric([name], pool["entries"])
            w = pool.get("wipes")
            if w is not None:
                wipes.add_metric([name, "deferred"], w["deferred"])
                wipes.add_metric([name, "sync"], w["sync"])
                sweep_steps.add_metric([name], w["sweep_steps"])
                sweep_passes.add_metric([name], w["sweep_passes"])
                swept.add_metric([name], w["swept_keys"])
                dead.add_metric([name], w["dead_slots"])
            nbytes.add_metric([name], pool["bytes"])
            for (rname, rk), n in (pool.get("prefix_homes") or {}).items():
                homes.add_metric([name, rname, str(rk)], n)
            for (rname, rk), n in (pool.get("prefix_families") or {}).items():
                families.add_metric([name, rname, str(rk)], n)
            for (rname, rk), n in (pool.get("fair_share_overrides") or {}).items():
                overrides.add_metric([name, rname, str(rk)], n)
            for (rname, rk), n in (pool.get("eviction_forecasts") or {}).items():
                lowered.add_metric([name, rname, str(rk)], n)
            lay = pool.get("layout")
            if lay is not None:
                for st in LAYOUT_STATUSES:
                    layout_status.add_metric([name, st], 1.0 if lay.status == st else 0.0)
                for v in lay.views:
                    layout_views.add_metric([name, v.view, str(int(v.adopted))], len(v.replicas))
            memo = pool.get("hash_memo")
            if memo is not None:
                memo_steps.add_metric([name], memo["steps"])
                memo_capacity.add_metric([name], memo["capacity"])
            for rs in pool["replica_stats"]:
                rep = [name, rs.replica, str(rs.dp_rank)]
                trusted.add_metric(rep, 1.0 if rs.trusted else 0.0)
                for st in ("exact", "partial", "untrusted"):
                    trust_state.add_metric([*rep, st], 1.0 if rs.trust == st else 0.0)
                for reason, n in rs.ingest_errors.items():
                    ingest.add_metric([*rep, reason], n)
                if rs.layout_hold is not None:
                    layout_held.add_metric([*rep, rs.layout_hold], 1.0)
                for outcome in (
                    "stored_blocks",
                    "removed_blocks",
                    "unknown_removals",
                    "conformance_mismatches",
                    "inferred_blocks",
                    "closure_kept",
                    "older_copy_evicted",
                    "witnessed_parents",
                    "implied_blocks",
                    "answer_keys_skipped",
                    "resets",
                    "late_attaches",
                    "wipes",
                    "sync_wipes",
                ):
                    outcomes.add_metric([*rep, outcome], getattr(rs, outcome))
            keys = pool.get("stream_keys", {})
            for stream, st in pool["stream_stats"].items():
                key = keys.get(stream)
                if key is None:  # every subscribed stream has one (PoolState._open_streams)
                    continue
                rep = [name, key[0], str(key[1])]
                for typ, n in st.events_by_type.items():
                    events.add_metric([*rep, typ], n)
                if st.lag_s is not None:
                    lag.add_metric(rep, st.lag_s)
                for kind in (
                    "gaps",
                    "replays",
                    "unrecoverable_gaps",
                    "replay_drops",
                    "resets",
                    "malformed",
                ):
                    gaps.add_metric([*rep, kind], getattr(st, kind))
        yield from (entries, nbytes, memo_steps, memo_capacity, homes, families, overrides)
        yield lowered
        yield from (wipes, sweep_steps, sweep_passes, swept, dead)
        yield from (events, outcomes, lag, gaps)
        yield from (trusted, trust_state, ingest, layout_status, layout_views, layout_held)
        yield from (family for _, family in health)


class RouterMetrics:
    """Every metric of one router app."""

    def __init__(self, snapshot: Callable[[], Iterable[dict[str, Any]]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvrouter_requests",
            'Requests on /v1/* by pool, the replica that answered ("": the router did) and '
            "the HTTP status the client got",
            ["pool", "replica", "status", "status_class"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvrouter_request_duration_seconds",
            "Request arrival to its last response byte, as the client saw it",
            ["pool"],
            buckets=_TOTAL_BUCKETS,
            registry=r,
        )
        self.router_added = Histogram(
            "kvrouter_router_added_seconds",
            "Latency the router adds: body received to the first attempt sent (parse, "
            "tokenize, predict, choose)",
            ["pool"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_ttft = Histogram(
            "kvrouter_upstream_ttft_seconds",
            "Streamed requests: the answering attempt sent to its first chunk (time to first "
            "token, queueing and prefill included)",
            ["pool"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.failovers = Counter(
            "kvrouter_failovers", "Attempts abandoned before the first byte",
            ["pool", "replica"], registry=r,
        )  # fmt: skip
        self.scrape_failures = Counter(
            "kvrouter_metrics_scrape_failures",
            "Reads of a replica's /metrics that failed, by reason: timeout (no whole answer "
            "within server.connect_timeout_s), too_large, http_status, unreachable",
            ["pool", "replica", "reason"],
            registry=r,
        )
        self.midstream_failures = Counter(
            "kvrouter_midstream_failures",
            "Streamed responses cut short by the replica failing after the first byte",
            ["pool", "replica"],
            registry=r,
        )
        self.untokenized = Counter(
            "kvrouter_untokenized_requests",
            "Requests routed by load because they could not be tokenized",
            ["pool", "reason"],
            registry=r,
        )
        self.report_mode_full = Counter(
            "kvrouter_report_mode_full_requests",
            "Requests asking vLLM for kv_cache_report_mode=full, stripped or refused "
            "(server.report_mode_full)",
            ["pool", "action"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvrouter_decision_seconds",
            "Tokenize + predict + policy time per request",
            ["pool"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.predicted_hit = Histogram(
            "kvrouter_predicted_hit_tokens",
            "Predicted hit of the chosen replica",
            ["pool"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        rank = ["pool", "replica", "dp_rank"]
        self.prediction_error = Histogram(
            "kvrouter_prediction_abs_error_tokens",
            "|cached_tokens reported - predicted| per replica and rank",
            rank,
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self.prediction_exact = Counter(
            "kvrouter_prediction_exact", "Predictions equal to cached_tokens", rank, registry=r
        )
        self.prediction_checked = Counter(
            "kvrouter_prediction_checked", "Predictions compared with cached_tokens", rank,
            registry=r,
        )  # fmt: skip
        self.prediction_outcomes = Counter(
            "kvrouter_prediction_outcomes",
            "Predicted hit of the chosen replica against vLLM's cached_tokens: exact, under or"
            " over; basis events = the events-only hit (x-kvrouter-predicted-hit), in_flight ="
            " events plus the requests routed ahead of it (x-kvrouter-in-flight-hit), admission"
            " = that minus the evictions their allocations will cause (x-kvrouter-expected-hit)",
            ["pool", "basis", "outcome"],
            registry=r,
        )
        self.refused = Counter(
            "kvrouter_refused_requests",
            "Requests answered with an error before reaching a replica (auth, origin, content "
            "type, body size, malformed body, unknown path or model), by reason",
            ["reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvrouter_in_flight", "Requests in flight per replica", ["pool", "replica"],
            registry=r,
        )  # fmt: skip
        self.client_disconnects = Counter(
            "kvrouter_client_disconnects",
            "Clients gone before their answer was complete (the replica's request is closed):"
            " phase waiting (nothing sent yet) or streaming",
            ["pool", "phase"],
            registry=r,
        )
        self.header_refusals = Counter(
            "kvrouter_header_refusals",
            "Connections closed for their request headers: timeout (over server."
            "header_timeout_s) or too_large (over server.max_header_bytes, answered 431)",
            ["reason"],
            registry=r,
        )
        # Kubernetes discovery (router.server.discovery), per pool with discovery = kubernetes
        self.discovery_events = Counter(
            "kvrouter_discovery_events",
            "Pod watch events received, by type (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR)",
            ["pool", "type"],
            registry=r,
        )
        self.discovery_relists = Counter(
            "kvrouter_discovery_relists",
            "Pod lists (the start, after 410 Gone, after a broken event, after an error)",
            ["pool", "reason"],
            registry=r,
        )
        self.discovery_errors = Counter(
            "kvrouter_discovery_errors",
            "Pod list/watch failures by reason (connect, timeout, disconnected, http_<code>, "
            "gone, malformed, config, add_failed, internal); each is retried",
            ["pool", "reason"],
            registry=r,
        )
        self.discovery_refused = Counter(
            "kvrouter_discovery_refused_pods",
            "Pod versions not made replicas: bad_annotation, bad_pod, name_clash (a static "
            "or admin replica has its name)",
            ["pool", "reason"],
            registry=r,
        )
        self.discovery_changes = Counter(
            "kvrouter_discovery_replica_changes",
            "Replica changes made by discovery: added, replaced, drained, undrained, removed "
            "(idle) and removed_timeout (drain_timeout_s passed with requests in flight)",
            ["pool", "change"],
            registry=r,
        )
        self.discovery_replicas = Gauge(
            "kvrouter_discovery_replicas",
            "Replicas discovery holds, by state: serving or draining",
            ["pool", "state"],
            registry=r,
        )
        self.discovery_connected = Gauge(
            "kvrouter_discovery_connected",
            "1 while the pool's pod watch stream is open",
            ["pool"],
            registry=r,
        )
        if snapshot is not None:
            r.register(_StateCollector(snapshot))
        self._exposed = _WithoutCreated(r)

    def forget_replica(self, pool: str, replica: str) -> None:
        """Drop every series labelled with a replica that left the pool. A fleet whose pods
        come and go under new names (Kubernetes discovery) would otherwise keep a set of
        counters and histogram buckets per replica it ever had, in the router's memory and
        in every scrape, for as long as the router runs."""
        for metric in vars(self).values():
            if isinstance(metric, MetricWrapperBase):
                try:
                    metric.remove_by_labels({"pool": pool, "replica": replica})
                except ValueError:  # a metric without these labels
                    continue

    def render(self) -> bytes:
        """The text exposition, without ``*_created`` series."""
        return generate_latest(self._exposed)  # type: ignore[arg-type]


class _WithoutCreated:
    """The registry's families without their ``<name>_created`` samples: a timestamp per
    labelled child that doubles the series count and that no query of ours reads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family
