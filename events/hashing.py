"""vLLM 0.32's prefix-cache block hash chain, recomputed from token ids (spec §1).

The router never trusts a parent hash from an event (with 64-bit wire hashes the chain cannot
be extended from one, spec §0.2), so it computes each request's chain itself and looks the
wire values up in the index. The chain is kept at ``hash_block_size`` H granularity (the
"fine chain", §1.4); a group with block size ``B = k*H`` reads its block ``j`` as fine hash
``(j+1)*k - 1`` -- vLLM 0.32 does not re-hash at B.

Two costs shape this module:

- A novel prompt must cost one or two block hashes, because the router stops at the first
  full-attention miss on every replica. :class:`LazyChain` therefore hashes on demand.
- A repeated prefix (system prompt, multi-turn history) must be nearly free. A bounded memo
  of *chain steps* maps ``(parent digest, tokens of up to K units, their extra keys)`` to the
  K digests and wire values that follow. A step is deterministic in its key, so a memo hit is
  exact, never an approximation. See :class:`BlockHasher` for the bound.

Serialized bytes are always made by the call vLLM makes, so they cannot drift from it:
``pickle.dumps(obj, protocol=5)`` for the pickle algorithms (hand-built pickle was measured
and was not faster) and ``cbor2.dumps(obj, canonical=True)`` for the CBOR ones. cbor2 6.x is
a C extension only (``cbor2._cbor2``, no pure-Python encoder to fall back to). A hand-built
canonical encoder for the block shape lived here while cbor2 was pure Python (about 7 us per
block); against the C cbor2 it was no faster on a cold 32k-token chain (sha256_cbor about
2.3 us per H=16 block either way, hashing included; ``bench/hashing_bench.py --baseline-rev``
times both interleaved), so it was removed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cbor2
import msgspec
import xxhash

from events.layout import HashSettings

__all__ = [
    "DEFAULT_MEMO_ENTRIES",
    "DEFAULT_NONE_HASH_SEED",
    "MEMO_SPAN",
    "BlockHasher",
    "HashSettingsError",
    "LazyChain",
    "MMItem",
    "RequestKeys",
    "RequestKeysError",
    "block_hashes_at",
    "expected_stored_hashes",
    "native_chain",
    "native_hashing",
    "none_hash_seed",
    "prompt_embeds_digest",
    "serializer_for",
    "to_wire",
]

#: vLLM's seed for sha256/sha256_cbor when ``PYTHONHASHSEED`` is unset (spec §1.2).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: Fine hashes per memo step (K). 16 units of H=16 are 256 tokens: a 32k prompt is 128
#: lookups, and a prefix that diverges inside a step re-hashes at most K-1 units.
MEMO_SPAN = 16
#: Default bound on the fine hashes the memo holds: 2M tokens of prefixes at H=16, about
#: 26 MB (measured ~200 bytes per memoized fine hash with sha256 and int wire hashes).
DEFAULT_MEMO_ENTRIES = 1 << 17

_U64 = (1 << 64) - 1
_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


class HashSettingsError(ValueError):
    """Hash settings with which kvrouter cannot reproduce the replicas' hashes."""


class RequestKeysError(ValueError):
    """Per-request extra keys that vLLM would never produce for a request."""


# --------------------------------------------------------------------------- extra keys


class MMItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One multimodal placeholder of a request (spec §1.3)."""

    identifier: str
    """vLLM's mm identifier: the processed item's mm hash, or the user-supplied uuid."""
    offset: int
    """First token position of the placeholder in the request."""
    length: int
    """Number of placeholder tokens."""


class RequestKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What besides the token ids enters a request's block hashes (spec §1.3).

    ``prompt_embeds_digests[i]`` is the SHA-256 digest (32 raw bytes, see
    :func:`prompt_embeds_digest`) of the embedding bytes of fine unit ``i`` (tokens
    ``i*H .. (i+1)*H``). It is taken precomputed because only the caller holds the tensor;
    units past its end get no prompt-embeds key.
    """

    lora_name: str | None = None
    lora_path: str | None = None
    """The adapter path as registered on the replica: it is part of the hash (§1.3, §5.1)."""
    cache_salt: str | None = None
    mm_items: tuple[MMItem, ...] = ()
    """Placeholders in position order, non-overlapping (as vLLM orders them)."""
    prompt_embeds_digests: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if (self.lora_name is None) != (self.lora_path is None):
            raise RequestKeysError(
                "lora_name and lora_path go together: vLLM hashes ('lora', name, path); "
                "give both (the path as registered on the replica) or neither"
            )
        if self.cache_salt == "":
            raise RequestKeysError("cache_salt is empty: vLLM rejects it; use None for no salt")
        prev_end = 0
        for item in self.mm_items:
            if item.length < 1 or item.offset < 0:
                raise RequestKeysError(
                    f"mm item {item.identifier!r}: offset must be >= 0 and length >= 1 "
                    f"(got offset={item.offset}, length={item.length})"
                )
            if item.offset < prev_end:
                raise RequestKeysError(
                    "mm_items must be sorted by offset and must not overlap, as vLLM's "
                    f"placeholders are; item {item.identifier!r} at {item.offset} is not"
                )
            prev_end = item.offset + item.length

    @property
    def empty(self) -> bool:
        """No extra key on any block: every block hashes with ``extra_keys = None``."""
        return (
            self.lora_name is None
            and self.cache_salt is None
            and not self.mm_items
            and not self.prompt_embeds_digests
        )

    def unit_extras(self, unit: int, hash_block_size: int) -> tuple[Any, ...] | None:
        """``extra_keys`` of fine unit ``unit``: None when empty, never ``()`` (§1.3)."""
        return _ExtrasFn(self, hash_block_size)(unit)


class _ExtrasFn:
    """Per-request precomputation so each unit's extra keys cost O(log items)."""

    __slots__ = ("_embeds", "_ends", "_h", "_items", "_lora", "_offsets", "_salt")

    def __init__(self, keys: RequestKeys, hash_block_size: int) -> None:
        self._h = hash_block_size
        self._lora = (
            (("lora", keys.lora_name, keys.lora_path),) if keys.lora_name is not None else ()
        )
        self._items = keys.mm_items
        self._offsets = [m.offset for m in keys.mm_items]
        self._ends = [m.offset + m.length for m in keys.mm_items]
        self._salt = ("cache_salt", keys.cache_salt) if keys.cache_salt is not None else None
        self._embeds = keys.prompt_embeds_digests

    def __call__(self, unit: int) -> tuple[Any, ...] | None:
        start = unit * self._h
        end = start + self._h
        # Order of §1.3: LoRA, overlapping mm items, cache salt (first block only), embeds.
        parts: list[Any] = list(self._lora)
        if self._items:
            lo = bisect_right(self._ends, start)  # first item ending after `start`
            hi = bisect_left(self._offsets, end)  # first item starting at/after `end`
            parts.extend(("mm", m.identifier, m.offset - start) for m in self._items[lo:hi])
        if start == 0 and self._salt is not None:
            parts.append(self._salt)
        if unit < len(self._embeds):
            parts.append(("prompt_embeds", self._embeds[unit]))
        return tuple(parts) if parts else None


def prompt_embeds_digest(raw_embedding_bytes: bytes) -> bytes:
    """The digest vLLM puts in a unit's prompt-embeds key: SHA-256 of the raw tensor bytes."""
    return hashlib.sha256(raw_embedding_bytes).digest()


# --------------------------------------------------------------------------- serializers


def _cbor_obj(obj: object) -> bytes:
    # Exactly vLLM's serialization for the *_cbor algos (vllm/utils/hashing.py).
    return cbor2.dumps(obj, canonical=True)


def _cbor_block(parent: bytes, tokens: Sequence[int], extras: object) -> bytes:
    return cbor2.dumps((parent, tuple(tokens), extras), canonical=True)


def _pickle_obj(obj: object) -> bytes:
    return pickle.dumps(obj, 5)


def _pickle_block(parent: bytes, tokens: Sequence[int], extras: object) -> bytes:
    return pickle.dumps((parent, tuple(tokens), extras), 5)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


#: algo -> (serialize an object, serialize a block 3-tuple, digest function)
_ALGO_PARTS: dict[
    str,
    tuple[
        Callable[[object], bytes],
        Callable[[bytes, Sequence[int], object], bytes],
        Callable[[bytes], bytes],
    ],
] = {
    "sha256": (_pickle_obj, _pickle_block, _sha256),
    "sha256_cbor": (_cbor_obj, _cbor_block, _sha256),
    "xxhash": (_pickle_obj, _pickle_block, xxhash.xxh3_128_digest),
    "xxhash_cbor": (_cbor_obj, _cbor_block, xxhash.xxh3_128_digest),
}


# Chain runners: hash units [start, stop) after `parent`, return their digests. The pickle
# ones are written out with the calls inlined: per-block Python overhead is most of the cost.
_Runner = Callable[
    [bytes, Sequence[int], int, int, int, "Callable[[int], Any] | None"], list[bytes]
]


def _run_pickle_sha256(
    p: bytes, toks: Sequence[int], H: int, start: int, stop: int, ex: Any
) -> list[bytes]:
    dumps = pickle.dumps
    sha = hashlib.sha256
    out: list[bytes] = []
    append = out.append
    if ex is None:
        for a in range(start * H, stop * H, H):
            p = sha(dumps((p, tuple(toks[a : a + H]), None), 5)).digest()
            append(p)
    else:
        for u in range(start, stop):
            a = u * H
            p = sha(dumps((p, tuple(toks[a : a + H]), ex(u)), 5)).digest()
            append(p)
    return out


def _run_pickle_xxh(
    p: bytes, toks: Sequence[int], H: int, start: int, stop: int, ex: Any
) -> list[bytes]:
    dumps = pickle.dumps
    xxh = xxhash.xxh3_128_digest
    out: list[bytes] = []
    append = out.append
    if ex is None:
        for a in range(start * H, stop * H, H):
            p = xxh(dumps((p, tuple(toks[a : a + H]), None), 5))
            append(p)
    else:
        for u in range(start, stop):
            a = u * H
            p = xxh(dumps((p, tuple(toks[a : a + H]), ex(u)), 5))
            append(p)
    return out


def _cbor_runner(digest: Callable[[bytes], bytes]) -> _Runner:
    def run(p: bytes, toks: Sequence[int], H: int, start: int, stop: int, ex: Any) -> list[bytes]:
        dumps = cbor2.dumps
        out: list[bytes] = []
        append = out.append
        for u in range(start, stop):
            a = u * H
            extras = None if ex is None else ex(u)
            p = digest(dumps((p, tuple(toks[a : a + H]), extras), canonical=True))
            append(p)
        return out

    return run


_RUNNERS: dict[str, _Runner] = {
    "sha256": _run_pickle_sha256,
    "sha256_cbor": _cbor_runner(_sha256),
    "xxhash": _run_pickle_xxh,
    "xxhash_cbor": _cbor_runner(xxhash.xxh3_128_digest),
}

# Extenders: hash units [start, stop) after `parent`, appending digests and wire values to the
# chain's two lists. The pure ones wrap the runners above; the native one is events/_chain.c.
_Extender = Callable[
    [bytes, Sequence[int], int, int, int, "Callable[[int], Any] | None", list, list, bool], None
]


def _pure_extender(run: _Runner) -> _Extender:
    def extend(
        p: bytes,
        toks: Sequence[int],
        H: int,
        start: int,
        stop: int,
        ex: Any,
        digests: list[bytes],
        wires: list[Any],
        ints: bool,
    ) -> None:
        new = run(p, toks, H, start, stop, ex)
        digests += new
        wires += _wires_of(new) if ints else new

    return extend


_PURE_EXTENDERS: dict[str, _Extender] = {a: _pure_extender(r) for a, r in _RUNNERS.items()}

#: Set to "0" to run the pure-Python chain even where the extension is built.
NATIVE_ENV = "KVROUTER_NATIVE_HASHING"


def _load_native() -> Any:
    """``events._chain`` when it was built and is not switched off; else None.

    The extension is optional at build time (setup.py): a machine without a C compiler
    installs and runs kvrouter on the pure-Python chain, which computes the same bytes.
    """
    if os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from events import _chain  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _chain


_NATIVE = _load_native()
#: ``events._chain.memo_steps``: LazyChain.extend's memo lookups in C (None: in Python).
_NATIVE_STEPS: Callable[..., int] | None = getattr(_NATIVE, "memo_steps", None)


def native_chain() -> Any:
    """The module ``events._chain`` when it is in use (built, and not switched off with
    ``KVROUTER_NATIVE_HASHING=0``), else None: for the router's other token hashing in C
    (router.core.affinity's chunk keys)."""
    return _NATIVE


def native_hashing() -> str | None:
    """The compiled chain in use, e.g. ``"events._chain (sha-ni)"``; None: pure Python only.

    Operators see why a router hashes slower than the docs say (no compiler at install
    time, or ``KVROUTER_NATIVE_HASHING=0``); CI asserts the extension is in use.
    """
    if _NATIVE is None:
        return None
    impl = _NATIVE.sha_impl()
    return f"events._chain ({'sha-ni' if impl == 'sha-ni' else 'sha256 by hashlib'})"


def _native_extender(algo: str) -> _Extender | None:
    """The C chain for ``algo``: it serializes the common blocks itself (no extra keys, token
    ids that are plain ints in range) and hands every other block to the pure serializer, so
    its output is the pure path's byte for byte (tests/test_native_hashing.py)."""
    if _NATIVE is None:
        return None
    serial = 1 if algo.endswith("_cbor") else 0
    digest: Callable[[bytes], bytes] | None = _ALGO_PARTS[algo][2]
    if digest is _sha256 and _NATIVE.sha_impl() == "sha-ni":
        digest = None  # SHA-256 in C: 4x cheaper than a call into hashlib per block
    # Without SHA-NI, hashlib (OpenSSL's assembly, ARMv8 SHA instructions included) is
    # called back per block (the extension has no SHA-256 code but SHA-NI's).
    return functools.partial(_NATIVE.extend, serial, _ALGO_PARTS[algo][1], digest)


_LITTLE_ENDIAN = sys.byteorder == "little"


def _wires_of(digests: list[bytes]) -> list[int]:
    """Wire ints of many digests at once (spec §1.5: low 8 bytes, big-endian).

    Reversing the joined digests turns each digest's big-endian tail into a native
    little-endian word, so one cast converts them all; per-digest int.from_bytes costs
    more than the hashing it follows.
    """
    if len(digests) < 8 or not _LITTLE_ENDIAN:
        return [int.from_bytes(d[-8:], "big") for d in digests]
    words = memoryview(b"".join(digests)[::-1]).cast("Q")
    return words[:: len(digests[0]) // 8].tolist()[::-1]


def serializer_for(algo: str) -> Callable[[object], bytes]:
    """The byte serialization ``algo`` hashes (spec §1.1 table)."""
    return _ALGO_PARTS[_check_algo(algo)][0]


def _check_algo(algo: str) -> str:
    if algo not in _ALGO_PARTS:
        raise HashSettingsError(
            f"unknown hash algo {algo!r}: set hash.algo to the replicas' "
            f"--prefix-caching-hash-algo, one of {', '.join(_ALGOS)}"
        )
    return algo


def none_hash_seed(settings: HashSettings) -> str:
    """The seed string of NONE_HASH as vLLM chooses it (spec §1.2)."""
    algo = _check_algo(settings.algo)
    seed = settings.pythonhashseed
    if seed is not None:
        # set but empty is still set: vLLM reads os.getenv("PYTHONHASHSEED") and seeds with
        # "" (resolve_none_hash_seed), for every algo, the non-cryptographic ones included
        return seed
    if algo.startswith("sha256"):
        return DEFAULT_NONE_HASH_SEED
    raise HashSettingsError(
        f"hash algo {algo!r} without PYTHONHASHSEED seeds NONE_HASH with random bytes in "
        "every vLLM engine-core process, so no other process can reproduce its hashes. Fix: "
        "start every replica with the same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0) and set "
        "hash.pythonhashseed to that value in kvrouter's config, or use the sha256 algo"
    )


def to_wire(digest: bytes, int_block_hashes: bool) -> int | bytes:
    """The published form of a digest (spec §1.5): low 64 bits big-endian, or the raw bytes."""
    if int_block_hashes:
        return int.from_bytes(digest, "big") & _U64
    return digest


# --------------------------------------------------------------------------- memo


class _StepMemo:
    """Bounded memo of chain steps with generation drop.

    Two dicts: lookups try the young one, then the old one (promoting a hit). When the young
    one reaches half the capacity, the old generation is dropped whole and the young one
    takes its place. So at most ``capacity`` steps are held, a step used within the last
    ``capacity/2`` insertions always survives, and no per-hit bookkeeping is paid (an LRU
    would reorder on every hit).
    """

    __slots__ = ("_half", "_old", "_young", "capacity", "hits", "misses")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._half = capacity // 2  # 0: a capacity of 1 keeps no old generation
        self._young: dict[Any, tuple[tuple[bytes, ...], tuple[Any, ...]]] = {}
        self._old: dict[Any, tuple[tuple[bytes, ...], tuple[Any, ...]]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def get(self, key: Any) -> tuple[tuple[bytes, ...], tuple[Any, ...]] | None:
        v = self._young.get(key)
        if v is None:
            v = self._old.pop(key, None)
            if v is None:
                self.misses += 1
                return None
            self._put_young(key, v)
        self.hits += 1
        return v

    def put(self, key: Any, value: tuple[tuple[bytes, ...], tuple[Any, ...]]) -> None:
        if self.capacity > 0:
            self._put_young(key, value)

    def _put_young(self, key: Any, value: tuple[tuple[bytes, ...], tuple[Any, ...]]) -> None:
        if len(self._young) >= max(1, self._half):
            self._old = self._young if self._half else {}
            self._young = {}
        self._young[key] = value

    def clear(self) -> None:
        self._young = {}
        self._old = {}


def _token_key(tokens: Sequence[int]) -> bytes | tuple[int, ...]:
    # 4 bytes per token is the cheapest hashable form; ids outside uint32 fall back to a
    # tuple (a different type, so the two forms never collide as keys).
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        return tuple(tokens)


def _pure_key(toks: Sequence[int], start: int, stop: int) -> bytes | tuple[int, ...]:
    return _token_key(toks[start:stop])


def _native_key(toks: Sequence[int], start: int, stop: int) -> bytes | tuple[int, ...]:
    # The same bytes as _token_key's array, without the slice and the array (~3x cheaper:
    # most of a cold chain's memo cost); None for anything else, keyed the pure way.
    key = _NATIVE.token_key(toks, start, stop)
    return _token_key(toks[start:stop]) if key is None else key


# --------------------------------------------------------------------------- hasher


class BlockHasher:
    """Computes vLLM block hash chains for one hash configuration and one H.

    ``memo_entries`` bounds the memo by fine hashes held: it keeps at most
    ``memo_entries // MEMO_SPAN`` steps of ``MEMO_SPAN`` fine hashes (0 disables it).
    Only whole steps are memoized, plus the final shorter step of an eagerly hashed chain.
    One instance may be shared across threads (the memo is only ever a cache; a race can
    at worst drop an entry); a :class:`LazyChain` belongs to one thread.

    Token ids must be Python ints, as vLLM's are: the memo keys them as uint32 bytes, and
    pickle would serialize a bool or numpy integer differently from vLLM.

    ``native`` (default True) lets the compiled chain (``events._chain``, when built) hash
    cold blocks, about 5x faster for sha256 (docs/native-hashing.md); False forces the
    pure-Python chain, the reference the compiled one is tested against.
    """

    __slots__ = (
        "_block",
        "_digest",
        "_extend",
        "_key",
        "_memo",
        "hash_block_size",
        "int_block_hashes",
        "native",
        "none_hash",
        "settings",
        "span",
    )

    def __init__(
        self,
        settings: HashSettings,
        hash_block_size: int,
        *,
        memo_entries: int = DEFAULT_MEMO_ENTRIES,
        memo_span: int = MEMO_SPAN,
        native: bool = True,
    ) -> None:
        if type(hash_block_size) is not int or hash_block_size < 1:
            raise HashSettingsError(
                f"hash_block_size must be a positive int (got {hash_block_size!r}); derive "
                "it with events.layout.resolve()"
            )
        if memo_entries < 0 or memo_span < 1:
            raise ValueError("memo_entries must be >= 0 and memo_span >= 1")
        seed = none_hash_seed(settings)
        obj_ser, self._block, self._digest = _ALGO_PARTS[settings.algo]
        fast = _native_extender(settings.algo) if native else None
        self._extend: _Extender = fast or _PURE_EXTENDERS[settings.algo]
        #: The compiled chain computes this hasher's cold blocks (``native`` asked for it and
        #: the extension is built; see :func:`native_hashing`).
        self.native = fast is not None
        self._key = _native_key if self.native else _pure_key
        self.settings = settings
        self.hash_block_size = hash_block_size
        self.int_block_hashes = settings.int_block_hashes
        self.span = memo_span
        #: Parent of the first block: hash_fn(seed string), serialized like any object.
        self.none_hash: bytes = self._digest(obj_ser(seed))
        self._memo = _StepMemo(memo_entries // memo_span)

    @property
    def memo_stats(self) -> dict[str, int]:
        """Steps held, the bound on them, and lookup hits/misses so far."""
        m = self._memo
        return {"steps": len(m), "capacity": m.capacity, "hits": m.hits, "misses": m.misses}

    def clear_memo(self) -> None:
        self._memo.clear()

    def step(self, parent: bytes, tokens: Sequence[int], extra_keys: Any = None) -> bytes:
        """One chain step: ``hash_fn((parent, tuple(tokens), extra_keys))`` (spec §1.3)."""
        return self._digest(self._block(parent, tokens, extra_keys))

    def to_wire(self, digest: bytes) -> int | bytes:
        return to_wire(digest, self.int_block_hashes)

    def lazy_chain(self, token_ids: Sequence[int], keys: RequestKeys | None = None) -> LazyChain:
        """A chain that hashes only as far as it is read."""
        return LazyChain(self, token_ids, keys)

    def digests(
        self,
        token_ids: Sequence[int],
        keys: RequestKeys | None = None,
        *,
        limit: int | None = None,
    ) -> list[bytes]:
        """The fine chain's raw digests: ``len(token_ids)//H`` of them, or the first ``limit``."""
        chain = LazyChain(self, token_ids, keys)
        chain.extend(_limit(len(chain), limit), eager=True)
        return chain._digests[: _limit(len(chain), limit)]

    def wire_chain(
        self,
        token_ids: Sequence[int],
        keys: RequestKeys | None = None,
        *,
        limit: int | None = None,
    ) -> list[int | bytes]:
        """The fine chain as published on the wire (spec §1.5)."""
        chain = LazyChain(self, token_ids, keys)
        n = _limit(len(chain), limit)
        chain.extend(n, eager=True)
        return chain._wires[:n]


def _limit(n: int, limit: int | None) -> int:
    if limit is None:
        return n
    if limit < 0:
        raise ValueError(f"limit must be >= 0 (got {limit})")
    return min(n, limit)


class LazyChain:
    """One request's fine chain, hashed left to right only as far as it is read.

    Reading hash ``i`` hashes units ``hashed .. i``; at each step boundary the memo is asked
    for the whole next step first (one dict lookup), so a known prefix comes in steps of
    ``MEMO_SPAN`` and a novel one costs one lookup plus the hashes actually read.
    """

    __slots__ = (
        "_digests",
        "_extras",
        "_hasher",
        "_n",
        "_pending",
        "_tokens",
        "_wires",
    )

    def __init__(
        self, hasher: BlockHasher, token_ids: Sequence[int], keys: RequestKeys | None = None
    ) -> None:
        self._hasher = hasher
        self._tokens = token_ids
        self._n = len(token_ids) // hasher.hash_block_size
        self._extras = (
            None if keys is None or keys.empty else _ExtrasFn(keys, hasher.hash_block_size)
        )
        self._digests: list[bytes] = []
        self._wires: list[int | bytes] = []
        # memo key of the step being hashed unit by unit (None: not memoizable / no step)
        self._pending: Any = None

    def __len__(self) -> int:
        """Full units of H tokens: the most fine hashes this chain has."""
        return self._n

    @property
    def hashed(self) -> int:
        """Fine hashes computed (or taken from the memo) so far."""
        return len(self._digests)

    def wire(self, i: int) -> int | bytes:
        """Fine wire hash ``i``: the chain hash at token ``(i+1)*H``."""
        w = self._wires
        if 0 <= i < len(w):
            return w[i]
        self._need(i)
        return w[i]

    def digest(self, i: int) -> bytes:
        """Raw digest of fine unit ``i`` (the parent of unit ``i+1``)."""
        if not 0 <= i < len(self._digests):
            self._need(i)
        return self._digests[i]

    def block_wire(self, j: int, k: int) -> int | bytes:
        """Wire hash of block ``j`` of a group with block size ``k*H`` (spec §1.4)."""
        return self.wire((j + 1) * k - 1)

    def iter_block_wires(self, k: int = 1, start: int = 0) -> Iterator[int | bytes]:
        """Wire hashes of blocks ``start, start+1, ...`` of a group with block size ``k*H``.

        The cheap way to walk a hit left to right: a generator step costs less than a
        :meth:`wire` call, and hashing still happens only as far as the walk goes.
        """
        for w, i in self.wire_runs(k, start):
            yield from w[i::k]  # everything already hashed, iterated in C

    def wire_runs(self, k: int = 1, start: int = 0) -> Iterator[tuple[list[int | bytes], int]]:
        """:meth:`iter_block_wires` a run at a time, for a reader in C: pairs ``(wires, i)``,
        the chain's own list of the fine wire hashes so far and the fine index of the next
        block to read; the reader takes ``wires[i::k]`` (not changing the list) before asking
        for the next pair, which hashes further. Stopping early hashes no more than
        :meth:`iter_block_wires` would have."""
        if k < 1 or start < 0:
            raise ValueError(f"need k >= 1 and start >= 0 (got k={k}, start={start})")
        w = self._wires
        n = self._n
        i = (start + 1) * k - 1
        while i < n:
            if i >= len(w):
                # Read ahead geometrically (1, 2, 4, ... up to 64 units): a walk that stops at
                # once hashes one unit, a long walk costs a few calls instead of one per
                # block, and at most 63 units are hashed beyond what the walk reads.
                self.extend(max(i + 1, len(w) + min(max(len(w), 1), 64)))
            have = len(w)
            yield w, i
            i += -(-(have - i) // k) * k

    def wires(self, n: int | None = None) -> list[int | bytes]:
        """The first ``n`` fine wire hashes (all by default), hashing what is missing."""
        n = _limit(self._n, n)
        self.extend(n, eager=True)
        return self._wires[:n]

    def _need(self, i: int) -> None:
        if not 0 <= i < self._n:
            raise IndexError(f"fine hash {i} out of range: the chain has {self._n} full units")
        self.extend(i + 1)

    def extend(self, target: int, *, eager: bool = False) -> None:
        """Hash until ``target`` fine hashes exist.

        ``eager`` says the caller will read the whole chain up to ``target``: the final short
        step is then memoized too, so an identical prompt is fully memoized next time.
        """
        digests = self._digests
        target = min(target, self._n)
        if len(digests) >= target:
            return
        h = self._hasher
        H = h.hash_block_size
        K = h.span
        n = self._n
        memo = h._memo
        use_memo = memo.capacity > 0
        toks = self._tokens
        wires = self._wires
        ex = self._extras
        run = h._extend
        ints = h.int_block_hashes
        steps = _NATIVE_STEPS if h.native and ex is None and use_memo else None
        while (done := len(digests)) < target:
            off = done % K
            step_end = min(done - off + K, n)
            if off == 0:
                # At a step boundary: one lookup may bring the whole step.
                self._pending = None
                if steps is not None and step_end - done == K:
                    # in C, the run of whole steps the young generation holds (the lookups
                    # below, key for key); the first it does not is looked up below
                    got = steps(
                        memo._young,
                        digests[-1] if done else h.none_hash,
                        toks,
                        H,
                        K,
                        done,
                        target,
                        n,
                        digests,
                        wires,
                    )
                    if got:
                        memo.hits += got
                        continue
                if use_memo and (step_end - done == K or (eager and step_end <= target)):
                    key = (
                        digests[-1] if done else h.none_hash,
                        h._key(toks, done * H, step_end * H),
                        None if ex is None else tuple(map(ex, range(done, step_end))),
                    )
                    hit = memo.get(key)
                    if hit is not None:
                        digests += hit[0]
                        wires += hit[1]
                        continue
                    self._pending = key
            stop = min(target, step_end)
            run(digests[-1] if done else h.none_hash, toks, H, done, stop, ex, digests, wires, ints)
            if stop == step_end and self._pending is not None:
                step_start = (step_end - 1) // K * K
                memo.put(self._pending, (tuple(digests[step_start:]), tuple(wires[step_start:])))
                self._pending = None


# --------------------------------------------------------------------------- group views


def block_hashes_at(fine_wire: Sequence[Any], block_size: int, hash_block_size: int) -> list[Any]:
    """A group's block hashes read off the fine chain: index ``(j+1)*k - 1``, k = B/H (§1.4)."""
    if block_size < 1 or block_size % hash_block_size:
        raise ValueError(
            f"block_size {block_size} is not a multiple of hash_block_size {hash_block_size}; "
            "vLLM requires every prefix-cacheable group's block size to be one (spec §1.4)"
        )
    k = block_size // hash_block_size
    return list(fine_wire[k - 1 :: k])


def expected_stored_hashes(
    hasher: BlockHasher,
    token_ids: Sequence[int],
    block_size: int,
    keys: RequestKeys | None = None,
) -> list[int | bytes]:
    """What a ``BlockStored`` with ``parent_block_hash`` None should list for a dense group.

    Such an event covers a range starting at token 0 (spec §2.4), so its hashes are the
    group's full ``block_size`` blocks of ``token_ids`` -- the live conformance check
    compares the two.
    """
    H = hasher.hash_block_size
    block_hashes_at((), block_size, H)  # validates block_size against H
    full_units = len(token_ids) // block_size * (block_size // H)
    return block_hashes_at(hasher.wire_chain(token_ids, keys, limit=full_units), block_size, H)
