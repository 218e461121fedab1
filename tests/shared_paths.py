"""Where the team's shared material (spec, fixtures, traces) lives: beside the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVROUTER_SHARED", ROOT.parent / "shared"))
GOLDEN = SHARED / "fixtures" / "vllm-0.32-hybrid-swa64"


def require(path: Path) -> Path:
    """Skip locally when shared/ is absent, but fail in CI, where it must be there."""
    if not path.exists():
        msg = f"{path} not found: set KVROUTER_SHARED to the shared/ folder"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path
