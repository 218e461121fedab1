"""The eviction-order proof's cost per request on a partial replica (router.core.eviction_order).

While a replica is partial, the router notes each request's prompt keys in the tracked group as
it is sent (hashing the whole prompt), the keys its answer says it hit, and its end; each
applied batch is scanned. This script times that bookkeeping per request, on an index with one
partial replica whose proof is armed, against the same index with the proof off
(``max_witness_keys = 0``), for prompts of 2k and 32k tokens (16-token blocks, FA + SWA): each
request hits its first half (a shared prefix) and stores the rest, as vLLM publishes it. The
hashing of the whole prompt is shown apart: the router's implication pass for partial replicas
(router.core.predict.Predictor.implied_keys) hashes it before the decision as well.

    .venv/bin/python bench/eviction_proof_bench.py [--requests 300] [--out PATH]

Prints a table (median and p99 microseconds per request) and writes JSON
(``bench/results/eviction_proof_bench.json`` by default).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from events.hashing import BlockHasher
from events.layout import GroupKind, GroupSpec, ModelLayout
from events.schema import BlockStored
from router.core.index import IndexLimits, KVIndex
from router.core.predict import Predictor

FA = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)
SWA = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48)
LAYOUT = ModelLayout(groups=(FA, SWA))
A = ("A", 0)


def run(tokens: int, requests: int, proof: bool, seed: int) -> tuple[list[float], list[float]]:
    """Microseconds per request: hashing its prompt for the tracked keys (what the proof
    adds, unless the router's implication pass hashed it already), and the rest (sending,
    its batch, its answer, its end)."""
    rng = random.Random(seed)
    limits = IndexLimits(max_witness_keys=(1 << 16) if proof else 0)
    index = KVIndex(LAYOUT, verify_hashes=False, limits=limits)
    index.add_replica("A")
    index.attached_late(A, "bench")
    index.witness_scrape(A, 0.0, 0, None, 0, 0)
    index.witness_scrape(A, 1.0, 0, None, 0, 0)
    predictor = Predictor(index)
    hasher = BlockHasher(LAYOUT.hash, 16)
    prefix = [rng.randrange(30000) for _ in range(tokens // 2)]
    hashing, rest = [], []
    for i in range(requests):
        prompt = prefix + [rng.randrange(30000) for _ in range(tokens - len(prefix))]
        chain = hasher.wire_chain(prompt)
        half = len(prefix) // 16
        stores = [
            BlockStored(
                block_hashes=chain[half:], parent_block_hash=chain[half - 1],
                token_ids=prompt[16 * half :], block_size=16, medium="GPU", group_idx=g,
            )
            for g in (0, 1)
        ]  # fmt: skip
        now = 2.0 + i
        t0 = time.perf_counter()
        tracked = predictor.group_keys(prompt, None, 0) if proof else None
        t1 = time.perf_counter()
        if proof:
            index.witness_sending(A, i, tracked)
        index.apply_events(A, stores)
        if proof:
            index.witness_touched(A, predictor.keys_behind(prompt, None, 16 * half), now)
            index.witness_ended(A, i, now + 0.5, True)
        hashing.append(1e6 * (t1 - t0))
        rest.append(1e6 * (time.perf_counter() - t1))
    return hashing, rest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results/eviction_proof_bench.json")
    args = ap.parse_args()
    rows = []
    for tokens in (2048, 32768):
        for proof in (False, True):
            hashing, rest = (sorted(x[10:]) for x in run(tokens, args.requests, proof, args.seed))
            rows.append(
                {
                    "prompt_tokens": tokens,
                    "proof": proof,
                    "hash_median_us": round(statistics.median(hashing), 1),
                    "median_us": round(statistics.median(rest), 1),
                    "p99_us": round(rest[int(0.99 * (len(rest) - 1))], 1),
                }
            )
            print(f"  {tokens:>6} tokens, proof {'on ' if proof else 'off'}: done", flush=True)
    print(
        "\n| prompt tokens | proof | hashing the prompt, median µs | the rest, median µs "
        "| the rest, p99 µs |"
    )
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        on = "on" if r["proof"] else "off"
        print(
            f"| {r['prompt_tokens']:,} | {on} | {r['hash_median_us']:,} | {r['median_us']:,} "
            f"| {r['p99_us']:,} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
