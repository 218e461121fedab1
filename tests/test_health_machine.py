"""router.core.health: one replica's health state machine, without sockets or a clock.

By-hand cases first (each rule of the module docstring), then a stateful property test that
drives random probes, attempts and clock steps and checks the rules on every step against
counts kept here, independently of the machine's own.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.config import ConfigError, HealthConfig, parse_config
from router.core.health import ReplicaHealth

CFG = HealthConfig(
    probe_interval_s=1.0,
    probe_timeout_s=0.5,
    unhealthy_threshold=2,
    healthy_threshold=2,
    eject_after_failures=3,
    eject_base_s=1.0,
    eject_max_s=8.0,
)


def fail_n(h: ReplicaHealth, n: int, now: float) -> list:
    return [h.failed(now, f"boom {i}") for i in range(n)]


def test_starts_healthy_and_routable() -> None:
    h = ReplicaHealth(CFG)
    assert h.state(0.0) == "healthy" and h.routable(0.0)
    assert h.as_dict(0.0, 1000.0)["probe"]["status"] == "up"


def test_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    h = ReplicaHealth(CFG)
    assert fail_n(h, 2, 0.0) == [None, None]
    assert h.succeeded(0.0) is None  # resets: two more failures are not three in a row
    assert fail_n(h, 2, 0.0) == [None, None] and h.routable(0.0)
    change = h.failed(10.0, "connect refused")
    assert change is not None and change.kind == "ejected"
    assert "3 consecutive failed attempts" in change.reason and "for 1 s" in change.reason
    assert h.state(10.0) == "ejected" and not h.routable(10.0)
    assert h.ejected_until == 11.0 and h.ejections == 1
    d = h.as_dict(10.0, 5000.0)
    assert d["ejected_until"] == 5001.0 and d["last_error"] == "connect refused"
    assert d["consecutive_failures"] == 3


def test_back_off_doubles_on_each_failed_trial_and_is_capped() -> None:
    h = ReplicaHealth(CFG)
    fail_n(h, 3, 0.0)
    now, lengths = 0.0, []
    for _ in range(6):
        until = h.ejected_until
        assert until is not None
        lengths.append(until - now)
        assert h.state(until - 1e-6) == "ejected"
        now = until
        assert h.state(now) == "half_open" and h.routable(now)
        assert h.begin(now) is True  # the trial
        assert not h.routable(now) and h.begin(now) is False  # one at a time
        change = h.failed(now, "still dead")
        h.end(True)
        assert change is not None and change.kind == "ejected"
    assert lengths == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_a_successful_trial_recovers_and_resets_the_back_off() -> None:
    h = ReplicaHealth(CFG)
    fail_n(h, 3, 0.0)
    assert h.begin(1.0) is True
    h.failed(1.0, "x")  # re-ejected for 2 s
    h.end(True)
    assert h.begin(3.0) is True
    change = h.succeeded(3.0)
    assert change is not None and change.kind == "recovered"
    assert h.state(3.0) == "healthy" and h.routable(3.0)  # before the trial even ends
    h.end(True)
    fail_n(h, 3, 4.0)
    assert h.ejected_until == 5.0  # base again


def test_an_abandoned_trial_frees_the_slot_without_deciding() -> None:
    h = ReplicaHealth(CFG)
    fail_n(h, 3, 0.0)
    assert h.begin(1.0) is True and not h.routable(1.0)
    h.end(True)
    assert h.state(1.0) == "half_open" and h.routable(1.0)


def test_probes_mark_down_and_bring_back_half_open() -> None:
    h = ReplicaHealth(CFG)
    assert h.probe(0.0, False, "refused") is None  # 1 of 2
    assert h.probe(1.0, True) is None  # the count restarts
    assert h.probe(2.0, False, "refused") is None
    down = h.probe(3.0, False, "refused")
    assert down is not None and down.kind == "down"
    assert h.state(3.0) == "down" and not h.routable(3.0) and h.begin(3.0) is False
    assert h.probe(4.0, True) is None  # 1 of 2 successes
    assert h.state(4.0) == "down"
    up = h.probe(5.0, True)
    assert up is not None and up.kind == "up"
    assert h.state(5.0) == "half_open" and h.routable(5.0)
    again = h.probe(6.0, True)  # a successful probe decides half-open
    assert again is not None and again.kind == "recovered"
    assert h.state(6.0) == "healthy"
    assert h.probe_failures_total == 3 and h.probes == 7


def test_coming_back_from_down_ends_an_ejection_but_a_probe_does_not_shorten_one() -> None:
    h = ReplicaHealth(CFG)
    fail_n(h, 3, 0.0)  # ejected until 1.0
    assert h.probe(0.5, True) is None and h.state(0.5) == "ejected"
    # the replica dies: down; its comeback ends the ejection (the outage explained it)
    h.probe(0.6, False)
    h.probe(0.7, False)
    assert h.state(0.8) == "down"
    h.probe(0.9, True)
    assert h.probe(0.95, True).kind == "up"  # type: ignore[union-attr]
    assert h.state(0.95) == "half_open" and h.ejected_until is None


def test_a_failed_probe_in_half_open_ejects_again() -> None:
    h = ReplicaHealth(CFG)
    fail_n(h, 3, 0.0)
    change = h.probe(1.5, False, "HTTP 503")
    assert change is not None and change.kind == "ejected" and "HTTP 503" in change.reason
    assert h.ejected_until == 3.5  # the second ejection: 2 s


def test_success_while_ejected_recovers_and_failures_while_ejected_do_not_extend() -> None:
    """Attempts can reach an ejected replica (the pool had nothing routable, or they began
    before the ejection): their failures do not extend it, a success ends it."""
    h = ReplicaHealth(CFG)
    fail_n(h, 3, 0.0)
    assert fail_n(h, 5, 0.5) == [None] * 5 and h.ejected_until == 1.0
    assert h.succeeded(0.6).kind == "recovered"  # type: ignore[union-attr]
    assert h.state(0.6) == "healthy"


def test_panic_rank_prefers_reachable_then_longest_out() -> None:
    a, b, c = ReplicaHealth(CFG), ReplicaHealth(CFG), ReplicaHealth(CFG)
    fail_n(a, 3, 5.0)  # ejected at 5
    fail_n(b, 3, 2.0)  # ejected at 2
    c.probe(1.0, False)
    c.probe(1.5, False)  # down at 1.5: out longest, but its probes fail
    order = sorted([("a", a), ("b", b), ("c", c)], key=lambda x: x[1].panic_rank())
    assert [n for n, _ in order] == ["b", "a", "c"]


def test_probes_off_shows_off() -> None:
    h = ReplicaHealth(HealthConfig(probe_interval_s=0))
    assert h.as_dict(0.0, 0.0)["probe"]["status"] == "off"


@pytest.mark.parametrize(
    "body",
    [
        "probe_interval_s = -1",
        "probe_timeout_s = 0",
        'probe_path = "health"',
        "unhealthy_threshold = 0",
        "eject_after_failures = 0",
        "eject_base_s = 10\neject_max_s = 5",
    ],
)
def test_bad_health_config_is_refused_with_its_path(body: str) -> None:
    toml = f'[health]\n{body}\n[[pools]]\nmodel = "m"\nreplicas = []\n'
    with pytest.raises(ConfigError, match=r"\$\.health"):
        parse_config(toml)


def test_window() -> None:
    assert CFG.window_s() == 2 * 1.0 + 2 * 0.5
    assert math.isinf(HealthConfig(probe_interval_s=0).window_s())


# -- the rules, on random histories ---------------------------------------------------------


class Machine(RuleBasedStateMachine):
    """Random probes, attempts and clock steps; the rules checked after each step with
    counts kept here."""

    def __init__(self) -> None:
        super().__init__()
        self.h = ReplicaHealth(CFG)
        self.now = 0.0
        self.trials: list[bool] = []
        """Attempts begun and not ended (True: the trial)."""
        self.req_fails = 0
        """Consecutive request failures since the last success, counted here."""
        self.probe_fail_run = 0
        self.probe_ok_run = 0
        self.down = False
        self.ejections_since_success = 0

    def check(self, change, before: str) -> None:
        h, now = self.h, self.now
        if change is None:
            return
        if change.kind == "ejected":
            # only from healthy after enough failures, or from half-open (a failed trial)
            assert before in ("healthy", "half_open")
            if before == "healthy":
                assert self.req_fails >= CFG.eject_after_failures
            expected = min(CFG.eject_base_s * 2**self.ejections_since_success, CFG.eject_max_s)
            assert h.ejected_until == pytest.approx(now + expected)
            self.ejections_since_success += 1
        elif change.kind == "down":
            assert self.probe_fail_run == CFG.unhealthy_threshold and before != "down"
            self.down = True
        elif change.kind == "up":
            assert self.down and self.probe_ok_run == CFG.healthy_threshold
            self.down = False
        elif change.kind == "recovered":
            assert before in ("half_open", "ejected")
            self.ejections_since_success = 0
            self.req_fails = 0  # a fresh start

    @rule(dt=st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, 20.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(ok=st.booleans())
    def probe(self, ok: bool) -> None:
        before = self.h.state(self.now)
        if ok:
            self.probe_ok_run += 1
            self.probe_fail_run = 0
        else:
            self.probe_fail_run += 1
            self.probe_ok_run = 0
        self.check(self.h.probe(self.now, ok, None if ok else "x"), before)

    @rule()
    def begin(self) -> None:
        routable = self.h.routable(self.now)
        st_ = self.h.state(self.now)
        trial = self.h.begin(self.now)
        # a trial only from a routable half-open state, and never two at once
        assert trial == (st_ == "half_open" and routable)
        assert not (trial and any(self.trials))
        self.trials.append(trial)

    @precondition(lambda self: self.trials)
    @rule(ok=st.booleans(), end=st.booleans())
    def outcome(self, ok: bool, end: bool) -> None:
        before = self.h.state(self.now)
        if ok:
            change = self.h.succeeded(self.now)
            self.req_fails = 0
            if before in ("healthy",):
                self.ejections_since_success = 0
        else:
            self.req_fails += 1
            change = self.h.failed(self.now, "x")
        self.check(change, before)
        if end:
            self.h.end(self.trials.pop())

    @invariant()
    def rules(self) -> None:
        h, now = self.h, self.now
        state = h.state(now)
        assert (state == "down") == self.down
        assert h.routable(now) == (
            state == "healthy" or (state == "half_open" and not h.trial_in_flight)
        )
        assert h.trial_in_flight == any(self.trials)
        if state == "ejected":
            assert h.ejected_until is not None and now < h.ejected_until
            # ejected_until is now + back-off: subtracting now back can round up (32.2 - 24.2)
            assert h.ejected_until - now <= CFG.eject_max_s + 1e-9
        assert h.consecutive_failures == self.req_fails


Machine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_health_rules = Machine.TestCase
