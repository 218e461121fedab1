"""The trace expander, the infinite-capacity bound and the routing simulator's accounting."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.routing_sim import ORACLE, Sim, SimConfig, policy_option  # noqa: E402
from gpu_emitter.workload import (  # noqa: E402
    ScaledRequest,
    Scaling,
    TraceError,
    block_token_ids,
    parse_trace,
    scale_trace,
    synthetic_trace,
    trace_reuse_bound,
)

pytest.importorskip("torch")


def _req(i: int, t: float, ids: tuple[int, ...], n: int, out: int = 1) -> ScaledRequest:
    return ScaledRequest(i, t, ids, n, out, 32)


# ------------------------------------------------------------------------- expander


def test_equal_ids_give_equal_tokens_and_the_last_block_is_partial() -> None:
    a = _req(0, 0.0, (7, 8, 9), 70).token_ids()
    b = _req(1, 0.0, (7, 8, 10), 96).token_ids()
    assert len(a) == 70 and len(b) == 96
    assert a[:64] == b[:64]  # ids 7, 8 shared
    assert a[64:70] != b[64:70]  # id 9 vs 10
    assert a[64:70] == list(block_token_ids(9, 32)[:6])
    assert block_token_ids(9, 32) != block_token_ids(10, 32)
    assert all(7 <= t < 2048 for t in a)  # wN words of the builtin vocabulary


def test_scaling_shrinks_counts_and_time_and_samples_whole_conversations() -> None:
    trace = parse_trace(
        [
            '{"timestamp": 0, "input_length": 600, "output_length": 100, "hash_ids": [0, 4]}',
            '{"timestamp": 1000, "input_length": 1100, "output_length": 1, '
            '"hash_ids": [0, 4, 5, 6]}',
            '{"timestamp": 2000, "input_length": 512, "output_length": 10, "hash_ids": [0, 3]}',
        ]
    )
    got = scale_trace(trace, Scaling(block_tokens=32, time_scale=0.5, session_stride=2))
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in got] == [
        (0.0, 38, 7),  # ceil(600 / 16), ceil(100 / 16)
        (0.5, 69, 1),
    ]
    other = scale_trace(trace, Scaling(session_stride=2, session_offset=1))
    assert [r.hash_ids for r in other] == [(0, 3)]


def test_bad_trace_lines_name_the_line() -> None:
    with pytest.raises(TraceError, match="<trace>:2"):
        parse_trace(
            [
                '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
                '{"timestamp": 0}',
            ]
        )
    with pytest.raises(TraceError, match="exceeds"):
        parse_trace(['{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}'])


def test_infinite_bound_by_hand() -> None:
    reqs = [
        _req(0, 0.0, (0, 1), 64),
        _req(1, 1.0, (0, 1, 2), 80),  # reuses 64; block 2 reached 16 tokens
        _req(2, 2.0, (0, 1, 2, 3), 128),  # 64 + 16 of block 2 = 80
        _req(3, 3.0, (0, 1), 64),  # at most n - 1 = 63 -> 48 aligned to 16
    ]
    assert trace_reuse_bound(reqs, 16) == (64 + 80 + 48, 64 + 80 + 128 + 64)


# ------------------------------------------------------------------------- simulator


def _summary_key(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in ("wall_s", "decide_us_mean")}


def test_accounting_by_hand_on_one_replica() -> None:
    reqs = [_req(0, 0.0, (0, 1), 64, out=2), _req(1, 10.0, (0, 1, 2), 96, out=1)]
    sim = Sim(SimConfig(layout="fa", replicas=1, num_blocks=64, check_all=True), Scaling())
    s = sim.run(reqs)
    assert s["completed"] == 2 and s["failed"] == 0
    assert s["prompt_tokens"] == 160
    assert s["cached_tokens"] == 64  # B reuses A's 4 full blocks
    assert s["prefill_tokens"] == 64 + 32
    # One step each, prefilling the uncached tokens at 0.05 ms x 16 per token + 0.5 ms.
    ttft = {r.src.index: r.first_token_at - r.src.arrival_s for r in sim.done}
    assert ttft[0] == pytest.approx(64 * 0.0008 + 0.0005)
    assert ttft[1] == pytest.approx(32 * 0.0008 + 0.0005)
    assert s["err_now_mismatches"] == 0 and s["err_admit_exact_ratio"] == 1.0


def _tiny() -> list[ScaledRequest]:
    return scale_trace(synthetic_trace(160, seed=3, rate_per_s=40.0), Scaling(block_tokens=32))


@pytest.mark.parametrize("layout", ["fa", "fa_swa"])
def test_invariants_on_a_tiny_trace(layout: str) -> None:
    reqs = _tiny()
    ceiling = trace_reuse_bound(reqs, 16)
    results = {}
    for policy in ("kv", "prefix_group_blind", "round_robin", ORACLE):
        cfg = SimConfig(layout=layout, replicas=3, policy=policy, num_blocks=160, check_all=True)
        sim = Sim(cfg, Scaling())
        results[policy] = s = sim.run(reqs)
        if policy != ORACLE:  # group-blind never under-predicts; exact on full attention
            assert all(r.blind_predicted >= r.true_now for r in sim.done)
            if layout == "fa":
                assert all(r.blind_predicted == r.predicted for r in sim.done)
        assert s["completed"] == len(reqs)
        # The index predicts every replica's true hit at every decision (events in order).
        assert s["err_now_mismatches"] == 0, policy
        assert s["cached_tokens"] <= ceiling[0]
    kv, oracle = results["kv"], results[ORACLE]
    # Exact predictions make the kv policy decide exactly as the oracle does.
    same = ("cached_tokens", "prefill_tokens", "ttft_p99_s", "requests_per_replica", "queue_mean_s")
    assert {k: kv[k] for k in same} == {k: oracle[k] for k in same}
    # Capacity is small: eviction happened, so the bound is not trivially reached.
    assert oracle["cached_tokens"] < ceiling[0]
    if layout == "fa_swa":
        assert results["prefix_group_blind"]["blind_over_max"] > 0  # group-blind over-predicts


def test_same_seed_same_result_and_delayed_events_can_mispredict() -> None:
    reqs = _tiny()
    cfg = SimConfig(layout="fa_swa", replicas=3, policy="kv", num_blocks=160, seed=4)
    a = Sim(cfg, Scaling()).run(reqs)
    b = Sim(cfg, Scaling()).run(reqs)
    assert _summary_key(a) == _summary_key(b)
    late = Sim(SimConfig(**{**cfg.__dict__, "event_delay_s": 5.0}), Scaling()).run(reqs)
    assert late["err_now_mismatches"] > 0  # stale state is visible as a prediction error


def test_policy_options_reach_the_policy_and_bad_ones_are_named() -> None:
    import argparse

    assert policy_option("per_request_tokens=256") == ("per_request_tokens", 256.0)
    for bad in ("per_request_tokens", "nope=1", "per_request_tokens=x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"FIELD=VALUE|number"):
            policy_option(bad)
    sim = Sim(
        SimConfig(layout="fa", replicas=2, policy="kv",
                  policy_options=(("per_request_tokens", 300.0),)),
        Scaling(block_tokens=32),
    )  # fmt: skip
    assert sim.policy.cfg.per_request_tokens == 300.0


def _shared_prefix_pair() -> list[ScaledRequest]:
    """Two requests over one 512-token prefix (16 blocks), the second sent 1 ms after the
    first. Run with events 1 s late, so the router has heard nothing of the first."""
    prefix = tuple(range(1, 17))
    return [_req(0, 0.0, (*prefix, 100), 544), _req(1, 0.001, (*prefix, 101), 544)]


@pytest.mark.parametrize(("weight", "together"), [(2.0, True), (0.0, False)])
def test_prefix_homes_keep_a_family_together_before_any_event(
    weight: float, together: bool
) -> None:
    # By hand, for the second request (hits 0 everywhere): on the first one's replica
    # queued = 544 pending + 256 per request = 800 and the home credit is min(2048, 2 x 512),
    # so its cost is 544 + 800 - 1024 = 320 against 544 on the idle replica. Without homes
    # it is 1344 against 544: the family splits.
    cfg = SimConfig(
        layout="fa",
        replicas=2,
        policy=f"kv:affinity_weight={weight:g}",
        num_blocks=256,
        event_delay_s=1.0,
    )
    sim = Sim(cfg, Scaling())
    sim.run(_shared_prefix_pair())
    where = {r.src.index: r.replica for r in sim.done}
    assert (where[0] == where[1]) is together
    assert sim.policy.cfg.affinity_weight == weight
    assert (sim.homes is not None) is (weight > 0)


def test_pinned_requests_home_nothing() -> None:
    # Set-up traffic pinned to a replica is not a routing decision (routing_scenarios.py):
    # had the pinned first request homed its prefix on replica 1, the second would follow it
    # there (the case above); unhomed, the idle replica 0 wins on its queue.
    cfg = SimConfig(layout="fa", replicas=2, policy="kv", num_blocks=256, event_delay_s=1.0)
    sim = Sim(cfg, Scaling())
    first, second = _shared_prefix_pair()
    a = sim.submit(first, replica=1)
    b = sim.submit(second)
    assert (a.replica, b.replica) == (1, 0)
    assert sim.homes is not None
    assert {sim.keys[0]} == set(sim.homes.homed(sim.homes.keys(b.tokens)))  # only b homed


def test_cache_pressure_reaches_the_policy_on_the_simulated_clock() -> None:
    # Unrelated one-block prompts 10 s apart (each done long before the next): hits and
    # queues are equal, so only recent_new_tokens (half-life 30 s) tells the replicas
    # apart, and it always points away from the one that took the last request.
    reqs = [_req(i, 10.0 * i, (1000 + i,), 32) for i in range(8)]
    cfg = SimConfig(layout="fa", replicas=2, policy="kv:pressure_weight=1", num_blocks=64)
    sim = Sim(cfg, Scaling())
    sim.run(reqs)
    order = [r.replica for r in sorted(sim.done, key=lambda r: r.src.index)]
    assert all(a != b for a, b in itertools.pairwise(order)), order


def test_policies_carry_their_own_fields_and_bad_ones_fail_before_any_run() -> None:
    from bench.routing_sim import split_policies

    got = split_policies("kv,kv:affinity_weight=8,affinity_max_tokens=8192,oracle,kv@0.5")
    assert got == ["kv", "kv:affinity_weight=8,affinity_max_tokens=8192", "oracle", "kv@0.5"]
    sim = Sim(
        SimConfig(layout="fa", replicas=2, policy=got[1],
                  policy_options=(("affinity_weight", 3.0), ("per_request_tokens", 300.0))),
        Scaling(),
    )  # fmt: skip
    assert sim.policy.cfg.affinity_weight == 8.0  # the policy's own field wins
    assert sim.policy.cfg.affinity_max_tokens == 8192.0
    assert sim.policy.cfg.per_request_tokens == 300.0  # the matrix-wide one still applies
    oracle = Sim(SimConfig(layout="fa", replicas=2, policy="oracle:affinity_weight=0"), Scaling())
    assert oracle.oracle and oracle.homes is None
    for bad, msg in (("kv,kvx", "unknown policy 'kvx'"), ("kv:nope=1", "FIELD=VALUE")):
        with pytest.raises(ValueError, match=msg):
            split_policies(bad)


def test_agent_trace_shares_one_prefix_and_nothing_else() -> None:
    from gpu_emitter.workload import TRACE_BLOCK_TOKENS, agent_trace

    trace = agent_trace(50, seed=5, prefix_blocks=4)
    assert [r.hash_ids[:4] for r in trace] == [(0, 1, 2, 3)] * 50
    assert len({r.hash_ids[4] for r in trace}) == 50  # each query its own
    assert all(4 * TRACE_BLOCK_TOKENS < r.input_length < 5 * TRACE_BLOCK_TOKENS for r in trace)
    assert all(b.timestamp_ms > a.timestamp_ms for a, b in itertools.pairwise(trace))
    assert agent_trace(50, seed=5) == trace and agent_trace(50, seed=6) != trace


def test_the_agent_matrix_reports_how_unevenly_requests_land(tmp_path: Path) -> None:
    import json

    from bench.routing_sim import main

    out = tmp_path / "agent.json"
    argv = ["--agent", "24", "--block-tokens", "512", "--layouts", "fa", "--replicas", "2",
            "--seeds", "1", "--jobs", "1", "--out", str(out),
            "--policies", "kv,round_robin"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["trace"] == "agent"
    for run in doc["runs"]:
        per = run["requests_per_replica"]
        assert sum(per) == 24
        assert run["requests_imbalance"] == pytest.approx(max(per) / (sum(per) / 2))
    agg = {r["policy"]: r for r in doc["aggregate"]}
    assert agg["round_robin"]["requests_imbalance"] == 1.0  # 12 and 12
    # The prefix is cached where the first request went; at this light load its exact hit
    # and look-ahead (3 x 2,048 tokens) outweigh every queue: kv sends everything there.
    assert agg["kv"]["requests_imbalance"] == 2.0
    assert "imbalance prefill / requests" in doc["table_md"]
    # Plots are named after the JSON (not routing_sim_*.png, which bench/run_all.py's report uses)
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["agent_hit.png", "agent_imbalance.png", "agent_ttft.png"]
