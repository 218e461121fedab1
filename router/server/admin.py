"""``/admin``: read and command the very objects the proxy uses (no second copy of state).

Who may call it is decided before a body byte is read, by :mod:`router.server.doors`
(``Authorization: Bearer <server.admin_token>``, loopback ``Host`` when no token is set,
JSON content type and no cross-site ``Origin`` for changes). The router's dependency asks the
same ``guard`` again, so these routes stay locked wherever they are mounted; its
``HTTPBearer`` scheme documents the token in the OpenAPI schema. What a replica added here may
be (endpoint schemes, bind, the model it serves) is :mod:`router.server.admission`'s. Errors
are OpenAI errors (:mod:`router.server.errors`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request, Security
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, Field

from events.subscriber import SubscriberError
from router.config import ReplicaConfig
from router.core.snapshot import encode_snapshot
from router.server.admission import check_endpoints, check_models
from router.server.decisions import DECISIONS_KEPT
from router.server.doors import Refusal
from router.server.errors import ApiError
from router.server.logs import kv
from router.server.state import PoolState, RouterState

__all__ = ["admin_router"]

log = logging.getLogger("kvrouter.admin")


def _changed(what: str, request: Request, pool: PoolState, name: str, **more: Any) -> None:
    """Log an admin change (INFO), with who asked: an operator reading the log after an
    incident sees each replica added, removed, drained or undrained, and from where."""
    client = request.client
    log.info(
        "replica %s %s",
        name,
        what,
        extra=kv(
            change=what,
            pool=pool.name,
            replica=name,
            client=f"{client.host}:{client.port}" if client else None,
            **more,
        ),
    )


class ExplainRequest(BaseModel):
    """Exactly one of ``prompt``, ``messages`` or ``token_ids``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    cache_salt: str | None = None
    add_special_tokens: bool | None = None


class ReplicaHitRow(BaseModel):
    replica: str
    dp_rank: int
    hit_tokens: int = Field(description="the events-only predicted hit on this replica")
    trust: str = Field(description="exact, partial (a lower bound) or untrusted (0)")


class DecisionRow(BaseModel):
    """One routed request's decision (router.server.decisions)."""

    time: float = Field(description="Unix seconds when the request ended")
    request_id: str | None
    pool: str
    replica: str = Field(description="the chosen replica (the last attempt's)")
    dp_rank: int
    policy: str
    reason: str = Field(
        description="best_hit, load (a larger hit passed over for load), no_hit, failover, "
        "untokenized[:why]"
    )
    tied: int
    attempts: int
    status: int = Field(description="the status the client got")
    num_tokens: int
    tokenized: bool
    predicted_hit: int | None = Field(description="events-only hit on the chosen replica")
    expected_hit: int | None = Field(
        description="admission-time hit (events + requests routed ahead), what the score used"
    )
    best_hit: int | None = Field(description="the largest predicted hit on any replica")
    cached_tokens: int | None = Field(
        description="usage.prompt_tokens_details.cached_tokens of the answer, when reported"
    )
    trust: str | None
    limiting_group: str | None = Field(
        description="the spec group that lowered the chosen replica's hit last"
    )
    longest_group_hit: int | None = Field(
        description="the largest single-group result of the hybrid loop on the chosen replica"
    )
    hits: list[ReplicaHitRow]
    router_ms: float | None = Field(description="body received to the first attempt sent")
    total_ms: float


class DecisionsOut(BaseModel):
    decisions: list[DecisionRow] = Field(description=f"oldest first, at most {DECISIONS_KEPT}")


class ReplicaIn(BaseModel):
    """A replica to add; the same fields as a ``[[pools.replicas]]`` table."""

    pool: str = Field(description="the pool's model name")
    replica: dict[str, Any]
    verify_model: bool = Field(
        True,
        description="check the replica's GET /v1/models lists the pool's model (and aliases) "
        "before adding it; false adds a replica that is not up yet",
    )


def admin_router(
    state: RouterState, guard: Callable[[dict[str, Any]], Refusal | None]
) -> APIRouter:
    """The ``/admin`` routes; ``guard`` is :meth:`router.server.doors.Doors.admin`."""
    bearer = HTTPBearer(auto_error=False, description="server.admin_token, when set")

    def locked(request: Request) -> None:
        refusal = guard(request.scope)
        if refusal is not None:
            raise ApiError(
                refusal.status,
                refusal.message,
                headers={k.decode(): v.decode() for k, v in refusal.headers},
            )

    r = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Security(bearer), Depends(locked)])

    def pool_of(model: str | None, param: str = "model") -> PoolState:
        p = state.pool_for(model)
        if p is None:
            raise ApiError(404, f"no pool serves model {model!r}; see GET /v1/models", param)
        return p

    def find_replica(name: str) -> tuple[PoolState, Any]:
        for p in state.pools.values():
            if name in p.replicas:
                return p, p.replicas[name]
        raise ApiError(404, f"no replica named {name!r}; see GET /admin/replicas", "name")

    @r.get("/replicas", summary="Replicas of every pool with their load and state")
    async def replicas() -> dict[str, Any]:
        out = []
        for p in state.pools.values():
            trust = {(s.replica, s.dp_rank): s for s in p.index.stats()}
            for rep in p.replicas.values():
                d = rep.as_dict()
                d["pool"] = p.name
                mine = [k for k in trust if k[0] == rep.name]
                d["trusted"] = {f"dp{k[1]}": trust[k].trusted for k in mine}
                d["trust"] = {f"dp{k[1]}": trust[k].trust for k in mine}
                out.append(d)
        return {"replicas": out}

    @r.get("/discovery", summary="Each discovering pool's pod watch: resourceVersion, pods")
    async def discovery() -> dict[str, Any]:
        return {
            "pools": [
                {"pool": p.name, **p.discovery.as_dict()}
                for p in state.pools.values()
                if p.discovery is not None
            ]
        }

    @r.post("/replicas", status_code=201, summary="Add a replica to a pool")
    async def add_replica(body: ReplicaIn, request: Request) -> dict[str, Any]:
        pool = pool_of(body.pool, "pool")
        try:
            rcfg = msgspec.convert(body.replica, ReplicaConfig)
        except msgspec.ValidationError as exc:
            raise ApiError(422, f"replica: {exc}", "replica") from None
        if rcfg.name in pool.replicas:
            raise ApiError(409, f"replica {rcfg.name!r} already exists in pool {pool.name!r}",
                           "replica.name")  # fmt: skip
        check_endpoints(rcfg, state.config.server)
        if body.verify_model:
            await check_models(rcfg, pool.cfg, state.config.server)
        try:
            rep = await pool.add_replica(rcfg, source="admin")
        except (ValueError, SubscriberError) as exc:  # EndpointError: cannot bind / connect
            raise ApiError(409, str(exc), "replica") from None
        _changed("added", request, pool, rcfg.name, url=rcfg.url, dp_ranks=rep.ranks)
        return rep.as_dict()

    @r.delete(
        "/replicas/{name}",
        summary="Remove a replica: its index state is dropped and the requests still in flight "
        "on it are cut (drain it first and wait for in_flight 0 to remove it gracefully)",
    )
    async def remove_replica(name: str, request: Request) -> dict[str, Any]:
        pool, _ = find_replica(name)
        await pool.remove_replica(name)
        _changed("removed", request, pool, name)
        return {"removed": name}

    @r.post("/replicas/{name}/drain", summary="Stop routing new requests to a replica")
    async def drain(name: str, request: Request) -> dict[str, Any]:
        pool, rep = find_replica(name)
        rep.drained = True
        _changed("drained", request, pool, name)
        return rep.as_dict()

    @r.post("/replicas/{name}/undrain", summary="Route to a drained replica again")
    async def undrain(name: str, request: Request) -> dict[str, Any]:
        pool, rep = find_replica(name)
        rep.drained = False
        _changed("undrained", request, pool, name)
        return rep.as_dict()

    @r.post("/route/explain", summary="Where a request would go and why, without sending it")
    async def explain(body: ExplainRequest) -> dict[str, Any]:
        pool = pool_of(body.model)
        given = [x for x in (body.prompt, body.messages, body.token_ids) if x is not None]
        if len(given) != 1:
            raise ApiError(422, "give exactly one of prompt, messages or token_ids")
        req: dict[str, Any] = {"cache_salt": body.cache_salt}
        if body.add_special_tokens is not None:
            req["add_special_tokens"] = body.add_special_tokens
        if body.token_ids is not None:
            ids, reason = body.token_ids, None
        else:
            kind = "chat" if body.messages is not None else "completion"
            if kind == "chat":
                req["messages"] = body.messages
            else:
                req["prompt"] = body.prompt
            tok = await pool.tokenizer.tokenize(kind, req)  # type: ignore[arg-type]
            ids, reason = tok.token_ids, tok.reason
        t0 = time.perf_counter()
        try:
            choice = pool.decide(ids, req, explain=True, reason=reason)
        except Exception as exc:  # NoCandidates
            raise ApiError(503, str(exc)) from None
        elapsed = time.perf_counter() - t0
        scores = {s.key: s for s in choice.decision.ranked}
        rows = []
        hits = choice.prediction.as_dict()["replicas"] if choice.prediction else []
        by_key = {(h["replica"], h["dp_rank"]): h for h in hits}
        spec = choice.speculative.as_dict()["replicas"] if choice.speculative else []
        spec_by_key = {(h["replica"], h["dp_rank"]): h for h in spec}
        cands = {c.key: c for c in pool.candidates(None, set())}
        now, wall = time.monotonic(), time.time()
        rotation, panic = pool.rotation(now)
        for key, s in scores.items():
            row = dict(by_key.get(key, {"replica": key[0], "dp_rank": key[1]}))
            rep = pool.replicas.get(key[0])
            row["health"] = rep.health.as_dict(now, wall) if rep is not None else None
            c = cands.get(key)
            row["load"] = (
                {
                    "in_flight": c.in_flight,
                    "pending_prefill_tokens": c.pending_prefill_tokens,
                    "recent_new_tokens": round(c.recent_new_tokens),
                    "running": c.running,
                    "waiting": c.waiting,
                    "kv_usage": c.kv_usage,
                }
                if c is not None
                else None
            )
            sp = spec_by_key.get(key)
            # hit_tokens above is the events-only prediction; the admission-time one adds the
            # requests routed ahead (the speculative overlay) and is what the score used
            row["expected_hit_tokens"] = (
                sp["hit_tokens"] if sp is not None else row.get("hit_tokens", 0)
            )
            row["speculative"] = (
                {
                    "hit_tokens": sp["hit_tokens"],
                    "spec_group_hits": sp.get("spec_group_hits"),
                    "limiting_group": sp.get("limiting_group"),
                }
                if sp is not None
                else None
            )
            # and what vLLM will find at admission: that, minus what the requests queued ahead
            # there will evict first (router.core.eviction_forecast)
            forecast = pool.forecast_explained(key, ids, req, choice.in_flight_hit(key))
            row["admission_hit_tokens"] = (
                forecast.pop("hit_tokens")
                if forecast is not None and forecast.get("hit_tokens") is not None
                else row["expected_hit_tokens"]
            )
            row["eviction_forecast"] = forecast
            row["score"] = s.as_dict()
            rows.append(row)
        chosen = choice.decision.chosen.key
        # Replicas that were not candidates, and why (drained, down, ejected, on trial).
        in_rotation = {r.name for r in rotation} if not panic else {chosen[0]}
        excluded = [
            {
                "replica": rep.name,
                "reason": "drained" if rep.drained else rep.health.state(now),
                "health": rep.health.as_dict(now, wall),
            }
            for rep in pool.replicas.values()
            if rep.name not in in_rotation
        ]
        return {
            "pool": pool.name,
            "policy": choice.decision.policy,
            "num_tokens": choice.num_tokens,
            "tokenized": ids is not None,
            "untokenized_reason": reason,
            "chosen": {"replica": chosen[0], "dp_rank": chosen[1]},
            "tied": choice.decision.tied,
            "fair_share_overrode": [
                {"replica": k[0], "dp_rank": k[1]} for k in choice.decision.crowded
            ],
            "decision_seconds": elapsed,
            "speculative_entries": (
                len(pool.speculative) if pool.speculative is not None else None
            ),
            "prefix_home_chunks": len(pool.homes) if pool.homes is not None else None,
            "panic": panic,
            "replicas": rows,
            "excluded": excluded,
        }

    @r.get(
        "/index/snapshot",
        summary="The whole index with each stream's last applied batch (msgpack, versioned)",
        response_class=Response,
    )
    async def index_snapshot() -> Response:
        # What a router starting with index.bootstrap_peer = this URL loads (router.core.snapshot).
        data = encode_snapshot(state.index_snapshot())
        return Response(data, media_type="application/vnd.msgpack")

    @r.get("/index", summary="Index entries and bytes per pool, group, replica and tier")
    async def index() -> dict[str, Any]:
        out = []
        for p in state.pools.values():
            idx = p.index
            layout = idx.layout
            n_groups = len(layout.layout.groups) if layout is not None else 0
            per: dict[str, dict[str, dict[str, int]]] = {}
            keys = idx.replicas()
            bits = {k: idx.slot_bit(k) for k in keys}
            for tier in idx.tiers():
                for g in range(n_groups):
                    table = idx.table(tier, g)
                    if not table:
                        continue
                    counts = dict.fromkeys(keys, 0)
                    for m in table.values():
                        for k, b in bits.items():
                            if m & b:
                                counts[k] += 1
                    for k, n in counts.items():
                        name = f"{k[0]}/dp{k[1]}"
                        per.setdefault(name, {}).setdefault(tier, {})[str(g)] = n
            out.append(
                {
                    "pool": p.name,
                    "entries": idx.entries,
                    "extra_entries": idx.extra_entries,
                    "bytes": idx.nbytes(),
                    "max_bytes": idx.limits.max_bytes,
                    "reclaimed": idx.reclaimed,
                    "groups": (
                        [msgspec.to_builtins(g) for g in layout.layout.groups] if layout else []
                    ),
                    "layout": msgspec.to_builtins(idx.layout_state()),
                    "replicas": per,
                }
            )
        return {"pools": out}

    @r.get(
        "/layout",
        summary="Per pool: the layout in use and, if learned, the quorum over the replicas' views",
    )
    async def layout() -> dict[str, Any]:
        # status: declared, unknown, learned, provisional, confirmed or contested; each view
        # with the replicas holding it; who is held back (router.core.layout_quorum)
        return {
            "pools": [
                {"pool": p.name, **msgspec.to_builtins(p.index.layout_state())}
                for p in state.pools.values()
            ]
        }

    @r.get("/events", summary="Per event stream: sequence, lag, gaps, replays, trust")
    async def events() -> dict[str, Any]:
        out = []
        for p in state.pools.values():
            rstats = {(s.replica, s.dp_rank): s for s in p.index.stats()}
            for rep in p.replicas.values():
                sub_stats = rep.subscriber.stats() if rep.subscriber is not None else {}
                for sname, key in rep.streams.items():
                    st = sub_stats.get(sname)
                    rs = rstats.get(key)
                    out.append(
                        {
                            "stream": sname,
                            "pool": p.name,
                            "replica": key[0],
                            "dp_rank": key[1],
                            "stream_stats": msgspec.to_builtins(st) if st else None,
                            "trusted": rs.trusted if rs else None,
                            "untrusted_reason": rs.untrusted_reason if rs else None,
                            "trust": rs.trust if rs else None,
                            "partial_reason": rs.partial_reason if rs else None,
                            "inferred_blocks": rs.inferred_blocks if rs else None,
                            "hash_conformance": (
                                {
                                    "checked": rs.conformance_checked,
                                    "mismatches": rs.conformance_mismatches,
                                    "skipped": rs.conformance_skipped,
                                    "ok": rs.conformance_mismatches == 0,
                                }
                                if rs
                                else None
                            ),
                            "index": msgspec.to_builtins(rs) if rs else None,
                        }
                    )
        return {"streams": out}

    @r.get("/config", summary="The effective config (secrets redacted)")
    async def config() -> dict[str, Any]:
        return state.config.redacted()

    @r.get(
        "/decisions",
        summary="The last routing decisions: chosen replica, predicted and reported hits",
        response_model=DecisionsOut,
    )
    async def decisions() -> dict[str, Any]:
        return {"decisions": state.decisions.rows()}

    @r.get("/mismatches", summary="Latest requests whose cached_tokens differed from the hit")
    async def mismatches() -> dict[str, Any]:
        return {"mismatches": list(state.mismatches)}

    return r
