"""``kvrouter serve`` as a subprocess in front of fake replicas: start, route, fail over on a
dead replica, tokenizer parity with the replica's /tokenize, bad config exits 2."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_replica import MODEL, FakeReplica, ServerThread, free_port
from test_proxy import TOKEN, router_toml, words

ROOT = Path(__file__).resolve().parents[1]
KVROUTER = [sys.executable, "-m", "router.cli"]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"router exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError("router did not become healthy")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, dict]]:
    fakes = {}
    for name in ("a", "b", "c"):
        fake = FakeReplica(name)
        fakes[name] = (fake, ServerThread(fake.app).start())
    port = free_port()
    text = router_toml(fakes, port=port)
    # A second pool on the same replicas that tokenizes through their /tokenize.
    remote = text.split("[[pools]]", 1)[1].replace(f'model = "{MODEL}"', 'model = "remote"', 1)
    text += "[[pools]]" + remote + '[pools.tokenizer]\nstrategy = "remote"\n'
    cfg = tmp_path_factory.mktemp("cfg") / "router.toml"
    cfg.write_text(text)
    proc = subprocess.Popen(
        [*KVROUTER, "serve", "--config", str(cfg)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc)
        yield url, fakes
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        for fake, srv in fakes.values():
            srv.stop()
            fake.close()


def test_routes_and_fails_over_on_a_dead_replica(served) -> None:
    url, fakes = served
    admin = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=10) as http:
        prompt = words(30, 300)
        first = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        owner = first.headers["x-kvrouter-replica"]
        deadline = time.monotonic() + 10
        while True:
            ex = http.post(
                "/admin/route/explain",
                json={"model": MODEL, "prompt": prompt + " w1"},
                headers=admin,
            )
            if ex.json()["chosen"]["replica"] == owner:
                break
            assert time.monotonic() < deadline, "owner never preferred"
        fakes[owner][1].stop()  # the replica's HTTP server is gone: connection refused
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + " w1"})
        assert r.status_code == 200
        assert r.headers["x-kvrouter-replica"] not in (owner, "")
        line = f'kvrouter_failovers_total{{pool="{MODEL}",replica="{owner}"}} 1.0'
        assert line in http.get("/metrics").text


def test_tokenizer_parity_with_the_replicas_tokenize(served) -> None:
    url, fakes = served
    admin = {"authorization": f"Bearer {TOKEN}"}
    live = next(srv.url for _, srv in fakes.values() if srv.thread.is_alive())
    cases = [
        {"prompt": words(31, 50)},
        {"prompt": "hello world, not in the vocabulary w5"},
        {"messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}]},
    ]
    with httpx.Client(timeout=10) as http:
        for case in cases:
            want = http.post(live + "/tokenize", json=case).json()["count"]
            for model in (MODEL, "remote"):
                ex = http.post(
                    url + "/admin/route/explain", json={"model": model, **case}, headers=admin
                ).json()
                assert ex["tokenized"] and ex["num_tokens"] == want, (model, case)


def test_bad_config_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nport = "x"\n[[pools]]\nmodel = "m"\nreplicas = []\n')
    p = subprocess.run(
        [*KVROUTER, "serve", "--config", str(bad)], cwd=ROOT, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert p.returncode == 2
    assert str(bad) in p.stderr and "$.server.port" in p.stderr
    ok = subprocess.run(
        [*KVROUTER, "serve", "--config", str(ROOT / "config/router-sim.toml"), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
