"""The OpenAI-compatible hot path: read, tokenize, predict, choose, forward, check.

Raw ASGI (no framework on the hot path; see bench/proxy_bench.py for what it costs).

* Bodies above ``server.max_body_bytes`` get 413 before anything is parsed. A body that is
  not a JSON object (invalid JSON or UTF-8, nested too deep), or whose fields the router reads
  (``model``, ``prompt``, ``messages``, ``stream``, ``cache_salt``) have the wrong type, gets
  400; every error is an OpenAI error (:mod:`router.server.errors`) and names no replica
  address (those go to the log and ``GET /admin/replicas``' ``last_error``).
* Hop-by-hop headers are dropped both ways; ``x-request-id`` is propagated or created.
* **Failover.** The upstream response is not forwarded until its first chunk is in. A connect
  error, a timeout or a 5xx before that moves to the next replica in the decision's ranking
  (at most ``server.max_attempts``). Non-streaming JSON is read whole before its first byte is
  sent (it is one object, and a replica dying mid-body can still be failed over); SSE is
  forwarded chunk by chunk as it arrives. After the first byte has gone to the client, an
  upstream failure ends the stream with a well-formed error event and ``data: [DONE]``.
* **Health.** Every attempt's outcome (first byte, or failure before it) feeds the replica's
  health (router.server.health): consecutive failures eject it, and ejected or down
  replicas are not candidates (``PoolState.rotation``).
* **Time limits.** ``server.ttfb_timeout_s`` (streaming requests) and
  ``server.ttfb_timeout_nonstream_s`` bound the wait for a replica's first response byte; on
  expiry the next replica is tried, as for any failure before the first byte. When the last
  attempt timed out the client gets 504 (else 502). After the first byte,
  ``server.read_timeout_s`` bounds each silence.
* **Cancellation.** Once the request body is read, a task awaits the client's ``receive``
  channel: the server reports ``http.disconnect`` there when the client's connection closes
  (``send`` to a closed connection returns silently, so nothing else would tell). The
  request's task is then cancelled wherever it waits (tokenizing, on the replica's answer, in
  the middle of a stream); unwinding closes the replica's connection (never back to the
  keep-alive pool), which is how vLLM learns to abort the request. Counted in
  ``kvrouter_client_disconnects_total{pool,phase}``.
* Response headers ``x-kvrouter-replica`` (``name`` or ``name/dp<rank>`` with several ranks),
  ``x-kvrouter-predicted-hit`` (the hit the events confirm), ``x-kvrouter-in-flight-hit``
  (plus the blocks the requests routed there ahead of this one will cache,
  router.core.speculative) and ``x-kvrouter-expected-hit`` (the admission-time hit: that,
  minus what their allocations will evict first, router.core.eviction_forecast) say where
  the request went and what hit was expected.
* **Prediction error loop.** When the response carries
  ``usage.prompt_tokens_details.cached_tokens`` it is compared with the prediction for the
  chosen replica: metrics per replica, and mismatches kept for ``GET /admin/mismatches``.
  The hot path predicts without per-group hits (they cost extra probes), so on a mismatch the
  prediction is explained once more for that replica: its ``spec_group_hits`` fill the logged
  row, and the whole re-explained row is kept as ``explained_at_detection`` (computed when the
  response came back: the index may hold this request's own blocks by then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import msgspec

from router.core.predict import ReplicaHit
from router.server.errors import error_body, send_error
from router.server.health import attempt_answered, attempt_failed, begin_attempt, end_attempt
from router.server.logs import kv
from router.server.outcome import outcome_of
from router.server.state import ReplicaState, RouteChoice, RouterState
from router.server.stream_usage import UsageStripper, reported_cached_tokens, request_usage
from router.server.upstream import UpstreamError

__all__ = ["HOP_BY_HOP", "Proxy"]

log = logging.getLogger("kvrouter.proxy")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
# Upstream response headers not forwarded: hop-by-hop, framing (the server frames anew), and
# date/server, which the router's HTTP server adds itself (no duplicates).
_DROP_DOWN = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server"}
)
_decode = msgspec.json.Decoder()
_encode = msgspec.json.encode
_TAIL = 8192


def _field_problem(kind: str, body: dict[str, Any]) -> tuple[str, str] | None:
    """(param, message) for a field the router reads whose type is wrong, else None. vLLM
    refuses these too; the router must, since it acts on them (``stream: "false"`` would be
    streamed)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return "model", "`model` must be a string"
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "stream", "`stream` must be true or false"
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return "cache_salt", "`cache_salt` must be a string"
    if kind == "completion":
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, (str, list)):
            return "prompt", "`prompt` must be a string, a list of strings or token ids"
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return "messages", "`messages` must be a list of message objects"
    return None


def _decode_problem(raw: bytes) -> tuple[Any, str | None]:
    """The decoded body, or None and why it cannot be (a client's fault, never a 500)."""
    try:
        return _decode.decode(raw), None
    except msgspec.DecodeError as exc:
        return None, f"the body is not valid JSON: {exc}"
    except UnicodeDecodeError as exc:
        return None, f"the body is not valid UTF-8 at byte {exc.start}"
    except RecursionError:
        return None, "the body's JSON is nested too deeply"


class _Upstream(Exception):
    """An attempt that failed before the first byte reached the client."""

    def __init__(
        self, why: str, response: tuple[int, list, bytes] | None = None, timeout: bool = False
    ) -> None:
        super().__init__(why)
        self.response = response
        self.timeout = timeout


class _ClientWatch:
    """Whether the client is still connected while its answer is prepared and forwarded.

    :meth:`start` (after the request body was read) runs a task that awaits ``receive``:
    from then on the server returns from it only with ``http.disconnect``, when the client's
    connection is lost or the response is complete. Before completion it means the client is
    gone, and the request's task is cancelled. :meth:`send` wraps the server's ``send`` to
    know whether the response started (the phase counted) or completed (a late disconnect
    message then means nothing).
    """

    __slots__ = ("_send", "_task", "_watcher", "complete", "gone", "pool", "started")

    def __init__(self) -> None:
        self._watcher: asyncio.Task[None] | None = None
        self.gone = self.started = self.complete = False
        self.pool = ""

    def start(self, receive: Any, send: Any, pool: str) -> Any:
        """Watch the client from now on; returns the ``send`` to use."""
        self._send = send
        self.pool = pool
        self._task = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        return self.send

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.complete and self._task is not None:
            self.gone = True
            self._task.cancel()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    def stop(self) -> None:
        # after a complete response the server wakes the watcher itself (cheaper than a cancel)
        if self._watcher is not None and not self.complete:
            self._watcher.cancel()


class Proxy:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.cfg = state.config.server
        self._m = state.metrics
        self._ttfb = {True: self.cfg.ttfb_timeout_s, False: self.cfg.ttfb_timeout_nonstream_s}

    async def _send_simple(
        self,
        send: Any,
        status: int,
        message: str,
        request_id: bytes,
        *,
        param: str | None = None,
        reason: str | None = None,
    ) -> None:
        """An OpenAI error; ``reason``: count it as a refusal with this label."""
        if reason is not None:
            self._m.refused.labels(reason).inc()
        await send_error(
            send, status, message, param=param, headers=((b"x-request-id", request_id),)
        )

    async def handle(self, kind: str, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Serve one request; a client that goes away cancels it (module docstring)."""
        watch = _ClientWatch()
        try:
            await self._handle(kind, scope, receive, send, watch)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not watch.gone or task is None:
                raise  # a shutdown, not this client
            task.uncancel()
            phase = "streaming" if watch.started else "waiting"
            self._m.client_disconnects.labels(watch.pool, phase).inc()
            log.debug("client gone (%s); its upstream request is closed", phase)
        finally:
            watch.stop()

    async def _handle(
        self, kind: str, scope: dict[str, Any], receive: Any, send: Any, watch: _ClientWatch
    ) -> None:
        out = outcome_of(scope)  # what it decided, for the request's metrics and log line
        limit = self.cfg.max_body_bytes
        request_id = None
        fwd: list[tuple[bytes, bytes]] = []
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                request_id = v
            elif k == b"content-length" and v.isdigit() and int(v) > limit:
                await self._too_large(send, request_id or b"-")
                return
            if k not in HOP_BY_HOP:
                fwd.append((k, v))
        if request_id is None:
            request_id = uuid.uuid4().hex.encode()
            fwd.append((b"x-request-id", request_id))
        # body
        chunks = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            b = msg.get("body", b"")
            if b:
                size += len(b)
                if size > limit:
                    await self._too_large(send, request_id)
                    return
                chunks.append(b)
            if not msg.get("more_body"):
                break
        out.body_received()
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        body, problem = _decode_problem(raw)
        if problem is None and not isinstance(body, dict):
            problem = "the body must be a JSON object"
        if problem is not None:
            await self._send_simple(send, 400, problem, request_id, reason="malformed_body")
            return
        field = _field_problem(kind, body)
        if field is not None:
            await self._send_simple(
                send, 400, field[1], request_id, param=field[0], reason="bad_field"
            )
            return
        model = body.get("model")
        pool = self.state.pool_for(model)
        if pool is None:
            if model is None:
                msg = (
                    "`model` is required: this router serves "
                    f"{', '.join(sorted(self.state.models))} (GET /v1/models)"
                )
                await self._send_simple(
                    send, 400, msg, request_id, param="model", reason="no_model"
                )
                return
            msg = f"The model `{model}` does not exist; GET /v1/models lists the models served"
            await self._send_simple(
                send, 404, msg, request_id, param="model", reason="unknown_model"
            )
            return
        out.pool = pool.name
        rewrite = False
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and xargs.get("kv_cache_report_mode") == "full":
            action = self.cfg.report_mode_full
            self._m.report_mode_full.labels(pool.name, action).inc()
            if action == "refuse":
                msg = (
                    'vllm_xargs.kv_cache_report_mode = "full" is refused by this router: vLLM '
                    "then re-announces reused blocks as new stores, which would make the "
                    "router's view of the replica's cache wrong; drop the key"
                )
                await self._send_simple(
                    send, 400, msg, request_id, param="vllm_xargs", reason="report_mode_full"
                )
                return
            rest = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
            body = (
                {**body, "vllm_xargs": rest}
                if rest
                else {k: v for k, v in body.items() if k != "vllm_xargs"}
            )
            rewrite = True
        send = watch.start(receive, send, pool.name)
        t0 = time.perf_counter()
        tok = await pool.tokenizer.tokenize(kind, body)  # type: ignore[arg-type]
        if tok.token_ids is None:
            self._m.untokenized.labels(pool.name, tok.reason or "unknown").inc()
        stream = bool(body.get("stream"))
        strip_usage = False
        if stream and self.cfg.stream_usage and request_usage(body):
            # the answer's cached_tokens feed the prediction loop and learning (a partial
            # replica); the client, which did not ask for usage, will not see it
            strip_usage = True
            rewrite = True
        if rewrite:
            raw = _encode(body)
        exclude: set[tuple[str, int]] = set()
        last_error: _Upstream | None = None
        path = scope.get("raw_path") or scope["path"].encode()
        qs = scope.get("query_string") or b""
        url = path.decode() + ("?" + qs.decode() if qs else "")
        for attempt in range(self.cfg.max_attempts):
            try:
                choice = pool.decide(tok.token_ids, body, exclude, reason=tok.reason)
            except Exception as exc:  # NoCandidates
                if last_error is not None:
                    break
                await self._send_simple(send, 503, str(exc), request_id)
                return
            if attempt == 0:
                self._m.decision_seconds.labels(pool.name).observe(time.perf_counter() - t0)
            chosen = choice.decision.chosen
            key = chosen.key
            exclude.add(key)
            rep = pool.replicas.get(key[0])
            if rep is None:
                continue
            out.attempt(choice)
            trial = begin_attempt(rep)  # replica health (router.server.health)
            try:
                await self._forward(
                    rep, key, choice, url, fwd, raw, stream, send, request_id, strip_usage
                )
                return
            except _Upstream as exc:
                last_error = exc
                pool.failed_over(choice)
                attempt_failed(pool, rep, str(exc))
                rep.last_error = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {rep.cfg.url}: {exc}"
                self._m.failovers.labels(pool.name, key[0]).inc()
                log.warning(
                    "replica %s failed before the first byte",
                    key[0],
                    extra=kv(
                        request_id=request_id.decode("latin-1"), pool=pool.name,
                        replica=key[0], dp_rank=key[1], url=rep.cfg.url, error=str(exc),
                    ),
                )  # fmt: skip
            finally:
                end_attempt(rep, trial)
        if last_error is not None and last_error.response is not None:
            status, headers, data = last_error.response
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return
        # the causes name replica addresses: they are in the log and /admin, not for clients
        timed_out = last_error is not None and last_error.timeout
        what = "answered in time" if timed_out else "could serve the request"
        msg = (
            f"no replica {what} (request id {request_id.decode('latin-1')}; "
            "the causes are in the router's log and GET /admin/replicas)"
        )
        await self._send_simple(send, 504 if timed_out else 502, msg, request_id)

    async def _too_large(self, send: Any, request_id: bytes) -> None:
        limit = self.cfg.max_body_bytes
        msg = f"request body exceeds {limit} bytes (server.max_body_bytes)"
        await self._send_simple(send, 413, msg, request_id, reason="body_too_large")

    async def _forward(
        self,
        rep: ReplicaState,
        key: tuple[str, int],
        choice: RouteChoice,
        url: str,
        fwd: list[tuple[bytes, bytes]],
        raw: bytes,
        stream: bool,
        send: Any,
        request_id: bytes,
        strip_usage: bool = False,
    ) -> None:
        rank = key[1]
        headers = list(fwd)
        if (rank_header := rep.cfg.rank_header) is not None:
            headers.append((rank_header.encode(), str(rank).encode()))
        # the events-only prediction, and the admission-time one (events + the requests
        # routed ahead of this one - the speculative overlay, when it could change the hit -
        # minus what their allocations will evict: the eviction forecast)
        hit: ReplicaHit | None = None
        if choice.prediction is not None:
            with contextlib.suppress(KeyError):
                hit = choice.prediction.hit(key)
        ahead = choice.in_flight_hit(key)
        expected = choice.expected_hit(key)
        predicted = hit.hit_tokens if hit is not None else 0
        label = key[0] if len(rep.ranks) == 1 else f"{key[0]}/dp{rank}"
        # the prefill it still owes uses the hit the policy ranked with: a request stacked on
        # an in-flight one with the same prefix (speculative hit) adds only its remainder
        pending = max(0, choice.num_tokens - choice.decision.chosen.hit_tokens)
        rep.request_started(rank, pending)  # its queued work (the pool's load-ordered book)
        attempt: int | None = None
        try:  # a partial replica's eviction-order proof must know what it may touch
            attempt = choice.pool.sending_to(key, choice.token_ids, choice.body or {})
        except Exception:
            log.exception("could not note a request sent to %s", key[0])
        finished = False  # its answer read whole (vLLM freed its blocks before the last byte)
        choice.sent_at = time.monotonic()
        choice.pool.wrote(rep, rank, pending)
        gauge = self._m.in_flight.labels(choice.pool.name, key[0])
        gauge.inc()
        first = True
        status = 0
        try:
            try:
                resp = await rep.upstream.post(url, raw, headers, ttfb_timeout=self._ttfb[stream])
            except UpstreamError as exc:
                raise _Upstream(str(exc), timeout=exc.timeout) from None
            try:
                status = resp.status
                out_headers = [
                    (k, v) for k, v in resp.headers if k not in _DROP_DOWN and k != b"x-request-id"
                ]
                out_headers += [
                    (b"x-request-id", request_id),
                    (b"x-kvrouter-replica", label.encode()),
                    (b"x-kvrouter-predicted-hit", str(predicted).encode()),
                    (b"x-kvrouter-expected-hit", str(_tokens(expected)).encode()),
                    (b"x-kvrouter-in-flight-hit", str(_tokens(ahead)).encode()),
                ]
                is_sse = stream and status == 200
                if not is_sse:
                    try:
                        data = await resp.read()
                    except UpstreamError as exc:
                        raise _Upstream(f"reading the body: {exc}") from None
                    finished = status < 500  # an engine error: when it freed is not said
                    if status >= 500:
                        raise _Upstream(
                            f"HTTP {status}",
                            (status, [*out_headers, _clen(data)], data),
                        )
                    rep.release_pending(rank, pending)
                    pending = 0
                    attempt_answered(choice.pool, rep)
                    choice.pool.answering(choice)
                    out_headers.append(_clen(data))
                    await send(
                        {"type": "http.response.start", "status": status, "headers": out_headers}
                    )
                    await send({"type": "http.response.body", "body": data})
                    first = False
                    if status == 200:
                        self._check(choice, hit, ahead, expected, key, label, data, request_id)
                    return
                tail = b""
                stripper = UsageStripper() if strip_usage else None
                try:
                    async for chunk in resp:
                        if first:
                            rep.release_pending(rank, pending)
                            pending = 0
                            attempt_answered(choice.pool, rep)
                            choice.pool.answering(choice)
                            await send(
                                {
                                    "type": "http.response.start",
                                    "status": status,
                                    "headers": out_headers,
                                }
                            )
                            first = False
                        tail = (tail + chunk)[-_TAIL:]
                        if stripper is not None:
                            chunk = stripper.feed(chunk)
                            if not chunk:
                                continue
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except UpstreamError as exc:
                    if first:
                        raise _Upstream(str(exc), timeout=exc.timeout) from None
                    rep.last_error = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} mid-stream: {exc}"
                    self._m.midstream_failures.labels(choice.pool.name, key[0]).inc()
                    log.warning(
                        "replica %s failed mid-stream",
                        key[0],
                        extra=kv(
                            request_id=request_id.decode("latin-1"), pool=choice.pool.name,
                            replica=key[0], dp_rank=rank, url=rep.cfg.url, error=str(exc),
                        ),
                    )  # fmt: skip
                    err = error_body(502, f"replica {label} failed mid-stream")
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"data: " + err + b"\n\ndata: [DONE]\n\n",
                            "more_body": False,
                        }
                    )
                    return
                if first:  # an empty 200 stream: say so rather than hang up
                    raise _Upstream("empty stream")
                finished = True
                rest = stripper.flush() if stripper is not None else b""
                await send({"type": "http.response.body", "body": rest, "more_body": False})
                if stripper is not None and stripper.usage is not None:
                    tail = stripper.usage
                self._check(choice, hit, ahead, expected, key, label, tail, request_id)
            finally:
                await resp.aclose()  # closes the connection unless the answer was read whole
        except asyncio.CancelledError:
            if first and choice.pool.speculative is not None:
                # the client left before any answer: the replica aborts; its events say what it kept
                choice.pool.speculative.discard(choice.insertion)
            raise
        finally:
            if choice.pool.speculative is not None:
                # in flight no more: its entries get the grace for its last events (a failover
                # discards them right after this, a cancelled start did above)
                choice.pool.speculative.finish(choice.insertion)
            choice.pool.ended(choice)
            rep.request_finished(rank, pending)
            gauge.dec()
            if attempt is not None:
                try:
                    choice.pool.sent_done(key, attempt, finished)
                except Exception:
                    log.exception("could not note the end of a request to %s", key[0])

    def _check(
        self,
        choice: RouteChoice,
        hit: ReplicaHit | None,
        ahead: ReplicaHit | None,
        expected: ReplicaHit | None,
        key: tuple[str, int],
        label: str,
        data: bytes,
        request_id: bytes,
    ) -> None:
        """Compare the reported hit with the prediction (prediction error loop); ``hit`` is
        the chosen replica's row of ``choice.prediction``, ``ahead`` the same counting the
        requests routed ahead, ``expected`` its admission-time row (``ahead`` after the
        eviction forecast). Only the events-only prediction feeds the mismatch log and
        learning: a request routed ahead that has not run yet explains an admission-time miss,
        not the index."""
        pred = choice.prediction
        if pred is None or hit is None:
            return
        actual = reported_cached_tokens(data)
        if actual is None:
            return
        choice.cached_tokens = actual
        predicted = hit.hit_tokens
        err = abs(actual - predicted)
        metrics = self._m
        pool, rank = choice.pool.name, str(key[1])
        outcomes = metrics.prediction_outcomes
        outcomes.labels(pool, "events", _outcome(predicted, actual)).inc()
        outcomes.labels(pool, "in_flight", _outcome(_tokens(ahead), actual)).inc()
        outcomes.labels(pool, "admission", _outcome(_tokens(expected), actual)).inc()
        metrics.prediction_checked.labels(pool, key[0], rank).inc()
        metrics.prediction_error.labels(pool, key[0], rank).observe(err)
        metrics.predicted_hit.labels(pool).observe(predicted)
        if choice.token_ids:
            # On a partial replica what it hit was touched (the eviction-order proof), and an
            # under-prediction says which blocks it cached before the router attached
            try:
                choice.pool.answered(
                    key,
                    choice.token_ids,
                    choice.body or {},
                    actual,
                    choice.sent_at,
                    learn=actual > predicted and hit.partial_reason is not None,
                )
            except Exception:  # an optimisation: never fail the response for it
                log.exception("could not learn from %s's cached_tokens", label)
        if err == 0:
            metrics.prediction_exact.labels(pool, key[0], rank).inc()
            return
        row = next(
            (r for r in pred.as_dict()["replicas"] if (r["replica"], r["dp_rank"]) == key), {}
        )
        explained = None
        if choice.token_ids and choice.body is not None:
            # The hot path predicts without explain (per-group hits cost extra probes); a
            # mismatch is rare, so the per-group hits are recomputed for this replica now.
            # The index may have moved since routing (this request's own stores included).
            try:
                again = choice.pool.predict(
                    choice.token_ids, choice.body, explain=True, replicas=[key]
                )
                explained = again.as_dict()["replicas"][0]
                if "spec_group_hits" in explained and row:
                    row = {**row, "spec_group_hits": explained["spec_group_hits"]}
            except Exception:  # the replica was removed meanwhile: keep the rest
                log.debug("could not re-explain a mismatch on %s", label, exc_info=True)
        self.state.record_mismatch(
            {
                "time": time.time(),
                "request_id": request_id.decode("latin-1"),
                "pool": choice.pool.name,
                "replica": label,
                "num_tokens": choice.num_tokens,
                "predicted": predicted,
                "cached_tokens": actual,
                "error": actual - predicted,
                "prediction": row,
                "explained_at_detection": explained,
            }
        )
        log.info(
            "prediction mismatch on replica %s",
            key[0],
            extra=kv(
                request_id=request_id.decode("latin-1"), pool=pool, replica=key[0],
                dp_rank=key[1], num_tokens=choice.num_tokens, predicted=predicted,
                cached_tokens=actual, error=actual - predicted, trust=hit.trust,
                limiting_group=row.get("limiting_group"),
            ),
        )  # fmt: skip


def _tokens(hit: ReplicaHit | None) -> int:
    return hit.hit_tokens if hit is not None else 0


def _outcome(predicted: int, actual: int) -> str:
    return "exact" if predicted == actual else "under" if predicted < actual else "over"


def _clen(data: bytes) -> tuple[bytes, bytes]:
    return (b"content-length", str(len(data)).encode())
