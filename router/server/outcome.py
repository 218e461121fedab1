"""What became of each request on ``/v1/*``: counted, timed and logged once, when it ends.

:func:`observe` wraps the whole app (outside the doors and the JSON-error guard), so every
``/v1/*`` request is seen, whoever answered it: the replica, the proxy's own 400/404/413/502/
503, the doors' 401, FastAPI's 404/405, a bug's 500. It puts an :class:`Outcome` in the ASGI
scope (key :data:`OUTCOME`); the proxy fills in what it decided (:func:`outcome_of`:
pool, each attempt's :class:`~router.server.state.RouteChoice`), and the wrapper reads the rest
from the messages it passes on (status, the response start, ``x-kvrouter-replica``, which the
proxy sets on exactly the responses a replica gave, ``x-request-id``, an SSE content type,
the router's own error message, a client disconnect). When the request is over it

* counts it in ``kvrouter_requests_total{pool, replica, status, status_class}``, then drops
  every series of a replica it tried that was removed meanwhile (``RouterMetrics.forget_replica``
  ran at the removal, and this request's counts would otherwise outlive the replica);
* observes ``kvrouter_request_duration_seconds`` (arrival to the last byte),
  ``kvrouter_router_added_seconds`` (body received to the first attempt sent: parse,
  tokenize, predict, choose; the time failed attempts took is the replicas', not the
  router's) and, for a streamed answer, ``kvrouter_upstream_ttft_seconds`` (the answering
  attempt sent to its first chunk, which the proxy forwards as soon as it is in);
* keeps its routing decision, with its status and vLLM's ``cached_tokens``, in the last
  decisions (:mod:`router.server.decisions`, ``GET /admin/decisions``);
* logs one line on ``kvrouter.request`` (INFO, WARNING for a 5xx) with the routing decision:
  request id, pool, chosen replica and rank, its predicted hit and the best hit of any
  replica, the policy and why it chose so (``reason``), attempts, status and the latencies.

A request that ends with no response sent counts as 499 (nginx's "client closed request")
when the client had disconnected, else 500 (what uvicorn then answers).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from router.server.decisions import DecisionLog, Kept, decision_reason
from router.server.logs import kv
from router.server.metrics import RouterMetrics
from router.server.state import RouteChoice

__all__ = ["OUTCOME", "Outcome", "observe", "outcome_of"]

log = logging.getLogger("kvrouter.request")

OUTCOME = "kvrouter.outcome"
"""The ASGI scope key of a request's :class:`Outcome`."""

_ERROR_BODY_MAX = 4096


class Outcome:
    """One request's story as the router saw it (perf_counter times, seconds)."""

    __slots__ = (
        "answered", "arrived", "attempt_at", "attempts", "choice", "disconnected",
        "error_body", "first_attempt", "method", "path", "pool", "received", "request_id",
        "sse", "started", "status", "tried",
    )  # fmt: skip

    def __init__(self, method: str, path: str, arrived: float) -> None:
        self.method = method
        self.path = path
        self.arrived = arrived
        self.received: float | None = None
        """The whole body was in."""
        self.pool = ""
        """The pool's name once one was chosen."""
        self.choice: RouteChoice | None = None
        """The latest attempt's routing decision."""
        self.attempts = 0
        self.tried: set[str] = set()
        """The replicas the attempts went to."""
        self.first_attempt: float | None = None
        self.attempt_at: float | None = None
        self.status = 0
        self.started: float | None = None
        """The response's head went to the client."""
        self.answered = False
        """A replica's response (``x-kvrouter-replica``), not one of the router's own."""
        self.sse = False
        self.request_id: str | None = None
        self.disconnected = False
        self.error_body = b""

    # -- what the proxy reports ---------------------------------------------------------

    def body_received(self) -> None:
        self.received = time.perf_counter()

    def attempt(self, choice: RouteChoice) -> None:
        """An attempt is about to go to ``choice``'s chosen replica."""
        now = time.perf_counter()
        if self.first_attempt is None:
            self.first_attempt = now
        self.attempt_at = now
        self.attempts += 1
        self.tried.add(choice.decision.chosen.key[0])
        self.choice = choice

    # -- what the wrapper sees ------------------------------------------------------------

    def response_started(self, message: dict[str, Any]) -> None:
        self.started = time.perf_counter()
        self.status = message["status"]
        for k, v in message.get("headers") or ():
            if k == b"x-kvrouter-replica":
                self.answered = True
            elif k == b"x-request-id":
                self.request_id = v.decode("latin-1")
            elif k == b"content-type":
                self.sse = v.startswith(b"text/event-stream")

    def final_status(self) -> int:
        if self.status:
            return self.status
        return 499 if self.disconnected else 500

    def decision(self) -> dict[str, Any]:
        """The routing decision's fields of the log line (empty when none was made)."""
        choice = self.choice
        if choice is None:
            return {}
        d = choice.decision
        key = d.chosen.key
        predicted = best = None
        if choice.prediction is not None:
            predicted = best = 0
            for h in choice.prediction.replicas:
                best = max(best, h.hit_tokens)
                if h.replica == key:
                    predicted = h.hit_tokens
        return {
            "replica": key[0],
            "dp_rank": key[1],
            "num_tokens": choice.num_tokens,
            "predicted_hit": predicted,
            "best_hit": best,
            "policy": d.policy,
            "reason": decision_reason(choice.prediction, d, choice.reason, self.attempts),
            "tied": d.tied,
            "attempts": self.attempts,
        }

    def error_message(self) -> str | None:
        """The message of the router's own error answer (it names no replica address)."""
        if not self.error_body:
            return None
        try:
            return str(msgspec.json.decode(self.error_body)["error"]["message"])
        except Exception:  # not an OpenAI error (a truncated body): say what it was
            return self.error_body[:200].decode("utf-8", "replace")


def outcome_of(scope: dict[str, Any]) -> Outcome:
    """The request's :class:`Outcome` (a detached one when the app was not wrapped by
    :func:`observe`, as when the proxy is driven on its own)."""
    out = scope.get(OUTCOME)
    if out is None:
        out = Outcome(scope.get("method", ""), scope.get("path", ""), time.perf_counter())
    return out


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return v.decode("latin-1")
    return None


def finish(
    out: Outcome,
    ended: float,
    metrics: RouterMetrics,
    request_id: str | None,
    decisions: DecisionLog | None = None,
) -> None:
    """Count, time, keep (``decisions``) and log one request (module docstring)."""
    status = out.final_status()
    pool = out.pool
    choice = out.choice
    replica = choice.decision.chosen.key[0] if out.answered and choice is not None else ""
    metrics.requests.labels(pool, replica, str(status), f"{status // 100}xx").inc()
    if choice is not None:
        for name in out.tried - choice.pool.replicas.keys():
            # removed while this request ran: its series were dropped then, and this
            # request's own counts (above, a failover, its prediction check) brought some
            # back; the last of its requests to end leaves none
            metrics.forget_replica(pool, name)
    total = ended - out.arrived
    metrics.request_seconds.labels(pool).observe(total)
    added = ttft = None
    if out.first_attempt is not None and out.received is not None:
        added = out.first_attempt - out.received
        metrics.router_added.labels(pool).observe(added)
    if out.sse and out.answered and out.started is not None and out.attempt_at is not None:
        ttft = out.started - out.attempt_at
        metrics.upstream_ttft.labels(pool).observe(ttft)
    if decisions is not None and choice is not None:
        decisions.record(
            Kept(time.time(), request_id, pool, choice.decision, choice.prediction,
                 choice.speculative, choice.admission, choice.num_tokens, choice.reason,
                 out.attempts, status, choice.cached_tokens, added, total)
        )  # fmt: skip
    level = logging.WARNING if status >= 500 else logging.INFO
    if not log.isEnabledFor(level):
        return
    fields: dict[str, Any] = {"request_id": request_id, "pool": pool or None}
    fields.update(out.decision())
    fields["status"] = status
    fields["stream"] = out.sse
    fields["router_ms"] = None if added is None else round(added * 1000, 3)
    fields["ttft_ms"] = None if ttft is None else round(ttft * 1000, 3)
    fields["total_ms"] = round(total * 1000, 3)
    if out.disconnected:
        fields["client_disconnected"] = True
    error = out.error_message()
    if error is not None:
        fields["error"] = error
    log.log(level, "%s %s %d", out.method, out.path, status, extra=kv(**fields))


def observe(app: Any, metrics: RouterMetrics, decisions: DecisionLog | None = None) -> Any:
    """``app`` with every ``/v1/*`` request counted, timed and logged, and its routing
    decision kept in ``decisions`` (module docstring)."""

    async def observed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await app(scope, receive, send)
            return
        out = Outcome(scope["method"], scope["path"], time.perf_counter())
        scope[OUTCOME] = out

        async def sent(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                out.response_started(message)
            elif not out.answered and out.status >= 400:
                room = _ERROR_BODY_MAX - len(out.error_body)
                if room > 0:
                    out.error_body += message.get("body", b"")[:room]
            await send(message)

        async def received() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect":
                out.disconnected = True
            return message

        try:
            await app(scope, received, sent)
        finally:
            ended = time.perf_counter()
            rid = out.request_id or _header(scope, b"x-request-id")
            try:
                finish(out, ended, metrics, rid, decisions)
            except Exception:  # accounting must never turn a served request into an error
                log.exception("could not account for request %s", rid)

    return observed
