"""The simulated replica's engine: one asyncio task that schedules requests like vLLM's.

Each *step* (one loop iteration) does what vLLM's scheduler and model runner do, in vLLM's
order, against a hybrid block pool (``gpu_emitter.hybrid_pool.HybridBlockPool`` or anything
with the same methods, :class:`BlockPool`):

1. **Running requests first.** Each running request needs a slot for the token sampled in
   the previous step (``pool.append_tokens``). When the pool has no room, the most recently
   admitted running request is preempted (its blocks are freed, it goes back to the *front*
   of the waiting queue and will recompute prompt + output so far), as vLLM does for FCFS.
2. **Then the waiting queue, FIFO**, while ``running < max_num_seqs`` and ``pool.admit``
   succeeds. ``admit`` computes the local prefix-cache hit (spec §4.1: ``num_tokens - 1`` at
   most, 0 when the request skips reading, e.g. it asked for ``prompt_logprobs``) and
   allocates; ``compute_prefill`` caches the prompt's blocks. A request the pool cannot take
   while nothing else runs can never fit: it fails with :class:`CapacityError`.
3. **Publish.** ``pool.take_events()`` is drained once and published as **one** batch when
   non-empty (vLLM publishes once per step; an empty step publishes nothing). Events are
   produced at scheduling time, before the step's compute (spec §2.5).
4. **Compute.** Sleep the cost model's step time (``gpu_emitter.cost_model``).
5. **Sample.** Every request of the step gets one token: admitted ones their first token
   (the prefill's), running ones their next. Tokens are deterministic, seeded by the prompt
   ids, so a request's output does not depend on batching, streaming or preemption.
6. **Finish** requests that reached ``max_tokens`` (``pool.finish``). Before their completion
   is delivered, the publisher is flushed: a request's events are on the wire before its HTTP
   response ends, as with real vLLM (the router relies on it).

``reset_prefix_cache`` is forwarded to the pool; the resulting ``AllBlocksCleared`` goes out
with the next step's batch, so an idle replica publishes it when the next request runs
(spec §2.5).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from gpu_emitter.cost_model import CostModel
from gpu_emitter.tokenizer import NUM_WORDS, WORD_OFFSET

__all__ = [
    "BlockPool",
    "CapacityError",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EngineStats",
    "EventSink",
    "Histogram",
    "RequestHandle",
    "generated_token",
]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


class BlockPool(Protocol):
    """What the engine needs from ``gpu_emitter.hybrid_pool.HybridBlockPool``."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    def admit(
        self, req_id: str, token_ids: Sequence[int], keys: Any = None, *, skip_reading: bool = False
    ) -> int | None: ...
    def compute_prefill(self, req_id: str) -> None: ...
    def append_tokens(self, req_id: str, new_token_ids: Sequence[int]) -> bool: ...
    def finish(self, req_id: str) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_events(self) -> list[Any]: ...


class EventSink(Protocol):
    """What the engine needs from ``events.publisher.EventPublisher``."""

    def publish(self, events: Sequence[Any]) -> int: ...
    def flush(self, timeout: float | None = 5.0) -> bool: ...


class EngineError(RuntimeError):
    """A request the engine could not serve; the message says why and what to change."""


class CapacityError(EngineError):
    """The request needs more KV blocks than the whole pool has."""


class EngineClosedError(EngineError):
    """The engine was stopped before the request finished."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prompt_seed(prompt_token_ids: Sequence[int]) -> int:
    """A 64-bit seed that identifies the prompt (its ids, hashed with xxh64)."""
    return xxhash.xxh64_intdigest(array.array("q", prompt_token_ids).tobytes())


def generated_token(seed: int, index: int) -> int:
    """Output token ``index`` of a request whose prompt has ``seed``: always a ``wN`` word of
    the builtin vocabulary, never a special token, so generated text re-encodes to the same
    ids (multi-turn prompts that quote earlier completions hash the same blocks)."""
    return WORD_OFFSET + _splitmix64(seed + index) % NUM_WORDS


TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)


class Histogram:
    """A Prometheus histogram's state: per-bucket counts (not cumulative), sum and count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


@dataclass
class EngineStats:
    """Counters behind ``/metrics`` (vLLM's names are given where they differ)."""

    prompt_tokens: int = 0
    """``vllm:prompt_tokens_total``: prompt tokens of requests admitted (first admission)."""
    generation_tokens: int = 0
    """``vllm:generation_tokens_total``."""
    prefix_cache_queries: int = 0
    """``vllm:prefix_cache_queries_total``: tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """``vllm:prefix_cache_hits_total``: tokens found."""
    preemptions: int = 0
    """``vllm:num_preemptions_total``."""
    finished: dict[str, int] = field(default_factory=dict)
    """``vllm:request_success_total`` by ``finished_reason``."""
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    """``vllm:time_to_first_token_seconds`` (queueing included)."""
    steps: int = 0
    batches_published: int = 0


class RequestHandle:
    """One submitted request: iterate :meth:`stream` for token deltas or await
    :meth:`result`; the engine fills the fields below as it runs."""

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        skip_reading: bool,
        keys: Any = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.skip_reading = skip_reading
        self.keys = keys
        """What besides the token ids enters its block hashes (``events.hashing.RequestKeys``:
        LoRA adapter, cache salt), or None."""
        self.output_token_ids: list[int] = []
        self.cached_tokens: int | None = None
        """The local prefix-cache hit of the first admission (vLLM's ``num_cached_tokens``)."""
        self.finish_reason: str | None = None
        self.error: EngineError | None = None
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.num_preemptions = 0
        self._seed = prompt_seed(prompt_token_ids)
        self._queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self._aborted = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token (queueing included)."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    def _all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def _sample(self) -> int:
        tok = generated_token(self._seed, len(self.output_token_ids))
        self.output_token_ids.append(tok)
        return tok

    async def stream(self) -> AsyncIterator[list[int]]:
        """Token deltas (one list per engine step) until the request finishes; raises the
        request's :class:`EngineError` if it failed. Read it once."""
        while True:
            item = await self._queue.get()
            if item is None:
                if self.error is not None:
                    raise self.error
                return
            yield item

    async def result(self) -> list[int]:
        """All output token ids, once the request has finished (raises its error)."""
        async for _ in self.stream():
            pass
        return self.output_token_ids


class Engine:
    """The scheduler loop over a block pool (see the module docstring).

    Args:
        pool: the hybrid block pool (``HybridBlockPool`` or a stand-in with its methods).
        publisher: where each step's events go (an ``EventPublisher``), or ``None`` to drop
            them (benchmarks of the HTTP layer alone).
        cost: the timing model.
        max_num_seqs: at most this many requests run at once (vLLM ``--max-num-seqs``).
        flush_timeout: seconds to wait for the publisher to send a finishing request's
            events before its completion is delivered anyway (logged).
    """

    def __init__(
        self,
        pool: BlockPool,
        publisher: EventSink | None,
        *,
        cost: CostModel | None = None,
        max_num_seqs: int = 256,
        flush_timeout: float = 5.0,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.pool = pool
        self.publisher = publisher
        self.cost = cost if cost is not None else CostModel()
        self.max_num_seqs = max_num_seqs
        self.flush_timeout = flush_timeout
        self.stats = EngineStats()
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[RequestHandle] = []
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._unflushed = False
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop task on the running event loop."""
        if self._task is not None:
            raise RuntimeError("engine already started")
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="replica-engine")

    async def stop(self) -> None:
        """Stop the loop and fail every unfinished request with :class:`EngineClosedError`."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in self._running:
            # Give the blocks back: a pool that outlives its engine (a replica whose HTTP
            # front restarts) must not keep them held by requests nobody will finish.
            self.pool.finish(req.req_id)
        for req in [*self._running, *self._waiting]:
            self._fail(req, EngineClosedError("the replica is shutting down"))
        self._running.clear()
        self._waiting.clear()

    # -- requests ---------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        skip_reading: bool = False,
        req_id: str | None = None,
        keys: Any = None,
    ) -> RequestHandle:
        """Queue a request (FIFO) and return its handle. ``keys``: its extra hash keys
        (``events.hashing.RequestKeys``), as vLLM derives them from the LoRA adapter and the
        cache salt."""
        if self._closed:
            raise EngineClosedError("the replica is shutting down")
        if self._task is None or self._wake is None:
            raise RuntimeError("engine not started: call Engine.start() inside the event loop")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty; a request needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        rid = req_id if req_id is not None else f"req-{next(self._ids)}"
        req = RequestHandle(rid, list(prompt_token_ids), max_tokens, skip_reading, keys)
        self._waiting.append(req)
        self._wake.set()
        return req

    def abort(self, req: RequestHandle) -> None:
        """Drop a request (its client went away); its blocks are freed. Idempotent."""
        if req.done or req._aborted:
            return
        req._aborted = True
        if req in self._running:
            self._running.remove(req)
            self.pool.finish(req.req_id)
        elif req in self._waiting:
            self._waiting.remove(req)
        req.finish_reason = "abort"
        req._queue.put_nowait(None)

    def reset_prefix_cache(self) -> bool:
        """Forward to the pool; False when blocks are in use (vLLM refuses then)."""
        return bool(self.pool.reset_prefix_cache())

    # -- the loop ---------------------------------------------------------------------

    async def _run(self) -> None:
        wake = self._wake
        if wake is None:  # pragma: no cover - start() sets it
            raise RuntimeError("engine not started")
        while True:
            if not self._running and not self._waiting:
                wake.clear()
                await wake.wait()
                continue
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a pool bug must not hang every client
                log.exception("engine step failed; failing every request")
                running, waiting = [*self._running], [*self._waiting]
                self._running.clear()
                self._waiting.clear()
                for req in running:
                    with contextlib.suppress(Exception):
                        self.pool.finish(req.req_id)
                for req in (*running, *waiting):
                    self._fail(req, EngineError(f"engine step failed: {exc!r}"))

    async def _step(self) -> None:
        pool = self.pool
        self.stats.steps += 1
        decoding = [req for req in list(self._running) if self._reserve_slot(req)]
        admitted: list[RequestHandle] = []
        prefill_tokens = 0
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            tokens = req._all_token_ids()
            hit = pool.admit(req.req_id, tokens, req.keys, skip_reading=req.skip_reading)
            if hit is None:
                if not self._running:
                    self._waiting.popleft()
                    self._fail(req, self._capacity_error(len(tokens)))
                    continue
                break
            self._waiting.popleft()
            self._running.append(req)
            admitted.append(req)
            pool.compute_prefill(req.req_id)
            prefill_tokens += len(tokens) - hit
            if req.cached_tokens is None:
                req.cached_tokens = hit
                self.stats.prompt_tokens += len(req.prompt_token_ids)
                if not req.skip_reading:
                    self.stats.prefix_cache_queries += len(tokens)
                    self.stats.prefix_cache_hits += hit
        self._publish()

        delay = self.cost.step_seconds(prefill_tokens, bool(decoding))
        await asyncio.sleep(delay)

        now = time.monotonic()
        finished: list[RequestHandle] = []
        deltas: list[tuple[RequestHandle, int]] = []
        for req in (*decoding, *admitted):
            if req._aborted or req not in self._running:
                continue  # aborted or preempted during the step's compute
            deltas.append((req, req._sample()))
            self.stats.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = now
                self.stats.ttft.observe(now - req.arrival)
            if len(req.output_token_ids) >= req.max_tokens:
                finished.append(req)
        for req in finished:
            self._running.remove(req)
            pool.finish(req.req_id)
        if finished and self._unflushed and self.publisher is not None:
            ok = await asyncio.to_thread(self.publisher.flush, self.flush_timeout)
            if not ok:
                log.warning("event publisher did not drain within %.1fs", self.flush_timeout)
            self._unflushed = False
        for req, tok in deltas:
            if not req._aborted:
                req._queue.put_nowait([tok])
        for req in finished:
            if req._aborted:
                continue
            req.finish_reason = "length"
            req.finished_at = time.monotonic()
            self.stats.finished["length"] = self.stats.finished.get("length", 0) + 1
            req._queue.put_nowait(None)

    def _publish(self) -> None:
        events = self.pool.take_events()
        if not events or self.publisher is None:
            return
        self.publisher.publish(events)
        self.stats.batches_published += 1
        self._unflushed = True

    def _reserve_slot(self, req: RequestHandle) -> bool:
        """Make room for ``req``'s last sampled token, preempting from the back (vLLM FCFS);
        False when ``req`` itself had to be preempted."""
        if req not in self._running:
            return False  # preempted earlier in this step
        last = req.output_token_ids[-1:]
        while not self.pool.append_tokens(req.req_id, last):
            victim = self._running.pop()
            self.pool.finish(victim.req_id)
            victim.num_preemptions += 1
            self.stats.preemptions += 1
            self._waiting.appendleft(victim)
            if victim is req:
                return False
        return True

    def _capacity_error(self, num_tokens: int) -> CapacityError:
        return CapacityError(
            f"a request of {num_tokens} tokens does not fit in the replica's KV cache "
            f"({self.pool.num_blocks} blocks) even with nothing else running; "
            "start the replica with more --num-blocks or send a shorter prompt"
        )

    def _fail(self, req: RequestHandle, error: EngineError) -> None:
        if req.done:
            return
        req.error = error
        req.finished_at = time.monotonic()
        self.stats.finished["error"] = self.stats.finished.get("error", 0) + 1
        req._queue.put_nowait(None)
