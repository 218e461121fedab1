"""How long one very large prompt stalls the router's event loop (issue 13, item 2).

Every request the router serves shares one event loop: while a handler runs without awaiting,
nothing else is served (no other request, no ``/health``, no KV event). This bench sends one
large completion prompt at a time (``max_body_bytes`` allows 8 MiB) to a router in a
subprocess, in front of a fast fake backend (bench/proxy_bench.py's), and measures:

* ``loop_stall_ms``: the router's worst event-loop stall while the prompt was handled, seen
  from inside the router by a ticker task (``sleep(1 ms)`` in a loop; a stall is how late a
  tick woke up). The driver wraps the router's app to run the ticker and to answer
  ``GET /_stall`` (the worst stall since the last call);
* ``health_max_ms``: the slowest ``GET /health`` answer meanwhile, from a client polling it
  on a second connection (what a load balancer's probe or another client would see);
* ``request_s``: the large request's own latency.

Prompts are fresh random words (no tokenizer memo hits: the worst case for the builtin
tokenizer, which hashes every unknown word). ``--root DIR`` runs the router from another
checkout (e.g. ``git archive <commit> | tar -x -C /tmp/before``) for a before/after table.

    .venv/bin/python bench/loop_stall_bench.py [--sizes 1,2,4,8] [--repeat 3] [--root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.proxy_bench import free_port, start_backend, wait_port  # noqa: E402

DRIVER = r"""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
from router.config import load_config
from router.server.app import create_app

config = load_config(sys.argv[2])
app = create_app(config)
worst = [0.0]
started = []

async def ticker():
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        late = time.perf_counter() - t - 0.001
        if late > worst[0]:
            worst[0] = late

async def wrapped(scope, receive, send):
    if scope["type"] == "lifespan" and not started:
        started.append(asyncio.get_running_loop().create_task(ticker()))
    if scope["type"] == "http" and scope["path"] == "/_stall":
        body = json.dumps({"worst_ms": worst[0] * 1000}).encode()
        worst[0] = 0.0
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    await app(scope, receive, send)

try:
    from router.server.http_server import make_server
except ImportError:  # a checkout from before the server factory: plain uvicorn as cli.py ran it
    import uvicorn
    uvicorn.run(wrapped, host=config.server.host, port=config.server.port, log_level="error",
                access_log=False, lifespan="on", http="auto", loop="auto")
else:
    make_server(wrapped, config.server).run()
"""


def prompt_of(nbytes: int, rng: random.Random) -> str:
    """Fresh words (``x`` + 9 random digits: none memoised, none a ``wN`` word)."""
    n = nbytes // 11
    return " ".join(f"x{rng.randrange(10**9):09d}" for _ in range(n))


async def one(port: int, body: bytes) -> dict:
    base = f"http://127.0.0.1:{port}"
    async with (
        httpx.AsyncClient(base_url=base, timeout=120) as big,
        httpx.AsyncClient(base_url=base, timeout=120) as probe,
    ):
        await probe.get("/health")
        await probe.get("/_stall")  # reset
        done = asyncio.Event()
        worst = 0.0
        polls = 0

        async def poll() -> None:
            nonlocal worst, polls
            while not done.is_set():
                t = time.perf_counter()
                r = await probe.get("/health")
                r.raise_for_status()
                worst = max(worst, time.perf_counter() - t)
                polls += 1
                await asyncio.sleep(0.002)

        poller = asyncio.create_task(poll())
        t0 = time.perf_counter()
        r = await big.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        took = time.perf_counter() - t0
        done.set()
        await poller
        stall = (await probe.get("/_stall")).json()["worst_ms"]
        return {
            "status": r.status_code,
            "request_s": took,
            "loop_stall_ms": stall,
            "health_max_ms": worst * 1000,
            "health_polls": polls,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,2,4,8", help="prompt sizes in MB (comma-separated)")
    ap.add_argument("--repeat", type=int, default=3, help="requests per size (worst reported)")
    ap.add_argument("--root", default=str(ROOT), help="checkout the router runs from")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    try:
        backend, bport, ep, rep = start_backend(env)
        procs.append(backend)
        rport = free_port()
        toml = "\n".join([
            "[server]", f"port = {rport}", "metrics_scrape_interval_s = 0",
            'log_level = "error"', "max_body_bytes = 16777216",
            "[[pools]]", 'model = "bench"',
            "[pools.layout]",
            'groups = [{kind = "full_attention", block_size = 16}, '
            '{kind = "sliding_window", block_size = 16, sliding_window = 64}]',
            "[[pools.replicas]]", 'name = "b0"', f'url = "http://127.0.0.1:{bport}"',
            f'event_endpoint = "{ep}"', f'replay_endpoint = "{rep}"',
        ])  # fmt: skip
        cfg = Path(tempfile.mkdtemp()) / "router.toml"
        cfg.write_text(toml + "\n")
        router = subprocess.Popen(
            [sys.executable, "-c", DRIVER, args.root, str(cfg)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=args.root, env=env,
        )  # fmt: skip
        procs.append(router)
        wait_port(rport, router)
        rng = random.Random(0)
        rows = []
        print(f"router from {args.root}")
        print(" MB  status  request_s  loop_stall_ms  health_max_ms  health_polls")
        for mb in (float(s) for s in args.sizes.split(",")):
            worst: dict | None = None
            for _ in range(args.repeat):
                prompt = prompt_of(int(mb * 1_000_000), rng)
                body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 8}).encode()
                row = asyncio.run(one(rport, body))
                if worst is None or row["loop_stall_ms"] > worst["loop_stall_ms"]:
                    worst = row
            assert worst is not None
            worst["mb"] = mb
            rows.append(worst)
            print(
                f"{mb:3g}  {worst['status']:6d}  {worst['request_s']:9.3f}  "
                f"{worst['loop_stall_ms']:13.1f}  {worst['health_max_ms']:13.1f}  "
                f"{worst['health_polls']:12d}"
            )
        out = ROOT / "bench" / "results" / "loop_stall.json"
        out.write_text(json.dumps({"root": args.root, "rows": rows}, indent=1) + "\n")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
