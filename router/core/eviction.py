"""Eviction horizon: which shared prefixes a request's new blocks would push out of a cache.

vLLM evicts least recently freed blocks first, and once a replica's cache is full every new
block it writes evicts one. A prefix last used on a replica is therefore gone after about
``horizon`` more new tokens have been written there, where ``horizon`` is the cache's size in
tokens per group: ``num_gpu_blocks · block_size / kv_groups`` (each group caches its own
blocks of every prompt, spec §3). On two real vLLM replicas under concurrent load
(bench/real_vllm/load.py, issue 17: 640 blocks of 32 tokens, 4 groups, so 5,120 tokens) every
first turn over a system prompt last used on its replica fewer than 3,800 new tokens before
was a hit, and almost every one past 5,400 was a miss (6 runs of kv).

Both kvrouter and vllm-router's ``cache_aware`` kept each family of conversations on one
replica and lost about four first turns per run to those evictions. The router decides
where each new block is written, so it can choose where they hurt least: a request whose
placement is otherwise open (a one-off, a new family) goes where it pushes no shared prefix
past the horizon. :class:`EvictionWatch` keeps, per replica, a token clock (new tokens routed
there) and the clock at each *shared* chunk's last use there (a chunk is shared once two
requests carried it: system prompts, conversation histories; a one-off's chunks never are).
:meth:`EvictionWatch.at_risk` counts the shared tokens a request's ``new`` tokens would push
from inside the horizon to past it: the policy's ``eviction`` term (router.core.policy).

Only the last ``danger_tokens`` before the horizon count (a request's own new tokens beyond
that add nothing), so a replica with no shared chunk that old scores 0 for any request and the
shortlist (router.core.shortlist) keeps it in its load book: :meth:`EvictionWatch.in_danger`.

A model, not a cache claim: it never changes a hit, and a wrong horizon only misplaces a tie
breaker. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from sortedcontainers import SortedList

from router.core.index import ReplicaKey

__all__ = ["EvictionWatch"]


class _Replica:
    """One replica's token clock and its shared chunks by last use."""

    __slots__ = ("by_age", "clock", "last")

    def __init__(self) -> None:
        self.clock = 0
        self.last: dict[int, int] = {}
        """Shared chunk -> the clock at its last use here."""
        self.by_age: SortedList = SortedList()
        """``(clock at last use, chunk)``, oldest first."""


class EvictionWatch:
    """Per replica, how far each shared prefix is from eviction (module docstring)."""

    __slots__ = ("_reps", "_uses", "capacity", "chunk_tokens", "danger_tokens")

    def __init__(self, chunk_tokens: int, danger_tokens: int, capacity: int = 100_000) -> None:
        if chunk_tokens < 1 or danger_tokens < 1 or capacity < 1:
            raise ValueError(
                "EvictionWatch needs chunk_tokens, danger_tokens and capacity >= 1, got "
                f"{chunk_tokens}, {danger_tokens} and {capacity}"
            )
        self.chunk_tokens = chunk_tokens
        self.danger_tokens = danger_tokens
        self.capacity = capacity
        self._uses: OrderedDict[int, int] = OrderedDict()
        """Chunk -> requests that carried it (capped at 2: shared or not), LRU-bounded."""
        self._reps: dict[ReplicaKey, _Replica] = {}

    def record(self, replica: ReplicaKey, keys: Sequence[int], new_tokens: int) -> None:
        """A request carrying the chunk ``keys`` (router.core.affinity.chunk_keys) was routed
        to ``replica`` and writes ``new_tokens`` there. Its blocks are freed together when it
        ends, so its shared chunks are as recent as its new blocks: both at the new clock."""
        rep = self._reps.get(replica)
        if rep is None:
            rep = self._reps[replica] = _Replica()
        rep.clock += max(0, new_tokens)
        now = rep.clock
        uses = self._uses
        last, by_age = rep.last, rep.by_age
        for k in keys:
            n = uses.get(k, 0)
            if n < 2:
                uses[k] = n = n + 1
            else:
                uses.move_to_end(k)
            if n < 2:
                continue
            old = last.get(k)
            if old is not None:
                by_age.remove((old, k))
            last[k] = now
            by_age.add((now, k))
        excess = len(uses) - self.capacity
        for _ in range(max(0, excess)):
            k, _n = uses.popitem(last=False)
            for r in self._reps.values():
                t = r.last.pop(k, None)
                if t is not None:
                    r.by_age.remove((t, k))

    def at_risk(
        self,
        replica: ReplicaKey,
        new_tokens: int,
        horizon: float | None,
        own: Collection[int] = (),
    ) -> int:
        """Shared tokens on ``replica`` that ``new_tokens`` more would push past ``horizon``
        (tokens a prefix lives after its last use there), not counting the request's ``own``
        chunks (it refreshes them). 0 when the horizon is unknown."""
        rep = self._reps.get(replica)
        if rep is None or not horizon or horizon <= 0 or new_tokens <= 0:
            return 0
        n = min(new_tokens, self.danger_tokens)
        # alive now: clock - t < horizon; gone after: clock + n - t >= horizon
        lo = rep.clock - horizon  # t > lo
        hi = rep.clock + n - horizon  # t <= hi
        count = 0
        for t, k in rep.by_age.irange((lo, float("inf")), (hi, float("inf")), (False, True)):
            if t > lo and k not in own:
                count += 1
        return count * self.chunk_tokens

    def in_danger(self, replica: ReplicaKey, horizon: float | None) -> bool:
        """Whether some request could score a non-zero :meth:`at_risk` here: a shared chunk
        alive but within ``danger_tokens`` of the horizon."""
        rep = self._reps.get(replica)
        if rep is None or not horizon or horizon <= 0 or not rep.by_age:
            return False
        lo = rep.clock - horizon
        hi = rep.clock + self.danger_tokens - horizon
        for t, _k in rep.by_age.irange((lo, float("inf")), (hi, float("inf")), (False, True)):
            if t > lo:
                return True
        return False

    def forget_replica(self, replica: ReplicaKey) -> None:
        """Its cache is not what the watch says (restarted, removed, distrusted)."""
        self._reps.pop(replica, None)

    def clock(self, replica: ReplicaKey) -> int:
        """New tokens routed to ``replica`` since the watch first saw it (for explain)."""
        rep = self._reps.get(replica)
        return rep.clock if rep is not None else 0
