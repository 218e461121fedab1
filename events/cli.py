"""``kvrouter events tail``: print the KV events a vLLM replica publishes, one line per event.

Text mode is for eyes; ``--json`` gives one JSON object per line (``stream``, ``seq``, ``ts``,
``dp_rank``, ``type`` and every field of the event; hashes as integers, bytes as hex) for
scripts. Stream signals (lost batches, restarts, malformed messages) go to stderr in text
mode and, in JSON mode, to stdout as objects with a ``"signal"`` key, so a pipeline sees them
in order with the events.

Exit codes: 0 on Ctrl-C, on ``--count`` reached, or on ``--timeout`` without ``--count``;
1 when ``--timeout`` expires before ``--count`` events; 2 for a bad endpoint or option.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, TextIO

import msgspec

from events.endpoints import EndpointError, offset_endpoint_port, validate_endpoint
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, UnknownEvent
from events.stream import StreamBatch, StreamItem, StreamSpec
from events.subscriber import Subscriber


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "endpoint",
        help="the replica's PUB endpoint, e.g. tcp://127.0.0.1:5557 (vLLM --kv-events-config "
        "endpoint, with the replica's host instead of *)",
    )
    parser.add_argument(
        "--replay-endpoint",
        metavar="E",
        help="the replica's replay (ROUTER) endpoint; lost batches are fetched from it",
    )
    parser.add_argument("--topic", metavar="T", default="", help="topic prefix (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--dp-rank",
        metavar="N",
        type=int,
        help="expected data_parallel_rank; batches from another rank are reported and dropped",
    )
    parser.add_argument(
        "--offset-ports",
        action="store_true",
        help="ENDPOINT and --replay-endpoint are rank 0's: add --dp-rank to their ports as "
        "vLLM does for each DP rank",
    )
    parser.add_argument(
        "--bind",
        action="store_true",
        help="bind ENDPOINT instead of connecting (for a replica whose endpoint has no * "
        "and therefore connects to the subscriber)",
    )
    parser.add_argument("--count", metavar="N", type=int, help="exit after N events")
    parser.add_argument("--timeout", metavar="S", type=float, help="exit after S seconds")


def _fail(message: str) -> int:
    print(f"kvrouter events tail: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        return _fail("--count must be at least 1")
    if args.timeout is not None and args.timeout <= 0:
        return _fail("--timeout must be a positive number of seconds")
    if args.dp_rank is not None and args.dp_rank < 0:
        return _fail("--dp-rank must be >= 0")
    if args.offset_ports and args.dp_rank is None:
        return _fail("--offset-ports needs --dp-rank N")
    endpoint, replay = args.endpoint, args.replay_endpoint
    try:
        validate_endpoint(endpoint)
        if replay is not None:
            validate_endpoint(replay, what="--replay-endpoint")
        if args.offset_ports:
            endpoint = offset_endpoint_port(endpoint, args.dp_rank)
            if replay is not None:
                replay = offset_endpoint_port(replay, args.dp_rank)
        spec = StreamSpec(
            endpoint, endpoint, replay, topic=args.topic, dp_rank=args.dp_rank, bind=args.bind
        )
        sub = Subscriber([spec])
    except EndpointError as exc:
        return _fail(str(exc))

    # SIGTERM ends the tail like Ctrl-C does (for supervisors and `timeout`).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    out = _Printer(sys.stdout, sys.stderr, as_json=args.json, limit=args.count)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        with sub:
            while args.count is None or out.events < args.count:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    break
                item = sub.get(timeout=wait)
                if item is not None:
                    out.item(item)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `kvrouter events tail ... | head`
        _silence_stdout()
        return 0
    if args.count is not None and out.events < args.count:
        print(
            f"kvrouter events tail: timed out after {args.timeout}s with "
            f"{out.events}/{args.count} events",
            file=sys.stderr,
        )
        return 1
    return 0


def _silence_stdout() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def event_fields(ev: Any) -> dict[str, Any]:
    """Every field of an event as JSON-ready values, ``type`` first."""
    d: dict[str, Any] = {"type": type(ev).__name__}
    for name in ev.__struct_fields__:
        d[name] = _jsonable(getattr(ev, name))
    return d


def _short(h: Any) -> str:
    return h.hex() if isinstance(h, bytes) else str(h)


def _text(ev: Any) -> str:
    if type(ev) is BlockStored:
        kind = f" kind={ev.kv_cache_spec_kind}" if ev.kv_cache_spec_kind else ""
        window = (
            f" window={ev.kv_cache_spec_sliding_window}"
            if ev.kv_cache_spec_sliding_window is not None
            else ""
        )
        parent = "-" if ev.parent_block_hash is None else _short(ev.parent_block_hash)
        lora = f" lora={ev.lora_name}" if ev.lora_name else ""
        return (
            f"BlockStored group={ev.group_idx}{kind}{window} medium={ev.medium} "
            f"block_size={ev.block_size} tokens={len(ev.token_ids)} parent={parent} "
            f"hashes=[{','.join(_short(h) for h in ev.block_hashes)}]{lora}"
        )
    if type(ev) is BlockRemoved:
        return (
            f"BlockRemoved group={ev.group_idx} medium={ev.medium} "
            f"hashes=[{','.join(_short(h) for h in ev.block_hashes)}]"
        )
    if type(ev) is AllBlocksCleared:
        return "AllBlocksCleared"
    if type(ev) is UnknownEvent:
        return f"UnknownEvent index={ev.index} error={ev.error!r} raw={ev.raw.hex()}"
    return repr(ev)


class _Printer:
    def __init__(self, out: TextIO, err: TextIO, *, as_json: bool, limit: int | None) -> None:
        self.out, self.err, self.as_json = out, err, as_json
        self.limit = limit
        self.events = 0

    def item(self, item: StreamItem) -> None:
        if type(item) is StreamBatch:
            self.batch(item)
            return
        if self.as_json:
            d = {"signal": type(item).__name__, **msgspec.to_builtins(item)}
            self.out.write(json.dumps(d) + "\n")
            self.out.flush()
        else:
            fields = " ".join(f"{k}={v}" for k, v in msgspec.to_builtins(item).items())
            self.err.write(f"! {type(item).__name__} {fields}\n")
            self.err.flush()

    def batch(self, item: StreamBatch) -> None:
        b = item.batch
        lines = []
        events = b.events
        if self.limit is not None:
            events = events[: self.limit - self.events]
        for ev in events:
            if self.as_json:
                head = {
                    "stream": item.stream,
                    "seq": item.seq,
                    "ts": b.ts,
                    "dp_rank": b.data_parallel_rank,
                    "replayed": item.replayed,
                }
                lines.append(json.dumps({**head, **event_fields(ev)}))
            else:
                mark = " (replayed)" if item.replayed else ""
                lines.append(
                    f"seq={item.seq} ts={b.ts:.6f} dp_rank={b.data_parallel_rank}{mark} {_text(ev)}"
                )
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()
        self.events += len(lines)
