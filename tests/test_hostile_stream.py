"""One replica's hostile event stream, through a real router (ZeroMQ + HTTP on 127.0.0.1).

The hostile replica publishes valid msgpack with values no vLLM sends: a ``group_idx`` of -1,
2,000,000 or 3 (a group the layout lacks), a 2**20-token block, unknown ``medium`` names, and
events of the wrong kind. The router must stay up, count every refusal under that replica in
``/metrics``, distrust only that replica, and leave the other replica's predictions exactly
as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from fake_replica import LAYOUT, FakeReplica, ServerThread, fa_swa_events
from prometheus_client.parser import text_string_to_metric_families
from test_proxy import TOKEN, router_toml
from zmq_helpers import wait_for

from events.hashing import BlockHasher
from events.schema import BlockRemoved, BlockStored
from gpu_emitter import tokenizer
from router.config import parse_config
from router.server.app import create_app

ADMIN = {"authorization": f"Bearer {TOKEN}"}


def _store(**kw: object) -> BlockStored:
    fields = {
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    fields.update(kw)
    return BlockStored(**fields)  # type: ignore[arg-type]


HOSTILE: list[tuple[str, list[object]]] = [
    ("refused_group_idx", [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=2_000_000)]),
    ("refused_group_idx", [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=-1)]),
    ("refused_group_idx", [_store(group_idx=-1)]),
    ("refused_block_size", [_store(block_size=1 << 20)]),
    ("layout_conflict", [_store(group_idx=3)]),
    ("refused_medium", [_store(medium="")]),
]


@pytest.fixture()
def pair() -> Iterator[tuple[FakeReplica, FakeReplica, httpx.Client]]:
    good, bad = FakeReplica("good"), FakeReplica("bad")
    with ServerThread(good.app) as gs, ServerThread(bad.app) as bs:
        config = parse_config(router_toml({"good": (good, gs), "bad": (bad, bs)}))
        with (
            ServerThread(create_app(config)) as router,
            httpx.Client(base_url=router.url, timeout=10) as http,
        ):
            yield good, bad, http
    good.close()
    bad.close()


def _hits(http: httpx.Client, ids: list[int]) -> dict[str, tuple[int, bool]]:
    r = http.post("/admin/route/explain", json={"token_ids": ids}, headers=ADMIN)
    assert r.status_code == 200, r.text
    return {row["replica"]: (row["hit_tokens"], row["trusted"]) for row in r.json()["replicas"]}


def _ingest_errors(http: httpx.Client, replica: str) -> dict[str, float]:
    """``kvrouter_ingest_errors_total`` of ``replica``'s rank 0, by reason."""
    out: dict[str, float] = {}
    want = {"replica": replica, "dp_rank": "0"}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == "kvrouter_ingest_errors_total" and want.items() <= s.labels.items():
                out[s.labels["reason"]] = s.value
    return out


def test_one_replicas_hostile_events_touch_nothing_else(pair) -> None:
    good, bad, http = pair
    prompt = tokenizer.encode(" ".join(f"w{i}" for i in range(100, 200)))
    want = good.serve_prompt(prompt)  # 0: first time; the next ask hits
    assert want == 0
    expected = good.own_hit(prompt)
    assert expected > 0
    before = wait_for(
        lambda: (h := _hits(http, prompt)) and h["good"] == (expected, True) and h,
        10,
        "the good replica's blocks indexed",
    )
    for _, events in HOSTILE:
        bad.pub.publish(events)
    want_counts: dict[str, float] = {}
    for reason, _ in HOSTILE:
        want_counts[reason] = want_counts.get(reason, 0) + 1
    wait_for(
        lambda: _ingest_errors(http, "bad") == want_counts,
        10,
        f"every hostile event counted under bad: {want_counts}",
    )
    after = _hits(http, prompt)
    assert after["good"] == before["good"] == (expected, True)
    assert after["bad"] == (0, False)
    assert _ingest_errors(http, "good") == {}
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post("/admin/route/explain", json={"token_ids": prompt}, headers=ADMIN).json()
    bad_row = next(row for row in r["replicas"] if row["replica"] == "bad")
    assert "group count" in bad_row["untrusted_reason"]  # a settings problem outranks lost events


def _trust(http: httpx.Client, replica: str) -> tuple[str, str | None]:
    r = http.get("/admin/events", headers=ADMIN).json()
    (row,) = [s for s in r["streams"] if s["replica"] == replica]
    return row["trust"], row["untrusted_reason"]


@pytest.mark.parametrize("bad_first", [False, True], ids=["good-first", "bad-first"])
def test_learned_layout_one_replicas_conflict_quarantines_only_it(bad_first: bool) -> None:
    """With the layout learned from events (``groups = []``), the replica whose events
    contradict the others' (a larger ``block_size``, another kind in a group) is quarantined
    with the reason in /admin and /metrics; the other keeps its layout, stays exact and keeps
    predicting, whichever of the two spoke first."""
    good, bad = FakeReplica("good"), FakeReplica("bad")
    conflicts = [
        _store(block_hashes=[21], block_size=32, token_ids=list(range(32))),  # group 0 at 32
        _store(group_idx=1, block_hashes=[22]),  # group 1 as full attention (it is SWA)
    ]
    prompt = tokenizer.encode(" ".join(f"w{i}" for i in range(300, 400)))
    with ServerThread(good.app) as gs, ServerThread(bad.app) as bs:
        toml = router_toml({"good": (good, gs), "bad": (bad, bs)})
        toml = toml.replace(toml[toml.index("groups = [") :].split("\n")[0], "groups = []")
        with (
            ServerThread(create_app(parse_config(toml))) as router,
            httpx.Client(base_url=router.url, timeout=10) as http,
        ):
            if bad_first:
                for ev in conflicts:
                    bad.pub.publish([ev])
                wait_for(
                    lambda: _ingest_errors(http, "bad") or _trust(http, "bad")[0] == "exact",
                    10,
                    "the bad replica's events applied",
                )
            good.serve_prompt(prompt)
            expected = good.own_hit(prompt)
            assert expected > 0
            # (again, if it spoke first: a hostile replica keeps publishing)
            wait_for(lambda: _hits(http, prompt)["good"] == (expected, True), 10, "learned")
            for ev in conflicts:
                bad.pub.publish([ev])
            wait_for(
                lambda: _ingest_errors(http, "bad").get("layout_conflict", 0) >= 1,
                10,
                "the bad replica's conflict counted",
            )
            wait_for(lambda: _hits(http, prompt)["good"] == (expected, True), 10, "good exact")
            assert _trust(http, "good") == ("exact", None)
            trust, reason = _trust(http, "bad")
            # first found wrong by its layout, or (spoke first) by its hashes: either way a
            # settings problem, which a cache reset does not clear
            assert trust == "untrusted" and ("pool layout" in reason or "hash" in reason), reason
            assert _ingest_errors(http, "good") == {}
            # the good replica keeps predicting what it serves after the conflict
            more = tokenizer.encode(" ".join(f"w{i}" for i in range(500, 580)))
            good.serve_prompt(more)
            want = good.own_hit(more)
            wait_for(lambda: _hits(http, more)["good"] == (want, True), 10, "good still exact")
            text = http.get("/metrics").text
            assert any(
                line.startswith("kvrouter_replica_trust{")
                and 'replica="bad"' in line
                and 'state="untrusted"' in line
                and line.endswith(" 1.0")
                for line in text.splitlines()
            )
    good.close()
    bad.close()


# ------------------------------------------------- the layout quorum, live (issue 12)

H32 = BlockHasher(LAYOUT.hash, 32)
P_GOOD1 = tokenizer.encode(" ".join(f"w{i}" for i in range(300, 400)))  # 101 tokens
P_GOOD2 = tokenizer.encode(" ".join(f"w{i}" for i in range(600, 700)))  # 101 tokens
P_ODD = tokenizer.encode(" ".join(f"w{i}" for i in range(500, 580)))  # 81 tokens
#: Hand-derived hits (FakeReplica's layout: FA + SWA window 48, 16-token blocks, so the SWA
#: needs the 3 blocks below the boundary): 101 tokens store 6 full blocks (96 tokens), the
#: SWA the last 4 (blocks 2..5); the longest boundary <= 100 with FA blocks 0..5 and SWA
#: blocks 3..5 held is 96.
HIT_101_AT_16 = 96
#: The odd replica runs 32-token blocks (FA + SWA window 48: ceil(47/32) = 2 SWA blocks
#: needed): 81 tokens store 2 full blocks (64 tokens) in both groups; the boundary <= 80 is 64.
HIT_81_AT_32 = 64


def publish_at_32(fake: FakeReplica, ids: list[int]) -> None:
    """What a replica launched with ``--block-size 32`` publishes for a prompt: FA + SWA
    (window 48) at 32 tokens a block, hashes as vLLM computes them with that block size
    (consistent: the conformance check against its own view passes)."""
    fake.pub.publish(fa_swa_events(H32.wire_chain(ids), ids, 32, 2))


@contextmanager
def learned_router(names: list[str]) -> Iterator[tuple[dict[str, FakeReplica], httpx.Client]]:
    """Real fake replicas (HTTP + ZeroMQ) behind a real router whose pool learns its layout
    from events (``groups = []``)."""
    fakes = {n: FakeReplica(n) for n in names}
    with ExitStack() as stack:
        servers = {n: stack.enter_context(ServerThread(f.app)) for n, f in fakes.items()}
        toml = router_toml({n: (fakes[n], servers[n]) for n in names})
        toml = toml.replace(toml[toml.index("groups = [") :].split("\n")[0], "groups = []")
        router = stack.enter_context(ServerThread(create_app(parse_config(toml))))
        http = stack.enter_context(httpx.Client(base_url=router.url, timeout=10))
        yield fakes, http
    for f in fakes.values():
        f.close()


def _layout(http: httpx.Client) -> dict:
    (pool,) = http.get("/admin/layout", headers=ADMIN).json()["pools"]
    return pool


def _explain(http: httpx.Client, ids: list[int]) -> dict[str, tuple[int, bool, str | None]]:
    r = http.post("/admin/route/explain", json={"token_ids": ids}, headers=ADMIN).json()
    return {
        row["replica"]: (row["hit_tokens"], row["trusted"], row["untrusted_reason"])
        for row in r["replicas"]
    }


def _gauge(http: httpx.Client, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    return None


V16 = "[0: full_attention/16, 1: sliding_window/16 w48]"
V32 = "[0: full_attention/32, 1: sliding_window/32 w48]"


def test_learned_layout_the_odd_first_speaker_of_three_is_outvoted() -> None:
    """Three replicas, one launched with 32-token blocks (consistent hashes) and speaking
    first: its layout is only provisional; the first 16-token replica makes it contested
    (that one predicts 0, visibly, rather than from the 32-token layout); the second makes a
    majority: the pool switches to 16, the odd one is quarantined with both views and the
    count, and both agreeing replicas predict exactly, on blocks they stored during the
    contest as well."""
    with learned_router(["odd", "a", "b"]) as (fakes, http):
        publish_at_32(fakes["odd"], P_ODD)
        wait_for(lambda: _layout(http)["status"] == "provisional", 10, "odd's layout provisional")
        assert _layout(http)["layout"] == V32
        assert _explain(http, P_ODD)["odd"] == (HIT_81_AT_32, True, None)

        assert fakes["a"].serve_prompt(P_GOOD1) == 0
        wait_for(lambda: _layout(http)["status"] == "contested", 10, "contested")
        lay = _layout(http)
        assert lay["layout"] == V32 and lay["held"] == {"a/dp0": "contested"}
        views = {v["view"]: (v["replicas"], v["adopted"]) for v in lay["views"]}
        assert views == {V32: (["odd/dp0"], True), V16: (["a/dp0"], False)}
        hit, trusted, reason = _explain(http, P_GOOD1)["a"]
        assert (hit, trusted) == (0, False) and "layout contested" in reason
        assert V16 in reason and V32 in reason
        assert _explain(http, P_ODD)["odd"] == (HIT_81_AT_32, True, None)
        assert _gauge(http, "kvrouter_pool_layout_status", status="contested") == 1.0

        assert fakes["b"].serve_prompt(P_GOOD2) == 0
        wait_for(lambda: _layout(http)["status"] == "confirmed", 10, "confirmed")
        lay = _layout(http)
        assert lay["layout"] == V16 and lay["held"] == {"odd/dp0": "outvoted"}
        views = {v["view"]: (v["replicas"], v["adopted"]) for v in lay["views"]}
        assert views == {V16: (["a/dp0", "b/dp0"], True), V32: (["odd/dp0"], False)}
        assert fakes["a"].own_hit(P_GOOD1) == fakes["b"].own_hit(P_GOOD2) == HIT_101_AT_16
        got1, got2 = _explain(http, P_GOOD1), _explain(http, P_GOOD2)
        assert got1["a"] == (HIT_101_AT_16, True, None), "stored while contested, kept"
        assert got2["b"] == (HIT_101_AT_16, True, None)
        assert got1["b"][:2] == got2["a"][:2] == (0, True)
        odd_hit, odd_trusted, odd_reason = _explain(http, P_ODD)["odd"]
        assert (odd_hit, odd_trusted) == (0, False)
        assert "layout outvoted" in odd_reason and "2 of the 3" in odd_reason
        assert V16 in odd_reason and V32 in odd_reason
        assert _trust(http, "a") == ("exact", None) and _trust(http, "b") == ("exact", None)
        assert _trust(http, "odd")[0] == "untrusted"
        assert _ingest_errors(http, "odd") == {"layout_conflict": 1}
        assert _ingest_errors(http, "a") == {"layout_contested": 1}
        assert _ingest_errors(http, "b") == {}
        assert _gauge(http, "kvrouter_pool_layout_status", status="confirmed") == 1.0
        assert _gauge(http, "kvrouter_pool_layout_status", status="contested") == 0.0
        held = {"replica": "odd", "state": "outvoted"}
        assert _gauge(http, "kvrouter_replica_layout_held", **held) == 1.0
        assert _gauge(http, "kvrouter_pool_layout_view_replicas", view=V16, adopted="1") == 2.0
        # the agreeing replicas keep predicting what they serve next
        more = tokenizer.encode(" ".join(f"w{i}" for i in range(700, 800)))
        fakes["a"].serve_prompt(more)
        wait_for(lambda: _explain(http, more)["a"] == (HIT_101_AT_16, True, None), 10, "a exact")


@pytest.mark.parametrize("odd_first", [True, False], ids=["odd-first", "good-first"])
def test_learned_layout_two_replicas_disagreeing_are_contested(odd_first: bool) -> None:
    """Two replicas, two layouts, consistent hashes each: no majority can say which is
    wrong. The first speaker's layout stays in use and it keeps predicting; the other
    predicts 0 with the reason; nobody is quarantined; /admin and /metrics show the
    contest."""
    with learned_router(["odd", "a"]) as (fakes, http):
        if odd_first:
            publish_at_32(fakes["odd"], P_ODD)
            wait_for(lambda: _layout(http)["status"] == "provisional", 10, "provisional")
            fakes["a"].serve_prompt(P_GOOD1)
        else:
            fakes["a"].serve_prompt(P_GOOD1)
            wait_for(lambda: _layout(http)["status"] == "provisional", 10, "provisional")
            publish_at_32(fakes["odd"], P_ODD)
        wait_for(lambda: _layout(http)["status"] == "contested", 10, "contested")
        lay = _layout(http)
        first, other = ("odd", "a") if odd_first else ("a", "odd")
        assert lay["layout"] == (V32 if odd_first else V16)
        assert lay["held"] == {f"{other}/dp0": "contested"}
        odd, good = _explain(http, P_ODD)["odd"], _explain(http, P_GOOD1)["a"]
        if odd_first:
            assert odd == (HIT_81_AT_32, True, None)
            assert good[:2] == (0, False) and "layout contested" in good[2]
        else:
            assert good == (HIT_101_AT_16, True, None)
            assert odd[:2] == (0, False) and "layout contested" in odd[2]
        assert _trust(http, first) == ("exact", None)
        assert _ingest_errors(http, other) == {"layout_contested": 1}
        assert _ingest_errors(http, first) == {}
        assert _gauge(http, "kvrouter_pool_layout_status", status="contested") == 1.0
        held = {"replica": other, "state": "contested"}
        assert _gauge(http, "kvrouter_replica_layout_held", **held) == 1.0


def test_learned_layout_all_agree_is_confirmed_and_exact() -> None:
    """Three replicas with one layout: as before the quorum (every one exact from its first
    batch, no ingest error), and the status says confirmed."""
    with learned_router(["a", "b", "c"]) as (fakes, http):
        prompts = {"a": P_GOOD1, "b": P_GOOD2, "c": P_ODD}
        for name, ids in prompts.items():
            fakes[name].serve_prompt(ids)
            want = fakes[name].own_hit(ids)
            wait_for(
                lambda n=name, i=ids, w=want: _explain(http, i)[n] == (w, True, None), 10, name
            )
        assert fakes["c"].own_hit(P_ODD) == 80  # 81 tokens at 16: boundary 80, SWA 2..4 held
        lay = _layout(http)
        assert lay["status"] == "confirmed" and lay["layout"] == V16 and lay["held"] == {}
        assert lay["views"] == [
            {"view": V16, "replicas": ["a/dp0", "b/dp0", "c/dp0"], "adopted": True}
        ]
        for name in prompts:
            assert _trust(http, name) == ("exact", None) and _ingest_errors(http, name) == {}
