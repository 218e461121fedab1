"""``kvrouter serve`` in front of two simulated replicas sharing one store (issue 14 item 4).

Real parts throughout: the router is the ``kvrouter serve`` subprocess, the replicas are
``gpu_emitter``'s simulated vLLM (tests/sim_cluster.py, full attention + sliding window 48)
sharing one :class:`gpu_emitter.shared_store.SharedStore`, which saves, publishes
(``BlockStored(medium="cpu")``) and loads by vLLM 0.32's Mooncake store connector rules,
written apart from the router's. A prefix computed on replica ``a`` must be predicted as
loadable on ``b``, and ``b``'s reported ``cached_tokens`` must equal that prediction.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_replica import free_port
from test_serve_e2e import KVROUTER, ROOT, wait_http

from gpu_emitter.shared_store import SharedStore
from tests.sim_cluster import MODEL, TOKEN, SimReplica, router_toml, words
from tests.zmq_helpers import wait_for

ADMIN = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[httpx.Client, dict[str, SimReplica], SharedStore]]:
    store = SharedStore()
    reps: dict[str, SimReplica] = {}
    proc = None
    try:
        for name in ("a", "b"):
            reps[name] = SimReplica(name, 400, store=store)
        port = free_port()
        text = router_toml(reps).replace("[server]\n", f"[server]\nport = {port}\n", 1)
        text += '[[pools.shared_tiers]]\nmedium = "cpu"\nload_cost = 0.25\n'
        cfg: Path = tmp_path_factory.mktemp("cfg") / "router.toml"
        cfg.write_text(text)
        proc = subprocess.Popen(
            [*KVROUTER, "serve", "--config", str(cfg)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(url, proc)
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client, reps, store
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        for rep in reps.values():
            rep.close()


def rows(client: httpx.Client, prompt: str) -> dict[str, dict[str, Any]]:
    r = client.post("/admin/route/explain", json={"model": MODEL, "prompt": prompt}, headers=ADMIN)
    assert r.status_code == 200, r.text
    return {row["replica"]: row for row in r.json()["replicas"]}


def complete(rep: SimReplica, prompt: str) -> int:
    r = rep.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prefix_computed_on_a_is_loaded_by_b_as_predicted(served) -> None:
    client, reps, store = served
    rng = random.Random("shared-store-e2e")
    prefix = words(rng, 150)
    assert complete(reps["a"], prefix) == 0  # computed on a, saved to the store
    assert len(store) > 0
    ask = prefix + " " + words(rng, 60)

    def loadable() -> dict[str, dict[str, Any]] | None:
        got = rows(client, ask)
        ext = got["b"].get("external", {}).get("CPU")
        return got if ext is not None and ext["loaded_tokens"] > 0 else None

    got = wait_for(loadable, 20, "the router to see a's store events")
    b = got["b"]
    ext = b["external"]["CPU"]
    assert ext["local_tokens"] == 0 and b["spec_group_hits"] == {
        "full_attention[0]": 0,
        "sliding_window[1]": 0,
    }
    assert ext["store_hit_tokens"] == ext["loaded_tokens"] == b["hit_tokens"]
    assert set(ext["store_spec_group_hits"]) == {"full_attention[0]", "sliding_window[1]"}
    # a serves the prefix from its own GPU cache and loads nothing
    assert got["a"]["external"]["CPU"]["loaded_tokens"] == 0
    assert got["a"]["hit_tokens"] > 0
    assert complete(reps["b"], ask) == b["hit_tokens"]


def test_the_router_prefers_the_local_hit_over_an_equal_load(served) -> None:
    client, reps, _ = served
    rng = random.Random("shared-store-e2e-2")
    prefix = words(rng, 120)
    complete(reps["a"], prefix)
    ask = prefix + " " + words(rng, 40)

    def seen() -> dict[str, dict[str, Any]] | None:
        got = rows(client, ask)
        return got if got["b"].get("external", {}).get("CPU", {}).get("loaded_tokens") else None

    got = wait_for(seen, 20, "the router to see a's store events")
    assert got["a"]["hit_tokens"] == got["b"]["hit_tokens"]  # same tokens, b must load them
    before = {n: rep.received["/v1/completions"] for n, rep in reps.items()}
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ask, "max_tokens": 1}, headers=ADMIN
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == got["a"]["hit_tokens"]
    after = {n: rep.received["/v1/completions"] for n, rep in reps.items()}
    assert (after["a"] - before["a"], after["b"] - before["b"]) == (1, 0)  # load_cost 0.25
