"""The last routing decisions, kept for ``GET /admin/decisions`` (and the ``/admin/ui`` page).

Recorded once per routed request when it ends (:mod:`router.server.outcome`'s ``finish``),
so a row can say what became of the decision: the status and vLLM's ``cached_tokens`` when
the answer reported it. Recording must cost the hot path nothing measurable, so
:meth:`DecisionLog.record` appends one :class:`Kept` tuple of references to objects the
decision already built (the :class:`~router.core.policy.Decision` and the
:class:`~router.core.predict.Prediction`s: a few small objects per replica, never the
request's body or token ids) to a bounded deque; the JSON rows are built only when read.

Per-group hits: the hot path predicts without ``explain`` (each spec group's standalone hit
costs extra probes and, for a request that misses early, hashing the whole prompt again:
measured ~1x the cost of the decision itself), so a row carries what the decision computed
anyway: the group that limited the chosen replica's hit (``limiting_group``) and the largest
single-group result of the hybrid loop (``longest_group_hit``: with full attention first, the
full-attention prefix hit). The standalone per-group hits of a request are what
``POST /admin/route/explain`` shows, and ``GET /admin/mismatches`` keeps them for every
request whose ``cached_tokens`` differed from the prediction.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

from router.core.policy import Decision
from router.core.predict import Prediction, ReplicaHit

__all__ = ["DECISIONS_KEPT", "DecisionLog", "Kept", "decision_reason"]

DECISIONS_KEPT = 50
"""Rows kept: enough for a page to show what just happened, bounded whatever the traffic."""


def decision_reason(
    prediction: Prediction | None, decision: Decision, untokenized: str | None, attempts: int
) -> str:
    """Why this replica: ``untokenized[:why]`` (routed by load alone), ``failover`` (an
    earlier attempt failed), ``no_hit`` (no candidate had a hit: load decided), ``best_hit``
    (the largest hit among the candidates), ``load`` (a candidate with a larger hit was
    passed over for its load)."""
    if prediction is None:
        return f"untokenized:{untokenized}" if untokenized else "untokenized"
    if attempts > 1:
        return "failover"
    ranked = decision.ranked
    top = max(s.hit_tokens for s in ranked)
    if top == 0:
        return "no_hit"
    return "best_hit" if ranked[0].hit_tokens >= top else "load"


def _hit(prediction: Prediction | None, key: tuple[str, int]) -> ReplicaHit | None:
    if prediction is None:
        return None
    for h in prediction.replicas:
        if h.replica == key:
            return h
    return None


class Kept(NamedTuple):
    """One decision as kept: references to what the request's decision already built."""

    wall: float
    request_id: str | None
    pool: str
    decision: Decision
    prediction: Prediction | None
    speculative: Prediction | None
    admission: ReplicaHit | None
    """The eviction forecast's hit on the chosen replica, when it lowered the expected one."""
    num_tokens: int
    untokenized: str | None
    """Why the request was not tokenized (routed by load), if it was not."""
    attempts: int
    status: int
    cached_tokens: int | None
    router_s: float | None
    total_s: float


class DecisionLog:
    """The last ``size`` routing decisions of every pool (module docstring). Written and
    read on the serving loop only."""

    __slots__ = ("_rows",)

    def __init__(self, size: int = DECISIONS_KEPT) -> None:
        self._rows: collections.deque[Kept] = collections.deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._rows)

    def record(self, kept: Kept) -> None:
        """Keep one decision (hot path: one append; see the module docstring)."""
        self._rows.append(kept)

    def rows(self) -> list[dict[str, Any]]:
        """The kept decisions as JSON-ready rows, oldest first."""
        return [_row(k) for k in self._rows]


def _row(k: Kept) -> dict[str, Any]:
    decision, prediction = k.decision, k.prediction
    key = decision.chosen.key
    hit = _hit(prediction, key)
    ahead = _hit(k.speculative, key) or hit
    expected = k.admission if k.admission is not None else ahead
    res = hit.result if hit is not None else None
    limiting = None
    if res is not None and res.limiting_group is not None and prediction is not None:
        layout = prediction.layout
        if layout is not None and res.limiting_group < len(layout.spec_groups):
            sg = layout.spec_groups[res.limiting_group]
            limiting = f"{sg.spec.kind}{list(sg.group_ids)}"  # as explain names them
    hits = (
        [
            {"replica": h.replica[0], "dp_rank": h.replica[1], "hit_tokens": h.hit_tokens,
             "trust": h.trust}
            for h in prediction.replicas
        ]
        if prediction is not None
        else []
    )  # fmt: skip
    return {
        "time": k.wall,
        "request_id": k.request_id,
        "pool": k.pool,
        "replica": key[0],
        "dp_rank": key[1],
        "policy": decision.policy,
        "reason": decision_reason(prediction, decision, k.untokenized, k.attempts),
        "tied": decision.tied,
        "attempts": k.attempts,
        "status": k.status,
        "num_tokens": k.num_tokens,
        "tokenized": prediction is not None,
        "predicted_hit": hit.hit_tokens if hit is not None else None,
        "in_flight_hit": ahead.hit_tokens if ahead is not None else None,
        "expected_hit": expected.hit_tokens if expected is not None else None,
        "best_hit": max((h["hit_tokens"] for h in hits), default=None),
        "cached_tokens": k.cached_tokens,
        "trust": hit.trust if hit is not None else None,
        "limiting_group": limiting,
        "longest_group_hit": res.longest if res is not None else None,
        "hits": hits,
        "router_ms": None if k.router_s is None else round(k.router_s * 1000, 3),
        "total_ms": round(k.total_s * 1000, 3),
    }
