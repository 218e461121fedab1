"""The routing load from a replica's ``/metrics``: other clients' share, the router's own now.

A scraped ``num_requests_running`` is up to a scrape interval old. Counting the router's own
requests from it kept a just-finished request weighing on the replica that had cached its
prefix; router.server.scrape.others_load keeps only other clients' share and the router adds its
own in-flight count at decision time.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from test_proxy import Cluster, cluster, words  # noqa: F401  (module fixture)
from zmq_helpers import wait_for

from router.server.scrape import others_load, parse_vllm_metrics

counts = st.integers(0, 40)


@given(counts, counts, counts, counts)
def test_own_requests_come_off_running_first_then_waiting(run, wait, before, after) -> None:
    r, w = others_load({0: float(run)}, {0: float(wait)}, {0: before}, {0: after})
    mine = max(before, after)
    assert r[0] == max(0, run - mine)
    assert w[0] == max(0, wait - max(0, mine - run))
    # Never more than was scraped, never negative, and all of it when the router has none.
    assert 0 <= r[0] <= run and 0 <= w[0] <= wait
    if mine == 0:
        assert (r[0], w[0]) == (run, wait)
    # Others' load plus the router's own covers what the replica reported.
    assert r[0] + w[0] + mine >= run + wait


def test_unlabelled_metrics_count_every_rank_of_the_router() -> None:
    r, w = others_load({-1: 5.0}, {-1: 1.0}, {0: 2, 1: 1}, {0: 1, 1: 1})
    assert (r[-1], w[-1]) == (2.0, 1.0)


def test_per_engine_metrics_are_split_per_rank() -> None:
    text = (
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        b'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
    )
    parsed = parse_vllm_metrics(text)
    r, w = others_load(parsed["running"], parsed["waiting"], {0: 1, 1: 2}, {0: 1, 1: 2})
    assert r == {0: 2.0, 1: 0.0}
    assert w == {0: 2.0, 1: 0.0}


def test_other_clients_load_steers_the_route(cluster: Cluster) -> None:  # noqa: F811
    """A replica busy with other clients' requests loses a cold request; when they finish
    (the next scrape), it is back in the running."""
    prompt = words(4242, 40)

    def load() -> dict[str, object]:
        rows = cluster.explain(prompt=prompt)["replicas"]
        return {row["replica"]: row["load"]["running"] for row in rows}

    cluster.fake("a").others_running = 3
    cluster.fake("b").others_running = 3
    seen = wait_for(lambda: (x := load()) and x["a"] == 3 and x["b"] == 3 and x, 10, "scrape")
    assert seen["c"] == 0
    assert cluster.explain(prompt=prompt)["chosen"]["replica"] == "c"
    r = cluster.http.post("/v1/completions", json={"model": "fake-model", "prompt": prompt})
    assert r.status_code == 200 and r.headers["x-kvrouter-replica"].startswith("c")
    cluster.fake("a").others_running = cluster.fake("b").others_running = 0
    wait_for(lambda: load() == {"a": 0, "b": 0, "c": 0}, 10, "the next scrape")
