"""Speculative insert (router.core.speculative): which blocks, routing effect, and retirement."""

from __future__ import annotations

import random
from typing import Any

from bench.decide_bench import make_pool as bench_pool
from events.layout import GroupKind, GroupSpec, ModelLayout, resolve
from events.schema import BlockRemoved, BlockStored
from router.core.hybrid import HitResult
from router.core.index import KVIndex
from router.core.predict import Predictor
from router.core.speculative import SpeculativeOverlay, speculative_blocks
from router.server.state import PoolState

FA_SWA = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=128),
    )
)
FA_MAMBA = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=64),
        GroupSpec(kind=GroupKind.MAMBA, block_size=64),
    )
)


def hit(tokens: int, uncached: int) -> HitResult:
    return HitResult(tokens, (), None, tokens + uncached, uncached, 1)


def test_blocks_fa_dense_swa_checkpoints_and_junction() -> None:
    lay = resolve(FA_SWA)
    # 1000 tokens: 62 full blocks; checkpoint at floor(999/16)*16 = 992, need = ceil(127/16) = 8
    plan = speculative_blocks(lay, 1000, hit(0, 0))
    assert plan == [((0,), 1, list(range(62))), ((1,), 1, list(range(54, 62)))]
    # junction hit + num_uncached = 330 -> boundary 320: blocks 12..19 as well (spec §4.1)
    plan = speculative_blocks(lay, 1000, hit(0, 330))
    assert plan[1] == ((1,), 1, list(range(12, 20)) + list(range(54, 62)))
    # dense retention caches differently: nothing speculative for the window (errs low)
    dense = resolve(ModelLayout(groups=FA_SWA.groups, retention_interval=None))
    assert speculative_blocks(dense, 1000, None) == [((0,), 1, list(range(62)))]
    assert speculative_blocks(lay, 10, None) == []


def test_blocks_mamba_state_at_the_checkpoint() -> None:
    lay = resolve(FA_MAMBA)
    # 1000 tokens: 15 full 64-blocks (960); checkpoint floor(999/64)*64 = 960 -> state block 14
    assert speculative_blocks(lay, 1000, None) == [((0,), 1, list(range(15))), ((1,), 1, [14])]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def overlay_setup(ttl: float = 2.0) -> tuple[KVIndex, Predictor, SpeculativeOverlay, Clock]:
    index = KVIndex(FA_SWA)
    for name in ("a", "b"):
        index.add_replica(name, 0)
    pred = Predictor(index)
    clock = Clock()
    return index, pred, SpeculativeOverlay(index, pred, ttl, clock=clock), clock


_rng = random.Random(1)
PROMPT = [_rng.randrange(7, 2048) for _ in range(1000)]


def test_record_predict_confirm_and_expire() -> None:
    index, pred, ov, clock = overlay_setup()
    assert ov.predict(PROMPT, None) is None  # empty overlay: no second prediction
    ins = ov.record(("a", 0), PROMPT, None, None)
    assert ins is not None and len(ov) == 62 + 8
    ov.finish(ins)  # its answer ended: the grace of ttl_s starts
    spec = ov.predict(PROMPT, None)
    assert spec is not None
    # a later request with the same prompt would hit on "a" (992, the checkpoint) and not "b"
    assert spec.hit(("a", 0)).hit_tokens == 992 and spec.hit(("b", 0)).hit_tokens == 0
    assert pred.predict(PROMPT).hit(("a", 0)).hit_tokens == 0  # the index is untouched
    assert ov.predict(PROMPT[:-400] + [5] * 400, None) is not None  # shares block 0
    assert ov.predict([6] * 1000, None) is None  # another first block: cannot change hits

    # the replica's events confirm the entries: they leave the overlay, the index has them
    chain = pred.hasher().lazy_chain(PROMPT)
    fa = [chain.block_wire(j, 1) for j in range(62)]
    common = dict(parent_block_hash=None, lora_id=None, medium="GPU", lora_name=None)
    events = [
        BlockStored(block_hashes=fa, token_ids=PROMPT[:992], block_size=16, group_idx=0,
                    kv_cache_spec_kind="full_attention", **common),
        BlockStored(block_hashes=fa[54:], token_ids=PROMPT[:992], block_size=16, group_idx=1,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
                    **common),
    ]  # fmt: skip
    index.apply_events(("a", 0), events)
    ov.on_events(("a", 0), events)
    assert len(ov) == 0 and ov.confirmed == 70
    assert pred.predict(PROMPT).hit(("a", 0)).hit_tokens == 992

    # a removal on "b" for a hash the overlay holds for "b" retires that entry
    ov.finish(ov.record(("b", 0), PROMPT, None, None))
    removed = [BlockRemoved(block_hashes=[fa[61]], medium="GPU", group_idx=1)]
    ov.on_events(("b", 0), removed)
    assert len(ov) == 69
    assert ov.predict(PROMPT, None).hit(("b", 0)).hit_tokens < 992  # type: ignore[union-attr]

    clock.t += 2.5  # TTL over
    assert ov.predict(PROMPT, None) is None and len(ov) == 0 and ov.expired == 2


def test_entries_stand_while_the_request_is_in_flight_then_ttl_more() -> None:
    """Under load vLLM may queue a request for longer than the TTL before scheduling it (no
    event can exist before): its entries must not lapse while it is in flight."""
    _, _, ov, clock = overlay_setup(ttl=2.0)
    ov.hold_s = 60.0
    slow = ov.record(("a", 0), PROMPT, None, None)
    clock.t += 30.0  # fifteen TTLs in the replica's queue
    assert len(ov) == 70 and ov.expired == 0
    spec = ov.predict(PROMPT, None)
    assert spec is not None and spec.hit(("a", 0)).hit_tokens == 992
    ov.finish(slow)
    ov.finish(slow)  # twice: still one grace, from the first
    clock.t += 1.9
    assert len(ov) == 70
    clock.t += 0.2
    assert ov.predict(PROMPT, None) is None and len(ov) == 0 and ov.expired == 1
    # an answer that never ends is bounded by hold_s
    hung = ov.record(("b", 0), PROMPT, None, None)
    clock.t += 59.0
    assert len(ov) == 70
    clock.t += 1.5
    ov.expire()
    assert len(ov) == 0 and ov.expired == 2
    ov.finish(hung)  # already retired: no effect, nothing queued again
    assert len(ov) == 0 and not ov._fifo
    # forgetting a replica covers requests in flight and finished ones alike
    ov.finish(ov.record(("a", 0), PROMPT, None, None))
    ov.record(("a", 0), PROMPT[:500], None, None)
    assert len(ov) > 0
    ov.forget_replica(("a", 0))
    assert len(ov) == 0


def test_discard_forget_and_refresh_by_a_later_request() -> None:
    index, _, ov, clock = overlay_setup(ttl=2.0)
    first = ov.record(("a", 0), PROMPT, None, None)
    ov.finish(first)
    clock.t += 1.5
    ov.record(("a", 0), PROMPT, None, None)  # same blocks again: now owned by the later one
    clock.t += 1.0  # the first one expires, the second (in flight) holds the entries
    assert ov.predict(PROMPT, None) is not None and len(ov) == 70
    ov.discard(first)  # already retired: no effect
    assert len(ov) == 70
    ov.forget_replica(("a", 0))
    assert len(ov) == 0 and ov.predict(PROMPT, None) is None
    index.mark_untrusted(("b", 0), "test")
    assert ov.record(("b", 0), PROMPT, None, None) is None  # untrusted: never speculate


def make_pool(speculative: bool, routing: bool = True) -> PoolState:
    # prefix homes off: these tests isolate the overlay (a burst spreads without it);
    # tests/test_affinity_routing.py covers homes
    return bench_pool(
        ("a", "b", "c"), speculative=speculative, routing=routing, seed=3, affinity_weight=0.0
    )


def burst(pool: PoolState, n: int = 4) -> list[Any]:
    """``n`` identical prompts routed before any event could arrive, as the proxy does
    (in-flight and pending prefill count up while they are outstanding)."""
    out = []
    for _ in range(n):
        choice = pool.decide(PROMPT, {})
        key = choice.decision.chosen.key
        rep = pool.replicas[key[0]]
        rep.in_flight[0] += 1
        rep.pending_prefill[0] += choice.num_tokens - choice.decision.chosen.hit_tokens
        rep.touch()  # as the proxy does: the pool's load-ordered book follows
        out.append(choice)
    return out


def test_a_burst_of_equal_prompts_lands_together_only_with_speculation() -> None:
    with_spec = burst(make_pool(True))
    assert len({c.decision.chosen.key for c in with_spec}) == 1
    # the reported prediction stays events-only; the speculative one is separate
    assert all(c.prediction.hit(c.decision.chosen.key).hit_tokens == 0 for c in with_spec)
    later = with_spec[1]
    assert later.speculative is not None
    assert later.speculative.hit(later.decision.chosen.key).hit_tokens == 992

    without = burst(make_pool(False))
    assert len({c.decision.chosen.key for c in without}) == 3
    assert all(c.speculative is None for c in without)


def test_explain_does_not_insert() -> None:
    pool = make_pool(True)
    pool.decide(PROMPT, {}, explain=True)
    assert pool.speculative is not None and len(pool.speculative) == 0


def test_the_admission_view_can_be_kept_for_reporting_only() -> None:
    """speculative_routing = false: routed on events alone (the burst spreads as without
    speculation), but each request still carries its admission-time hit, and the entries
    of the requests ahead are recorded where they went."""
    choices = burst(make_pool(True, routing=False))
    assert len({c.decision.chosen.key for c in choices}) == 3
    fourth = choices[3]
    assert fourth.speculative is not None
    key = fourth.decision.chosen.key
    assert fourth.prediction.hit(key).hit_tokens == 0
    assert fourth.speculative.hit(key).hit_tokens == 992  # the first request went there too
