"""``kvrouter replay``: check the predictor against a recording of real traffic, offline.

A recording is the golden fixture's format: ``meta.json`` (replica names and the hash
settings), ``events-<replica>.jsonl`` (every published event, ``{"seq", "event"}`` in order)
and ``requests.jsonl`` (``prompt_token_ids``, the replica that served it, how many of its
batches had been received when it was sent, and the ``cached_tokens`` vLLM reported). The
layout is learned from the events. Users run it on their own recorded traffic before they
trust the predictor.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import msgspec

from events.layout import HashSettings, ModelLayout
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from router.core.index import KVIndex, ReplicaStats
from router.core.predict import Predictor

__all__ = [
    "RecordedBatch",
    "RecordingError",
    "ReplayRow",
    "ReplaySummary",
    "add_arguments",
    "load_events",
    "replay",
    "run",
]

_EventT = BlockStored | BlockRemoved | AllBlocksCleared


class RecordingError(ValueError):
    """The recording directory is incomplete or malformed."""


class _Meta(msgspec.Struct):
    replicas: list[str]
    prefix_caching_hash_algo: str = "sha256"
    pythonhashseed: str | None = None
    kv_events_use_int_block_hashes: bool = True
    prefix_cache_retention_interval: int | None = 0
    prefix_match_unit: int | None = None


class _Request(msgspec.Struct):
    i: int
    replica: str
    batches_before: int
    prompt_token_ids: list[int]
    cached_tokens: int
    kind: str = ""
    prompt_logprobs: bool = False


@dataclass(slots=True)
class ReplayRow:
    i: int
    replica: str
    kind: str
    prompt_tokens: int
    actual: int
    predicted: int
    blind: int
    limiting: str | None

    @property
    def exact(self) -> bool:
        return self.actual == self.predicted


@dataclass(slots=True)
class ReplaySummary:
    requests: int = 0
    exact: int = 0
    mean_abs_error: float = 0.0
    max_abs_error: int = 0
    blind_exact: int = 0
    blind_mean_abs_error: float = 0.0
    blind_max_abs_error: int = 0
    blind_over_predicted: int = 0
    rows: list[ReplayRow] = field(default_factory=list)
    replicas: list[ReplicaStats] = field(default_factory=list)

    def as_json(self) -> dict:
        return {
            "requests": self.requests,
            "exact": self.exact,
            "mean_abs_error": self.mean_abs_error,
            "max_abs_error": self.max_abs_error,
            "blind_exact": self.blind_exact,
            "blind_mean_abs_error": self.blind_mean_abs_error,
            "blind_max_abs_error": self.blind_max_abs_error,
            "blind_over_predicted": self.blind_over_predicted,
            "replicas": [msgspec.to_builtins(r) for r in self.replicas],
        }


def _read_jsonl(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


class RecordedBatch(NamedTuple):
    seq: int
    ts: float | None
    """The batch's publish time, when the recording kept it (``"ts"`` on its lines)."""
    events: list[_EventT]


def load_events(path: Path) -> list[RecordedBatch]:
    """Group a replica's recorded events into its batches, in file order."""
    line_dec = msgspec.json.Decoder(dict)
    batches: list[RecordedBatch] = []
    for lineno, line in _read_jsonl(path):
        try:
            rec = line_dec.decode(line)
            seq = int(rec["seq"])
            ev = msgspec.convert(rec["event"], _EventT)
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError) as exc:
            raise RecordingError(f"{path}:{lineno}: not an event record: {exc}") from None
        if batches and batches[-1].seq == seq:
            batches[-1].events.append(ev)
        elif batches and seq < batches[-1].seq:
            raise RecordingError(
                f"{path}:{lineno}: seq {seq} after {batches[-1].seq}: a recording must be in "
                f"stream order (a replica restart needs a new recording)"
            )
        else:
            batches.append(RecordedBatch(seq, rec.get("ts"), [ev]))
    return batches


def replay(directory: Path, *, layout: ModelLayout | None = None) -> ReplaySummary:
    """Replay a recording and compare every prediction with the real ``cached_tokens``."""
    directory = Path(directory)
    try:
        meta = msgspec.json.decode((directory / "meta.json").read_bytes(), type=_Meta)
    except FileNotFoundError:
        raise RecordingError(f"{directory}: no meta.json: is this a recording directory?") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordingError(f"{directory}/meta.json: {exc}") from None
    if layout is None:
        try:
            settings = msgspec.convert(
                {
                    "algo": meta.prefix_caching_hash_algo,
                    "pythonhashseed": meta.pythonhashseed,
                    "int_block_hashes": meta.kv_events_use_int_block_hashes,
                },
                HashSettings,
            )
        except msgspec.ValidationError as exc:
            raise RecordingError(f"{directory}/meta.json: {exc}") from None
        layout = ModelLayout(
            groups=(),
            hash=settings,
            prefix_match_unit=meta.prefix_match_unit,
            retention_interval=meta.prefix_cache_retention_interval,
        )
    index = KVIndex(layout, pool=directory.name)
    predictor = Predictor(index)
    streams = {}
    for name in meta.replicas:
        path = directory / f"events-{name}.jsonl"
        if not path.exists():
            raise RecordingError(f"{path} is missing: meta.json lists replica {name!r}")
        streams[name] = load_events(path)
        index.add_replica(name)
    applied = dict.fromkeys(meta.replicas, 0)  # position in each replica's batch list

    summary = ReplaySummary()
    req_dec = msgspec.json.Decoder(_Request)
    abs_err = blind_abs = 0
    for lineno, line in _read_jsonl(directory / "requests.jsonl"):
        try:
            req = req_dec.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RecordingError(f"{directory}/requests.jsonl:{lineno}: {exc}") from None
        if req.replica not in streams:
            raise RecordingError(
                f"{directory}/requests.jsonl:{lineno}: replica {req.replica!r} is not in "
                f"meta.json's replicas {meta.replicas}"
            )
        batches, key = streams[req.replica], (req.replica, 0)
        pos = applied[req.replica]
        while pos < len(batches) and batches[pos].seq < req.batches_before:
            index.apply_events(key, batches[pos].events)
            pos += 1
        applied[req.replica] = pos
        pred = predictor.predict(
            req.prompt_token_ids,
            skip_reading=req.prompt_logprobs,
            replicas=[key],
            blind=True,
            explain=True,
        ).replicas[0]
        limiting = None
        if pred.result is not None and pred.result.limiting_group is not None:
            sg = index.layout.spec_groups[pred.result.limiting_group]
            limiting = f"{sg.spec.kind}{list(sg.group_ids)}"
        row = ReplayRow(
            req.i,
            req.replica,
            req.kind,
            len(req.prompt_token_ids),
            req.cached_tokens,
            pred.hit_tokens,
            pred.blind_hit_tokens,
            limiting,
        )
        summary.rows.append(row)
        summary.requests += 1
        err = abs(row.predicted - row.actual)
        berr = abs(row.blind - row.actual)
        summary.exact += err == 0
        summary.blind_exact += berr == 0
        summary.blind_over_predicted += row.blind > row.actual
        summary.max_abs_error = max(summary.max_abs_error, err)
        summary.blind_max_abs_error = max(summary.blind_max_abs_error, berr)
        abs_err += err
        blind_abs += berr
    summary.replicas = index.stats()
    if summary.requests:
        summary.mean_abs_error = abs_err / summary.requests
        summary.blind_mean_abs_error = blind_abs / summary.requests
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Exit status: 0 when every prediction equals the recorded cached_tokens, 1 when some "
        "differ, 2 when the recording cannot be read."
    )
    parser.add_argument(
        "dir", type=Path, help="recording dir: meta.json, events-<replica>.jsonl, requests.jsonl"
    )
    parser.add_argument(
        "--layout",
        type=Path,
        help="a TOML file declaring the pool's layout (events.layout.ModelLayout); by default "
        "the groups are learned from the events and the hash settings read from meta.json",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--verbose", "-v", action="store_true", help="print one row per request")


def run(args: argparse.Namespace) -> int:
    layout = None
    if args.layout is not None:
        try:
            layout = msgspec.toml.decode(args.layout.read_bytes(), type=ModelLayout)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            print(f"kvrouter replay: --layout {args.layout}: {exc}", file=sys.stderr)
            return 2
    try:
        summary = replay(args.dir, layout=layout)
    except RecordingError as exc:
        print(f"kvrouter replay: {exc}", file=sys.stderr)
        return 2
    if args.verbose:
        print(
            f"{'i':>4} {'replica':<8} {'kind':<18} {'prompt':>6} {'actual':>6} "
            f"{'pred':>6} {'blind':>6}  limited by"
        )
        for r in summary.rows:
            mark = "" if r.exact else "  MISMATCH"
            print(
                f"{r.i:>4} {r.replica:<8} {r.kind:<18} {r.prompt_tokens:>6} {r.actual:>6} "
                f"{r.predicted:>6} {r.blind:>6}  {r.limiting or '-'}{mark}"
            )
    if args.json:
        print(json.dumps(summary.as_json()))
    else:
        n = summary.requests or 1
        print(f"requests: {summary.requests}")
        print(
            f"exact:    {summary.exact} ({100 * summary.exact / n:.1f} %), mean abs error "
            f"{summary.mean_abs_error:.1f} tokens, max {summary.max_abs_error}"
        )
        print(
            f"group-blind exact: {summary.blind_exact} ({100 * summary.blind_exact / n:.1f} %), "
            f"mean abs error {summary.blind_mean_abs_error:.1f}, max "
            f"{summary.blind_max_abs_error}, over-predicted {summary.blind_over_predicted}"
        )
        for r in summary.replicas:
            state = "trusted" if r.trusted else f"UNTRUSTED: {r.untrusted_reason}"
            print(
                f"replica {r.replica}: {state}; hash conformance: {r.conformance_checked} "
                f"root stores re-hashed, {r.conformance_mismatches} mismatched"
            )
    return 0 if summary.exact == summary.requests else 1
