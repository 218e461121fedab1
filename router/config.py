"""The router's configuration: one msgspec schema for the TOML file, env vars and flags.

Precedence, highest first (documented for operators in ``config/router-sim.toml``):

1. command-line flags of ``kvrouter serve`` (``--host``, ``--port``, ``--admin-token``, ...);
2. environment variables ``KVROUTER_<FIELD>`` for ``[server]`` fields (``KVROUTER_PORT``,
   ``KVROUTER_ADMIN_TOKEN``, ...), ``KVROUTER_INDEX_<FIELD>`` for ``[index]`` fields and
   ``KVROUTER_HEALTH_<FIELD>`` for ``[health]`` fields;
3. the TOML file given with ``--config``, or the pool that ``kvrouter serve``'s quick-start flags
   (``--model``, ``--replica``, ...) describe instead of a file (router.config_flags);
4. the defaults below.

The same Struct validates every source (overrides are applied to the decoded file as plain
data and the whole document is validated once more), so a bad value names its path whichever
source it came from: ``router.toml: Expected `int`, got `str` - at `$.server.port```.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from events.layout import LayoutError, ModelLayout, resolve
from events.publisher import EndpointError, offset_endpoint_port, validate_endpoint
from router.core.index import IndexLimits
from router.core.label_selector import SelectorError, parse_selector

__all__ = [
    "ConfigError",
    "HealthConfig",
    "IndexConfig",
    "KubernetesConfig",
    "PolicyConfig",
    "PoolConfig",
    "ReplicaConfig",
    "RouterConfig",
    "ServerConfig",
    "StreamConfig",
    "TokenizerConfig",
    "apply_overrides",
    "convert_config",
    "effective_overrides",
    "env_overrides",
    "is_loopback",
    "load_config",
    "parse_bool",
    "parse_config",
]

ENV_PREFIX = "KVROUTER_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ORIGIN = re.compile(r"^https?://[^/\s?#]+$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class ConfigError(ValueError):
    """A configuration that cannot start the router; the message names the file, the field
    path and the fix."""


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The HTTP face and its limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    admin_enabled: bool = True
    admin_token: str | None = None
    """Bearer token of ``/admin``. Required when ``host`` is not a loopback address. Without
    it, admin requests must also name a loopback ``Host`` (no DNS-rebound names)."""
    api_key: str | None = None
    """Bearer key of every ``/v1/*`` path, as vLLM's ``--api-key`` (``Authorization: Bearer
    <key>``; 401 otherwise). Unset: ``/v1/*`` is open."""
    max_body_bytes: int = 8 << 20
    """Larger bodies of the two proxied routes get 413 before anything is parsed."""
    admin_max_body_bytes: int = 1 << 20
    """The body limit of every other route (``/admin`` and anything else)."""
    admin_endpoint_schemes: tuple[Literal["tcp", "ipc", "inproc"], ...] = ("tcp",)
    """ZeroMQ schemes a replica added through ``POST /admin/replicas`` may use for its event
    and replay endpoints (the config file may use any). ``ipc`` names a path on this host and
    ``inproc`` this process's sockets: allow them only where every admin caller may."""
    admin_allow_bind: bool = False
    """Whether ``POST /admin/replicas`` may add a replica with ``bind = true`` (the router then
    binds a socket on this host). Even then an ``ipc://`` path that exists is refused."""
    admin_allowed_origins: tuple[str, ...] = ()
    """Browser origins (``scheme://host[:port]``) besides the router's own that may send admin
    mutations. Any other ``Origin`` (or ``Sec-Fetch-Site: cross-site``) gets 403."""
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    """Longest silence between two bytes of a replica's response, once its first byte came
    (the stream idle timeout)."""
    ttfb_timeout_s: float = 30.0
    """Streaming requests: longest wait from sending the request to a replica to the first
    byte of its response; then the next replica is tried (``max_attempts``). vLLM starts a
    stream's response before the first token, so this finds a hung replica without limiting
    queueing or prefill (the wait for the first token is bounded by ``read_timeout_s``)."""
    ttfb_timeout_nonstream_s: float = 600.0
    """The same for non-streaming requests. vLLM sends nothing of a non-streaming answer
    until the whole generation is done, so this bounds the whole generation: keep it above
    the longest one you serve, or a slow answer is abandoned and generated again on the next
    replica."""
    header_timeout_s: float = 10.0
    """Longest time a client may take to send a request line and headers, counted from the
    connection's opening (or, on a kept-alive connection, from the request's first byte);
    then the router closes the connection (slowloris)."""
    max_header_bytes: int = 1 << 16
    """Largest request line + headers a client may send (bytes); larger gets 431 and the
    connection is closed."""
    keep_alive_s: float = 75.0
    """How long an idle kept-alive client connection stays open after a response. Keep it above
    the idle lifetime of every client pool and load balancer in front of the router: if the
    router closes a connection the client still thinks reusable, a request written onto it as
    it closes is lost with a connection error and never reaches the router (the client is told
    nothing useful, the router counts nothing). uvicorn's 5 s equals httpx's (and the OpenAI
    SDK's) 5 s pool expiry; with it one request of 1,350 in a benchmark round
    (bench/real_vllm/load.py) ended in a ``ReadError`` with no response, this race's
    signature. 75 s is nginx's default and above the common 60 s of cloud load balancers and
    ingress-nginx's upstream pools. Each idle connection holds one descriptor."""
    max_attempts: int = 3
    """Replicas tried per request (failover happens only before the first response byte)."""
    metrics_scrape_interval_s: float = 1.0
    """How often each replica's ``/metrics`` is read for running/waiting/KV usage (0: never)."""
    mismatch_log_size: int = 100
    stream_usage: bool = True
    """Set ``stream_options.include_usage`` on streaming requests that lack it, so every
    answer reports ``cached_tokens`` (the prediction check, and learning what a replica held
    before the router attached), and strip the usage event from the client's stream again."""
    report_mode_full: Literal["strip", "refuse"] = "strip"
    """A request with ``vllm_xargs.kv_cache_report_mode = "full"`` makes vLLM re-announce
    the prefix it reused as ``BlockStored`` events that store nothing (null positions of
    sliding-window and Mamba groups included, spec §5.4): counted as copies they would make
    the index claim blocks the replica does not hold. ``strip`` removes the key before
    forwarding (the replica reports incrementally, as by default); ``refuse`` answers 400."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    """``text``: ``<time> <LEVEL> <logger>: <message> key=value ...``; ``json``: one object per
    line with ``ts``, ``level``, ``logger``, ``message`` and the line's fields
    (router.server.logs)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        for f in ("max_body_bytes", "admin_max_body_bytes"):
            if getattr(self, f) < 1024:
                raise ValueError(f"{f} must be >= 1024, got {getattr(self, f)}")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 seconds")
        for name in (
            "ttfb_timeout_s",
            "ttfb_timeout_nonstream_s",
            "header_timeout_s",
            "keep_alive_s",
        ):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.metrics_scrape_interval_s < 0:
            raise ValueError("metrics_scrape_interval_s must be >= 0 (0 disables scraping)")
        for origin in self.admin_allowed_origins:
            if not _ORIGIN.match(origin):
                raise ValueError(
                    f"admin_allowed_origins: {origin!r} is not an origin; write "
                    "scheme://host[:port] with no path, e.g. https://ops.example:8443"
                )


class IndexConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_bytes: int = 1 << 30
    """Memory budget of each pool's index (router.core.index ``KVIndex.nbytes``: its tables,
    hashes and replica bitmasks: about 25-45 bytes per key with the compact tables of
    router.core._keytable, 70-160 with dict tables, more with more replicas;
    docs/index-memory.md)."""
    replay_timeout_s: float = 2.0
    max_groups: int = 64
    """Events with ``group_idx`` outside ``0..max_groups-1`` are refused (counted, replica
    untrusted) before anything is allocated for them."""
    max_block_size: int = 1 << 16
    """Stores announcing a larger ``block_size`` (tokens) are refused, never learned."""
    max_extra_tiers: int = 8
    """Connector ``medium`` names each replica may bring as tiers of their own besides
    GPU/CPU/STORAGE (per replica: one replica's junk names never crowd out another's)."""
    warn_interval_s: float = 60.0
    """One log warning per (replica, reason) per interval; every occurrence is counted."""
    max_dead_slots: int = 64
    """Wiped replicas' old slots the index may keep while its sweep clears them from keys (a
    wipe takes a fresh slot at once instead of scanning the index); past it a wipe scans the
    index at once (``kvrouter_index_wipes_total{mode="sync"}``)."""
    sweep_step: int = 2048
    """Table slots one step of that sweep reads (one step after each applied batch, and on a
    timer): smaller steps stall the event loop less and finish later."""
    max_witness_keys: int = 1 << 16
    """Keys a *partial* replica's eviction-order proof keeps a record for (about 250 bytes
    each, only while partial: router.core.eviction_order); past it, after dropping those the
    index no longer holds, the proof turns off for that replica. 0 turns it off."""
    snapshot_path: str | None = None
    """Where the router writes its index on shutdown (and every ``snapshot_interval_s``) and
    reads it back at start, resuming each replica's stream where the file left off: a restart
    within the replicas' replay rings is exact at once (router.core.snapshot)."""
    snapshot_interval_s: float = 0.0
    """Also write the snapshot this often (0: only on shutdown)."""
    bootstrap_peer: str | None = None
    """URL of a running router of the same fleet: at start, its ``/admin/index/snapshot`` is
    loaded (with this router's admin token) instead of the file."""
    bootstrap_timeout_s: float = 60.0
    """The whole snapshot GET from ``bootstrap_peer``, body included: past it the router
    starts without (replaying the rings), so a peer that hangs or drips its answer cannot
    hold the start."""
    bootstrap_max_bytes: int = 4 << 30
    """The largest snapshot taken from ``bootstrap_peer``; a larger one is refused (the rings
    are replayed), not read into memory."""

    def __post_init__(self) -> None:
        if self.max_bytes < 1 << 20:
            raise ValueError(f"max_bytes must be >= 1 MiB, got {self.max_bytes}")
        if self.replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be > 0")
        if not 1 <= self.max_groups <= 4096:
            raise ValueError(f"max_groups must be in 1..4096, got {self.max_groups}")
        if self.max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {self.max_block_size}")
        if self.max_extra_tiers < 0 or self.warn_interval_s < 0 or self.snapshot_interval_s < 0:
            raise ValueError(
                "max_extra_tiers, warn_interval_s and snapshot_interval_s must be >= 0"
            )
        if self.max_dead_slots < 0 or self.sweep_step < 1:
            raise ValueError("max_dead_slots must be >= 0 and sweep_step >= 1")
        if self.max_witness_keys < 0:
            raise ValueError(f"max_witness_keys must be >= 0, got {self.max_witness_keys}")
        if self.bootstrap_timeout_s <= 0 or self.bootstrap_max_bytes < 1:
            raise ValueError("bootstrap_timeout_s must be > 0 and bootstrap_max_bytes >= 1")
        if self.bootstrap_peer is not None and not self.bootstrap_peer.startswith(
            ("http://", "https://")
        ):
            raise ValueError(f"bootstrap_peer must be an http(s) URL, got {self.bootstrap_peer!r}")

    def limits(self) -> IndexLimits:
        """The index bounds this config sets."""
        return IndexLimits(
            max_bytes=self.max_bytes,
            max_groups=self.max_groups,
            max_block_size=self.max_block_size,
            max_extra_tiers=self.max_extra_tiers,
            warn_interval_s=self.warn_interval_s,
            max_dead_slots=self.max_dead_slots,
            sweep_step=self.sweep_step,
            max_witness_keys=self.max_witness_keys,
        )


class HealthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When a replica is taken out of rotation and when it comes back (router.core.health).

    Two signals, combined: an *active probe* (``GET probe_path`` on every replica, 200 =
    up) and *passive outlier ejection* (consecutive proxied attempts that failed before the
    first response byte). A replica is routable while its probe says up and it is not
    ejected; an ejection lasts ``eject_base_s * 2**k`` (``k``: ejections since its last
    success, capped at ``eject_max_s``), then one trial request or probe decides."""

    probe_interval_s: float = 2.0
    """Seconds between two probes of a replica (0: no probes, passive ejection only)."""
    probe_timeout_s: float = 1.0
    """A probe that has no answer after this long failed."""
    probe_path: str = "/health"
    """vLLM's liveness route: 200 while its engine is alive."""
    unhealthy_threshold: int = 2
    """Consecutive failed probes that mark a replica down."""
    healthy_threshold: int = 1
    """Consecutive successful probes that bring a down replica back (half-open)."""
    eject_after_failures: int = 3
    """Consecutive attempts failed before the first byte (connect error, timeout, 5xx) that
    eject a replica."""
    eject_base_s: float = 5.0
    """The first ejection's length; each further one without a success in between doubles."""
    eject_max_s: float = 120.0
    """The longest ejection."""

    def __post_init__(self) -> None:
        if self.probe_interval_s < 0:
            raise ValueError("probe_interval_s must be >= 0 (0 disables the probes)")
        if self.probe_timeout_s <= 0:
            raise ValueError("probe_timeout_s must be > 0")
        if not self.probe_path.startswith("/"):
            raise ValueError(f"probe_path must start with '/', got {self.probe_path!r}")
        for f in ("unhealthy_threshold", "healthy_threshold", "eject_after_failures"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if not 0 < self.eject_base_s <= self.eject_max_s:
            raise ValueError(
                f"need 0 < eject_base_s <= eject_max_s, got {self.eject_base_s} and "
                f"{self.eject_max_s}"
            )

    def window_s(self) -> float:
        """The longest a dead replica stays routable once the probes see it gone (the probe
        after the one that failed first: ``unhealthy_threshold`` probes, each up to
        ``probe_timeout_s``); ``inf`` without probes."""
        if self.probe_interval_s == 0:
            return float("inf")
        n = self.unhealthy_threshold
        return n * self.probe_interval_s + n * self.probe_timeout_s


class TokenizerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the router computes the token ids the replica will compute (router.core.tokenize)."""

    strategy: Literal["builtin", "local", "remote"] = "builtin"
    path: str | None = None
    """``local``: the directory holding the replica's ``tokenizer.json`` and
    ``tokenizer_config.json`` (the same files vLLM loads)."""
    timeout_s: float = 2.0
    """``remote`` (and ``template_args = "remote"``): how long a replica's ``/tokenize`` may
    take before routing by load."""
    template_args: Literal["remote", "load_only"] = "remote"
    """``local``: a chat with ``tools``, ``chat_template_kwargs``, its own ``chat_template``,
    ``continue_final_message`` or ``tool_calls`` is tokenized by a replica's ``/tokenize``
    (vLLM's renderer: exact; one round trip for those requests), or routed by load."""

    def __post_init__(self) -> None:
        if self.strategy == "local" and not self.path:
            raise ValueError("strategy 'local' needs `path`: the replica's tokenizer directory")


DEFAULT_FAMILY_SPREAD_TOKENS = 2048.0
"""``PolicyConfig.family_spread_tokens`` where it is unset and prefix homes are on."""


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The cost model's knobs (router.core.policy documents the formula)."""

    name: Literal["kv", "round_robin", "least_load", "prefix_group_blind"] = "kv"
    per_request_tokens: float = 256.0
    """Queued work of one running request, in prefill-token equivalents."""
    waiting_request_tokens: float = 1024.0
    """Queued work of one request waiting in the replica's queue: about one uncached prompt.

    Both chosen by a sweep (64/256, 128/512, 256/1024, 512/2048) on the simulator's targeted
    scenarios and the Mooncake trace (bench/routing_scenarios.py and bench/routing_sim.py with
    ``--policy-option``): at 64/256 the kv policy kept every request of a prefix on its busy
    home while an idle replica holding the full-attention prefix waited, and its TTFT p90 under
    heavy load was 0.254 s against group-blind's 0.133 s; at 256/1024 it was 0.145 s against
    0.205 s, with kv's cached share still above group-blind's in every scenario. 512/2048 gave
    up more reuse (Mooncake fa_swa, 16 replicas: 30.2 % against 31.3 %)."""
    lookahead_weight: float = 2.0
    """Credit per token of the full-attention prefix a replica holds (future reuse). On two
    real vLLM replicas under concurrent load (bench/real_vllm/load.py, 3 seeds, issue 17) 2.0
    against 1.0 moved 0-5 of ~97 later conversation turns off their replica instead of 6-10
    and raised reuse from 58.3-58.9 % to 60.2-63.5 % (6 runs) with a lower TTFT mean; 3.0
    (6 runs) averaged 61.7 % at a higher TTFT (mean 170 / p90 425 ms against 131 / 326), and
    lighter load terms (128/512 at 2.0) 60.5 % at 257 / 638 ms. The routing simulator's
    earlier sweep had preferred 1.0 (bench/results/REPORT.md, look-ahead sweep). With prefix
    homes (``affinity_weight = 8``) 1.0 against 2.0 on 3 seeds x 2 repeats
    (bench/results/real_vllm_load_lookahead1.md): 62.8 against 62.6 % reuse, TTFT mean 150
    against 151 ms, within the spread."""
    load_band_tokens: float = 0.0
    """Queued work within this many tokens of the least queued candidate counts as equal
    (router.core.policy, load band); 0: every token counts. Off by default: on real vLLM
    under concurrent load (bench/real_vllm/load.py, 3 seeds x 2 repeats) 1024 and 2048 gave
    61.2 / 61.4 % reuse against 60.7 % without, within the spread, at a TTFT mean of 259 /
    178 ms against 131 ms. With prefix homes (3 seeds x 3 repeats, 6-15 in flight,
    bench/results/real_vllm_load_band2.md), 4096 gave 62.1 % against 61.7 % and
    cache_aware's 60.9 %, at a TTFT mean of 242 against 274 and 433 ms, but the undisturbed
    round after it (bench/results/real_vllm_load_band4.md) gave 61.2 % against 62.3 % and
    62.6 %, losing more conversation histories to eviction: off. Ties within the band go to
    the replica whose cache turned over least lately, then the least queued
    (router.core.policy); router.core.shortlist decides banded requests exactly."""
    pressure_weight: float = 0.0
    """Cost per token of cache pressure (``recent_new_tokens``, router.core.pressure, which
    says why it is off by default: no gain measured on real vLLM at 0.05-0.25)."""
    affinity_weight: float = 8.0
    """Credit per prompt token whose prefix the router first sent to a replica (its home,
    router.core.affinity), among the replicas with the longest exact hit; 0 turns prefix homes
    off. On two real vLLM replicas under concurrent load (bench/real_vllm/load.py, issue 17):
    2.0 against 0 raised reuse in 6 of 6 paired runs (59.7 -> 62.3 %, TTFT mean 221 -> 163
    ms; bench/results/real_vllm_load_affinity.md): later turns moved off their conversation's
    replica fell from 6.2 to 0.8 per run, first turns sent where their system prompt had never
    been from 9.0 to 6.5 (the floor is 6, each family's first). 8.0 (with
    ``affinity_max_tokens = 8192``) against 2.0 at ``--rate 3``, 3 seeds x 3 repeats
    (bench/results/real_vllm_load_rate3.md): 62.8 against 61.9 % reuse, more in 8 of 9 pairs,
    lower TTFT mean and p90 in 7 of 9 each; level with vllm-router's ``cache_aware`` there and
    in the next round (bench/results/real_vllm_load_spread.md: 62.9 against 62.7 %), ahead of
    it on three fresh seeds (bench/results/real_vllm_load_fresh456.md, 3 seeds x 2 repeats:
    62.7 against 61.4 %, more in 5 of 6 pairs, per seed +1.5 / +0.4 / +2.0); at --rate 6 ahead
    on seeds 1-3 (real_vllm_load_rate6.md: 63.1 against 62.4 %, 6 of 6 pairs) and level on
    seeds 4-6 (real_vllm_load_rate6_fresh.md: 62.5 against 62.5 %, behind on two seeds). 1.0 and 4.0
    were measured too (README, issue 17). It costs ~22 us per 2,000-token decision
    (bench/decide_bench.py). At fleet scale homes concentrate a prefix every request shares
    on its home: ``affinity_fair_share`` bounds that."""
    affinity_max_tokens: float = 8192.0
    """Bound on the affinity credit, in prefill tokens: the most queued work a home holds a
    request against. Without it one long prefix that every request shares (a fleet-wide agent
    prompt) would pull all traffic to its home until the queue there outweighed
    ``affinity_weight`` times its length. At 2048 (with weight 2) it bound on later turns only,
    which their own hit holds: 62.1 % reuse with it against 62.3 % without, 6 runs each."""
    affinity_fair_share: float = 2.0
    """A home keeps its credit only while it has at most this many times the candidates' mean
    number of requests (``router.core.policy.request_load``, the mean counted as at least one);
    beyond it hit, look-ahead and queue decide as without homes. 0: no bound. With two
    replicas 2 or more never binds (a replica holds at most twice the mean), so the real vLLM
    rounds above measure it too. Where every request shares one prefix on 16 simulated
    replicas (bench/routing_sim.py --agent, bench/results/routing_sim_fair_share.md) it took
    the busiest replica's share of requests from 14.4 to 5.8 times the mean at light load
    (the same as without homes) and from 2.8 to 2.0 at 8x the rate, with the lowest p99 TTFT
    of the kv variants there; on the scaled Mooncake trace it keeps homes x8's reuse (23.1 /
    33.9 % at 4 / 16 replicas) at a higher p99 than weight 2 had. It costs 5-25 us per
    2,000-token decision on top of homes' ~120 us (bench/decide_bench.py, 2-128 replicas,
    medians: "no fair share" against "off")."""
    family_spread_tokens: float | None = None
    """Cost, in prefill tokens, of each prefix family already homed on a replica (a first
    chunk that a second request carried, router.core.affinity), charged only to a request that
    no candidate is home to: a new prefix goes to the replica hosting fewer families unless
    its queue is longer by more than this per family of difference. Without it the first
    request of each family is placed by the queue of that moment, for good: on two real vLLM
    replicas (bench/real_vllm/load.py --rate 3) one run homed five of six families on one
    replica. Unset: :data:`DEFAULT_FAMILY_SPREAD_TOKENS` where prefix homes are on
    (``affinity_weight > 0``), else 0 (no families to count); 0: off. At ``--rate 6`` (README,
    issue 17: thirteen rounds at 2048, eight beside the same policy without it) it kept ``kv``
    at or above vllm-router's ``cache_aware`` on 42 of 46 seeds, and on the four others when
    they were run again with fresh repeats (without it: 20 of 27 in the rounds run beside
    them), +0.38 points of reuse over 0 (more in 40 of 60 pairs). Its latency
    cost is within the runs' noise (the lower TTFT mean in 27 of those 60 pairs, +2.2 % as a
    geometric mean, interval across 0); it can pile the one-offs on the replica with fewer
    families (71 % of them there in one round, and 64 % of the prefill). The decision
    shortlist keeps replicas by family count too (router.core.shortlist), so it costs a few
    scores per decision, not a scan; only with a load band (``load_band_tokens > 0``) does a
    new prefix go to the full scan."""
    affinity_chunk_tokens: int = 64
    """Granularity of prefix homes: a chunk is homed once a request carried all of it."""
    affinity_capacity: int = 100_000
    """Chunks remembered (least recently routed forgotten first; ~100 bytes each)."""
    pressure_half_life_s: float = 30.0
    """How fast cache pressure fades: about the time a replica's cache takes to turn over."""
    lower_tier_weights: dict[str, float] = msgspec.field(
        default_factory=lambda: {"CPU": 0.5, "STORAGE": 0.2}
    )
    kv_usage_threshold: float = 0.95
    kv_pressure_tokens: float = 2048.0
    tie_tokens: float = 0.5
    temperature: float = 0.0
    """0: the lowest cost wins (ties at random); > 0: softmax over -cost / temperature."""
    seed: int | None = None
    speculative_insert: bool = False
    """Count the blocks a just-routed request will cache on its replica as present (for
    routing only) until its events arrive, so a burst sharing a new prefix lands together
    (router.core.speculative). Never changes the reported prediction. Off by default: while
    entries share a request's first block it costs a second prediction and an insert per
    request (bench/proxy_bench.py: router CPU ~0.4 -> ~1.0 ms per 2,000-token request)."""
    speculative_routing: bool = True
    """With ``speculative_insert``: rank replicas on the admission-time hit (false: keep the
    overlay only to report it, ``x-kvrouter-expected-hit``, and route on events alone)."""
    speculative_ttl_s: float = 2.0
    """How long a request's speculative entries outlive its answer without the events that
    confirm them (the events of a finished request are already published; this covers
    their way to the router)."""
    speculative_hold_s: float = 300.0
    """Bound on how long an in-flight request's entries stand before its answer ends (a
    request may wait in vLLM's queue far longer than ``speculative_ttl_s`` before any
    event about it exists)."""
    eviction_forecast: bool = False
    """Take from the admission-time hit (``x-kvrouter-expected-hit``) the cached blocks the
    requests queued ahead on the replica will evict before vLLM admits this one
    (router.core.eviction_forecast; needs the replica's ``vllm:cache_config_info`` and
    ``vllm:kv_cache_usage_perc``). Reported, never routed on. Off by default: on two real
    vLLM replicas at ~20 requests/s it cut the over-predictions by about two thirds but
    added as many under-predictions (README, "Under concurrent load")."""

    def __post_init__(self) -> None:
        if self.family_spread_tokens is None:  # unset: on wherever prefix homes keep families
            spread = DEFAULT_FAMILY_SPREAD_TOKENS if self.affinity_weight > 0 else 0.0
            msgspec.structs.force_setattr(self, "family_spread_tokens", spread)
        if self.speculative_ttl_s <= 0 or self.speculative_hold_s <= 0:
            raise ValueError(
                "speculative_ttl_s and speculative_hold_s must be > 0 "
                "(set speculative_insert = false to turn speculation off)"
            )
        if self.pressure_half_life_s <= 0:
            raise ValueError("pressure_half_life_s must be > 0")
        for f in ("per_request_tokens", "waiting_request_tokens", "lookahead_weight",
                  "pressure_weight", "load_band_tokens", "affinity_weight",
                  "affinity_max_tokens", "affinity_fair_share",
                  "family_spread_tokens"):  # fmt: skip
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.affinity_chunk_tokens < 1 or self.affinity_capacity < 1:
            raise ValueError("affinity_chunk_tokens and affinity_capacity must be >= 1")
        if not math.isfinite(self.affinity_fair_share):
            raise ValueError(
                "affinity_fair_share must be a finite multiple of the mean load (0: no bound)"
            )
        if not math.isfinite(self.family_spread_tokens):
            raise ValueError("family_spread_tokens must be a finite number of tokens (0: off)")
        if self.family_spread_tokens > 0 and self.affinity_weight == 0:
            raise ValueError(
                "family_spread_tokens counts the families prefix homes keep, and "
                "affinity_weight = 0 turns prefix homes off: set affinity_weight > 0 or "
                "family_spread_tokens = 0 (or leave it unset)"
            )
        for tier, w in self.lower_tier_weights.items():
            if tier not in ("CPU", "STORAGE") or not 0 <= w <= 1:
                raise ValueError(
                    f"lower_tier_weights[{tier!r}]: tiers are CPU and STORAGE, weights 0..1"
                )


VLLM_DP_RANK_HEADER = "X-data-parallel-rank"
"""The header vLLM 0.32's OpenAI server reads to serve a request on one DP rank
(entrypoints/generate/base/serving.py)."""


class StreamConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One DP rank's event stream, spelled out (instead of a base endpoint plus ranks)."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None


class ReplicaConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM server. Its events: either ``event_endpoint`` (rank 0's address, other ranks
    offset by vLLM's rule) with ``dp_ranks``, or an explicit ``streams`` list."""

    name: str
    url: str
    event_endpoint: str | None = None
    replay_endpoint: str | None = None
    dp_ranks: tuple[int, ...] = (0,)
    streams: tuple[StreamConfig, ...] = ()
    dp_rank_header: str | None = None
    """Header naming the DP rank the router chose. Unset: vLLM's own ``X-data-parallel-rank``
    when the URL serves several ranks (its API server then sends the request to that engine
    core instead of balancing it itself, so the rank predicted is the rank served; spec §6.7),
    none for one rank. ``""`` with several ranks is refused: vLLM's balancer would pick the
    rank and no per-rank prediction could hold."""
    bind: bool = False
    """Bind the SUB socket (when vLLM's PUB connects: its endpoint has no ``*``/``::``)."""
    topic: str = ""
    metrics_path: str | None = "/metrics"

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"replica name {self.name!r}: use letters, digits, '.', '_', '-'")
        if not self.url.startswith("http://"):
            raise ValueError(
                f"url {self.url!r} must start with http:// (the proxy speaks plain HTTP/1.1 "
                "to replicas, like vLLM serves; terminate TLS in front of the router)"
            )
        if self.streams and self.event_endpoint:
            raise ValueError("give either event_endpoint (+ dp_ranks) or streams, not both")
        if not self.dp_ranks or any(r < 0 for r in self.dp_ranks):
            raise ValueError("dp_ranks must list ranks >= 0")
        if self.dp_rank_header == "" and len(self.ranks()) > 1:
            raise ValueError(
                f"replica {self.name!r} serves DP ranks {self.ranks()} and dp_rank_header is "
                "empty: without the header vLLM balances the ranks itself and kvrouter cannot "
                "know which rank's cache a request meets; leave dp_rank_header unset (vLLM's "
                "X-data-parallel-rank is sent) or list each rank as its own replica"
            )
        try:
            for ep in (self.event_endpoint, self.replay_endpoint):
                if ep is not None:
                    validate_endpoint(ep)
            for s in self.streams:
                validate_endpoint(s.endpoint)
                if s.replay_endpoint:
                    validate_endpoint(s.replay_endpoint)
        except EndpointError as exc:
            raise ValueError(str(exc)) from None

    def stream_list(self) -> list[StreamConfig]:
        """Every DP rank's stream, explicit or derived with vLLM's port offset."""
        if self.streams:
            return list(self.streams)
        if self.event_endpoint is None:
            return []
        return [
            StreamConfig(
                r,
                offset_endpoint_port(self.event_endpoint, r),
                offset_endpoint_port(self.replay_endpoint, r) if self.replay_endpoint else None,
            )
            for r in self.dp_ranks
        ]

    def ranks(self) -> list[int]:
        return [s.dp_rank for s in self.streams] if self.streams else list(self.dp_ranks)

    @property
    def rank_header(self) -> str | None:
        """The header the proxy names the chosen DP rank with (see ``dp_rank_header``)."""
        if self.dp_rank_header is not None:
            return self.dp_rank_header or None
        return VLLM_DP_RANK_HEADER if len(self.ranks()) > 1 else None


class KubernetesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a pool with ``discovery = "kubernetes"`` finds its replicas: the ready pods
    matching ``label_selector`` in ``namespace`` (router.server.discovery watches them,
    router.core.pods turns each into a replica; docs/kubernetes-discovery.md). Each port can
    be overridden per pod by an annotation (``kvrouter.io/http-port``, ``kvrouter.io/events-port``,
    ``kvrouter.io/replay-port``; ``kvrouter.io/dp-ranks`` lists the pod's DP ranks)."""

    namespace: str = ""
    """``""``: the router pod's own namespace (its service-account ``namespace`` file)."""
    label_selector: str = ""
    """Which pods serve this pool, in Kubernetes selector syntax (``app=vllm,tier in (a,b)``).
    Required: an empty selector would take every pod of the namespace."""
    http_port: int = 8000
    """vLLM's HTTP port on the pod."""
    events_port: int = 5557
    """The ``--kv-events-config`` endpoint port of DP rank 0 (rank r: this + r); 0: the pods
    publish no events (routed by load only)."""
    replay_port: int = 5558
    """The replay ROUTER port of rank 0; 0: none."""
    drain_timeout_s: float = 30.0
    """A pod that terminates (or stops being ready) is drained at once and removed when its
    in-flight requests are done, or after this long whatever is left."""
    api_server: str = ""
    """``""``: in-cluster (``KUBERNETES_SERVICE_HOST``/``_PORT``, the service-account token,
    re-read when it rotates, and CA), or the kubeconfig (``KUBECONFIG``, ``~/.kube/config``)
    outside a cluster. A URL (``http://127.0.0.1:8001`` for ``kubectl proxy``, or a test's
    fake API server) is used as it is, without credentials: plain ``http`` is allowed there
    because such a URL is a local proxy that authenticates for the router."""

    def __post_init__(self) -> None:
        if not self.label_selector.strip():
            raise ValueError(
                "label_selector is required (e.g. 'app.kubernetes.io/name=vllm'): an empty "
                "selector would make every pod of the namespace a replica"
            )
        try:
            parse_selector(self.label_selector)
        except SelectorError as exc:
            raise ValueError(f"label_selector: {exc}") from None
        if not 1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be 1..65535, got {self.http_port}")
        for f in ("events_port", "replay_port"):
            if not 0 <= getattr(self, f) <= 65535:
                raise ValueError(f"{f} must be 0..65535 (0: none), got {getattr(self, f)}")
        if not 0 <= self.drain_timeout_s < math.inf:
            raise ValueError(f"drain_timeout_s must be >= 0 seconds, got {self.drain_timeout_s}")
        if self.api_server and not _ORIGIN.match(self.api_server.rstrip("/")):
            raise ValueError(
                f"api_server {self.api_server!r} must be an http(s)://host[:port] URL "
                '(or "" for in-cluster)'
            )
        if self.api_server and not self.namespace:
            raise ValueError(
                "namespace is required with api_server (the router's own namespace is only "
                "known in-cluster)"
            )
        if self.namespace and not _DNS_LABEL.match(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} is not a Kubernetes namespace name")


class SharedTierConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A KV store every replica of the pool loads from (docs/external-tiers.md).

    Its events (any replica's) make a block loadable by all replicas; the router predicts the
    load by the connector's own rule (router.core.external) and reports ``hit_tokens`` =
    local + loaded, as vLLM reports ``cached_tokens``."""

    medium: str = "CPU"
    """The ``medium`` the connector's events carry (any case: vLLM's Mooncake store
    connector writes ``"cpu"``). Its events then no longer count as a per-replica tier."""
    connector: Literal["mooncake_store"] = "mooncake_store"
    """Whose load rule applies: vLLM 0.32's ``MooncakeStoreConnector``."""
    load_cost: float = 0.25
    """What a loaded token costs the policy, as a share of a prefilled token (0: free,
    1: no better than recomputing it)."""
    ttl_s: float = 600.0
    """The store publishes no removals: a key is forgotten this long after its last store
    event. Set it below the time the store keeps a block under load."""
    capacity_blocks: int = 1_000_000
    """At most this many keys are held (the oldest stored go first): about the store's size
    in blocks times the number of groups it stores."""

    def __post_init__(self) -> None:
        if not self.medium or self.medium.upper() == "GPU":
            raise ValueError("shared_tiers.medium must name a connector's tier, not GPU")
        if not 0 <= self.load_cost <= 1 or self.ttl_s <= 0 or self.capacity_blocks < 1:
            raise ValueError(
                "shared_tiers: load_cost must be in 0..1, ttl_s > 0 and capacity_blocks >= 1"
            )


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The replicas serving one model (the ``model`` field of requests selects the pool)."""

    model: str
    replicas: tuple[ReplicaConfig, ...]
    """Static replicas (with ``discovery = "kubernetes"`` too, beside the discovered ones;
    write ``replicas = []`` for none)."""
    discovery: Literal["static", "kubernetes"] = "static"
    """``static``: only ``replicas`` and the admin API; ``kubernetes``: also every ready pod
    the ``[pools.kubernetes]`` table selects."""
    kubernetes: KubernetesConfig | None = None
    layout: ModelLayout = ModelLayout(groups=())
    tokenizer: TokenizerConfig = TokenizerConfig()
    policy: PolicyConfig = PolicyConfig()
    aliases: tuple[str, ...] = ()
    """Other model names routed to this pool (served-model-name aliases)."""
    lora_adapters: dict[str, str] = {}
    """LoRA adapters the replicas serve, name -> path exactly as vLLM was given it
    (``--lora-modules name=path``; the adapter's ``root`` in the replica's ``GET
    /v1/models``). A request whose ``model`` names one goes to this pool, and vLLM hashes
    ``("lora", name, path)`` into every block of it (spec §1.3): a wrong path predicts 0."""
    shared_tiers: tuple[SharedTierConfig, ...] = ()
    """Stores the replicas share (``[[pools.shared_tiers]]``), e.g. a Mooncake store."""

    def __post_init__(self) -> None:
        if self.discovery == "kubernetes" and self.kubernetes is None:
            raise ValueError(
                'discovery = "kubernetes" needs a [pools.kubernetes] table (at least '
                "label_selector)"
            )
        if self.discovery != "kubernetes" and self.kubernetes is not None:
            raise ValueError(
                '[pools.kubernetes] is only read with discovery = "kubernetes" in the same '
                "pool; add it, or remove the table"
            )
        for name, path in self.lora_adapters.items():
            if not name or not path:
                raise ValueError(
                    f"lora_adapters: {name!r} = {path!r}: give the adapter's name and its path "
                    "as vLLM's --lora-modules has them (both non-empty)"
                )
        names = [r.name for r in self.replicas]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"replica names must be unique in a pool; repeated: {sorted(dup)}")
        if self.layout.groups:
            try:
                resolve(self.layout)
            except LayoutError as exc:
                raise ValueError(f"layout: {exc}") from None


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    server: ServerConfig = ServerConfig()
    index: IndexConfig = IndexConfig()
    health: HealthConfig = HealthConfig()
    pools: tuple[PoolConfig, ...] = ()

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError("no pools: add at least one [[pools]] with model and replicas")
        seen: set[str] = set()
        for p in self.pools:
            for name in (p.model, *p.aliases, *p.lora_adapters):
                if name in seen:
                    raise ValueError(
                        f"model name {name!r} is served by two pools (or is both a model and "
                        "a LoRA adapter)"
                    )
                seen.add(name)

    def pool_for(self, model: str | None) -> PoolConfig | None:
        for p in self.pools:
            if model == p.model or model in p.aliases or model in p.lora_adapters:
                return p
        return self.pools[0] if model is None and len(self.pools) == 1 else None

    def redacted(self) -> dict[str, Any]:
        """The config as JSON-ready data, secrets replaced (for ``GET /admin/config``)."""
        data = msgspec.to_builtins(self)
        for secret in ("admin_token", "api_key"):
            if data["server"].get(secret):
                data["server"][secret] = "***"
        return data


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, ``[v6]`` or a name) can only mean this machine.

    Decided from the parsed address (``ipaddress``: ``127.0.0.0/8``, ``::1``, an IPv4-mapped
    ``::ffff:127.x``); of names, ``localhost`` alone counts. A string-prefix test would take
    ``localhost.attacker.example`` or ``127.0.0.1.nip.io``, which resolve anywhere."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "index": IndexConfig,
    "health": HealthConfig,
}


def env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """``KVROUTER_<FIELD>`` -> server.<field>, ``KVROUTER_INDEX_<FIELD>`` -> index.<field>,
    ``KVROUTER_HEALTH_<FIELD>`` -> health.<field>."""
    out: dict[str, dict[str, str]] = {s: {} for s in _SECTIONS}
    for section, cls, prefix in (
        ("index", IndexConfig, ENV_PREFIX + "INDEX_"),
        ("health", HealthConfig, ENV_PREFIX + "HEALTH_"),
        ("server", ServerConfig, ENV_PREFIX),
    ):
        for f in cls.__struct_fields__:
            v = environ.get(prefix + f.upper())
            if v is not None:
                out[section][f] = v
    return out


def parse_bool(value: str) -> bool | None:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case, spaces around) as a bool; ``None``
    for anything else, which the caller refuses in its own words (env, flags)."""
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    return None


def _coerce(cls: type, field: str, value: Any) -> Any:
    """A string from env or flags, as the field's type wants it (the Struct validates)."""
    if not isinstance(value, str):
        return value
    default = getattr(cls(), field, None)  # an unknown field: the Struct refuses it by name
    if isinstance(default, tuple):  # a list from env: comma-separated
        return [x.strip() for x in value.split(",") if x.strip()]
    if isinstance(default, bool):
        flag = parse_bool(value)
        return value if flag is None else flag
    for typ in (int, float):
        if isinstance(default, typ):
            try:
                return typ(value)
            except ValueError:
                return value
    return value


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Mapping[str, Any]]) -> None:
    """Merge ``{"server": {...}, "index": {...}, "health": {...}}`` into decoded file data,
    in place."""
    classes = _SECTIONS
    for section, values in overrides.items():
        if not values:
            continue
        target = data.setdefault(section, {})
        for k, v in values.items():
            if v is not None:
                target[k] = _coerce(classes[section], k, v)


def convert_config(
    data: dict[str, Any],
    *,
    source: str = "<config>",
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> RouterConfig:
    """Validate decoded config data (a TOML file's, or the one ``kvrouter serve``'s quick-start
    flags build, router.config_flags) after merging ``overrides`` into it; errors become
    :class:`ConfigError` naming ``source`` and the field's path."""
    if overrides:
        for section, values in overrides.items():
            given = data.get(section)
            if values and given is not None and not isinstance(given, dict):
                raise ConfigError(
                    f"{source}: `{section}` must be a table ([{section}]), not "
                    f"{type(given).__name__} {given!r}: the environment or flags set "
                    f"{', '.join(sorted(values))} in it"
                )
        apply_overrides(data, overrides)
    try:
        return msgspec.convert(data, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def parse_config(
    text: str | bytes,
    *,
    source: str = "<config>",
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> RouterConfig:
    """Decode and validate TOML text; errors become :class:`ConfigError` naming ``source``."""
    try:
        data = msgspec.toml.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return convert_config(data, source=source, overrides=overrides)


def effective_overrides(
    environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """The env vars' and then the flags' overrides, flags winning (the module docstring)."""
    env = env_overrides(os.environ if environ is None else environ)
    merged: dict[str, dict[str, Any]] = {k: dict(v) for k, v in env.items()}
    if flags:
        merged["server"].update({k: v for k, v in flags.items() if v is not None})
    return merged


def load_config(
    path: str | os.PathLike[str],
    *,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> RouterConfig:
    """The effective config: file, then env, then flags (see the module docstring)."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror}") from None
    return parse_config(text, source=str(p), overrides=effective_overrides(environ, flags))
