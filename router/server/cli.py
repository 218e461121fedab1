"""``kvrouter serve``: run the router from a file (``--config FILE``) or, for the common case of
one pool, from flags alone (``--model M --replica URL[,...]``); then flags > KVROUTER_* env >
file or quick-start flags > defaults."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]

_EPILOG = """\
Either --config FILE or --model with one --replica per replica; not both (flags never add to
a file: a file says everything, so what runs is what it says). The server flags (--host,
--port, --admin-token, --api-key, --log-*) and KVROUTER_* env vars apply to either.

--replica URL[,events=tcp://H:P][,replay=tcp://H:P][,name=N][,dp_ranks=0+1]
          [,dp_rank_header=X-data-parallel-rank][,bind=true][,topic=T][,metrics_path=none]
  events/replay: the replica's --kv-events-config endpoint and replay_endpoint (rank 0's);
  name: defaults to HOST-PORT of the URL (http://10.0.0.7:8000 -> 10.0.0.7-8000).

Example:
  kvrouter serve --model Qwen/Qwen3-8B --policy kv --tokenizer remote \\
    --replica http://10.0.0.7:8000,events=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558 \\
    --replica http://10.0.0.8:8000,events=tcp://10.0.0.8:5557,replay=tcp://10.0.0.8:5558

Every other knob needs a file: `kvrouter config example` prints one with all of them."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    source = parser.add_argument_group("what to route (a file, or the quick-start flags)")
    source.add_argument("--config", metavar="FILE", help="router TOML file")
    source.add_argument("--model", help="quick start: the model name the replicas serve")
    source.add_argument(
        "--replica",
        action="append",
        metavar="URL[,key=value...]",
        help="quick start: one replica (repeat the flag for each; options below)",
    )
    source.add_argument(
        "--policy",
        choices=["kv", "round_robin", "least_load", "prefix_group_blind"],
        help="quick start: routing policy (default kv)",
    )
    source.add_argument(
        "--layout",
        metavar="FILE",
        help="quick start: the model's KV-cache layout file (as gpu_emitter/layout_files/*.toml); "
        "default: learned from the first events",
    )
    source.add_argument(
        "--tokenizer",
        metavar="builtin|remote|DIR",
        help="quick start: builtin (the simulated replica's), remote (each replica's "
        "/tokenize) or the directory of the replicas' tokenizer files (default builtin)",
    )
    parser.add_argument("--host", help="listen address (overrides server.host)")
    parser.add_argument("--port", type=int, help="listen port (overrides server.port)")
    parser.add_argument("--admin-token", help="bearer token of /admin (prefer the env var)")
    parser.add_argument(
        "--api-key",
        help="bearer key every /v1/* request must carry, as vLLM's --api-key "
        "(overrides server.api_key; prefer KVROUTER_API_KEY)",
    )
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="log level"
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text lines or one JSON object per line (overrides server.log_format)",
    )
    parser.add_argument(
        "--check", action="store_true", help="validate the config and exit (0 ok, 2 bad)"
    )


_QUICK = ("model", "replica", "policy", "layout", "tokenizer")


def _source_error(args: argparse.Namespace) -> str | None:
    """Why the flags name no config, or two (None when they name exactly one)."""
    quick = [f"--{f}" for f in _QUICK if getattr(args, f) is not None]
    if args.config is not None and quick:
        return (
            f"give either --config FILE or the quick-start flags, not both ({', '.join(quick)} "
            "given with --config): put those settings in the file instead"
        )
    if args.config is None and not (args.model and args.replica):
        missing = [f for f, v in (("--model", args.model), ("--replica", args.replica)) if not v]
        return (
            f"no config: give --config FILE, or --model and at least one --replica "
            f"(missing {' and '.join(missing)}; see kvrouter serve --help)"
        )
    return None


def run(args: argparse.Namespace) -> int:
    from router.config import ConfigError, effective_overrides, load_config
    from router.config_flags import config_from_flags

    flags = {
        "host": args.host,
        "port": args.port,
        "admin_token": args.admin_token,
        "api_key": args.api_key,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }
    problem = _source_error(args)
    if problem is not None:
        print(f"kvrouter serve: {problem}", file=sys.stderr)
        return 2
    try:
        if args.config is not None:
            config = load_config(args.config, flags=flags)
            source = args.config
        else:
            config = config_from_flags(
                args.model,
                args.replica,
                policy=args.policy,
                layout=args.layout,
                tokenizer=args.tokenizer,
                overrides=effective_overrides(flags=flags),
            )
            source = "flags"
    except ConfigError as exc:
        print(f"kvrouter serve: {exc}", file=sys.stderr)
        return 2
    from router.server.app import StartupError, check_startup

    try:
        check_startup(config)
    except StartupError as exc:
        print(f"kvrouter serve: {exc}", file=sys.stderr)
        return 2
    if args.check:
        replicas = sum(len(p.replicas) for p in config.pools)
        print(f"{source}: ok ({len(config.pools)} pool(s), {replicas} replica(s))")
        return 0
    from router.server.app import create_app
    from router.server.http_server import make_server
    from router.server.logs import configure

    configure(config.server.log_level, config.server.log_format)
    app = create_app(config)
    server = make_server(app, config.server, metrics=app.state.router.metrics)
    server.run()
    return 0 if server.started else 3  # 3: could not start (uvicorn.run's exit code)
