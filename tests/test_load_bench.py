"""The concurrent real-vLLM benchmark's parts that need no vLLM: the seeded workload plan, the
client that plays it (against a fake streaming endpoint on 127.0.0.1), the router config it
writes, and the summarizer (table, paired comparison, plot) over a synthetic JSON."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_vllm.load import (  # noqa: E402
    handler_counts,
    kvrouter_config,
    main,
    policy_options,
    prefill_counts,
    run_order,
    since,
    success_counts,
)
from bench.real_vllm.load_client import LoadRunner  # noqa: E402
from bench.real_vllm.load_plan import CHAT_OVERHEAD, PlanConfig, make_plan  # noqa: E402
from bench.real_vllm.load_report import (  # noqa: E402
    exactness,
    exactness_by_load,
    paired,
    paired_base,
    paired_table,
    percentile,
    prefill_split,
    summarize_run,
    ttft_by_kind,
    ttft_noise,
    ttft_noise_table,
)
from router.config import parse_config  # noqa: E402
from tests.fake_replica import ServerThread  # noqa: E402


def _words(text: str) -> int:
    return len(text.split())


# ------------------------------------------------------------------------------ plan


def test_the_plan_is_a_function_of_its_seed() -> None:
    assert make_plan(7) == make_plan(7)
    assert make_plan(7) != make_plan(8)
    assert make_plan(7).sessions[0].user_messages != make_plan(8).sessions[0].user_messages


def test_the_plan_has_the_asked_mix() -> None:
    for seed in (1, 2, 3):
        plan = make_plan(seed)
        assert plan.requests == 150
        assert len(plan.system_prompts) == 6
        assert all(300 <= _words(p) <= 900 for p in plan.system_prompts)
        one_offs = [s for s in plan.sessions if s.kind == "one_off"]
        convs = [s for s in plan.sessions if s.kind == "conversation"]
        assert len(one_offs) == 18  # 12 % of 150
        for s in one_offs:
            assert s.turns == 1 and s.system is None
            assert 1200 <= _words(s.user_messages[0]) + CHAT_OVERHEAD <= 1800
        assert {s.system for s in convs} == set(range(6))
        for s in convs:
            assert 2 <= s.turns <= 6
            assert len(s.think_s) == s.turns - 1
            assert all(20 <= _words(m) <= 120 for m in s.user_messages)
        assert all(16 <= m <= 32 for s in plan.sessions for m in s.max_tokens)
        arrivals = [s.arrival_s for s in plan.sessions]
        assert arrivals == sorted(arrivals)
        # one-offs are spread over the run, not bunched at one end
        first_half = sum(s.arrival_s < arrivals[-1] / 2 for s in one_offs)
        assert 3 <= first_half <= 15


@pytest.mark.parametrize("rate", [15.0, 4.0])
def test_arrivals_are_poisson_at_the_asked_rate(rate: float) -> None:
    plan = make_plan(11, PlanConfig(requests=6000, rate=rate))
    arrivals = [s.arrival_s for s in plan.sessions]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # all requests together are offered at `rate` per second
    assert plan.requests / arrivals[-1] == pytest.approx(rate, rel=0.06)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)
    think = [t for s in plan.sessions for t in s.think_s]
    assert statistics.fmean(think) == pytest.approx(0.3, rel=0.08)


# ---------------------------------------------------------------------------- client


def _fake_endpoint(seen: list[dict]) -> FastAPI:
    """Streams like vLLM: a role chunk, content chunks, a usage chunk; cached = half."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        seen.append(body)
        prompt = sum(_words(m["content"]) + 1 for m in body["messages"]) + 1
        sid = len(seen)

        async def stream():
            head = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            yield f"data: {json.dumps(head)}\n\n"
            for i in range(3):
                delta = {"choices": [{"index": 0, "delta": {"content": f" w{sid}{i}"}}]}
                yield f"data: {json.dumps(delta)}\n\n"
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": prompt // 2},
            }
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        headers = {"x-kvrouter-replica": "B/dp0", "x-kvrouter-predicted-hit": str(prompt // 2)}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    return app


def test_turns_extend_the_previous_messages_with_the_streamed_answer() -> None:
    seen: list[dict] = []
    plan = make_plan(5, PlanConfig(requests=30, rate=200.0, think_mean_s=0.01))
    server = ServerThread(_fake_endpoint(seen)).start()
    try:
        runner = LoadRunner(plan, server.url, "tiny-hybrid")
        assert asyncio.run(runner.run(deadline_s=60))
    finally:
        server.stop()
    assert len(runner.records) == len(seen) == plan.requests
    assert all(r.error is None for r in runner.records)
    by_first = {json.dumps(b["messages"][:2]): [] for b in seen}
    for b in seen:
        by_first[json.dumps(b["messages"][:2])].append(b["messages"])
    convs = [s for s in plan.sessions if s.kind == "conversation"]
    for s in convs:
        turns = sorted(
            (m for m in by_first[json.dumps(plan.first_messages(s)[:2])]),
            key=len,
        )
        assert len(turns) == s.turns
        for k in range(1, s.turns):
            prev, cur = turns[k - 1], turns[k]
            assert cur[: len(prev)] == prev
            assert cur[len(prev)]["role"] == "assistant"
            assert (
                cur[len(prev)]["content"].startswith("w")
                and len(cur[len(prev)]["content"].split()) == 3
            )
            assert cur[len(prev) + 1] == {"role": "user", "content": s.user_messages[k]}
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in seen)
    r = runner.records[0]
    assert r.replica == "B" and r.predicted_hit == r.cached_tokens and r.expected_hit is None
    assert r.ttft_s is not None and r.ttft_s <= r.latency_s
    assert runner.max_in_flight >= 2  # sessions overlap at 200/s
    assert "x-kvrouter-predicted-hit" in runner.header_names


# ---------------------------------------------------------------------------- config


def test_the_kvrouter_config_is_valid_and_has_the_four_groups(tmp_path: Path) -> None:
    replicas = [
        SimpleNamespace(
            name=n,
            url=f"http://127.0.0.1:{p}",
            events_endpoint=f"tcp://127.0.0.1:{p + 1}",
            replay_endpoint=f"tcp://127.0.0.1:{p + 2}",
        )
        for n, p in (("A", 18600), ("B", 18610))
    ]
    fleet = SimpleNamespace(workdir=tmp_path, replicas=replicas)
    opts = policy_options(["speculative_insert=true", "lookahead_weight=0.5"])
    cfg = parse_config(kvrouter_config(fleet, "kv", 18690, opts, tie_seed=3))
    pool = cfg.pools[0]
    assert [g.kind.value if hasattr(g.kind, "value") else g.kind for g in pool.layout.groups] == [
        "sliding_window"
    ] * 3 + ["full_attention"]
    assert all(g.sliding_window == 100 for g in pool.layout.groups[:3])
    assert pool.layout.retention_interval == 0
    assert pool.policy.speculative_insert is True and pool.policy.lookahead_weight == 0.5
    assert pool.policy.seed == 3
    with pytest.raises(SystemExit):
        policy_options(["no-equals-sign"])


# ------------------------------------------------------------------------- summaries


def _record(cached: int, prompt: int, ttft: float, pred: int | None = None) -> dict:
    return {
        "sid": 0, "turn": 0, "kind": "conversation", "send_s": 0.0, "in_flight": 3,
        "status": 200, "ttft_s": ttft, "latency_s": ttft + 0.1, "prompt_tokens": prompt,
        "cached_tokens": cached, "completion_tokens": 16, "replica": "A",
        "predicted_hit": pred, "expected_hit": None, "error": None,
    }  # fmt: skip


def test_exactness_splits_misses_and_percentiles_are_nearest_rank() -> None:
    recs = [_record(64, 100, 0.1, 64), _record(64, 100, 0.1, 32), _record(0, 100, 0.1, 32)]
    assert exactness(recs, "predicted_hit") == {"exact": 1, "under": 1, "over": 1, "total": 3}
    assert exactness(recs, "expected_hit") is None
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile(list(range(1, 101)), 90) == 90
    assert percentile([], 50) is None
    s = summarize_run(recs)
    assert s["reuse"] == pytest.approx(128 / 300)
    assert s["ttft_ms"]["mean"] == pytest.approx(100.0)


def test_ttft_is_pooled_per_kind_of_request() -> None:
    """Hand-counted: first turns 100 and 300 ms (mean 200, p90 300), one later turn 50 ms, one
    one-off 900 ms; an errored request and one without a first chunk are left out."""

    def rec(kind: str, turn: int, ttft: float | None, error: str | None = None) -> dict:
        return {"kind": kind, "turn": turn, "ttft_s": ttft, "error": error}

    run = {
        "policy": "kv",
        "records": [
            rec("conversation", 0, 0.1),
            rec("conversation", 0, 0.3),
            rec("conversation", 2, 0.05),
            rec("one_off", 0, 0.9),
            rec("conversation", 1, 5.0, error="timeout"),
            rec("conversation", 1, None),
        ],
    }
    table = ttft_by_kind([run, {"policy": "cache_aware", "records": []}])
    lines = table.splitlines()
    assert lines[2] == "| kv | 4, 338 / 900 | 2, 200 / 300 | 1, 50 / 50 | 1, 900 / 900 |"
    assert lines[3] == "| cache_aware | – | – | – | – |"


def test_the_prefill_split_is_the_busier_replicas_share() -> None:
    """Hand-counted. Run 1: A computed 300 + 100 = 400 uncached tokens, B 100 (80 %); one-offs 2
    on A, 1 on B (67 %). Run 2: 50 / 50 and one one-off (100 %). Mean 65 % and 83 %. An errored
    request counts nowhere. vllm-router's run has only the replicas' counters: 600 of 1000."""

    def rec(replica: str | None, prompt: int, cached: int, kind: str = "conversation") -> dict:
        return {"replica": replica, "prompt_tokens": prompt, "cached_tokens": cached,
                "kind": kind, "error": None}  # fmt: skip

    run1 = [
        rec("A", 400, 100, "one_off"),
        rec("A", 100, 0, "one_off"),
        rec("B", 100, 0, "one_off"),
        {**rec("B", 900, 0), "error": "timeout"},
    ]
    run2 = [rec("A", 64, 14), rec("B", 50, 0, "one_off")]
    ca = {"policy": "cache_aware", "records": [rec(None, 100, 0)],
          "per_replica_prefill": {"A": 400, "B": 600}}  # fmt: skip
    lines = prefill_split(
        [{"policy": "kv", "records": run1}, {"policy": "kv", "records": run2}, ca]
    ).splitlines()
    assert lines[2] == "| kv | 2 | 65 % (50–80 %) | 83 % (67–100 %) |"
    assert lines[3] == "| cache_aware | 1 | 60 % (60–60 %) | – |"


def test_exactness_is_counted_per_band_of_requests_in_flight() -> None:
    """Hand-counted: at 1 and 4 in flight the admission-time prediction is right, at 25 it
    over-predicts once (what the queue ahead evicted) and an errored answer is not counted."""

    def rec(in_flight: int, cached: int, pred: int, expected: int, error: str | None = None):
        r = _record(cached, 100, 0.1, pred)
        return {**r, "in_flight": in_flight, "expected_hit": expected, "error": error}

    recs = [
        rec(1, 0, 0, 0),
        rec(4, 64, 32, 64),
        rec(5, 64, 64, 64),
        rec(25, 0, 64, 64),
        rec(30, 32, 32, 32),
        rec(4, 0, 64, 64, error="timeout"),
    ]
    md = exactness_by_load([{"policy": "kv", "records": recs}])
    lines = md.splitlines()
    head = "| policy | prediction | 1-2 | 3-5 | 6-10 | 11-20 | 21+ | all (under / over) |"
    assert lines[0] == head
    # events-only: one under at 4 in flight, one over at 25; the record has no in-flight hit
    bands = "| – | – | 1/2 (50.0 %) |"
    assert f"| kv | events-only | 1/1 (100.0 %) | 1/2 (50.0 %) {bands} 3/5 (1 / 1) |" in lines
    assert f"| kv | admission-time | 1/1 (100.0 %) | 2/2 (100.0 %) {bands} 4/5 (0 / 1) |" in lines
    assert not any("requests ahead" in line for line in lines)
    # a router with no prediction headers (vllm-router) gets no row
    bare = [{**r, "predicted_hit": None, "expected_hit": None} for r in recs]
    assert "cache_aware" not in exactness_by_load([{"policy": "cache_aware", "records": bare}])


def _run(policy: str, seed: int, repeat: int, reuse: float, ttft: float) -> dict:
    recs = [_record(round(100 * reuse), 100, ttft / 1e3, 0 if policy == "kv" else None)]
    return {
        "policy": policy, "seed": seed, "repeat": repeat, "requests_planned": 1,
        **summarize_run(recs), "per_replica": {"A": 1, "B": 0}, "timed_out": False,
        "startup_s": 40.0, "run_s": 10.0, "records": recs,
    }  # fmt: skip


def test_summarize_rebuilds_table_pairs_and_plot_from_json(tmp_path: Path) -> None:
    runs = []
    for seed in (1, 2):
        for rep in (1, 2):
            runs.append(_run("kv", seed, rep, 0.60 + 0.01 * rep, 80.0))
            runs.append(_run("cache_aware", seed, rep, 0.58, 120.0 if rep == 1 else 60.0))
    runs.append(_run("round_robin", 1, 1, 0.50, 200.0))
    out = tmp_path / "load.json"
    out.write_text(json.dumps({"config": {"requests": 1, "rate": 15.0}, "runs": runs}))
    assert main(["--summarize", "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| kv | 61.0, 62.0 / 61.0, 62.0 |" in md
    assert "| cache_aware | 58.0, 58.0 / 58.0, 58.0 |" in md
    assert out.with_suffix(".png").stat().st_size > 1000
    rows = {p["other"]: p for p in paired(runs)}
    assert rows["cache_aware"]["pairs"] == 4
    assert rows["cache_aware"]["reuse_delta_mean"] == pytest.approx(3.5)
    assert rows["cache_aware"]["ttft_mean_wins"] == 2  # 80 < 120 twice, 80 > 60 twice
    assert rows["round_robin"]["pairs"] == 1
    assert "| cache_aware | 4 | +3.0, +4.0, +3.0, +4.0 | +3.5 | 4/4 | 2/4 | 2/4 |" in md


def test_rounds_merge_into_per_seed_means_and_the_bar_s_verdict(tmp_path: Path) -> None:
    """Issue 17's bar is judged on each seed's mean over every round: two rounds merged, the
    second one's repeats numbered after the first's so the pairs stay within a round."""
    one = [
        _run("kv", 1, 1, 0.60, 80.0), _run("kv", 1, 2, 0.62, 80.0), _run("kv", 2, 1, 0.64, 80.0),
        _run("cache_aware", 1, 1, 0.61, 90.0), _run("cache_aware", 1, 2, 0.61, 90.0),
        _run("cache_aware", 2, 1, 0.63, 90.0),
        _run("kv", 3, 1, 0.62, 80.0), _run("cache_aware", 3, 1, 0.62, 90.0),  # equal: "at least"
    ]  # fmt: skip
    two = [
        _run("kv", 1, 1, 0.58, 80.0), _run("kv", 2, 1, 0.66, 80.0),
        _run("cache_aware", 1, 1, 0.60, 90.0), _run("cache_aware", 2, 1, 0.64, 90.0),
    ]  # fmt: skip
    paths = []
    for i, runs in enumerate((one, two)):
        paths.append(tmp_path / f"round{i}.json")
        paths[-1].write_text(json.dumps({"config": {"command": f"round {i}"}, "runs": runs}))
    out = tmp_path / "pooled.json"
    assert main(["--summarize", "--merge", *map(str, paths), "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    # kv: seed 1 (60 + 62 + 58) / 3 = 60.00 < 60.67 = (61 + 61 + 60) / 3; seed 2 (64 + 66) / 2
    # = 65.00 >= 63.50 = (63 + 64) / 2
    assert "| kv | 3 / 2 / 1 | 60.00 / 65.00 / 62.00 | – |" in md
    assert "| cache_aware | 3 / 2 / 1 | 60.67 / 63.50 / 62.00 | 2/3 |" in md
    assert "| cache_aware | 6 | " in md  # 4 pairs in round 0, 2 in round 1, none across
    pooled = json.loads(out.read_text())
    assert sorted(r["repeat"] for r in pooled["runs"] if r["policy"] == "kv") == [1, 1, 1, 2, 3, 3]
    assert pooled["config"]["command"] == "round 0 ; round 1"
    with pytest.raises(SystemExit):
        main(["--merge", str(paths[0]), "--out", str(out)])  # only with --summarize
    with pytest.raises(SystemExit):
        main(["--summarize", "--merge", str(tmp_path / "absent.json"), "--out", str(out)])


def test_the_run_order_rotates_the_policies_one_place_per_block() -> None:
    order = run_order([1, 2], 2, ["a", "b", "c"])
    blocks = [order[i : i + 3] for i in range(0, len(order), 3)]
    assert [[p for _, _, p in b] for b in blocks] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]
    ]  # fmt: skip
    assert [b[0][:2] for b in blocks] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(len({(s, k) for s, k, _ in b}) == 1 for b in blocks)  # a block is one pairing
    firsts = [b[0][2] for b in blocks[:3]]
    assert sorted(firsts) == ["a", "b", "c"]  # over 3 blocks each policy leads once
    fixed = run_order([1, 2], 2, ["a", "b", "c"], rotate=False)
    assert [p for _, _, p in fixed] == ["a", "b", "c"] * 4
    assert sorted(order) == sorted(fixed)  # the same runs, only reordered
    assert run_order([1], 1, []) == []


def test_ttft_noise_sets_the_policies_distance_beside_each_one_s_repeats() -> None:
    runs = [
        _run("kv", 1, 1, 0.6, 80.0), _run("kv", 1, 2, 0.6, 120.0),
        _run("cache_aware", 1, 1, 0.6, 100.0), _run("cache_aware", 1, 2, 0.6, 100.0),
        _run("round_robin", 1, 1, 0.6, 40.0),
    ]  # fmt: skip
    rows = {r["policy"]: r for r in ttft_noise(runs, "kv")}
    assert rows["kv"]["repeat_mean"] == pytest.approx(math.log(1.5))  # 80 vs 120
    assert rows["kv"]["repeat_n"] == 1
    assert rows["cache_aware"]["repeat_mean"] == pytest.approx(0.0)
    # kv / cache_aware: 0.8 and 1.2 -> median distance of |ln| and mean signed ln
    ca = rows["cache_aware"]
    assert ca["pair_n"] == 2
    assert ca["pair_mean"] == pytest.approx((math.log(1.25) + math.log(1.2)) / 2)
    assert ca["bias_mean"] == pytest.approx((math.log(0.8) + math.log(1.2)) / 2)
    rr = rows["round_robin"]
    assert rr["repeat_n"] == 0 and rr["repeat_mean"] is None  # one run: no repeats to compare
    assert rr["pair_n"] == 1 and rr["bias_mean"] == pytest.approx(math.log(2.0))
    table = ttft_noise_table(runs)
    assert "| kv | 1 | 50 % / 50 % | – | – | – |" in table
    assert "| cache_aware | 1 | 0 % / 0 % | 2 | 22 % / 22 % | -2 % / -2 % |" in table
    assert "| round_robin | 0 | – / – | 1 | 100 % / 100 % | +100 % / +100 % |" in table


def test_a_round_of_kv_with_options_only_is_paired_under_its_own_name() -> None:
    spec = "kv:speculative_insert=true,speculative_routing=false"
    runs = [_run(spec, 1, 1, 0.62, 80.0), _run("cache_aware", 1, 1, 0.60, 90.0)]
    assert paired_base(runs) == spec
    assert paired_base([*runs, _run("kv", 1, 1, 0.5, 1.0)]) == "kv"
    assert paired_base([_run("cache_aware", 1, 1, 0.6, 1.0)]) == "kv"
    table = paired_table(runs)
    assert f"| {spec} vs |" in table
    assert "| cache_aware | 1 | +2.0 | +2.0 | 1/1 | 1/1 | 1/1 |" in table


def test_replica_metrics_are_parsed_per_replica_and_handler() -> None:
    text = (
        "# HELP http_requests_total x\n"
        'http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 12.0\n'
        'http_requests_total{handler="/v1/completions/render",method="POST",status="2xx"} 3.0\n'
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0\n'
        'vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9\n'
    )
    assert success_counts({"A": text, "B": text.replace("} 2.0", "} 5.0")}) == {"A": 3, "B": 6}
    assert handler_counts({"A": text, "B": text}) == {
        "/v1/chat/completions 2xx": 24,
        "/v1/completions/render 2xx": 6,
    }


def test_each_replicas_prefill_is_its_prompt_tokens_less_the_cached_ones() -> None:
    text = (
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0\n'
        'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 640.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local"} 9.0\n'
    )
    assert prefill_counts({"A": text, "B": text.replace("} 640.0", "} 0.0")}) == {
        "A": 360,
        "B": 1000,
    }
    # a run's share is what the counters grew by between the scrapes before and after it
    later = {"A": text.replace("} 1000.0", "} 1500.0"), "B": text}
    assert since(prefill_counts, {"A": text}, later) == {"A": 500, "B": 360}  # B: new


def test_losses_split_each_kind_by_its_own_limit() -> None:
    from bench.real_vllm.load_losses import losses_table, run_losses

    cfg = PlanConfig(requests=40)
    plan = make_plan(4, cfg)
    convs = [s for s in plan.sessions if s.kind == "conversation"]
    a, b = convs[0], next(s for s in convs[1:] if s.system == convs[0].system)
    other = next(s for s in plan.sessions if s.kind == "one_off")

    def rec(s, turn, t, replica, prompt, cached):
        return {"sid": s.sid, "turn": turn, "kind": s.kind, "send_s": t, "replica": replica,
                "prompt_tokens": prompt, "cached_tokens": cached, "error": None}  # fmt: skip

    records = [
        rec(a, 0, 0.0, "A", 500, 0),  # the family's first request on A: new there
        rec(b, 0, 0.1, "A", 520, 0),  # seen there (the window checkpoint rule, or evicted)
        rec(b, 1, 0.5, "A", 700, 512),  # bound (520 - 1) // 32 * 32 = 512: at it
        rec(b, 2, 0.9, "B", 900, 0),  # bound 672: moved, 672 lost
        rec(a, 1, 1.0, "A", 600, 448),  # bound 480: stayed, 32 lost
        rec(other, 0, 1.1, "B", 1500, 0),
        {**rec(a, 2, 1.2, "A", 800, 0), "error": "timeout"},  # not counted
    ]
    got = run_losses({"seed": 4, "records": records}, cfg)
    assert got["first_n"] == 2 and got["first_miss_new"] == 1 and got["first_miss_seen"] == 1
    assert got["later_n"] == 3 and got["later_bound"] == 512 + 672 + 480
    assert got["later_cached"] == 960 and got["later_lost"] == 672 + 32
    assert got["later_short_moved"] == 1 and got["later_short_stayed"] == 1
    assert got["one_off_prompt"] == 1500
    doc = {"config": {"requests": 40}, "runs": [{"policy": "kv", "seed": 4, "records": records}]}
    row = losses_table(doc, ["kv"]).splitlines()[2]
    # 960 / 1664 of the bound; one-offs 1500 of 1020 + 2200 + 1500 prompt tokens
    assert row == "| kv | 1 | 0.0 % | 1.0 / 1.0 | 57.7 % | 1.0 / 1.0 | 704 | 31.8 % |"


def test_the_ceiling_counts_two_misses_per_family_and_each_later_turn_s_bound() -> None:
    from bench.real_vllm.load_losses import ceiling_table, run_ceiling

    cfg = PlanConfig(requests=60)
    plan = make_plan(35, cfg)
    convs = [s for s in plan.sessions if s.kind == "conversation"]
    a, b, c = [s for s in convs if s.system == 1][:3]
    firsts = {s.user_messages[0].split()[0] for s in (a, b, c)}
    assert len(firsts) == 3, "the hand count below assumes no user words in common"
    other = next(s for s in plan.sessions if s.kind == "one_off")
    system = len(plan.system_prompts[1].split())
    # <system> + 414 words + <user> = 416 tokens, a whole number of 32-token blocks: one
    # template token fewer would change the ceiling by a block; family 0's 861 words make 863
    # tokens, one short of a block: one more would
    assert system == 414
    d, e, f = [s for s in convs if s.system == 0][:3]
    assert len(plan.system_prompts[0].split()) == 861
    assert len({s.user_messages[0].split()[0] for s in (d, e, f)}) == 3

    def rec(s, turn, t, prompt, cached, error=None):
        return {"sid": s.sid, "turn": turn, "kind": s.kind, "send_s": t, "replica": "A",
                "prompt_tokens": prompt, "cached_tokens": cached, "error": error}  # fmt: skip

    records = [
        rec(b, 0, 0.0, 900, 0),  # the family's first request: 0
        rec(a, 0, 0.1, 950, 0),  # its second, which pins the junction: 0
        rec(c, 0, 0.2, 990, 0),  # from the third on: <system> S <user> aligned
        rec(b, 1, 0.5, 1000, 0),  # bound (900 - 1) // 32 * 32 = 896
        rec(other, 0, 0.6, 1500, 0),  # never
        rec(a, 1, 0.7, 1200, 0, error="timeout"),  # not answered: out of both sums
        rec(a, 2, 0.9, 1300, 0),  # previous turn not answered: 0
        rec(d, 0, 1.0, 900, 0),
        rec(e, 0, 1.1, 950, 0),
        rec(f, 0, 1.2, 990, 0),  # 863 // 32 * 32 = 832
    ]
    ceiling, prompt = run_ceiling({"seed": 35, "records": records}, cfg)
    assert prompt == 900 + 950 + 990 + 1000 + 1500 + 1300 + 900 + 950 + 990
    assert ceiling == 416 + 896 + 832
    # a run that reached it: every cached token the ceiling allows
    reached = [dict(r) for r in records]
    reached[2]["cached_tokens"] = 416
    reached[3]["cached_tokens"] = 896
    reached[-1]["cached_tokens"] = 832
    doc = {
        "config": {"requests": 60},
        "runs": [
            {"policy": "kv", "seed": 35, "records": reached},
            {"policy": "cache_aware", "seed": 35, "records": records},
        ],
    }
    lines = ceiling_table(doc, ["kv", "cache_aware"]).splitlines()
    pct = f"{100 * ceiling / prompt:.2f}"
    assert lines[2] == f"| kv | {pct} | {pct} | 100.0 % |"
    assert lines[3] == f"| cache_aware | 0.00 | {pct} | 0.0 % |"

    # The family's first prompt ends in the block where the system prompt does: its end
    # checkpoint (439 // 32 * 32 = 416) lies within the 416 tokens the second shares with it,
    # so the second hits 416 without a pinned junction (seen on real vLLM: round 15, seed 45).
    # One token longer (441 -> 440 // 32 * 32 = 416) still serves; 449 ends past the shared
    # prefix (448 > 416): 0.
    for first, second in ((440, 416), (441, 416), (449, 0)):
        short = [rec(b, 0, 0.0, first, 0), rec(a, 0, 0.1, 950, 0)]
        assert run_ceiling({"seed": 35, "records": short}, cfg)[0] == second, first
    # the second's own lookup stops at its prompt - 1: a 400-token prompt cannot reach 416
    short = [rec(b, 0, 0.0, 440, 0), rec(a, 0, 0.1, 400, 0)]
    assert run_ceiling({"seed": 35, "records": short}, cfg)[0] == 0


def test_request_deltas_compare_two_runs_request_by_request_and_kind_by_kind() -> None:
    from bench.real_vllm.load_losses import request_deltas, request_kinds
    from bench.real_vllm.load_report import deltas_table

    cfg = PlanConfig(requests=60)
    plan = make_plan(35, cfg)
    convs = [s for s in plan.sessions if s.kind == "conversation"]
    fam = [s for s in convs if s.system == 1]
    assert len(fam) >= 3, "the hand count below needs three conversations of one family"
    a, b, c = fam[:3]
    other = next(s for s in plan.sessions if s.kind == "one_off")

    def rec(s, turn, t, cached, error=None):
        return {"sid": s.sid, "turn": turn, "kind": s.kind, "send_s": t, "replica": None,
                "prompt_tokens": 2000, "cached_tokens": cached, "error": error}  # fmt: skip

    mine = [
        rec(c, 0, 0.0, 0),  # sent first: the family's first, whatever its sid
        rec(a, 0, 0.1, 416),  # its second
        rec(b, 0, 0.2, 416),  # its third
        rec(c, 1, 0.5, 900),
        rec(a, 1, 0.6, 0),
        rec(other, 0, 0.7, 0),
        rec(b, 1, 0.8, 100, error="timeout"),  # not answered here: not compared
    ]
    theirs = [dict(r) for r in mine]
    theirs[1]["cached_tokens"] = 0  # mine had 416 more on the second conversation
    theirs[2]["cached_tokens"] = 448  # 32 fewer on the third
    theirs[4]["cached_tokens"] = 600  # 600 fewer on a later turn, equal on the other
    theirs[6] = {**theirs[6], "error": None}
    kinds = request_kinds({"seed": 35, "records": mine}, cfg)
    assert kinds[(c.sid, 0)] == "family's first" and kinds[(a.sid, 0)] == "family's second"
    assert kinds[(b.sid, 0)] == "family's third on" and kinds[(other.sid, 0)] == "one-off"
    assert (b.sid, 1) not in kinds
    got = request_deltas({"seed": 35, "records": mine}, {"seed": 35, "records": theirs}, cfg)
    assert got["family's first"] == {"more": 0, "fewer": 0, "net": 0}
    assert got["family's second"] == {"more": 1, "fewer": 0, "net": 416}
    assert got["family's third on"] == {"more": 0, "fewer": 1, "net": -32}
    assert got["later turn"] == {"more": 0, "fewer": 1, "net": -600}
    assert got["one-off"] == {"more": 0, "fewer": 0, "net": 0}
    doc = {
        "config": {"requests": 60},
        "runs": [
            {"policy": "kv", "seed": 35, "repeat": 1, "records": mine},
            {"policy": "cache_aware", "seed": 35, "repeat": 1, "records": theirs},
            {"policy": "cache_aware", "seed": 35, "repeat": 2, "records": theirs},  # no pair
        ],
    }
    row = deltas_table(doc, "kv").splitlines()[2]
    assert row == (
        "| cache_aware | 1 | 0.0 / 0.0, +0 | 1.0 / 0.0, +416 | 0.0 / 1.0, -32 "
        "| 0.0 / 1.0, -600 | 0.0 / 0.0, +0 | -216 |"
    )
