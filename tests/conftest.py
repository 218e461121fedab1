"""Suite-wide settings."""

from __future__ import annotations

from router.server.state import PoolState

# Every routing decision the suite makes through the shortlist path (router.core.shortlist)
# is checked against the full scan: same replica, scores, tie count and RNG use. A change
# to a replica's load that bypasses ReplicaState.touch fails the test that makes it.
PoolState.check_shortlist = True


def pytest_configure(config: object) -> None:
    # a killed run still stops what its fixtures started (tests/sigterm_teardown.py)
    from tests.sigterm_teardown import install

    install()
