"""The router's ASGI app: the factory and its lifespan.

The app is a thin dispatcher. Every HTTP request first meets the doors
(:mod:`router.server.doors`: API key, admin token, origin, content type, body size, from the
head alone); then ``POST /v1/completions`` and ``/v1/chat/completions`` go straight to
:class:`router.server.proxy.Proxy` (the hot path, raw ASGI, no framework on it) and every other
request, its body read within ``server.admin_max_body_bytes``, goes to a FastAPI app
(``/v1/models``, ``/health``, ``/ready``, ``/metrics``, ``/admin``, the ``/admin/ui`` page,
the schema at ``/openapi.json``; no ``/docs``: Swagger UI would load from a CDN). Every error
is an OpenAI error (:mod:`router.server.errors`), a bug's included, and every ``/v1/*``
request is counted, timed and logged when it ends (:mod:`router.server.outcome`). This is the
one module that knows every face; the state it hands them (:mod:`router.server.state`) knows
none of them, so no face reaches around another.

The lifespan starts the pools (their replicas' event subscribers run on the serving loop, so the
index is read and written by one thread only), the ``/metrics`` scraper, the health prober
(router.server.health) and, for pools with ``discovery = "kubernetes"``, the pod watchers
(router.server.discovery), and stops them.

``GET /health`` is liveness: 200 while the process serves. ``GET /ready`` is readiness: 200
when every pool has a routable replica with its event streams connected, else 503, both with
a JSON body saying what is missing (router.server.health.readiness).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from router.config import RouterConfig, is_loopback
from router.server.admin import admin_router
from router.server.discovery import DiscoveryUnavailable, PodWatcher, require_client
from router.server.doors import PROXIED, Doors, Refusal
from router.server.errors import install_error_handlers, json_errors, send_error
from router.server.health import probe_forever, readiness
from router.server.metrics import CONTENT_TYPE
from router.server.openapi_routes import document_proxied
from router.server.outcome import observe
from router.server.persist import load_snapshot, snapshot_forever, write_snapshot
from router.server.proxy import Proxy
from router.server.scrape import scrape_forever
from router.server.state import RouterState
from router.server.sweep import sweep_forever
from router.server.ui import UI_PATHS, install_ui
from router.version import kvrouter_version

__all__ = ["StartupError", "check_startup", "create_app"]

log = logging.getLogger("kvrouter.serve")


class StartupError(RuntimeError):
    """The router cannot start safely with this config; the message says what to change."""


def check_startup(config: RouterConfig) -> None:
    """Refuse configs that would expose the admin API unauthenticated, or that discover pods
    without the Kubernetes client installed."""
    if any(p.discovery == "kubernetes" for p in config.pools):
        try:
            require_client()
        except DiscoveryUnavailable as exc:
            raise StartupError(str(exc)) from None
    s = config.server
    if s.admin_enabled and not s.admin_token and not is_loopback(s.host):
        raise StartupError(
            f"admin API enabled on non-loopback host {s.host!r} without a token: set "
            f"server.admin_token (or KVROUTER_ADMIN_TOKEN), or admin_enabled = false"
        )


def create_app(config: RouterConfig) -> Any:
    """The router's ASGI app. ``app.state.router`` (FastAPI side) is the :class:`RouterState`."""
    check_startup(config)
    state = RouterState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start(await load_snapshot(config))
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(sweep_forever(state))]
        if config.server.metrics_scrape_interval_s > 0:
            tasks.append(loop.create_task(scrape_forever(state)))
        if config.health.probe_interval_s > 0:
            tasks.append(loop.create_task(probe_forever(state)))
        for pool in state.pools.values():
            if pool.cfg.discovery == "kubernetes":
                tasks.append(loop.create_task(PodWatcher(pool, state.metrics).run()))
        path = config.index.snapshot_path
        if path and config.index.snapshot_interval_s > 0:
            tasks.append(
                loop.create_task(snapshot_forever(state, path, config.index.snapshot_interval_s))
            )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if path:
                try:
                    write_snapshot(state, path)  # before the streams close: their last seqs
                except Exception:
                    log.exception("index snapshot to %s failed at shutdown", path)
            await state.stop()

    # no /docs nor /redoc: FastAPI's pages load Swagger UI and ReDoc from a CDN, and nothing the
    # router serves may refer to another host (the machines have no internet); the schema is
    # /openapi.json, and /admin/ui lists its operations
    api = FastAPI(
        title="kvrouter",
        lifespan=lifespan,
        version=kvrouter_version(),
        docs_url=None,
        redoc_url=None,
    )
    api.state.router = state

    def refused(reason: str) -> None:
        state.metrics.refused.labels(reason).inc()

    install_error_handlers(api, refused)
    document_proxied(api)

    @api.get("/health", summary="Liveness: 200 while the router process serves")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @api.get(
        "/ready",
        summary="Readiness: 200 when every pool has a routable replica with connected events",
    )
    async def ready() -> Response:
        ok, body = readiness(state)
        return JSONResponse(body, status_code=200 if ok else 503)

    @api.get("/v1/models")
    async def models() -> Response:
        now = int(time.time())
        data = [
            {"id": name, "object": "model", "created": now, "owned_by": "kvrouter"}
            for name in state.models
        ]
        return JSONResponse({"object": "list", "data": data})

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    doors = Doors(config.server, refused, UI_PATHS if config.server.admin_enabled else frozenset())
    if config.server.admin_enabled:
        api.include_router(admin_router(state, doors.admin))
        install_ui(api)

    proxy = Proxy(state)

    async def dispatch(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await api(scope, receive, send)
            return
        refusal = doors.check(scope)
        if refusal is None:
            if scope["method"] == "POST":
                # the decoded path, as the doors and FastAPI's routing read it
                kind = PROXIED.get(scope["path"])
                if kind is not None:
                    await proxy.handle(kind, scope, receive, send)
                    return
            bounded = await doors.bounded_receive(receive)
            if not isinstance(bounded, Refusal):
                await api(scope, bounded, send)
                return
            refusal = bounded
        await send_error(send, refusal.status, refusal.message, headers=refusal.headers)

    # outermost: every /v1/* request is counted and logged, whoever answers it
    app = observe(json_errors(dispatch), state.metrics, state.decisions)
    app.state = api.state  # type: ignore[attr-defined]
    app.fastapi = api  # type: ignore[attr-defined]
    return app
