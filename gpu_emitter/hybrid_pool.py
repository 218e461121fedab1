"""A paged KV cache for a hybrid model that caches, evicts and publishes like vLLM 0.32.

Layered as vLLM's ``v1/core``, each module importing only the ones above it:

- :mod:`gpu_emitter.request`: a running request and its per-group block lists.
- :mod:`gpu_emitter.block_pool` (vLLM's ``BlockPool``): the free queue (LRU, lazy eviction)
  and the prefix-cache map shared by all KV-cache groups.
- :mod:`gpu_emitter.managers` (vLLM's per-type managers): each kind's own
  ``find_longest_cache_hit`` over the pool's map (spec §4.4), which positions a group holds,
  which blocks it frees as the request advances and which full blocks it hashes (§4.7).
- :mod:`gpu_emitter.coordinator` (vLLM's unitary/hybrid coordinators): spec groups and the
  hybrid fixed-point loop (§4.5) that turns the managers' hits into the request's hit.
- this module, :class:`HybridBlockPool` (vLLM's ``KVCacheManager``): admission, decode,
  free, reset, events, and one KV tensor per group.

The hit is the engine's own: nothing here imports the router, so a test that compares the
router's predicted hit with a replica's ``cached_tokens`` checks one implementation against
another.

Events are exactly what vLLM 0.32 would queue: one ``BlockStored`` per (request, group,
scheduling step) covering the newly full block range (``token_ids`` of the whole range,
``block_hashes`` only for the inserted blocks, possibly none), ``BlockRemoved`` with one hash
per evicted block, and ``AllBlocksCleared`` on a successful reset. Hashes are wire hashes
(uint64, or raw digests when ``layout.hash.int_block_hashes`` is false).

Engine-builder example (one batch per engine step)::

    from events.publisher import EventPublisher
    from gpu_emitter.hybrid_pool import HybridBlockPool
    from gpu_emitter.hook import PublisherHook
    from gpu_emitter.layouts import load_layout

    pub = EventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558")
    hook = PublisherHook(pub)
    pool = HybridBlockPool(load_layout("fa_swa"), 4096, hook=hook)
    hit = pool.admit("r1", prompt_ids)        # None: not enough blocks, keep it waiting
    if hit is not None:
        pool.compute_prefill("r1")            # the "forward pass": writes the KV it computed
    hook.end_step()                           # publishes this step's events (if any)
    pool.append_tokens("r1", [next_token])    # a decode step; False: no space this step
    hook.end_step()
    pool.finish("r1")

Without a hook, drain :meth:`HybridBlockPool.take_events` once per step and publish the list.

Modelling choices that differ from vLLM (none changes which hashes exist or a hit):

- A prompt is prefilled in one scheduling step unless ``prefill_chunk`` is set. With a Mamba
  group vLLM's align mode also ends a step at every checkpoint (and, for ``R > 0``, at every
  ``R`` boundary). :meth:`HybridBlockPool.admit` runs all those steps back to back, so its
  events may hold several ``BlockStored`` per group, all in one batch (vLLM spreads them over
  engine steps, interleaved with other requests).
- Admission is all-or-nothing and checks the blocks of all its steps at once, not crediting
  blocks freed between them (conservative: it may keep a request waiting that vLLM would
  start). A decode step that cannot get a block changes nothing (vLLM would still free the
  out-of-window blocks first; frees emit no event).
- The prefix-cache map is keyed by the wire hash (vLLM keys by the full digest); with uint64
  wire hashes two distinct digests could in principle collide.
- Not modelled: EAGLE groups, partial-hash-hit layouts and full-attention
  partial tail entries (rejected or absent; they never change a non-partial hit),
  preemption, KV connectors, ``kv_cache_report_mode="full"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import torch

from events.hashing import BlockHasher, LazyChain, RequestKeys
from events.layout import GroupKind, LayoutError, ModelLayout, ResolvedLayout, resolve
from events.retention import reachable_boundaries
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from gpu_emitter.block_pool import NULL_BLOCK, BlockPoolCore, KVEvent
from gpu_emitter.coordinator import CacheHit, make_coordinator
from gpu_emitter.managers import MambaManager, manager_for
from gpu_emitter.request import Request
from gpu_emitter.shared_store import SharedStore, StoreConnector

__all__ = [
    "DuplicateRequest",
    "EventHook",
    "HybridBlockPool",
    "ModelShape",
    "PoolInvariantError",
    "UnknownRequest",
    "UnsupportedLayout",
]

#: The constants of the deterministic KV "model" (see :meth:`HybridBlockPool.expected_kv`).
_MOD = 2039
_SIG_MOD = 65521


class UnsupportedLayout(LayoutError):
    """A layout vLLM accepts but this pool does not model; the message says what to change."""


class UnknownRequest(KeyError):
    """An operation named a request the pool does not hold."""

    def __str__(self) -> str:
        return f"unknown request {self.args[0]!r}: admit it first (or it already finished)"


class DuplicateRequest(ValueError):
    """``admit`` was called with the id of a request that is still running."""


class PoolInvariantError(RuntimeError):
    """The pool's bookkeeping contradicts itself (a bug): see ``check_invariants``."""


class ModelShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-group KV tensor shape: ``[num_blocks, block_size, layers, 2 (K, V), heads, dim]``.

    Block-then-slot major like vLLM's paged layout, so one token's KV is one flat slot
    (``block * block_size + offset``) and writes/reads are a single index on dim 0.
    """

    layers_per_group: int = 1
    kv_heads: int = 1
    head_dim: int = 8
    dtype: str = "float16"


class EventHook(Protocol):
    """Receives each event as the pool produces it (see :class:`gpu_emitter.hook.PublisherHook`)."""

    def on_stored(self, ev: BlockStored) -> None: ...

    def on_removed(self, ev: BlockRemoved) -> None: ...

    def on_cleared(self, ev: AllBlocksCleared) -> None: ...


# --------------------------------------------------------------------------- helpers


def _check_tokens(token_ids: Sequence[int], what: str = "token_ids") -> list[int]:
    tokens = list(token_ids)
    for t in tokens:
        if type(t) is not int or t < 0:
            raise TypeError(
                f"{what} must be non-negative Python ints (vLLM hashes ints); got {t!r}"
            )
    return tokens


def _check_supported(r: ResolvedLayout) -> None:
    lay = r.layout
    if r.partial_hits:
        raise UnsupportedLayout(
            "partial hash hits (a Mamba block larger than hash_block_size) are not modelled "
            "by HybridBlockPool: drop prefix_match_unit so hash_block_size equals the block size"
        )
    for i, g in enumerate(lay.groups):
        if g.eagle:
            raise UnsupportedLayout(f"groups[{i}] is an EAGLE group: set eagle = false")
        if not g.prefix_cacheable or manager_for(g) is None:
            raise UnsupportedLayout(
                f"groups[{i}] ({g.kind}, prefix_cacheable={g.prefix_cacheable}) is not "
                "modelled: use full_attention, mla_attention, sink_full_attention, "
                "chunked_local_attention, sliding_window(_mla) or mamba"
            )
        if g.kind == GroupKind.MAMBA and g.mamba_mode != "align":
            raise UnsupportedLayout(f"groups[{i}] mamba_mode {g.mamba_mode!r}: only 'align'")
    ri = lay.retention_interval
    if ri is not None and (ri < 0 or (ri > 0 and ri % r.scheduler_block_size)):
        raise UnsupportedLayout(
            f"retention_interval {ri} must be 0, null or a positive multiple of the scheduler "
            f"block size {r.scheduler_block_size}"
        )


# --------------------------------------------------------------------------- the pool


class HybridBlockPool:
    """A vLLM 0.32-like KV cache for one replica (see the module docstring).

    Args:
        layout: the model's KV-cache groups and hash settings (validated with
            :func:`events.layout.resolve`).
        num_blocks: physical blocks, including vLLM's null block (so ``num_blocks - 1`` are
            usable), shared by all groups.
        shape: per-group KV tensor shape.
        device: torch device; None picks ``cuda`` when available, else ``cpu``.
        max_hit_check: after every hit computation, check by brute force that no longer
            aligned length is accepted by every spec group and that the hit itself is
            (raises :class:`gpu_emitter.coordinator.HitCheckError`); a debugging aid, costs a
            scan per request.
        hook: receives every event as it is produced (e.g. a
            :class:`gpu_emitter.hook.PublisherHook`).
        queue_events: also keep events for :meth:`take_events`; default: only without a hook.
        prefill_chunk: vLLM's chunked-prefill budget (tokens per step for one long prompt):
            admission then runs one scheduling step per chunk, so its events split as
            vLLM's do. None: the whole prompt in one step.
        store: a store shared with other replicas (vLLM's Mooncake store connector,
            :mod:`gpu_emitter.shared_store`): admission loads from it what the connector
            would, on top of the local hit, and saves the prompt's blocks to it, publishing
            ``medium="cpu"`` events. None: no connector.
    """

    def __init__(
        self,
        layout: ModelLayout,
        num_blocks: int,
        *,
        shape: ModelShape = ModelShape(),  # noqa: B008 - frozen Struct
        device: str | None = None,
        max_hit_check: bool = False,
        hook: EventHook | None = None,
        queue_events: bool | None = None,
        prefill_chunk: int | None = None,
        store: SharedStore | None = None,
    ) -> None:
        if type(num_blocks) is not int or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (one is the null block), got {num_blocks!r}"
            )
        self.resolved = r = resolve(layout)
        _check_supported(r)
        self.layout = layout
        self.num_blocks = num_blocks
        self.max_hit_check = max_hit_check
        self.hook = hook
        self._queue = hook is None if queue_events is None else queue_events
        self._events: list[KVEvent] = []
        self.hasher = BlockHasher(layout.hash, r.hash_block_size)
        self.core = BlockPoolCore(num_blocks, len(layout.groups), self._emit, r.hash_block_size)
        self.coordinator = make_coordinator(self.core, layout.groups, layout.retention_interval)
        self.managers = self.coordinator.managers
        self._mamba = any(isinstance(m, MambaManager) for m in self.managers)
        if prefill_chunk is not None and (type(prefill_chunk) is not int or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self._requests: dict[str, Request] = {}
        self.connector = (
            None
            if store is None
            else StoreConnector(
                store,
                layout.groups,
                r.hash_block_size,
                r.scheduler_block_size,
                layout.retention_interval,
                self._emit,
            )
        )

        self.shape = shape
        self.device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype = getattr(torch, shape.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"shape.dtype {shape.dtype!r} is not a torch dtype (e.g. float16)")
        self.dtype = dtype
        dims = (shape.layers_per_group, 2, shape.kv_heads, shape.head_dim)
        if min(dims) < 1:
            raise ValueError(f"every ModelShape dimension must be >= 1, got {shape}")
        self.kv: list[torch.Tensor] = [
            torch.zeros(
                (
                    num_blocks,
                    g.block_size,
                    shape.layers_per_group,
                    2,
                    shape.kv_heads,
                    shape.head_dim,
                ),
                dtype=dtype,
                device=self.device,
            )
            for g in layout.groups
        ]
        grid = torch.stack(
            torch.meshgrid(*(torch.arange(n, device=self.device) for n in dims), indexing="ij")
        )
        weights = torch.tensor([17, 3, 5, 1], device=self.device).view(4, 1, 1, 1, 1)
        inner = (grid * weights).sum(0)
        self._inner = [(inner + 101 * gi) % _MOD for gi in range(len(layout.groups))]

    # ------------------------------------------------------------------ events

    def _emit(self, ev: KVEvent) -> None:
        if self._queue:
            self._events.append(ev)
        hook = self.hook
        if hook is not None:
            if type(ev) is BlockStored:
                hook.on_stored(ev)
            elif type(ev) is BlockRemoved:
                hook.on_removed(ev)
            else:
                hook.on_cleared(ev)

    def take_events(self) -> list[KVEvent]:
        """Drain the queued events, oldest first (vLLM's ``take_events``)."""
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ state

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks included)."""
        return self.core.num_free

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage``: the share of usable blocks some request holds."""
        return 1.0 - self.core.num_free / (self.num_blocks - 1)

    def cached_count(self, group: int, wire_hash: Any) -> int:
        """Physical blocks of ``group`` currently keyed by ``wire_hash``."""
        return len(self.core.cache[group].get(wire_hash, ()))

    def cached_keys(self, group: int) -> dict[Any, int]:
        """Every key of ``group`` with its copy count (for tests and debugging)."""
        return {w: len(c) for w, c in self.core.cache[group].items()}

    def request(self, req_id: str) -> Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise UnknownRequest(req_id) from None

    @property
    def running(self) -> list[str]:
        return list(self._requests)

    def check_invariants(self) -> None:
        """Raise :class:`PoolInvariantError` if the bookkeeping is inconsistent.

        Checked: the null block is never free or cached; a block is in the free queue iff no
        request holds it; its reference count equals the positions holding it; a block
        belongs to one group at a time (its holders' and its key's); the prefix-cache map
        and the blocks' keys agree. For tests and debugging (it walks every block).
        """
        core = self.core
        fail = PoolInvariantError
        if NULL_BLOCK in core.free_queue or core.key[NULL_BLOCK] is not None:
            raise fail("the null block is free or cached")
        holders = [0] * self.num_blocks
        owner = [-1] * self.num_blocks
        for req in self._requests.values():
            for g, st in enumerate(req.groups):
                for bid in st.blocks:
                    if bid == NULL_BLOCK:
                        continue
                    holders[bid] += 1
                    if owner[bid] not in (-1, g):
                        raise fail(f"block {bid} is held by groups {owner[bid]} and {g}")
                    owner[bid] = g
        for bid in range(1, self.num_blocks):
            if (bid in core.free_queue) != (core.ref[bid] == 0):
                raise fail(f"block {bid}: ref {core.ref[bid]} but free={bid in core.free_queue}")
            if core.ref[bid] != holders[bid]:
                raise fail(f"block {bid}: ref {core.ref[bid]} but {holders[bid]} holders")
            if core.key[bid] is not None:
                g = core.key_group[bid]
                if owner[bid] not in (-1, g):
                    raise fail(f"block {bid} keyed in group {g} but held by {owner[bid]}")
                if bid not in core.cache[g].get(core.key[bid], ()):
                    raise fail(f"block {bid}'s key is missing from the cache map")
        for g, table in enumerate(core.cache):
            for wire, copies in table.items():
                if not copies:
                    raise fail(f"group {g}: empty copy list for {wire!r}")
                for bid in copies:
                    if core.key[bid] != wire or core.key_group[bid] != g:
                        raise fail(f"group {g}: map says block {bid} holds {wire!r}")

    # ------------------------------------------------------------------ hits

    def find_hit(
        self,
        token_ids: Sequence[int],
        keys: RequestKeys | None = None,
        *,
        skip_reading: bool = False,
        explain: bool = False,
    ) -> CacheHit:
        """The hit vLLM would compute for this prompt now; no state change (spec §4).

        ``explain`` adds each spec group's own hit (``spec_group_hits``, in the layout's
        spec-group order: full-attention types first)."""
        tokens = _check_tokens(token_ids)
        return self._find(len(tokens), self.hasher.lazy_chain(tokens, keys), skip_reading, explain)

    def _find(self, n: int, chain: LazyChain, skip_reading: bool, explain: bool) -> CacheHit:
        coord = self.coordinator
        if skip_reading:
            # prompt_logprobs or skip_reading_prefix_cache: vLLM does not look (spec §4.1).
            zeros = (0,) * len(coord.spec_groups) if explain else ()
            return CacheHit(0, tuple([] for _ in self.managers), 0, 0, 0, zeros)
        max_length = max(n - 1, 0)  # the last token is always recomputed (spec §4.1)
        res = coord.find_longest_cache_hit(chain, max_length)
        if self.max_hit_check:
            coord.check_maximal(chain, max_length, res.hit_tokens)
        if explain:
            hits = coord.spec_group_hits(chain, max_length)
            res = CacheHit(
                res.hit_tokens, res.blocks, res.longest, res.num_uncached, res.passes, hits
            )
        return res

    # ------------------------------------------------------------------ admission

    def _step_ends(self, n: int, hit: int, reachable: frozenset[int]) -> list[int]:
        """Ends of the scheduling steps of a prefill: one step per ``prefill_chunk`` (or one
        in all); Mamba's align mode also ends a step at every checkpoint (and every retention
        boundary) and rounds chunk ends down to its block size."""
        cuts: set[int] = set()
        chunk = self.prefill_chunk
        if chunk is not None:
            cuts.update(range(hit + chunk, n, chunk))
        if self._mamba:
            b = self.resolved.scheduler_block_size
            cuts = {c // b * b for c in cuts}
            cuts.update(reachable)
            r = self.layout.retention_interval
            if r:
                cuts.update(range(r, n, r))
        return [c for c in sorted(cuts) if hit < c < n] + [n]

    def admit(
        self,
        req_id: str,
        token_ids: Sequence[int],
        keys: RequestKeys | None = None,
        *,
        skip_reading: bool = False,
    ) -> int | None:
        """Start a request: hit, touch, allocate the prompt's slots and cache its full blocks.

        vLLM's ``get_computed_blocks`` + ``allocate_slots`` for the whole prompt. Returns the
        hit in tokens (with a shared store: the local hit plus the tokens loaded from the
        store, what vLLM reports as ``cached_tokens``), or None, with no state change at all,
        when the free blocks do not suffice (the caller keeps the request waiting). Call
        :meth:`compute_prefill` next (before another request can read these blocks), as the
        forward pass would.
        """
        if req_id in self._requests:
            raise DuplicateRequest(
                f"request {req_id!r} is still running: finish it first or use a fresh id"
            )
        tokens = _check_tokens(token_ids)
        n = len(tokens)
        if n == 0:
            raise ValueError("token_ids is empty: vLLM rejects empty prompts")
        chain = self.hasher.lazy_chain(tokens, keys)
        res = self._find(n, chain, skip_reading, False)
        hit = res.hit_tokens
        spb = res.longest if res.num_uncached > 0 else None
        a = self.coordinator.alignment
        reachable = reachable_boundaries(n, spb, a)
        ends = self._step_ends(n, hit, reachable)
        hit_lists = res.blocks
        core = self.core
        evictable = {b for lst in hit_lists for b in lst if b != NULL_BLOCK and core.ref[b] == 0}
        need = len(evictable) + sum(m.admission_blocks(hit, ends) for m in self.managers)
        if need > core.num_free:
            return None

        req = Request(
            req_id, tokens, keys, hit, spb, a, len(self.managers), self.resolved.hash_block_size
        )
        req.wires = chain.wires()
        if self.connector is not None and not skip_reading:
            req.external = self.connector.matched_tokens(req.wires, n, hit)
        req.last_digest = chain.digest(len(chain) - 1) if len(chain) else self.hasher.none_hash
        for m, st, lst in zip(self.managers, req.groups, hit_lists, strict=True):
            st.blocks = list(lst)
            st.num_cached = hit // m.block_size
        for st in req.groups:
            core.touch(st.blocks)
        for end in ends:
            self._step(req, end, record=True)
        self._requests[req_id] = req
        if self.connector is not None:
            self.connector.save(tokens, req.wires, n)
        return hit + req.external

    def _step(self, req: Request, end: int, *, record: bool) -> None:
        """One scheduling step computing tokens ``[num_computed, end)`` (``allocate_slots``)."""
        coord = self.coordinator
        coord.remove_skipped_blocks(req, req.num_computed)
        new = coord.allocate_slots(req, end)
        if record:
            epoch = self.core.epoch
            req.pending.extend((gi, pos, bid, epoch[bid]) for gi, pos, bid in new)
        coord.cache_blocks(req, min(end, len(req.tokens)))
        req.num_computed = end

    # ------------------------------------------------------------------ decode / free

    def append_tokens(self, req_id: str, new_token_ids: Sequence[int]) -> bool:
        """A decode step: the request grows by ``new_token_ids``, which are computed now.

        Allocates a block where one fills up, frees blocks that left a sliding window (and
        Mamba's previous state block), caches newly full blocks (dense for full attention;
        SWA/Mamba only per the retention rules, spec §4.7) and writes their KV. Returns
        False, changing nothing, when no block is available.
        """
        req = self.request(req_id)
        new = _check_tokens(new_token_ids, "new_token_ids")
        if not new:
            return True
        end = req.num_computed + len(new)
        core = self.core
        need = self.coordinator.num_new_blocks(req, end)
        if need > core.num_free:
            freeable = {
                b
                for m, st in zip(self.managers, req.groups, strict=True)
                for _, b in m.skipped_to_free(st, req.num_computed)
                if core.ref[b] == 1
            }
            if need > core.num_free + len(freeable):
                return False
        start = len(req.tokens)
        req.tokens.extend(new)
        self._extend_hashes(req)
        self._step(req, end, record=False)
        self._write_positions(req, range(start, end))
        return True

    def _extend_hashes(self, req: Request) -> None:
        h = self.resolved.hash_block_size
        tokens = req.tokens
        keys = req.keys
        for unit in range(len(req.wires), len(tokens) // h):
            extras = keys.unit_extras(unit, h) if keys is not None else None
            d = self.hasher.step(req.last_digest, tokens[unit * h : (unit + 1) * h], extras)
            req.last_digest = d
            req.wires.append(self.hasher.to_wire(d))

    def finish(self, req_id: str) -> None:
        """Free the request's blocks (group by group, tail first); cached ones stay cached."""
        req = self.request(req_id)
        self.coordinator.free(req)
        del self._requests[req_id]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False, no event) while any block is in use."""
        return self.core.reset()

    # ------------------------------------------------------------------ KV data

    def _finish(self, base: torch.Tensor, group: int) -> torch.Tensor:
        v = (base.view(-1, 1, 1, 1, 1) + self._inner[group]) % _MOD
        return (v.to(torch.float32) / _MOD).to(self.dtype)

    def expected_kv(
        self, token_ids: Sequence[int], group: int, positions: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The KV a recomputation gives: ``[positions, layers, 2, heads, dim]``.

        A value depends on the token, its position, a signature of the whole prefix up to it,
        the group, layer, K/V, head and channel, so a block reused from a different prefix
        would not match. Mamba groups use the same per-position values (the "state after
        position p"). Computed vectorised here, incrementally by the pool; both give the
        same integers, hence the same values.
        """
        tokens = torch.tensor(_check_tokens(token_ids), dtype=torch.int64, device=self.device)
        if positions is None:
            pos = torch.arange(tokens.numel(), device=self.device)
        else:
            pos = torch.tensor(list(positions), dtype=torch.int64, device=self.device)
        every = torch.arange(tokens.numel(), device=self.device)
        sig = torch.cumsum((tokens + 1) * (every % 251 + 1), 0) % _SIG_MOD
        base = (tokens[pos] * 31 + pos * 7 + sig[pos] * 13) % _MOD
        return self._finish(base, group)

    def _slots(self, group: int) -> torch.Tensor:
        """The group's KV as ``[num_blocks * block_size, layers, 2, heads, dim]`` (a view)."""
        return self.kv[group].flatten(0, 1)

    def _base(self, req: Request, positions: list[int]) -> torch.Tensor:
        """Per-position part of the KV values, from the request's running prefix sums (cheap
        for the few positions of a decode step)."""
        cum = req.cum
        tokens = req.tokens
        for p in range(len(cum), len(tokens)):
            cum.append((cum[-1] if p else 0) + (tokens[p] + 1) * (p % 251 + 1))
        vals = [(tokens[p] * 31 + p * 7 + (cum[p] % _SIG_MOD) * 13) % _MOD for p in positions]
        return torch.tensor(vals, dtype=torch.int64, device=self.device)

    def _write_positions(self, req: Request, positions: range) -> None:
        """Decode: write the new positions wherever a group holds their block."""
        base: torch.Tensor | None = None
        for gi, (m, st) in enumerate(zip(self.managers, req.groups, strict=True)):
            b = m.block_size
            ps, bs = [], []
            for p in positions:
                bid = st.blocks[p // b]
                if bid != NULL_BLOCK:
                    ps.append(p)
                    bs.append(bid)
            if not ps:
                continue
            dev = self.device
            if len(ps) == len(positions):
                if base is None:
                    base = self._base(req, list(positions))
                vals = base
            else:
                vals = self._base(req, ps)
            slots = torch.tensor(
                [bid * b + p % b for p, bid in zip(ps, bs, strict=True)],
                dtype=torch.int64,
                device=dev,
            )
            self._slots(gi)[slots] = self._finish(vals, gi)

    def compute_prefill(self, req_id: str) -> None:
        """Write the KV of the prompt positions admission did not hit; hit blocks are reused
        untouched. Blocks allocated at admission and since re-allocated are skipped (their
        key was evicted with them, so nothing can read them)."""
        req = self.request(req_id)
        pending, req.pending = req.pending, []
        epoch = self.core.epoch
        live = [w for w in pending if epoch[w[2]] == w[3]]
        if not live:
            return
        dev = self.device
        n = req.num_prompt_tokens
        tokens = torch.tensor(req.tokens[:n], dtype=torch.int64, device=dev)
        every = torch.arange(n, device=dev)
        sig = torch.cumsum((tokens + 1) * (every % 251 + 1), 0) % _SIG_MOD
        base = (tokens * 31 + every * 7 + sig * 13) % _MOD
        for gi in sorted({w[0] for w in live}):
            b = self.managers[gi].block_size
            blocks = [(pos, bid) for g, pos, bid, _ in live if g == gi]
            starts = torch.tensor([pos * b for pos, _ in blocks], dtype=torch.int64, device=dev)
            ids = torch.tensor([bid for _, bid in blocks], dtype=torch.int64, device=dev)
            p = (starts.view(-1, 1) + torch.arange(b, device=dev)).reshape(-1)
            slots = (ids.view(-1, 1) * b + torch.arange(b, device=dev)).reshape(-1)
            keep = (p >= req.hit) & (p < n)
            self._slots(gi)[slots[keep]] = self._finish(base[p[keep]], gi)

    def kv_positions(self, req_id: str, group: int) -> list[int]:
        """Positions of the request the group holds a block for, in order."""
        req = self.request(req_id)
        m = self.managers[group]
        b = m.block_size
        n = len(req.tokens)
        out: list[int] = []
        for j, bid in enumerate(req.groups[group].blocks):
            if bid != NULL_BLOCK:
                out.extend(range(j * b, min((j + 1) * b, n)))
        return out

    def gather_kv(self, req_id: str, group: int) -> torch.Tensor:
        """The request's KV in ``group``, position-ordered, for :meth:`kv_positions` only:
        ``[positions, layers, 2, heads, dim]``. Compare with ``expected_kv(tokens, group,
        kv_positions(...))``, or use :meth:`verify_kv`."""
        req = self.request(req_id)
        b = self.managers[group].block_size
        pos = self.kv_positions(req_id, group)
        blocks = req.groups[group].blocks
        slots = [blocks[p // b] * b + p % b for p in pos]
        return self._slots(group)[torch.tensor(slots, dtype=torch.int64, device=self.device)]

    def verify_kv(self, req_id: str) -> bool:
        """Every group's held KV equals a recomputation (reused blocks included)."""
        req = self.request(req_id)
        for g in range(len(self.managers)):
            pos = self.kv_positions(req_id, g)
            if not torch.equal(self.gather_kv(req_id, g), self.expected_kv(req.tokens, g, pos)):
                return False
        return True
