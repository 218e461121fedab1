"""Index snapshots on disk and from a peer router: load one at start, write one on shutdown
and every ``index.snapshot_interval_s`` (router.core.snapshot holds the format).

A snapshot that cannot be read never stops the router: it starts without it (the replicas'
rings are replayed, and replicas whose rings lost their start come up partial) and says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path

import httpx

from router.config import RouterConfig
from router.core.snapshot import IndexSnapshot, SnapshotError, decode_snapshot, encode_snapshot
from router.server.side_get import BodyTooLarge, side_get
from router.server.state import RouterState

__all__ = ["load_snapshot", "snapshot_forever", "write_snapshot"]

log = logging.getLogger("kvrouter.snapshot")


async def load_snapshot(config: RouterConfig) -> IndexSnapshot | None:
    """The peer's snapshot if ``index.bootstrap_peer`` is set, else the file's, else None."""
    idx = config.index
    if idx.bootstrap_peer:
        url = idx.bootstrap_peer.rstrip("/") + "/admin/index/snapshot"
        token = config.server.admin_token
        headers = {"authorization": f"Bearer {token}"} if token else {}
        deadline = idx.bootstrap_timeout_s
        try:
            async with httpx.AsyncClient(headers=headers) as client:
                answer = await side_get(
                    client, url, deadline_s=deadline, max_bytes=idx.bootstrap_max_bytes
                )
            if answer.status != 200:
                raise SnapshotError(f"HTTP {answer.status}")
            snap = decode_snapshot(answer.body, source=url)
            log.info("index loaded from peer %s", idx.bootstrap_peer)
            return snap
        except TimeoutError:
            why = f"no whole answer within index.bootstrap_timeout_s = {deadline:g} s"
        except BodyTooLarge:
            why = f"larger than index.bootstrap_max_bytes = {idx.bootstrap_max_bytes}"
        except (httpx.HTTPError, SnapshotError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.warning("no snapshot from peer %s (%s): replaying the rings", url, why)
        return None
    if idx.snapshot_path and Path(idx.snapshot_path).is_file():
        try:
            snap = decode_snapshot(Path(idx.snapshot_path).read_bytes(), source=idx.snapshot_path)
            log.info("index loaded from %s", idx.snapshot_path)
            return snap
        except (OSError, SnapshotError) as exc:
            log.warning("snapshot %s not loaded (%s): replaying the rings", idx.snapshot_path, exc)
    return None


def write_snapshot(state: RouterState, path: str) -> int:
    """Write the index atomically (a temporary file renamed over ``path``); returns bytes."""
    data = encode_snapshot(state.index_snapshot())
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(data)


async def snapshot_forever(state: RouterState, path: str, interval: float) -> None:
    """The lifespan's background task: a snapshot every ``interval`` seconds."""
    while True:
        await asyncio.sleep(interval)
        try:
            n = write_snapshot(state, path)
            log.debug("index snapshot written to %s (%d bytes)", path, n)
        except Exception:  # never let the writer die silently
            log.exception("index snapshot to %s failed", path)
