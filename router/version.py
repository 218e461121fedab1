"""kvrouter's version, read once from the installed package's metadata.

One place for it, so ``kvrouter --version``, the OpenAPI schema (FastAPI's ``version``) and
anything else that reports a version never disagree with what ``pip`` installed. A source tree
run without installing (``PYTHONPATH=.``) has no metadata: the version is then
:data:`UNKNOWN`, which says so instead of repeating a number that may be stale.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

__all__ = ["DISTRIBUTION", "UNKNOWN", "kvrouter_version"]

DISTRIBUTION = "kvrouter"
#: Reported when the package is not installed (PEP 440 local version: sorts below any release).
UNKNOWN = "0+unknown"


@cache
def kvrouter_version() -> str:
    """The installed distribution's version (``pyproject.toml``'s), else :data:`UNKNOWN`."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN
