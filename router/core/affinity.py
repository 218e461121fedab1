"""Prefix homes: the replica the router first sent each prefix to, so a family stays together.

Under concurrent load the kv policy's exact hits tie whenever a prefix is cached on several
replicas, and the load terms then decide: a family of conversations over one system prompt
drifts onto every replica, each replica caches every family, and each cache turns over faster.
vllm-router's ``cache_aware`` never splits a family (it routes on the prompts it routed, and
balances only at a 64-request imbalance), and on real vLLM (bench/real_vllm/load.py, issue 17)
that was where it out-reused kv: kv sent about two first turns per run to a replica that had
never seen their family.

A home is a routing fact, not a cache claim: the router's own record of where it placed a
prefix first, kept after the prefix is evicted and never shown as a hit. Prompts are cut into
``chunk_tokens``-token chunks hashed as a chain (:meth:`PrefixHomes.keys`: chunk ``i``'s key
covers tokens ``0 .. (i+1)·chunk_tokens``); the first request to carry a chunk gives it its
home, later requests only refresh it. :meth:`PrefixHomes.homed` walks a new request's keys
while its chunks have homes and counts, per replica, the tokens homed there: the policy's
affinity credit (router.core.policy) then breaks the tie a split would otherwise be decided by.

A *family* is a first chunk a second request carried while it was homed: a shared system
prompt, or a conversation's opening (a one-off never becomes one). Its first request placed it
wherever the load was lightest at that moment, and the family then stays there for good:
:meth:`PrefixHomes.families` counts them per replica so that the policy can place a prefix no
replica is home to away from the replica already hosting the most (``family_spread_tokens``,
router.core.policy), instead of letting a passing queue stack five families on one replica.

Bounded: at most ``capacity`` chunks, least recently routed first out. Pure: no I/O, no clock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from events.hashing import native_chain
from router.core.index import ReplicaKey

__all__ = ["PrefixHomes", "chunk_keys"]

log = logging.getLogger(__name__)


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int) -> list[int]:
    """:meth:`PrefixHomes.keys` in Python, the reference: per full chunk,
    ``h = hash((h, tuple(chunk)))`` from ``h = 0``. (A tuple of ints hashes the same in every
    process: no PYTHONHASHSEED dependence.)"""
    c = chunk_tokens
    out = []
    h = 0
    for start in range(0, len(token_ids) - c + 1, c):
        h = hash((h, tuple(token_ids[start : start + c])))
        out.append(h)
    return out


def _load_chunk_chain() -> Callable[[Sequence[int], int], list[int] | None] | None:
    """``events._chain.chunk_chain`` (the same keys, 4x cheaper: no slices or tuples made)
    where it is in use and computes exactly what :func:`chunk_keys` does on this interpreter.
    It follows CPython's tuple and int hash (unchanged since 3.8); should a Python change
    them, this check at import finds it and the keys stay on the Python path."""
    fn = getattr(native_chain(), "chunk_chain", None)
    if fn is None:
        return None
    probe = [*range(-3, 200), 2**61 - 2, 2**61 - 1, 2**64, -(2**70), True, 2.5]
    for c in (1, 7, 64):
        for toks in (probe, tuple(probe)):
            if fn(toks, c) != chunk_keys(toks, c):
                log.warning("events._chain.chunk_chain disagrees with hash(): keys in Python")
                return None
    return fn


_chunk_chain = _load_chunk_chain()


class PrefixHomes:
    """Chunk-chain hash -> the replica that chunk was first routed to (LRU-bounded)."""

    __slots__ = (
        "_counts",
        "_families",
        "_family_changes",
        "_homes",
        "_reused",
        "capacity",
        "chunk_tokens",
    )

    def __init__(self, chunk_tokens: int = 64, capacity: int = 100_000) -> None:
        if chunk_tokens < 1 or capacity < 1:
            raise ValueError(
                f"PrefixHomes needs chunk_tokens >= 1 and capacity >= 1, "
                f"got {chunk_tokens} and {capacity}"
            )
        self.chunk_tokens = chunk_tokens
        self.capacity = capacity
        self._homes: OrderedDict[int, ReplicaKey] = OrderedDict()
        self._counts: dict[ReplicaKey, int] = {}
        self._reused: set[int] = set()
        """First chunks a second request carried while homed: the families."""
        self._families: dict[ReplicaKey, int] = {}
        self._family_changes: set[ReplicaKey] = set()
        """Replicas whose family count changed since :meth:`take_family_changes`."""

    def __len__(self) -> int:
        return len(self._homes)

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """One key per full chunk; each covers the whole prefix up to its chunk's end
        (:func:`chunk_keys`). In C where events._chain is in use: on this machine 32k tokens
        take ~45 us there, ~190 us in Python."""
        if _chunk_chain is not None:
            got = _chunk_chain(token_ids, self.chunk_tokens)
            if got is not None:
                return got
        return chunk_keys(token_ids, self.chunk_tokens)

    def homed(self, keys: Sequence[int]) -> dict[ReplicaKey, int]:
        """Tokens of the request's leading homed chunks (``keys``), per home replica; the walk
        stops at the first chunk no request has carried yet."""
        out: dict[ReplicaKey, int] = {}
        get = self._homes.get
        run_rep, run = None, 0  # chunks in a row homed on one replica: added up at once
        for h in keys:
            rep = get(h)
            if rep is None:
                break
            if rep == run_rep:
                run += 1
                continue
            if run_rep is not None:
                out[run_rep] = out.get(run_rep, 0) + run * self.chunk_tokens
            run_rep, run = rep, 1
        if run_rep is not None:
            out[run_rep] = out.get(run_rep, 0) + run * self.chunk_tokens
        return out

    def record(self, keys: Sequence[int], replica: ReplicaKey) -> list[int]:
        """The request (its chunk ``keys``) was routed to ``replica``: its new chunks are homed
        there, the known ones refreshed. Returns the new chunks' keys (for :meth:`withdraw`)."""
        homes, counts = self._homes, self._counts
        if keys:
            root = keys[0]
            at = homes.get(root)
            if at is not None and root not in self._reused:
                self._reused.add(root)
                self._families[at] = self._families.get(at, 0) + 1
                self._family_changes.add(at)
        new = []
        for h in keys:
            if h in homes:
                homes.move_to_end(h)
            else:
                homes[h] = replica
                new.append(h)
        if new:
            counts[replica] = counts.get(replica, 0) + len(new)
        excess = len(homes) - self.capacity
        if excess > 0:  # a long novel prompt at capacity evicts hundreds: count them at once
            popitem = homes.popitem
            gone: dict[ReplicaKey, int] = {}
            for _ in range(excess):
                h, old = popitem(last=False)
                gone[old] = gone.get(old, 0) + 1
                if h in self._reused:
                    self._unfamily(h, old)
            for old, n in gone.items():
                self._uncount(old, n)
        return new

    def withdraw(self, keys: Sequence[int], replica: ReplicaKey) -> None:
        """The request failed over before ``replica`` took it: the chunks it homed there (the
        keys :meth:`record` returned) lose that home, so the next request carrying them is
        homed where it really goes."""
        homes = self._homes
        for h in keys:
            if homes.get(h) == replica:
                del homes[h]
                self._uncount(replica)
                if h in self._reused:
                    self._unfamily(h, replica)

    def _uncount(self, replica: ReplicaKey, n: int = 1) -> None:
        counts = self._counts
        left = counts[replica] - n
        if left:
            counts[replica] = left
        else:
            del counts[replica]

    def _unfamily(self, root: int, replica: ReplicaKey) -> None:
        self._reused.discard(root)
        self._family_changes.add(replica)
        left = self._families[replica] - 1
        if left:
            self._families[replica] = left
        else:
            del self._families[replica]

    def forget_replica(self, replica: ReplicaKey) -> int:
        """Drop every home on ``replica`` (removed, restarted or distrusted: its cache is not
        where its homes said). Returns how many went."""
        gone = [h for h, r in self._homes.items() if r == replica]
        for h in gone:
            del self._homes[h]
            self._reused.discard(h)
        self._counts.pop(replica, None)
        if self._families.pop(replica, None) is not None:
            self._family_changes.add(replica)
        return len(gone)

    def homes_by_replica(self) -> dict[ReplicaKey, int]:
        """Chunks homed on each replica (for metrics; kept as routing goes, not counted)."""
        return dict(self._counts)

    def families(self, replica: ReplicaKey) -> int:
        """Families homed on ``replica`` (module docstring): what ``family_spread_tokens``
        charges a new prefix there."""
        return self._families.get(replica, 0)

    def take_family_changes(self) -> set[ReplicaKey]:
        """The replicas whose :meth:`families` changed since the last call (a family formed,
        or its first chunk was forgotten), for a caller that files replicas by their count
        (router.core.shortlist's family order); the record starts over. At most one entry
        per replica however many changes, so a caller that never asks holds a set no larger
        than the replicas it has seen."""
        changed, self._family_changes = self._family_changes, set()
        return changed

    def families_by_replica(self) -> dict[ReplicaKey, int]:
        """Families homed on each replica (for metrics and the admin API)."""
        return dict(self._families)
