"""The doors: who may call what, decided from the request head before a body byte is read.

Every request passes :meth:`Doors.check` first (headers only, no ``receive``), so a refused
caller costs the router a header parse and nothing else: an unauthenticated 100 MB admin POST
is answered 401 while its body is still on the wire, and never buffered.

* ``/v1/*`` with ``server.api_key``: ``Authorization: Bearer <key>`` (vLLM's ``--api-key``
  rule), else 401.
* ``/admin``: ``Authorization: Bearer <server.admin_token>`` (401 without, 403 wrong). With no
  token (allowed on a loopback host only) the ``Host`` header must be a loopback address or
  ``localhost``, so a DNS-rebound name in a browser cannot reach it.
* The ``/admin/ui`` page's static files (exact paths, ``GET``/``HEAD``) need nothing: they hold
  no data, and every fetch the page makes goes through the ``/admin`` rules above.
* Admin *mutations* (POST, PUT, PATCH, DELETE) need ``content-type: application/json`` (415:
  no HTML form or ``text/plain`` fetch can send one without a CORS preflight, which the router
  never grants) and no cross-site ``Origin`` (403: only the router's own origin and
  ``server.admin_allowed_origins``) nor ``Sec-Fetch-Site: cross-site``/``same-site``.
* Bodies: the proxied routes bound their own (``server.max_body_bytes``, in the proxy); every
  other route is held to ``server.admin_max_body_bytes`` by :meth:`Doors.bounded_receive`,
  by ``content-length`` up front and by counting a chunked body as it arrives.

Each refusal is counted in ``kvrouter_refused_requests_total{reason}``.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from router.config import ServerConfig, is_loopback

__all__ = ["PROXIED", "Doors", "Refusal"]

PROXIED: Mapping[str, str] = MappingProxyType(
    {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
)
"""The paths the proxy serves, with the request kind each is (the dispatcher's table too)."""
"""The paths the raw-ASGI proxy serves (POST); every other path is the FastAPI app's."""

_MUTATIONS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_BEARER = ((b"www-authenticate", b"Bearer"),)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is turned away: the status, the client-facing message and the metric
    reason."""

    status: int
    message: str
    reason: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def _bearer(scope: dict[str, Any]) -> bytes | None:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive), else None."""
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, given = value.strip().partition(b" ")
    given = given.strip()
    return given if scheme.lower() == b"bearer" and given else None


def _host_name(host: str) -> str:
    """``host[:port]`` or ``[v6][:port]`` without the port."""
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    name, sep, port = host.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        return name
    return host


class Doors:
    """The head-only checks of one router (its :class:`ServerConfig`)."""

    def __init__(
        self,
        cfg: ServerConfig,
        count: Callable[[str], None],
        public: frozenset[str] = frozenset(),
    ) -> None:
        """``public``: exact ``/admin`` paths a ``GET``/``HEAD`` may read without the admin
        rules (the ``/admin/ui`` page's static files, router.server.ui; they hold no data)."""
        self.cfg = cfg
        self.count = count
        self._public = public
        self._api_key = cfg.api_key.encode() if cfg.api_key else None
        self._admin_token = cfg.admin_token.encode() if cfg.admin_token else None
        self._origins = {o.lower() for o in cfg.admin_allowed_origins}

    def _refuse(self, refusal: Refusal) -> Refusal:
        self.count(refusal.reason)
        return refusal

    def check(self, scope: dict[str, Any]) -> Refusal | None:
        """Why this request head is refused, or None. Reads no body."""
        path: str = scope["path"]
        if path == "/v1" or path.startswith("/v1/"):
            if self._api_key is not None:
                given = _bearer(scope)
                if given is None or not hmac.compare_digest(given, self._api_key):
                    return self._refuse(
                        Refusal(401, "this router needs 'Authorization: Bearer <api key>' "
                                "(server.api_key)", "api_key", _BEARER)
                    )  # fmt: skip
        elif (
            (path == "/admin" or path.startswith("/admin/"))
            and self.cfg.admin_enabled
            and not (path in self._public and scope["method"] in ("GET", "HEAD"))
        ):
            refusal = self.admin(scope)
            if refusal is not None:
                return self._refuse(refusal)
        if path not in PROXIED:
            length = _header(scope, b"content-length")
            limit = self.cfg.admin_max_body_bytes
            if length is not None and length.isdigit() and int(length) > limit:
                return self._refuse(self.too_large(limit))
        return None

    def admin(self, scope: dict[str, Any]) -> Refusal | None:
        """The admin API's rules (module docstring), in the order a caller fixes them."""
        if self._admin_token is not None:
            given = _bearer(scope)
            if given is None:
                return Refusal(401, "the admin API needs 'Authorization: Bearer <token>' "
                               "(server.admin_token)", "admin_no_token", _BEARER)  # fmt: skip
            if not hmac.compare_digest(given, self._admin_token):
                return Refusal(403, "wrong admin token", "admin_wrong_token")
        else:
            host = (_header(scope, b"host") or b"").decode("latin-1")
            if not is_loopback(_host_name(host)):
                return Refusal(
                    403,
                    "without server.admin_token the admin API answers only requests whose Host "
                    "is a loopback address or localhost; set a token to reach it by name",
                    "admin_host",
                )
        if scope["method"] not in _MUTATIONS:
            return None
        origin = _header(scope, b"origin")
        if origin is not None:
            own = f"{scope.get('scheme', 'http')}://".encode() + (_header(scope, b"host") or b"")
            o = origin.decode("latin-1").lower()
            if o != own.decode("latin-1").lower() and o not in self._origins:
                return Refusal(
                    403,
                    "cross-site admin request refused (Origin is neither this router nor in "
                    "server.admin_allowed_origins)",
                    "admin_cross_site",
                )
        else:
            site = _header(scope, b"sec-fetch-site")
            if site is not None and site.lower() not in (b"same-origin", b"none"):
                return Refusal(403, "cross-site admin request refused (Sec-Fetch-Site)",
                               "admin_cross_site")  # fmt: skip
        ctype = _header(scope, b"content-type") or b""
        if ctype.partition(b";")[0].strip().lower() != b"application/json":
            return Refusal(
                415,
                "admin changes need 'content-type: application/json' (send {} when there is "
                "nothing to say)",
                "admin_content_type",
            )
        return None

    @staticmethod
    def too_large(limit: int) -> Refusal:
        return Refusal(
            413,
            f"request body exceeds {limit} bytes (server.admin_max_body_bytes)",
            "body_too_large",
        )

    async def bounded_receive(self, receive: Any) -> Any:
        """The whole body read up to ``server.admin_max_body_bytes``, as a ``receive`` that
        replays it (then passes on to the real one, for the disconnect); a :class:`Refusal`
        when it is larger. The body is small by then, so holding it is bounded."""
        limit = self.cfg.admin_max_body_bytes
        messages: list[dict[str, Any]] = []
        size = 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > limit:
                return self._refuse(self.too_large(limit))
            if not msg.get("more_body"):
                break
        pending = iter(messages)

        async def replay() -> dict[str, Any]:
            msg = next(pending, None)
            return msg if msg is not None else await receive()

        return replay
