"""``/admin/ui``: a small page to look at the router (replicas, index, last decisions, explain).

The page is three static files shipped as package data (``router/server/ui_assets``: HTML,
vanilla JS, CSS; no CDN, no web font: the machines have no internet). They hold no data, so
:mod:`router.server.doors` lets a ``GET``/``HEAD`` of exactly these paths (:data:`UI_PATHS`)
through without the admin token: an operator opens the page and types the token there. Every
number the page shows comes from its own ``fetch`` of the ``/admin/*`` JSON API with that token
(``Authorization: Bearer``, kept in the tab's ``sessionStorage``), which the doors guard as
any other admin call; without ``server.admin_token`` the loopback-``Host`` rule applies to those
fetches as to any. The explain form's POST is same-origin (``Origin`` is the router's own,
``content-type: application/json``), which the doors' cross-site checks accept.

Every answer carries a strict ``Content-Security-Policy`` (scripts, styles and fetches from
this origin only, no inline script, no framing, no form posts elsewhere), ``nosniff`` and
``no-referrer``; the script writes strings with ``textContent`` only.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

__all__ = ["SECURITY_HEADERS", "UI_PATHS", "install_ui"]

_ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "index.html": ("index.html", "text/html; charset=utf-8"),
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "style.css": ("style.css", "text/css; charset=utf-8"),
}
UI_PATHS = frozenset({"/admin/ui", *(f"/admin/ui/{name}" for name in _ASSETS)})
"""The exact paths served without the admin token (GET/HEAD; they hold no data)."""

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files("router.server").joinpath("ui_assets", name).read_bytes()


def install_ui(api: FastAPI) -> None:
    """Serve the page on ``api`` (left out of the OpenAPI schema: it is not an API). The
    files are read once, here: a missing file (a broken install) fails at startup, not on the
    first visit."""
    files = {path: (_read(name), ctype) for path, (name, ctype) in _ASSETS.items()}

    async def to_slash() -> Response:
        # the page's relative URLs (app.js, ../replicas) resolve against /admin/ui/
        return RedirectResponse("ui/", status_code=307, headers=SECURITY_HEADERS)

    api.add_api_route("/admin/ui", to_slash, methods=["GET"], include_in_schema=False)
    for path, (body, ctype) in files.items():
        api.add_api_route(
            f"/admin/ui/{path}", _server(body, ctype), methods=["GET"], include_in_schema=False
        )


def _server(body: bytes, ctype: str) -> Any:
    """An endpoint answering ``body`` (a closure: no parameter a request could set)."""

    async def serve() -> Response:
        return Response(body, media_type=ctype, headers=SECURITY_HEADERS)

    return serve
