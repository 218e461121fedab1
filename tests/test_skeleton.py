"""The packages import without torch and the console script assembles its commands."""

import subprocess
import sys

import pytest

from router.cli import build_parser


@pytest.mark.parametrize("module", ["events", "router", "router.cli", "events.layout"])
def test_imports_without_torch(module: str) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any 'import torch' now raises
        f"import {module}\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_cli_lists_commands() -> None:
    text = build_parser().format_help()
    assert "events" in text and "replay" in text
