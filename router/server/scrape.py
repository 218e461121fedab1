"""Replica load from vLLM's Prometheus ``/metrics``: parse it, split off the router's own
share, and keep every replica's :class:`~router.server.state.ReplicaState` current.

The scraped counts can be a scrape interval old, so what the policy uses is *other clients'*
share of them (:func:`others_load`) plus the router's own in-flight count at decision time
(``PoolState.candidates``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from router.server.logs import kv
from router.server.side_get import BodyTooLarge, side_get
from router.server.state import PoolState, ReplicaState, RouterState
from router.server.vllm_metrics import (
    MAX_PAGE_BYTES,
    parse_start_time,
    parse_vllm_metrics,
    restarted,
)

__all__ = ["others_load", "scrape_forever", "scrape_once", "scrape_replica"]

log = logging.getLogger("kvrouter.scrape")


def others_load(
    running: dict[int, float],
    waiting: dict[int, float],
    mine_before: dict[int, int],
    mine_after: dict[int, int],
) -> tuple[dict[int, float], dict[int, float]]:
    """Split a replica's scraped running/waiting counts into other clients' share.

    The router's own requests at the scrape (the larger of its in-flight count before and
    after the GET, so a request finishing meanwhile is not taken for someone else's) are
    taken off ``running`` first and the remainder off ``waiting``. Unlabelled metrics (-1)
    cover every rank."""
    others_r: dict[int, float] = {}
    others_w: dict[int, float] = {}
    for eng in running.keys() | waiting.keys():
        if eng == -1:
            mine = max(sum(mine_before.values()), sum(mine_after.values()))
        else:
            mine = max(mine_before.get(eng, 0), mine_after.get(eng, 0))
        run = running.get(eng, 0.0)
        others_r[eng] = max(0.0, run - mine)
        others_w[eng] = max(0.0, waiting.get(eng, 0.0) - max(0.0, mine - run))
    return others_r, others_w


async def scrape_replica(pool: PoolState, rep: ReplicaState, timeout: float) -> None:
    """One scrape of one replica; a failure is kept in ``rep.scrape_error``, never raised, and
    drops the load the last good scrape read (other clients' share, KV usage) until the next.
    A changed process start time is a restart: the pool re-reads the replica's streams from
    the new process's start (:meth:`PoolState.replica_restarted`).

    Logged: the first failed scrape after a good one (or the first one) at WARNING, the first
    good scrape after failures at INFO, every other scrape at DEBUG (one a second per replica
    would bury the log; the latest error is in ``/admin/replicas``' ``scrape_error``)."""
    path = rep.cfg.metrics_path
    if path is None or not pool.holds(rep):
        return
    before = dict(rep.in_flight)
    where = {"pool": pool.name, "replica": rep.name, "url": rep.cfg.url + path}
    error: str | None = None
    try:
        answer = await side_get(rep.client, path, deadline_s=timeout, max_bytes=MAX_PAGE_BYTES)
        if answer.status >= 400:
            reason, error = "http_status", f"HTTP {answer.status}"
    except TimeoutError:
        reason, error = "timeout", f"no whole answer within {timeout:g} s"
    except BodyTooLarge as exc:
        reason, error = "too_large", str(exc)
    except httpx.HTTPError as exc:
        reason, error = "unreachable", f"{type(exc).__name__}: {exc}"
    except RuntimeError:  # httpx: "the client has been closed", by remove_replica
        if pool.holds(rep):
            raise
    if not pool.holds(rep):
        # removed (maybe re-added under its name) while the GET ran: its series were dropped
        # and must stay so, and a failure or a restart seen here belongs to no replica
        return
    if error is not None:
        pool.router.metrics.scrape_failures.labels(pool.name, rep.name, reason).inc()
        if rep.scrape_error is None:
            log.warning(
                "metrics scrape of replica %s failed", rep.name, extra=kv(**where, error=error)
            )
        else:
            log.debug(
                "metrics scrape of replica %s failed again",
                rep.name,
                extra=kv(**where, error=error),
            )
        rep.scrape_error = error
        # other clients' load and the KV usage are unknown now, as before any scrape: routed on
        # as such (the router's own in-flight count still counts), not frozen at the last good
        # scrape for as long as the failures last
        rep.others_running, rep.others_waiting, rep.kv_usage = {}, {}, {}
        return
    if rep.scrape_error is not None:
        log.info("metrics scrape of replica %s works again", rep.name, extra=kv(**where))
    else:
        log.debug("metrics scrape of replica %s", rep.name, extra=kv(**where))
    parsed = parse_vllm_metrics(answer.body)
    rep.running, rep.waiting = parsed["running"], parsed["waiting"]
    rep.kv_usage = parsed["kv_usage"]
    if parsed["num_gpu_blocks"]:  # an info gauge: keep the last seen if a scrape lacks it
        rep.num_gpu_blocks = parsed["num_gpu_blocks"]
    rep.others_running, rep.others_waiting = others_load(
        parsed["running"], parsed["waiting"], before, rep.in_flight
    )
    rep.finished = parsed["finished"]
    rep.scraped_at = time.time()
    rep.scraped_mono = time.monotonic()
    rep.scrape_error = None
    pool.scraped(rep, {r: max(before.get(r, 0), n) for r, n in rep.in_flight.items()})
    started = parse_start_time(answer.body)
    if restarted(rep.started_at, started):
        old = rep.started_at
        rep.started_at = started
        await pool.replica_restarted(
            rep.name, f"its process start time changed from {old:.0f} to {started:.0f}"
        )
    elif started is not None:
        rep.started_at = started


async def scrape_once(state: RouterState) -> None:
    """Scrape every replica of every pool concurrently; each read, body included, ends
    within ``server.connect_timeout_s`` (router.server.side_get), so one slow replica cannot
    hold the round."""
    timeout = state.config.server.connect_timeout_s
    reps = [(p, r) for p in state.pools.values() for r in list(p.replicas.values())]
    await asyncio.gather(*(scrape_replica(p, r, timeout) for p, r in reps))


async def scrape_forever(state: RouterState) -> None:
    """The lifespan's background task: scrape at ``server.metrics_scrape_interval_s``."""
    interval = state.config.server.metrics_scrape_interval_s
    while True:
        try:
            await scrape_once(state)
        except Exception:  # never let the scraper die silently
            log.exception("metrics scrape failed")
        await asyncio.sleep(interval)
