"""Decode and dispatch throughput of the KV-event SDK, in blocks/s and events/s.

Workloads (vLLM 0.32 map encoding, uint64 hashes, realistic engine-step batches):

* ``stored64``: ``BlockStored`` of 64 blocks x 16 tokens (1024 token ids, 64 hashes, parent
  hash, group 0, ``full_attention``), 4 events per batch: a step admitting a few long
  prefills. Target >= 1.5 M blocks/s.
* ``removed1``: ``BlockRemoved`` with one hash each (what vLLM sends per evicted block),
  32 events per batch: an eviction burst. Target >= 300 k events/s.

Stages, each on one core from the msgpack payload bytes:

* ``decode``: :func:`events.schema.decode_batch` alone;
* ``process``: :class:`events.stream.StreamProcessor` — frame checks, the sequence state
  machine, decode, rank check, counters — handing every item to a no-op consumer;
* ``zmq e2e`` (optional, ``--e2e``): an :class:`events.publisher.EventPublisher` in another
  process (as vLLM is) to a subscriber over loopback TCP; the subscriber's socket thread and
  the no-op consumer share this process's core. Measured for each way of consuming
  (``--e2e-modes``): ``sync`` (:class:`events.subscriber.Subscriber` with a callback),
  ``sync_iter`` (``for item in sub`` on the caller's thread), ``async``
  (:class:`events.subscriber.AsyncSubscriber` with a callback) and ``async_iter``
  (``async for``). The column ``zmq e2e`` is ``sync``.

Usage: ``.venv/bin/python bench/events_bench.py [--seconds S] [--e2e] [--e2e-modes M,..]
[--e2e-repeat N] [--out PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from events.schema import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch  # noqa: E402
from events.stream import StreamBatch, StreamProcessor, StreamSpec  # noqa: E402
from events.subscriber import AsyncSubscriber, Subscriber  # noqa: E402

SEQ = struct.Struct(">Q")
TARGETS = {"stored64": ("blocks/s", 1_500_000), "removed1": ("events/s", 300_000)}
E2E_MODES = ("sync", "sync_iter", "async", "async_iter")


def make_payloads(workload: str, batch_events: int, n_batches: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(n_batches):
        events: list[Any] = []
        for _ in range(batch_events):
            if workload == "stored64":
                events.append(
                    BlockStored(
                        block_hashes=[rng.getrandbits(64) for _ in range(64)],
                        parent_block_hash=rng.getrandbits(64),
                        token_ids=[rng.randrange(151_936) for _ in range(64 * 16)],
                        block_size=16,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                    )
                )
            else:
                events.append(
                    BlockRemoved(block_hashes=[rng.getrandbits(64)], medium="GPU", group_idx=0)
                )
        out.append(encode_batch(KVEventBatch(time.time(), events, 0)))
    return out


def best_rate(run: Callable[[], int], seconds: float) -> tuple[float, int]:
    """Repeat ``run`` (returns units done) for ~``seconds``; best units/s over the passes."""
    best = 0.0
    total = 0
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        units = run()
        dt = time.perf_counter() - t0
        total += units
        best = max(best, units / dt)
        if time.perf_counter() > end:
            return best, total


def bench_decode(payloads: list[bytes], per_batch: int, seconds: float) -> float:
    def run() -> int:
        for p in payloads:
            decode_batch(p)
        return len(payloads) * per_batch

    return best_rate(run, seconds)[0]


def bench_process(payloads: list[bytes], per_batch: int, seconds: float) -> float:
    proc = StreamProcessor(StreamSpec("bench", "tcp://127.0.0.1:1", dp_rank=0))
    frames = [[b"", SEQ.pack(seq), p] for seq, p in enumerate(payloads)]
    consumed = [0]

    def consumer(item: Any) -> None:
        consumed[0] += 1

    def run() -> int:
        nonlocal proc
        # A fresh stream each pass, so the same seqs are in order again.
        proc = StreamProcessor(StreamSpec("bench", "tcp://127.0.0.1:1", dp_rank=0))
        out: list[Any] = []
        on_live = proc.on_live
        now = time.time()
        for f in frames:
            on_live(f, now, out)
            for item in out:
                consumer(item)
            out.clear()
        return len(frames) * per_batch

    rate, _ = best_rate(run, seconds)
    st = proc.stats
    if st.batches != len(frames) or st.malformed or st.gaps:
        raise SystemExit(f"bench processor misbehaved: {st}")
    return rate


_E2E_PUBLISHER = """
import select, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
from events.publisher import EventPublisher
from events_bench import make_payloads
payloads = make_payloads({workload!r}, {per_batch}, {n_batches})
with EventPublisher("tcp://127.0.0.1:*", hwm=0) as pub:
    print(pub.endpoint, flush=True)
    while not select.select([sys.stdin], [], [], 0.01)[0]:  # until the subscriber sees one
        pub.publish_raw(payloads[0])
    sys.stdin.readline()
    print(pub.next_seq, flush=True)
    sys.stdin.readline()  # the subscriber knows where the timed window starts
    for _ in range({rounds}):
        for p in payloads:
            pub.publish_raw(p)
    pub.flush(120)
    sys.stdin.readline()  # keep the socket open until everything is read
"""


StatsFn = Callable[[], dict[str, Any]]


@contextlib.contextmanager
def _sync_subscriber(
    spec: StreamSpec, on_item: Callable[[Any], None], iterate: bool
) -> Iterator[StatsFn]:
    """A :class:`Subscriber` feeding ``on_item``: as its callback, or from ``for item in sub``
    on a reader thread standing for the caller's."""
    if not iterate:
        with Subscriber([spec], on_item, rcvhwm=0) as sub:
            yield sub.stats
        return
    sub = Subscriber([spec], rcvhwm=0)

    def read() -> None:
        for item in sub:
            on_item(item)

    reader = threading.Thread(target=read, name="bench-reader", daemon=True)
    reader.start()
    try:
        yield sub.stats
    finally:
        sub.close()
        reader.join(10)


@contextlib.contextmanager
def _async_subscriber(
    spec: StreamSpec, on_item: Callable[[Any], None], iterate: bool
) -> Iterator[StatsFn]:
    """An :class:`AsyncSubscriber` on its own ``asyncio.run`` loop (a thread here), feeding
    ``on_item`` as its callback or from ``async for``."""
    ready = threading.Event()
    ctl: dict[str, Any] = {}

    async def consume(sub: AsyncSubscriber) -> None:
        async for item in sub:
            on_item(item)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        ctl["stop"] = lambda: loop.call_soon_threadsafe(stop.set)
        try:
            async with AsyncSubscriber([spec], None if iterate else on_item, rcvhwm=0) as sub:
                ctl["stats"] = sub.stats
                reader = asyncio.create_task(consume(sub)) if iterate else None
                ready.set()
                await stop.wait()
            if reader is not None:
                await reader
        finally:
            ready.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="bench-loop", daemon=True)
    thread.start()
    ready.wait(30)
    if "stats" not in ctl:
        raise SystemExit("e2e: the AsyncSubscriber did not start")
    try:
        yield ctl["stats"]
    finally:
        ctl["stop"]()
        thread.join(10)


def bench_e2e(workload: str, per_batch: int, n_batches: int, rounds: int, mode: str) -> float:
    """Loopback TCP from an EventPublisher in another process (as vLLM is) to a subscriber
    here, consumed as ``mode`` says (:data:`E2E_MODES`): batches/s from the first timed batch
    to the last, times events per batch."""
    code = _E2E_PUBLISHER.format(
        root=str(ROOT),
        bench=str(ROOT / "bench"),
        workload=workload,
        per_batch=per_batch,
        n_batches=n_batches,
        rounds=rounds,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    if proc.stdin is None or proc.stdout is None:  # pragma: no cover - PIPE was asked for
        raise SystemExit("e2e: could not talk to the publisher process")
    try:
        endpoint = proc.stdout.readline().strip()
        seen = threading.Event()
        done = threading.Event()
        marks: dict[str, float] = {}
        window = [-1, -1]

        def on_item(item: Any) -> None:
            if type(item) is not StreamBatch:
                return
            seen.set()
            if item.seq == window[0]:
                marks["t0"] = time.perf_counter()
            if item.seq == window[1]:
                marks["t1"] = time.perf_counter()
                done.set()

        spec = StreamSpec("e2e", endpoint)
        running = _async_subscriber if mode.startswith("async") else _sync_subscriber
        with running(spec, on_item, mode.endswith("_iter")) as stats:
            if not seen.wait(30):
                raise SystemExit("e2e: the subscriber never received the publisher")
            proc.stdin.write("go\n")
            proc.stdin.flush()
            first = int(proc.stdout.readline())
            n_total = n_batches * rounds
            window[:] = [first, first + n_total - 1]
            proc.stdin.write("start\n")  # only now: batch `first` must not beat the window
            proc.stdin.flush()
            if not done.wait(300):
                raise SystemExit("e2e: not everything arrived")
            st = stats()["e2e"]
            if st.gaps or st.malformed:
                raise SystemExit(f"e2e lost messages: {st}")
        proc.stdin.write("bye\n")
        proc.stdin.flush()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return (n_total - 1) * per_batch / (marks["t1"] - marks["t0"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    ap.add_argument("--e2e", action="store_true", help="also measure over loopback ZMQ")
    ap.add_argument(
        "--e2e-repeat",
        type=int,
        default=1,
        help="runs per e2e measurement, the best kept (loopback timings are noisy)",
    )
    ap.add_argument(
        "--e2e-modes",
        default=",".join(E2E_MODES),
        help=f"comma-separated ways of consuming for --e2e, of {', '.join(E2E_MODES)}",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "events_bench.json")
    args = ap.parse_args(argv)
    modes = [m for m in args.e2e_modes.split(",") if m]
    bad = sorted(set(modes) - set(E2E_MODES))
    if bad:
        ap.error(f"unknown --e2e-modes {bad}; choose from {', '.join(E2E_MODES)}")
    if args.e2e_repeat < 1:
        ap.error("--e2e-repeat must be at least 1")

    cases = [
        ("stored64", 4, 64, 500),
        ("stored64", 1, 64, 1000),
        ("removed1", 32, 1, 2000),
        ("removed1", 8, 1, 4000),
        ("removed1", 1, 1, 10000),
    ]
    rows = []
    for workload, per_batch, blocks_per_event, n_batches in cases:
        payloads = make_payloads(workload, per_batch, n_batches)
        unit, target = TARGETS[workload]
        mult = blocks_per_event if unit == "blocks/s" else 1
        dec = bench_decode(payloads, per_batch, args.seconds)
        proc = bench_process(payloads, per_batch, args.seconds)
        by_mode = {
            m: max(
                bench_e2e(workload, per_batch, n_batches, rounds=4, mode=m)
                for _ in range(args.e2e_repeat)
            )
            for m in (modes if args.e2e else [])
        }
        e2e = by_mode.get("sync")
        row = {
            "workload": workload,
            "events_per_batch": per_batch,
            "blocks_per_event": blocks_per_event,
            "payload_bytes_per_batch": round(sum(map(len, payloads)) / len(payloads)),
            "decode_events_per_s": dec,
            "process_events_per_s": proc,
            "e2e_events_per_s": e2e,
            "decode_blocks_per_s": dec * blocks_per_event,
            "process_blocks_per_s": proc * blocks_per_event,
            "e2e_blocks_per_s": None if e2e is None else e2e * blocks_per_event,
            **{f"e2e_{m}_events_per_s": by_mode.get(m) for m in E2E_MODES if m != "sync"},
            "target_unit": unit,
            "target": target,
            "process_meets_target": proc * mult >= target,
        }
        rows.append(row)

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e6:8.3f} M"

    print(
        f"{'workload':10} {'ev/batch':>8} {'bytes/batch':>11} {'unit':>9}"
        f" {'decode':>11} {'process':>11} {'zmq e2e':>11} {'target':>9}  ok"
        + "".join(f" {m:>11}" for m in E2E_MODES if m != "sync")
    )
    for r in rows:
        mult = r["blocks_per_event"] if r["target_unit"] == "blocks/s" else 1
        e2e = None if r["e2e_events_per_s"] is None else r["e2e_events_per_s"] * mult
        print(
            f"{r['workload']:10} {r['events_per_batch']:8} {r['payload_bytes_per_batch']:11}"
            f" {r['target_unit']:>9} {fmt(r['decode_events_per_s'] * mult):>11}"
            f" {fmt(r['process_events_per_s'] * mult):>11} {fmt(e2e):>11}"
            f" {r['target'] / 1e6:7.2f} M  {'yes' if r['process_meets_target'] else 'NO':3}"
            + "".join(
                f" {fmt(None if (v := r[f'e2e_{m}_events_per_s']) is None else v * mult):>11}"
                for m in E2E_MODES
                if m != "sync"
            )
        )
    result = {
        "bench": "events_bench",
        "command": " ".join([".venv/bin/python", "bench/events_bench.py", *(argv or sys.argv[1:])]),
        "python": platform.python_version(),
        "msgspec": msgspec.__version__,
        "pyzmq": zmq.__version__,
        "machine": platform.machine(),
        "seconds_per_measurement": args.seconds,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
