"""Index benchmark: ingest, removal, decision latency and memory, Dynamo's workload shape.

Workload (issue #3, item 8): 8 replicas, block size 16, 2,048-block sequences (32k tokens),
25 % of each sequence a shared prefix drawn from 4 prefix groups, about 1 M stored blocks, two
KV-cache groups (full attention + sliding window 4096). Every hash is a real vLLM sha256
chain hash of real token ids, so the decision path (hashing + lookup + hybrid) runs on data
the index actually holds. Sliding-window stores follow vLLM's default retention: only the
``ceil(4095/16) = 256`` blocks ending at the prompt's replay boundary (spec §4.7).

Ingest is measured from encoded msgpack batches (vLLM 0.32 map encoding) to applied index
state, on one core: ``decode_batch(lazy_token_ids=True)`` (what the router's subscriber uses:
token ids stay encoded until a conformance check reads them) then ``KVIndex.apply_events``.

    python bench/index_bench.py            # full size (about a minute)
    python bench/index_bench.py --quick    # a smaller run for a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

from events.hashing import BlockHasher
from events.layout import GroupKind, GroupSpec, ModelLayout
from events.schema import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from router.core.index import KVIndex
from router.core.predict import Predictor

BLOCK = 16
WINDOW = 4096
NEED = math.ceil((WINDOW - 1) / BLOCK)
LAYOUT = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=BLOCK),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=BLOCK, sliding_window=WINDOW),
    )
)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_sequences(n_seqs: int, seq_blocks: int, rng: random.Random) -> list[list[int]]:
    """Token sequences: the first 25 % from one of 4 shared prefixes, the rest unique."""
    prefix_blocks = seq_blocks // 4
    prefixes = [[rng.randrange(32000) for _ in range(prefix_blocks * BLOCK)] for _ in range(4)]
    seqs = []
    for i in range(n_seqs):
        tail = [rng.randrange(32000) for _ in range((seq_blocks - prefix_blocks) * BLOCK)]
        seqs.append(prefixes[i % 4] + tail)
    return seqs


def store_events(wire: list[int], token_ids: list[int], per_event: int) -> list[BlockStored]:
    """The FA events (dense) and the SWA checkpoint events vLLM would emit for a prompt."""
    boundary = (len(token_ids) - 1) // BLOCK  # blocks below the replay boundary
    ranges = (
        (range(len(wire)), 0, {"kv_cache_spec_kind": "full_attention"}),
        (
            range(max(0, boundary - NEED), boundary),
            1,
            {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": WINDOW},
        ),
    )
    events: list[BlockStored] = []
    for blocks, group, kind in ranges:
        for start in range(blocks.start, blocks.stop, per_event):
            end = min(blocks.stop, start + per_event)
            events.append(
                BlockStored(
                    block_hashes=wire[start:end],
                    parent_block_hash=wire[start - 1] if start else None,
                    token_ids=token_ids[start * BLOCK : end * BLOCK],
                    block_size=BLOCK,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=group,
                    **kind,
                )
            )
    return events


def batches_of(events: list, per_batch: int, rank: int = 0) -> list[bytes]:
    return [
        encode_batch(KVEventBatch(time.time(), events[i : i + per_batch], rank))
        for i in range(0, len(events), per_batch)
    ]


def ingest(index: KVIndex, per_replica: dict, blocks: int) -> tuple[float, float]:
    """Decode and apply every replica's batches; returns (seconds, blocks/s).

    The generator's own data (tens of millions of token ids in lists) is moved out of the
    collector's sight first (``gc.freeze``): otherwise every full collection during the run
    walks it and the figure measures the benchmark's heap, not the index.
    """
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    for key, payloads in per_replica.items():
        for p in payloads:
            index.apply_events(key, decode_batch(p, lazy_token_ids=True).events)
    dt = time.perf_counter() - t0
    return dt, blocks / dt


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": 1e3 * statistics.median(s),
        "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))],
        "mean_ms": 1e3 * statistics.fmean(s),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--seq-blocks", type=int, default=2048, help="blocks per sequence (x16 tokens)")
    ap.add_argument("--stored-blocks", type=int, default=1_000_000, help="target stored blocks")
    ap.add_argument("--decisions", type=int, default=200, help="decision samples per case")
    ap.add_argument("--quick", action="store_true", help="a 10x smaller run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "index_bench.json"
    )
    args = ap.parse_args()
    if args.quick:
        args.stored_blocks //= 10
        args.decisions = max(20, args.decisions // 5)

    rng = random.Random(args.seed)
    per_seq = args.seq_blocks + NEED
    n_seqs = max(args.replicas, round(args.stored_blocks / per_seq))
    progress(f"generating {n_seqs} sequences of {args.seq_blocks} blocks ({per_seq} stored each)")
    seqs = make_sequences(n_seqs, args.seq_blocks, rng)
    hasher = BlockHasher(LAYOUT.hash, BLOCK)
    t0 = time.perf_counter()
    chains = []
    for i, s in enumerate(seqs):
        chains.append(hasher.wire_chain(s))
        if i % 50 == 49:
            progress(f"  hashed {i + 1}/{n_seqs} sequences")
    progress(f"hashed {n_seqs * args.seq_blocks} blocks in {time.perf_counter() - t0:.1f} s")
    owner = [i % args.replicas for i in range(n_seqs)]
    keys = [(f"r{r}", 0) for r in range(args.replicas)]

    results: dict = {
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
        },
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "workload": {
            "replicas": args.replicas,
            "block_size": BLOCK,
            "seq_blocks": args.seq_blocks,
            "sequences": n_seqs,
            "shared_prefix": "25 % of each sequence from 4 prefix groups",
            "groups": f"FA + SWA window {WINDOW} (SWA stores {NEED} checkpoint blocks per prompt)",
        },
    }
    index = None
    for per_event in (64, 1):
        progress(f"encoding batches with {per_event} block(s) per event")
        per_replica: dict = {k: [] for k in keys}
        blocks = 0
        for s, w, o in zip(seqs, chains, owner, strict=True):
            evs = store_events(w, s, per_event)
            blocks += sum(len(e.block_hashes) for e in evs)
            per_replica[keys[o]].extend(batches_of(evs, max(1, 2048 // per_event)))
        index = KVIndex(LAYOUT, verify_hashes=False)  # synthetic hashes
        for k in keys:
            index.add_replica(*k)
        progress(f"ingesting {blocks} blocks")
        dt, rate = ingest(index, per_replica, blocks)
        results[f"ingest_{per_event}_per_event"] = {
            "blocks": blocks,
            "seconds": dt,
            "blocks_per_s": rate,
        }
        progress(f"  {rate:,.0f} blocks/s")

    # Memory: rebuild once under tracemalloc, from encoded batches, so every key is a fresh
    # int object as in production (the generator's own hash lists are not counted).
    progress("measuring memory")
    index = None
    per_replica = {k: [] for k in keys}
    stored_total = 0
    for s, w, o in zip(seqs, chains, owner, strict=True):
        evs = store_events(w, s, 64)
        stored_total += sum(len(e.block_hashes) for e in evs)
        per_replica[keys[o]].extend(batches_of(evs, 32))
    del evs
    gc.collect()
    tracemalloc.start()
    index = KVIndex(LAYOUT, verify_hashes=False)
    for k in keys:
        index.add_replica(*k)
    for key, payloads in per_replica.items():
        for p in payloads:
            index.apply_events(key, decode_batch(p, lazy_token_ids=True).events)
    gc.collect()
    mem, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del per_replica
    results["memory"] = {
        "stored_blocks": stored_total,
        "unique_keys": index.entries,
        "bytes": mem,
        "bytes_per_stored_block": mem / stored_total,
        "bytes_per_key": mem / max(1, index.entries),
        "estimate_bytes": index.nbytes(),
    }
    progress(f"  {mem / stored_total:.1f} bytes per stored block")

    # Decisions on a 32k-token prompt the index holds (full hit on its owner).
    predictor = Predictor(index)
    target = 0
    prompt = seqs[target]

    def time_case(make_prompt, clear_memo: bool) -> dict:
        samples = []
        hits = None
        for _ in range(args.decisions):
            p = make_prompt()
            if clear_memo:
                predictor.hasher().clear_memo()
            t = time.perf_counter()
            pred = predictor.predict(p)
            samples.append(time.perf_counter() - t)
            hits = pred
        out = percentiles(samples)
        out["best_hit_tokens"] = max(r.hit_tokens for r in hits.replicas)
        out["hashed"] = hits.hashed
        return out

    progress("decision latency")
    predictor.predict(prompt)  # warm the memo: "a prefix the router has hashed before"
    results["decision_full_hit_warm"] = time_case(lambda: prompt, False)
    results["decision_full_hit_memo_cleared"] = time_case(lambda: prompt, True)
    novel_rng = random.Random(99)
    results["decision_novel"] = time_case(
        lambda: [novel_rng.randrange(32000) for _ in range(args.seq_blocks * BLOCK)], False
    )

    # Removal: every stored block removed again as vLLM sends it, one hash per event.
    progress("removal")
    removals: dict = {k: [] for k in keys}
    n_removed = 0
    for w, o in zip(chains, owner, strict=True):
        evs = [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0) for h in w]
        n_removed += len(evs)
        removals[keys[o]].extend(batches_of(evs, 512))
    dt, rate = ingest(index, removals, n_removed)
    results["removal_1_per_event"] = {"blocks": n_removed, "seconds": dt, "blocks_per_s": rate}

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print_table(results)
    print(f"\nJSON: {args.out}")
    return 0


def print_table(r: dict) -> None:
    def lat(case: str) -> str:
        return f"p50 {r[case]['p50_ms']:.3f} ms / p99 {r[case]['p99_ms']:.3f} ms"

    def rate(case: str) -> str:
        return f"{r[case]['blocks_per_s']:,.0f} blocks/s"

    rows = [
        ("ingest, 64 blocks/event", rate("ingest_64_per_event"), ">= 1.2 M"),
        ("ingest, 1 block/event", rate("ingest_1_per_event"), ">= 150 k"),
        ("removal, 1 block/event", rate("removal_1_per_event"), "-"),
        ("decision 32k, full hit, memo warm", lat("decision_full_hit_warm"), "<= 1.3 ms p50"),
        ("decision 32k, full hit, memo cleared", lat("decision_full_hit_memo_cleared"), "report"),
        ("decision 32k, novel prompt", lat("decision_novel"), "<= 0.1 ms p50"),
        ("memory", f"{r['memory']['bytes_per_stored_block']:.1f} bytes/stored block", "<= 70"),
    ]
    w = max(len(a) for a, _, _ in rows)
    v = max(len(b) for _, b, _ in rows)
    print(f"\n{'measure':<{w}}  {'result':<{v}}  target")
    print(f"{'-' * w}  {'-' * v}  ------")
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:<{v}}  {c}")


if __name__ == "__main__":
    sys.exit(main())
