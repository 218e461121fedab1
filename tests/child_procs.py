"""The processes a command started and recorded (``pids.txt``, one ``<pid> <name>`` a line,
as ``gpu_emitter.demo.Procs`` writes it): are they gone, and killing what is left so one
failed test does not leave servers running for the next."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

__all__ = ["alive", "kill_groups", "recorded_pids"]


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie counts as gone: only its parent can reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def recorded_pids(folder: Path) -> list[int]:
    """The pids listed in ``folder/pids.txt`` (none if it does not exist yet)."""
    path = folder / "pids.txt"
    if not path.exists():
        return []
    return [int(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]


def kill_groups(folder: Path) -> None:
    """SIGKILL the process group of every recorded pid still alive (each leads its own)."""
    for pid in recorded_pids(folder):
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
