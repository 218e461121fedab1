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

With a load band (``load_band_tokens > 0``, :func:`_choose_banded`) every ``queued`` is seen
through the band above the least queued candidate's, recomputed from the cost's terms, so the
book's replicas inside the band all cost the same float: the tied ones are a prefix of the
book, found by bisection. Among several tied candidates the full scan takes the one whose cache
turned over least lately (``recent_new_tokens``), then the least queued, drawing only among
equals; the book keeps its replicas in that order too (by
:meth:`router.core.pressure.DecayingSum.order_key`, which time does not change), and
:func:`_lightest` walks it from the least churned to the first one inside the tie.

:func:`choose_shortlist` declines (returns None, before touching the RNG) where this does not
hold: softmax sampling (``temperature > 0``), non-finite weights, costs or band, and, with a
band, churn sums too close to order without reading them all (equal histories, values that
underflowed, or more than :data:`_WALK_LIMIT` least churned replicas outside the tie), and a
new prefix (below) while both the family spread and a load band are on, or with a book kept
without families (``family_order``). The caller then runs the full scan. Pure: no I/O; the
clock is passed in.

With the family spread on (``family_spread_tokens > 0``) a request no candidate is home to and
none holds is a new prefix (router.core.policy ``new_prefix``; the book's replicas are neither
homes nor holders, so the explicit candidates decide it), and every replica's ``families``
enter its cost (``spread · families``): the book then also orders its replicas by
``(families, queued, key)``, and each family count is a *segment* whose cost grows with
``queued`` like the whole book's does without the spread. Segments are walked one after the
other, fewest families first, runs cheapest first within each, one score per run, each stopped
as above; the walk ends at the first segment whose families alone, at the book's least
``queued``, cost beyond the best found by more than ``tie_tokens`` (cost grows with the family
count too). A decision scores a few runs, however many replicas and family counts the fleet
has. Any other request drops every ``families`` term (router.core.policy ``placement_terms``)
and reads the book by ``queued`` alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterator, Sequence

from sortedcontainers import SortedList

from router.core.index import ReplicaKey
from router.core.policy import (
    NO_CANDIDATES,
    Candidate,
    Decision,
    KVCostPolicy,
    NoCandidates,
    Scored,
    crowded_homes,
    new_prefix,
    placement_terms,
    request_load,
    with_crowded,
)
from router.core.pressure import ORDER_KEY_SLACK, DecayingSum

__all__ = ["LoadBook", "choose_shortlist"]

_ANON = Candidate(("", -1), trusted=False)
"""What a book replica is to the cost model: no hit, no look-ahead, no home. (Trusted or not,
its cost terms are the same floats: ``w * 0`` is 0.0 for finite weights.)"""


class LoadBook:
    """Replica keys ordered by their ``queued`` term (router.core.policy.queued_tokens), then
    by key: a run of equal ``queued`` is contiguous and sorted by key.

    With ``churn_order`` (a load band is set) also ordered by cache churn (each key's
    :class:`DecayingSum` of new tokens, none: never written), then ``queued``, then key, for
    the band's tie-break (:func:`_lightest`); churn changes when the router sends a request,
    so the caller re-puts the replica then. Without a band nothing reads that order, and the
    routing path does not pay for keeping it.

    With ``family_order`` (the family spread is on) also ordered by ``(families, queued,
    key)``: the prefix families homed on each replica, which a new prefix pays for (module
    docstring); they change as requests carry homed prefixes, so the caller re-puts the
    replica then too."""

    __slots__ = ("_at", "_by_churn", "_by_family", "_churn", "_families", "_load", "_sorted",
                 "churn_order", "family_order", "total_load")  # fmt: skip

    def __init__(self, churn_order: bool = False, family_order: bool = False) -> None:
        self._sorted: SortedList = SortedList()
        self._at: dict[ReplicaKey, float] = {}
        self._load: dict[ReplicaKey, int] = {}
        self.total_load = 0
        """Σ ``request_load`` of the members: the affinity fair share's mean without a scan."""
        self.churn_order = churn_order
        self._by_churn: SortedList = SortedList()
        self._churn: dict[ReplicaKey, tuple[float, DecayingSum | None]] = {}
        self.family_order = family_order
        self._by_family: SortedList = SortedList()
        self._families: dict[ReplicaKey, int] = {}

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def queued(self, key: ReplicaKey) -> float | None:
        return self._at.get(key)

    def load(self, key: ReplicaKey) -> int:
        return self._load.get(key, 0)

    def put(
        self,
        key: ReplicaKey,
        queued: float,
        churn: DecayingSum | None = None,
        load: int = 0,
        families: int = 0,
    ) -> None:
        """Add or move ``key`` (``queued`` must be finite: the caller keeps the rest out);
        ``load`` is its ``request_load`` (router.core.policy) and ``families`` the prefix
        families homed there, filed with it."""
        if not math.isfinite(queued):
            raise ValueError(f"queued must be finite to be ordered, got {queued!r} for {key}")
        if families < 0:
            raise ValueError(f"families must be >= 0, got {families} for {key}")
        self.total_load += load - self._load.get(key, 0)
        self._load[key] = load
        old = self._at.get(key)
        if self.churn_order:
            self._file_churn(key, old, queued, churn)
        if self.family_order:
            prev = self._families.get(key)
            if prev != families or old != queued:
                if prev is not None:
                    self._by_family.remove((prev, old, key))
                self._by_family.add((families, queued, key))
                self._families[key] = families
        if old == queued:
            return
        if old is not None:
            self._sorted.remove((old, key))
        self._sorted.add((queued, key))
        self._at[key] = queued

    def _file_churn(
        self, key: ReplicaKey, old: float | None, queued: float, churn: DecayingSum | None
    ) -> None:
        """Keep ``key``'s place in the churn order (``old``: its ``queued`` before the put)."""
        order = churn.order_key() if churn is not None else -math.inf
        prev = self._churn.get(key)
        self._churn[key] = (order, churn)
        if prev is not None:
            if prev[0] == order and old == queued:
                return
            self._by_churn.remove((prev[0], old, key))
        self._by_churn.add((order, queued, key))

    def discard(self, key: ReplicaKey) -> None:
        self.total_load -= self._load.pop(key, 0)
        old = self._at.pop(key, None)
        if old is not None:
            self._sorted.remove((old, key))
            if self.churn_order:
                order, _ = self._churn.pop(key)
                self._by_churn.remove((order, old, key))
            if self.family_order:
                self._by_family.remove((self._families.pop(key), old, key))

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

    def segments(self) -> Iterator[tuple[int, Iterator[tuple[float, int, int]]]]:
        """Per family count present, fewest first: ``(families, runs)`` with ``runs`` the
        ``(queued, lo, hi)`` of that count's replicas in the family order, least queued first
        (``family_order`` only). Each segment is found by bisection: one that is not read
        costs nothing."""
        s = self._by_family
        lo = 0
        while lo < len(s):
            f = s[lo][0]
            hi = s.bisect_left((f + 1,))
            yield f, self._segment_runs(f, lo, hi)
            lo = hi

    def _segment_runs(self, f: int, lo: int, hi: int) -> Iterator[tuple[float, int, int]]:
        s = self._by_family
        i = lo
        while i < hi:
            q = s[i][1]
            j = s.bisect_left((f, math.nextafter(q, math.inf)))
            yield q, i, j
            i = j

    def families(self, key: ReplicaKey) -> int | None:
        """The families ``key`` was filed with (None: not a member, or no family order)."""
        return self._families.get(key)

    def family_key_at(self, i: int) -> ReplicaKey:
        return self._by_family[i][2]

    def family_position(self, families: int, queued: float, key: ReplicaKey) -> int:
        """Where ``(families, queued, key)`` is or would be in the family order."""
        return self._by_family.bisect_left((families, queued, key))

    def key_at(self, i: int) -> ReplicaKey:
        return self._sorted[i][1]

    def queued_at(self, i: int) -> float:
        return self._sorted[i][0]

    def position(self, queued: float, key: ReplicaKey) -> int:
        """Where ``(queued, key)`` is or would be."""
        return self._sorted.bisect_left((queued, key))

    def by_churn(self) -> SortedList:
        """``(order_key, queued, key)`` of every member, ascending (read only)."""
        return self._by_churn

    def churn(self, key: ReplicaKey) -> DecayingSum | None:
        return self._churn[key][1]

    def churn_position(self, key: ReplicaKey) -> int:
        """Where ``key`` is in :meth:`by_churn`'s order."""
        return self._by_churn.bisect_left((self._churn[key][0], self._at[key], key))


@dataclasses.dataclass(slots=True)
class _Run:
    cost: float
    lo: int
    hi: int
    queued: float
    count: int
    """Members not skipped."""
    template: Scored
    gone: list[ReplicaKey]
    """Its skipped members, by key."""
    key_at: Callable[[int], ReplicaKey]
    """The member at a position of the order the run is in (the load or the family order)."""
    where: Callable[[ReplicaKey], int]
    """Where a key of the run's ``(families, queued)`` is or would be in that order."""


def choose_shortlist(
    policy: KVCostPolicy,
    num_tokens: int,
    explicit: Sequence[Candidate],
    book: LoadBook,
    skip: Collection[ReplicaKey],
    *,
    now: float = 0.0,
    commit: bool = True,
) -> Decision | None:
    """``policy.choose(num_tokens, candidates)`` where the candidates are ``explicit`` plus
    every book replica not in ``skip`` as a no-hit, no-home candidate (module docstring).

    ``Decision.ranked`` holds the chosen candidate first, then the other explicit ones in
    cost order (each scored as the full scan scores it); ``Decision.tied`` counts every tied
    candidate, listed or not. ``now`` is when the book's churn sums are read (the time the
    explicit candidates' ``recent_new_tokens`` were read at). None: this cannot be decided
    exactly here (nothing consumed)."""
    cfg = policy.cfg
    tie, band = cfg.tie_tokens, cfg.load_band_tokens
    if cfg.temperature > 0 or not (math.isfinite(tie) and tie >= 0 and math.isfinite(band)):
        return None
    weights = (
        cfg.lookahead_weight,
        cfg.affinity_weight,
        cfg.affinity_max_tokens,
        cfg.pressure_weight,
        cfg.family_spread_tokens,
        *cfg.lower_tier_weights.values(),
    )
    if not all(math.isfinite(w) for w in weights):
        return None
    novel = new_prefix(cfg, explicit)  # the book's replicas hold none of it, and are no home
    if novel and (band > 0 or not book.family_order):
        return None  # every replica's families count: the band's walk does not read them
    # KVCostPolicy.choose's rules (placement_terms); the book's candidates have hit 0, which
    # never raises the best trusted hit, and no home (their requests count in the fair share)
    skip = set(skip)
    crowded: frozenset[ReplicaKey] = frozenset()
    if cfg.affinity_fair_share > 0 and any(c.home_tokens for c in explicit):
        gone = [k for k in skip if k in book]
        fleet = (
            book.total_load - sum(map(book.load, gone)) + sum(map(request_load, explicit)),
            len(book) - len(gone) + len(explicit),
        )
        crowded = crowded_homes(cfg, explicit, fleet)
    explicit = placement_terms(cfg, explicit, crowded)
    scored = [policy.score(num_tokens, c) for c in explicit]
    if any(math.isnan(s.cost) for s in scored):
        return None
    if band > 0:
        if not book.churn_order:
            return None  # a book kept without churn cannot break the band's ties
        banded = _choose_banded(policy, num_tokens, explicit, scored, book, skip, now, commit)
        return with_crowded(banded, crowded) if banded is not None else None
    best = min((s.cost for s in scored), default=math.inf)
    skipped: dict[tuple[int, float], list[ReplicaKey]] = {}
    for k in sorted(skip):
        q = book.queued(k)
        if q is not None:
            f = (book.families(k) or 0) if novel else 0
            skipped.setdefault((f, q), []).append(k)
    runs: list[_Run] = []
    least = book.queued_at(0) if len(book) else 0.0
    for f, seg_runs, template_of, key_at, where_of in _segments(book, novel, num_tokens, policy):
        if novel and template_of(least).cost - best > tie:
            break  # this segment and the later ones (more families) cost at least this much
        for q, lo, hi in seg_runs:
            template = template_of(q)
            cost = template.cost
            if math.isnan(cost):
                return None
            if cost - best > tie:
                break  # every later run of the segment costs at least this much
            gone = skipped.get((f, q), [])
            count = hi - lo - len(gone)
            if count <= 0:
                continue
            best = min(best, cost)
            runs.append(_Run(cost, lo, hi, q, count, template, gone, key_at, where_of(q)))
    tied_ex = [s for s in scored if s.cost - best <= tie]
    tied_runs = [r for r in runs if r.cost - best <= tie]
    n_tied = len(tied_ex) + sum(r.count for r in tied_runs)
    if not n_tied:
        raise NoCandidates(NO_CANDIDATES)
    pick = policy.tie_rng(commit).randrange(n_tied) if n_tied > 1 else 0
    chosen = _locate(pick, tied_ex, tied_runs)
    others = sorted((s for s in scored if s.key != chosen.key), key=lambda s: (s.cost, s.key))
    return with_crowded(Decision(policy.name, (chosen, *others), n_tied), crowded)


_SegmentOf = tuple[
    int,
    Iterator[tuple[float, int, int]],
    Callable[[float], Scored],
    Callable[[int], ReplicaKey],
    Callable[[float], Callable[[ReplicaKey], int]],
]


def _segments(
    book: LoadBook, novel: bool, num_tokens: int, policy: KVCostPolicy
) -> Iterator[_SegmentOf]:
    """The book as runs of one cost each, in segments where cost grows with ``queued``:
    ``(families, runs, template, key_at, where)`` with ``template(queued)`` a member's score
    (key unset) and ``where(queued)(key)`` a key's position in the segment's order. Without a
    new prefix under the family spread, the whole load order is one segment; with one, each
    family count of the family order is (module docstring)."""
    if not novel:
        yield (
            0,
            book.runs(),
            lambda q: policy.score_queued(num_tokens, _ANON, q),
            book.key_at,
            lambda q: lambda k: book.position(q, k),
        )
        return
    for f, seg_runs in book.segments():
        anon = dataclasses.replace(_ANON, families=f)
        yield (
            f,
            seg_runs,
            lambda q, anon=anon: policy.score_queued(num_tokens, anon, q),
            book.family_key_at,
            lambda q, f=f: lambda k: book.family_position(f, q, k),
        )


def _locate(pick: int, tied_ex: list[Scored], tied_runs: list[_Run]) -> Scored:
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
            key, own = _select(r.key_at, r.where, r.lo, r.gone, ex, pick)
        else:
            # runs of one cost in different orders or of different queued floats rounding to
            # one cost (a family more and a queue shorter by the spread, typically): list them
            owner: dict[ReplicaKey, _Run] = {}
            for r in rs:
                gone = set(r.gone)
                for i in range(r.lo, r.hi):
                    if (k := r.key_at(i)) not in gone:
                        owner[k] = r
            members = sorted([*owner, *(s.key for s in ex)])
            key = members[pick]
            own = next((s for s in ex if s.key == key), None)
            r = owner.get(key, rs[0])
        if own is not None:
            return own
        return dataclasses.replace(r.template, key=key)
    raise AssertionError("pick beyond the tied candidates")  # pragma: no cover


def _select(
    key_at: Callable[[int], ReplicaKey],
    where: Callable[[ReplicaKey], int],
    lo: int,
    removed: list[ReplicaKey],
    extras: list[Scored],
    j: int,
) -> tuple[ReplicaKey, Scored | None]:
    """The ``j``-th key of (a key-sorted stretch of positions from ``lo``, less ``removed``)
    plus ``extras`` (explicit candidates of the same cost) in key order, by bisection
    (``where(key)``: the position ``key`` has or would have); with the extra's Scored when the
    key is one."""
    marks = sorted([(s.key, s) for s in extras] + [(k, None) for k in removed], key=lambda m: m[0])
    pos = lo
    for key, extra in marks:
        at = where(key)
        if j < at - pos:
            return key_at(pos + j), None
        j -= at - pos
        pos = at
        if extra is not None:
            if j == 0:
                return key, extra
            j -= 1
        else:
            pos = at + 1  # the removed member itself
    return key_at(pos + j), None


_WALK_LIMIT = 64
"""Replicas :func:`_lightest` looks at, in churn order, before it leaves the decision to the
full scan (the least churned replicas all being outside the band, or excluded)."""


def _choose_banded(
    policy: KVCostPolicy,
    num_tokens: int,
    explicit: Sequence[Candidate],
    scored: list[Scored],
    book: LoadBook,
    skip: Collection[ReplicaKey],
    now: float,
    commit: bool,
) -> Decision | None:
    """:func:`choose_shortlist` with a load band (router.core.policy, load band).

    Every candidate's ``queued`` is seen through the band above the least queued one
    (:meth:`KVCostPolicy.band`), so the book's replicas inside the band all cost the same
    float and the tied ones are a prefix of the book, found by bisection (cost is
    non-decreasing along it). Among several tied candidates the full scan takes the least
    churned, then least queued (one draw among equals): the book's is found by
    :func:`_lightest`, walking its churn order rather than the tied replicas."""
    skipped = {k for k in set(skip) if k in book}
    first = next((i for i in range(len(skipped) + 1) if i < len(book)
                  and book.key_at(i) not in skipped), None)  # fmt: skip
    queues = [s.queued for s in scored]
    if first is not None:
        queues.append(book.queued_at(first))
    if not queues:
        raise NoCandidates(NO_CANDIDATES)
    floor = min(queues)
    banded = [policy.band(s, floor) for s in scored]

    def member(q: float) -> Scored:
        """A book replica with ``queued == q``, as the full scan scores it (key unset)."""
        return policy.band(policy.score_queued(num_tokens, _ANON, q), floor)

    best = min((s.cost for s in banded), default=math.inf)
    if first is not None:
        best = min(best, member(book.queued_at(first)).cost)
    lo, end = 0, len(book)  # the book's tied prefix is positions [0, end)
    while lo < end:
        mid = (lo + end) // 2
        if member(book.queued_at(mid)).cost - best <= policy.cfg.tie_tokens:
            lo = mid + 1
        else:
            end = mid
    skipped_tied = {k for k in skipped if book.position(book.queued(k), k) < end}  # type: ignore[arg-type]
    tied_ex = [i for i, s in enumerate(banded) if s.cost - best <= policy.cfg.tie_tokens]
    n_book = end - len(skipped_tied)
    n_tied = len(tied_ex) + n_book
    if not n_tied:
        raise NoCandidates(NO_CANDIDATES)
    others = sorted(banded, key=lambda s: (s.cost, s.key))
    if n_tied == 1:
        if tied_ex:
            chosen = banded[tied_ex[0]]
        else:
            i = next(i for i in range(end) if book.key_at(i) not in skipped)
            chosen = dataclasses.replace(member(book.queued_at(i)), key=book.key_at(i))
        return _ranked(policy, chosen, others, n_tied)
    # the tie-break: least churn, then least queued (the unbanded term), one draw among equals
    light = {i: (explicit[i].recent_new_tokens, scored[i].queued) for i in tied_ex}
    group = None
    if n_book:
        end_mark = (book.queued_at(end), book.key_at(end)) if end < len(book) else None
        group = _lightest(book, end_mark, skipped, now)
        if group is None:
            return None
    least = min([*light.values(), *([group[:2]] if group else [])])
    ex_light = [banded[i] for i, v in light.items() if v == least]
    in_group: list[ReplicaKey] = []
    g_count = 0
    if group is not None and group[:2] == least:
        _, g_q, g_lo, g_hi = group
        bc = book.by_churn()
        order = bc[g_lo][0]
        # skipped members may sit inside the group (the never-written run, or sums equal to
        # the float: the same writes at the same times)
        in_group = sorted(k for k in skipped if g_lo <= book.churn_position(k) < g_hi)
        g_count = g_hi - g_lo - len(in_group)
    n_light = len(ex_light) + g_count
    pick = policy.tie_rng(commit).randrange(n_light) if n_light > 1 else 0
    if not g_count:
        chosen = sorted(ex_light, key=lambda s: (s.cost, s.key))[pick]
        return _ranked(policy, chosen, others, n_tied)
    g_cost = member(g_q).cost
    below = sorted((s for s in ex_light if s.cost < g_cost), key=lambda s: (s.cost, s.key))
    same = [s for s in ex_light if s.cost == g_cost]
    above = sorted((s for s in ex_light if s.cost > g_cost), key=lambda s: (s.cost, s.key))
    if pick < len(below):
        return _ranked(policy, below[pick], others, n_tied)
    pick -= len(below)
    if pick >= len(same) + g_count:
        return _ranked(policy, above[pick - len(same) - g_count], others, n_tied)
    key, own = _select(
        lambda i: bc[i][2],
        lambda k: bc.bisect_left((order, g_q, k)),
        g_lo,
        in_group,
        same,
        pick,
    )
    chosen = own if own is not None else dataclasses.replace(member(g_q), key=key)
    return _ranked(policy, chosen, others, n_tied)


def _ranked(policy: KVCostPolicy, chosen: Scored, ranked: list[Scored], tied: int) -> Decision:
    return Decision(policy.name, (chosen, *(s for s in ranked if s.key != chosen.key)), tied)


def _lightest(
    book: LoadBook,
    end: tuple[float, ReplicaKey] | None,
    skipped: Collection[ReplicaKey],
    now: float,
) -> tuple[float, float, int, int] | None:
    """The least ``(churn, queued)`` among the book's members before ``end`` (a ``(queued,
    key)`` mark; None: all) and not ``skipped``, and the positions ``[lo, hi)`` of the book's
    churn order holding every member with that pair (skipped ones included). None: not
    decidable here without reading every member (the full scan decides).

    Never-written members (churn 0.0) come first in churn order, by queued then key, so the
    first eligible one gives the pair and its run is contiguous. Otherwise churn values are
    distinct floats in practice: the first eligible member is the least unless one within
    :data:`ORDER_KEY_SLACK` of its order key reads as light or lighter (rounding), or its
    value underflowed; those cases decline."""
    bc = book.by_churn()
    zero_end = bc.bisect_left((-math.inf, math.inf))

    def eligible(q: float, key: ReplicaKey) -> bool:
        return (end is None or (q, key) < end) and key not in skipped

    i = 0
    while i < zero_end:
        _, q, key = bc[i]
        if end is not None and (q, key) >= end:
            break  # later never-written members are more queued: outside the band's tie too
        if key in skipped:
            i += 1
            continue
        if zero_end < len(bc):
            w = book.churn(bc[zero_end][2])
            if w is None or w.value(now) < 1e-300:
                return None  # a written member's churn may read 0.0 too
        lo = bc.bisect_left((-math.inf, q))
        return 0.0, q, lo, bc.bisect_left((-math.inf, math.nextafter(q, math.inf)))
    found: tuple[float, float, int, float] | None = None  # value, queued, position, order
    for i in range(zero_end, len(bc)):
        order, q, key = bc[i]
        if found is None:
            if i >= zero_end + _WALK_LIMIT:
                return None
            if eligible(q, key):
                w = book.churn(key)
                v = w.value(now) if w is not None else 0.0
                if v < 1e-300:
                    return None
                found = (v, q, i, order)
            continue
        if order > found[3] + ORDER_KEY_SLACK:
            break
        if i >= found[2] + _WALK_LIMIT:
            return None
        if eligible(q, key):
            w = book.churn(key)
            if w is None or w.value(now) <= found[0]:
                return None  # too close to tell apart by the order key alone
    if found is None:
        return None
    # members before the first eligible one with the same order key and queued (skipped ones:
    # equal sums) belong to its group, where the caller takes them out
    return found[0], found[1], bc.bisect_left((found[3], found[1])), found[2] + 1
