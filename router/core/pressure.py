"""Cache pressure: how many new tokens the router wrote into each replica's cache lately.

Every uncached prompt token a replica computes takes a block that, once the cache is full,
evicts an older one (vLLM frees least recently used blocks first). A replica that was sent
more new tokens lately has been evicting faster, so a prefix placed there now is more likely to
be gone before it is reused. On two real vLLM replicas (bench/real_vllm/load.py, issue 17) the
kv policy hit the right replica for every first turn of a conversation and still got 0 where
vllm-router's ``cache_aware`` got 640 tokens: its shared system prompt had been evicted on a
replica that received 31 k new tokens against 24 k on the other, because new prefix families
and one-offs were placed by the momentary queue alone.

As a cost term (``pressure_weight``, router.core.policy) it did not pay on that benchmark:
weights 0.05 and 0.1 (3 runs each) moved reuse within the run-to-run spread, 0.25 with a 60 s
half-life (3 runs) pushed conversations off their replicas (4-15 of ~97 later turns moved) and
lost reuse. It stays off by default and exported (``recent_new_tokens`` in explain and
``/admin/replicas``) for fleets whose caches turn over more slowly than this benchmark's.

:class:`DecayingSum` is the measure: new tokens added at routing time, decaying exponentially
with a half-life, so it reads "tokens written in about the last half-life" without keeping a
window of samples. Pure: the clock is passed in.
"""

from __future__ import annotations

import math

__all__ = ["ORDER_KEY_SLACK", "DecayingSum"]

ORDER_KEY_SLACK = 1e-7
"""Bound on what rounding can do to :meth:`DecayingSum.order_key` against ``value``: the key's
own rounding (about 1e-11 with a monotonic clock of a year) and ``value``'s (a few ulps,
relative) are far below it."""


class DecayingSum:
    """A sum whose terms halve every ``half_life_s`` seconds.

    A read stores nothing but the latest time read (a clock that went backwards reads the
    value at that time): the value at ``now`` is then the same float however often, or
    whether at all, it was read before, so router.core.shortlist, which reads only the
    replicas a request could go to, and the full scan, which reads every one, see the same
    pressure (with a monotonic clock)."""

    __slots__ = ("_at", "_rate", "_seen", "_value")

    def __init__(self, half_life_s: float) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
        self._rate = math.log(2) / half_life_s
        self._value = 0.0
        self._at = 0.0
        """When ``_value`` was the sum (the last add)."""
        self._seen = 0.0
        """The latest time read or added at."""

    def add(self, amount: float, now: float) -> None:
        t = now if now > self._seen else self._seen
        self._seen = t
        dt = t - self._at
        if dt > 0:
            self._value *= math.exp(-self._rate * dt)
            self._at = t
        self._value += amount

    def order_key(self) -> float:
        """A number that orders sums of one half-life as their values order at any time, and
        that time does not change: ``log(value(t)) + rate * t`` (-inf for a sum never added
        to). router.core.shortlist keeps replicas sorted by it between decisions, to find
        the one whose cache turned over least without reading every replica's value.

        Two sums whose keys differ by more than :data:`ORDER_KEY_SLACK` read in that order
        at any time, floats included; closer ones may read equal or, by rounding, the other
        way round."""
        if self._value <= 0:
            return -math.inf
        return math.log(self._value) + self._rate * self._at

    def value(self, now: float) -> float:
        """The sum at ``now`` (a clock that went backwards reads the last value)."""
        t = now if now > self._seen else self._seen
        self._seen = t
        dt = t - self._at
        if dt > 0:
            return self._value * math.exp(-self._rate * dt)
        return self._value
