"""``kvrouter demo``: simulated replicas + the router + a Mooncake-shaped workload, one command.

For each policy (``kv``, shown as ``hybrid``; ``prefix_group_blind``; ``least_load``;
``round_robin``) the demo starts **fresh** processes: N ``kvrouter replica`` (simulated vLLM
replicas: a hybrid block pool with vLLM's caching rules, KV events over ZeroMQ, an OpenAI
server with ``cached_tokens``; the KV capacity is small so eviction happens) and one
``kvrouter serve`` with a generated config in the output folder. It replays the same workload
through the router's HTTP port (streaming completions, token-id prompts, each request at its
scaled arrival time, at most ``--max-in-flight`` at once if set), prints a progress line every
two seconds, stops everything and ends with a comparison table. Results (``demo.json``,
``demo_policies.png``, each run's router config and logs) go to the output folder named at
the end.

The workload is a sample of whole conversations of the Mooncake conversation trace (see
:mod:`gpu_emitter.workload`), or a synthetic Mooncake-shaped one when the trace file is absent.
Every process is started in its own process group and stopped (SIGTERM, then SIGKILL) on the
way out, Ctrl-C included. This module imports no torch: the replicas are subprocesses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

__all__ = [
    "DemoError",
    "Procs",
    "add_arguments",
    "free_port",
    "percentile",
    "read_endpoints",
    "replica_argv",
    "router_toml",
    "run",
    "wait_healthy",
]

POLICIES = ("kv", "prefix_group_blind", "least_load", "round_robin")
LABELS = {"kv": "hybrid"}
MODEL = "kvrouter-sim"


class DemoError(RuntimeError):
    """The demo cannot run (a process did not start, a bad option); the message says why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.description = (
        "Start N simulated vLLM replicas and the router, replay a Mooncake-shaped workload "
        "through the router's HTTP API once per routing policy (fresh replicas each time), "
        "print live progress and a comparison table, and write JSON + PNG results. "
        "No GPU and no vLLM needed. Ctrl-C stops every process it started."
    )
    parser.add_argument(
        "--layout",
        default="fa_swa",
        help="replica KV layout: fa, fa_swa (full attention + sliding window 128), gemma3, "
        "fa_mamba, or a layout TOML file",
    )
    parser.add_argument("--replicas", type=int, default=3, help="simulated replicas")
    parser.add_argument(
        "--trace",
        default=None,
        help="Mooncake JSONL trace; default: ../shared/traces/mooncake/"
        "conversation_trace.jsonl beside the repo ($KVROUTER_SHARED), else a synthetic "
        "Mooncake-shaped workload; 'synthetic' forces the latter",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=300,
        help="requests per policy: whole conversations sampled evenly from the trace",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=35.0,
        help="seconds the replay of one policy's arrivals spans (sets the time scale)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="multiply trace arrival times by this instead of fitting --duration",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=32,
        help="tokens each 512-token trace block becomes (token counts scaled by it / 512)",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=768,
        help="KV blocks per replica (shared by all groups): small, so eviction happens",
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated policies to compare (kv is the hybrid-hit policy)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default: ./kvrouter-demo-<date-time>)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=0,
        help="at most this many requests outstanding through the router (0: no limit, each "
        "request goes at its arrival time); 1 sends each request only once the previous one "
        "has finished, so every prediction sees the events of all earlier requests",
    )
    parser.add_argument(
        "--replica-time-scale",
        type=float,
        default=1.0,
        help="the replicas' --time-scale (simulated compute: 0.2 ms per uncached prompt "
        "token, 20 ms per decode step)",
    )


# ----------------------------------------------------------------------------- processes


_T = TypeVar("_T")


class Procs:
    """Every process the demo started, each in its own process group."""

    def __init__(self, logdir: Path) -> None:
        self.root = logdir
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen[str], IO[str]]] = []
        self._main: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None
        self._cancelled = False

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[str]:
        log = (self.logdir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs.append((name, proc, log))
        with (self.root / "pids.txt").open("a") as f:  # lets a caller check they are gone
            f.write(f"{proc.pid} {name}\n")
        return proc

    def stop_all(self, timeout: float = 10.0) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc, log in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()
            log.close()
        self.procs.clear()

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every process group now, without waiting (safe in a handler)."""
        for _, proc, _ in list(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    def pids(self) -> list[int]:
        return [p.pid for _, p, _ in self.procs]

    def stop_on_signals(self) -> None:
        """On SIGINT or SIGTERM, stop every process from the handler itself (whatever the
        main code is blocked in), raise KeyboardInterrupt in the main thread, and make sure
        this process ends even if unwinding hangs: Ctrl-C must stop it all."""

        def on_signal(sig: int, frame: Any) -> None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # one interrupt is enough: the
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stop and the watchdog finish it
            self.signal_all(signal.SIGTERM)
            watchdog = threading.Timer(20.0, _force_exit, args=(self,))
            watchdog.daemon = True
            watchdog.start()
            if self._main is not None:  # inside run_async: unwind the loop's way
                loop, task = self._main
                self._cancelled = True
                loop.call_soon_threadsafe(task.cancel)
                return
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run_async(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """``asyncio.run(coro)``, except that an interrupt cancels its task (every task it
        awaits unwinds with it) and KeyboardInterrupt is raised once that is done. Raised by
        the handler at whatever instruction the loop is at, KeyboardInterrupt can land in
        asyncio's own bookkeeping and leave a task that never finishes, which the loop's
        shutdown then waits for: bench/soak.py once sat out its 20 s watchdog that way in CI
        and ended without saying it was interrupted."""

        async def main() -> _T:
            current = asyncio.current_task()
            if current is None:  # pragma: no cover - asyncio.run always runs a task
                raise RuntimeError("run_async needs a running task")
            self._main = (asyncio.get_running_loop(), current)
            try:
                return await coro
            finally:
                self._main = None

        try:
            return asyncio.run(main())
        except asyncio.CancelledError:
            if self._cancelled:
                raise KeyboardInterrupt from None
            raise


def _force_exit(procs: Procs) -> None:
    """Last resort after an interrupt: kill what is left and leave with Ctrl-C's status."""
    procs.signal_all(signal.SIGKILL)
    os._exit(130)


def read_endpoints(proc: subprocess.Popen[str], name: str, timeout: float) -> dict[str, str]:
    """The ``http``/``events``/``replay`` lines ``kvrouter replica`` prints once bound."""
    got: dict[str, str] = {}
    box: list[str] = []

    def reader() -> None:
        if proc.stdout is None:
            return
        for line in proc.stdout:
            box.append(line)
            parts = line.split()
            if len(parts) == 2 and parts[0] in ("http", "events", "replay"):
                got[parts[0]] = parts[1]
            if len(got) == 3:
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    if len(got) < 3:
        raise DemoError(
            f"{name} did not report its endpoints within {timeout:.0f}s "
            f"(exit code {proc.poll()}); see its log in the output folder"
        )
    return got


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replica_argv(
    layout: str,
    num_blocks: int,
    max_model_len: int,
    time_scale: float,
    *,
    port: int = 0,
    events: str = "tcp://127.0.0.1:*",
    replay: str = "tcp://127.0.0.1:*",
) -> list[str]:
    """The ``kvrouter replica`` command line of one simulated replica of :data:`MODEL`.

    The defaults pick free ports (read back with :func:`read_endpoints`); fixed ports (an
    ``events`` endpoint without ``*`` is bound, not connected) let the same command line
    restart a killed replica where the router expects it."""
    argv = [sys.executable, "-m", "router.cli", "replica", "--port", str(port)]
    argv += ["--layout", layout, "--events-endpoint", events, "--replay-endpoint", replay]
    if "*" not in events:
        argv.append("--events-bind")
    argv += ["--num-blocks", str(num_blocks), "--model", MODEL]
    argv += ["--max-model-len", str(max_model_len), "--time-scale", str(time_scale)]
    return argv


def router_toml(
    port: int,
    policy: str,
    replicas: list[dict[str, str]],
    seed: int,
    *,
    admin: bool = False,
    log_level: str = "warning",
    extra: str = "",
    generator: str = "kvrouter demo",
) -> str:
    """A ``kvrouter serve`` config: one pool of :data:`MODEL` over ``replicas`` (their
    ``http``/``events``/``replay`` addresses as :func:`read_endpoints` returns them), the
    layout learned from their events; ``extra`` is appended TOML (e.g. a ``[health]`` table).
    """
    lines = [
        f"# Generated by `{generator}`.",
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        f"admin_enabled = {'true' if admin else 'false'}",
        "metrics_scrape_interval_s = 0.5",
        f'log_level = "{log_level}"',
        "",
        "[[pools]]",
        f'model = "{MODEL}"',
        "[pools.tokenizer]",
        'strategy = "builtin"',
        "[pools.layout]",
        "groups = []  # learned from the replicas' events",
        "[pools.layout.hash]",
        'algo = "sha256"',
        "int_block_hashes = true",
        "[pools.policy]",
        f'name = "{policy}"',
        f"seed = {seed}",
        "# the admission-time view (x-kvrouter-expected-hit), for the report only: routing",
        "# stays on events alone, as by default",
        "speculative_insert = true",
        "speculative_routing = false",
    ]
    for i, r in enumerate(replicas):
        lines += [
            "",
            "[[pools.replicas]]",
            f'name = "sim-{i}"',
            f'url = "{r["http"]}"',
            f'event_endpoint = "{r["events"]}"',
            f'replay_endpoint = "{r["replay"]}"',
        ]
    return "\n".join(lines) + "\n" + extra


# ----------------------------------------------------------------------------- replay


@dataclass
class Outcome:
    index: int
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted: int | None = None
    """``x-kvrouter-predicted-hit``: what the events said at routing."""
    expected: int | None = None
    """``x-kvrouter-expected-hit``: plus what the requests routed ahead will store."""
    in_flight: int = 0
    """This demo's requests on the same replica when its answer began, this one included."""
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class Live:
    total: int
    replicas: list[str]
    done: list[Outcome] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    sent: int = 0

    def line(self, label: str, elapsed: float) -> str:
        ok = [o for o in self.done if o.error is None]
        prompt = sum(o.prompt_tokens for o in ok) or 1
        hit = sum(o.cached_tokens for o in ok) / prompt
        ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
        p50 = ttfts[len(ttfts) // 2] * 1000 if ttfts else 0.0
        served: dict[str, int] = {}
        for o in ok:
            served[o.replica] = served.get(o.replica, 0) + 1
        load = " ".join(f"{r}:{served.get(r, 0)}/{self.in_flight.get(r, 0)}" for r in self.replicas)
        errs = len(self.done) - len(ok)
        return (
            f"  [{label:18}] {elapsed:5.1f}s  done {len(self.done):4}/{self.total}  "
            f"hit {100 * hit:5.1f} %  TTFT p50 {p50:6.1f} ms  "
            f"replica done/in-flight {load}" + (f"  errors {errs}" if errs else "")
        )


async def _one(
    client: Any,
    url: str,
    req: Any,
    out: Outcome,
    live: Live,
    t0: float,
    limit: asyncio.Semaphore | None,
) -> None:
    delay = t0 + req.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    async with limit if limit is not None else contextlib.nullcontext():
        await _send(client, url, req, out, live)


def _header_int(value: str | None) -> int | None:
    return int(value) if value and value.isascii() and value.isdigit() else None


async def _send(client: Any, url: str, req: Any, out: Outcome, live: Live) -> None:
    import httpx

    ids = req.token_ids()
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out.prompt_tokens = len(ids)
    start = time.monotonic()
    live.sent += 1
    replica = ""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            replica = resp.headers.get("x-kvrouter-replica", "?")
            live.in_flight[replica] = live.in_flight.get(replica, 0) + 1
            out.in_flight = live.in_flight[replica]
            out.predicted = _header_int(resp.headers.get("x-kvrouter-predicted-hit"))
            out.expected = _header_int(resp.headers.get("x-kvrouter-expected-hit"))
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if out.ttft_s is None and chunk.get("choices"):
                        out.ttft_s = time.monotonic() - start
                    usage = chunk.get("usage")
                    if usage:
                        details = usage.get("prompt_tokens_details") or {}
                        out.cached_tokens = int(details.get("cached_tokens") or 0)
                        out.prompt_tokens = int(usage.get("prompt_tokens") or len(ids))
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        if replica:
            live.in_flight[replica] -= 1
        out.replica = replica
        out.latency_s = time.monotonic() - start
        live.done.append(out)


async def _replay(
    url: str, requests: Sequence[Any], live: Live, label: str, max_in_flight: int = 0
) -> list[Outcome]:
    import httpx

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    outs = [Outcome(r.index) for r in requests]
    # asyncio.Semaphore serves its waiters first come, first served: with a limit the
    # requests still go in arrival order.
    limit = asyncio.Semaphore(max_in_flight) if max_in_flight > 0 else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        t0 = time.monotonic() + 0.2
        tasks = [
            asyncio.create_task(_one(client, url, r, o, live, t0, limit))
            for r, o in zip(requests, outs, strict=True)
        ]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=2.0)
            print(live.line(label, time.monotonic() - t0), flush=True)
    return outs


# ----------------------------------------------------------------------------- summary


def percentile(xs: Sequence[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile of ``xs`` (0.0 for none)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


MISPREDICTED_KEPT = 20
"""Requests whose events-only or admission-time prediction differed from ``cached_tokens``
kept in ``demo.json`` (``mispredicted``), so a miss can be traced after the run."""


def summarize(policy: str, outs: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outs if o.error is None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    per: dict[str, int] = {}
    for o in ok:
        per[o.replica] = per.get(o.replica, 0) + 1
    with_pred = [o for o in ok if o.predicted is not None]
    exact = sum(1 for o in with_pred if o.predicted == o.cached_tokens)
    with_exp = [o for o in ok if o.expected is not None]
    exp_exact = sum(1 for o in with_exp if o.expected == o.cached_tokens)
    return {
        "policy": policy,
        "label": LABELS.get(policy, policy),
        "requests": len(outs),
        "errors": len(outs) - len(ok),
        "error_samples": [o.error for o in outs if o.error][:3],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "latency_mean_s": statistics.fmean(o.latency_s for o in ok) if ok else 0.0,
        "requests_per_replica": dict(sorted(per.items())),
        "prediction_exact_ratio": exact / len(with_pred) if with_pred else None,
        "admission_exact_ratio": exp_exact / len(with_exp) if with_exp else None,
        "mispredicted": [
            {
                "index": o.index,
                "replica": o.replica,
                "prompt_tokens": o.prompt_tokens,
                "cached_tokens": o.cached_tokens,
                "predicted": o.predicted,
                "expected": o.expected,
                "in_flight": o.in_flight,
            }
            for o in ok
            if o.predicted not in (None, o.cached_tokens)
            or o.expected not in (None, o.cached_tokens)
        ][:MISPREDICTED_KEPT],
        "wall_s": wall_s,
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'policy':20} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p90':>10} {'TTFT p99':>10} "
        f"{'pred exact':>10} {'adm exact':>10} {'errors':>6}  requests per replica"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        pe, ae = r["prediction_exact_ratio"], r.get("admission_exact_ratio")
        out.append(
            f"{r['label']:20} {100 * r['hit_rate']:8.1f}% {1000 * r['ttft_p50_s']:8.1f}ms "
            f"{1000 * r['ttft_p90_s']:8.1f}ms {1000 * r['ttft_p99_s']:8.1f}ms "
            f"{'-' if pe is None else f'{100 * pe:.1f}%':>10} "
            f"{'-' if ae is None else f'{100 * ae:.1f}%':>10} {r['errors']:6}  "
            + " ".join(str(v) for v in r["requests_per_replica"].values())
        )
    return "\n".join(out)


def plot(doc: dict[str, Any], out_dir: Path) -> Path:
    """``demo_policies.png``: cache hit rate and TTFT p50/p90 per policy (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["policies"]
    names = [r["label"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.4))
    a1.bar(names, [100 * r["hit_rate"] for r in rows], color="tab:green")
    a1.set_ylabel("prompt tokens from cache (%)")
    x = list(range(len(rows)))
    a2.bar([i - 0.2 for i in x], [1000 * r["ttft_p50_s"] for r in rows], 0.4, label="p50")
    a2.bar([i + 0.2 for i in x], [1000 * r["ttft_p90_s"] for r in rows], 0.4, label="p90")
    a2.set_xticks(x)
    a2.set_xticklabels(names)
    a2.set_ylabel("TTFT through the router (ms)")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{doc['replicas']} x {doc['layout']}, {doc['requests']} requests", fontsize=9)
    fig.tight_layout()
    path = out_dir / "demo_policies.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main


def _workload(args: argparse.Namespace) -> tuple[list[Any], str, Any]:
    from gpu_emitter.workload import (
        Scaling,
        default_trace_path,
        load_trace,
        scale_trace,
        synthetic_trace,
    )

    path = None if args.trace == "synthetic" else Path(args.trace or default_trace_path())
    if path is not None and (args.trace or path.is_file()):
        trace = load_trace(path)
        source = str(path)
    else:
        trace = synthetic_trace(max(args.requests, 1) * 3, seed=0)
        source = "synthetic (Mooncake-shaped; trace file not found)"
    # The largest stride (fewest, whole conversations) that still yields --requests requests.
    keys = [r.hash_ids[1] if len(r.hash_ids) > 1 else r.hash_ids[0] for r in trace]
    stride = max(1, len(trace) // max(1, args.requests))
    while stride > 1 and sum(1 for k in keys if k % stride == 0) < args.requests:
        stride = max(1, stride * 4 // 5)
    probe = scale_trace(trace, Scaling(args.block_tokens, 1.0, stride, 0, args.requests))
    if not probe:
        raise DemoError("the workload is empty: check --trace and --requests")
    span = probe[-1].arrival_s or 1.0
    ts = args.time_scale if args.time_scale is not None else args.duration / span
    scaling = Scaling(args.block_tokens, ts, stride, 0, args.requests)
    return scale_trace(trace, scaling), source, scaling


def _check(args: argparse.Namespace) -> list[str]:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise DemoError(f"unknown policy {bad}: choose from {', '.join(POLICIES)}")
    problems = [
        (args.replicas >= 1, "--replicas must be >= 1"),
        (args.requests >= 1, "--requests must be >= 1"),
        (args.duration > 0, "--duration must be > 0"),
        (args.time_scale is None or args.time_scale >= 0, "--time-scale must be >= 0"),
        (args.num_blocks >= 2, "--num-blocks must be >= 2"),
        (args.max_in_flight >= 0, "--max-in-flight must be >= 0"),
    ]
    for ok, msg in problems:
        if not ok:
            raise DemoError(msg)
    return policies


def run_policy(
    args: argparse.Namespace,
    policy: str,
    requests: Sequence[Any],
    out_dir: Path,
    procs: Procs,
    seed: int = 0,
) -> dict[str, Any]:
    """Fresh replicas + router for ``policy``, replay, stop; the policy's summary row."""
    label = LABELS.get(policy, policy)
    run_dir = out_dir / f"run-{label}"
    run_dir.mkdir(parents=True, exist_ok=True)
    procs.logdir = run_dir
    exe = [sys.executable, "-m", "router.cli"]
    max_len = max(r.prompt_len + r.output_len for r in requests) + 16
    argv = replica_argv(args.layout, args.num_blocks, max(4096, max_len), args.replica_time_scale)
    started = [procs.start(f"replica-{i}", argv) for i in range(args.replicas)]
    endpoints = [read_endpoints(p, f"replica-{i}", 120.0) for i, p in enumerate(started)]
    port = free_port()
    cfg = run_dir / "router.toml"
    cfg.write_text(router_toml(port, policy, endpoints, seed))
    router = procs.start("router", [*exe, "serve", "--config", str(cfg)])
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, router, 60.0)
    live = Live(len(requests), [f"sim-{i}" for i in range(args.replicas)])
    t = time.monotonic()
    outs = procs.run_async(_replay(url, requests, live, label, args.max_in_flight))
    wall = time.monotonic() - t
    procs.stop_all()
    row = summarize(policy, outs, wall)
    row["router_config"] = str(cfg)
    return row


def wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float) -> None:
    """Poll the router's ``/health`` until 200; raise :class:`DemoError` if it exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the router exited with code {proc.returncode}: see router.log")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise DemoError(f"the router at {url} did not become healthy in {timeout:.0f}s")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C outside the policy runs (start-up, report writing)
        print("\nkvrouter demo: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    try:
        policies = _check(args)
        requests, source, scaling = _workload(args)
    except (DemoError, ValueError) as exc:
        print(f"kvrouter demo: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out or f"kvrouter-demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    prompt_total = sum(r.prompt_len for r in requests)
    print(
        f"kvrouter demo: {args.replicas} simulated replicas ({args.layout}, {args.num_blocks} "
        f"KV blocks each) behind kvrouter serve; {len(requests)} requests "
        f"({prompt_total} prompt tokens) over {requests[-1].arrival_s:.0f}s per policy\n"
        f"  workload: {source}; {scaling.describe()}\n"
        f"  policies: {', '.join(LABELS.get(p, p) for p in policies)} (fresh replicas each)",
        flush=True,
    )
    procs = Procs(out_dir)

    procs.stop_on_signals()
    rows: list[dict[str, Any]] = []
    try:
        for p in policies:
            print(f"policy {LABELS.get(p, p)}: starting replicas and router", flush=True)
            rows.append(run_policy(args, p, requests, out_dir, procs))
    except KeyboardInterrupt:
        print("\nkvrouter demo: interrupted; stopping every process it started", flush=True)
        procs.stop_all()
        return 130
    except DemoError as exc:
        procs.stop_all()
        print(f"kvrouter demo: {exc} (logs in {out_dir})", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        # The handlers stay installed: a late Ctrl-C while the report is written still ends
        # in run()'s KeyboardInterrupt branch (exit 130) with nothing left to stop.
    doc = {
        "command": "kvrouter demo " + " ".join(sys.argv[2:]),
        "layout": args.layout,
        "replicas": args.replicas,
        "num_blocks": args.num_blocks,
        "workload": source,
        "scaling": scaling.describe(),
        "requests": len(requests),
        "prompt_tokens": prompt_total,
        "policies": rows,
    }
    (out_dir / "demo.json").write_text(json.dumps(doc, indent=1))
    print()
    print(table(rows))
    print(
        "pred exact: the router's events-only prediction (x-kvrouter-predicted-hit) equalled "
        "the replica's cached_tokens; adm exact: its admission-time one "
        "(x-kvrouter-expected-hit: also what the requests routed ahead will store)"
    )
    written = [out_dir / "demo.json"]
    try:
        written.append(plot(doc, out_dir))
    except ImportError as exc:
        print(f"(no plot: {exc}; install the dev extra for matplotlib)")
    print(f"\nresults: {out_dir}  ({', '.join(p.name for p in written)})")
    return 0
