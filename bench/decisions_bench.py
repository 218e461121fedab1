"""What keeping the last decisions (``GET /admin/decisions``, router.server.decisions) costs a
request: ``router.server.outcome.finish`` (run once per request when it ends) with and without
the :class:`~router.server.decisions.DecisionLog`, on a real decision of the router's own pool
(bench/decide_bench.py's: fa + swa, ``--replicas`` replicas, ``--tokens``-token prompts), with
the request log off (``finish`` then only counts and times) and on (one INFO line to a null
handler). Also what reading the 50 rows back as JSON costs (``/admin/decisions``, off the hot
path).

    .venv/bin/python bench/decisions_bench.py [--replicas 8] [--n 20000]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decide_bench import SYSTEMS, make_pool, store  # noqa: E402

from router.server.decisions import DecisionLog, Kept  # noqa: E402
from router.server.outcome import Outcome, finish  # noqa: E402


def ab_us(a, b, n: int, rounds: int = 15) -> tuple[float, float]:
    """The fastest of ``rounds`` mean times of ``n`` calls of ``a`` and of ``b``, rounds
    interleaved (a, b, a, b...) so that a busy neighbour slows both alike; microseconds."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((a, b)):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / n * 1e6)
    return best[0], best[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--n", type=int, default=20000, help="finish() calls per round")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # "no event endpoint configured": known here
    rng = random.Random(1)
    systems = [[rng.randrange(7, 2048) for _ in range(1000)] for _ in range(SYSTEMS)]
    pool = make_pool([f"r{i}" for i in range(args.replicas)], speculative=False)
    store(pool, systems)
    prompt = systems[0] + [rng.randrange(7, 2048) for _ in range(args.tokens - 1000)]
    choice = pool.decide(prompt, {})
    choice.cached_tokens = 992
    metrics = pool.router.metrics
    out = Outcome("POST", "/v1/completions", time.perf_counter())
    out.pool = pool.name
    out.body_received()
    out.attempt(choice)
    out.response_started({"status": 200, "headers": [(b"x-kvrouter-replica", b"r0")]})
    log = DecisionLog()
    rows = []
    for level, what in ((logging.WARNING, "request log off"), (logging.INFO, "request log on")):
        logging.disable(logging.NOTSET)
        req_log = logging.getLogger("kvrouter.request")
        req_log.handlers[:] = [logging.NullHandler()]
        req_log.propagate = False
        req_log.setLevel(level)
        off, on = ab_us(
            lambda: finish(out, time.perf_counter(), metrics, "rid"),
            lambda: finish(out, time.perf_counter(), metrics, "rid", log),
            args.n,
        )
        rows.append((what, off, on))
    kept = Kept(time.time(), "rid", pool.name, choice.decision, choice.prediction, None,
                choice.num_tokens, None, 1, 200, 992, 1e-4, 1e-3)  # fmt: skip
    record, _ = ab_us(lambda: log.record(kept), lambda: None, args.n)
    read, _ = ab_us(log.rows, lambda: None, 200, rounds=5)
    print(f"outcome.finish() per request, {args.replicas} replicas "
          f"(fastest of 15 interleaved rounds x {args.n}):")  # fmt: skip
    for what, off, on in rows:
        print(f"  {what:<16} without the log {off:6.2f} us   with it {on:6.2f} us   "
              f"cost {on - off:+.2f} us")  # fmt: skip
    print(f"DecisionLog.record alone (one append): {record:.3f} us")
    print(f"reading {len(log)} rows as JSON (GET /admin/decisions, off the hot path): "
          f"{read:.0f} us")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
