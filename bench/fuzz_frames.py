"""Hostile-frame fuzzing of the KV-event SDK (issue 12: no frame can kill, freeze or poison).

:class:`FrameFuzzer` is a seeded generator of the frames a broken or hostile publisher could
send: random bytes, truncated and bit-flipped valid batches, valid batches with one field
made hostile (non-UTF-8 strings in values and keys, wrong types, huge and negative ints for
``group_idx``/``block_size``/hashes, unknown event tags, extra fields, deep nesting, ext
types, lying length headers), broken envelopes, and messages with the wrong frame count or a
sequence frame of the wrong size. ``tests/test_frame_fuzz.py`` runs ~20,000 of them in CI;
this script runs as many as asked and reports what became of them:

* ``ok`` / ``ok_unknown``: decoded (with at least one :class:`~events.schema.UnknownEvent`);
* ``batch_error``: :class:`~events.schema.BatchDecodeError` (a broken envelope);
* ``bad_frames``: wrong frame count or sequence frame (never reaches the decoder; the
  subscriber counts it as a :class:`~events.stream.MalformedMessage`);
* ``escaped:<type>``: any other exception out of ``decode_batch`` or a lazy store's
  ``tokens()`` other than :class:`~events.schema.EventDecodeError`: a bug (exit status 1).

Usage: ``PYTHONPATH=. .venv/bin/python bench/fuzz_frames.py --frames 1000000 [--seed S]
[--progress N] [--out PATH]``; writes JSON to ``bench/results/fuzz_frames.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import struct
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from events.schema import (  # noqa: E402
    AllBlocksCleared,
    BatchDecodeError,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    LazyTokensBlockStored,
    decode_batch,
    encode_batch,
)

SEQ = struct.Struct(">Q")
U64 = 2**64 - 1
I64_MIN = -(2**63)

#: Hostile scalar and container values for any field (all encodable as msgpack).
HOSTILE_VALUES: list[Any] = [
    -1,
    0,
    2_000_000,
    2**31,
    2**32,
    U64,
    I64_MIN,
    -(2**31),
    1.5,
    math.nan,
    math.inf,
    -1e308,
    "",
    "x" * 300,
    "GPU\x00",
    b"",
    b"\x00" * 40,
    None,
    True,
    [],
    [None, "a", 1.0],
    {},
    {"a": {"b": [1, {"c": None}]}},
    {1: 2},
    msgspec.msgpack.Ext(5, b"ext"),
    msgspec.msgpack.Ext(-1, b"\x00" * 4),  # a msgpack timestamp
    msgspec.msgpack.Ext(-1, b"\x01"),  # a broken timestamp
]

#: Raw msgpack spliced in where a marker string was encoded (what ``encode`` cannot write).
RAW_SPLICES: list[bytes] = [
    b"\xa4\xff\xfe\xfd\xfc",  # str of 4 non-UTF-8 bytes
    b"\xa3\xed\xa0\x80",  # an encoded UTF-16 surrogate
    b"\xa2\xc3\x28",  # invalid 2-byte sequence
    b"\x91" * 5_000 + b"\x00",  # nesting too deep
    b"\x81\xa1k" * 3_000 + b"\xc0",  # maps nested too deep
    b"\xc1",  # the reserved byte
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 G elements
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 G pairs
    b"\xdb\xff\xff\xff\xf0abc",  # str32 claiming 4 GiB
    b"\xc6\x7f\xff\xff\xffabc",  # bin32 claiming 2 GiB
    b"\x82\x01\x02\x03\x04",  # map with int keys
    b"\xc7\x03\x05abc",  # ext8
]

KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "brand_new_field",
]

OUTCOMES = ("ok", "ok_unknown", "batch_error", "bad_frames")


class FrameFuzzer:
    """A seeded source of hostile payloads and messages; the same seed gives the same
    sequence, so a failure found in CI or by the long run can be replayed exactly."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._marker_n = 0

    # -- valid material -----------------------------------------------------------------

    def valid_events(self) -> list[Any]:
        rng = self.rng
        evs: list[Any] = []
        for _ in range(rng.randint(1, 4)):
            k = rng.random()
            if k < 0.45:
                n = rng.randint(1, 4)
                evs.append(
                    BlockStored(
                        block_hashes=[rng.getrandbits(64) for _ in range(n)],
                        parent_block_hash=rng.choice([None, rng.getrandbits(64)]),
                        token_ids=[rng.randrange(151_936) for _ in range(4 * n)],
                        block_size=4,
                        medium=rng.choice(["GPU", "CPU", None]),
                        lora_name=rng.choice([None, "adapter"]),
                        group_idx=rng.choice([None, 0, 1]),
                        kv_cache_spec_kind=rng.choice([None, "full_attention", "mamba"]),
                    )
                )
            elif k < 0.9:
                evs.append(BlockRemoved(block_hashes=[rng.getrandbits(64)], medium="GPU"))
            else:
                evs.append(AllBlocksCleared())
        return evs

    def valid_payload(self, rank: int | None = 0) -> bytes:
        batch = KVEventBatch(self.rng.random() * 1e9, self.valid_events(), rank)
        return encode_batch(batch, legacy=self.rng.random() < 0.3)

    # -- hostile payloads ---------------------------------------------------------------

    def payload(self) -> tuple[str, bytes]:
        """One hostile payload and the name of the way it was made."""
        rng = self.rng
        r = rng.random()
        if r < 0.1:
            return "random_bytes", rng.randbytes(rng.randint(0, 120))
        good = self.valid_payload()
        if r < 0.2:
            return "truncated", good[: rng.randrange(len(good))]
        if r < 0.3:
            b = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            return "byte_flips", bytes(b)
        if r < 0.35:
            return "valid", good
        return self._structured(good)

    def _marker(self) -> str:
        self._marker_n += 1
        return f"QZ{self._marker_n:08d}QZ"

    def _value(self, marker: str) -> Any:
        """A hostile value; a third of the time the marker, later replaced by raw bytes."""
        return marker if self.rng.random() < 0.33 else self.rng.choice(HOSTILE_VALUES)

    def _structured(self, good: bytes) -> tuple[str, bytes]:
        rng = self.rng
        obj = msgspec.msgpack.decode(good)  # [ts, events, rank]: events are dicts or lists
        splice: bytes | None = None
        marker = self._marker()
        events = obj[1]
        i = rng.randrange(len(events))
        ev = events[i]
        r = rng.random()
        if r < 0.15:  # the envelope
            kind = "envelope"
            what = rng.randrange(5)
            if what == 0:
                obj[rng.randrange(len(obj))] = self._value(marker)
            elif what == 1:
                obj.append(rng.choice(HOSTILE_VALUES))
            elif what == 2:
                obj = obj[: rng.randint(0, 1)]
            elif what == 3:
                obj = self._value(marker)
            else:
                obj[1] = {"events": obj[1]}
        elif r < 0.25:  # one whole event hostile
            kind = "event_replaced"
            events[i] = self._value(marker)
        elif r < 0.35:  # unknown tag
            kind = "unknown_tag"
            tag = rng.choice(["BlockPinned", "", "blockstored", marker, 7])
            if isinstance(ev, dict):
                ev["type"] = tag
            else:
                ev[0] = tag
        elif r < 0.5 and isinstance(ev, dict):  # a key itself hostile (extra or non-UTF-8)
            kind = "key"
            ev[marker] = rng.choice(HOSTILE_VALUES)
            if rng.random() < 0.5:
                ev.pop(rng.choice(list(ev)), None)
        elif r < 0.65:  # inside the hash or token lists
            kind = "list_item"
            field = rng.choice(["block_hashes", "token_ids"])
            if isinstance(ev, dict):
                target = ev.get(field)
            else:
                target = ev[1] if field == "block_hashes" and len(ev) > 1 else None
            if isinstance(target, list) and target:
                target[rng.randrange(len(target))] = self._value(marker)
            elif isinstance(ev, dict):
                ev[field] = [self._value(marker)]
        else:  # one field hostile
            kind = "field"
            value = self._value(marker)
            if isinstance(ev, dict):
                ev[rng.choice(KEYS)] = value
            elif ev:
                j = rng.randrange(len(ev) + 2)
                if j < len(ev):
                    ev[j] = value
                elif j == len(ev):
                    ev.append(value)
                else:
                    del ev[rng.randrange(len(ev)) :]
        try:
            raw = msgspec.msgpack.encode(obj)
        except (OverflowError, msgspec.EncodeError):  # pragma: no cover - values are encodable
            return "unencodable", good
        enc_marker = msgspec.msgpack.encode(marker)
        if enc_marker in raw:
            splice = rng.choice(RAW_SPLICES)
            raw = raw.replace(enc_marker, splice, 1)
            kind += "+raw"
        return kind, raw

    # -- messages (frames) --------------------------------------------------------------

    def bad_frames(self) -> list[bytes]:
        """A message the stream cannot place: wrong frame count or sequence frame size."""
        rng = self.rng
        if rng.random() < 0.5:
            count = rng.choice([1, 2, 4, 5])
            return [rng.randbytes(rng.randint(0, 12)) for _ in range(count)]
        return [b"", rng.randbytes(rng.choice([0, 1, 7, 9, 16])), self.valid_payload()]


def classify(payload: bytes, *, lazy: bool) -> str:
    """What ``decode_batch`` made of ``payload``: one of :data:`OUTCOMES` or
    ``escaped:<type>`` (a bug). Lazy stores have their ``tokens()`` read too."""
    try:
        batch = decode_batch(payload, lazy_token_ids=lazy)
    except BatchDecodeError:
        return "batch_error"
    except Exception as exc:
        return f"escaped:{type(exc).__name__}"
    if lazy:
        for ev in batch.events:
            if type(ev) is LazyTokensBlockStored:
                try:
                    ev.tokens()
                except EventDecodeError:
                    pass
                except Exception as exc:
                    return f"escaped_tokens:{type(exc).__name__}"
    return "ok_unknown" if batch.unknown else "ok"


def rss_kib() -> dict[str, int]:
    """Resident and peak resident set of this process, in KiB (Linux ``/proc``)."""
    out = {"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key.lower() + "_kib"] = int(value.split()[0])
    except OSError:  # pragma: no cover - not Linux
        pass
    return out


def run(frames: int, seed: int, progress: int) -> dict[str, Any]:
    """Fuzz ``frames`` messages: 5% bad frames, the rest payloads decoded in both
    ``lazy_token_ids`` modes. Returns counts per outcome and per way of making."""
    fz = FrameFuzzer(seed)
    outcomes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    escaped: list[dict[str, Any]] = []
    rss_before = rss_kib()
    t0 = time.perf_counter()
    for n in range(1, frames + 1):
        if fz.rng.random() < 0.05:
            fz.bad_frames()
            outcomes["bad_frames"] += 1
            kinds["bad_frames"] += 1
        else:
            kind, payload = fz.payload()
            kinds[kind] += 1
            for lazy in (False, True):
                got = classify(payload, lazy=lazy)
                outcomes[got] += 1
                if got.startswith("escaped") and len(escaped) < 20:
                    escaped.append(
                        {
                            "kind": kind,
                            "lazy": lazy,
                            "outcome": got,
                            "payload_hex": payload[:200].hex(),
                        }
                    )
        if progress and n % progress == 0:
            dt = time.perf_counter() - t0
            print(
                f"{n:>10,} frames  {dt:7.1f}s  {n / dt:9,.0f}/s  "
                f"rss {rss_kib().get('vmrss_kib', 0) / 1024:7.1f} MiB  "
                + " ".join(f"{k}={v}" for k, v in sorted(outcomes.items())),
                flush=True,
            )
    elapsed = time.perf_counter() - t0
    return {
        "frames": frames,
        "seed": seed,
        "seconds": round(elapsed, 2),
        "frames_per_s": round(frames / elapsed) if elapsed else None,
        "decodes": sum(v for k, v in outcomes.items() if k != "bad_frames"),
        "outcomes": dict(sorted(outcomes.items())),
        "kinds": dict(sorted(kinds.items())),
        "escaped": escaped,
        "rss_before": rss_before,
        "rss_after": rss_kib(),
        "python": sys.version.split()[0],
        "msgspec": msgspec.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--progress", type=int, default=100_000, help="a line every N frames")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fuzz_frames.json")
    args = ap.parse_args(argv)
    result = run(args.frames, args.seed, args.progress)
    print(json.dumps({k: v for k, v in result.items() if k != "escaped"}, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    bad = sum(v for k, v in result["outcomes"].items() if k.startswith("escaped"))
    if bad:
        print(f"FAIL: {bad} exceptions escaped; first ones in the JSON", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
