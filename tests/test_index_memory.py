"""router.core.index memory account: ``KVIndex.nbytes`` against what tracemalloc measures, and
the incremental mask account against a recount through every kind of state change."""

from __future__ import annotations

import gc
import random
import sys
import tracemalloc

import pytest

from events.schema import AllBlocksCleared
from router.core.index import IndexLimits, KVIndex, _mask_bytes
from tests.test_index import FA_SWA, removed, stored

SHARED = 64  # blocks of each shared system prompt
OWN = 256  # blocks each replica holds alone


def _fresh(h: int) -> int:
    """An int equal to ``h`` in its own object (``h + 0`` may return ``h`` itself)."""
    return int.from_bytes(h.to_bytes(8, "big"), "big")


def _fill(replicas: int, seed: int) -> KVIndex:
    """An index of ``replicas`` replicas, each holding one of four shared prompts (in three
    copies), its own blocks and a sliding-window tail, built from hashes made here (so
    tracemalloc sees them)."""
    rng = random.Random(seed)
    index = KVIndex(FA_SWA, verify_hashes=False)
    systems = [[rng.getrandbits(64) for _ in range(SHARED)] for _ in range(4)]
    for r in range(replicas):
        key = index.add_replica(f"r{r}")
        own = [rng.getrandbits(64) for _ in range(OWN)]
        # the system prompt stored three times: two extra copies of each of its blocks, each
        # event with its own hash objects, as every event decoded from the wire has
        system = rng.choice(systems)
        events = [stored([_fresh(h) for h in system], 0) for _ in range(3)]
        events += [stored(own[i : i + 64], 0) for i in range(0, OWN, 64)]
        events.append(stored(own[-4:], 1, "sliding_window"))
        index.apply_events(key, events)
    return index


@pytest.mark.parametrize("replicas", [8, 64, 256])
def test_nbytes_within_ten_percent_of_tracemalloc(replicas: int) -> None:
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        index = _fill(replicas, seed=replicas)
        gc.collect()
        full = tracemalloc.get_traced_memory()[0] - base
        full_estimate = index.nbytes()
        # a quarter of the replicas remove their own blocks: masks narrow, keys go
        for key in index.replicas()[::4]:
            bit = index.slot_bit(key)
            own = [h for h, m in index.table("GPU", 0).items() if m == bit]
            index.apply_events(key, [removed(own, 0)])
            del own
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert abs(full_estimate / full - 1) < 0.10, (replicas, full_estimate, full)
    assert abs(index.nbytes() / after - 1) < 0.10, (replicas, index.nbytes(), after)
    # the dict path frees each removed key's int object; a KeyTable holds keys inline and
    # keeps its allocation until its load falls under 1/4
    assert index.nbytes() < full_estimate or (index.compact and index.nbytes() == full_estimate)


def test_mask_bytes_follows_cpython_int_sizes() -> None:
    assert _mask_bytes(1) == _mask_bytes(255) == 0  # shared small ints
    for bits in (9, 30, 31, 60, 61, 256, 1024):
        m = (1 << (bits - 1)) | 1
        assert _mask_bytes(m) == sys.getsizeof(m), bits


def test_account_returns_to_empty_baseline() -> None:
    index = KVIndex(FA_SWA, verify_hashes=False)
    keys = [index.add_replica(f"r{r}") for r in range(70)]
    empty_masks = index.mask_bytes
    rng = random.Random(3)
    hashes = [rng.getrandbits(64) for _ in range(500)]
    for key in keys:
        index.apply_events(key, [stored(rng.sample(hashes, 50), 0)])
    assert index.mask_bytes > 0
    for key in keys:
        held = [h for h, m in index.table("GPU", 0).items() if m & index.slot_bit(key)]
        index.apply_events(key, [removed(held, 0)])
    assert index.entries == 0
    assert index.mask_bytes == empty_masks == 0
    # what stays is the tables' allocation (dicts do not shrink) and the replicas' records
    tables = sum(sys.getsizeof(index.table("GPU", g)) for g in (0, 1))
    assert index.nbytes() == index.recount_bytes()
    assert index.nbytes() - tables - sys.getsizeof({}) * 3 <= 70 * 1200


def _step(index: KVIndex, rng: random.Random, names: list[str], pool: list[int]) -> str:
    """One random operation on the index; returns its name for the failure message."""
    op = rng.choice(["store", "store", "store", "remove", "remove", "clear", "drop", "add",
                     "lost", "infer", "snapshot"])  # fmt: skip
    live = index.replicas()
    if op == "add" or not live:
        index.add_replica(rng.choice(names))
        return "add"
    key = rng.choice(live)
    g = rng.choice((0, 1))
    kind = "sliding_window" if g else "full_attention"
    if op == "store":
        index.apply_events(key, [stored(rng.sample(pool, rng.randint(1, 12)), g, kind)])
    elif op == "remove":  # held, unknown and extra copies alike
        index.apply_events(key, [removed(rng.sample(pool, rng.randint(1, 12)), g)])
    elif op == "clear":
        index.apply_events(key, [stored(rng.sample(pool, 3), g, kind), AllBlocksCleared()])
    elif op == "drop":
        index.remove_replica(key[0])
    elif op == "lost":
        index.lost_events(key, "test")
    elif op == "infer":
        index.infer(key, [(0, h) for h in rng.sample(pool, 4)])
    else:  # a snapshot round trip puts the same state back through import_replica
        snap = index.export_replica(key)
        index.remove_replica(key[0])
        index.import_replica(snap)
    return op


@pytest.mark.parametrize("seed", range(6))
def test_incremental_account_matches_recount(seed: int) -> None:
    rng = random.Random(seed)
    # 70 names so masks cross 256 (slot 8) and two digit boundaries (slots 30, 60); a small
    # budget so reclaim runs too
    limits = IndexLimits(max_bytes=60_000 if seed % 2 else 1 << 30)
    index = KVIndex(FA_SWA, verify_hashes=False, limits=limits)
    names = [f"r{r}" for r in range(70)]
    for name in names:
        index.add_replica(name)
    pool = [rng.getrandbits(64) for _ in range(300)]
    for i in range(600):
        op = _step(index, rng, names, pool)
        assert index.nbytes() == index.recount_bytes(), (seed, i, op)
    assert index.reclaimed or not seed % 2
