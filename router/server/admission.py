"""What a replica added through ``POST /admin/replicas`` may be.

The config file is the operator's word; an admin call may come from anyone holding the token
(or, with no token, from anyone on this host), so what it can make the router do is bounded:

* **Endpoints**: only the ZeroMQ schemes of ``server.admin_endpoint_schemes`` (``tcp`` by
  default). An ``ipc://`` path names a file on this host and ``inproc://`` this process's own
  sockets.
* **Binding**: ``bind = true`` makes the router bind a socket on this host; refused unless
  ``server.admin_allow_bind``. Even then an ``ipc://`` path that exists is refused: ZeroMQ
  unlinks whatever is there before it binds, so an admin call could destroy any file the
  router can write.
* **Model**: the replica's own ``GET /v1/models`` must list every name the pool answers to
  (clients' ``model`` field is forwarded unchanged, so a replica serving another model would
  answer them 404). ``verify_model = false`` skips this for a replica not up yet.
"""

from __future__ import annotations

import os

import httpx
import msgspec

from router.config import PoolConfig, ReplicaConfig, ServerConfig
from router.server.errors import ApiError
from router.server.side_get import BodyTooLarge, side_get

__all__ = ["check_endpoints", "check_models"]


def _endpoints(rcfg: ReplicaConfig) -> list[tuple[str, str]]:
    """(field, endpoint) of every ZeroMQ address the replica config names."""
    out = [(f, ep) for f in ("event_endpoint", "replay_endpoint") if (ep := getattr(rcfg, f))]
    for i, s in enumerate(rcfg.streams):
        out.append((f"streams[{i}].endpoint", s.endpoint))
        if s.replay_endpoint:
            out.append((f"streams[{i}].replay_endpoint", s.replay_endpoint))
    return out


def check_endpoints(rcfg: ReplicaConfig, server: ServerConfig) -> None:
    """Raise :class:`ApiError` (403, 409) for an endpoint or bind the admin API may not use."""
    allowed = set(server.admin_endpoint_schemes)
    for field, ep in _endpoints(rcfg):
        scheme = ep.partition("://")[0]
        if scheme not in allowed:
            raise ApiError(
                403,
                f"replica.{field}: {scheme}:// endpoints cannot be added through the admin API "
                f"(server.admin_endpoint_schemes = {sorted(allowed)}); use tcp://HOST:PORT, or "
                "put the replica in the config file",
                f"replica.{field}",
            )
    if not rcfg.bind:
        return
    if not server.admin_allow_bind:
        raise ApiError(
            403,
            "replica.bind: the admin API may not make the router bind sockets "
            "(server.admin_allow_bind = false); let the replica bind and the router connect",
            "replica.bind",
        )
    for field, ep in _endpoints(rcfg):
        binds = field == "event_endpoint" or field.endswith("].endpoint")  # replay connects
        if binds and ep.startswith("ipc://"):
            path = ep[len("ipc://") :]
            if path != "*" and not path.startswith("@") and os.path.lexists(path):
                raise ApiError(
                    409,
                    f"replica.{field}: {path} exists; binding there would replace it with a "
                    "socket. Choose a path that does not exist",
                    f"replica.{field}",
                )


MODELS_TIMEOUT_S = 5.0
"""On top of ``server.connect_timeout_s``: the whole ``GET /v1/models`` of a replica added
through the admin API, body included (router.server.side_get)."""
MAX_MODELS_BYTES = 8 << 20
"""Largest ``/v1/models`` answer read: a model card is a few hundred bytes."""


async def check_models(rcfg: ReplicaConfig, pool: PoolConfig, server: ServerConfig) -> None:
    """Raise :class:`ApiError` (409) unless the replica's ``/v1/models`` lists every name of
    ``pool``."""
    names = [pool.model, *pool.aliases, *pool.lora_adapters]
    url = rcfg.url.rstrip("/") + "/v1/models"
    skip = 'or add it with "verify_model": false if it is not up yet'
    deadline = MODELS_TIMEOUT_S + server.connect_timeout_s
    try:
        async with httpx.AsyncClient(timeout=deadline) as client:
            answer = await side_get(client, url, deadline_s=deadline, max_bytes=MAX_MODELS_BYTES)
        if answer.status != 200:
            raise ValueError(f"HTTP {answer.status}")
        data = msgspec.json.decode(answer.body)["data"]
        cards = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        served = [m.get("id") for m in cards]
        roots = {m.get("id"): m.get("root") for m in cards}
    except TimeoutError:
        raise ApiError(
            409,
            f"replica {rcfg.name!r}: no whole answer from {url} within {deadline:g} s to check "
            f"it serves {pool.model!r}; {skip}",
            "replica.url",
        ) from None
    except (
        httpx.HTTPError, BodyTooLarge, msgspec.DecodeError, RecursionError, ValueError,
        KeyError, TypeError,
    ) as exc:  # fmt: skip
        raise ApiError(
            409,
            f"replica {rcfg.name!r}: cannot read {url} to check it serves {pool.model!r} "
            f"({type(exc).__name__}: {exc}); start it first, {skip}",
            "replica.url",
        ) from None
    missing = [n for n in names if n not in served]
    if missing:
        raise ApiError(
            409,
            f"replica {rcfg.name!r} at {rcfg.url} serves {served}, not {missing} (pool "
            f"{pool.model!r}): clients would get its 404. Add it to the pool of its model, "
            f"{skip}",
            "replica.url",
        )
    # vLLM lists an adapter with its path as root, and hashes that path into every block
    wrong = {n: roots[n] for n, p in pool.lora_adapters.items() if roots.get(n) not in (None, p)}
    if wrong:
        raise ApiError(
            409,
            f"replica {rcfg.name!r} serves LoRA adapters from other paths than the pool's "
            f"lora_adapters ({wrong}): vLLM hashes the path, so no hit could be predicted. "
            f"Give the pool the replicas' paths, {skip}",
            "replica.url",
        )
