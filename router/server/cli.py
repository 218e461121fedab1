"""``kvrouter serve --config FILE``: run the router (flags > KVROUTER_* env > file)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="router TOML file")
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


def run(args: argparse.Namespace) -> int:
    from router.config import ConfigError, load_config

    flags = {
        "host": args.host,
        "port": args.port,
        "admin_token": args.admin_token,
        "api_key": args.api_key,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }
    try:
        config = load_config(args.config, flags=flags)
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
        print(f"{args.config}: ok ({len(config.pools)} pool(s))")
        return 0
    from router.server.app import create_app
    from router.server.http_server import make_server
    from router.server.logs import configure

    configure(config.server.log_level, config.server.log_format)
    app = create_app(config)
    server = make_server(app, config.server, metrics=app.state.router.metrics)
    server.run()
    return 0 if server.started else 3  # 3: could not start (uvicorn.run's exit code)
