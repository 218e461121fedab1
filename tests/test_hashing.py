"""events.hashing against spec §1: test vectors, an independent naive oracle, memo and laziness."""

from __future__ import annotations

import hashlib
import inspect
import pickle

import cbor2
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    HashSettingsError,
    MMItem,
    RequestKeys,
    RequestKeysError,
    block_hashes_at,
    expected_stored_hashes,
    none_hash_seed,
    prompt_embeds_digest,
    to_wire,
)
from events.layout import HashSettings

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
U64 = 2**64 - 1


def settings_for(algo: str, *, seed: str | None = None, ints: bool = True) -> HashSettings:
    if seed is None and algo.startswith("xxhash"):
        seed = "0"  # xxhash needs a fixed seed to be reproducible at all (spec §1.2)
    return HashSettings(algo=algo, pythonhashseed=seed, int_block_hashes=ints)


# --------------------------------------------------------------------------- naive oracle
# Written straight from spec §1.2/§1.3 with no shortcut: serializer of the table, one
# pickle/cbor2 call per block, extra keys by scanning every mm item.


def oracle_hash(algo: str, obj: object) -> bytes:
    data = cbor2.dumps(obj, canonical=True) if algo.endswith("_cbor") else pickle.dumps(obj, 5)
    if algo.startswith("sha256"):
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128(data).digest()


def oracle_extras(keys: RequestKeys | None, unit: int, H: int) -> tuple | None:
    if keys is None:
        return None
    start, end = unit * H, unit * H + H
    out: list = []
    if keys.lora_name is not None:
        out.append(("lora", keys.lora_name, keys.lora_path))
    for m in keys.mm_items:
        if m.offset < end and m.offset + m.length > start:
            out.append(("mm", m.identifier, m.offset - start))
    if keys.cache_salt is not None and start == 0:
        out.append(("cache_salt", keys.cache_salt))
    if unit < len(keys.prompt_embeds_digests):
        out.append(("prompt_embeds", keys.prompt_embeds_digests[unit]))
    return tuple(out) if out else None


def oracle_chain(
    algo: str, seed: str, tokens: list[int], H: int, keys: RequestKeys | None = None
) -> list[bytes]:
    parent = oracle_hash(algo, seed)
    out = []
    for u in range(len(tokens) // H):
        parent = oracle_hash(
            algo, (parent, tuple(tokens[u * H : u * H + H]), oracle_extras(keys, u, H))
        )
        out.append(parent)
    return out


# --------------------------------------------------------------------------- spec §1.6


def test_spec_vectors_sha256() -> None:
    h = BlockHasher(HashSettings(algo="sha256"), 16)
    assert h.none_hash.hex() == ("066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198")
    d = h.digests(list(range(1, 33)))
    assert d[0].hex().startswith("7b255da4") and d[0].hex().endswith("547f4caf")
    assert h.wire_chain(list(range(1, 33))) == [1403909460543360175, 1643945449041937783]
    salted = h.wire_chain(list(range(1, 17)), RequestKeys(cache_salt="tenant-a"))
    assert salted == [14725353451287653808]


def test_spec_vectors_sha256_cbor() -> None:
    h = BlockHasher(HashSettings(algo="sha256_cbor"), 16)
    assert h.none_hash.hex() == ("9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0")
    assert h.wire_chain(list(range(1, 33))) == [8866452693264111234, 807986237951177663]


# --------------------------------------------------------------------------- seeds


def test_xxhash_without_seed_raises_with_fix() -> None:
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(HashSettingsError, match="PYTHONHASHSEED") as e:
            BlockHasher(HashSettings(algo=algo), 16)
        assert "hash.pythonhashseed" in str(e.value)
        assert "same PYTHONHASHSEED" in str(e.value)


def test_pythonhashseed_is_the_seed_for_every_algo() -> None:
    for algo in ALGOS:
        h = BlockHasher(HashSettings(algo=algo, pythonhashseed="42"), 16)
        assert none_hash_seed(h.settings) == "42"
        assert h.none_hash == oracle_hash(algo, "42")
    plain = BlockHasher(HashSettings(algo="sha256"), 16)
    seeded = BlockHasher(HashSettings(algo="sha256", pythonhashseed="0"), 16)
    assert plain.none_hash == oracle_hash("sha256", DEFAULT_NONE_HASH_SEED)
    assert seeded.none_hash != plain.none_hash
    toks = list(range(100, 164))
    assert seeded.wire_chain(toks) != plain.wire_chain(toks)


def test_an_empty_pythonhashseed_is_the_empty_seed() -> None:
    # PYTHONHASHSEED="" on the replicas: os.getenv gives "", which vLLM takes as the seed (not
    # as unset), so even the xxhash algos are reproducible and none uses the default seed
    for algo in ALGOS:
        h = BlockHasher(HashSettings(algo=algo, pythonhashseed=""), 16)
        assert none_hash_seed(h.settings) == ""
        assert h.none_hash == oracle_hash(algo, "")
        assert h.none_hash != oracle_hash(algo, DEFAULT_NONE_HASH_SEED)


def test_bad_settings_raise_typed_errors() -> None:
    with pytest.raises(HashSettingsError, match="prefix-caching-hash-algo"):
        BlockHasher(HashSettings(algo="md5"), 16)  # type: ignore[arg-type]
    for bad in (0, -16, 16.0):
        with pytest.raises(HashSettingsError, match="hash_block_size"):
            BlockHasher(HashSettings(), bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- oracle match

token_lists = st.lists(
    st.one_of(
        st.integers(0, 300),
        st.integers(0, 70_000),
        st.integers(0, 2**31 + 10),
        st.integers(0, 2**64 - 1),
    ),
    max_size=90,
)


@settings(max_examples=60, deadline=None)
@given(algo=st.sampled_from(ALGOS), tokens=token_lists, H=st.sampled_from([1, 2, 3, 4, 16]))
def test_chain_matches_naive_oracle(algo: str, tokens: list[int], H: int) -> None:
    s = settings_for(algo)
    h = BlockHasher(s, H, memo_entries=64, memo_span=3)
    want = oracle_chain(algo, none_hash_seed(s), tokens, H)
    assert h.digests(tokens) == want
    assert h.digests(tokens) == want  # second time from the memo
    assert BlockHasher(s, H, memo_entries=0).digests(tokens) == want


mm_items = st.lists(
    st.tuples(st.integers(0, 20), st.integers(1, 25), st.sampled_from(["img-a", "img-b"])),
    max_size=4,
).map(
    lambda specs: tuple(
        MMItem(identifier=ident, offset=off, length=ln) for off, ln, ident in _place(specs)
    )
)


def _place(specs: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    # Turn (gap, length, id) triples into sorted, non-overlapping placeholders.
    pos, out = 0, []
    for gap, length, ident in specs:
        out.append((pos + gap, length, ident))
        pos += gap + length
    return out


request_keys = st.builds(
    lambda lora, salt, mm, embeds: RequestKeys(
        lora_name=lora[0],
        lora_path=lora[1],
        cache_salt=salt,
        mm_items=mm,
        prompt_embeds_digests=embeds,
    ),
    st.sampled_from([(None, None), ("adapter-1", "/adapters/a1")]),
    st.sampled_from([None, "tenant-a", "ü-salt"]),
    mm_items,
    st.lists(st.binary(min_size=32, max_size=32), max_size=3).map(tuple),
)


@settings(max_examples=80, deadline=None)
@given(
    algo=st.sampled_from(ALGOS),
    tokens=st.lists(st.integers(0, 200_000), max_size=80),
    keys=request_keys,
    H=st.sampled_from([4, 16]),
)
def test_chain_with_extra_keys_matches_oracle(
    algo: str, tokens: list[int], keys: RequestKeys, H: int
) -> None:
    s = settings_for(algo)
    want = oracle_chain(algo, none_hash_seed(s), tokens, H, keys)
    h = BlockHasher(s, H, memo_entries=32, memo_span=2)
    assert h.digests(tokens, keys) == want
    assert h.digests(tokens, keys) == want
    for u in range(len(tokens) // H):
        assert keys.unit_extras(u, H) == oracle_extras(keys, u, H)


# --------------------------------------------------------------------------- chain property


@settings(max_examples=40, deadline=None)
@given(
    algo=st.sampled_from(ALGOS),
    tokens=st.lists(st.integers(0, 50_000), min_size=16, max_size=64),
    data=st.data(),
)
def test_each_hash_depends_on_every_earlier_token(
    algo: str, tokens: list[int], data: st.DataObject
) -> None:
    H = 4
    h = BlockHasher(settings_for(algo), H)
    pos = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[pos] += 1
    a, b = h.wire_chain(tokens), h.wire_chain(changed)
    for u in range(len(a)):
        if u < pos // H:
            assert a[u] == b[u]
        else:
            assert a[u] != b[u]


def test_algorithms_differ_and_are_deterministic() -> None:
    toks = list(range(5000, 5064))
    chains = {}
    for algo in ALGOS:
        one = BlockHasher(settings_for(algo), 16).wire_chain(toks)
        two = BlockHasher(settings_for(algo), 16, memo_entries=0).wire_chain(toks)
        assert one == two and len(one) == 4
        chains[algo] = tuple(one)
    assert len(set(chains.values())) == 4


# --------------------------------------------------------------------------- extra keys


def test_none_and_empty_tuple_extra_keys_differ() -> None:
    h = BlockHasher(HashSettings(), 16)
    toks = list(range(16))
    assert h.step(h.none_hash, toks, None) != h.step(h.none_hash, toks, ())
    assert h.step(h.none_hash, toks, None) == h.digests(toks)[0]
    assert RequestKeys().unit_extras(0, 16) is None
    assert h.digests(toks, RequestKeys()) == h.digests(toks)


def test_extra_key_order_matters() -> None:
    h = BlockHasher(HashSettings(), 16)
    toks = list(range(16))
    ab = (("lora", "n", "p"), ("cache_salt", "s"))
    assert h.step(h.none_hash, toks, ab) != h.step(h.none_hash, toks, ab[::-1])


def test_cache_salt_only_on_first_block() -> None:
    h = BlockHasher(HashSettings(), 16)
    keys = RequestKeys(cache_salt="tenant-a")
    toks = list(range(48))
    assert keys.unit_extras(0, 16) == (("cache_salt", "tenant-a"),)
    assert keys.unit_extras(1, 16) is None and keys.unit_extras(2, 16) is None
    d = h.digests(toks, keys)
    # later blocks carry no salt themselves; they differ only through the chain
    assert d[1] == h.step(d[0], toks[16:32], None)
    assert d[2] == h.step(d[1], toks[32:48], None)
    assert d[0] != h.digests(toks)[0]


def test_lora_on_every_block_and_path_matters() -> None:
    h = BlockHasher(HashSettings(), 16)
    keys = RequestKeys(lora_name="sql", lora_path="/lora/sql-v1")
    toks = list(range(64))
    for u in range(4):
        assert keys.unit_extras(u, 16) == (("lora", "sql", "/lora/sql-v1"),)
    d = h.digests(toks, keys)
    for u in range(1, 4):
        assert d[u] == h.step(
            d[u - 1], toks[u * 16 : u * 16 + 16], (("lora", "sql", "/lora/sql-v1"),)
        )
    other = RequestKeys(lora_name="sql", lora_path="/lora/sql-v2")
    assert h.digests(toks, other)[0] != d[0]


def test_mm_offsets_relative_to_block_start() -> None:
    keys = RequestKeys(
        lora_name="l",
        lora_path="/p",
        cache_salt="s",
        mm_items=(MMItem("img0", 10, 30), MMItem("img1", 40, 2)),
        prompt_embeds_digests=(b"\x01" * 32,),
    )
    assert keys.unit_extras(0, 16) == (
        ("lora", "l", "/p"),
        ("mm", "img0", 10),
        ("cache_salt", "s"),
        ("prompt_embeds", b"\x01" * 32),
    )
    assert keys.unit_extras(1, 16) == (("lora", "l", "/p"), ("mm", "img0", -6))
    assert keys.unit_extras(2, 16) == (
        ("lora", "l", "/p"),
        ("mm", "img0", -22),
        ("mm", "img1", 8),
    )
    assert keys.unit_extras(3, 16) == (("lora", "l", "/p"),)
    # an item ending exactly at a block boundary does not touch the next block
    edge = RequestKeys(mm_items=(MMItem("x", 0, 16),))
    assert edge.unit_extras(1, 16) is None


def test_prompt_embeds_digest_is_sha256_bytes() -> None:
    raw = bytes(range(256)) * 4
    assert prompt_embeds_digest(raw) == hashlib.sha256(raw).digest()
    assert len(prompt_embeds_digest(raw)) == 32


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_path": "/x"}, "lora_path"),
        ({"cache_salt": ""}, "None for no salt"),
        ({"mm_items": (MMItem("a", 10, 5), MMItem("b", 12, 5))}, "sorted"),
        ({"mm_items": (MMItem("a", 10, 5), MMItem("b", 2, 5))}, "sorted"),
        ({"mm_items": (MMItem("a", 3, 0),)}, "length"),
        ({"mm_items": (MMItem("a", -1, 3),)}, "offset"),
    ],
)
def test_request_keys_validation(kwargs: dict, fragment: str) -> None:
    with pytest.raises(RequestKeysError, match=fragment):
        RequestKeys(**kwargs)


# --------------------------------------------------------------------------- group views


def test_striding_reads_fine_hash_at_block_end() -> None:
    h = BlockHasher(HashSettings(), 16)
    toks = list(range(1000, 1000 + 16 * 9 + 5))
    fine = h.wire_chain(toks)
    assert len(fine) == 9
    assert block_hashes_at(fine, 16, 16) == fine
    assert block_hashes_at(fine, 32, 16) == [fine[1], fine[3], fine[5], fine[7]]
    assert block_hashes_at(fine, 48, 16) == [fine[2], fine[5], fine[8]]
    # vLLM 0.32 does not re-hash at B: a chain hashed at 32-token units is a different chain
    assert BlockHasher(HashSettings(), 32).wire_chain(toks)[:4] != block_hashes_at(fine, 32, 16)
    with pytest.raises(ValueError, match="multiple of hash_block_size"):
        block_hashes_at(fine, 24, 16)


def test_expected_stored_hashes_dense_group() -> None:
    h = BlockHasher(HashSettings(), 16)
    toks = list(range(7, 7 + 100))  # 6 units, 3 blocks of 32, 2 blocks of 48
    fine = h.wire_chain(toks)
    assert expected_stored_hashes(h, toks, 16) == fine
    assert expected_stored_hashes(h, toks, 32) == [fine[1], fine[3], fine[5]]
    assert expected_stored_hashes(h, toks, 48) == [fine[2], fine[5]]
    assert expected_stored_hashes(h, toks[:47], 48) == []
    keys = RequestKeys(cache_salt="t")
    salted = h.wire_chain(toks, keys)
    assert expected_stored_hashes(h, toks, 32, keys) == [salted[1], salted[3], salted[5]]
    with pytest.raises(ValueError, match="multiple"):
        expected_stored_hashes(h, toks, 40)


# --------------------------------------------------------------------------- wire forms


@pytest.mark.parametrize("algo", ALGOS)
def test_wire_forms(algo: str) -> None:
    toks = list(range(16 * 21))  # 21 units: wire ints are converted in bulk (>= 8 at once)
    ints = BlockHasher(settings_for(algo), 16, memo_entries=0)
    raw = BlockHasher(settings_for(algo, ints=False), 16)
    digests = ints.digests(toks)
    size = 32 if algo.startswith("sha256") else 16
    assert all(len(d) == size for d in digests)
    assert raw.wire_chain(toks) == digests
    wires = ints.wire_chain(toks)
    assert all(type(w) is int and 0 <= w <= U64 for w in wires)
    assert wires == [int.from_bytes(d, "big") & U64 for d in digests]
    assert wires == [to_wire(d, True) for d in digests] == [ints.to_wire(d) for d in digests]
    memo = BlockHasher(settings_for(algo), 16, memo_span=4)
    assert memo.wire_chain(toks) == wires == memo.wire_chain(toks)
    lazy = memo.lazy_chain(toks)
    assert [lazy.wire(i) for i in range(21)] == wires


# --------------------------------------------------------------------------- lazy chain


def test_lazy_chain_hashes_only_what_is_read() -> None:
    h = BlockHasher(HashSettings(), 16, memo_span=16)
    toks = list(range(32 * 1024))
    chain = h.lazy_chain(toks)
    assert len(chain) == 2048 and chain.hashed == 0
    eager = h.wire_chain(toks, limit=3)
    assert chain.wire(0) == eager[0] and chain.hashed == 1
    assert chain.wire(2) == eager[2] and chain.hashed == 3
    assert chain.digest(1) == h.digests(toks, limit=2)[1] and chain.hashed == 3
    assert chain.block_wire(0, 2) == eager[1]
    with pytest.raises(IndexError, match="2048 full units"):
        chain.wire(2048)
    with pytest.raises(IndexError):
        chain.wire(-1)


def test_lazy_chain_equals_eager_and_uses_memo() -> None:
    h = BlockHasher(HashSettings(), 16, memo_span=8)
    toks = list(range(3000))  # 187 units
    full = h.wire_chain(toks)
    assert len(full) == 187
    warm = h.lazy_chain(toks)
    assert warm.wire(0) == full[0]
    assert warm.hashed == 8  # the whole first step came from the memo
    assert [warm.wire(i) for i in range(187)] == full
    assert warm.wires() == full and warm.wires(5) == full[:5]
    walk = h.lazy_chain(toks).iter_block_wires(3, start=2)
    assert next(walk) == full[8]
    assert list(walk) == full[11::3]
    fresh = BlockHasher(HashSettings(), 16).lazy_chain(toks)
    for j, w in enumerate(fresh.iter_block_wires(2)):
        assert w == full[2 * j + 1]
        if j == 4:
            break
    # The walk read 10 units; geometric read-ahead may hash at most as many again (cap 64).
    assert 10 <= fresh.hashed <= 20
    first = BlockHasher(HashSettings(), 16).lazy_chain(toks)
    next(first.iter_block_wires(1))
    assert first.hashed == 1  # a walk that stops at once hashes one unit
    with pytest.raises(ValueError, match="k >= 1"):
        next(fresh.iter_block_wires(0))
    cold = BlockHasher(HashSettings(), 16, memo_entries=0).lazy_chain(toks)
    assert [cold.wire(i) for i in range(186, -1, -1)][::-1] == full


def test_short_prompts_and_limits() -> None:
    h = BlockHasher(HashSettings(), 16)
    assert h.digests([]) == [] and h.wire_chain(list(range(15))) == []
    assert len(h.lazy_chain(list(range(15)))) == 0
    toks = list(range(80))
    assert h.wire_chain(toks, limit=0) == []
    assert h.wire_chain(toks, limit=99) == h.wire_chain(toks)
    assert h.wire_chain(toks, limit=2) == h.wire_chain(toks)[:2]
    with pytest.raises(ValueError, match="limit"):
        h.digests(toks, limit=-1)


# --------------------------------------------------------------------------- memo


prompts = st.lists(st.integers(0, 5), min_size=1, max_size=8).flatmap(
    lambda shape: st.tuples(
        st.lists(st.integers(0, 1000), min_size=40, max_size=120),  # shared stem
        st.lists(
            st.tuples(
                st.integers(0, 120),  # cut the stem here
                st.lists(st.integers(0, 1000), max_size=40),  # then a tail
                st.integers(0, 40),  # lazy read depth
            ),
            min_size=len(shape),
            max_size=len(shape),
        ),
    )
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=prompts, span=st.sampled_from([1, 2, 3, 8]), cap=st.sampled_from([0, 4, 16, 1000]))
def test_memo_never_changes_results(
    case: tuple[list[int], list[tuple[int, list[int], int]]], span: int, cap: int
) -> None:
    stem, requests = case
    H = 4
    memo = BlockHasher(HashSettings(), H, memo_entries=cap, memo_span=span)
    plain = BlockHasher(HashSettings(), H, memo_entries=0)
    for cut, tail, depth in requests:
        toks = stem[:cut] + tail
        want = plain.wire_chain(toks)
        lazy = memo.lazy_chain(toks)
        read = min(depth, len(lazy))
        assert [lazy.wire(i) for i in range(read)] == want[:read]
        assert memo.wire_chain(toks) == want
        assert memo.memo_stats["steps"] <= cap // span


def test_memo_bound_respected_and_hits_counted() -> None:
    h = BlockHasher(HashSettings(), 16, memo_entries=64, memo_span=4)  # 16 steps
    assert h.memo_stats["capacity"] == 16
    for r in range(50):
        h.wire_chain([r] * 16 * 12)  # 3 steps each
        assert h.memo_stats["steps"] <= 16
    toks = list(range(16 * 12))
    h.wire_chain(toks)
    before = h.memo_stats["hits"]
    h.wire_chain(toks)
    assert h.memo_stats["hits"] == before + 3
    h.clear_memo()
    assert h.memo_stats["steps"] == 0


def test_memo_survives_recent_use_across_generations() -> None:
    h = BlockHasher(HashSettings(), 16, memo_entries=8, memo_span=1)  # 8 steps, young half 4
    hot = list(range(16))
    h.wire_chain(hot)
    for r in range(40):
        h.wire_chain([10_000 + r] * 16)
        hits = h.memo_stats["hits"]
        h.wire_chain(hot)  # used every other insertion: never dropped
        assert h.memo_stats["hits"] == hits + 1


# --------------------------------------------------------------------------- CBOR bytes

cbor_leaf = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),
    st.integers(0, 2**64 - 1),
    st.integers(-(2**64), -1),
    st.binary(max_size=300),
    st.text(max_size=40),
)
cbor_obj = st.recursive(
    cbor_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=30).map(tuple), st.lists(inner, max_size=30)),
    max_leaves=60,
)


def test_cbor2_is_the_c_extension() -> None:
    # cbor2 6.x ships only the C encoder (cbor2._cbor2); a pure-Python cbor2 (5.x built
    # without its extension, or a stand-in package) would make the *_cbor algos ~5x slower.
    assert inspect.isbuiltin(cbor2.dumps), cbor2.dumps
    assert cbor2.dumps.__module__ == "cbor2._cbor2"


@settings(max_examples=200, deadline=None)
@given(
    parent=st.sampled_from([16, 32]).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
    tokens=st.lists(
        st.one_of(st.integers(0, 2**17), st.integers(0, 2**64 + 5), st.integers(-5, -1)),
        min_size=1,
        max_size=300,
    ),
    extras=st.one_of(st.none(), cbor_obj),
)
def test_cbor_block_bytes_identical_to_cbor2(
    parent: bytes, tokens: list[int], extras: object
) -> None:
    h = BlockHasher(HashSettings(algo="sha256_cbor"), len(tokens))
    want = hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extras), canonical=True)).digest()
    assert h.step(parent, tokens, extras) == want
    assert h.step(parent, tuple(tokens), extras) == want
