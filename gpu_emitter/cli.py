"""``kvrouter replica``: run a simulated vLLM replica (OpenAI API + vLLM KV events).

A hybrid block pool (``gpu_emitter.hybrid_pool``, torch tensors) behind vLLM's scheduling
rules (``gpu_emitter.engine``), a vLLM-compatible event publisher (``events.publisher``) and
the HTTP server (``gpu_emitter.server``). Torch is imported only when the command runs, so
``kvrouter --help`` stays torch-free.

Event endpoints follow vLLM's rule (spec §3): the PUB socket binds when the endpoint contains
``*`` or ``::`` and otherwise *connects* (the subscriber must then bind); ``--events-bind``
forces binding, e.g. ``--events-endpoint tcp://127.0.0.1:5601 --events-bind`` binds on
loopback only. The replay endpoint always binds. Both are offset by ``--dp-rank`` as vLLM
offsets each data-parallel rank's ports.

On start the command prints one line per address (``http``, ``events``, ``replay``) with the
ports actually bound (``--port 0`` and ``tcp://...:*`` pick free ones), then serves until
SIGINT or SIGTERM, after which it drains, closes the publisher and exits 0. Exit 2: bad
option, unknown layout, or an address that cannot be bound.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["add_arguments", "event_source", "run"]

log = logging.getLogger("kvrouter.replica")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True, help="HTTP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument(
        "--layout",
        required=True,
        metavar="NAME_OR_PATH",
        help="the model's KV-cache groups: a shipped layout name (fa, fa_swa, gemma3, "
        "fa_mamba) or a layout file (see gpu_emitter.layouts)",
    )
    parser.add_argument(
        "--events-endpoint",
        default="tcp://*:5557",
        metavar="E",
        help="KV-event PUB endpoint, as vLLM's kv-events-config endpoint (default tcp://*:5557)",
    )
    parser.add_argument(
        "--replay-endpoint",
        metavar="E",
        help="replay ROUTER endpoint (always bound), e.g. tcp://*:5558; default: no replay",
    )
    parser.add_argument(
        "--events-bind",
        action="store_true",
        help="bind the PUB endpoint even without * or :: in it (vLLM would connect)",
    )
    parser.add_argument("--topic", default="", help="event topic (default empty)")
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=2048,
        metavar="N",
        help="KV blocks in the pool, shared by all groups (default 2048)",
    )
    parser.add_argument(
        "--model",
        default="kvrouter-sim",
        metavar="NAME",
        help="served model name (default kvrouter-sim)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        metavar="N",
        help="requests running at once (default 256)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        metavar="N",
        help="prompt + output tokens per request (default 4096)",
    )
    parser.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=0.2,
        metavar="X",
        help="simulated prefill time per uncached prompt token (default 0.2)",
    )
    parser.add_argument(
        "--decode-ms-per-step",
        type=float,
        default=20.0,
        metavar="Y",
        help="simulated time of one decode step for the batch (default 20)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="multiply all simulated times (0: no simulated compute)",
    )
    parser.add_argument(
        "--dp-rank",
        type=int,
        default=0,
        metavar="N",
        help="data-parallel rank: offsets both event ports (default 0)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served besides the model, as vLLM's flag takes them: a request "
        "whose model is NAME hashes its blocks with ('lora', NAME, PATH)",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )


def _fail(message: str) -> int:
    print(f"kvrouter replica: {message}", file=sys.stderr)
    return 2


def event_source(publisher: Any, configured: str, configured_replay: str | None) -> dict[str, Any]:
    """One ``/kv_event_sources`` entry: what was configured and what is in use."""
    return {
        "data_parallel_rank": publisher.data_parallel_rank,
        "endpoint": publisher.endpoint,
        "replay_endpoint": publisher.replay_endpoint,
        "configured_endpoint": configured,
        "configured_replay_endpoint": configured_replay,
        "topic": publisher.topic,
        "binds": publisher.binds,
    }


def _check(args: argparse.Namespace) -> str | None:
    checks = [
        (0 <= args.port <= 65535, "--port must be 0..65535"),
        (args.num_blocks >= 2, "--num-blocks must be >= 2 (one block is the null block)"),
        (args.max_num_seqs >= 1, "--max-num-seqs must be >= 1"),
        (args.max_model_len >= 2, "--max-model-len must be >= 2"),
        (args.prefill_ms_per_token >= 0, "--prefill-ms-per-token must be >= 0"),
        (args.decode_ms_per_step >= 0, "--decode-ms-per-step must be >= 0"),
        (args.time_scale >= 0, "--time-scale must be >= 0"),
        (args.dp_rank >= 0, "--dp-rank must be >= 0"),
        (bool(args.model.strip()), "--model must not be empty"),
    ]
    return next((msg for ok, msg in checks if not ok), None)


def bind_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket for uvicorn; public so in-process replicas in tests bind alike."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY on accepted connections
    # only then, and without it every response with a body waits ~40 ms (Nagle + delayed
    # ACK between uvicorn's header and body writes).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT/SIGTERM end it with exit code 0: uvicorn
        re-raises the signal after a graceful shutdown, which would turn a clean stop into
        a KeyboardInterrupt traceback or a death by SIGTERM. A second signal forces exit."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def stop(sig: int, frame: Any) -> None:
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True

            old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server


def _lora_modules(specs: list[str]) -> dict[str, str] | str:
    """``NAME=PATH`` pairs as a dict, or the problem with one of them."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            return f"--lora-modules {spec!r}: give NAME=PATH (as vLLM's --lora-modules takes it)"
        if name in out:
            return f"--lora-modules: adapter {name!r} given twice"
        out[name] = path
    return out


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        return _fail(problem)
    lora = _lora_modules(args.lora_modules)
    if isinstance(lora, str):
        return _fail(lora)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    from gpu_emitter.layouts import load_layout

    try:
        layout = load_layout(args.layout)
    except Exception as exc:  # the loader's own message names the shipped layouts
        return _fail(f"--layout {args.layout!r}: {exc}")

    from events.publisher import EndpointError, EventPublisher
    from gpu_emitter.cost_model import CostModel
    from gpu_emitter.engine import Engine
    from gpu_emitter.hybrid_pool import HybridBlockPool  # imports torch: after the checks
    from gpu_emitter.server import ReplicaInfo, create_app

    try:
        pool = HybridBlockPool(layout, args.num_blocks)
    except Exception as exc:
        return _fail(f"cannot build a pool of {args.num_blocks} blocks for this layout: {exc}")

    try:
        http_sock = bind_http(args.host, args.port)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc}")
    try:
        publisher = EventPublisher(
            args.events_endpoint,
            replay_endpoint=args.replay_endpoint,
            topic=args.topic,
            data_parallel_rank=args.dp_rank,
            bind=True if args.events_bind else None,
        )
    except EndpointError as exc:
        http_sock.close()
        return _fail(str(exc))

    cost = CostModel(
        prefill_s_per_token=args.prefill_ms_per_token / 1000.0,
        decode_s_per_step=args.decode_ms_per_step / 1000.0,
        time_scale=args.time_scale,
    )
    engine = Engine(pool, publisher, cost=cost, max_num_seqs=args.max_num_seqs)
    info = ReplicaInfo(
        model_name=args.model,
        max_model_len=args.max_model_len,
        data_parallel_rank=args.dp_rank,
        event_sources=[event_source(publisher, args.events_endpoint, args.replay_endpoint)],
        lora_modules=lora,
    )
    app = create_app(engine, info, on_shutdown=publisher.close)

    import uvicorn

    server_class = _server_class()
    host, port = http_sock.getsockname()[:2]
    print(f"http http://{host}:{port}", flush=True)
    print(f"events {publisher.endpoint}", flush=True)
    print(f"replay {publisher.replay_endpoint}", flush=True)
    if not publisher.binds:
        print(
            f"kvrouter replica: the event PUB socket connects to {publisher.endpoint} (vLLM's "
            "rule for endpoints without * or ::): the subscriber must bind it; pass "
            "--events-bind to bind here instead",
            file=sys.stderr,
            flush=True,
        )
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on")
    server = server_class(config)
    try:
        server.run(sockets=[http_sock])
    finally:
        publisher.close()  # idempotent; covers a failed startup
        http_sock.close()
    return 0
