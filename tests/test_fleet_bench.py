"""bench/fleet_bench.py --quick end to end, in a subprocess as it is run: the table has one
row per (replicas, tokens, prompt kind) and one per fleet size, and the values are the ones
its workload implies (hits of the three prompt kinds, pairs held, memory and ratio that agree).
No timing assertions: speed targets live in bench/, and these cores are shared."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KINDS = ("stored", "half-shared", "novel")


def _num(cell: str) -> float:
    return float(cell.replace(",", ""))


def _rows(text: str, header_start: str) -> list[list[str]]:
    """The body rows of the markdown table whose header starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_quick_run_prints_every_row_with_plausible_values(tmp_path: Path) -> None:
    out = tmp_path / "fleet_bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/fleet_bench.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\] 64 replicas, 2048 tokens, novel: p50", proc.stderr)  # progress lines

    decisions = _rows(proc.stdout, "| replicas | tokens | prompt |")
    assert [(r[0], r[1], r[2]) for r in decisions] == [
        (str(n), "2048", kind) for n in (8, 64) for kind in KINDS
    ]
    for _reps, _tokens, kind, n, p50, p99, hit, scored in decisions:
        assert 20 <= int(n) <= 40
        assert 0 < _num(p50) <= _num(p99)
        # the shortlist (docs/decision-cost.md): the two holders and the home at most, the
        # chosen replica alone for a novel prompt, whatever the fleet's size
        assert 1 <= int(scored) <= (1 if kind == "novel" else 3)
        # stored: all but the last block's token (vLLM never hits a whole prompt);
        # half-shared: the cached first half; novel: nothing
        assert int(hit) == {"stored": 2032, "half-shared": 1024, "novel": 0}[kind]

    index = _rows(proc.stdout, "| replicas | pairs |")
    assert [r[0] for r in index] == ["8", "64"]
    for reps, pairs, keys, measured, estimate, ratio, per_key, rm_decode, rm_apply, build in index:
        # 4 system prompts of 64 blocks, 9 conversations of 192 own + 8 sliding-window blocks
        assert _num(pairs) == int(reps) * (4 * 64 + 9 * (192 + 8))
        assert 0 < _num(keys) <= _num(pairs)
        # bytes per (replica, block): a 16-byte slot at least (router.core._keytable), an int
        # key and a dict slot on the dict path
        assert 16 < _num(measured) < 400
        assert 16 < _num(estimate) < 400
        assert abs(_num(ratio) - 1) < 0.10  # the index's account tracks what it holds (issue 16)
        assert abs(_num(ratio) - _num(measured) / _num(estimate)) < 0.01
        assert _num(per_key) >= _num(measured)
        assert _num(rm_decode) > 1000 and _num(rm_apply) > 1000
        assert _num(build) >= 0

    doc = json.loads(out.read_text())
    assert len(doc["cells"]) == 6 and len(doc["index"]) == 2
    assert out.with_suffix(".md").read_text() in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
