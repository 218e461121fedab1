"""Kubernetes pods as replicas: what one pod object asks for, and what must change.

Pure (no I/O), so that every rule is tested on plain JSON: :func:`read_pod` turns a Pod as the
API server serves it (``apiVersion: v1, kind: Pod``) into a :class:`PodView` (the replica it
should be, or why it is not one now), and :func:`plan` compares the ready pods with the
replicas discovery added and says what to add, replace, drain and undrain.
:mod:`router.server.discovery` does the list/watch and carries the plan out.

A pod is a replica while it has an IP, its ``Ready`` condition is ``True``, it has no
``deletionTimestamp`` and its phase is not ``Succeeded``/``Failed``. Its replica is named after
the pod; its URL and endpoints are the pod IP with the pool's ports, each overridable by an
annotation (``kvrouter.io/http-port``, ``kvrouter.io/events-port``, ``kvrouter.io/replay-port``,
``kvrouter.io/dp-ranks``). A replica whose pod changed IP, ports, ranks or uid (a new pod of the
same name: a new vLLM process with an empty cache) is replaced, not patched: its index state
belongs to the old process.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.config import KubernetesConfig, ReplicaConfig

__all__ = [
    "ANNOTATIONS",
    "Plan",
    "PodRefused",
    "PodView",
    "plan",
    "read_pod",
]

PREFIX = "kvrouter.io/"
HTTP_PORT = PREFIX + "http-port"
EVENTS_PORT = PREFIX + "events-port"
REPLAY_PORT = PREFIX + "replay-port"
DP_RANKS = PREFIX + "dp-ranks"
ANNOTATIONS = (HTTP_PORT, EVENTS_PORT, REPLAY_PORT, DP_RANKS)
MAX_DP_RANKS = 1024
"""More ranks than any vLLM deployment: a bound on what one annotation can make the router
subscribe to."""


class PodRefused(ValueError):
    """A pod the router will not turn into a replica. ``reason`` is the metric label
    (``bad_annotation``, ``bad_pod``); the message says what to fix on the pod."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class PodView:
    """One pod as discovery sees it."""

    name: str
    uid: str
    resource_version: str
    replica: ReplicaConfig | None
    """The replica it should be now; ``None`` while it is not ready (``not_ready`` says why)
    or when it was refused (``refused``)."""
    not_ready: str | None = None
    refused: PodRefused | None = None


def _port(annotations: Mapping[str, Any], key: str, default: int, *, zero: bool) -> int:
    raw = annotations.get(key)
    if raw is None:
        return default
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit()) or not (0 if zero else 1) <= int(text) <= 65535:
        low = 0 if zero else 1
        raise PodRefused(
            "bad_annotation", f"annotation {key}={raw!r}: must be a port number {low}..65535"
        )
    return int(text)


def _ranks(annotations: Mapping[str, Any]) -> tuple[int, ...]:
    raw = annotations.get(DP_RANKS)
    if raw is None:
        return (0,)
    parts = [p.strip() for p in str(raw).split(",")]
    if (
        not parts
        or len(parts) > MAX_DP_RANKS
        or not all(p.isascii() and p.isdigit() and int(p) < MAX_DP_RANKS for p in parts)
    ):
        raise PodRefused(
            "bad_annotation",
            f"annotation {DP_RANKS}={raw!r}: must list DP ranks 0..{MAX_DP_RANKS - 1}, "
            "comma-separated (e.g. '0,1,2,3')",
        )
    ranks = tuple(int(p) for p in parts)
    if len(set(ranks)) != len(ranks):
        raise PodRefused("bad_annotation", f"annotation {DP_RANKS}={raw!r}: a rank is repeated")
    return ranks


def _ready(meta: Mapping[str, Any], status: Mapping[str, Any]) -> str | None:
    """Why the pod is not serving now, or ``None`` when it is."""
    if meta.get("deletionTimestamp"):
        return "terminating"
    if status.get("phase") in ("Succeeded", "Failed"):
        return f"phase {status.get('phase')}"
    if not status.get("podIP"):
        return "no pod IP yet"
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        raise PodRefused("bad_pod", "status.conditions is not a list")
    ready = [c for c in conditions if isinstance(c, Mapping) and c.get("type") == "Ready"]
    if not ready or ready[0].get("status") != "True":
        return "Ready condition not True"
    return None


def _mapping(obj: Any, what: str) -> Mapping[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise PodRefused("bad_pod", f"{what} is not an object")
    return obj


def read_pod(obj: Any, k: KubernetesConfig) -> PodView:
    """What ``obj`` (a Pod's JSON) asks for. Raises :class:`PodRefused` when it has no
    usable name (nothing can be said of it); a named pod with bad annotations or a bad IP
    comes back with ``refused`` set, so the caller still knows the pod exists."""
    pod = _mapping(obj, "the pod")
    meta = _mapping(pod.get("metadata"), "metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise PodRefused("bad_pod", "a pod without metadata.name")
    uid = str(meta.get("uid") or "")
    rv = str(meta.get("resourceVersion") or "")
    try:
        status = _mapping(pod.get("status"), "status")
        annotations = _mapping(meta.get("annotations"), "metadata.annotations")
        http_port = _port(annotations, HTTP_PORT, k.http_port, zero=False)
        events_port = _port(annotations, EVENTS_PORT, k.events_port, zero=True)
        replay_port = _port(annotations, REPLAY_PORT, k.replay_port, zero=True)
        ranks = _ranks(annotations)
        top = max(ranks)
        for key, port in ((EVENTS_PORT, events_port), (REPLAY_PORT, replay_port)):
            if port and port + top > 65535:
                raise PodRefused(
                    "bad_annotation",
                    f"{key} {port} + DP rank {top} is past port 65535 (rank r uses port + r)",
                )
        why = _ready(meta, status)
        if why is not None:
            return PodView(name, uid, rv, None, not_ready=why)
        ip = str(status["podIP"])
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            raise PodRefused("bad_pod", f"status.podIP {ip!r} is not an IP address") from None
        host = f"[{addr}]" if addr.version == 6 else str(addr)
        try:
            replica = ReplicaConfig(
                name=name,
                url=f"http://{host}:{http_port}",
                event_endpoint=f"tcp://{host}:{events_port}" if events_port else None,
                replay_endpoint=(
                    f"tcp://{host}:{replay_port}" if events_port and replay_port else None
                ),
                dp_ranks=ranks,
            )
        except ValueError as exc:  # a name the config would refuse (pod names never are)
            raise PodRefused("bad_pod", f"pod {name!r}: {exc}") from None
    except PodRefused as exc:
        return PodView(name, uid, rv, None, refused=exc)
    return PodView(name, uid, rv, replica)


@dataclass(frozen=True)
class Owned:
    """A replica discovery added: the pod (uid) and config it was made from."""

    uid: str
    replica: ReplicaConfig


@dataclass
class Plan:
    """What to do so that the replicas match the ready pods (:func:`plan`)."""

    add: list[tuple[str, Owned]] = field(default_factory=list)
    replace: list[tuple[str, Owned]] = field(default_factory=list)
    """Remove now (the pod behind it is another process or address) and add again."""
    drain: list[str] = field(default_factory=list)
    undrain: list[str] = field(default_factory=list)
    clash: list[str] = field(default_factory=list)
    """Ready pods named like a replica discovery did not add (static or admin): refused."""

    def __bool__(self) -> bool:
        return bool(self.add or self.replace or self.drain or self.undrain or self.clash)


def plan(
    pods: Mapping[str, PodView],
    owned: Mapping[str, Owned],
    draining: set[str] | frozenset[str],
    taken: set[str] | frozenset[str],
) -> Plan:
    """The changes that bring ``owned`` (the replicas discovery added, by name; those in
    ``draining`` are being drained) in line with the ready ``pods``. ``taken``: names of the
    pool's other replicas (static or added through the admin API), never touched."""
    out = Plan()
    want = {
        name: Owned(v.uid, v.replica)
        for name, v in pods.items()
        if v.replica is not None
    }  # fmt: skip
    for name, target in sorted(want.items()):
        have = owned.get(name)
        if have is None:
            if name in taken:
                out.clash.append(name)
            else:
                out.add.append((name, target))
        elif have != target:
            out.replace.append((name, target))
        elif name in draining:
            out.undrain.append(name)
    for name in sorted(owned):
        if name not in want and name not in draining:
            out.drain.append(name)
    return out
