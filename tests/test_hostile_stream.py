"""One replica's hostile event stream, through a real router (ZeroMQ + HTTP on 127.0.0.1).

The hostile replica publishes valid msgpack with values no vLLM sends: a ``group_idx`` of -1,
2,000,000 or 3 (a group the layout lacks), a 2**20-token block, unknown ``medium`` names, and
events of the wrong kind. The router must stay up, count every refusal under that replica in
``/metrics``, distrust only that replica, and leave the other replica's predictions exactly
as they were.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fake_replica import FakeReplica, ServerThread
from prometheus_client.parser import text_string_to_metric_families
from test_proxy import TOKEN, router_toml
from zmq_helpers import wait_for

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
