"""A small reader of the repository's Dockerfile, so tests check what the image really does.

Docker cannot run on these machines; the tests instead read the stages' ``COPY``, ``ENV``,
``ENTRYPOINT`` and ``CMD`` from the file itself and run the same steps in a clean virtual
environment (tests/test_install.py), so the file and the tests cannot drift apart. Only the
subset of the syntax the Dockerfile uses is understood (line continuations, comments, JSON
exec form, ``KEY=VALUE`` environment pairs); anything else raises.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the (joined) line
    line: int  # 1-based line of the instruction's start


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def exec_form(self, keyword: str) -> list[str]:
        """The last ``ENTRYPOINT``/``CMD`` of the stage, which must use the JSON exec form."""
        found = self.all(keyword)
        if not found:
            raise ValueError(f"stage {self.name!r} has no {keyword}")
        value = json.loads(found[-1].args)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{keyword} of stage {self.name!r} is not a JSON list of strings")
        return value

    def env(self, inherited: dict[str, str] | None = None) -> dict[str, str]:
        """The stage's ``ENV`` pairs (``KEY=VALUE`` form only), after ``inherited``'s."""
        out = dict(inherited or {})
        for ins in self.all("ENV"):
            for pair in shlex.split(ins.args):
                key, sep, value = pair.partition("=")
                if not sep:
                    raise ValueError(f"line {ins.line}: use ENV KEY=VALUE, got {pair!r}")
                out[key] = value
        return out

    def copy_sources(self) -> list[str]:
        """The build-context paths the stage's ``COPY`` lines take (not ``--from`` copies)."""
        out: list[str] = []
        for ins in self.all("COPY"):
            words = shlex.split(ins.args)
            if any(w.startswith("--from") for w in words):
                continue
            words = [w for w in words if not w.startswith("--")]
            out += words[:-1]
        return out


def instructions(text: str) -> list[Instruction]:
    """The file's instructions, continuation lines joined, comments and blank lines dropped."""
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = no
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        joined = " ".join(b for b in buf if b)
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        buf = []
    if buf:
        raise ValueError("the Dockerfile ends inside a continued line")
    return out


def stages(text: str | None = None) -> dict[str, Stage]:
    """Every named stage, in file order (``FROM base AS name``)."""
    text = DOCKERFILE.read_text(encoding="utf-8") if text is None else text
    out: dict[str, Stage] = {}
    current: Stage | None = None
    for ins in instructions(text):
        if ins.keyword == "FROM":
            words = ins.args.split()
            if len(words) != 3 or words[1].upper() != "AS":
                raise ValueError(f"line {ins.line}: name every stage (FROM image AS name)")
            current = Stage(words[2], words[0])
            out[current.name] = current
        elif current is not None:
            current.instructions.append(ins)
    return out


def stage_env(all_stages: dict[str, Stage], name: str) -> dict[str, str]:
    """A stage's environment including what its ``FROM <stage>`` ancestors set."""
    stage = all_stages[name]
    inherited = stage_env(all_stages, stage.base) if stage.base in all_stages else {}
    return stage.env(inherited)
