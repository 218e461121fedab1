"""A GET of a replica's side endpoint (``/health``, ``/metrics``), or of a peer router's index
snapshot, that ends in time, whole.

httpx's timeouts bound each socket operation, not the exchange: a replica that answers a
header and then a byte every quarter second is never silent long enough to time out
(measured: a 2 s timeout, a 10 s GET that lasted as long as the drip). The health prober
and the metrics scraper each wait for a round over every replica, so one such replica,
broken or hostile, held every other replica's probes and scrapes with it: a dead replica
then stayed in rotation and every load figure went stale, silently. Here a deadline covers
the connection, the headers and the body together, and the body is capped, so a replica
cannot hold the router's memory either.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

__all__ = ["BodyTooLarge", "SideAnswer", "side_get"]


class BodyTooLarge(Exception):
    """The body went past the cap: the answer is refused, not truncated."""


@dataclass(frozen=True, slots=True)
class SideAnswer:
    """Status and body (empty when the caller asked for none) of one side GET."""

    status: int
    body: bytes


async def side_get(
    client: httpx.AsyncClient, path: str, *, deadline_s: float, max_bytes: int
) -> SideAnswer:
    """GET ``path`` within ``deadline_s`` for the whole exchange, reading at most
    ``max_bytes`` of body (0: only the status; the connection is closed unread).

    Raises ``TimeoutError`` past the deadline, :class:`BodyTooLarge` past the cap, and
    ``httpx.HTTPError`` for what httpx refuses (connection, protocol)."""
    async with asyncio.timeout(deadline_s):
        async with client.stream("GET", path, timeout=deadline_s) as r:
            if max_bytes <= 0:
                return SideAnswer(r.status_code, b"")
            parts: list[bytes] = []
            size = 0
            async for chunk in r.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(f"body over {max_bytes} bytes")
                parts.append(chunk)
            return SideAnswer(r.status_code, b"".join(parts))
