"""Play a ``load_plan.Plan`` against one OpenAI-style endpoint, concurrently, and record it.

Every session is an asyncio task: it waits for its arrival time, sends its turns one after the
other (each turn's messages are the previous messages, the answer just streamed back and the
next user message; the think time runs from the moment the answer finished) and records what
each request saw: time to the first content chunk, vLLM's usage (``prompt_tokens``,
``prompt_tokens_details.cached_tokens``), and kvrouter's response headers when a kvrouter is in
front (``x-kvrouter-replica``, ``x-kvrouter-predicted-hit``: the events-only prediction,
``x-kvrouter-in-flight-hit``: plus the requests routed ahead, and ``x-kvrouter-expected-hit``:
the admission-time one, when the router sends them). Arrivals are
open-loop: a slow endpoint does not slow the arrival of new sessions.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bench.real_vllm.load_plan import Plan, Session

HEADER_REPLICA = "x-kvrouter-replica"
HEADER_PREDICTED = "x-kvrouter-predicted-hit"
HEADER_EXPECTED = "x-kvrouter-expected-hit"
HEADER_IN_FLIGHT = "x-kvrouter-in-flight-hit"


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds from the run's start)."""

    sid: int
    turn: int
    kind: str
    send_s: float
    in_flight: int
    """Requests in flight when this one was sent, itself included."""
    status: int | None = None
    ttft_s: float | None = None
    """Until the first chunk with content (vLLM sends an empty role chunk first)."""
    latency_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    replica: str | None = None
    predicted_hit: int | None = None
    expected_hit: int | None = None
    in_flight_hit: int | None = None
    """The admission-time hit before the eviction forecast (events + requests ahead)."""
    error: str | None = None


def _int_header(headers: httpx.Headers, name: str) -> int | None:
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


@dataclass
class LoadRunner:
    """Runs ``plan`` against ``base_url``; ``records`` fills in completion order."""

    plan: Plan
    base_url: str
    model: str
    request_timeout_s: float = 120.0
    progress: Callable[[int, int], None] | None = None
    """Called with (done, planned) after every 25th finished request."""
    records: list[RequestRecord] = field(default_factory=list)
    header_names: set[str] = field(default_factory=set)
    """Every response header name seen (shows what a router adds)."""
    max_in_flight: int = 0
    _in_flight: int = 0
    _t0: float = 0.0

    async def run(self, deadline_s: float) -> bool:
        """Play the plan; False if ``deadline_s`` ran out first (the rest is cancelled)."""
        self._t0 = time.monotonic()
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.request_timeout_s, connect=5.0)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=timeout, limits=limits) as c:
            tasks = [asyncio.create_task(self._session(c, s)) for s in self.plan.sessions]
            done, pending = await asyncio.wait(tasks, timeout=deadline_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                t.result()  # a bug in the runner itself must not pass silently
        return not pending

    async def _session(self, client: httpx.AsyncClient, s: Session) -> None:
        await asyncio.sleep(max(0.0, self._t0 + s.arrival_s - time.monotonic()))
        messages = self.plan.first_messages(s)
        answer = ""
        for k in range(s.turns):
            if k:
                await asyncio.sleep(s.think_s[k - 1])
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": s.user_messages[k]},
                ]
            rec, answer = await self._request(client, s, k, messages)
            if rec.error is not None:
                return  # the next turn needs this answer

    async def _request(
        self, client: httpx.AsyncClient, s: Session, k: int, messages: list[dict[str, str]]
    ) -> tuple[RequestRecord, str]:
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        t0 = time.monotonic()
        rec = RequestRecord(s.sid, k, s.kind, t0 - self._t0, self._in_flight)
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": s.max_tokens[k],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        parts: list[str] = []
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                rec.status = r.status_code
                self.header_names.update(h.lower() for h in r.headers)
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return rec, ""
                label = r.headers.get(HEADER_REPLICA)
                rec.replica = label.split("/")[0] if label else None
                rec.predicted_hit = _int_header(r.headers, HEADER_PREDICTED)
                rec.expected_hit = _int_header(r.headers, HEADER_EXPECTED)
                rec.in_flight_hit = _int_header(r.headers, HEADER_IN_FLIGHT)
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if rec.ttft_s is None:
                                rec.ttft_s = time.monotonic() - t0
                            parts.append(text)
                    usage = chunk.get("usage")
                    if usage:
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        rec.completion_tokens = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = details.get("cached_tokens")
            rec.latency_s = time.monotonic() - t0
            if rec.ttft_s is None:
                rec.ttft_s = rec.latency_s  # no content at all (only special tokens generated)
            if rec.cached_tokens is None:
                rec.error = "no usage.prompt_tokens_details.cached_tokens in the stream"
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._in_flight -= 1
            self.records.append(rec)
            n = len(self.records)
            if self.progress is not None and n % 25 == 0:
                self.progress(n, self.plan.requests)
        return rec, "".join(parts).strip()
