"""The eviction-order proof (router.core.eviction_order) against an independent LRU model.

The model is a free-queue block pool written here from vLLM's rules (spec §2.1): a request
hits the longest cached prefix of its chain (the first copy of each key), allocates the rest
from the head of the free queue (evicting the block's old key), stores each new block (a key
already cached gets a second copy when a request recomputes it), and frees its blocks tail
first. Requests before attach and before ``T`` come from other clients; after ``T`` only the
router's, some of which never answer (failed, cancelled). A lower-bound index applies the
events (counts), learns each answer's hit and holds again what the proof names. The
property: it never claims a key the pool does not hold, nor more copies than the pool has.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.eviction_order import NAMED, REMOVED, STORED, EvictionWitness

Key = tuple[int, object]


class LRUPool:
    """A free-queue block pool with copies (the model the proof reasons about)."""

    def __init__(self, n: int) -> None:
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))
        self.key: dict[int, Key] = {}
        self.copies: dict[Key, dict[int, None]] = {}
        self.ref: Counter[int] = Counter()

    def count(self, k: Key) -> int:
        return len(self.copies.get(k, ()))

    def serve(self, chain: list[Key], recompute_from: int) -> tuple[list[Key], list]:
        """Run one request; returns the keys it hit and its events (one batch)."""
        events: list[tuple[int, Key]] = []
        h = 0
        while h < min(len(chain), recompute_from) and self.copies.get(chain[h]):
            h += 1
        blocks = [next(iter(self.copies[k])) for k in chain[:h]]
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        for i, k in enumerate(chain[h:]):
            b, _ = self.free.popitem(last=False)
            old = self.key.pop(b, None)
            if old is not None:
                del self.copies[old][b]
                if not self.copies[old]:
                    del self.copies[old]
                events.append((REMOVED, old))
            self.key[b] = k
            self.copies.setdefault(k, {})[b] = None
            self.ref[b] = 1
            if i == 0 and h:
                events.append((NAMED, chain[h - 1]))
            events.append((STORED, k))
            blocks.append(b)
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        return chain[:h], events


class LowerBound:
    """What the index keeps for a partial replica: counts from events, answers and proofs."""

    def __init__(self) -> None:
        self.held: Counter[Key] = Counter()

    def apply(self, events: list) -> None:
        for what, k in events:
            if what == STORED:
                self.held[k] += 1
            elif what == REMOVED and self.held[k] > 0:
                self.held[k] -= 1
                if not self.held[k]:
                    del self.held[k]

    def ensure(self, keys) -> int:
        new = 0
        for k in keys:
            if not self.held[k]:
                self.held[k] = 1
                new += 1
        return new


def _chain(rng: random.Random, families: int, serial: list[int]) -> list[Key]:
    f = rng.randrange(families)
    stem = [(0, ("f", f, j)) for j in range(3 + f % 4)]
    serial[0] += 1
    return stem + [(0, ("u", serial[0], j)) for j in range(rng.randrange(0, 4))]


def run(seed: int, before: int = 60, foreign_after_attach: int = 5, mine: int = 200,
        blocks: int = 48, families: int = 5) -> tuple[int, int]:  # fmt: skip
    """Simulate one attach; asserts the lower bound after every request. Returns how many
    keys the proof held again and how many the index lacked at the end (pool held them)."""
    rng = random.Random(seed)
    pool, serial = LRUPool(blocks), [0]

    def request() -> tuple[list[Key], list[Key], list]:
        chain = _chain(rng, families, serial)
        recompute = rng.randrange(len(chain) + 1) if rng.random() < 0.3 else len(chain)
        hit, events = pool.serve(chain, recompute)
        return chain, hit, events

    for _ in range(before):  # other clients, before the router attached
        request()
    w = EvictionWitness(max_keys=10**6, max_quiet_removals=10**6)
    index = LowerBound()
    for _ in range(foreign_after_attach):  # running at attach, finished before T
        _, _, events = request()
        index.apply(events)
        w.scan(events)
    w.scrape(1.0, 0)
    w.scrape(2.0, 0)
    assert w.armed
    proved_total = 0
    for i in range(mine):
        sent_at = 3.0 + i
        chain = _chain(rng, families, serial)
        w.sending(chain)
        recompute = rng.randrange(len(chain) + 1) if rng.random() < 0.3 else len(chain)
        hit, events = pool.serve(chain, recompute)
        index.apply(events)
        proved_total += index.ensure(w.scan(events))
        if rng.random() < 0.85:  # an answer (a failed or cancelled request gives none)
            index.ensure(hit)  # what it hit is held (KVIndex.infer)
            w.touched(hit, sent_at)
        for k, n in index.held.items():
            assert n <= pool.count(k), (i, k, n, pool.count(k))
    lacking = sum(1 for k in pool.copies if not index.held[k])
    return proved_total, lacking


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    blocks=st.integers(24, 96),
    families=st.integers(2, 8),
    foreign=st.integers(0, 10),
)
def test_the_proof_never_claims_a_block_the_pool_lacks(
    seed: int, blocks: int, families: int, foreign: int
) -> None:
    run(seed, blocks=blocks, families=families, foreign_after_attach=foreign)


def test_the_proof_holds_keys_again_that_the_pool_still_has() -> None:
    """Not vacuous: over seeded runs it re-holds keys whose older copy was evicted."""
    proved = sum(run(seed)[0] for seed in range(20))
    assert proved >= 20, proved


def test_another_client_after_t_breaks_the_proof_so_its_scrape_turns_it_off() -> None:
    """Why the gate: unknown blocks freed *after* T by a request the router did not send
    make the rule claim keys the pool lost. A scrape that sees such a request turns it off."""
    w = EvictionWitness(max_keys=100, max_quiet_removals=100)
    w.scrape(1.0, 0)
    w.scrape(2.0, 0)
    live, stale = (0, "live"), (0, "unknown")
    w.touched([live], sent_at=3.0)
    # the live copy itself is evicted, then a block another client freed after it
    assert w.scan([(REMOVED, live), (REMOVED, stale)]) == {live}  # wrong: why the gate
    w.scrape(4.0, 1)  # the scrape shows that client's request
    assert w.off is not None and not w.armed
    assert w.scan([(REMOVED, live), (REMOVED, stale)]) == set()


def test_arming_needs_two_clean_scrapes_in_a_row() -> None:
    w = EvictionWitness(max_keys=100, max_quiet_removals=100)
    w.scrape(1.0, 0)
    w.scrape(2.0, 2)  # another client: start over
    assert not w.armed
    w.scrape(3.0, 0)
    assert not w.armed
    w.scrape(4.0, 0)
    assert w.armed and w.armed_at == 4.0
    # a request sent before T hit it: known, not live (it may have freed its copy before T)
    w.touched([(0, "a")], sent_at=3.5)
    assert (0, "a") in w.seen and (0, "a") not in w.live


def test_a_request_finished_between_scrapes_is_counted_as_another_clients() -> None:
    """``vllm:request_success_total`` grew by more than the router sent (and had in flight at
    the first clean scrape): someone else's request ran between two scrapes."""
    w = EvictionWitness(max_keys=100, max_quiet_removals=100)
    w.scrape(1.0, 0, finished=10, sent=4, mine=1)
    w.scrape(2.0, 0, finished=12, sent=5, mine=0)  # 2 finished: the one in flight + 1 sent
    assert w.armed
    w.scrape(3.0, 0, finished=14, sent=6, mine=0)  # 4 finished, 2 sent + 1 in flight
    assert w.off == "another client sends it requests"


@pytest.mark.parametrize("limit", ["keys", "quiet"])
def test_its_records_are_bounded(limit: str) -> None:
    w = EvictionWitness(max_keys=10, max_quiet_removals=3)
    w.scrape(1.0, 0)
    w.scrape(2.0, 0)
    if limit == "keys":
        w.sending([(0, i) for i in range(11)])
    else:
        w.sending([(0, i) for i in range(5)])
        w.scan([(REMOVED, (0, i)) for i in range(5)])  # known blocks only: no proof to come
    assert w.off is not None and not w.seen and not w.live
