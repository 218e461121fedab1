"""Replica health in the service: the probe loop, request outcomes, and readiness.

The rules live in :mod:`router.core.health` (a pure state machine per replica, on
``ReplicaState.health``); this module feeds it and acts on what it returns:

* :func:`probe_forever` (a lifespan task, like the ``/metrics`` scraper) GETs every
  replica's ``health.probe_path`` every ``health.probe_interval_s``; 200 is up, anything
  else (another status, a connect error, no answer within ``probe_timeout_s``) a failure.
* The proxy reports each attempt: :func:`begin_attempt` before sending, :func:`attempt_answered`
  at its first response byte, :func:`attempt_failed` when it failed before that,
  :func:`end_attempt` when it is over.
* A replica leaving rotation (down or ejected) is logged and its index state distrusted
  (``PoolState.distrust_replica``): it may restart while unreachable, and vLLM restarts with
  an empty cache and no event saying so. Coming back is logged too.
* :func:`readiness` answers ``GET /ready``.

Counters (ejections, probe failures) live on the health objects and are exported at scrape
time (router.server.metrics), like the index's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from router.core.health import Change
from router.server.logs import kv
from router.server.side_get import side_get
from router.server.state import PoolState, ReplicaState, RouterState

__all__ = [
    "attempt_answered",
    "attempt_failed",
    "begin_attempt",
    "end_attempt",
    "probe_forever",
    "probe_once",
    "readiness",
]

log = logging.getLogger("kvrouter.health")


def _act(pool: PoolState, rep: ReplicaState, change: Change | None) -> None:
    if change is None:
        return
    kind = change.kind
    more = {"ejections": rep.health.ejections} if kind == "ejected" else {}
    fields = kv(pool=pool.name, replica=rep.name, change=kind, reason=change.reason, **more)
    if kind in ("ejected", "down"):
        log.warning("replica %s %s: out of rotation", rep.name, kind, extra=fields)
        pool.distrust_replica(rep, f"{kind}: {change.reason}")
    elif kind == "up":
        log.info("replica %s is back (half-open)", rep.name, extra=fields)
    else:
        log.info("replica %s healthy again", rep.name, extra=fields)


# -- request outcomes (the proxy) ----------------------------------------------------------


def begin_attempt(rep: ReplicaState) -> bool:
    """An attempt is about to be sent to ``rep``; returns whether it is a half-open trial
    (pass it to :func:`end_attempt`)."""
    trial = rep.health.begin(time.monotonic())
    rep.touch()
    return trial


def attempt_answered(pool: PoolState, rep: ReplicaState) -> None:
    """The attempt's first response byte arrived (a status below 500): ``rep`` serves."""
    _act(pool, rep, rep.health.succeeded(time.monotonic()))
    rep.touch()


def attempt_failed(pool: PoolState, rep: ReplicaState, error: str) -> None:
    """The attempt failed before its first byte (connect error, timeout, 5xx)."""
    _act(pool, rep, rep.health.failed(time.monotonic(), error))
    rep.touch()


def end_attempt(rep: ReplicaState, trial: bool) -> None:
    rep.health.end(trial)
    rep.touch()


# -- probes --------------------------------------------------------------------------------


PROBE_MAX_BYTES = 1 << 16
"""Largest ``/health`` body read: vLLM's is empty; a larger one fails the probe."""


async def probe_replica(pool: PoolState, rep: ReplicaState) -> None:
    """One probe of one replica; never raises."""
    cfg = pool.router.config.health
    error: str | None = None
    try:  # within the timeout whatever the replica sends (side_get); the body is read
        # (vLLM's is empty) so the connection is kept alive for the next probe
        answer = await side_get(
            rep.client, cfg.probe_path, deadline_s=cfg.probe_timeout_s, max_bytes=PROBE_MAX_BYTES
        )
        if answer.status != 200:
            error = f"HTTP {answer.status}"
    except (TimeoutError, httpx.TimeoutException):
        error = f"no answer within {cfg.probe_timeout_s:g} s"
    except Exception as exc:  # connect errors, a client closed by remove_replica, ...
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if not pool.holds(rep):
        return  # removed while the probe ran
    log.debug("probe", extra=kv(pool=pool.name, replica=rep.name, error=error))
    _act(pool, rep, rep.health.probe(time.monotonic(), error is None, error))
    rep.touch()


async def probe_once(state: RouterState) -> None:
    """Probe every replica of every pool concurrently."""
    await asyncio.gather(
        *(probe_replica(p, r) for p in state.pools.values() for r in list(p.replicas.values()))
    )


async def probe_forever(state: RouterState) -> None:
    """The lifespan's background task: a round every ``health.probe_interval_s`` (a round
    lasts at most ``probe_timeout_s``; the next starts one interval after this one did)."""
    interval = state.config.health.probe_interval_s
    while True:
        start = time.monotonic()
        try:
            await probe_once(state)
        except Exception:  # never let the prober die silently
            log.exception("health probe round failed")
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))


# -- readiness -----------------------------------------------------------------------------


def _streams_problem(rep: ReplicaState) -> str | None:
    """Why ``rep``'s event streams cannot be relied on now, or None."""
    sub = rep.subscriber
    if not rep.streams:
        return None  # routed by load only, by configuration
    if sub is None or sub.failure is not None:
        return "its event subscriber has stopped"
    down = sorted(name for name, st in sub.stats().items() if st.connected is False)
    if down:
        return f"event stream not connected: {', '.join(down)}"
    return None


def readiness(state: RouterState) -> tuple[bool, dict[str, Any]]:
    """``GET /ready``: ready when every pool has a replica that is routable (not drained,
    down or ejected) and whose event streams are connected. The body says, per pool, which
    replicas are ready and why the others are not."""
    if not state.started:
        return False, {"status": "starting", "missing": ["the router is starting"]}
    now = time.monotonic()
    pools: dict[str, Any] = {}
    missing: list[str] = []
    for pool in state.pools.values():
        ready: list[str] = []
        not_ready: dict[str, str] = {}
        for rep in pool.replicas.values():
            st = rep.health.state(now)
            if rep.drained:
                not_ready[rep.name] = "drained"
            elif not rep.health.routable(now):
                not_ready[rep.name] = st if st != "half_open" else "half_open (trial in flight)"
            elif (problem := _streams_problem(rep)) is not None:
                not_ready[rep.name] = problem
            else:
                ready.append(rep.name)
        pools[pool.name] = {"ready": ready, "not_ready": not_ready}
        if not ready:
            why = "; ".join(f"{n}: {w}" for n, w in not_ready.items()) or "no replicas"
            missing.append(f"pool {pool.name!r} has no routable replica with its events ({why})")
    ok = not missing
    body: dict[str, Any] = {"status": "ready" if ok else "not_ready", "pools": pools}
    if not ok:
        body["missing"] = missing
    return ok, body
