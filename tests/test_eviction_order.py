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

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.eviction_order import EvictionWitness

Key = tuple[int, object]
REMOVED, STORED, NAMED = 0, 1, 2
"""The model's events: a ``BlockRemoved``, a ``BlockStored``, a store's parent."""


class LRUPool:
    """A free-queue block pool with copies (the model the proofs reason about)."""

    def __init__(self, n: int) -> None:
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))
        self.key: dict[int, Key] = {}
        self.copies: dict[Key, dict[int, None]] = {}
        self.ref: Counter[int] = Counter()

    def count(self, k: Key) -> int:
        return len(self.copies.get(k, ()))

    def admit(
        self, chain: list[Key], recompute_from: int, window: int = 0
    ) -> tuple[list[Key], list[int], list]:
        """Admit a request: hit the cached prefix of ``chain`` (its first copies), allocate
        and store the rest. With ``window`` (blocks), a second group (a sliding window, keys
        ``(1, name)``) is cached too: a hit of ``h`` blocks needs the window's blocks before
        ``h`` in it as well, and the request keeps only its last ``window`` blocks there (the
        rest it frees at once). Returns the keys it hit, the blocks it holds and the events."""
        events: list[tuple[int, Key]] = []
        swa = [(1, k[1]) for k in chain] if window else []

        def cached(h: int) -> bool:
            if not all(self.copies.get(k) for k in chain[:h]):
                return False
            return all(self.copies.get(k) for k in swa[max(0, h - window) : h])

        h = min(len(chain), recompute_from)
        while h and not cached(h):
            h -= 1
        hit = chain[:h] + swa[max(0, h - window) : h]
        blocks = [next(iter(self.copies[k])) for k in hit]
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        for i, k in enumerate(chain[h:]):
            if i == 0 and h:
                events.append((NAMED, chain[h - 1]))
            blocks.append(self._store(k, events))
        if window:
            held = swa[max(0, len(chain) - window) :]
            new = [self._store(k, events) for k in swa[h:]]
            keep = [b for b in new if self.key[b] in held]
            early = [b for b in new if b not in keep]
            early += [b for b in blocks if self.key[b][0] == 1 and self.key[b] not in held]
            for b in early:  # outside the window: freed at once
                self.ref[b] -= 1
                if self.ref[b] == 0:
                    self.free[b] = None
            blocks = [b for b in blocks if b not in early] + keep
        return hit, blocks, events

    def _store(self, k: Key, events: list) -> int:
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
        events.append((STORED, k))
        return b

    def finish(self, blocks: list[int], decode: list[Key]) -> list:
        """The request generates ``decode`` blocks (stored), then frees all, tail first."""
        events: list[tuple[int, Key]] = []
        blocks = blocks + [self._store(k, events) for k in decode]
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        return events

    def serve(
        self, chain: list[Key], recompute_from: int, decode: list[Key] = (), window: int = 0
    ) -> list:
        """Admit and finish at once: one batch of events."""
        _, blocks, events = self.admit(chain, recompute_from, window)
        return events + self.finish(blocks, list(decode))


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

    def prove(self, w: EvictionWitness, events: list) -> int:
        """What KVIndex._witness_batch does with a batch (the stores and removals, in order)."""
        removed, named = w.scan([(what == STORED, k) for what, k in events if what != NAMED])
        lost = [k for k in removed if not self.held[k]]
        oldest = w.oldest_held(lambda k: self.held[k] > 0, named) if lost else None
        keep = [k for k in lost if oldest is not None and oldest < w.live.get(k, oldest)]
        w.compact(lambda k: self.held[k] > 0)
        return self.ensure(keep)


def _chain(rng: random.Random, families: int, serial: list[int]) -> list[Key]:
    f = rng.randrange(families)
    stem = [(0, ("f", f, j)) for j in range(rng.randrange(2, 7))]
    serial[0] += 1
    return stem + [(0, ("u", serial[0], j)) for j in range(rng.randrange(0, 4))]


def _decode(rng: random.Random, families: int) -> list[Key]:
    """Blocks a request generates: sometimes a block another prompt of a family has (a
    conversation's next turn), so a prompt key also gets copies no prompt stored."""
    if rng.random() < 0.5:
        return []
    return [(0, ("f", rng.randrange(families), rng.randrange(7)))]


def run(seed: int, before: int = 60, foreign_after_attach: int = 5, mine: int = 200,
        blocks: int = 48, families: int = 5, concurrency: int = 3,
        max_keys: int = 10**6, window: int = 0) -> tuple[int, int]:  # fmt: skip
    """Simulate one attach; asserts the lower bound after every batch. Returns how many keys
    the proofs held again and how many keys the index lacked at the end."""
    rng = random.Random(seed)
    pool, serial = LRUPool(blocks), [0]

    def recompute(chain: list[Key]) -> int:
        return rng.randrange(len(chain) + 1) if rng.random() < 0.3 else len(chain)

    for _ in range(before):  # other clients, before the router attached
        chain = _chain(rng, families, serial)
        pool.serve(chain, recompute(chain), _decode(rng, families), window)
    w = EvictionWitness(max_keys=max_keys)
    index = LowerBound()

    def apply(events: list) -> int:
        index.apply(events)
        n = index.prove(w, events)
        for k, c in index.held.items():
            assert c <= pool.count(k), (k, c, pool.count(k))
        return n

    for _ in range(foreign_after_attach):  # running at attach, finished before T
        chain = _chain(rng, families, serial)
        apply(pool.serve(chain, recompute(chain), _decode(rng, families), window))
    w.scrape(1.0, 0)
    w.scrape(2.0, 0)
    assert w.armed or w.off  # a small max_keys may have turned it off already
    proved = 0
    clock = 3.0
    # the router's requests: sent, admitted by the pool (holding their blocks), finished
    # (freed), then ended at the router; a cancelled one ends at the router first
    sent_q: list[dict] = []
    running: list[dict] = []
    sent = done = 0
    while done < mine:
        clock += 0.1
        step = rng.random()
        if not any(r["cancelled"] for r in sent_q + running) and rng.random() < 0.1:
            w.scrape(clock, 0)  # nothing runs that the router does not count
        if sent < mine and len(sent_q) + len(running) < concurrency and step < 0.4:
            chain = _chain(rng, families, serial)
            w.sending(sent, chain)
            r = {"attempt": sent, "chain": chain, "sent_at": clock, "cancelled": False}
            if rng.random() < 0.1:  # the client leaves: the router ends it now
                w.ended(sent, clock, finished=False)
                r["cancelled"] = True
            sent_q.append(r)
            sent += 1
        elif sent_q and (step < 0.7 or not running):
            r = sent_q.pop(rng.randrange(len(sent_q)))
            r["hit"], r["blocks"], events = pool.admit(r["chain"], recompute(r["chain"]), window)
            proved += apply(events)
            running.append(r)
        elif running:
            r = running.pop(rng.randrange(len(running)))
            proved += apply(pool.finish(r["blocks"], _decode(rng, families)))
            if not r["cancelled"]:
                if rng.random() < 0.9:  # its answer (a failed request gives none)
                    # what it hit is held (KVIndex.infer): the full-attention part; a window
                    # block it hit may have left the window, been freed and been evicted
                    # before the answer (this model found it; the router now skips a window
                    # key removed since the request was sent: test_partial_implied.py)
                    index.ensure(k for k in r["hit"] if k[0] == 0)
                    w.touched(r["hit"], r["sent_at"])
                clock += 0.05
                w.ended(r["attempt"], clock, finished=rng.random() < 0.95)
            done += 1
    lacking = sum(1 for k in pool.copies if not index.held[k])
    return proved, lacking


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    blocks=st.integers(64, 128),  # 4 requests in flight hold up to 40 (+8 window blocks)
    families=st.integers(2, 8),
    foreign=st.integers(0, 10),
    concurrency=st.integers(1, 4),
    max_keys=st.sampled_from([60, 100, 10**6]),  # small ones compact, or turn it off
    window=st.sampled_from([0, 1, 2]),  # 0: one group; else a sliding window of that many
)
def test_the_proof_never_claims_a_block_the_pool_lacks(
    seed: int, blocks: int, families: int, foreign: int, concurrency: int, max_keys: int,
    window: int,
) -> None:  # fmt: skip
    run(seed, blocks=blocks, families=families, foreign_after_attach=foreign,
        concurrency=concurrency, max_keys=max_keys, window=window)  # fmt: skip


def test_the_proof_holds_keys_again_that_the_pool_still_has() -> None:
    """Not vacuous: over seeded runs it re-holds keys whose older copy was evicted."""
    proved = sum(run(seed)[0] for seed in range(20))
    assert proved >= 20, proved


def test_another_client_after_t_breaks_the_proof_so_its_scrape_turns_it_off() -> None:
    """Why the gate: a block another client hit after T may be in use, or freed late, while
    the router's bound says it was freed early. A scrape that sees such a request turns the
    proof off and frees its records."""
    w = EvictionWitness(max_keys=100)
    w.scrape(1.0, 0)
    w.scrape(2.0, 0)
    x, k = (0, "x"), (0, "k")
    w.sending(0, [x])
    w.ended(0, 3.5, finished=True)
    w.touched([k], sent_at=4.0)
    assert w.scan([(False, k)]) == ({k}, {k})
    assert w.oldest_held({x}.__contains__, set()) == 3.5  # wrong if another client used x
    w.scrape(5.0, 1)  # a scrape shows a request the router does not count: maybe a lag
    assert w.armed
    w.scrape(6.0, 1)  # still there: another client's
    assert w.off == "another client sends it requests" and not w.armed
    assert w.scan([(False, k)]) == (set(), set()) and not w.live
    assert w.oldest_held({x}.__contains__, set()) is None


def test_arming_needs_two_clean_scrapes_in_a_row() -> None:
    w = EvictionWitness(max_keys=100)
    w.scrape(1.0, 0)
    w.scrape(2.0, 2)  # another client: start over
    assert not w.armed
    w.scrape(3.0, 0)
    assert not w.armed
    w.scrape(4.0, 0)
    assert w.armed and w.armed_at == 4.0
    # a request sent before T hit it: no newer copy proved (it may have freed it before T)
    w.touched([(0, "a")], sent_at=3.5)
    assert (0, "a") not in w.live
    w.touched([(0, "a")], sent_at=4.5)
    assert w.live[(0, "a")] == 4.5


def test_one_scrape_ahead_of_vllms_count_is_not_another_client() -> None:
    """vLLM's running count can lag a request the router just saw end: one such scrape is
    not enough, the next clean one clears it."""
    w = EvictionWitness(max_keys=100)
    w.scrape(1.0, 0, finished=0, sent=0)
    w.scrape(2.0, 0, finished=0, sent=0)
    w.sending(0, [])
    w.ended(0, 2.5, finished=True)
    w.scrape(3.0, 1, finished=0, sent=1)  # vLLM still counts it running
    w.scrape(4.0, 0, finished=1, sent=1)
    assert w.armed
    w.scrape(5.0, 1, finished=2, sent=1)  # one finished the router never sent: at once
    assert w.off == "another client sends it requests"


def test_a_request_sent_before_the_proof_started_holds_arming_back() -> None:
    """The router had a request in flight when the replica became partial: it is not
    tracked, so the blocks it uses are unknown; arming waits until it is gone."""
    w = EvictionWitness(max_keys=100)
    w.sending(0, [(0, "a")])
    w.scrape(1.0, 0, mine=2)  # two of the router's own, one of them untracked
    w.scrape(2.0, 0, mine=2)
    assert not w.armed
    w.scrape(3.0, 0, mine=1)
    w.scrape(4.0, 0, mine=1)
    assert w.armed


def test_a_request_finished_between_scrapes_is_counted_as_another_clients() -> None:
    """``vllm:request_success_total`` grew by more than the router sent (and had in flight at
    the first clean scrape): someone else's request ran between two scrapes."""
    w = EvictionWitness(max_keys=100)
    w.sending(0, [])
    w.scrape(1.0, 0, finished=10, sent=4, mine=1)
    w.ended(0, 1.5, finished=True)
    w.scrape(2.0, 0, finished=12, sent=5, mine=0)  # 2 finished: the one in flight + 1 sent
    assert w.armed
    w.scrape(3.0, 0, finished=14, sent=6, mine=0)  # 4 finished, 2 sent + 1 in flight
    assert w.off == "another client sends it requests"


def test_the_proof_needs_a_block_freed_before_the_copy_and_still_held() -> None:
    """Hand-derived: block X (freed when request 0 ended, at 3.5) is still held when a copy
    of K goes; K's copy that request 1 (sent at 4.0) hit was freed after 4.0, so the LRU
    queue would have evicted X first: the copy that went was an older one."""
    w = EvictionWitness(max_keys=100)
    w.scrape(1.0, 0)
    w.scrape(2.0, 0)
    x, k = (0, "x"), (0, "k")
    w.sending(0, [x])
    w.ended(0, 3.5, finished=True)
    w.sending(1, [k])
    w.touched([k], sent_at=4.0)
    w.ended(1, 4.5, finished=True)
    held = {x}.__contains__
    assert w.scan([(False, k)])[0] == {k}
    assert w.oldest_held(held, set()) == 3.5 < w.live[k]
    # X in a request in flight: maybe in use, so no bound, even once another one ends
    w.sending(2, [x])
    assert w.oldest_held(held, set()) is None
    w.sending(5, [x])
    w.ended(5, 4.8, finished=True)
    assert w.oldest_held(held, set()) is None
    w.ended(2, 5.0, finished=True)
    assert w.oldest_held(held, set()) == 5.0  # now newer than K's copy: no proof
    # a request that did not finish: its keys are never bounded again
    w.sending(3, [x])
    w.ended(3, 6.0, finished=False)
    assert w.oldest_held(held, set()) is None
    # a store while a request is in flight waits for it: it may have stored the copy; so
    # does the cancelled one, which vLLM runs until it gets to the abort (a clean scrape
    # proves that done)
    y = (0, "y")
    w.sending(4, [])
    w.scan([(True, y)])
    assert w.oldest_held({y}.__contains__, set()) is None
    w.ended(4, 7.0, finished=True)
    assert w.oldest_held({y}.__contains__, set()) is None
    w.scrape(7.5, 0)
    assert w.oldest_held({y}.__contains__, set()) == 7.5
    assert w.oldest_held({y}.__contains__, {y}) is None  # the batch named it: not used
    # a block of another group gets no bound: a hit there touches it, and no tracked key says
    # which request may be using it
    z = (1, "z")
    w.scan([(True, z)])
    w.sending(6, [])
    w.ended(6, 8.0, finished=True)
    assert w.oldest_held({z}.__contains__, set()) is None


def test_its_records_are_bounded() -> None:
    w = EvictionWitness(max_keys=10)
    w.scrape(1.0, 0)
    w.scrape(2.0, 0)
    keys = [(0, i) for i in range(12)]
    w.sending(0, keys)
    w.ended(0, 3.0, finished=True)
    w.compact({(0, 1), (0, 2)}.__contains__)  # what the index no longer holds is dropped
    assert w.off is None and w.size() == 2
    w.sending(1, keys)
    w.ended(1, 4.0, finished=True)
    w.compact(lambda k: True)  # all still held: over the bound, off
    assert w.off is not None and w.size() == 0


# --- the index's use of the proofs (KVIndex._witness_batch, witness_scrape) ---------------


def _partial_index():
    from events.layout import GroupKind, GroupSpec, ModelLayout
    from router.core.index import KVIndex

    fa = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)
    index = KVIndex(ModelLayout(groups=(fa,)), verify_hashes=False)
    index.add_replica("A")
    index.attached_late(("A", 0), "test")
    return index


def _store(hashes: list[int]):
    from events.schema import BlockStored

    return BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))),
        block_size=16, medium="GPU", group_idx=0,
    )  # fmt: skip


def _remove(hashes: list[int]):
    from events.schema import BlockRemoved

    return BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)


def _stores(index, attempt: int, h: int, sent: float) -> None:
    """Request ``attempt`` (prompt block ``h``), sent at ``sent``, stores ``h`` and ends 0.5
    later: the block was last freed then."""
    index.witness_sending(("A", 0), attempt, [(0, h)])
    index.apply_events(("A", 0), [_store([h])])
    index.witness_ended(("A", 0), attempt, sent + 0.5, True)


def _hits(index, attempt: int, h: int, sent: float) -> None:
    """Request ``attempt``, sent at ``sent``, hit ``h`` (cached before attach: its answer
    taught it) and ends 0.5 later."""
    index.witness_sending(("A", 0), attempt, [(0, h)])
    index.infer(("A", 0), [(0, h)])
    index.witness_touched(("A", 0), [(0, h)], sent)
    index.witness_ended(("A", 0), attempt, sent + 0.5, True)


def test_the_index_holds_again_what_a_proof_keeps_and_retires_it_on_another_client() -> None:
    A = ("A", 0)
    index = _partial_index()
    held = lambda h: index.copies(A, 0, h) > 0  # noqa: E731
    index.witness_scrape(A, 1.0, 0, None, 0, 0)
    index.witness_scrape(A, 2.0, 0, None, 0, 0)
    assert index.stats()[0].eviction_proof == "armed"
    _stores(index, 0, 11, 3.0)  # block 11 freed at 3.5
    _hits(index, 1, 22, 4.0)  # a copy of 22 freed after 4.0
    # a copy of 22 is evicted while 11 (freed before 4.0) is still held: an older copy went
    index.apply_events(A, [_remove([22])])
    assert held(22) and index.stats()[0].older_copy_evicted == 1
    # without 11 held there is no proof
    index.apply_events(A, [_remove([11])])
    index.apply_events(A, [_remove([22])])
    assert not held(22)
    # another client shows up at the next scrape: what was kept since the last clean one goes
    _stores(index, 2, 33, 5.0)
    _hits(index, 3, 44, 6.0)
    index.apply_events(A, [_remove([44])])
    assert held(44)
    index.witness_scrape(A, 7.0, 1, None, 0, 0)  # once: maybe vLLM's count lagging
    assert held(44)
    index.witness_scrape(A, 8.0, 1, None, 0, 0)  # twice: another client's
    assert not held(44) and held(33)
    assert index.stats()[0].eviction_proof == "off: another client sends it requests"
