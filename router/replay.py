"""``kvrouter replay``: offline replay of a recorded event stream (placeholder)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="recording dir: meta.json, events-*.jsonl, requests.jsonl")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvrouter replay: not implemented yet")
