"""The wire schema against vLLM 0.32's bytes (spec §2.1), built independently of msgspec."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.schema import (
    AllBlocksCleared,
    BatchDecodeError,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    LazyTokensBlockStored,
    UnknownEvent,
    decode_batch,
    encode_batch,
)

U64_MAX = 2**64 - 1


# -- a reference msgpack writer, written from the msgpack spec (not from msgspec) ----------


def mp(obj: Any) -> bytes:
    """Smallest-form msgpack, the way msgspec (and therefore vLLM) writes it."""
    if obj is None:
        return b"\xc0"
    if obj is True:
        return b"\xc3"
    if obj is False:
        return b"\xc2"
    if isinstance(obj, int):
        if 0 <= obj <= 0x7F:
            return bytes([obj])
        if 0 <= obj <= 0xFF:
            return b"\xcc" + struct.pack(">B", obj)
        if 0 <= obj <= 0xFFFF:
            return b"\xcd" + struct.pack(">H", obj)
        if 0 <= obj <= 0xFFFFFFFF:
            return b"\xce" + struct.pack(">I", obj)
        if 0 <= obj <= U64_MAX:
            return b"\xcf" + struct.pack(">Q", obj)
        if -32 <= obj < 0:
            return struct.pack(">b", obj)
        raise ValueError(obj)
    if isinstance(obj, float):
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, str):
        raw = obj.encode()
        n = len(raw)
        if n < 32:
            return bytes([0xA0 | n]) + raw
        if n < 256:
            return b"\xd9" + bytes([n]) + raw
        return b"\xda" + struct.pack(">H", n) + raw
    if isinstance(obj, bytes):
        if len(obj) < 256:
            return b"\xc4" + bytes([len(obj)]) + obj
        return b"\xc5" + struct.pack(">H", len(obj)) + obj
    if isinstance(obj, (list, tuple)):
        n = len(obj)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
        return head + b"".join(mp(x) for x in obj)
    if isinstance(obj, dict):
        n = len(obj)
        head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
        return head + b"".join(mp(k) + mp(v) for k, v in obj.items())
    raise TypeError(type(obj))


def test_reference_writer_matches_hand_written_bytes() -> None:
    # The reference writer itself, checked against bytes typed from the msgpack spec.
    assert mp([1.5, [{"type": "AllBlocksCleared"}], 0]) == bytes.fromhex(
        "93"
        + "cb3ff8000000000000"
        + "91"
        + "81"
        + "a474797065"
        + "b0"
        + b"AllBlocksCleared".hex()
        + "00"
    )
    assert mp(U64_MAX) == bytes.fromhex("cfffffffffffffffff")
    assert mp(200) == bytes.fromhex("ccc8")


# vLLM 0.32's field order (spec §2.1): the tag, then the declared fields; optional ones
# (extra_keys and after) are absent when None.
def vllm_stored(**f: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": "BlockStored"}
    for k in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"):
        d[k] = f[k]
    d["medium"] = f["medium"]
    d["lora_name"] = f["lora_name"]
    for k in (
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    ):
        if f.get(k) is not None:
            d[k] = f[k]
    return d


def vllm_removed(**f: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": f["block_hashes"]}
    d["medium"] = f["medium"]
    for k in ("group_idx", "locality", "ownership"):
        if f.get(k) is not None:
            d[k] = f[k]
    return d


STORED_FA = dict(
    block_hashes=[1403909460543360175, 1643945449041937783],
    parent_block_hash=None,
    token_ids=list(range(1, 33)),
    block_size=16,
    lora_id=None,
    medium="GPU",
    lora_name=None,
    group_idx=0,
    kv_cache_spec_kind="full_attention",
)
STORED_SWA = dict(
    block_hashes=[U64_MAX, 2**63 + 5],
    parent_block_hash=2**63,
    token_ids=list(range(300, 364)),
    block_size=32,
    lora_id=None,
    medium="GPU",
    lora_name=None,
    extra_keys=[None, ["tenant-a"]],
    group_idx=1,
    kv_cache_spec_kind="sliding_window",
    kv_cache_spec_sliding_window=64,
)
REMOVED = dict(block_hashes=[14725353451287653808], medium="GPU", group_idx=1)
TS = 1767225600.125


def vllm_bytes() -> bytes:
    events = [vllm_stored(**STORED_FA), vllm_stored(**STORED_SWA), vllm_removed(**REMOVED)]
    events.append({"type": "AllBlocksCleared"})
    return mp([TS, events, 0])


def our_batch() -> KVEventBatch:
    return KVEventBatch(
        TS,
        [
            BlockStored(**STORED_FA),
            BlockStored(**STORED_SWA),
            BlockRemoved(**REMOVED),
            AllBlocksCleared(),
        ],
        0,
    )


def test_encode_is_byte_identical_to_vllm_0_32() -> None:
    expected = vllm_bytes()
    assert expected[0] == 0x93  # spec §2.1: array of 3, then the float
    assert expected[1] == 0xCB
    assert encode_batch(our_batch()) == expected


def test_decode_of_vllm_bytes_gives_every_field() -> None:
    d = decode_batch(vllm_bytes())
    assert d.ts == TS and d.data_parallel_rank == 0 and d.unknown == 0 and d.legacy == 0
    fa, swa, rem, clr = d.events
    assert type(fa) is BlockStored and type(swa) is BlockStored
    for ev, src in ((fa, STORED_FA), (swa, STORED_SWA)):
        for k, v in src.items():
            assert getattr(ev, k) == v, k
    assert swa.block_hashes[0] == U64_MAX  # uint64, not a negative int64
    assert swa.parent_block_hash == 2**63
    assert swa.extra_keys == [None, ["tenant-a"]]
    assert fa.extra_keys is None and fa.session_id is None and fa.locality is None
    assert type(rem) is BlockRemoved and rem.block_hashes == REMOVED["block_hashes"]
    assert rem.group_idx == 1 and rem.medium == "GPU"
    assert type(clr) is AllBlocksCleared


FULL_STORED = dict(
    block_hashes=[b"\x01" * 32, b"\xff" * 16],
    parent_block_hash=b"\x02" * 32,
    token_ids=[0, 7, 2**31],
    block_size=16,
    lora_id=3,
    medium="CPU",
    lora_name="adapter",
    extra_keys=[["adapter", ["mm-1", -4], "salt"], ["adapter", b"\x09" * 32]],
    group_idx=2,
    kv_cache_spec_kind="mamba",
    kv_cache_spec_sliding_window=None,
    locality="REMOTE",
    ownership="tier-7",
    session_id="sess-1",
)


@pytest.mark.parametrize("legacy", [False, True])
def test_every_field_round_trips_in_both_encodings(legacy: bool) -> None:
    stored = BlockStored(**FULL_STORED)
    removed = BlockRemoved(block_hashes=[U64_MAX], medium="STORAGE", group_idx=0)
    removed.locality, removed.ownership = "LOCAL", "o"
    batch = KVEventBatch(1.0, [stored, removed, AllBlocksCleared()], 5)
    raw = encode_batch(batch, legacy=legacy)
    d = decode_batch(raw)
    assert d.legacy == (3 if legacy else 0) and d.unknown == 0
    assert d.events == [stored, removed, AllBlocksCleared()]
    assert d.data_parallel_rank == 5
    if legacy:
        # Positional arrays tagged by their first element (spec §2.1 legacy note).
        inner = msgspec.msgpack.decode(raw)[1]
        assert inner[0][0] == "BlockStored" and inner[1][0] == "BlockRemoved"
        assert inner[2] == ["AllBlocksCleared"]


def test_missing_optional_fields_and_unknown_extra_fields() -> None:
    # An old producer that omits the always-written fields, and a newer one adding keys.
    old = {"type": "BlockStored", "block_hashes": [5]}
    new = {"type": "BlockRemoved", "block_hashes": [6], "medium": "GPU", "remaining": 2}
    d = decode_batch(mp([2.0, [old, new], 1]))
    stored, removed = d.events
    assert stored == BlockStored(block_hashes=[5])
    assert stored.parent_block_hash is None and stored.token_ids == [] and stored.block_size == 0
    assert stored.medium is None and stored.group_idx is None and not stored.group_aware
    assert removed.block_hashes == [6] and removed.medium == "GPU"
    # Re-encoding writes vLLM's always-present keys.
    assert encode_batch(KVEventBatch(2.0, [stored], 1)) == mp(
        [
            2.0,
            [
                vllm_stored(
                    block_hashes=[5],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=None,
                    lora_name=None,
                )
            ],
            1,
        ]
    )


def test_two_element_batch_has_no_rank() -> None:
    d = decode_batch(mp([3.0, [{"type": "AllBlocksCleared"}]]))
    assert d.data_parallel_rank is None and d.events == [AllBlocksCleared()]


def test_unknown_and_broken_events_are_kept_in_place() -> None:
    raw = mp(
        [
            1.0,
            [
                {"type": "BlockPinned", "block_hashes": [1]},
                {"type": "BlockRemoved", "block_hashes": "nope"},
                7,
                {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
            ],
            0,
        ]
    )
    d = decode_batch(raw)
    assert d.unknown == 3
    assert [type(e) for e in d.events] == [UnknownEvent] * 3 + [BlockRemoved]
    assert [e.index for e in d.events[:3]] == [0, 1, 2]
    assert d.events[0].raw == mp({"type": "BlockPinned", "block_hashes": [1]})


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", mp([1.0]), mp({"ts": 1.0}), mp(["x", [], 0]), mp([1.0, 5, 0]), b"\x93\xcb\x00"],
)
def test_broken_envelope_raises_typed_error(payload: bytes) -> None:
    with pytest.raises(BatchDecodeError):
        decode_batch(payload)


# -- hostile bytes: only BatchDecodeError may leave decode_batch (issue 12) ----------------

NOT_UTF8 = b"\xff\xfe"


def _with_bad_string(field: str, legacy: bool) -> bytes:
    """A batch [bad store, good removal] whose store has a non-UTF-8 string in ``field``
    (encoded as a 3-byte marker first, then patched in place, msgpack length unchanged)."""
    store = BlockStored(
        block_hashes=[1],
        token_ids=[1, 2],
        block_size=2,
        medium="GPU",
        lora_name="qqq",
        kv_cache_spec_kind="zzz",
        group_idx=0,
    )
    marker = {"medium": "GPU", "lora_name": "qqq", "kv_cache_spec_kind": "zzz"}[field]
    raw = encode_batch(KVEventBatch(1.0, [store, BlockRemoved(block_hashes=[2])], 0), legacy=legacy)
    assert raw.count(marker.encode()) == 1
    return raw.replace(marker.encode(), NOT_UTF8 + b"U")


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("field", ["medium", "lora_name", "kv_cache_spec_kind"])
def test_non_utf8_string_costs_only_its_event(field: str, legacy: bool, lazy: bool) -> None:
    d = decode_batch(_with_bad_string(field, legacy), lazy_token_ids=lazy)
    assert d.unknown == 1 and [type(e) for e in d.events] == [UnknownEvent, BlockRemoved]
    bad = d.events[0]
    assert isinstance(bad, UnknownEvent) and bad.index == 0 and NOT_UTF8 in bad.raw
    # msgspec < 0.23: "UnicodeDecodeError: 'utf-8' codec can't decode ..."; 0.23: "Invalid
    # UTF-8 encoded string"
    assert "utf-8" in bad.error.lower()
    assert d.events[1] == BlockRemoved(block_hashes=[2])


@pytest.mark.parametrize("lazy", [False, True])
def test_too_deep_nesting_is_a_typed_error(lazy: bool) -> None:
    deep = b"\x91" * 100_000 + b"\x00"  # [[[...[0]...]]]: msgspec raises RecursionError
    # In the envelope: the batch is broken.
    with pytest.raises(BatchDecodeError, match="RecursionError"):
        decode_batch(mp([1.0, [], 0])[:-2] + b"\x91" + deep + b"\x00", lazy_token_ids=lazy)
    # Inside one event's unknown extra key: that event only.
    good = mp({"type": "BlockRemoved", "block_hashes": [2]})
    ev = mp({"type": "BlockRemoved", "block_hashes": [1]})
    ev = bytes([ev[0] + 1]) + ev[1:] + mp("junk") + deep
    payload = b"\x93" + mp(1.0) + b"\x92" + ev + good + mp(0)
    try:
        d = decode_batch(payload, lazy_token_ids=lazy)
    except BatchDecodeError:
        return  # skipping the nested value recursed in the envelope pass too: allowed
    assert [type(e) for e in d.events] == [UnknownEvent, BlockRemoved]


def test_lazy_tokens_of_hostile_bytes_raise_event_decode_error() -> None:
    ev = mp({"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"]})
    d = decode_batch(b"\x93" + mp(1.0) + b"\x91" + ev + mp(0), lazy_token_ids=True)
    store = d.events[0]
    assert isinstance(store, LazyTokensBlockStored)
    with pytest.raises(EventDecodeError, match="token_ids"):
        store.tokens()


hashes = st.one_of(st.integers(0, U64_MAX), st.binary(min_size=16, max_size=32))
stored_st = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=5),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    block_size=st.integers(0, 1024),
    lora_id=st.none() | st.integers(0, 100),
    medium=st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
    lora_name=st.none() | st.text(max_size=8),
    group_idx=st.none() | st.integers(0, 8),
    kv_cache_spec_kind=st.none() | st.sampled_from(["full_attention", "mamba", "new_kind"]),
    kv_cache_spec_sliding_window=st.none() | st.integers(1, 4096),
    session_id=st.none() | st.text(max_size=8),
)
removed_st = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, min_size=1, max_size=3),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    group_idx=st.none() | st.integers(0, 8),
)
event_st = st.one_of(stored_st, removed_st, st.just(AllBlocksCleared()))


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(event_st, max_size=6),
    ts=st.floats(allow_nan=False, allow_infinity=False),
    rank=st.none() | st.integers(0, 64),
    legacy=st.booleans(),
)
def test_round_trip_property(events: list[Any], ts: float, rank: int | None, legacy: bool) -> None:
    d = decode_batch(encode_batch(KVEventBatch(ts, events, rank), legacy=legacy))
    assert d.events == events and d.ts == ts and d.data_parallel_rank == rank
    assert d.unknown == 0 and d.legacy == (len(events) if legacy else 0)
