/* What the native modules share: the payload checksum (xxh3-64, AVX2 where the CPU has it), the copy
 * of a verified payload into the caller's memory, and the caller's scatter targets (a buffer, or runs
 * of one).  Header-only: each extension module compiles its own copy (static functions). */
#ifndef KVSWARM_PAYLOAD_H
#define KVSWARM_PAYLOAD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define XXH_INLINE_ALL
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
/* xxHash's own hooks for an AVX2 variant beside the baseline one, chosen at run time (hash_payload):
 * from memory it hashes ~16 GB/s vs ~12.5 with SSE2, and the build stays portable. */
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((target("avx2")))
#define HAVE_AVX2_VARIANT 1
#include <immintrin.h>
#endif
#include "xxhash.h"

#ifdef HAVE_AVX2_VARIANT
static XXH_TARGET_AVX2 XXH64_hash_t hash_long_avx2(const void *in, size_t len, XXH64_hash_t seed,
                                                   const xxh_u8 *secret, size_t secret_len) {
    (void)seed;
    return XXH3_hashLong_64b_internal(in, len, secret, secret_len, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}

static int use_avx2; /* set once, by payload_init, when the module is loaded */
#endif

static void payload_init(void) {
#ifdef HAVE_AVX2_VARIANT
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
}

/* XXH3_64bits (seed 0, default secret), with the AVX2 loop where the CPU has it. */
static XXH64_hash_t hash_payload(const void *p, size_t len) {
#ifdef HAVE_AVX2_VARIANT
    if (use_avx2) return XXH3_64bits_internal(p, len, 0, XXH3_kSecret, sizeof(XXH3_kSecret), hash_long_avx2);
#endif
    return XXH3_64bits(p, len);
}

/* Copies of this many bytes or more bypass the caches (streaming stores): a payload copied into an
 * engine's page is read next by a DMA to the GPU or much later, not by this core, and the stores
 * then need no read of the destination first (measured on 2 MiB restores: docs/results.md). */
#define STREAM_MIN (64 * 1024)

static void copy_out(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
    if (n >= STREAM_MIN) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16)),
                    c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
    }
#endif
    memcpy(d, s, n);
}

/* Streaming stores are weakly ordered: a batch's copies are made visible before it is marked finished. */
static void copies_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

typedef struct { int64_t off, len; } Run; /* bytes [off, off + len) of a payload's destination buffer */

/* Per payload, where a verified copy goes: payload i to runs[first[i]] .. runs[first[i + 1] - 1] of
 * dst[i], in order (dst[i].obj NULL: nowhere). */
typedef struct {
    Py_buffer *dst;
    Run *runs;
    Py_ssize_t *first;
    Py_ssize_t n, nruns; /* payloads; runs allocated */
} Scatter;

static int scatter_alloc(Scatter *s, Py_ssize_t n) {
    s->n = n;
    s->nruns = 0;
    s->runs = NULL;
    s->first = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    s->dst = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    if (s->first == NULL || s->dst == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void scatter_release(Scatter *s) {
    if (s->dst != NULL)
        for (Py_ssize_t i = 0; i < s->n; i++)
            if (s->dst[i].obj != NULL) PyBuffer_Release(&s->dst[i]);
    PyMem_Free(s->dst);
    PyMem_Free(s->runs);
    PyMem_Free(s->first);
    s->dst = NULL;
    s->runs = NULL;
    s->first = NULL;
}

/* Payload i's destination (or, with writable 0, its source): None, a buffer (one run, all of it) or
 * (base, run_offsets, run_lengths). */
static int scatter_hold_as(Scatter *s, Py_ssize_t i, PyObject *b, int64_t want, int writable) {
    s->first[i + 1] = s->first[i];
    if (b == Py_None) return 0;
    PyObject *base = b;
    Py_buffer ob = {0}, lb = {0};
    Py_ssize_t m = 1;
    int rc = -1;
    if (PyTuple_Check(b)) {
        if (PyTuple_GET_SIZE(b) != 3) {
            PyErr_Format(PyExc_ValueError, "into[%zd]: runs are (base, run_offsets, run_lengths)", i);
            return -1;
        }
        base = PyTuple_GET_ITEM(b, 0);
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(b, 1), &ob, PyBUF_C_CONTIGUOUS) < 0) return -1;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(b, 2), &lb, PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (ob.itemsize != 8 || lb.itemsize != 8 || ob.len != lb.len) {
            PyErr_Format(PyExc_ValueError, "into[%zd]: run offsets and lengths must be int64 arrays of one size", i);
            goto done;
        }
        m = ob.len / 8;
    }
    if (PyObject_GetBuffer(base, &s->dst[i], PyBUF_SIMPLE | (writable ? PyBUF_WRITABLE : 0)) < 0) goto done;
    if (s->first[i] + m > s->nruns) {
        Py_ssize_t cap = (s->first[i] + m) * 2 + 16;
        Run *r = PyMem_Realloc(s->runs, (size_t)cap * sizeof(Run));
        if (r == NULL) { PyErr_NoMemory(); goto done; }
        s->runs = r;
        s->nruns = cap;
    }
    int64_t total = 0, size = s->dst[i].len;
    for (Py_ssize_t k = 0; k < m; k++) {
        int64_t off = ob.obj ? ((const int64_t *)ob.buf)[k] : 0, len = ob.obj ? ((const int64_t *)lb.buf)[k] : size;
        if (off < 0 || len < 0 || off > size - len) {
            PyErr_Format(PyExc_ValueError, "into[%zd]: run %zd lies outside its buffer", i, k);
            goto done;
        }
        s->runs[s->first[i] + k] = (Run){off, len};
        total += len;
    }
    if (total != want) {
        PyErr_Format(PyExc_ValueError, "buffer %zd holds %lld bytes, its payload %lld", i, (long long)total,
                     (long long)want);
        goto done;
    }
    s->first[i + 1] = s->first[i] + m;
    rc = 0;
done:
    if (ob.obj) PyBuffer_Release(&ob);
    if (lb.obj) PyBuffer_Release(&lb);
    return rc;
}

static int scatter_hold(Scatter *s, Py_ssize_t i, PyObject *b, int64_t want) {
    return scatter_hold_as(s, i, b, want, 1);
}

/* Gather payload i from its runs (held with writable 0) into p. */
static inline void gather_copy(const Scatter *s, Py_ssize_t i, char *p) {
    const char *b = s->dst[i].buf;
    for (Py_ssize_t k = s->first[i]; k < s->first[i + 1]; k++) {
        memcpy(p, b + s->runs[k].off, (size_t)s->runs[k].len);
        p += s->runs[k].len;
    }
}

/* Copy payload i (p) over its runs; nothing where it has no destination. */
static void scatter_copy(const Scatter *s, Py_ssize_t i, const char *p) {
    if (s->first == NULL) return;
    char *d = s->dst[i].buf;
    for (Py_ssize_t k = s->first[i]; k < s->first[i + 1]; k++) {
        copy_out(d + s->runs[k].off, p, (size_t)s->runs[k].len);
        p += s->runs[k].len;
    }
}

#endif
