"""``kvrouter demo`` end to end (tiny): real replica and router subprocesses over loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_procs import alive, kill_groups, recorded_pids
from tests.zmq_helpers import wait_for

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
KVROUTER = [sys.executable, "-m", "router.cli"]


def test_tiny_demo_compares_policies_and_leaves_no_process(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    try:
        proc = subprocess.run(
            [
                *KVROUTER,
                "demo",
                "--replicas",
                "2",
                "--requests",
                "20",
                "--duration",
                "2",
                "--policies",
                "kv,round_robin",
                "--trace",
                "synthetic",
                "--max-in-flight",
                "1",
                "--replica-time-scale",
                "0.1",
                "--out",
                str(out),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        # The demo was killed: do not leave its children running for the next tests.
        kill_groups(out)
        raise
    assert proc.returncode == 0, proc.stderr
    assert "done   20/20" in proc.stdout  # live progress lines
    assert str(out) in proc.stdout  # the output folder is named at the end
    doc = json.loads((out / "demo.json").read_text())
    rows = {r["label"]: r for r in doc["policies"]}
    assert set(rows) == {"hybrid", "round_robin"}
    for r in rows.values():
        assert r["requests"] == 20 and r["errors"] == 0
        assert r["prompt_tokens"] > 0 and r["ttft_p50_s"] > 0
        assert sum(r["requests_per_replica"].values()) == 20
    # The threshold is all of them. One request at a time (--max-in-flight 1; the replicas'
    # compute at 0.1x to keep that short): a replica publishes a request's stores and
    # evictions when it schedules it, before the first token, and the router applies them in
    # the loop that routes; the next request is sent only after this one's whole stream has
    # come back through the router. So the router's view (events -> index -> prediction) has
    # every earlier event, and its predicted hit must equal the replica's cached_tokens for
    # every request, under both policies (round robin sends half of them away from their
    # prefix). With requests overlapping, a prediction may trail a store still in flight
    # (this run at arrival times gave 19/20), which is why the replay is sequential here.
    for label, r in rows.items():
        assert r["prediction_exact_ratio"] == 1.0, f"{label}: {r}"
        assert r["admission_exact_ratio"] == 1.0, f"{label}: {r}"
        assert r["mispredicted"] == [], f"{label}: {r['mispredicted']}"
    assert (out / "demo_policies.png").stat().st_size > 1000
    assert (out / "run-hybrid" / "router.toml").read_text().count("[[pools.replicas]]") == 2
    pids = recorded_pids(out)
    assert len(pids) == 2 * 3  # two replicas and a router per policy
    assert not [p for p in pids if alive(p)]


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [
            *KVROUTER,
            "demo",
            "--replicas",
            "2",
            "--requests",
            "400",
            "--duration",
            "60",
            "--trace",
            "synthetic",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Interrupt once the replicas and the router are running (the router is third).
        wait_for(lambda: len(recorded_pids(out)) >= 3, 60, "the replicas and the router")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        code = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            kill_groups(out)  # never leave a demo's children behind for the next tests
    assert code == 130, (stdout[-2000:], stderr[-2000:])
    assert not [p for p in recorded_pids(out) if alive(p)]


RUN_ASYNC_CHILD = """
import asyncio, sys, tempfile
from pathlib import Path
from gpu_emitter.demo import Procs

procs = Procs(Path(tempfile.mkdtemp()))
procs.stop_on_signals()

async def worker():
    try:
        await asyncio.sleep(60)
    finally:
        print("worker unwound", flush=True)

async def main():
    task = asyncio.create_task(worker())
    print("ready", flush=True)
    await task

try:
    procs.run_async(main())
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_an_interrupt_inside_run_async_unwinds_every_task() -> None:
    """Ctrl-C during the load cancels the loop's main task instead of raising at an arbitrary
    instruction: every task's ``finally`` runs, and the caller still sees KeyboardInterrupt."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_ASYNC_CHILD],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert out.split() == ["worker", "unwound", "interrupted"], (out, err)


def test_the_summary_keeps_the_requests_a_prediction_missed() -> None:
    from gpu_emitter.demo import Outcome, summarize

    outs = [
        Outcome(0, "a", 64, 32, predicted=32, expected=32),  # both exact
        Outcome(1, "a", 64, 32, predicted=0, expected=32),  # a request ahead stored it first
        Outcome(2, "b", 64, 0, predicted=32, expected=32, in_flight=9),  # evicted meanwhile
        Outcome(3, "b", 64, 32, predicted=32, expected=None),  # no admission-time view
        Outcome(4, "b", 64, 0, error="HTTP 500"),  # failed: not a prediction
    ]
    row = summarize("kv", outs, 1.0)
    assert [m["index"] for m in row["mispredicted"]] == [1, 2]
    assert row["mispredicted"][1] == {
        "index": 2, "replica": "b", "prompt_tokens": 64, "cached_tokens": 0,
        "predicted": 32, "expected": 32, "in_flight": 9,
    }  # fmt: skip
    assert row["prediction_exact_ratio"] == 2 / 4 and row["admission_exact_ratio"] == 2 / 3
