"""Hostile frames through a running router: the whole ingest, not just the SDK (issue 12).

:class:`RouterRig` starts a real router app (``router.server.app.create_app``, served by
uvicorn on 127.0.0.1 in a thread of this process) with one pool of three replicas, each
publishing its KV events on its own ZeroMQ PUB endpoint on 127.0.0.1:

* ``b`` and ``c`` are steady: real :class:`~events.publisher.EventPublisher` s with replay
  rings, which published the hand-built FA + SWA batches of :data:`STEADY` before the router
  started (the router's attach replay reads them, so both are *exact*);
* ``a`` is hostile: a bare PUB socket (no replay ring) that sends what
  :class:`HostileStream` makes from :class:`bench.fuzz_frames.FrameFuzzer`: random and broken
  payloads, non-UTF-8 strings, huge or negative ``group_idx``/``block_size``, unknown media,
  wrong frame counts, sequence frames of the wrong size, sequence jumps and restarts, with
  valid batches in between.

A :class:`Ledger` says what the router must have made of every hostile message: frame-level
outcomes from the fuzzer's own classification (:func:`bench.fuzz_frames.classify`), and the
refusals of the events inside decodable batches from an offline twin of the router's ingest
(a :class:`~events.stream.StreamProcessor`, an :class:`~router.server.ingest.IndexFeeder` and
a :class:`~router.core.index.KVIndex` of the same config, fed the same frames), so a frame lost
or an exception swallowed anywhere between the socket and ``/metrics`` shows as a difference.

``tests/test_router_fuzz.py`` runs ~20,000 messages in CI. This script is the long run:
``PYTHONPATH=. .venv/bin/python bench/fuzz_router.py --frames 1000000 [--seed S]
[--progress N] [--learned] [--out PATH]``. It reports frames sent, counted refusals by reason,
dead subscribers (must be 0), whether the steady replicas' predictions are unchanged, HTTP
latency during the run and this process's RSS before and after (the router runs in it), and
writes JSON to ``bench/results/fuzz_router.json``; exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fuzz_frames import SEQ, FrameFuzzer, classify, rss_kib  # noqa: E402
from events.hashing import BlockHasher  # noqa: E402
from events.layout import GroupKind, GroupSpec, ModelLayout  # noqa: E402
from events.publisher import EventPublisher  # noqa: E402
from events.schema import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from events.stream import StreamItem, StreamProcessor, StreamSpec  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.core.index import KVIndex  # noqa: E402
from router.server.app import create_app  # noqa: E402
from router.server.ingest import IndexFeeder  # noqa: E402
from tests.fake_replica import ServerThread  # noqa: E402
from tests.zmq_helpers import LOOPBACK, RawPub, publish_until, wait_for  # noqa: E402

MODEL = "fuzz-model"
TOKEN = "fuzz-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
BLOCK = 16
LAYOUT = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=BLOCK),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=BLOCK, sliding_window=48),
    )
)
"""Full attention (group 0) and a 48-token sliding window (group 1), 16-token blocks: the
window needs ceil(47/16) = 3 blocks below a hit boundary (spec §0.4)."""
HOSTILE, STEADY_NAMES = "a", ("b", "c")

#: Token ids of the prompts the steady replicas cache and the probes ask about.
PROMPTS: dict[str, list[int]] = {
    "P": list(range(1000, 1200)),  # 200 tokens: 12 full blocks + 8
    "P150": list(range(1000, 1150)),  # P's first 150 tokens
    "Q": list(range(1000, 1080)) + list(range(5000, 5120)),  # P's first 5 blocks, then its own
    "R": list(range(7000, 7100)),  # 100 tokens: 6 full blocks + 4
    "W": list(range(9000, 9100)),  # cached by every replica only at the end
}

_HASHER = BlockHasher(LAYOUT.hash, BLOCK)


def store(prompt: str, group: int, blocks: range, medium: str = "GPU") -> BlockStored:
    """vLLM's ``BlockStored`` for ``blocks`` (block indices) of ``prompt`` in ``group``."""
    ids = PROMPTS[prompt]
    wire = _HASHER.wire_chain(ids)
    spec = LAYOUT.groups[group]
    return BlockStored(
        block_hashes=[wire[i] for i in blocks],
        parent_block_hash=wire[blocks.start - 1] if blocks.start else None,
        token_ids=ids[blocks.start * BLOCK : blocks.stop * BLOCK],
        block_size=BLOCK,
        lora_id=None,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=spec.kind.value,
        kv_cache_spec_sliding_window=spec.sliding_window,
    )


def remove(prompt: str, group: int, blocks: range) -> BlockRemoved:
    wire = _HASHER.wire_chain(PROMPTS[prompt])
    return BlockRemoved(block_hashes=[wire[i] for i in blocks], medium="GPU", group_idx=group)


#: What the steady replicas published before the router started, batch by batch.
STEADY: dict[str, list[list[Any]]] = {
    "b": [
        [store("P", 0, range(12)), store("P", 1, range(8, 12))],  # FA all, SWA the last 4
        [store("R", 0, range(6)), store("R", 1, range(6))],
    ],
    "c": [
        [store("Q", 0, range(12)), store("Q", 1, range(12))],
        [store("R", 0, range(4)), store("R", 1, range(4))],
        [remove("R", 1, range(2, 3))],  # the window loses R's block 2
    ],
}

#: The last batch of each replica: it must be applied, so its subscriber is alive. The hostile
#: replica's starts with a clear, so its indexed state afterwards is exactly this batch.
FINAL: dict[str, list[Any]] = {
    "a": [AllBlocksCleared(), store("W", 0, range(6)), store("W", 1, range(6))],
    # and a connector's tier of its own: the hostile replica's junk media must not have used
    # up the tiers the pool may hold (router.core.index IndexLimits.max_extra_tiers)
    "b": [store("W", 0, range(6)), store("W", 1, range(3, 6)), store("W", 0, range(1), "lmcache")],
    "c": [store("W", 0, range(3)), store("W", 1, range(3))],
}

PRIME = [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)]
"""What the hostile replica sends until the router hears it (a removal of an unknown hash:
no state, no refusal)."""


def stream_name(replica: str) -> str:
    return f"{MODEL}/{replica}/dp0"


def router_config(endpoints: dict[str, tuple[str, str | None]], *, learned: bool) -> RouterConfig:
    """One pool of the three replicas; the layout declared, or learned from events."""
    layout = msgspec.to_builtins(LAYOUT)
    if learned:
        layout["groups"] = []
    replicas = []
    for name, (pub, replay) in endpoints.items():
        rep = {"name": name, "url": "http://127.0.0.1:9", "event_endpoint": pub}
        if replay is not None:
            rep["replay_endpoint"] = replay
        replicas.append(rep)
    data = {
        # No /metrics scrape and no health probe: the replicas' HTTP side is never contacted,
        # only their events (a probe of the dead URL would mark them down: replica_down).
        "server": {"admin_token": TOKEN, "metrics_scrape_interval_s": 0, "log_level": "error"},
        "health": {"probe_interval_s": 0},
        "pools": [{"model": MODEL, "layout": layout, "replicas": replicas}],
    }
    return msgspec.convert(data, RouterConfig)


class HostileStream:
    """The messages of a hostile publisher: mostly :meth:`FrameFuzzer.payload`, with wrong
    frame counts and sequence frames (:meth:`FrameFuzzer.bad_frames`), valid batches, valid
    batches at a jumped (a gap) or restarted (seq 0: a publisher restart) sequence, and
    well-formed stores whose layout is a plausible lie (:meth:`layout_payload`). Each message
    comes with the way it was made."""

    BAD_FRAMES = 0.05
    VALID = 0.10
    SEQ_GAP = 0.015
    SEQ_RESTART = 0.005
    LAYOUT_LIE = 0.05

    def __init__(self, fz: FrameFuzzer, next_seq: int) -> None:
        self.fz = fz
        self.seq = next_seq

    def message(self) -> tuple[str, list[bytes]]:
        fz = self.fz
        r = fz.rng.random()
        if r < self.BAD_FRAMES:
            return "bad_frames", fz.bad_frames()
        r -= self.BAD_FRAMES
        if r < self.VALID:
            kind, payload = "valid_batch", fz.valid_payload()
        elif (r := r - self.VALID) < self.SEQ_GAP:
            kind, payload = "seq_gap", fz.valid_payload()
            self.seq += fz.rng.randint(1, 1000)
        elif (r := r - self.SEQ_GAP) < self.SEQ_RESTART and self.seq > 0:
            kind, payload = "seq_restart", fz.valid_payload()
            self.seq = 0
        elif r - self.SEQ_RESTART < self.LAYOUT_LIE:
            kind, payload = "layout_lie", self.layout_payload()
        else:
            kind, payload = fz.payload()
        frames = [b"", SEQ.pack(self.seq), payload]
        self.seq += 1
        return kind, frames

    def layout_payload(self) -> bytes:
        """A well-formed batch of stores that mostly look like the pool's FA + SWA groups but
        lie about one thing within the wire bounds: a group the pool lacks, another kind,
        window or block size. Any of them, adopted, would change every replica's hit (the
        poisoning of a learned layout, issue 12 item 2)."""
        rng = self.fz.rng
        events = []
        for _ in range(rng.randint(1, 3)):
            g = rng.choice([0, 0, 1, 1, 2, 3, 7, 63])
            kind = "sliding_window" if g == 1 else "full_attention"
            if rng.random() < 0.2:
                kind = rng.choice(["full_attention", "sliding_window", "mamba", "mla_attention"])
            window = 48 if kind == "sliding_window" else None
            if rng.random() < 0.2:
                window = rng.choice([None, 16, 32, 64, 4096])
            bs = BLOCK if rng.random() < 0.7 else rng.choice([8, 32, 48, 4096, 1 << 16])
            n = rng.randint(1, 3)
            events.append(
                BlockStored(
                    block_hashes=[rng.getrandbits(64) for _ in range(n)],
                    parent_block_hash=rng.getrandbits(64),
                    token_ids=[rng.randrange(151_936) for _ in range(n * min(bs, 64))],
                    block_size=bs,
                    lora_id=None,
                    medium="GPU",
                    group_idx=g,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
            )
        return encode_batch(KVEventBatch(rng.random() * 1e9, events, 0))

    def messages(self, n: int) -> Iterator[tuple[str, list[bytes]]]:
        for _ in range(n):
            yield self.message()


#: Stream counters the ledger predicts, as ``/admin/events`` names them.
STREAM_COUNTERS = (
    "batches",
    "malformed",
    "rank_mismatches",
    "gaps",
    "unrecoverable_gaps",
    "resets",
    "events",
    "unknown_events",
    "consumer_errors",
    "disconnects",
)


class Ledger:
    """What the router must make of the hostile replica's messages (module docstring).

    ``outcomes`` counts each message by the fuzzer's classification of its payload
    (``ok``, ``ok_unknown``, ``batch_error``; ``bad_frames`` for a message the stream cannot
    place; ``rank_mismatch`` for a decodable batch of another DP rank; ``escaped:*`` is a
    decoder bug). :meth:`expected_stream` and :meth:`expected_lost` derive the stream counters
    from those alone; :meth:`twin_errors` gives the index's refusals by reason from the twin.
    """

    def __init__(self, config: RouterConfig) -> None:
        pool = config.pools[0]
        self.index = KVIndex(pool.layout, limits=config.index.limits(), pool=pool.model)
        self.proc = StreamProcessor(
            StreamSpec(
                stream_name(HOSTILE),
                "tcp://127.0.0.1:1",
                dp_rank=0,
                replay_from_start=True,
                lazy_token_ids=True,
            )
        )
        names = {stream_name(n): (n, 0) for n in (HOSTILE, *STEADY_NAMES)}
        self.feeder = IndexFeeder(self.index, names)
        self.kinds: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.unknown_events = 0
        self.events = 0
        self.escaped: list[dict[str, Any]] = []
        self._out: list[StreamItem] = []
        self._base_errors: dict[str, int] = {}
        self._base_stream: dict[str, int] = {}

    def steady(self, replica: str, batches: list[list[Any]]) -> None:
        """The twin applies a steady replica's batches (they can shape a learned layout)."""
        for events in batches:
            self.index.apply_events((replica, 0), events)

    def primed(self, frames: list[bytes]) -> None:
        """The twin reads the last priming message, then both sides count from here."""
        self._feed(frames)
        self._base_errors = self._errors()
        self._base_stream = self._stream()

    def add(self, kind: str, frames: list[bytes]) -> None:
        self.kinds[kind] += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self.outcomes["bad_frames"] += 1
        else:
            payload = frames[2]
            got = classify(payload, lazy=True)
            if got in ("ok", "ok_unknown"):
                batch = decode_batch(payload, lazy_token_ids=True)
                if batch.data_parallel_rank not in (None, 0):
                    got = "rank_mismatch"
                else:
                    self.unknown_events += batch.unknown
                    self.events += len(batch.events)
            elif got.startswith("escaped") and len(self.escaped) < 20:
                self.escaped.append({"kind": kind, "outcome": got, "hex": payload[:200].hex()})
            self.outcomes[got] += 1
        self._feed(frames)

    def _feed(self, frames: list[bytes]) -> None:
        out = self._out
        self.proc.on_live(frames, time.time(), out)
        for item in out:
            self.feeder(item)
        out.clear()

    def _errors(self) -> dict[str, int]:
        st = next(s for s in self.index.stats() if s.replica == HOSTILE)
        return dict(st.ingest_errors)

    def _stream(self) -> dict[str, int]:
        st = self.proc.stats
        return {k: getattr(st, k) for k in STREAM_COUNTERS}

    # -- what the router must show (deltas since the ledger was primed) ----------------

    @property
    def sent(self) -> int:
        return sum(self.kinds.values())

    def expected_stream(self) -> dict[str, int]:
        """The hostile stream's counters, from the fuzzer's classification alone."""
        o = self.outcomes
        return {
            "batches": o["ok"] + o["ok_unknown"],
            "malformed": o["bad_frames"] + o["batch_error"],
            "rank_mismatches": o["rank_mismatch"],
            "gaps": self.kinds["seq_gap"],
            "unrecoverable_gaps": self.kinds["seq_gap"],
            "resets": self.kinds["seq_restart"],
            "events": self.events,
            "unknown_events": self.unknown_events,
            "consumer_errors": 0,
            "disconnects": 0,
        }

    def expected_lost(self) -> int:
        """``lost_events`` refusals: every message not applied, and every gap."""
        o = self.outcomes
        return o["bad_frames"] + o["batch_error"] + o["rank_mismatch"] + self.kinds["seq_gap"]

    def twin_stream(self) -> dict[str, int]:
        return _minus(self._stream(), self._base_stream)

    def twin_errors(self) -> dict[str, int]:
        return _minus(self._errors(), self._base_errors)


def _minus(now: dict[str, int], base: dict[str, int]) -> dict[str, int]:
    return {k: v - base.get(k, 0) for k, v in now.items() if v - base.get(k, 0)}


class RouterRig:
    """The router and its three replicas' publishers (module docstring); a context manager.

    Every wait polls the router's HTTP API with a deadline, so each one is also a check that
    the router's event loop answers while the hostile stream is being ingested.
    """

    def __init__(self, *, learned: bool = False, timeout: float = 30.0) -> None:
        self.learned = learned
        self.timeout = timeout
        self.max_http_s = 0.0
        self.http_calls = 0
        self.http_slow: list[tuple[int, float]] = []
        """(hostile messages sent, seconds) of every HTTP call slower than 100 ms."""
        self.pubs: dict[str, EventPublisher] = {}
        self.raw: RawPub | None = None
        self.server: ServerThread | None = None
        self.http: httpx.Client | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        for name in STEADY_NAMES:
            pub = EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
            self.pubs[name] = pub
            for events in STEADY[name]:
                pub.publish(events)
        self.raw = RawPub()
        endpoints: dict[str, tuple[str, str | None]] = {HOSTILE: (self.raw.endpoint, None)}
        for name, pub in self.pubs.items():
            endpoints[name] = (pub.endpoint, pub.replay_endpoint)
        self.config = router_config(endpoints, learned=self.learned)
        self.app = create_app(self.config)
        self.server = ServerThread(self.app).start()
        self.http = httpx.Client(base_url=self.server.url, timeout=self.timeout)
        self.ledger = Ledger(self.config)
        for name in STEADY_NAMES:
            self.ledger.steady(name, STEADY[name])
            n = len(STEADY[name])
            self.wait(lambda name=name, n=n: self.stream(name)["batches"] == n, f"{name}'s batches")

    # -- reading the router ---------------------------------------------------------------

    def get(self, path: str) -> httpx.Response:
        return self._timed(lambda: self.http.get(path, headers=ADMIN))  # type: ignore[union-attr]

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self._timed(lambda: self.http.post(path, json=body, headers=ADMIN))  # type: ignore[union-attr]

    def _timed(self, call: Any) -> httpx.Response:
        t0 = time.perf_counter()
        r = call()
        dt = time.perf_counter() - t0
        self.http_calls += 1
        self.max_http_s = max(self.max_http_s, dt)
        if dt > 0.1:
            self.http_slow.append((self.ledger.sent if hasattr(self, "ledger") else 0, dt))
        if r.status_code != 200:
            raise AssertionError(f"{r.request.url.path}: {r.status_code} {r.text[:300]}")
        return r

    def events(self) -> dict[str, dict[str, Any]]:
        """``/admin/events`` rows by replica."""
        return {row["replica"]: row for row in self.get("/admin/events").json()["streams"]}

    def stream(self, replica: str) -> dict[str, Any]:
        return self.events()[replica]["stream_stats"]

    def processed(self, replica: str) -> int:
        """Messages the replica's stream has dealt with: every one is a batch, a malformed
        message or a batch of another rank."""
        st = self.stream(replica)
        return st["batches"] + st["malformed"] + st["rank_mismatches"]

    def probe(self) -> dict[str, dict[str, tuple[int, str]]]:
        """Per prompt, each replica's predicted hit and trust."""
        out = {}
        for name, ids in PROMPTS.items():
            rows = self.post("/admin/route/explain", {"token_ids": ids}).json()["replicas"]
            out[name] = {r["replica"]: (r["hit_tokens"], r["trust"]) for r in rows}
        return out

    def index(self) -> dict[str, Any]:
        """``/admin/index`` of the one pool: layout groups and entries per replica."""
        return self.get("/admin/index").json()["pools"][0]

    def held(self) -> dict[str, dict[str, dict[str, int]]]:
        """Keys each replica holds in the index, by tier and group (``/admin/index``, zeros
        left out)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for rep, tiers in self.index()["replicas"].items():
            for tier, per in tiers.items():
                if any(per.values()):
                    out.setdefault(rep.split("/")[0], {})[tier] = {
                        g: n for g, n in per.items() if n
                    }
        return out

    def ingest_errors(self) -> dict[str, dict[str, int]]:
        """``kvrouter_ingest_errors_total`` by replica and reason, read from ``/metrics``."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, dict[str, int]] = {}
        text = self._timed(lambda: self.http.get("/metrics")).text  # type: ignore[union-attr]
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvrouter_ingest_errors_total":
                    rep = s.labels["replica"].split("/")[0]
                    out.setdefault(rep, {})[s.labels["reason"]] = int(s.value)
        return out

    def subscribers_alive(self) -> dict[str, bool]:
        """Per replica, whether its subscriber's reader task is still running (read from
        the app in this process; the final batches prove it from the outside)."""
        pool = self.app.state.router.pools[MODEL]
        out = {}
        for name, rep in pool.replicas.items():
            core = rep.subscriber._core if rep.subscriber is not None else None
            task = core._task if core is not None else None
            out[name] = core is not None and core.failure is None and not task.done()
        return out

    def wait(self, cond: Any, what: str) -> Any:
        return wait_for(cond, self.timeout, what)

    # -- driving the hostile replica ------------------------------------------------------

    def prime(self) -> int:
        """Publish :data:`PRIME` batches from the hostile socket until the router has read
        one and the last one (past ZeroMQ's slow joiner); returns the next free sequence."""
        raw = self.raw
        assert raw is not None
        seq = iter(range(10**6))

        def publish() -> int:
            s = next(seq)
            raw.send_batch(s, PRIME)
            return s

        last = publish_until(publish, lambda: self.stream(HOSTILE)["batches"], self.timeout)
        self.wait(lambda: self.stream(HOSTILE)["last_seq"] == last, "the last priming batch")
        self.ledger.primed([b"", SEQ.pack(last), _prime_payload()])
        self._base = {k: self.stream(HOSTILE)[k] for k in STREAM_COUNTERS}
        self._base_processed = self.processed(HOSTILE)
        self._base_errors = self.ingest_errors().get(HOSTILE, {})
        return last + 1

    def send(self, messages: Iterator[tuple[str, list[bytes]]], chunk: int = 2_000) -> None:
        """Send ``messages`` from the hostile socket, ``chunk`` at a time, each chunk once the
        router has dealt with the one before (PUB drops what a full SUB queue cannot take)."""
        raw = self.raw
        assert raw is not None
        ledger = self.ledger
        pending = 0
        for kind, frames in messages:
            raw.send(frames)
            ledger.add(kind, frames)
            pending += 1
            if pending == chunk:
                self.sync()
                pending = 0
        self.sync()

    def sync(self) -> None:
        want = self._base_processed + self.ledger.sent
        self.wait(lambda: self.processed(HOSTILE) >= want, f"{want} hostile messages read")

    def hostile_stream(self) -> dict[str, int]:
        """The hostile stream's counters since :meth:`prime`."""
        now = self.stream(HOSTILE)
        return {k: now[k] - self._base[k] for k in STREAM_COUNTERS}

    def hostile_errors(self) -> dict[str, int]:
        """The hostile replica's ``kvrouter_ingest_errors_total`` since :meth:`prime`."""
        return _minus(self.ingest_errors().get(HOSTILE, {}), self._base_errors)

    def finish(self, next_seq: int) -> None:
        """Each replica's :data:`FINAL` batch; returns once the router applied all three."""
        assert self.raw is not None
        for name, pub in self.pubs.items():
            pub.publish(FINAL[name])
        self.raw.send_batch(next_seq, FINAL[HOSTILE])
        want = {n: len(STEADY[n]) + 1 for n in STEADY_NAMES}
        self.wait(
            lambda: (
                all(self.stream(n)["batches"] == want[n] for n in STEADY_NAMES)
                and self.stream(HOSTILE)["last_seq"] == next_seq
            ),
            "every replica's final batch",
        )

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        if self.server is not None:
            self.server.stop()
        if self.raw is not None:
            self.raw.close()
        for pub in self.pubs.values():
            pub.close()

    def __enter__(self) -> RouterRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prime_payload() -> bytes:
    return encode_batch(KVEventBatch(0.0, PRIME, 0))


# ---------------------------------------------------------------------------- long run


def run(frames: int, seed: int, progress: int, learned: bool, chunk: int) -> dict[str, Any]:
    rss_before = rss_kib()
    with RouterRig(learned=learned, timeout=120) as rig:
        rss_started = rss_kib()
        next_seq = rig.prime()
        before = rig.probe()
        layout_before = rig.index()["groups"]
        stream = HostileStream(FrameFuzzer(seed), next_seq)
        t0 = time.perf_counter()
        done = 0
        while done < frames:
            n = min(progress, frames - done)
            rig.send(stream.messages(n), chunk)
            done += n
            dt = time.perf_counter() - t0
            errs = rig.hostile_errors()
            print(
                f"{done:>10,} frames  {dt:7.1f}s  {done / dt:7,.0f}/s  "
                f"rss {rss_kib().get('vmrss_kib', 0) / 1024:6.1f} MiB  "
                f"http max {rig.max_http_s * 1000:6.1f} ms  refusals {sum(errs.values()):,}  "
                + " ".join(f"{k}={v}" for k, v in sorted(errs.items())),
                flush=True,
            )
        elapsed = time.perf_counter() - t0
        after = rig.probe()
        layout_after = rig.index()["groups"]
        got_stream = rig.hostile_stream()
        got_errors = rig.hostile_errors()
        all_errors = rig.ingest_errors()
        rig.finish(stream.seq)
        final = rig.probe()
        alive = rig.subscribers_alive()
        held = rig.held()
        ledger = rig.ledger
        steady_before = {p: {r: v for r, v in h.items() if r != HOSTILE} for p, h in before.items()}
        steady_after = {p: {r: v for r, v in h.items() if r != HOSTILE} for p, h in after.items()}
        checks = {
            "stream_counters_match_fuzzer": got_stream == ledger.expected_stream(),
            "stream_counters_match_twin": _minus(got_stream, {}) == ledger.twin_stream(),
            "refusals_match_twin": got_errors == ledger.twin_errors(),
            "lost_events_match_fuzzer": got_errors.get("lost_events", 0) == ledger.expected_lost(),
            "no_ingest_exceptions": "ingest_exception" not in got_errors,
            "no_decoder_escapes": not ledger.escaped,
            "steady_predictions_unchanged": steady_before == steady_after,
            "steady_replicas_no_refusals": all(not all_errors.get(n) for n in STEADY_NAMES),
            "layout_unchanged": layout_before == layout_after,
            "subscribers_alive": all(alive.values()),
            "hostile_final_batch_indexed": held.get(HOSTILE) == {"GPU": {"0": 6, "1": 6}},
            "steady_final_batches_exact": all(
                trust == "exact" for n in STEADY_NAMES for _, trust in (final[p][n] for p in final)
            ),
            "steady_connector_tier_kept": held.get("b", {}).get("LMCACHE") == {"0": 1},
        }
        result = {
            "frames": frames,
            "seed": seed,
            "learned_layout": learned,
            "seconds": round(elapsed, 2),
            "frames_per_s": round(frames / elapsed) if elapsed else None,
            "kinds": dict(sorted(ledger.kinds.items())),
            "outcomes": dict(sorted(ledger.outcomes.items())),
            "refusals": dict(sorted(got_errors.items())),
            "refusals_total": sum(got_errors.values()),
            "refusals_expected_twin": dict(sorted(ledger.twin_errors().items())),
            "stream": got_stream,
            "stream_expected": ledger.expected_stream(),
            "dead_subscribers": sum(1 for v in alive.values() if not v),
            "probes_before": before,
            "probes_after": after,
            "probes_final": final,
            "layout": layout_after,
            "http_calls": rig.http_calls,
            "http_max_ms": round(rig.max_http_s * 1000, 1),
            "http_slow": [(n, round(dt * 1000, 1)) for n, dt in rig.http_slow[:50]],
            "checks": checks,
            "escaped": ledger.escaped,
            "rss_before": rss_before,
            "rss_router_started": rss_started,
            "rss_after": rss_kib(),
            "python": sys.version.split()[0],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--progress", type=int, default=50_000, help="a line every N frames")
    ap.add_argument("--chunk", type=int, default=2_000, help="frames in flight at most")
    ap.add_argument("--learned", action="store_true", help="learn the layout from events")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fuzz_router.json")
    args = ap.parse_args(argv)
    result = run(args.frames, args.seed, args.progress, args.learned, args.chunk)
    brief = {k: v for k, v in result.items() if not k.startswith("probes") and k != "escaped"}
    print(json.dumps(brief, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    failed = [k for k, ok in result["checks"].items() if not ok]
    if failed:
        print(f"FAIL: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
