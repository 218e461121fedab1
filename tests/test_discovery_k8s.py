"""Kubernetes discovery end to end: the router watches a fake API server's pods and routes to
the simulated vLLM replicas they point at.

Real parts throughout: the API server is tests/k8s_fake_api.py (list/watch over loopback HTTP,
real-format Pod objects, chunked watch streams, bookmarks, 410 Gone, cut connections), the
replicas are tests/sim_cluster.py's simulated vLLM (HTTP + ZeroMQ events), the router is
``create_app`` on uvicorn. Every pod's IP is 127.0.0.1 and its annotations carry the replica's
ports, so a discovered pod is a real replica the router connects to. Each test gets a fresh API
server and router; the replicas are shared.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.config import parse_config
from router.server.app import create_app
from tests.fake_replica import ServerThread
from tests.k8s_fake_api import NAMESPACE, SELECTOR, FakeKubeApi, make_pod
from tests.sim_cluster import MODEL, TOKEN, SimReplica, router_toml
from tests.zmq_helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
ADMIN = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
STATIC = "static-s"


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, SimReplica]]:
    # real-time engine steps (20 ms per decode step): a long request stays in flight while
    # the test drains its replica; every other request asks for 2 tokens
    reps: dict[str, SimReplica] = {}
    try:
        for name in ("s", "a", "b", "c"):
            reps[name] = SimReplica(name, 160, time_scale=1.0)
        yield reps
    finally:
        for rep in reps.values():
            rep.close()


def _port(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[1]


def pod_for(name: str, sim: SimReplica, **kw: Any) -> dict[str, Any]:
    """A ready pod at 127.0.0.1 whose annotations name ``sim``'s ports."""
    annotations = {
        "kvrouter.io/http-port": str(sim.port),
        "kvrouter.io/events-port": _port(sim.publisher.endpoint),
        "kvrouter.io/replay-port": _port(sim.publisher.replay_endpoint),
        **kw.pop("annotations", {}),
    }
    return make_pod(name, annotations=annotations, **kw)


class Env:
    """A fake API server and a router discovering its pods (beside one static replica)."""

    def __init__(self, sims: dict[str, SimReplica], *, drain_timeout_s: float = 600.0,
                 fail_first: list[int] | None = None) -> None:  # fmt: skip
        self.sims = sims
        self.api = FakeKubeApi()
        if fail_first:
            self.api.fail_next = list(fail_first)
        self.api.start()
        toml = router_toml({STATIC: sims["s"]}).replace(
            f'model = "{MODEL}"\n', f'model = "{MODEL}"\ndiscovery = "kubernetes"\n'
        )
        toml += (
            "[pools.kubernetes]\n"
            f'namespace = "{NAMESPACE}"\n'
            f'label_selector = "{SELECTOR}"\n'
            f'api_server = "{self.api.url}"\n'
            "http_port = 1\n"  # every pod here names its ports in annotations
            f"drain_timeout_s = {drain_timeout_s}\n"
            "[health]\nprobe_interval_s = 0\n"
        )
        self.router = ServerThread(create_app(parse_config(toml))).start()
        self.http = httpx.Client(base_url=self.router.url, timeout=30)

    def close(self) -> None:
        self.http.close()
        try:
            self.router.stop()
        finally:
            self.api.close()

    def replicas(self) -> dict[str, dict[str, Any]]:
        r = self.http.get("/admin/replicas", headers=ADMIN)
        assert r.status_code == 200, r.text
        return {x["name"]: x for x in r.json()["replicas"]}

    def status(self) -> dict[str, Any]:
        r = self.http.get("/admin/discovery", headers=ADMIN)
        assert r.status_code == 200, r.text
        (pool,) = r.json()["pools"]
        return pool

    def metric(self, name: str, **labels: str) -> float:
        text = self.http.get("/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed
        m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def wait_replicas(self, *names: str, absent: tuple[str, ...] = ()) -> dict[str, Any]:
        def ok() -> dict[str, Any] | None:
            reps = self.replicas()
            if all(n in reps for n in names) and not any(n in reps for n in absent):
                return reps
            return None

        return wait_for(ok, 20, f"replicas {names} present and {absent} absent")

    def complete(self, prompt: str = "w1 w2 w3") -> httpx.Response:
        r = self.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        return r

    def drain(self, name: str, undrain: bool = False) -> None:
        verb = "undrain" if undrain else "drain"
        r = self.http.post(f"/admin/replicas/{name}/{verb}", headers=ADMIN)
        assert r.status_code == 200, r.text


@pytest.fixture
def env(sims: dict[str, SimReplica]) -> Iterator[Env]:
    e = Env(sims)
    try:
        yield e
    finally:
        e.close()


def test_ready_pods_become_replicas_beside_the_static_one_and_take_requests(env: Env) -> None:
    env.api.create(pod_for("vllm-a", env.sims["a"]))
    env.api.create(pod_for("vllm-b", env.sims["b"], ready=False))
    reps = env.wait_replicas("vllm-a", STATIC)
    assert reps["vllm-a"]["source"] == "kubernetes" and reps[STATIC]["source"] == "static"
    assert reps["vllm-a"]["url"] == env.sims["a"].url
    assert "vllm-b" not in reps  # not Ready
    st = env.status()
    assert st["pods"] == {"vllm-a": "ready", "vllm-b": "not ready: Ready condition not True"}
    assert st["connected"] and st["namespace"] == NAMESPACE

    # the protocol: a list with the selector, then a watch from the list's resourceVersion
    # asking for bookmarks
    (lst,) = env.api.queries(watch=False)
    assert lst == {"labelSelector": SELECTOR}
    first_watch = env.api.queries(watch=True)[0]
    assert first_watch["resourceVersion"] == str(env.api.listed[0])
    assert first_watch["allowWatchBookmarks"] == "true" and first_watch["watch"] == "1"
    assert first_watch["labelSelector"] == SELECTOR and int(first_watch["timeoutSeconds"]) >= 300

    # the admin API works beside discovery: with the static replica drained, the pod serves
    env.drain(STATIC)
    before = env.sims["a"].received["/v1/completions"]
    for i in range(3):
        assert env.complete(f"w{i} w7 w8").headers["x-kvrouter-replica"] == "vllm-a"
    assert env.sims["a"].received["/v1/completions"] == before + 3

    # the not-ready pod becomes ready: added
    def ready(pod: dict[str, Any]) -> None:
        for c in pod["status"]["conditions"]:
            c["status"] = "True"

    env.api.modify("vllm-b", ready)
    env.wait_replicas("vllm-b")
    wait_for(lambda: env.metric("kvrouter_discovery_replicas", pool=MODEL, state="serving") == 2)
    assert env.metric("kvrouter_discovery_replica_changes_total", pool=MODEL, change="added") == 2
    assert env.metric("kvrouter_discovery_events_total", pool=MODEL, type="MODIFIED") >= 1


def test_terminating_pod_is_drained_then_removed_when_its_requests_end(env: Env) -> None:
    env.api.create(pod_for("vllm-a", env.sims["a"]))
    env.api.create(pod_for("vllm-b", env.sims["b"]))
    env.wait_replicas("vllm-a", "vllm-b")
    env.drain(STATIC)
    env.drain("vllm-b")
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 1500, "stream": True}
    with env.http.stream("POST", "/v1/completions", json=body) as held:
        assert held.headers["x-kvrouter-replica"] == "vllm-a"
        lines = held.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)  # the stream runs: one request in flight on vllm-a
        env.drain("vllm-b", undrain=True)
        env.api.terminate("vllm-a")
        wait_for(lambda: env.replicas()["vllm-a"]["drained"], 20, "vllm-a drained")
        assert env.replicas()["vllm-a"]["in_flight"] == 1
        assert env.status()["pods"]["vllm-a"] == "not ready: terminating"
        assert "vllm-a" in env.status()["draining"]
        for i in range(3):  # new requests avoid it
            assert env.complete(f"w{i} w9").headers["x-kvrouter-replica"] == "vllm-b"
        assert "vllm-a" in env.replicas()  # still there while its request runs
    # the client went away: its request ends, the drained replica is idle and removed
    env.wait_replicas("vllm-b", absent=("vllm-a",))
    # counted once the removal (which awaits the replica's clients closing) has returned, a
    # moment after the pool stopped listing it
    wait_for(
        lambda: env.metric(
            "kvrouter_discovery_replica_changes_total", pool=MODEL, change="removed"
        ) == 1,
        20,
        "the removal counted",
    )  # fmt: skip
    assert env.metric("kvrouter_discovery_replicas", pool=MODEL, state="draining") == 0
    env.api.delete("vllm-a")
    wait_for(lambda: "vllm-a" not in env.status()["pods"], 20, "the deleted pod forgotten")
    assert env.metric("kvrouter_discovery_events_total", pool=MODEL, type="DELETED") == 1


def test_drain_timeout_removes_a_replica_with_requests_in_flight(
    sims: dict[str, SimReplica],
) -> None:
    env = Env(sims, drain_timeout_s=0.2)
    try:
        env.api.create(pod_for("vllm-a", sims["a"]))
        env.wait_replicas("vllm-a")
        env.drain(STATIC)
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 1500, "stream": True}
        with env.http.stream("POST", "/v1/completions", json=body) as held:
            lines = held.iter_lines()
            next(lines)
            assert env.replicas()["vllm-a"]["in_flight"] == 1
            env.api.terminate("vllm-a")
            env.wait_replicas(absent=("vllm-a",))
            assert env.metric("kvrouter_discovery_replica_changes_total", pool=MODEL,
                              change="removed_timeout") == 1  # fmt: skip
    finally:
        env.close()


def test_a_dropped_watch_resumes_from_the_last_resource_version(env: Env) -> None:
    env.api.create(pod_for("vllm-a", env.sims["a"]))
    env.wait_replicas("vllm-a")
    last = env.api.rv
    wait_for(lambda: env.status()["resource_version"] == str(last))
    watches = len(env.api.queries(watch=True))
    env.api.drop_watches()  # cut mid-stream
    wait_for(lambda: len(env.api.queries(watch=True)) > watches, 20, "a new watch")
    resumed = env.api.queries(watch=True)[watches]
    assert resumed["resourceVersion"] == str(last)
    assert len(env.api.queries(watch=False)) == 1  # resumed, not relisted
    assert env.metric("kvrouter_discovery_errors_total", pool=MODEL, reason="disconnected") >= 1
    # the resumed watch carries on
    env.api.create(pod_for("vllm-b", env.sims["b"]))
    env.wait_replicas("vllm-a", "vllm-b")
    assert env.metric("kvrouter_discovery_relists_total", pool=MODEL, reason="start") == 1


def test_bookmarks_advance_the_resource_version_a_watch_resumes_from(env: Env) -> None:
    env.api.create(pod_for("vllm-a", env.sims["a"]))
    env.wait_replicas("vllm-a")
    wait_for(lambda: env.api.open_watches() == 1, 20, "the watch open")
    mark = env.api.bookmark()
    wait_for(lambda: env.status()["resource_version"] == str(mark), 20, "the bookmark applied")
    watches = len(env.api.queries(watch=True))
    env.api.drop_watches(abrupt=False)  # the server's timeoutSeconds: a clean end
    wait_for(lambda: len(env.api.queries(watch=True)) > watches, 20, "a new watch")
    assert env.api.queries(watch=True)[watches]["resourceVersion"] == str(mark)
    assert env.metric("kvrouter_discovery_events_total", pool=MODEL, type="BOOKMARK") == 1
    # a clean end is no error
    assert "kvrouter_discovery_errors_total{" not in env.http.get("/metrics").text


@pytest.mark.parametrize("gone_mode", ["http", "event"])
def test_410_gone_relists_and_reconciles(env: Env, gone_mode: str) -> None:
    env.api.gone_mode = gone_mode
    env.api.create(pod_for("vllm-a", env.sims["a"]))
    env.api.create(pod_for("vllm-b", env.sims["b"]))
    env.wait_replicas("vllm-a", "vllm-b")
    # the router loses its watch and cannot get another one for a while ...
    env.api.refuse_watches = True
    env.api.drop_watches()
    wait_for(
        lambda: env.metric("kvrouter_discovery_errors_total", pool=MODEL, reason="http_503") >= 1,
        20,
        "a refused watch",
    )
    # ... meanwhile vllm-a is deleted, vllm-c created and the history compacted away
    env.api.delete("vllm-a")
    env.api.create(pod_for("vllm-c", env.sims["c"]))
    env.api.compact()
    env.api.refuse_watches = False
    reps = env.wait_replicas("vllm-b", "vllm-c", absent=("vllm-a",))
    assert reps["vllm-c"]["source"] == "kubernetes"
    assert env.metric("kvrouter_discovery_relists_total", pool=MODEL, reason="gone") == 1
    assert env.metric("kvrouter_discovery_errors_total", pool=MODEL, reason="gone") == 1
    assert len(env.api.queries(watch=False)) == 2
    # the watch after the relist starts from the new list's resourceVersion
    wait_for(lambda: env.api.open_watches() == 1, 20, "the watch open again")
    assert env.api.queries(watch=True)[-1]["resourceVersion"] == str(env.api.listed[-1])
    if gone_mode == "event":
        assert env.metric("kvrouter_discovery_events_total", pool=MODEL, type="ERROR") == 1
    assert env.status()["pods"] == {"vllm-b": "ready", "vllm-c": "ready"}


def test_bad_annotations_and_broken_events_are_counted_not_fatal(env: Env) -> None:
    env.api.create(pod_for("vllm-x", env.sims["a"], annotations={"kvrouter.io/http-port": "80a"}))
    env.api.create(pod_for("vllm-y", env.sims["b"], annotations={"kvrouter.io/dp-ranks": "0,0"}))
    env.api.create(pod_for("vllm-c", env.sims["c"]))
    env.wait_replicas("vllm-c")
    reasons = env.status()["pods"]
    assert reasons["vllm-x"].startswith("refused: annotation kvrouter.io/http-port='80a'")
    assert "repeated" in reasons["vllm-y"]
    assert env.metric("kvrouter_discovery_refused_pods_total", pool=MODEL,
                      reason="bad_annotation") == 2  # fmt: skip
    assert "vllm-x" not in env.replicas() and "vllm-y" not in env.replicas()

    # a broken line on the watch: counted, and the router relists (an event may be lost)
    env.api.inject(b'{"type": "ADDED", "object": [1, 2]}\n')
    wait_for(lambda: len(env.api.queries(watch=False)) == 2, 20, "a relist")
    assert env.metric("kvrouter_discovery_errors_total", pool=MODEL, reason="malformed") == 1
    # one nested past the JSON decoder's depth (RecursionError): the same
    env.api.inject(b'{"type": "ADDED", "object": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    wait_for(lambda: len(env.api.queries(watch=False)) == 3, 20, "another relist")
    assert env.metric("kvrouter_discovery_errors_total", pool=MODEL, reason="malformed") == 2

    # fixed: added
    env.api.modify(
        "vllm-x",
        lambda p: p["metadata"]["annotations"].update(
            {"kvrouter.io/http-port": str(env.sims["a"].port)}
        ),
    )
    env.wait_replicas("vllm-x", "vllm-c")
    # the relist saw the same bad vllm-y version again: not counted twice
    assert env.metric("kvrouter_discovery_refused_pods_total", pool=MODEL,
                      reason="bad_annotation") == 2  # fmt: skip


def test_a_pod_named_like_a_static_replica_is_refused(env: Env) -> None:
    env.api.create(pod_for(STATIC, env.sims["a"]))
    env.api.create(pod_for("vllm-b", env.sims["b"]))
    env.wait_replicas("vllm-b")
    wait_for(
        lambda: env.metric("kvrouter_discovery_refused_pods_total", pool=MODEL,
                           reason="name_clash") == 1,
        20, "the clash counted",
    )  # fmt: skip
    static = env.replicas()[STATIC]
    assert static["source"] == "static" and static["url"] == env.sims["s"].url


def test_a_pod_whose_ports_or_uid_change_is_replaced(env: Env) -> None:
    env.api.create(pod_for("vllm-a", env.sims["a"]))
    env.wait_replicas("vllm-a")
    env.drain(STATIC)
    b = env.sims["b"]
    # the pod now points at replica b (as a new IP would): the replica is replaced
    env.api.modify(
        "vllm-a",
        lambda p: p["metadata"]["annotations"].update(
            {"kvrouter.io/http-port": str(b.port),
             "kvrouter.io/events-port": _port(b.publisher.endpoint),
             "kvrouter.io/replay-port": _port(b.publisher.replay_endpoint)}
        ),
    )  # fmt: skip
    # a replacement removes the old replica before it adds the new one: absent in between
    wait_for(lambda: env.replicas().get("vllm-a", {}).get("url") == b.url, 20, "vllm-a replaced")
    before = b.received["/v1/completions"]
    assert env.complete("w3 w4").headers["x-kvrouter-replica"] == "vllm-a"
    assert b.received["/v1/completions"] == before + 1
    assert env.metric("kvrouter_discovery_replica_changes_total", pool=MODEL,
                      change="replaced") == 1  # fmt: skip
    # deleted and created again under the same name (a StatefulSet pod): a new uid, replaced
    env.api.delete("vllm-a")
    env.api.create(pod_for("vllm-a", b))
    wait_for(
        lambda: env.metric("kvrouter_discovery_replica_changes_total", pool=MODEL,
                           change="replaced") == 2
        or env.metric("kvrouter_discovery_replica_changes_total", pool=MODEL,
                      change="added") == 2,
        20, "the new pod taken",
    )  # fmt: skip
    env.wait_replicas("vllm-a")


def test_api_errors_are_retried_with_backoff(sims: dict[str, SimReplica]) -> None:
    env = Env(sims, fail_first=[500, 500, 403])
    try:
        env.api.create(pod_for("vllm-a", sims["a"]))
        env.wait_replicas("vllm-a")
        assert env.metric("kvrouter_discovery_errors_total", pool=MODEL, reason="http_500") == 2
        assert env.metric("kvrouter_discovery_errors_total", pool=MODEL, reason="http_403") == 1
        assert env.status()["last_error"].startswith("http_403")
        assert env.status()["connected"]
    finally:
        env.close()


def test_the_router_runs_without_the_kubernetes_client_unless_discovery_asks_for_it() -> None:
    code = (
        "import sys\n"
        "sys.modules['lightkube'] = None\n"  # `import lightkube` now raises ImportError
        "from router.config import parse_config\n"
        "from router.server.app import StartupError, check_startup, create_app\n"
        "static = '[[pools]]\\nmodel = \"m\"\\nreplicas = []\\n'\n"
        "create_app(parse_config(static))\n"
        'k8s = static + \'discovery = "kubernetes"\\n[pools.kubernetes]\\n'
        'label_selector = "app=vllm"\\n\'\n'
        "try:\n"
        "    check_startup(parse_config(k8s))\n"
        "except StartupError as exc:\n"
        "    print(exc)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pip install 'kvrouter[kubernetes]'" in r.stdout
