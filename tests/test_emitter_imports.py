"""The simulated replica stays independent of the router, and its modules form no cycle.

Tests that compare the router's predicted hit with a replica's ``cached_tokens`` only prove
something if the replica computes its hit without the router's code (issue 11). Every
import counts here: module level, function level and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    """Every module a file names in an import statement, wherever the statement is."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("gpu_emitter", "events"):
                out.update(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                out.add(node.module)
    return out


def package_graph(package: str) -> dict[str, set[str]]:
    """``module -> modules of the same package it imports``."""
    files = sorted((ROOT / package).glob("*.py"))
    names = {f"{package}.{f.stem}" for f in files}
    return {f"{package}.{f.stem}": imports_of(f) & names for f in files}


def test_gpu_emitter_and_events_import_nothing_from_the_router() -> None:
    for package in ("gpu_emitter", "events"):
        for f in sorted((ROOT / package).glob("*.py")):
            bad = sorted(m for m in imports_of(f) if m == "router" or m.startswith("router."))
            assert not bad, f"{package}/{f.name} imports {bad}"


def test_gpu_emitter_modules_form_no_cycle() -> None:
    graph = package_graph("gpu_emitter")
    done: set[str] = set()
    path: list[str] = []

    def visit(mod: str) -> None:
        if mod in done:
            return
        assert mod not in path, "import cycle: " + " -> ".join([*path[path.index(mod) :], mod])
        path.append(mod)
        for dep in sorted(graph[mod]):
            visit(dep)
        path.pop()
        done.add(mod)

    for mod in sorted(graph):
        visit(mod)
    # The layering the engine's modules document (vLLM's v1/core split).
    assert graph["gpu_emitter.request"] == set()
    assert graph["gpu_emitter.block_pool"] == {"gpu_emitter.request"}
    assert graph["gpu_emitter.managers"] == {"gpu_emitter.block_pool", "gpu_emitter.request"}
    assert "gpu_emitter.managers" in graph["gpu_emitter.coordinator"]
    assert "gpu_emitter.coordinator" in graph["gpu_emitter.hybrid_pool"]


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from router.core.hybrid import HitResult\n"
        "def f():\n    from gpu_emitter import managers\n    import router.core.index\n"
    )
    assert {"router.core.hybrid", "gpu_emitter.managers", "router.core.index"} <= imports_of(src)
