"""The KV-event wire schema of vLLM 0.32, as msgspec Structs (spec §2.1).

One set of Structs is the schema, the validator and the codec. vLLM 0.32 encodes each event as
a msgpack map tagged by ``"type"`` (PR #42892) inside a positional batch array
``[ts, events, data_parallel_rank]``; older releases encoded events as positional arrays
``["BlockStored", block_hashes, parent, ...]``. :func:`decode_batch` accepts both, telling
every event apart by its msgpack type (map or array) and decoding each event exactly once.

Fields that vLLM always writes (possibly as nil) but that older producers lack
(``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``)
default to ``UNSET`` so that a missing key is tolerated; after decoding they read as
``None`` (``[]`` and ``0`` for the token list and block size) and they are always written on
encoding, which is what vLLM 0.32 does. Unknown extra keys are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "AllBlocksCleared",
    "BatchDecodeError",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "EventDecodeError",
    "KVCacheEvent",
    "KVEventBatch",
    "LazyTokensBlockStored",
    "Medium",
    "UnknownEvent",
    "decode_batch",
    "encode_batch",
]

#: A wire block hash: a uint64 (the low 8 bytes of the digest, big-endian; values above 2**63
#: are normal) or the raw digest bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (§1.5).
BlockHash = int | bytes

#: Storage tier of an event (§2.1); ``None`` when an old producer did not say (read as GPU).
Medium = Literal["GPU", "CPU", "STORAGE"]

#: vLLM's ``KVCacheSpecKind`` values (§2.3); kept as plain strings so a new kind decodes.
KNOWN_SPEC_KINDS = frozenset(
    {
        "full_attention",
        "mla_attention",
        "sliding_window",
        "sliding_window_mla",
        "mamba",
        "chunked_local_attention",
        "sink_full_attention",
        "encoder_only_attention",
        "cross_attention",
        "unknown",
    }
)


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the map-encoded events (vLLM's ``KVCacheEvent``: tagged, defaults omitted)."""


class BlockStored(_Event):
    """Blocks newly inserted into one KV-cache group of one tier (§2.1, §2.4).

    ``token_ids`` covers the whole newly cached range while ``block_hashes`` lists only the
    blocks actually inserted (sliding-window and Mamba groups insert checkpoints only), so a
    hash cannot be placed from its index: consumers test membership by hash instead.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | UnsetType | None = UNSET
    token_ids: list[int] | UnsetType = UNSET
    block_size: int | UnsetType = UNSET
    lora_id: int | UnsetType | None = UNSET
    medium: str | UnsetType | None = UNSET
    lora_name: str | UnsetType | None = UNSET
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        # Normalise "absent" to vLLM's nil so consumers see one value and re-encoding writes
        # the key the way vLLM 0.32 does.
        if self.parent_block_hash is UNSET:
            self.parent_block_hash = None
        if self.token_ids is UNSET:
            self.token_ids = []
        if self.block_size is UNSET:
            self.block_size = 0
        if self.lora_id is UNSET:
            self.lora_id = None
        if self.medium is UNSET:
            self.medium = None
        if self.lora_name is UNSET:
            self.lora_name = None

    def tokens(self) -> list[int]:
        """The token ids of the covered range, however the event was decoded."""
        return self.token_ids  # type: ignore[return-value]

    @property
    def group_aware(self) -> bool:
        """False when the producer sent no ``group_idx``: a single group 0 of unknown kind
        (pre-#37688 vLLM or a connector path, spec §6 item 2)."""
        return self.group_idx is not None


class LazyTokensBlockStored(BlockStored, tag="BlockStored"):
    """A :class:`BlockStored` whose ``token_ids`` are left msgpack-encoded (``msgspec.Raw``).

    Token ids are most of an event's bytes, and a consumer that tracks presence by hash (the
    router) needs them only now and then; ``decode_batch(..., lazy_token_ids=True)`` yields
    this class so they are decoded on demand with :meth:`tokens`. Same wire form.
    """

    token_ids: msgspec.Raw | UnsetType = UNSET  # type: ignore[assignment]

    def tokens(self) -> list[int]:
        """The token ids, decoded now. Their bytes were not checked when the batch was, so
        a hostile list shows here: :class:`EventDecodeError` (a ``ValueError``), whatever
        the bytes hold, and never another exception type."""
        raw = self.token_ids
        if not isinstance(raw, msgspec.Raw):
            return list(raw)
        try:
            return _tokens_decoder.decode(raw)
        except Exception as exc:
            raise EventDecodeError(f"token_ids: {_describe(exc)}") from None


class BlockRemoved(_Event):
    """Blocks evicted from one group; GPU removals carry exactly one hash each (§2.1)."""

    block_hashes: list[BlockHash]
    medium: str | UnsetType | None = UNSET
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        if self.medium is UNSET:
            self.medium = None

    @property
    def group_aware(self) -> bool:
        """See :attr:`BlockStored.group_aware`."""
        return self.group_idx is not None


class AllBlocksCleared(_Event):
    """The replica's prefix cache was reset: every tier and group of it is empty (§2.2)."""


class UnknownEvent(msgspec.Struct, frozen=True, gc=False):
    """An event this SDK could not type: a tag it does not know (a newer vLLM) or a
    malformed entry. It is delivered, not dropped, so a consumer can count it and decide
    whether its state is still trustworthy."""

    index: int
    """Position of the event inside its batch."""
    error: str
    raw: bytes
    """The event's msgpack bytes, untouched."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


# Legacy positional-array encoding (before vLLM PR #42892): the tag is element 0 and the fields
# follow in declaration order. Subclasses, so ``isinstance(ev, BlockStored)`` holds for both.
class _LegacyBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _LegacyBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _LegacyAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_LEGACY = {
    BlockStored: _LegacyBlockStored,
    BlockRemoved: _LegacyBlockRemoved,
    AllBlocksCleared: _LegacyAllBlocksCleared,
}

_CANONICAL = {legacy: canon for canon, legacy in _LEGACY.items()}


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events: ``[ts, events, data_parallel_rank]`` (§2.1).

    ``data_parallel_rank`` is optional on the wire (2-element batches are accepted).
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class DecodedBatch(msgspec.Struct, gc=False):
    """A decoded batch plus what could not be typed inside it."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent]
    data_parallel_rank: int | None
    unknown: int = 0
    """How many entries of ``events`` are :class:`UnknownEvent`."""
    legacy: int = 0
    """How many events used the legacy positional-array encoding."""


class BatchDecodeError(ValueError):
    """The batch envelope itself is not a KV-event batch (bad msgpack, wrong shape)."""


class EventDecodeError(ValueError):
    """One event's field could not be decoded: raised by
    :meth:`LazyTokensBlockStored.tokens` when the token bytes it decodes late are bad."""


class _TypedBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared | list]
    data_parallel_rank: int | None = None


class _TypedLazyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[LazyTokensBlockStored | BlockRemoved | AllBlocksCleared | list]
    data_parallel_rank: int | None = None


_tokens_decoder = msgspec.msgpack.Decoder(list[int])

# msgspec picks the event's type from its msgpack type: a map is a tagged 0.32 event, an
# array is a legacy event (decoded once into a list, then converted field by field).
_typed_decoder = msgspec.msgpack.Decoder(_TypedBatch)
_typed_lazy_decoder = msgspec.msgpack.Decoder(_TypedLazyBatch)
_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)
_map_decoder = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_LegacyEvent = _LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared
_array_decoder = msgspec.msgpack.Decoder(_LegacyEvent)
_encoder = msgspec.msgpack.Encoder()

# msgpack first-byte ranges: fixmap 0x80-0x8f, map16 0xde, map32 0xdf; fixarray 0x90-0x9f,
# array16 0xdc, array32 0xdd.
_MAP_FIRST = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_ARRAY_FIRST = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


def _canonical(old: Any) -> BlockStored | BlockRemoved | AllBlocksCleared:
    # Hand out the canonical classes so equality and ``type(ev) is`` checks do not depend on
    # the producer's encoding.
    return _CANONICAL[type(old)](*msgspec.structs.astuple(old))


def decode_batch(payload: bytes | memoryview, *, lazy_token_ids: bool = False) -> DecodedBatch:
    """Decode one msgpack ``KVEventBatch`` payload.

    Each event is told apart by its msgpack type (a map: vLLM 0.32's tagged form; an array:
    the legacy positional form) and decoded once, in a single pass over the batch. Only when
    some event is not a valid KV event does a second, per-event pass run: that event becomes
    an :class:`UnknownEvent` at its position so the rest of the batch is not lost. A broken
    envelope raises :class:`BatchDecodeError`.

    ``lazy_token_ids`` yields :class:`LazyTokensBlockStored` for map-encoded stores (about
    three times faster for 16-token blocks); read their tokens with ``tokens()``.
    """
    try:
        typed = (_typed_lazy_decoder if lazy_token_ids else _typed_decoder).decode(payload)
    except msgspec.ValidationError:
        return _decode_per_event(payload)
    except msgspec.DecodeError:
        # Bad msgpack somewhere: in the envelope (the salvage path raises BatchDecodeError),
        # or inside one event, which costs that event only. msgspec >= 0.23 reports a string
        # that is not UTF-8 this way (DecodeError), where earlier ones raised
        # UnicodeDecodeError (below).
        return _decode_per_event(payload)
    except Exception:
        # Not a msgspec error but still the payload's fault: a string that is not UTF-8
        # (UnicodeDecodeError) or nesting too deep (RecursionError). Which event it is in is
        # unknown here, so the salvage path finds it (or calls the envelope broken).
        return _decode_per_event(payload)
    events = typed.events
    legacy = 0
    for i, ev in enumerate(events):
        if type(ev) is list:
            try:
                events[i] = _canonical(msgspec.convert(ev, _LegacyEvent))
            except Exception:  # ValidationError, or anything else a hostile event causes
                return _decode_per_event(payload)
            legacy += 1
    return DecodedBatch(typed.ts, events, typed.data_parallel_rank, 0, legacy)


def _decode_per_event(payload: bytes | memoryview) -> DecodedBatch:
    """The salvage path: sniff and decode every event alone, keeping the undecodable ones."""
    try:
        raw = _batch_decoder.decode(payload)
    except Exception as exc:
        # Any decode failure of the envelope (msgspec's errors, RecursionError, ...) is one
        # thing to the caller: this is not a batch. Only BatchDecodeError may leave here.
        raise BatchDecodeError(f"not a KV-event batch: {_describe(exc)}") from None
    events: list[BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent] = []
    unknown = legacy = 0
    map_decode = _map_decoder.decode
    for i, ev in enumerate(raw.events):
        try:
            first = memoryview(ev)[0]
            if first in _MAP_FIRST:
                events.append(map_decode(ev))
                continue
            if first in _ARRAY_FIRST:
                events.append(_canonical(_array_decoder.decode(ev)))
                legacy += 1
                continue
            error = f"event is msgpack type byte 0x{first:02x}, expected a map or an array"
        except Exception as exc:
            # Whatever one event's bytes cause (a ValidationError, a non-UTF-8 string's
            # UnicodeDecodeError, a RecursionError), it costs that event only.
            error = _describe(exc)
        events.append(UnknownEvent(i, error, bytes(ev)))
        unknown += 1
    return DecodedBatch(raw.ts, events, raw.data_parallel_rank, unknown, legacy)


def _describe(exc: BaseException) -> str:
    """msgspec's messages stand alone; others (``UnicodeDecodeError``) need their type."""
    if isinstance(exc, msgspec.MsgspecError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def encode_batch(batch: KVEventBatch, *, legacy: bool = False) -> bytes:
    """Encode a batch exactly as vLLM 0.32 does (maps), or in the legacy array layout.

    The legacy layout exists so consumers can be tested against old producers.
    """
    if legacy:
        batch = KVEventBatch(
            batch.ts, [_to_legacy(ev) for ev in batch.events], batch.data_parallel_rank
        )
    return _encoder.encode(batch)


def _to_legacy(ev: Any) -> Any:
    cls = _LEGACY.get(type(ev))
    if cls is None:
        return ev
    return cls(**{f: getattr(ev, f) for f in ev.__struct_fields__})
