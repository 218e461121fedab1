"""Decisions at fleet scale (issue 16, item 4): how the router's decision cost, its index's
memory and its removal rate grow with the number of replicas.

The instrument the rest of issue 16 is judged with. For each ``--replicas`` count it builds the
router's own pool (``router.server.state.PoolState``, no HTTP, no subscribers; the pool of
bench/decide_bench.py: hybrid full attention + sliding window 128, 16-token blocks, the shape
of the shipped layout ``fa_swa``; speculation off and prefix homes on, the shipped defaults),
fills its index through ``KVIndex.apply_events`` from encoded vLLM batches, as the router's
subscriber does, and measures:

- **decisions**: ``PoolState.decide`` p50/p99 (µs) and the replicas it scored one by one
  (docs/decision-cost.md) per prompt length (``--tokens``) and kind:
  *stored* (the whole prompt cached on two replicas, and hashed by the router before: its
  memo is warm), *half-shared* (the first half is an earlier turn cached on two replicas, the
  second half new) and *novel* (no replica holds its first block);
- **memory**: tracemalloc's count of the index filled with the background from empty, per
  stored (replica, block) pair, beside the index's own account (``KVIndex.nbytes``, the figure its
  ``max_bytes`` budget is enforced on) and their ratio;
- **removals** in vLLM's form (one hash per ``BlockRemoved``, 512 events per batch): decode +
  apply (the subscriber's path) and apply alone, blocks/s;
- **pool build** seconds: the router's per-replica state (``PoolState.add_replica``: an HTTP
  client each), which no decision touches but every fleet pays at start.

The cyclic garbage collector stays on, as in the router, so p99 includes its full passes.

Background (every replica, "a realistic share"): ``--blocks-per-replica`` full-attention
blocks (2,048 = 32k tokens by default, a small GPU's cache), made of 4 of 32 shared 1,024-token
system prompts and conversations of 4k tokens behind them (their own 3k tokens stored in
2,048-token prefill chunks); the sliding-window group keeps the 8 blocks ending at each
conversation's replay boundary (vLLM's default retention, spec §4.7). Every hash is a real
chain hash of real token ids, so the conformance check passes and every lookup is genuine.

    .venv/bin/python bench/fleet_bench.py            # full run, about 10 minutes on 2 cores
    .venv/bin/python bench/fleet_bench.py --quick    # 8 and 64 replicas, 2k tokens, < 30 s

Writes a markdown table (also on stdout), JSON and a PNG of decision p50 against replicas
beside ``--out`` (``bench/results/fleet_bench.{json,md,png}``; ``--quick`` writes to the temp
directory unless ``--out`` is given, so a smoke run never replaces the committed results).
Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decide_bench import make_pool, store  # noqa: E402
from index_bench import batches_of, ingest, progress  # noqa: E402

from events.hashing import BlockHasher  # noqa: E402
from events.schema import BlockRemoved, BlockStored, decode_batch  # noqa: E402
from router.server.state import PoolState  # noqa: E402

KINDS = ("stored", "half-shared", "novel")
PROMPTS = 16
"""Stored prompts (and half-shared first halves) per length, each on two replicas."""
SYSTEMS = 32
SYSTEM_BLOCKS = 64
"""Shared system prompts of the background: 32 of 1,024 tokens; each replica holds 4."""
SYSTEMS_PER_REPLICA = 4
CONV_OWN_BLOCKS = 192
"""A background conversation's own blocks behind its system prompt (3k tokens)."""
PREFILL_CHUNK = 128
"""Blocks per store event (vLLM's chunked prefill of 2,048 tokens)."""
EVENTS_PER_BATCH = 16
REMOVALS_PER_BATCH = 512


def token_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids below 65,536 (a 64k vocabulary), cheaply: the full run draws
    about 90 million."""
    return array.array("H", rng.randbytes(2 * n)).tolist()


def _stored(wire: list, tokens: list[int], start: int, stop: int, group: int) -> BlockStored:
    return BlockStored(
        block_hashes=wire[start:stop],
        parent_block_hash=wire[start - 1] if start else None,
        token_ids=tokens[start * 16 : stop * 16],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
    )


class Background:
    """Every replica's share of the fleet's cache, as encoded event batches, and a sample of
    its (group, hash) keys for the removal measurement."""

    def __init__(self, pool: PoolState, rng: random.Random, blocks: int, removals: int) -> None:
        layout = pool.index.layout
        if layout is None:
            raise RuntimeError("the pool's layout is not resolved: declare its groups")
        window = layout.layout.groups[1].sliding_window or 0
        self.need = math.ceil((window - 1) / 16)
        self.hasher = BlockHasher(layout.layout.hash, layout.hash_block_size)
        self.systems = [token_ids(rng, SYSTEM_BLOCKS * 16) for _ in range(SYSTEMS)]
        for s in self.systems:  # the conformance check re-hashes root stores with the pool's
            pool.index.hasher().wire_chain(s)  # hasher: warm its memo now, not while traced
        self.convs = max(0, (blocks - SYSTEMS_PER_REPLICA * SYSTEM_BLOCKS) // CONV_OWN_BLOCKS)
        self.rng = rng
        self.per_replica_removals = max(1, math.ceil(removals / len(pool.index.replicas())))

    def replica(self) -> tuple[list[bytes], list[tuple[int, int]]]:
        """One replica's batches and its removal sample."""
        rng = self.rng
        mine = rng.sample(range(SYSTEMS), SYSTEMS_PER_REPLICA)
        events: list[BlockStored] = []
        for s in mine:  # first computed on this replica: a root store (conformance-checked)
            tokens = self.systems[s]
            events.append(_stored(self.hasher.wire_chain(tokens), tokens, 0, SYSTEM_BLOCKS, 0))
        sample: list[tuple[int, int]] = []
        for _ in range(self.convs):
            tokens = self.systems[rng.choice(mine)] + token_ids(rng, CONV_OWN_BLOCKS * 16)
            wire = self.hasher.wire_chain(tokens)
            for start in range(SYSTEM_BLOCKS, len(wire), PREFILL_CHUNK):
                stop = min(len(wire), start + PREFILL_CHUNK)
                events.append(_stored(wire, tokens, start, stop, 0))
            boundary = (len(tokens) - 1) // 16
            events.append(_stored(wire, tokens, boundary - self.need, boundary, 1))
            if len(sample) < self.per_replica_removals:
                sample += [(0, h) for h in wire[SYSTEM_BLOCKS:]]
                sample += [(1, h) for h in wire[boundary - self.need : boundary]]
        return batches_of(events, EVENTS_PER_BATCH), sample[: self.per_replica_removals]


def populate(pool: PoolState, bg: Background) -> tuple[dict, dict]:
    """Fill the empty index with the background under tracemalloc; the memory row and the
    removal sample. Only decode + apply is traced: the batches are encoded first and the decoded
    events are garbage once applied, so what stays is what the index holds."""
    keys = pool.index.replicas()
    payloads: dict = {}
    removals: dict = {}
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        payloads[key], removals[key] = bg.replica()
        if (i + 1) % max(1, len(keys) // 4) == 0:
            progress(f"  background: {i + 1}/{len(keys)} replicas generated")
    gen_s = time.perf_counter() - t0
    progress(f"  applying {sum(len(b) for b in payloads.values()):,} batches under tracemalloc")
    index = pool.index
    if index.entries:
        raise RuntimeError("the background must be the index's first content: it is measured")
    gc.collect()
    tracemalloc.start()
    fill_s, _ = ingest(index, payloads, 1)  # index_bench's: the subscriber's decode + apply
    gc.unfreeze()  # ingest freezes the heap to keep full collections off it; undo that here
    del payloads
    gc.collect()
    traced, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stats = index.stats()
    bad = [s.replica for s in stats if s.trust != "exact"]
    if bad:
        raise RuntimeError(f"background fill left replicas not exact: {bad[:5]}")
    pairs = sum(s.blocks for s in stats)
    estimate = index.nbytes()
    return {
        "pairs": pairs,
        "keys": index.entries,
        "traced_bytes": traced,
        "estimate_bytes": estimate,
        "measured_b_per_pair": traced / pairs,
        "estimate_b_per_pair": estimate / pairs,
        "ratio": traced / estimate,
        "measured_b_per_key": traced / index.entries,
        "generate_s": gen_s,
        "fill_traced_s": fill_s,
    }, removals


def remove(pool: PoolState, removals: dict) -> dict:
    """Remove the sample in vLLM's form; half timed as decode + apply, half as apply only."""
    index = pool.index
    coded: list = []
    for key, sample in removals.items():
        evs = [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=g) for g, h in sample]
        half = len(evs) // 2
        coded.append((key, batches_of(evs[:half], REMOVALS_PER_BATCH), evs[half:]))
    before = sum(s.blocks for s in index.stats())
    gc.collect()
    n1 = n2 = 0
    t0 = time.perf_counter()
    for key, batches, _ in coded:
        for p in batches:
            evs = decode_batch(p).events
            n1 += len(evs)
            index.apply_events(key, evs)
    decode_s = time.perf_counter() - t0
    plain = [
        (key, [evs[i : i + REMOVALS_PER_BATCH] for i in range(0, len(evs), REMOVALS_PER_BATCH)])
        for key, _, evs in coded
    ]
    t0 = time.perf_counter()
    for key, batches in plain:
        for evs in batches:
            n2 += len(evs)
            index.apply_events(key, evs)
    apply_s = time.perf_counter() - t0
    gone = before - sum(s.blocks for s in index.stats())
    if gone != n1 + n2:
        raise RuntimeError(f"removed {gone} blocks of the {n1 + n2} sent: the sample is wrong")
    return {
        "removed": gone,
        "decode_apply_blocks_per_s": n1 / decode_s,
        "apply_blocks_per_s": n2 / apply_s,
    }


def decisions(
    pool: PoolState,
    prompt: object,
    n: int,
    budget_s: float,
) -> dict:
    """``n`` timed ``decide`` calls (fewer if ``budget_s`` runs out first, at least 20) after
    a few untimed ones; each prompt is made before its clock starts."""
    times: list[float] = []
    hits: list[int] = []
    scored: list[int] = []
    for _ in range(3):
        pool.decide(prompt(), {})  # type: ignore[operator]
    gc.collect()
    deadline = time.perf_counter() + budget_s
    while len(times) < n and (len(times) < 20 or time.perf_counter() < deadline):
        p = prompt()  # type: ignore[operator]
        t0 = time.perf_counter()
        choice = pool.decide(p, {})
        times.append(time.perf_counter() - t0)
        pred = choice.prediction
        hits.append(max((r.hit_tokens for r in pred.replicas), default=0) if pred else 0)
        scored.append(len(choice.decision.ranked))
    s = sorted(times)
    return {
        "n": len(s),
        "p50_us": 1e6 * statistics.median(s),
        "p99_us": 1e6 * s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)],
        "mean_us": 1e6 * statistics.fmean(s),
        "best_hit_tokens": int(statistics.median(hits)),
        "scored": int(statistics.median(scored)),
    }


def run_replicas(replicas: int, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every measurement at one fleet size, on one pool."""
    rng = random.Random(args.seed * 1_000_003 + replicas)
    progress(f"{replicas} replicas: building the pool")
    t0 = time.perf_counter()
    pool = make_pool(
        [f"r{i}" for i in range(replicas)],
        speculative=False,
        seed=args.seed,
        load_band_tokens=args.band,
        family_spread_tokens=args.spread,
    )
    build_s = time.perf_counter() - t0
    if args.band or args.spread:  # a fleet at work: some load on each replica
        for rep in pool.replicas.values():
            rep.request_started(0, rng.choice([0, 0, 512, 2048, 16_384]))
            if args.band:  # and each cache's churn
                pool.wrote(rep, 0, rng.randint(1, 50_000))
    if args.spread and pool.homes is not None:  # 0-4 prefix families homed on each replica
        for key in pool.index.replicas():
            for _ in range(rng.randint(0, 4)):
                chunks = pool.homes.keys(token_ids(rng, 128))
                pool.homes.record(chunks, key)
                pool.homes.record(chunks, key)  # carried twice: a family
    if args.full_scan:
        pool._decide_shortlist = lambda *a, **k: None  # type: ignore[method-assign]
    bg = Background(pool, rng, args.blocks_per_replica, args.removals)
    mem, removals = populate(pool, bg)  # first, so tracemalloc sees the index grow from empty
    stored = {t: [token_ids(rng, t) for _ in range(PROMPTS)] for t in args.tokens}
    halves = {t: [token_ids(rng, t // 2) for _ in range(PROMPTS)] for t in args.tokens}
    for t in args.tokens:
        store(pool, stored[t])  # each on two replicas; hashed by the pool's own hasher
        store(pool, halves[t])
    if args.partial:  # a router attached late: decisions also imply (Predictor.implied_keys)
        for key in pool.index.replicas():
            pool.index.attached_late(key, "fleet bench --partial")
    progress(
        f"{replicas} replicas: {mem['pairs']:,} (replica, block) pairs, "
        f"{mem['measured_b_per_pair']:.1f} B each (index estimate "
        f"{mem['estimate_b_per_pair']:.1f} B)"
    )
    cells = []
    for t in args.tokens:
        makers = {
            "stored": lambda t=t: rng.choice(stored[t]),
            "half-shared": lambda t=t: rng.choice(halves[t]) + token_ids(rng, t - t // 2),
            "novel": lambda t=t: token_ids(rng, t),
        }
        for kind in KINDS:
            cell = decisions(pool, makers[kind], args.n, args.cell_seconds)
            cells.append({"replicas": replicas, "tokens": t, "kind": kind, **cell})
            progress(
                f"{replicas} replicas, {t} tokens, {kind}: p50 {cell['p50_us']:,.0f} µs, "
                f"p99 {cell['p99_us']:,.0f} µs ({cell['n']} decisions)"
            )
    rem = remove(pool, removals)
    progress(f"{replicas} replicas: removals {rem['decode_apply_blocks_per_s']:,.0f} blocks/s")
    return cells, {"replicas": replicas, "pool_build_s": build_s, **mem, **rem}


def markdown(doc: dict) -> str:
    """The results as markdown: the decision table, then the index table."""
    a = doc["args"]
    w = doc["workload"]
    lines = [
        "# Fleet bench: decisions, index memory and removals against replicas",
        "",
        f"`{doc['command']}` on {doc['meta']['cores']} cores, Python {doc['meta']['python']}.",
        f"Pool: {w['layout']}; policy {w.get('policy', 'defaults')} (speculation off, "
        "prefix homes on). "
        f"Background per replica: {w['background']}. Replicas: {w.get('trust', 'exact')}.",
        "",
        f"## Decision (`PoolState.decide`), µs; up to {a['n']} decisions per cell",
        "",
        "`scored`: replicas the decision scored one by one (median; the kv policy's shortlist, "
        "docs/decision-cost.md, stands for the others by their load).",
        "",
        "| replicas | tokens | prompt | n | p50 µs | p99 µs | best hit (tokens) | scored |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in doc["cells"]:
        lines.append(
            f"| {c['replicas']} | {c['tokens']} | {c['kind']} | {c['n']} | {c['p50_us']:,.0f} "
            f"| {c['p99_us']:,.0f} | {c['best_hit_tokens']} | {c['scored']} |"
        )
    lines += [
        "",
        "## Index: memory per stored (replica, block) and removals (one hash per BlockRemoved)",
        "",
        "| replicas | pairs | keys | measured B/pair | estimate B/pair | measured/estimate "
        "| measured B/key | removal decode+apply blocks/s | removal apply blocks/s "
        "| pool build s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["index"]:
        lines.append(
            f"| {r['replicas']} | {r['pairs']:,} | {r['keys']:,} | "
            f"{r['measured_b_per_pair']:.1f} | {r['estimate_b_per_pair']:.1f} | "
            f"{r['ratio']:.2f} | {r['measured_b_per_key']:.1f} | "
            f"{r['decode_apply_blocks_per_s']:,.0f} | {r['apply_blocks_per_s']:,.0f} | "
            f"{r['pool_build_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--n", type=int, default=1000, help="most decisions per cell")
    ap.add_argument("--cell-seconds", type=float, default=10.0,
                    help="stop a cell after this long (with at least 20 decisions)")  # fmt: skip
    ap.add_argument("--blocks-per-replica", type=int, default=2048,
                    help="full-attention blocks each replica holds (x16 tokens)")  # fmt: skip
    ap.add_argument("--removals", type=int, default=200_000, help="blocks removed per size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="JSON path; .md and .png beside it")
    ap.add_argument("--partial", action="store_true",
                    help="every replica partial (attached late): decisions pay the implication "
                         "of partial replicas' keys (docs/live-fleet.md)")  # fmt: skip
    ap.add_argument("--band", type=float, default=0.0,
                    help="the kv policy's load_band_tokens; each replica then gets some load "
                         "and a cache-churn history before the decisions")  # fmt: skip
    ap.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="the kv policy's family_spread_tokens; each replica then gets some load "
        "and 0-4 prefix families",
    )
    ap.add_argument("--full-scan", action="store_true",
                    help="decide by the full scan only (no shortlist): what it saves")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="8 and 64 replicas, 2k tokens, 40 decisions per cell")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.replicas, args.tokens, args.n, args.cell_seconds = [8, 64], [2048], 40, 2.0
        args.removals = 20_000
    if args.out is None:
        base = Path(tempfile.gettempdir()) if args.quick else ROOT / "bench/results"
        args.out = base / "fleet_bench.json"
    bad = [t for t in args.tokens if t < 64 or t % 32]
    if bad or min(args.replicas) < 2:
        ap.error("--tokens must be multiples of 32 of at least 64, --replicas at least 2")
    logging.disable(logging.WARNING)  # "no event endpoint configured" per replica: known here
    cells: list[dict] = []
    index: list[dict] = []
    for r in args.replicas:
        c, i = run_replicas(r, args)
        cells += c
        index.append(i)
        gc.collect()
    doc = {
        "meta": {"python": platform.python_version(), "cores": os.cpu_count()},
        "command": " ".join(["python", "bench/fleet_bench.py", *(argv or sys.argv[1:])]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": {
            "layout": "full attention + sliding window 128, 16-token blocks (fa_swa)",
            "background": (
                f"{args.blocks_per_replica} full-attention blocks ({SYSTEMS_PER_REPLICA} of "
                f"{SYSTEMS} shared {SYSTEM_BLOCKS * 16}-token system prompts, conversations "
                f"of {CONV_OWN_BLOCKS * 16} own tokens behind them) + 8 sliding-window blocks "
                f"per conversation"
            ),
            "stored_prompts": f"{PROMPTS} per length, each on two replicas",
            "trust": "every replica partial (attached late)" if args.partial else "exact",
            "policy": (
                f"load_band_tokens = {args.band:g}, each replica with 0-16k tokens queued and "
                "1-50k new tokens written"
                if args.band
                else f"family_spread_tokens = {args.spread:g}, each replica with 0-16k tokens "
                "queued and 0-4 prefix families"
                if args.spread
                else "defaults"
            )
            + (", full scan only" if args.full_scan else ""),
        },
        "cells": cells,
        "index": index,
    }
    md = markdown(doc)
    print("\n" + md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    args.out.with_suffix(".md").write_text(md)
    from plots import plot_fleet_decisions

    paths = plot_fleet_decisions(doc, args.out.with_suffix(".png"))
    print(f"JSON: {args.out}\nmarkdown: {args.out.with_suffix('.md')}")
    for p in paths:
        print(f"plot: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
