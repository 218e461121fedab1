"""The compiled hash chain (events/_chain.c) against the pure-Python chain, byte for byte.

The pure chain is the reference (tests/test_hashing.py checks it against spec §1 and a naive
oracle); here every algorithm, seed, token range, extra key, wire form and read pattern must
give the same digests from both. Also: the fallback when the extension is missing or switched
off, a build without a compiler, and hostile callers of the C entry point.

``KVROUTER_REQUIRE_NATIVE=1`` (set by .ci/run) turns "extension not built" from a skip into a
failure, so CI proves the README's install builds it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import shutil
import subprocess
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import hashing
from events.hashing import (
    NATIVE_ENV,
    BlockHasher,
    RequestKeys,
    native_hashing,
    none_hash_seed,
)
from events.layout import HashSettings
from tests.test_hashing import mm_items

ROOT = Path(__file__).resolve().parent.parent
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
REQUIRED = os.environ.get("KVROUTER_REQUIRE_NATIVE", "") == "1"

try:
    from events import _chain  # type: ignore[attr-defined]
except ImportError:  # not built: skip, unless CI requires it
    _chain = None


@pytest.fixture(autouse=True)
def _need_native(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("without_native") is not None:
        return
    if _chain is None or hashing._NATIVE is None:
        if REQUIRED:
            pytest.fail(
                "KVROUTER_REQUIRE_NATIVE=1 but events._chain is not in use: the extension did "
                f"not build (see pip's output) or {NATIVE_ENV}=0 is set"
            )
        pytest.skip("events._chain not built (no C compiler at install time?)")


without_native = pytest.mark.without_native


def hashers(algo: str, seed: str | None, H: int, ints: bool, memo: int) -> tuple[Any, Any]:
    s = HashSettings(algo=algo, pythonhashseed=seed, int_block_hashes=ints)
    kw = {"memo_entries": memo, "memo_span": 3}
    fast, pure = BlockHasher(s, H, **kw), BlockHasher(s, H, native=False, **kw)
    assert fast.native and not pure.native
    return fast, pure


# --------------------------------------------------------------------------- in use


@without_native
def test_native_extension_in_use_when_required() -> None:
    """CI (.ci/run sets KVROUTER_REQUIRE_NATIVE=1) must hash with the extension."""
    if not REQUIRED:
        pytest.skip("KVROUTER_REQUIRE_NATIVE is not set")
    assert native_hashing() is not None and native_hashing().startswith("events._chain (")
    assert BlockHasher(HashSettings(), 16).native


# --------------------------------------------------------------------------- SHA-256


@pytest.fixture
def each_sha_impl() -> Iterator[list[str]]:
    """The SHA-256 code this CPU can run (SHA-NI or none); the default is restored afterwards."""
    default = _chain.sha_impl()
    impls = ["sha-ni"] if _chain._use_sha("sha-ni") == "sha-ni" else []
    _chain._use_sha(default)
    if not impls:
        pytest.skip("no SHA-NI on this CPU: the extension has no SHA-256 code of its own")
    try:
        yield impls
    finally:
        _chain._use_sha(default)


def test_sha256_equals_hashlib_at_every_padding_boundary(each_sha_impl: list[str]) -> None:
    rng = random.Random(7)
    datas = [rng.randbytes(n) for n in range(300)] + [rng.randbytes(5000), b"\xff" * 1000]
    for impl in each_sha_impl:
        assert _chain._use_sha(impl) == impl
        for d in datas:
            assert _chain.sha256(d) == hashlib.sha256(d).digest(), (impl, len(d))


def test_chain_equal_with_each_sha_impl(each_sha_impl: list[str]) -> None:
    rng = random.Random(8)
    tokens = [rng.randrange(200_000) for _ in range(16 * 40)]
    want = BlockHasher(HashSettings(), 16, native=False).digests(tokens)
    none_hash = BlockHasher(HashSettings(), 16).none_hash
    for impl in each_sha_impl:
        _chain._use_sha(impl)
        got, _ = _call(parent=none_hash, toks=tokens, H=16, stop=40)
        assert got == want, impl


def test_without_sha_ni_hashlib_digests_each_block(each_sha_impl: list[str]) -> None:
    """No SHA-NI: the C serializer hands each block to hashlib (OpenSSL's assembly)."""
    tokens = list(range(100_000, 100_000 + 16 * 20))
    want = BlockHasher(HashSettings(), 16, native=False).digests(tokens)
    _chain._use_sha("none")
    with pytest.raises(RuntimeError, match="SHA-NI"):
        _chain.sha256(b"x")  # no SHA-256 of its own: never a NULL call
    with pytest.raises(RuntimeError, match="SHA-NI"):
        _call(toks=tokens, H=16, stop=2)
    h = BlockHasher(HashSettings(), 16, memo_entries=0)
    assert h._extend.args[2] is hashing._sha256
    assert native_hashing() == "events._chain (sha256 by hashlib)"
    assert h.digests(tokens) == want


def test_sha_ni_chosen_when_the_cpu_has_it() -> None:
    """The 2x of SHA-NI over hashlib per block is the point on x86: losing it silently is a
    bug."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or " sha_ni" not in cpuinfo.read_text():
        pytest.skip("no SHA-NI on this CPU (or not Linux)")
    assert _chain.sha_impl() == "sha-ni"
    assert native_hashing() == "events._chain (sha-ni)"
    assert BlockHasher(HashSettings(), 16)._extend.args[2] is None  # digest computed in C


def test_unknown_sha_impl_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown SHA-256"):
        _chain._use_sha("md5")


# --------------------------------------------------------------------------- properties

# Every pickle/CBOR integer encoding and each side of its bounds: BININT1/2/4, LONG1, CBOR's
# 1/2/4/8-byte heads, past 2**64, negatives (never token ids, but they must not hash wrong).
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32]
EDGES += [2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -1, -24, -25, -(2**31), -(2**31) - 1]
token = st.one_of(
    st.integers(0, 255),
    st.integers(256, 65535),
    st.integers(65536, 2**31 - 1),
    st.integers(0, 200_000),
    st.sampled_from(EDGES),
)


request_keys = st.one_of(
    st.none(),
    st.builds(
        lambda lora, salt, mm, embeds: RequestKeys(
            lora_name=lora[0],
            lora_path=lora[1],
            cache_salt=salt,
            mm_items=mm,
            prompt_embeds_digests=embeds,
        ),
        st.sampled_from([(None, None), ("adapter-1", "/adapters/a1"), ("ü", "ü")]),
        st.sampled_from([None, "tenant-a", "ü-salt", "x" * 300]),
        mm_items,
        st.lists(st.binary(min_size=32, max_size=32), max_size=3).map(tuple),
    ),
)


@st.composite
def algo_and_seed(draw: st.DrawFn) -> tuple[str, str | None]:
    algo = draw(st.sampled_from(ALGOS))
    seed = draw(st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(["0", "ü" * 200])))
    if algo.startswith("sha256") and draw(st.booleans()):
        seed = None  # vLLM's "vllm-none-hash" default
    return algo, seed


@settings(max_examples=300, deadline=None)
@given(
    algo_seed=algo_and_seed(),
    tokens=st.lists(token, max_size=120),
    H=st.sampled_from([1, 2, 3, 4, 5, 16, 17]),
    ints=st.booleans(),
    keys=request_keys,
)
def test_native_equals_pure_byte_for_byte(
    algo_seed: tuple[str, str | None],
    tokens: list[int],
    H: int,
    ints: bool,
    keys: RequestKeys | None,
) -> None:
    algo, seed = algo_seed
    fast, pure = hashers(algo, seed, H, ints, memo=0)
    assert fast.none_hash == pure.none_hash
    want = pure.digests(tokens, keys)
    assert fast.digests(tokens, keys) == want
    assert fast.wire_chain(tokens, keys) == pure.wire_chain(tokens, keys)
    # tuples, and sequences the C code reads through slices, give the same chain
    assert fast.digests(tuple(tokens), keys) == want
    if all(0 <= t < 2**32 for t in tokens):
        assert fast.digests(array("I", tokens), keys) == want


@settings(max_examples=150, deadline=None)
@given(
    algo_seed=algo_and_seed(),
    tokens=st.lists(st.integers(0, 200_000), min_size=1, max_size=200),
    H=st.sampled_from([1, 4, 16]),
    keys=request_keys,
    data=st.data(),
)
def test_lazy_reads_in_any_order_equal_pure(
    algo_seed: tuple[str, str | None],
    tokens: list[int],
    H: int,
    keys: RequestKeys | None,
    data: st.DataObject,
) -> None:
    """Many small extends (start > 0, memo hits in between) give the eager pure chain."""
    algo, seed = algo_seed
    fast, pure = hashers(algo, seed, H, True, memo=64)
    want = pure.wire_chain(tokens, keys)
    for _ in range(2):  # the second pass reads through the memo
        chain = fast.lazy_chain(tokens, keys)
        if not want:
            assert len(chain) == 0
            continue
        reads = data.draw(st.lists(st.integers(0, len(want) - 1), max_size=8))
        for i in reads:
            assert chain.wire(i) == want[i]
        assert chain.wires() == want


@settings(max_examples=150, deadline=None)
@given(
    bases=st.lists(st.lists(st.integers(0, 9), min_size=10, max_size=60), min_size=1, max_size=3),
    prompts=st.lists(
        st.tuples(
            st.integers(0, 2),  # which base prompt: repeated prefixes hit the memo
            st.integers(0, 60),  # cut there
            st.lists(st.sampled_from([0, 1, 5, 2**32]), max_size=4),  # a tail, 2**32: no key
            st.integers(0, 25),  # how far the lazy read goes
            st.booleans(),  # eager (wires()) or a walk (wire_runs)
        ),
        max_size=12,
    ),
    memo=st.sampled_from([6, 12, 30]),
)
def test_memo_lookups_in_c_are_the_python_lookups(
    bases: list[list[int]], prompts: list, memo: int
) -> None:
    """LazyChain.extend's memo lookups (events._chain.memo_steps for the young generation)
    leave the memo as the Python lookups do: the same wires, as far hashed, the same hits,
    misses and steps held, through generation turnover (a memo of 2-10 steps of 3)."""
    fast, pure = hashers("sha256", None, 2, True, memo=memo)
    for which, cut, tail, read, eager in prompts:
        toks = bases[which % len(bases)][:cut] + tail
        chains = [h.lazy_chain(toks) for h in (fast, pure)]
        for chain in chains:
            if eager:
                chain.wires()
            else:
                for _wires, i in chain.wire_runs(1):
                    if i >= read:
                        break
        a, b = chains
        assert a.hashed == b.hashed
        assert a.wires(a.hashed) == b.wires(b.hashed)
        assert fast.memo_stats == pure.memo_stats


def test_token_key_is_the_pure_memo_key() -> None:
    """The memo key the C code builds is array('I') bytes, or None where pure keys otherwise."""
    ok = [0, 1, 255, 65536, 2**31, 2**32 - 1, 150_000]
    for toks in (ok, tuple(ok)):
        for a, b in ((0, 7), (2, 5), (3, 3)):
            assert _chain.token_key(toks, a, b) == array("I", ok[a:b]).tobytes()
    for bad in ([1, 2**32], [1, -1], [1, True], [1, 2.0]):
        assert _chain.token_key(bad, 0, 2) is None
        assert _chain.token_key(bad, 0, 1) is not None
    assert _chain.token_key(array("I", ok), 0, 2) is None  # not a list or tuple
    assert _chain.token_key(ok, 0, 8) is None  # past the end
    assert _chain.token_key(ok, 3, 2) is None


def test_bools_and_big_tokens_hash_like_pure() -> None:
    """A bool pickles differently from an int: the C code must not serialize it as one
    (vLLM's ids are ints; anything else must still hash like the pure path)."""

    tokens: list[Any] = [True, False, 1, 0, 5, 3, 2**40, 7] * 3
    for algo in ALGOS:
        fast, pure = hashers(algo, "0", 4, True, memo=0)
        assert fast.digests(tokens) == pure.digests(tokens), algo
        assert fast.digests(tokens)[0] != fast.digests([1, 0, 1, 0, *tokens[4:]])[0]


def test_list_subclass_is_read_through_its_slicing() -> None:
    class Shifted(list):
        def __getitem__(self, i: Any) -> Any:
            got = super().__getitem__(i)
            return [t + 1 for t in got] if isinstance(i, slice) else got + 1

    tokens = Shifted(range(64))
    for algo in ALGOS:
        fast, pure = hashers(algo, "0", 16, True, memo=0)
        assert fast.digests(tokens) == pure.digests(tokens)
        assert fast.digests(tokens) == pure.digests(list(range(1, 65)))


def test_default_sha256_cold_chain_matches_vllm_call() -> None:
    """The default configuration, computed the way vLLM does it, with no kvrouter code."""
    rng = random.Random(3)
    tokens = [rng.randrange(150_000) for _ in range(16 * 64)]
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash", 5)).digest()
    want = []
    for a in range(0, len(tokens), 16):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[a : a + 16]), None), 5))
        parent = parent.digest()
        want.append(int.from_bytes(parent[-8:], "big"))
    h = BlockHasher(HashSettings(), 16, memo_entries=0)
    assert none_hash_seed(h.settings) == "vllm-none-hash"
    assert h.wire_chain(tokens) == want


# --------------------------------------------------------------------------- hostile callers


def _call(**over: Any) -> tuple[list[bytes], list[Any]]:
    args: dict[str, Any] = {
        "serial": 0,
        "block_fn": lambda p, t, e: pickle.dumps((p, tuple(t), e), 5),
        "digest_fn": None,
        "parent": b"p" * 32,
        "toks": list(range(32)),
        "H": 4,
        "start": 0,
        "stop": 8,
        "ex": None,
        "digests": [],
        "wires": [],
        "ints": True,
    }
    args.update(over)
    _chain.extend(*args.values())
    return args["digests"], args["wires"]


def test_extend_refuses_bad_arguments() -> None:
    for over in ({"serial": 2}, {"H": 0}, {"start": -1}, {"parent": "str"}, {"digests": ()}):
        with pytest.raises(ValueError, match="extend"):
            _call(**over)
    with pytest.raises(TypeError, match="12 arguments"):
        _chain.extend(0, None)


def test_errors_from_callbacks_propagate() -> None:
    def bad_extras(u: int) -> Any:
        if u == 3:
            raise RuntimeError("extras exploded")
        return None

    digests: list[bytes] = []
    with pytest.raises(RuntimeError, match="extras exploded"):
        _call(ex=bad_extras, digests=digests)
    assert len(digests) == 3  # the units before the failure, in order
    with pytest.raises(TypeError, match="serializer must return bytes"):
        _call(ex=lambda u: ("x",), block_fn=lambda p, t, e: "not bytes")
    with pytest.raises(TypeError, match="digest function must return bytes"):
        _call(digest_fn=lambda b: 42)


def test_token_list_shrunk_by_a_callback_does_not_crash() -> None:
    """The C code re-reads the list's size after every Python callback."""
    toks = list(range(32))

    def shrink(u: int) -> None:
        del toks[8:]
        return None

    digests, _ = _call(toks=toks, ex=shrink)
    assert len(digests) == 8  # short blocks hash their (shorter) slices, as pure slicing does


# --------------------------------------------------------------------------- fallback


def _run_child(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != NATIVE_ENV} | env
    full["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


CHILD = """
import sys
{prelude}
from events.hashing import BlockHasher, native_hashing
from events.layout import HashSettings
from tests.test_hashing import mm_items
h = BlockHasher(HashSettings(), 16, memo_entries=0)
print(native_hashing(), h.native, h.wire_chain(list(range(1000, 1160)))[-1],
      "torch" in sys.modules)
"""


@without_native
@pytest.mark.parametrize(
    ("prelude", "env"),
    [
        ("", {NATIVE_ENV: "0"}),
        ("sys.modules['events._chain'] = None  # as if it never built", {}),
    ],
    ids=["switched-off", "not-built"],
)
def test_pure_fallback_when_extension_missing_or_off(prelude: str, env: dict[str, str]) -> None:
    want = BlockHasher(HashSettings(), 16, native=False).wire_chain(list(range(1000, 1160)))[-1]
    got = _run_child(CHILD.format(prelude=prelude), **env)
    assert got == f"None False {want} False"


@without_native
@pytest.mark.parametrize("cc", ["false", "/nonexistent/cc"], ids=["compile-fails", "no-compiler"])
def test_build_without_compiler_installs_pure(tmp_path: Path, cc: str) -> None:
    """setup.py's extension is optional: a failed compile is a warning, not a failed build."""
    sources = ("events/_chain.c", "router/core/_keytable.c")
    for name in ("setup.py", "pyproject.toml", "README.md", *sources):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    out = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tmp_path,
        env=dict(os.environ, CC=cc, LDSHARED=cc),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert 'building extension "events._chain" failed' in out.stdout + out.stderr
    assert 'building extension "router.core._keytable" failed' in out.stdout + out.stderr
    assert not list(tmp_path.rglob("*.so"))
