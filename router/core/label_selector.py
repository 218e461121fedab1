"""Kubernetes label selectors (``app=vllm,tier in (a,b),!canary``), parsed to check them.

The API server does the selecting (the router sends the selector with every list and watch
request); the router parses it only to refuse a malformed one at startup, with the position of
the mistake, instead of learning from a 400 on its first request (and retrying it forever).
The grammar is apimachinery's ``labels.Parse`` for equality- and set-based requirements:
``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``, ``key in (v1,v2)``,
``key notin (v1,v2)``, joined by commas. The numeric ``key>1`` / ``key<1`` form, which only
node affinity uses in practice, is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Requirement", "SelectorError", "parse_selector"]

_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_TOKEN = re.compile(r"\s*(\(|\)|,|!=|==|=|!|[^\s(),!=]+)")

Op = Literal["exists", "!exists", "=", "!=", "in", "notin"]


class SelectorError(ValueError):
    """A label selector the API server would refuse; the message says where and why."""


@dataclass(frozen=True)
class Requirement:
    """One comma-separated term of a selector."""

    key: str
    op: Op
    values: tuple[str, ...] = ()


def _key(key: str) -> str:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        raise SelectorError(f"label key {key!r}: the prefix must be a DNS subdomain")
    if not _NAME.match(name):
        raise SelectorError(
            f"label key {key!r}: the name must be 1-63 characters, alphanumeric at both ends, "
            "with '-', '_' or '.' between"
        )
    return key


def _value(value: str) -> str:
    if value and not _NAME.match(value):
        raise SelectorError(
            f"label value {value!r}: at most 63 characters, alphanumeric at both ends, with "
            "'-', '_' or '.' between"
        )
    return value


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:  # pragma: no cover - the pattern matches any non-space run
            raise SelectorError(f"cannot read {text[pos:]!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


def parse_selector(text: str) -> tuple[Requirement, ...]:
    """The requirements of ``text``; :class:`SelectorError` if the API server would refuse
    it. An empty selector (all objects) parses to ``()``: callers decide whether to allow it."""
    toks = _tokens(text)
    reqs: list[Requirement] = []
    i = 0

    def take() -> str:
        nonlocal i
        if i >= len(toks):
            raise SelectorError(f"selector {text!r} ends too early")
        i += 1
        return toks[i - 1]

    while i < len(toks):
        tok = take()
        if tok == "!":
            reqs.append(Requirement(_key(take()), "!exists"))
        elif tok in ("(", ")", ",", "=", "==", "!="):
            raise SelectorError(f"selector {text!r}: expected a label key, found {tok!r}")
        else:
            key = _key(tok)
            nxt = toks[i] if i < len(toks) else ","
            if nxt == ",":
                reqs.append(Requirement(key, "exists"))
            elif nxt in ("=", "==", "!="):
                take()
                value = toks[i] if i < len(toks) and toks[i] != "," else ""
                if value:
                    take()
                if value in ("(", ")", "=", "==", "!=", "!"):
                    raise SelectorError(f"selector {text!r}: bad value {value!r} for {key!r}")
                reqs.append(Requirement(key, "!=" if nxt == "!=" else "=", (_value(value),)))
            elif nxt in ("in", "notin"):
                take()
                if take() != "(":
                    raise SelectorError(f"selector {text!r}: '{nxt}' must be followed by '('")
                values: list[str] = []
                while True:
                    v = take()
                    if v == ")" and not values:
                        raise SelectorError(f"selector {text!r}: '{nxt} ()' needs values")
                    if v in ("(", ")", ",", "=", "==", "!=", "!"):
                        raise SelectorError(f"selector {text!r}: bad value {v!r} in a set")
                    values.append(_value(v))
                    sep = take()
                    if sep == ")":
                        break
                    if sep != ",":
                        raise SelectorError(f"selector {text!r}: expected ',' or ')', got {sep!r}")
                reqs.append(Requirement(key, nxt, tuple(values)))  # type: ignore[arg-type]
            else:
                raise SelectorError(
                    f"selector {text!r}: after {key!r} expected '=', '==', '!=', 'in', 'notin' "
                    f"or ',', found {nxt!r}"
                )
        if i < len(toks):
            if toks[i] != ",":
                raise SelectorError(f"selector {text!r}: expected ',' before {toks[i]!r}")
            i += 1
            if i == len(toks):
                raise SelectorError(f"selector {text!r} ends with ','")
    return tuple(reqs)
