"""Presence of (group, wire hash) per replica, per tier: what each replica's cache holds.

State follows the events alone, applied in stream order (spec §2.5, §5.2):

- Keyed by ``(tier, group_idx, wire hash)``: the same hash value appears in every group for
  one prefix, and a sliding-window removal must never touch the full-attention entry (§6.3-4).
- Each key maps to a **replica bitmask** (one bit per replica and DP rank, a "slot"), so a
  single lookup answers for every replica at once and the cost of a decision grows with the
  prompt, not with replicas x prompt.
- **Counts, not sets** (§0.7, §6.15): vLLM may hold several physical copies of a key and
  sends one ``BlockRemoved`` per evicted copy. The bit stands for the first copy; further
  copies live in a small side table that is empty in the common case.
- Partial entries (an event ``block_size`` below the group's) go in the same table: their
  hash is the chain hash at a boundary inside a block, so it can only ever match a
  fine-grained lookup at that boundary (§1.4, §6.5).

The index never guesses: a replica whose stream lost events it cannot recover, whose layout
contradicts the pool's, or whose hashes fail the live conformance check is marked untrusted
(with the reason) and predicts no hit until a known state returns.

Memory is accounted in bytes and bounded by ``IndexLimits.max_bytes``. The account
(:meth:`KVIndex.nbytes`) follows what the index holds, as tracemalloc measures it on CPython:
the tables as allocated (``sys.getsizeof`` of each, O(tables)), one hash object per key of a
dict table (its size sampled once: a pool's hashes share one type), the replica bitmask of
each key two or more replicas hold, by its width (a Python int grows 4 bytes per 30 bits of
slots, so masks of high slots cost more; the ingest updates this part only when a mask's
highest bit moves), a tuple and a hash object per side-table entry and ~1.2 kB per replica's
own records. A key one replica alone holds (most keys: conversations, one-offs) stores that
replica's own bit object as its mask, so it costs no int of its own.

**Tables** (docs/index-memory.md): where the C extension ``router.core._keytable`` is built
and the pool's wire hashes are ints (``int_block_hashes``, vLLM's default), each (tier, group)
table is a ``KeyTable``: the 64-bit hash stored inline beside the mask pointer, 16 bytes a
slot at a load of 1/2-3/4, so a key costs 21-32 bytes where a dict spends ~44 on its slot and
36 on the int object of the key. Otherwise (not built, ``KVROUTER_NATIVE_INDEX=0``, bytes
hashes) the tables are dicts, the reference the KeyTable is tested against. A KeyTable refuses
a key that is not an int in [0, 2**64) (a replica sending bytes or negative hashes although
the pool's are ints): that one table is then turned into a dict holding the same keys
(``KVIndex.demoted``), so the key is kept as the dict path keeps it.
tests/test_index_memory.py holds the account within 10 % of tracemalloc at 8-256 replicas on
either kind of table, and bench/fleet_bench.py reports the ratio.

**Wipes** (a clear, a restart, lost events, a replica seen down or removed) do not scan the
index: the replica takes a fresh slot at once, and its old bit becomes *dead*, read by no
prediction (no replica has it), cleared from the keys by :meth:`KVIndex.sweep` in bounded
steps (after each batch, and on the server's timer); the slot is given again only when no key
carries it (docs/live-fleet.md §3).

When the account exceeds the budget, 10 % of the keys of the largest table are reclaimed at a
time until it is under 90 % of the budget: a dict's oldest-inserted keys (dicts keep
insertion order, so FIFO by first store; a dict does not shrink, so its allocation stays
counted), a KeyTable's next keys in a clock sweep over its (seeded) hash order, each reclaim
resuming where the last stopped, after which it shrinks to fit (so a budget holds 2-5x the
keys it holds with dicts). Reclaimed keys only ever make predictions lower than the truth (a
missing key cannot create a hit), and their later removals are ignored like any unknown
hash.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from events.hashing import DEFAULT_MEMO_ENTRIES, BlockHasher, RequestKeys, expected_stored_hashes
from events.layout import (
    SLIDING_KINDS,
    GroupKind,
    GroupSpec,
    LayoutError,
    ModelLayout,
    ResolvedLayout,
    resolve,
)
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    LazyTokensBlockStored,
    UnknownEvent,
)
from router.core.eviction_order import EvictionWitness
from router.core.layout_quorum import (
    LayoutState,
    LayoutViewState,
    QuorumVerdict,
    View,
    complete_view,
    decide,
    describe,
)
from router.core.shared_tier import SharedTier
from router.core.snapshot import ReplicaSnapshot

__all__ = [
    "NATIVE_INDEX_ENV",
    "TIERS",
    "HashTable",
    "IndexLimits",
    "KVIndex",
    "LayoutConflict",
    "ReplicaKey",
    "ReplicaStats",
    "Trust",
    "UnknownReplica",
]

log = logging.getLogger(__name__)

#: Storage tiers, GPU first. An event with no medium (old producers) is a GPU event.
TIERS = ("GPU", "CPU", "STORAGE")

#: How far a replica's indexed state can be believed (KVIndex.trust).
Trust = Literal["exact", "partial", "untrusted"]

#: A routing target: a replica name and a DP rank (each rank is its own cache, §6.7).
ReplicaKey = tuple[str, int]

#: CPython's int layout: a header plus one digit per ``bits_per_digit`` bits (24 + 4 bytes per
#: 30 bits on 64-bit builds). Ints below 256 are shared singletons and cost a mask nothing.
_DIGIT_BITS = sys.int_info.bits_per_digit
_DIGIT_BYTES = sys.int_info.sizeof_digit
_INT_BASE = sys.getsizeof(1) - _DIGIT_BYTES
_SMALL_INT = 256
#: A side-table entry: its ``(slot, hash)`` tuple (the hash object is counted apart). One per
#: (replica, key) with copies, whatever their number: the count is a shared small int.
_EXTRA_BYTES = sys.getsizeof((0, 0))
#: One replica's own records (its _Replica, counters and small dicts), measured by tracemalloc.
_REPLICA_BYTES = 1200


def _proof_state(rep: _Replica) -> str | None:
    """:attr:`ReplicaStats.eviction_proof` of a replica."""
    if rep.trust != "partial":
        return None
    w = rep.witness
    if w is None or w.off is not None:
        return f"off: {rep.witness_off or (w.off if w else 'not started')}"
    return "armed" if w.armed else "settling"


def _mask_bytes(m: int) -> int:
    """Bytes of the int object holding replica bitmask ``m``, by its highest bit: 0 below 256
    (the interpreter's shared small ints), else the header and one digit per 30 bits. The mask
    of exactly 256 is counted though shared (28 bytes too many on keys only slot 8 holds): the
    size then depends on the highest bit alone, so the ingest hot path updates it only when
    that bit moves (KVIndex.apply_events)."""
    if m < _SMALL_INT:
        return 0
    return _INT_BASE + _DIGIT_BYTES * (-(-m.bit_length() // _DIGIT_BITS))


def _tier_name(medium: object) -> str | None:
    """The tier an event's ``medium`` spelling names (case-insensitive: vLLM writes "GPU",
    its Mooncake store connector "cpu"), or None when it is not a tier name at all."""
    if not isinstance(medium, str) or not medium or len(medium) > 64:
        return None
    return medium.upper()


def iter_bits(mask: int) -> Iterator[int]:
    """The set bits of a non-negative replica mask, lowest first, each as ``1 << slot``."""
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


#: Set to "0" to keep the index's tables in dicts even where router.core._keytable is built.
NATIVE_INDEX_ENV = "KVROUTER_NATIVE_INDEX"


def _load_keytable() -> Any:
    """The module ``router.core._keytable`` when it was built and is not switched off; else
    None.

    The extension is optional at build time (setup.py): without a C compiler the index keeps
    its tables in dicts, which hold the same keys and answer the same (tests/test_keytable.py),
    and predictions walk a request's chain in Python (tests/test_leading_walk.py).
    """
    if os.environ.get(NATIVE_INDEX_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from router.core import _keytable  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _keytable


_native = _load_keytable()
_KeyTable: type | None = None if _native is None else _native.KeyTable
#: ``router.core._keytable.leading_walk`` (router.core.predict's walk over these tables, in
#: C), or None where the tables are dicts because the extension is missing or switched off
#: (or was built before it had the walk: a stale in-place build walks in Python).
leading_walk: Callable[..., tuple[int, int]] | None = getattr(_native, "leading_walk", None)


def native_index() -> str | None:
    """The compact table in use for new indexes (``"router.core._keytable"``), or None when
    they keep dicts (not built, or ``KVROUTER_NATIVE_INDEX=0``)."""
    return None if _KeyTable is None else "router.core._keytable"


class HashTable(Protocol):
    """What the index and its readers use of one (tier, group) table: a dict, or a
    ``router.core._keytable.KeyTable`` (uint64 keys inline, docs/index-memory.md)."""

    def get(self, key: object, default: int = 0, /) -> int: ...
    def __setitem__(self, key: object, value: int, /) -> None: ...
    def __delitem__(self, key: object, /) -> None: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[object]: ...
    def items(self) -> Iterable[tuple[object, int]]: ...
    def values(self) -> Iterable[int]: ...


def _pop_some(table: HashTable, n: int) -> list[tuple[object, int]]:
    """Remove ``n`` keys of ``table`` for a reclaim and return them with their masks: a
    dict's oldest-inserted (dicts keep insertion order), a KeyTable's next in its clock sweep
    over hash order (it then shrinks to fit, so the bytes freed show in the account)."""
    if type(table) is dict:
        return [(h, table.pop(h)) for h in list(itertools.islice(table, n))]
    return table.pop_some(n)  # type: ignore[attr-defined]


_UNSET_MEDIUM = object()
"""No removal resolved yet in a batch (KVIndex.apply_events)."""


def _held_bytes(m: int) -> int:
    """What the mask ``m`` stored as a key's value costs: nothing for a single holder, whose
    mask is its replica's own bit object (shared by every key it alone holds), else
    :func:`_mask_bytes`."""
    return _mask_bytes(m) if m & (m - 1) else 0


class UnknownReplica(KeyError):
    """An operation named a replica the index does not hold."""

    def __str__(self) -> str:
        return f"unknown replica {self.args[0]!r}: add it with KVIndex.add_replica() first"


class LayoutConflict(LayoutError):
    """Events contradict the declared layout, or replicas of one pool disagree.

    Names the field and both values so the operator can tell which side to fix.
    """

    def __init__(self, field_name: str, expected: object, observed: object, where: str) -> None:
        self.field = field_name
        self.expected = expected
        self.observed = observed
        self.where = where
        super().__init__(
            f"{where}: {field_name} is {observed!r} in the events but {expected!r} in the "
            f"pool layout; fix the pool's config (or the replica's launch flags) so they agree"
        )


@dataclass(slots=True)
class IndexLimits:
    """Bounds and sampling rates; the defaults suit a few million cached blocks."""

    max_bytes: int = 2 << 30
    """Memory budget of the index (KVIndex.nbytes: about 25-45 bytes per key with compact
    tables, 70-160 with dicts, more with more replicas); over it, keys are reclaimed."""
    conformance_first: int = 64
    """Root full-attention stores re-hashed per replica before sampling starts."""
    conformance_every: int = 32
    """After that, one root store in this many is re-hashed."""
    max_groups: int = 64
    """``group_idx`` accepted from the wire is ``0 <= g < max_groups``. A table per group is
    allocated on first use, so an unbounded index would let one frame allocate millions."""
    max_block_size: int = 1 << 16
    """Largest ``block_size`` a store may announce (tokens). A bigger one is refused, not
    learned: a learned layout with a huge block would make every prediction 0."""
    max_extra_tiers: int = 8
    """Tiers beyond GPU/CPU/STORAGE (a connector's own ``medium`` names) each replica may bring:
    a store naming a new tier past this many of its own is refused. Per replica, so one
    replica's junk names never use up the budget another's connector needs."""
    warn_interval_s: float = 60.0
    """One log warning per (replica, reason) per interval; every occurrence is still counted."""
    max_closure_parents: int = 1 << 17
    """Full-attention parents whose stored children a *partial* replica's index remembers
    (KVIndex._close_ancestors); past it the oldest are forgotten (predictions stay a lower
    bound, only less often exact). About 150 bytes each."""
    max_partial_removals: int = 1 << 14
    """Sliding-window keys a *partial* replica's index remembers as removed since attach
    (``_Replica.gone``, about 130 bytes each): past it, windows are no longer implied for that
    replica (router.core.predict.Predictor.implied_keys; full attention and witnessed parents
    go on). Implication matters most just after attach, so the bound is small."""
    max_witness_keys: int = 1 << 16
    """Keys a *partial* replica's eviction-order proof keeps a record for (a time bound or a
    newer copy: router.core.eviction_order, about 250 bytes each, so up to ~16 MB per partial
    replica); past it, after dropping those the index no longer holds, the proof is off for
    that replica (predictions stay a lower bound, only less often exact)."""
    max_dead_slots: int = 64
    """Wiped slots whose keys may still carry their bit (KVIndex.sweep clears them). A wipe
    beyond this many pending ones is done at once instead (O(index), counted in
    ``sync_wipes``): the bound keeps masks from widening without limit under a flapping
    fleet (each slot number adds 4 bytes per 30 to the masks that reach it)."""
    sweep_step: int = 2048
    """Table slots (a dict table: keys) one sweep step reads (KVIndex.sweep). About 15-30 us
    plus ~0.5 us per key it clears, after every applied batch."""


class ReplicaStats(msgspec.Struct):
    """What the index knows about one replica's stream; read by the admin API."""

    replica: str
    dp_rank: int
    trusted: bool
    untrusted_reason: str | None
    blocks: int
    """Keys currently held (all tiers and groups; extra copies not included)."""
    extra_copies: int
    stored_blocks: int
    removed_blocks: int
    unknown_removals: int
    partial_stores: int
    clears: int
    resets: int
    unrecoverable_gaps: int
    unknown_events: int
    conformance_checked: int
    conformance_mismatches: int
    conformance_skipped: int
    late_attaches: int
    inferred_blocks: int
    group_aware: bool | None
    trust: str = "exact"
    """``exact``, ``partial`` or ``untrusted`` (KVIndex.trust)."""
    partial_reason: str | None = None
    ingest_errors: dict[str, int] = {}
    """Refused events and ingest failures by reason (``kvrouter_ingest_errors_total``)."""
    closure_kept: int = 0
    """Removals of a partial replica's last known copy of a full-attention key that a held
    child proved was not its last copy (KVIndex._close_ancestors)."""
    eviction_proof: str | None = None
    """A partial replica's eviction-order proof (router.core.eviction_order): ``settling``
    (until two metrics scrapes in a row show no other client), ``armed``, or ``off: <why>``
    for the rest of the partial period; None while exact or untrusted."""
    older_copy_evicted: int = 0
    """Removals of a partial replica's last known copy of a key that the eviction order proved
    took an older copy (router.core.eviction_order): the key is held again."""
    witnessed_parents: int = 0
    """Keys a partial replica's stores named as their parent while the index did not hold
    them: blocks cached before attach, proved present by the store
    (KVIndex._after_partial_batch)."""
    implied_blocks: int = 0
    """Keys a partial replica holds by vLLM's cache structure, implied by held keys when a
    request's prefix named them (Predictor.implied_keys, KVIndex.infer)."""
    answer_keys_skipped: int = 0
    """Keys an answer of a partial replica showed hit that a ``BlockRemoved`` since the request
    was sent may have taken (a window block the request left and vLLM evicted before it
    answered): not learned (KVIndex.infer)."""
    layout_view: str | None = None
    """The replica's own view of the learned layout (router.core.layout_quorum.describe);
    None with a declared layout or before its first store."""
    layout_hold: str | None = None
    """``outvoted`` or ``contested`` while its view keeps it from predicting
    (router.core.layout_quorum), else None."""
    wipes: int = 0
    """Wipes of this replica's state that took it a fresh slot at once (KVIndex._wipe)."""
    sync_wipes: int = 0
    """Wipes done by a scan of the whole index, every dead slot being in use."""


@dataclass(slots=True)
class _Replica:
    name: str
    dp_rank: int
    slot: int
    bit: int
    mask_top: int = 0
    """Bytes of a mask whose highest bit is this replica's (_mask_bytes)."""
    mask_low: int = 0
    """Masks below ``bit`` and at or above this have the size ``mask_top`` (0 when every mask
    below ``bit`` costs what ``mask_top`` does): setting or clearing this replica's bit on
    them leaves the account as it is, so only masks below it need ``_mask_bytes``."""
    trusted: bool = True
    untrusted_reason: str | None = None
    partial_reason: str | None = None
    """Set while the replica is partial (see KVIndex.trust)."""
    recoverable: bool = True
    """Whether a known state (a clear or a restart) makes the replica trusted again: true
    for lost events, false for wrong settings, which only a config fix cures."""
    down: bool = False
    """Untrusted because the replica was seen down (KVIndex.seen_down) and nothing since has
    said what it holds: its next in-order batch makes it partial."""
    group_aware: bool | None = None
    roots_seen: int = 0
    blocks: int = 0
    """Keys this replica holds (all tiers and groups), kept as events apply so stats are O(1)."""
    extra: int = 0
    """Physical copies beyond the first, likewise."""
    learned: dict[int, GroupSpec] = field(default_factory=dict)
    """This replica's own view of the groups (learned mode): kind, window, largest block."""
    hold: str | None = None
    """Why its view keeps it from predicting (learned mode: outvoted or contested, see
    router.core.layout_quorum), recomputed by KVIndex._settle; None when it may predict."""
    hold_kind: str | None = None
    """``outvoted`` or ``contested`` with :attr:`hold`."""
    ingest_errors: dict[str, int] = field(default_factory=dict)
    warned: dict[str, float] = field(default_factory=dict)
    """Last warning time per reason label (the rate limit of IndexLimits.warn_interval_s)."""
    tiers_made: int = 0
    """Tiers this replica's events created (IndexLimits.max_extra_tiers bounds it)."""
    children: dict[tuple[int, object], list[object]] | None = None
    """While partial: full-attention ``(group, parent hash) -> child hashes`` seen stored, the
    witnesses of KVIndex._close_ancestors (None while exact or untrusted)."""
    gone: set[tuple[int, object]] | None = None
    """While partial: the GPU sliding-window ``(group, hash)`` keys whose removal since attach
    left the index without them (KVIndex.gone). A block cached before attach that is named
    only as an ancestor is implied present unless it is here; None while exact or untrusted,
    and once more than ``IndexLimits.max_partial_removals`` were seen (nothing is implied
    through windows from then)."""
    anchors: set[tuple[int, object]] | None = None
    """While partial: the held sliding-window keys whose window vLLM held when they were
    stored (stored since attach, or a store's parent), the only ones that imply the blocks
    before them (KVIndex.anchors). A key held for another reason (an answer, an implication)
    proves nothing about its own window. Dropped with ``gone``."""
    witness: EvictionWitness | None = None
    """While partial: the eviction-order proof's record (router.core.eviction_order)."""
    removed_at: OrderedDict[tuple[int, object], float] | None = None
    """While partial: when (monotonic) each recent GPU removal of a non-full-attention key was
    applied, the latest ``IndexLimits.max_partial_removals``: an answer's hit does not prove a
    window block the request left early and vLLM evicted before answering (KVIndex.infer)."""
    witness_off: str | None = None
    """Why the proof ended this partial period (its record is freed then)."""
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "stored_blocks",
                "removed_blocks",
                "unknown_removals",
                "partial_stores",
                "clears",
                "resets",
                "unrecoverable_gaps",
                "unknown_events",
                "conformance_checked",
                "conformance_mismatches",
                "conformance_skipped",
                "late_attaches",
                "inferred_blocks",
                "closure_kept",
                "older_copy_evicted",
                "witnessed_parents",
                "implied_blocks",
                "answer_keys_skipped",
                "wipes",
                "sync_wipes",
            ),
            0,
        )
    )

    def __post_init__(self) -> None:
        self.place(self.slot, self.bit)

    def place(self, slot: int, bit: int) -> None:
        """Take ``slot`` (its bit object ``bit``): on creation, and when a wipe gives the
        replica a fresh slot (KVIndex._wipe)."""
        self.slot, self.bit = slot, bit
        self.mask_top = _mask_bytes(bit)
        if bit < _SMALL_INT:
            self.mask_low = 0
        else:
            digit_start = 1 << (_DIGIT_BITS * (slot // _DIGIT_BITS))
            self.mask_low = max(_SMALL_INT, digit_start)

    @property
    def routed(self) -> bool:
        """Predicted on: trusted, and not held back by the layout quorum."""
        return self.trusted and self.hold is None

    @property
    def trust(self) -> Trust:
        if not self.trusted or self.hold is not None:
            return "untrusted"
        return "partial" if self.partial_reason is not None else "exact"


@dataclass(slots=True)
class _PartialScan:
    """What one pass over a partial replica's batch found (KVIndex._partial_scan), for
    KVIndex._close_ancestors and KVIndex._after_partial_batch after the batch is applied."""

    watch: list[tuple[int, object]] = field(default_factory=list)
    """Full-attention keys the batch removed that have recorded children."""
    parents: dict[tuple[int, object], bool] = field(default_factory=dict)
    """Keys the stores named as parent (implying groups), False if removed later in it."""
    stored: list[tuple[int, object]] = field(default_factory=list)
    """Sliding-window keys stored (anchors if still held after the batch)."""
    removed: list[tuple[int, object]] = field(default_factory=list)
    """Sliding-window keys removed (gone if not held after the batch)."""


@dataclass(slots=True)
class _Dead:
    """A wiped slot whose bit some keys may still carry (KVIndex._wipe): no prediction reads
    it (no replica has the bit), and the sweep clears it (KVIndex.sweep). The counts are what
    is left to clear, kept exact as for a replica, so the slot is free again at 0."""

    slot: int
    bit: int
    blocks: int
    extra: int


@dataclass(slots=True)
class _Sweep:
    """Where the sweep of dead bits stands: one pass over every table, in table order, each
    table in bounded steps (a KeyTable by hash position, a dict over a copy of its keys)."""

    bits: int
    """Dead before the pass began: every key carrying one is visited by it, so they are free
    when it ends (bits that die during the pass are cleared where met, freed by the next)."""
    i: int = 0
    """The table being swept: ``KVIndex._dicts[2 * i]``."""
    table: object = None
    """That table as the pass found it (a demoted KeyTable is swept again as a dict)."""
    cursor: int = 0
    """A KeyTable's next hash position (KeyTable.scan); a dict's next index into ``keys``."""
    keys: list | None = None
    """A dict table's keys when the pass reached it: those that can carry a bit dead then
    (a key stored later carries only live bits)."""


class _Tier:
    """Tables of one storage tier: per group, hash -> replica bitmask, plus extra copies."""

    __slots__ = ("dicts", "extra", "new_table", "tables")

    def __init__(self, dicts: list, new_table: Callable[[], HashTable]) -> None:
        self.tables: list[HashTable] = []
        self.extra: list[dict[tuple[int, object], int]] = []
        self.dicts = dicts
        """Every table of the index, shared by its tiers, so KVIndex.nbytes sums them fast:
        each group's table at an even position, its extra copies right after it."""
        self.new_table = new_table

    def group(self, g: int) -> tuple[HashTable, dict[tuple[int, object], int]]:
        while len(self.tables) <= g:
            self.tables.append(self.new_table())
            self.extra.append({})
            self.dicts += (self.tables[-1], self.extra[-1])
        return self.tables[g], self.extra[g]


def _salt_of(ev: BlockStored) -> str | bool | None:
    """The cache salt a root store was hashed with, None if none, False if unknowable.

    On the wire each block's extra keys are None or an untagged tuple (§2.1): the LoRA name
    first (its path, which the hash includes, is not published), then mm pairs, then the bare
    salt on the block starting at token 0. Only a salt alone can be re-hashed here.
    """
    if ev.lora_name is not None:
        return False
    keys = ev.extra_keys
    if keys is None:
        return None
    first, rest = (keys[0] if keys else None), keys[1:]
    if any(k is not None for k in rest):
        return False
    if first is None:
        return None
    if isinstance(first, (list, tuple)) and len(first) == 1 and isinstance(first[0], str):
        return first[0]
    return False


# Event kind strings mapped onto the layout's kinds; a missing group_idx means a single
# full-attention group 0 (§6 item 2).
_KIND_BY_NAME = {k.value: k for k in GroupKind}


def _link(
    children: dict[tuple[int, object], list[object]],
    parent: tuple[int, object],
    child: object,
    cap: int,
) -> None:
    """Remember ``child`` under ``parent`` (KVIndex._close_ancestors): the 8 latest children
    per parent (any one held is proof, and the latest are the likeliest still cached: a hot
    prefix gets a new child with every request, and its first ones are long evicted), at most
    ``cap`` parents (the oldest forgotten first)."""
    kids = children.get(parent)
    if kids is None:
        if len(children) >= cap:
            del children[next(iter(children))]
        children[parent] = [child]
    elif child not in kids:
        if len(kids) >= 8:
            del kids[0]
        kids.append(child)


class KVIndex:
    """The cache state of one pool (one served model) across its replicas and DP ranks.

    ``layout`` may declare the groups; with ``layout.groups == ()`` they are learned from the
    events (kind, window, full-block size per ``group_idx``): each replica's own view, and
    the pool's layout by a quorum over those views (router.core.layout_quorum, _settle); the
    rest (hash settings, retention, prefix-match unit) is taken from ``layout``.

    ``verify_hashes`` turns on the live conformance check (ARCHITECTURE decision 1): root
    full-attention stores are re-hashed from their token ids with :meth:`hasher` and compared.
    ``conformance`` replaces that check with any callable ``(token_ids, block_size,
    cache_salt) -> list[wire hash] | None`` (None: cannot tell yet); tests use it to inject
    expected hashes. The hasher lives here, not in the predictor, so the index never calls up
    into the layer that reads it.
    """

    def __init__(
        self,
        layout: ModelLayout,
        *,
        limits: IndexLimits | None = None,
        conformance: Callable[[Sequence[int], int, str | None], list | None] | None = None,
        verify_hashes: bool = True,
        pool: str = "default",
        hash_memo_entries: int = DEFAULT_MEMO_ENTRIES,
        compact: bool | None = None,
    ) -> None:
        self.pool = pool
        if compact is None:
            compact = _KeyTable is not None and layout.hash.int_block_hashes
        elif compact and _KeyTable is None:
            raise ValueError(
                "compact tables need router.core._keytable: build it (pip install -e . with a "
                f"C compiler) and leave {NATIVE_INDEX_ENV} unset, or pass compact=False"
            )
        self.compact = compact
        """Whether new (tier, group) tables are KeyTables (uint64 keys inline) rather than
        dicts: when the extension is there and the pool's wire hashes are ints."""
        self.demoted = 0
        """KeyTables turned into dicts because a replica stored a key they cannot hold (not
        an int in [0, 2**64): bytes hashes from a replica whose settings differ, or junk)."""
        if compact:
            seed = int.from_bytes(os.urandom(8), "little")
            self._new_table: Callable[[], HashTable] = lambda: _KeyTable(seed)  # type: ignore[misc]
        else:
            self._new_table = dict
        self.declared = layout
        self.limits = limits or IndexLimits()
        self.conformance = conformance
        self._custom_conformance = conformance is not None
        if conformance is None and verify_hashes:
            self.conformance = self._rehash_root
        self._memo_entries = hash_memo_entries
        self._hasher: BlockHasher | None = None
        self._hasher_for: tuple | None = None
        self._dicts: list[dict] = []
        self._tiers = {t: _Tier(self._dicts, self._new_table) for t in TIERS}
        self._tier_of: dict[object, str] = {None: "GPU", **{t: t for t in TIERS}}
        self._shared: dict[str, SharedTier] = {}
        """Tiers one store shared by the whole pool holds (router.core.shared_tier): their
        events go there, pool-wide, instead of into per-replica bitmasks."""
        self._replicas: dict[ReplicaKey, _Replica] = {}
        self._partial: dict[ReplicaKey, None] = {}
        """The partial replicas (those with ``children``), so a decision finds them in O(1)."""
        self._free_slots: list[int] = []
        """A heap: the lowest free slot is taken first, so masks stay as narrow as they can."""
        self._next_slot = 0
        self._dead: dict[int, _Dead] = {}
        """Wiped slots still on some keys, by slot (KVIndex._wipe, KVIndex.sweep)."""
        self.dead_bits = 0
        """The bits of ``_dead``: on keys, read by no prediction, cleared by the sweep."""
        self.live_bits = 0
        """The bits of the replicas: a mask ANDed with it names holders only."""
        self._sweep: _Sweep | None = None
        self.wipes = 0
        """Wipes that took a fresh slot at once (the old one left to the sweep)."""
        self.sync_wipes = 0
        """Wipes done at once by a scan of the index: ``max_dead_slots`` were pending."""
        self.sweep_steps = 0
        self.sweep_passes = 0
        """Passes of the sweep over every table that ended (each frees the slots dead when
        it began)."""
        self.swept = 0
        """Dead bits cleared from keys by the sweep."""
        self.slot_moves = 0
        """Bumped when a replica's slot bit changes (a wipe) or a slot is freed: holders of a
        bit (router.core.speculative) check theirs are still what they were."""
        self._learned: dict[int, GroupSpec] = {}
        """The pool's learned groups: the view the layout quorum adopted (_settle)."""
        self._verdict: QuorumVerdict[ReplicaKey] | None = None
        """The last outcome of the layout quorum (router.core.layout_quorum)."""
        self._views_dirty = False
        """A replica's view changed in the batch being applied: settle after it."""
        self._in_batch = False
        self._view_layouts: dict[View, ResolvedLayout | None] = {}
        """Each view seen, resolved (None: not a layout vLLM runs); bounded."""
        self._view_hashers: dict[tuple, BlockHasher] = {}
        """Hashers (no memo) of the views whose hash settings differ from the pool's, for
        the conformance check of a replica against its own view."""
        self._resolved: ResolvedLayout | None = resolve(layout) if layout.groups else None
        self.entries = 0
        self.extra_entries = 0
        self.mask_bytes = 0
        """Sum of _held_bytes over every key's mask, kept as masks change."""
        self._bit_objs: dict[int, int] = {}
        """Each slot's bit, one int object per slot: a key one replica alone holds stores
        this object as its mask, so the most common keys cost no mask of their own (a fresh
        ``1 << 63`` is 36 bytes, ``1 << 255`` 60)."""
        self._key_size: int | None = None
        """Bytes of one hash object, sampled from the first key held (a pool's hashes share
        one type and width)."""
        self.reclaimed = 0
        self.generation = 0
        """Bumped on every state change; lets callers cache per-generation results."""

    # ----------------------------------------------------------------- replicas

    def add_replica(self, name: str, dp_rank: int = 0) -> ReplicaKey:
        """Give a replica (and DP rank) a slot; idempotent."""
        key = (name, dp_rank)
        if key not in self._replicas:
            slot, bit = self._take_slot()
            self._replicas[key] = _Replica(name, dp_rank, slot, bit)
            self.live_bits |= bit
            self._settle()  # one member more: a lone replica's layout becomes provisional
        return key

    def _take_slot(self) -> tuple[int, int]:
        """The lowest free slot (never a dead one) and its shared bit object."""
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = self._next_slot
            self._next_slot += 1
        bit = 1 << slot
        return slot, self._bit_objs.setdefault(bit, bit)

    def remove_replica(self, name: str, dp_rank: int | None = None) -> None:
        """Forget a replica (all its DP ranks by default); its slots are free once no key
        carries their bit (at once if it held nothing, else after the sweep)."""
        keys = [k for k in self._replicas if k[0] == name and dp_rank in (None, k[1])]
        if not keys:
            raise UnknownReplica(name if dp_rank is None else f"{name}/dp{dp_rank}")
        for key in keys:
            rep = self._replicas.pop(key)
            self._partial.pop(key, None)
            self.live_bits &= ~rep.bit
            self._wipe(rep, leaving=True)
        self._settle()  # its vote goes: the others' may now decide

    def replicas(self) -> list[ReplicaKey]:
        return list(self._replicas)

    def partial_replicas(self) -> list[ReplicaKey]:
        """The replicas whose hits are a lower bound (trust ``partial``), in O(partial)."""
        return list(self._partial)

    def gone(self, key: ReplicaKey) -> AbstractSet[tuple[int, object]] | None:
        """A partial replica's GPU keys removed since attach and not held again (read-only:
        see ``_Replica.gone``); None when nothing may be implied from what is not here."""
        return self._replica(key).gone

    def anchors(self, key: ReplicaKey) -> AbstractSet[tuple[int, object]]:
        """A partial replica's sliding-window keys that imply their window (read-only: see
        ``_Replica.anchors``); empty when nothing may be implied through windows."""
        rep = self._replica(key)
        return rep.anchors if rep.gone is not None and rep.anchors is not None else frozenset()

    def _track_partial(self, rep: _Replica, on: bool) -> None:
        """Start (empty) or drop what only a partial replica's index keeps (``children``,
        ``gone``, ``anchors``): a new partial period starts from nothing known about before
        it."""
        rep.children = {} if on else None
        rep.gone = set() if on else None
        rep.removed_at = OrderedDict() if on else None
        rep.anchors = set() if on else None
        keys = self.limits.max_witness_keys
        rep.witness = EvictionWitness(keys) if on and keys > 0 else None
        rep.witness_off = None if keys > 0 else "turned off (index.max_witness_keys = 0)"
        key = (rep.name, rep.dp_rank)
        if on:
            self._partial[key] = None
        else:
            self._partial.pop(key, None)

    # ---------------------------------------------------------------- snapshot

    def export_replica(self, key: ReplicaKey) -> ReplicaSnapshot:
        """One replica's state for a snapshot (router.core.snapshot); streams left empty."""
        rep = self._replica(key)
        bit, slot = rep.bit, rep.slot
        tiers: dict[str, list[list[tuple[int | bytes, int]]]] = {}
        for name, tier in self._tiers.items():
            groups = []
            for table, extra in zip(tier.tables, tier.extra, strict=True):
                groups.append(
                    [(h, extra.get((slot, h), 1)) for h, m in table.items() if m & bit]  # type: ignore[misc]
                )
            if any(groups):
                tiers[name] = groups
        return ReplicaSnapshot(
            name=rep.name,
            dp_rank=rep.dp_rank,
            trusted=rep.trusted,
            untrusted_reason=rep.untrusted_reason,
            recoverable=rep.recoverable,
            partial_reason=rep.partial_reason,
            group_aware=rep.group_aware,
            learned=dict(rep.learned),
            tiers=tiers,
        )

    def learned_layout(self) -> tuple[list[GroupSpec], str | None]:
        """The pool's learned groups and the ``name/dpN`` of a replica holding that view."""
        groups = [self._learned[g] for g in sorted(self._learned)]
        v = self._verdict
        holders = v.holders.get(tuple(groups), ()) if v is not None else ()
        return groups, next((f"{k[0]}/dp{k[1]}" for k in holders), None)

    def layout_state(self) -> LayoutState:
        """Where the pool's layout stands: declared, or the layout quorum's status, views and
        the replicas each holds, and who is held back (router.core.layout_quorum)."""
        if self.declared.groups:
            return LayoutState("declared", describe(tuple(self.declared.groups)))
        v = self._verdict
        if v is None:
            return LayoutState("unknown", None)
        return LayoutState(
            v.status,
            describe(v.layout) if v.layout is not None else None,
            [
                LayoutViewState(describe(view), [f"{k[0]}/dp{k[1]}" for k in ks], view == v.layout)
                for view, ks in v.holders.items()
            ],
            {f"{k[0]}/dp{k[1]}": kind for k, (kind, _) in v.held.items()},
        )

    def import_replica(
        self, snap: ReplicaSnapshot, *, learned: list[GroupSpec] | None = None, source: bool = False
    ) -> ReplicaKey:
        """Load one replica's state from a snapshot into an empty slot. ``learned`` restores
        the pool's layout when it is learned from events and not known yet; the replicas'
        own views (in ``snap``) then vote on it as live ones do (``source`` is kept for
        snapshots of older routers and not needed)."""
        key = self.add_replica(snap.name, snap.dp_rank)
        rep = self._replicas[key]
        if rep.blocks or rep.extra:
            raise ValueError(f"replica {snap.name}/dp{snap.dp_rank} already holds state")
        rep.trusted, rep.untrusted_reason = snap.trusted, snap.untrusted_reason
        rep.recoverable, rep.partial_reason = snap.recoverable, snap.partial_reason
        self._track_partial(rep, rep.trusted and rep.partial_reason is not None)
        rep.group_aware, rep.learned = snap.group_aware, dict(snap.learned)
        if learned and not self.declared.groups and self._resolved is None:
            try:
                self._resolved = resolve(
                    msgspec.structs.replace(self.declared, groups=tuple(learned))
                )
                self._learned = dict(enumerate(learned))
            except LayoutError as exc:
                log.warning("snapshot layout of pool %r not usable: %s", self.pool, exc)
        for tier_name, groups in snap.tiers.items():
            if tier_name not in self._tiers:
                self._tiers[tier_name] = _Tier(self._dicts, self._new_table)
            tier = self._tiers[tier_name]
            for g, keys in enumerate(groups):
                if not keys or g >= self.limits.max_groups:
                    continue
                extra = tier.group(g)[1]
                for h, copies in keys:
                    if not self._hold(rep, tier, g, h):
                        continue
                    if copies > 1:
                        extra[(rep.slot, h)] = copies
                        self.extra_entries += copies - 1
                        rep.extra += copies - 1
        self._settle()
        self.generation += 1
        return key

    def _replica(self, key: ReplicaKey) -> _Replica:
        try:
            return self._replicas[key]
        except KeyError:
            raise UnknownReplica(f"{key[0]}/dp{key[1]}") from None

    def slot_bit(self, key: ReplicaKey) -> int:
        return self._replica(key).bit

    def is_trusted(self, key: ReplicaKey) -> bool:
        """Routed on its state: exact or partial (a partial state predicts a lower bound),
        and not held back by the layout quorum (outvoted or contested)."""
        return self._replica(key).routed

    def trust(self, key: ReplicaKey) -> Trust:
        """``exact``: every event since the replica's start applied; ``partial``: attached
        after the replay ring had dropped its start, so blocks stored before are unknown
        (predictions are a lower bound, and grow as vLLM's answers teach the index);
        ``untrusted``: events lost mid-stream or wrong settings (predicts 0)."""
        return self._replica(key).trust

    def partial_reason(self, key: ReplicaKey) -> str | None:
        return self._replica(key).partial_reason

    def untrusted_reason(self, key: ReplicaKey) -> str | None:
        rep = self._replica(key)
        return rep.untrusted_reason or rep.hold

    # ------------------------------------------------------------------ layout

    @property
    def layout(self) -> ResolvedLayout | None:
        """The resolved layout, or None while groups are still being learned."""
        return self._resolved

    def hasher(self) -> BlockHasher | None:
        """The block hasher of the pool's current layout (None until the layout is known)."""
        layout = self._resolved
        if layout is None:
            return None
        want = (layout.layout.hash, layout.hash_block_size)
        if self._hasher is None or self._hasher_for != want:
            self._hasher = BlockHasher(
                layout.layout.hash, layout.hash_block_size, memo_entries=self._memo_entries
            )
            self._hasher_for = want
        return self._hasher

    def _rehash_root(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None,
        layout: ResolvedLayout | None = None,
    ) -> list | None:
        """The wire hashes of a root store under ``layout`` (the pool's by default): what
        the conformance check expects; None while that layout is unknown."""
        hasher = self.hasher() if layout is None else self._hasher_of(layout)
        if hasher is None:
            return None
        keys = RequestKeys(cache_salt=cache_salt) if cache_salt is not None else None
        return expected_stored_hashes(hasher, token_ids, block_size, keys)

    def _hasher_of(self, layout: ResolvedLayout) -> BlockHasher:
        """A hasher for ``layout``: the pool's when they hash alike, else one without memo
        (it only re-hashes sampled root stores), kept per hash settings."""
        want = (layout.layout.hash, layout.hash_block_size)
        if self._resolved is not None and want == (
            self._resolved.layout.hash,
            self._resolved.hash_block_size,
        ):
            hasher = self.hasher()
            assert hasher is not None  # the pool's layout is known here
            return hasher
        hasher = self._view_hashers.get(want)
        if hasher is None:
            if len(self._view_hashers) >= 16:
                self._view_hashers.clear()
            hasher = self._view_hashers[want] = BlockHasher(*want, memo_entries=0)
        return hasher

    def _view_layout(self, view: View) -> ResolvedLayout | None:
        """``view`` resolved with the pool's declared settings (hash, retention, ...), or
        None when vLLM would refuse it; memoized (views are few, but a hostile stream could
        show many, so the memo is bounded)."""
        if view in self._view_layouts:
            return self._view_layouts[view]
        try:
            out: ResolvedLayout | None = resolve(
                msgspec.structs.replace(self.declared, groups=view)
            )
        except LayoutError as exc:
            log.warning(
                "pool %r: the view %s is not a usable layout: %s", self.pool, describe(view), exc
            )
            out = None
        if len(self._view_layouts) >= 256:
            keep = {k: v for k, v in self._view_layouts.items() if v is self._resolved}
            self._view_layouts = keep
        self._view_layouts[view] = out
        return out

    def _learn(self, rep: _Replica, ev: BlockStored, g: int) -> str | None:
        """Check a store's group metadata against the declared layout, or learn it into the
        replica's own view; returns a conflict or None."""

        def where() -> str:  # built only when there is something to report (hot path)
            return f"pool {self.pool!r} replica {rep.name}/dp{rep.dp_rank} group {g}"

        if ev.group_idx is None:
            kind = GroupKind.FULL_ATTENTION
        else:
            kind = _KIND_BY_NAME.get(ev.kv_cache_spec_kind or "", GroupKind.UNKNOWN)
        window = ev.kv_cache_spec_sliding_window
        declared = self.declared.groups
        if declared:
            if g >= len(declared):
                return str(LayoutConflict("group count", len(declared), g + 1, where()))
            spec = declared[g]
            if ev.group_idx is not None and ev.kv_cache_spec_kind is not None:
                if kind != spec.kind and not (kind == GroupKind.FULL_ATTENTION and spec.is_fa_type):
                    return str(LayoutConflict("kv_cache_spec_kind", spec.kind.value, kind, where()))
                if window is not None and window != spec.sliding_window:
                    return str(
                        LayoutConflict("sliding_window", spec.sliding_window, window, where())
                    )
            if ev.block_size > spec.block_size:
                return str(LayoutConflict("block_size", spec.block_size, ev.block_size, where()))
            return None
        if kind == GroupKind.UNKNOWN:
            return (
                f"{where()}: kv_cache_spec_kind is {ev.kv_cache_spec_kind!r}; kvrouter cannot "
                f"learn this group's hit rule: declare the pool's groups in the config"
            )
        if kind == GroupKind.CHUNKED_LOCAL_ATTENTION:
            return (
                f"{where()}: chunked_local_attention needs attention_chunk_size, which events "
                f"do not carry: declare the pool's groups in the config"
            )
        own = rep.learned
        known = own.get(g)
        if known is not None and known.kind != kind:  # the replica contradicts itself
            return str(LayoutConflict("kv_cache_spec_kind", known.kind.value, kind.value, where()))
        if known is not None and known.sliding_window != window:
            return str(LayoutConflict("sliding_window", known.sliding_window, window, where()))
        if known is None or ev.block_size > known.block_size:
            own[g] = GroupSpec(kind=kind, block_size=ev.block_size, sliding_window=window)
            self._views_dirty = True  # the layout quorum is settled after the batch
        if not rep.trusted and not rep.recoverable:
            # quarantined for its settings, it has no vote; what it stores against the
            # pool's layout is still counted (kvrouter_ingest_errors_total{layout_conflict})
            have = self._learned.get(g)
            if have is not None:
                for name, want, got in (
                    ("kv_cache_spec_kind", have.kind.value, kind.value),
                    ("sliding_window", have.sliding_window, window),
                ):
                    if want != got:
                        return str(LayoutConflict(name, want, got, where()))
                if ev.block_size > have.block_size:
                    return str(
                        LayoutConflict("block_size", have.block_size, ev.block_size, where())
                    )
        return None

    def _settle(self) -> None:
        """Re-run the layout quorum (router.core.layout_quorum.decide) over the replicas'
        views: adopt its layout and hold back (predicting no hit, with the reason) the
        replicas it outvotes or finds contested. Called after a batch that changed a view,
        and when a member comes, goes, restarts or is quarantined for its settings. Stored
        keys are not touched: a wire hash is the chain hash its replica computed under its
        own layout, so a held replica's keys never match the pool's lookups, and its bit is
        left out of predictions while it is held; one that rejoins (its view grew into the
        layout, or it restarted with the right flags) predicts from its keys again."""
        self._views_dirty = False
        if self.declared.groups:
            return
        if self._in_batch:
            self._views_dirty = True
            return
        views = {
            key: rep.learned
            for key, rep in self._replicas.items()
            if rep.learned and (rep.trusted or rep.recoverable)  # no say when quarantined
        }
        current = tuple(self._learned[g] for g in sorted(self._learned)) or None
        verdict = decide(
            views,
            current,
            len(self._replicas),
            lambda view: self._view_layout(view) is not None,
            name=lambda k: f"{k[0]}/dp{k[1]}",
        )
        if verdict.layout != current:
            if verdict.layout is None:
                self._learned, self._resolved = {}, None
            else:
                self._learned = dict(enumerate(verdict.layout))
                self._resolved = self._view_layout(verdict.layout)
            if current is not None:
                log.warning(
                    "pool %r: learned layout %s replaced by %s (%s)",
                    self.pool, describe(current), describe(verdict.layout), verdict.status,
                )  # fmt: skip
            self.generation += 1
        for key, rep in self._replicas.items():
            kind, reason = verdict.held.get(key, (None, None))
            if kind != rep.hold_kind:
                if kind == "outvoted":
                    self._count(rep, "layout_conflict", "quarantined", reason or "")
                elif kind == "contested":
                    self._count(rep, "layout_contested", "predicts no hit", reason or "")
                else:
                    log.info(
                        "pool %r replica %s/dp%d: its layout view agrees with the pool's again",
                        self.pool, rep.name, rep.dp_rank,
                    )  # fmt: skip
                self.generation += 1
            rep.hold_kind, rep.hold = kind, reason
        self._verdict = verdict

    # ------------------------------------------------------------------ ingest

    def apply_events(self, key: ReplicaKey, events: Iterable[object]) -> None:
        """Apply one batch's events for one replica, strictly in order (§2.5).

        Wire values are bounded before anything is allocated for them (``group_idx``,
        ``block_size``, the tier a ``medium`` names): an event outside the bounds is refused,
        counted and makes the replica untrusted (its state is then incomplete). The counters
        are written back even if an event raises, so the index stays consistent for the
        caller to distrust the replica (:meth:`ingest_failed`).
        """
        rep = self._replica(key)
        if rep.down:
            self._back_up(rep)
        if rep.children is not None:  # partial: the slow path that keeps ancestors closed
            return self._apply_partial(key, rep, events)
        bit, slot, counters = rep.bit, rep.slot, rep.counters
        top, low, above = rep.mask_top, rep.mask_low, bit << 1
        tiers, tier_of, bit_objs = self._tiers, self._tier_of, self._bit_objs
        shared = self._shared
        now = time.monotonic() if shared else 0.0
        max_groups, max_block = self.limits.max_groups, self.limits.max_block_size
        entries = self.entries
        held = rep.blocks
        # A key this replica alone holds stores ``bit`` itself (shared, no cost); ``masks``
        # follows the masks of two holders or more as they appear, widen, narrow and go.
        masks = self.mask_bytes
        removed = unknown = 0
        rm_medium: object = _UNSET_MEDIUM
        rm_group: int | None = None
        rm_table: dict = {}
        rm_extra: dict = {}
        declared = bool(self.declared.groups)
        roots: list[tuple[int, BlockStored]] = []
        """Learned mode: root stores to re-hash against the replica's own view once the
        batch has shown all of it (a view is complete only after its batch)."""
        self._in_batch = True
        try:
            for ev in events:
                cls = type(ev)
                if cls is BlockStored or cls is LazyTokensBlockStored:
                    tier = tier_of.get(ev.medium) or self._new_tier(rep, ev.medium)
                    g = ev.group_idx
                    aware = g is not None
                    if tier is None:
                        continue
                    if aware and not 0 <= g < max_groups:
                        self._refuse(rep, "group_idx", f"group_idx {g} outside 0..{max_groups - 1}")
                        continue
                    if not 0 <= ev.block_size <= max_block:
                        self._refuse(
                            rep, "block_size", f"block_size {ev.block_size} outside 0..{max_block}"
                        )
                        continue
                    if not aware:
                        g = 0
                    if tier in shared:
                        shared[tier].store(g, ev.block_hashes, now)
                        counters["stored_blocks"] += len(ev.block_hashes)
                        continue
                    if tier == "GPU":
                        # Only the GPU stream says whether the producer tags groups: connectors
                        # publish their own tiers with or without group_idx (spec §6.2).
                        if rep.group_aware is not aware:
                            if rep.group_aware is None:
                                rep.group_aware = aware
                            else:
                                self._distrust(
                                    rep,
                                    "GPU events with and without group_idx on one stream: "
                                    "kvrouter cannot tell which group they belong to (spec "
                                    "§6.2); run the replica's engine on one vLLM version",
                                    recoverable=True,
                                    label="mixed_group_idx",
                                )
                        if ev.block_size > 0:
                            problem = self._learn(rep, ev, g)
                            if problem is not None:
                                self._distrust(
                                    rep, problem, recoverable=False, label="layout_conflict"
                                )
                            # learned: partial against the replica's own view, not the pool's
                            spec = self._group_spec(g) if declared else rep.learned.get(g)
                            if spec is not None and ev.block_size < spec.block_size:
                                counters["partial_stores"] += 1
                            elif (
                                ev.parent_block_hash is None
                                and self.conformance is not None
                                and spec is not None
                                and spec.is_fa_type
                                and ev.block_hashes
                            ):
                                if declared:
                                    self._check_conformance(rep, ev, spec, None)
                                else:
                                    roots.append((g, ev))
                    table, extra = tiers[tier].group(g)
                    for h in ev.block_hashes:
                        m = table.get(h, 0)
                        if m & bit:
                            k = (slot, h)
                            extra[k] = extra.get(k, 1) + 1
                            self.extra_entries += 1
                            rep.extra += 1
                        elif not m:
                            try:
                                table[h] = bit
                            except (TypeError, OverflowError):  # not a KeyTable's key
                                table = self._demote(table)
                                rm_medium = _UNSET_MEDIUM  # that table may be cached there
                                table[h] = bit
                            entries += 1
                            held += 1
                        else:
                            n = m | bit
                            if not m & (m - 1):  # a second holder: the key gets its own mask
                                masks += _mask_bytes(n)
                            elif m < low:  # this bit becomes the highest and widens the mask
                                masks += top - _mask_bytes(m)
                            table[h] = n
                            held += 1
                    counters["stored_blocks"] += len(ev.block_hashes)
                elif cls is BlockRemoved:
                    # vLLM sends one BlockRemoved per evicted block (spec §2.1): a run of them
                    # reuses the table the previous one resolved (same medium and group)
                    medium, g = ev.medium, ev.group_idx
                    if medium != rm_medium or g != rm_group:
                        tier = tier_of.get(medium) or self._new_tier(rep, medium)
                        if tier is None:
                            continue
                        gi = g if g is not None else 0
                        if not 0 <= gi < max_groups:
                            self._refuse(
                                rep, "group_idx", f"group_idx {gi} outside 0..{max_groups - 1}"
                            )
                            continue
                        if tier in shared:  # a store the pool shares (router.core.shared_tier)
                            shared[tier].remove(gi, ev.block_hashes)
                            removed += len(ev.block_hashes)
                            continue
                        t = tiers[tier]
                        if gi >= len(t.tables):  # nothing was ever stored there: allocate nothing
                            unknown += len(ev.block_hashes)
                            removed += len(ev.block_hashes)
                            continue
                        rm_medium, rm_group = medium, g
                        table, extra = rm_table, rm_extra = t.tables[gi], t.extra[gi]
                    else:
                        table, extra = rm_table, rm_extra
                    hashes = ev.block_hashes
                    removed += len(hashes)
                    for h in hashes:
                        m = table.get(h, 0)
                        if not m & bit:
                            unknown += 1
                            continue
                        if extra:  # copies beyond the first are rare: no key built without
                            k = (slot, h)
                            c = extra.get(k)
                            if c is not None:
                                self.extra_entries -= 1
                                rep.extra -= 1
                                if c == 2:
                                    del extra[k]
                                else:
                                    extra[k] = c - 1
                                continue
                        held -= 1
                        if m == bit:
                            del table[h]
                            entries -= 1
                        else:
                            rest = m ^ bit  # bit is set: its holders without this replica
                            if not rest & (rest - 1):  # one holder left: its shared bit
                                masks -= _mask_bytes(m)
                                table[h] = bit_objs.get(rest, rest)
                            else:
                                if m < above and rest < low:  # the highest bit went: narrower
                                    masks += _mask_bytes(rest) - top
                                table[h] = rest
                elif cls is AllBlocksCleared:
                    for st in shared.values():  # a reset with reset_connector wipes the store
                        st.clear()
                    self.entries, rep.blocks, self.mask_bytes = entries, held, masks
                    self._known_empty(rep)  # the replica may take a fresh slot (_wipe)
                    entries = self.entries
                    held, masks = 0, self.mask_bytes
                    bit, slot = rep.bit, rep.slot
                    top, low, above = rep.mask_top, rep.mask_low, bit << 1
                    counters["clears"] += 1
                elif cls is UnknownEvent:
                    counters["unknown_events"] += 1
                    self._distrust(
                        rep,
                        f"lost events: an event could not be decoded ({ev.error}); upgrade "
                        f"kvrouter or reset the replica's prefix cache",
                        recoverable=True,
                        label="unknown_event",
                    )
                else:
                    raise TypeError(f"not a KV event: {ev!r}")
        finally:
            self.entries = entries
            rep.blocks = held
            self.mask_bytes = masks
            counters["removed_blocks"] += removed
            counters["unknown_removals"] += unknown
            self.generation += 1
            self._in_batch = False
        if roots:
            self._check_own_view(rep, roots)
        if self._views_dirty:
            self._settle()
        if self.nbytes() > self.limits.max_bytes:
            while self.entries and self.nbytes() > 0.9 * self.limits.max_bytes:
                self._reclaim()
        if self.dead_bits:
            self.sweep()

    def _apply_partial(self, key: ReplicaKey, rep: _Replica, events: Iterable[object]) -> None:
        """:meth:`apply_events` for a partial replica, keeping full attention ancestor-closed.

        A partial replica's copy counts are lower bounds: a block cached before attach may
        have had several physical copies (vLLM stores a full-attention block again when a
        hybrid hit stopped short of it), and a key learned from an answer or stored since
        holds one. The first ``BlockRemoved`` of such a key would drop it while the replica
        still holds a copy: the next request on that prefix is predicted short (measured: 2
        of 150 requests after a late attach). vLLM frees a request's blocks tail first into
        an LRU queue, and a request that holds a block holds (touches or computes) a copy of
        each of its full-attention ancestors, freed after it; so a cached full-attention
        block's parent is cached too. Hence a removal that leaves the index without a key
        one of whose children it still holds cannot have taken the last copy: the key is
        kept (``closure_kept``). Checked after the batch, so a child removed later in the
        same batch only makes the answer more cautious, never wrong."""
        events = events if isinstance(events, list) else list(events)
        children, rep.children = rep.children, None
        scan = self._partial_scan(children, events) if children is not None else None
        try:
            self.apply_events(key, events)
        finally:
            if rep.trusted and rep.partial_reason is not None and rep.children is None:
                rep.children = children
        if rep.children is None or scan is None:
            return  # a clear made it exact, or it was distrusted: nothing more to keep
        if scan.watch:
            self._close_ancestors(rep, rep.children, scan.watch)
        self._after_partial_batch(rep, scan)
        if rep.witness is not None:
            self._witness_batch(rep, rep.witness, events)

    def _witness_batch(self, rep: _Replica, witness: EvictionWitness, events: list) -> None:
        """Feed a partial replica's applied batch to its eviction-order proof and hold again
        the keys it proves still cached (router.core.eviction_order)."""
        tier_of, max_groups = self._tier_of, self.limits.max_groups
        items: list[tuple[bool, tuple[int, object]]] = []
        for ev in events:
            cls = type(ev)
            if cls is BlockStored or cls is LazyTokensBlockStored:
                stored = True
            elif cls is BlockRemoved:
                stored = False
            else:
                continue
            if (tier_of.get(ev.medium) or _tier_name(ev.medium)) != "GPU":
                continue
            g = ev.group_idx or 0
            if 0 <= g < max_groups:
                items.extend((stored, (g, h)) for h in ev.block_hashes)
        tables, bit = self._tiers["GPU"], rep.bit

        def held(k: tuple[int, object]) -> bool:
            return k[0] < len(tables.tables) and bool(tables.tables[k[0]].get(k[1], 0) & bit)

        removed, named = witness.scan(items)
        lost = [k for k in removed if not held(k)]
        if lost:  # a block still held was freed before their copies: an older one went
            oldest = witness.oldest_held(held, named)
            for g, h in lost:
                if oldest is None or oldest >= witness.live.get((g, h), oldest):
                    continue
                if g < len(tables.tables) and self._hold(rep, tables, g, h):
                    witness.recent.add((g, h))
                    rep.counters["older_copy_evicted"] += 1
                    if rep.gone is not None:
                        rep.gone.discard((g, h))
                    self.generation += 1
        witness.compact(held)
        if witness.off is not None:
            self._witness_off(rep, witness.off)

    def _witness_off(self, rep: _Replica, reason: str) -> None:
        """The eviction-order proof ends for the rest of the partial period; its records
        are freed. Logged once per period at INFO: it changes how exact the replica gets."""
        rep.witness, rep.witness_off = None, reason
        log.info(
            "pool %r replica %s/dp%d: eviction-order proof off: %s",
            self.pool,
            rep.name,
            rep.dp_rank,
            reason,
        )

    def witness_sending(
        self, key: ReplicaKey, attempt: int, tracked: Iterable[tuple[int, object]] | None
    ) -> None:
        """Request ``attempt`` is being sent to ``key`` with ``tracked``, its prompt's keys in
        the group the eviction-order proof bounds (router.core.eviction_order.EvictionWitness.
        sending; None when they cannot be computed, which ends the proof: it needs them all).
        Nothing unless the replica is partial."""
        rep = self._replicas.get(key)
        if rep is None or rep.witness is None:
            return
        if tracked is None:
            self._witness_off(rep, "a request's keys could not be computed (layout unknown)")
        else:
            rep.witness.sending(attempt, tracked)

    def witness_ended(self, key: ReplicaKey, attempt: int, now: float, finished: bool) -> None:
        """Request ``attempt`` to ``key`` left the router (EvictionWitness.ended)."""
        rep = self._replicas.get(key)
        if rep is not None and rep.witness is not None:
            rep.witness.ended(attempt, now, finished)
            if rep.witness.off is not None:
                self._witness_off(rep, rep.witness.off)

    def witness_touched(
        self, key: ReplicaKey, keys: Iterable[tuple[int, object]], sent_at: float
    ) -> None:
        """vLLM's answer to a request sent at ``sent_at`` showed it hit ``keys`` on ``key``
        (EvictionWitness.touched). Nothing unless the replica is partial."""
        rep = self._replicas.get(key)
        if rep is not None and rep.witness is not None:
            rep.witness.touched(keys, sent_at)

    def witness_scrape(
        self,
        key: ReplicaKey,
        now: float,
        others: float,
        finished: float | None,
        sent: int,
        mine: int,
    ) -> None:
        """A metrics scrape of ``key`` (EvictionWitness.scrape): whether the router is its
        only client. Nothing unless the replica is partial."""
        rep = self._replicas.get(key)
        if rep is not None and rep.witness is not None:
            witness = rep.witness
            witness.scrape(now, others, finished, sent, mine)
            if witness.off is not None:
                self._witness_off(rep, witness.off)
                if witness.recent:
                    # another client ran since the last clean scrape: what the proof kept
                    # since then rests on a premise that no longer held; retire it
                    by_group: dict[int, list[object]] = {}
                    for g, h in witness.recent:
                        by_group.setdefault(g, []).append(h)
                    self.apply_events(
                        key,
                        [
                            BlockRemoved(block_hashes=hs, medium="GPU", group_idx=g)
                            for g, hs in by_group.items()
                        ],
                    )

    def _fa_groups(self) -> frozenset[int]:
        """Group ids of the pool's full-attention-type groups (empty while not learned)."""
        layout = self._resolved
        if layout is None:
            return frozenset()
        return frozenset(g for sg in layout.spec_groups if sg.spec.is_fa_type for g in sg.group_ids)

    def _implying_groups(self) -> frozenset[int]:
        """Groups whose held keys imply others (full attention: every ancestor; sliding
        window: the blocks of the window before it), where the layout's hit rule is the plain
        one :func:`router.core.hybrid.blocks_behind_hit` describes; empty otherwise."""
        layout = self._resolved
        if layout is None or layout.partial_hits:
            return frozenset()
        if any(sg.spec.eagle for sg in layout.spec_groups):
            return frozenset()
        return frozenset(
            g
            for sg in layout.spec_groups
            if sg.spec.is_fa_type or sg.spec.kind in SLIDING_KINDS
            for g in sg.group_ids
        )

    def _partial_scan(
        self, children: dict[tuple[int, object], list[object]], events: list
    ) -> _PartialScan:
        """One pass over a partial replica's batch, before it is applied: record the
        parent -> child links its full-attention stores show (a dense store of full blocks:
        its parent, then each hash the parent of the next) and note what
        :meth:`_after_partial_batch` needs after it: the removed keys that have recorded children
        (for :meth:`_close_ancestors`), the parents the stores named, and the sliding-window
        keys stored and removed."""
        scan = _PartialScan()
        fa, implying = self._fa_groups(), self._implying_groups()
        cap = self.limits.max_closure_parents
        parents = scan.parents
        for g, ev, spec in self._gpu_chain_events(events, fa | implying):
            if spec is None:  # a removal
                for h in ev.block_hashes:
                    if (g, h) in children:
                        scan.watch.append((g, h))
                    if g not in fa:  # full attention is ancestor-closed: no record needed
                        scan.removed.append((g, h))
                    if (g, h) in parents:
                        parents[(g, h)] = False
                continue
            prev = ev.parent_block_hash
            if g in implying:
                if not spec.is_fa_type:
                    scan.stored.extend((g, h) for h in ev.block_hashes)
                if prev is not None:
                    parents[(g, prev)] = True
            if g in fa:
                for h in ev.block_hashes:
                    if prev is not None:
                        _link(children, (g, prev), h, cap)
                    prev = h
        return scan

    def _after_partial_batch(self, rep: _Replica, scan: _PartialScan) -> None:
        """After a partial replica's batch: hold the parents its stores named that the index
        lacks, and keep ``rep.gone`` and ``rep.anchors`` up to date.

        A ``BlockStored``'s parent is the block before it in the request's chain, which the
        request holds in that group when vLLM stores the new blocks (spec §2.2: the first
        store after admission names the last hit block; later ones the request's own last
        block, inside its window). A parent the index does not hold was therefore cached
        before attach, and is cached at that moment: held from now on, retired by its
        ``BlockRemoved`` like any key (``witnessed_parents``). A parent removed later in the
        same batch proves nothing about the state after it and is skipped.

        ``gone`` collects the sliding-window keys whose removal left the index without
        them, and drops those held again: the keys :meth:`Predictor.implied_keys` may not
        imply. Past ``IndexLimits.max_partial_removals`` of them it is dropped (None) and
        nothing is implied through windows any more (full attention needs no such record)."""
        tables = self._tiers["GPU"]
        bit, gone, anchors = rep.bit, rep.gone, rep.anchors
        if scan.removed and (removed_at := rep.removed_at) is not None:
            now = time.monotonic()
            for gh in scan.removed:
                removed_at[gh] = now
                removed_at.move_to_end(gh)
            while len(removed_at) > self.limits.max_partial_removals:
                removed_at.popitem(last=False)
        for (g, p), proved in scan.parents.items():
            if proved and g < len(tables.tables) and self._hold(rep, tables, g, p):
                rep.counters["witnessed_parents"] += 1
                self.generation += 1
        if gone is None or anchors is None:
            return
        for gh in scan.stored:
            if tables.tables[gh[0]].get(gh[1], 0) & bit:
                anchors.add(gh)
        for gh, proved in scan.parents.items():
            if proved:
                gone.discard(gh)
                if gh[0] < len(tables.tables) and not self._group_spec(gh[0]).is_fa_type:
                    anchors.add(gh)
        for g, h in scan.removed:
            if g < len(tables.tables) and tables.tables[g].get(h, 0) & bit:
                gone.discard((g, h))
            else:
                gone.add((g, h))
                anchors.discard((g, h))
        if len(gone) > self.limits.max_partial_removals:
            rep.gone = rep.anchors = None
            log.info(
                "pool %r replica %s/dp%d: over %d blocks removed since attach; sliding-window "
                "blocks are no longer implied by the keys after them",
                self.pool,
                rep.name,
                rep.dp_rank,
                self.limits.max_partial_removals,
            )

    def _gpu_chain_events(
        self, events: list, groups: frozenset[int]
    ) -> Iterator[tuple[int, Any, GroupSpec | None]]:
        """``(group, event, spec)`` for a batch's GPU stores of whole blocks in ``groups`` (not
        partial entries, whose block is the hash unit) and ``(group, event, None)`` for its
        GPU removals there, in order: what the partial replica's scans read."""
        if not groups:
            return
        tier_of = self._tier_of

        def gpu(medium: object) -> bool:  # a spelling not applied yet is not in tier_of
            return (tier_of.get(medium) or _tier_name(medium)) == "GPU"

        for ev in events:
            cls = type(ev)
            if cls is BlockStored or cls is LazyTokensBlockStored:
                g = ev.group_idx or 0
                if g not in groups or not ev.block_hashes or not gpu(ev.medium):
                    continue
                spec = self._group_spec(g)
                if spec is not None and ev.block_size == spec.block_size:
                    yield g, ev, spec
            elif cls is BlockRemoved:
                g = ev.group_idx or 0
                if g in groups and gpu(ev.medium):
                    yield g, ev, None

    def _close_ancestors(
        self,
        rep: _Replica,
        children: dict[tuple[int, object], list[object]],
        watch: list[tuple[int, object]],
    ) -> None:
        """Hold again each watched key the batch dropped that has a held child (see
        :meth:`_apply_partial`), until nothing changes (a re-held child proves its parent)."""
        table_of = self._tiers["GPU"]
        bit = rep.bit
        pending = set(watch)
        changed = True
        while changed and pending:
            changed = False
            for g, h in list(pending):
                if g >= len(table_of.tables):
                    pending.discard((g, h))
                    continue
                table = table_of.tables[g]
                if table.get(h, 0) & bit:
                    pending.discard((g, h))
                    continue
                if any(table.get(c, 0) & bit for c in children.get((g, h), ())):
                    self._hold(rep, table_of, g, h)
                    rep.counters["closure_kept"] += 1
                    pending.discard((g, h))
                    changed = True
        self.generation += 1

    def _new_tier(self, rep: _Replica, medium: object) -> str | None:
        """The tier a ``medium`` spelling names, memoized; None (counted, replica untrusted)
        when it is not a string or would be one tier too many for ``rep``.

        vLLM writes ``"GPU"``/``"CPU"``; its Mooncake store connector writes ``"cpu"``, so
        names are case-insensitive. A connector's own name is kept as its own tier rather than
        refused: its events are then indexed apart from the GPU's and never decide a GPU hit.
        """
        name = _tier_name(medium)
        if name is None:
            self._refuse(rep, "medium", f"medium {medium!r} is not a tier name")
            return None
        if name not in self._tiers:
            # Counted per replica: a pool-wide count let one replica's junk names exhaust it,
            # and another replica's connector stores were then refused (it went untrusted).
            if rep.tiers_made >= self.limits.max_extra_tiers:
                self._refuse(
                    rep,
                    "medium",
                    f"medium {medium!r}: over {self.limits.max_extra_tiers} extra tiers",
                )
                return None
            self._tiers[name] = _Tier(self._dicts, self._new_table)
            rep.tiers_made += 1
        if len(self._tier_of) < 256:  # spellings are memoized, but never without bound
            self._tier_of[medium] = name
        return name

    def _refuse(self, rep: _Replica, what: str, detail: str) -> None:
        """An event the index will not apply: its information is lost, so the replica's state
        is incomplete (untrusted until a clear or restart), and the refusal is counted."""
        self._distrust(
            rep,
            f"refused an event: {detail}; call the replica's /reset_prefix_cache or restart it "
            f"to return to a known state",
            recoverable=True,
            label=f"refused_{what}",
        )

    def _group_spec(self, g: int) -> GroupSpec | None:
        if self.declared.groups:
            return self.declared.groups[g] if g < len(self.declared.groups) else None
        return self._learned.get(g)

    def _check_own_view(self, rep: _Replica, roots: list[tuple[int, BlockStored]]) -> None:
        """The conformance check of a batch's root full-attention stores against the
        replica's *own* view (learned mode), so that its hashes are judged by the layout it
        runs, not by a pool layout it may rightly disagree with (the layout quorum decides
        that); a hash mismatch then means wrong hash settings, whichever layout wins."""
        view = complete_view(rep.learned)
        layout = self._view_layout(view) if view is not None else None
        if layout is None:  # a gap, or no layout vLLM runs: nothing to re-hash with yet
            rep.counters["conformance_skipped"] += len(roots)
            return
        for g, ev in roots:
            spec = rep.learned.get(g)
            if spec is None or not spec.is_fa_type or ev.block_size < spec.block_size:
                continue  # a partial entry after all: its group showed a bigger block later
            self._check_conformance(rep, ev, spec, layout)

    def _check_conformance(
        self, rep: _Replica, ev: BlockStored, spec: GroupSpec, layout: ResolvedLayout | None
    ) -> None:
        """Re-hash a root full-attention store (sampled) under ``layout`` (None: the pool's)
        and distrust the replica for its settings when the hashes differ."""
        salt = _salt_of(ev)
        if salt is False:  # LoRA or multimodal keys: the event lacks what the hash needs
            rep.counters["conformance_skipped"] += 1
            return
        rep.roots_seen += 1
        n = rep.roots_seen
        lim = self.limits
        if n > lim.conformance_first and (n - lim.conformance_first) % lim.conformance_every:
            rep.counters["conformance_skipped"] += 1
            return
        try:
            tokens = ev.tokens()
        except EventDecodeError as exc:  # a bad frame, not bad settings: recoverable
            rep.roots_seen -= 1
            self._refuse(rep, "token_ids", f"a root store's token ids could not be read ({exc})")
            return
        try:
            if self._custom_conformance:
                expected = self.conformance(tokens, ev.block_size, salt)  # type: ignore[misc]
            else:
                expected = self._rehash_root(tokens, ev.block_size, salt, layout)
        except ValueError as exc:  # the hash settings themselves are unusable
            rep.counters["conformance_mismatches"] += 1
            self._distrust(
                rep,
                f"cannot recompute block hashes: {exc}",
                recoverable=False,
                label="hash_settings",
            )
            return
        if expected is None:  # hash_block_size not known yet (groups still being learned)
            rep.roots_seen -= 1
            rep.counters["conformance_skipped"] += 1
            return
        rep.counters["conformance_checked"] += 1
        got = list(ev.block_hashes)
        if expected[: len(got)] != got:
            i = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), 0)
            rep.counters["conformance_mismatches"] += 1
            exp_i = expected[i] if i < len(expected) else None
            msg = (
                f"hash settings mismatch: block {i} of a root full-attention store is "
                f"{got[i]!r} in the events but kvrouter computes {exp_i!r}; check the pool's "
                f"hash algo, PYTHONHASHSEED, int_block_hashes and block sizes against the "
                f"replica's launch flags"
            )
            self._distrust(rep, msg, recoverable=False, label="hash_mismatch")

    def _distrust(
        self, rep: _Replica, reason: str, *, recoverable: bool, label: str = "external"
    ) -> None:
        """Mark ``rep`` untrusted. Every call is counted under ``label`` (a short, bounded
        reason for the metric); the log gets one line per (replica, label) per
        ``warn_interval_s``, so a replica that stays wrong cannot flood it."""
        self._count(rep, label, "untrusted", reason)
        if rep.trusted or rep.recoverable:
            # A settings problem outranks lost events: it must not be cleared by a reset.
            rep.untrusted_reason = reason
            rep.recoverable = recoverable
            rep.down = label == "replica_down"
        rep.trusted = False
        self._track_partial(rep, False)
        if not recoverable:
            self._settle()  # quarantined for its settings: its vote goes
        self.generation += 1

    def _count(self, rep: _Replica, label: str, became: str, reason: str) -> None:
        """Count one ingest problem under ``label``; log it at most once per (replica,
        label) per ``warn_interval_s``."""
        rep.ingest_errors[label] = rep.ingest_errors.get(label, 0) + 1
        now = time.monotonic()
        last = rep.warned.get(label)
        if last is None or now - last >= self.limits.warn_interval_s:
            rep.warned[label] = now
            log.warning(
                "pool %r replica %s/dp%d %s (%s, %d so far): %s",
                self.pool, rep.name, rep.dp_rank, became, label, rep.ingest_errors[label], reason,
            )  # fmt: skip

    # --------------------------------------------------------- stream signals

    def reset_replica(self, key: ReplicaKey) -> None:
        """The replica restarted (its sequence went backwards, §3): vLLM comes back with an
        empty cache and sends no event for it, so its state is wiped and known again."""
        rep = self._replica(key)
        self._known_empty(rep)
        rep.counters["resets"] += 1
        rep.group_aware = None
        rep.learned = {}  # it may come back with other flags: its view is learned anew
        self._settle()

    def _known_empty(self, rep: _Replica) -> None:
        """An empty cache (a clear, or a restart) is a fully known state (§5.4): the replica's
        keys go, nothing is unknown any more, and it is trusted again unless its settings
        are what distrusted it."""
        self._wipe(rep)
        rep.partial_reason = None
        self._track_partial(rep, False)
        if rep.recoverable:
            self._trust_again(rep)

    @staticmethod
    def _trust_again(rep: _Replica) -> None:
        rep.trusted, rep.untrusted_reason, rep.down = True, None, False

    def _hold(self, rep: _Replica, tier: _Tier, g: int, h: object) -> bool:
        """Set ``rep``'s bit on key ``h`` in group ``g`` (allocated) of ``tier`` (one copy);
        False if it held the key already. The event ingest inlines the same steps on its hot
        path. The table is looked up here, not passed: storing may turn it into a dict."""
        table = tier.tables[g]
        m = table.get(h, 0)
        if m & rep.bit:
            return False
        if not m:
            try:
                table[h] = rep.bit
            except (TypeError, OverflowError):  # not a KeyTable's key
                self._demote(table)[h] = rep.bit
            self.entries += 1
        else:
            self.mask_bytes += _mask_bytes(m | rep.bit) - _held_bytes(m)
            table[h] = m | rep.bit
        rep.blocks += 1
        return True

    def attached_late(self, key: ReplicaKey, detail: str) -> None:
        """The stream's first batches are gone from the replica's replay ring (the router
        attached to a replica that has run for a while). What the ring still holds is applied
        next; blocks stored before it are unknown, so the replica is *partial*: routed on, its
        hit a lower bound, exact again after an ``AllBlocksCleared`` or a restart. Unlike a
        gap in mid-stream, nothing known is lost: a block removed before attach is simply not
        in the index, and one removed after arrives as an event."""
        rep = self._replica(key)
        rep.counters["late_attaches"] += 1
        if rep.trusted and rep.partial_reason is None:
            self._track_partial(rep, True)
            rep.partial_reason = (
                f"attached late ({detail}): blocks cached before are unknown until vLLM's "
                f"answers show them or the replica's prefix cache is reset"
            )
            log.info(
                "pool %r replica %s/dp%d partial: %s", self.pool, rep.name, rep.dp_rank, detail
            )
            self.generation += 1

    def infer(
        self,
        key: ReplicaKey,
        keys: Iterable[tuple[int, object]],
        counter: str = "inferred_blocks",
        sent_at: float | None = None,
    ) -> int:
        """Record ``(group, wire hash)`` keys vLLM's answer proved the replica holds (its
        reported ``cached_tokens`` needed them) but no event showed: blocks cached before a
        late attach. They are held like any stored key, so a ``BlockRemoved`` retires them.
        ``counter`` names the proof (``implied_blocks``: vLLM's cache structure, see
        :meth:`Predictor.implied_keys`). Returns how many were new.

        An answer proves its hit's blocks were there when the request was admitted, not that
        they still are: a sliding-window (or chunked, Mamba) block behind the hit leaves the
        request's window as it computes, is freed at once and may be evicted before it
        answers. With ``sent_at`` (monotonic, when the request was sent), such a key removed
        since then is skipped (``answer_keys_skipped``); full-attention blocks stay held by
        the request until it ends."""
        rep = self._replica(key)
        tier = self._tiers["GPU"]
        added = 0
        keys = list(keys)
        removed_at = rep.removed_at
        if sent_at is not None and removed_at:
            kept = [k for k in keys if removed_at.get(k, -math.inf) < sent_at]
            rep.counters["answer_keys_skipped"] += len(keys) - len(kept)
            keys = kept
        if rep.children is not None:  # FA keys in chain order: each an ancestor of the next
            fa, prev = self._fa_groups(), {}
            for g, h in keys:
                if g in fa:
                    if (p := prev.get(g)) is not None:
                        _link(rep.children, (g, p), h, self.limits.max_closure_parents)
                    prev[g] = h
        for g, h in keys:
            if 0 <= g < self.limits.max_groups:
                tier.group(g)
                added += self._hold(rep, tier, g, h)
        rep.counters[counter] += added
        if rep.gone is not None:
            rep.gone.difference_update(keys)
        if added:
            self.generation += 1
        return added

    def lost_events(self, key: ReplicaKey, detail: str) -> None:
        """Events were lost and replay could not cover them (§3, §5.4).

        The state is wiped and the replica predicts no hit until a known state returns: an
        ``AllBlocksCleared`` (reset the replica's prefix cache) or a restart.
        """
        rep = self._replica(key)
        self._wipe(rep)
        rep.counters["unrecoverable_gaps"] += 1
        self._distrust(
            rep,
            f"lost events ({detail}); call the replica's /reset_prefix_cache or restart it to "
            f"return to a known state",
            recoverable=True,
            label="lost_events",
        )

    def gap_lost(self, key: ReplicaKey, detail: str) -> None:
        """Batches were lost in mid-stream and the replay ring no longer holds them.

        What they said is unknown, removals included, so what the index holds of the replica
        may be stale: it is wiped. From then on the stream is applied as after a late attach:
        every batch since the gap is known and blocks cached before it are not, so the
        replica is *partial* (routed on, its hit a lower bound that vLLM's answers raise),
        not untrusted: a busy replica's subscriber that fell behind its ring must not turn
        into load-only routing until someone flushes its cache. The loss is counted
        (``unrecoverable_gaps``, ``kvrouter_ingest_errors_total{reason="lost_events"}``).
        A replica untrusted for its settings stays so; one untrusted for lost or refused
        events is wiped here too, so it becomes partial like the rest."""
        rep = self._replica(key)
        self._wipe(rep)
        rep.counters["unrecoverable_gaps"] += 1
        reason = (
            f"lost events ({detail}): its state was dropped and the stream goes on; blocks "
            f"cached before are unknown until vLLM's answers show them or the replica's "
            f"prefix cache is reset"
        )
        if not (rep.trusted or (rep.recoverable and not rep.down)):
            self._count(rep, "lost_events", "stays untrusted", reason)
            return
        self._count(rep, "lost_events", "partial", reason)
        self._trust_again(rep)
        rep.partial_reason = reason
        self._track_partial(rep, True)
        self.generation += 1

    def seen_down(self, key: ReplicaKey, detail: str) -> None:
        """The replica was seen down or failing (health probe, ejection: router.core.health).

        While it is unreachable it may restart, and vLLM comes back with an empty cache and
        sequence numbers from 0 without any event for it; a restart whose first visible batch
        is not below the last one seen cannot be told from a continuation (spec §3, §6.14).
        So what the index holds for it is dropped now, and it predicts no hit until its
        stream says what it holds: a restart (sequence going back) or an ``AllBlocksCleared``
        make it exact; the next batch that continues its sequence makes it partial (blocks
        stored before are unknown, those from then on are known; vLLM's answers fill in the
        rest, as after a late attach). A replica untrusted for its settings stays so."""
        rep = self._replica(key)
        self._wipe(rep)
        rep.partial_reason = None
        self._distrust(
            rep,
            f"seen down ({detail}): it may have restarted with an empty cache, which vLLM "
            f"announces with no event; no hit is predicted until its event stream shows its "
            f"state",
            recoverable=True,
            label="replica_down",
        )

    def _back_up(self, rep: _Replica) -> None:
        """A batch continues the stream of a replica seen down (see :meth:`seen_down`)."""
        self._trust_again(rep)
        self._track_partial(rep, True)
        rep.partial_reason = (
            "it was seen down and its cache state was dropped; its stream went on without a "
            "restart, so blocks cached before are unknown until vLLM's answers show them or "
            "its prefix cache is reset"
        )
        log.info(
            "pool %r replica %s/dp%d partial: its stream continues after it was seen down",
            self.pool, rep.name, rep.dp_rank,
        )  # fmt: skip
        self.generation += 1

    def mark_untrusted(
        self, key: ReplicaKey, reason: str, *, recoverable: bool = True, label: str = "external"
    ) -> None:
        """Distrust a replica for a reason found outside the event stream (``label``: the
        short reason it is counted under)."""
        self._distrust(self._replica(key), reason, recoverable=recoverable, label=label)

    def ingest_failed(self, key: ReplicaKey, exc: BaseException) -> None:
        """An unexpected error while applying one of this replica's batches (a bug, or input
        no check foresaw): the rest of that batch is lost, so the replica is untrusted until a
        known state returns. Only this replica is affected; its stream keeps running."""
        self._distrust(
            self._replica(key),
            f"an event batch could not be applied ({type(exc).__name__}: {exc}); call the "
            f"replica's /reset_prefix_cache or restart it to return to a known state",
            recoverable=True,
            label="ingest_exception",
        )

    def _wipe(self, rep: _Replica, *, leaving: bool = False) -> None:
        """Drop every key and copy of ``rep`` without scanning the index: its slot becomes
        *dead* (no replica has its bit, so no prediction reads it) and the replica takes a
        fresh slot at once, unless it is ``leaving`` (removed). The dead bit is cleared from
        the keys by :meth:`sweep` in bounded steps (the first one here), and the slot is free
        again when none is left. The accounts (``entries``, ``nbytes``) follow as the sweep
        clears.

        A replica holding nothing keeps its slot (nothing to clear). With ``max_dead_slots``
        pending, the wipe is done at once instead, by a scan of every table (O(index),
        counted in ``sync_wipes``)."""
        if not rep.blocks and not rep.extra:
            if leaving:
                self._release(rep.slot)
            return
        if len(self._dead) >= self.limits.max_dead_slots:
            self._wipe_now(rep)
            self.sync_wipes += 1
            rep.counters["sync_wipes"] += 1
            if leaving:
                self._release(rep.slot)
            return
        old = rep.slot
        self._dead[old] = _Dead(old, rep.bit, rep.blocks, rep.extra)
        self.dead_bits |= rep.bit
        self.live_bits &= ~rep.bit
        rep.blocks = rep.extra = 0
        self.wipes += 1
        rep.counters["wipes"] += 1
        if not leaving:
            slot, bit = self._take_slot()
            rep.place(slot, bit)
            self.live_bits |= bit
        self.slot_moves += 1
        self.generation += 1
        self.sweep()  # a first step: a small index is clean at once

    def _release(self, slot: int) -> None:
        """``slot`` is on no key any more: it may be given again (lowest first)."""
        heapq.heappush(self._free_slots, slot)
        self.slot_moves += 1

    def _wipe_now(self, rep: _Replica) -> None:
        """Clear ``rep``'s bit from every key now, keeping its slot: a scan of every table."""
        bit, slot, keep, bit_objs = rep.bit, rep.slot, ~rep.bit, self._bit_objs
        top, above = rep.mask_top, bit << 1
        masks = 0  # the change to the account
        for tier in self._tiers.values():
            for table, extra in zip(tier.tables, tier.extra, strict=True):
                dead = []
                for h, m in table.items():
                    if m & bit:
                        if m == bit:
                            dead.append(h)
                            continue
                        rest = m & keep
                        if not rest & (rest - 1):  # one holder left: its shared bit
                            table[h] = bit_objs.get(rest, rest)
                            masks -= _mask_bytes(m)
                        else:
                            table[h] = rest
                            if m < above:
                                masks += _mask_bytes(rest) - top
                for h in dead:
                    del table[h]
                self.entries -= len(dead)
                for k in [k for k in extra if k[0] == slot]:
                    self.extra_entries -= extra.pop(k) - 1
        rep.blocks = rep.extra = 0
        self.mask_bytes += masks
        self.generation += 1

    def sweep(self, budget: int | None = None) -> bool:
        """One bounded step of clearing dead bits from keys (:meth:`_wipe`): reads about
        ``budget`` table slots (``IndexLimits.sweep_step`` by default) and clears the dead
        bits of the keys among them. Returns whether dead slots remain (call again).

        The ingest runs a step after every batch; the server also runs steps on a timer
        (router.server.sweep), so a quiet pool frees its dead slots too. Pure bookkeeping:
        predictions never read a dead bit, whether or not it was cleared yet."""
        if not self.dead_bits:
            return False
        st = self._sweep
        if st is None:
            st = self._sweep = _Sweep(self.dead_bits)
        left = self.limits.sweep_step if budget is None else max(1, budget)
        dicts = self._dicts
        self.sweep_steps += 1
        while left > 0 and st.bits:
            if 2 * st.i >= len(dicts):
                break
            table, extra = dicts[2 * st.i], dicts[2 * st.i + 1]
            if table is not st.table:  # the next table, or this one turned into a dict
                st.table, st.cursor, st.keys = table, 0, None
            if not table:
                done = True
                pairs: list = []
            elif type(table) is dict:
                if st.keys is None:
                    st.keys = list(table)
                chunk = st.keys[st.cursor : st.cursor + left]
                st.cursor += len(chunk)
                left -= len(chunk)
                done = st.cursor >= len(st.keys)
                dead = self.dead_bits
                pairs = [(h, m) for h in chunk if (m := table.get(h, 0)) & dead]
            else:
                cap = table.capacity  # type: ignore[attr-defined]
                pairs, nxt = table.scan(st.cursor, left, self.dead_bits)  # type: ignore[attr-defined]
                done = nxt is None
                left -= left if not done else max(1, ((1 << 64) - st.cursor) * cap >> 64)
                if not done:
                    st.cursor = nxt
            if pairs:
                self._clear_dead(table, extra, pairs)
            if done:
                if type(table) is not dict and table:
                    table.shrink()  # type: ignore[attr-defined]
                st.i += 1
                st.table, st.cursor, st.keys = None, 0, None
        if not st.bits or 2 * st.i >= len(dicts):
            self._end_pass(st)
        return bool(self.dead_bits)

    def _clear_dead(self, table: HashTable, extra: dict, pairs: list[tuple[object, int]]) -> None:
        """Clear the dead bits of ``pairs`` (keys of ``table`` with their masks as read)."""
        dead_bits, bit_objs, dead_of = self.dead_bits, self._bit_objs, self._dead
        masks = 0
        for h, m in pairs:
            gone = m & dead_bits
            if not gone:
                continue
            rest = m ^ gone
            masks += _held_bytes(rest) - _held_bytes(m)
            if not rest:
                del table[h]
                self.entries -= 1
            elif not rest & (rest - 1):  # one holder left: its shared bit
                table[h] = bit_objs.get(rest, rest)
            else:
                table[h] = rest
            for low in iter_bits(gone):
                d = dead_of[low.bit_length() - 1]
                d.blocks -= 1
                if extra:
                    c = extra.pop((d.slot, h), None)
                    if c is not None:
                        self.extra_entries -= c - 1
                        d.extra -= c - 1
                self.swept += 1
                if not d.blocks and not d.extra:
                    self._free_dead(d)
                    dead_bits = self.dead_bits
        self.mask_bytes += masks
        self.generation += 1

    def _free_dead(self, d: _Dead) -> None:
        """No key carries ``d``'s bit any more: its slot is free."""
        del self._dead[d.slot]
        self.dead_bits &= ~d.bit
        if self._sweep is not None:
            self._sweep.bits &= ~d.bit
        self._release(d.slot)

    def _end_pass(self, st: _Sweep) -> None:
        """A pass visited every table: the slots dead when it began are on no key now."""
        self._sweep = None
        self.sweep_passes += 1
        for low in iter_bits(st.bits):
            d = self._dead.get(low.bit_length() - 1)
            if d is None:
                continue
            if d.blocks or d.extra:  # the counts disagree with the pass: a bug, said loudly
                log.error(
                    "pool %r: dead slot %d still counts %d keys and %d copies after a full "
                    "sweep; freeing it", self.pool, d.slot, d.blocks, d.extra,
                )  # fmt: skip
            self._free_dead(d)

    def dead_slots(self) -> int:
        """Wiped slots the sweep has not freed yet (their bits are still on some keys)."""
        return len(self._dead)

    def _demote(self, table: HashTable) -> dict:
        """Replace the KeyTable ``table`` by a dict holding the same keys, for a key it cannot
        hold (not an int in [0, 2**64)): the replica's key is then stored as the dict path
        stores it. Only that table changes; counted in ``demoted`` and logged."""
        fresh: dict = dict(table.items())
        for name, tier in self._tiers.items():
            for g, t in enumerate(tier.tables):
                if t is table:
                    tier.tables[g] = fresh
                    i = next(i for i, d in enumerate(self._dicts) if d is table)
                    self._dicts[i] = fresh
                    self.demoted += 1
                    log.warning(
                        "pool %r: a replica stored a hash that is not a 64-bit int (in tier "
                        "%s group %d) although the pool's int_block_hashes is true; that table "
                        "is kept in a dict from now on: check the replicas' "
                        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", self.pool, name, g,
                    )  # fmt: skip
                    return fresh
        raise LookupError("KVIndex._demote: the table is not one of the index's")

    def _reclaim(self) -> None:
        """Drop 10 % of the largest table (module docstring): a dict's oldest-inserted keys,
        a KeyTable's next keys in its sweep over hash order."""
        table, extra = max(
            (
                (t, e)
                for tier in self._tiers.values()
                for t, e in zip(tier.tables, tier.extra, strict=True)
            ),
            key=lambda te: len(te[0]),
        )
        victims = _pop_some(table, max(1, len(table) // 10))
        by_slot: dict[int, _Replica | _Dead] = {r.slot: r for r in self._replicas.values()}
        by_slot.update(self._dead)
        for h, m in victims:
            self.mask_bytes -= _held_bytes(m)
            for low in iter_bits(m):
                rep = by_slot[low.bit_length() - 1]
                rep.blocks -= 1
                c = extra.pop((rep.slot, h), None)
                if c is not None:
                    self.extra_entries -= c - 1
                    rep.extra -= c - 1
        for d in list(self._dead.values()):
            if not d.blocks and not d.extra:
                self._free_dead(d)
        self.entries -= len(victims)
        self.reclaimed += len(victims)
        log.warning(
            "pool %r index over its entry budget: reclaimed %d keys", self.pool, len(victims)
        )

    # ------------------------------------------------------------------ lookup

    def table(self, tier: str, group: int) -> HashTable:
        """The hash -> replica-bitmask table of one tier and group (empty if none yet): a
        dict or a KeyTable (:class:`HashTable` is what both offer)."""
        t = self._tiers.get(tier)
        return t.tables[group] if t is not None and group < len(t.tables) else {}

    def tiers(self) -> list[str]:
        """Every tier the index has: GPU, CPU, STORAGE and the connectors' own names seen."""
        return list(self._tiers)

    def share_tier(self, tier: SharedTier) -> None:
        """Hold the tier ``tier.name`` (a medium, any case) pool-wide: every replica's events
        of that medium fill one store view (router.core.shared_tier), which
        :meth:`shared_tiers` gives to the predictor."""
        name = tier.name.upper()
        self._shared[name] = tier
        self._tiers.setdefault(name, _Tier(self._dicts, self._new_table))
        self._tier_of[name] = name

    def shared_tiers(self) -> dict[str, SharedTier]:
        return self._shared

    def expire_shared(self, now: float) -> None:
        """Forget the shared stores' keys older than their ``ttl_s`` (their connector
        publishes no evictions); the caller reads the clock, so the predictor stays pure."""
        for tier in self._shared.values():
            tier.expire(now)

    def tiers_in_use(self) -> list[str]:
        return [name for name, t in self._tiers.items() if any(t.tables)]

    def copies(self, key: ReplicaKey, group: int, h: object, tier: str = "GPU") -> int:
        """Physical copies of ``h`` the replica holds in ``group`` (0 if none)."""
        rep = self._replica(key)
        t = self._tiers.get(tier)
        if t is None or group >= len(t.tables) or not t.tables[group].get(h, 0) & rep.bit:
            return 0
        return t.extra[group].get((rep.slot, h), 1)

    # ------------------------------------------------------------------ stats

    def nbytes(self) -> int:
        """The memory account of the index (module docstring), in bytes: the tables as
        allocated, a hash object per key and per side-table entry, every key's mask by its
        width, and each replica's own records. O(tables); called after every batch."""
        key = self._key_size
        if key is None:
            key = self._key_size = self._sample_key_size()
            if key is None:
                key = 0
        dicts = self._dicts
        # a KeyTable holds its keys inline: only keys of dict tables are int objects
        objects = (
            sum(len(t) for t in dicts[::2] if type(t) is dict) if self.compact else self.entries
        )
        return (
            sum(map(sys.getsizeof, dicts))
            + objects * key
            + sum(map(len, dicts[1::2])) * (_EXTRA_BYTES + key)
            + self.mask_bytes
            + len(self._replicas) * _REPLICA_BYTES
        )

    def _sample_key_size(self) -> int | None:
        """The size of one held hash object, or None (nothing held yet: the account is then
        the tables' own size). Read once: a table's first key is found in O(1) only until
        keys from its start are removed, so it is not looked at again. A KeyTable yields a new
        int for its key, of the size the wire's int object has (side-table entries hold
        those)."""
        for table in self._dicts[::2]:
            for h in table:
                return sys.getsizeof(h)
        return None

    def recount_bytes(self) -> int:
        """:meth:`nbytes` with the masks' part recomputed from every mask (O(index)); tests
        compare it with the account kept as events apply."""
        kept = self.mask_bytes
        self.mask_bytes = sum(_held_bytes(m) for d in self._dicts[::2] for m in d.values())
        try:
            return self.nbytes()
        finally:
            self.mask_bytes = kept

    def stats(self) -> list[ReplicaStats]:
        """Per replica: trust, held keys and copies, and every ingest counter. O(replicas),
        so the metrics scrape and the admin API can call it on every request."""
        out = []
        for rep in self._replicas.values():
            out.append(
                ReplicaStats(
                    replica=rep.name,
                    dp_rank=rep.dp_rank,
                    trusted=rep.routed,
                    untrusted_reason=rep.untrusted_reason or rep.hold,
                    blocks=rep.blocks,
                    extra_copies=rep.extra,
                    group_aware=rep.group_aware,
                    ingest_errors=dict(rep.ingest_errors),
                    trust=rep.trust,
                    layout_view=describe(rep.learned) if rep.learned else None,
                    layout_hold=rep.hold_kind,
                    partial_reason=rep.partial_reason,
                    eviction_proof=_proof_state(rep),
                    **rep.counters,
                )
            )
        return out
