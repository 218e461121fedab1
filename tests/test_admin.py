"""The admin API over real HTTP: auth, replicas, explain, index, events, config, start checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_replica import MODEL, FakeReplica, ServerThread
from test_proxy import TOKEN, Cluster, router_toml, words
from zmq_helpers import wait_for

from gpu_emitter import tokenizer
from router.config import parse_config
from router.server.app import StartupError, create_app


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/replicas"),
        ("GET", "/admin/index"),
        ("GET", "/admin/events"),
        ("GET", "/admin/config"),
        ("GET", "/admin/mismatches"),
        ("POST", "/admin/route/explain"),
        ("POST", "/admin/replicas/a/drain"),
        ("DELETE", "/admin/replicas/a"),
    ],
)
def test_auth_401_without_and_403_with_a_wrong_token(cluster: Cluster, method, path) -> None:
    r = cluster.http.request(method, path)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = cluster.http.request(method, path, headers={"authorization": "Bearer nope"})
    assert r.status_code == 403


def test_openapi_documents_admin(cluster: Cluster) -> None:
    paths = cluster.http.get("/openapi.json").json()["paths"]
    assert "/admin/route/explain" in paths and "/admin/replicas/{name}/drain" in paths


def test_explain_shows_per_replica_groups_load_and_score(cluster: Cluster) -> None:
    prompt = words(20, 200)
    cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    ex = wait_for(
        lambda: (
            (e := cluster.explain(prompt=prompt + " w1"))
            and max(r["hit_tokens"] for r in e["replicas"]) > 0
            and e
        ),
        10,
        "hit indexed",
    )
    assert ex["tokenized"] and ex["num_tokens"] == 202
    best = max(ex["replicas"], key=lambda r: r["hit_tokens"])
    assert ex["chosen"]["replica"] == best["replica"]
    for row in ex["replicas"]:
        assert set(row["score"]) >= {"cost", "prefill", "queued", "look_ahead", "hit_tokens"}
        assert set(row["load"]) >= {"in_flight", "pending_prefill_tokens", "running"}
        assert len(row["spec_group_hits"]) == 2 and "tier_hits" in row
    by_ids = cluster.explain(token_ids=[2, 3, 4])
    assert by_ids["num_tokens"] == 3
    chat = cluster.explain(messages=[{"role": "user", "content": "w1"}])
    assert chat["num_tokens"] == 3  # <user> w1 <assistant>: no BOS on chats
    r = cluster.http.post(
        "/admin/route/explain", json={"prompt": "w1", "token_ids": [1]}, headers=cluster.admin
    )
    assert r.status_code == 422


def test_drain_undrain_remove_add(cluster: Cluster) -> None:
    h = cluster.admin
    for name in ("a", "b"):
        assert cluster.http.post(f"/admin/replicas/{name}/drain", headers=h).json()["drained"]
    for _ in range(5):
        assert cluster.explain(prompt="w1 w2")["chosen"]["replica"] == "c"
        r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": "w1 w2"})
        assert r.headers["x-kvrouter-replica"] == "c"
    cluster.http.post("/admin/replicas/a/undrain", headers=h)
    cluster.http.post("/admin/replicas/b/undrain", headers=h)
    reps = cluster.http.get("/admin/replicas", headers=h).json()["replicas"]
    assert {r["name"]: r["drained"] for r in reps} == {"a": False, "b": False, "c": False}
    assert cluster.http.post("/admin/replicas/zzz/drain", headers=h).status_code == 404

    fake = FakeReplica("d")
    with ServerThread(fake.app) as srv:
        spec = {
            "name": "d",
            "url": srv.url,
            "event_endpoint": fake.pub.endpoint,
            "replay_endpoint": fake.pub.replay_endpoint,
        }
        r = cluster.http.post("/admin/replicas", json={"pool": MODEL, "replica": spec}, headers=h)
        assert r.status_code == 201, r.text
        assert r.json()["source"] == "admin"
        dup = cluster.http.post("/admin/replicas", json={"pool": MODEL, "replica": spec},
                                headers=h)  # fmt: skip
        assert dup.status_code == 409
        bad = cluster.http.post(
            "/admin/replicas", json={"pool": MODEL, "replica": {"name": "e"}}, headers=h
        )
        assert bad.status_code == 422 and "url" in bad.text
        prompt = words(21, 120)
        fake.serve_prompt(tokenizer.encode(prompt))
        wait_for(
            lambda: cluster.explain(prompt=prompt + " w3")["chosen"]["replica"] == "d",
            10,
            "d's events indexed and d chosen",
        )
        r = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + " w3"})
        assert r.headers["x-kvrouter-replica"] == "d"
        assert 'replica="d"' in cluster.http.get("/metrics").text  # its requests, in flight...
        assert cluster.http.delete("/admin/replicas/d", headers=h).json() == {"removed": "d"}
        names = [r["name"] for r in cluster.http.get("/admin/replicas", headers=h).json()[
            "replicas"]]  # fmt: skip
        assert "d" not in names
        # no series of a replica that is gone (a fleet's pods come and go under new names)
        gone = [ln for ln in cluster.http.get("/metrics").text.splitlines() if 'replica="d"' in ln]
        assert not gone, gone
    fake.close()


def test_index_events_config(cluster: Cluster) -> None:
    h = cluster.admin
    cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": words(22, 100)})
    idx = wait_for(
        lambda: (
            (i := cluster.http.get("/admin/index", headers=h).json()["pools"][0])
            and i["entries"] > 0
            and i
        ),
        10,
        "index entries",
    )
    assert idx["bytes"] > 0 and len(idx["groups"]) == 2
    assert any(tiers["GPU"]["0"] > 0 for tiers in idx["replicas"].values())
    streams = cluster.http.get("/admin/events", headers=h).json()["streams"]
    assert {s["replica"] for s in streams} >= {"a", "b", "c"}
    for s in streams:
        assert s["trusted"] is True and s["hash_conformance"]["ok"] is True
        assert set(s["stream_stats"]) >= {"last_seq", "lag_s", "gaps", "replays", "resets"}
    assert any(s["hash_conformance"]["checked"] > 0 for s in streams)
    cfg = cluster.http.get("/admin/config", headers=h).json()
    assert cfg["server"]["admin_token"] == "***" and cfg["pools"][0]["model"] == MODEL


BASE = f"""
[[pools]]
model = "{MODEL}"
[[pools.replicas]]
name = "a"
url = "http://127.0.0.1:9"
"""


def test_refuses_admin_on_public_host_without_token() -> None:
    with pytest.raises(StartupError, match="admin_token"):
        create_app(parse_config('[server]\nhost = "0.0.0.0"\n' + BASE))
    create_app(parse_config(f'[server]\nhost = "0.0.0.0"\nadmin_token = "{TOKEN}"\n' + BASE))
    create_app(parse_config('[server]\nhost = "0.0.0.0"\nadmin_enabled = false\n' + BASE))


def test_removing_a_replica_whose_subscriber_died_releases_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug inside the event reader makes the subscriber's close() raise SubscriberError; the
    admin removal must still drop the replica, its index state and its connections."""
    import httpx

    from events.stream import StreamProcessor

    class InjectedCoreBug(Exception):
        pass

    def on_live(self: StreamProcessor, frames: object, now: float, out: list) -> None:
        raise InjectedCoreBug("injected")

    fake = FakeReplica("x")
    with ServerThread(fake.app) as srv:
        app = create_app(parse_config(router_toml({"x": (fake, srv)})))
        state = app.state.router
        with ServerThread(app) as router, httpx.Client(base_url=router.url, timeout=10) as http:
            h = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}

            def entries() -> int:
                return http.get("/admin/index", headers=h).json()["pools"][0]["entries"]

            fake.serve_prompt(tokenizer.encode(words(5, 64)))
            wait_for(lambda: entries() > 0, 10, "x's blocks indexed")
            monkeypatch.setattr(StreamProcessor, "on_live", on_live)
            sub = state.pools[MODEL].replicas["x"].subscriber
            wait_for(
                lambda: (
                    fake.serve_prompt(tokenizer.encode(words(6, 64))) is None
                    or sub._core.failure is not None
                ),
                10,
                "the subscriber's reader to hit the injected bug",
            )
            assert isinstance(sub._core.failure, InjectedCoreBug)
            r = http.delete("/admin/replicas/x", headers=h)
            assert r.status_code == 200 and r.json() == {"removed": "x"}, r.text
            assert http.get("/admin/replicas", headers=h).json()["replicas"] == []
            assert entries() == 0
    fake.close()


def test_a_request_outliving_its_replica_leaves_none_of_its_series(cluster: Cluster) -> None:
    """Removing a replica drops its series at once and cuts the streams still coming from it
    (drain first to remove it gracefully); each cut request then ends and counts itself
    (requests, mid-stream failures) under the replica's name. Kubernetes discovery cuts what
    is left at ``drain_timeout_s``, so without the request's own clean-up every pod ever
    removed busy would leave a few series behind."""
    h = cluster.admin
    fake = FakeReplica("e")
    fake.token_interval_s = 0.05  # 20 tokens: a stream of about a second
    with ServerThread(fake.app) as srv:
        spec = {"name": "e", "url": srv.url, "event_endpoint": fake.pub.endpoint,
                "replay_endpoint": fake.pub.replay_endpoint}  # fmt: skip
        r = cluster.http.post("/admin/replicas", json={"pool": MODEL, "replica": spec}, headers=h)
        assert r.status_code == 201, r.text
        for name in ("a", "b", "c"):
            cluster.http.post(f"/admin/replicas/{name}/drain", headers=h)
        try:
            body = {"model": MODEL, "prompt": words(23, 80), "max_tokens": 20, "stream": True}
            with cluster.http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.headers["x-kvrouter-replica"] == "e"
                wait_for(lambda: fake.held == 1, 10, "the stream under way")
                assert cluster.http.delete("/admin/replicas/e", headers=h).status_code == 200
                text = resp.read().decode()
            assert "failed mid-stream" in text and text.endswith("data: [DONE]\n\n")

            def series() -> list[str]:
                lines = cluster.http.get("/metrics").text.splitlines()
                return [ln for ln in lines if 'replica="e"' in ln]

            wait_for(lambda: not series(), 10, f"no series of the removed replica: {series()}")
        finally:
            for name in ("a", "b", "c"):
                cluster.http.post(f"/admin/replicas/{name}/undrain", headers=h)
    fake.close()
