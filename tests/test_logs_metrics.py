"""Logs and metrics that tell each request's story (issue 13 items 5 and 6), over real
loopback HTTP in front of fake replicas: every ``/v1/*`` answer counted with its pool, replica
and status class (the router's own 4xx/5xx and the doors' 401 included), the latency
histograms, no ``*_created`` series, one replica label form, the routing-decision log line,
admin / mismatch / mid-stream lines; and ``kvrouter serve --log-format json`` as a
subprocess: every line JSON, scrapes and probes kept out of INFO, one warning when a replica's
scrape starts failing, one when it goes down."""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_replica import MODEL, FakeReplica, ServerThread, free_port
from prometheus_client.parser import text_string_to_metric_families
from test_proxy import Cluster, router_toml, words
from zmq_helpers import wait_for

from router.config import ConfigError, parse_config
from router.server.logs import FIELDS, JsonFormatter, TextFormatter, kv

ROOT = Path(__file__).resolve().parents[1]
TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")

Key = tuple[str, str, str, str]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster() as c:  # three fake replicas a, b, c
        yield c


@pytest.fixture(autouse=True)
def _knobs(cluster: Cluster) -> Iterator[None]:
    """Each test starts and ends with the replicas well behaved and none drained."""
    cluster.reset_knobs()
    yield
    cluster.reset_knobs()


def requests_total(http: httpx.Client) -> dict[Key, float]:
    """``kvrouter_requests_total`` by (pool, replica, status, status_class)."""
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == "kvrouter_requests_total":
                lb = s.labels
                out[(lb["pool"], lb["replica"], lb["status"], lb["status_class"])] = s.value
    return out


def delta(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def settle(read: Callable[[], Any], want: Any, what: str, timeout: float = 5.0) -> None:
    """Poll until ``read() == want`` (a request is counted just after its last byte went
    out, so the client can be a little ahead); on timeout show what was read."""
    got = None

    def same() -> bool:
        nonlocal got
        got = read()
        return got == want

    try:
        wait_for(same, timeout, what)
    except AssertionError:
        assert got == want, what


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    return getattr(record, FIELDS, None) or {}


def logged(caplog: pytest.LogCaptureFixture, logger: str, **match: Any) -> logging.LogRecord:
    """The first record of ``logger`` whose fields include ``match`` (polled: the router
    logs a request once its last byte is out, from its own thread)."""

    def find() -> logging.LogRecord | None:
        for rec in list(caplog.records):
            f = fields_of(rec)
            if rec.name == logger and all(f.get(k) == v for k, v in match.items()):
                return rec
        return None

    return wait_for(find, 5, f"a {logger} line with {match}")


def hist(http: httpx.Client, name: str) -> dict[str, tuple[float, float]]:
    """A histogram's (count, sum) by pool."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name in (name + "_count", name + "_sum"):
                i = 0 if s.name.endswith("_count") else 1
                out.setdefault(s.labels["pool"], [0.0, 0.0])[i] = s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def complete(http: httpx.Client, prompt: str, **body: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **body})


# -- every answer counted -------------------------------------------------------------------


def test_every_v1_answer_is_counted_with_pool_replica_and_status_class(cluster: Cluster) -> None:
    http = cluster.http
    before = requests_total(http)
    ok = complete(http, words(11, 20))
    assert ok.status_code == 200
    served = ok.headers["x-kvrouter-replica"]
    assert complete(http, "w1", model="nope").status_code == 404
    assert http.post("/v1/completions", content=b"{nope").status_code == 400
    limit = cluster.config.server.max_body_bytes
    assert http.post("/v1/completions", content=b"x" * (limit + 1)).status_code == 413
    assert http.get("/v1/completions").status_code == 405
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/models").status_code == 200
    for _ in range(3):  # not /v1/*: not requests of the API
        assert http.get("/health").status_code == 200
        assert http.get("/admin/replicas", headers=cluster.admin).status_code == 200
    want = {
        (MODEL, served, "200", "2xx"): 1.0,
        ("", "", "404", "4xx"): 2.0,
        ("", "", "400", "4xx"): 1.0,
        ("", "", "413", "4xx"): 1.0,
        ("", "", "405", "4xx"): 1.0,
        ("", "", "200", "2xx"): 1.0,  # GET /v1/models
    }
    settle(lambda: delta(before, requests_total(http)), want, "each answer counted once")


def test_a_client_gone_before_its_body_is_a_499(cluster: Cluster) -> None:
    """No response could be sent: counted as 499 (nginx's "client closed request")."""
    before = requests_total(cluster.http)
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        "content-length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", cluster.router.port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"model": "')
    want = {("", "", "499", "4xx"): 1.0}
    settle(lambda: delta(before, requests_total(cluster.http)), want, "the 499")


def test_the_routers_own_5xx_and_the_doors_401_are_counted() -> None:
    """A replica's 5xx passed on (counted under it), the doors' 401, the router's own 503
    (nothing to route to) and 502 (every attempt failed): pool known, no replica."""
    c = Cluster(names=("x", "y"), api_key="k")
    key = {"authorization": "Bearer k"}
    try:
        http = c.http
        before = requests_total(http)
        assert complete(http, "w1 w2").status_code == 401
        for name in ("x", "y"):
            c.fake(name).fail_status = 500
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w1"}, headers=key)
        assert r.status_code == 500
        last = r.headers["x-kvrouter-replica"]
        for name in ("x", "y"):
            c.fake(name).fail_status = None
            assert http.post(f"/admin/replicas/{name}/drain", headers=c.admin).status_code == 200
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w1"}, headers=key)
        assert r.status_code == 503
        for name in ("x", "y"):
            http.post(f"/admin/replicas/{name}/undrain", headers=c.admin)
            c.fakes[name][1].stop()  # connections refused from now on
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w1"}, headers=key)
        assert r.status_code == 502
        want = {
            ("", "", "401", "4xx"): 1.0,
            (MODEL, last, "500", "5xx"): 1.0,
            (MODEL, "", "503", "5xx"): 1.0,
            (MODEL, "", "502", "5xx"): 1.0,
        }
        settle(lambda: delta(before, requests_total(http)), want, "the 401, 500, 503 and 502")
        for name in ("x", "y"):  # each tried and failed over twice (500, then refused)
            assert c.sample("kvrouter_failovers_total", pool=MODEL, replica=name) == 2
    finally:
        c.close()


def test_latency_histograms_observe_by_pool(cluster: Cluster) -> None:
    http = cluster.http
    names = (
        "kvrouter_request_duration_seconds",
        "kvrouter_router_added_seconds",
        "kvrouter_upstream_ttft_seconds",
    )
    before = {n: hist(http, n) for n in names}
    assert complete(http, words(12, 30)).status_code == 200
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": words(13, 30),
                                                      "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200
        assert b"".join(r.iter_raw()).endswith(b"data: [DONE]\n\n")
    assert complete(http, "w1", model="nope").status_code == 404

    def counts() -> dict[str, dict[str, float]]:
        out = {}
        for n in names:
            now = hist(http, n)
            out[n] = {
                pool: now[pool][0] - before[n].get(pool, (0.0, 0.0))[0]
                for pool in now
                if now[pool][0] != before[n].get(pool, (0.0, 0.0))[0]
            }
        return out

    want = {
        # both routed requests and the 404 (no pool: "")
        "kvrouter_request_duration_seconds": {MODEL: 2.0, "": 1.0},
        # only requests that reached an attempt
        "kvrouter_router_added_seconds": {MODEL: 2.0},
        # only the streamed answer
        "kvrouter_upstream_ttft_seconds": {MODEL: 1.0},
    }
    settle(counts, want, "each histogram observed what it covers")
    after = {n: hist(http, n)[MODEL][1] - before[n].get(MODEL, (0, 0))[1] for n in names}
    total, added, ttft = (after[n] for n in names)
    assert 0 < added < total, (added, total)
    assert 0 < ttft < total, (ttft, total)
    assert added < 1.0  # parse + tokenize + predict + choose for two short prompts


def test_no_created_series_and_one_replica_label_form(cluster: Cluster) -> None:
    assert complete(cluster.http, words(14, 20)).status_code == 200
    wait_for(lambda: "kvrouter_stream_lag_seconds{" in cluster.http.get("/metrics").text, 5, "lag")
    text = cluster.http.get("/metrics").text
    assert "_created" not in text
    families = list(text_string_to_metric_families(text))
    assert any(f.name == "kvrouter_requests" for f in families)
    replicas = set()
    for family in families:
        for s in family.samples:
            if "replica" in s.labels:
                replicas.add(s.labels["replica"])
            if s.labels.get("dp_rank") is not None:
                assert s.labels["dp_rank"] == "0", s
            assert "stream" not in s.labels, s  # per replica and rank, not a stream name
    assert replicas <= {"", "a", "b", "c"}, replicas
    assert {"a", "b", "c"} <= replicas


# -- log lines --------------------------------------------------------------------------------


def test_the_routing_decision_is_one_structured_line(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.request")
    prompt = words(15, 120)
    first = complete(cluster.http, prompt)
    rep = first.headers["x-kvrouter-replica"]
    cluster.wait_hits(prompt, lambda h: h[rep] > 0, "the first answer's blocks indexed")
    r = cluster.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt + " w1"},
        headers={"x-request-id": "rid-decision-1"},
    )
    assert r.status_code == 200 and r.headers["x-kvrouter-replica"] == rep
    rec = logged(caplog, "kvrouter.request", request_id="rid-decision-1")
    line = json.loads(JsonFormatter().format(rec))
    assert TS.fullmatch(line["ts"]), line["ts"]
    assert (line["level"], line["logger"]) == ("INFO", "kvrouter.request")
    assert line["message"] == "POST /v1/completions 200"
    assert (line["pool"], line["replica"], line["dp_rank"]) == (MODEL, rep, 0)
    assert line["predicted_hit"] == int(r.headers["x-kvrouter-predicted-hit"]) > 0
    assert line["best_hit"] == line["predicted_hit"]
    assert line["num_tokens"] > line["predicted_hit"]
    assert (line["policy"], line["reason"]) == (cluster.config.pools[0].policy.name, "best_hit")
    assert (line["status"], line["attempts"], line["stream"]) == (200, 1, False)
    assert 0 < line["router_ms"] < line["total_ms"]
    assert line["ttft_ms"] is None  # not streamed
    assert "error" not in line

    # A refused request: one line too, with the router's own message and no decision.
    bad = cluster.http.post(
        "/v1/completions",
        json={"model": "nope", "prompt": "w1"},
        headers={"x-request-id": "rid-decision-2"},
    )
    assert bad.status_code == 404
    line = json.loads(JsonFormatter().format(logged(caplog, "kvrouter.request",
                                                    request_id="rid-decision-2")))  # fmt: skip
    assert line["status"] == 404 and line["pool"] is None and "replica" not in line
    assert line["error"] == bad.json()["error"]["message"]


def test_admin_changes_mismatches_and_mid_stream_failures_are_logged(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    for what in ("drain", "undrain"):
        r = cluster.http.post(f"/admin/replicas/b/{what}", headers=cluster.admin)
        assert r.status_code == 200
        rec = logged(caplog, "kvrouter.admin", change=what + "ed", replica="b")
        assert fields_of(rec)["pool"] == MODEL
        assert fields_of(rec)["client"].startswith("127.0.0.1:")

    for fake, _ in cluster.fakes.values():
        fake.lie_by = 16
    r = cluster.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": words(16, 40)},
        headers={"x-request-id": "rid-mismatch"},
    )
    assert r.status_code == 200
    rec = logged(caplog, "kvrouter.proxy", request_id="rid-mismatch")
    f = fields_of(rec)
    assert rec.getMessage().startswith("prediction mismatch")
    assert (f["replica"], f["predicted"], f["cached_tokens"], f["error"]) == (
        r.headers["x-kvrouter-replica"], 0, 16, 16,
    )  # fmt: skip

    for fake, _ in cluster.fakes.values():
        fake.lie_by = 0
        fake.die_after_chunks = 1
    cut = {n: cluster.sample("kvrouter_midstream_failures_total", pool=MODEL, replica=n)
           for n in cluster.fakes}  # fmt: skip
    with cluster.http.stream(
        "POST",
        "/v1/completions",
        json={"model": MODEL, "prompt": words(17, 40), "stream": True},
        headers={"x-request-id": "rid-cut"},
    ) as resp:
        assert resp.status_code == 200
        raw = b"".join(resp.iter_raw())
        rep = resp.headers["x-kvrouter-replica"]
    assert b"failed mid-stream" in raw and raw.endswith(b"data: [DONE]\n\n")
    rec = logged(caplog, "kvrouter.proxy", request_id="rid-cut")
    assert rec.levelno == logging.WARNING and fields_of(rec)["replica"] == rep
    assert "127.0.0.1" in fields_of(rec)["url"]  # the address goes to the log, not the client
    assert cluster.sample("kvrouter_midstream_failures_total", pool=MODEL, replica=rep) == (
        cut[rep] + 1
    )


def test_formatters() -> None:
    rec = logging.LogRecord("kvrouter.x", logging.INFO, __file__, 1, "hello %s", ("you",), None)
    fields = kv(pool="p", error='a "b"', n=3, ok=True, ms=0.1234567, none=None, message="m")
    rec.__dict__.update(fields)
    text = TextFormatter().format(rec)
    assert re.fullmatch(
        TS.pattern + r' INFO kvrouter\.x: hello you pool=p error="a \\"b\\"" n=3 ok=true '
        r"ms=0\.123457 none=- message=m",
        text,
    ), text
    line = json.loads(JsonFormatter().format(rec))
    assert line["message"] == "hello you" and line["field_message"] == "m"  # never replaced
    assert (line["pool"], line["n"], line["none"]) == ("p", 3, None)
    try:
        raise ValueError("boom")
    except ValueError:
        err = logging.LogRecord("kvrouter.x", logging.ERROR, __file__, 1, "failed", (),
                                sys.exc_info())  # fmt: skip
    err.__dict__.update(kv(path=Path("/x")))  # not JSON: written as its str
    line = json.loads(JsonFormatter().format(err))
    assert "ValueError: boom" in line["exception"] and line["path"] == "/x"
    assert "ValueError: boom" in TextFormatter().format(err)
    with pytest.raises(ConfigError, match="log_format"):
        parse_config('[server]\nlog_format = "xml"\n' + _one_pool())


def _one_pool() -> str:
    return '[[pools]]\nmodel = "m"\n[[pools.replicas]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'


# -- kvrouter serve --log-format json ------------------------------------------------------


def _replicas(http: httpx.Client, admin: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in http.get("/admin/replicas", headers=admin).json()["replicas"]}


def test_serve_logs_json_lines_and_keeps_scrapes_and_probes_out_of_info(tmp_path: Path) -> None:
    fakes: dict[str, tuple[FakeReplica, ServerThread]] = {}
    for name in ("a", "b", "c"):
        fake = FakeReplica(name)
        fakes[name] = (fake, ServerThread(fake.app).start())
    port = free_port()
    # the file asks for text; the flag wins. Probes every 0.1 s, scrapes every 0.2 s.
    text = router_toml(fakes, port=port, log_format="text")
    cfg = tmp_path / "router.toml"
    cfg.write_text("[health]\nprobe_interval_s = 0.1\nunhealthy_threshold = 2\n" + text)
    err = tmp_path / "stderr"
    url = f"http://127.0.0.1:{port}"
    admin = {"authorization": "Bearer t0ken", "content-type": "application/json"}
    with err.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg),
             "--log-format", "json"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sink,
        )  # fmt: skip
    try:
        http = httpx.Client(base_url=url, timeout=10)

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"router exited {proc.returncode}: {err.read_text()}")
            try:
                return http.get("/ready").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 20, "the router ready")
        t0 = time.time()
        # several scrapes of every replica (and probes, every 0.1 s)
        wait_for(
            lambda: all((r["scraped_at"] or 0) > t0 + 0.5 for r in _replicas(http, admin).values()),
            10,
            "scrapes after start",
        )
        r = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": words(18, 30)},
            headers={"x-request-id": "rid-cli"},
        )
        assert r.status_code == 200
        assert (
            http.post("/v1/completions", json={"model": "nope", "prompt": "w"}).status_code == 404
        )
        assert http.post("/admin/replicas/a/drain", headers=admin).status_code == 200
        # c dies: its scrapes fail (one warning, however many fail) and it goes down
        fakes["c"][1].stop()
        wait_for(lambda: _replicas(http, admin)["c"]["scrape_error"], 10, "c's scrape failing")
        t1 = time.time()
        wait_for(
            lambda: all((r["scraped_at"] or 0) > t1 + 0.6 for n, r in _replicas(http, admin).items()
                        if n != "c"),
            10,
            "three more scrape rounds",
        )  # fmt: skip
        wait_for(lambda: _replicas(http, admin)["c"]["health"]["state"] == "down", 10, "c down")
        http.close()
    finally:
        proc.terminate()
        proc.wait(20)
        for fake, srv in fakes.values():
            srv.stop()
            fake.close()
    lines = [json.loads(x) for x in err.read_text().splitlines() if x.strip()]
    assert lines
    for line in lines:  # every line is one JSON object with the core keys
        assert {"ts", "level", "logger", "message"} <= line.keys(), line
        assert TS.fullmatch(line["ts"]), line
    info = [x for x in lines if x["level"] not in ("DEBUG",)]
    assert not [x for x in info if x["logger"].startswith(("httpx", "httpcore"))]
    assert not [x for x in info if "/metrics" in x["message"] or "/health" in x["message"]]
    assert any(x["logger"].startswith("uvicorn") for x in lines)  # uvicorn's own lines too
    (req,) = [x for x in lines if x.get("request_id") == "rid-cli"]
    assert req["logger"] == "kvrouter.request" and req["status"] == 200
    for k in ("pool", "replica", "dp_rank", "predicted_hit", "best_hit", "policy", "reason",
              "router_ms", "total_ms", "attempts"):  # fmt: skip
        assert k in req, k
    assert req["replica"] == r.headers["x-kvrouter-replica"]
    assert [x["status"] for x in lines if x["logger"] == "kvrouter.request"] == [200, 404]
    assert [x["change"] for x in lines if x["logger"] == "kvrouter.admin"] == ["drained"]
    scrape = [x for x in lines if x["logger"] == "kvrouter.scrape" and x.get("replica") == "c"]
    assert [x["level"] for x in scrape] == ["WARNING"], scrape
    assert scrape[0]["error"] and scrape[0]["url"].endswith("/metrics")
    down = [x for x in lines if x["logger"] == "kvrouter.health" and x.get("replica") == "c"]
    assert [(x["level"], x["change"]) for x in down] == [("WARNING", "down")], down


def test_the_hash_memo_is_exported_so_its_growth_is_not_taken_for_a_leak(cluster: Cluster) -> None:
    """The router's RSS grows after warm-up until the block-hash memo is full (bench/soak.py);
    the memo's size and bound are exported, and a new long prefix adds steps to it."""
    from events.hashing import DEFAULT_MEMO_ENTRIES, MEMO_SPAN

    before = cluster.sample("kvrouter_hash_memo_steps", pool=MODEL)
    capacity = cluster.sample("kvrouter_hash_memo_capacity_steps", pool=MODEL)
    assert capacity == DEFAULT_MEMO_ENTRIES // MEMO_SPAN
    # 600 words: two whole memo steps of 16 hash units of 16 tokens each
    assert complete(cluster.http, words(21, 600)).status_code == 200
    # the steps come as the replica's events are checked (the router rehashes a stored
    # root's tokens, off the request path), so they are polled for
    after = wait_for(
        lambda: (n := cluster.sample("kvrouter_hash_memo_steps", pool=MODEL)) > before and n,
        10,
        "the memo to grow",
    )
    assert before < after <= capacity
