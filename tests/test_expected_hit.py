"""Admission-time prediction: the hit vLLM finds when it admits a request counts the requests
routed there ahead of it, which have no events yet (issue 17, router.core.speculative).

A simulated replica (its own block pool and hit rule, gpu_emitter) serves one request at a
time in real-time steps, so a request routed behind another with the same prefix waits in its
queue: the events cannot yet show the first one's blocks, the replica will have them when it
admits the second. The router's ``x-kvrouter-expected-hit`` must equal the ``cached_tokens``
the replica reports; ``x-kvrouter-predicted-hit`` (events only) is lower.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.sim_cluster import MODEL, SimCluster, words
from tests.zmq_helpers import wait_for


@pytest.fixture(params=[True, False], ids=["speculative", "events-only"])
def cluster(request: pytest.FixtureRequest) -> Iterator[SimCluster]:
    policy = f"[pools.policy]\nspeculative_insert = {'true' if request.param else 'false'}\n"
    # one replica, one request at a time, 20 ms decode steps: requests queue behind each other
    c = SimCluster(400, names=("a",), extra_toml=policy, max_num_seqs=1, time_scale=1.0)
    c.speculative = request.param  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        c.close()


def send(c: SimCluster, prompt: str, max_tokens: int, out: dict[str, Any]) -> None:
    with httpx.Client(base_url=c.router.url, timeout=60) as http:  # type: ignore[union-attr]
        r = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        )
    out["status"] = r.status_code
    out["predicted"] = int(r.headers["x-kvrouter-predicted-hit"])
    out["expected"] = int(r.headers["x-kvrouter-expected-hit"])
    out["in-flight"] = int(r.headers["x-kvrouter-in-flight-hit"])
    usage = r.json()["usage"]
    out["cached"] = usage["prompt_tokens_details"]["cached_tokens"]
    out["prompt"] = usage["prompt_tokens"]
    out["routed_hit"] = out["expected"]


def in_flight(c: SimCluster) -> float:
    return c.metric("kvrouter_in_flight", pool=MODEL, replica="a")


def test_expected_hit_counts_the_requests_routed_ahead(cluster: SimCluster) -> None:
    c = cluster
    rng = random.Random(5)
    # the next turn extends the previous prompt (a prompt that diverges inside it would hit
    # 0 on a sliding-window layout, spec §4.7 Example 2; the overlay must predict that too)
    turn = words(rng, 330)
    turn2 = turn + " " + words(rng, 50)
    results: list[dict[str, Any]] = [{}, {}, {}]
    threads = [
        # a long answer holds the only sequence slot for ~2 s of 20 ms decode steps
        threading.Thread(target=send, args=(c, words(rng, 40), 100, results[0])),
        threading.Thread(target=send, args=(c, turn, 4, results[1])),
        threading.Thread(target=send, args=(c, turn2, 4, results[2])),
    ]
    for i, t in enumerate(threads):
        t.start()
        wait_for(lambda n=i + 1: in_flight(c) >= n, 10, f"request {i} in flight")
    for t in threads:
        t.join(60)
    assert all(r.get("status") == 200 for r in results), results
    second, third = results[1], results[2]
    # the third was routed while the second waited in the replica's queue: no event could say
    # what the second caches, and the replica found it when it admitted the third
    assert second["cached"] == 0
    assert third["predicted"] == 0 < third["cached"]
    if c.speculative:  # type: ignore[attr-defined]
        assert third["expected"] == third["cached"]
        want = {"exact": 3.0, "under": 0.0}
    else:
        assert third["expected"] == third["predicted"] == 0
        want = {"exact": 2.0, "under": 1.0}

    def outcomes(basis: str) -> dict[str, float]:
        return {
            o: c.metric("kvrouter_prediction_outcomes_total", basis=basis, outcome=o, pool=MODEL)
            for o in ("exact", "under", "over")
        }

    # counted once the answer is out (polled: the client can be a little ahead)
    wait_for(lambda: outcomes("admission") == {**want, "over": 0.0}, 10, "admission outcomes")
    assert outcomes("events") == {"exact": 2.0, "under": 1.0, "over": 0.0}
    # once the answers are in and their events applied, the overlay empties (confirmed by
    # the events, or at the end of the grace) and the events alone give the same hit
    c.sync("a")
    if c.speculative:  # type: ignore[attr-defined]
        wait_for(lambda: c.explain(prompt=turn)["speculative_entries"] == 0, 10, "overlay to empty")
    (row,) = c.explain(prompt=turn2)["replicas"]
    # cache pressure: the uncached tokens sent there, by the hit each was routed with (the
    # third's expected hit with speculation, 0 without), decaying over a 30 s half-life
    sent = sum(r["prompt"] - r["routed_hit"] for r in results)
    assert 0.5 * sent < row["load"]["recent_new_tokens"] <= sent  # < 30 s of decay
    # the same prompt again: its own checkpoint now, and no speculation left to add
    assert row["hit_tokens"] == row["expected_hit_tokens"] > third["cached"]
