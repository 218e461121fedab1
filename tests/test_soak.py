"""The soak (bench/soak.py) in small: real replica and router processes over loopback, one
replica killed with SIGKILL and restarted on its ports mid-run; nothing may be lost.

Also the soak's own accounting, on hand-made answers: a truncated or malformed answer must
count as lost, or a clean run would prove nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.soak import Result, parse_json, parse_sse
from tests.child_procs import alive, kill_groups, recorded_pids
from tests.zmq_helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]


def test_short_soak_loses_nothing_through_a_kill_and_restart(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    logs, out, png = tmp_path / "logs", tmp_path / "soak.json", tmp_path / "soak.png"
    argv = [sys.executable, "bench/soak.py", "--requests", "600", "--concurrency", "8"]
    argv += ["--json", str(out), "--plot", str(png), "--logs", str(logs), "--deadline", "60"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        kill_groups(logs)  # never leave the soak's processes to the next tests
        raise
    wall = time.monotonic() - t0
    print(f"\n{proc.stdout[-1500:]}\nwall {wall:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    # every request has exactly one outcome, and none is lost
    assert doc["sent"] == 600 and sum(doc["outcomes"].values()) == 600
    assert doc["lost"] == 0, doc["lost_samples"]
    assert doc["json_requests"] > 100 and doc["sse_requests"] > 100
    assert doc["outcomes"]["ok"] >= 590  # only what was on the victim mid-stream may fail
    # the kill: out of rotation within the health window (2 x (0.5 + 0.5) s), no attempt on
    # it while it was out, back after the restart, and serving again
    k = doc["kill"]
    assert k["handled"] and k["error"] is None
    assert 0 <= k["out_of_rotation_after_s"] <= 2.0
    assert k["failed_attempts_on_victim_while_out_of_rotation"] == 0
    assert k["served_by_victim_while_down"] == 0
    assert k["served_by_victim_after_restart"] > 0
    # evictions happened (a small pool), the cache still mattered, predictions were checked
    assert doc["router"]["removed_blocks"] > 1000 and doc["cached_share"] > 0.3
    assert doc["router"]["prediction_checked"] > 500
    seen = doc["predictions_seen_by_client"]  # the x-kvrouter-predicted-hit header, per answer
    assert seen["checked"] > 300 and seen["exact"] + seen["under"] + seen["over"] == seen["checked"]
    # RSS sampled every second, from before warm-up end to the end
    rss = doc["rss_mb"]
    assert rss["warmup_end"] > 10 and rss["end"] > 10 and len(doc["samples"]) >= 3
    assert png.stat().st_size > 1000
    # every process it started is gone
    pids = recorded_pids(logs)
    assert len(pids) >= 3 + 1 + 1  # three replicas, the router, the restarted one (+ retries)
    assert not [p for p in pids if alive(p)]


def test_ctrl_c_after_the_restart_stops_every_process(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    logs = tmp_path / "logs"
    argv = [sys.executable, "bench/soak.py", "--requests", "100000", "--concurrency", "4"]
    argv += ["--json", str(tmp_path / "soak.json"), "--plot", "", "--logs", str(logs)]
    argv += ["--kill-at", "0.001", "--restart-after", "0.5"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    left: list[int] = []
    try:
        # Interrupt once the killed replica's successor was started (the fifth process).
        wait_for(lambda: len(recorded_pids(logs)) >= 5, 90, "the restarted replica")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        left = [p for p in recorded_pids(logs) if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_groups(logs)  # never leave the soak's processes to the next tests
    assert proc.returncode == 130, (stdout[-2000:], stderr[-2000:])
    assert "interrupted" in stdout, (stdout[-2000:], stderr[-2000:])
    assert not (tmp_path / "soak.json").exists()  # no results from a run cut short
    assert len(recorded_pids(logs)) >= 5 and not left


def _res(chat: bool = False, stream: bool = True) -> Result:
    return Result(0, chat, stream, 0.0)


def _chunk(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]})


def test_sse_accounting_ok_error_event_truncated_malformed() -> None:
    r = _res()
    assert parse_sse([_chunk("w1"), "", _chunk(" w2"), "", "data: [DONE]", ""], r) == "w1 w2"
    assert r.outcome == "ok"
    err = 'data: {"error": {"message": "replica failed mid-stream", "type": "x", "code": 502}}'
    r = _res()
    assert parse_sse([_chunk("w1"), err, "data: [DONE]"], r) is None
    assert r.outcome == "stream_error" and "mid-stream" in r.detail
    for lines in (
        [_chunk("w1")],  # no [DONE]: truncated
        [err],  # an error event, then the connection ended
        [_chunk("w1"), "data: {not json", "data: [DONE]"],
        [_chunk("w1"), "data: [DONE]", _chunk("w2")],  # data after [DONE]
        ["event: x", "data: [DONE]"],
    ):
        r = _res()
        assert parse_sse(lines, r) is None and r.outcome == "lost", lines


def test_json_accounting_reads_the_reply_and_usage_or_counts_lost() -> None:
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "w5 w6"}}],
        "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}},
    }
    r = _res(chat=True, stream=False)
    assert parse_json(json.dumps(body).encode(), r) == "w5 w6"
    assert (r.outcome, r.prompt_tokens, r.cached_tokens) == ("ok", 40, 32)
    for raw in (b'{"choices": []}', b'{"choices": [{"text": "w1"}]}', b"{trunc", b"[]"):
        r = _res(chat=True, stream=False)
        assert parse_json(raw, r) is None and r.outcome == "lost", raw
