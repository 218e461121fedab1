/*
 * events._chain: the cold block hash chain of events/hashing.py in C (docs/native-hashing.md).
 *
 * Optional at build time (setup.py builds it with optional=True); events/hashing.py falls back
 * to its pure-Python runners when this module is missing, and those runners are the reference
 * the tests compare this module against, byte for byte.
 *
 * Per block, the common case (extra keys None, every token an exact int in the range the fast
 * serializers cover) is serialized here, exactly as pickle.dumps((parent, tuple(tokens), None),
 * protocol=5) or cbor2.dumps(..., canonical=True) lays it out, and hashed:
 *   - SHA-256 here with the SHA-NI instructions when the CPU has them (no OpenSSL headers
 *     needed, nothing linked but libc); without them events/hashing.py passes hashlib's
 *     sha256 as the digest callable, OpenSSL's own code (a call per block: 2x slower);
 *   - xxh3_128 through the Python callable events/hashing.py passes (xxhash.xxh3_128_digest),
 *     so the digest is the very function the pure path uses.
 * Every other block (extra keys present, a bool / numpy int / big or negative token) is
 * serialized by the pure-Python block serializer passed in, so it is exact by construction.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KV_HAVE_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------------ SHA-256 */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static const uint32_t SHA256_INIT[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};



#ifdef KV_HAVE_SHANI
/* The SHA extensions: 2 rounds per sha256rnds2, the message schedule by sha256msg1/msg2. */
__attribute__((target("sha,sse4.1,ssse3"))) static void
sha256_blocks_shani(uint32_t st[8], const uint8_t *p, size_t nblocks) {
    const __m128i BSWAP = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&st[0]);
    __m128i s1 = _mm_loadu_si128((const __m128i *)&st[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);        /* CDAB */
    s1 = _mm_shuffle_epi32(s1, 0x1B);          /* EFGH */
    __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);  /* ABEF */
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);       /* CDGH */
    while (nblocks--) {
        __m128i abef = s0, cdgh = s1, m[4];
        for (int g = 0; g < 16; g++) {
            __m128i x;
            if (g < 4) {
                x = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * g)), BSWAP);
            } else {
                /* W[4g..4g+3] from the last 16: msg1 adds sigma0, alignr brings W[t-7],
                   msg2 adds sigma1 of the two words before each. */
                x = _mm_sha256msg1_epu32(m[g & 3], m[(g + 1) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(m[(g + 3) & 3], m[(g + 2) & 3], 4));
                x = _mm_sha256msg2_epu32(x, m[(g + 3) & 3]);
            }
            m[g & 3] = x;
            __m128i k = _mm_add_epi32(x, _mm_loadu_si128((const __m128i *)&K256[4 * g]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, k);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(k, 0x0E));
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
        p += 64;
    }
    tmp = _mm_shuffle_epi32(s0, 0x1B);         /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);          /* DCHG */
    s0 = _mm_blend_epi16(tmp, s1, 0xF0);       /* DCBA */
    s1 = _mm_alignr_epi8(s1, tmp, 8);          /* HGFE */
    _mm_storeu_si128((__m128i *)&st[0], s0);
    _mm_storeu_si128((__m128i *)&st[4], s1);
}

static int cpu_has_shani(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    if (!(c & bit_SSE4_1) || !(c & bit_SSSE3))
        return 0;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1; /* CPUID.(EAX=7,ECX=0):EBX.SHA[bit 29] */
}
#endif

typedef void (*sha_blocks_fn)(uint32_t st[8], const uint8_t *p, size_t nblocks);
static sha_blocks_fn sha_blocks = NULL; /* SHA-NI, or NULL: digests come from the callable */
static const char *sha_impl = "none";

/* SHA-256 of buf[0..n); buf must have room for n + 72 bytes (the padding is written there). */
static void sha256_padded(uint8_t *buf, size_t n, uint8_t out[32]) {
    uint32_t st[8];
    memcpy(st, SHA256_INIT, sizeof st);
    size_t total = (n + 9 + 63) & ~(size_t)63;
    buf[n] = 0x80;
    memset(buf + n + 1, 0, total - n - 9);
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++)
        buf[total - 1 - i] = (uint8_t)(bits >> (8 * i));
    sha_blocks(st, buf, total / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(st[i] >> 24);
        out[4 * i + 1] = (uint8_t)(st[i] >> 16);
        out[4 * i + 2] = (uint8_t)(st[i] >> 8);
        out[4 * i + 3] = (uint8_t)st[i];
    }
}

/* ------------------------------------------------------------------------ serializers */

#define SER_PICKLE 0
#define SER_CBOR 1

/* Bytes a serialized block can take at most, plus SHA padding room. */
static size_t block_capacity(Py_ssize_t plen, Py_ssize_t H) {
    return (size_t)plen + 9 * (size_t)H + 64 + 72;
}

/* The value of a token that is an exact int in [0, limit] into *v (0); else -1. */
static inline int read_token(PyObject *t, long long limit, uint64_t *v) {
    if (!PyLong_CheckExact(t))
        return -1;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)t)) { /* |v| < 2**30: no call */
        Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)t);
        if (c < 0 || c > limit)
            return -1;
        *v = (uint64_t)c;
        return 0;
    }
#elif PY_VERSION_HEX >= 0x030B0000
    if (Py_SIZE(t) == 0 || Py_SIZE(t) == 1) { /* 0 or one non-negative 30-bit digit */
        *v = Py_SIZE(t) ? (uint64_t)((PyLongObject *)t)->ob_digit[0] : 0;
        return *v > (uint64_t)limit ? -1 : 0;
    }
#endif
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(t, &overflow);
    if (overflow || x < 0 || x > limit)
        return -1; /* (a -1 with an error set cannot happen for an exact int) */
    *v = (uint64_t)x;
    return 0;
}

/* The values of one block's tokens when all are exact ints in [0, limit]; else -1. */
static int read_tokens(PyObject *const *items, Py_ssize_t H, long long limit, uint64_t *vals) {
    for (Py_ssize_t i = 0; i < H; i++)
        if (read_token(items[i], limit, &vals[i]) < 0)
            return -1;
    return 0;
}

/* pickle.dumps((parent, tuple(tokens), None), 5), tokens in [0, 2**31): one frame. */
static size_t pickle_block(uint8_t *buf, const uint8_t *parent, Py_ssize_t plen,
                           const uint64_t *vals, Py_ssize_t H) {
    uint8_t *w = buf + 11;
    *w++ = 'C'; /* SHORT_BINBYTES */
    *w++ = (uint8_t)plen;
    memcpy(w, parent, (size_t)plen);
    w += plen;
    *w++ = 0x94; /* MEMOIZE */
    if (H > 3)
        *w++ = '('; /* MARK */
    for (Py_ssize_t i = 0; i < H; i++) {
        uint64_t v = vals[i];
        if (v < 0x100) {
            *w++ = 'K'; /* BININT1 */
            *w++ = (uint8_t)v;
        } else if (v < 0x10000) {
            *w++ = 'M'; /* BININT2 */
            *w++ = (uint8_t)v;
            *w++ = (uint8_t)(v >> 8);
        } else {
            *w++ = 'J'; /* BININT, little-endian signed 32 */
            *w++ = (uint8_t)v;
            *w++ = (uint8_t)(v >> 8);
            *w++ = (uint8_t)(v >> 16);
            *w++ = (uint8_t)(v >> 24);
        }
    }
    *w++ = H > 3 ? 't' : (uint8_t)(0x84 + H); /* TUPLE, or TUPLE1..TUPLE3 */
    *w++ = 0x94;
    *w++ = 'N';  /* None */
    *w++ = 0x87; /* TUPLE3 */
    *w++ = 0x94;
    *w++ = '.'; /* STOP */
    size_t n = (size_t)(w - buf);
    uint64_t frame = n - 11;
    buf[0] = 0x80; /* PROTO 5 */
    buf[1] = 5;
    buf[2] = 0x95; /* FRAME, 8-byte little-endian length */
    for (int i = 0; i < 8; i++)
        buf[3 + i] = (uint8_t)(frame >> (8 * i));
    return n;
}

static uint8_t *cbor_head(uint8_t *w, uint8_t major, uint64_t v) {
    major <<= 5;
    if (v < 24) {
        *w++ = major | (uint8_t)v;
    } else if (v < 0x100) {
        *w++ = major | 24;
        *w++ = (uint8_t)v;
    } else if (v < 0x10000) {
        *w++ = major | 25;
        *w++ = (uint8_t)(v >> 8);
        *w++ = (uint8_t)v;
    } else if (v < 0x100000000ULL) {
        *w++ = major | 26;
        for (int i = 3; i >= 0; i--)
            *w++ = (uint8_t)(v >> (8 * i));
    } else {
        *w++ = major | 27;
        for (int i = 7; i >= 0; i--)
            *w++ = (uint8_t)(v >> (8 * i));
    }
    return w;
}

/* cbor2.dumps((parent, tuple(tokens), None), canonical=True), tokens in [0, 2**63). */
static size_t cbor_block(uint8_t *buf, const uint8_t *parent, Py_ssize_t plen,
                         const uint64_t *vals, Py_ssize_t H) {
    uint8_t *w = buf;
    *w++ = 0x83; /* array(3) */
    w = cbor_head(w, 2, (uint64_t)plen);
    memcpy(w, parent, (size_t)plen);
    w += plen;
    w = cbor_head(w, 4, (uint64_t)H);
    for (Py_ssize_t i = 0; i < H; i++)
        w = cbor_head(w, 0, vals[i]);
    *w++ = 0xf6; /* null */
    return (size_t)(w - buf);
}

/* ------------------------------------------------------------------------ the chain */

/* Digest of buf[0..n) as a new bytes object (buf has the SHA padding room). */
static PyObject *digest_of(PyObject *digest_fn, uint8_t *buf, size_t n) {
    if (digest_fn == Py_None) {
        uint8_t out[32];
        sha256_padded(buf, n, out);
        return PyBytes_FromStringAndSize((const char *)out, 32);
    }
    PyObject *data = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)n);
    if (data == NULL)
        return NULL;
    PyObject *d = PyObject_CallOneArg(digest_fn, data);
    Py_DECREF(data);
    return d;
}

static PyObject *digest_bytes_obj(PyObject *digest_fn, PyObject *data) {
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "the block serializer must return bytes");
        return NULL;
    }
    if (digest_fn != Py_None)
        return PyObject_CallOneArg(digest_fn, data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    uint8_t *buf = PyMem_Malloc((size_t)n + 72);
    if (buf == NULL)
        return PyErr_NoMemory();
    memcpy(buf, PyBytes_AS_STRING(data), (size_t)n);
    uint8_t out[32];
    sha256_padded(buf, (size_t)n, out);
    PyMem_Free(buf);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

/* The published wire value of a digest (spec 1.5): its last 8 bytes, big-endian. */
static PyObject *wire_int(PyObject *digest) {
    Py_ssize_t n = PyBytes_GET_SIZE(digest);
    const uint8_t *d = (const uint8_t *)PyBytes_AS_STRING(digest);
    uint64_t v = 0;
    Py_ssize_t from = n >= 8 ? n - 8 : 0;
    for (Py_ssize_t i = from; i < n; i++)
        v = (v << 8) | d[i];
    return PyLong_FromUnsignedLongLong(v);
}

PyDoc_STRVAR(extend_doc,
"extend(serial, block_fn, digest_fn, parent, toks, H, start, stop, ex, digests, wires, ints)\n"
"--\n\n"
"Hash fine units [start, stop) of ``toks`` after ``parent``; append each digest to\n"
"``digests`` and its wire value to ``wires`` (an int when ``ints``, else the digest).\n\n"
"serial: 0 pickle protocol 5, 1 canonical CBOR. digest_fn: None for SHA-256 computed here,\n"
"else a callable bytes -> digest bytes. block_fn(parent, tokens, extras) -> bytes serializes\n"
"the blocks this module does not (extras present, tokens outside the fast range). ex: None\n"
"or a callable unit -> extras (None for none).");

static PyObject *chain_extend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "extend() takes exactly 12 arguments");
        return NULL;
    }
    long serial = PyLong_AsLong(args[0]);
    if (serial == -1 && PyErr_Occurred())
        return NULL;
    PyObject *block_fn = args[1], *digest_fn = args[2], *parent = args[3], *toks = args[4];
    Py_ssize_t H = PyLong_AsSsize_t(args[5]);
    Py_ssize_t start = PyLong_AsSsize_t(args[6]);
    Py_ssize_t stop = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *ex = args[8], *digests = args[9], *wires = args[10];
    int ints = PyObject_IsTrue(args[11]);
    if (ints < 0)
        return NULL;
    if ((serial != SER_PICKLE && serial != SER_CBOR) || H < 1 || start < 0 || !PyBytes_Check(parent) ||
        !PyList_Check(digests) || !PyList_Check(wires)) {
        PyErr_SetString(PyExc_ValueError, "extend(): bad serial, H, start, parent or output lists");
        return NULL;
    }
    if (digest_fn == Py_None && sha_blocks == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "extend(): digest_fn None needs SHA-NI, which this CPU lacks; pass "
                        "hashlib's sha256");
        return NULL;
    }
    int seq = PyList_CheckExact(toks) || PyTuple_CheckExact(toks); /* subclasses: sliced */
    if (stop > start && (H > PY_SSIZE_T_MAX / stop))
        return PyErr_NoMemory();
    long long limit = serial == SER_PICKLE ? 0x7fffffffLL : 0x7fffffffffffffffLL;

    uint64_t *vals = PyMem_Malloc(sizeof(uint64_t) * (size_t)H);
    uint8_t *buf = PyMem_Malloc(block_capacity(255, H));
    if (vals == NULL || buf == NULL) {
        PyMem_Free(vals);
        PyMem_Free(buf);
        return PyErr_NoMemory();
    }
    Py_INCREF(parent);
    PyObject *p = parent; /* owned */
    for (Py_ssize_t u = start; u < stop; u++) {
        Py_ssize_t a = u * H;
        PyObject *extras = NULL;
        if (ex != Py_None) {
            extras = PyObject_CallFunction(ex, "n", u);
            if (extras == NULL)
                goto fail;
            if (extras == Py_None)
                Py_CLEAR(extras);
        }
        PyObject *d = NULL, *slice = NULL;
        int fast = 0;
        if (extras == NULL && PyBytes_GET_SIZE(p) < 256) {
            /* Items are read with no Python code running in between: nothing can change them. */
            PyObject *src = toks;
            Py_ssize_t off = a;
            if (!seq) { /* another sequence type: read its slice if that is a list or tuple */
                slice = PySequence_GetSlice(toks, a, a + H);
                if (slice == NULL) {
                    Py_XDECREF(extras);
                    goto fail;
                }
                src = slice;
                off = 0;
            }
            if ((PyList_CheckExact(src) || PyTuple_CheckExact(src)) && off + H <= PySequence_Fast_GET_SIZE(src))
                fast = read_tokens(PySequence_Fast_ITEMS(src) + off, H, limit, vals) == 0;
        }
        if (fast) {
            const uint8_t *pb = (const uint8_t *)PyBytes_AS_STRING(p);
            Py_ssize_t plen = PyBytes_GET_SIZE(p);
            size_t n = serial == SER_PICKLE ? pickle_block(buf, pb, plen, vals, H)
                                            : cbor_block(buf, pb, plen, vals, H);
            d = digest_of(digest_fn, buf, n);
        } else {
            if (slice == NULL)
                slice = PySequence_GetSlice(toks, a, a + H);
            if (slice == NULL) {
                Py_XDECREF(extras);
                goto fail;
            }
            PyObject *data = PyObject_CallFunctionObjArgs(block_fn, p, slice,
                                                          extras ? extras : Py_None, NULL);
            if (data != NULL) {
                d = digest_bytes_obj(digest_fn, data);
                Py_DECREF(data);
            }
        }
        Py_XDECREF(slice);
        Py_XDECREF(extras);
        if (d == NULL)
            goto fail;
        if (!PyBytes_Check(d)) {
            Py_DECREF(d);
            PyErr_SetString(PyExc_TypeError, "the digest function must return bytes");
            goto fail;
        }
        if (PyList_Append(digests, d) < 0) {
            Py_DECREF(d);
            goto fail;
        }
        int rc;
        if (ints) {
            PyObject *wv = wire_int(d);
            rc = wv == NULL ? -1 : PyList_Append(wires, wv);
            Py_XDECREF(wv);
        } else {
            rc = PyList_Append(wires, d);
        }
        Py_DECREF(p);
        p = d;
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(p);
    PyMem_Free(vals);
    PyMem_Free(buf);
    Py_RETURN_NONE;
fail:
    Py_DECREF(p);
    PyMem_Free(vals);
    PyMem_Free(buf);
    return NULL;
}

/* token_key's work: a new reference to the key bytes or to None, or NULL (no memory). */
static PyObject *token_key(PyObject *toks, Py_ssize_t start, Py_ssize_t stop) {
    if (!(PyList_CheckExact(toks) || PyTuple_CheckExact(toks)) || start < 0 || stop < start ||
        stop > PySequence_Fast_GET_SIZE(toks))
        Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (stop - start) * (Py_ssize_t)sizeof(uint32_t));
    if (out == NULL)
        return NULL;
    uint32_t *w = (uint32_t *)PyBytes_AS_STRING(out);
    PyObject *const *items = PySequence_Fast_ITEMS(toks);
    for (Py_ssize_t i = start; i < stop; i++) {
        uint64_t v;
        if (read_token(items[i], 0xffffffffLL, &v) < 0) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        *w++ = (uint32_t)v;
    }
    return out;
}

PyDoc_STRVAR(token_key_doc,
"token_key(toks, start, stop) -> bytes | None\n--\n\n"
"toks[start:stop] as native-endian uint32 bytes, the memo key array('I', ...).tobytes()\n"
"makes, without the slice and the array; None when a token is not an int in [0, 2**32)\n"
"(or toks is not a list or tuple): the caller then keys the pure way.");

static PyObject *chain_token_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "token_key() takes exactly 3 arguments");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), stop = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    return token_key(args[0], start, stop);
}

PyDoc_STRVAR(memo_steps_doc,
"memo_steps(young, parent, toks, H, K, done, target, n, digests, wires) -> int\n--\n\n"
"events/hashing.py LazyChain.extend's memo lookups for a chain without extra keys, in C: from\n"
"unit ``done`` (a step boundary, ``parent`` the digest before it) while ``done < target`` and\n"
"a whole step of K units fits in the chain's n, look the step up in ``young`` (the memo's young\n"
"generation, a dict) under the key extend builds, (parent, token_key, None), and append a hit's\n"
"digests and wires to the two lists. Returns the steps taken; stops at the first step the\n"
"young generation does not hold (or whose tokens token_key cannot key), which extend then\n"
"looks up itself (the old generation, a miss: counted there).");

static PyObject *chain_memo_steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "memo_steps() takes exactly 10 arguments");
        return NULL;
    }
    PyObject *young = args[0], *parent = args[1], *toks = args[2];
    PyObject *digests = args[8], *wires = args[9];
    Py_ssize_t H = PyLong_AsSsize_t(args[3]), K = PyLong_AsSsize_t(args[4]);
    Py_ssize_t done = PyLong_AsSsize_t(args[5]), target = PyLong_AsSsize_t(args[6]);
    Py_ssize_t n = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyDict_CheckExact(young) || !PyList_CheckExact(digests) || !PyList_CheckExact(wires) ||
        H < 1 || K < 1 || done < 0) {
        PyErr_SetString(PyExc_ValueError, "memo_steps(): bad memo, H, K, done or output lists");
        return NULL;
    }
    Py_ssize_t steps = 0;
    Py_INCREF(parent);
    while (done < target && done <= n - K) {
        PyObject *tk = token_key(toks, done * H, (done + K) * H);
        if (tk == NULL)
            goto fail;
        if (tk == Py_None) {
            Py_DECREF(tk);
            break;
        }
        PyObject *key = PyTuple_Pack(3, parent, tk, Py_None);
        Py_DECREF(tk);
        if (key == NULL)
            goto fail;
        PyObject *hit = PyDict_GetItemWithError(young, key); /* borrowed */
        Py_DECREF(key);
        if (hit == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 2)
            break;
        PyObject *ds = PyTuple_GET_ITEM(hit, 0), *ws = PyTuple_GET_ITEM(hit, 1);
        if (!PyTuple_CheckExact(ds) || !PyTuple_CheckExact(ws) || PyTuple_GET_SIZE(ds) != K ||
            PyTuple_GET_SIZE(ws) != K)
            break;
        Py_INCREF(hit); /* the lists' growth runs no Python code, but hold it anyway */
        Py_ssize_t nd = PyList_GET_SIZE(digests), nw = PyList_GET_SIZE(wires);
        int bad = PyList_SetSlice(digests, nd, nd, ds) < 0 || PyList_SetSlice(wires, nw, nw, ws) < 0;
        if (!bad)
            Py_SETREF(parent, Py_NewRef(PyTuple_GET_ITEM(ds, K - 1)));
        Py_DECREF(hit);
        if (bad)
            goto fail;
        done += K;
        steps++;
    }
    Py_DECREF(parent);
    return PyLong_FromSsize_t(steps);
fail:
    Py_DECREF(parent);
    return NULL;
}

PyDoc_STRVAR(sha256_doc, "sha256(data) -> bytes\n--\n\nSHA-256 of a bytes-like object, "
                         "computed by this module's own code (tests check it against hashlib).");

static PyObject *chain_sha256(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint8_t *buf = PyMem_Malloc((size_t)view.len + 72);
    if (buf == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    if (sha_blocks == NULL) {
        PyMem_Free(buf);
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "no SHA-256 code in use: this CPU lacks SHA-NI");
        return NULL;
    }
    memcpy(buf, view.buf, (size_t)view.len);
    uint8_t out[32];
    sha256_padded(buf, (size_t)view.len, out);
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

PyDoc_STRVAR(use_sha_doc, "_use_sha(impl) -> str\n--\n\nSelect 'sha-ni' (if the CPU has it) or "
                          "'none' (as a CPU without it); returns the one in use. For tests.");

static PyObject *chain_use_sha(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    if (strcmp(name, "none") == 0) {
        sha_blocks = NULL;
        sha_impl = "none";
    }
#ifdef KV_HAVE_SHANI
    else if (strcmp(name, "sha-ni") == 0 && cpu_has_shani()) {
        sha_blocks = sha256_blocks_shani;
        sha_impl = "sha-ni";
    }
#endif
    else if (strcmp(name, "sha-ni") != 0) {
        PyErr_Format(PyExc_ValueError, "unknown SHA-256 implementation %R", arg);
        return NULL;
    }
    return PyUnicode_FromString(sha_impl);
}

static PyObject *chain_sha_impl(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(sha_impl);
}

/* ------------------------------------------------------------------ prefix-home chunk keys */

PyDoc_STRVAR(chunk_chain_doc,
"chunk_chain(toks, chunk) -> list[int] | None\n--\n\n"
"router/core/affinity.py PrefixHomes.keys in C: h = 0, then per full chunk of `chunk` tokens\n"
"h = hash((h, tuple(toks[start:start + chunk]))), every h in a list. Computed with CPython's\n"
"own tuple and int hash (the xxHash-based tuplehash of 3.8+; a token that is not an int in\n"
"[0, 2**61 - 1) is hashed by PyObject_Hash, as tuplehash does), without making the slices\n"
"and tuples. None when toks is not a list or tuple, Py_hash_t is not 64 bits or a token's\n"
"__hash__ shrinks the list: the caller\n"
"computes it in Python, which router/core/affinity.py also checks this against at import.");

#define XXPRIME_1 ((uint64_t)11400714785074694791ULL)
#define XXPRIME_2 ((uint64_t)14029467366897019727ULL)
#define XXPRIME_5 ((uint64_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))
#define HASH_MODULUS (((uint64_t)1 << 61) - 1)

/* One lane of CPython's tuplehash; the caller starts acc at XXPRIME_5. */
static inline uint64_t tuple_lane(uint64_t acc, uint64_t lane) {
    acc += lane * XXPRIME_2;
    acc = XXROTATE(acc);
    return acc * XXPRIME_1;
}

/* The end of tuplehash: mix in the length, never -1. */
static inline Py_hash_t tuple_end(uint64_t acc, Py_ssize_t len) {
    acc += (uint64_t)len ^ (XXPRIME_5 ^ 3527539UL);
    return acc == (uint64_t)-1 ? 1546275796 : (Py_hash_t)acc;
}

/* hash(int(v)) for a Py_hash_t v: |v| mod 2**61 - 1 with v's sign, -1 made -2 (long_hash). */
static inline Py_hash_t int_hash(Py_hash_t v) {
    uint64_t mag = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    Py_hash_t x = (Py_hash_t)(mag % HASH_MODULUS);
    if (v < 0) {
        x = -x;
    }
    return x == -1 ? -2 : x;
}

static PyObject *chain_chunk_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "chunk_chain() takes exactly 2 arguments");
        return NULL;
    }
    PyObject *toks = args[0];
    Py_ssize_t c = PyLong_AsSsize_t(args[1]);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    if (c < 1) {
        PyErr_SetString(PyExc_ValueError, "chunk_chain() needs chunk >= 1");
        return NULL;
    }
    if (sizeof(Py_hash_t) != 8 || !(PyList_CheckExact(toks) || PyTuple_CheckExact(toks)))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(toks) / c;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    PyObject *const *items = PySequence_Fast_ITEMS(toks);
    Py_hash_t h = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t acc = XXPRIME_5;
        for (Py_ssize_t i = k * c; i < (k + 1) * c; i++) {
            PyObject *t = items[i];
            uint64_t v;
            Py_hash_t lane;
            if (read_token(t, (long long)HASH_MODULUS - 1, &v) == 0) {
                lane = (Py_hash_t)v; /* hash(v) == v below the modulus */
            }
            else {
                Py_INCREF(t);
                lane = PyObject_Hash(t);
                Py_DECREF(t);
                if (lane == -1) {
                    Py_DECREF(out);
                    return NULL;
                }
                /* that __hash__ may have changed a list: re-read its items, check its size */
                items = PySequence_Fast_ITEMS(toks);
                if (PySequence_Fast_GET_SIZE(toks) < (k + 1) * c) {
                    Py_DECREF(out); /* it shrank: let the caller's Python do what it does */
                    Py_RETURN_NONE;
                }
            }
            acc = tuple_lane(acc, (uint64_t)lane);
        }
        Py_hash_t inner = tuple_end(acc, c);
        acc = tuple_lane(XXPRIME_5, (uint64_t)int_hash(h));
        h = tuple_end(tuple_lane(acc, (uint64_t)inner), 2);
        PyObject *v = PyLong_FromSsize_t(h);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, v);
    }
    return out;
}

static PyMethodDef chain_methods[] = {
    {"extend", (PyCFunction)(void (*)(void))chain_extend, METH_FASTCALL, extend_doc},
    {"token_key", (PyCFunction)(void (*)(void))chain_token_key, METH_FASTCALL, token_key_doc},
    {"chunk_chain", (PyCFunction)(void (*)(void))chain_chunk_chain, METH_FASTCALL,
     chunk_chain_doc},
    {"memo_steps", (PyCFunction)(void (*)(void))chain_memo_steps, METH_FASTCALL, memo_steps_doc},
    {"sha256", chain_sha256, METH_O, sha256_doc},
    {"_use_sha", chain_use_sha, METH_O, use_sha_doc},
    {"sha_impl", chain_sha_impl, METH_NOARGS, "The SHA-256 code in use: 'sha-ni' or 'none'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT, "events._chain",
    "vLLM's block hash chain in C (see docs/native-hashing.md).", -1, chain_methods,
};

PyMODINIT_FUNC PyInit__chain(void) {
#ifdef KV_HAVE_SHANI
    if (cpu_has_shani()) {
        sha_blocks = sha256_blocks_shani;
        sha_impl = "sha-ni";
    }
#endif
    return PyModule_Create(&chain_module);
}
