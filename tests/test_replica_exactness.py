"""The simulated replica's cached_tokens equals what a fresh subscriber + index predicts.

A hybrid (full attention + sliding window 128) replica over HTTP with a cache small enough to
evict, its KV events over real ZeroMQ into kvrouter's SDK, index and predictor: before each
request the prediction is made from the events alone, and vLLM-style ``cached_tokens`` in the
response must equal it, request after request, through evictions of sliding-window blocks.
"""

from __future__ import annotations

import random

from test_replica_server import MODEL, Replica
from zmq_helpers import wait_for

from events.stream import StreamSpec
from events.subscriber import Subscriber
from gpu_emitter import tokenizer as tok
from gpu_emitter.hybrid_pool import HybridBlockPool
from gpu_emitter.layouts import load_layout
from router.core.index import KVIndex
from router.core.predict import Predictor
from router.server.ingest import IndexFeeder


def words(rng: random.Random, n: int) -> list[int]:
    return [tok.WORD_OFFSET + rng.randrange(tok.NUM_WORDS) for _ in range(n)]


def test_cached_tokens_equal_the_prediction_from_events() -> None:
    layout = load_layout("fa_swa")
    rep = Replica(pool=HybridBlockPool(layout, 200))  # 200 blocks: evictions happen
    index = KVIndex(layout)
    feeder = IndexFeeder(index, {"sim": ("sim", 0)})
    predictor = Predictor(index)
    spec = StreamSpec(
        "sim",
        rep.publisher.endpoint,
        rep.publisher.replay_endpoint,
        replay_from_start=True,
        lazy_token_ids=True,
    )
    rng = random.Random(4)
    seen: list[int] = []
    sub = Subscriber([spec], on_item=lambda item: (feeder(item), seen.append(item.seq)))
    try:

        def caught_up() -> bool:
            rep.publisher.flush(5)
            return bool(seen) and seen[-1] == rep.publisher.next_seq - 1

        def send(prompt: list[int]) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            r = rep.post("/v1/completions", body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        wait_for(lambda: send([tok.BOS_ID, *words(rng, 20)]) >= 0 and caught_up(), 10, "prime")
        systems = [[tok.BOS_ID, *words(rng, n)] for n in (150, 300, 420)]
        history: list[list[int]] = []
        rows = []
        for _ in range(60):
            kind = rng.choice(["prefix", "prefix", "prefix", "repeat", "turn", "turn", "flood"])
            if kind == "repeat" and history:
                prompt = rng.choice(history)
            elif kind == "turn" and history:
                prompt = rng.choice(history) + words(rng, rng.randint(10, 60))
            elif kind == "flood":
                prompt = [tok.BOS_ID, *words(rng, rng.randint(300, 600))]
            else:
                prompt = rng.choice(systems) + words(rng, rng.randint(5, 80))
            wait_for(caught_up, 10, "events of the previous request")
            pred = predictor.predict(prompt, blind=True).hit(("sim", 0))
            actual = send(prompt)
            rows.append((kind, pred.hit_tokens, pred.blind_hit_tokens, actual))
            history.append(prompt)
        assert [r for r in rows if r[1] != r[3]] == []
        removed = sum(s.removed_blocks for s in index.stats())
        assert removed > 0  # the cache was small enough to evict
        assert sum(r[3] > 0 for r in rows) >= 10  # the workload reuses the cache
        assert any(r[2] > r[1] for r in rows)  # and some hits are cut by the window group
        assert index.stats()[0].trusted
    finally:
        sub.close()
        rep.close()
