"""Suite-wide settings."""

from __future__ import annotations

from router.server.state import PoolState

# Every routing decision the suite makes through the shortlist path (router.core.shortlist)
# is checked against the full scan: same replica, scores, tie count and RNG use. A change
# to a replica's load that bypasses ReplicaState.touch fails the test that makes it.
PoolState.check_shortlist = True
