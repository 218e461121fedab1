"""Every refusal is an OpenAI error: JSON ``{"error": {"message", "type", "param", "code"}}``
with the right status, for every path and every malformed body, over real loopback HTTP.

Each case here was a plain-text 500, FastAPI's ``{"detail": ...}`` or a wrong status before
router.server.errors existed (issue 13, "Bad bodies" and "Smaller").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_replica import MODEL, FakeReplica, ServerThread
from test_proxy import TOKEN, Cluster

from router.config import parse_config
from router.server.app import create_app
from tests.zmq_helpers import wait_for

JSON = {"content-type": "application/json"}


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The error object of ``r``, checked to be an OpenAI error with ``status``."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["type"], str) and err["type"]
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(names=("a",)) as c:
        yield c


ROUTES = ["/v1/completions", "/v1/chat/completions"]
NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    ("raw", "words"),
    [
        # UnicodeDecodeError in the proxy: was a plain-text 500
        (b'{"model": "fake-model", "prompt": "w1 \xff\xfe w2"}', "UTF-8"),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": "\xc3"}]}', "UTF-8"),
        # RecursionError in the proxy: was a plain-text 500
        (NESTED, "nested"),
        (b'{"model": "fake-model", "prompt": "w1", "x": ' + NESTED + b"}", "nested"),
        (b"{nope", "JSON"),
        (b"", "JSON"),
        (b"[1, 2]", "object"),
        (b'"w1"', "object"),
        (b"null", "object"),
    ],
)
def test_malformed_bodies_are_400_openai_errors(
    cluster: Cluster, path: str, raw: bytes, words: str
) -> None:
    err = openai_error(cluster.http.post(path, content=raw, headers=JSON), 400)
    assert words in err["message"], err


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": 5, "prompt": "w1"}, "model"),
        ("/v1/completions", {"model": [MODEL], "prompt": "w1"}, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": {"w1": 1}}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "w1", "stream": "false"}, "stream"),
        ("/v1/completions", {"model": MODEL, "prompt": "w1", "cache_salt": 5}, "cache_salt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "w1"}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": ["w1"]}, "messages"),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ],
)
def test_wrong_types_of_the_fields_the_router_reads_are_400(
    cluster: Cluster, path: str, body: dict[str, Any], param: str
) -> None:
    before = sum(fake.requests for fake, _ in cluster.fakes.values())
    openai_error(cluster.http.post(path, json=body), 400, param)
    assert sum(fake.requests for fake, _ in cluster.fakes.values()) == before  # not forwarded


def test_413_names_the_setting(cluster: Cluster) -> None:
    limit = cluster.config.server.max_body_bytes
    err = openai_error(cluster.http.post(ROUTES[0], content=b"x" * (limit + 1)), 413)
    assert "server.max_body_bytes" in err["message"] and str(limit) in err["message"]

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536

    err = openai_error(cluster.http.post(ROUTES[0], content=chunks()), 413)
    assert "server.max_body_bytes" in err["message"]


def test_unknown_v1_path_is_a_404_openai_error(cluster: Cluster) -> None:
    openai_error(cluster.http.post("/v1/embeddings", json={"model": MODEL}), 404)
    openai_error(cluster.http.get("/v1/nothing"), 404)
    openai_error(cluster.http.get("/nothing/at/all"), 404)


@pytest.mark.parametrize("path", ROUTES)
def test_other_methods_on_the_proxied_routes_are_405(cluster: Cluster, path: str) -> None:
    for method in ("GET", "PUT", "DELETE"):
        r = cluster.http.request(method, path)
        openai_error(r, 405)
        assert r.headers["allow"] == "POST"


def test_admin_errors_are_openai_errors_too(cluster: Cluster) -> None:
    h = {**cluster.admin, **JSON}
    openai_error(cluster.http.post("/admin/route/explain", content=NESTED, headers=h), 400)
    openai_error(
        cluster.http.post("/admin/route/explain", content=b'{"prompt": "\xff"}', headers=h), 400
    )
    err = openai_error(
        cluster.http.post("/admin/route/explain", json={"prompt": 5}, headers=cluster.admin), 422
    )
    assert err["param"] == "prompt", err
    openai_error(cluster.http.post("/admin/replicas/zzz/drain", json={}, headers=h), 404)
    openai_error(cluster.http.get("/admin/replicas"), 401)


def test_missing_model_with_several_pools_is_a_400_not_a_404() -> None:
    fakes = {n: FakeReplica(n, model=n) for n in ("m1", "m2")}
    servers = {n: ServerThread(f.app).start() for n, f in fakes.items()}
    toml = f'[server]\nadmin_token = "{TOKEN}"\nmetrics_scrape_interval_s = 0\n'
    for n in fakes:
        toml += f'[[pools]]\nmodel = "{n}"\n[[pools.replicas]]\nname = "{n}"\n'
        toml += f'url = "{servers[n].url}"\n'
    try:
        with (
            ServerThread(create_app(parse_config(toml))) as router,
            httpx.Client(base_url=router.url, timeout=10) as http,
        ):
            err = openai_error(http.post(ROUTES[0], json={"prompt": "w1"}), 400, "model")
            assert "None" not in err["message"] and "m1" in err["message"], err
            err = openai_error(http.post(ROUTES[0], json={"model": "m3", "prompt": "w1"}), 404)
            assert err["param"] == "model" and "m3" in err["message"]
            assert http.post(ROUTES[0], json={"model": "m2", "prompt": "w1"}).status_code == 200
    finally:
        for n, f in fakes.items():
            servers[n].stop()
            f.close()


def test_a_bug_is_a_json_500_logged_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception nobody expected, on the proxy or the FastAPI side: a JSON 500, not
    uvicorn's plain text, and one log record with the traceback."""
    from router.config import RouterConfig

    class InjectedBug(Exception):
        pass

    def boom(*args: object, **kwargs: object) -> None:
        raise InjectedBug("injected")

    state = cluster.router.server.config.app.state.router
    monkeypatch.setattr(state, "pool_for", boom)
    with caplog.at_level("ERROR", logger="kvrouter.errors"):
        err = openai_error(cluster.http.post(ROUTES[0], json={"model": MODEL, "prompt": "w1"}), 500)
        assert "InjectedBug" not in err["message"]  # internals stay in the log
        monkeypatch.setattr(RouterConfig, "redacted", boom)
        openai_error(cluster.http.get("/admin/config", headers=cluster.admin), 500)

        def bugs() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.exc_info and r.exc_info[0] is InjectedBug]

        # Starlette sends the FastAPI side's 500 before re-raising to the logging guard, so its
        # record can land just after the client has the answer
        wait_for(lambda: len(bugs()) >= 2, 5, "both bugs logged")
    assert len(bugs()) == 2, [(r.name, r.getMessage()) for r in caplog.records]


def test_refusals_are_counted(cluster: Cluster) -> None:
    def refused(reason: str) -> float:
        return cluster.sample("kvrouter_refused_requests_total", reason=reason)

    before = {r: refused(r) for r in ("malformed_body", "bad_field", "admin_no_token", "http_404")}
    cluster.http.post(ROUTES[0], content=b"{nope", headers=JSON)
    cluster.http.post(ROUTES[0], json={"model": 5})
    cluster.http.get("/admin/replicas")
    cluster.http.get("/v1/nothing")
    assert {r: refused(r) - n for r, n in before.items()} == dict.fromkeys(before, 1.0)
