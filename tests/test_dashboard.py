"""The Grafana dashboard (config/grafana/kvrouter-dashboard.json) asks only for what a running
router exports: every metric a panel's PromQL (or a template variable) names is a family of
its ``/metrics`` with the right suffix for its type, every label a selector or a ``by``
clause names is one of that family's labels, and the panels the issue asks for are there."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fake_replica import MODEL
from prometheus_client.parser import text_string_to_metric_families
from test_proxy import Cluster, words
from zmq_helpers import wait_for

DASHBOARD = Path(__file__).resolve().parents[1] / "config" / "grafana" / "kvrouter-dashboard.json"

# PromQL words that are not metric names (functions, aggregations, keywords).
PROMQL = frozenset(
    ("sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
     "clamp_min", "clamp_max", "topk", "bottomk", "abs", "by", "without", "on", "ignoring",
     "group_left", "group_right", "bool", "and", "or", "unless", "offset", "label_values")
)  # fmt: skip
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def exported(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Sample names a query may use -> family, and each family's labels (seen on samples)."""
    names: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            names[family.name + suffix] = family.name
        seen = labels.setdefault(family.name, set())
        for s in family.samples:
            seen.update(s.labels)
    return names, labels


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and template variable."""
    out = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", ()))  # a collapsed row holds its panels
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for t in panel["targets"]:
            assert t.get("expr"), f"panel {panel['title']!r}: empty query"
            out.append((panel["title"], t["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"${var['name']}", var["query"]["query"]))
            assert var["definition"] == var["query"]["query"]
    return out


def metric_names(expr: str) -> list[str]:
    """The metric names ``expr`` reads: every identifier left once strings, label matchers,
    ranges, grouping clauses and PromQL's own words are taken out."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = _BY.sub(" ", bare)
    bare = re.sub(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*\w+\s*\)", r"\1", bare)
    return [w for w in _IDENT.findall(bare) if w not in PROMQL]


def test_every_dashboard_query_names_only_what_the_router_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    with Cluster() as c:
        http = c.http
        prompt = words(21, 60)
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": prompt}).is_success
        body = {"model": MODEL, "prompt": words(22, 60), "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            r.read()
        bad = {"model": "nope", "prompt": "w"}
        assert http.post("/v1/completions", json=bad).status_code == 404
        assert http.post("/v1/completions", content=b"{nope").status_code == 400
        wait_for(lambda: "kvrouter_stream_lag_seconds{" in http.get("/metrics").text, 5, "events")
        names, labels = exported(http.get("/metrics").text)

    used: set[str] = set()
    problems: list[str] = []
    for where, expr in queries(dashboard):
        found = metric_names(expr)
        if not found:
            problems.append(f"{where}: no metric in {expr!r}")
        families = set()
        for name in found:
            if name not in names:
                problems.append(f"{where}: {name} is not exported (in {expr!r})")
                continue
            families.add(names[name])
            used.add(names[name])
        # labels a selector matches on must be the family's (where samples show them)
        for metric, matchers in _SELECTOR.findall(expr):
            fam = names.get(metric)
            have = labels.get(fam or "", set())
            for label in _MATCHER.findall(matchers):
                if have and label not in have:
                    problems.append(f"{where}: {metric} has no label {label!r} ({sorted(have)})")
        # labels a by() keeps must come from one of the expression's families
        have = set().union(*(labels[f] for f in families)) if families else set()
        for group in _BY.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if have and label not in have:
                    problems.append(f"{where}: no family of {expr!r} has label {label!r}")
        if "label_values" in expr:
            label = expr.rsplit(",", 1)[1].strip(" )")
            if label not in have:
                problems.append(f"{where}: label_values label {label!r} not in {sorted(have)}")
    assert not problems, "\n".join(problems)

    # the panels the issue asks for
    for family in (
        "kvrouter_requests",  # request rate by status class
        "kvrouter_router_added_seconds",  # router-added latency p50/p99
        "kvrouter_upstream_ttft_seconds",  # upstream TTFT p50/p99
        "kvrouter_prediction_exact",  # the exactness ratio ...
        "kvrouter_prediction_checked",  # ... of checked predictions
        "kvrouter_replica_up",
        "kvrouter_replica_ejected",
        "kvrouter_replica_trust",
        "kvrouter_ingest_errors",
        "kvrouter_index_entries",
        "kvrouter_index_bytes",
        "kvrouter_stream_lag_seconds",
    ):
        assert family in used, f"no panel shows {family}"


def test_the_metric_name_reader_itself() -> None:
    """The checker above must see through PromQL (else it proves nothing)."""
    expr = (
        'histogram_quantile(0.99, sum by (le, pool) (rate(kvrouter_x_bucket{pool=~"$pool", '
        'a!="sum"}[$__rate_interval]))) / sum(kvrouter_y_total) and on (pool) kvrouter_z'
    )
    assert metric_names(expr) == ["kvrouter_x_bucket", "kvrouter_y_total", "kvrouter_z"]
    assert metric_names("label_values(kvrouter_index_entries, pool)") == ["kvrouter_index_entries"]
    assert _SELECTOR.findall(expr)[0][0] == "kvrouter_x_bucket"
    assert _MATCHER.findall('pool=~"$pool", a!="sum"') == ["pool", "a"]
