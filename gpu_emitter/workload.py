"""Workloads for the demo and the routing simulator: the Mooncake trace, scaled and expanded.

The Mooncake conversation trace (``../shared/traces/mooncake/conversation_trace.jsonl``) gives,
per request, an arrival time, prompt and output lengths and one anonymised id per 512-token
prompt block; two requests sharing their first ``k`` ids share their first ``k * 512`` tokens.
No text is included, so each id is *expanded* into a deterministic block of token ids: equal
ids give equal tokens, different ids different tokens (with overwhelming probability), so the
prefix reuse the trace recorded becomes real prefix-cache reuse on a replica.

Scaling, because the trace is 145 M prompt tokens (12,031 requests of up to 126 k tokens):

* ``block_tokens``: tokens one trace block becomes (default 32, i.e. every token count is
  divided by 512 / 32 = 16). Prompt length ``ceil(input_length * block_tokens / 512)``, capped
  at ``len(hash_ids) * block_tokens`` (the last block is partial); output length scaled the
  same way (at least 1).
* ``time_scale``: arrival times are multiplied by it (0.01 replays the hour in 36 s).
* ``session_stride``: keep only the conversations whose first private block id (``hash_ids[1]``,
  block 0 is the system prompt every request shares) is a multiple of the stride. Sampling
  whole conversations keeps the trace's reuse (about 42 % at every stride from 10 to 40, 37 %
  for the full trace), where a contiguous slice of a few hundred requests keeps under 10 %.

Token ids are ``wN`` words of the builtin vocabulary (``gpu_emitter.tokenizer``), so the
simulated replicas accept them as a prompt and the router's ``builtin`` tokenizer agrees.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from gpu_emitter.tokenizer import NUM_WORDS, WORD_OFFSET

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "ScaledRequest",
    "Scaling",
    "TraceError",
    "TraceRequest",
    "block_token_ids",
    "default_trace_path",
    "load_trace",
    "parse_trace",
    "scale_trace",
    "synthetic_trace",
    "trace_reuse_bound",
]

#: Prompt tokens per trace ``hash_id`` in the Mooncake release.
TRACE_BLOCK_TOKENS = 512
_MASK64 = (1 << 64) - 1


class TraceError(ValueError):
    """A trace file or line that cannot be replayed; the message names the line and the fix."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of the trace, as recorded (milliseconds, real token counts)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Scaling:
    """How a trace is shrunk for a run (module docstring); stated in every result."""

    block_tokens: int = 32
    time_scale: float = 1.0
    session_stride: int = 1
    session_offset: int = 0
    """Which residue of the stride is kept: different offsets give disjoint conversation sets."""
    limit: int | None = None
    """Keep at most this many requests (after session sampling), from the start."""

    def __post_init__(self) -> None:
        if not 1 <= self.block_tokens <= TRACE_BLOCK_TOKENS:
            raise TraceError(f"block_tokens must be 1..{TRACE_BLOCK_TOKENS}")
        if not self.time_scale >= 0 or math.isinf(self.time_scale):
            raise TraceError("time_scale must be a finite number >= 0")
        if self.session_stride < 1:
            raise TraceError("session_stride must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise TraceError("limit must be >= 1 (or None for every request)")

    @property
    def token_factor(self) -> float:
        return self.block_tokens / TRACE_BLOCK_TOKENS

    def describe(self) -> str:
        return (
            f"1 trace block = {self.block_tokens} tokens (token counts x{self.token_factor:g}), "
            f"time x{self.time_scale:g}, conversations with id % {self.session_stride} == "
            f"{self.session_offset % self.session_stride}"
            + (f", first {self.limit} requests" if self.limit else "")
        )


@dataclass(frozen=True, slots=True)
class ScaledRequest:
    """A request ready to replay: arrival in seconds, prompt and output sizes in tokens."""

    index: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    prompt_len: int
    output_len: int
    block_tokens: int

    def token_ids(self) -> list[int]:
        """The prompt: each id's block, the last one cut to ``prompt_len``."""
        out: list[int] = []
        for h in self.hash_ids:
            out.extend(block_token_ids(h, self.block_tokens))
            if len(out) >= self.prompt_len:
                break
        del out[self.prompt_len :]
        return out


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@lru_cache(maxsize=1 << 16)
def block_token_ids(hash_id: int, n: int) -> tuple[int, ...]:
    """The ``n`` token ids trace block ``hash_id`` stands for (``wN`` words; deterministic)."""
    base = _splitmix64(hash_id) * 1024
    return tuple(WORD_OFFSET + _splitmix64(base + j) % NUM_WORDS for j in range(n))


def default_trace_path() -> Path:
    """``$KVROUTER_SHARED/traces/mooncake/conversation_trace.jsonl``, else ``../shared/...``
    beside the repository."""
    root = Path(__file__).resolve().parents[1]
    shared = Path(os.environ.get("KVROUTER_SHARED", root.parent / "shared"))
    return shared / "traces" / "mooncake" / "conversation_trace.jsonl"


def parse_trace(lines: Iterable[str], *, source: str = "<trace>") -> list[TraceRequest]:
    """Trace lines (JSON objects) to requests, in arrival order."""
    out: list[TraceRequest] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            req = TraceRequest(
                float(d["timestamp"]),
                int(d["input_length"]),
                int(d["output_length"]),
                tuple(int(h) for h in d["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(
                f"{source}:{no}: not a trace line ({exc!r}); each line needs timestamp, "
                "input_length, output_length and hash_ids"
            ) from None
        if req.input_length < 1 or req.output_length < 0 or not req.hash_ids:
            raise TraceError(f"{source}:{no}: input_length >= 1 and non-empty hash_ids needed")
        if req.input_length > len(req.hash_ids) * TRACE_BLOCK_TOKENS:
            raise TraceError(
                f"{source}:{no}: input_length {req.input_length} exceeds "
                f"{len(req.hash_ids)} blocks of {TRACE_BLOCK_TOKENS} tokens"
            )
        out.append(req)
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def load_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as f:
            return parse_trace(f, source=str(p))
    except OSError as exc:
        raise TraceError(
            f"cannot read trace {str(p)!r}: {exc.strerror}; give --trace PATH (a Mooncake "
            "JSONL trace) or set KVROUTER_SHARED to the shared/ folder"
        ) from None


def _session_key(r: TraceRequest) -> int:
    return r.hash_ids[1] if len(r.hash_ids) > 1 else r.hash_ids[0]


def scale_trace(trace: Sequence[TraceRequest], scaling: Scaling) -> list[ScaledRequest]:
    """Sample conversations, shrink token counts and time (module docstring)."""
    f = scaling.token_factor
    bt = scaling.block_tokens
    stride, offset = scaling.session_stride, scaling.session_offset % scaling.session_stride
    picked = [r for r in trace if _session_key(r) % stride == offset]
    if scaling.limit is not None:
        picked = picked[: scaling.limit]
    if not picked:
        return []
    t0 = picked[0].timestamp_ms
    out = []
    for i, r in enumerate(picked):
        n = min(len(r.hash_ids) * bt, max(1, math.ceil(r.input_length * f)))
        out.append(
            ScaledRequest(
                i,
                (r.timestamp_ms - t0) / 1000.0 * scaling.time_scale,
                r.hash_ids,
                n,
                max(1, math.ceil(r.output_length * f)),
                bt,
            )
        )
    return out


def synthetic_trace(n: int, *, seed: int = 0, rate_per_s: float = 4.0) -> list[TraceRequest]:
    """A Mooncake-shaped stand-in (shared system block, multi-turn conversations that extend
    their previous prompt) for machines without the trace file."""
    import random

    rng = random.Random(seed)
    next_id = 1
    sessions: list[list[int]] = []
    out: list[TraceRequest] = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate_per_s) * 1000.0
        if sessions and rng.random() < 0.55:
            ids = rng.choice(sessions)
            grow = rng.randint(1, 3)
            ids.extend(range(next_id, next_id + grow))
            next_id += grow
        else:
            k = rng.randint(2, 12)
            ids = [0, *range(next_id, next_id + k - 1)]
            next_id += k - 1
            sessions.append(ids)
        length = (len(ids) - 1) * TRACE_BLOCK_TOKENS + rng.randint(1, TRACE_BLOCK_TOKENS)
        out.append(TraceRequest(t, length, rng.randint(20, 600), tuple(ids)))
    return out


def agent_trace(
    n: int,
    *,
    seed: int = 0,
    rate_per_s: float = 4.0,
    prefix_blocks: int = 4,
    output_tokens: tuple[int, int] = (20, 200),
) -> list[TraceRequest]:
    """Every request one fleet-wide prefix of ``prefix_blocks`` trace blocks (an agent's
    system prompt: 2,048 tokens by default) and then a short query of its own (1-511 tokens).
    The case a prefix home is most at risk in: the prefix is cached on every replica, so hits
    tie everywhere and only the home credit and the queue tell replicas apart
    (router.core.affinity), while each request brings little prefill to queue."""
    import random

    rng = random.Random(seed)
    shared = tuple(range(prefix_blocks))
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate_per_s) * 1000.0
        length = prefix_blocks * TRACE_BLOCK_TOKENS + rng.randint(1, TRACE_BLOCK_TOKENS - 1)
        ids = (*shared, prefix_blocks + i)
        out.append(TraceRequest(t, length, rng.randint(*output_tokens), ids))
    return out


def trace_reuse_bound(requests: Sequence[ScaledRequest], alignment: int) -> tuple[int, int]:
    """``(cached, prompt)`` tokens with infinite capacity on one replica, from the trace alone:
    a request reuses the longest prefix any earlier request had (whole trace blocks, then the
    part of the next block an earlier request reached), at most ``prompt_len - 1`` tokens
    (vLLM recomputes the last one), rounded down to ``alignment``. Layout-blind: with dense
    caching this is the ceiling of every policy; sliding-window layouts cache less."""
    reach: dict[tuple[int, ...], int] = {}
    cached = total = 0
    for r in requests:
        ids, bt, n = r.hash_ids, r.block_tokens, r.prompt_len
        k = 0
        while k < len(ids) and reach.get(ids[: k + 1], 0) >= bt:
            k += 1
        hit = k * bt
        if k < len(ids):
            hit += min(reach.get(ids[: k + 1], 0), n - hit)
        hit = min(hit, n - 1)
        cached += max(0, hit) // alignment * alignment
        total += n
        for j in range(-(-n // bt)):
            key = ids[: j + 1]
            got = min(bt, n - j * bt)
            if reach.get(key, 0) < got:
                reach[key] = got
    return cached, total
