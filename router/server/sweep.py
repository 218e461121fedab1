"""The lifespan's background task that finishes wiped replicas' sweeps in a quiet pool.

A wipe (a cache clear, a gap the ring cannot cover, a replica seen down or removed) takes the
replica a fresh slot at once and leaves its old bit on the keys for ``KVIndex.sweep`` to
clear in bounded steps (router.core.index). Every applied batch runs a step; this task runs
steps too, so a pool whose replicas publish nothing still gets its memory and slots back.
Each tick spends at most ``budget_s`` per pool on the event loop it shares with requests.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.server.state import RouterState

__all__ = ["sweep_forever"]

log = logging.getLogger(__name__)


async def sweep_forever(
    state: RouterState, interval: float = 0.05, budget_s: float = 0.001
) -> None:
    """Every ``interval`` seconds, sweep steps on each pool with dead slots for up to
    ``budget_s`` (a step is ~15-500 us: IndexLimits.sweep_step)."""
    while True:
        await asyncio.sleep(interval)
        for pool in state.pools.values():
            index = pool.index
            if not index.dead_bits:
                continue
            try:
                end = time.perf_counter() + budget_s
                while index.sweep() and time.perf_counter() < end:
                    pass
            except Exception:  # never let the task die silently: the next tick tries again
                log.exception("pool %r: index sweep failed", pool.name)
