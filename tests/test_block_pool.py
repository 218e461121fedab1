"""gpu_emitter.hybrid_pool: vLLM 0.32 caching, eviction and events, driven through the API.

The spec's own examples (§2.4, §4.8) are reproduced by driving the pool, then the rules
behind them one by one: LRU order, per-group eviction, copies, reset, sliding-window frees
during decode, all-or-nothing admission, reused KV equal to a recomputation.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from events.hashing import BlockHasher, RequestKeys  # noqa: E402
from events.layout import GroupKind, GroupSpec, HashSettings, LayoutError, ModelLayout  # noqa: E402
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from gpu_emitter.block_pool import NULL_BLOCK  # noqa: E402
from gpu_emitter.hybrid_pool import (  # noqa: E402
    DuplicateRequest,
    HybridBlockPool,
    ModelShape,
    PoolInvariantError,
    UnknownRequest,
    UnsupportedLayout,
)
from gpu_emitter.layouts import (  # noqa: E402
    LayoutFileError,
    load_layout,
    parse_layout,
    shipped_layouts,
)

FA16 = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)
SWA64 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=64)
FA_SWA = ModelLayout(groups=(FA16, SWA64))  # the spec's §2.4/§4.8 setting: need = 4
FA_ONLY = ModelLayout(groups=(FA16,))
FA_MAMBA64 = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=64),
        GroupSpec(kind=GroupKind.MAMBA, block_size=64),
    )
)


def wires(layout: ModelLayout, tokens: list[int], block: int) -> list:
    """The group-``block`` block hashes of ``tokens`` (H is the layouts' block size here)."""
    return BlockHasher(layout.hash, block).wire_chain(tokens)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def stores(events: list, group: int) -> list[BlockStored]:
    return [e for e in events if type(e) is BlockStored and e.group_idx == group]


def positions(hashes: list, chain: list) -> list[int]:
    return [chain.index(h) for h in hashes]


def run(pool: HybridBlockPool, rid: str, tokens: list[int]) -> int | None:
    hit = pool.admit(rid, tokens)
    if hit is not None:
        pool.compute_prefill(rid)
    return hit


# --------------------------------------------------------------------------- spec examples


def test_spec_2_4_event_shapes_192_and_200_tokens() -> None:
    pool = HybridBlockPool(FA_SWA, 64)
    p = toks(1, 192)
    assert run(pool, "a", p) == 0
    chain = wires(FA_SWA, p, 16)
    fa, swa = pool.take_events()
    assert type(fa) is BlockStored and fa.group_idx == 0
    assert fa.block_hashes == chain[:12] and fa.parent_block_hash is None
    assert fa.token_ids == p and fa.block_size == 16 and fa.medium == "GPU"
    assert fa.kv_cache_spec_kind == "full_attention" and fa.kv_cache_spec_sliding_window is None
    assert fa.extra_keys == [None] * 12
    assert swa.group_idx == 1 and swa.token_ids == p and swa.parent_block_hash is None
    assert positions(swa.block_hashes, chain) == [7, 8, 9, 10]  # not the last 4 blocks
    assert swa.kv_cache_spec_kind == "sliding_window" and swa.kv_cache_spec_sliding_window == 64
    assert swa.extra_keys == [None] * 4

    q = toks(1000, 200)
    run(pool, "b", q)
    evs = pool.take_events()
    assert positions(stores(evs, 1)[0].block_hashes, wires(FA_SWA, q, 16)) == [8, 9, 10, 11]
    assert len(stores(evs, 0)[0].token_ids) == 192  # block 12 is not full


def test_spec_4_8_examples_1_and_2() -> None:
    pool = HybridBlockPool(FA_SWA, 128, max_hit_check=True)
    p1 = toks(1, 200)
    run(pool, "p1", p1)
    pool.finish("p1")
    pool.take_events()
    # Example 1: the same 200 tokens hit 192.
    assert pool.find_hit(p1).hit_tokens == 192
    # Example 2: 300 tokens sharing 180 (blocks 0..10): FA holds 176, SWA nothing -> 0.
    p2 = p1[:180] + toks(5000, 120)
    res = pool.find_hit(p2, explain=True)
    assert (res.hit_tokens, res.spec_group_hits, res.num_uncached) == (0, (176, 0), 176)
    assert run(pool, "p2", p2) == 0
    assert pool.request("p2").shared_prefix_boundary == 176
    chain = wires(FA_SWA, p2, 16)
    (swa,) = stores(pool.take_events(), 1)
    assert positions(swa.block_hashes, chain) == [7, 8, 9, 10, 14, 15, 16, 17]
    # A third request sharing the 180 tokens now gets 176.
    p3 = p1[:180] + toks(9000, 70)
    assert pool.find_hit(p3).hit_tokens == 176
    assert run(pool, "p3", p3) == 176


def test_spec_4_8_example_3_mamba() -> None:
    pool = HybridBlockPool(FA_MAMBA64, 64, max_hit_check=True)
    p1 = toks(1, 300)
    run(pool, "p1", p1)
    chain = wires(FA_MAMBA64, p1, 64)
    evs = pool.take_events()
    assert positions(stores(evs, 0)[0].block_hashes, chain) == [0, 1, 2, 3]
    (mamba,) = stores(evs, 1)
    assert positions(mamba.block_hashes, chain) == [3]
    assert mamba.kv_cache_spec_kind == "mamba" and len(mamba.token_ids) == 256
    # Same first 300 tokens, 400 in all: FA 256, Mamba state at 256 -> 256.
    assert pool.find_hit(p1 + toks(7000, 100)).hit_tokens == 256
    # 500 tokens sharing 200 (block 3 differs): FA 192, Mamba nothing below -> 0.
    p2 = p1[:200] + toks(8000, 300)
    res = pool.find_hit(p2)
    assert (res.hit_tokens, res.longest) == (0, 192)
    assert run(pool, "p2", p2) == 0
    chain2 = wires(FA_MAMBA64, p2, 64)
    mamba_hashes = [h for e in stores(pool.take_events(), 1) for h in e.block_hashes]
    assert positions(mamba_hashes, chain2) == [2, 6]  # junction 192 and boundary 448
    assert pool.find_hit(p1[:200] + toks(1, 100)).hit_tokens == 192


# --------------------------------------------------------------------------- retention


def test_retention_interval_r_and_none_masks() -> None:
    swa32 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=32)  # need 2
    lay = ModelLayout(groups=(FA16, swa32), retention_interval=64)
    pool = HybridBlockPool(lay, 64)
    p = toks(1, 200)
    run(pool, "a", p)
    (swa,) = stores(pool.take_events(), 1)
    # The 2 blocks before every 64-token boundary, plus the tail before 192 (= 10, 11).
    assert positions(swa.block_hashes, wires(lay, p, 16)) == [2, 3, 6, 7, 10, 11]

    # Dense (None) with A = 32 > B = 16 and need 1: the block before every A boundary.
    swa17 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=17)
    fa32 = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=32)
    lay = ModelLayout(groups=(fa32, swa17), retention_interval=None)
    pool = HybridBlockPool(lay, 64)
    run(pool, "a", p)
    evs = pool.take_events()
    assert len(stores(evs, 0)[0].token_ids) == 192  # cacheable rounded down to S = 32
    assert positions(stores(evs, 1)[0].block_hashes, wires(lay, p, 16)) == [1, 3, 5, 7, 9, 11]


def test_decode_blocks_cached_in_fa_only_under_default_retention() -> None:
    pool = HybridBlockPool(FA_SWA, 64)
    p = toks(1, 200)
    run(pool, "a", p)
    pool.take_events()
    for t in range(8):  # fills block 12 (tokens 192..207)
        assert pool.append_tokens("a", [3000 + t])
    evs = pool.take_events()
    full = wires(FA_SWA, p + toks(3000, 8), 16)
    (fa,) = stores(evs, 0)
    (swa,) = stores(evs, 1)
    assert fa.block_hashes == [full[12]] and fa.parent_block_hash == full[11]
    assert swa.block_hashes == [] and swa.extra_keys is None and len(swa.token_ids) == 16
    assert pool.verify_kv("a")


# --------------------------------------------------------------------------- eviction


def test_lru_eviction_tail_first_oldest_first() -> None:
    pool = HybridBlockPool(FA_ONLY, 1 + 8)
    a, b = toks(1, 32), toks(100, 32)
    run(pool, "a", a)
    run(pool, "b", b)
    pool.finish("a")
    pool.finish("b")
    pool.take_events()
    ha, hb = wires(FA_ONLY, a, 16), wires(FA_ONLY, b, 16)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    run(pool, "c", toks(500, 96))  # 4 never-used blocks, then evicts a's tail, then a's head
    removed = [e for e in pool.take_events() if type(e) is BlockRemoved]
    assert [(e.block_hashes, e.group_idx, e.medium) for e in removed] == [
        ([ha[1]], 0, "GPU"),
        ([ha[0]], 0, "GPU"),
    ]
    run(pool, "d", toks(900, 16))
    removed = [e for e in pool.take_events() if type(e) is BlockRemoved]
    assert [e.block_hashes for e in removed] == [[hb[1]]]
    assert pool.find_hit([*b, 1]).hit_tokens == 16  # b's head survives
    assert pool.usage == pytest.approx(7 / 8)


def test_hit_blocks_are_touched_before_eviction() -> None:
    pool = HybridBlockPool(FA_ONLY, 1 + 4)
    a = toks(1, 48)
    run(pool, "a", a)
    pool.finish("a")
    pool.take_events()
    # 64 tokens: hits a's 3 blocks (48), needs one new block: the only free uncached one.
    assert run(pool, "b", [*a, *toks(70, 16)]) == 48
    assert not [e for e in pool.take_events() if type(e) is BlockRemoved]
    assert pool.verify_kv("b")


def test_swa_evicted_while_fa_same_hash_survives() -> None:
    pool = HybridBlockPool(FA_SWA, 1 + 40)
    p = toks(1, 200)
    run(pool, "a", p)
    chain = wires(FA_SWA, p, 16)
    held = sum(b != NULL_BLOCK for b in pool.request("a").groups[1].blocks)
    assert held == 13  # vLLM allocates the whole prompt at admission
    for t in range(60):  # the window moves past blocks 8..11: SWA frees them
        assert pool.append_tokens("a", [4000 + t])
    swa_blocks = pool.request("a").groups[1].blocks
    assert sum(b != NULL_BLOCK for b in swa_blocks) <= 5  # only the window is held
    assert swa_blocks[:12] == [NULL_BLOCK] * 12
    pool.take_events()
    # Flood: allocation evicts the freed SWA checkpoints while FA still holds the blocks.
    filler = 0
    while pool.cached_count(1, chain[8]):
        assert run(pool, f"f{filler}", toks(100_000 + 1000 * filler, 16)) is not None
        pool.finish(f"f{filler}")
        filler += 1
    removed = [e for e in pool.take_events() if type(e) is BlockRemoved]
    assert removed and {e.group_idx for e in removed} == {1}
    assert all(len(e.block_hashes) == 1 for e in removed)
    assert chain[8] in {e.block_hashes[0] for e in removed}
    assert pool.cached_count(0, chain[8]) == 1


def test_copies_are_counted_not_deduplicated() -> None:
    pool = HybridBlockPool(FA_SWA, 128)
    p1 = toks(1, 200)
    run(pool, "p1", p1)
    pool.take_events()
    chain = wires(FA_SWA, p1, 16)
    assert pool.cached_count(0, chain[0]) == 1
    # Hit 0 (SWA limits it), so FA blocks 0..10 are recomputed and stored a second time.
    run(pool, "p2", p1[:180] + toks(5000, 120))
    (fa,) = stores(pool.take_events(), 0)
    assert fa.block_hashes[:11] == chain[:11]
    assert [pool.cached_count(0, h) for h in chain[:12]] == [2] * 11 + [1]
    # SWA: p1 holds 8..11, the junction tail of p2 is 7..10 (same tokens, same hashes).
    assert [pool.cached_count(1, h) for h in chain[6:12]] == [0, 1, 2, 2, 2, 1]


# --------------------------------------------------------------------------- reset / full


def test_reset_prefix_cache_refused_while_running_then_clears() -> None:
    pool = HybridBlockPool(FA_SWA, 64)
    p = toks(1, 100)
    run(pool, "a", p)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
    assert pool.find_hit(p).hit_tokens > 0
    pool.finish("a")
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.find_hit(p).hit_tokens == 0
    assert pool.cached_keys(0) == {} and pool.cached_keys(1) == {}
    # Blocks whose keys were dropped are reused without BlockRemoved.
    run(pool, "b", toks(700, 900))
    assert not [e for e in pool.take_events() if type(e) is BlockRemoved]


def _snapshot(pool: HybridBlockPool) -> tuple:
    core = pool.core
    return (
        list(core.free_queue),
        list(core.ref),
        list(core.key),
        [pool.cached_keys(g) for g in range(len(pool.managers))],
        pool.running,
    )


def test_admit_none_when_full_changes_nothing() -> None:
    pool = HybridBlockPool(FA_SWA, 1 + 20)
    run(pool, "a", toks(1, 100))  # 7 + 7 blocks
    pool.finish("a")
    run(pool, "b", toks(500, 48))  # 3 + 3
    pool.take_events()
    before = _snapshot(pool)
    # 8 + 8 blocks needed with 15 free (a's 14 cached ones evictable) -> refused.
    assert pool.admit("c", toks(900, 128)) is None
    assert pool.take_events() == []
    assert _snapshot(pool) == before
    assert pool.admit("c", toks(900, 112)) is not None  # 7 + 7 fits


def test_admit_counts_evictable_hit_blocks() -> None:
    pool = HybridBlockPool(FA_ONLY, 1 + 4)
    a = toks(1, 48)
    run(pool, "a", a)
    pool.finish("a")
    run(pool, "x", toks(900, 16))  # holds the fourth block
    pool.take_events()
    # Hit 48 needs its 3 free cached blocks back plus one new block: 4 > 3 free.
    assert pool.admit("b", [*a, *toks(70, 16)]) is None
    assert pool.take_events() == []


def test_append_false_when_full_changes_nothing() -> None:
    pool = HybridBlockPool(FA_ONLY, 1 + 2)
    run(pool, "a", toks(1, 32))
    pool.take_events()
    before = _snapshot(pool)
    assert pool.append_tokens("a", [5]) is False
    assert _snapshot(pool) == before and len(pool.request("a").tokens) == 32
    assert pool.take_events() == []


def test_mamba_holds_at_most_two_state_blocks_in_decode() -> None:
    pool = HybridBlockPool(FA_MAMBA64, 64)
    run(pool, "a", toks(1, 300))
    for t in range(200):
        assert pool.append_tokens("a", [t])
        assert sum(b != NULL_BLOCK for b in pool.request("a").groups[1].blocks) <= 2
    assert pool.verify_kv("a")
    # Decode-phase Mamba blocks are not cached under retention 0.
    assert len(pool.cached_keys(1)) == 1


# --------------------------------------------------------------------------- KV data


def test_reused_kv_equals_recomputation_and_corruption_is_caught() -> None:
    pool = HybridBlockPool(FA_SWA, 128, shape=ModelShape(layers_per_group=2, kv_heads=2))
    p = toks(1, 200)
    run(pool, "a", p)
    pool.finish("a")
    assert run(pool, "b", [*p, 42]) == 192
    for g in (0, 1):
        got = pool.gather_kv("b", g)
        pos = pool.kv_positions("b", g)
        assert got.shape == (len(pos), 2, 2, 2, 8)
        assert torch.equal(got, pool.expected_kv(pool.request("b").tokens, g, pos))
    assert pool.kv_positions("b", 1)[0] == 128  # SWA holds blocks 8..12 only
    assert pool.verify_kv("b")
    # The same tokens after a different prefix give different values: a wrong block shows.
    assert not torch.equal(
        pool.expected_kv([*toks(1, 16), 7], 0)[16], pool.expected_kv([*toks(2, 16), 7], 0)[16]
    )
    hit_block = pool.request("b").groups[0].blocks[3]
    assert pool.kv[0].shape == (128, 16, 2, 2, 2, 8)
    pool.kv[0][hit_block, 5, 0, 1, 0, 0] += 1
    assert not pool.verify_kv("b")


def test_extra_keys_and_lora_on_events() -> None:
    keys = RequestKeys(cache_salt="tenant-a", lora_name="ad", lora_path="/p/ad")
    pool = HybridBlockPool(FA_ONLY, 16)
    p = toks(1, 40)
    pool.admit("a", p, keys)
    (ev,) = pool.take_events()
    assert ev.lora_name == "ad"
    assert ev.extra_keys == [("ad", "tenant-a"), ("ad",)]
    assert ev.block_hashes == BlockHasher(FA_ONLY.hash, 16).wire_chain(p, keys)[:2]
    assert pool.find_hit(p).hit_tokens == 0 and pool.find_hit(p, keys).hit_tokens == 32
    assert pool.find_hit(p, keys, skip_reading=True).hit_tokens == 0


def test_bytes_hashes_when_int_block_hashes_off() -> None:
    lay = ModelLayout(groups=(FA16,), hash=HashSettings(int_block_hashes=False))
    pool = HybridBlockPool(lay, 16)
    pool.admit("a", toks(1, 32))
    (ev,) = pool.take_events()
    assert all(isinstance(h, bytes) and len(h) == 32 for h in ev.block_hashes)


# --------------------------------------------------------------------------- API errors


def test_api_errors_are_typed_and_clear() -> None:
    pool = HybridBlockPool(FA_ONLY, 16)
    pool.admit("a", toks(1, 20))
    with pytest.raises(DuplicateRequest, match="still running"):
        pool.admit("a", toks(1, 20))
    with pytest.raises(UnknownRequest, match="admit it first"):
        pool.finish("zz")
    with pytest.raises(ValueError, match="empty"):
        pool.admit("b", [])
    with pytest.raises(TypeError, match="Python ints"):
        pool.admit("b", [1, 2.0])
    with pytest.raises(ValueError, match="num_blocks"):
        HybridBlockPool(FA_ONLY, 1)
    eagle = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16, eagle=True)
    with pytest.raises(UnsupportedLayout, match="EAGLE"):
        HybridBlockPool(ModelLayout(groups=(eagle,)), 16)
    partial = ModelLayout(groups=FA_MAMBA64.groups, prefix_match_unit=16)
    with pytest.raises(UnsupportedLayout, match="partial"):
        HybridBlockPool(partial, 16)
    # refused by events.layout.resolve already, as vLLM's
    # _validate_prefix_cache_retention_interval does
    with pytest.raises(LayoutError, match="retention_interval"):
        HybridBlockPool(ModelLayout(groups=(FA16, SWA64), retention_interval=24), 16)


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("name", ["fa", "fa_swa", "gemma3", "fa_mamba"])
def test_shipped_layouts_build_pools(name: str) -> None:
    layout = load_layout(name)
    pool = HybridBlockPool(layout, 256)
    p = toks(1, 300)
    run(pool, "a", p)
    pool.finish("a")
    assert pool.find_hit(p).hit_tokens > 0
    assert pool.take_events()


def test_layout_loader_shapes_and_errors(tmp_path) -> None:
    assert set(shipped_layouts()) >= {"fa", "fa_swa", "gemma3", "fa_mamba"}
    g3 = load_layout("gemma3")
    assert [g.kind for g in g3.groups] == [GroupKind.SLIDING_WINDOW] * 5 + [
        GroupKind.FULL_ATTENTION
    ]
    assert load_layout("fa_swa").groups[1].sliding_window == 128
    assert {g.block_size for g in load_layout("fa_mamba").groups} == {64}
    with pytest.raises(LayoutFileError, match=r"fa, fa_mamba, fa_swa, gemma3"):
        load_layout("llama")
    f = tmp_path / "x.toml"
    f.write_text(
        'retention_interval = "none"\n[[groups]]\nkind = "full_attention"\nblock_size = 32\n'
    )
    lay = load_layout(f)
    assert lay.retention_interval is None and lay.groups[0].block_size == 32
    assert load_layout(str(f)) == lay
    with pytest.raises(LayoutFileError, match=r"x.toml: .*block_size"):
        parse_layout('[[groups]]\nkind = "full_attention"\nblock_size = "16"\n', source="x.toml")
    with pytest.raises(LayoutFileError, match="sliding_window"):
        parse_layout('[[groups]]\nkind = "sliding_window"\nblock_size = 16\n')


def test_layouts_module_is_torch_free() -> None:
    code = "import sys, gpu_emitter, gpu_emitter.layouts; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_invariant_checker_catches_corruption() -> None:
    pool = HybridBlockPool(FA_SWA, 64)
    run(pool, "a", toks(1, 100))
    pool.check_invariants()
    bid = pool.request("a").groups[0].blocks[0]
    pool.core.ref[bid] += 1
    with pytest.raises(PoolInvariantError, match="holders"):
        pool.check_invariants()
    pool.core.ref[bid] -= 1
    pool.request("a").groups[1].blocks[-1] = bid  # one block in two groups
    with pytest.raises(PoolInvariantError):
        pool.check_invariants()
