"""The ``kvrouter`` command line.

Each subcommand lives in the module that owns the capability; this file only assembles them,
importing a module when its command runs so ``kvrouter --help`` stays fast and torch-free.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (command words, module, one-line help). The module exposes
# ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("events", "tail"), "events.cli", "print the KV events a vLLM replica publishes"),
    (("replay",), "router.replay", "replay a recorded event stream and check hit predictions"),
    (("serve",), "router.serve_cli", "run the router: OpenAI proxy with KV-aware routing"),
    (("replica",), "gpu_emitter.cli", "run a simulated vLLM replica (OpenAI API + KV events)"),
    (("demo",), "router.demo", "simulated replicas + router + Mooncake workload: compare policies"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrouter",
        description="KV-cache-aware router for vLLM fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, module, help_text in COMMANDS:
        parent = sub
        for depth, word in enumerate(words[:-1]):
            key = " ".join(words[: depth + 1])
            if key not in groups:
                p = parent.add_parser(word, help=f"{word} commands")
                groups[key] = p.add_subparsers(dest=f"{word}_command", metavar="COMMAND")
            parent = groups[key]
        p = parent.add_parser(words[-1], help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
