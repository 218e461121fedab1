"""Where each policy loses reuse on the concurrent benchmark, request by request.

Pure functions over the JSON document ``load.py`` writes (its plan is rebuilt from the seed:
the records name the session, the plan names its system prompt). The prompt tokens of a run
split three ways, and each kind has its own limit:

* **one-offs** (novel prompts): never cached, by any policy;
* **later turns** of a conversation: at most the previous turn's prompt, rounded down to a
  block (``bound``), since vLLM 0.32's default retention keeps a sliding-window checkpoint at
  the end of each prompt only (spec §4.7) and none inside the streamed answer. A turn below
  its bound either *moved* to another replica than its previous turn, or stayed and lost its
  history there (evicted);
* **first turns** over a shared system prompt: a miss is either the family's first request on
  that replica (*new there*: its prefix was never computed there) or a family seen there before.
  In this layout a conversation diverging right after the system prompt misses even then until
  one request has stored a window checkpoint at that point (spec §4.7 Example 2): the family's
  second conversation on a replica misses by rule (unless the first one's prompt ended in the
  block where the two part, its own end checkpoint then serving), later ones miss only if it
  was evicted.

The same limits give each run a **ceiling** (:func:`run_ceiling`): the reuse no router can
exceed on that run's prompts, reached only with no eviction, no split family and no request
arriving before the one it should reuse has stored its blocks. Against it, "kv ≥ cache_aware
by two points" can be judged for what it asks: on a seed where the ceiling is within two
points of ``cache_aware``'s reuse, no router gets there.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from itertools import takewhile
from typing import Any

from bench.real_vllm.load_plan import PlanConfig, make_plan

BLOCK = 32
"""The benchmark model's block size (bench/real_vllm/model.py)."""


def plan_config(cfg: dict[str, Any]) -> PlanConfig:
    """The plan settings a benchmark document's ``config`` recorded."""
    names = {f.name for f in dataclasses.fields(PlanConfig)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in names}
    return PlanConfig(**kw)


def run_losses(run: dict[str, Any], plan_cfg: PlanConfig) -> dict[str, Any]:
    """One run's tokens and misses by kind (module docstring)."""
    family = {s.sid: s.system for s in make_plan(run["seed"], plan_cfg).sessions}
    answered = [r for r in run["records"] if r.get("error") is None]
    ok = [r for r in answered if r.get("cached_tokens") is not None]
    ok.sort(key=lambda r: r["send_s"])
    c: Counter[str] = Counter()
    seen: set[tuple[int | None, str | None]] = set()
    turns: dict[tuple[int, int], dict[str, Any]] = {(r["sid"], r["turn"]): r for r in ok}
    for r in ok:
        prompt, cached = r["prompt_tokens"], r["cached_tokens"]
        if r["kind"] != "conversation":
            c["one_off_prompt"] += prompt
            c["one_off_cached"] += cached
            continue
        if r["turn"] == 0:
            fam = (family.get(r["sid"]), r.get("replica"))
            c["first_n"] += 1
            c["first_prompt"] += prompt
            c["first_cached"] += cached
            if cached == 0:
                c["first_miss_seen" if fam in seen else "first_miss_new"] += 1
            seen.add(fam)
            continue
        prev = turns.get((r["sid"], r["turn"] - 1))
        if prev is None:
            continue
        bound = (prev["prompt_tokens"] - 1) // BLOCK * BLOCK
        c["later_n"] += 1
        c["later_prompt"] += prompt
        c["later_cached"] += cached
        c["later_bound"] += bound
        if cached < bound:
            moved = r.get("replica") is not None and r.get("replica") != prev.get("replica")
            c["later_short_moved" if moved else "later_short_stayed"] += 1
            c["later_lost"] += bound - cached
    return dict(c)


def run_ceiling(run: dict[str, Any], plan_cfg: PlanConfig) -> tuple[int, int]:
    """``(ceiling, prompt)`` tokens of one run: the most any router could have had cached,
    and the run's prompt tokens (the denominator of its reuse, the answered requests).

    * one-offs: 0;
    * a conversation's first turn: 0 for the family's first request; for its second, the
      checkpoint the first left at its own prompt's end (``(prompt - 1)`` rounded down to a
      block, spec §4.7) if that lies within the prefix the two share (a first question short
      enough to end in the block where the system prompt ends), else 0: this one then pins
      the junction (spec §4.1, §4.7 Example 2); from the third on, the aligned longest prefix
      it shares with an earlier conversation of the family. The chat template renders
      ``<system> S <user> U ...`` one token per word, so a shared prefix is ``2 + len(S) +``
      the user words in common, rounded down to a 32-token block;
    * a later turn: its bound, the previous turn's prompt rounded down (module docstring);
      0 when the previous turn was not answered.
    """
    plan = make_plan(run["seed"], plan_cfg)
    sessions = {s.sid: s for s in plan.sessions}
    ok = [r for r in run["records"] if r.get("error") is None]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    turns = {(r["sid"], r["turn"]): r for r in ok}
    earlier: dict[int, list[tuple[list[str], int]]] = {}
    ceiling = 0
    for r in sorted(ok, key=lambda r: r["send_s"]):
        s = sessions[r["sid"]]
        if s.kind != "conversation" or s.system is None:
            continue
        if r["turn"] > 0:
            prev = turns.get((r["sid"], r["turn"] - 1))
            if prev is not None and prev.get("prompt_tokens"):
                ceiling += (prev["prompt_tokens"] - 1) // BLOCK * BLOCK
            continue
        seen = earlier.setdefault(s.system, [])
        mine = s.user_messages[0].split()
        system = 2 + len(plan.system_prompts[s.system].split())
        last = (r.get("prompt_tokens") or 1) - 1  # vLLM looks up at most prompt - 1 tokens
        best = 0
        for other, other_prompt in seen:
            # the tokens shared with that earlier first turn: the leading user words in common
            shared = system + sum(
                1 for _ in takewhile(lambda p: p[0] == p[1], zip(mine, other, strict=False))
            )
            end = (other_prompt - 1) // BLOCK * BLOCK  # the checkpoint at its prompt's end
            if end <= min(shared, last):
                best = max(best, end)
            if len(seen) >= 2:  # the junction was pinned by the family's second conversation
                best = max(best, min(shared, last) // BLOCK * BLOCK)
        ceiling += best
        seen.append((mine, r.get("prompt_tokens") or 0))
    return ceiling, prompt


def ceiling_table(doc: dict[str, Any], order: Sequence[str]) -> str:
    """Per policy and seed, the mean reuse against the mean ceiling of the same runs
    (:func:`run_ceiling`), and the share of the ceiling reached."""
    plan_cfg = plan_config(doc.get("config") or {})
    got: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for run in doc.get("runs") or []:
        ceiling, prompt = run_ceiling(run, plan_cfg)
        if not prompt:
            continue
        cached = sum(r.get("cached_tokens") or 0 for r in run["records"] if r.get("error") is None)
        got.setdefault(run["policy"], {}).setdefault(run["seed"], []).append(
            (100 * cached / prompt, 100 * ceiling / prompt)
        )
    seeds = sorted({s for per in got.values() for s in per})
    head = " / ".join(str(s) for s in seeds)
    lines = [
        f"| policy | reuse % mean, seed {head} | ceiling % mean, seed {head} "
        f"| share of the ceiling reached, seed {head} |",
        "|---|---|---|---|",
    ]

    def cells(policy: str, f) -> str:
        per = got[policy]
        return " / ".join(
            f(sum(a for a, _ in per[s]) / len(per[s]), sum(c for _, c in per[s]) / len(per[s]))
            if s in per
            else "–"
            for s in seeds
        )

    for policy in [p for p in order if p in got]:
        lines.append(
            f"| {policy} | {cells(policy, lambda a, c: f'{a:.2f}')} "
            f"| {cells(policy, lambda a, c: f'{c:.2f}')} "
            f"| {cells(policy, lambda a, c: f'{100 * a / c:.1f} %' if c else '–')} |"
        )
    return "\n".join(lines)


REQUEST_KINDS = ("family's first", "family's second", "family's third on", "later turn", "one-off")
"""The kinds :func:`request_deltas` compares by: first turns by their place among the
family's conversations in send order (the same in every run of a seed: first turns arrive
open-loop at the plan's times), since each has its own limit (module docstring)."""


def request_kinds(run: dict[str, Any], plan_cfg: PlanConfig) -> dict[tuple[int, int], str]:
    """``(sid, turn)`` -> one of :data:`REQUEST_KINDS`, for the run's answered requests."""
    family = {s.sid: s.system for s in make_plan(run["seed"], plan_cfg).sessions}
    ok = [r for r in run["records"] if r.get("error") is None]
    place: Counter[int | None] = Counter()
    out: dict[tuple[int, int], str] = {}
    for r in sorted(ok, key=lambda r: r["send_s"]):
        if r["kind"] != "conversation":
            kind = REQUEST_KINDS[4]
        elif r["turn"] > 0:
            kind = REQUEST_KINDS[3]
        else:
            fam = family.get(r["sid"])
            kind = REQUEST_KINDS[min(place[fam], 2)]
            place[fam] += 1
        out[(r["sid"], r["turn"])] = kind
    return out


def request_deltas(
    base: dict[str, Any], other: dict[str, Any], plan_cfg: PlanConfig
) -> dict[str, dict[str, int]]:
    """Two runs of one seed, request by request: per kind, how many requests ``base`` cached
    more of (``more``) and fewer of (``fewer``), and the cached tokens it had over ``other``
    (``net``, negative where ``other`` had more). Same seed, same requests, so this shows where
    a reuse difference comes from even for a router whose answers name no replica."""
    kinds = request_kinds(base, plan_cfg)
    theirs = {
        (r["sid"], r["turn"]): r.get("cached_tokens")
        for r in other["records"]
        if r.get("error") is None
    }
    out = {k: {"more": 0, "fewer": 0, "net": 0} for k in REQUEST_KINDS}
    for r in base["records"]:
        key = (r["sid"], r["turn"])
        mine, other_cached = r.get("cached_tokens"), theirs.get(key)
        if r.get("error") is not None or mine is None or other_cached is None:
            continue
        cell = out[kinds[key]]
        cell["net"] += mine - other_cached
        if mine != other_cached:
            cell["more" if mine > other_cached else "fewer"] += 1
    return out


def losses_table(doc: dict[str, Any], order: Sequence[str]) -> str:
    """Per policy, summed over its runs: first-turn reuse and misses, later turns against
    their bound, one-offs. A policy whose answers name no replica (vllm-router) cannot tell
    a moved turn from one that stayed, nor a family new on a replica."""
    plan_cfg = plan_config(doc.get("config") or {})
    tot: dict[str, Counter[str]] = {}
    runs_of: Counter[str] = Counter()
    for run in doc.get("runs") or []:
        tot.setdefault(run["policy"], Counter()).update(run_losses(run, plan_cfg))
        runs_of[run["policy"]] += 1
    lines = [
        "| policy | runs | first turns: reuse % | first-turn misses per run: new there / "
        "seen there | later turns: cached / bound | later turns short per run: moved / stayed "
        "| tokens lost by short later turns per run | one-off share of prompt tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def pct(a: int, b: int) -> str:
        return f"{100 * a / b:.1f} %" if b else "–"

    for policy in [p for p in order if p in tot]:
        c, n = tot[policy], runs_of[policy]
        total = c["first_prompt"] + c["later_prompt"] + c["one_off_prompt"]
        lines.append(
            f"| {policy} | {n} | {pct(c['first_cached'], c['first_prompt'])} "
            f"| {c['first_miss_new'] / n:.1f} / {c['first_miss_seen'] / n:.1f} "
            f"| {pct(c['later_cached'], c['later_bound'])} "
            f"| {c['later_short_moved'] / n:.1f} / {c['later_short_stayed'] / n:.1f} "
            f"| {c['later_lost'] / n:.0f} | {pct(c['one_off_prompt'], total)} |"
        )
    return "\n".join(lines)
