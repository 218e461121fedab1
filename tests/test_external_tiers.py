"""Shared tiers in the index and the prediction (router.core.shared_tier, router.core.external):
pool-wide presence from any replica's store events, the TTL and capacity bounds (the store
publishes no removals), the clear, and local + loaded per replica."""

from __future__ import annotations

import pytest

from events.layout import GroupKind, GroupSpec, ModelLayout, resolve
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from router.config import parse_config
from router.core.external import connector_load, store_hit
from router.core.index import KVIndex
from router.core.predict import Predictor
from router.core.shared_tier import SharedTier

LAYOUT = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48),
    ),
    retention_interval=0,
)


def stored(tier: str, g: int, hashes: list, block_size: int = 16) -> BlockStored:
    return BlockStored(block_hashes=hashes, block_size=block_size, medium=tier, group_idx=g)


def make_index(**tier: object) -> tuple[KVIndex, SharedTier]:
    index = KVIndex(LAYOUT, verify_hashes=False)
    shared = SharedTier(
        "cpu", **{"ttl_s": 600.0, "capacity_blocks": 1000, "load_cost": 0.5, **tier}
    )
    index.share_tier(shared)
    for name in ("a", "b"):
        index.add_replica(name)
    return index, shared


def chain_of(index: KVIndex, tokens: list[int]) -> list:
    hasher = index.hasher()
    assert hasher is not None
    return hasher.lazy_chain(tokens, None).wires()


def test_one_replicas_store_events_make_the_prefix_loadable_everywhere() -> None:
    index, shared = make_index()
    tokens = list(range(1, 101))
    w = chain_of(index, tokens)
    index.apply_events(("a", 0), [stored("GPU", 0, w[:6]), stored("GPU", 1, w[3:6])])
    index.apply_events(("a", 0), [stored("cpu", 0, w[:6]), stored("cpu", 1, w[3:6])])
    assert len(shared) == 9 and index.table("CPU", 0) == {}  # not per replica
    pred = Predictor(index).predict(tokens + [5] * 30, explain=True)
    a, b = pred.hit(("a", 0)), pred.hit(("b", 0))
    assert (a.hit_tokens, a.external["CPU"].external_tokens) == (96, 0)
    assert (b.hit_tokens, b.external["CPU"].local_tokens, b.external["CPU"].external_tokens) == (
        96, 0, 96,
    )  # fmt: skip
    assert b.load_cost_tokens == 48.0 and a.load_cost_tokens == 0.0
    row = {r["replica"]: r for r in pred.as_dict()["replicas"]}["b"]
    assert row["external"]["CPU"]["store_spec_group_hits"] == {
        "full_attention[0]": 96,
        "sliding_window[1]": 96,
    }


def test_removals_clears_ttl_and_capacity_bound_the_view() -> None:
    index, shared = make_index(capacity_blocks=4, ttl_s=10.0)
    index.apply_events(("a", 0), [stored("cpu", 0, [1, 2, 3, 4, 5])])
    assert sorted(h for _, h in shared.keys) == [2, 3, 4, 5] and shared.expired == 1
    index.apply_events(("b", 0), [BlockRemoved(block_hashes=[3], medium="cpu", group_idx=0)])
    assert not shared.has(0, 3) and shared.has(0, 2)
    index.expire_shared(next(iter(shared.keys.values())) + 9.0)  # not yet
    assert len(shared) == 3
    index.expire_shared(next(iter(shared.keys.values())) + 11.0)  # what PoolState.predict calls
    assert len(shared) == 0
    index.apply_events(("a", 0), [stored("cpu", 0, [7])])
    index.apply_events(("b", 0), [AllBlocksCleared()])
    assert len(shared) == 0
    # a replica's restart leaves the store alone
    index.apply_events(("a", 0), [stored("cpu", 0, [8])])
    index.reset_replica(("a", 0))
    assert shared.has(0, 8)


def test_connector_load_keeps_a_sub_block_local_tail_unless_the_load_passes_it() -> None:
    r = resolve(
        ModelLayout(
            groups=(
                GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
                GroupSpec(kind=GroupKind.MAMBA, block_size=64),
            )
        )
    )
    assert r.partial_hits and r.scheduler_block_size == 64
    assert connector_load(r, 80, 96).cached_tokens == 96  # the load (32) passes the tail (16)
    assert (connector_load(r, 80, 96).local_tokens, connector_load(r, 80, 96).external_tokens) == (
        64, 32,
    )  # fmt: skip
    assert connector_load(r, 80, 72).cached_tokens == 80  # the load would not pass the tail
    assert connector_load(r, 64, 48).cached_tokens == 64
    assert connector_load(r, 0, 48, skip_reading=True).external_tokens == 0


def test_the_store_hit_starts_at_token_0_not_at_the_local_hit() -> None:
    r = resolve(LAYOUT)
    held = {(0, i) for i in range(3, 6)} | {(1, i) for i in range(3, 6)}

    def has(group_ids: tuple[int, ...], i: int) -> bool:
        return all((g, i) in held for g in group_ids)

    # the store lacks FA blocks 0..2: nothing is loadable even for a replica holding them
    assert store_hit(r, 130, has) == 0


def test_config_shared_tiers() -> None:
    base = '[[pools]]\nmodel = "m"\nreplicas = []\n'
    cfg = parse_config(base + '[[pools.shared_tiers]]\nmedium = "cpu"\nload_cost = 0.1\n')
    (t,) = cfg.pools[0].shared_tiers
    assert (t.medium, t.load_cost, t.connector) == ("cpu", 0.1, "mooncake_store")
    with pytest.raises(Exception, match="not GPU"):
        parse_config(base + '[[pools.shared_tiers]]\nmedium = "GPU"\n')
    with pytest.raises(Exception, match="load_cost"):
        parse_config(base + "[[pools.shared_tiers]]\nload_cost = 2\n")
