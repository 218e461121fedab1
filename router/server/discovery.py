"""Kubernetes discovery: list and watch a pool's pods, and keep its replicas in step.

One :class:`PodWatcher` per pool with ``discovery = "kubernetes"`` runs on the serving loop
(started and stopped by the app's lifespan). It speaks the API server's list/watch protocol
itself, over the HTTP client :mod:`lightkube` configures (the ``kubernetes`` extra):

1. ``GET /api/v1/namespaces/<ns>/pods?labelSelector=...``: every pod and the list's
   ``resourceVersion``; replicas that are no longer backed by a ready pod are drained, new
   ready pods added (the reconcile after a 410 works the same way);
2. ``GET ...?watch=1&resourceVersion=<rv>&allowWatchBookmarks=true&timeoutSeconds=<t>``: a
   chunked stream of ``{"type": ..., "object": ...}`` lines. Every event and bookmark advances
   the resourceVersion; when the stream ends or breaks, the watch resumes from it (no relist);
3. ``410 Gone`` (the HTTP status of the watch request, or an ``ERROR`` event holding a Status
   with code 410: the resourceVersion is older than the server's history) relists;
4. any other failure (connect, timeout, a broken stream, 5xx, 403) is counted and retried after
   a bounded exponential backoff with jitter; a broken event line relists.

Why not lightkube's own ``AsyncClient.list``/``watch``: its watch cannot ask for bookmarks,
takes label selectors as dicts only, and on 410 restarts the watch without a resourceVersion
instead of relisting (a pod deleted while the router was disconnected would stay a replica);
its list decodes all pods into models at once, so one malformed pod would refuse them all.
What lightkube gives is the connection: in-cluster service account (its token re-read when
it rotates), CA, or a kubeconfig outside a cluster.

What to do with the pods is :mod:`router.core.pods` (pure): this module carries the plan out
through :meth:`PoolState.add_replica` / :meth:`PoolState.remove_replica` and
:attr:`ReplicaState.drained`. A drained replica is removed when it has nothing in flight, or
``drain_timeout_s`` after it was drained. Nothing here may stop the router: every failure is
counted (``kvrouter_discovery_*``), logged, and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from typing import Any

from router.config import KubernetesConfig
from router.core.pods import Owned, PodRefused, PodView, plan, read_pod
from router.server.logs import kv
from router.server.metrics import RouterMetrics
from router.server.state import DiscoveryStatus, PoolState

__all__ = ["DiscoveryUnavailable", "PodWatcher", "backoff_delay", "require_client"]

log = logging.getLogger("kvrouter.discovery")

INSTALL_HINT = "pip install 'kvrouter[kubernetes]'"
BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 30.0
WATCH_TIMEOUT_S = (300, 600)
"""``timeoutSeconds`` of each watch, drawn in this range (client-go's reflector does the same,
so that several routers do not renew their watches in step)."""
READ_MARGIN_S = 30.0
"""The client gives up on a silent watch this long after the server should have ended it: a
connection that died without a FIN is found within ``timeoutSeconds`` + this."""
SWEEP_INTERVAL_S = 0.1
"""How often draining replicas are checked for being idle."""
ADD_RETRY_S = 5.0
"""A ready pod whose replica could not be added is tried again this long after."""
EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")


def backoff_delay(failures: int, rand: float | None = None) -> float:
    """Seconds to wait after ``failures`` consecutive failures: ``BACKOFF_BASE_S`` doubled per
    failure up to ``BACKOFF_MAX_S``, drawn in the upper half of that (jitter, so that several
    routers that lost the API server together do not come back in step)."""
    top = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** min(max(0, failures - 1), 30))
    return top / 2 + (random.random() if rand is None else rand) * top / 2


class DiscoveryUnavailable(RuntimeError):
    """``discovery = "kubernetes"`` is configured but its client library is not installed."""


def require_client() -> None:
    """Raise :class:`DiscoveryUnavailable` (naming the install command) unless lightkube can
    be imported. The router imports lightkube only when a pool discovers pods."""
    try:
        import lightkube  # noqa: F401
    except ImportError as exc:
        raise DiscoveryUnavailable(
            f'discovery = "kubernetes" needs the Kubernetes client: {INSTALL_HINT} ({exc})'
        ) from None


class _Gone(Exception):
    """410: the resourceVersion is too old; relist."""


class _Failure(Exception):
    """A counted failure with its metric reason; ``relist``: the watch cannot resume."""

    def __init__(self, reason: str, message: str, *, relist: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.relist = relist


def _connect(k: KubernetesConfig) -> tuple[Any, str, Any]:
    """lightkube's configured HTTP client (an ``httpx2.AsyncClient``), the namespace to
    watch, and the ``httpx2`` module (for its exception classes)."""
    require_client()
    import httpx2
    from lightkube.config import client_adapter
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.config.models import Cluster, User

    if k.api_server:
        conf = KubeConfig.from_one(
            cluster=Cluster(server=k.api_server.rstrip("/")), user=User(), namespace=k.namespace
        ).get()
    else:
        conf = KubeConfig.from_env().get()  # in-cluster first, then the kubeconfig
    if conf is None:
        raise _Failure("config", "no Kubernetes configuration found (in-cluster or kubeconfig)")
    params = client_adapter.ConnectionParams(timeout=httpx2.Timeout(10.0), trust_env=False)
    client = client_adapter.AsyncClient(conf, params)
    return client, k.namespace or conf.namespace or "default", httpx2


class PodWatcher:
    """Keeps one pool's discovered replicas in step with its pods (module docstring)."""

    def __init__(self, pool: PoolState, metrics: RouterMetrics) -> None:
        if pool.cfg.kubernetes is None:
            raise ValueError(f"pool {pool.name!r} has no [pools.kubernetes] table")
        self.pool = pool
        self.k: KubernetesConfig = pool.cfg.kubernetes
        self.metrics = metrics
        self.status = DiscoveryStatus(self.k.namespace, self.k.label_selector, self.k.api_server)
        pool.discovery = self.status
        self.rv: str | None = None
        self.pods: dict[str, PodView] = {}
        self.owned: dict[str, tuple[Owned, Any]] = {}
        """Replicas discovery added: name -> (what it was made from, its ReplicaState)."""
        self.draining: dict[str, float] = self.status.draining
        self._refused_seen: dict[str, str] = {}
        self._clashed: set[str] = set()
        self._lock = asyncio.Lock()
        self._client: Any = None
        self._httpx: Any = None
        self._path = ""
        self._failures = 0
        self._retry_at: float | None = None

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """List, watch, resume, relist: until cancelled. Never raises otherwise."""
        sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        reason = "start"
        try:
            while True:
                try:
                    if self._client is None:
                        self._client, ns, self._httpx = _connect(self.k)
                        self.status.namespace = ns
                        self._path = f"/api/v1/namespaces/{ns}/pods"
                    if self.rv is None:
                        await self._relist(reason)
                    await self._watch()
                except asyncio.CancelledError:
                    raise
                except _Gone as exc:
                    self.rv = None
                    reason = "gone"
                    self._failed("gone", str(exc), logging.INFO)
                    if self._failures > 1:
                        await asyncio.sleep(self._backoff())
                except Exception as exc:
                    failure = self._classify(exc)
                    if failure.relist:
                        self.rv = None
                    reason = "error"
                    self._failed(failure.reason, str(failure), logging.WARNING, exc)
                    await asyncio.sleep(self._backoff())
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            self._set_connected(False)
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.aclose()

    def _classify(self, exc: Exception) -> _Failure:
        if isinstance(exc, _Failure):
            return exc
        h = self._httpx
        if h is not None:
            if isinstance(exc, h.TimeoutException):
                return _Failure("timeout", f"timed out: {exc!r}")
            if isinstance(exc, h.ConnectError):
                return _Failure("connect", f"cannot connect: {exc}")
            if isinstance(exc, h.RemoteProtocolError | h.ReadError):
                return _Failure("disconnected", f"connection lost: {exc!r}")
            if isinstance(exc, h.HTTPError):
                return _Failure("http", f"HTTP failure: {exc!r}")
        if self._client is None:
            return _Failure("config", f"cannot configure the Kubernetes client: {exc!r}")
        log.exception("pod discovery of pool %s failed unexpectedly", self.pool.name)
        return _Failure("internal", f"unexpected: {exc!r}", relist=True)

    def _failed(
        self, reason: str, message: str, level: int, exc: BaseException | None = None
    ) -> None:
        self._failures += 1
        self._set_connected(False)
        self.metrics.discovery_errors.labels(self.pool.name, reason).inc()
        self.status.last_error = f"{reason}: {message}"
        self.status.last_error_at = time.time()
        log.log(
            level,
            "pod watch of pool %s: %s",
            self.pool.name,
            message,
            extra=kv(pool=self.pool.name, reason=reason, resource_version=self.rv,
                     failures=self._failures),
        )  # fmt: skip

    def _backoff(self) -> float:
        return backoff_delay(self._failures)

    def _set_connected(self, up: bool) -> None:
        self.status.connected = up
        self.metrics.discovery_connected.labels(self.pool.name).set(1 if up else 0)

    def _advance(self, rv: str) -> None:
        if rv:
            self.rv = rv
            self.status.resource_version = rv

    # ------------------------------------------------------------ list/watch

    def _status_failure(self, code: int, body: bytes | str) -> Exception:
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        message = text[:300]
        with contextlib.suppress(ValueError, AttributeError, TypeError, RecursionError):
            message = json.loads(text).get("message") or message
        if code == 410:
            return _Gone(f"410 Gone: {message}")
        return _Failure(f"http_{code}", f"API server answered {code}: {message}")

    async def _relist(self, reason: str) -> None:
        resp = await self._client.get(self._path, params={"labelSelector": self.k.label_selector})
        if resp.status_code != 200:
            raise self._status_failure(resp.status_code, resp.content)
        try:
            data = resp.json()
            items = data["items"] or []
            rv = data["metadata"]["resourceVersion"]
            if not isinstance(items, list) or not isinstance(rv, str) or not rv:
                raise TypeError("items or metadata.resourceVersion missing")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise _Failure("malformed", f"pod list: {exc!r}", relist=True) from None
        pods: dict[str, PodView] = {}
        for obj in items:
            view = self._read(obj)
            if view is not None:
                pods[view.name] = view
        self.metrics.discovery_relists.labels(self.pool.name, reason).inc()
        self.status.relists += 1
        self.pods = pods
        self._advance(rv)
        log.info(
            "pod list of pool %s: %d pods",
            self.pool.name,
            len(pods),
            extra=kv(pool=self.pool.name, reason=reason, resource_version=rv),
        )
        await self._reconcile()

    async def _watch(self) -> None:
        timeout_s = random.randint(*WATCH_TIMEOUT_S)
        params = {
            "watch": "1",
            "labelSelector": self.k.label_selector,
            "resourceVersion": self.rv or "",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        timeout = self._httpx.Timeout(10.0, read=timeout_s + READ_MARGIN_S)
        started, lines = time.monotonic(), 0
        async with self._client.stream("GET", self._path, params=params, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise self._status_failure(resp.status_code, await resp.aread())
            self._set_connected(True)
            self._failures = 0
            async for line in resp.aiter_lines():
                if line.strip():
                    lines += 1
                    await self._event(line)
        self._set_connected(False)
        if lines == 0 and time.monotonic() - started < 1.0:
            # a server that ends every watch at once would otherwise be asked again in a loop
            raise _Failure("watch_ended_early", "the watch ended at once without an event")

    async def _event(self, line: str) -> None:
        try:
            ev = json.loads(line)
            typ, obj = ev["type"], ev["object"]
            if typ not in EVENT_TYPES or not isinstance(obj, dict):
                raise TypeError(f"event type {typ!r} with a {type(obj).__name__} object")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            # an event may be lost: only a relist says what is there now
            raise _Failure("malformed", f"watch event: {exc!r}", relist=True) from None
        self.metrics.discovery_events.labels(self.pool.name, typ).inc()
        if typ == "ERROR":
            code = obj.get("code")
            raise self._status_failure(code if isinstance(code, int) else 0, json.dumps(obj))
        meta = obj.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        rv = rv if isinstance(rv, str) else ""
        if typ == "BOOKMARK":
            self._advance(rv)
            return
        view = self._read(obj)
        if view is not None:
            if typ == "DELETED":
                old = self.pods.get(view.name)
                if old is not None and (not view.uid or old.uid in ("", view.uid)):
                    del self.pods[view.name]
            else:
                self.pods[view.name] = view
        self._advance(rv)
        await self._reconcile()

    def _read(self, obj: Any) -> PodView | None:
        """The pod's view; refusals counted and logged once per pod version."""
        try:
            view = read_pod(obj, self.k)
        except PodRefused as exc:
            self._refuse(None, None, exc)
            return None
        if view.refused is not None:
            self._refuse(view.name, view.resource_version, view.refused)
        else:
            self._refused_seen.pop(view.name, None)
        return view

    def _refuse(self, name: str | None, rv: str | None, exc: PodRefused) -> None:
        if name is not None:
            if self._refused_seen.get(name) == rv:
                return
            self._refused_seen[name] = rv or ""
        self.metrics.discovery_refused.labels(self.pool.name, exc.reason).inc()
        log.warning(
            "pod %s refused as a replica of pool %s: %s",
            name,
            self.pool.name,
            exc,
            extra=kv(pool=self.pool.name, pod=name, reason=exc.reason),
        )

    # ------------------------------------------------------------- reconcile

    async def _reconcile(self) -> None:
        async with self._lock:
            await self._apply()
            await self._sweep()
            self._publish()

    async def _apply(self) -> None:
        pool = self.pool
        for name in [n for n, (_, rep) in self.owned.items() if pool.replicas.get(n) is not rep]:
            # removed behind discovery's back (the admin API): it is added again if still ready
            del self.owned[name]
            self.draining.pop(name, None)
        taken = {n for n in pool.replicas if n not in self.owned}
        owned = {n: o for n, (o, _) in self.owned.items()}
        p = plan(self.pods, owned, frozenset(self.draining), taken)
        for name in p.clash:
            if name not in self._clashed:
                self._clashed.add(name)
                self._refuse(None, None, PodRefused(
                    "name_clash",
                    f"pod {name!r}: a {pool.replicas[name].source} replica of that name exists; "
                    "rename one of them",
                ))  # fmt: skip
        self._clashed &= set(p.clash)
        for name, target in p.replace:
            await self._remove(name, "replaced")
            await self._add(name, target, "replaced")
        for name, target in p.add:
            await self._add(name, target, "added")
        now = time.monotonic()
        for name in p.undrain:
            self.owned[name][1].drained = False
            del self.draining[name]
            self._changed(name, "undrained")
        for name in p.drain:
            self.owned[name][1].drained = True
            self.draining[name] = now + self.k.drain_timeout_s
            view = self.pods.get(name)
            self._changed(name, "drained", why=view.not_ready if view else "pod deleted")

    async def _add(self, name: str, target: Owned, change: str) -> None:
        try:
            rep = await self.pool.add_replica(target.replica, source="kubernetes")
        except Exception as exc:  # cannot connect its streams, a name taken meanwhile
            self.metrics.discovery_errors.labels(self.pool.name, "add_failed").inc()
            self._retry_at = time.monotonic() + ADD_RETRY_S
            log.warning(
                "pod %s could not be added to pool %s: %s",
                name,
                self.pool.name,
                exc,
                extra=kv(pool=self.pool.name, pod=name, reason="add_failed"),
            )
            return
        self.owned[name] = (target, rep)
        self._changed(name, change, url=target.replica.url, dp_ranks=list(rep.ranks),
                      uid=target.uid)  # fmt: skip

    async def _remove(self, name: str, change: str) -> None:
        self.draining.pop(name, None)
        _, rep = self.owned.pop(name)
        if self.pool.replicas.get(name) is rep:
            await self.pool.remove_replica(name)
        if change != "replaced":
            self._changed(name, change)

    async def _sweep(self) -> None:
        """Remove the draining replicas that are idle or past their deadline."""
        now = time.monotonic()
        for name, deadline in list(self.draining.items()):
            _, rep = self.owned[name]
            busy = sum(rep.in_flight.values())
            if busy == 0:
                await self._remove(name, "removed")
            elif now >= deadline:
                await self._remove(name, "removed_timeout")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            retry = self._retry_at is not None and time.monotonic() >= self._retry_at
            if self.draining or retry:
                try:
                    if retry:
                        self._retry_at = None
                        await self._reconcile()
                    else:
                        async with self._lock:
                            await self._sweep()
                            self._publish()
                except Exception:  # the sweep must go on: a later one retries
                    self.metrics.discovery_errors.labels(self.pool.name, "internal").inc()
                    log.exception("draining discovered replicas of pool %s", self.pool.name)

    def _publish(self) -> None:
        """The status and gauges from the current state."""
        status = self.status
        status.pods = {
            n: "ready" if v.replica is not None
            else f"refused: {v.refused}" if v.refused is not None
            else f"not ready: {v.not_ready}"
            for n, v in self.pods.items()
        }  # fmt: skip
        g = self.metrics.discovery_replicas
        g.labels(self.pool.name, "serving").set(len(self.owned) - len(self.draining))
        g.labels(self.pool.name, "draining").set(len(self.draining))

    def _changed(self, name: str, change: str, **fields: Any) -> None:
        self.metrics.discovery_changes.labels(self.pool.name, change).inc()
        log.info(
            "discovered replica %s %s",
            name,
            change,
            extra=kv(pool=self.pool.name, replica=name, change=change, **fields),
        )
