"""Targeted routing scenarios: where the exact hybrid hit changes the routing decision.

The Mooncake averages (bench/routing_sim.py) mix every situation; these scenarios isolate the
one the exact hybrid hit is for: a prefix whose full-attention (FA) blocks are cached on
several replicas while its sliding-window (SWA) checkpoint survives on only some of them. A
group-blind router counts a block if any group holds it, so it sees the same hit everywhere;
vLLM only serves the hit where every group accepts it (spec §4.4-§4.5), so elsewhere the
request recomputes the whole prefix (spec §4.8 Example 2).

The state is built through the real pools (``gpu_emitter`` HybridBlockPool, ``fa_swa``: FA +
SWA window 128, 16-token blocks, vLLM's default retention 0), with requests pinned to a
replica (:meth:`bench.routing_sim.Sim.submit`), nothing written into a pool by hand:

1. *Prime*: every replica serves, for each tenant prefix ``P`` (40-60 blocks), a request
   ``P`` + a few tokens with a long output (256 tokens). Its prompt boundary is ``P``'s end,
   so FA caches ``P`` and SWA caches the 8 blocks ending there (spec §4.7).
2. *Churn*: other traffic (unique prompts) arrives on every replica. vLLM frees a request's
   SWA blocks as soon as they leave the window, so the checkpoint goes to the free queue
   while the request still decodes; its FA blocks are freed only when it finishes. The free
   queue is LRU, so the churn reuses the SWA checkpoint first. Churn on a replica stops as
   soon as none of its checkpoints is left (checked with ``pool.find_hit``); the FA blocks
   of every prefix are checked to have survived.
3. *Refresh*: each prefix is served once more on one replica, its *home* (seeded choice).
   Its hit there is 0 now, so vLLM pins ``shared_prefix_boundary`` at ``P``'s end and caches
   the checkpoint again (spec §4.1).
4. *Check*: every replica holds ``P`` in FA; only the home serves a hit of ``len(P)`` tokens.
   The pools' ``find_hit`` and the router's index (per-group hits, group-blind hit) are both
   recorded; the run stops with an error if the state did not arise.

Then the measured, routed requests (the fleet is idle when the measured phase begins; in B
other clients' traffic runs for ``warmup_s`` before the first routed request):

* **A** (several copies, different SWA state): a stream of requests ``P`` + a distinct
  suffix. Group-blind sees equal hits everywhere and spreads them by load; each replica
  without the checkpoint costs one full prefill (which then stores the checkpoint there).
* **B1, B2** (under load): 8 tenants, each with its own home; other clients' traffic is
  pinned to the replicas at different rates during the measured phase (B2: more of it), so
  homes can carry more queued work than replicas that only hold the FA prefix. Group-blind
  takes those for equally good and less loaded; ``kv`` prices them right (prefill = prompt -
  exact hit) and moves only when the queue difference exceeds the prefix.

Metrics over the routed requests (set-up and background traffic excluded): cached share
(hit at first admission / prompt tokens), prefill tokens computed, TTFT p50/p90/p99 and
``wrong``: decisions sent to a replica whose true hit (``pool.find_hit`` at that moment) was
below the best replica's. ``kv`` may do that deliberately under load (its cost includes the
queue); in A the fleet is lightly loaded. Background TTFT (B) shows what the routed traffic
did to the other clients. Everything is deterministic given the seed (prefix lengths, homes,
suffixes, arrivals); the default run is 5 seeds x 3 scenarios x 4 policies.

Usage::

    .venv/bin/python bench/routing_scenarios.py            # 5 seeds, < 2 min on 2 cores
    .venv/bin/python bench/routing_scenarios.py --quick    # 2 seeds, fewer requests (tests)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.routing_sim import (  # noqa: E402
    LABEL,
    Sim,
    SimConfig,
    _pct,
    add_policy_option_arg,
    machine,
    run_jobs,
    seed_spread,
)
from gpu_emitter.workload import ScaledRequest, Scaling  # noqa: E402

RESULTS = ROOT / "bench" / "results"
POLICIES = ("kv", "prefix_group_blind", "least_load", "round_robin")
BLOCK = 16
"""Tokens per KV block of ``fa_swa``; one request hash id expands to one block."""


class ScenarioError(RuntimeError):
    """The set-up did not produce the cache state the scenario is about (a bug, or
    parameters that cannot produce it); the message says which replica and prefix."""


@dataclass(frozen=True)
class Scenario:
    """Every parameter of one scenario (all stated in the output). Sizes are in KV blocks of
    16 simulated tokens, outputs in tokens; ranges are inclusive and drawn per request (or per
    prefix) from the seed."""

    name: str
    title: str
    replicas: int = 4
    layout: str = "fa_swa"
    num_blocks: int = 1024
    """KV blocks per replica (all groups share them)."""
    tenants: int = 1
    """Distinct shared prefixes (system prompts)."""
    prefix_blocks: tuple[int, int] = (40, 60)
    prime_output: int = 256
    """Output of the priming requests: long enough for their SWA checkpoint to leave the
    window (128 tokens) and be freed before the request finishes."""
    churn_gap_s: float = 0.5
    churn_prompt_blocks: tuple[int, int] = (8, 24)
    churn_output: tuple[int, int] = (16, 48)
    refresh_output: int = 8
    requests: int = 40
    """Routed (measured) requests."""
    rate_per_s: float = 1.0
    """Poisson arrivals of the routed requests, whole fleet."""
    suffix_blocks: tuple[int, int] = (1, 8)
    output: tuple[int, int] = (8, 64)
    background_rate_per_s: tuple[float, ...] = ()
    """Per replica: other clients' requests (unique prompts, pinned) during the measured phase."""
    background_prompt_blocks: tuple[int, int] = (16, 32)
    background_output: tuple[int, int] = (32, 128)
    warmup_s: float = 10.0
    """With background traffic: how long it runs before the first routed request."""
    prefill_ms_per_token: float = 0.8
    """Per simulated token (the Mooncake simulation's 0.05 ms x 16)."""
    decode_ms_per_step: float = 20.0
    step_overhead_ms: float = 0.5

    def describe(self) -> str:
        bg = (
            ", background per replica "
            + "/".join(f"{r:g}" for r in self.background_rate_per_s)
            + f" req/s (prompt {_rng_s(self.background_prompt_blocks)} blocks, output "
            f"{_rng_s(self.background_output)})"
            if self.background_rate_per_s
            else ""
        )
        return (
            f"{self.layout}, {self.replicas} replicas x {self.num_blocks} KV blocks of "
            f"{BLOCK} tokens; {self.tenants} prefix(es) of {_rng_s(self.prefix_blocks)} blocks; "
            f"set-up: prime output {self.prime_output}, churn every {self.churn_gap_s:g} s "
            f"(prompt {_rng_s(self.churn_prompt_blocks)} blocks, output "
            f"{_rng_s(self.churn_output)}) until no checkpoint is left, refresh output "
            f"{self.refresh_output}; measured: {self.requests} routed requests at "
            f"{self.rate_per_s:g}/s (prefix + {_rng_s(self.suffix_blocks)} blocks, output "
            f"{_rng_s(self.output)}){bg}; cost: prefill {self.prefill_ms_per_token:g} ms/token, "
            f"decode step {self.decode_ms_per_step:g} ms, step overhead "
            f"{self.step_overhead_ms:g} ms"
        )


def _rng_s(r: tuple[int, int]) -> str:
    return f"{r[0]}-{r[1]}" if r[0] != r[1] else str(r[0])


_B = Scenario(
    "B",
    "",
    tenants=8,
    requests=200,
    rate_per_s=2.0,
    num_blocks=2048,
)
SCENARIOS = {
    "A": Scenario("A", "one prefix on every replica, its window checkpoint on one"),
    "B1": replace(
        _B,
        name="B1",
        title="under moderate load: 8 prefixes, homes busier than FA-only replicas",
        background_rate_per_s=(1.2, 0.8, 0.4, 0.0),
    ),
    "B2": replace(
        _B,
        name="B2",
        title="under heavy load: as B1 with more background traffic",
        background_rate_per_s=(2.0, 1.2, 0.6, 0.0),
    ),
}


def quick(s: Scenario) -> Scenario:
    """The ``--quick`` (test) size: fewer routed requests."""
    return replace(s, requests=max(12, s.requests // 3))


# ---------------------------------------------------------------------------- one run


class _Traffic:
    """Unique hash ids and request indices for one run (deterministic)."""

    def __init__(self, seed: int) -> None:
        self.next_id = (seed + 1) << 40
        self.next_index = 0

    def ids(self, k: int) -> tuple[int, ...]:
        out = tuple(range(self.next_id, self.next_id + k))
        self.next_id += k
        return out

    def request(self, t: float, ids: tuple[int, ...], n: int, out: int) -> ScaledRequest:
        self.next_index += 1
        return ScaledRequest(self.next_index, t, ids, n, out, BLOCK)


def _probe(prefix: tuple[int, ...], probe_id: int) -> list[int]:
    """The prefix plus one block nobody sent: its hit is what a new request would get."""
    return ScaledRequest(
        0, 0.0, (*prefix, probe_id), (len(prefix) + 1) * BLOCK, 1, BLOCK
    ).token_ids()


def _busy(sim: Sim) -> bool:
    return any(r.running or r.waiting or r.step_end is not None for r in sim.replicas)


def _drain(sim: Sim, t: float, limit_s: float = 600.0) -> float:
    """Advance the simulated clock (in 0.5 s steps) until every replica is idle."""
    end = t + limit_s
    while _busy(sim):
        t += 0.5
        if t > end:
            raise ScenarioError(f"the fleet did not go idle within {limit_s:g} s of set-up")
        sim.advance(t)
    return t


def _state(sim: Sim, probes: list[list[int]]) -> list[list[dict[str, int]]]:
    """Per tenant, per replica: the pool's true hit and FA-alone hit, and what the router's
    index says (exact hit, group-blind hit, each group's own hit)."""
    out = []
    for toks in probes:
        pred = sim.predictor.predict(toks, blind=True, explain=True)
        row = []
        for rep, key in zip(sim.replicas, sim.keys, strict=True):
            true = rep.pool.find_hit(toks)
            h = pred.hit(key)
            groups = list(h.result.spec_group_hits) if h.result is not None else []
            row.append(
                {
                    "pool_hit": true.hit_tokens,
                    "pool_fa": true.longest,
                    "index_hit": h.hit_tokens,
                    "index_blind": h.blind_hit_tokens or 0,
                    "index_fa": groups[0] if groups else 0,
                    "index_swa": groups[1] if len(groups) > 1 else 0,
                }
            )
        out.append(row)
    return out


def _expect(
    state: list[list[dict[str, int]]],
    when: str,
    hit: Callable[[int, int], int],
    fa: Callable[[int, int], int],
) -> None:
    """Raise :class:`ScenarioError` unless, for prefix ``k`` on replica ``r``, the pool's hit
    is ``hit(k, r)``, its full-attention group alone holds ``fa(k, r)`` tokens, and the
    router's index predicts exactly the pool's hit."""
    for k, row in enumerate(state):
        for r, cell in enumerate(row):
            want = (hit(k, r), fa(k, r))
            got = (cell["pool_hit"], cell["pool_fa"])
            if got != want or cell["index_hit"] != cell["pool_hit"]:
                raise ScenarioError(
                    f"{when}: prefix {k} on replica {r}: (hit, FA-alone hit) = {got}, wanted "
                    f"{want}; index predicts {cell['index_hit']}"
                )


def _setup(
    sim: Sim, sc: Scenario, rng: random.Random, tr: _Traffic
) -> tuple[float, dict[str, Any]]:
    """Steps 1-4 of the module docstring; returns the clock and the checked state."""
    n = sc.replicas
    lens = [rng.randint(*sc.prefix_blocks) for _ in range(sc.tenants)]
    prefixes = [tr.ids(k) for k in lens]
    probe_ids = tr.ids(sc.tenants)
    probes = [_probe(p, q) for p, q in zip(prefixes, probe_ids, strict=True)]
    first_home = rng.randrange(n)
    homes = [(first_home + k) % n for k in range(sc.tenants)]
    full = [k * BLOCK for k in lens]

    t = 0.0
    for r in range(n):  # 1. prime
        for p, k in zip(prefixes, lens, strict=True):
            tail = rng.randint(1, BLOCK - 1)
            sim.submit(tr.request(t, p + tr.ids(1), k * BLOCK + tail, sc.prime_output), replica=r)
    sim.advance(t)  # delivers the events of the admissions made at t
    while any(rep.waiting for rep in sim.replicas):  # one admitted per engine step
        t += 0.05
        sim.advance(t)
    after_prime = _state(sim, probes)
    _expect(after_prime, "after priming", lambda k, r: full[k], lambda k, r: full[k])
    churning = set(range(n))  # 2. churn until no checkpoint is left on a replica
    churn = [0] * n
    while churning:
        t += sc.churn_gap_s
        sim.advance(t)
        for r in sorted(churning):
            pool = sim.replicas[r].pool
            if all(pool.find_hit(q).hit_tokens < f for q, f in zip(probes, full, strict=True)):
                churning.discard(r)
                continue
            k = rng.randint(*sc.churn_prompt_blocks)
            out = rng.randint(*sc.churn_output)
            sim.submit(
                tr.request(t, tr.ids(k), k * BLOCK - rng.randint(0, BLOCK - 1), out), replica=r
            )
            churn[r] += 1
        if t > 3600:
            raise ScenarioError(f"churn did not evict every checkpoint in an hour: {churn}")
    t = _drain(sim, t)
    after_churn = _state(sim, probes)
    _expect(after_churn, "after the churn", lambda k, r: 0, lambda k, r: full[k])
    for k, (p, h) in enumerate(zip(prefixes, homes, strict=True)):  # 3. refresh
        tail = rng.randint(1, BLOCK - 1)
        req = tr.request(t, p + tr.ids(1), lens[k] * BLOCK + tail, sc.refresh_output)
        sim.submit(req, replica=h)
        t = _drain(sim, t)
    t = _drain(sim, t + 1.0)
    state = _state(sim, probes)  # 4. check
    _expect(
        state,
        "before the measured phase",
        lambda k, r: full[k] if r == homes[k] else 0,
        lambda k, r: full[k],
    )
    return t, {
        "prefix_tokens": full,
        "homes": homes,
        "churn_requests": churn,
        "after_prime": after_prime,
        "after_churn": after_churn,
        "before_measured": state,
        "setup_end_s": t,
        "prefixes": prefixes,
    }


def run_scenario(
    sc: Scenario, policy: str, seed: int, options: tuple[tuple[str, float], ...] = ()
) -> dict[str, Any]:
    """One (scenario, policy, seed) run: set-up, routed stream, metrics of the routed part."""
    wall = time.perf_counter()
    rng = random.Random(seed)
    scaling = Scaling(block_tokens=BLOCK)
    cfg = SimConfig(
        layout=sc.layout,
        replicas=sc.replicas,
        policy=policy,
        seed=seed,
        num_blocks=sc.num_blocks,
        prefill_ms_per_token=sc.prefill_ms_per_token * scaling.token_factor,
        decode_ms_per_step=sc.decode_ms_per_step,
        step_overhead_ms=sc.step_overhead_ms,
        policy_options=options,
    )
    sim = Sim(cfg, scaling)
    tr = _Traffic(seed)
    t0, setup = _setup(sim, sc, rng, tr)
    prefixes = setup.pop("prefixes")
    prefill_before = [rep.prefill_tokens for rep in sim.replicas]

    # The measured phase: routed requests and (B) pinned background, merged by arrival.
    mrng = random.Random(seed * 7919 + 1)
    stream: list[tuple[float, int, ScaledRequest, int | None]] = []
    # With background traffic, the routed stream starts once its queues are in steady state.
    t = t0 + (sc.warmup_s if sc.background_rate_per_s else 0.0)
    for _ in range(sc.requests):
        t += mrng.expovariate(sc.rate_per_s)
        k = mrng.randrange(sc.tenants)
        s = mrng.randint(*sc.suffix_blocks)
        ids = prefixes[k] + tr.ids(s)
        n = len(ids) * BLOCK - mrng.randint(0, BLOCK - 1)
        stream.append((t, 0, tr.request(t, ids, n, mrng.randint(*sc.output)), None))
    horizon = t
    for r, rate in enumerate(sc.background_rate_per_s):
        if rate <= 0:
            continue
        brng = random.Random(seed * 104729 + r)
        tb = t0
        while True:
            tb += brng.expovariate(rate)
            if tb > horizon:
                break
            k = brng.randint(*sc.background_prompt_blocks)
            req = tr.request(
                tb,
                tr.ids(k),
                k * BLOCK - brng.randint(0, BLOCK - 1),
                brng.randint(*sc.background_output),
            )
            stream.append((tb, 1, req, r))
    stream.sort(key=lambda x: (x[0], x[1], x[2].index))

    routed: list[tuple[Any, list[int]]] = []
    background: list[Any] = []
    for _, kind, src, pin in stream:
        if kind == 1:
            background.append(sim.submit(src, replica=pin))
            continue
        sim.advance(src.arrival_s)
        toks = src.token_ids()
        true = [rep.pool.find_hit(toks).hit_tokens for rep in sim.replicas]
        routed.append((sim.submit(src), true))
    for rep in sim.replicas:
        rep.advance_to(math.inf)

    reqs = [q for q, _ in routed]
    prompt = sum(len(q.tokens) for q in reqs)
    cached = sum(q.admit_hit or 0 for q in reqs)
    ttft = sorted(q.first_token_at - q.src.arrival_s for q in reqs if q.first_token_at)
    bg_ttft = sorted(q.first_token_at - q.src.arrival_s for q in background if q.first_token_at)
    wrong = [(true[q.replica], max(true)) for q, true in routed if true[q.replica] < max(true)]
    per_replica = [0] * sc.replicas
    for q in reqs:
        per_replica[q.replica] += 1
    return {
        "scenario": sc.name,
        "policy": policy,
        "seed": seed,
        "requests": len(reqs),
        "failed": sum(1 for q in reqs if q.failed),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "prefill_tokens": prompt - cached,
        "fleet_prefill_tokens": sum(
            rep.prefill_tokens - b for rep, b in zip(sim.replicas, prefill_before, strict=True)
        ),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
        "wrong": len(wrong),
        "wrong_tokens": sum(best - got for got, best in wrong),
        "blind_over_tokens": sum(q.blind_predicted - q.true_now for q in reqs),
        "requests_per_replica": per_replica,
        "preemptions": sum(q.preemptions for q in reqs),
        "background_requests": len(background),
        "background_ttft_p90_s": _pct(bg_ttft, 90),
        "err_now_mismatches": sim.err_now_mismatch,
        "setup": setup,
        "wall_s": time.perf_counter() - wall,
    }


# ---------------------------------------------------------------------------- matrix

METRICS = (
    "cached_share",
    "prefill_tokens",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "wrong",
    "wrong_tokens",
    "background_ttft_p90_s",
    "err_now_mismatches",
    "failed",
)


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and min..max over seeds, per (scenario, policy), in POLICIES order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["policy"]), []).append(r)
    order = {p: i for i, p in enumerate(POLICIES)}
    out = []
    for (name, policy), rs in sorted(
        groups.items(), key=lambda x: (x[0][0], order.get(x[0][1], 9))
    ):
        row: dict[str, Any] = {"scenario": name, "policy": policy, "seeds": len(rs)}
        out.append(row | seed_spread(rs, METRICS, sd=False))
    return out


#: (metric, short name, scale, unit, digits) of the kv vs group-blind check.
_CHECKS = (
    ("cached_share", "cached share", 100.0, " points", 1),
    ("prefill_tokens", "prefill", 1.0, " tokens", 0),
    ("ttft_mean_s", "TTFT mean", 1000.0, " ms", 0),
    ("ttft_p50_s", "p50", 1000.0, " ms", 0),
    ("ttft_p90_s", "p90", 1000.0, " ms", 0),
    ("ttft_p99_s", "p99", 1000.0, " ms", 0),
    ("wrong", "wrong", 1.0, "", 0),
)


def compare(rows: list[dict[str, Any]], base: str = "prefix_group_blind") -> list[dict[str, Any]]:
    """Per scenario: in how many seeds ``kv`` did at least as well as ``base``, per metric,
    and the worst per-seed difference (kv minus base)."""
    by = {(r["scenario"], r["policy"], r["seed"]): r for r in rows}
    out = []
    for name in sorted({r["scenario"] for r in rows}):
        seeds = sorted({r["seed"] for r in rows if r["scenario"] == name})
        pairs = [
            (by[(name, "kv", s)], by[(name, base, s)])
            for s in seeds
            if (name, "kv", s) in by and (name, base, s) in by
        ]
        if not pairs:
            continue
        for m, *_ in _CHECKS:
            higher_better = m == "cached_share"
            diffs = [float(k[m]) - float(b[m]) for k, b in pairs]
            ok = sum(1 for d in diffs if (d >= 0 if higher_better else d <= 0))
            worst = min(diffs) if higher_better else max(diffs)
            out.append(
                {
                    "scenario": name,
                    "metric": m,
                    "kv_not_worse": ok,
                    "seeds": len(pairs),
                    "worst_diff": worst,
                    "higher_better": higher_better,
                }
            )
    return out


def _fmt_range(r: dict[str, Any], m: str, scale: float = 1.0, digits: int = 3) -> str:
    return (
        f"{scale * r[m]:.{digits}f} ({scale * r[m + '_min']:.{digits}f}.."
        f"{scale * r[m + '_max']:.{digits}f})"
    )


def table(
    agg: list[dict[str, Any]], cmp: list[dict[str, Any]], scenarios: dict[str, Scenario]
) -> str:
    """Markdown: per scenario its parameters, a table (means with min..max over seeds) and
    the per-seed kv vs group-blind check."""
    parts = []
    for name in sorted({r["scenario"] for r in agg}):
        sc = scenarios[name]
        bg = bool(sc.background_rate_per_s)
        parts += [
            f"**{name}: {sc.title}.** {sc.describe()}.",
            "",
            "| policy | cached % | prefill tokens | TTFT mean s | TTFT p50 s | TTFT p90 s | "
            "TTFT p99 s | wrong (tokens lost) |" + (" background TTFT p90 s |" if bg else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|" if bg else ""),
        ]
        for r in agg:
            if r["scenario"] != name:
                continue
            cells = [
                LABEL.get(r["policy"], r["policy"]),
                _fmt_range(r, "cached_share", 100, 1),
                _fmt_range(r, "prefill_tokens", 1, 0),
                *(_fmt_range(r, m) for m in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s")),
                _fmt_range(r, "ttft_p99_s"),
                f"{_fmt_range(r, 'wrong', 1, 1)}; {r['wrong_tokens']:.0f}",
            ]
            if bg:
                cells.append(_fmt_range(r, "background_ttft_p90_s"))
            parts.append("| " + " | ".join(cells) + " |")
        checks = {c["metric"]: c for c in cmp if c["scenario"] == name}
        bits = []
        for m, short, scale, unit, digits in _CHECKS:
            c = checks.get(m)
            if c is not None:
                bits.append(
                    f"{short} {c['kv_not_worse']}/{c['seeds']} "
                    f"(worst {scale * c['worst_diff']:+.{digits}f}{unit})"
                )
        if bits:
            parts += [
                "",
                "Seeds where hybrid (kv) did at least as well as prefix_group_blind, and the "
                "worst per-seed difference (kv minus group-blind): " + "; ".join(bits) + ".",
            ]
        parts.append("")
    return "\n".join(parts)


def plot(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """One row per scenario: cached share, TTFT p50/p90/p99 and wrong decisions per policy
    (``kv`` in green, as in bench/plots.py), the seeds' min..max as error bars."""
    agg = doc.get("aggregate") or []
    if not agg:
        return []
    from matplotlib.patches import Patch

    from bench.plots import _plt

    plt = _plt()
    names = sorted({r["scenario"] for r in agg})
    fig, axes = plt.subplots(len(names), 3, figsize=(12, 3.2 * len(names)), squeeze=False)

    def bars(
        ax: Any, rows: list[dict[str, Any]], m: str, scale: float, dx: float, w: float, hatch: str
    ) -> None:
        vals = [scale * r[m] for r in rows]
        lo = [v - scale * r[m + "_min"] for v, r in zip(vals, rows, strict=True)]
        hi = [scale * r[m + "_max"] - v for v, r in zip(vals, rows, strict=True)]
        colors = ["tab:green" if r["policy"] == "kv" else "tab:gray" for r in rows]
        ax.bar(
            [i + dx for i in range(len(rows))],
            vals,
            w,
            yerr=[lo, hi],
            capsize=2,
            color=colors,
            hatch=hatch,
            edgecolor="black",
            linewidth=0.5,
        )

    for row_axes, name in zip(axes, names, strict=True):
        rows = [r for r in agg if r["scenario"] == name]
        labels = [LABEL.get(r["policy"], r["policy"]) for r in rows]
        bars(row_axes[0], rows, "cached_share", 100.0, 0.0, 0.7, "")
        row_axes[0].set_ylabel("prompt tokens from cache (%)")
        row_axes[0].set_title(f"{name}: cached share", fontsize=9)
        hatches = ("", "//", "xx")
        for j, m in enumerate(("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")):
            bars(row_axes[1], rows, m, 1.0, (j - 1) * 0.27, 0.27, hatches[j])
        row_axes[1].legend(
            handles=[
                Patch(facecolor="white", edgecolor="black", hatch=h, label=q)
                for h, q in zip(hatches, ("p50", "p90", "p99"), strict=True)
            ],
            fontsize=7,
        )
        row_axes[1].set_ylabel("TTFT (s, simulated)")
        row_axes[1].set_title(f"{name}: TTFT of the routed requests", fontsize=9)
        bars(row_axes[2], rows, "wrong", 1.0, 0.0, 0.7, "")
        row_axes[2].set_ylabel("requests")
        row_axes[2].set_title(f"{name}: sent where the true hit < best", fontsize=9)
        for ax in row_axes:
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    fig.tight_layout()
    path = out_dir / "routing_scenarios.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


Job = tuple[Scenario, str, int, tuple[tuple[str, float], ...]]


def _job(args: Job) -> dict[str, Any]:
    return run_scenario(*args)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Scenarios: "
        + "; ".join(f"{k}: {s.title} ({s.describe()})" for k, s in SCENARIOS.items()),
    )
    ap.add_argument("--quick", action="store_true", help="2 seeds, a third of the requests")
    ap.add_argument("--seeds", type=int, help="seeds per scenario and policy (default 5)")
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated, e.g. A or A,B2"
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "routing_scenarios.json"))
    ap.add_argument("--no-plot", action="store_true")
    add_policy_option_arg(ap)
    args = ap.parse_args(argv)

    seeds = args.seeds or (2 if args.quick else 5)
    scenarios = {}
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            ap.error(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
        scenarios[name] = quick(SCENARIOS[name]) if args.quick else SCENARIOS[name]
    policies = args.policies.split(",")
    opts = tuple(args.policy_option)
    jobs = [(sc, p, s, opts) for sc in scenarios.values() for s in range(seeds) for p in policies]
    t0 = time.perf_counter()
    print(
        f"routing_scenarios: {len(jobs)} runs on {args.jobs} processes", file=sys.stderr, flush=True
    )
    rows: list[dict[str, Any]] = []

    def report(r: dict[str, Any]) -> None:
        rows.append(r)
        print(
            f"[{len(rows)}/{len(jobs)} {time.perf_counter() - t0:5.0f}s] {r['scenario']:2} "
            f"seed={r['seed']} {LABEL.get(r['policy'], r['policy']):20} "
            f"cached {100 * r['cached_share']:5.1f} %  TTFT p90 {r['ttft_p90_s']:.3f}s  "
            f"wrong {r['wrong']}  ({r['wall_s']:.1f}s)",
            file=sys.stderr,
            flush=True,
        )

    for r in run_jobs(_job, jobs, args.jobs):
        report(r)
    rows.sort(
        key=lambda r: (
            r["scenario"],
            r["seed"],
            POLICIES.index(r["policy"]) if r["policy"] in POLICIES else 9,
        )
    )
    agg = aggregate(rows)
    cmp = compare(rows)
    md = table(agg, cmp, scenarios)
    print(md)
    doc = {
        "bench": "routing_scenarios",
        "machine": machine(),
        "command": "bench/routing_scenarios.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "scenarios": {k: asdict(v) | {"describe": v.describe()} for k, v in scenarios.items()},
        "seeds": seeds,
        "runs": rows,
        "aggregate": agg,
        "kv_vs_group_blind": cmp,
        "table_md": md,
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    if not args.no_plot:
        for p in plot(doc, out.parent):
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
