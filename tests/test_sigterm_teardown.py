"""A test run stopped by SIGTERM tears its fixtures down (tests/sigterm_teardown.py).

A real pytest run in a subprocess has a fixture that starts a process in a session of its own,
as bench/real_vllm/replicas.py starts vLLM, and kills it in its teardown. The run is sent
SIGTERM while its test waits; the process must be gone after the run exits. Without the
handler (the control run) it survives, which is what the handler is for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.child_procs import alive

ROOT = Path(__file__).resolve().parent.parent

INNER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from pathlib import Path

    import pytest

    OUT = Path(os.environ["SIGTERM_TEST_DIR"])


    @pytest.fixture()
    def server():
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
        )
        (OUT / "child.pid").write_text(str(proc.pid))
        try:
            yield proc
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            (OUT / "torn_down").write_text("yes")


    def test_waits(server):
        (OUT / "ready").write_text("yes")
        deadline = time.monotonic() + 60  # the outer test sends SIGTERM long before
        while time.monotonic() < deadline:
            time.sleep(0.05)
    """
)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _run_and_term(tmp_path: Path, plugin: bool) -> tuple[int, bool, bool]:
    """Exit code of the inner run, whether its child is still alive, whether teardown ran."""
    (tmp_path / "test_inner.py").write_text(INNER)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")]  # fmt: skip
    if plugin:
        args[3:3] = ["-p", "tests.sigterm_teardown"]
    env = {**os.environ, "SIGTERM_TEST_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)  # fmt: skip
    child = 0
    try:
        _wait(lambda: (tmp_path / "ready").exists() or run.poll() is not None, 60, "inner test")
        assert run.poll() is None, run.stdout.read().decode() if run.stdout else ""
        child = int((tmp_path / "child.pid").read_text())
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=30)
        return code, alive(child), (tmp_path / "torn_down").exists()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)
        if child and alive(child):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)


def test_sigterm_runs_fixture_teardown(tmp_path: Path) -> None:
    code, child_alive, torn_down = _run_and_term(tmp_path, plugin=True)
    assert torn_down and not child_alive
    assert code == pytest.ExitCode.INTERRUPTED


def test_without_the_handler_the_child_survives(tmp_path: Path) -> None:
    code, child_alive, torn_down = _run_and_term(tmp_path, plugin=False)
    assert code == -signal.SIGTERM and child_alive and not torn_down
