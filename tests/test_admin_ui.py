"""The ``/admin/ui`` page and the last-decisions log behind it (issue 15, item 6).

A real router (``create_app`` on uvicorn, 127.0.0.1) in front of three simulated hybrid vLLM
replicas (tests/sim_cluster.py). ``GET /admin/decisions`` is checked against what the proxied
answers said (their ``x-kvrouter-*`` headers and ``usage``); the page's files are checked for
what the doors let through without a token and for the headers they carry; every page the
router serves is checked for references to other hosts; and the page itself is loaded in
headless Chromium (Debian's ``chromium``; the test skips, saying so, when there is none,
and fails instead with ``KVROUTER_REQUIRE_CHROMIUM=1``),
whose DOM after its scripts ran must show the replicas with their trust and health, the
decision of a request sent through the router, and the explain result the API gives for it.
``KVROUTER_UI_SCREENSHOT=path.png`` also saves a screenshot of that page.
"""

from __future__ import annotations

import fnmatch
import os
import random
import re
import shutil
import subprocess
import tempfile
import tomllib
import urllib.parse
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.server.decisions import DECISIONS_KEPT
from tests.sim_cluster import MODEL, NAMES, TOKEN, SimCluster, words
from tests.zmq_helpers import wait_for

ASSETS = Path(__file__).resolve().parents[1] / "router" / "server" / "ui_assets"
CHROMIUM = next(
    (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p is not None),
    None,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    c = SimCluster(400, extra_toml="[health]\nprobe_interval_s = 0.2\n")
    try:
        yield c
    finally:
        c.close()


def complete(cluster: SimCluster, prompt: str, request_id: str) -> httpx.Response:
    r = cluster.client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        headers={"x-request-id": request_id},
    )
    assert r.status_code == 200, r.text
    return r


def decisions(cluster: SimCluster) -> dict[str, dict[str, Any]]:
    r = cluster.client.get("/admin/decisions", headers=cluster.admin)
    assert r.status_code == 200, r.text
    return {d["request_id"]: d for d in r.json()["decisions"]}


def sync_all(cluster: SimCluster) -> None:
    for name in NAMES:
        cluster.sync(name)


def warm(cluster: SimCluster, prompt: str, tag: str) -> httpx.Response:
    """Send ``prompt`` once, wait for its blocks to be indexed, send it again (a hit)."""
    complete(cluster, prompt, f"{tag}-cold")
    sync_all(cluster)
    return complete(cluster, prompt, f"{tag}-warm")


# -- the decisions log --------------------------------------------------------------------


def test_decisions_keep_each_request_with_its_predicted_and_reported_hit(
    cluster: SimCluster,
) -> None:
    prompt = words(random.Random("decisions"), 200)
    r = warm(cluster, prompt, "dec")
    reported = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    predicted = int(r.headers["x-kvrouter-predicted-hit"])
    assert reported > 0 and predicted == reported
    rows = wait_for(lambda: (d := decisions(cluster)).get("dec-warm") and d, 10, "the row")
    row = rows["dec-warm"]
    assert row["replica"] == r.headers["x-kvrouter-replica"]
    assert row["predicted_hit"] == predicted and row["cached_tokens"] == reported
    assert row["status"] == 200 and row["pool"] == MODEL and row["num_tokens"] == 201
    assert row["reason"] == "best_hit" and row["trust"] == "exact" and row["tokenized"]
    # the replicas predicted one by one: those holding the prompt's first block (the cold
    # request's replica among them) and the chosen one; every other had no hit
    # (docs/decision-cost.md)
    listed = {h["replica"] for h in row["hits"]}
    assert row["replica"] in listed and listed <= set(NAMES)
    assert row["best_hit"] == max(h["hit_tokens"] for h in row["hits"]) == predicted
    # the hybrid loop's largest single-group result bounds the hit from above
    assert row["longest_group_hit"] >= predicted
    cold = rows["dec-cold"]
    assert cold["predicted_hit"] == 0 and cold["cached_tokens"] == 0 and cold["reason"] == "no_hit"
    assert rows["dec-cold"]["time"] <= row["time"]


def test_decisions_are_bounded_and_keep_the_newest(cluster: SimCluster) -> None:
    for i in range(DECISIONS_KEPT + 5):
        complete(cluster, f"w{i} w{i + 1}", f"bound-{i}")
    rows = cluster.client.get("/admin/decisions", headers=cluster.admin).json()["decisions"]
    assert len(rows) == DECISIONS_KEPT
    ids = [d["request_id"] for d in rows]
    assert ids == [f"bound-{i}" for i in range(5, DECISIONS_KEPT + 5)]  # oldest first


def test_decisions_are_in_the_schema_and_guarded(cluster: SimCluster) -> None:
    paths = cluster.client.get("/openapi.json").json()["paths"]
    assert "/admin/decisions" in paths
    assert not any(p.startswith("/admin/ui") for p in paths)  # a page, not an API
    assert cluster.client.get("/admin/decisions").status_code == 401


# -- the page's files and the doors ---------------------------------------------------------


def test_page_files_load_without_a_token_and_carry_a_strict_csp(cluster: SimCluster) -> None:
    http = cluster.client
    r = http.get("/admin/ui")
    assert r.status_code == 307 and r.headers["location"] == "ui/"
    for path, ctype, name in (
        ("/admin/ui/", "text/html", "index.html"),
        ("/admin/ui/index.html", "text/html", "index.html"),
        ("/admin/ui/app.js", "text/javascript", "app.js"),
        ("/admin/ui/style.css", "text/css", "style.css"),
    ):
        r = http.get(path)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"].startswith(ctype)
        assert r.content == (ASSETS / name).read_bytes()  # no data in them
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp
        assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    # no request parameter changes what is served
    assert (
        http.get("/admin/ui/", params={"body": "<script>"}).content
        == (ASSETS / "index.html").read_bytes()
    )
    # only those exact files are open: the data, other methods and other paths are not
    assert http.get("/admin/replicas").status_code == 401
    assert http.get("/admin/ui/nothing").status_code == 401
    assert http.get("/admin/ui/../replicas").status_code == 401
    assert http.post("/admin/ui/", json={}).status_code == 401
    # no inline script or handler: the CSP would block them
    html = (ASSETS / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", html) and not re.search(r"\son\w+=", html)
    js = (ASSETS / "app.js").read_text()
    assert "innerHTML" not in js and "outerHTML" not in js and "eval(" not in js


def test_same_origin_explain_post_passes_the_doors(cluster: SimCluster) -> None:
    """What the page's fetch sends: the router's own Origin, JSON, the typed token."""
    own = cluster.router.url
    body = {"model": MODEL, "prompt": "w1 w2"}
    headers = {**cluster.admin, "origin": own, "sec-fetch-site": "same-origin"}
    r = cluster.client.post("/admin/route/explain", json=body, headers=headers)
    assert r.status_code == 200, r.text
    headers["origin"] = "http://evil.example"
    r = cluster.client.post("/admin/route/explain", json=body, headers=headers)
    assert r.status_code == 403


_URL = re.compile(r"""https?://([^/\s"'<>)`]+)""", re.I)


def test_nothing_served_refers_to_another_host(cluster: SimCluster) -> None:
    """No page, script or style the router serves loads from elsewhere (the machines have no
    internet): /docs and /redoc, whose FastAPI pages load from a CDN, are not served."""
    http = cluster.client
    own = {f"127.0.0.1:{cluster.router.port}", f"localhost:{cluster.router.port}"}
    api = cluster.app.fastapi
    paths = {r.path for r in api.routes if "GET" in getattr(r, "methods", ()) and "{" not in r.path}
    paths |= {"/docs", "/redoc", "/docs/oauth2-redirect", "/admin/ui/"}
    assert "/admin/ui/app.js" in paths and "/openapi.json" in paths
    checked = 0
    for path in sorted(paths):
        r = http.get(path, headers=cluster.admin)
        if path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert r.status_code == 404, path
            continue
        ctype = r.headers.get("content-type", "")
        if not ctype.startswith(("text/html", "text/javascript", "text/css")):
            continue
        checked += 1
        hosts = {h.lower() for h in _URL.findall(r.text)}
        assert hosts <= own, f"{path} refers to {sorted(hosts - own)}"
    assert checked >= 4
    for f in ASSETS.iterdir():  # relative URLs only in the shipped files
        assert not _URL.findall(f.read_text()), f


# -- the page in headless Chromium ----------------------------------------------------------


class Dom(HTMLParser):
    """The rows the page drew: each ``tr[data-row]`` (and the page itself) as its attributes
    plus the text of each ``[data-f]`` / ``[data-k]`` element inside."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.page: dict[str, str] = {}
        self._row: dict[str, str] | None = None
        self._open: list[tuple[str, str, list[str]]] = []  # (tag, field, text parts)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-row" in a:
            self._row = dict(a)
            self.rows.append(self._row)
        field = a.get("data-f") or a.get("data-k")
        if field:
            self._open.append((tag, field, []))

    def handle_endtag(self, tag: str) -> None:
        if self._open and self._open[-1][0] == tag:
            _, field, parts = self._open.pop()
            text = " ".join("".join(parts).split())
            (self._row if self._row is not None and tag != "div" else self.page)[field] = text
            if self._open:  # nested: the outer element's text includes it
                self._open[-1][2].append(" " + text + " ")
        if tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1][2].append(data)

    def of(self, kind: str) -> list[dict[str, str]]:
        return [r for r in self.rows if r["data-row"] == kind]


def chromium(url: str, *extra: str, budget_ms: int = 6000) -> str:
    """Chromium's DOM of ``url`` after its scripts ran for ``budget_ms`` of virtual time."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="kvrouter-ui-") as profile:
        cmd = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
            f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *extra, url,
        ]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, f"chromium failed ({p.returncode}): {p.stderr[-2000:]}"
    return p.stdout


@pytest.fixture
def browser() -> str:
    """The Chromium binary; the test is skipped without one, or fails when
    ``KVROUTER_REQUIRE_CHROMIUM=1`` (CI, which installs it)."""
    if CHROMIUM is None:
        why = "no chromium binary on PATH (Debian: apt-get install -y chromium)"
        if os.environ.get("KVROUTER_REQUIRE_CHROMIUM") == "1":
            pytest.fail(why + "; KVROUTER_REQUIRE_CHROMIUM=1 requires it")
        pytest.skip(why)
    return CHROMIUM


@pytest.mark.usefixtures("browser")
def test_page_in_headless_chromium_shows_replicas_decisions_and_explain(
    cluster: SimCluster,
) -> None:
    prompt = words(random.Random("ui-explain"), 240)
    r = warm(cluster, prompt, "ui")
    chosen, predicted = r.headers["x-kvrouter-replica"], int(r.headers["x-kvrouter-predicted-hit"])
    assert predicted > 0
    sync_all(cluster)
    expected = cluster.explain(prompt=prompt)
    api_hits = {(x["replica"], x["dp_rank"]): x for x in expected["replicas"]}
    wait_for(
        lambda: all(cluster.health(n)["probe"]["status"] == "up" for n in NAMES), 10, "probes up"
    )
    frag = urllib.parse.urlencode(
        {"token": TOKEN, "model": MODEL, "prompt": prompt, "explain": "1", "refresh": "0"}
    )
    url = f"{cluster.router.url}/admin/ui/#{frag}"
    dom = Dom()
    dom.feed(chromium(url, "--dump-dom"))

    assert dom.page["status"].startswith("updated"), dom.page.get("status")
    reps = {row["data-name"]: row for row in dom.of("replica")}
    assert set(reps) == set(NAMES)
    for row in reps.values():
        assert row["health"] == "up" and row["trust"] == "dp0 exact", row
        assert row["pool"] == MODEL and row["url"].startswith("http://127.0.0.1:")
        assert row["source"] == "static", row  # from the config file
        assert row["index"].startswith("GPU ") and int(row["index"].split()[1]) >= 0
    assert int(reps[chosen]["index"].split()[1]) > 0  # it holds the prompt's blocks
    (pool,) = dom.of("pool")
    assert pool["data-name"] == MODEL and int(pool["entries"]) > 0

    decided = {row["data-request-id"]: row for row in dom.of("decision")}
    row = decided["ui-warm"]
    assert row["replica"] == chosen and row["reason"] == "best_hit"
    assert int(row["predicted_hit"]) == predicted == int(row["cached_tokens"])
    assert row["groups"].startswith("longest ") and int(row["groups"].split()[1]) >= predicted
    assert f"{chosen}:{predicted}" in row["hits"].split()
    assert int(decided["ui-cold"]["predicted_hit"]) == 0

    assert dom.page["explain"].startswith("chosen"), dom.page["explain"]
    want = expected["chosen"]["replica"]
    assert dom.page["chosen"] == want
    shown = {(row["data-name"], int(row["data-rank"])): row for row in dom.of("explain")}
    assert set(shown) == set(api_hits)
    for key, row in shown.items():
        api = api_hits[key]
        assert int(row["hit_tokens"]) == api["hit_tokens"], (key, row, api)
        assert row["trust"] == api["trust"]
        for group, hit in api["spec_group_hits"].items():
            assert int(row[f"group:{group}"]) == hit, (key, group, row)
    assert int(shown[(want, 0)]["hit_tokens"]) == api_hits[(want, 0)]["hit_tokens"] > 0
    assert shown[(want, 0)]["class"] == "chosen"

    out = os.environ.get("KVROUTER_UI_SCREENSHOT")
    if out:
        chromium(url, f"--screenshot={Path(out).resolve()}", "--window-size=1500,1900")
        assert Path(out).stat().st_size > 10_000


@pytest.mark.usefixtures("browser")
def test_page_without_the_token_says_so(cluster: SimCluster) -> None:
    dom = Dom()
    dom.feed(chromium(f"{cluster.router.url}/admin/ui/#refresh=0", "--dump-dom", budget_ms=3000))
    assert "401" in dom.page["status"] and "admin token" in dom.page["status"]
    assert not dom.of("replica") and not dom.of("decision")


def test_every_page_file_is_declared_as_package_data() -> None:
    """``pip install .`` (not only an editable install) ships the page: each file of
    ui_assets matches a ``[tool.setuptools.package-data]`` pattern of ``router.server``
    (a built wheel was checked by hand to hold them)."""
    pyproject = tomllib.loads((ASSETS.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["router.server"]
    files = sorted(f.relative_to(ASSETS.parent).as_posix() for f in ASSETS.iterdir())
    assert files == ["ui_assets/app.js", "ui_assets/index.html", "ui_assets/style.css"]
    for f in files:
        assert any(fnmatch.fnmatch(f, p) for p in patterns), f
