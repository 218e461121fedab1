"""Model layouts shipped as TOML (``gpu_emitter/layout_files/*.toml``), loaded by name or path.

Torch-free on purpose: the router CLI imports it. A layout file is a
:class:`events.layout.ModelLayout` in TOML (``[[groups]]`` tables, an optional ``[hash]``
table, ``retention_interval``, ``prefix_match_unit``). TOML has no null, so
``retention_interval = "none"`` stands for vLLM's ``None`` (dense retention).

Shipped: ``fa`` (Llama-like FA, B=16), ``fa_swa`` (gpt-oss-like FA + SWA 128, B=16),
``gemma3`` (five SWA-1024 groups + one FA, B=16), ``fa_mamba`` (FA + Mamba align, B=64).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

from events.layout import LayoutError, ModelLayout, resolve

__all__ = ["LAYOUT_DIR", "LayoutFileError", "load_layout", "parse_layout", "shipped_layouts"]

#: Where the shipped layout files live: package data of :mod:`gpu_emitter` (declared in
#: pyproject.toml's ``[tool.setuptools.package-data]``), so a wheel or ``pip install .``
#: carries them, not only a source checkout.
LAYOUT_DIR = Path(__file__).resolve().parent / "layout_files"


class LayoutFileError(LayoutError):
    """A layout name or file that cannot be used; the message says which and how to fix it."""


def shipped_layouts() -> list[str]:
    """Names of the layouts in :data:`LAYOUT_DIR`, sorted."""
    return sorted(p.stem for p in LAYOUT_DIR.glob("*.toml"))


def parse_layout(text: str, *, source: str = "<layout>") -> ModelLayout:
    """A validated layout from TOML text; errors name ``source`` and the bad field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LayoutFileError(f"{source}: not valid TOML: {exc}") from None
    if data.get("retention_interval") == "none":
        data["retention_interval"] = None
    try:
        layout = msgspec.convert(data, ModelLayout)
    except msgspec.ValidationError as exc:
        raise LayoutFileError(f"{source}: {exc}") from None
    try:
        resolve(layout)
    except LayoutError as exc:
        raise LayoutFileError(f"{source}: {exc}") from None
    return layout


def load_layout(name_or_path: str | Path) -> ModelLayout:
    """Load a shipped layout by name (``"fa_swa"``) or any layout file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = LAYOUT_DIR / f"{name_or_path}.toml"
        if isinstance(name_or_path, str) and "/" not in name_or_path and shipped.is_file():
            path = shipped
        else:
            raise LayoutFileError(
                f"no layout {str(name_or_path)!r}: give a shipped name "
                f"({', '.join(shipped_layouts()) or 'none found in ' + str(LAYOUT_DIR)}) "
                "or the path of a layout TOML file"
            )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LayoutFileError(f"cannot read layout file {str(path)!r}: {exc}") from None
    return parse_layout(text, source=str(path))
