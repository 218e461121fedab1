"""Wiping one replica's state: what it costs the serving loop (docs/live-fleet.md §3).

An index of two replicas: ``a`` stores N keys (int wire hashes, batches of 1,000), ``b`` stores
100. Then one replica is wiped with ``AllBlocksCleared`` (what a clear, a gap the ring cannot
cover, an untrust or a removal does). Reported per case:

* ``wipe``: the synchronous part, the ``apply_events`` call that carries the clear (what every
  request queued behind it on the event loop waits);
* ``sweep``: where the index retires the old slot in bounded steps (``KVIndex.sweep``), the
  steps' count, total and slowest/median step, until the slot is free again. An index without
  ``sweep`` (before the change) wipes everything inside the first figure.

Cases: wiping ``b`` (100 keys among N) and wiping ``a`` (all N keys), each on the compact
KeyTable (where built) and on dict tables (``--dict``, the ``KVROUTER_NATIVE_INDEX=0`` path).

    python bench/wipe_bench.py                  # 100k and 1M keys, KeyTable
    python bench/wipe_bench.py --dict           # the same on dict tables
    python bench/wipe_bench.py --keys 100000    # one size
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from events.layout import GroupKind, GroupSpec, ModelLayout
from events.schema import AllBlocksCleared, BlockStored
from router.core.index import KVIndex

LAYOUT = ModelLayout(groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),))


def build(n: int, compact: bool, seed: int) -> KVIndex:
    rng = random.Random(seed)
    index = KVIndex(LAYOUT, verify_hashes=False, compact=compact)
    a, b = index.add_replica("a"), index.add_replica("b")
    hashes = [rng.getrandbits(63) for _ in range(n)]
    for i in range(0, n, 1000):
        index.apply_events(a, [BlockStored(hashes[i : i + 1000], None, [], 16)])
    index.apply_events(b, [BlockStored([rng.getrandbits(63) for _ in range(100)], None, [], 16)])
    return index


def measure(index: KVIndex, victim: str) -> dict[str, float]:
    """Wipe ``victim`` and run the sweep to its end (if the index has one)."""
    key = (victim, 0)
    # the builder's garbage out of the way, and what survives out of the collector's sight
    # (as bench/index_bench.py does): the figures are the index's, not this script's heap's
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    index.apply_events(key, [AllBlocksCleared()])
    out = {"wipe_ms": 1e3 * (time.perf_counter() - t0)}
    sweep = getattr(index, "sweep", None)
    if sweep is None:
        return out
    steps: list[float] = []
    while True:
        t0 = time.perf_counter()
        more = sweep()
        steps.append(time.perf_counter() - t0)
        if not more:
            break
    out |= {
        "steps": len(steps),
        "sweep_total_ms": 1e3 * sum(steps),
        "step_max_ms": 1e3 * max(steps),
        "step_p50_ms": 1e3 * statistics.median(steps),
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--keys", type=int, nargs="*", default=[100_000, 1_000_000])
    ap.add_argument("--dict", action="store_true", help="dict tables instead of KeyTables")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    compact = not args.dict
    for n in args.keys:
        for victim, held in (("b", 100), ("a", n)):
            index = build(n, compact, args.seed)
            r = measure(index, victim)
            line = f"{'KeyTable' if compact else 'dict':8} keys={n:>9,} wipe {held:>9,} keys: "
            line += f"wipe {r['wipe_ms']:7.2f} ms"
            if "steps" in r:
                line += (
                    f"  sweep {r['steps']:5d} steps {r['sweep_total_ms']:7.2f} ms total,"
                    f" step max {r['step_max_ms']:.3f} ms p50 {r['step_p50_ms']:.3f} ms"
                )
            print(line, flush=True)
            assert index.entries == n + 100 - held, "the wipe left keys behind"
            del index
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
