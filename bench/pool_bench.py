"""Operations/s of the simulated hybrid KV cache (gpu_emitter.hybrid_pool), one core.

Layout: the shipped ``fa_swa`` (full attention + sliding window 128, 16-token blocks) by
default. Every prompt has ``--prompt-tokens`` tokens (default 1024: 64 blocks per group).
Each row times one kind of call; events are drained (``take_events``) outside the timing,
as an engine would publish them once per step.

* ``find_hit warm``: lookup of a prompt whose whole prefix is cached (hashes memoized after
  the first call, as the router's are); ``find_hit cold``: a never-seen prompt.
* ``admit hit``: a cached prefix plus a new 32-token tail (hashing, hit, touch, allocation of
  the tail, caching and events); ``admit cold``: a new prompt into free never-used blocks.
* ``compute_prefill``: the KV writes of a cold admission (torch index_put per group).
* ``append``: one decode token per running request (block fills, SWA frees, KV write).
* ``finish``: freeing a running request (both groups, tail first).
* ``admit evict``: a cold admission into a pool whose free blocks are all cached, so every
  block it takes evicts one (one ``BlockRemoved`` each).

Usage: ``.venv/bin/python bench/pool_bench.py [--layout fa_swa] [--prompt-tokens 1024]
[--n 200] [--repeat 3] [--out PATH]``
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gpu_emitter.hybrid_pool import HybridBlockPool  # noqa: E402
from gpu_emitter.layouts import load_layout  # noqa: E402


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


class Bench:
    def __init__(self, layout_name: str, prompt_tokens: int, n: int, seed: int = 0) -> None:
        self.layout = load_layout(layout_name)
        self.p = prompt_tokens
        self.n = n
        self.rng = random.Random(seed)
        self.groups = len(self.layout.groups)
        block = max(g.block_size for g in self.layout.groups)
        self.blocks_per_req = -(-(prompt_tokens + 64) // block) + 2

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 150_000) for _ in range(n)]

    def pool(self, requests: int) -> HybridBlockPool:
        return HybridBlockPool(self.layout, 1 + self.groups * self.blocks_per_req * requests)

    def run_once(self) -> dict[str, tuple[float, int]]:
        n, p = self.n, self.p
        out: dict[str, tuple[float, int]] = {}
        pool = self.pool(2 * n + 2)
        warm = self.tokens(p)
        pool.admit("warm", warm)
        pool.compute_prefill("warm")
        pool.take_events()
        pool.find_hit(warm)  # memoize its chain, as a router would have

        out["find_hit warm"] = _timed(lambda: [pool.find_hit(warm) for _ in range(n)] and n)
        colds = [self.tokens(p) for _ in range(n)]
        out["find_hit cold"] = _timed(lambda: [pool.find_hit(c) for c in colds] and n)

        tails = [warm + self.tokens(32) for _ in range(n)]

        def admit_hit() -> int:
            for i, t in enumerate(tails):
                if pool.admit(f"h{i}", t) is None:
                    raise SystemExit("pool too small for the admit-hit phase")
            return n

        out["admit hit"] = _timed(admit_hit)
        pool.take_events()

        def admit_cold() -> int:
            for i, t in enumerate(colds):
                if pool.admit(f"c{i}", t) is None:
                    raise SystemExit("pool too small for the admit-cold phase")
            return n

        out["admit cold"] = _timed(admit_cold)
        pool.take_events()
        out["compute_prefill"] = _timed(
            lambda: [pool.compute_prefill(f"c{i}") for i in range(n)] and n
        )

        def append() -> int:
            done = 0
            for step in range(32):
                for i in range(n):
                    if not pool.append_tokens(f"c{i}", [step + 1]):
                        raise SystemExit("pool too small for the append phase")
                    done += 1
            return done

        out["append"] = _timed(append)
        pool.take_events()

        def finish() -> int:
            for i in range(n):
                pool.finish(f"h{i}")
                pool.finish(f"c{i}")
            return 2 * n

        out["finish"] = _timed(finish)
        pool.take_events()

        # Eviction-heavy: a pool exactly big enough for one request, all of it cached.
        small = self.pool(1)
        small.admit("fill", self.tokens(p))
        small.finish("fill")
        small.take_events()
        removed = 0
        evict_prompts = [self.tokens(p) for _ in range(n)]

        def admit_evict() -> int:
            nonlocal removed
            for i, t in enumerate(evict_prompts):
                if small.admit(f"e{i}", t) is None:
                    raise SystemExit("pool too small for the eviction phase")
                small.finish(f"e{i}")
                removed += sum(type(e).__name__ == "BlockRemoved" for e in small.take_events())
            return n

        out["admit evict"] = _timed(admit_evict)
        out["_removed_per_admit"] = (1.0, removed // n)
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="fa_swa")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--n", type=int, default=200, help="requests per phase")
    ap.add_argument("--repeat", type=int, default=3, help="passes; the best is reported")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pool_bench.json")
    args = ap.parse_args(argv)
    if args.prompt_tokens < 2 or args.n < 1 or args.repeat < 1:
        ap.error("--prompt-tokens must be >= 2, --n and --repeat >= 1")

    bench = Bench(args.layout, args.prompt_tokens, args.n)
    best: dict[str, float] = {}
    counts: dict[str, int] = {}
    removed = 0
    for _ in range(args.repeat):
        for name, (dt, units) in bench.run_once().items():
            if name == "_removed_per_admit":
                removed = units
                continue
            rate = units / dt
            if rate > best.get(name, 0.0):
                best[name] = rate
                counts[name] = units

    print(
        f"pool_bench: layout={args.layout} prompt={args.prompt_tokens} tokens "
        f"n={args.n} best of {args.repeat}, torch {torch.__version__} on cpu"
    )
    print(f"{'operation':<18} {'ops/s':>12} {'us/op':>10} {'ops timed':>10}")
    for name, rate in best.items():
        print(f"{name:<18} {rate:>12,.0f} {1e6 / rate:>10.1f} {counts[name]:>10}")
    print(f"(admit evict: {removed} BlockRemoved per admission)")

    result = {
        "bench": "pool_bench",
        "layout": args.layout,
        "prompt_tokens": args.prompt_tokens,
        "n": args.n,
        "repeat": args.repeat,
        "ops_per_s": {k: round(v, 1) for k, v in best.items()},
        "us_per_op": {k: round(1e6 / v, 2) for k, v in best.items()},
        "removed_per_evicting_admit": removed,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
