"""What kvrouter costs on the hot path: direct vs through the router, against fast fake backends.

Two fake backends (a raw-ASGI uvicorn process each, answering at once with a JSON completion
or an 8-chunk SSE stream, and a real KV-event publisher so the router's replicas are trusted)
and ``kvrouter serve`` run as subprocesses. A light HTTP/1.1 keep-alive client (raw asyncio
streams, so the client's own cost stays small on a 2-core machine) sends 2,000-token prompts
(distinct ``wN`` words, builtin tokenizer) at concurrency 1, 16 and 64, first directly to a
backend, then through the router. Each cell is bounded in requests and seconds.

Reported per cell: requests/s, p50/p99 latency, added p50/p99 (router minus direct) and the
router's CPU milliseconds per request (CPU time of the router process's threads from /proc,
divided by the requests it served). Targets (issue #5): <= 0.5 ms router CPU per request
non-streaming at concurrency 16, <= 1 ms added p50 at concurrency 1.

    .venv/bin/python bench/proxy_bench.py [--quick] [--profile]
        [--upstream-client own,httpx,aiohttp] [--repeat N] [--router-log-level info]

``--router-log-level`` (default ``error``): ``info`` costs the router one log line per request
(router.server.outcome; its stderr goes to a temporary file).

``--profile`` runs the router under cProfile for the c=16 JSON cell and prints the top
functions by cumulative time (written to bench/results/proxy_bench.prof).

``--upstream-client`` A/Bs the client the proxy forwards with (bench/upstream_clients.py):
one router process per client, all in front of the same two backends and fed the same
prompts. Each cell (mode, concurrency) measures direct, then every client's router, in an
order rotated per repeat; with ``--repeat N`` the table gives each client's median over the
N repeats (added p50 is taken per repeat against that repeat's direct p50). Several clients
write bench/results/proxy_bench_ab.json instead of proxy_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/proxy_bench.py` as the README runs it
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "proxy_bench.json"
TICK = os.sysconf("SC_CLK_TCK")
SCHEDSTAT = Path("/proc/self/schedstat").exists()

BACKEND = r"""
import sys, collections, msgspec, uvicorn
from events.publisher import EventPublisher
port, events_on, capacity = int(sys.argv[1]), sys.argv[2] == "events", int(sys.argv[3])
pub = EventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
print(pub.endpoint, pub.replay_endpoint, flush=True)
usage = {"prompt_tokens": 2001, "completion_tokens": 8, "total_tokens": 2009,
         "prompt_tokens_details": {"cached_tokens": 0}}
JSON = msgspec.json.encode({"id": "x", "object": "text_completion", "model": "bench",
    "choices": [{"index": 0, "text": " w1" * 8, "finish_reason": "length"}], "usage": usage})
CHUNKS = [b"data: " + msgspec.json.encode({"id": "x", "choices": [{"index": 0, "text": " w1"}]})
          + b"\n\n" for _ in range(8)]
LAST = b"data: " + msgspec.json.encode({"id": "x", "choices": [], "usage": usage}) + b"\n\n"
if events_on:
    from events.hashing import BlockHasher
    from events.layout import HashSettings
    from events.schema import BlockRemoved, BlockStored
    from gpu_emitter.tokenizer import encode
    hasher = BlockHasher(HashSettings(), 16)
cache = collections.OrderedDict()  # (group, hash) -> None, least recently used first
def tokens(body):
    prompt = msgspec.json.decode(body).get("prompt", "")
    return encode(prompt) if events_on else [7] * 2001
def publish(ids):
    # what vLLM publishes for a prompt it had not wholly cached: per group, BlockStored of the
    # blocks from the first one missing (full attention: to the end; sliding window 64: its
    # last 4) with their parent and token ids, and one BlockRemoved per block evicted (LRU over
    # capacity). A block cached behind the first missing one is dropped first (BlockRemoved),
    # so every store is one contiguous run and the router's index holds no copies.
    wires = hasher.wire_chain(ids)
    n = len(wires)
    batch = []
    for g, start in ((0, 0), (1, max(0, n - 4))):
        i0 = next((i for i in range(start, n) if (g, wires[i]) not in cache), n)
        for i in range(start, i0):
            cache.move_to_end((g, wires[i]))
        if i0 == n:
            continue
        for h in wires[i0:]:
            if cache.pop((g, h), 0) is None:
                batch.append(BlockRemoved(block_hashes=[h], group_idx=g, medium="GPU"))
            cache[(g, h)] = None
        batch.append(BlockStored(block_hashes=wires[i0:], block_size=16, group_idx=g,
                                 medium="GPU", parent_block_hash=wires[i0 - 1] if i0 else None,
                                 token_ids=ids[16 * i0 : 16 * n]))
    while len(cache) > capacity:
        (g, h), _ = cache.popitem(last=False)
        batch.append(BlockRemoved(block_hashes=[h], group_idx=g, medium="GPU"))
    if batch:
        pub.publish(batch)
        stats[0] += sum(len(e.block_hashes) for e in batch)
stats = [0]
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    body = b""
    while more:
        m = await receive(); body += m.get("body", b""); more = m.get("more_body", False)
    path = scope["path"]
    if path == "/metrics":
        text = f"bench_event_blocks_total {stats[0]}\n".encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": text}); return
    if path.endswith("/render"):  # vllm-router asks for the token ids before each request
        out = msgspec.json.encode([{"request_id": "x", "token_ids": tokens(body)}])
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out}); return
    if events_on and path == "/v1/completions":
        publish(tokens(body))
    if b'"stream":true' in body:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for c in CHUNKS:
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": LAST + b"data: [DONE]\n\n"})
    else:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(JSON)).encode())]})
        await send({"type": "http.response.body", "body": JSON})
uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)
"""


def free_port() -> int:
    # An explicit TCP socket (proto IPPROTO_TCP): asyncio only sets TCP_NODELAY on sockets
    # whose proto says TCP, and a 0-proto listener would stall small writes ~40 ms.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_backend(
    env: dict, events: bool = False, capacity: int = 4096
) -> tuple[subprocess.Popen, int, str, str]:
    """One fake backend (``BACKEND``) on a free port, listening: the process, its port, and
    its event and replay endpoints. With ``events`` it publishes what vLLM would for each
    prompt, with a cache of ``capacity`` blocks (LRU)."""
    port = free_port()
    mode = "events" if events else "quiet"
    p = subprocess.Popen(
        [sys.executable, "-c", BACKEND, str(port), mode, str(capacity)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert p.stdout is not None
    ep, rep = p.stdout.readline().split()
    wait_port(port, p)
    return p, port, ep, rep


@dataclasses.dataclass
class _Pid:
    """A process the bench did not start itself (it has a pid, no Popen)."""

    pid: int


def _listener_pid(port: int) -> int:
    """The process listening on 127.0.0.1:``port`` (from /proc/net/tcp and /proc/*/fd)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and int(f[1].split(":")[1], 16) == port:
            inode = f[9]
    if inode is None:
        raise SystemExit(f"nothing listens on port {port}")
    target = f"socket:[{inode}]"
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if os.readlink(fd) == target:
                return int(fd.parent.parent.name)
    raise SystemExit(f"no process found for the listener on port {port}")


def _event_blocks(port: int) -> int:
    """Blocks a backend has published in KV events (stored + removed), from its /metrics."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    for line in data.decode().splitlines():
        if line.startswith("bench_event_blocks_total "):
            return int(line.split()[1])
    return 0


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and every process below it (vllm-router's launcher may run the
    router in a child process)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
        todo += children.get(p, [])
    return total


def cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid``, summed over its threads.

    From ``/proc/PID/task/*/schedstat`` (nanoseconds) where the kernel has it: ``stat``'s
    utime+stime count 10 ms ticks, too coarse for a cell of a few hundred requests at well
    under 1 ms each. A thread that exits within a cell would take its time with it; the
    router's threads (event loop, ZeroMQ I/O, tokenizer pool) live as long as it does.
    """
    if not SCHEDSTAT:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            ns += int((task / "schedstat").read_text().split()[0])
    return ns / 1e9


class Conn:
    """One keep-alive HTTP/1.1 connection (Content-Length and chunked responses)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def request(self, path: str, body: bytes) -> int:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.w.write(head + body)
        r = self.r
        assert r is not None
        status_line = await r.readline()
        status = int(status_line.split()[1])
        length = None
        chunked = False
        while True:
            line = await r.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "transfer-encoding" and "chunked" in v:
                chunked = True
        if length is not None:
            await r.readexactly(length)
        elif chunked:
            while True:
                n = int((await r.readline()).split(b";")[0], 16)
                await r.readexactly(n + 2)
                if n == 0:
                    break
        return status


async def run_cell(
    port: int, bodies: list[bytes], concurrency: int, max_requests: int, max_seconds: float
) -> dict:
    lat: list[float] = []
    errors = 0
    it = iter(range(max_requests))
    deadline = time.monotonic() + max_seconds

    async def worker() -> None:
        nonlocal errors
        conn = Conn("127.0.0.1", port)
        for i in it:
            if time.monotonic() > deadline:
                return
            t = time.perf_counter()
            status = await conn.request("/v1/completions", bodies[i % len(bodies)])
            lat.append(time.perf_counter() - t)
            if status != 200:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    lat.sort()
    return {
        "requests": len(lat),
        "errors": errors,
        "rps": len(lat) / wall,
        "p50_ms": lat[len(lat) // 2] * 1000,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
    }


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"port {port} never opened")


def start_router(
    client: str,
    backends: list[tuple[int, str, str]],
    profile: Path | None,
    env: dict,
    log_level: str = "error",
) -> tuple[int, subprocess.Popen]:
    """``kvrouter serve`` in front of ``backends``, forwarding with upstream client ``client``."""
    rport = free_port()
    lines = [
        "[server]", f"port = {rport}", "metrics_scrape_interval_s = 0",
        f'log_level = "{log_level}"',
        "[[pools]]", 'model = "bench"',
        "[pools.layout]",
        'groups = [{kind = "full_attention", block_size = 16}, '
        '{kind = "sliding_window", block_size = 16, sliding_window = 64}]',
    ]  # fmt: skip
    for i, (port, ep, rep) in enumerate(backends):
        lines += [
            "[[pools.replicas]]", f'name = "b{i}"', f'url = "http://127.0.0.1:{port}"',
            f'event_endpoint = "{ep}"', f'replay_endpoint = "{rep}"',
        ]  # fmt: skip
    tmp = Path(tempfile.mkdtemp())
    cfg = tmp / "router.toml"
    cfg.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable]
    if profile is not None:
        cmd += ["-m", "cProfile", "-o", str(profile)]
    cmd += ["-m", "bench.upstream_clients", client, "serve", "--config", str(cfg)]
    # below error a line per request: to a file (a pipe nobody reads would fill and block)
    err: Any = subprocess.PIPE if log_level == "error" else (tmp / "stderr").open("w")
    router = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=ROOT, env=env
    )
    return rport, router


def summarize(samples: list[dict]) -> dict:
    """One (mode, concurrency, client) cell over its repeats: medians (and every sample)."""
    med = {
        k: statistics.median(s[k] for s in samples)
        for k in ("added_p50_ms", "added_p99_ms", "router_cpu_ms_per_request")
    }
    first = samples[0]
    return {
        "mode": first["mode"],
        "concurrency": first["concurrency"],
        "client": first["client"],
        "repeats": len(samples),
        **med,
        "direct": {"p50_ms": statistics.median(s["direct"]["p50_ms"] for s in samples)},
        "router": {
            k: statistics.median(s["router"][k] for s in samples)
            for k in ("rps", "p50_ms", "p99_ms")
        },
        "errors": sum(s["router"]["errors"] for s in samples),
        "samples": samples,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests per cell")
    ap.add_argument("--profile", action="store_true", help="cProfile the router (c=16 JSON)")
    ap.add_argument("--seconds", type=float, default=10.0, help="max seconds per cell")
    ap.add_argument(
        "--upstream-client",
        default="own",
        help="comma-separated clients the proxy forwards with: own, httpx, aiohttp "
        "(bench/upstream_clients.py); several are A/B-ed in one run",
    )
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every cell (medians)")
    ap.add_argument(
        "--router-log-level", default="error", choices=["error", "warning", "info", "debug"]
    )
    ap.add_argument(
        "--events",
        action="store_true",
        help="the backends publish vLLM's KV events for every prompt (stores, and one removal "
        "per block evicted from a --capacity-block LRU cache): the router's ingest is measured too",
    )
    ap.add_argument("--capacity", type=int, default=4096, help="blocks each backend caches (LRU)")
    ap.add_argument(
        "--vllm-router",
        action="store_true",
        help="also measure vllm-router 0.1.17 cache_aware (bench/real_vllm/install_vllm_router.sh "
        "installs it) in front of the same backends: its CPU per request beside kvrouter's",
    )
    args = ap.parse_args()
    clients = args.upstream_client.split(",")
    from bench.upstream_clients import CLIENTS

    unknown = [c for c in clients if c not in CLIENTS]
    if unknown or len(set(clients)) != len(clients) or args.repeat < 1:
        ap.error(f"--upstream-client: distinct names of {', '.join(CLIENTS)}; --repeat >= 1")
    if args.profile and len(clients) > 1:
        ap.error("--profile profiles one router: give one --upstream-client")
    n_req = {1: 200, 16: 1000, 64: 1500} if not args.quick else {1: 60, 16: 300, 64: 400}
    procs: list[subprocess.Popen] = []
    stack = contextlib.ExitStack()  # vllm-router, when measured
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    prof = ROOT / "bench" / "results" / "proxy_bench.prof"
    try:
        backends = []
        for _ in range(2):
            p, port, ep, rep = start_backend(env, args.events, args.capacity)
            procs.append(p)
            backends.append((port, ep, rep))
        routers: dict[str, tuple[int, subprocess.Popen]] = {}
        for client in clients:
            routers[client] = start_router(
                client, backends, prof if args.profile else None, env, args.router_log_level
            )
            procs.append(routers[client][1])
        for rport, router in routers.values():
            wait_port(rport, router)
        if args.vllm_router:
            from bench.real_vllm.vllm_router import vllm_router_process

            vport = free_port()
            vlog = Path(tempfile.mkdtemp()) / "vllm-router.log"
            urls = [f"http://127.0.0.1:{port}" for port, _, _ in backends]
            vbase = stack.enter_context(vllm_router_process(urls, vport, free_port(), vlog))
            vpid = _listener_pid(vport)
            print(f"vllm-router cache_aware at {vbase} (pid {vpid})", flush=True)
            routers["vllm-router"] = (vport, _Pid(vpid))
            clients.append("vllm-router")

        rng = random.Random(0)

        def bodies(stream: bool, n: int = 64) -> list[bytes]:
            out = []
            for _ in range(n):
                prompt = " ".join(f"w{rng.randrange(2041)}" for _ in range(2000))
                b = {"model": "bench", "prompt": prompt, "max_tokens": 8, "stream": stream}
                out.append(json.dumps(b, separators=(",", ":")).encode())
            return out

        data = {mode: bodies(mode == "sse") for mode in ("json", "sse")}
        samples: dict[tuple[str, int, str], list[dict]] = {}
        for r in range(args.repeat):
            order = clients[r % len(clients) :] + clients[: r % len(clients)]
            for mode in ("json", "sse"):
                for c in (1, 16, 64):
                    if args.profile and (mode, c) != ("json", 16):
                        continue
                    n = n_req[c]
                    asyncio.run(run_cell(backends[0][0], data[mode], c, min(n, 50), 5))  # warm
                    direct = asyncio.run(run_cell(backends[0][0], data[mode], c, n, args.seconds))
                    for client in order:
                        rport, router = routers[client]
                        asyncio.run(run_cell(rport, data[mode], c, min(n, 50), 5))
                        cpu0 = tree_cpu_seconds(router.pid)
                        via = asyncio.run(run_cell(rport, data[mode], c, n, args.seconds))
                        cpu = tree_cpu_seconds(router.pid) - cpu0
                        row = {
                            "mode": mode,
                            "concurrency": c,
                            "client": client,
                            "repeat": r,
                            "direct": direct,
                            "router": via,
                            "added_p50_ms": via["p50_ms"] - direct["p50_ms"],
                            "added_p99_ms": via["p99_ms"] - direct["p99_ms"],
                            "router_cpu_ms_per_request": cpu * 1000 / max(1, via["requests"]),
                        }
                        samples.setdefault((mode, c, client), []).append(row)
                        print(
                            f"{mode:4} c={c:<3} {client:7} direct {direct['rps']:6.0f} rps p50 "
                            f"{direct['p50_ms']:6.2f} ms | router {via['rps']:6.0f} rps p50 "
                            f"{via['p50_ms']:6.2f} p99 {via['p99_ms']:7.2f} ms | added p50 "
                            f"{row['added_p50_ms']:6.2f} p99 {row['added_p99_ms']:7.2f} ms | "
                            f"router CPU {row['router_cpu_ms_per_request']:.3f} ms/req"
                            + (f" ERRORS {via['errors']}" if via["errors"] else ""),
                            flush=True,
                        )
        rows = [summarize(v) for v in samples.values()]
        if args.repeat > 1 or len(clients) > 1:
            print(f"\nmedians over {args.repeat} repeat(s):")
            print("| mode | c | client | router CPU ms/req | added p50 ms | added p99 ms | rps |")
            print("|---|---|---|---|---|---|---|")
            for row in rows:
                print(
                    f"| {row['mode']} | {row['concurrency']} | {row['client']} | "
                    f"{row['router_cpu_ms_per_request']:.3f} | {row['added_p50_ms']:.2f} | "
                    f"{row['added_p99_ms']:.2f} | {row['router']['rps']:.0f} |"
                )
        event_blocks = sum(_event_blocks(port) for port, _, _ in backends)
        served = sum(s["router"]["requests"] for v in samples.values() for s in v)
        if args.events:
            print(
                f"\nevents: {event_blocks:,} blocks stored or removed by the backends, "
                f"{event_blocks / max(1, served):.0f} per request served through a router"
            )
        ratios = []
        if args.vllm_router:
            by_cell = {(r["mode"], r["concurrency"], r["client"]): r for r in rows}
            print("\nrouter CPU per request, kvrouter / vllm-router cache_aware (medians):")
            print("| mode | c | kvrouter ms/req | vllm-router ms/req | ratio |")
            print("|---|---|---|---|---|")
            for (mode, c, client), row in by_cell.items():
                other = by_cell.get((mode, c, "vllm-router"))
                if client == "vllm-router" or other is None:
                    continue
                ratio = row["router_cpu_ms_per_request"] / other["router_cpu_ms_per_request"]
                ratios.append({"mode": mode, "concurrency": c, "client": client, "ratio": ratio})
                print(
                    f"| {mode} | {c} | {row['router_cpu_ms_per_request']:.3f} | "
                    f"{other['router_cpu_ms_per_request']:.3f} | {ratio:.2f} |"
                )
        out = {
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "prompt_tokens": 2001,
            "clients": clients,
            "repeat": args.repeat,
            "events": args.events,
            "capacity_blocks": args.capacity,
            "event_blocks": event_blocks,
            "targets": {"router_cpu_ms_json_c16": 0.5, "added_p50_ms_c1": 1.0},
            "rows": rows,
            "cpu_ratio_vs_vllm_router": ratios,
        }
        if not args.profile:
            if args.vllm_router:
                name = "proxy_bench_vs_vllm_router" + ("_events" if args.events else "")
                path = RESULTS.with_name(name + ".json")
            elif len(clients) == 1:
                path = RESULTS
            else:
                path = RESULTS.with_name("proxy_bench_ab.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=2))
            print(f"wrote {path}")
    finally:
        stack.close()
        for p in reversed(procs):
            p.send_signal(signal.SIGINT)  # uvicorn exits cleanly; cProfile writes its file
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    if args.profile:
        import pstats

        pstats.Stats(str(prof)).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
