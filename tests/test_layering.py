"""The package layering of ARCHITECTURE.md, checked on the source itself.

``events`` at the bottom; ``router`` and ``gpu_emitter`` each build on it and never on each
other; no import cycle anywhere. Every import statement counts: module level, inside functions
and behind ``if TYPE_CHECKING`` alike, because a cycle hidden there is still a cycle to a reader
(and becomes a real one the day someone moves the import up).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("events", "router", "gpu_emitter")

#: package -> top-level packages of ours (and torch) it must never import.
FORBIDDEN = {
    "events": {"router", "gpu_emitter", "torch"},
    "router": {"gpu_emitter", "torch"},
    "gpu_emitter": {"router"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Absolute names one import statement brings in (a ``from pkg import mod`` names both)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = name.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        mod = ".".join([*base, node.module] if node.module else base)
    else:
        mod = node.module or ""
    return [mod, *(f"{mod}.{a.name}" for a in node.names)]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours (or ``torch``) it imports, anywhere in its source."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(name, path, node):
                top = target.split(".")[0]
                if top == "torch":
                    graph[name].add("torch")
                elif top in PACKAGES:
                    while target not in mods and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target in mods and target != name:
                        graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_graph_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """The checker itself: imports hidden in functions and TYPE_CHECKING blocks are edges."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from router.core import index\n"
        "def f():\n    from . import policy\n    import torch\n"
    )
    tree = ast.parse(src)
    names = [
        t
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for t in _imported("router.core.predict", ROOT / "router/core/predict.py", n)
    ]
    assert "router.core.index" in names and "router.core.policy" in names and "torch" in names
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    cycles = _cycles(import_graph())
    assert not cycles, f"import cycles (counting function-level and TYPE_CHECKING): {cycles}"


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_what_the_layering_allows(package: str) -> None:
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in import_graph().items()
        if mod.split(".")[0] == package
        for dep in deps
        if dep.split(".")[0] in FORBIDDEN[package]
    )
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}: {bad}"


def test_events_and_router_import_without_torch() -> None:
    """Every module of events/ and router/ imports with torch made unimportable."""
    mods = [m for m in _modules() if m.split(".")[0] in ("events", "router")]
    code = (
        "import importlib, sys\n"
        "sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        f"for m in {mods!r}:\n    importlib.import_module(m)\n"
        "print('ok', len(sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_engine_modules_follow_vllms_v1_core_split() -> None:
    """Request at the bottom, then the block pool, the per-type managers, the coordinator and
    the KV-cache manager (``HybridBlockPool``), each importing only downwards."""
    graph = import_graph()

    def ours(mod: str) -> set[str]:
        return {d for d in graph[mod] if d.startswith("gpu_emitter.")}

    assert ours("gpu_emitter.request") == set()
    assert ours("gpu_emitter.block_pool") == {"gpu_emitter.request"}
    assert ours("gpu_emitter.managers") == {"gpu_emitter.block_pool", "gpu_emitter.request"}
    assert "gpu_emitter.managers" in ours("gpu_emitter.coordinator")
    assert "gpu_emitter.hybrid_pool" not in ours("gpu_emitter.coordinator")
    assert "gpu_emitter.coordinator" in ours("gpu_emitter.hybrid_pool")
