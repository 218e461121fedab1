"""kvrouter in front of simulated vLLM replicas, all in this process, over real loopback.

Each :class:`SimReplica` is the simulated vLLM of ``kvrouter replica`` built in-process (as
``tests/test_replica_server.py``'s ``Replica`` does, but over a hybrid pool): a
:class:`gpu_emitter.hybrid_pool.HybridBlockPool` (full attention + sliding window 48, 16-token
blocks, vLLM's default retention 0) behind :class:`gpu_emitter.engine.Engine`, publishing its
KV events on a real ZeroMQ :class:`events.publisher.EventPublisher` bound on 127.0.0.1, and
served over HTTP by uvicorn on a thread. Its HTTP server can be stopped (the port then refuses
connections) and started again on the same port over the same pool and publisher, so a test
can kill a replica's front end and bring it back with its cache intact; or the whole replica
can be killed (HTTP and publisher) and restarted on the same ports with an empty cache and
sequence numbers from 0, as vLLM restarts. Each replica counts the POSTs it receives.

:class:`SimCluster` starts three of them and the router (``router.server.app.create_app`` over
``router.config.parse_config``) on its own uvicorn thread, subscribed to their events.
Every server binds its own socket first (no free-port race) and is stopped with a deadline.
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from typing import Any

import httpx
import zmq

from events.endpoints import EndpointError
from events.layout import GroupKind, GroupSpec, ModelLayout
from events.publisher import EventPublisher
from gpu_emitter import tokenizer as bt
from gpu_emitter.cli import event_source
from gpu_emitter.cost_model import CostModel
from gpu_emitter.engine import Engine
from gpu_emitter.hybrid_pool import HybridBlockPool
from gpu_emitter.server import ReplicaInfo, create_app
from gpu_emitter.shared_store import SharedStore
from router.config import RouterConfig, parse_config
from router.server.app import create_app as create_router_app
from tests.fake_replica import ServerThread
from tests.zmq_helpers import LOOPBACK, wait_for

__all__ = ["LAYOUT", "MODEL", "NAMES", "TOKEN", "SimCluster", "SimReplica", "words"]

MODEL = "sim-fa-swa"
TOKEN = "sim-admin-token"
NAMES = ("a", "b", "c")
#: Full attention is group 0, the sliding window group 1 (as in the shipped layout
#: gpu_emitter/layout_files/fa_swa.toml, with a 48-token window so that
#: need = ceil(47/16) = 3 blocks, spec §4.7).
LAYOUT = ModelLayout(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48),
    ),
    retention_interval=0,
)
FA = "full_attention[0]"
SWA = "sliding_window[1]"
"""Spec-group names as ``/admin/route/explain`` prints them (router.core.predict)."""


def words(rng: random.Random, n: int) -> str:
    """``n`` random in-vocabulary words: ``n`` tokens (plus BOS for a completion prompt)."""
    return " ".join(f"w{rng.randrange(bt.NUM_WORDS)}" for _ in range(n))


class SimReplica:
    """One simulated hybrid vLLM replica (module docstring)."""

    def __init__(
        self,
        name: str,
        num_blocks: int,
        max_model_len: int = 2048,
        buffer_steps: int = 10_000,
        *,
        max_num_seqs: int = 256,
        time_scale: float = 0.01,
        store: SharedStore | None = None,
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        """``max_num_seqs`` and ``time_scale`` are the engine's (a small batch and real-time
        steps make requests queue, as on a loaded replica); ``store`` a store shared with
        other replicas (gpu_emitter.shared_store); ``lora_modules`` the LoRA adapters it
        serves (name -> path, as vLLM's --lora-modules)."""
        self.lora_modules = dict(lora_modules or {})
        self.name = name
        self.max_num_seqs = max_num_seqs
        self.time_scale = time_scale
        self.num_blocks = num_blocks
        self.buffer_steps = buffer_steps
        self.store = store
        self.pool = HybridBlockPool(LAYOUT, num_blocks, store=store)
        self.publisher = EventPublisher(
            LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=buffer_steps
        )
        self.publishing = True
        # /kv_event_sources as ``kvrouter replica`` reports it
        sources = [event_source(self.publisher, LOOPBACK, LOOPBACK)]
        self.info = ReplicaInfo(
            MODEL, max_model_len, event_sources=sources, lora_modules=self.lora_modules
        )
        self.http: ServerThread | None = None
        self.port = 0
        self.received: Counter[str] = Counter()
        """POSTs received, by path (completions, chat), across HTTP restarts."""
        self.sick = False
        """Answer ``GET /health`` with 503 while the rest serves, as vLLM does when its engine
        died under a live API server."""
        try:
            self.start_http()
        except BaseException:
            self.publisher.close()
            raise
        self.client = httpx.Client(base_url=self.url, timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_http(self) -> None:
        """Serve the pool over HTTP (again) on the same port. A fresh engine each time: an
        engine stops with its server's lifespan; the pool, its cache and the publisher (with
        its sequence numbers) carry over, as a restarted API front end over a live cache."""
        if self.http is not None:
            raise RuntimeError(f"replica {self.name} is already serving")
        engine = Engine(
            self.pool,
            self.publisher,
            cost=CostModel(time_scale=self.time_scale),
            max_num_seqs=self.max_num_seqs,
        )
        # No on_shutdown: the publisher must outlive an HTTP stop; close() closes it.
        app = create_app(engine, self.info)
        received = self.received

        async def counted(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                received[scope["path"]] += 1
            elif scope["type"] == "http" and scope["path"] == "/health" and self.sick:
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            await app(scope, receive, send)

        self.http = ServerThread(counted, self.port).start()
        self.port = self.http.port

    def stop_http(self) -> None:
        """Stop the HTTP server: connections to its port are refused from then on. Requests in
        flight fail (the engine stops with the server and gives their blocks back)."""
        if self.http is not None:
            http, self.http = self.http, None
            http.stop()

    def kill(self) -> None:
        """The whole replica goes: its HTTP server and its event publisher (the cache with
        them, as a vLLM process that dies)."""
        self.stop_http()
        self.stop_events()

    def stop_events(self) -> None:
        """Close the event publisher (the router's stream loses its connection)."""
        if self.publishing:
            self.publishing = False
            self.publisher.close()

    def restart(self, timeout: float = 10.0) -> None:
        """A fresh replica on the same ports, as vLLM restarts: an empty cache, a new
        publisher numbering its batches from 0 (and its replay ring empty), HTTP again."""
        self.kill()
        endpoint, replay = self.publisher.endpoint, self.publisher.replay_endpoint
        self.pool = HybridBlockPool(LAYOUT, self.num_blocks, store=self.store)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.publisher = EventPublisher(
                    endpoint, replay_endpoint=replay, buffer_steps=self.buffer_steps, bind=True
                )
                break
            except (zmq.ZMQError, EndpointError):  # the old sockets' ports not released yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)  # bounded retry of a bind, not synchronisation
        self.publishing = True
        # a new process: a new start time (process_start_time_seconds), the router's epoch
        sources = [event_source(self.publisher, LOOPBACK, LOOPBACK)]
        self.info = ReplicaInfo(
            MODEL,
            self.info.max_model_len,
            event_sources=sources,
            lora_modules=self.lora_modules,
        )
        self.start_http()

    def close(self) -> None:
        self.client.close()
        try:
            self.stop_http()
        finally:
            self.stop_events()


def router_toml(replicas: dict[str, SimReplica]) -> str:
    """The router's config: one pool, the layout declared (checked against every event), the
    builtin tokenizer (the simulated replica's own), one entry per replica."""
    groups = ", ".join(
        f'{{kind = "{g.kind}", block_size = {g.block_size}'
        + (f", sliding_window = {g.sliding_window}" if g.sliding_window else "")
        + "}"
        for g in LAYOUT.groups
    )
    lines = [
        "[server]",
        f'admin_token = "{TOKEN}"',
        "metrics_scrape_interval_s = 0.5",
        "[[pools]]",
        f'model = "{MODEL}"',
        "[pools.tokenizer]",
        'strategy = "builtin"',
        "[pools.layout]",
        f"groups = [{groups}]",
        f"retention_interval = {LAYOUT.retention_interval}",
    ]
    for name, rep in replicas.items():
        lines += [
            "[[pools.replicas]]",
            f'name = "{name}"',
            f'url = "{rep.url}"',
            f'event_endpoint = "{rep.publisher.endpoint}"',
            f'replay_endpoint = "{rep.publisher.replay_endpoint}"',
        ]
    return "\n".join(lines) + "\n"


class SimCluster:
    """Three :class:`SimReplica` and the router in front of them."""

    def __init__(
        self,
        num_blocks: int,
        *,
        names: tuple[str, ...] = NAMES,
        buffer_steps: int = 10_000,
        router: bool = True,
        extra_toml: str = "",
        **engine: Any,
    ) -> None:
        """``router=False`` starts the replicas only; :meth:`start_router` attaches it later
        (after the replicas have published more than their ``buffer_steps`` ring holds).
        ``extra_toml`` is appended to the router's config (e.g. a ``[health]`` table);
        ``engine`` goes to every :class:`SimReplica` (``max_num_seqs``, ``time_scale``)."""
        self.replicas: dict[str, SimReplica] = {}
        self.router: ServerThread | None = None
        self.http: httpx.Client | None = None
        self.admin = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
        self.extra_toml = extra_toml
        try:
            for name in names:
                self.replicas[name] = SimReplica(
                    name, num_blocks, buffer_steps=buffer_steps, **engine
                )
            self.config: RouterConfig = parse_config(router_toml(self.replicas) + extra_toml)
            if router:
                self.start_router()
        except BaseException:
            self.close()
            raise

    def start_router(self, extra_toml: str = "") -> None:
        """Start (or restart) the router; ``extra_toml`` is appended to its config (e.g. an
        ``[index]`` table), after the cluster's own."""
        if self.router is not None:
            raise RuntimeError("the router is already running")
        self.config = parse_config(router_toml(self.replicas) + self.extra_toml + extra_toml)
        self.app = create_router_app(self.config)
        self.router = ServerThread(self.app).start()
        self.http = httpx.Client(base_url=self.router.url, timeout=30)

    def stop_router(self) -> None:
        """Stop the router (its lifespan ends: subscribers close, a configured snapshot is
        written); the replicas keep running."""
        if self.http is not None:
            self.http.close()
            self.http = None
        if self.router is not None:
            router, self.router = self.router, None
            router.stop()

    @property
    def client(self) -> httpx.Client:
        if self.http is None:
            raise RuntimeError("the cluster is closed")
        return self.http

    def direct(self, name: str) -> httpx.Client:
        """An HTTP client of replica ``name`` itself (bypassing the router)."""
        return self.replicas[name].client

    def route(self, prompt: str) -> str:
        """Send a 2-token completion through the router; the replica that served it."""
        r = self.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        if r.status_code != 200:
            raise AssertionError(f"completion failed: {r.status_code} {r.text}")
        return r.headers["x-kvrouter-replica"]

    # -- admin API ------------------------------------------------------------------------

    def explain(self, **body: Any) -> dict[str, Any]:
        r = self.client.post(
            "/admin/route/explain", json={"model": MODEL, **body}, headers=self.admin
        )
        if r.status_code != 200:
            raise AssertionError(f"explain failed: {r.status_code} {r.text}")
        return r.json()

    def rows(self, **body: Any) -> dict[str, dict[str, Any]]:
        """The explain rows by replica name."""
        return {row["replica"]: row for row in self.explain(**body)["replicas"]}

    def caught_up(self, name: str, http: httpx.Client | None = None) -> bool:
        """Whether the router (or the one ``http`` talks to) has applied every batch replica
        ``name`` has published."""
        pub = self.replicas[name].publisher
        if not pub.flush(5):
            return False
        target = pub.next_seq - 1
        if target < 0:
            return True
        r = (http or self.client).get("/admin/events", headers=self.admin)
        if r.status_code != 200:
            raise AssertionError(f"/admin/events failed: {r.status_code} {r.text}")
        (stream,) = [s for s in r.json()["streams"] if s["replica"] == name]
        stats = stream["stream_stats"]
        return stats is not None and stats["last_seq"] == target

    def sync(self, name: str, timeout: float = 20.0) -> None:
        wait_for(lambda: self.caught_up(name), timeout, f"the router to apply {name}'s events")

    def replica_row(self, name: str) -> dict[str, Any]:
        """Replica ``name``'s row of ``/admin/replicas``."""
        r = self.client.get("/admin/replicas", headers=self.admin)
        (rep,) = [x for x in r.json()["replicas"] if x["name"] == name]
        return rep

    def health(self, name: str) -> dict[str, Any]:
        """Replica ``name``'s health as ``/admin/replicas`` shows it (router.core.health)."""
        return self.replica_row(name)["health"]

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the router's ``/metrics`` (0 when the series does not exist yet)."""
        text = self.client.get("/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the router first (its subscribers close), then every replica; raise the
        first failure only after trying them all."""
        errors: list[BaseException] = []
        if self.http is not None:
            self.http.close()
            self.http = None
        if self.router is not None:
            try:
                self.router.stop()
            except BaseException as exc:
                errors.append(exc)
            self.router = None
        for rep in self.replicas.values():
            try:
                rep.close()
            except BaseException as exc:
                errors.append(exc)
        self.replicas.clear()
        if errors:
            raise errors[0]
