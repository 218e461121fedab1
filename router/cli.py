"""The ``kvrouter`` command line.

Each subcommand lives in the package that owns the capability and registers itself as an entry
point of the group ``kvrouter.commands`` (``pyproject.toml``: name ``events.tail`` is
``kvrouter events tail``). This file only assembles them, and imports the module of the command
that runs and no other, so ``kvrouter --help`` stays fast and torch-free, and the router package
does not depend on the packages that add commands (``gpu_emitter`` adds ``replica`` and
``demo``). A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from router.version import kvrouter_version

GROUP = "kvrouter.commands"

#: One-line help per command, shown by ``kvrouter --help`` without importing any command.
HELP: dict[tuple[str, ...], str] = {
    ("events", "tail"): "print the KV events a vLLM replica publishes",
    ("replay",): "replay a recorded event stream and check hit predictions",
    ("serve",): "run the router: OpenAI proxy with KV-aware routing",
    ("replica",): "run a simulated vLLM replica (OpenAI API + KV events)",
    ("demo",): "simulated replicas + router + Mooncake workload: compare policies",
    ("config", "example"): "print a router.toml with every knob, its default and what it does",
}


class CommandsMissing(RuntimeError):
    """No command is registered: the package was not installed (entry points come with it)."""


def commands() -> dict[tuple[str, ...], str]:
    """Registered commands: words -> ``module`` (the entry point's value)."""
    found = {tuple(ep.name.split(".")): ep.value for ep in entry_points(group=GROUP)}
    if not found:
        raise CommandsMissing(
            "no kvrouter commands are registered: install the package "
            "(pip install -e '.[dev,emitter]') so its entry points exist"
        )
    return found


def _chosen(argv: Sequence[str], known: dict[tuple[str, ...], str]) -> tuple[str, ...] | None:
    words = []
    for a in argv:
        if a.startswith("-"):
            break
        words.append(a)
    for n in range(len(words), 0, -1):
        if tuple(words[:n]) in known:
            return tuple(words[:n])
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser, with the full arguments of the command ``argv`` names (if any)."""
    known = commands()
    chosen = _chosen(argv, known)
    parser = argparse.ArgumentParser(
        prog="kvrouter",
        description="KV-cache-aware router for vLLM fleets.",
    )
    parser.add_argument("--version", action="version", version=f"kvrouter {kvrouter_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {}
    for words in sorted(known, key=lambda w: list(HELP).index(w) if w in HELP else len(HELP)):
        parent = sub
        for depth in range(1, len(words)):
            key = words[:depth]
            if key not in groups:
                p = parent.add_parser(words[depth - 1], help=f"{' '.join(key)} commands")
                groups[key] = p.add_subparsers(dest=f"{'_'.join(key)}_command", metavar="COMMAND")
            parent = groups[key]
        help_text = HELP.get(words, "")
        p = parent.add_parser(words[-1], help=help_text, description=help_text)
        if words == chosen:
            mod = importlib.import_module(known[words])
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
    except CommandsMissing as exc:
        print(f"kvrouter: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
