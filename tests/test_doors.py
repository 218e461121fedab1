"""The router's doors over real loopback HTTP: who may call what, with which body.

Each test is one attack or mistake from issue 13 ("Doors"): an unauthenticated 100 MB admin
POST, a cross-site or text/plain admin mutation, an admin-added ``ipc://`` endpoint that binds
over a file, a DNS-rebound Host, a string-prefix loopback check, upstream addresses in client
errors, a replica serving another model; and the optional API key of ``/v1/*``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_replica import MODEL, FakeReplica, ServerThread, free_port
from test_openai_errors import JSON, openai_error
from test_proxy import TOKEN, Cluster

from router.config import is_loopback, load_config, parse_config
from router.server.app import StartupError, create_app


def rss_bytes() -> int:
    """This process's resident set (the router under test runs in it, on a thread)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def read_head(sock: socket.socket) -> bytes:
    """The response's status line and headers (and whatever came with them)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def raw_head(port: int, head: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """Send request headers only (no body byte) and read the response: a router that waits
    for the body before answering times out here."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n")
        data = read_head(s)
    return int(data.split(b" ", 2)[1]), data


def drained(c: Cluster, name: str) -> bool:
    reps = c.http.get("/admin/replicas", headers=c.admin).json()["replicas"]
    return next(r["drained"] for r in reps if r["name"] == name)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(names=("a", "b")) as c:
        yield c


@pytest.fixture(scope="module")
def open_cluster() -> Iterator[Cluster]:
    """The loopback default: no admin token."""
    with Cluster(names=("a",), admin_token=None) as c:
        yield c


# ------------------------------------------------------------------ auth before the body


def test_admin_answers_401_before_reading_the_body(cluster: Cluster) -> None:
    head = (
        "POST /admin/replicas HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "content-type: application/json\r\ncontent-length: 104857600\r\n"
    )
    status, data = raw_head(cluster.router.port, head)
    assert status == 401 and b'"error"' in data


def test_unauthenticated_100mb_admin_post_does_not_grow_rss(cluster: Cluster) -> None:
    """The issue's measurement: RSS went from 64 MB to 355 MB. The body is sent as fast as
    the router takes it while the response is read; RSS is this process's (router included)."""
    size = 100 << 20
    block = b"x" * (1 << 20)
    before = rss_bytes()
    sock = socket.create_connection(("127.0.0.1", cluster.router.port), timeout=10)
    sock.sendall(
        f"POST /admin/replicas HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json"
        f"\r\ncontent-length: {size}\r\n\r\n".encode()
    )
    sent = 0

    def blast() -> None:
        nonlocal sent
        try:
            while sent < size:
                sock.sendall(block)
                sent += len(block)
        except OSError:  # the router closed the connection: the rest is not read
            pass

    t = threading.Thread(target=blast, daemon=True)
    t.start()
    data = read_head(sock)
    t.join(30)
    sock.close()
    after = rss_bytes()
    print(
        f"RSS before {before / 2**20:.1f} MiB, after {after / 2**20:.1f} MiB, sent {sent >> 20} MiB"
    )
    assert data.startswith(b"HTTP/1.1 401"), data[:200]
    assert not t.is_alive()
    assert after - before < 16 << 20, (before, after)


def test_admin_body_limit_applies_with_a_valid_token(cluster: Cluster) -> None:
    limit = cluster.config.server.admin_max_body_bytes
    h = {**cluster.admin, **JSON}
    # a declared length over the limit is refused from the head, before any body byte
    head = (
        f"POST /admin/route/explain HTTP/1.1\r\nHost: 127.0.0.1\r\nauthorization: Bearer "
        f"{TOKEN}\r\ncontent-type: application/json\r\ncontent-length: {limit + 1}\r\n"
    )
    assert raw_head(cluster.router.port, head)[0] == 413
    err = openai_error(
        cluster.http.post("/admin/route/explain", content=b" " * (limit + 1), headers=h), 413
    )
    assert "server.admin_max_body_bytes" in err["message"]

    def chunks() -> Iterator[bytes]:
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    openai_error(cluster.http.post("/admin/route/explain", content=chunks(), headers=h), 413)
    # and on paths that take no body at all
    openai_error(cluster.http.request("GET", "/health", content=b" " * (limit + 1)), 413)


# --------------------------------------------------------- mutations: content type, origin


MUTATIONS = [
    ("POST", "/admin/replicas/a/drain"),
    ("DELETE", "/admin/replicas/a"),
    ("POST", "/admin/replicas"),
]


@pytest.mark.parametrize(("method", "path"), MUTATIONS)
def test_admin_mutations_need_json(cluster: Cluster, method: str, path: str) -> None:
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        headers = {"authorization": f"Bearer {TOKEN}"}
        if ctype:
            headers["content-type"] = ctype
        r = cluster.http.request(method, path, headers=headers, content=b"{}")
        openai_error(r, 415)
    assert not drained(cluster, "a")
    assert cluster.http.post("/admin/replicas/a/drain", json={}, headers=cluster.admin).is_success
    assert drained(cluster, "a")
    h = {**cluster.admin, "content-type": "application/json; charset=utf-8"}
    assert cluster.http.post("/admin/replicas/a/undrain", headers=h).is_success
    assert not drained(cluster, "a")


def test_admin_mutations_refuse_cross_site_origins(cluster: Cluster) -> None:
    h = {**cluster.admin, **JSON}
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1"):
        r = cluster.http.post("/admin/replicas/a/drain", headers={**h, "origin": origin})
        openai_error(r, 403)
    r = cluster.http.post("/admin/replicas/a/drain", headers={**h, "sec-fetch-site": "cross-site"})
    openai_error(r, 403)
    assert not drained(cluster, "a")
    own = f"http://127.0.0.1:{cluster.router.port}"
    r = cluster.http.post("/admin/replicas/a/drain", headers={**h, "origin": own})
    assert r.status_code == 200 and r.json()["drained"]
    cluster.http.post("/admin/replicas/a/undrain", headers=h)


def test_no_token_loopback_default_refuses_the_issues_attacks(open_cluster: Cluster) -> None:
    c = open_cluster
    # the issue's drain: a cross-site form post with text/plain
    r = c.http.post(
        "/admin/replicas/a/drain",
        content=b"{}",
        headers={"content-type": "text/plain", "origin": "http://evil.example"},
    )
    assert r.status_code in (403, 415)
    # a rebound DNS name pointing at 127.0.0.1: same-origin for the browser, Host says so
    port = c.router.port
    for host in (f"evil.example:{port}", f"localhost.attacker.example:{port}"):
        r = c.http.post(
            "/admin/replicas/a/drain",
            json={},
            headers={"host": host, "origin": f"http://{host}"},
        )
        openai_error(r, 403)
        openai_error(c.http.get("/admin/config", headers={"host": host}), 403)
    assert not drained(c, "a")
    # a local tool without a token still works
    assert c.http.post("/admin/replicas/a/drain", json={}).json()["drained"]
    assert c.http.post("/admin/replicas/a/undrain", json={}).is_success
    assert c.http.get("/admin/config", headers={"host": f"localhost:{port}"}).is_success


# ----------------------------------------------------------------- replicas added by admin


def _add(c: Cluster, replica: dict[str, Any], **extra: Any) -> httpx.Response:
    body = {"pool": MODEL, "replica": replica, **extra}
    return c.http.post("/admin/replicas", json=body, headers=c.admin)


def test_admin_ipc_bind_cannot_replace_a_file(cluster: Cluster, tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    url = cluster.fakes["a"][1].url
    for spec in (
        {"event_endpoint": f"ipc://{victim}", "bind": True},
        {"event_endpoint": f"ipc://{victim}"},
        {"event_endpoint": "inproc://x"},
        {"streams": [{"dp_rank": 0, "endpoint": f"ipc://{victim}"}], "bind": True},
        {"event_endpoint": "tcp://127.0.0.1:5999", "replay_endpoint": f"ipc://{victim}"},
    ):
        r = _add(cluster, {"name": "z", "url": url, **spec})
        err = openai_error(r, 403)
        assert "server.admin_endpoint_schemes" in err["message"], err
    r = _add(
        cluster, {"name": "z", "url": url, "event_endpoint": "tcp://127.0.0.1:*", "bind": True}
    )
    err = openai_error(r, 403)
    assert "server.admin_allow_bind" in err["message"], err
    assert victim.read_text() == "keep me"
    names = [r["name"] for r in cluster.http.get("/admin/replicas", headers=cluster.admin).json()[
        "replicas"]]  # fmt: skip
    assert "z" not in names


def test_allowed_ipc_bind_still_never_replaces_a_file(tmp_path: Path) -> None:
    with Cluster(names=("a",), admin_endpoint_schemes=["tcp", "ipc"], admin_allow_bind=True) as c:
        victim = tmp_path / "precious.txt"
        victim.write_text("keep me")
        url = c.fakes["a"][1].url
        r = _add(c, {"name": "z", "url": url, "event_endpoint": f"ipc://{victim}", "bind": True})
        err = openai_error(r, 409)
        assert str(victim) in err["message"]
        assert victim.read_text() == "keep me"
        fresh = tmp_path / "fresh.sock"
        r = _add(c, {"name": "z", "url": url, "event_endpoint": f"ipc://{fresh}", "bind": True})
        assert r.status_code == 201, r.text
        assert fresh.is_socket()


def test_admin_refuses_a_replica_serving_another_model(cluster: Cluster) -> None:
    other = FakeReplica("o", model="other-model")
    try:
        with ServerThread(other.app) as srv:
            r = _add(cluster, {"name": "o", "url": srv.url})
            err = openai_error(r, 409)
            assert "other-model" in err["message"] and MODEL in err["message"], err
            dead = f"http://127.0.0.1:{free_port()}"
            err = openai_error(_add(cluster, {"name": "o", "url": dead}), 409)
            assert "verify_model" in err["message"]
            r = _add(cluster, {"name": "o", "url": dead}, verify_model=False)
            assert r.status_code == 201, r.text
            assert cluster.http.delete(
                "/admin/replicas/o", headers={**cluster.admin, **JSON}
            ).is_success
    finally:
        other.close()


# ------------------------------------------------------------------------ loopback, startup


@pytest.mark.parametrize(
    ("host", "loop"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("localhost.attacker.example", False),
        ("127.0.0.1.nip.io", False),
        ("127.evil.example", False),
        ("::1.evil", False),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("", False),
    ],
)
def test_loopback_is_decided_from_the_parsed_address(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


def test_startup_refuses_a_lookalike_loopback_host_without_token() -> None:
    base = f'[[pools]]\nmodel = "{MODEL}"\n[[pools.replicas]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    with pytest.raises(StartupError, match="admin_token"):
        create_app(parse_config('[server]\nhost = "localhost.attacker.example"\n' + base))
    create_app(parse_config('[server]\nhost = "localhost"\n' + base))


# ------------------------------------------------------------ no addresses in client errors


def test_502_names_no_upstream_address() -> None:
    port = free_port()  # nothing listens there
    toml = (
        f'[server]\nadmin_token = "{TOKEN}"\nmetrics_scrape_interval_s = 0\n'
        f'[[pools]]\nmodel = "{MODEL}"\n[[pools.replicas]]\nname = "gone"\n'
        f'url = "http://127.0.0.1:{port}"\n'
    )
    with (
        ServerThread(create_app(parse_config(toml))) as router,
        httpx.Client(base_url=router.url, timeout=10) as http,
    ):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w1"})
        err = openai_error(r, 502)
        assert str(port) not in r.text and "127.0.0.1" not in r.text, r.text
        assert r.headers["x-request-id"] in err["message"]
        admin = {"authorization": f"Bearer {TOKEN}"}
        rep = http.get("/admin/replicas", headers=admin).json()["replicas"][0]
        assert str(port) in rep["last_error"], rep


def test_mid_stream_error_names_no_upstream_address(cluster: Cluster) -> None:
    for fake, _ in cluster.fakes.values():
        fake.die_after_chunks = 1
    try:
        body = {"model": MODEL, "prompt": "w1 w2 w3", "stream": True, "max_tokens": 4}
        with cluster.http.stream("POST", "/v1/completions", json=body) as r:
            data = b"".join(r.iter_raw())
        assert b'"error"' in data
        for _, srv in cluster.fakes.values():
            assert str(srv.port).encode() not in data
    finally:
        for fake, _ in cluster.fakes.values():
            fake.die_after_chunks = None


# --------------------------------------------------------------------------- the API key


KEY = "sk-router"


@pytest.fixture(scope="module")
def keyed() -> Iterator[Cluster]:
    with Cluster(names=("a",), api_key=KEY) as c:
        yield c


def test_api_key_guards_every_v1_path(keyed: Cluster) -> None:
    body = {"model": MODEL, "prompt": "w1 w2"}
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": KEY},
                    {"authorization": f"Basic {KEY}"}):  # fmt: skip
        r = keyed.http.post("/v1/completions", json=body, headers=headers)
        openai_error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
        openai_error(keyed.http.get("/v1/models", headers=headers), 401)
        openai_error(keyed.http.post("/v1/chat/completions", json=body, headers=headers), 401)
    assert keyed.fake("a").requests == 0
    ok = {"authorization": f"Bearer {KEY}"}
    assert keyed.http.post("/v1/completions", json=body, headers=ok).status_code == 200
    assert keyed.http.get("/v1/models", headers=ok).status_code == 200
    # outside /v1: health and metrics stay open, admin has its own token
    assert keyed.http.get("/health").status_code == 200
    assert keyed.http.get("/metrics").status_code == 200
    cfg = keyed.http.get("/admin/config", headers=keyed.admin).json()
    assert cfg["server"]["api_key"] == "***"


def test_api_key_is_checked_before_the_body_is_read(keyed: Cluster) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "content-type: application/json\r\ncontent-length: 1000000\r\n"
    )
    status, _ = raw_head(keyed.router.port, head)
    assert status == 401


def test_api_key_from_flag_env_and_file(tmp_path: Path) -> None:
    from router.cli import build_parser

    f = tmp_path / "r.toml"
    f.write_text(
        f'[server]\napi_key = "file"\n[[pools]]\nmodel = "{MODEL}"\n'
        '[[pools.replicas]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    assert load_config(f, environ={}).server.api_key == "file"
    assert load_config(f, environ={"KVROUTER_API_KEY": "env"}).server.api_key == "env"
    args = build_parser(["serve"]).parse_args(["serve", "--config", str(f), "--api-key", "flag"])
    assert args.api_key == "flag"
    cfg = load_config(f, environ={"KVROUTER_API_KEY": "env"}, flags={"api_key": args.api_key})
    assert cfg.server.api_key == "flag"


def test_openapi_documents_the_proxied_routes(cluster: Cluster) -> None:
    schema = cluster.http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = schema["paths"][path]["post"]
        assert "requestBody" in op and {"400", "401", "413"} <= set(op["responses"]), op
    assert "get" in schema["paths"]["/v1/models"]
