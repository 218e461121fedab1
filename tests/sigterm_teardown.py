"""SIGTERM unwinds a test run like Ctrl-C, so its fixtures' teardown runs.

Python's default SIGTERM ends the process on the spot: a ``timeout`` or ``kill`` of a test run
skipped every ``finally`` and left what the fixtures had started running in sessions of their
own (seen: two vLLM replicas and a ``kvrouter serve`` from tests/test_real_vllm.py, holding
their ports, after a CI run was killed). As KeyboardInterrupt, pytest stops the run and still
tears down every fixture set up (its ``pytest_sessionfinish``). tests/conftest.py installs
it for the suite; tests/test_sigterm_teardown.py loads it with ``-p tests.sigterm_teardown``.
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["install"]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def install() -> None:
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_configure(config: object) -> None:
    install()
