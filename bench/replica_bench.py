"""The simulated replica's own request overhead, beside its simulated compute.

A ``kvrouter replica`` subprocess (real hybrid block pool, real event publisher, uvicorn) runs
with ``--time-scale 0``, so the cost model adds no time: what is measured is HTTP, JSON/SSE,
tokenization, the engine's scheduling, the pool's hashing/allocation and event publishing.
The client (httpx, asyncio) runs in this process, on the other core.

Workload: 2,000-token text prompts (``wN`` words, tokenized by the replica), each prompt
distinct (no prefix-cache hit: every request hashes, allocates and stores all its blocks, and
evicts once the pool is full), ``max_tokens`` 16. Rows: ``engine`` (the same requests into
an in-process engine and pool, no HTTP: the pool's own cost, KV tensor writes included), then
JSON and SSE over HTTP at concurrency 1 (latency) and 8 (throughput). Reported: requests/s,
p50 and p99 latency (SSE: time to the last byte).

Usage: ``.venv/bin/python bench/replica_bench.py [--requests N] [--layout fa] [--out PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_emitter import tokenizer as tok  # noqa: E402

PROMPT_TOKENS = 2000
MAX_TOKENS = 16


def start_replica(layout: str, num_blocks: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable, "-m", "router.cli", "replica", "--port", "0", "--layout", layout,
        "--num-blocks", str(num_blocks), "--time-scale", "0",
        "--events-endpoint", "tcp://127.0.0.1:*", "--replay-endpoint", "tcp://127.0.0.1:*",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline().split()
    if len(first) != 2 or first[0] != "http":
        proc.kill()
        raise SystemExit(f"replica did not start: {first}")
    url = first[1]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("replica did not become healthy within 60 s")


def prompt_text(i: int) -> str:
    # Distinct from the first word on: no two requests share a block.
    return " ".join(f"w{(i * 7919 + j * 31) % tok.NUM_WORDS}" for j in range(PROMPT_TOKENS - 1))


async def one(client: httpx.AsyncClient, i: int, stream: bool) -> float:
    body = {"prompt": prompt_text(i), "max_tokens": MAX_TOKENS, "stream": stream}
    t0 = time.perf_counter()
    if stream:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for _ in r.aiter_bytes():
                pass
    else:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        if r.json()["usage"]["completion_tokens"] != MAX_TOKENS:
            raise SystemExit("unexpected completion length")
    return time.perf_counter() - t0


async def run_row(url: str, stream: bool, concurrency: int, n: int, base: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        for w in range(4):  # warm-up
            await one(client, base - 1 - w, stream)
        todo = iter(range(base, base + n))
        latencies: list[float] = []

        async def worker() -> None:
            for i in todo:
                latencies.append(await one(client, i, stream))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "mode": "sse" if stream else "json",
        "concurrency": concurrency,
        "requests": n,
        "requests_per_s": n / wall,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000,
    }


async def engine_only(layout_name: str, num_blocks: int, n: int) -> dict[str, Any]:
    """The same requests straight into the engine (no HTTP, no tokenizer, no publisher):
    what the pool and the scheduler cost on their own."""
    from gpu_emitter.cost_model import CostModel
    from gpu_emitter.engine import Engine
    from gpu_emitter.hybrid_pool import HybridBlockPool
    from gpu_emitter.layouts import load_layout

    engine = Engine(
        HybridBlockPool(load_layout(layout_name), num_blocks), None, cost=CostModel(time_scale=0)
    )
    engine.start()
    prompts = [tok.encode(prompt_text(i)) for i in range(n + 4)]
    for p in prompts[:4]:
        await engine.submit(p, MAX_TOKENS).result()
    latencies = []
    t0 = time.perf_counter()
    for p in prompts[4:]:
        t = time.perf_counter()
        await engine.submit(p, MAX_TOKENS).result()
        latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    await engine.stop()
    latencies.sort()
    return {
        "mode": "engine",
        "concurrency": 1,
        "requests": n,
        "requests_per_s": n / wall,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per row (default 200)")
    ap.add_argument("--layout", default="fa", help="replica layout (default fa)")
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "replica_bench.json")
    args = ap.parse_args()

    rows = [asyncio.run(engine_only(args.layout, args.num_blocks, args.requests))]
    proc, url = start_replica(args.layout, args.num_blocks)
    try:
        base = 10_000
        for stream in (False, True):
            for conc in (1, 8):
                rows.append(asyncio.run(run_row(url, stream, conc, args.requests, base)))
                base += args.requests + 10
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()

    print(f"replica overhead, --time-scale 0, layout {args.layout}, "
          f"{PROMPT_TOKENS}-token prompts, max_tokens {MAX_TOKENS}")  # fmt: skip
    print(f"{'mode':<5} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(
            f"{r['mode']:<5} {r['concurrency']:>4} {r['requests_per_s']:>8.1f} "
            f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "bench": "replica_bench",
        "layout": args.layout,
        "num_blocks": args.num_blocks,
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": MAX_TOKENS,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
