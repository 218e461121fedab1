"""The routing load from a replica's ``/metrics``: other clients' share, the router's own now.

A scraped ``num_requests_running`` is up to a scrape interval old. Counting the router's own
requests from it kept a just-finished request weighing on the replica that had cached its
prefix; router.server.scrape.others_load keeps only other clients' share and the router adds its
own in-flight count at decision time.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_proxy import Cluster, cluster, words  # noqa: F401  (module fixture)
from zmq_helpers import wait_for

from router.server.scrape import others_load
from router.server.vllm_metrics import parse_start_time, parse_vllm_metrics, restarted

counts = st.integers(0, 40)

# (scraped running, scraped waiting, router in flight before the GET, after it)
#   -> (others' running, others' waiting), worked by hand.
CASES = [
    ((5, 2, 0, 0), (5, 2)),  # the router has nothing there: all of it is others'
    ((5, 2, 3, 3), (2, 2)),  # the router's 3 are among the running
    ((5, 2, 2, 3), (2, 2)),  # one more started during the GET: 3 of the router's
    ((5, 2, 3, 1), (2, 2)),  # two finished during the GET: still counted as 3
    ((3, 2, 3, 3), (0, 2)),  # every running request is the router's
    ((3, 2, 4, 4), (0, 1)),  # one of the router's 4 is still waiting
    ((3, 2, 5, 5), (0, 0)),  # two of them waiting: nothing left for others
    ((3, 2, 9, 9), (0, 0)),  # the scrape is older than the router's count: not negative
    ((0, 4, 2, 2), (0, 2)),  # the router's 2 were just admitted, both waiting
    ((0, 0, 2, 0), (0, 0)),  # an idle replica
    ((7, 0, 1, 0), (6, 0)),
]


@pytest.mark.parametrize(("scraped", "others"), CASES)
def test_others_load_by_hand(scraped, others) -> None:
    run, wait, before, after = scraped
    r, w = others_load({0: float(run)}, {0: float(wait)}, {0: before}, {0: after})
    assert (r, w) == ({0: float(others[0])}, {0: float(others[1])})


@given(counts, counts, counts, counts)
def test_others_load_properties(run, wait, before, after) -> None:
    r, w = others_load({0: float(run)}, {0: float(wait)}, {0: before}, {0: after})
    # Never negative, never more than was scraped.
    assert 0 <= r[0] <= run and 0 <= w[0] <= wait
    # The router's own requests cover at most what it had in flight at either end of the GET.
    assert r[0] + w[0] >= run + wait - max(before, after)
    # No own requests: the scrape unchanged.
    if before == after == 0:
        assert (r[0], w[0]) == (run, wait)
    # Before and after play the same part.
    assert others_load({0: float(run)}, {0: float(wait)}, {0: after}, {0: before}) == (r, w)
    # One more own request never makes others' load larger.
    r2, w2 = others_load({0: float(run)}, {0: float(wait)}, {0: before + 1}, {0: after + 1})
    assert r2[0] <= r[0] and w2[0] <= w[0]


def test_an_engine_in_only_one_metric() -> None:
    # engine 0 reports running only, engine 1 waiting only; the router has 1 on engine 1,
    # which is taken off engine 1's waiting since it has nothing running.
    r, w = others_load({0: 2.0}, {1: 3.0}, {1: 1}, {1: 1})
    assert (r, w) == ({0: 2.0, 1: 0.0}, {0: 0.0, 1: 2.0})


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


def test_a_failed_scrape_forgets_what_the_last_one_said(cluster: Cluster) -> None:  # noqa: F811
    """Other clients' load is known only from a scrape that worked: while a replica's
    ``/metrics`` fails it counts as unknown (the router's own in-flight requests only), not
    as whatever the last good scrape said, which would weigh against the replica for as long
    as the failures lasted (and a little after it came back)."""
    prompt = words(4343, 40)

    def running(name: str) -> object:
        rows = cluster.explain(prompt=prompt)["replicas"]
        return next(row["load"]["running"] for row in rows if row["replica"] == name)

    fake = cluster.fake("a")
    fake.others_running = 3
    try:
        wait_for(lambda: running("a") == 3, 10, "a scrape of a's other clients")
        fake.metrics_status = 500
        wait_for(lambda: running("a") is None, 10, "a failed scrape dropping them (unknown)")
        reps = cluster.http.get("/admin/replicas", headers=cluster.admin).json()["replicas"]
        assert next(r for r in reps if r["name"] == "a")["scrape_error"] == "HTTP 500"
        fake.metrics_status = None
        wait_for(lambda: running("a") == 3, 10, "the next good scrape")
    finally:
        fake.metrics_status = None
        fake.others_running = 0
    wait_for(lambda: running("a") == 0, 10, "the next scrape")


def test_label_values_that_are_not_ranks_or_counts_are_skipped() -> None:
    huge = b"9" * 5000  # int() refuses it (CPython's digit limit); 400 digits overflow float
    text = (
        b'vllm:num_requests_running{engine="' + huge + b'"} 7.0\n'
        b'vllm:num_requests_running{engine="one"} 5.0\n'
        b'vllm:num_requests_running{engine="\xc2\xb9"} 4.0\n'  # '\u00b9' in UTF-8
        b'vllm:num_requests_running{my_engine="3",engine="1"} 2.0\n'
        b'vllm:num_requests_waiting{my_engine="3"} 1.0\n'
        b'vllm:cache_config_info{engine="0",num_gpu_blocks="' + b"9" * 400 + b'"} 1.0\n'
        b'vllm:cache_config_info{engine="1",num_gpu_blocks="640"} 1.0\n'
        b'vllm:cache_config_info{engine="' + huge + b'",num_gpu_blocks="640"} 1.0\n'
    )
    parsed = parse_vllm_metrics(text)
    assert parsed["running"] == {1: 2.0}  # my_engine is another label, not the rank
    assert parsed["waiting"] == {-1: 1.0}
    assert parsed["num_gpu_blocks"] == {1: 640.0}


metric_names = st.sampled_from([
    b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"vllm:kv_cache_usage_perc",
    b"vllm:request_success_total", b"vllm:cache_config_info", b"process_start_time_seconds",
])  # fmt: skip
label_values = st.one_of(st.binary(max_size=12), st.text(max_size=6).map(str.encode),
                         st.integers(0, 10**600).map(lambda n: str(n).encode()))  # fmt: skip
labels = st.lists(
    st.tuples(st.sampled_from([b"engine", b"num_gpu_blocks", b"model_name", b"x"]), label_values),
    max_size=3,
).map(lambda kv: b"{" + b",".join(k + b'="' + v + b'"' for k, v in kv) + b"}")
values = st.one_of(
    st.floats(allow_nan=True).map(lambda f: repr(f).encode()),
    st.integers(-(10**600), 10**600).map(lambda n: str(n).encode()),
    st.binary(max_size=8),
)
lines = st.one_of(
    st.tuples(metric_names, labels | st.just(b""), values).map(lambda t: t[0] + t[1] + b" " + t[2]),
    st.binary(max_size=40),
)


@given(st.lists(lines, max_size=8).map(b"\n".join))
def test_any_metrics_page_parses_without_raising(text: bytes) -> None:
    parsed = parse_vllm_metrics(text)
    for per_rank in parsed.values():
        assert all(-1 <= rank < 10**15 for rank in per_rank)
    start = parse_start_time(text)
    assert start is None or isinstance(start, float)


def test_the_start_time_is_read_as_vllm_exports_it() -> None:
    # as vLLM 0.32's API server serves it (prometheus_client's process collector)
    text = (
        b"# HELP process_start_time_seconds Start time of the process since unix epoch in "
        b"seconds.\n# TYPE process_start_time_seconds gauge\n"
        b"process_start_time_seconds 1.79547170445e+09\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    )
    assert parse_start_time(text) == 1795471704.45
    assert parse_start_time(b'vllm:num_requests_running{engine="0"} 1.0\n') is None
    assert parse_start_time(b"process_start_time_seconds NaNx\n") is None
    # another metric whose name starts alike is not it
    assert parse_start_time(b"process_start_time_seconds_total 5\n") is None


def test_restarted_needs_two_known_different_start_times() -> None:
    assert restarted(1000.0, 1000.5)
    assert not restarted(1000.0, 1000.01)  # the same process, read twice
    assert not restarted(None, 1000.0)  # nothing known yet
    assert not restarted(1000.0, None)  # the scrape did not say
