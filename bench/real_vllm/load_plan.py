"""The concurrent benchmark's workload: a request plan drawn from one seed, with no I/O.

Two kinds of session arrive open-loop (Poisson):

* **conversations** over one of six shared system prompts (300–900 words; every word ``wN`` of
  the tiny model's vocabulary is one token), 2–6 turns. Turn k's messages are turn k-1's
  messages, the assistant's actual streamed answer to turn k-1 and a new user message of
  20–120 words, so each prompt extends the previous one by the generated tokens. A turn is
  released a think time (exponential) after the previous one finished, because it needs the
  answer: that part of the load is closed-loop by nature;
* **one-offs**: a single novel user message of 1,200–1,800 prompt tokens (~12 % of requests).

The plan fixes everything except the answers and the moments turns finish: the same seed gives
the same sessions, texts, arrival times, think times and ``max_tokens`` for every policy.
Sessions arrive at ``rate * sessions / requests`` per second, so all requests together are
offered at about ``rate`` per second (15/s with ~0.3 s latency keeps 2–7 requests in flight on
two CPU replicas, as in the issue); a conversation's later turns fall inside that budget.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

NUM_WORDS = 2048 - 7
"""Words ``w0 .. w2040``: the tiny model's vocabulary minus its seven specials."""
CHAT_OVERHEAD = 2
"""Tokens the chat template adds around a lone user message (``<user>`` ... ``<assistant>``);
vLLM renders chat prompts without a BOS token."""


@dataclass(frozen=True)
class PlanConfig:
    """The knobs of a plan; the defaults are issue 17's workload."""

    requests: int = 150
    rate: float = 15.0
    """Offered requests per second, all kinds together."""
    system_prompts: int = 6
    system_words: tuple[int, int] = (300, 900)
    turns: tuple[int, int] = (2, 6)
    user_words: tuple[int, int] = (20, 120)
    one_off_share: float = 0.12
    one_off_tokens: tuple[int, int] = (1200, 1800)
    think_mean_s: float = 0.3
    max_tokens: tuple[int, int] = (16, 32)

    def __post_init__(self) -> None:
        if self.requests < 1 or self.rate <= 0 or not 0 <= self.one_off_share <= 1:
            raise ValueError("a plan needs requests >= 1, rate > 0 and one_off_share in 0..1")
        if self.turns[0] < 1 or self.turns[0] > self.turns[1]:
            raise ValueError(f"turns must be 1 <= lo <= hi, got {self.turns}")


@dataclass(frozen=True)
class Session:
    """One conversation or one-off; ``think_s[k]`` is the pause before turn k+1."""

    sid: int
    kind: Literal["conversation", "one_off"]
    arrival_s: float
    system: int | None
    """Index of the shared system prompt (None for one-offs)."""
    user_messages: tuple[str, ...]
    think_s: tuple[float, ...]
    max_tokens: tuple[int, ...]

    @property
    def turns(self) -> int:
        return len(self.user_messages)


@dataclass(frozen=True)
class Plan:
    seed: int
    config: PlanConfig
    system_prompts: tuple[str, ...]
    sessions: tuple[Session, ...]

    @property
    def requests(self) -> int:
        return sum(s.turns for s in self.sessions)

    def first_messages(self, s: Session) -> list[dict[str, str]]:
        """Turn 0's messages; later turns append the answer and ``s.user_messages[k]``."""
        msgs = (
            []
            if s.system is None
            else [{"role": "system", "content": self.system_prompts[s.system]}]
        )
        return [*msgs, {"role": "user", "content": s.user_messages[0]}]


def words(rng: random.Random, n: int) -> str:
    """``n`` random vocabulary words (one token each)."""
    return " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(n))


def _conversation_lengths(rng: random.Random, total: int, turns: tuple[int, int]) -> list[int]:
    """Turn counts in ``turns`` summing to exactly ``total``: the last conversation takes what
    is left when that fits, else the one before leaves it at least ``turns[0]``."""
    lo, hi = turns
    out: list[int] = []
    while total > 0:
        n = total if total <= hi else rng.randint(lo, hi)
        if 0 < total - n < lo:
            n = total - lo
        out.append(n)
        total -= n
    return out


def make_plan(seed: int, config: PlanConfig | None = None) -> Plan:
    """The plan for ``seed``: same seed, same plan, whatever runs it."""
    cfg = config or PlanConfig()
    rng = random.Random(seed)
    prompts = tuple(words(rng, rng.randint(*cfg.system_words)) for _ in range(cfg.system_prompts))
    one_offs = round(cfg.one_off_share * cfg.requests)
    kinds: list[tuple[str, int]] = [("one_off", 1)] * one_offs
    kinds += [
        ("conversation", n) for n in _conversation_lengths(rng, cfg.requests - one_offs, cfg.turns)
    ]
    rng.shuffle(kinds)
    # every system prompt gets its share of the conversations, in random order
    n_convs = sum(kind == "conversation" for kind, _ in kinds)
    systems = [i % cfg.system_prompts for i in range(n_convs)]
    rng.shuffle(systems)
    session_rate = cfg.rate * len(kinds) / cfg.requests
    t = 0.0
    sessions = []
    for sid, (kind, turns) in enumerate(kinds):
        t += rng.expovariate(session_rate) if sid else 0.0
        max_tokens = tuple(rng.randint(*cfg.max_tokens) for _ in range(turns))
        if kind == "one_off":
            n = rng.randint(*cfg.one_off_tokens) - CHAT_OVERHEAD
            sessions.append(Session(sid, "one_off", t, None, (words(rng, n),), (), max_tokens))
            continue
        msgs = tuple(words(rng, rng.randint(*cfg.user_words)) for _ in range(turns))
        think = tuple(rng.expovariate(1 / cfg.think_mean_s) for _ in range(turns - 1))
        system = systems.pop()
        sessions.append(Session(sid, "conversation", t, system, msgs, think, max_tokens))
    return Plan(seed, cfg, prompts, tuple(sessions))
