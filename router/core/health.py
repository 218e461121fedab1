"""One replica's health as a pure state machine: probe results and request outcomes in, whether
it may be routed to out. No I/O and no clock: every call takes ``now`` (monotonic seconds),
so the rules below can be tested exhaustively (tests/test_health.py) and the service only
feeds it (router.server.health).

Two signals, combined (``[health]`` in the config, router.config.HealthConfig):

* **Active probe.** ``GET /health`` every ``probe_interval_s``. ``unhealthy_threshold``
  consecutive failures mark the replica **down**; ``healthy_threshold`` consecutive
  successes bring it back, in **half-open**. Before the first probe a replica counts as up
  (a router starting next to a dead replica learns it from the probes or its first failures).
* **Passive outlier ejection.** ``eject_after_failures`` consecutive attempts that failed
  before the first response byte (connect error, timeout, 5xx) **eject** the replica for
  ``min(eject_base_s * 2**k, eject_max_s)``, ``k`` being the ejections since its last
  success. When that time is over it is **half-open**.
* **Half-open**: routable, but one request at a time (the trial); the first outcome decides,
  a request's or a probe's: success makes it **healthy** (and resets ``k``), failure ejects it
  again for twice as long. A probe success does not cut an ejection short: a replica that
  answers ``/health`` may still fail every completion (the 5xx case).

The state shown (``state``): ``down`` whenever the probe says so, else ``ejected`` during a
back-off, ``half_open`` after it or after a comeback, ``healthy`` otherwise.

A replica's going out of rotation (``ejected`` or ``down``) is returned as a
:class:`Change`: the service then distrusts its cache state in the index, because what
happens while a replica is unreachable is unknown (vLLM restarts empty and says nothing;
router.core.index.KVIndex.seen_down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from router.config import HealthConfig

__all__ = ["Change", "HealthState", "ReplicaHealth"]

HealthState = Literal["healthy", "half_open", "ejected", "down"]
ChangeKind = Literal["ejected", "down", "up", "recovered"]


@dataclass(frozen=True, slots=True)
class Change:
    """A transition the service acts on: ``ejected`` / ``down`` (out of rotation: log it,
    count it, distrust the replica's index state), ``up`` (the probe sees it again: it is
    half-open), ``recovered`` (half-open decided: healthy)."""

    kind: ChangeKind
    reason: str


class ReplicaHealth:
    """The health of one replica (module docstring). Not thread-safe: one event loop owns it."""

    __slots__ = (
        "_half_open",
        "cfg",
        "consecutive_failures",
        "ejected_at",
        "ejected_until",
        "ejections",
        "last_error",
        "last_error_at",
        "last_probe_at",
        "last_probe_error",
        "probe_failures",
        "probe_failures_total",
        "probe_successes",
        "probe_up",
        "probes",
        "streak",
        "trial_in_flight",
    )

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self.consecutive_failures = 0
        """Attempts failed before the first byte since the last success."""
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.ejections = 0
        """Passive ejections so far (``kvrouter_replica_ejections_total``)."""
        self.streak = 0
        """Ejections since the last success: the back-off's exponent."""
        self.ejected_until: float | None = None
        """Set while an ejection's back-off runs or has run out (then half-open)."""
        self.ejected_at: float | None = None
        """When the replica last left rotation (ejection or probe down)."""
        self._half_open = False
        """Half-open without a back-off behind it (the probe brought it back)."""
        self.trial_in_flight = False
        self.probe_up = True
        self.probe_successes = 0
        self.probe_failures = 0
        """Consecutive, for the thresholds."""
        self.probes = 0
        self.probe_failures_total = 0
        self.last_probe_at: float | None = None
        self.last_probe_error: str | None = None

    # ------------------------------------------------------------------ reading

    def state(self, now: float) -> HealthState:
        if not self.probe_up:
            return "down"
        until = self.ejected_until
        if until is not None:
            return "ejected" if now < until else "half_open"
        return "half_open" if self._half_open else "healthy"

    def routable(self, now: float) -> bool:
        """May a new request be sent here? Half-open: only while no trial is in flight."""
        st = self.state(now)
        return st == "healthy" or (st == "half_open" and not self.trial_in_flight)

    def backoff(self) -> float:
        """How long the next ejection lasts."""
        c = self.cfg
        return min(c.eject_base_s * 2.0 ** min(self.streak, 64), c.eject_max_s)

    def panic_rank(self) -> tuple[int, float]:
        """Order among unroutable replicas when a pool has no routable one (router.server.state):
        the probe-reachable first, then the one out of rotation longest."""
        return (0 if self.probe_up else 1, self.ejected_at if self.ejected_at is not None else 0.0)

    def as_dict(self, now: float, wall: float) -> dict[str, Any]:
        """For ``/admin/replicas`` and explain; times as Unix seconds (``wall`` is ``now``
        on the wall clock)."""

        def at(t: float | None) -> float | None:
            return None if t is None else round(wall + (t - now), 3)

        st = self.state(now)
        probing = self.cfg.probe_interval_s > 0
        return {
            "state": st,
            "routable": self.routable(now),
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_error_at": at(self.last_error_at),
            "ejections": self.ejections,
            "ejected_until": at(self.ejected_until) if st == "ejected" else None,
            "next_backoff_s": self.backoff(),
            "trial_in_flight": self.trial_in_flight,
            "probe": {
                "status": ("up" if self.probe_up else "down") if probing else "off",
                "consecutive_failures": self.probe_failures,
                "consecutive_successes": self.probe_successes,
                "failures": self.probe_failures_total,
                "probes": self.probes,
                "last_at": at(self.last_probe_at),
                "last_error": self.last_probe_error,
            },
        }

    # ----------------------------------------------------------------- requests

    def begin(self, now: float) -> bool:
        """A request is being sent here; returns whether it is the half-open trial (then no
        other request is routed here until :meth:`end`, unless an outcome decides first)."""
        if self.state(now) == "half_open" and not self.trial_in_flight:
            self.trial_in_flight = True
            return True
        return False

    def succeeded(self, now: float) -> Change | None:
        """An attempt got its first response byte (any status below 500): the replica
        serves. Decides a half-open state at once, not when a long stream ends."""
        self.consecutive_failures = 0
        st = self.state(now)
        if st in ("half_open", "ejected"):
            # ejected: an attempt made anyway (a pool with nothing routable) that worked
            return self._recover("a request succeeded")
        if st == "healthy":
            self.streak = 0
        return None

    def failed(self, now: float, error: str) -> Change | None:
        """An attempt failed before the first byte (connect error, timeout, 5xx)."""
        self.consecutive_failures += 1
        self.last_error, self.last_error_at = error, now
        st = self.state(now)
        if st == "half_open":
            return self._eject(now, f"failed while half-open: {error}")
        if st == "healthy" and self.consecutive_failures >= self.cfg.eject_after_failures:
            return self._eject(
                now, f"{self.consecutive_failures} consecutive failed attempts; last: {error}"
            )
        return None

    def end(self, trial: bool) -> None:
        """An attempt :meth:`begin` started is over, whatever its outcome (the client may
        have gone away before any): the trial slot is free again."""
        if trial:
            self.trial_in_flight = False

    # ------------------------------------------------------------------- probes

    def probe(self, now: float, ok: bool, error: str | None = None) -> Change | None:
        """One probe's result."""
        self.probes += 1
        self.last_probe_at = now
        c = self.cfg
        if ok:
            self.probe_failures = 0
            self.probe_successes += 1
            self.last_probe_error = None
            if not self.probe_up:
                if self.probe_successes < c.healthy_threshold:
                    return None
                self.probe_up = True
                self.ejected_until = None  # the outage it was ejected for is over
                self._half_open = True
                return Change("up", f"{self.probe_successes} consecutive probes succeeded")
            if self.state(now) == "half_open":
                return self._recover("a probe succeeded")
            return None
        self.probe_successes = 0
        self.probe_failures += 1
        self.probe_failures_total += 1
        self.last_probe_error = error or "failed"
        if not self.probe_up:
            return None
        if self.probe_failures >= c.unhealthy_threshold:
            self.probe_up = False
            self.ejected_at = now
            return Change("down", f"{self.probe_failures} consecutive probes failed; last: {error}")
        if self.state(now) == "half_open":
            return self._eject(now, f"a probe failed while half-open: {error}")
        return None

    # ---------------------------------------------------------------- internals

    def _eject(self, now: float, reason: str) -> Change:
        length = self.backoff()
        self.streak += 1
        self.ejections += 1
        self.ejected_until = now + length
        self.ejected_at = now
        self._half_open = False
        return Change("ejected", f"{reason} (for {length:g} s)")

    def _recover(self, reason: str) -> Change:
        self.ejected_until = None
        self._half_open = False
        self.streak = 0
        self.consecutive_failures = 0
        return Change("recovered", reason)
