"""Several routers, one truth: two ``kvrouter serve`` processes in front of the same simulated
replicas, with traffic through one of them only (issue 15, docs/several-routers.md).

Each router subscribes to every replica's event stream (ZeroMQ PUB fans out to any number of
subscribers) and scrapes every replica's ``/metrics``; nothing else passes between them. So
once both have applied the same events, both predict the same hit on every replica for any
prompt, including the prompts only router A routed; and what each router keeps of its own
(requests, in-flight counts, prefix homes) differs. Router A runs from a file, router B from
the quick-start flags alone (``--model``/``--replica``/``--layout``).

Real processes over loopback: the replicas are tests/sim_cluster.py's simulated vLLM (real
``HybridBlockPool``, real ZeroMQ publishers, uvicorn) in this process; the routers are
subprocesses started as an operator would.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_replica import free_port
from tests.sim_cluster import LAYOUT, MODEL, TOKEN, SimCluster, router_toml, words
from tests.zmq_helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
B = 16
ADMIN = {"authorization": f"Bearer {TOKEN}"}
ADMIN_JSON = {**ADMIN, "content-type": "application/json"}  # admin changes
#: What a router predicts about a replica from the events alone (explain's row keys).
PREDICTION = ("hit_tokens", "spec_group_hits", "limiting_group", "trusted",
              "group_blind_hit_tokens", "tier_hits", "num_uncached_common_prefix")  # fmt: skip


@dataclass
class Router:
    name: str
    proc: subprocess.Popen[str]
    url: str
    http: httpx.Client

    def explain(self, ask: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/admin/route/explain", json={"model": MODEL, **ask}, headers=ADMIN)
        assert r.status_code == 200, r.text
        return r.json()

    def rows(self, ask: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {row["replica"]: row for row in self.explain(ask)["replicas"]}

    def predictions(self, ask: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {name: {k: row.get(k) for k in PREDICTION} for name, row in self.rows(ask).items()}

    def metric_sum(self, name: str) -> float:
        text = self.http.get("/metrics").text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$",
                                                text, re.M))  # fmt: skip


def layout_toml() -> str:
    lines = [f"retention_interval = {LAYOUT.retention_interval}"]
    for g in LAYOUT.groups:
        lines += ["[[groups]]", f'kind = "{g.kind}"', f"block_size = {g.block_size}"]
        if g.sliding_window:
            lines.append(f"sliding_window = {g.sliding_window}")
    return "\n".join(lines) + "\n"


def start(name: str, args: list[str], port: int) -> Router:
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", *args, "--port", str(port),
         "--admin-token", TOKEN, "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    router = Router(name, proc, url, httpx.Client(base_url=url, timeout=30))

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"router {name} exited {proc.returncode}: {proc.stderr.read()}")
        try:
            return router.http.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, 60, f"router {name} to be ready")
    return router


def stop(router: Router) -> None:
    router.http.close()
    if router.proc.poll() is None:
        os.killpg(router.proc.pid, signal.SIGTERM)
        try:
            router.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(router.proc.pid, signal.SIGKILL)
            router.proc.wait(5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[SimCluster, Router, Router]]:
    # Engines at the cost model's real-time speed (20 ms per decode step), so a long answer
    # stays in flight while the test looks at both routers, with room for it in the cache.
    cluster = SimCluster(400, router=False, time_scale=1.0)
    routers: list[Router] = []
    try:
        folder = tmp_path_factory.mktemp("routers")
        cfg = folder / "router-a.toml"
        cfg.write_text(router_toml(cluster.replicas))
        layout = folder / "layout.toml"
        layout.write_text(layout_toml())
        routers.append(start("A", ["--config", str(cfg)], free_port()))
        flags = ["--model", MODEL, "--layout", str(layout), "--policy", "kv"]
        for name, rep in cluster.replicas.items():
            pub = rep.publisher
            flags += ["--replica", f"{rep.url},name={name},events={pub.endpoint},"
                                   f"replay={pub.replay_endpoint}"]  # fmt: skip
        routers.append(start("B", flags, free_port()))
        yield cluster, routers[0], routers[1]
    finally:
        for r in routers:
            stop(r)
        cluster.close()


def both_caught_up(cluster: SimCluster, *routers: Router) -> None:
    """Poll until every router has applied every batch every replica has published."""
    for router in routers:
        for name in cluster.replicas:
            wait_for(lambda n=name, r=router: cluster.caught_up(n, http=r.http), 30,
                     f"router {router.name} to apply {name}'s events")  # fmt: skip


def test_both_routers_predict_the_same_hits_from_traffic_through_one(fleet) -> None:
    cluster, a, b = fleet
    rng = random.Random("several-routers")
    families = [words(rng, 10 * B) for _ in range(4)]
    sent = []
    with httpx.Client(base_url=a.url, timeout=60) as client:
        for i in range(12):
            prompt = families[i % 4] + " " + words(rng, 2 * B + i)
            # Novel first turns tie and are spread at random: all of them may land on one
            # replica (a clean-clone CI run saw it). The last family's first turn is kept off
            # that replica (drained on A, for that request only), so the comparison covers
            # more than one replica's index whatever the tie-breaks did.
            used = {replica for _, replica in sent}
            lonely = used.pop() if i == 3 and len(used) == 1 else None
            if lonely is not None:
                d = client.post(f"/admin/replicas/{lonely}/drain", headers=ADMIN_JSON)
                assert d.status_code == 200 and d.json()["drained"], d.text
            r = client.post(
                "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            sent.append((prompt, r.headers["x-kvrouter-replica"]))
            if lonely is not None:
                u = client.post(f"/admin/replicas/{lonely}/undrain", headers=ADMIN_JSON)
                assert u.status_code == 200 and not u.json()["drained"], u.text
    assert len({replica for _, replica in sent}) >= 2  # the traffic spread over replicas
    both_caught_up(cluster, a, b)

    asks = [{"prompt": p} for p, _ in sent]  # exactly what A routed
    asks += [{"prompt": f + " " + words(rng, 3 * B)} for f in families]  # their families, new
    asks += [{"prompt": words(rng, 8 * B)}]  # never seen: no hit anywhere
    asks += [{"messages": [{"role": "user", "content": families[0]}]}]  # other framing
    # A stream's last_seq counts a batch a moment before the index has applied it
    # (tests/test_ingest.py), so each comparison is polled: both must converge on one answer.
    # (Routers that disagree never converge: a different hash algo on B fails here.)
    hits_seen = 0
    for ask in asks:
        last: list[Any] = []

        def agree(ask: dict[str, Any] = ask, last: list[Any] = last) -> Any:
            last[:] = [a.predictions(ask), b.predictions(ask)]
            return last[0] if last[0] == last[1] else None

        try:
            pa = wait_for(agree, 20, "both routers to predict the same")
        except AssertionError:
            raise AssertionError(f"{ask}: A {last[0]} != B {last[1]}") from None
        assert set(pa) == set(cluster.replicas)
        hits_seen += sum(1 for row in pa.values() if row["hit_tokens"] > 0)
    # the comparison is not vacuous: every prompt A sent is now a hit where it went
    for prompt, replica in sent:
        assert a.predictions({"prompt": prompt})[replica]["hit_tokens"] > 0
    assert hits_seen >= len(sent) + len(families)

    # What is each router's own: A routed every request, B none; A homed the prefixes it
    # routed (its affinity credit), B has no homes to credit.
    # (a request is counted as its answer ends: poll, the client may have it a moment earlier)
    wait_for(lambda: a.metric_sum("kvrouter_requests_total") == len(sent), 20, "A's count")
    assert b.metric_sum("kvrouter_requests_total") == 0
    assert a.metric_sum("kvrouter_prefix_home_chunks") > 0
    assert b.metric_sum("kvrouter_prefix_home_chunks") == 0
    prompt, replica = sent[0]
    a_scores = {
        r["replica"]: r["score"]["affinity"] for r in a.explain({"prompt": prompt})["replicas"]
    }
    b_scores = {
        r["replica"]: r["score"]["affinity"] for r in b.explain({"prompt": prompt})["replicas"]
    }
    assert a_scores[replica] > 0 and set(b_scores.values()) == {0}


def test_in_flight_is_per_router_and_load_is_shared_through_the_replicas_metrics(fleet) -> None:
    """A request held open through A: A counts it in flight, B does not; B learns of it only
    from the replica's scraped ``vllm:num_requests_running``, so both see one request running
    there (A: its own in-flight; B: other clients' share of the scrape)."""
    cluster, a, b = fleet
    rng = random.Random("in-flight")
    prompt = words(rng, 4 * B)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 600, "stream": True}
    with (
        httpx.Client(base_url=a.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        replica = resp.headers["x-kvrouter-replica"]
        # Keep the iterator: a dropped one closes the response (the router then aborts it).
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # the answer has started on the replica

        seen: list[Any] = []

        def loads() -> tuple[dict[str, Any], dict[str, Any]] | None:
            la = a.rows({"prompt": prompt})[replica]["load"]
            lb = b.rows({"prompt": prompt})[replica]["load"]
            seen[:] = [la, lb]
            # both have scraped the replica since it started running the request
            if la["running"] == 1 and lb["running"] == 1:
                return la, lb
            return None

        try:
            la, lb = wait_for(loads, 20, "both routers to see one request running")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen (A, B): {seen}") from None
        assert la["in_flight"] == 1 and lb["in_flight"] == 0
        assert a.metric_sum("kvrouter_in_flight") == 1
        assert b.metric_sum("kvrouter_in_flight") == 0
        for other in set(cluster.replicas) - {replica}:
            assert a.rows({"prompt": prompt})[other]["load"]["running"] in (0, None)
    # closing the stream ends the request on the replica (the router aborts it): both see it go
    wait_for(lambda: a.metric_sum("kvrouter_in_flight") == 0, 20, "A's in-flight to drop")
    wait_for(
        lambda: b.rows({"prompt": prompt})[replica]["load"]["running"] in (0, None),
        20,
        "B to see the replica idle again",
    )
