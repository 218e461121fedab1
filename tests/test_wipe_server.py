"""The router finishes a wiped replica's sweep on its own and exports the wipe counters.

Over real HTTP and ZeroMQ: a replica's blocks are indexed, the replica is removed through the
admin API (a wipe: its slot is retired and swept in steps, router.core.index KVIndex._wipe),
and no batch arrives afterwards, so only the server's sweep task (router.server.sweep) can
finish; ``/metrics`` shows the wipe, the steps, the pass and no dead slot left.
"""

from __future__ import annotations

import re

import httpx
from fake_replica import MODEL, FakeReplica, ServerThread
from test_proxy import TOKEN, router_toml, words
from zmq_helpers import wait_for

from gpu_emitter import tokenizer
from router.config import parse_config
from router.server.app import create_app


def _sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_a_removed_replicas_slot_is_swept_by_the_server_task() -> None:
    fake = FakeReplica("x")
    with ServerThread(fake.app) as srv:
        toml = router_toml({"x": (fake, srv)}) + "[index]\nsweep_step = 1\n"
        app = create_app(parse_config(toml))
        with ServerThread(app) as router, httpx.Client(base_url=router.url, timeout=10) as http:
            h = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}

            def entries() -> int:
                return http.get("/admin/index", headers=h).json()["pools"][0]["entries"]

            fake.serve_prompt(tokenizer.encode(words(5, 64)))
            wait_for(lambda: entries() > 0, 10, "x's blocks indexed")
            held = entries()
            steps_before = _sample(
                http.get("/metrics").text, "kvrouter_index_sweep_steps_total", pool=MODEL
            )
            assert steps_before == 0
            r = http.delete("/admin/replicas/x", headers=h)
            assert r.status_code == 200, r.text

            def swept() -> str | None:
                text = http.get("/metrics").text
                done = _sample(text, "kvrouter_index_dead_slots", pool=MODEL) == 0
                return text if done and entries() == 0 else None

            text = wait_for(swept, 10, "the sweep task to free x's slot")
            assert _sample(text, "kvrouter_index_wipes_total", mode="deferred", pool=MODEL) == 1
            assert _sample(text, "kvrouter_index_wipes_total", mode="sync", pool=MODEL) == 0
            assert _sample(text, "kvrouter_index_sweeps_total", pool=MODEL) == 1
            assert (_sample(text, "kvrouter_index_sweep_steps_total", pool=MODEL) or 0) > 1
            assert _sample(text, "kvrouter_index_swept_keys_total", pool=MODEL) == held
    fake.close()
