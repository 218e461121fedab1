"""The targeted routing scenarios: the cache state they rely on really arises in the pools, and
the exact hybrid hit routes the prefix stream where it hits (bench/routing_scenarios.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("torch")

from bench.routing_scenarios import (  # noqa: E402
    SCENARIOS,
    compare,
    main,
    quick,
    run_scenario,
)
from bench.routing_sim import Sim, SimConfig  # noqa: E402
from gpu_emitter.workload import ScaledRequest, Scaling  # noqa: E402

QUICK_A = quick(SCENARIOS["A"])


@pytest.fixture(scope="module")
def runs_a() -> dict[tuple[str, int], dict]:
    return {
        (policy, seed): run_scenario(QUICK_A, policy, seed)
        for seed in (0, 1)
        for policy in ("kv", "prefix_group_blind")
    }


def test_a_state_checkpoint_evicted_by_churn_and_kept_on_one_replica(runs_a) -> None:
    for (_, _seed), r in runs_a.items():
        setup = r["setup"]
        (full,) = setup["prefix_tokens"]
        (home,) = setup["homes"]
        assert 40 * 16 <= full <= 60 * 16
        # Priming: every replica serves the whole prefix (FA and the window checkpoint).
        assert all(c["pool_hit"] == full for c in setup["after_prime"][0])
        # Churn (other traffic on every replica) evicted every checkpoint, not the FA blocks.
        assert all(n > 0 for n in setup["churn_requests"])
        for c in setup["after_churn"][0]:
            assert (c["pool_hit"], c["pool_fa"]) == (0, full)
            assert (c["index_fa"], c["index_swa"], c["index_blind"]) == (full, 0, full)
        # Before the measured phase: FA everywhere, the hit only on the home replica, and the
        # group-blind prediction equal everywhere (it cannot tell the replicas apart).
        state = setup["before_measured"][0]
        assert [c["pool_fa"] for c in state] == [full] * 4
        assert [c["pool_hit"] for c in state] == [full if i == home else 0 for i in range(4)]
        assert [c["index_hit"] for c in state] == [c["pool_hit"] for c in state]
        assert [c["index_blind"] for c in state] == [full] * 4


def test_a_setup_does_not_depend_on_the_policy(runs_a) -> None:
    for seed in (0, 1):
        assert runs_a[("kv", seed)]["setup"] == runs_a[("prefix_group_blind", seed)]["setup"]
    # ... while the seed does choose it (prefix length, home replica, churn).
    assert runs_a[("kv", 0)]["setup"] != runs_a[("kv", 1)]["setup"]


def test_a_kv_routes_where_the_hit_is_real(runs_a) -> None:
    for seed in (0, 1):
        kv, blind = runs_a[("kv", seed)], runs_a[("prefix_group_blind", seed)]
        home = kv["setup"]["homes"][0]
        assert kv["err_now_mismatches"] == 0 and blind["err_now_mismatches"] == 0
        assert kv["failed"] == 0 and blind["failed"] == 0
        assert kv["cached_share"] >= blind["cached_share"]
        assert kv["prefill_tokens"] <= blind["prefill_tokens"]
        # Group-blind sees equal hits, spreads, and recomputes the prefix on the others.
        assert blind["wrong"] >= 1
        assert blind["wrong_tokens"] >= 40 * 16
        # kv keeps the stream on the replica with the real hit; it leaves it only when the
        # home's queue outweighs the prefix (the cost model's load terms), so it loses fewer
        # tokens than group-blind and most requests land on the home.
        assert kv["wrong"] < blind["wrong"]
        assert kv["wrong_tokens"] < blind["wrong_tokens"]
        assert kv["requests_per_replica"][home] > kv["requests"] // 2


def test_same_seed_same_result() -> None:
    a = run_scenario(QUICK_A, "prefix_group_blind", 3)
    b = run_scenario(QUICK_A, "prefix_group_blind", 3)
    drop = ("wall_s",)
    assert {k: v for k, v in a.items() if k not in drop} == {
        k: v for k, v in b.items() if k not in drop
    }


def test_pinned_submit_bypasses_the_policy() -> None:
    sim = Sim(SimConfig(layout="fa_swa", replicas=3, policy="round_robin"), Scaling())
    reqs = [ScaledRequest(i, 0.0, (100 + i,), 40, 50, 32) for i in range(3)]
    pinned = [sim.submit(r, replica=2) for r in reqs]
    assert [q.replica for q in pinned] == [2, 2, 2]
    assert sim.replicas[2].requests == 3 and sim.in_flight == [0, 0, 3]
    routed = sim.submit(ScaledRequest(9, 0.0, (200,), 40, 2, 32))
    assert routed.replica == 0  # round robin still at its first position
    sim.advance(1e6)
    assert sim.in_flight == [0, 0, 0] and len(sim.done) == 4


def test_compare_counts_seeds_where_kv_is_not_worse() -> None:
    def row(policy: str, seed: int, share: float, p90: float) -> dict:
        base = dict.fromkeys(
            ("prefill_tokens", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "wrong"), 0.0
        )
        return base | {
            "scenario": "A",
            "policy": policy,
            "seed": seed,
            "cached_share": share,
            "ttft_p90_s": p90,
        }

    rows = [
        row("kv", 0, 0.9, 0.10),
        row("prefix_group_blind", 0, 0.8, 0.20),
        row("kv", 1, 0.7, 0.30),
        row("prefix_group_blind", 1, 0.8, 0.20),
    ]
    got = {c["metric"]: c for c in compare(rows)}
    assert (got["cached_share"]["kv_not_worse"], got["cached_share"]["seeds"]) == (1, 2)
    assert got["cached_share"]["worst_diff"] == pytest.approx(-0.1)
    assert got["ttft_p90_s"]["kv_not_worse"] == 1
    assert got["ttft_p90_s"]["worst_diff"] == pytest.approx(0.1)
    assert got["wrong"]["kv_not_worse"] == 2


def test_cli_writes_json_table_and_plot(tmp_path: Path, capsys) -> None:
    out = tmp_path / "scen.json"
    rc = main(["--quick", "--scenarios", "A", "--seeds", "1", "--jobs", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {r["policy"] for r in doc["runs"]} == {
        "kv",
        "prefix_group_blind",
        "least_load",
        "round_robin",
    }
    assert doc["scenarios"]["A"]["requests"] == QUICK_A.requests
    assert (tmp_path / "routing_scenarios.png").stat().st_size > 10_000
    printed = capsys.readouterr()
    assert "| hybrid |" in printed.out and "40-60 blocks" in printed.out
    assert "[4/4" in printed.err  # progress on stderr
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
