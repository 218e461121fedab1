"""What the admission-time view and prefix homes cost per routing decision (issue 17):
``PoolState.decide`` without prefix homes (``affinity_weight = 0``, speculation off), with
homes but no fair share (``affinity_fair_share = 0``), with the defaults (prefix homes and
their fair share on, the speculative overlay off), with the overlay on and nothing in
flight, and on with requests in flight that share the request's system prompt (then every
decision runs a second prediction over index + overlay, and records its own entries); last
the defaults with the eviction forecast on (``eviction_forecast = true``) and requests in
flight on replicas whose metrics say their cache is full, so that every decision walks the
allocations queued ahead and predicts once more without what they evict.

The pool is the router's own (``router.server.state.PoolState``, no HTTP, no subscribers),
hybrid full attention + sliding window 128 with 16-token blocks (the shape of the shipped
layout ``fa_swa``), ``--replicas`` replicas each holding a share of eight 1,000-token system prompts
(stored through ``KVIndex.apply_events``, as events would). Each decision is a new
``--tokens``-token prompt behind one of the system prompts. "in flight" keeps the last
``--in-flight`` decisions' insertions open and finishes the oldest as a new one comes, as the
proxy does when answers end.

    .venv/bin/python bench/decide_bench.py [--replicas 2 8 32] [--n 2000] [--tokens 2000]

Prints a table (median and p90 microseconds per decision, and on/off ratios measured in the
same run) and writes ``bench/results/decide_bench.json``.

Where the cost goes: with the overlay on, every decision hashes its prompt's every block to
record what it will cache (the events-only prediction stops hashing at the first block no
replica holds), so "on, idle" already costs the full chain's hashes; "in flight" adds the
second prediction over index + overlay. Prefix homes (router.core.affinity) hash the prompt
once more in 64-token chunks, to look up and to record its homes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from events.schema import BlockStored  # noqa: E402
from router.config import parse_config  # noqa: E402
from router.server.state import PoolState, RouterState  # noqa: E402

SYSTEMS = 8


def make_pool(
    names: Sequence[str],
    *,
    speculative: bool,
    routing: bool = True,
    seed: int = 1,
    affinity_weight: float | None = None,
    load_band_tokens: float = 0.0,
    affinity_fair_share: float | None = None,
    forecast: bool = False,
    family_spread_tokens: float = 0.0,
) -> PoolState:
    """The router's own pool (fa + swa 128, 16-token blocks) over replicas with no event
    stream, each reset to known-empty and so trusted (tests/test_speculative.py uses it too).
    ``affinity_weight`` None keeps the policy's default (prefix homes on)."""
    toml = f"""
[server]
metrics_scrape_interval_s = 0
[[pools]]
model = "m"
[pools.layout]
groups = [{{kind = "full_attention", block_size = 16}},
          {{kind = "sliding_window", block_size = 16, sliding_window = 128}}]
[pools.policy]
seed = {seed}
speculative_insert = {"true" if speculative else "false"}
speculative_routing = {"true" if routing else "false"}
"""
    if affinity_weight is not None:
        toml += f"affinity_weight = {affinity_weight}\n"
    if load_band_tokens:
        toml += f"load_band_tokens = {float(load_band_tokens)}\n"
    if affinity_fair_share is not None:
        toml += f"affinity_fair_share = {float(affinity_fair_share)}\n"
    if forecast:
        toml += "eviction_forecast = true\n"
    if family_spread_tokens:
        toml += f"family_spread_tokens = {float(family_spread_tokens)}\n"
    for name in names:
        toml += f'[[pools.replicas]]\nname = "{name}"\nurl = "http://127.0.0.1:9"\n'
    return pool_from_toml(toml)


def pool_from_toml(toml: str) -> PoolState:
    """The first pool of a config, its replicas added (no event stream: each reset to
    known-empty, so trusted)."""
    config = parse_config(toml)
    pool = PoolState(config.pools[0], RouterState(config))

    async def add() -> None:
        for rcfg in config.pools[0].replicas:
            await pool.add_replica(rcfg)

    asyncio.run(add())
    for key in pool.index.replicas():
        pool.index.reset_replica(key)  # no event stream here: known empty, trusted
    return pool


def store(pool: PoolState, systems: list[list[int]]) -> None:
    """Each system prompt on two replicas (round robin), every block in both groups."""
    hasher = pool.index.hasher()
    keys = pool.index.replicas()
    for s, tokens in enumerate(systems):
        wire = hasher.wire_chain(tokens)
        for key in (keys[s % len(keys)], keys[(s + 1) % len(keys)]):
            events = [
                BlockStored(block_hashes=wire, parent_block_hash=None,
                            token_ids=tokens[: len(wire) * 16], block_size=16, lora_id=None,
                            medium="GPU", lora_name=None, group_idx=g)
                for g in (0, 1)
            ]  # fmt: skip
            pool.index.apply_events(key, events)
            if pool.forecast is not None:  # as the subscriber feeds both
                pool.forecast.on_events(key, events)


def run(replicas: int, mode: str, n: int, tokens: int, in_flight: int) -> list[float]:
    rng = random.Random(replicas)
    systems = [[rng.randrange(7, 2048) for _ in range(1000)] for _ in range(SYSTEMS)]
    pool = make_pool(
        [f"r{i}" for i in range(replicas)],
        speculative=mode not in ("off", "no affinity", "no fair share", "forecast"),
        affinity_weight=0.0 if mode == "no affinity" else None,
        affinity_fair_share=0.0 if mode == "no fair share" else None,
        forecast=mode == "forecast",
    )
    store(pool, systems)
    if mode == "forecast":  # 1 % of 2,000 blocks free; no waiting count: all in flight queue
        for rep in pool.replicas.values():
            rep.kv_usage, rep.num_gpu_blocks = {0: 0.99}, {0: 2000.0}
            rep.scraped_mono = 0.0
    prompts = [
        systems[rng.randrange(SYSTEMS)] + [rng.randrange(7, 2048) for _ in range(tokens - 1000)]
        for _ in range(n)
    ]
    open_ins: list[object] = []
    times = []
    for p in prompts:
        t0 = time.perf_counter()
        choice = pool.decide(p, {})
        times.append(time.perf_counter() - t0)
        if pool.forecast is not None:  # answers begin and end in routing order
            open_ins.append(choice)
            if len(open_ins) > in_flight:
                done = open_ins.pop(0)
                pool.answering(done)  # type: ignore[arg-type]
                pool.ended(done)  # type: ignore[arg-type]
        if pool.speculative is not None:
            if mode == "on, idle":
                pool.speculative.discard(choice.insertion)
            else:
                open_ins.append(choice.insertion)
                if len(open_ins) > in_flight:
                    pool.speculative.finish(open_ins.pop(0))  # type: ignore[arg-type]
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--n", type=int, default=2000, help="decisions per cell")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens per request")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/decide_bench.json")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # "no event endpoint configured" per replica: known here
    flight = f"on, {args.in_flight} in flight"
    modes = ["no affinity", "no fair share", "off", "on, idle", flight, "forecast"]
    rows = []
    for r in args.replicas:
        cells = {}
        for mode in modes:
            t = run(r, mode if mode != flight else "flight", args.n,
                    args.tokens, args.in_flight)  # fmt: skip
            t = t[len(t) // 10 :]  # warm-up (hash memo, first inserts) out
            cells[mode] = {
                "p50_us": 1e6 * statistics.median(t),
                "p90_us": 1e6 * sorted(t)[int(0.9 * (len(t) - 1))],
            }
            print(f"  replicas {r:>3} {mode:<18} p50 {cells[mode]['p50_us']:8.1f} us", flush=True)
        rows.append({"replicas": r, **cells})
    print(f"\ndecide() per request, {args.tokens}-token prompts, fa+swa 16-token blocks, "
          f"{args.n} decisions per cell (medians; p90 in brackets)")  # fmt: skip
    print(f"{'replicas':>8} " + " ".join(f"{m:>24}" for m in modes)
          + "   on/off (in flight)   affinity   fair share   forecast")  # fmt: skip
    for row in rows:
        cells = " ".join(
            f"{row[m]['p50_us']:>12.1f} [{row[m]['p90_us']:>8.1f}] us"[-24:].rjust(24)
            for m in modes
        )
        ratio = row[modes[4]]["p50_us"] / row["off"]["p50_us"]
        homes = row["no fair share"]["p50_us"] / row["no affinity"]["p50_us"]
        fair = row["off"]["p50_us"] / row["no fair share"]["p50_us"]
        fc = row["forecast"]["p50_us"] / row["off"]["p50_us"]
        print(f"{row['replicas']:>8} {cells}   {ratio:.2f}x{'':17}{homes:.2f}x{'':6}{fair:.2f}x"
              f"{'':8}{fc:.2f}x")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine()}
    args.out.write_text(json.dumps({"meta": meta, "args": vars(args) | {"out": str(args.out)},
                                    "rows": rows}, indent=2))  # fmt: skip
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
