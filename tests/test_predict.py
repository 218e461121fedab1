"""router.core.predict: the shared-walk fast path equals vLLM's rule over a presence oracle."""

from __future__ import annotations

import random

import pytest

from events.hashing import BlockHasher
from events.layout import GroupKind, GroupSpec, ModelLayout, resolve
from events.schema import BlockStored
from router.core.hybrid import find_longest_cache_hit, group_blind_hit
from router.core.index import KVIndex
from router.core.predict import Predictor, body_request_keys

LAYOUTS = {
    "fa": ModelLayout(groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),)),
    "fa_swa": ModelLayout(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48),
        )
    ),
    "swa_fa_mixed_sizes": ModelLayout(
        groups=(
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=64),
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=32),
        )
    ),
    "gemma_like": ModelLayout(
        groups=(
            *[GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=32)] * 3,
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        )
    ),
    "fa_mamba_partial": ModelLayout(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=64),
            GroupSpec(kind=GroupKind.MAMBA, block_size=64),
        ),
        prefix_match_unit=16,
    ),
    "fa_eagle_swa": ModelLayout(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16, eagle=True),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48),
        )
    ),
}


def stored(group: int, hashes: list, spec: GroupSpec, parent: object = 1) -> BlockStored:
    """``parent`` 1 by default: not a root store, so no conformance re-hash is needed."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[],
        block_size=spec.block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=spec.kind.value,
        kv_cache_spec_sliding_window=spec.sliding_window,
    )


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_predictor_equals_plain_oracle(name: str) -> None:
    layout = LAYOUTS[name]
    resolved = resolve(layout)
    H = resolved.hash_block_size
    hasher = BlockHasher(layout.hash, H)
    rng = random.Random(name)
    nonzero = 0
    for case in range(60):
        n_rep = rng.randint(1, 5)
        index = KVIndex(layout)
        keys = [index.add_replica(f"r{i}") for i in range(n_rep)]
        predictor = Predictor(index)
        n_tokens = rng.randint(0, 40 * H)
        tokens = [rng.randrange(50) for _ in range(n_tokens)]
        chain = hasher.wire_chain(tokens)
        held: dict[tuple[int, int], set[int]] = {}
        for key in keys:
            density = rng.choice([0.3, 0.8, 0.95, 1.0])
            for g, spec in enumerate(layout.groups):
                # hashes at fine indices (any index: block ends and partial entries alike)
                pick = [i for i in range(len(chain)) if rng.random() < density]
                if pick:
                    index.apply_events(key, [stored(g, [chain[i] for i in pick], spec)])
                held[(key, g)] = set(pick)
        if rng.random() < 0.3 and n_rep > 1:
            index.lost_events(keys[0], "test")
        pred = predictor.predict(tokens, blind=True, explain=bool(case % 2))
        for key in keys:
            got = pred.hit(key)
            if not index.is_trusted(key):
                assert got.hit_tokens == 0 and got.result is None
                continue

            if n_tokens == 0:
                assert got.hit_tokens == 0
                continue

            def has(gids, i, key=key, held=held):
                return all(i in held[(key, g)] for g in gids)

            def has_any(i, key=key, held=held):
                return any(i in held[(key, g)] for g in range(len(layout.groups)))

            want = find_longest_cache_hit(resolved, n_tokens, has, num_hashes=len(chain))
            assert got.hit_tokens == want.hit_tokens, (name, case, key)
            nonzero += want.hit_tokens > 0
            assert got.result.longest == want.longest
            assert got.blind_hit_tokens == group_blind_hit(
                resolved, n_tokens, has_any, num_hashes=len(chain)
            )
    assert nonzero >= 10, f"only {nonzero} cases with a hit: the test would prove little"


def test_novel_prompt_hashes_little() -> None:
    layout = LAYOUTS["fa_swa"]
    index = KVIndex(layout)
    index.add_replica("a")
    pred = Predictor(index).predict(list(range(32768)))
    assert pred.hit(("a", 0)).hit_tokens == 0
    assert pred.hashed <= 16  # one read-ahead step, not the 2,048-hash chain


def test_skip_reading_is_the_effective_prompt_logprobs() -> None:
    # hand-derived from vLLM 0.32's OpenAI request classes (checked against them in
    # tests/test_request_flags_vs_vllm.py with vLLM's own environment)
    chat = {"messages": [{"role": "user", "content": "w1"}]}
    cases = [
        ({"prompt": "w1"}, False),
        ({"prompt": "w1", "prompt_logprobs": 0}, True),
        ({"prompt": "w1", "skip_reading_prefix_cache": True}, False),
        ({"prompt": "w1", "echo": True}, False),
        ({"prompt": "w1", "echo": True, "logprobs": 0}, True),
        ({"prompt": "w1", "echo": False, "logprobs": 2}, False),
        ({**chat}, False),
        ({**chat, "echo": True}, True),
        ({**chat, "echo": True, "top_logprobs": None}, True),
        ({**chat, "prompt_logprobs": 1}, True),
    ]
    for body, skip in cases:
        assert body_request_keys(body)[1] is skip, body
