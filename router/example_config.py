"""``kvrouter config example``: print a router.toml with every knob, its default and its meaning.

The file is written by hand (``router/router.example.toml``, package data) rather than generated
from the Structs: the comments are the point, and attribute docstrings are not introspectable at
run time. tests/test_config_example.py keeps it honest: every field of every Struct reachable
from :class:`router.config.RouterConfig` appears in it (set, or commented out when it has no
TOML value), every value set is the default, and it parses and passes ``--check``.
"""

from __future__ import annotations

import argparse
import sys
from importlib.resources import files

__all__ = ["EXAMPLE", "add_arguments", "example_text", "run"]

#: The file's name inside the ``router`` package.
EXAMPLE = "router.example.toml"


def example_text() -> str:
    """The commented example config."""
    return files("router").joinpath(EXAMPLE).read_text(encoding="utf-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write it to FILE (refused if FILE exists) instead of standard output",
    )


def run(args: argparse.Namespace) -> int:
    text = example_text()
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "x", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        print(
            f"kvrouter config example: cannot write {args.output}: {exc.strerror}", file=sys.stderr
        )
        return 2
    print(f"wrote {args.output}: edit [[pools]], then kvrouter serve --config {args.output}")
    return 0
