"""The router's config from ``kvrouter serve``'s quick-start flags, without a file.

``kvrouter serve --model M --replica URL[,events=…,replay=…,name=…,dp_ranks=0+1] --policy kv``
describes the common case, one pool: the flags become the same plain data a TOML file decodes
to (``{"pools": [{"model": …, "replicas": [...]}]}``) and go through the same validation
(:func:`router.config.convert_config`), so nothing a file refuses is accepted here. Only a
refusal's wording differs: the field path msgspec names (``$.pools[0].replicas[1].url``) is
turned back into the flag and the value the user typed (``--replica 'htp://x:8000'``).

Every knob beyond these flags (policy weights, health, index limits, several pools) needs a
file: ``kvrouter config example`` prints one with all of them. The server flags (``--host``,
``--port``, ...) and the ``KVROUTER_*`` env vars apply on top, as they do to a file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from router.config import ConfigError, RouterConfig, convert_config, parse_bool

__all__ = ["REPLICA_KEYS", "config_from_flags", "default_replica_name", "parse_replica"]

#: ``--replica`` option -> ReplicaConfig field.
REPLICA_KEYS = {
    "name": "name",
    "events": "event_endpoint",
    "replay": "replay_endpoint",
    "dp_ranks": "dp_ranks",
    "dp_rank_header": "dp_rank_header",
    "bind": "bind",
    "topic": "topic",
    "metrics_path": "metrics_path",
}
_NOT_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_AT = re.compile(r"^(?P<msg>.*) - at `\$\.pools\[0\](?P<path>[^`]*)`$", re.S)
_REPLICA_PATH = re.compile(r"^\.replicas\[(?P<i>\d+)\](?P<rest>.*)$")


def default_replica_name(url: str) -> str:
    """``host-port`` of ``url`` (``http://10.0.0.7:8000`` -> ``10.0.0.7-8000``): stable across
    restarts and the same on every router given the same flags, so metrics, logs and
    ``x-kvrouter-replica`` name a replica alike everywhere. (``:`` is not allowed in names.)"""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host:
        return _NOT_NAME.sub("-", url).strip("-._") or "replica"
    name = _NOT_NAME.sub("-", host).strip("-._") or "replica"
    return f"{name}-{port or 80}"


def parse_replica(spec: str) -> dict[str, Any]:
    """One ``--replica`` value as ReplicaConfig data: ``URL`` then ``key=value`` options,
    comma-separated (keys: :data:`REPLICA_KEYS`; ``dp_ranks=0+1`` lists ranks; ``bind`` is a
    boolean; ``metrics_path=none`` turns the load scrape off). Raises :class:`ConfigError`
    for a malformed value; the rest is the Struct's to judge."""
    url, *options = (part.strip() for part in spec.split(","))
    if not url or "=" in url.split("://", 1)[0]:
        raise ConfigError(f"--replica {spec!r}: start with the replica's URL (http://HOST:PORT)")
    data: dict[str, Any] = {"url": url}
    for opt in options:
        key, sep, value = opt.partition("=")
        key = key.strip()
        if not sep or key not in REPLICA_KEYS:
            raise ConfigError(
                f"--replica {spec!r}: unknown option {opt!r}; write key=value with key one of "
                f"{', '.join(REPLICA_KEYS)}"
            )
        field = REPLICA_KEYS[key]
        if field in data:
            raise ConfigError(f"--replica {spec!r}: {key} given twice")
        data[field] = _option_value(spec, key, value.strip())
    data.setdefault("name", default_replica_name(url))
    return data


def _option_value(spec: str, key: str, value: str) -> Any:
    if key == "dp_ranks":
        try:
            return [int(r) for r in value.split("+")]
        except ValueError:
            raise ConfigError(
                f"--replica {spec!r}: dp_ranks={value!r}: list ranks joined by '+' (0+1+2+3)"
            ) from None
    if key == "bind":
        flag = parse_bool(value)
        if flag is not None:
            return flag
        raise ConfigError(f"--replica {spec!r}: bind={value!r}: write true or false")
    if key == "metrics_path" and value.lower() == "none":
        return None
    return value


def config_from_flags(
    model: str,
    replicas: Sequence[str],
    *,
    policy: str | None = None,
    layout: str | None = None,
    tokenizer: str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> RouterConfig:
    """One pool serving ``model`` on ``replicas`` (``--replica`` values), validated as a file
    would be. ``layout``: a layout TOML file (``gpu_emitter/layout_files/*.toml``: ``[[groups]]``,
    ``[hash]``, ...; omitted: learned from the first events). ``tokenizer``: ``builtin``,
    ``remote`` or the directory holding the replicas' tokenizer files (``local``)."""
    specs = list(replicas)
    pool: dict[str, Any] = {"model": model, "replicas": [parse_replica(s) for s in specs]}
    if policy is not None:
        pool["policy"] = {"name": policy}
    if tokenizer is not None:
        if tokenizer in ("builtin", "remote"):
            pool["tokenizer"] = {"strategy": tokenizer}
        else:
            pool["tokenizer"] = {"strategy": "local", "path": tokenizer}
    if layout is not None:
        pool["layout"] = _layout_data(layout)
    try:
        return convert_config({"pools": [pool]}, source="flags", overrides=overrides)
    except ConfigError as exc:
        raise ConfigError(_name_the_flag(str(exc), specs, layout)) from None


def _layout_data(path: str) -> Any:
    try:
        return msgspec.toml.decode(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(
            f"--layout {path!r}: cannot read the layout file: {exc.strerror} (give the path of "
            "a layout TOML file, e.g. gpu_emitter/layout_files/fa_swa.toml)"
        ) from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"--layout {path!r}: not valid TOML: {exc}") from None


def _name_the_flag(message: str, specs: list[str], layout: str | None) -> str:
    """``flags: <why> - at `$.pools[0].replicas[1].url``` -> ``--replica '<spec>': <why>
    (url)``; a path outside the pool's flags (``$.server.port`` from ``--port`` or the env)
    keeps msgspec's wording."""
    body = message.removeprefix("flags: ")
    m = _AT.match(body)
    if m is None:
        return message
    why, path = m.group("msg"), m.group("path")
    rep = _REPLICA_PATH.match(path)
    if rep is not None and int(rep.group("i")) < len(specs):
        where = rep.group("rest").lstrip(".")
        return f"--replica {specs[int(rep.group('i'))]!r}: {why}" + (f" ({where})" if where else "")
    for prefix, flag in ((".policy", "--policy"), (".layout", f"--layout {layout!r}"),
                         (".tokenizer", "--tokenizer"), (".model", "--model")):  # fmt: skip
        if path.startswith(prefix):
            where = path.removeprefix(prefix).lstrip(".")
            return f"{flag}: {why}" + (f" ({where})" if where else "")
    if path == "":
        if why.startswith("layout: "):
            return f"--layout {layout!r}: {why.removeprefix('layout: ')}"
        return f"flags (--model, --replica, --layout): {why}"
    return message
