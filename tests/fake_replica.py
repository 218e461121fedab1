"""A minimal real-socket stand-in for a vLLM replica, and a uvicorn-in-a-thread server helper.

The fake serves the OpenAI routes the router proxies (JSON and SSE), ``/tokenize`` and
``/metrics``, and publishes on a real ZeroMQ :class:`EventPublisher` the ``BlockStored``
events vLLM would publish for each prompt (layout ``fa_swa``: full attention and a
sliding window of 48 tokens, 16-token blocks; FA stores every full block, SWA the last 4).
Its ``cached_tokens`` is the hit of what it holds, by a rule written out here for this one
layout (:meth:`FakeReplica.own_hit`) and not by the router's code, so a router test that
compares the router's prediction with it compares two independent implementations (plus
``lie_by`` when a test wants a mismatch). Test knobs: ``fail_status`` (answer 5xx),
``die_after_chunks`` (drop the connection mid-stream), ``evict_swa(prompt)``, ``stall``
(accept requests and never answer them, like a hung replica or a long non-streaming
generation), ``token_interval_s`` (stream one token per interval, like a real decode).
``disconnects`` records when a client (the router) closed a request before its answer was
complete, as vLLM notices it to abort the request: a stalled request ends when its
connection's ``http.disconnect`` arrives, a stream when Starlette cancels it on disconnect.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from events.hashing import BlockHasher
from events.layout import GroupKind, GroupSpec, ModelLayout
from events.publisher import EventPublisher
from events.schema import BlockRemoved, BlockStored
from gpu_emitter import tokenizer as bt
from gpu_emitter.cli import bind_http
from router.config import ServerConfig
from router.server.http_server import make_server

LAYOUT = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48),
    )
)
BLOCK = 16
"""Tokens per block in both groups (so the hash unit and the alignment are 16 too)."""
SWA_TAIL = 4
"""Sliding-window blocks the fake stores per prompt: the last 4 full blocks."""
SWA_NEED = 3
"""Blocks the window needs below a hit boundary: ceil((48 - 1) / 16) (spec §0.4, §4.4)."""
MODEL = "fake-model"
LOOPBACK = "tcp://127.0.0.1:*"


def fa_swa_events(
    wire: list[int], ids: list[int], block: int, swa_tail: int, window: int = 48
) -> list[BlockStored]:
    """The stores vLLM publishes for one prompt's first prefill on an FA + SWA replica with
    ``block``-token blocks: every full block in group 0, the last ``swa_tail`` in group 1;
    ``wire`` is the prompt's chain hashed at ``block`` tokens."""
    n = len(wire)
    common = dict(parent_block_hash=None, lora_id=None, medium="GPU", lora_name=None)
    return [
        BlockStored(
            block_hashes=wire, token_ids=ids[: n * block], block_size=block, group_idx=0,
            kv_cache_spec_kind="full_attention", **common,
        ),
        BlockStored(
            block_hashes=wire[max(0, n - swa_tail) :], token_ids=ids[: n * block],
            block_size=block, group_idx=1, kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=window, **common,
        ),
    ]  # fmt: skip


class FakeReplica:
    def __init__(self, name: str, *, model: str = MODEL) -> None:
        self.name = name
        self.model = model
        self.pub = EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
        self.hasher = BlockHasher(LAYOUT.hash, 16)
        self.fa: Counter[int] = Counter()
        """Full-attention blocks held: wire hash -> physical copies (spec §5.2 counts them)."""
        self.swa: Counter[int] = Counter()
        """Sliding-window blocks held, likewise."""
        self.lock = threading.Lock()
        self.fail_status: int | None = None
        self.die_after_chunks: int | None = None
        self.lie_by = 0
        self.others_running = 0
        """Running requests of other clients that ``/metrics`` reports on top of the router's."""
        self.metrics_status: int | None = None
        """Answer ``/metrics`` with this status (and no metrics) instead."""
        self.requests = 0
        self.last_headers: dict[str, str] = {}
        self.stall = False
        self.token_interval_s = 0.0
        self.held = 0
        """Requests being held now by ``stall`` or in a stream still going."""
        self.disconnects: list[float] = []
        """``time.monotonic()`` of each request whose client left before the answer ended."""
        self.app = self._build()

    # ---------------------------------------------------------------- cache

    def _events_for(self, ids: list[int]) -> list[Any]:
        return fa_swa_events(self.hasher.wire_chain(ids), ids, BLOCK, SWA_TAIL)

    def own_hit(self, ids: list[int]) -> int:
        """The prefix-cache hit of ``ids`` on what this fake holds now.

        Spec §0.4/§4.5 for this layout (FA + SWA window 48, both 16-token blocks, alignment
        16, no EAGLE): the largest ``L``, a multiple of 16 and at most ``len(ids) - 1``, such
        that

        * full attention holds every block ``0 .. L/16 - 1`` (a contiguous run from block 0),
        * the sliding window holds the ``need = ceil(47/16) = 3`` blocks ending at ``L``,
          i.e. blocks ``max(0, L/16 - 3) .. L/16 - 1`` (all of them from block 0 when
          ``L < 48``).

        ``L = 0`` always qualifies. Block ``j``'s hash is the chain hash at token
        ``16*(j+1)``, the same value in both groups (spec §1.4)."""
        wire = self.hasher.wire_chain(ids)
        best = 0
        for blocks in range(1, (len(ids) - 1) // BLOCK + 1):
            if not all(self.fa[h] > 0 for h in wire[:blocks]):
                break  # FA is a run from block 0: no longer L can qualify either
            if all(self.swa[h] > 0 for h in wire[max(0, blocks - SWA_NEED) : blocks]):
                best = blocks * BLOCK
        return best

    def _hold(self, wire: list[int]) -> None:
        """Store ``wire``'s blocks as :meth:`_events_for` announces them."""
        self.fa.update(wire)
        self.swa.update(wire[max(0, len(wire) - SWA_TAIL) :])

    def serve_prompt(self, ids: list[int]) -> int:
        """The hit of ``ids`` now, then cache it and publish the events (before answering,
        like vLLM)."""
        with self.lock:
            hit = self.own_hit(ids)
            evs = self._events_for(ids)
            self._hold(self.hasher.wire_chain(ids))
            self.pub.publish(evs)
        return hit

    def evict_swa(self, ids: list[int]) -> None:
        """Drop one copy of the sliding-window blocks of ``ids`` (the FA blocks stay), as
        vLLM does."""
        wire = self.hasher.wire_chain(ids)
        gone = wire[max(0, len(wire) - SWA_TAIL) :]
        ev = BlockRemoved(block_hashes=gone, medium="GPU", group_idx=1)
        with self.lock:
            self.swa.subtract(gone)
            self.swa = +self.swa  # unary + keeps only the positive counts
            self.pub.publish([ev])

    # ------------------------------------------------------------------ http

    def _build(self) -> FastAPI:
        app = FastAPI()

        def tokens(kind: str, body: dict[str, Any]) -> list[int]:
            if kind == "chat":
                return bt.encode_chat(body["messages"])
            p = body["prompt"]
            if isinstance(p, list):
                return p
            return bt.encode(p, body.get("add_special_tokens", True))

        async def complete(kind: str, request: Request) -> Response:
            self.requests += 1
            self.last_headers = dict(request.headers)
            if self.fail_status:
                return JSONResponse({"error": {"message": "boom"}}, status_code=self.fail_status)
            body_raw = await request.body()
            if self.stall:
                self.held += 1
                try:  # after the body, receive() returns only when the client has gone
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    self.disconnects.append(time.monotonic())
                finally:
                    self.held -= 1
                return Response(status_code=500)  # nobody is there to read it
            try:  # what vLLM would refuse with 400 (a fuzzer sends anything the schema allows)
                body = msgspec.json.decode(body_raw)
                self.last_body = body
                ids = tokens(kind, body)
                if not ids or not all(type(t) is int and 0 <= t < 1 << 31 for t in ids):
                    raise ValueError("prompt must be a non-empty text or list of token ids")
                n_out = min(64, max(1, int(body.get("max_tokens") or 4)))
            except Exception as exc:
                err = {"message": f"{type(exc).__name__}: {exc}", "type": "BadRequestError",
                       "param": None, "code": 400}  # fmt: skip
                return JSONResponse({"error": err}, status_code=400)
            hit = self.serve_prompt(ids) + self.lie_by
            words = [f"w{(ids[-1] + i) % 100}" for i in range(n_out)]
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": n_out,
                "total_tokens": len(ids) + n_out,
                "prompt_tokens_details": {"cached_tokens": hit},
            }
            obj = "chat.completion" if kind == "chat" else "text_completion"
            rid = f"cmpl-{len(ids)}-{ids[-1]}"
            if not body.get("stream"):
                choice = (
                    {"index": 0, "message": {"role": "assistant", "content": " ".join(words)}}
                    if kind == "chat"
                    else {"index": 0, "text": " ".join(words), "finish_reason": "length"}
                )
                return Response(
                    msgspec.json.encode(
                        {"id": rid, "object": obj, "model": self.model, "choices": [choice],
                         "usage": usage, "served_by": self.name}
                    ),
                    media_type="application/json",
                )  # fmt: skip
            include_usage = (body.get("stream_options") or {}).get("include_usage")
            die = self.die_after_chunks
            interval = self.token_interval_s

            async def gen():
                self.held += 1
                ended = False
                try:
                    for i, w in enumerate(words):
                        if die is not None and i >= die:
                            ended = True
                            raise RuntimeError("replica died mid-stream")
                        chunk = {
                            "id": rid, "object": obj + ".chunk", "model": self.model,
                            "choices": [{"index": 0, "text": (" " if i else "") + w}],
                        }  # fmt: skip
                        yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                        await asyncio.sleep(interval)  # the decode step of one token
                    if include_usage:
                        last = {"id": rid, "object": obj + ".chunk", "choices": [], "usage": usage}
                        yield b"data: " + msgspec.json.encode(last) + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    ended = True
                finally:
                    self.held -= 1
                    if not ended:  # cancelled: the client went away
                        self.disconnects.append(time.monotonic())

            return StreamingResponse(gen(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await complete("completion", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await complete("chat", request)

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            body = msgspec.json.decode(await request.body())
            if "messages" in body:
                ids = bt.encode_chat(
                    body["messages"],
                    body.get("add_generation_prompt", True),
                    body.get("add_special_tokens", False),
                )
            else:
                ids = bt.encode(body["prompt"], body.get("add_special_tokens", True))
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 4096})

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.metrics_status is not None:
                return Response(b"", status_code=self.metrics_status)
            text = (
                f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} '
                f"{float(self.others_running)}\n"
                f'vllm:num_requests_waiting{{engine="0",model_name="{self.model}"}} 0.0\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.model}"}} 0.1\n'
            )
            return Response(text, media_type="text/plain")

        @app.get("/health")
        async def health() -> Response:
            return Response(b"")

        return app

    def close(self) -> None:
        self.pub.close()


def free_port() -> int:
    # An explicit TCP socket (proto IPPROTO_TCP): asyncio only sets TCP_NODELAY on sockets
    # whose proto says TCP, and a 0-proto listener would stall small writes ~40 ms.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving an ASGI app on 127.0.0.1 in a thread, started and stopped with
    deadlines (no sleeps as synchronisation).

    The server is the one ``kvrouter serve`` runs (:func:`router.server.http_server.make_server`)
    with ``server``'s settings; by default, when ``app`` is the router's (``create_app``), its
    own ``config.server`` and metrics, as in production, else the defaults. The listening
    socket is bound here, before the thread starts (``port=None``: any free port, no
    pick-then-bind race; a given port is re-bound with SO_REUSEADDR, so a stopped server can
    take its port back), the way ``kvrouter replica`` binds its own."""

    def __init__(
        self, app: Any, port: int | None = None, *, server: ServerConfig | None = None
    ) -> None:
        self.sock = bind_http("127.0.0.1", port or 0)
        self.port: int = self.sock.getsockname()[1]
        router = getattr(getattr(app, "state", None), "router", None)  # a RouterState
        if server is None:
            server = router.config.server if router is not None else ServerConfig()
        metrics = router.metrics if router is not None else None
        self.server = make_server(app, server, metrics=metrics, log_level="warning")
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.005)  # polling another thread's flag, bounded by the deadline
        return self

    def stop(self, timeout: float = 20.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()
        if self.thread.is_alive():
            raise RuntimeError(f"server on {self.url} did not stop within {timeout}s")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
