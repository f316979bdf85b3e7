/* kvswarm._digest_index: the catalog's index, 16-byte key digest -> row, as one open-addressing table.
 *
 * Why native: a batched read looks up every key of the batch in the catalog, and with a Python dict
 * of a few hundred thousand digests each lookup chases three or four pointers into cold memory
 * (the table's slot, its entry, the key object, the row's int object): about 1.5 us per key in the
 * store's read loop, a quarter of a verified 4 KiB read's CPU.  Here a key's slot holds its digest
 * and row side by side, and a whole batch is looked up in one call.
 *
 * Digests are xxh3-128 outputs, so their first 8 bytes already spread evenly; they are mixed with a
 * per-table random seed anyway, so that keys chosen to collide cannot build long probe chains.
 * Linear probing; deleted slots become tombstones until the next rehash.  Every method runs with the
 * GIL held and never releases it, so each call is atomic to Python threads, as a dict's are.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define EMPTY (-1)
#define TOMB (-2)
#define DIGEST 16

typedef struct {
    PyObject_HEAD
    uint8_t *keys;     /* DIGEST bytes per slot */
    int64_t *vals;     /* row, EMPTY or TOMB per slot */
    Py_ssize_t cap;    /* a power of two */
    Py_ssize_t len;    /* live keys */
    Py_ssize_t used;   /* live keys + tombstones */
    uint64_t seed;
} Index;

static inline Py_ssize_t home(const Index *x, const uint8_t *d) {
    uint64_t h;
    memcpy(&h, d, 8);
    h = (h ^ x->seed) * 0x9E3779B97F4A7C15ull;
    return (Py_ssize_t)(h >> 17) & (x->cap - 1);
}

/* The slot holding d, or -1. */
static Py_ssize_t find(const Index *x, const uint8_t *d) {
    Py_ssize_t mask = x->cap - 1;
    for (Py_ssize_t s = home(x, d);; s = (s + 1) & mask) {
        int64_t v = x->vals[s];
        if (v == EMPTY) return -1;
        if (v != TOMB && memcmp(x->keys + s * DIGEST, d, DIGEST) == 0) return s;
    }
}

static int alloc_table(Index *x, Py_ssize_t cap) {
    uint8_t *k = PyMem_Malloc((size_t)cap * DIGEST);
    int64_t *v = PyMem_Malloc((size_t)cap * sizeof(int64_t));
    if (k == NULL || v == NULL) {
        PyMem_Free(k);
        PyMem_Free(v);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < cap; i++) v[i] = EMPTY;
    x->keys = k;
    x->vals = v;
    x->cap = cap;
    x->len = x->used = 0;
    return 0;
}

/* Rehash into a table sized for `want` live keys at most half full (tombstones dropped). */
static int resize(Index *x, Py_ssize_t want) {
    Py_ssize_t cap = 16;
    while (cap < 2 * want) cap <<= 1;
    uint8_t *ok = x->keys;
    int64_t *ov = x->vals;
    Py_ssize_t ocap = x->cap;
    if (alloc_table(x, cap) < 0) {
        x->keys = ok;
        x->vals = ov;
        x->cap = ocap;
        return -1;
    }
    Py_ssize_t n = 0, mask = cap - 1;
    for (Py_ssize_t i = 0; i < ocap; i++) {
        if (ov[i] < 0) continue;
        Py_ssize_t s = home(x, ok + i * DIGEST);
        while (x->vals[s] != EMPTY) s = (s + 1) & mask;
        memcpy(x->keys + s * DIGEST, ok + i * DIGEST, DIGEST);
        x->vals[s] = ov[i];
        n++;
    }
    x->len = x->used = n;
    PyMem_Free(ok);
    PyMem_Free(ov);
    return 0;
}

/* A digest argument's bytes, or NULL: a 16-byte bytes object is a digest; any other key cannot be held
 * (missing = 1 then, no exception), unless `strict`, which raises. */
static const uint8_t *digest_of(PyObject *k, int strict, int *missing) {
    *missing = 0;
    if (PyBytes_Check(k) && PyBytes_GET_SIZE(k) == DIGEST) return (const uint8_t *)PyBytes_AS_STRING(k);
    if (strict) {
        PyErr_Format(PyExc_TypeError, "a key digest is 16 bytes, not %R", k);
        return NULL;
    }
    *missing = 1;
    return NULL;
}

static int set_item(Index *x, const uint8_t *d, int64_t row) {
    if (row < 0) {
        PyErr_SetString(PyExc_ValueError, "a row is a non-negative integer");
        return -1;
    }
    Py_ssize_t s = find(x, d);
    if (s >= 0) {
        x->vals[s] = row;
        return 0;
    }
    if ((x->used + 1) * 10 > x->cap * 7 && resize(x, x->len + 1) < 0) return -1;
    Py_ssize_t mask = x->cap - 1;
    for (s = home(x, d); x->vals[s] >= 0; s = (s + 1) & mask) {}
    if (x->vals[s] == EMPTY) x->used++;
    memcpy(x->keys + s * DIGEST, d, DIGEST);
    x->vals[s] = row;
    x->len++;
    return 0;
}

static void del_slot(Index *x, Py_ssize_t s) {
    /* Before an empty slot no probe chain goes on past s: it can become empty itself. */
    if (x->vals[(s + 1) & (x->cap - 1)] == EMPTY) {
        x->vals[s] = EMPTY;
        x->used--;
    } else {
        x->vals[s] = TOMB;
    }
    x->len--;
}

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "DigestIndex() takes no arguments");
        return NULL;
    }
    Index *x = (Index *)type->tp_alloc(type, 0);
    if (x == NULL) return NULL;
    if (getrandom(&x->seed, sizeof x->seed, 0) != (ssize_t)sizeof x->seed) x->seed = (uint64_t)(uintptr_t)x;
    if (alloc_table(x, 16) < 0) {
        Py_DECREF(x);
        return NULL;
    }
    return (PyObject *)x;
}

static void Index_dealloc(Index *x) {
    PyMem_Free(x->keys);
    PyMem_Free(x->vals);
    Py_TYPE(x)->tp_free((PyObject *)x);
}

static Py_ssize_t Index_len(Index *x) { return x->len; }

static int Index_contains(Index *x, PyObject *k) {
    int missing;
    const uint8_t *d = digest_of(k, 0, &missing);
    return missing ? 0 : find(x, d) >= 0;
}

static PyObject *Index_subscript(Index *x, PyObject *k) {
    int missing;
    const uint8_t *d = digest_of(k, 0, &missing);
    Py_ssize_t s = missing ? -1 : find(x, d);
    if (s < 0) {
        PyErr_SetObject(PyExc_KeyError, k);
        return NULL;
    }
    return PyLong_FromLongLong(x->vals[s]);
}

static int Index_ass_subscript(Index *x, PyObject *k, PyObject *v) {
    int missing;
    const uint8_t *d = digest_of(k, v != NULL, &missing);
    if (v == NULL) {
        Py_ssize_t s = missing ? -1 : find(x, d);
        if (s < 0) {
            PyErr_SetObject(PyExc_KeyError, k);
            return -1;
        }
        del_slot(x, s);
        return 0;
    }
    if (d == NULL) return -1;
    long long row = PyLong_AsLongLong(v);
    if (row == -1 && PyErr_Occurred()) return -1;
    return set_item(x, d, row);
}

static PyObject *Index_get(Index *x, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(digest, default=None)");
        return NULL;
    }
    int missing;
    const uint8_t *d = digest_of(args[0], 0, &missing);
    Py_ssize_t s = missing ? -1 : find(x, d);
    if (s >= 0) return PyLong_FromLongLong(x->vals[s]);
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

static PyObject *Index_pop(Index *x, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(digest[, default])");
        return NULL;
    }
    int missing;
    const uint8_t *d = digest_of(args[0], 0, &missing);
    Py_ssize_t s = missing ? -1 : find(x, d);
    if (s >= 0) {
        int64_t row = x->vals[s];
        del_slot(x, s);
        return PyLong_FromLongLong(row);
    }
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *Index_update(Index *x, PyObject *pairs) {
    PyObject *it = PyObject_GetIter(pairs);
    if (it == NULL) return NULL;
    PyObject *item;
    while ((item = PyIter_Next(it)) != NULL) {
        PyObject *k, *v;
        int rc = -1;
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2) {
            k = PyTuple_GET_ITEM(item, 0);
            v = PyTuple_GET_ITEM(item, 1);
            rc = Index_ass_subscript(x, k, v);
        } else {
            PyErr_SetString(PyExc_TypeError, "update() takes (digest, row) pairs");
        }
        Py_DECREF(item);
        if (rc < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Index_clear(Index *x, PyObject *unused) {
    for (Py_ssize_t i = 0; i < x->cap; i++) x->vals[i] = EMPTY;
    x->len = x->used = 0;
    Py_RETURN_NONE;
}

/* The digests held, as a new list (a snapshot: the table may change while a caller walks it). */
static PyObject *Index_keys(Index *x, PyObject *unused) {
    PyObject *out = PyList_New(x->len);
    if (out == NULL) return NULL;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < x->cap && j < x->len; i++) {
        if (x->vals[i] < 0) continue;
        PyObject *b = PyBytes_FromStringAndSize((const char *)x->keys + i * DIGEST, DIGEST);
        if (b == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j++, b);
    }
    return out;
}

static PyObject *Index_iter(Index *x) {
    PyObject *keys = Index_keys(x, NULL);
    if (keys == NULL) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* The out argument of lookup and lookup_keys: a writable int64 buffer of n items (0, or -1 with the
 * error set; on 0 the caller releases it). */
static int get_rows_out(PyObject *arg, Py_ssize_t n, Py_buffer *out, const char *msg) {
    if (PyObject_GetBuffer(arg, out, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (out->itemsize != 8 || out->format == NULL || (strcmp(out->format, "q") && strcmp(out->format, "l")) ||
        out->len != n * 8) {
        PyBuffer_Release(out);
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    return 0;
}

/* lookup(digests, out): out[i] = the row of digests[i], or -1 where it is not held; one call a batch. */
static PyObject *Index_lookup(Index *x, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lookup(digests, out)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "lookup: digests must be a sequence of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer out;
    if (get_rows_out(args[1], n, &out, "lookup: out must be an int64 buffer of one item per digest") < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int missing;
        const uint8_t *d = digest_of(items[i], 0, &missing);
        Py_ssize_t s = missing ? -1 : find(x, d);
        o[i] = s < 0 ? -1 : x->vals[s];
    }
    PyBuffer_Release(&out);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* lookup_keys(keys, out, digests): each key's digest (xxh3-128, canonical bytes: what
 * kvswarm.format.key_digest makes) into digests[16 i:16 i + 16], its row into out[i] (-1 where it is
 * not held).  A batched read's keys are hashed and looked up in one call, with no Python object per
 * key: with a digest made per key in Python, then joined, the Python part of submitting a 256-key
 * batch took about 200 us, 80 this way. */
static PyObject *Index_lookup_keys(Index *x, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "lookup_keys(keys, out, digests)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "lookup_keys: keys must be a sequence of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer out, dig;
    if (get_rows_out(args[1], n, &out, "lookup_keys: out must be an int64 buffer of one item per key") < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &dig, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&out);
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *ret = NULL;
    if (dig.len != n * DIGEST) {
        PyErr_SetString(PyExc_ValueError, "lookup_keys: digests must be a buffer of 16 bytes per key");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t *o = out.buf;
    uint8_t *d = dig.buf;
    for (Py_ssize_t i = 0; i < n; i++, d += DIGEST) {
        XXH128_canonical_t c;
        if (PyBytes_Check(items[i])) {
            XXH128_canonicalFromHash(&c, XXH3_128bits(PyBytes_AS_STRING(items[i]), (size_t)PyBytes_GET_SIZE(items[i])));
        } else {  /* any other bytes-like key (bytearray, memoryview), as key_digest takes it */
            Py_buffer k;
            if (PyObject_GetBuffer(items[i], &k, PyBUF_C_CONTIGUOUS) < 0) goto done;
            XXH128_canonicalFromHash(&c, XXH3_128bits(k.buf, (size_t)k.len));
            PyBuffer_Release(&k);
        }
        memcpy(d, c.digest, DIGEST);
        Py_ssize_t s = find(x, d);
        o[i] = s < 0 ? -1 : x->vals[s];
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    PyBuffer_Release(&dig);
    PyBuffer_Release(&out);
    Py_DECREF(seq);
    return ret;
}

static PyMethodDef Index_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Index_get, METH_FASTCALL, "get(digest, default=None): its row"},
    {"pop", (PyCFunction)(void (*)(void))Index_pop, METH_FASTCALL, "pop(digest[, default]): remove it, its row"},
    {"update", (PyCFunction)Index_update, METH_O, "update(pairs): set each (digest, row)"},
    {"clear", (PyCFunction)Index_clear, METH_NOARGS, "remove every digest"},
    {"keys", (PyCFunction)Index_keys, METH_NOARGS, "the digests held, as a new list"},
    {"lookup", (PyCFunction)(void (*)(void))Index_lookup, METH_FASTCALL,
     "lookup(digests, out): each digest's row into the int64 buffer out, -1 where it is not held"},
    {"lookup_keys", (PyCFunction)(void (*)(void))Index_lookup_keys, METH_FASTCALL,
     "lookup_keys(keys, out, digests): each key's digest into digests (16 bytes each), its row into out"},
    {NULL}
};

static PyMappingMethods Index_mapping = {
    .mp_length = (lenfunc)Index_len,
    .mp_subscript = (binaryfunc)Index_subscript,
    .mp_ass_subscript = (objobjargproc)Index_ass_subscript,
};

static PySequenceMethods Index_sequence = {
    .sq_contains = (objobjproc)Index_contains,
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvswarm._digest_index.DigestIndex",
    .tp_doc = "16-byte key digest -> row (a non-negative int), as an open-addressing table",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Index_new,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_as_mapping = &Index_mapping,
    .tp_as_sequence = &Index_sequence,
    .tp_iter = (getiterfunc)Index_iter,
    .tp_methods = Index_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvswarm._digest_index",
                                    "The catalog's digest -> row table (see native/digest_index.c).", -1, NULL};

PyMODINIT_FUNC PyInit__digest_index(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "DigestIndex", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
