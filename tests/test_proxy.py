"""The router end to end over real loopback HTTP and ZeroMQ, in front of 3 fake replicas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from fake_replica import LAYOUT, MODEL, FakeReplica, ServerThread
from prometheus_client.parser import text_string_to_metric_families
from zmq_helpers import wait_for

from router.config import parse_config
from router.server.app import create_app

TOKEN = "t0ken"


def router_toml(
    reps: dict[str, tuple[FakeReplica, ServerThread]],
    admin_token: str | None = TOKEN,
    **server: Any,
) -> str:
    """A one-pool router config in front of ``reps``; ``server`` adds ``[server]`` keys."""
    groups = (
        '{kind = "full_attention", block_size = 16}, '
        '{kind = "sliding_window", block_size = 16, sliding_window = 48}'
    )
    assert len(LAYOUT.groups) == 2
    lines = ["[server]", "metrics_scrape_interval_s = 0.2"]
    if admin_token is not None:
        lines.append(f'admin_token = "{admin_token}"')
    lines += [f"{k} = {_toml(v)}" for k, v in server.items()]
    lines += ["[[pools]]", f'model = "{MODEL}"', "[pools.layout]", f"groups = [{groups}]"]
    for name, (fake, srv) in reps.items():
        lines += [
            "[[pools.replicas]]",
            f'name = "{name}"',
            f'url = "{srv.url}"',
            f'event_endpoint = "{fake.pub.endpoint}"',
            f'replay_endpoint = "{fake.pub.replay_endpoint}"',
        ]
    return "\n".join(lines) + "\n"


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, str) else repr(v)


class Cluster:
    """A router in this process in front of fake replicas (``a``, ``b``, ``c`` by default);
    ``server`` adds ``[server]`` keys."""

    def __init__(
        self, names: tuple[str, ...] = ("a", "b", "c"), admin_token: str | None = TOKEN,
        **server: Any,
    ) -> None:  # fmt: skip
        self.fakes: dict[str, tuple[FakeReplica, ServerThread]] = {}
        for name in names:
            fake = FakeReplica(name)
            self.fakes[name] = (fake, ServerThread(fake.app).start())
        self.config = parse_config(router_toml(self.fakes, admin_token, **server))
        self.router = ServerThread(create_app(self.config)).start()
        self.http = httpx.Client(base_url=self.router.url, timeout=10)
        self.admin = {"content-type": "application/json"}
        """Headers of admin calls: the token, and the JSON content type admin changes need."""
        if admin_token:
            self.admin["authorization"] = f"Bearer {admin_token}"

    def fake(self, name: str) -> FakeReplica:
        return self.fakes[name][0]

    def direct(self, name: str) -> httpx.Client:
        return httpx.Client(base_url=self.fakes[name][1].url, timeout=10)

    def explain(self, **body: Any) -> dict[str, Any]:
        r = self.http.post("/admin/route/explain", json=body, headers=self.admin)
        assert r.status_code == 200, r.text
        return r.json()

    def hits(self, prompt: str | list[int]) -> dict[str, int]:
        """Each replica's predicted hit of a text prompt or of token ids."""
        key = "prompt" if isinstance(prompt, str) else "token_ids"
        ex = self.explain(**{key: prompt})
        return {row["replica"]: row["hit_tokens"] for row in ex["replicas"]}

    def wait_hits(self, prompt: str | list[int], cond, what: str) -> dict[str, int]:
        return wait_for(lambda: (h := self.hits(prompt)) and cond(h) and h, 10, what)

    def sample(self, name: str, **labels: str) -> float:
        """One sample of the router's ``/metrics`` (0.0 while the labelled child is absent)."""
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                if s.name == name and s.labels == labels:
                    return s.value
        return 0.0

    def per_rank(self, name: str, replica: str, dp_rank: int = 0) -> float:
        """A per-rank series of the pool (labels ``pool``, ``replica``, ``dp_rank``)."""
        return self.sample(name, pool=MODEL, replica=replica, dp_rank=str(dp_rank))

    def reset_knobs(self) -> None:
        for fake, _ in self.fakes.values():
            fake.fail_status = None
            fake.die_after_chunks = None
            fake.lie_by = 0
            fake.others_running = 0
            fake.stall = False
            fake.token_interval_s = 0.0
        for name in self.fakes:
            self.http.post(f"/admin/replicas/{name}/undrain", headers=self.admin)
        # a test's held requests end when the router or the client closes them
        fakes = [f for f, _ in self.fakes.values()]
        wait_for(lambda: all(f.held == 0 for f in fakes), 10, "every held request released")

    def close(self) -> None:
        self.http.close()
        self.router.stop()
        for fake, srv in self.fakes.values():
            srv.stop()
            fake.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster() as c:
        yield c


@pytest.fixture(autouse=True)
def _knobs(cluster: Cluster) -> Iterator[None]:
    cluster.reset_knobs()
    yield
    cluster.reset_knobs()


def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 2000}" for i in range(n))


def test_shared_prefix_lands_on_the_replica_that_has_it(cluster: Cluster) -> None:
    prefix = words(1, 300)
    with cluster.direct("b") as b:
        assert b.post("/v1/completions", json={"model": MODEL, "prompt": prefix + " w1"}).is_success
    prompt = prefix + " w2 w3"
    # b holds BOS + 301 words = 302 tokens: FA blocks 0..17 (288 tokens), SWA blocks 14..17.
    # The new prompt (303 tokens) shares the first 301, so L <= 302 gives 288: FA 0..17 and
    # the window's 3 blocks 15..17 are all held.
    cluster.wait_hits(prompt, lambda h: h["b"] == 288, "b's events indexed")
    r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200
    assert r.headers["x-kvrouter-replica"] == "b"
    assert r.headers["x-kvrouter-predicted-hit"] == "288"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 288


def test_swa_evicted_replica_loses_although_it_holds_the_fa_blocks(cluster: Cluster) -> None:
    prefix = words(2, 400)
    for name in ("a", "c"):
        with cluster.direct(name) as d:
            assert d.post("/v1/completions", json={"model": MODEL, "prompt": prefix}).is_success
    prompt = prefix + " w5 w6 w7"
    cluster.wait_hits(prompt, lambda h: h["a"] > 0 and h["c"] > 0, "a and c indexed")
    cluster.fake("a").evict_swa(_ids(prefix))
    h = cluster.wait_hits(prompt, lambda h: h["a"] == 0, "a's SWA eviction indexed")
    assert h["c"] > 0
    ex = cluster.explain(prompt=prompt)
    rows = {row["replica"]: row for row in ex["replicas"]}
    fa = next(k for k in rows["a"]["spec_group_hits"] if k.startswith("full_attention"))
    assert rows["a"]["spec_group_hits"][fa] == rows["c"]["spec_group_hits"][fa] > 0
    assert rows["a"]["group_blind_hit_tokens"] == rows["c"]["group_blind_hit_tokens"]
    assert rows["a"]["limiting_group"].startswith("sliding_window")
    for _ in range(5):
        assert cluster.explain(prompt=prompt)["chosen"]["replica"] == "c"
    r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert r.headers["x-kvrouter-replica"] == "c"


def test_fake_replica_hit_rule_by_hand() -> None:
    """The fake's own hit rule (what the router's predictions are checked against) on
    hand-worked cases: FA 16-token blocks, SWA window 48 (3 blocks), SWA holds the last 4."""
    fake = FakeReplica("solo")
    try:
        p = [2] + [7 + (97 * i + 13) % 2000 for i in range(301)]  # 302 tokens, 18 blocks
        assert fake.serve_prompt(p) == 0  # nothing held yet
        # Same prompt: L <= 301 -> 288; FA 0..17 and SWA 15..17 held.
        assert fake.own_hit(p) == 288
        # 272 tokens: L <= 271, so 256 is the top candidate; it needs SWA 13..15 but SWA
        # holds 14..17 only, and no lower boundary has its 3 window blocks either.
        assert fake.own_hit(p[:272]) == 0
        # 273 tokens: L <= 272 -> 272 needs SWA 14..16: held.
        assert fake.own_hit(p[:273]) == 272
        # Diverging inside block 15: FA holds 0..14 (240) but SWA 12..14 is not held.
        assert fake.own_hit(p[:250] + [9] * 60) == 0
        # Below the window (L < 48) every block from 0 must be in the SWA group.
        assert fake.own_hit(p[:40]) == 0
        fake.serve_prompt(p[:40])  # stores FA 0..1 and SWA 0..1
        assert fake.own_hit(p[:40]) == 32
        assert fake.own_hit(p[:33]) == 32 and fake.own_hit(p[:32]) == 16
        # Two copies of the tail are held: one eviction leaves one, a second leaves none.
        fake.serve_prompt(p)
        fake.evict_swa(p)
        assert fake.own_hit(p) == 288
        fake.evict_swa(p)
        # SWA 14..17 gone; what is left is the short prompt's SWA 0..1 under FA 0..17
        assert fake.own_hit(p) == 32
        assert fake.own_hit(p[:40]) == 32
    finally:
        fake.close()


def test_predicted_header_equals_the_replicas_own_hit(cluster: Cluster) -> None:
    """The router's prediction (events -> index -> hybrid rule) against the fake's own hit
    rule (:meth:`FakeReplica.own_hit`, no router code), on hand-worked cases. Only b is
    routable, so every request lands on the replica whose state the cases are worked for."""
    for name in ("a", "c"):
        r = cluster.http.post(f"/admin/replicas/{name}/drain", headers=cluster.admin)
        assert r.status_code == 200
    p = [2] + [7 + (89 * i + 5) % 2000 for i in range(301)]  # 302 tokens, 18 blocks
    tail = [7 + (31 * i + 1000) % 2000 for i in range(60)]
    assert tail[0] != p[250] and p[301] != 8
    with cluster.direct("b") as b:  # b: FA blocks 0..17, SWA 14..17
        assert b.post("/v1/completions", json={"model": MODEL, "prompt": p}).is_success
    cases = [
        # shares 301 tokens: L <= 302 -> 288, FA 0..17 and SWA 15..17 held
        ([*p[:301], 8, 9], 288),
        # diverges in block 15: FA has 0..14 (240) but SWA 12..14 is not held (it has
        # 14..17) and no lower boundary has its 3 window blocks
        (p[:250] + tail, 0),
        # the previous prompt (310 tokens, 19 blocks: SWA 15..18) extended: L <= 314 -> 304
        (p[:250] + tail + [10, 11, 12, 13, 14], 304),
        # 40 tokens: L <= 39 -> 32 needs SWA blocks 0..1 (below the window), not held
        (p[:40], 0),
        # ... which that request stored (its last 4 = its only 2 blocks)
        (p[:40], 32),
        # 32 tokens: the last token is never a hit (L <= 31), so one block
        (p[:32], 16),
    ]
    for prompt, expected in cases:
        cluster.wait_hits(prompt, lambda h, e=expected: h["b"] == e, f"b predicted {expected}")
        r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 200 and r.headers["x-kvrouter-replica"] == "b"
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (int(r.headers["x-kvrouter-predicted-hit"]), cached) == (expected, expected)


def _ids(text: str) -> list[int]:
    from gpu_emitter import tokenizer as bt

    return bt.encode(text)


def test_streaming_is_byte_for_byte_a_direct_call(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": words(3, 100), "stream": True, "max_tokens": 8}
    with cluster.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        via = b"".join(r.iter_raw())
        name = r.headers["x-kvrouter-replica"]
    with cluster.direct(name) as d, d.stream("POST", "/v1/completions", json=body) as r:
        direct = b"".join(r.iter_raw())
    assert via == direct and via.endswith(b"data: [DONE]\n\n")


def test_streaming_usage_feeds_the_prediction_check(cluster: Cluster) -> None:
    """``cached_tokens`` from the SSE stream's final usage chunk is compared with the
    prediction: the per-replica counters move by hand-counted amounts. A stream whose client
    did not ask for usage is checked too (the router asks the replica for it) and its client
    reads no usage."""
    prompt = words(4, 200)  # BOS + 200 words = 201 tokens, 12 full blocks
    body = {"model": MODEL, "prompt": prompt, "stream": True}
    usage = {**body, "stream_options": {"include_usage": True}}

    def stream(b: dict[str, Any]) -> str:
        with cluster.http.stream("POST", "/v1/completions", json=b) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
            rep = r.headers["x-kvrouter-replica"]
        sent = cluster.fake(rep).last_body
        assert sent["stream_options"]["include_usage"] is True
        assert (b'"usage"' in raw) == ("stream_options" in b), raw
        assert raw.endswith(b"data: [DONE]\n\n")
        return rep

    def counts(rep: str) -> tuple[float, ...]:
        return (
            cluster.per_rank("kvrouter_prediction_checked_total", rep),
            cluster.per_rank("kvrouter_prediction_exact_total", rep),
            cluster.per_rank("kvrouter_prediction_abs_error_tokens_sum", rep),
            cluster.sample("kvrouter_predicted_hit_tokens_sum", pool=MODEL),
        )

    before = {name: counts(name) for name in cluster.fakes}
    rep = stream(usage)  # a new prompt: predicted 0, cached 0
    # Again on the same replica once its events are in: L <= 200 -> 192 (FA blocks 0..11,
    # SWA 9..11 of the 8..11 it stored), predicted and reported alike.
    cluster.wait_hits(prompt, lambda h: h[rep] == 192, "the first stream's blocks indexed")
    assert stream(usage) == rep
    assert stream(body) == rep  # the client did not ask: checked all the same
    cluster.fake(rep).lie_by = 16
    assert stream(body) == rep  # reports 208 against 192: checked, not exact, error 16
    after = counts(rep)
    old = before[rep]
    deltas = tuple(a - b for a, b in zip(after, old, strict=True))
    # checked: 4 streams; exact: the first three; |error|: 0 + 0 + 0 + 16;
    # predicted hits: 0 + 192 + 192 + 192
    assert deltas == (4.0, 3.0, 16.0, 576.0), deltas
    for name in cluster.fakes:
        if name != rep:
            assert counts(name)[:3] == before[name][:3]


def test_stream_usage_off_leaves_the_request_alone() -> None:
    """``server.stream_usage = false``: the body reaches the replica unchanged (no usage
    asked, nothing checked)."""
    c = Cluster(stream_usage=False)
    try:
        body = {"model": MODEL, "prompt": words(6, 40), "stream": True}
        with c.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
            rep = r.headers["x-kvrouter-replica"]
        assert "stream_options" not in c.fake(rep).last_body
        assert b'"usage"' not in raw
        assert c.per_rank("kvrouter_prediction_checked_total", rep) == 0
    finally:
        c.close()


def test_failover_on_a_5xx_before_the_first_byte(cluster: Cluster) -> None:
    prompt = words(5, 200)
    first = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    owner = first.headers["x-kvrouter-replica"]
    cluster.wait_hits(prompt + " w9", lambda h: h[owner] > 0, "owner indexed")
    cluster.fake(owner).fail_status = 503
    r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + " w9"})
    assert r.status_code == 200
    assert r.headers["x-kvrouter-replica"] != owner
    assert cluster.fake(owner).requests >= 1


def test_all_replicas_failing_returns_the_upstream_error(cluster: Cluster) -> None:
    for fake, _ in cluster.fakes.values():
        fake.fail_status = 500
    r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": "w1 w2"})
    assert r.status_code == 500
    assert "error" in r.json()


def test_mid_stream_failure_ends_with_an_error_event_and_done(cluster: Cluster) -> None:
    for fake, _ in cluster.fakes.values():
        fake.die_after_chunks = 2
    body = {"model": MODEL, "prompt": words(6, 50), "stream": True, "max_tokens": 6}
    with cluster.http.stream("POST", "/v1/completions", json=body) as r:
        data = b"".join(r.iter_raw())
    events = [e for e in data.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    err = msgspec.json.decode(events[-2][len(b"data: ") :])
    assert err["error"]["code"] == 502
    assert len(events) == 4  # two tokens, the error, [DONE]


def test_chat_and_request_id_and_hop_headers(cluster: Cluster) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(7, 40)}]}
    r = cluster.http.post(
        "/v1/chat/completions",
        json=body,
        headers={"x-request-id": "req-42", "connection": "keep-alive", "x-custom": "1"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
    got = cluster.fake(r.headers["x-kvrouter-replica"]).last_headers
    assert got["x-request-id"] == "req-42" and got["x-custom"] == "1"
    r = cluster.http.post("/v1/chat/completions", json=body)
    assert len(r.headers["x-request-id"]) == 32


def test_untokenizable_request_is_routed_by_load_and_counted(cluster: Cluster) -> None:
    content = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert r.headers["x-kvrouter-predicted-hit"] == "0"
    ex = cluster.explain(messages=body["messages"])
    assert ex["tokenized"] is False and ex["untokenized_reason"] == "non_text_content"
    assert 'reason="batched_prompts"' in cluster.http.get("/metrics").text


def test_bad_requests(cluster: Cluster) -> None:
    limit = cluster.config.server.max_body_bytes
    big = cluster.http.post("/v1/completions", content=b"x" * (limit + 1))
    assert big.status_code == 413
    assert cluster.http.post("/v1/completions", content=b"{nope").status_code == 400
    r = cluster.http.post("/v1/completions", json={"model": "other", "prompt": "w1"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


def test_models_health_metrics(cluster: Cluster) -> None:
    assert cluster.http.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in cluster.http.get("/v1/models").json()["data"]] == [MODEL]
    wait_for(lambda: "kvrouter_index_entries" in cluster.http.get("/metrics").text, 5, "metrics")
    text = cluster.http.get("/metrics").text
    for name in (
        "kvrouter_requests_total",
        "kvrouter_decision_seconds",
        "kvrouter_events_total",
        "kvrouter_stream_lag_seconds",
        "kvrouter_in_flight",
        "kvrouter_index_bytes",
    ):
        assert name in text, name


def test_prediction_mismatch_is_recorded(cluster: Cluster) -> None:
    for fake, _ in cluster.fakes.values():
        fake.lie_by = 16
    checked = {n: cluster.per_rank("kvrouter_prediction_checked_total", n) for n in "abc"}
    exact = {n: cluster.per_rank("kvrouter_prediction_exact_total", n) for n in "abc"}
    r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": words(8, 64)})
    assert r.status_code == 200
    # a new 65-token prompt: predicted 0, the replica reports 0 + 16
    rep = r.headers["x-kvrouter-replica"]
    assert r.headers["x-kvrouter-predicted-hit"] == "0"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert cluster.per_rank("kvrouter_prediction_checked_total", rep) == checked[rep] + 1
    assert cluster.per_rank("kvrouter_prediction_exact_total", rep) == exact[rep]
    mm = cluster.http.get("/admin/mismatches", headers=cluster.admin).json()["mismatches"]
    assert mm and mm[-1]["error"] == 16 and mm[-1]["replica"] == rep
    assert (mm[-1]["predicted"], mm[-1]["cached_tokens"]) == (0, 16)
    assert mm[-1]["prediction"]["hit_tokens"] == mm[-1]["predicted"]
    # per-group hits, recomputed for that replica when the mismatch was seen (not empty)
    groups = mm[-1]["prediction"]["spec_group_hits"]
    assert set(groups) == {"full_attention[0]", "sliding_window[1]"}, groups
    again = mm[-1]["explained_at_detection"]
    assert again["replica"] == r.headers["x-kvrouter-replica"]
    assert again["spec_group_hits"] == groups


def test_a_multi_rank_replica_gets_vllms_rank_header_by_default() -> None:
    # spec §6.7: without the header vLLM balances its DP ranks itself and the rank the router
    # predicted for is not the one that serves; vLLM reads X-data-parallel-rank
    fake = FakeReplica("dp")
    srv = ServerThread(fake.app).start()
    one = FakeReplica("single")
    srv1 = ServerThread(one.app).start()
    text = (
        f'[[pools]]\nmodel = "{MODEL}"\n'
        f'[[pools.replicas]]\nname = "dp"\nurl = "{srv.url}"\ndp_ranks = [0, 1]\n'
        f'[[pools.replicas]]\nname = "single"\nurl = "{srv1.url}"\n'
    )
    router = ServerThread(create_app(parse_config(text))).start()
    try:
        seen: dict[str, set[str]] = {"dp": set(), "single": set()}
        with httpx.Client(base_url=router.url, timeout=10) as http:
            for i in range(12):
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": words(i, 40)})
                assert r.status_code == 200, r.text
                label = r.headers["x-kvrouter-replica"]
                name = label.split("/")[0]
                got = (fake if name == "dp" else one).last_headers.get("x-data-parallel-rank")
                seen[name].add(f"{label}:{got}")
        assert {s.split(":")[1] for s in seen["single"]} <= {"None"}  # one rank: no header
        for s in seen["dp"]:
            label, got = s.split(":")
            assert label == f"dp/dp{got}", s  # the rank named is the rank the router chose
        assert seen["dp"], seen
    finally:
        router.stop()
        srv.stop()
        srv1.stop()
        fake.close()
        one.close()
    empty = text.replace("dp_ranks = [0, 1]\n", 'dp_ranks = [0, 1]\ndp_rank_header = ""\n')
    with pytest.raises(ValueError, match="dp_rank_header is empty"):
        parse_config(empty)


def test_report_mode_full_is_stripped_or_refused(cluster: Cluster) -> None:
    # vLLM re-announces a reused prefix as BlockStored with kv_cache_report_mode = "full"
    # (spec §5.4): the router keeps the request but not the key (or refuses it)
    full = {"kv_cache_report_mode": "full", "other": 3}
    r = cluster.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": words(91, 20), "vllm_xargs": full}
    )
    assert r.status_code == 200, r.text
    fake = cluster.fake(r.headers["x-kvrouter-replica"])
    assert fake.last_body["vllm_xargs"] == {"other": 3}
    alone = {"vllm_xargs": {"kv_cache_report_mode": "full"}}
    r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": "w1", **alone})
    assert "vllm_xargs" not in cluster.fake(r.headers["x-kvrouter-replica"]).last_body
    plain = {"vllm_xargs": {"kv_cache_report_mode": "incremental"}}
    r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": "w2", **plain})
    last = cluster.fake(r.headers["x-kvrouter-replica"]).last_body
    assert last["vllm_xargs"] == {"kv_cache_report_mode": "incremental"}  # left alone
    text = cluster.http.get("/metrics").text
    assert 'kvrouter_report_mode_full_requests_total{action="strip",pool=' in text
    refusing = Cluster(names=("a",), report_mode_full="refuse")
    try:
        r = refusing.http.post("/v1/completions", json={"model": MODEL, "prompt": "w1", **alone})
        assert r.status_code == 400 and "kv_cache_report_mode" in r.json()["error"]["message"]
        assert refusing.fake("a").requests == 0
    finally:
        refusing.close()
