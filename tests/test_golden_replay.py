"""The golden recording of real vLLM 0.32 (hybrid SWA-64 + FA): every hit predicted exactly."""

from __future__ import annotations

import json
import subprocess
import sys

from shared_paths import GOLDEN, require

from router.tools.replay import replay


def test_every_request_of_the_golden_recording_is_predicted_exactly() -> None:
    summary = replay(require(GOLDEN))
    misses = [r for r in summary.rows if not r.exact]
    assert summary.requests == 250
    assert not misses, [(r.i, r.kind, r.actual, r.predicted) for r in misses[:10]]
    # The group-blind figure, for the record: it must be clearly worse on this model.
    print(
        f"\ngolden replay: hybrid exact {summary.exact}/{summary.requests}, group-blind exact "
        f"{summary.blind_exact}/{summary.requests} (max error {summary.blind_max_abs_error})"
    )
    assert summary.blind_exact < summary.requests
    assert summary.blind_over_predicted > 0


def test_replay_cli_prints_the_summary_as_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "replay", str(require(GOLDEN)), "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["requests"] == 250 and out["exact"] == 250
    assert out["mean_abs_error"] == 0 and out["max_abs_error"] == 0
    assert 0 < out["blind_exact"] < 250


def test_replay_cli_rejects_a_directory_that_is_not_a_recording(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "replay", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "meta.json" in proc.stderr
