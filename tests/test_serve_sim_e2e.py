"""The router end to end in front of three simulated hybrid vLLM replicas (issue 5).

Real loopback HTTP and ZeroMQ throughout: the replicas are ``gpu_emitter``'s simulated vLLM
(a real :class:`HybridBlockPool` of full attention + sliding window 48, 16-token blocks, vLLM's
default retention 0, publishing its KV events), not the hand-written fakes of
``test_proxy.py``; the router is ``router.server.app.create_app`` (tests/sim_cluster.py). So every
hit below is the one the pool's vLLM rules produce, and every prediction is made from the
events the pool published.

Each test uses its own prompts (words drawn from a generator seeded by the test's name), so
the tests hold in any order and share one module-scoped cluster. The failover test restarts
the replica it stops.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.sim_cluster import FA, MODEL, NAMES, SWA, SimCluster, words
from tests.zmq_helpers import wait_for

B = 16
"""Block size of both groups."""
NUM_BLOCKS = 160
"""Blocks per replica (both groups share them): room for any single request here, small
enough that the sliding-window test's flood reaches the blocks it wants to evict quickly."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    # No health probes here: the failover test checks the proxy's own failover on a replica
    # the router still believes alive (tests/test_health.py covers probes and ejection).
    c = SimCluster(NUM_BLOCKS, extra_toml="[health]\nprobe_interval_s = 0\n")
    try:
        yield c
    finally:
        c.close()


def floor_block(n: int) -> int:
    return n // B * B


def ok(r: httpx.Response) -> httpx.Response:
    assert r.status_code == 200, r.text
    return r


def post(
    client: httpx.Client, ask: dict[str, Any], path: str = "/v1/completions", **opts: Any
) -> httpx.Response:
    """POST ``ask`` (prompt or messages) for the pool's model; must answer 200."""
    return ok(client.post(path, json={"model": MODEL, **ask, **opts}))


def cached_tokens(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


Row = dict[str, Any]


def wait_hit(
    cluster: SimCluster, name: str, ask: dict[str, Any], cond: Callable[[Row], bool], what: str
) -> Row:
    """Poll ``/admin/route/explain`` for ``ask`` until ``cond`` holds for ``name``'s row (its
    hit, per-group hits, limiting group...); return that row."""

    def ready() -> Row | None:
        row = cluster.rows(**ask)[name]
        return row if cond(row) else None

    return wait_for(ready, 20, what)


# -- 1. a shared prefix lands on the replica that has it -----------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_shared_prefix_lands_on_the_replica_that_has_it(cluster: SimCluster, kind: str) -> None:
    rng = random.Random(f"shared-prefix-{kind}")
    b = cluster.direct("b")
    if kind == "completion":
        path = "/v1/completions"
        first: dict[str, Any] = {"prompt": words(rng, 12 * B)}  # BOS + 192 words: 193 tokens
        r = post(b, first, path, max_tokens=2)
        second: dict[str, Any] = {"prompt": first["prompt"] + " " + words(rng, 40)}
        # FA holds blocks 0..11; the window checkpoint ends at (193 - 1) // 16 * 16 = 192.
        want = 12 * B
    else:
        path = "/v1/chat/completions"
        turn = [
            {"role": "system", "content": words(rng, 150)},
            {"role": "user", "content": words(rng, 30)},
        ]
        first = {"messages": turn}
        r = post(b, first, path, max_tokens=24)
        reply = r.json()["choices"][0]["message"]["content"]
        second = {
            "messages": [
                *turn,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": words(rng, 20)},
            ]
        }
        # The next turn extends the first prompt and its reply. Full attention cached the
        # reply too (decode blocks), the sliding window only its checkpoint at the first
        # prompt's last aligned boundary (spec §4.7): that is the hit.
        n_first = post(b, first, "/tokenize").json()["count"]
        want = floor_block(n_first - 1)
    assert cached_tokens(r.json()) == 0  # a cold prompt on b

    row = wait_hit(cluster, "b", second, lambda x: x["hit_tokens"] > 0, "b's hit in explain")
    assert row["hit_tokens"] == want
    if kind == "chat":
        assert row["spec_group_hits"][FA] > want and row["limiting_group"] == SWA
    r = post(cluster.client, second, path, max_tokens=4)
    assert r.headers["x-kvrouter-replica"] == "b"
    predicted = int(r.headers["x-kvrouter-predicted-hit"])
    assert predicted == want
    assert cached_tokens(r.json()) == predicted


# -- 2. a replica whose window blocks were evicted loses --------------------------------------


def test_swa_evicted_replica_loses_to_the_one_that_kept_its_window_blocks(
    cluster: SimCluster,
) -> None:
    """Both a and c hold the full-attention blocks of a prefix; a lost its sliding-window
    checkpoint to later traffic, so vLLM on a would report 0 cached tokens and on c all of it.

    How the eviction happens honestly (gpu_emitter.managers, spec §4.7): with retention 0 the
    window group hashes only the ``need = 3`` blocks ending at the prompt's checkpoint
    (``16k`` for a ``16k + 1``-token prompt). While the request decodes, blocks that left the
    window of the next token are freed at once; after 64 generated tokens the checkpoint
    blocks have left it, so they join the free queue (LRU) *before* the full-attention blocks,
    which are freed only when the request finishes (decode blocks first, tail first). Small
    requests to a then take blocks from the head of the queue: the checkpoint is evicted while
    the full-attention prefix (behind the 4 decode blocks) survives. The flood goes in steps
    of 4 blocks and stops as soon as explain shows the eviction.
    """
    rng = random.Random("swa-eviction")
    k = 12
    prefix = words(rng, k * B)  # BOS + 16k words
    want = k * B
    probe = {"prompt": prefix + " " + words(rng, 20)}
    for name in ("a", "c"):
        r = post(cluster.direct(name), {"prompt": prefix}, max_tokens=64)
        assert r.json()["usage"]["completion_tokens"] == 64
    for name in ("a", "c"):
        wait_hit(cluster, name, probe, lambda x: x["hit_tokens"] == want, f"{name} indexed")

    flood_ids = random.Random("swa-eviction-flood")
    rows: dict[str, Row] = {}
    for _ in range(NUM_BLOCKS // 4 + 10):
        # 32 tokens (BOS + 31 words), one output token: 2 blocks per group, nothing decoded.
        post(cluster.direct("a"), {"prompt": words(flood_ids, 31)}, max_tokens=1)
        cluster.sync("a")
        rows = cluster.rows(**probe)
        if rows["a"]["hit_tokens"] < want:
            break
        assert rows["a"]["spec_group_hits"][FA] == want, "the flood evicted FA blocks first"
    else:
        pytest.fail("the flood never evicted a's sliding-window checkpoint")

    a, c = rows["a"], rows["c"]
    # Same full-attention prefix, same group-blind hit...
    assert a["spec_group_hits"][FA] == c["spec_group_hits"][FA] == want
    assert a["group_blind_hit_tokens"] == c["group_blind_hit_tokens"] == want
    # ...but on a the window group no longer has a run of 3 blocks ending at or before 192.
    assert a["spec_group_hits"][SWA] == 0 and c["spec_group_hits"][SWA] == want
    assert a["hit_tokens"] == 0 and a["limiting_group"] == SWA
    assert c["hit_tokens"] == want
    assert cluster.explain(**probe)["chosen"]["replica"] == "c"

    r = post(cluster.client, probe, max_tokens=2)
    assert r.headers["x-kvrouter-replica"] == "c"
    assert int(r.headers["x-kvrouter-predicted-hit"]) == want
    assert cached_tokens(r.json()) == want


# -- 3. streaming through the router is the replica's own stream ---------------------------

# The two fields of a chunk that legitimately differ between two calls: the response id
# (a fresh uuid4 per response, as vLLM's) and ``created`` (the second the response started,
# which may tick between the calls). Every chunk carries each exactly once (msgspec encodes
# without spaces); nothing else is normalised.
_ID = re.compile(rb'"id":"(?:cmpl|chatcmpl)-[0-9a-f]{32}"')
_CREATED = re.compile(rb'"created":\d+')


def normalise(raw: bytes) -> bytes:
    n_chunks = raw.count(b"data: {")
    out, n_ids = _ID.subn(b'"id":"<id>"', raw)
    out, n_created = _CREATED.subn(b'"created":0', out)
    assert n_ids == n_created == n_chunks, (n_ids, n_created, n_chunks)
    return out


def stream_raw(
    client: httpx.Client, path: str, body: dict[str, Any]
) -> tuple[httpx.Headers, bytes]:
    """POST a streaming request; the response headers and the body's bytes as on the wire."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        return r.headers, b"".join(r.iter_raw())


def first_id(raw: bytes) -> bytes:
    m = _ID.search(raw)
    assert m is not None, raw[:200]
    return m.group()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_is_byte_for_byte_a_direct_call(cluster: SimCluster, kind: str) -> None:
    rng = random.Random(f"streaming-{kind}")
    if kind == "completion":
        path, ask = "/v1/completions", {"prompt": words(rng, 100)}
    else:
        path = "/v1/chat/completions"
        ask = {"messages": [{"role": "user", "content": words(rng, 100)}]}
    body = {
        "model": MODEL,
        **ask,
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # Warm one replica through the router, so the streamed call and the direct one both find
    # the same cache state there (same cached_tokens in their usage chunks).
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    warm = ok(cluster.client.post(path, json=plain))
    owner = warm.headers["x-kvrouter-replica"]
    wait_hit(cluster, owner, ask, lambda x: x["hit_tokens"] > 0, f"{owner}'s hit in explain")

    via_headers, via = stream_raw(cluster.client, path, body)
    assert via_headers["x-kvrouter-replica"] == owner
    assert via_headers["content-type"].startswith("text/event-stream")
    direct_headers, direct = stream_raw(cluster.direct(owner), path, body)
    assert direct_headers["content-type"] == via_headers["content-type"]

    assert via.endswith(b"data: [DONE]\n\n")
    assert via.count(b"data: {") >= 13  # 12 tokens (+ a role chunk for chat) + usage
    # The replica gives every response its own id: the bodies differ there (and in
    # ``created`` when the second ticked), and nowhere else.
    assert first_id(via) != first_id(direct)
    assert normalise(via) == normalise(direct)
    usage = re.findall(rb'"cached_tokens":(\d+)', via)
    assert len(usage) == 1
    assert int(usage[0]) == int(via_headers["x-kvrouter-predicted-hit"]) > 0


# -- 4. failover when the best replica's HTTP server is gone --------------------------------


def test_failover_when_the_best_replica_is_dead(cluster: SimCluster) -> None:
    rng = random.Random("failover")
    dead = "c"
    prefix = words(rng, 10 * B)  # 161 tokens: hit 160 on a replica that holds it
    # 40 more words: the checkpoint the replica that serves it instead stores ends at 192,
    # past the prefix, so it cannot steal the later request below (its window run breaks).
    ask = {"prompt": prefix + " " + words(rng, 40)}
    post(cluster.direct(dead), {"prompt": prefix}, max_tokens=2)
    wait_hit(cluster, dead, ask, lambda x: x["hit_tokens"] == 10 * B, f"{dead} indexed")
    assert cluster.explain(**ask)["chosen"]["replica"] == dead

    failovers = cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead)
    assert cluster.health(dead)["consecutive_failures"] == 0
    cluster.replicas[dead].stop_http()
    try:
        with pytest.raises(httpx.ConnectError):
            httpx.get(cluster.replicas[dead].url + "/health", timeout=5)
        # Still the best by cache: the events said nothing about the HTTP server.
        assert cluster.explain(**ask)["chosen"]["replica"] == dead
        r = post(cluster.client, ask, max_tokens=2)
        served = r.headers["x-kvrouter-replica"]
        assert served in NAMES and served != dead
        assert cached_tokens(r.json()) == int(r.headers["x-kvrouter-predicted-hit"])
        assert cluster.metric("kvrouter_failovers_total", pool=MODEL, replica=dead) == failovers + 1
        # one failure: below health.eject_after_failures, so still in rotation
        health = cluster.health(dead)
        assert (health["consecutive_failures"], health["state"]) == (1, "healthy")
        status = cluster.metric(
            "kvrouter_requests_total", pool=MODEL, replica=served, status="200", status_class="2xx"
        )
        assert status >= 1
    finally:
        cluster.replicas[dead].start_http()

    # Back on the same port with its cache intact: the next request with that prefix goes to
    # it again and hits what the events said.
    assert httpx.get(cluster.replicas[dead].url + "/health", timeout=5).status_code == 200
    again = {"prompt": prefix + " " + words(rng, 10)}
    row = cluster.rows(**again)[dead]
    assert row["hit_tokens"] == 10 * B
    # Its load is what its last good scrape said, which may have caught the direct request
    # above in flight (another client's running request: 256 tokens of queue, more than its
    # 160-token lead) when no scrape failed while it was stopped; the next scrape (every
    # 0.5 s) clears it.
    wait_for(
        lambda: cluster.explain(**again)["chosen"]["replica"] == dead,
        10,
        f"{dead} chosen again once scraped",
    )
    r = post(cluster.client, again, max_tokens=2)
    assert r.headers["x-kvrouter-replica"] == dead
    assert cached_tokens(r.json()) == int(r.headers["x-kvrouter-predicted-hit"]) == 10 * B


# -- 5. the router tokenizes exactly as the replica ----------------------------------------


def test_tokenizer_parity_with_the_replicas_tokenize(cluster: SimCluster) -> None:
    """Three views of the router's token ids against the replica's ``POST /tokenize``: the
    pool tokenizer the proxy calls (exact ids), explain's ``num_tokens`` over HTTP, and the
    consequence that matters: after the replica served the request, the router's hashes of
    its own ids find every full block the replica published (hit = the aligned ``n - 1``)."""
    rng = random.Random("tokenizer-parity")
    cases: list[tuple[str, dict[str, Any]]] = [
        ("completion", {"prompt": words(rng, 70)}),
        ("completion", {"prompt": words(rng, 60), "add_special_tokens": False}),
        ("completion", {"prompt": "  Hello, world!\n\tnot  in the vocabulary " + words(rng, 50)}),
        ("completion", {"prompt": "<bos> <user> w3 " + words(rng, 50) + " <assistant>"}),
        (
            "chat",
            {
                "messages": [
                    {"role": "system", "content": words(rng, 30)},
                    {"role": "user", "content": "Some words, " + words(rng, 30)},
                ]
            },
        ),
        (
            "chat",
            {
                "messages": [
                    {"role": "user", "content": words(rng, 20)},
                    {"role": "assistant", "content": words(rng, 20)},
                    {"role": "user", "content": [{"type": "text", "text": words(rng, 20)}]},
                ]
            },
        ),
    ]
    pool = cluster.app.state.router.pools[MODEL]
    replica = cluster.direct("a")
    for kind, case in cases:
        want = post(replica, case, "/tokenize").json()
        # The call the proxy awaits (router.server.proxy); the builtin tokenizer never awaits
        # anything, so a private event loop here is enough.
        got = asyncio.run(pool.tokenizer.tokenize(kind, case))
        assert got.token_ids == want["tokens"], case
        assert cluster.explain(**case)["num_tokens"] == want["count"] == len(want["tokens"])

        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        r = post(replica, case, path, max_tokens=1)
        assert r.json()["usage"]["prompt_tokens"] == want["count"]
        full = floor_block(want["count"] - 1)
        assert full > 0
        wait_hit(cluster, "a", case, lambda x, f=full: x["hit_tokens"] == f, f"hit {full} on a")
