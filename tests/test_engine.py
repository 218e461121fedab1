"""gpu_emitter.engine and gpu_emitter.cost_model: scheduling, events, determinism, preemption.

The engine runs on a real pool; the publisher is a recording sink so the order of
"published", "flushed" and "request finished" can be checked exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import pytest

from events.schema import BlockRemoved, BlockStored
from gpu_emitter import tokenizer as tok
from gpu_emitter.cost_model import CostModel, CostModelError
from gpu_emitter.engine import (
    CapacityError,
    Engine,
    EngineClosedError,
    generated_token,
    prompt_seed,
)

B = 16


class StandInPool:
    """A full-attention-only pool with the HybridBlockPool API: chain hashes per 16-token
    block, LRU eviction of free cached blocks, BlockStored/BlockRemoved events. It keeps the
    engine's scheduling tests apart from the real pool (gpu_emitter.hybrid_pool), whose own
    tests are test_block_pool.py and test_engine_vs_vllm.py."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cached: OrderedDict[int, int] = OrderedDict()  # hash -> users (0 = evictable)
        self.reqs: dict[str, dict[str, Any]] = {}
        self.private = 0  # held blocks that are not (yet) cached
        self.events: list[Any] = []

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.private - sum(1 for u in self.cached.values() if u)

    @property
    def usage(self) -> float:
        return 1 - self.num_free_blocks / self.num_blocks

    @staticmethod
    def _chain(tokens: Sequence[int]) -> list[int]:
        out, parent = [], 0
        for i in range(len(tokens) // B):
            parent = hash((parent, tuple(tokens[i * B : (i + 1) * B]))) & (2**64 - 1)
            out.append(parent)
        return out

    def find_hit(self, token_ids: Sequence[int], keys: Any = None, *, skip_reading: bool = False):
        raise NotImplementedError

    def _hit(self, tokens: Sequence[int], skip: bool) -> int:
        if skip:
            return 0
        n = 0
        for h in self._chain(tokens[: len(tokens) - 1]):
            if h not in self.cached:
                break
            n += 1
        return n

    def _take(self, n: int) -> bool:
        while self.num_blocks - self.private - len(self.cached) < n:
            victim = next((h for h, u in self.cached.items() if u == 0), None)
            if victim is None:
                return False
            del self.cached[victim]
            self.events.append(BlockRemoved(block_hashes=[victim], medium="GPU", group_idx=0))
        self.private += n
        return True

    def admit(self, req_id: str, token_ids: Sequence[int], keys: Any = None, *, skip_reading=False):
        hit = self._hit(token_ids, skip_reading)
        hashes = self._chain(token_ids)[:hit]
        need = -(-len(token_ids) // B) - hit
        for h in hashes:  # pin before evicting
            self.cached[h] += 1
        if not self._take(need):
            for h in hashes:
                self.cached[h] -= 1
            return None
        self.reqs[req_id] = {"tokens": list(token_ids), "held": hashes, "n": hit}
        return hit * B

    def _cache_full(self, req_id: str) -> None:
        r = self.reqs[req_id]
        chain = self._chain(r["tokens"])
        new = chain[r["n"] :]
        if not new:
            return
        parent = chain[r["n"] - 1] if r["n"] else None
        for h in new:
            self.private -= 1
            self.cached[h] = self.cached.get(h, 0) + 1
            self.cached.move_to_end(h)
            r["held"].append(h)
        toks = r["tokens"][r["n"] * B : len(chain) * B]
        self.events.append(
            BlockStored(
                block_hashes=new,
                parent_block_hash=parent,
                token_ids=toks,
                block_size=B,
                medium="GPU",
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
        r["n"] = len(chain)

    def compute_prefill(self, req_id: str) -> None:
        self._cache_full(req_id)

    def append_tokens(self, req_id: str, new_token_ids: Sequence[int]) -> bool:
        r = self.reqs[req_id]
        have = -(-len(r["tokens"]) // B)
        need = -(-(len(r["tokens"]) + len(new_token_ids)) // B) - have
        if not self._take(need):
            return False
        r["tokens"].extend(new_token_ids)
        self._cache_full(req_id)
        return True

    def finish(self, req_id: str) -> None:
        r = self.reqs.pop(req_id)
        for h in r["held"]:
            self.cached[h] -= 1
        self.private -= -(-len(r["tokens"]) // B) - r["n"]

    def reset_prefix_cache(self) -> bool:
        if self.reqs:
            return False
        from events.schema import AllBlocksCleared

        self.cached.clear()
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Any]:
        out, self.events = self.events, []
        return out


def make_pool(num_blocks: int = 512) -> Any:
    """A full-attention pool with 16-token blocks: the real HybridBlockPool when present."""
    try:
        from gpu_emitter.hybrid_pool import HybridBlockPool
    except ImportError:
        return StandInPool(num_blocks)
    from events.layout import GroupKind, GroupSpec, ModelLayout

    layout = ModelLayout(groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=B),))
    return HybridBlockPool(layout, num_blocks)


class RecordingSink:
    """An EventPublisher stand-in that records what was published and flushed, in order."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.flushed = 0
        self.log: list[tuple[str, int]] = []

    def publish(self, events: Sequence[Any]) -> int:
        self.batches.append(list(events))
        self.log.append(("publish", len(self.batches) - 1))
        return len(self.batches) - 1

    def flush(self, timeout: float | None = 5.0) -> bool:
        self.flushed = len(self.batches)
        self.log.append(("flush", self.flushed))
        return True


FAST = CostModel(time_scale=0.0)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [tok.BOS_ID] + [tok.WORD_OFFSET + (i * 7 + salt) % tok.NUM_WORDS for i in range(n - 1)]


async def _engine(pool: Any = None, sink: Any = None, **kw: Any) -> tuple[Engine, Any, Any]:
    pool = pool if pool is not None else make_pool()
    sink = sink if sink is not None else RecordingSink()
    engine = Engine(pool, sink, cost=kw.pop("cost", FAST), **kw)
    engine.start()
    return engine, pool, sink


# -- cost model ---------------------------------------------------------------------------


def test_cost_model_formula() -> None:
    c = CostModel(prefill_s_per_token=0.001, decode_s_per_step=0.02, step_overhead_s=0.005)
    assert c.step_seconds(0, False) == 0.0
    assert c.step_seconds(100, False) == pytest.approx(0.105)
    assert c.step_seconds(100, True) == pytest.approx(0.125)
    assert c.step_seconds(0, True) == pytest.approx(0.025)
    half = CostModel(prefill_s_per_token=0.001, decode_s_per_step=0.02, time_scale=0.5)
    assert half.step_seconds(100, True) == pytest.approx(0.06)
    assert CostModel(time_scale=0).step_seconds(10_000, True) == 0.0


@pytest.mark.parametrize("field", ["prefill_s_per_token", "decode_s_per_step", "time_scale"])
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_cost_model_rejects_bad_values(field: str, bad: float) -> None:
    with pytest.raises(CostModelError, match=field):
        CostModel(**{field: bad})


# -- engine -------------------------------------------------------------------------------


def test_outputs_are_deterministic_words() -> None:
    async def main() -> tuple[list[int], list[int], list[int]]:
        engine, _, _ = await _engine()
        a = await engine.submit(prompt(40), 12).result()
        b = await engine.submit(prompt(40), 12).result()
        c = await engine.submit(prompt(40, salt=1), 12).result()
        await engine.stop()
        return a, b, c

    a, b, c = run(main())
    assert a == b and a != c and len(a) == 12
    assert a == [generated_token(prompt_seed(prompt(40)), i) for i in range(12)]
    assert all(t >= tok.WORD_OFFSET for t in a)
    assert tok.encode(tok.decode(a), add_bos=False) == a


def test_stop_fails_unfinished_requests_and_gives_their_blocks_back() -> None:
    async def main() -> tuple[int, int, int, list[object]]:
        pool = make_pool(64)
        engine, _, _ = await _engine(pool, cost=CostModel(decode_s_per_step=0.05))
        free0 = pool.num_free_blocks
        running = engine.submit(prompt(100), 500)
        deadline = time.monotonic() + 10
        while engine.num_running == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # polling the engine's loop, bounded by the deadline
        held = pool.num_free_blocks
        await engine.stop()
        errors = []
        try:
            await running.result()
        except EngineClosedError as exc:
            errors.append(exc)
        return free0, held, pool.num_free_blocks, errors

    free0, held, after, errors = run(main())
    assert held < free0, "the request never got blocks: the test proves nothing"
    assert after == free0
    assert len(errors) == 1


def test_second_identical_request_hits_and_events_flush_before_completion() -> None:
    async def main() -> tuple[int | None, int | None, RecordingSink, list[int]]:
        engine, _, sink = await _engine()
        r1 = engine.submit(prompt(200), 4)
        await r1.result()
        published_at_finish = [sink.flushed, len(sink.batches)]
        r2 = engine.submit(prompt(200), 4)
        await r2.result()
        await engine.stop()
        return r1.cached_tokens, r2.cached_tokens, sink, published_at_finish

    c1, c2, sink, (flushed, published) = run(main())
    assert (c1, c2) == (0, 192)
    # Everything published before r1 finished was flushed before its result was delivered.
    assert published > 0 and flushed == published
    assert all(batch for batch in sink.batches)  # no empty batch is ever published
    stored = [e for batch in sink.batches for e in batch if isinstance(e, BlockStored)]
    assert stored[0].token_ids[:192] == prompt(200)[:192]


def test_skip_reading_reports_no_hit() -> None:
    async def main() -> int | None:
        engine, _, _ = await _engine()
        await engine.submit(prompt(100), 2).result()
        r = engine.submit(prompt(100), 2, skip_reading=True)
        await r.result()
        await engine.stop()
        return r.cached_tokens

    assert run(main()) == 0


def test_max_num_seqs_bounds_running_and_admission_is_fifo() -> None:
    async def main() -> tuple[int, list[Any]]:
        cost = CostModel(decode_s_per_step=0.002, prefill_s_per_token=0.0)
        engine, _, _ = await _engine(max_num_seqs=2, cost=cost)
        reqs = [engine.submit(prompt(20, salt=i), 3) for i in range(6)]
        peak = 0
        while not all(r.done for r in reqs):
            peak = max(peak, engine.num_running)
            await asyncio.sleep(0)
        await engine.stop()
        return peak, reqs

    peak, reqs = run(main())
    assert peak == 2
    firsts = [r.first_token_at for r in reqs]
    assert firsts == sorted(firsts)
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 3 for r in reqs)


def test_preemption_keeps_outputs_identical() -> None:
    async def main(blocks: int) -> tuple[list[list[int]], int]:
        engine, pool, _ = await _engine(pool=make_pool(blocks))
        free = pool.num_free_blocks
        reqs = [engine.submit(prompt(40, salt=i), 40) for i in range(4)]
        outs = [await r.result() for r in reqs]
        await engine.stop()
        assert pool.num_free_blocks == free
        return outs, engine.stats.preemptions

    roomy, p0 = run(main(512))
    tight, p1 = run(main(12))
    assert p0 == 0 and p1 > 0
    assert tight == roomy


def test_request_larger_than_the_pool_fails_with_capacity_error() -> None:
    async def main() -> None:
        engine, _, _ = await _engine(pool=make_pool(4))
        with pytest.raises(CapacityError, match="--num-blocks"):
            await engine.submit(prompt(200), 2).result()
        ok = await engine.submit(prompt(20), 2).result()  # the engine goes on
        assert len(ok) == 2
        await engine.stop()

    run(main())


def test_abort_frees_blocks() -> None:
    async def main() -> None:
        cost = CostModel(decode_s_per_step=0.001)
        engine, pool, _ = await _engine(cost=cost)
        free = pool.num_free_blocks
        r = engine.submit(prompt(64), 1000)
        async for _ in r.stream():
            break
        assert pool.num_free_blocks < free
        engine.abort(r)
        assert r.finish_reason == "abort" and engine.num_running == 0
        assert pool.num_free_blocks == free
        await engine.stop()

    run(main())


def test_reset_prefix_cache_refused_while_running_then_cleared() -> None:
    async def main() -> tuple[bool, bool, int | None]:
        cost = CostModel(decode_s_per_step=0.001)
        engine, _, _ = await _engine(cost=cost)
        await engine.submit(prompt(64), 2).result()
        r = engine.submit(prompt(64), 1000)
        async for _ in r.stream():
            break
        busy = engine.reset_prefix_cache()
        engine.abort(r)
        idle = engine.reset_prefix_cache()
        r2 = engine.submit(prompt(64), 2)
        await r2.result()
        await engine.stop()
        return busy, idle, r2.cached_tokens

    busy, idle, cached = run(main())
    assert (busy, idle, cached) == (False, True, 0)


def test_ttft_includes_simulated_prefill_of_uncached_tokens() -> None:
    async def main() -> tuple[float, float]:
        cost = CostModel(prefill_s_per_token=0.0001, decode_s_per_step=0.0)
        engine, _, _ = await _engine(cost=cost)
        cold = engine.submit(prompt(1000), 1)
        await cold.result()
        await engine.stop()
        return cold.ttft or 0.0, cost.prefill_seconds(1000)

    ttft, expected = run(main())
    assert ttft >= expected


def test_stop_fails_unfinished_requests() -> None:
    async def main() -> None:
        cost = CostModel(decode_s_per_step=0.001)
        engine, _, _ = await _engine(cost=cost)
        r = engine.submit(prompt(10), 10_000)
        async for _ in r.stream():
            break
        await engine.stop()
        with pytest.raises(Exception, match="shutting down"):
            await r.result()

    run(main())


@pytest.mark.parametrize("layout_name", ["fa_swa", "gemma3", "fa_mamba"])
def test_reported_hit_is_the_pools_hybrid_hit(layout_name: str) -> None:
    """cached_tokens is what the pool's own find_hit says just before admission, on hybrid
    layouts where the sliding-window or Mamba group limits the hit."""
    hybrid_pool = pytest.importorskip("gpu_emitter.hybrid_pool")
    from gpu_emitter.layouts import load_layout

    async def main() -> list[tuple[int, int | None]]:
        pool = hybrid_pool.HybridBlockPool(load_layout(layout_name), 4096)
        engine, _, _ = await _engine(pool=pool)
        shared = prompt(700)
        pairs = []
        for i, tail in enumerate([0, 0, 50, 51, 0, 130, 50]):
            p = shared + prompt(tail + 1, salt=i % 3)[1:]
            predicted = pool.find_hit(p).hit_tokens
            r = engine.submit(p, 3)
            await r.result()
            pairs.append((predicted, r.cached_tokens))
        await engine.stop()
        return pairs

    pairs = run(main())
    assert all(pred == got for pred, got in pairs), pairs
    assert any(got for _, got in pairs)
