"""The pool's events, through the wire, predict the pool's own hits exactly.

Differential: a router index + predictor fed only with the pool's events (encoded and decoded
as vLLM 0.32 batches) must agree with ``pool.find_hit`` on every request of random workloads
(shared prefixes, repeats, multi-turn extensions, divergence mid-block, floods that evict),
and hold exactly the pool's ``(group, hash) -> copies`` state after every step. Then the same
over real ZeroMQ sockets through :class:`PublisherHook` and :class:`EventPublisher`.
"""

from __future__ import annotations

import json
import random
import time

import msgspec
import pytest

pytest.importorskip("torch")

from shared_paths import GOLDEN, require
from zmq_helpers import LOOPBACK, SyncHarness, publish_until, wait_for

from events.hashing import to_wire
from events.layout import GroupKind, GroupSpec, HashSettings, ModelLayout
from events.publisher import EventPublisher
from events.schema import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from events.stream import StreamSpec
from gpu_emitter.hook import HashFormError, PublisherHook
from gpu_emitter.hybrid_pool import HybridBlockPool
from router.core.index import KVIndex
from router.core.predict import Predictor

FA = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)
SWA64 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=64)
SWA48 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48)
MAMBA = GroupSpec(kind=GroupKind.MAMBA, block_size=16)

LAYOUTS = {
    "fa": ModelLayout(groups=(FA,)),
    "fa_swa": ModelLayout(groups=(FA, SWA64)),
    "swa5_fa": ModelLayout(groups=(SWA48,) * 5 + (FA,)),
    "fa_mamba": ModelLayout(groups=(FA, MAMBA)),
    "fa_swa_dense": ModelLayout(groups=(FA, SWA64), retention_interval=None),
    "fa_swa_r64": ModelLayout(groups=(FA, SWA48), retention_interval=64),
    "fa_mamba_r64": ModelLayout(groups=(FA, MAMBA), retention_interval=64),
    "fa_swa_chunk48": ModelLayout(groups=(FA, SWA64)),
    "fa_mamba_chunk48": ModelLayout(groups=(FA, MAMBA)),
}
#: Chunked-prefill budget per layout (None: whole prompt in one step).
CHUNK = {"fa_swa_chunk48": 48, "fa_mamba_chunk48": 48}
KEY = ("replica", 0)


class Mirror:
    """A router's view of one pool, fed only with its encoded-then-decoded event batches."""

    def __init__(self, layout: ModelLayout) -> None:
        self.index = KVIndex(layout)
        self.index.add_replica(*KEY)
        self.predictor = Predictor(self.index)
        self.batches = 0

    def apply(self, events: list) -> None:
        if not events:
            return
        payload = encode_batch(KVEventBatch(time.time(), events, 0))
        decoded = decode_batch(payload)
        assert decoded.unknown == 0
        self.index.apply_events(KEY, decoded.events)
        self.batches += 1

    def hit(self, tokens: list[int]) -> int:
        return self.predictor.predict(tokens).hit(KEY).hit_tokens

    def state(self, group: int) -> dict:
        bit = self.index.slot_bit(KEY)
        table = self.index.table("GPU", group)
        return {h: self.index.copies(KEY, group, h) for h, m in table.items() if m & bit}


def drive(
    layout: ModelLayout, seed: int, steps: int, num_blocks: int, chunk: int | None = None
) -> dict[str, int]:
    """A random multi-request workload; checks prediction == pool at every admission and the
    index state == pool state after every step. Returns counters showing what it covered."""
    rng = random.Random(seed)
    pool = HybridBlockPool(layout, num_blocks, max_hit_check=True, prefill_chunk=chunk)
    mirror = Mirror(layout)
    trusted = mirror.index.is_trusted

    def rand(n: int) -> list[int]:
        return [rng.randrange(1, 30_000) for _ in range(n)]

    bases = [rand(rng.randint(16, 160)) for _ in range(4)]
    history: list[list[int]] = []
    running: dict[str, int] = {}
    stats = dict.fromkeys(("admitted", "hits", "refused", "removed", "resets", "probes"), 0)

    def check(tokens: list[int]) -> int:
        want = pool.find_hit(tokens).hit_tokens
        assert mirror.hit(tokens) == want, (seed, len(tokens))
        stats["probes"] += 1
        return want

    def finish(rid: str) -> None:
        history.append(list(pool.request(rid).tokens))
        pool.finish(rid)
        running.pop(rid, None)

    for step in range(steps):
        r = rng.random()
        if r < 0.2 or not history:
            tokens = rng.choice(bases) + rand(rng.randint(1, 120))
        elif r < 0.35:
            tokens = list(rng.choice(history))  # exact repeat
        elif r < 0.55:
            tokens = rng.choice(history) + rand(rng.randint(1, 80))  # next turn
        elif r < 0.8:
            h = rng.choice(history)
            tokens = h[: rng.randint(1, len(h))] + rand(rng.randint(1, 100))  # diverge anywhere
        else:
            tokens = rand(rng.randint(100, 500))  # flood
        tokens = tokens[:640]  # conversations keep growing; bound the cost
        for probe in (tokens, tokens[: rng.randint(1, len(tokens))]):
            check(probe)
        want = check(tokens)
        rid = f"r{step}"
        hit = pool.admit(rid, tokens)
        if hit is None and running:
            for old in list(running):
                finish(old)
            mirror.apply(pool.take_events())
            want = check(tokens)
            hit = pool.admit(rid, tokens)
        if hit is None:
            stats["refused"] += 1
        else:
            assert hit == want
            stats["admitted"] += 1
            stats["hits"] += hit > 0
            pool.compute_prefill(rid)
            running[rid] = rng.randint(0, 48)
        for other in list(running):
            for _ in range(rng.randint(1, 8)):
                if running[other] <= 0 or not pool.append_tokens(other, [rng.randrange(30_000)]):
                    finish(other)
                    break
                running[other] -= 1
        if rng.random() < 0.02:
            for other in list(running):
                finish(other)
            assert pool.reset_prefix_cache()
            stats["resets"] += 1
        events = pool.take_events()
        stats["removed"] += sum(type(e).__name__ == "BlockRemoved" for e in events)
        mirror.apply(events)
        assert trusted(KEY), mirror.index.untrusted_reason(KEY)
        pool.check_invariants()
        for g in range(len(layout.groups)):
            assert mirror.state(g) == pool.cached_keys(g), (seed, step, g)
    for rid in list(running):
        assert pool.verify_kv(rid)
    return stats


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("seed", [1, 2])
def test_index_fed_with_pool_events_predicts_pool_hits(name: str, seed: int) -> None:
    layout = LAYOUTS[name]
    stats = drive(layout, seed, 120, 1 + 70 * len(layout.groups), CHUNK.get(name))
    # The workload must have exercised hits, evictions and refusals-free admission.
    assert stats["admitted"] > 100 and stats["hits"] > 10 and stats["removed"] > 0, stats


# --------------------------------------------------------------------------- hook


def test_hook_converts_bytes_hashes_and_refuses_lost_digests() -> None:
    class Sink:
        data_parallel_rank = 0
        legacy = False

        def __init__(self) -> None:
            self.batches: list[KVEventBatch] = []

        def publish(self, batch: KVEventBatch) -> int:
            self.batches.append(batch)
            return len(self.batches) - 1

    raw = ModelLayout(groups=(FA,), hash=HashSettings(int_block_hashes=False))
    sink = Sink()
    hook = PublisherHook(sink)  # type: ignore[arg-type]
    pool = HybridBlockPool(raw, 8, hook=hook)
    pool.admit("a", list(range(1, 40)))
    assert pool.take_events() == []  # a hook alone: events are not also queued
    assert hook.end_step() == 0 and hook.end_step() is None
    (ev,) = sink.batches[0].events
    digests = pool.hasher.digests(list(range(1, 40)))
    assert ev.block_hashes == [to_wire(d, True) for d in digests[:2]]
    assert ev.parent_block_hash is None
    assert pool.request("a").wires[1] == digests[1] and pool.cached_count(0, digests[1]) == 1

    keep = PublisherHook.for_pool(sink, pool)  # type: ignore[arg-type]
    assert keep.int_hashes is False
    keep.on_stored(BlockStored(block_hashes=[digests[0]], medium="GPU"))
    with pytest.raises(HashFormError, match="int_block_hashes"):
        keep.on_stored(BlockStored(block_hashes=[123], medium="GPU"))


# --------------------------------------------------------------------------- real ZMQ


@pytest.mark.parametrize("legacy", [False, True])
def test_pool_events_over_real_zmq_predict_pool_hits(legacy: bool) -> None:
    layout = LAYOUTS["fa_swa"]
    pub = EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    hook = PublisherHook(pub, legacy=legacy)
    pool = HybridBlockPool(layout, 1 + 2 * 40, hook=hook, queue_events=True)
    spec = StreamSpec("replica", pub.endpoint, replay_endpoint=pub.replay_endpoint)
    mirror = Mirror(layout)
    rng = random.Random(7)
    try:
        with SyncHarness([spec]) as h:
            # Past the slow joiner with empty batches; everything after arrives in order.
            publish_until(lambda: pub.publish([]), lambda: h.batches())
            start = len(h.batches())
            sent: dict[int, list] = {}
            prompts = []
            base = [rng.randrange(1, 30_000) for _ in range(150)]
            for step in range(40):
                tokens = base[: rng.randint(20, 150)] + [rng.randrange(30_000) for _ in range(60)]
                prompts.append(tokens)
                if pool.admit(f"r{step}", tokens) is not None:
                    pool.compute_prefill(f"r{step}")
                    for t in range(rng.randint(0, 20)):
                        pool.append_tokens(f"r{step}", [t])
                    pool.finish(f"r{step}")
                if step == 20:
                    assert pool.reset_prefix_cache()  # AllBlocksCleared rides this step
                seq = hook.end_step()
                assert seq is not None
                sent[seq] = pool.take_events()
            assert hook.end_step() is None
            wait_for(lambda: max(sent) in h.seqs(), 10, "the last pool batch")
            got = [b for b in h.batches()[start:] if b.seq in sent]
            assert [b.seq for b in got] == sorted(sent)
            for b in got:
                assert b.batch.legacy == (len(sent[b.seq]) if legacy else 0)
                again = encode_batch(KVEventBatch(0.0, b.batch.events, 0))
                assert again == encode_batch(KVEventBatch(0.0, sent[b.seq], 0))
                mirror.index.apply_events(KEY, b.batch.events)
            assert any(AllBlocksCleared() in evs for evs in sent.values())
            for tokens in prompts:
                assert mirror.hit(tokens) == pool.find_hit(tokens).hit_tokens
            assert any(pool.find_hit(t).hit_tokens for t in prompts)
    finally:
        pub.close()


# --------------------------------------------------------------------------- real vLLM parity


def test_first_prefill_events_equal_real_vllm_golden_recording() -> None:
    """The golden recording's replicas start empty, so their first request's events depend
    on nothing but the rules: a pool with that model's layout and vLLM's 512-token chunked
    prefill must produce them exactly (both chunks, both groups, every field)."""
    root = require(GOLDEN)
    layout = ModelLayout(
        groups=(
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=32, sliding_window=64),
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=32),
        )
    )
    requests = [json.loads(line) for line in (root / "requests.jsonl").open()]
    for replica in ("A", "B"):
        first = next(r for r in requests if r["replica"] == replica)
        assert first["batches_before"] == 0 and first["cached_tokens"] == 0
        nxt = next(r for r in requests if r["replica"] == replica and r is not first)
        golden = [
            json.loads(line)
            for line in (root / f"events-{replica}.jsonl").open()
            if json.loads(line)["seq"] < nxt["batches_before"]
        ]
        pool = HybridBlockPool(layout, 160, prefill_chunk=512)
        assert pool.admit("r", first["prompt_token_ids"]) == 0
        ours = [msgspec.json.decode(msgspec.json.encode(e)) for e in pool.take_events()]
        assert len(ours) == 4  # two chunks (two steps) x two groups
        assert ours == [g["event"] for g in golden[:4]]
        assert [g["seq"] for g in golden[:4]] == [0, 0, 1, 1]
