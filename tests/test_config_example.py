"""``kvrouter config example`` (router/router.example.toml): every knob of every config Struct is
in it, every value it sets is the default, it parses and passes ``kvrouter serve --check``, and
the command prints it through the ``kvrouter`` entry points; the shipped configs point at it.

The coverage walk starts at :class:`router.config.RouterConfig` and follows every field whose
type is a Struct (a table, ``[pools.policy]``) or a list of Structs (``[[pools.replicas]]``), so
a Struct or field added later (Kubernetes discovery's ``[pools.kubernetes]``) is required here
the day it exists, and fields that do not exist on this branch are not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.config import ConfigError, ReplicaConfig, RouterConfig, parse_config
from router.example_config import example_text

ROOT = Path(__file__).resolve().parents[1]
KVROUTER = [sys.executable, "-m", "router.cli"]

_HEADER = re.compile(r"^\s*#?\s*\[\[?\s*([\w.]+)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*#?\s*(\w+)\s*=")


def documented_keys(text: str) -> dict[str, set[str]]:
    """Table path (``pools.replicas.streams``; ``""`` at the top) -> the keys written in it,
    set or commented out (``# key = value``)."""
    out: dict[str, set[str]] = {"": set()}
    table = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            table = header.group(1)
            out.setdefault(table, set())
            continue
        key = _KEY.match(line)
        if key:
            out[table].add(key.group(1))
    return out


def _struct_of(t: Any) -> tuple[msgspec.inspect.StructType | None, bool]:
    """The Struct a field's type holds (directly, in a list, or in an optional), and whether
    it is a list of them."""
    if isinstance(t, msgspec.inspect.StructType):
        return t, False
    if isinstance(t, msgspec.inspect.UnionType):
        for member in t.types:
            found, many = _struct_of(member)
            if found is not None:
                return found, many
    if isinstance(t, msgspec.inspect.TupleType | msgspec.inspect.VarTupleType):
        inner = t.item_type if isinstance(t, msgspec.inspect.VarTupleType) else None
        if inner is not None and isinstance(inner, msgspec.inspect.StructType):
            return inner, True
    if isinstance(t, msgspec.inspect.ListType) and isinstance(
        t.item_type, msgspec.inspect.StructType
    ):
        return t.item_type, True
    return None, False


def knobs() -> list[tuple[str, str, msgspec.inspect.Field]]:
    """Every scalar field reachable from RouterConfig: (table path, field name, field)."""
    out = []

    def walk(struct: msgspec.inspect.StructType, table: str) -> None:
        for f in struct.fields:
            sub, _ = _struct_of(f.type)
            if sub is not None:
                walk(sub, f"{table}.{f.encode_name}" if table else f.encode_name)
            else:
                out.append((table, f.encode_name, f))

    walk(msgspec.inspect.type_info(RouterConfig), "")
    return out


def test_every_field_of_every_struct_is_in_the_example() -> None:
    keys = documented_keys(example_text())
    found = knobs()
    tables = {table for table, _, _ in found}
    # the walk reached every Struct of the schema (a regression in it would pass vacuously)
    assert {"server", "index", "health", "pools", "pools.replicas", "pools.replicas.streams",
            "pools.tokenizer", "pools.policy", "pools.layout", "pools.layout.hash",
            "pools.layout.groups"} <= tables  # fmt: skip
    assert len(found) >= 89
    missing = [f"[{t}] {name}" for t, name, _ in found if name not in keys.get(t, set())]
    assert not missing, f"router.example.toml lacks: {missing}"


def plain(obj: Any) -> Any:
    """As TOML reads it back: lists, not tuples."""
    return msgspec.json.decode(msgspec.json.encode(obj))


def test_every_value_the_example_sets_is_the_default() -> None:
    """Set lines of the tables whose every field has a default show that default (a changed
    default must change the example too)."""
    data = tomllib.loads(example_text())
    pool = data["pools"][0]
    defaults = plain(msgspec.convert({"pools": [{"model": "m", "replicas": []}]}, RouterConfig))
    pool_defaults = defaults["pools"][0]
    cases = [
        (data["server"], defaults["server"], "server"),
        (data["index"], defaults["index"], "index"),
        (data["health"], defaults["health"], "health"),
        (pool["tokenizer"], pool_defaults["tokenizer"], "pools.tokenizer"),
        (pool["policy"], pool_defaults["policy"], "pools.policy"),
        (pool["layout"]["hash"], pool_defaults["layout"]["hash"], "pools.layout.hash"),
        ({k: v for k, v in pool["layout"].items() if k != "hash"},
         {k: v for k, v in pool_defaults["layout"].items() if k != "hash"}, "pools.layout"),
        ({"aliases": pool["aliases"]}, {"aliases": pool_defaults["aliases"]}, "pools"),
    ]  # fmt: skip
    checked = 0
    for shown, default, where in cases:
        for key, value in shown.items():
            assert key in default, f"[{where}] {key}: not a field"
            assert value == default[key], f"[{where}] {key} = {value!r}, default {default[key]!r}"
            checked += 1
    assert checked >= 60
    # the first replica's optional settings are the ReplicaConfig defaults too
    rep = {k: v for k, v in pool["replicas"][0].items() if k not in
           ("name", "url", "event_endpoint", "replay_endpoint")}  # fmt: skip
    rep_default = plain(ReplicaConfig(name="x", url="http://x:1"))
    assert rep.keys() == {"dp_ranks", "bind", "topic", "metrics_path"}
    for key, value in rep.items():
        assert value == rep_default[key], key


def test_example_parses_and_passes_serve_check(tmp_path: Path) -> None:
    config = parse_config(example_text(), source="router.example.toml")
    assert [r.name for r in config.pools[0].replicas] == ["vllm-a", "vllm-b"]
    assert [s.dp_rank for s in config.pools[0].replicas[1].stream_list()] == [0, 1]
    path = tmp_path / "router.toml"
    path.write_text(example_text())
    p = subprocess.run(
        [*KVROUTER, "serve", "--config", str(path), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "1 pool(s), 2 replica(s)" in p.stdout


def test_the_commented_kubernetes_block_follows_the_contract() -> None:
    """Uncommented, the discovery block is the contract's (ISSUE15_CONTRACT.md): checked against
    the schema where this branch has it, else only for its keys."""
    text = example_text()
    block = text[text.index("# [pools.kubernetes]") :].split("\n\n", 1)[0]
    keys = documented_keys(block)["pools.kubernetes"]
    assert keys == {"namespace", "label_selector", "http_port", "events_port", "replay_port",
                    "drain_timeout_s", "api_server"}  # fmt: skip
    assert '# discovery = "static"' in text
    from router.config import PoolConfig

    if "discovery" in PoolConfig.__struct_fields__:  # the k8s branch merged: it must parse too
        start = text.index("# discovery = ")
        end = text.index("\n\n", text.index("# [pools.kubernetes]"))
        block = re.sub(r"^# (discovery|\[pools\.kubernetes\]|\w+ =)", r"\1", text[start:end],
                       flags=re.M)  # fmt: skip
        uncommented = text[:start] + block.replace('"static"', '"kubernetes"', 1) + text[end:]
        pool = parse_config(uncommented).pools[0]
        assert pool.discovery == "kubernetes" and pool.kubernetes is not None
        assert pool.kubernetes.label_selector == "app.kubernetes.io/name=vllm"


def test_config_example_command_prints_the_file(tmp_path: Path) -> None:
    """Through ``kvrouter``'s entry points, as installed from this tree's pyproject.toml (the
    shared venv may hold an older install's table; a dist-info written from this tree's table
    is put on the path, the way ``pip install`` would)."""
    env = source_tree_entry_points(tmp_path)
    p = subprocess.run([*KVROUTER, "config", "example"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == example_text()
    listed = subprocess.run([*KVROUTER, "--help"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert "config" in listed.stdout
    out = tmp_path / "router.toml"
    w = subprocess.run([*KVROUTER, "config", "example", "-o", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert w.returncode == 0 and out.read_text() == example_text()
    again = subprocess.run([*KVROUTER, "config", "example", "-o", str(out)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 2 and "exists" in again.stderr


def source_tree_entry_points(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``kvrouter.commands`` entry points are this tree's pyproject
    table: a ``*.dist-info`` with that table, first on PYTHONPATH after the tree itself."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    commands = table["kvrouter.commands"]
    dist = tmp_path / "site" / "kvrouter_source_tree-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvrouter-source-tree\nVersion: 0\n"
    )
    lines = ["[kvrouter.commands]", *(f"{k} = {v}" for k, v in commands.items())]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{dist.parent}"}


@pytest.mark.parametrize("shipped", ["config/router-sim.toml", "config/router-vllm.toml"])
def test_shipped_configs_point_at_the_example(shipped: str) -> None:
    text = (ROOT / shipped).read_text()
    assert "kvrouter config example" in text
    parse_config(text, source=shipped)


def test_a_knob_missing_from_the_example_is_found() -> None:
    """The coverage check itself: a key dropped from the text is reported."""
    text = example_text().replace("kv_usage_threshold = 0.95", "")
    keys = documented_keys(text)
    assert "kv_usage_threshold" not in keys["pools.policy"]
    with pytest.raises(ConfigError):
        parse_config(example_text().replace("tie_tokens = 0.5", "tie_tokens = 'x'"))
