"""The kv policy's decision without scoring every replica: the full scan's answer, exactly.

A request's cost on a replica that holds none of its first full-attention block does not
depend on the request beyond its length: no hit, no look-ahead, no lower-tier hit, and (unless
it is the prefix's home) no affinity, so it is ``prefill + queued`` with ``prefill`` the same
for all of them. Those replicas are kept in a :class:`LoadBook`, ordered by ``queued`` (which
changes when load changes, not per request); the decision scores only

* the *explicit* candidates: replicas holding the first block (the index's bitmask for that
  block names them, router.core.predict), the prefix's homes (router.core.affinity), and
  the replicas the book cannot stand for (drained, not healthy, under cache pressure, load
  not a finite number);
* the book's *runs* (replicas with the same ``queued`` float, hence the same cost), cheapest
  first, one score per run, until a run's cost is beyond the best cost found by more than
  ``tie_tokens``: no later run can be the choice or tie with it (cost grows with ``queued``,
  and float rounding is monotone).

Ties are broken as :class:`router.core.policy._CostPolicy.choose` breaks them: every candidate
within ``tie_tokens`` of the best counts (``Decision.tied``), one ``rng.randrange(tied)`` is
drawn (none when one is tied) and the pick indexes the tied candidates in ``(cost, key)``
order. A run's members are consecutive in the book's order and sorted by key there, so the
pick is found by bisection, never by listing the run: 256 idle replicas tied cost one score
and a few ``log n`` steps. The RNG is consumed exactly as the full scan does (one draw, same
range), so a pool routes identically whichever path decided.

:func:`choose_shortlist` declines (returns None, before touching the RNG) where this does not
hold: softmax sampling (``temperature > 0``), the load band, non-finite weights or costs. The
caller then runs the full scan. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterator, Sequence

from sortedcontainers import SortedList

from router.core.index import ReplicaKey
from router.core.policy import (
    NO_CANDIDATES,
    Candidate,
    Decision,
    KVCostPolicy,
    NoCandidates,
    Scored,
)

__all__ = ["LoadBook", "choose_shortlist"]

_ANON = Candidate(("", -1), trusted=False)
"""What a book replica is to the cost model: no hit, no look-ahead, no home. (Trusted or not,
its cost terms are the same floats: ``w * 0`` is 0.0 for finite weights.)"""


class LoadBook:
    """Replica keys ordered by their ``queued`` term (router.core.policy.queued_tokens), then
    by key: a run of equal ``queued`` is contiguous and sorted by key."""

    __slots__ = ("_at", "_sorted")

    def __init__(self) -> None:
        self._sorted: SortedList = SortedList()
        self._at: dict[ReplicaKey, float] = {}

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def queued(self, key: ReplicaKey) -> float | None:
        return self._at.get(key)

    def put(self, key: ReplicaKey, queued: float) -> None:
        """Add or move ``key`` (``queued`` must be finite: the caller keeps the rest out)."""
        if not math.isfinite(queued):
            raise ValueError(f"queued must be finite to be ordered, got {queued!r} for {key}")
        old = self._at.get(key)
        if old is not None:
            if old == queued:
                return
            self._sorted.remove((old, key))
        self._sorted.add((queued, key))
        self._at[key] = queued

    def discard(self, key: ReplicaKey) -> None:
        old = self._at.pop(key, None)
        if old is not None:
            self._sorted.remove((old, key))

    def keys(self) -> list[ReplicaKey]:
        return list(self._at)

    def runs(self) -> Iterator[tuple[float, int, int]]:
        """``(queued, lo, hi)`` per run of equal ``queued``, least first: positions
        ``lo .. hi - 1`` of the book."""
        s = self._sorted
        i, n = 0, len(s)
        while i < n:
            q = s[i][0]
            j = s.bisect_left((math.nextafter(q, math.inf),))
            yield q, i, j
            i = j

    def key_at(self, i: int) -> ReplicaKey:
        return self._sorted[i][1]

    def position(self, queued: float, key: ReplicaKey) -> int:
        """Where ``(queued, key)`` is or would be."""
        return self._sorted.bisect_left((queued, key))


@dataclasses.dataclass(slots=True)
class _Run:
    cost: float
    lo: int
    hi: int
    queued: float
    count: int
    """Members not skipped."""
    template: Scored


def choose_shortlist(
    policy: KVCostPolicy,
    num_tokens: int,
    explicit: Sequence[Candidate],
    book: LoadBook,
    skip: Collection[ReplicaKey],
    *,
    commit: bool = True,
) -> Decision | None:
    """``policy.choose(num_tokens, candidates)`` where the candidates are ``explicit`` plus
    every book replica not in ``skip`` as a no-hit, no-home candidate (module docstring).

    ``Decision.ranked`` holds the chosen candidate first, then the other explicit ones in
    cost order (each scored as the full scan scores it); ``Decision.tied`` counts every tied
    candidate, listed or not. None: this cannot be decided exactly here (nothing consumed)."""
    cfg = policy.cfg
    tie = cfg.tie_tokens
    if cfg.temperature > 0 or cfg.load_band_tokens > 0 or not (math.isfinite(tie) and tie >= 0):
        return None
    weights = (
        cfg.lookahead_weight,
        cfg.affinity_weight,
        cfg.affinity_max_tokens,
        cfg.pressure_weight,
        *cfg.lower_tier_weights.values(),
    )
    if not all(math.isfinite(w) for w in weights):
        return None
    # KVCostPolicy.choose's affinity rule; the book's candidates have hit 0, which never
    # raises the best trusted hit
    best_hit = max((c.hit_tokens for c in explicit if c.trusted), default=0)
    if any(c.home_tokens and c.hit_tokens < best_hit for c in explicit):
        explicit = [
            dataclasses.replace(c, home_tokens=0) if c.hit_tokens < best_hit else c
            for c in explicit
        ]
    scored = [policy.score(num_tokens, c) for c in explicit]
    if any(math.isnan(s.cost) for s in scored):
        return None
    best = min((s.cost for s in scored), default=math.inf)
    skipped: dict[float, list[ReplicaKey]] = {}
    for k in set(skip):
        q = book.queued(k)
        if q is not None:
            skipped.setdefault(q, []).append(k)
    runs: list[_Run] = []
    for q, lo, hi in book.runs():
        template = policy.score_queued(num_tokens, _ANON, q)
        cost = template.cost
        if math.isnan(cost):
            return None
        if cost - best > tie:
            break  # every later run costs at least this much: neither best nor tied
        count = hi - lo - len(skipped.get(q, ()))
        if count <= 0:
            continue
        best = min(best, cost)
        runs.append(_Run(cost, lo, hi, q, count, template))
    tied_ex = [s for s in scored if s.cost - best <= tie]
    tied_runs = [r for r in runs if r.cost - best <= tie]
    n_tied = len(tied_ex) + sum(r.count for r in tied_runs)
    if not n_tied:
        raise NoCandidates(NO_CANDIDATES)
    pick = policy.tie_rng(commit).randrange(n_tied) if n_tied > 1 else 0
    chosen = _locate(book, pick, tied_ex, tied_runs, skipped)
    others = sorted((s for s in scored if s.key != chosen.key), key=lambda s: (s.cost, s.key))
    return Decision(policy.name, (chosen, *others), n_tied)


def _locate(
    book: LoadBook,
    pick: int,
    tied_ex: list[Scored],
    tied_runs: list[_Run],
    skipped: dict[float, list[ReplicaKey]],
) -> Scored:
    """The ``pick``-th tied candidate in ``(cost, key)`` order, as scored."""
    for cost in sorted({s.cost for s in tied_ex} | {r.cost for r in tied_runs}):
        ex = sorted((s for s in tied_ex if s.cost == cost), key=lambda s: s.key)
        rs = [r for r in tied_runs if r.cost == cost]
        size = len(ex) + sum(r.count for r in rs)
        if pick >= size:
            pick -= size
            continue
        if not rs:
            return ex[pick]
        if len(rs) == 1:
            r = rs[0]
            key, own = _select(book, r, sorted(skipped.get(r.queued, ())), ex, pick)
        else:  # different queued floats rounding to one cost: rare, list them
            members = [s.key for s in ex]
            for r in rs:
                gone = set(skipped.get(r.queued, ()))
                members += [k for i in range(r.lo, r.hi) if (k := book.key_at(i)) not in gone]
            members.sort()
            key = members[pick]
            own = next((s for s in ex if s.key == key), None)
            r = next((r for r in rs if book.queued(key) == r.queued), rs[0])
        if own is not None:
            return own
        return dataclasses.replace(r.template, key=key)
    raise AssertionError("pick beyond the tied candidates")  # pragma: no cover


def _select(
    book: LoadBook, run: _Run, skipped: list[ReplicaKey], extras: list[Scored], j: int
) -> tuple[ReplicaKey, Scored | None]:
    """The ``j``-th key of (the run's members - ``skipped``) + ``extras`` (explicit
    candidates of the same cost) in key order, by bisection; with the extra's Scored when
    the key is one."""
    marks = sorted([(s.key, s) for s in extras] + [(k, None) for k in skipped], key=lambda m: m[0])
    pos = run.lo
    for key, extra in marks:
        at = book.position(run.queued, key)
        if j < at - pos:
            return book.key_at(pos + j), None
        j -= at - pos
        pos = at
        if extra is not None:
            if j == 0:
                return key, extra
            j -= 1
        else:
            pos = at + 1  # the skipped member itself
    return book.key_at(pos + j), None
