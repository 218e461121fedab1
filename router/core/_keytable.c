/*
 * router.core._keytable: a compact hash table from unsigned 64-bit int keys to Python objects,
 * the per-(tier, group) tables of router/core/index.py (docs/index-memory.md); and
 * leading_walk, a prediction's walk of a request's chain over those tables (router/core/
 * predict.py, docs/decision-cost.md), here because it reads the tables' slots directly.
 *
 * Optional at build time (setup.py builds it with optional=True); router/core/index.py uses a
 * plain dict when this module is missing or switched off (KVROUTER_NATIVE_INDEX=0), and that
 * dict is the reference tests/test_keytable.py compares this type against.
 *
 * Why: a dict of wire hash -> replica bitmask costs ~44 bytes per key for its slot and 36 for
 * the int object of the key. Here a key is stored inline as a uint64 next to its value
 * pointer: 16 bytes per slot, at a load of 1/2 to 3/4, so 21-32 bytes per key.
 *
 * Layout: open addressing, linear probing. A key's home slot is the high word of
 * mix(key ^ seed) * capacity (Lemire's reduction), so any capacity works (the table grows by
 * 1.5x and shrinks to fit, not by powers of two) and slot order follows hash order. An empty
 * slot has value == NULL. Deletion shifts the following run back (no tombstones), so churn
 * never lengthens probes. Values are strong references. Keys are ints in [0, 2**64): storing
 * anything else raises TypeError/OverflowError; looking one up finds nothing (no such key can
 * be in the table), as a dict would answer for a key it does not hold.
 *
 * Nothing here calls Python code while the slots are in an inconsistent state: key
 * conversion happens first, and an old value is released only after its slot is rewritten
 * (a value's finalizer may then use the table again).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <limits.h>
#include <string.h>

typedef struct {
    uint64_t key;
    PyObject *value; /* NULL: an empty slot */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;       /* NULL while cap == 0 */
    Py_ssize_t cap;
    Py_ssize_t used;
    uint64_t seed;
    uint64_t cursor;   /* where pop_some goes on, in hash space */
    uint64_t version;  /* bumped on every insert, delete and resize: iterators check it */
    Py_ssize_t shrink_below; /* after a shrink gave up (try_shrink): retry under this many
                                keys (0: no hold-off) */
} KeyTable;

typedef struct {
    PyObject_HEAD
    KeyTable *table;   /* NULL once exhausted */
    Py_ssize_t pos;
    uint64_t version;
    int kind;          /* 0 keys, 1 values, 2 items */
} KeyTableIter;

static PyTypeObject KeyTableType;
static PyTypeObject KeyTableIterType;

#define MIN_CAP 8
/* grow past a load of 3/4, shrink below 1/4; both resize to a load of 1/2 */
#define OVER_FULL(used, cap) ((uint64_t)(used) * 4 > (uint64_t)(cap) * 3)
#define UNDER_FULL(used, cap) ((uint64_t)(used) * 4 < (uint64_t)(cap))
/* a shrink on delete gives up when an entry would land this far past its home (try_shrink) */
#define MAX_SHRINK_PROBE 64

static inline uint64_t mix(uint64_t k, uint64_t seed) {
    /* murmur3's fmix64: a bijection, so distinct keys never share a hash */
    k ^= seed;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline uint64_t mulhi(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
#else
    uint64_t a_lo = (uint32_t)a, a_hi = a >> 32, b_lo = (uint32_t)b, b_hi = b >> 32;
    uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
    uint64_t cross = (lo_lo >> 32) + (uint32_t)hi_lo + lo_hi;
    return hi_hi + (hi_lo >> 32) + (cross >> 32);
#endif
}

static inline Py_ssize_t home_of(const KeyTable *t, uint64_t key) {
    return (Py_ssize_t)mulhi(mix(key, t->seed), (uint64_t)t->cap);
}

/* An int's value as uint64, with OverflowError out of [0, 2**64). PyLong_AsUnsignedLong walks
 * the digits; PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray on 3.11 (30 ns more
 * per lookup), so the former is used where a long has 64 bits. */
static inline unsigned long long int_value(PyObject *o) {
#if ULONG_MAX == 0xffffffffffffffffULL
    return (unsigned long long)PyLong_AsUnsignedLong(o);
#else
    return PyLong_AsUnsignedLongLong(o);
#endif
}

/* 1: *out is the key; 0: not a key this table can hold (not an int, negative, >= 2**64);
 * -1: another error (set). No Python code runs: int subclasses are read as ints. */
static int as_key(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        return 0;
    }
    unsigned long long v = int_value(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 1;
}

/* as_key for a store: a key out of the domain is an error naming the fix. */
static int as_key_strict(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError,
                     "KeyTable keys are ints in [0, 2**64), not %.100s: use a dict for other "
                     "keys",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = int_value(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError,
                            "KeyTable keys are ints in [0, 2**64): use a dict for other keys");
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 1;
}

/* The slot holding key, or -1. */
static inline Py_ssize_t find(const KeyTable *t, uint64_t key) {
    if (t->used == 0) {
        return -1;
    }
    Slot *s = t->slots;
    Py_ssize_t i = home_of(t, key), cap = t->cap;
    while (s[i].value != NULL) {
        if (s[i].key == key) {
            return i;
        }
        if (++i == cap) {
            i = 0;
        }
    }
    return -1;
}

/* Move every entry into a fresh array of new_cap slots (0: free it). No refcount changes.
 * With max_probe >= 0 it gives up, returning 1 with the table untouched, when an entry would
 * land more than max_probe slots past its home (try_shrink). Returns -1 with MemoryError
 * set, the table untouched. */
static int rehash(KeyTable *t, Py_ssize_t new_cap, Py_ssize_t max_probe) {
    Slot *fresh = NULL;
    if (new_cap > 0) {
        if (new_cap < MIN_CAP) {
            new_cap = MIN_CAP;
        }
        if ((size_t)new_cap > PY_SSIZE_T_MAX / sizeof(Slot)) {
            PyErr_NoMemory();
            return -1;
        }
        fresh = PyMem_Calloc((size_t)new_cap, sizeof(Slot));
        if (fresh == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    Slot *old = t->slots;
    Py_ssize_t old_cap = t->cap;
    uint64_t seed = t->seed;
    for (Py_ssize_t j = 0; j < old_cap; j++) {
        if (old[j].value != NULL) {
            Py_ssize_t i = (Py_ssize_t)mulhi(mix(old[j].key, seed), (uint64_t)new_cap);
            Py_ssize_t probe = 0;
            while (fresh[i].value != NULL) {
                if (++i == new_cap) {
                    i = 0;
                }
                if (max_probe >= 0 && ++probe > max_probe) {
                    PyMem_Free(fresh);
                    return 1;
                }
            }
            fresh[i] = old[j];
        }
    }
    t->slots = fresh;
    t->cap = new_cap;
    PyMem_Free(old);
    t->version++;
    return 0;
}

/* rehash with no probe limit; the shrink hold-off is over (the table has its new size). */
static int resize(KeyTable *t, Py_ssize_t new_cap) {
    int r = rehash(t, new_cap, -1);
    if (r == 0) {
        t->shrink_below = 0;
    }
    return r;
}

/* Empty slot i and shift the run after it back; returns the value it held (a reference the
 * caller now owns). */
static PyObject *take_slot(KeyTable *t, Py_ssize_t i) {
    Slot *s = t->slots;
    Py_ssize_t cap = t->cap, j = i;
    PyObject *v = s[i].value;
    for (;;) {
        if (++j == cap) {
            j = 0;
        }
        if (s[j].value == NULL) {
            break;
        }
        /* j may move back to i if i lies on its probe path: home(j) .. j covers i */
        Py_ssize_t h = home_of(t, s[j].key);
        Py_ssize_t from_home = j >= h ? j - h : j + cap - h;
        Py_ssize_t from_i = j >= i ? j - i : j + cap - i;
        if (from_home >= from_i) {
            s[i] = s[j];
            i = j;
        }
    }
    s[i].value = NULL;
    s[i].key = 0;
    t->used--;
    t->version++;
    return v;
}

/* rehash(t, new_cap) for a shrink on delete, or 1 (the table untouched) when an entry would
 * land more than MAX_SHRINK_PROBE slots past its home. Homes follow hash order, so after keys
 * were deleted in hash order (a sweep of the index, a wipe) the survivors crowd one part of
 * hash space: squeezed to a load of 1/2 overall, that part would hold more keys than slots
 * and become one run around the table, whose every delete shifts it all (a wipe of 1M keys
 * took 82 s that way). Such a shrink waits until the keys are spread again (shrink_below,
 * KeyTable.shrink). -1 with MemoryError set. */
static int try_shrink(KeyTable *t, Py_ssize_t new_cap) {
    return rehash(t, new_cap, MAX_SHRINK_PROBE);
}

/* After a delete: give memory back once the load falls under 1/4 (a failed or refused shrink
 * is not an error: the table stays as it is; a refused one is retried at half the keys). */
static void maybe_shrink(KeyTable *t) {
    if (t->used == 0) {
        (void)resize(t, 0);
        t->shrink_below = 0;
    }
    else if (t->cap > MIN_CAP && UNDER_FULL(t->used, t->cap) &&
             (t->shrink_below == 0 || t->used < t->shrink_below)) {
        int r = try_shrink(t, t->used * 2);
        if (r < 0) {
            PyErr_Clear();
        }
        else {
            t->shrink_below = r ? (t->used / 2 > 0 ? t->used / 2 : 1) : 0;
        }
    }
}

/* Store value under key (a new reference is taken); -1 on MemoryError. */
static int store(KeyTable *t, uint64_t key, PyObject *value) {
    /* like a dict of ints, a table of ints stays out of the cyclic GC: it is tracked from the
     * first value that could take part in a cycle */
    if (!PyObject_GC_IsTracked((PyObject *)t) && PyObject_IS_GC(value)) {
        PyObject_GC_Track((PyObject *)t);
    }
    Py_ssize_t i = find(t, key);
    if (i >= 0) {
        PyObject *old = t->slots[i].value;
        Py_INCREF(value);
        t->slots[i].value = value;
        Py_DECREF(old); /* last: its finalizer may use the table */
        return 0;
    }
    if (t->cap == 0 || OVER_FULL(t->used + 1, t->cap)) {
        if (resize(t, (t->used + 1) * 2) < 0) {
            return -1;
        }
    }
    i = home_of(t, key);
    while (t->slots[i].value != NULL) {
        if (++i == t->cap) {
            i = 0;
        }
    }
    Py_INCREF(value);
    t->slots[i].key = key;
    t->slots[i].value = value;
    t->used++;
    t->version++;
    return 0;
}

/* ------------------------------------------------------------------- the type */

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seed", NULL};
    PyObject *seed_obj = NULL;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O!:KeyTable", kwlist, &PyLong_Type,
                                     &seed_obj)) {
        return NULL;
    }
    if (seed_obj != NULL) {
        seed = PyLong_AsUnsignedLongLong(seed_obj); /* checked: "K" would wrap */
        if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (t == NULL) {
        return NULL;
    }
    /* tp_alloc tracks GC objects; an empty table or one of ints needs no traversal */
    PyObject_GC_UnTrack(t);
    t->slots = NULL;
    t->cap = t->used = 0;
    t->seed = (uint64_t)seed;
    t->cursor = 0;
    t->version = 0;
    t->shrink_below = 0;
    return (PyObject *)t;
}

static int KeyTable_traverse(KeyTable *t, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        Py_VISIT(t->slots[i].value);
    }
    return 0;
}

static int KeyTable_clear(KeyTable *t) {
    Slot *old = t->slots;
    Py_ssize_t cap = t->cap;
    t->slots = NULL;
    t->cap = t->used = 0;
    t->version++;
    for (Py_ssize_t i = 0; i < cap; i++) {
        Py_XDECREF(old[i].value);
    }
    PyMem_Free(old);
    return 0;
}

static void KeyTable_dealloc(KeyTable *t) {
    PyObject_GC_UnTrack(t);
    Py_TRASHCAN_BEGIN(t, KeyTable_dealloc)
    (void)KeyTable_clear(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
    Py_TRASHCAN_END
}

static Py_ssize_t KeyTable_len(KeyTable *t) { return t->used; }

static PyObject *KeyTable_subscript(KeyTable *t, PyObject *k) {
    uint64_t key;
    int ok = as_key(k, &key);
    if (ok < 0) {
        return NULL;
    }
    Py_ssize_t i = ok ? find(t, key) : -1;
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, k);
        return NULL;
    }
    PyObject *v = t->slots[i].value;
    Py_INCREF(v);
    return v;
}

static int KeyTable_ass_subscript(KeyTable *t, PyObject *k, PyObject *v) {
    uint64_t key;
    if (v != NULL) {
        if (as_key_strict(k, &key) < 0) {
            return -1;
        }
        return store(t, key, v);
    }
    int ok = as_key(k, &key);
    if (ok < 0) {
        return -1;
    }
    Py_ssize_t i = ok ? find(t, key) : -1;
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, k);
        return -1;
    }
    PyObject *old = take_slot(t, i);
    maybe_shrink(t);
    Py_DECREF(old);
    return 0;
}

static int KeyTable_contains(KeyTable *t, PyObject *k) {
    uint64_t key;
    int ok = as_key(k, &key);
    if (ok <= 0) {
        return ok;
    }
    return find(t, key) >= 0;
}

static PyObject *KeyTable_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    uint64_t key;
    int ok = as_key(args[0], &key);
    if (ok < 0) {
        return NULL;
    }
    Py_ssize_t i = ok ? find(t, key) : -1;
    PyObject *v = i >= 0 ? t->slots[i].value : (nargs == 2 ? args[1] : Py_None);
    Py_INCREF(v);
    return v;
}

static PyObject *KeyTable_pop_some(KeyTable *t, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "pop_some(n) needs n >= 0");
        return NULL;
    }
    if (n > t->used) {
        n = t->used;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL || n == 0) {
        return out;
    }
    /* Entries are taken in slot order, each as it is reached. The slot index does not move
     * on after a take: the shift-back of take_slot may have moved a later entry of the run
     * into it. So no entry ever moves behind the sweep (taking them all first and deleting
     * after would shift some of the run behind it, to be missed for a whole round). */
    Py_ssize_t cap = t->cap, i = (Py_ssize_t)mulhi(t->cursor, (uint64_t)cap), got = 0;
    uint64_t last = 0;
    while (got < n) {
        Slot *s = &t->slots[i];
        if (s->value == NULL) {
            if (++i == cap) {
                i = 0;
            }
            continue;
        }
        PyObject *key = PyLong_FromUnsignedLongLong(s->key);
        PyObject *pair = key != NULL ? PyTuple_New(2) : NULL;
        if (pair != NULL) {
            PyTuple_SET_ITEM(pair, 0, key);
        }
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            if (pair == NULL) {
                Py_XDECREF(key);
            }
            Py_XDECREF(pair);
            if (got == 0) {
                Py_DECREF(out);
                return NULL;
            }
            PyErr_Clear(); /* out of memory: return the entries taken so far ("up to n") */
            break;
        }
        last = s->key;
        PyTuple_SET_ITEM(pair, 1, take_slot(t, i)); /* the table's reference moves there */
        Py_DECREF(pair);                             /* the list holds it */
        got++;
    }
    /* the next pop_some goes on from here, in hash space (a clock sweep) */
    t->cursor = mix(last, t->seed) + 1;
    /* shrink to a load of 1/2 at most, so the memory the caller freed shows at once */
    if (t->used == 0) {
        (void)resize(t, 0);
    }
    else if (t->used * 2 < t->cap && t->cap > MIN_CAP) {
        if (resize(t, t->used * 2) < 0) {
            PyErr_Clear();
        }
    }
    return out;
}

/* ceil(e * 2**64 / cap) for 0 < e < cap: the least hash whose home (mulhi(hash, cap)) is e. */
static uint64_t first_hash_of(uint64_t e, uint64_t cap) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 num = ((unsigned __int128)e << 64) + (cap - 1);
    return (uint64_t)(num / cap);
#else
    /* long division of (e:0) by cap, a bit at a time; the quotient fits (e < cap) */
    uint64_t rem = e, q = 0;
    for (int b = 63; b >= 0; b--) {
        int carry = (rem >> 63) != 0;
        rem <<= 1;
        q <<= 1;
        if (carry || rem >= cap) {
            rem -= cap;
            q |= 1;
        }
    }
    return rem ? q + 1 : q;
#endif
}

typedef struct {
    uint64_t key;
    PyObject *value; /* a new reference */
} Hit;

static PyObject *KeyTable_scan(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "scan expected 3 arguments, got %zd", nargs);
        return NULL;
    }
    uint64_t c;
    if (!PyLong_Check(args[0]) || as_key(args[0], &c) != 1) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "scan(cursor, n, mask): cursor in [0, 2**64)");
        }
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *mask = args[2];
    if (n < 1 || !PyLong_CheckExact(mask)) {
        PyErr_SetString(PyExc_ValueError, "scan(cursor, n, mask): n >= 1 and mask an int");
        return NULL;
    }
    Py_ssize_t cap = t->cap;
    Py_ssize_t s = cap ? (Py_ssize_t)mulhi(c, (uint64_t)cap) : 0;
    int done = cap == 0 || n >= cap - s;
    Py_ssize_t e = done ? cap : s + n;
    uint64_t d = done ? 0 : first_hash_of((uint64_t)e, (uint64_t)cap);
    /* Phase 1 reads the slots and allocates nothing the cyclic GC tracks (ints only), so no
     * finalizer can run and change the table under it; phase 2 builds the tuples. */
    Hit *hits = NULL;
    Py_ssize_t nhits = 0, room = 0;
    PyObject *clean[8] = {NULL}; /* values seen with no bit of mask (most are shared bits) */
    uint64_t seed = t->seed;
    for (Py_ssize_t walk = 0; walk < cap; walk++) {
        Py_ssize_t i = s + walk < cap ? s + walk : s + walk - cap;
        Slot *sl = &t->slots[i];
        if (sl->value == NULL) {
            if (walk >= e - s) {
                break; /* past the range's last home and its run */
            }
            continue;
        }
        uint64_t h = mix(sl->key, seed);
        if (h < c || (!done && h >= d)) {
            continue;
        }
        PyObject *v = sl->value;
        size_t ci = ((uintptr_t)v >> 4) & 7;
        if (clean[ci] == v) {
            continue;
        }
        if (!PyLong_CheckExact(v)) {
            PyErr_SetString(PyExc_TypeError, "scan needs a table of int values");
            goto fail;
        }
        PyObject *both = PyNumber_And(v, mask);
        if (both == NULL) {
            goto fail;
        }
        int hit = PyObject_IsTrue(both);
        Py_DECREF(both);
        if (!hit) {
            clean[ci] = v;
            continue;
        }
        if (nhits == room) {
            Py_ssize_t more = room ? room * 2 : 64;
            Hit *grown = PyMem_Realloc(hits, (size_t)more * sizeof(Hit));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            hits = grown;
            room = more;
        }
        Py_INCREF(v);
        hits[nhits].key = sl->key;
        hits[nhits].value = v;
        nhits++;
    }
    PyObject *out = PyList_New(nhits), *next = NULL, *ret = NULL;
    if (out == NULL) {
        goto fail;
    }
    for (Py_ssize_t k = 0; k < nhits; k++) {
        PyObject *key = PyLong_FromUnsignedLongLong(hits[k].key);
        PyObject *pair = key != NULL ? PyTuple_New(2) : NULL;
        if (pair == NULL) {
            Py_XDECREF(key);
            Py_DECREF(out);
            goto fail;
        }
        PyTuple_SET_ITEM(pair, 0, key);
        PyTuple_SET_ITEM(pair, 1, hits[k].value); /* its reference moves there */
        hits[k].value = NULL;
        PyList_SET_ITEM(out, k, pair);
    }
    PyMem_Free(hits);
    if (done) {
        Py_INCREF(Py_None);
        next = Py_None;
    }
    else {
        next = PyLong_FromUnsignedLongLong(d);
    }
    if (next == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    ret = PyTuple_Pack(2, out, next);
    Py_DECREF(out);
    Py_DECREF(next);
    return ret;
fail:
    for (Py_ssize_t k = 0; k < nhits; k++) {
        Py_XDECREF(hits[k].value);
    }
    PyMem_Free(hits);
    return NULL;
}

static PyObject *KeyTable_shrink(KeyTable *t, PyObject *unused) {
    (void)unused;
    t->shrink_below = 0;
    maybe_shrink(t);
    Py_RETURN_NONE;
}

static PyObject *KeyTable_sizeof(KeyTable *t, PyObject *unused) {
    (void)unused;
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(KeyTable) + t->cap * (Py_ssize_t)sizeof(Slot));
}

static PyObject *make_iter(KeyTable *t, int kind) {
    KeyTableIter *it = PyObject_GC_New(KeyTableIter, &KeyTableIterType);
    if (it == NULL) {
        return NULL;
    }
    Py_INCREF(t);
    it->table = t;
    it->pos = 0;
    it->version = t->version;
    it->kind = kind;
    PyObject_GC_Track(it);
    return (PyObject *)it;
}

static PyObject *KeyTable_iter(KeyTable *t) { return make_iter(t, 0); }
static PyObject *KeyTable_keys(KeyTable *t, PyObject *unused) {
    (void)unused;
    return make_iter(t, 0);
}
static PyObject *KeyTable_values(KeyTable *t, PyObject *unused) {
    (void)unused;
    return make_iter(t, 1);
}
static PyObject *KeyTable_items(KeyTable *t, PyObject *unused) {
    (void)unused;
    return make_iter(t, 2);
}

static PyObject *KeyTable_capacity(KeyTable *t, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(t->cap);
}

static PyObject *KeyTable_repr(KeyTable *t) {
    return PyUnicode_FromFormat("<KeyTable: %zd keys in %zd slots>", t->used, t->cap);
}

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL,
     "get(key, default=None): the value of key, or default. A key no table can hold (not an "
     "int in [0, 2**64)) is simply not found."},
    {"pop_some", (PyCFunction)KeyTable_pop_some, METH_O,
     "pop_some(n): remove up to n entries and return them as [(key, value)], in hash order "
     "from where the previous call stopped (a clock sweep); then shrink to fit."},
    {"scan", (PyCFunction)(void (*)(void))KeyTable_scan, METH_FASTCALL,
     "scan(cursor, n, mask) -> (pairs, next): every entry whose key's position in hash order "
     "is in [cursor, next) and whose value & mask is not 0, as [(key, value)]; next is chosen "
     "so that about n slots are read (None: the range reached the end). Positions do not move "
     "when the table resizes, so scan(0, ...), scan(next, ...), ... visits every key present "
     "throughout, however the table changes between calls. Values must be ints."},
    {"shrink", (PyCFunction)KeyTable_shrink, METH_NOARGS,
     "shrink(): give memory back now if the load is under 1/4 (a shrink on delete waits while "
     "the keys crowd one part of hash space, as after a scan deleted in hash order)."},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "An iterator over the keys."},
    {"values", (PyCFunction)KeyTable_values, METH_NOARGS, "An iterator over the values."},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS, "An iterator over (key, value)."},
    {"__sizeof__", (PyCFunction)KeyTable_sizeof, METH_NOARGS,
     "Bytes allocated: the object and its slot array."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyTable_getset[] = {
    {"capacity", (getter)KeyTable_capacity, NULL, "Slots allocated.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods KeyTable_as_mapping = {
    (lenfunc)KeyTable_len,
    (binaryfunc)KeyTable_subscript,
    (objobjargproc)KeyTable_ass_subscript,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.core._keytable.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "KeyTable(seed=0): a hash table from ints in [0, 2**64) to objects, 16 bytes "
              "per slot (docs/index-memory.md).",
    .tp_new = KeyTable_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_traverse = (traverseproc)KeyTable_traverse,
    .tp_clear = (inquiry)KeyTable_clear,
    .tp_iter = (getiterfunc)KeyTable_iter,
    .tp_methods = KeyTable_methods,
    .tp_getset = KeyTable_getset,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_repr = (reprfunc)KeyTable_repr,
    .tp_hash = PyObject_HashNotImplemented,
};

/* ------------------------------------------------------------------- iterators */

static void KeyTableIter_dealloc(KeyTableIter *it) {
    PyObject_GC_UnTrack(it);
    Py_XDECREF(it->table);
    PyObject_GC_Del(it);
}

static int KeyTableIter_traverse(KeyTableIter *it, visitproc visit, void *arg) {
    Py_VISIT(it->table);
    return 0;
}

static PyObject *KeyTableIter_next(KeyTableIter *it) {
    KeyTable *t = it->table;
    if (t == NULL) {
        return NULL;
    }
    if (t->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "KeyTable changed size during iteration");
        return NULL;
    }
    while (it->pos < t->cap) {
        Slot *s = &t->slots[it->pos++];
        if (s->value == NULL) {
            continue;
        }
        if (it->kind == 1) {
            Py_INCREF(s->value);
            return s->value;
        }
        PyObject *key = PyLong_FromUnsignedLongLong(s->key);
        if (key == NULL || it->kind == 0) {
            return key;
        }
        PyObject *pair = PyTuple_New(2);
        if (pair == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        Py_INCREF(s->value);
        PyTuple_SET_ITEM(pair, 0, key);
        PyTuple_SET_ITEM(pair, 1, s->value);
        return pair;
    }
    it->table = NULL;
    Py_DECREF(t);
    return NULL;
}

static PyTypeObject KeyTableIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.core._keytable.KeyTableIterator",
    .tp_basicsize = sizeof(KeyTableIter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)KeyTableIter_dealloc,
    .tp_traverse = (traverseproc)KeyTableIter_traverse,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)KeyTableIter_next,
};

/* ------------------------------------------------------------------- leading_walk */

/* router/core/predict.py _Masks.leading_runs' walk over a request's chain, in C: per block the
 * (tier, group) tables' replica bitmasks, narrowed into `alive`, recording the block index at
 * which each replica bit drops out. The Python loop is the reference (tests/test_leading_walk.py
 * holds the two equal); this one differs only in how it learns that nothing dropped.
 *
 * Masks are Python ints of any width (a bit per replica slot). Most blocks of a walk drop no
 * bit: `alive` is a subset of the block's mask (of each mask, ANDing groups; of their union,
 * ORing them). On CPython < 3.12 that test reads the ints' 30-bit digits in place (no object
 * made); elsewhere, or for an int subclass or a negative int, it is the Python expression
 * `alive & m == alive`, with the mask object that last passed it remembered (a key one replica
 * alone holds stores that replica's shared bit object, so runs of one object are common). A
 * block that does drop bits goes through exactly the Python loop's int operations. */

#if PY_VERSION_HEX < 0x030C0000
#define DIGITS_IN_PLACE 1
/* 3.11's layout (cpython/longintrepr.h): ob_size is the digit count, negative for a negative
 * int; ob_digit the little-endian PyLong_SHIFT-bit digits. */
static inline Py_ssize_t long_size(PyObject *o) { return Py_SIZE(o); }
static inline const digit *long_digits(PyObject *o) { return ((PyLongObject *)o)->ob_digit; }
#else
#define DIGITS_IN_PLACE 0
#endif

static PyObject *ZERO;    /* the int 0: an absent key's mask */
static PyObject *STR_GET; /* "get", for a table that is neither a KeyTable nor a dict */

/* The mask `table` holds for `h` (0 when absent): a new reference, or NULL with an error. */
static PyObject *mask_of(PyObject *table, PyObject *h) {
    PyObject *v;
    if (Py_IS_TYPE(table, &KeyTableType)) {
        KeyTable *t = (KeyTable *)table;
        uint64_t key;
        int ok = as_key(h, &key);
        if (ok < 0) {
            return NULL;
        }
        Py_ssize_t i = ok ? find(t, key) : -1;
        v = i >= 0 ? t->slots[i].value : ZERO;
    }
    else if (PyDict_CheckExact(table)) {
        v = PyDict_GetItemWithError(table, h);
        if (v == NULL) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            v = ZERO;
        }
    }
    else {
        return PyObject_CallMethodObjArgs(table, STR_GET, h, ZERO, NULL);
    }
    Py_INCREF(v);
    return v;
}

/* 1: `alive` is a subset of every mask (any_group 0) or of their union (any_group 1);
 * 0: it is not; -1: cannot tell in place (not exact non-negative ints, or not this CPython). */
static int covered_in_place(PyObject *alive, PyObject **ms, Py_ssize_t nt, int any_group) {
#if DIGITS_IN_PLACE
    if (!PyLong_CheckExact(alive) || long_size(alive) < 0) {
        return -1;
    }
    for (Py_ssize_t t = 0; t < nt; t++) {
        if (!PyLong_CheckExact(ms[t]) || long_size(ms[t]) < 0) {
            return -1;
        }
    }
    Py_ssize_t na = long_size(alive);
    const digit *a = long_digits(alive);
    for (Py_ssize_t d = 0; d < na; d++) {
        digit need = a[d], have = any_group ? 0 : (digit)-1;
        for (Py_ssize_t t = 0; t < nt; t++) {
            digit md = d < long_size(ms[t]) ? long_digits(ms[t])[d] : 0;
            have = any_group ? (have | md) : (have & md);
        }
        if (need & ~have) {
            return 0;
        }
    }
    return 1;
#else
    (void)alive;
    (void)ms;
    (void)nt;
    (void)any_group;
    return -1;
#endif
}

/* The block's combined mask as the Python loop computes it: `alive & m1 & m2 ...`, or
 * `m1 | m2 | ...` for any_group (one table: its mask). A new reference or NULL. */
static PyObject *combined(PyObject *alive, PyObject **ms, Py_ssize_t nt, int any_group) {
    if (nt == 1) {
        Py_INCREF(ms[0]);
        return ms[0];
    }
    PyObject *m = any_group ? ZERO : alive;
    Py_INCREF(m);
    for (Py_ssize_t t = 0; t < nt; t++) {
        PyObject *next = any_group ? PyNumber_Or(m, ms[t]) : PyNumber_And(m, ms[t]);
        Py_DECREF(m);
        if (next == NULL) {
            return NULL;
        }
        m = next;
    }
    return m;
}

/* Narrow *alive by mask m (the Python loop's body past the lookups): record each dropped bit
 * at block j in `stopped`. 0, or -1 with an error. */
static int narrow(PyObject **alive, PyObject *m, PyObject *stopped, Py_ssize_t j) {
    PyObject *inv = PyNumber_Invert(m);
    if (inv == NULL) {
        return -1;
    }
    PyObject *dropped = PyNumber_And(*alive, inv);
    Py_DECREF(inv);
    if (dropped == NULL) {
        return -1;
    }
    int any = PyObject_IsTrue(dropped);
    if (any <= 0) {
        Py_DECREF(dropped);
        return any;
    }
    PyObject *next = PyNumber_And(*alive, m);
    PyObject *jobj = next != NULL ? PyLong_FromSsize_t(j) : NULL;
    if (jobj == NULL) {
        Py_XDECREF(next);
        Py_DECREF(dropped);
        return -1;
    }
    Py_SETREF(*alive, next);
    int rc = 0;
    while (rc == 0 && (any = PyObject_IsTrue(dropped)) > 0) {
        PyObject *neg = PyNumber_Negative(dropped);
        PyObject *low = neg != NULL ? PyNumber_And(dropped, neg) : NULL;
        Py_XDECREF(neg);
        PyObject *rest = low != NULL ? PyNumber_Xor(dropped, low) : NULL;
        if (rest == NULL || PyObject_SetItem(stopped, low, jobj) < 0) {
            rc = -1;
        }
        Py_XDECREF(low);
        if (rest != NULL) {
            Py_SETREF(dropped, rest);
        }
    }
    Py_DECREF(jobj);
    Py_DECREF(dropped);
    return any < 0 ? -1 : rc;
}

#define MAX_WALK_TABLES 64
#define PREFETCH_SLOTS 16
#define PREFETCH_VALUES 8
#define RING 32 /* > PREFETCH_SLOTS */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

static PyObject *leading_walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError,
                     "leading_walk(wires, i, k, tables, any_group, alive, stopped, j) takes 8 "
                     "arguments, got %zd",
                     nargs);
        return NULL;
    }
    PyObject *wires = args[0], *tables = args[3], *stopped = args[6];
    if (!PyList_Check(wires) || !PyTuple_Check(tables) || !PyDict_Check(stopped)) {
        PyErr_SetString(PyExc_TypeError,
                        "leading_walk needs wires as a list, tables as a tuple and stopped as a "
                        "dict");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    Py_ssize_t k = i == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[2]);
    Py_ssize_t j = k == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[7]);
    int any_group = j == -1 && PyErr_Occurred() ? -1 : PyObject_IsTrue(args[4]);
    if (any_group < 0) {
        return NULL;
    }
    Py_ssize_t nt = PyTuple_GET_SIZE(tables);
    if (i < 0 || k < 1 || j < 0 || nt < 1 || nt > MAX_WALK_TABLES) {
        PyErr_Format(PyExc_ValueError,
                     "leading_walk needs i >= 0, k >= 1, j >= 0 and 1 to %d tables",
                     MAX_WALK_TABLES);
        return NULL;
    }
    PyObject *ms[MAX_WALK_TABLES];
    PyObject *alive = args[5];
    PyObject *last_cover = NULL; /* the one-table mask object alive was last a subset of */
    Py_INCREF(alive);
    int truth = PyObject_IsTrue(alive);
    if (truth < 0) {
        goto fail;
    }
    /* Keys of the blocks ahead, read once into a ring: a block's KeyTable slots are prefetched
     * PREFETCH_SLOTS blocks before it is walked, its mask objects PREFETCH_VALUES blocks
     * before (the slots being there by then), so the cache misses of a long walk overlap. */
    uint64_t ring[RING];
    signed char ring_ok[RING];
    Py_ssize_t s = 0, ahead = 0; /* blocks walked / whose keys are read, from i */
    const Py_ssize_t i0 = i;
    while (truth && i < PyList_GET_SIZE(wires)) {
        Py_ssize_t n_wires = PyList_GET_SIZE(wires);
        for (; ahead < s + PREFETCH_SLOTS && i0 + ahead * k < n_wires; ahead++) {
            int ok = as_key(PyList_GET_ITEM(wires, i0 + ahead * k), &ring[ahead % RING]);
            if (ok < 0) {
                goto fail;
            }
            ring_ok[ahead % RING] = (signed char)ok;
            for (Py_ssize_t t = 0; ok && t < nt; t++) {
                KeyTable *kt = (KeyTable *)PyTuple_GET_ITEM(tables, t);
                if (Py_IS_TYPE(kt, &KeyTableType) && kt->used) {
                    PREFETCH(&kt->slots[home_of(kt, ring[ahead % RING])]);
                }
            }
        }
        Py_ssize_t v = s + PREFETCH_VALUES;
        for (Py_ssize_t t = 0; v < ahead && ring_ok[v % RING] && t < nt; t++) {
            KeyTable *kt = (KeyTable *)PyTuple_GET_ITEM(tables, t);
            Py_ssize_t at = Py_IS_TYPE(kt, &KeyTableType) ? find(kt, ring[v % RING]) : -1;
            if (at >= 0) {
                PREFETCH(kt->slots[at].value);
            }
        }
        PyObject *h = PyList_GET_ITEM(wires, i);
        Py_INCREF(h);
        Py_ssize_t got = 0;
        for (; got < nt; got++) {
            PyObject *table = PyTuple_GET_ITEM(tables, got);
            if (Py_IS_TYPE(table, &KeyTableType)) { /* mask_of, with the key read above */
                KeyTable *kt = (KeyTable *)table;
                Py_ssize_t at = ring_ok[s % RING] ? find(kt, ring[s % RING]) : -1;
                ms[got] = at >= 0 ? kt->slots[at].value : ZERO;
                Py_INCREF(ms[got]);
                continue;
            }
            ms[got] = mask_of(table, h);
            if (ms[got] == NULL) {
                break;
            }
        }
        Py_DECREF(h);
        int cover = got < nt ? -2 : (nt == 1 && ms[0] == last_cover) ? 1 : -1;
        if (cover == -1) {
            cover = covered_in_place(alive, ms, nt, any_group);
        }
        if (cover == -1 && nt == 1) {
            /* not readable in place: `alive & m == alive`, remembering m when it holds */
            PyObject *both = PyNumber_And(alive, ms[0]);
            cover = both == NULL ? -2 : PyObject_RichCompareBool(both, alive, Py_EQ);
            Py_XDECREF(both);
            cover = cover < 0 ? -2 : cover;
            if (cover == 1) {
                Py_INCREF(ms[0]);
                Py_XSETREF(last_cover, ms[0]);
            }
        }
        if (cover != 1 && cover != -2) {
            PyObject *m = combined(alive, ms, nt, any_group);
            cover = m == NULL || narrow(&alive, m, stopped, j) < 0 ? -2 : 0;
            Py_XDECREF(m);
            if (cover == 0 && (truth = PyObject_IsTrue(alive)) < 0) {
                cover = -2;
            }
        }
        for (Py_ssize_t t = 0; t < got; t++) {
            Py_DECREF(ms[t]);
        }
        if (cover == -2) {
            goto fail;
        }
        if (truth) {
            j++;
            i += k;
            s++;
        }
    }
    Py_XDECREF(last_cover);
    return Py_BuildValue("(Nn)", alive, j);
fail:
    Py_XDECREF(last_cover);
    Py_DECREF(alive);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"leading_walk", (PyCFunction)(void (*)(void))leading_walk, METH_FASTCALL,
     "leading_walk(wires, i, k, tables, any_group, alive, stopped, j) -> (alive, j)\n\n"
     "Walk blocks wires[i], wires[i+k], ... while `alive` (a replica bitmask int) is not 0: "
     "each block's mask is the AND over `tables` (a tuple of KeyTables or dicts) of "
     "table.get(wire, 0), or their OR with any_group; a bit of alive the mask lacks is "
     "dropped and stopped[bit] = j, the block's number; j counts blocks every surviving bit "
     "matched. router/core/predict.py _Masks.leading_runs is the reference."},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------- module */

static struct PyModuleDef keytable_module = {
    PyModuleDef_HEAD_INIT, "router.core._keytable",
    "A compact uint64 -> object hash table for the router's index (docs/index-memory.md), and "
    "the walk of a request's chain over such tables (docs/decision-cost.md).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__keytable(void) {
    if (PyType_Ready(&KeyTableType) < 0 || PyType_Ready(&KeyTableIterType) < 0) {
        return NULL;
    }
    if (ZERO == NULL && (ZERO = PyLong_FromLong(0)) == NULL) {
        return NULL;
    }
    if (STR_GET == NULL && (STR_GET = PyUnicode_InternFromString("get")) == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&keytable_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
