"""The eviction forecast (issue 17 item 2): which cached blocks the requests queued ahead of a
request will evict before vLLM admits it.

Three layers, each against something independent of the forecast:

* :class:`router.core.free_queue.FreeQueue` against the simulated engine's own block pool
  (gpu_emitter.block_pool, vLLM's free queue): fed only the pool's events and the holds and
  frees a router sees, it must name the blocks the pool's next allocations evict, in order.
* The allocation sizes and free order, hand-derived.
* End to end: a simulated replica that serves one request at a time keeps a request waiting
  while the ones routed ahead of it allocate enough to evict its prefix; the router's
  ``x-kvrouter-expected-hit`` must equal the ``cached_tokens`` the replica reports, where the
  hit before the forecast (``x-kvrouter-in-flight-hit``) is too high.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.layout import GroupKind, GroupSpec, ModelLayout, resolve
from events.schema import BlockRemoved, BlockStored
from gpu_emitter.block_pool import BlockPoolCore
from router.core.eviction_forecast import EvictionForecast, Ticket, allocation, hit_keys
from router.core.free_queue import FreeQueue
from router.core.index import KVIndex
from router.core.predict import Predictor
from tests.sim_cluster import MODEL, SimCluster, words
from tests.test_expected_hit import send
from tests.zmq_helpers import wait_for

# ----------------------------------------------------------------- the queue, against a pool


@st.composite
def _ops(draw: Any) -> list[tuple[str, int, int]]:
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(["start", "start", "hit", "end", "end"]),
                st.integers(0, 7),
                st.integers(1, 6),
            ),
            max_size=60,
        )
    )


@settings(max_examples=150, deadline=None)
@given(_ops(), st.integers(8, 30))
def test_free_queue_names_what_the_pool_evicts_in_order(ops: list, num_blocks: int) -> None:
    """Requests start (allocate blocks, each keyed at once: a store), hit cached blocks of
    others and end (free their blocks in a given order). Every block gets a key, so after the
    fresh blocks the whole queue is cached: the model's head must be the pool's evictions."""
    events: list[Any] = []
    core = BlockPoolCore(num_blocks, 2, events.append, 16)
    q = FreeQueue()
    running: dict[int, list[int]] = {}
    keyed: dict[int, tuple[int, int]] = {}
    serial = 0

    def drain() -> None:
        for ev in events:
            if isinstance(ev, BlockRemoved):
                q.removed([(ev.group_idx, h) for h in ev.block_hashes])
        events.clear()

    for op, who, n in ops:
        if op == "start" and who not in running and n <= core.num_free:
            blocks = core.get_new_blocks(n)
            drain()
            keys = []
            for bid in blocks:
                serial += 1
                g = serial % 2
                core.insert(bid, g, serial)
                keyed[bid] = (g, serial)
                keys.append((g, serial))
            q.hold(keys)  # the request's own blocks: held before their store arrives
            q.stored(keys)
            running[who] = blocks
        elif op == "hit" and who in running:
            cached = [b for b in range(1, num_blocks) if core.key[b] is not None]
            take = [b for b in cached[:n] if b not in running[who]]
            core.touch(take)
            q.hold([keyed[b] for b in take])
            running[who] += take
        elif op == "end" and who in running:
            blocks = running.pop(who)
            order = blocks[::-1] if n % 2 else blocks
            core.free_blocks(order)
            q.release([keyed[b] for b in order])
        uncached = core.num_free - q.free_cached
        assert uncached >= 0
        # what the next allocations evict: take every free block from a copy's point of view
        fresh = [b for b in core.free_queue if core.key[b] is None]
        assert len(fresh) == uncached
        want = [keyed[b] for b in core.free_queue if core.key[b] is not None]
        assert list(q.head(core.num_free)) == want
        assert len(q) == sum(1 for b in range(1, num_blocks) if core.key[b] is not None)


def test_free_queue_hand_derived() -> None:
    q = FreeQueue()
    q.stored([(0, "a"), (0, "b")])  # two stores nobody holds: queued in order
    q.hold([(0, "c")])
    q.stored([(0, "c")])  # its own prefill's block: held
    assert list(q.head(5)) == [(0, "a"), (0, "b")]
    q.hold([(0, "a")])  # a hit takes it out
    assert list(q.head(5)) == [(0, "b")] and q.free_cached == 1
    q.release([(0, "c"), (0, "a")])  # freed: c first (evicted first), then a
    assert list(q.head(5)) == [(0, "b"), (0, "c"), (0, "a")]
    q.touch([(0, "b")])
    assert list(q.head(2)) == [(0, "c"), (0, "a")]
    q.removed([(0, "c"), (0, "zz")])  # an unknown key is ignored
    assert list(q.head(5)) == [(0, "a"), (0, "b")] and len(q) == 2
    q.hold([(1, "x")])
    q.clear()
    assert q.free_cached == 0 and len(q) == 0 and q.is_held((1, "x"))


# ----------------------------------------------------------------- sizes, hand-derived

BENCH = resolve(
    ModelLayout(
        groups=(
            *(
                GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=32, sliding_window=100)
                for _ in range(3)
            ),
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=32),
        ),
        retention_interval=0,
    )
)


def test_allocation_hand_derived() -> None:
    # 1000 tokens: ceil(1000 / 32) = 32 blocks per group; a 640-token hit covers 20 of them.
    # A window of 100 is ceil(99 / 32) = 4 blocks: each sliding group keeps at most
    # 3 x 4 + 1 = 13 of its new blocks, the rest come back uncached
    assert allocation(BENCH, 1000, 0) == (4 * 32, 3 * (32 - 13))
    assert allocation(BENCH, 1000, 640) == (4 * 12, 0)
    assert allocation(BENCH, 1000, 992) == (4, 0)  # the last, partial block
    assert allocation(BENCH, 31, 0) == (4, 0)


def test_hit_keys_hand_derived() -> None:
    hasher = KVIndex(BENCH.layout).hasher()
    assert hasher is not None
    tokens = list(range(7, 507))
    wire = hasher.wire_chain(tokens)  # the fine chain: one hash per 32 tokens here
    end, early = hit_keys(BENCH, hasher.lazy_chain(tokens), 200)
    # 200 tokens: 6 full blocks. Full attention (group 3) holds all six, freed last first;
    # each sliding group touches the window before the hit, ceil(99 / 32) = 4 blocks
    assert end == [(3, wire[j]) for j in (5, 4, 3, 2, 1, 0)]
    assert early == [(g, wire[j]) for g in (0, 1, 2) for j in (5, 4, 3, 2)]
    assert hit_keys(BENCH, hasher.lazy_chain(tokens), 31) == ([], [])


def test_evicted_walks_the_queue_ahead_in_order() -> None:
    f = EvictionForecast(Predictor(KVIndex(BENCH.layout)))
    key = ("a", 0)
    q = f.queue(key)
    q.stored([(3, i) for i in range(30)])
    f._ahead[key] = {1: Ticket(key, 12, 10)}
    # (free, usable): 30 usable blocks all hold a cached key: nothing uncached to take first
    assert f.evicted(key, (15, 30)) == [(3, i) for i in range(12)]
    # 35 usable, 30 keyed: at most 5 uncached free blocks go first, then 7 cached ones
    assert f.evicted(key, (20, 35)) == [(3, i) for i in range(7)]
    assert f.evicted(key, (20, 42)) == []  # 12 uncached: enough
    assert f.evicted(key, None) == []  # no metrics: no forecast
    # a second request: the first's 10 returned blocks are taken before any cached one
    f._ahead[key][2] = Ticket(key, 14, 0)
    assert f.evicted(key, (20, 35)) == [(3, i) for i in range(7 + 4)]
    assert f.ahead(key) == 26


def test_evicted_leaves_out_what_the_last_scrape_shows_admitted() -> None:
    f = EvictionForecast(Predictor(KVIndex(BENCH.layout)))
    key = ("a", 0)
    f.queue(key).stored([(3, i) for i in range(30)])
    f._ahead[key] = {i: Ticket(key, 5, 0, routed_at=float(i)) for i in range(4)}
    blocks = (30, 30)
    assert len(f.evicted(key, blocks)) == 20  # no scrape: all four are ahead
    # a scrape at t = 1.5 saw one request waiting: of the two routed before it (t = 0, 1)
    # vLLM had admitted the older; the two routed after are ahead too
    assert len(f.evicted(key, blocks, waiting=1, since=1.5)) == 15
    assert len(f.evicted(key, blocks, waiting=0, since=1.5)) == 10
    assert len(f.evicted(key, blocks, waiting=9, since=1.5)) == 20
    assert len(f.evicted(key, blocks, waiting=0, since=5.0)) == 0


def _stored(g: int, hashes: list[Any], parent: Any) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=32,
        lora_id=None, medium="GPU", lora_name=None, group_idx=g,
    )  # fmt: skip


def test_a_request_holds_what_its_events_store_until_it_ends() -> None:
    """Its stores continue its hit (the parent is its last hit block) or start at the block
    past it; later ones (decode) continue its last store. Held while it runs, freed at its
    end in vLLM's order: its stores last first, then its hit last first."""
    index = KVIndex(BENCH.layout)
    hasher = index.hasher()
    assert hasher is not None
    f = EvictionForecast(Predictor(index))
    key = ("a", 0)
    tokens = list(range(7, 207))  # 200 tokens: 6 full blocks
    w = hasher.wire_chain(tokens)
    f.on_events(key, [_stored(3, w[:2], None)])  # an earlier request cached two blocks
    q = f.queue(key)
    t = f.routed(key, BENCH, hasher.lazy_chain(tokens), 200, 64, now=1.0)
    assert t is not None and t.end == [(3, w[1]), (3, w[0])]
    f.admitted(t)
    assert q.free_cached == 0  # its hit is held
    f.on_events(key, [_stored(3, w[2:4], w[1]), _stored(3, w[4:6], w[3])])
    f.on_events(key, [_stored(3, [w[0] + 1], None)])  # someone else's: free
    assert q.free_cached == 1 and all(q.is_held((3, h)) for h in w[:6])
    f.ended(t)
    assert list(q.head(10)) == [(3, w[0] + 1), *((3, w[j]) for j in (5, 4, 3, 2, 1, 0))]
    assert f._owner == {}


def test_a_store_starting_past_the_hit_is_the_request_s() -> None:
    index = KVIndex(BENCH.layout)
    hasher = index.hasher()
    assert hasher is not None
    f = EvictionForecast(Predictor(index))
    key = ("a", 0)
    tokens = list(range(7, 107))
    w = hasher.wire_chain(tokens)
    t = f.routed(key, BENCH, hasher.lazy_chain(tokens), 100, 0, now=1.0)
    f.on_events(key, [_stored(3, w[:3], None)])  # a miss: its first store has no parent
    q = f.queue(key)
    assert q.free_cached == 0
    f.ended(t)  # ended before its answer began (cancelled): still frees what it stored
    assert list(q.head(5)) == [(3, w[j]) for j in (2, 1, 0)]
    # a replica that leaves the pool leaves nothing behind, and its last requests end quietly
    t2 = f.routed(key, BENCH, hasher.lazy_chain(tokens), 100, 96, now=2.0)
    f.drop(key)
    f.admitted(t2)
    f.ended(t2)
    assert f.queues == {} and f._ahead == {} and f._owner == {}


# ----------------------------------------------------------------- end to end


@pytest.fixture
def cluster() -> Iterator[SimCluster]:
    # one replica, one request at a time, 20 ms decode steps: requests queue behind each
    # other; 40 blocks (39 usable) so that two queued prompts evict a cached one
    policy = "[pools.policy]\neviction_forecast = true\n"
    c = SimCluster(40, names=("a",), extra_toml=policy, max_num_seqs=1, time_scale=1.0)
    try:
        yield c
    finally:
        c.close()


def test_expected_hit_leaves_out_what_the_queue_ahead_evicts(cluster: SimCluster) -> None:
    c = cluster
    rng = random.Random(11)
    prefix = words(rng, 95)  # 96 tokens with BOS: 6 full blocks per group
    first: dict[str, Any] = {}
    send(c, prefix, 1, first)
    c.sync("a")
    app = c.app.state.router  # type: ignore[attr-defined]
    pool = next(iter(app.pools.values()))
    rep = pool.replicas["a"]
    # a scrape after the first request ended: the free blocks the forecast starts from
    wait_for(lambda: rep.kv_usage.get(0) == 0.0 and rep.num_gpu_blocks, 10, "a clean scrape")
    results: list[dict[str, Any]] = [{}, {}, {}, {}]
    plan = [
        (words(rng, 20), 60, results[0]),  # holds the only slot for ~1.2 s
        (words(rng, 150), 1, results[1]),  # then two unrelated prompts allocate ~20 blocks
        (words(rng, 150), 1, results[2]),  # each: more than the cache has besides the prefix
        (prefix + " " + words(rng, 20), 1, results[3]),
    ]
    threads = [threading.Thread(target=send, args=(c, *p)) for p in plan]
    for i, t in enumerate(threads):
        t.start()
        wait_for(
            lambda n=i + 1: c.metric("kvrouter_in_flight", pool=MODEL, replica="a") >= n,
            10,
            f"request {i} in flight",
        )
    for t in threads:
        t.join(60)
    assert all(r.get("status") == 200 for r in results), results
    last = results[3]
    assert first["cached"] == 0
    # the events still held the prefix when the last was routed; the two queued ahead of it
    # took more blocks than were free and uncached, and the prefix was the oldest cached
    assert last["predicted"] == last["in-flight"] > last["cached"]
    assert last["expected"] == last["cached"]
    assert all(r["expected"] == r["in-flight"] for r in results[:3])  # nothing ahead to evict

    def outcome(basis: str, o: str) -> float:
        return c.metric("kvrouter_prediction_outcomes_total", basis=basis, outcome=o, pool=MODEL)

    wait_for(lambda: outcome("admission", "exact") == 5.0, 10, "admission outcomes")
    assert outcome("in_flight", "over") == 1.0 and outcome("admission", "over") == 0.0
    assert pool.eviction_forecasts == {("a", 0): 1}
    # (the exposition lists labels in name order)
    assert c.metric("kvrouter_eviction_forecasts_total", dp_rank="0", pool=MODEL, replica="a") == 1
    # once every answer is in, nothing is queued ahead and nothing is held
    snap = pool.forecast.snapshot()["replicas"]["a/0"]
    assert snap["ahead_blocks"] == 0 and snap["cached"] == snap["free_cached"] > 0
    (row,) = c.explain(prompt=prefix)["replicas"]
    assert row["eviction_forecast"]["ahead_blocks"] == 0
    assert row["admission_hit_tokens"] == row["expected_hit_tokens"]
