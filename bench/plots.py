"""PNG plots of the benchmark results (matplotlib, Agg backend: no display needed).

Each function takes the JSON document a benchmark wrote and returns the paths it wrote.
Missing data gives no plot rather than an error: the report states what ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "plot_decision_latency",
    "plot_fleet_decisions",
    "plot_ingest",
    "plot_proxy",
    "plot_real_vllm_load",
    "plot_routing_sim",
]

_ORDER = ("kv", "oracle", "prefix_group_blind", "least_load", "round_robin")
_NAMES = {"kv": "hybrid", "oracle": "oracle"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _sim_order(policies: set[str]) -> list[str]:
    """The known policies in their usual order, then variants with their own fields
    (``kv:affinity_weight=0``, ``kv@0.5``) in the order they sort."""
    return [p for p in _ORDER if p in policies] + sorted(policies - set(_ORDER))


def _sim_label(policy: str) -> str:
    return _NAMES.get(policy, policy.replace(",", ",\n"))


def plot_routing_sim(doc: dict[str, Any], out_dir: Path, stem: str = "routing_sim") -> list[Path]:
    """Cached-token share, TTFT p90 and (where the runs have it) the busiest replica's share
    of requests per policy, one panel per (layout, replicas), with the seeds' min..max as
    error bars; files ``<stem>_hit.png``, ``<stem>_ttft.png``, ``<stem>_imbalance.png``."""
    agg = doc.get("aggregate") or []
    if not agg:
        return []
    plt = _plt()
    panels = sorted({(r["layout"], r["replicas"]) for r in agg})
    out: list[Path] = []
    metrics = [
        ("cached_share", "prompt tokens served from cache (%)", "hit", 100.0),
        ("ttft_p90_s", "TTFT p90 (s, simulated)", "ttft", 1.0),
    ]
    if all("requests_imbalance" in r for r in agg):
        metrics.append(
            ("requests_imbalance", "busiest replica's requests / mean", "imbalance", 1.0)
        )
    for metric, ylabel, suffix, scale in metrics:
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False)
        for ax, (layout, n) in zip(axes[0], panels, strict=True):
            rows = {r["policy"]: r for r in agg if r["layout"] == layout and r["replicas"] == n}
            names = _sim_order(set(rows))
            vals = [scale * rows[p][metric] for p in names]
            lo = [v - scale * rows[p][metric + "_min"] for v, p in zip(vals, names, strict=True)]
            hi = [scale * rows[p][metric + "_max"] - v for v, p in zip(vals, names, strict=True)]
            colors = [
                "tab:green" if p == "kv" else "tab:olive" if p.startswith("kv") else "tab:gray"
                for p in names
            ]
            ax.bar(range(len(names)), vals, yerr=[lo, hi], color=colors, capsize=3)
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels([_sim_label(p) for p in names], rotation=35, ha="right", fontsize=7)
            ax.set_title(f"{layout}, {n} replicas", fontsize=9)
            if metric == "cached_share":
                inf = doc.get("infinite_capacity_share") or {}
                if inf:
                    v = scale * sum(inf.values()) / len(inf)
                    ax.axhline(v, color="tab:red", ls="--", lw=1, label="infinite capacity")
                    ax.legend(fontsize=7, loc="lower right")
        axes[0][0].set_ylabel(ylabel)
        fig.tight_layout()
        path = out_dir / f"{stem}_{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


def _find_rows(doc: Any, keys: Sequence[str]) -> list[dict[str, Any]]:
    """Every dict nested in ``doc`` that has all ``keys`` (benchmarks nest differently)."""
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if all(k in x for k in keys):
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    return found


def plot_decision_latency(points: list[tuple[int, float, str]], out_dir: Path) -> list[Path]:
    """Decision latency (ms) against prompt length (tokens), one line per series."""
    if not points:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    series: dict[str, list[tuple[int, float]]] = {}
    for n, ms, label in points:
        series.setdefault(label, []).append((n, ms))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("decision latency p50 (ms)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "decision_latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_fleet_decisions(doc: dict[str, Any], out_path: Path) -> list[Path]:
    """bench/fleet_bench.py: decision p50 (µs) against replicas, log-log, one line per
    (prompt kind, prompt length): colour by kind, line style by length. A cost that does not
    grow with replicas is a flat line; one linear in replicas rises one decade per decade."""
    cells = doc.get("cells") or []
    if not cells:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    kinds = list(dict.fromkeys(c["kind"] for c in cells))
    lengths = sorted({c["tokens"] for c in cells})
    styles, markers = ("-", "--", "-.", ":"), ("o", "s", "^", "D")
    for i, kind in enumerate(kinds):
        for j, tokens in enumerate(lengths):
            pts = sorted(
                (c["replicas"], c["p50_us"])
                for c in cells
                if c["kind"] == kind and c["tokens"] == tokens
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}",
                        marker=markers[j % 4], ls=styles[j % 4],
                        label=f"{kind}, {tokens:,} tokens")  # fmt: skip
    # a cost linear in replicas, through the smallest fleet's cheapest cell: the slope to beat
    lo = min(reps := sorted({c["replicas"] for c in cells}))
    base = min(c["p50_us"] for c in cells if c["replicas"] == lo)
    ax.plot(reps, [base * r / lo for r in reps], color="gray", ls=":", lw=1,
            label="linear in replicas")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(reps)
    ax.set_xticklabels([str(r) for r in reps])
    ax.minorticks_off()
    ax.set_xlabel("replicas")
    ax.set_ylabel("decide() p50 (µs)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, handlelength=3)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return [out_path]


def plot_ingest(bars: list[tuple[str, float]], out_dir: Path) -> list[Path]:
    """Ingest throughput bars (million blocks or events per second)."""
    if not bars:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.barh([b[0] for b in bars], [b[1] / 1e6 for b in bars], color="tab:blue")
    ax.set_xlabel("million per second")
    fig.tight_layout()
    path = out_dir / "ingest_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_proxy(bars: list[tuple[str, float, float]], out_dir: Path) -> list[Path]:
    """Proxy overhead: added p50 latency (ms) and router CPU-ms per request, per scenario."""
    if not bars:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    x = range(len(bars))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="added p50 latency (ms)")
    ax.bar([i + 0.2 for i in x], [b[2] for b in bars], 0.4, label="router CPU ms / request")
    ax.set_xticks(list(x))
    ax.set_xticklabels([b[0] for b in bars], rotation=30, ha="right", fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "proxy_overhead.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


_LOAD_ORDER = ("kv", "prefix_group_blind", "cache_aware", "least_load", "round_robin")


def plot_real_vllm_load(doc: dict[str, Any], out_path: Path) -> list[Path]:
    """The concurrent real-vLLM benchmark: reuse (%) and TTFT p90 (ms) per policy, one colour
    per seed, each repeat a point (so the run-to-run spread shows), the mean per seed a bar."""
    runs = doc.get("runs") or []
    if not runs:
        return []
    plt = _plt()
    present = {r["policy"] for r in runs}
    policies = [p for p in _LOAD_ORDER if p in present] + sorted(present - set(_LOAD_ORDER))
    seeds = sorted({r["seed"] for r in runs})
    width = 0.8 / len(seeds)
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 2.0 * len(policies) + 3), 3.6))
    panels = (
        (axes[0], lambda r: 100 * r["reuse"], "prompt tokens served from cache (%)"),
        (axes[1], lambda r: r["ttft_ms"]["p90"], "TTFT p90 (ms)"),
    )
    for ax, value, ylabel in panels:
        for j, seed in enumerate(seeds):
            color = f"C{j}"
            for i, policy in enumerate(policies):
                vals = [
                    value(r)
                    for r in runs
                    if r["policy"] == policy and r["seed"] == seed and value(r) is not None
                ]
                if not vals:
                    continue
                x = i - 0.4 + width * (j + 0.5)
                ax.bar(x, sum(vals) / len(vals), width * 0.9, color=color, alpha=0.35)
                ax.scatter([x] * len(vals), vals, color=color, s=14, zorder=3,
                           label=f"seed {seed}" if i == 0 else None)  # fmt: skip
        ax.set_xticks(range(len(policies)))
        # a variant's keys one per line, so a long one does not squash the panels
        ax.set_xticklabels([p.replace(":", "\n").replace(",", "\n") for p in policies],
                           rotation=30, ha="right", fontsize=8)  # fmt: skip
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return [out_path]
