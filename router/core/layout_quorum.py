"""Which learned layout a pool adopts when its replicas' views of it differ (issue 12).

With the layout learned from events (a pool configured with ``groups = []``), each replica's
events show its own *view*: per ``group_idx`` the kind, window and largest block size seen
(router.core.index). Replicas of one pool should agree, but a replica launched with other
flags (``--block-size 32`` beside 16) publishes consistent hashes for another layout, and
nothing in one stream says which side is wrong. Following the first speaker made the odd
replica the pool's layout whenever it spoke first, and quarantined the good ones.

The rule (:func:`decide`), pure and re-run whenever a view, a member or a trust changes:

- Only *complete* views vote: groups ``0..n-1`` without a gap. Views are compared whole and
  exactly (kind, window and block size of every group).
- One member in the pool: its view is the layout (``learned``), as before.
- One voter among several members: its view is the layout, ``provisional``, so the common
  case predicts from the first batch on.
- A view held by a strict majority of the voters, and by at least two of them, is the
  layout (``confirmed``); a voter holding another view is *outvoted*: quarantined, the
  reason naming both views and the count.
- No such majority (two voters, one view each): ``contested``. The layout stays what it was
  (the first speaker's); its holders keep predicting; every other voter predicts no hit,
  with the reason, until another replica's view decides.
- A view that cannot vote (a gap, or a layout vLLM would refuse) is held only when it
  contradicts the layout on a group both have: running ahead is waiting, not disagreeing.

Outvoted and contested are recomputed, not latched: a view that grows into the layout (a
first store that was a partial block) or a replica restarted with the right flags joins it
again. Replicas quarantined for other settings (hash mismatch) have no vote (the caller
leaves them out).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar, get_args

import msgspec

from events.layout import GroupSpec

__all__ = [
    "LAYOUT_STATUSES",
    "LayoutState",
    "LayoutStatus",
    "LayoutViewState",
    "QuorumVerdict",
    "View",
    "complete_view",
    "decide",
    "describe",
    "diff",
]

K = TypeVar("K", bound=Hashable)

#: A complete view: the spec of groups ``0..n-1``.
View = tuple[GroupSpec, ...]

#: ``declared`` (the config's groups: no quorum), ``unknown`` (nothing learned yet),
#: ``learned`` (one member: its view), ``provisional`` (one voter of several members),
#: ``confirmed`` (a strict majority of at least two), ``contested`` (no such majority).
LayoutStatus = Literal["declared", "unknown", "learned", "provisional", "confirmed", "contested"]
LAYOUT_STATUSES: tuple[LayoutStatus, ...] = get_args(LayoutStatus)


@dataclass(frozen=True, slots=True)
class QuorumVerdict(Generic[K]):
    """The outcome of :func:`decide`."""

    status: LayoutStatus
    layout: View | None
    """The pool's layout (None while nothing usable was learned)."""
    holders: dict[View, tuple[K, ...]] = field(default_factory=dict)
    """Every voting view and the voters holding it, most held first."""
    held: dict[K, tuple[Literal["outvoted", "contested"], str]] = field(default_factory=dict)
    """Replicas that predict no hit because of their view: why, and the reason to show."""


class LayoutViewState(msgspec.Struct):
    """One voting view of a pool's learned layout, as /admin and /metrics show it."""

    view: str
    """:func:`describe` of the view."""
    replicas: list[str]
    """``name/dpN`` of the replicas holding it."""
    adopted: bool
    """Whether it is the pool's layout."""


class LayoutState(msgspec.Struct):
    """Where a pool's layout stands (KVIndex.layout_state): read by /admin and /metrics."""

    status: LayoutStatus
    layout: str | None
    """:func:`describe` of the layout in use, None while unknown."""
    views: list[LayoutViewState] = []
    held: dict[str, str] = {}
    """``name/dpN`` -> ``outvoted`` or ``contested``: replicas whose view keeps them from
    predicting (the reason is each one's ``untrusted_reason``)."""


def complete_view(groups: Mapping[int, GroupSpec]) -> View | None:
    """``groups`` as a view when it holds ``0..n-1`` without a gap, else None."""
    n = len(groups)
    if not n or max(groups) != n - 1 or min(groups) != 0:
        return None
    return tuple(groups[g] for g in range(n))


def describe(view: View | Mapping[int, GroupSpec] | None) -> str:
    """A short, stable spelling of a view for reasons, /admin and metric labels:
    ``[full_attention/16, sliding_window/16 w48]``."""
    if view is None:
        return "[]"
    items = enumerate(view) if isinstance(view, tuple) else sorted(view.items())
    parts = []
    for g, s in items:
        w = f" w{s.sliding_window}" if s.sliding_window is not None else ""
        parts.append(f"{g}: {s.kind.value}/{s.block_size}{w}")
    return "[" + ", ".join(parts) + "]"


def diff(view: Mapping[int, GroupSpec] | View, layout: View) -> str | None:
    """The first difference of ``view`` from ``layout`` on a group both have, as
    ``group 0 block_size 32 (pool: 16)`` (event field names); the group count when one is a
    prefix of the other; None when they are equal."""
    mine = dict(enumerate(view)) if isinstance(view, tuple) else dict(view)
    for g in sorted(mine):
        if g >= len(layout):
            continue
        a, b = mine[g], layout[g]
        for name, attr in (
            ("kv_cache_spec_kind", "kind"),
            ("sliding_window", "sliding_window"),
            ("block_size", "block_size"),
        ):
            x, y = getattr(a, attr), getattr(b, attr)
            if x != y:
                x, y = getattr(x, "value", x), getattr(y, "value", y)
                return f"group {g} {name} {x} (pool: {y})"
    if len(mine) != len(layout) or any(g >= len(layout) for g in mine):
        return f"group count {max(mine) + 1 if mine else 0} (pool: {len(layout)})"
    return None


def _contradicts(view: Mapping[int, GroupSpec], layout: View) -> bool:
    return any(g < len(layout) and s != layout[g] for g, s in view.items())


def decide(
    views: Mapping[K, Mapping[int, GroupSpec]],
    current: View | None,
    members: int,
    usable: Callable[[View], bool],
    name: Callable[[K], str] = str,
) -> QuorumVerdict[K]:
    """Apply the module's rule. ``views``: each voting-eligible replica's non-empty view
    (replicas quarantined for other settings left out); ``current``: the layout in use;
    ``members``: replicas in the pool, speaking or not; ``usable``: whether a complete view
    resolves as a layout (vLLM would run it); ``name`` spells a replica in reasons."""
    complete: dict[K, View] = {}
    waiting: dict[K, Mapping[int, GroupSpec]] = {}
    for k, v in views.items():
        cv = complete_view(v)
        if cv is not None and usable(cv):
            complete[k] = cv
        else:
            waiting[k] = v
    tally: dict[View, list[K]] = {}
    for k, cv in complete.items():
        tally.setdefault(cv, []).append(k)
    holders = {
        v: tuple(ks) for v, ks in sorted(tally.items(), key=lambda item: -len(item[1]))
    }  # dicts keep the first-held order among equal counts: insertion follows `views`
    n = len(complete)
    winner = next((v for v, ks in holders.items() if len(ks) >= 2 and 2 * len(ks) > n), None)
    status: LayoutStatus
    if winner is not None:
        status, layout = "confirmed", winner
    elif len(holders) == 1:
        layout = next(iter(holders))
        status = "learned" if members <= 1 else "provisional"
    elif holders:
        status, layout = "contested", current
    else:
        status, layout = ("unknown" if current is None else "provisional"), current
    held: dict[K, tuple[Literal["outvoted", "contested"], str]] = {}
    if layout is None:
        return QuorumVerdict(status, None, holders, held)
    count = ", ".join(
        f"{describe(v)} held by {len(ks)} ({', '.join(map(name, ks))})" for v, ks in holders.items()
    )
    for k, cv in complete.items():
        if cv == layout:
            continue
        what = diff(cv, layout)
        if status == "confirmed":
            held[k] = (
                "outvoted",
                f"layout outvoted: its view {describe(cv)} differs from the pool's "
                f"{describe(layout)} ({what}), which {len(holders[layout])} of the {n} replicas "
                f"that published a layout hold ({count}); restart it with the same launch "
                f"flags (--block-size, model, KV-cache settings) as the others",
            )
        else:
            held[k] = (
                "contested",
                f"layout contested: its view {describe(cv)} differs from the layout in use "
                f"{describe(layout)} ({what}) and no view holds a strict majority of the {n} "
                f"replicas that published one ({count}); no hit is predicted from it until "
                f"another replica's view decides, or its launch flags are fixed",
            )
    for k, v in waiting.items():
        if _contradicts(v, layout):
            held[k] = (
                "contested",
                f"layout contested: its view {describe(v)} (incomplete or not a layout vLLM "
                f"runs) contradicts the pool's {describe(layout)} ({diff(v, layout)}); no hit "
                f"is predicted from it until its view agrees",
            )
    return QuorumVerdict(status, layout, holders, held)
