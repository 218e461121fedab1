"""The simulated replica's shared store (gpu_emitter.shared_store): what two pools sharing one
store save, publish and load, by vLLM 0.32's Mooncake store connector rules."""

from __future__ import annotations

import pytest

from events.layout import GroupKind, GroupSpec, ModelLayout
from events.schema import BlockStored
from gpu_emitter.hybrid_pool import HybridBlockPool
from gpu_emitter.shared_store import SharedStore, UnsupportedStoreLayout

FA_SWA = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48),
    ),
    retention_interval=0,
)


def cpu_events(pool: HybridBlockPool) -> list[BlockStored]:
    return [ev for ev in pool.take_events() if type(ev) is BlockStored and ev.medium == "cpu"]


def test_a_prefix_saved_by_one_replica_is_loaded_by_the_other() -> None:
    store = SharedStore()
    a = HybridBlockPool(FA_SWA, 200, store=store, device="cpu")
    b = HybridBlockPool(FA_SWA, 200, store=store, device="cpu")
    prompt = list(range(1, 101))  # 100 tokens: 6 full blocks
    assert a.admit("r1", prompt) == 0
    saved = cpu_events(a)
    # FA: blocks 0..5; SWA (retention 0): the 3 blocks ending at the replay boundary 96
    assert sorted((ev.group_idx, ev.block_hashes[0]) for ev in saved) == sorted(
        [(0, a.request("r1").wires[j]) for j in range(6)]
        + [(1, a.request("r1").wires[j]) for j in (3, 4, 5)]
    )
    assert all(ev.block_size == 16 and len(ev.token_ids) == 16 for ev in saved)
    longer = prompt + list(range(500, 540))
    got = b.admit("r2", longer)
    assert got == 96  # nothing local; the store serves FA 0..5 and the SWA window ending at 96
    assert b.request("r2").hit == 0 and b.request("r2").external == 96
    # b's save publishes only the blocks the store lacked (dedup, as batch_is_exist does)
    keys = {(ev.group_idx, ev.block_hashes[0]) for ev in cpu_events(b)}
    w = b.request("r2").wires
    assert keys == {(0, w[6]), (0, w[7]), (1, w[6]), (1, w[7])}  # FA 6-7, SWA window at 128


def test_the_local_hit_is_kept_and_only_the_rest_is_loaded() -> None:
    store = SharedStore()
    a = HybridBlockPool(FA_SWA, 200, store=store, device="cpu")
    prompt = list(range(1, 101))
    a.admit("r1", prompt)
    a.finish("r1")
    # the same replica again: its own GPU already holds 96, the store adds nothing
    assert a.admit("r2", prompt + [7] * 20) == 96
    assert a.request("r2").external == 0


def test_a_silent_eviction_lowers_the_load() -> None:
    store = SharedStore()
    a = HybridBlockPool(FA_SWA, 200, store=store, device="cpu")
    b = HybridBlockPool(FA_SWA, 200, store=store, device="cpu")
    prompt = list(range(1, 101))
    a.admit("r1", prompt)
    wires = a.request("r1").wires
    store.evict([(0, wires[2])])  # FA block 2 gone: the store's hit stops at 32
    # the SWA window the store holds ends at 96, beyond FA's 32: nothing is loadable
    assert b.admit("r2", prompt + [9] * 30) == 0


def test_mamba_layouts_are_refused_with_a_store() -> None:
    mamba = ModelLayout(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
            GroupSpec(kind=GroupKind.MAMBA, block_size=16),
        )
    )
    with pytest.raises(UnsupportedStoreLayout, match="mamba"):
        HybridBlockPool(mamba, 50, store=SharedStore(), device="cpu")
