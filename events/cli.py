"""``kvrouter events tail``: print a replica's KV events (placeholder until the SDK lands)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoint", help="the replica's PUB endpoint, e.g. tcp://127.0.0.1:5557")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvrouter events tail: not implemented yet")
