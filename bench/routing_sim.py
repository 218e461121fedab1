"""Trace-driven routing simulator: the Mooncake trace through the router's own code, no HTTP.

Per run: N in-process replicas, each a ``gpu_emitter.hybrid_pool.HybridBlockPool`` (vLLM 0.32
caching and events; KV tensor writes skipped: they change no hit and no event) scheduled like
``gpu_emitter.engine`` (running requests first, FIFO admission, preemption from the back,
one event batch per step) on a **simulated clock** whose step times come from
``gpu_emitter.cost_model.CostModel``. The router side is the server's code path: each step's
``take_events()`` goes into a ``router.core.index.KVIndex`` via ``apply_events`` (at once, or after
``--event-delay`` simulated seconds), ``router.core.predict.Predictor`` computes every replica's
hit, and ``router.core.policy`` chooses, with the service's candidate terms (router in-flight
count, pending prefill, running/waiting/KV usage read from the replica as a fresh
``/metrics`` scrape would, the prefix homes of routed requests (router.core.affinity) and each
replica's cache pressure (router.core.pressure) on the simulated clock).

A policy may carry its own PolicyConfig fields, as in bench/real_vllm/load.py:
``--policies kv,kv:affinity_weight=0`` compares the shipped prefix homes with none. Token-valued
fields are in the simulator's tokens: with the default scaling (a 512-token trace block becomes
32 tokens) a credit or a queue term weighs 16 times what it would on real prompts, and a
64-token home chunk covers two trace blocks. ``--block-tokens 512`` replays the trace at its
real size, where the fields mean what they mean in production.

Bounds: ``oracle`` runs the ``kv`` cost model on each pool's true state at decision time
(``pool.find_hit``); ``infinite`` is the reuse of the trace itself with unlimited capacity on
one replica (:func:`gpu_emitter.workload.trace_reuse_bound`; layout-blind, so an upper bound).

Prediction error, per routed request on the chosen replica:

* ``err_now``: predicted hit minus ``pool.find_hit`` at decision time. With in-order events
  this must be 0 for every request (a non-zero value is a bug in the index/predictor).
* ``err_admit``: predicted hit minus the hit ``pool.admit`` returned when the request was
  admitted (later, if it queued: requests admitted in between change the cache). This is what
  a router can observe from ``cached_tokens``.
* ``blind_over``: the group-blind prediction minus the true hit at decision time (what other
  routers believe: never under, over on sliding-window layouts).

Scaling (stated in every result): see :mod:`gpu_emitter.workload`; defaults: one 512-token trace
block becomes 32 tokens (all token counts / 16), prefill costs ``0.05 ms x 16`` per scaled
token (20 k real tokens/s), one decode step (one scaled output token) 20 ms, arrivals sped up
so that each replica sees about 0.8 requests/s whatever the sample and the replica count
(``time_scale = 4.25 / (session_stride * N)``; the trace averages 3.4 requests/s).

Usage::

    .venv/bin/python bench/routing_sim.py            # full matrix (tens of minutes, 2 cores)
    .venv/bin/python bench/routing_sim.py --quick    # 1/20 of the conversations, 3 seeds, ~2 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_emitter.tokenizer import NUM_WORDS, WORD_OFFSET  # noqa: E402
from gpu_emitter.workload import (  # noqa: E402
    ScaledRequest,
    Scaling,
    agent_trace,
    default_trace_path,
    load_trace,
    scale_trace,
    synthetic_trace,
    trace_reuse_bound,
)
from router.config import PolicyConfig  # noqa: E402
from router.core.affinity import PrefixHomes  # noqa: E402
from router.core.index import KVIndex  # noqa: E402
from router.core.policy import Candidate, make_policy  # noqa: E402
from router.core.predict import Predictor  # noqa: E402
from router.core.pressure import DecayingSum  # noqa: E402

RESULTS = ROOT / "bench" / "results"
POLICIES = ("kv", "prefix_group_blind", "least_load", "round_robin")
ORACLE = "oracle"
#: What the tables call each policy (``kv`` is the hybrid-hit policy: ours).
LABEL = {
    "kv": "hybrid",
    "prefix_group_blind": "prefix_group_blind",
    "least_load": "least_load",
    "round_robin": "round_robin",
    "oracle": "oracle (true pool state)",
}


@dataclass(frozen=True)
class SimConfig:
    """One simulated run (what, where, how fast)."""

    layout: str = "fa_swa"
    replicas: int = 4
    policy: str = "kv"
    seed: int = 0
    num_blocks: int = 4096
    prefill_ms_per_token: float = 0.05
    """Per *real* token; per scaled token it is divided by the token factor."""
    decode_ms_per_step: float = 20.0
    step_overhead_ms: float = 0.5
    max_num_seqs: int = 256
    event_delay_s: float = 0.0
    lookahead_weight: float | None = None
    """None: PolicyConfig's default."""
    policy_options: tuple[tuple[str, float], ...] = ()
    """Other PolicyConfig fields to set (``--policy-option per_request_tokens=256``)."""
    check_all: bool = False
    """Check ``err_now`` on every replica, not only the chosen one (slower; for tests)."""


@dataclass
class _Req:
    src: ScaledRequest
    tokens: list[int]
    req_id: str
    replica: int = -1
    predicted: int = 0
    blind_predicted: int = 0
    true_now: int = 0
    pending: int = 0
    admit_hit: int | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    out: list[int] = field(default_factory=list)
    preemptions: int = 0
    failed: bool = False


def _sim_pool_class() -> type:
    from gpu_emitter.hybrid_pool import HybridBlockPool

    class SimPool(HybridBlockPool):
        """The real pool with the KV tensor writes skipped (no effect on hits or events)."""

        def compute_prefill(self, req_id: str) -> None:
            self.request(req_id).pending = []

        def _write_positions(self, req: Any, positions: range) -> None:
            return None

    return SimPool


class SimReplica:
    """One replica: the pool, vLLM's step order (``gpu_emitter.engine``), a simulated clock."""

    def __init__(self, index: int, pool: Any, cost: Any, max_num_seqs: int, router: Sim) -> None:
        self.index = index
        self.pool = pool
        self.cost = cost
        self.max_num_seqs = max_num_seqs
        self.router = router
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.step_end: float | None = None
        self.step_reqs: list[_Req] = []
        self.outbox: deque[tuple[float, list[Any]]] = deque()
        self.prompt_tokens = 0
        self.prefill_tokens = 0
        self.requests = 0
        self.preemptions = 0

    def submit(self, req: _Req, now: float) -> None:
        self.waiting.append(req)
        self.requests += 1
        self.prompt_tokens += len(req.tokens)
        if self.step_end is None:
            self._start(now)

    def advance_to(self, t: float) -> None:
        while self.step_end is not None and self.step_end <= t:
            end = self.step_end
            self._end(end)
            self.step_end = None
            if self.running or self.waiting:
                self._start(end)

    def _reserve(self, req: _Req) -> bool:
        if req not in self.running:
            return False
        while not self.pool.append_tokens(req.req_id, req.out[-1:]):
            victim = self.running.pop()
            self.pool.finish(victim.req_id)
            victim.preemptions += 1
            self.preemptions += 1
            self.waiting.appendleft(victim)
            if victim is req:
                return False
        return True

    def _start(self, now: float) -> None:
        pool = self.pool
        decoding = [r for r in list(self.running) if self._reserve(r)]
        admitted: list[_Req] = []
        prefill = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.tokens + req.out
            hit = pool.admit(req.req_id, tokens)
            if hit is None:
                if not self.running:
                    self.waiting.popleft()
                    req.failed = True
                    self.router.on_done(req, now)
                    continue
                break
            self.waiting.popleft()
            self.running.append(req)
            admitted.append(req)
            pool.compute_prefill(req.req_id)
            prefill += len(tokens) - hit
            if req.admit_hit is None:
                req.admit_hit = hit
                req.admitted_at = now
        self.prefill_tokens += prefill
        events = pool.take_events()
        if events:
            self.outbox.append((now, events))
        if not decoding and not admitted:
            return  # idle (every waiting request failed)
        d = self.cost.step_seconds(prefill, bool(decoding))
        self.step_end = now + max(d, 1e-6)
        self.step_reqs = decoding + admitted

    def _end(self, now: float) -> None:
        finished = []
        for req in self.step_reqs:
            if req not in self.running:
                continue
            k = len(req.out)
            req.out.append(WORD_OFFSET + (req.src.index * 7919 + k * 104729) % NUM_WORDS)
            if req.first_token_at is None:
                req.first_token_at = now
                self.router.on_first_token(req)
            if len(req.out) >= req.src.output_len:
                finished.append(req)
        for req in finished:
            self.running.remove(req)
            self.pool.finish(req.req_id)
            req.finished_at = now
            self.router.on_done(req, now)
        self.step_reqs = []


class Sim:
    """Routes a scaled trace over :class:`SimReplica` s with one policy (see the module doc)."""

    def __init__(self, cfg: SimConfig, scaling: Scaling) -> None:
        from gpu_emitter.cost_model import CostModel
        from gpu_emitter.hybrid_pool import ModelShape
        from gpu_emitter.layouts import load_layout

        self.cfg = cfg
        self.scaling = scaling
        layout = load_layout(cfg.layout)
        self.layout = layout
        f = scaling.token_factor
        cost = CostModel(
            prefill_s_per_token=cfg.prefill_ms_per_token / 1000.0 / f,
            decode_s_per_step=cfg.decode_ms_per_step / 1000.0,
            step_overhead_s=cfg.step_overhead_ms / 1000.0,
        )
        pool_cls = _sim_pool_class()
        self.replicas = [
            SimReplica(
                i,
                pool_cls(layout, cfg.num_blocks, shape=ModelShape(head_dim=1), device="cpu"),
                cost,
                cfg.max_num_seqs,
                self,
            )
            for i in range(cfg.replicas)
        ]
        self.index = KVIndex(layout)
        self.keys = [self.index.add_replica(f"r{i}") for i in range(cfg.replicas)]
        self.predictor = Predictor(self.index)
        pname, own = policy_spec(cfg.policy)
        self.oracle = pname == ORACLE
        pname = "kv" if self.oracle else pname
        weight = cfg.lookahead_weight
        if "@" in pname:  # "kv@0.5": the kv policy with lookahead_weight 0.5 (sweeps)
            pname, w = pname.split("@", 1)
            weight = float(w)
        extra: dict[str, float] = dict(cfg.policy_options)
        if weight is not None:
            extra["lookahead_weight"] = weight
        extra.update(own)  # the policy's own fields win over the matrix-wide ones
        for f in ("affinity_chunk_tokens", "affinity_capacity"):  # int fields
            if f in extra:
                extra[f] = int(extra[f])  # type: ignore[assignment]
        pc = PolicyConfig(name=pname, seed=cfg.seed, **extra)  # type: ignore[arg-type]
        self.policy = make_policy(pc, random.Random(cfg.seed))
        # The service's routing state beside the index (router.server.state): prefix homes
        # for the kv policy (router.core.affinity) and each replica's cache pressure
        # (router.core.pressure), both on the simulated clock.
        self.homes = (
            PrefixHomes(pc.affinity_chunk_tokens, pc.affinity_capacity)
            if pname == "kv" and pc.affinity_weight > 0
            else None
        )
        self.written = [DecayingSum(pc.pressure_half_life_s) for _ in range(cfg.replicas)]
        self.in_flight = [0] * cfg.replicas
        self.pending = [0] * cfg.replicas
        self.done: list[_Req] = []
        self.err_now_mismatch = 0
        self.decide_s = 0.0

    # -- replica callbacks ------------------------------------------------------------
    def on_first_token(self, req: _Req) -> None:
        self.pending[req.replica] -= req.pending

    def on_done(self, req: _Req, now: float) -> None:
        self.in_flight[req.replica] -= 1
        if req.first_token_at is None:
            self.pending[req.replica] -= req.pending
        req.finished_at = now
        self.done.append(req)

    # -- routing ----------------------------------------------------------------------
    def _deliver(self, now: float) -> None:
        cutoff = now - self.cfg.event_delay_s
        for rep, key in zip(self.replicas, self.keys, strict=True):
            box = rep.outbox
            while box and box[0][0] <= cutoff:
                self.index.apply_events(key, box.popleft()[1])

    def _route(self, req: _Req, now: float, pin: int | None = None) -> int:
        t0 = time.perf_counter()
        cands = []
        homes = self.homes
        home_keys = homes.keys(req.tokens) if homes is not None else []
        homed = homes.homed(home_keys) if homes is not None else {}
        if self.oracle:
            # Perfect information: the kv cost model on every pool's true state now.
            hits = []
            for rep in self.replicas:
                res = rep.pool.find_hit(req.tokens)
                hits.append((res.hit_tokens, res.longest, None))
        else:
            pred = self.predictor.predict(req.tokens, blind=True)
            hits = []
            for key in self.keys:
                h = pred.hit(key)
                longest = h.result.longest if h.result is not None else 0
                hits.append((h.hit_tokens, longest, h.blind_hit_tokens))
        for i, (rep, (hit, longest, blind)) in enumerate(zip(self.replicas, hits, strict=True)):
            cands.append(
                Candidate(
                    self.keys[i],
                    hit_tokens=hit,
                    fa_prefix_tokens=longest,
                    blind_hit_tokens=blind,
                    in_flight=self.in_flight[i],
                    pending_prefill_tokens=self.pending[i],
                    running=len(rep.running),
                    waiting=len(rep.waiting),
                    kv_usage=rep.pool.usage,
                    recent_new_tokens=self.written[i].value(now),
                    home_tokens=homed.get(self.keys[i], 0),
                )
            )
        if pin is None:
            decision = self.policy.choose(len(req.tokens), cands, commit=True)
            i = self.keys.index(decision.chosen.key)
            if homes is not None:  # a routing fact: pinned set-up traffic homes nothing
                homes.record(home_keys, self.keys[i])
        else:
            i = pin
        self.decide_s += time.perf_counter() - t0
        c = cands[i]
        req.replica = i
        req.predicted = c.hit_tokens
        req.blind_predicted = c.blind_hit_tokens if c.blind_hit_tokens is not None else c.hit_tokens
        check = range(len(self.replicas)) if self.cfg.check_all else (i,)
        for j in check:
            true = self.replicas[j].pool.find_hit(req.tokens).hit_tokens
            if j == i:
                req.true_now = true
            if true != cands[j].hit_tokens:
                self.err_now_mismatch += 1
        return i

    def run(self, requests: Sequence[ScaledRequest], progress: Any = None) -> dict[str, Any]:
        wall = time.perf_counter()
        n = len(requests)
        for k, src in enumerate(requests):
            self.submit(src)
            if progress is not None and (k + 1) % 2000 == 0:
                progress(k + 1, n)
        for rep in self.replicas:
            rep.advance_to(math.inf)
        return self.summary(requests, time.perf_counter() - wall)

    def advance(self, t: float) -> None:
        """Run every replica up to simulated time ``t`` and apply the events due by then."""
        for rep in self.replicas:
            rep.advance_to(t)
        self._deliver(t)

    def submit(self, src: ScaledRequest, *, replica: int | None = None) -> _Req:
        """One request of :meth:`run`: advance to ``src.arrival_s``, route, hand it over.

        ``replica`` (an index into :attr:`replicas`) pins the request there without asking
        the policy; the prediction and the router's load accounting stay as for a routed
        request. That is the hook for set-up traffic: bench/routing_scenarios.py builds a
        chosen cache state through the real pools (e.g. a prefix whose sliding-window
        checkpoint was evicted on some replicas) before the routed requests it measures.
        The caller keeps ``src.arrival_s`` non-decreasing and ``src.index`` unique among
        running requests (it names the request in the pool).
        """
        now = src.arrival_s
        self.advance(now)
        req = _Req(src, src.token_ids(), f"q{src.index}")
        i = self._route(req, now, pin=replica)
        req.pending = max(0, len(req.tokens) - req.predicted)
        self.in_flight[i] += 1
        self.pending[i] += req.pending
        if req.pending > 0:
            self.written[i].add(req.pending, now)
        self.replicas[i].submit(req, now)
        return req

    def summary(self, requests: Sequence[ScaledRequest], wall_s: float) -> dict[str, Any]:
        done = [r for r in self.done if not r.failed]
        failed = [r for r in self.done if r.failed]
        prompt = sum(len(r.tokens) for r in done)
        cached = sum(r.admit_hit or 0 for r in done)
        ttft = sorted(r.first_token_at - r.src.arrival_s for r in done if r.first_token_at)
        queue = sorted(r.admitted_at - r.src.arrival_s for r in done if r.admitted_at is not None)
        err_admit = [r.predicted - (r.admit_hit or 0) for r in done]
        blind_over = [r.blind_predicted - r.true_now for r in done]
        per_prefill = [rep.prefill_tokens for rep in self.replicas]
        per_req = [rep.requests for rep in self.replicas]
        mean_prefill = statistics.fmean(per_prefill) or 1.0
        return {
            "config": asdict(self.cfg),
            "requests": len(requests),
            "completed": len(done),
            "failed": len(failed),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_share": cached / prompt if prompt else 0.0,
            "prefill_tokens": sum(per_prefill),
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p90_s": _pct(ttft, 90),
            "ttft_p99_s": _pct(ttft, 99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
            "queue_mean_s": statistics.fmean(queue) if queue else 0.0,
            "queue_p90_s": _pct(queue, 90),
            "load_imbalance": max(per_prefill) / mean_prefill,
            "requests_imbalance": max(per_req) / (statistics.fmean(per_req) or 1.0),
            "requests_per_replica": per_req,
            "preemptions": sum(rep.preemptions for rep in self.replicas),
            "err_now_mismatches": self.err_now_mismatch,
            "err_admit_exact_ratio": (
                sum(1 for e in err_admit if e == 0) / len(err_admit) if err_admit else 1.0
            ),
            "err_admit_mean_abs": statistics.fmean(map(abs, err_admit)) if err_admit else 0.0,
            "blind_over_mean": statistics.fmean(blind_over) if blind_over else 0.0,
            "blind_over_max": max(blind_over, default=0),
            "blind_exact_ratio": (
                sum(1 for e in blind_over if e == 0) / len(blind_over) if blind_over else 1.0
            ),
            "decide_us_mean": self.decide_s / max(1, len(requests)) * 1e6,
            "wall_s": wall_s,
        }


def _pct(xs: Sequence[float], p: float) -> float:
    if not xs:
        return 0.0
    k = min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))
    return xs[k]


# ---------------------------------------------------------------------------- matrix


def workload(
    trace_path: str | None,
    scaling: Scaling,
    synthetic: int | None = None,
    agent: int | None = None,
    seed: int = 0,
) -> list[ScaledRequest]:
    """The scaled requests of one run: the Mooncake trace, or ``synthetic`` requests like it,
    or ``agent`` requests that all share one prefix (:func:`gpu_emitter.workload.agent_trace`,
    sampled by ``seed``, at the trace's 3.4 requests/s before the time scale)."""
    if agent:
        return scale_trace(agent_trace(agent, seed=seed, rate_per_s=3.4), scaling)
    if synthetic:
        return scale_trace(synthetic_trace(synthetic, seed=scaling.session_offset), scaling)
    return scale_trace(load_trace(trace_path or default_trace_path()), scaling)


def policy_option(text: str) -> tuple[str, float]:
    """``FIELD=VALUE`` for ``--policy-option``: a numeric field of router.config.PolicyConfig."""
    name, sep, value = text.partition("=")
    fields = PolicyConfig.__struct_fields__
    if not sep or name not in fields:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give FIELD=VALUE with FIELD one of {', '.join(fields)}"
        )
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: VALUE must be a number") from None


def policy_spec(text: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """``POLICY[:FIELD=VALUE,...]``, as bench/real_vllm/load.py takes it: the policy and
    PolicyConfig fields for its runs only (the whole string labels them), so one matrix can
    hold ``kv`` and ``kv:affinity_weight=0`` side by side."""
    name, sep, rest = text.partition(":")
    if not sep:
        return name, ()
    try:
        return name, tuple(policy_option(kv) for kv in rest.split(","))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"policy {text!r}: {e}") from None


def split_policies(text: str) -> list[str]:
    """``--policies``: comma-separated specs, where a comma followed by ``FIELD=VALUE`` (no
    policy name holds ``=``) continues the previous spec: ``kv,kv:affinity_weight=8,
    affinity_max_tokens=8192,oracle`` is three policies. Each spec is checked here, so a
    typo fails before any run starts."""
    out: list[str] = []
    for piece in text.split(","):
        if "=" in piece and ":" not in piece and out:
            out[-1] += "," + piece
        else:
            out.append(piece)
    for spec in out:
        name = policy_spec(spec)[0].split("@", 1)[0]
        known = (*POLICIES, ORACLE)
        if name not in known:
            raise ValueError(f"unknown policy {name!r} in {spec!r}; known: {', '.join(known)}")
    return out


def add_policy_option_arg(ap: argparse.ArgumentParser) -> None:
    """``--policy-option FIELD=VALUE`` (repeatable), shared with bench/routing_scenarios.py."""
    ap.add_argument(
        "--policy-option",
        type=policy_option,
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set a numeric PolicyConfig field for every policy (repeatable)",
    )


def run_one(job: tuple[SimConfig, Scaling, str | None, int | None, int | None]) -> dict[str, Any]:
    cfg, scaling, trace_path, synthetic, agent = job
    reqs = workload(trace_path, scaling, synthetic, agent, cfg.seed)
    out = Sim(cfg, scaling).run(reqs)
    out["scaling"] = asdict(scaling)
    return out


def infinite_bound(
    trace_path: str | None,
    scaling: Scaling,
    synthetic: int | None = None,
    agent: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    reqs = workload(trace_path, scaling, synthetic, agent, seed)
    cached, total = trace_reuse_bound(reqs, 16)
    return {"cached_tokens": cached, "prompt_tokens": total, "cached_share": cached / total}


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and spread (min..max, stdev) over seeds, per (layout, replicas, policy)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        c = r["config"]
        groups.setdefault((c["layout"], c["replicas"], c["policy"]), []).append(r)
    out = []
    metrics = (
        "cached_share",
        "prefill_tokens",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "queue_mean_s",
        "load_imbalance",
        "requests_imbalance",
        "err_now_mismatches",
        "err_admit_exact_ratio",
        "err_admit_mean_abs",
        "blind_over_mean",
        "blind_over_max",
        "blind_exact_ratio",
        "failed",
        "preemptions",
        "decide_us_mean",
    )
    for (layout, n, policy), rs in sorted(groups.items()):
        row: dict[str, Any] = {"layout": layout, "replicas": n, "policy": policy, "seeds": len(rs)}
        out.append(row | seed_spread(rs, metrics, sd=True))
    return out


def seed_spread(rs: Sequence[dict[str, Any]], metrics: Sequence[str], *, sd: bool) -> dict:
    """Per metric over the runs (seeds): the mean as ``m``, then ``m_min``, ``m_max`` and,
    with ``sd``, the sample standard deviation ``m_sd``."""
    row: dict[str, float] = {}
    for m in metrics:
        vals = [float(r[m]) for r in rs]
        row[m] = statistics.fmean(vals)
        row[m + "_min"] = min(vals)
        row[m + "_max"] = max(vals)
        if sd:
            row[m + "_sd"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return row


def run_jobs(fn: Callable[[Any], dict[str, Any]], jobs: Sequence[Any], procs: int) -> Iterator:
    """``fn`` over ``jobs``, results as they finish: forked worker processes when
    ``procs > 1`` (each run is independent and CPU-bound), in order in this one otherwise."""
    if procs <= 1:
        yield from map(fn, jobs)
        return
    import multiprocessing as mp

    with mp.get_context("fork").Pool(procs) as pool:
        yield from pool.imap_unordered(fn, jobs)


def table(agg: list[dict[str, Any]], bounds: dict[str, Any]) -> str:
    """A markdown table: one row per (layout, replicas, policy), means with spreads."""
    head = (
        "| layout | N | policy | cached % (min..max) | % of oracle | prefill Mtok | "
        "TTFT p50 / p90 / p99 s | queue s | imbalance prefill / requests | pred exact now | "
        "exact at admit | "
        "blind over-pred mean / max | failed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    oracle = {(r["layout"], r["replicas"]): r["cached_share"] for r in agg if r["policy"] == ORACLE}
    for r in agg:
        key = (r["layout"], r["replicas"])
        o = oracle.get(key)
        rel = f"{100 * r['cached_share'] / o:.1f} %" if o else "-"
        now = "all" if r["err_now_mismatches_max"] == 0 else f"{r['err_now_mismatches']:.0f} off"
        req_imb = f"{r['requests_imbalance']:.2f}" if "requests_imbalance" in r else "-"
        lines.append(
            f"| {r['layout']} | {r['replicas']} | {LABEL.get(r['policy'], r['policy'])} | "
            f"{100 * r['cached_share']:.2f} ({100 * r['cached_share_min']:.2f}.."
            f"{100 * r['cached_share_max']:.2f}) | {rel} | {r['prefill_tokens'] / 1e6:.2f} | "
            f"{r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} / {r['ttft_p99_s']:.3f} | "
            f"{r['queue_mean_s']:.3f} | {r['load_imbalance']:.2f} / {req_imb} | {now} | "
            f"{100 * r['err_admit_exact_ratio']:.1f} % | "
            f"{r['blind_over_mean']:.1f} / {r['blind_over_max']:.0f} | {r['failed']:.0f} |"
        )
    inf = "".join(
        f"\nInfinite-capacity reuse from the trace ({k}): {100 * v:.2f} % of prompt tokens."
        for k, v in bounds.items()
    )
    return head + "\n".join(lines) + "\n" + inf + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/20 of the conversations, 3 seeds")
    ap.add_argument("--trace", help="Mooncake JSONL trace (default: the shared conversation one)")
    ap.add_argument("--synthetic", type=int, metavar="N", help="a synthetic trace of N requests")
    ap.add_argument(
        "--agent",
        type=int,
        metavar="N",
        help="N requests that all share one 2,048-token prefix and then a short query of their "
        "own (gpu_emitter.workload.agent_trace): where a prefix home pulls traffic hardest; "
        "every request is kept (no session stride); use with --block-tokens 512",
    )
    ap.add_argument("--layouts", default="fa,fa_swa")
    ap.add_argument("--replicas", default="4,16")
    ap.add_argument(
        "--policies",
        default=",".join((*POLICIES, ORACLE)),
        help="comma-separated; a policy may carry its own PolicyConfig fields, e.g. "
        "kv,kv:affinity_weight=0,kv:affinity_weight=8,affinity_max_tokens=8192",
    )
    ap.add_argument("--seeds", type=int, help="seeds per configuration (default 5, quick 3)")
    ap.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token block")
    ap.add_argument("--session-stride", type=int, help="keep 1 conversation in S (quick: 10)")
    ap.add_argument("--limit", type=int, help="at most this many requests per run")
    ap.add_argument(
        "--time-scale",
        type=float,
        help="arrival time multiplier (default 4.25 / (session stride x replicas): about "
        "0.8 requests/s per replica whatever the sample and fleet size)",
    )
    ap.add_argument("--note", default="", help="a sentence stored with the result")
    ap.add_argument("--num-blocks", type=int, help="KV blocks per replica (default 4096)")
    ap.add_argument("--event-delay", type=float, default=0.0, help="seconds before events apply")
    ap.add_argument("--lookahead-weight", type=float, help="PolicyConfig.lookahead_weight")
    add_policy_option_arg(ap)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "routing_sim.json"))
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)

    stride = 1 if args.agent else args.session_stride or (20 if args.quick else 1)
    num_blocks = args.num_blocks or (1024 if args.quick else 4096)
    seeds = args.seeds or (3 if args.quick else 5)
    layouts = args.layouts.split(",")
    counts = [int(x) for x in args.replicas.split(",")]
    try:
        policies = split_policies(args.policies)
    except ValueError as e:
        ap.error(str(e))
    jobs = []
    bounds: dict[str, float] = {}
    for n in counts:
        for seed in range(seeds):
            scaling = Scaling(
                block_tokens=args.block_tokens,
                time_scale=(
                    args.time_scale if args.time_scale is not None else 4.25 / (stride * n)
                ),
                session_stride=stride,
                session_offset=seed if stride > 1 else 0,
                limit=args.limit,
            )
            for layout in layouts:
                for policy in policies:
                    cfg = SimConfig(
                        layout=layout,
                        replicas=n,
                        policy=policy,
                        seed=seed,
                        num_blocks=num_blocks,
                        event_delay_s=args.event_delay,
                        lookahead_weight=args.lookahead_weight,
                        policy_options=args.policy_option,
                    )
                    jobs.append((cfg, scaling, args.trace, args.synthetic, args.agent))
    seen_scalings = {}
    for c, sc, tp, syn, ag in jobs:
        key = (c.seed if ag else sc.session_offset, sc.block_tokens, sc.limit)
        if key not in seen_scalings:
            seen_scalings[key] = infinite_bound(tp, sc, syn, ag, c.seed)["cached_share"]
    bounds = (
        {f"sample {k[0]}": v for k, v in sorted(seen_scalings.items())}
        if len(seen_scalings) > 1
        else {"all": next(iter(seen_scalings.values()))}
    )

    print(
        f"routing_sim: {len(jobs)} runs on {args.jobs} processes; scaling: {jobs[0][1].describe()}",
        flush=True,
    )
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []

    def report(r: dict[str, Any]) -> None:
        rows.append(r)
        c = r["config"]
        print(
            f"[{len(rows)}/{len(jobs)} {time.perf_counter() - t0:6.0f}s] {c['layout']:6} "
            f"N={c['replicas']:<2} seed={c['seed']} {LABEL.get(c['policy'], c['policy']):24} "
            f"cached {100 * r['cached_share']:5.2f} %  TTFT p90 {r['ttft_p90_s']:.3f}s  "
            f"pred-now mismatches {r['err_now_mismatches']}  ({r['wall_s']:.0f}s)",
            flush=True,
        )

    for r in run_jobs(run_one, jobs, args.jobs):
        report(r)

    agg = aggregate(rows)
    md = table(agg, bounds)
    print(md)
    doc = {
        "bench": "routing_sim",
        "machine": machine(),
        "command": "bench/routing_sim.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "trace": args.trace
        or (
            "agent" if args.agent else "synthetic" if args.synthetic else str(default_trace_path())
        ),
        "scaling": jobs[0][1].describe() + f"; {num_blocks} KV blocks per replica",
        "infinite_capacity_share": bounds,
        "note": args.note,
        "runs": rows,
        "aggregate": agg,
        "table_md": md,
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    if not args.no_plots:
        from bench.plots import plot_routing_sim

        for p in plot_routing_sim(doc, out.parent, out.stem):
            print(f"wrote {p}")
    return 0


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())
