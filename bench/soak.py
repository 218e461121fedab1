"""A bounded soak of kvrouter: real processes, evictions, one replica killed and restarted.

Started on 127.0.0.1 with the demo's machinery (:mod:`gpu_emitter.demo`: each process in its
own process group, stopped with SIGTERM then SIGKILL on the way out, Ctrl-C included):
``--replicas`` simulated vLLM replicas (``kvrouter replica``, fixed ports, a small KV pool
so blocks are evicted all the time) and ``kvrouter serve`` in front of them (fast health
probes, admin on loopback). An async httpx client then sends ``--requests`` requests with
``--concurrency`` workers: chat and text completions, JSON and SSE, in multi-turn
conversations over a few shared system prompts (each turn repeats the conversation so far,
with the replies the replicas gave, so the prefix cache matters).

Once ``--kill-at`` of the requests are done, one replica's process group gets SIGKILL; it is
started again ``--restart-after`` seconds later with the same command line (same ports, an
empty cache, as a restarted vLLM). The last ``--hold-tail`` of the requests are sent only once
the restarted replica is back in the router's rotation, so even a short run shows it serving
again (in a long run it is back long before).

Every request ends in exactly one outcome:

* ``ok``: 200 with a well-formed answer (SSE: JSON chunks ending with ``data: [DONE]``);
* ``error_response``: a non-200 answer whose body is an OpenAI error (``{"error": {...}}``);
* ``stream_error``: an SSE stream that ends with a well-formed error event and ``[DONE]``
  (the router's answer when a replica dies after the first byte was sent);
* ``lost``: anything else: no answer within ``--request-timeout``, a connection reset or a
  truncated body, a malformed answer, or not finished by the overall ``--deadline``.

The router's RSS (``VmRSS`` of its process) and the completions are sampled every second.
Reported: counts per outcome, lost requests with their kind, failovers (the router's
``kvrouter_failovers_total``), the attempts on the killed replica while it was down before
and after the router took it out of rotation, how long that took and how long until it was
back, RSS at the end of the warm-up (``--warmup`` of the requests done), at the end and its
maximum after warm-up, latency p50/p99, the share of prompt tokens served from cache, evicted
blocks (the router's index counters) and the router's prediction exactness
(``kvrouter_prediction_exact_total / kvrouter_prediction_checked_total``). JSON goes to
``--json`` (default ``bench/results/soak.json``), a PNG of RSS and throughput over time to
``--plot``. Exit 0 when nothing was lost, the kill was handled (the replica left rotation and
came back) and RSS grew at most ``--max-rss-growth`` after warm-up; 1 otherwise; 2 for a bad
option or a process that did not start; 130 on Ctrl-C.

Router RSS and the hash memo: the router memoizes block-hash chain steps (256 tokens each,
``events.hashing``, at most 8192 steps, about 27 MB here). Every request whose prompt
completes a new step adds one; this workload adds one step per ~5 requests, so the router's
RSS rises by ~27 MB over the first ~45,000 requests and is flat after (measured: 98.6 MB at
44,500 requests, 98.9 MB at 80,000; with the memo disabled it stays within 1.5 % from
2,000 to 20,000 requests). The default run (10,000 requests, warm-up 10 %) sees part of that
fill (~+10 %); a flatness check past it needs a longer run with a later warm-up end.

Prediction exactness: a prediction is made when the request is routed; the replica reports
what it had cached when it admitted the request. With small KV pools a request may wait for
blocks while its prefix is evicted (over-prediction), and concurrent requests with a new
prefix find each other's blocks before the router has their events (under-prediction).
``predictions_seen_by_client`` splits the two; with ``--num-blocks 1024`` both nearly vanish.

    .venv/bin/python bench/soak.py                      # 10,000 requests, concurrency 16
    .venv/bin/python bench/soak.py --requests 600 --concurrency 8   # the CI variant's size
    .venv/bin/python bench/soak.py --requests 80000 --warmup 0.6    # RSS past the memo fill
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpu_emitter.demo import (  # noqa: E402
    MODEL,
    DemoError,
    Procs,
    free_port,
    percentile,
    read_endpoints,
    replica_argv,
    router_toml,
    wait_healthy,
)

RESULTS = ROOT / "bench" / "results"
NUM_WORDS = 2041  # the builtin tokenizer's wN words (gpu_emitter.tokenizer.NUM_WORDS)

#: The router's health settings for the soak: a dead replica is out of rotation within
#: 2 x (0.5 + 0.5) s by the probes, or after 3 failed attempts by passive ejection.
HEALTH_TOML = """
[health]
probe_interval_s = 0.5
probe_timeout_s = 0.5
unhealthy_threshold = 2
healthy_threshold = 1
eject_after_failures = 3
eject_base_s = 2.0
eject_max_s = 30.0
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    a = parser.add_argument
    a("--requests", type=int, default=10_000, help="requests to send in all")
    a("--concurrency", type=int, default=16, help="requests in flight at once (workers)")
    a("--replicas", type=int, default=3, help="simulated replicas")
    a("--layout", default="fa_swa", help="the replicas' KV layout (shipped name or file)")
    a("--num-blocks", type=int, default=320, help="KV blocks per replica: small, to evict")
    a("--replica-time-scale", type=float, default=0.1, help="the replicas' --time-scale")
    a("--systems", type=int, default=8, help="shared system prompts")
    a("--max-turns", type=int, default=6, help="turns per conversation, at most")
    a("--stream-share", type=float, default=0.5, help="share of requests sent as SSE")
    a("--kill-at", type=float, default=1 / 3, help="kill once this share of requests is done")
    a("--restart-after", type=float, default=3.0, help="seconds the killed replica stays down")
    a("--victim", type=int, default=1, help="index of the replica to kill (-1: none)")
    a("--hold-tail", type=float, default=0.2, help="share of requests held until it is back")
    a("--warmup", type=float, default=0.1, help="share of requests done that ends warm-up")
    a("--max-rss-growth", type=float, default=0.2, help="allowed RSS growth after warm-up")
    a("--request-timeout", type=float, default=30.0, help="a request's deadline (s)")
    a("--deadline", type=float, default=900.0, help="the whole run's deadline (s)")
    a("--progress", type=float, default=5.0, help="seconds between progress lines")
    a("--seed", type=int, default=0, help="workload and policy seed")
    a("--router-log-level", default="warning", choices=["debug", "info", "warning", "error"])
    a("--json", type=Path, default=RESULTS / "soak.json", help="where the results go")
    a("--plot", default=str(RESULTS / "soak.png"), help="PNG of RSS and throughput ('': none)")
    a("--logs", type=Path, default=None, help="process logs (default: a new temp folder)")


def check_args(args: argparse.Namespace) -> None:
    """Refuse options that cannot make a run (DemoError names the option)."""
    for ok, msg in (
        (args.requests >= 1, "--requests must be >= 1"),
        (args.concurrency >= 1, "--concurrency must be >= 1"),
        (args.replicas >= 2, "--replicas must be >= 2 (one is killed, the others serve)"),
        (-1 <= args.victim < args.replicas, "--victim must be -1 or a replica index"),
        (0 <= args.kill_at < 1, "--kill-at must be in [0, 1)"),
        (0 <= args.hold_tail < 1 - args.kill_at, "--hold-tail must be in [0, 1 - kill-at)"),
        (0 < args.warmup < 1, "--warmup must be in (0, 1)"),
        (0 <= args.stream_share <= 1, "--stream-share must be in [0, 1]"),
        (args.systems >= 1 and args.max_turns >= 1, "--systems and --max-turns must be >= 1"),
        (args.restart_after >= 0, "--restart-after must be >= 0"),
        (args.request_timeout > 0 and args.deadline > 0, "timeouts must be > 0"),
    ):
        if not ok:
            raise DemoError(msg)


# ----------------------------------------------------------------------------- workload


def words(rng: random.Random, n: int) -> str:
    """``n`` in-vocabulary words of the builtin tokenizer (one token each)."""
    return " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(n))


@dataclass
class Conversation:
    """One multi-turn conversation: every turn sends the whole history again."""

    system: str
    chat: bool
    turns_left: int
    history: list[tuple[str, str]] = field(default_factory=list)

    def body(self, user: str, stream: bool, usage: bool, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
        if stream and usage:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            msgs = [{"role": "system", "content": self.system}]
            msgs += [{"role": r, "content": t} for r, t in self.history]
            body["messages"] = [*msgs, {"role": "user", "content": user}]
        else:
            body["prompt"] = " ".join([self.system, *(t for _, t in self.history), user])
        return body


class Workload:
    """Shared system prompts (a few popular ones) and conversations over them."""

    def __init__(self, rng: random.Random, systems: int, max_turns: int) -> None:
        self.systems = [words(rng, rng.randint(120, 360)) for _ in range(systems)]
        self.weights = [1.0 / (i + 1) for i in range(systems)]  # Zipf-like popularity
        self.max_turns = max_turns

    def conversation(self, rng: random.Random) -> Conversation:
        system = rng.choices(self.systems, self.weights)[0]
        return Conversation(system, rng.random() < 0.5, rng.randint(1, self.max_turns))

    def max_model_len(self) -> int:
        """Tokens a conversation may reach (prompt + answer), with room for the template."""
        longest = max(len(s.split()) for s in self.systems)
        return longest + self.max_turns * (60 + 16) + 4 * self.max_turns + 64


# ----------------------------------------------------------------------------- one request


@dataclass
class Result:
    """One request's outcome (module docstring)."""

    index: int
    chat: bool
    stream: bool
    started: float
    ended: float = 0.0
    outcome: str = "lost"
    detail: str = "not finished"
    status: int = 0
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """From the answer's usage (JSON answers, and SSE answers that asked for it)."""
    has_usage: bool = False
    predicted: int | None = None
    """The router's predicted hit for the replica it chose (``x-kvrouter-predicted-hit``)."""


def _error_body(raw: bytes) -> str | None:
    """The OpenAI error's type and message, or None if ``raw`` is not one."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    return f"{err.get('type')}: {err['message'][:120]}"


def _usage(res: Result, usage: Any) -> None:
    if isinstance(usage, dict):
        res.has_usage = True
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens") or 0)


def parse_json(raw: bytes, res: Result) -> str | None:
    """A 200 JSON answer: the reply text, or None (and ``res`` says lost: malformed)."""
    try:
        doc = json.loads(raw)
        choice = doc["choices"][0]
        text = choice["message"]["content"] if res.chat else choice["text"]
        if not isinstance(text, str):
            raise TypeError("text is not a string")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        res.outcome, res.detail = "lost", f"malformed JSON answer: {exc!r} {raw[:80]!r}"
        return None
    _usage(res, doc.get("usage"))
    res.outcome, res.detail = "ok", ""
    return text


def parse_sse(lines: list[str], res: Result) -> str | None:
    """A 200 SSE answer's lines: the reply text, or None (``res`` says why)."""
    parts: list[str] = []
    done = False
    error: str | None = None
    for line in lines:
        if not line or line.startswith(":"):
            continue
        if done or not line.startswith("data: "):
            res.outcome, res.detail = "lost", f"malformed SSE line {line[:80]!r}"
            return None
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(data)
            if "error" in chunk:
                error = _error_body(data.encode()) or "error event without a message"
                continue
            for c in chunk.get("choices") or ():
                text = (c.get("delta") or {}).get("content") if res.chat else c.get("text")
                parts.append(text or "")
            _usage(res, chunk.get("usage"))
        except (ValueError, AttributeError, TypeError) as exc:
            res.outcome, res.detail = "lost", f"malformed SSE chunk: {exc!r} {data[:80]!r}"
            return None
    if not done:
        res.outcome, res.detail = "lost", "truncated stream: no data: [DONE]"
        return None
    if error is not None:
        res.outcome, res.detail = "stream_error", error
        return None
    res.outcome, res.detail = "ok", ""
    return "".join(parts)


async def send(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    res: Result,
    timeout: float,
    streaming: Callable[[Result, bool], None] | None = None,
) -> str | None:
    """Send one request and classify its answer; the reply text when it is ``ok``.
    ``streaming(res, True)`` is called once a 200 SSE answer has begun, ``(res, False)``
    when it is over."""
    path = "/v1/chat/completions" if res.chat else "/v1/completions"
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + path, json=body) as resp:
                res.status = resp.status_code
                res.replica = resp.headers.get("x-kvrouter-replica", "")
                pred = resp.headers.get("x-kvrouter-predicted-hit", "")
                res.predicted = int(pred) if pred.isdigit() else None
                if resp.status_code != 200:
                    err = _error_body(await resp.aread())
                    if err is None:
                        res.outcome, res.detail = "lost", f"HTTP {res.status}, not an OpenAI error"
                    else:
                        res.outcome, res.detail = "error_response", f"HTTP {res.status} {err}"
                    return None
                if not res.stream:
                    return parse_json(await resp.aread(), res)
                if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                    res.outcome, res.detail = "lost", "a streaming 200 that is not SSE"
                    return None
                if streaming is not None:
                    streaming(res, True)
                try:
                    return parse_sse([line async for line in resp.aiter_lines()], res)
                finally:
                    if streaming is not None:
                        streaming(res, False)
    except (TimeoutError, httpx.TimeoutException):
        res.outcome, res.detail = "lost", f"no complete answer within {timeout:g} s"
    except httpx.HTTPError as exc:  # reset, refused, truncated body
        res.outcome, res.detail = "lost", f"{type(exc).__name__}: {exc}"
    finally:
        res.ended = time.monotonic()
    return None


# ----------------------------------------------------------------------------- the router


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition as (name, labels, value) samples (prometheus_client's
    parser: the router's page is written by prometheus_client, so it always parses)."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels match ``labels`` (a replica label matches
    ``sim-1`` and ``sim-1/dp0`` alike)."""

    def match(have: dict[str, str]) -> bool:
        for k, v in labels.items():
            got = have.get(k, "")
            if got != v and not (k == "replica" and got.startswith(v + "/")):
                return False
        return True

    return sum(v for n, lab, v in samples if n == name and match(lab))


class Control:
    """The soak's view of the router: ``/metrics``, ``/admin/replicas``, its RSS."""

    def __init__(self, url: str, pid: int) -> None:
        self.url = url
        self.pid = pid
        self.client = httpx.AsyncClient(timeout=5.0)

    async def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        r = await self.client.get(self.url + "/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)

    async def replica(self, name: str) -> dict[str, Any]:
        r = await self.client.get(self.url + "/admin/replicas")
        r.raise_for_status()
        for d in r.json()["replicas"]:
            if d["name"] == name:
                return d
        raise DemoError(f"the router does not list replica {name!r}")

    async def routable(self, name: str) -> bool:
        return bool((await self.replica(name))["health"]["routable"])

    def rss_mb(self) -> float:
        """The router process's resident set (``VmRSS``) in MiB."""
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        raise DemoError(f"the router (pid {self.pid}) is gone: no VmRSS")

    async def aclose(self) -> None:
        await self.client.aclose()


# ----------------------------------------------------------------------------- the run


@dataclass
class Chaos:
    """The kill and the restart, as they went (seconds since the start of the load)."""

    victim: str = ""
    killed_at: float | None = None
    in_flight_at_kill: int = 0
    """Requests the router had on the victim just before the kill (``/admin/replicas``)."""
    sse_streaming_from_victim_at_kill: int = 0
    """SSE answers from the victim the client was reading when the kill was sent."""
    out_of_rotation_at: float | None = None
    restarted_at: float | None = None
    back_in_rotation_at: float | None = None
    failovers_to_victim: dict[str, float] = field(default_factory=dict)
    """Attempts on the victim that failed: before the kill, when it left rotation, at the
    restart (all cumulative)."""
    served_by_victim_while_down: int = 0
    served_by_victim_after_restart: int = 0
    error: str | None = None


class Soak:
    """The load, the sampler, the kill and the restart, in one event loop."""

    def __init__(
        self,
        args: argparse.Namespace,
        url: str,
        control: Control,
        procs: Procs,
        victim: tuple[str, subprocess.Popen[str], list[str]] | None,
    ) -> None:
        self.args = args
        self.url = url
        self.control = control
        self.procs = procs
        self.victim = victim
        self.workload = Workload(random.Random(args.seed), args.systems, args.max_turns)
        self.results: list[Result] = []
        self.next_index = 0
        self.done = 0
        self.in_flight = 0
        self.t0 = time.monotonic()
        self.samples: list[dict[str, float]] = []
        self.chaos = Chaos(victim=victim[0] if victim else "")
        self.kill_armed = asyncio.Event()
        self.kill_now = asyncio.Event()
        self.streaming_from: Counter[str] = Counter()
        self.back = asyncio.Event()
        self.hold_from = args.requests - int(args.hold_tail * args.requests)
        self.warmup_done_at: float | None = None
        self.finished = asyncio.Event()
        if victim is None:
            self.back.set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- load ------------------------------------------------------------------------------

    async def worker(self, wid: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(f"{self.args.seed}-{wid}")
        conv: Conversation | None = None
        while self.next_index < self.args.requests:
            index = self.next_index
            self.next_index += 1
            if index >= self.hold_from and not self.back.is_set():
                await self.back.wait()
            if conv is None or conv.turns_left <= 0:
                conv = self.workload.conversation(rng)
            user = words(rng, rng.randint(10, 60))
            stream = rng.random() < self.args.stream_share
            body = conv.body(user, stream, rng.random() < 0.5, rng.randint(4, 16))
            res = Result(index, conv.chat, stream, time.monotonic())
            self.results.append(res)
            self.in_flight += 1
            try:
                reply = await send(
                    client, self.url, body, res, self.args.request_timeout, self.streaming
                )
            finally:
                self.in_flight -= 1
                self.done += 1
            conv.turns_left -= 1
            if reply is None:
                conv = None  # an error ends the conversation
            else:
                conv.history += [("user", user), ("assistant", reply)]
            self._count(res)

    def streaming(self, res: Result, begun: bool) -> None:
        """Track the SSE answers being read, per replica; once the kill is armed, the first
        one from the victim pulls the trigger (so the kill lands mid-stream)."""
        name = res.replica.split("/")[0]
        self.streaming_from[name] += 1 if begun else -1
        if begun and self.kill_armed.is_set() and self.victim and name == self.victim[0]:
            self.kill_now.set()

    def _count(self, res: Result) -> None:
        n = self.args.requests
        if self.warmup_done_at is None and self.done >= self.args.warmup * n:
            self.warmup_done_at = self.now()
        if self.done >= self.args.kill_at * n:
            self.kill_armed.set()
        c = self.chaos
        if c.victim and res.outcome == "ok" and res.replica.split("/")[0] == c.victim:
            start = res.started - self.t0
            if c.killed_at is not None and start >= c.killed_at:
                if c.restarted_at is None or start < c.restarted_at:
                    c.served_by_victim_while_down += 1
                else:
                    c.served_by_victim_after_restart += 1

    # -- sampler ---------------------------------------------------------------------------

    def sample(self, rss_mb: float) -> None:
        """One point of the time series: RSS, requests done, completions/s since the last."""
        t = self.now()
        prev = self.samples[-1] if self.samples else {"t": 0.0, "done": 0}
        rps = (self.done - prev["done"]) / max(1e-9, t - prev["t"])
        self.samples.append({"t": t, "rss_mb": rss_mb, "done": self.done, "rps": rps})

    async def sampler(self) -> None:
        last_line = 0.0
        while not self.finished.is_set():
            t = self.now()
            try:
                rss = self.control.rss_mb()
            except DemoError as exc:
                print(f"  {t:6.1f}s  {exc}", flush=True)
                return
            self.sample(rss)
            if t - last_line >= self.args.progress:
                last_line = t
                print(self.progress_line(t, rss), flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.finished.wait(), 1.0)

    def progress_line(self, t: float, rss: float) -> str:
        outcomes = Counter(r.outcome for r in self.results if r.ended)
        recent = [s for s in self.samples if s["t"] >= t - self.args.progress]
        rps = sum(s["rps"] for s in recent) / max(1, len(recent))
        c = self.chaos
        phase = ""
        if c.killed_at is not None:
            phase = f"  {c.victim}: " + (
                "back" if c.back_in_rotation_at is not None
                else "restarted" if c.restarted_at is not None
                else "out of rotation" if c.out_of_rotation_at is not None
                else "killed"
            )  # fmt: skip
        return (
            f"  {t:6.1f}s  done {self.done:6}/{self.args.requests}  {rps:6.1f} req/s  "
            f"in flight {self.in_flight:3}  ok {outcomes['ok']}  "
            f"errors {outcomes['error_response'] + outcomes['stream_error']}  "
            f"lost {outcomes['lost']}  router RSS {rss:6.1f} MB{phase}"
        )

    # -- chaos -----------------------------------------------------------------------------

    async def failovers(self, name: str) -> float:
        return metric_sum(await self.control.metrics(), "kvrouter_failovers_total", replica=name)

    async def chaos_task(self) -> None:
        if self.victim is None:
            return
        name, proc, argv = self.victim
        c = self.chaos
        await self.kill_armed.wait()
        try:
            c.failovers_to_victim["before_kill"] = await self.failovers(name)
            c.in_flight_at_kill = int((await self.control.replica(name))["in_flight"])
            # Kill while an SSE answer from the victim is being read (the mid-stream path),
            # or after 2 s whatever is in flight.
            give_up = time.monotonic() + 2.0
            while self.streaming_from[name] == 0 and time.monotonic() < give_up:
                self.kill_now.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.kill_now.wait(), give_up - time.monotonic())
            os.killpg(proc.pid, signal.SIGKILL)
            c.killed_at = self.now()
            c.sse_streaming_from_victim_at_kill = self.streaming_from[name]
            print(f"  {c.killed_at:6.1f}s  kill -9 {name} (pid {proc.pid})", flush=True)
            await asyncio.to_thread(proc.wait, 10)
            up_at = c.killed_at + self.args.restart_after
            while self.now() < up_at:
                if c.out_of_rotation_at is None and not await self.control.routable(name):
                    c.out_of_rotation_at = self.now()
                    c.failovers_to_victim["out_of_rotation"] = await self.failovers(name)
                await asyncio.sleep(min(0.05, max(0.0, up_at - self.now())))
            c.failovers_to_victim["restart"] = await self.failovers(name)
            new = self.procs.start(f"{name}-restarted", argv)
            c.restarted_at = self.now()
            print(f"  {c.restarted_at:6.1f}s  restart {name} (pid {new.pid})", flush=True)
            await asyncio.to_thread(read_endpoints, new, f"{name}-restarted", 120.0)
            deadline = time.monotonic() + 60.0
            while not await self.control.routable(name):
                if time.monotonic() > deadline:
                    raise DemoError(f"{name} was not back in rotation 60 s after its restart")
                await asyncio.sleep(0.05)
            c.back_in_rotation_at = self.now()
            print(f"  {c.back_in_rotation_at:6.1f}s  {name} back in rotation", flush=True)
        except (DemoError, httpx.HTTPError, OSError, subprocess.TimeoutExpired) as exc:
            c.error = f"{type(exc).__name__}: {exc}"
            print(f"  kill/restart failed: {c.error}", flush=True)
        finally:
            self.back.set()  # never hold the tail forever

    # -- all of it -------------------------------------------------------------------------

    async def run(self) -> None:
        limits = httpx.Limits(
            max_connections=2 * self.args.concurrency,
            max_keepalive_connections=self.args.concurrency,
            # below the router's (uvicorn's) 5 s: an idle connection is dropped here first,
            # never reused at the instant the server closes it (a reset no router can avoid)
            keepalive_expiry=2.0,
        )
        timeout = httpx.Timeout(self.args.request_timeout)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            self.t0 = time.monotonic()
            side = [asyncio.create_task(self.sampler()), asyncio.create_task(self.chaos_task())]
            workers = [
                asyncio.create_task(self.worker(i, client)) for i in range(self.args.concurrency)
            ]
            try:
                left = self.args.deadline - self.now()
                _, pending = await asyncio.wait(workers, timeout=max(0.0, left))
                for t in pending:
                    t.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                if not self.back.is_set() or not side[1].done():
                    # the tail never ran or the load ended first: let the restart finish
                    await asyncio.wait([side[1]], timeout=max(5.0, self.args.deadline - self.now()))
            finally:
                side[1].cancel()
                self.finished.set()
                await asyncio.gather(*side, return_exceptions=True)
            for t in workers:  # a worker that raised is a bug in the soak itself: say so
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]

    async def final_metrics(self) -> dict[str, float]:
        m = await self.control.metrics()
        exact = metric_sum(m, "kvrouter_prediction_exact_total")
        checked = metric_sum(m, "kvrouter_prediction_checked_total")
        return {
            "failovers": metric_sum(m, "kvrouter_failovers_total"),
            "prediction_exact": exact,
            "prediction_checked": checked,
            "prediction_exact_ratio": exact / checked if checked else float("nan"),
            "removed_blocks": metric_sum(
                m, "kvrouter_index_block_ops_total", outcome="removed_blocks"
            ),
            "stored_blocks": metric_sum(
                m, "kvrouter_index_block_ops_total", outcome="stored_blocks"
            ),
            "ejections": metric_sum(m, "kvrouter_replica_ejections_total"),
        }


# ----------------------------------------------------------------------------- report


def summarize(soak: Soak, metrics: dict[str, float], wall_s: float) -> dict[str, Any]:
    """The JSON document (and what decides the exit code)."""
    args = soak.args
    res = soak.results
    not_sent = args.requests - len(res)
    outcomes = Counter(r.outcome for r in res)
    outcomes["lost"] += not_sent
    lost = [r for r in res if r.outcome == "lost"]
    ok = [r for r in res if r.outcome == "ok"]
    lat = [r.ended - r.started for r in ok]
    samples = soak.samples
    warm_t = soak.warmup_done_at
    after = [s for s in samples if warm_t is not None and s["t"] >= warm_t]
    rss_warm = after[0]["rss_mb"] if after else None
    rss_end = samples[-1]["rss_mb"] if samples else None
    rss_max = max((s["rss_mb"] for s in after), default=None)
    growth = (rss_end - rss_warm) / rss_warm if rss_warm and rss_end else None
    prompt = sum(r.prompt_tokens for r in ok)
    c = soak.chaos
    fo = c.failovers_to_victim
    kill_handled = soak.victim is None or (
        c.error is None and c.out_of_rotation_at is not None and c.back_in_rotation_at is not None
    )
    doc = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "requests": args.requests,
        "sent": len(res),
        "outcomes": dict(outcomes),
        "lost": outcomes["lost"],
        "lost_samples": [asdict(r) for r in lost[:10]],
        "error_samples": sorted({r.detail for r in res if r.outcome != "ok"})[:10],
        "by_replica": dict(sorted(Counter(r.replica for r in ok).items())),
        "json_requests": sum(1 for r in res if not r.stream),
        "sse_requests": sum(1 for r in res if r.stream),
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "prompt_tokens": prompt,
        "cached_share": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "predictions_seen_by_client": _predictions(ok),
        "misprediction_samples": [
            {
                "t": round(r.started - soak.t0, 3),
                "replica": r.replica,
                "predicted": r.predicted,
                "cached_tokens": r.cached_tokens,
                "prompt_tokens": r.prompt_tokens,
            }
            for r in ok
            if r.has_usage and r.predicted is not None and r.predicted != r.cached_tokens
        ][:200],
        "router": metrics,
        "kill": {
            **asdict(c),
            "out_of_rotation_after_s": _diff(c.out_of_rotation_at, c.killed_at),
            "back_after_restart_s": _diff(c.back_in_rotation_at, c.restarted_at),
            "failed_attempts_on_victim_before_out_of_rotation": _diff(
                fo.get("out_of_rotation"), fo.get("before_kill")
            ),
            "failed_attempts_on_victim_while_out_of_rotation": _diff(
                fo.get("restart"), fo.get("out_of_rotation")
            ),
            "handled": kill_handled,
        },
        "rss_mb": {
            "warmup_end": rss_warm,
            "end": rss_end,
            "max_after_warmup": rss_max,
            "max": max((s["rss_mb"] for s in samples), default=None),
            "growth_after_warmup": growth,
            "warmup_ends_at_s": warm_t,
        },
        "throughput_rps": len(res) / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
        "samples": samples,
    }
    problems = []
    if doc["lost"]:
        problems.append(f"{doc['lost']} request(s) lost")
    if not kill_handled:
        problems.append(f"the kill/restart was not handled ({c.error or 'see kill'})")
    if growth is None or growth > args.max_rss_growth:
        problems.append(f"router RSS grew {growth} after warm-up (max {args.max_rss_growth})")
    doc["problems"] = problems
    return doc


def _predictions(ok: list[Result]) -> dict[str, int]:
    """The router's predicted hit against the replica's ``cached_tokens``, per answer that
    reported usage: ``under`` (the replica had more: stores still in flight when routing,
    e.g. a concurrent request with the same new prefix), ``over`` (it had less: blocks
    evicted between routing and scheduling, or a restarted replica not yet distrusted)."""
    seen = [r for r in ok if r.has_usage and r.predicted is not None]
    return {
        "checked": len(seen),
        "exact": sum(1 for r in seen if r.predicted == r.cached_tokens),
        "under": sum(1 for r in seen if (r.predicted or 0) < r.cached_tokens),
        "over": sum(1 for r in seen if (r.predicted or 0) > r.cached_tokens),
    }


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def report(doc: dict[str, Any]) -> str:
    k, rss, m = doc["kill"], doc["rss_mb"], doc["router"]
    growth = rss["growth_after_warmup"]

    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    return "\n".join(
        [
            f"requests {doc['requests']} ({doc['json_requests']} JSON, {doc['sse_requests']} "
            f"SSE) in {doc['wall_s']:.1f} s ({doc['throughput_rps']:.1f} req/s)",
            "outcomes " + ", ".join(f"{k2} {v}" for k2, v in sorted(doc["outcomes"].items())),
            f"lost {doc['lost']}",
            f"served per replica {doc['by_replica']}",
            f"latency p50 {1000 * doc['latency_p50_s']:.1f} ms, p99 "
            f"{1000 * doc['latency_p99_s']:.1f} ms; prompt tokens from cache "
            f"{100 * doc['cached_share']:.1f} %",
            f"router: failovers {m['failovers']:.0f}, ejections {m['ejections']:.0f}, "
            f"prediction exact {m['prediction_exact']:.0f}/{m['prediction_checked']:.0f} "
            f"({100 * m['prediction_exact_ratio']:.2f} %), evicted blocks seen "
            f"{m['removed_blocks']:.0f} (stored {m['stored_blocks']:.0f})",
            "client-side predicted vs cached_tokens: "
            + ", ".join(f"{k2} {v}" for k2, v in doc["predictions_seen_by_client"].items()),
            f"kill: {k['victim']} killed at {f(k['killed_at'], '.1f')} s with "
            f"{k['in_flight_at_kill']} in flight ({k['sse_streaming_from_victim_at_kill']} SSE "
            f"mid-stream); out of rotation after "
            f"{f(k['out_of_rotation_after_s'], '.3f')} s; failed attempts on it "
            f"{f(k['failed_attempts_on_victim_before_out_of_rotation'], '.0f')} before and "
            f"{f(k['failed_attempts_on_victim_while_out_of_rotation'], '.0f')} while out of "
            f"rotation; restarted at {f(k['restarted_at'], '.1f')} s, back in rotation "
            f"{f(k['back_after_restart_s'], '.2f')} s later; served by it after the restart "
            f"{k['served_by_victim_after_restart']}; handled {k['handled']}",
            f"router RSS: warm-up end {f(rss['warmup_end'], '.1f')} MB, end "
            f"{f(rss['end'], '.1f')} MB, max after warm-up {f(rss['max_after_warmup'], '.1f')}"
            f" MB (growth {f(None if growth is None else 100 * growth, '+.1f')} %)",
        ]
        + ([f"PROBLEMS: {'; '.join(doc['problems'])}"] if doc["problems"] else ["PASS"])
    )


def plot(doc: dict[str, Any], path: Path) -> Path:
    """RSS and throughput over time, with the kill, the restart and warm-up marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["samples"]
    t = [x["t"] for x in s]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True)
    a1.plot(t, [x["rss_mb"] for x in s], color="tab:blue")
    a1.set_ylabel("router RSS (MB)")
    a1.set_ylim(bottom=0)
    a2.plot(t, [x["rps"] for x in s], color="tab:green")
    a2.set_ylabel("completed req/s")
    a2.set_xlabel("seconds")
    k = doc["kill"]
    marks = [
        (doc["rss_mb"]["warmup_ends_at_s"], "warm-up end", "tab:gray"),
        (k["killed_at"], "kill -9", "tab:red"),
        (k["restarted_at"], "restart", "tab:orange"),
        (k["back_in_rotation_at"], "back", "tab:purple"),
    ]
    for ax in (a1, a2):
        for x, label, color in marks:
            if x is not None:
                ax.axvline(x, color=color, ls="--", lw=1, label=label if ax is a1 else None)
    a1.legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"kvrouter soak: {doc['requests']} requests, concurrency {doc['options']['concurrency']}"
        f", lost {doc['lost']}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main


#: Tries at starting a process on ports just found free (another process on the machine may
#: take one in between: the process then exits at once and is started on new ports).
PORT_TRIES = 3


def _start_replica(
    args: argparse.Namespace, procs: Procs, name: str, max_len: int
) -> tuple[subprocess.Popen[str], list[str], dict[str, str]]:
    """One replica on fixed free ports: (process, its command line, its endpoints)."""
    for attempt in range(PORT_TRIES):
        argv = replica_argv(
            args.layout,
            args.num_blocks,
            max_len,
            args.replica_time_scale,
            port=free_port(),
            events=f"tcp://127.0.0.1:{free_port()}",
            replay=f"tcp://127.0.0.1:{free_port()}",
        )
        proc = procs.start(name, argv)
        try:
            return proc, argv, read_endpoints(proc, name, 120.0)
        except DemoError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
            if proc.returncode != 2 or attempt == PORT_TRIES - 1:  # 2: cannot bind
                raise
    raise DemoError(f"{name}: no free ports in {PORT_TRIES} tries")


def start(args: argparse.Namespace, procs: Procs, logdir: Path) -> tuple[Any, ...]:
    """Replicas on fixed free ports, then the router; returns what the run needs."""
    workload = Workload(random.Random(args.seed), args.systems, args.max_turns)
    max_len = max(2048, workload.max_model_len())
    started = [_start_replica(args, procs, f"sim-{i}", max_len) for i in range(args.replicas)]
    endpoints = [ep for _, _, ep in started]
    exe = [sys.executable, "-m", "router.cli"]
    for attempt in range(PORT_TRIES):
        port = free_port()
        cfg = logdir / "router.toml"
        cfg.write_text(
            router_toml(
                port, "kv", endpoints, args.seed, admin=True, log_level=args.router_log_level,
                extra=HEALTH_TOML, generator="bench/soak.py",
            )
        )  # fmt: skip
        router = procs.start("router", [*exe, "serve", "--config", str(cfg)])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, router, 60.0)
            break
        except DemoError:
            if router.poll() is None or attempt == PORT_TRIES - 1:
                raise  # not a lost port race: say so
    victim = None
    if args.victim >= 0:
        proc, argv, _ = started[args.victim]
        victim = (f"sim-{args.victim}", proc, argv)
    return url, router, victim


async def wait_ready(url: str, timeout: float) -> None:
    """Poll ``/ready`` (every replica's event stream connected) before the load starts."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as c:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await c.get(url + "/ready")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise DemoError(f"the router at {url} was not ready within {timeout:.0f} s")
            await asyncio.sleep(0.1)


async def drive(args: argparse.Namespace, url: str, router_pid: int, procs: Procs, victim: Any):
    await wait_ready(url, 60.0)
    control = Control(url, router_pid)
    try:
        soak = Soak(args, url, control, procs, victim)
        t = time.monotonic()
        await soak.run()
        wall = time.monotonic() - t
        soak.sample(control.rss_mb())  # the end of the run
        return summarize(soak, await soak.final_metrics(), wall)
    finally:
        await control.aclose()


def _deadline_passed(procs: Procs) -> None:
    procs.signal_all(signal.SIGKILL)
    print("bench/soak.py: hard deadline passed; every process killed", file=sys.stderr)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/soak.py")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except DemoError as exc:
        print(f"bench/soak.py: {exc}", file=sys.stderr)
        return 2
    logdir = (args.logs or Path(tempfile.mkdtemp(prefix="kvrouter-soak-"))).resolve()
    logdir.mkdir(parents=True, exist_ok=True)
    procs = Procs(logdir)
    # The hard bound: whatever hangs, every process is killed and this one ends.
    watchdog = threading.Timer(args.deadline + 180.0, _deadline_passed, args=(procs,))
    watchdog.daemon = True
    watchdog.start()

    procs.stop_on_signals()
    print(
        f"bench/soak.py: {args.replicas} replicas ({args.layout}, {args.num_blocks} KV blocks) "
        f"behind kvrouter serve; {args.requests} requests at concurrency {args.concurrency}; "
        f"logs in {logdir}",
        flush=True,
    )
    wall0 = time.monotonic()
    try:
        url, router, victim = start(args, procs, logdir)
        doc = procs.run_async(drive(args, url, router.pid, procs, victim))
    except KeyboardInterrupt:
        print("\nbench/soak.py: interrupted; stopping every process it started", flush=True)
        return 130
    except (DemoError, httpx.HTTPError, OSError) as exc:
        print(f"bench/soak.py: {type(exc).__name__}: {exc} (logs in {logdir})", file=sys.stderr)
        return 2
    finally:
        procs.stop_all()
        watchdog.cancel()
    doc["wall_total_s"] = time.monotonic() - wall0
    doc["logs"] = str(logdir)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(report(doc))
    written = [str(args.json)]
    if args.plot:
        try:
            written.append(str(plot(doc, Path(args.plot))))
        except ImportError as exc:
            print(f"(no plot: {exc})")
    print("results: " + ", ".join(written), flush=True)
    return 1 if doc["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
