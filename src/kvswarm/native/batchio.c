/* kvswarm.io._batchio: whole batches of O_DIRECT I/O on an io_uring ring, reads verified and scattered
 * in native code, with no Python object per I/O and the GIL released.
 *
 * A batch is arrays, one slot per extent (drive, file offset, length, where in a buffer it lands; for
 * verified reads also the header the catalog predicts, where the payload starts, its length and
 * xxh3-64, and where its verified copy goes).  Ring.submit queues it and returns a Job at once;
 * Ring.reap takes completions in, refills the ring (each drive up to its depth) and, outside the
 * ring's lock, checks every completed read: whole, header equal byte for byte (56 bytes: every field
 * the header checksum covers), payload checksum, then the copy into the caller's runs.  The verdict
 * per extent says which check failed.  The caller's thread drives the ring (no wake-up per batch);
 * several threads may share it (each wait is a bounded slice: a completion one thread is waiting for
 * may be taken in by another).  A helper thread verifies half of a pass's extents when the pass took
 * in many payload bytes (see "a second core").  A ring made with driven=True is the exception: a
 * thread of its own submits and reaps it, and callers only queue batches and wait for them (see "a
 * driven ring": the store's writes, whose submission would otherwise stall the caller's packing).
 *
 * The ring is set up with raw system calls (io_uring_setup/enter and mmap): no liburing to install.
 * Kernels before 5.11 (no IORING_FEAT_EXT_ARG, needed for timed waits) and processes io_uring is
 * forbidden to (seccomp) get an OSError from Ring(): the store then takes its Python path.
 */
#include "payload.h"
#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { V_OK = 0, V_SHORT = 1, V_ERRNO = 2, V_HEADER = 3, V_CHECKSUM = 4, V_INFLIGHT = 254, V_QUEUED = 255 };
enum { OP_READ = 0, OP_WRITE = 1 };
#define HEADER_BODY 56      /* the header bytes a read compares (kvswarm.format.HEADER_BODY) */
#define MAX_DRIVES 4096
#define MAX_JOBS 65536      /* jobs in flight per ring; user_data = slot << 32 | extent */
#define HARVEST 256         /* completions taken per pass (verified outside the lock) */
#define WAIT_SLICE_NS 10000000LL

#define MAX_BUCKETS 32       /* latency histogram bounds (kvswarm.metrics.LATENCY_BUCKETS) */

typedef struct Job Job;

/* Per drive and op, what completed since the last take_stats(): kvswarm.metrics.DriveStats, folded. */
typedef struct {
    int64_t ops, bytes, errors, lat_ns, hist[MAX_BUCKETS + 1];
} Acc;

typedef struct {
    PyObject_HEAD
    int fd;
    unsigned sq_entries, cq_entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *sq_flags;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqes_len;
    int coop;                  /* COOP_TASKRUN: completions run when this process enters the kernel */
    int fds[MAX_DRIVES];       /* per drive (-1: none: its I/O fails with EIO at once) */
    int busy[MAX_DRIVES][2];   /* per drive and op, I/Os in the ring: reads never wait for ring slots
                                * held by writes (a drive's write cap, or a slow flush, would delay
                                * a load queued behind a store) */
    int depth;                 /* per drive */
    unsigned in_ring, to_submit;
    long long queued;          /* I/Os submitted by the caller and not yet completed */
    long long completions;
    Job **slots;
    unsigned next_slot, used_slots;
    Job *pend_head, *pend_tail; /* jobs with I/Os not yet in the ring, in submission order */
    Job *done_head;            /* finished jobs whose buffers reap() lets go of (under the GIL) */
    Acc *acc;                  /* [drive * 2 + op], drives below acc_top touched since take_stats */
    int acc_top, nbounds;
    int64_t bounds_ns[MAX_BUCKETS];
    pthread_mutex_t mu;
    struct Helper *helper;     /* verifies half of a large pass, where a core is spare (or NULL) */
    int driven;                /* its driver thread alone submits and reaps (see "a driven ring") */
    int stop;                  /* the driver thread is to return */
    pid_t pid;                 /* the process whose driver thread it is */
    pthread_t driver;
    pthread_cond_t work_cv;    /* the driver: a batch queued, or stop */
    pthread_cond_t done_cv;    /* callers: a job finished */
} Ring;

struct Job {
    PyObject_HEAD
    Ring *ring;                /* strong reference while the job is held by the ring */
    Py_buffer mem, drive, off, len, at, want, poff, plen, sum, verdict, res, lat;
    Scatter into;
    Py_ssize_t n, cursor;
    int op, check, slot, held_ring;
    int finished;              /* extents done (atomics) */
    int state;                 /* 1 once every extent is done and verified (atomics) */
    Job *next_pend, *next_done;
};

static PyTypeObject JobType, RingType;

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags, void *arg, size_t argsz) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* ---- jobs ------------------------------------------------------------------------------------ */

static void job_release(Job *j) {
    Py_buffer *bufs[] = {&j->mem, &j->drive, &j->off, &j->len, &j->at, &j->want, &j->poff, &j->plen, &j->sum,
                         &j->verdict, &j->res, &j->lat};
    for (size_t k = 0; k < sizeof(bufs) / sizeof(*bufs); k++)
        if (bufs[k]->obj != NULL) PyBuffer_Release(bufs[k]);
    scatter_release(&j->into);
}

static void job_dealloc(Job *j) {
    job_release(j); /* never while the ring holds it: the ring owns a reference until it is finished */
    Py_XDECREF(j->ring);
    Py_TYPE(j)->tp_free((PyObject *)j);
}

static PyObject *job_done(Job *j, void *closure) {
    (void)closure;
    return PyBool_FromLong(__atomic_load_n(&j->state, __ATOMIC_ACQUIRE));
}

static PyObject *job_len(Job *j, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(j->n);
}

static PyGetSetDef job_getset[] = {
    {"done", (getter)job_done, NULL, "every I/O is back and every read verified (never blocks)", NULL},
    {"n", (getter)job_len, NULL, "extents in the batch", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvswarm.io._batchio.Job",
    .tp_basicsize = sizeof(Job),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a batch on a Ring; its verdict, res and lat arrays and the caller's buffers are final once done",
    .tp_dealloc = (destructor)job_dealloc,
    .tp_getset = job_getset,
};

/* One extent's outcome, once its I/O is back (outside the ring's lock). */
static void finish_extent(Job *j, Py_ssize_t i) {
    const int64_t *len = j->len.buf, *res = j->res.buf;
    uint8_t *v = j->verdict.buf;
    int64_t r = res[i];
    uint8_t out = V_OK;
    if (r < 0) out = V_ERRNO;
    else if (r != len[i]) out = V_SHORT;
    else if (j->check) {
        const char *p = (const char *)j->mem.buf + ((const int64_t *)j->at.buf)[i];
        const int64_t poff = ((const int64_t *)j->poff.buf)[i], plen = ((const int64_t *)j->plen.buf)[i];
        if (j->want.obj != NULL && memcmp(p, (const char *)j->want.buf + HEADER_BODY * i, HEADER_BODY) != 0)
            out = V_HEADER;
        else if (hash_payload(p + poff, (size_t)plen) != ((const uint64_t *)j->sum.buf)[i])
            out = V_CHECKSUM;
        else
            scatter_copy(&j->into, i, p + poff);
    }
    v[i] = out;
}

/* Count extents finished; the last one marks the job done and queues it for reap() to let go of. */
static void job_count(Job *j, Py_ssize_t k) {
    if (__atomic_add_fetch(&j->finished, (int)k, __ATOMIC_ACQ_REL) != j->n) return;
    copies_fence();
    Ring *r = j->ring;
    pthread_mutex_lock(&r->mu);
    j->next_done = r->done_head;
    r->done_head = j;
    r->slots[j->slot] = NULL;
    r->used_slots--;
    __atomic_store_n(&j->state, 1, __ATOMIC_RELEASE);
    if (r->driven) pthread_cond_broadcast(&r->done_cv);
    pthread_mutex_unlock(&r->mu);
}

/* ---- the ring -------------------------------------------------------------------------------- */

/* Move queued I/Os into the SQ, each drive up to its depth of reads and its depth of writes, oldest
 * job first (the lock is held).
 * I/O to a drive without a file fails at once with EIO: appended to `failed` for the caller. */
static void fill(Ring *r, Job **failed_job, Py_ssize_t *failed_i, int *nfailed, int cap) {
    unsigned tail = *r->sq_tail, mask = *r->sq_mask;
    unsigned room = r->cq_entries - r->in_ring;
    unsigned sq_room = r->sq_entries - r->to_submit;
    if (sq_room < room) room = sq_room;
    Job *prev = NULL, *j = r->pend_head;
    int64_t t = now_ns();
    while (j != NULL && room > 0 && *nfailed < cap) {
        const int64_t *drive = j->drive.buf, *off = j->off.buf, *len = j->len.buf, *at = j->at.buf;
        uint8_t *v = j->verdict.buf;
        int64_t *res = j->res.buf, *lat = j->lat.buf;
        for (Py_ssize_t i = j->cursor; i < j->n && room > 0 && *nfailed < cap; i++) {
            if (v[i] != V_QUEUED) continue;
            int64_t d = drive[i];
            int fd = d >= 0 && d < MAX_DRIVES ? r->fds[d] : -1;
            if (fd < 0) {
                res[i] = -EIO;
                lat[i] = 0;
                v[i] = V_INFLIGHT;
                r->queued--;
                failed_job[*nfailed] = j;
                failed_i[(*nfailed)++] = i;
                continue;
            }
            if (r->busy[d][j->op] >= r->depth) continue;
            struct io_uring_sqe *sqe = &r->sqes[tail & mask];
            memset(sqe, 0, sizeof(*sqe));
            sqe->opcode = j->op == OP_READ ? IORING_OP_READ : IORING_OP_WRITE;
            sqe->fd = fd;
            sqe->off = (uint64_t)off[i];
            sqe->addr = (uint64_t)(uintptr_t)((char *)j->mem.buf + at[i]);
            sqe->len = (uint32_t)len[i];
            sqe->user_data = ((uint64_t)j->slot << 32) | (uint64_t)i;
            r->sq_array[tail & mask] = tail & mask;
            tail++;
            r->busy[d][j->op]++;
            r->in_ring++;
            r->to_submit++;
            room--;
            v[i] = V_INFLIGHT;
            lat[i] = t;
        }
        while (j->cursor < j->n && v[j->cursor] != V_QUEUED) j->cursor++;
        Job *next = j->next_pend;
        if (j->cursor == j->n) { /* all in the ring (or failed): off the pending list */
            if (prev == NULL) r->pend_head = next; else prev->next_pend = next;
            if (r->pend_tail == j) r->pend_tail = prev;
            j->next_pend = NULL;
        } else {
            prev = j;
        }
        j = next;
    }
    __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
}

/* Hand the prepared SQEs to the kernel (the lock is held).  Returns 0 or -errno. */
static int flush_sq(Ring *r) {
    while (r->to_submit) {
        int n = sys_enter(r->fd, r->to_submit, 0, 0, NULL, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EBUSY) return 0; /* retried at the next reap */
            return -errno;
        }
        r->to_submit -= (unsigned)n;
        if (n == 0) break;
    }
    return 0;
}

/* Take up to `cap` completions out of the CQ (the lock is held). */
static int harvest(Ring *r, Job **jobs, Py_ssize_t *idx, int cap) {
    unsigned head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE), mask = *r->cq_mask;
    int n = 0;
    int64_t t = now_ns();
    for (; head != tail && n < cap; head++, n++) {
        struct io_uring_cqe *c = &r->cqes[head & mask];
        Job *j = r->slots[c->user_data >> 32];
        Py_ssize_t i = (Py_ssize_t)(c->user_data & 0xffffffffu);
        int64_t lat = t - ((int64_t *)j->lat.buf)[i], d = ((const int64_t *)j->drive.buf)[i];
        ((int64_t *)j->res.buf)[i] = c->res;
        ((int64_t *)j->lat.buf)[i] = lat;
        r->busy[d][j->op]--;
        Acc *a = &r->acc[d * 2 + j->op];
        if (c->res >= 0) {
            int b = 0;
            while (b < r->nbounds && r->bounds_ns[b] < lat) b++;
            a->ops++;
            a->bytes += c->res;
            a->lat_ns += lat;
            a->hist[b]++;
        } else {
            a->errors++;
        }
        if (d >= r->acc_top) r->acc_top = (int)d + 1;
        jobs[n] = j;
        idx[n] = i;
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    r->in_ring -= (unsigned)n;
    r->queued -= n;
    r->completions += n;
    return n;
}

/* ---- a second core ---------------------------------------------------------------------------
 * Hashing (and, for writes, gathering) every payload is most of a large batch's CPU, and the thread
 * driving the ring cannot refill it meanwhile.  Where the machine has a core to spare, a reap pass
 * that took in many payload bytes, or a pack of many, hands the second half of its extents (by bytes)
 * to a helper thread and does the first half itself.  One caller at a time uses a helper (others work
 * alone); the helper never touches Python objects.  Each ring has one for its reads, the module one
 * for pack.  KVSWARM_IO_HELPER=0 turns them off. */
#define SPLIT_BYTES (512 * 1024) /* below this, waking the helper costs about what it saves */

typedef void (*RangeFn)(void *ctx, int lo, int hi);

typedef struct Helper {
    pthread_t th;
    pid_t pid;               /* the process that started it (a forked child has no helper thread) */
    pthread_mutex_t use;     /* held by the caller whose extents the helper is working on */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    RangeFn fn;
    void *ctx;
    int lo, hi;
    int state;               /* 0 idle, 1 work posted, 2 work done, 3 stop */
    long long helped;        /* extents it did (under mu) */
} Helper;

static void *helper_main(void *arg) {
    Helper *h = arg;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (h->state != 1 && h->state != 3) pthread_cond_wait(&h->cv, &h->mu);
        if (h->state == 3) break;
        RangeFn fn = h->fn;
        void *ctx = h->ctx;
        int lo = h->lo, hi = h->hi;
        pthread_mutex_unlock(&h->mu);
        fn(ctx, lo, hi);
        copies_fence(); /* this thread's streaming copies, visible before the caller goes on */
        pthread_mutex_lock(&h->mu);
        h->state = 2;
        h->helped += hi - lo;
        pthread_cond_broadcast(&h->cv);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* A helper thread, or NULL on one CPU, with KVSWARM_IO_HELPER=0, or when no thread can start. */
static Helper *helper_start(void) {
    const char *env = getenv("KVSWARM_IO_HELPER");
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2 || (env != NULL && strcmp(env, "0") == 0)) return NULL;
    Helper *h = PyMem_RawCalloc(1, sizeof(Helper));
    if (h == NULL) return NULL;
    pthread_mutex_init(&h->use, NULL);
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    h->pid = getpid();
    if (pthread_create(&h->th, NULL, helper_main, h) != 0) {
        PyMem_RawFree(h);
        return NULL;
    }
    return h;
}

static void helper_stop(Helper *h) {
    if (h == NULL || h->pid != getpid()) return; /* a forked child: the thread is its parent's */
    pthread_mutex_lock(&h->use); /* after the work a caller handed it */
    pthread_mutex_lock(&h->mu);
    h->state = 3;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->th, NULL);
    pthread_mutex_unlock(&h->use);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    pthread_mutex_destroy(&h->use);
    PyMem_RawFree(h);
}

/* Run fn over extents [0, n) of ctx, whose payload bytes are bytes[k]: the helper takes the second
 * half by bytes when the total is at least SPLIT_BYTES and it is free; the caller does the rest. */
static void helper_run(Helper *h, RangeFn fn, void *ctx, const int64_t *bytes, int n) {
    int split = n;
    if (h != NULL && n >= 2 && h->pid == getpid()) {
        int64_t total = 0;
        for (int k = 0; k < n; k++) total += bytes[k];
        if (total >= SPLIT_BYTES && pthread_mutex_trylock(&h->use) == 0) {
            int64_t acc = 0;
            for (split = 0; split < n - 1 && 2 * (acc + bytes[split]) <= total; split++) acc += bytes[split];
            if (split == 0) split = 1;
            pthread_mutex_lock(&h->mu);
            h->fn = fn, h->ctx = ctx, h->lo = split, h->hi = n, h->state = 1;
            pthread_cond_broadcast(&h->cv);
            pthread_mutex_unlock(&h->mu);
        }
    }
    fn(ctx, 0, split);
    if (split == n) return;
    pthread_mutex_lock(&h->mu);
    while (h->state != 2) pthread_cond_wait(&h->cv, &h->mu);
    h->state = 0;
    pthread_mutex_unlock(&h->mu);
    pthread_mutex_unlock(&h->use);
}

static long long helper_helped(Helper *h) {
    if (h == NULL) return 0;
    pthread_mutex_lock(&h->mu);
    long long n = h->helped;
    pthread_mutex_unlock(&h->mu);
    return n;
}

typedef struct {
    Job **jobs;
    Py_ssize_t *idx;
} Taken;

static void finish_range(void *ctx, int lo, int hi) {
    Taken *t = ctx;
    for (int k = lo; k < hi; k++) finish_extent(t->jobs[k], t->idx[k]);
}

/* Verify the taken-in extents and count them per job (outside the lock). */
static void settle(Ring *r, Job **jobs, Py_ssize_t *idx, int n) {
    int64_t bytes[HARVEST * 2];
    for (int k = 0; k < n; k++)
        bytes[k] = jobs[k]->check ? ((const int64_t *)jobs[k]->plen.buf)[idx[k]] : 0;
    Taken t = {jobs, idx};
    helper_run(r->helper, finish_range, &t, bytes, n);
    for (int k = 0; k < n;) { /* one atomic add per run of one job's extents */
        int e = k + 1;
        while (e < n && jobs[e] == jobs[k]) e++;
        job_count(jobs[k], e - k);
        k = e;
    }
}

/* One pass (GIL released): completions in, refill, submit, verify.  Waits up to timeout_ns (< 0: one
 * slice) for a first completion when none is there.  Returns completions taken, or -errno. */
static int reap_pass(Ring *r, long long timeout_ns) {
    Job *jobs[HARVEST * 2];
    Py_ssize_t idx[HARVEST * 2];
    pthread_mutex_lock(&r->mu);
    if (r->queued == 0) {
        pthread_mutex_unlock(&r->mu);
        return 0;
    }
    int n = harvest(r, jobs, idx, HARVEST);
    if (n == 0 && r->in_ring > 0 && (timeout_ns != 0 || r->coop)) {
        pthread_mutex_unlock(&r->mu);
        struct __kernel_timespec ts = {0, 0};
        long long w = timeout_ns < 0 || timeout_ns > WAIT_SLICE_NS ? WAIT_SLICE_NS : timeout_ns;
        ts.tv_sec = w / 1000000000LL;
        ts.tv_nsec = w % 1000000000LL;
        struct io_uring_getevents_arg arg = {.sigmask = 0, .sigmask_sz = _NSIG / 8, .ts = (uint64_t)(uintptr_t)&ts};
        int rc = sys_enter(r->fd, 0, timeout_ns == 0 ? 0 : 1, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG,
                           &arg, sizeof(arg));
        int err = rc < 0 ? errno : 0;
        pthread_mutex_lock(&r->mu);
        if (rc < 0 && err != ETIME && err != EINTR && err != EAGAIN && err != EBUSY) {
            pthread_mutex_unlock(&r->mu);
            return -err;
        }
        n = harvest(r, jobs, idx, HARVEST);
    }
    int nf = 0;
    fill(r, jobs + n, idx + n, &nf, HARVEST);
    int rc = flush_sq(r);
    pthread_mutex_unlock(&r->mu);
    settle(r, jobs, idx, n + nf);
    return rc < 0 ? rc : n + nf;
}

/* Let go of finished jobs' buffers and the ring's references (the GIL is held); a list of them. */
static PyObject *collect(Ring *r) {
    pthread_mutex_lock(&r->mu);
    Job *j = r->done_head;
    r->done_head = NULL;
    pthread_mutex_unlock(&r->mu);
    PyObject *out = PyList_New(0);
    while (j != NULL) {
        Job *next = j->next_done;
        /* every view goes (the outputs too: the caller reads them through its own arrays) */
        job_release(j);
        if (out != NULL && PyList_Append(out, (PyObject *)j) < 0) Py_CLEAR(out);
        Py_DECREF(j); /* the ring's reference */
        j = next;
    }
    return out;
}

/* ---- a driven ring ---------------------------------------------------------------------------
 * Submitting a batch does the block layer's work per I/O (as much CPU as raw's whole write loop), and
 * a caller-driven ring refills only when its caller comes back to reap: a caller packing its next put
 * batch left the drives idle once the ring's depth was written (at 4 KiB, half a millisecond), and the
 * store wrote at about half of raw's rate.  A driven ring has a thread of its own that alone submits
 * and reaps it, so that the completions (io_uring runs them in the submitter's context, with
 * COOP_TASKRUN when it next enters the kernel) are always taken in; callers queue batches and wait
 * for jobs on a condition variable.  Started only where a helper may run (two CPUs or more, and not
 * KVSWARM_IO_HELPER=0); otherwise, and in a forked child, callers drive it as any ring. */
#define DRIVER_SLICE_NS 1000000LL /* its waits: a batch queued while I/O is in flight waits at most this */

static int ring_driven(Ring *r) { return r->driven && r->pid == getpid(); }

static void *driver_main(void *arg) {
    Ring *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && r->queued == 0) pthread_cond_wait(&r->work_cv, &r->mu);
        if (r->queued == 0) break; /* stopped, with nothing in flight */
        pthread_mutex_unlock(&r->mu);
        if (reap_pass(r, DRIVER_SLICE_NS) < 0) { /* retried: the jobs stay queued */
            struct timespec pause = {0, 1000000};
            nanosleep(&pause, NULL);
        }
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static void driver_start(Ring *r) {
    const char *env = getenv("KVSWARM_IO_HELPER");
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2 || (env != NULL && strcmp(env, "0") == 0)) return;
    r->pid = getpid();
    r->stop = 0;
    r->driven = pthread_create(&r->driver, NULL, driver_main, r) == 0;
}

/* After every I/O is back (ring_drain). */
static void driver_stop(Ring *r) {
    if (!ring_driven(r)) return;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->work_cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->driver, NULL);
    r->driven = 0;
}

/* Wait (GIL released, the lock held) until a job has finished, nothing is in flight, or timeout_ns
 * have passed (< 0: one slice). */
static void wait_done(Ring *r, long long timeout_ns) {
    if (timeout_ns == 0) return;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    long long ns = until.tv_nsec + (timeout_ns < 0 ? WAIT_SLICE_NS : timeout_ns);
    until.tv_sec += ns / 1000000000LL;
    until.tv_nsec = ns % 1000000000LL;
    while (r->done_head == NULL && r->queued > 0)
        if (pthread_cond_timedwait(&r->done_cv, &r->mu, &until) == ETIMEDOUT) break;
}

static void ring_unmap(Ring *r) {
    if (r->sqes != NULL && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->cq_map != NULL && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_len);
    if (r->sq_map != NULL && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_len);
    r->sqes = NULL;
    r->sq_map = r->cq_map = NULL;
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
}

static int ring_init(Ring *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"entries", "depth", "single_thread", "driven", NULL};
    unsigned entries = 1024;
    int depth = 32, single = 0, driven = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Iipp", names, &entries, &depth, &single, &driven)) return -1;
    if (depth < 1) {
        PyErr_SetString(PyExc_ValueError, "depth must be at least 1");
        return -1;
    }
    self->fd = -1;
    self->depth = depth;
    for (int d = 0; d < MAX_DRIVES; d++) self->fds[d] = -1;
    self->slots = PyMem_Calloc(MAX_JOBS, sizeof(Job *));
    self->acc = PyMem_Calloc(MAX_DRIVES * 2, sizeof(Acc));
    if (self->slots == NULL || self->acc == NULL) { PyErr_NoMemory(); return -1; }
    pthread_mutex_init(&self->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&self->done_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&self->work_cv, NULL);
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = entries * 2;
    if (single) p.flags |= IORING_SETUP_COOP_TASKRUN;
    int fd = sys_setup(entries, &p);
    if (fd < 0 && single && errno == EINVAL) { /* kernels before 5.19: no COOP_TASKRUN */
        single = 0;
        p.flags &= ~IORING_SETUP_COOP_TASKRUN;
        fd = sys_setup(entries, &p);
    }
    if (fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->fd = fd;
    self->coop = single;
    if (!(p.features & IORING_FEAT_EXT_ARG)) {
        ring_unmap(self);
        errno = ENOSYS;
        PyErr_SetString(PyExc_OSError, "io_uring without IORING_FEAT_EXT_ARG (kernel before 5.11)");
        return -1;
    }
    self->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    self->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single_mmap = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_mmap && self->cq_len > self->sq_len) self->sq_len = self->cq_len;
    self->sq_map = mmap(NULL, self->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (self->sq_map == MAP_FAILED) goto fail;
    self->cq_map = single_mmap ? self->sq_map
                               : mmap(NULL, self->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                                      IORING_OFF_CQ_RING);
    if (self->cq_map == MAP_FAILED) goto fail;
    self->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    self->sqes = mmap(NULL, self->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (self->sqes == MAP_FAILED) goto fail;
    char *sq = self->sq_map, *cq = self->cq_map;
    self->sq_head = (unsigned *)(sq + p.sq_off.head);
    self->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    self->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    self->sq_flags = (unsigned *)(sq + p.sq_off.flags);
    self->sq_array = (unsigned *)(sq + p.sq_off.array);
    self->cq_head = (unsigned *)(cq + p.cq_off.head);
    self->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    self->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    self->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    self->sq_entries = p.sq_entries;
    self->cq_entries = p.cq_entries;
    self->helper = helper_start();
    if (driven) driver_start(self);
    return 0;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    ring_unmap(self);
    return -1;
}

static PyObject *ring_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args;
    (void)kw;
    Ring *r = (Ring *)type->tp_alloc(type, 0);
    if (r != NULL) r->fd = -1;
    return (PyObject *)r;
}

/* Wait out every I/O (a late DMA into freed memory would be wrong data), then tear down. */
static void ring_drain(Ring *r) {
    if (r->fd < 0) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&r->mu);
    while (ring_driven(r) && r->queued > 0) wait_done(r, -1);
    pthread_mutex_unlock(&r->mu);
    driver_stop(r);
    for (;;) {
        pthread_mutex_lock(&r->mu);
        long long q = r->queued;
        pthread_mutex_unlock(&r->mu);
        if (q == 0) break;
        if (reap_pass(r, -1) < 0) {
            struct timespec s = {0, 1000000};
            nanosleep(&s, NULL);
        }
    }
    Py_END_ALLOW_THREADS
    PyObject *l = collect(r);
    Py_XDECREF(l);
}

static void ring_dealloc(Ring *r) {
    /* Jobs hold a reference to their ring while queued, so a ring freed has nothing in flight. */
    if (r->fd >= 0) {
        ring_drain(r);
        ring_unmap(r);
    }
    helper_stop(r->helper);
    r->helper = NULL;
    if (r->slots != NULL) {
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->work_cv);
        pthread_cond_destroy(&r->done_cv);
    }
    PyMem_Free(r->slots);
    PyMem_Free(r->acc);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int hold(PyObject *obj, Py_buffer *view, Py_ssize_t n, Py_ssize_t itemsize, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->len != n * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes, got %zd bytes", what, n, itemsize,
                     view->len);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(submit_doc,
"submit(op, mem, drive, offset, length, at, verdict, res, lat, want=None, poff=None, plen=None, sums=None,\n"
"       into=None) -> Job\n\n"
"Queue n I/Os and return at once.  op 0 reads, 1 writes; extent i moves length[i] bytes between\n"
"drive[i]'s file at offset[i] and mem[at[i]:at[i] + length[i]] (mem: a writable buffer, e.g. the\n"
"store's pool; offsets, lengths and addresses 4 KiB-aligned for O_DIRECT).  drive, offset, length,\n"
"at, poff and plen are int64 arrays of n, sums uint64; verdict (uint8), res and lat (int64) are\n"
"outputs, final once the job is done: res the bytes moved or -errno, lat the nanoseconds in the\n"
"ring, verdict 0 ok, 1 short, 2 errno, 3 header differs, 4 checksum differs.  A read with sums is\n"
"verified: its first 56 bytes must equal want[56 * i:56 * i + 56] (want: n * 56 bytes, or None to\n"
"skip), and xxh3_64 of its payload, mem[at + poff : at + poff + plen], must be sums[i]; a verified\n"
"payload is then copied to into[i] (None, a buffer of plen[i] bytes, or (base, run_offsets,\n"
"run_lengths) scattered in order).  A drive without a file (never attached, or detached) fails its\n"
"I/O with EIO.  The job holds every buffer until it is finished; the ring holds the job until then.");

static PyObject *ring_submit(Ring *r, PyObject *args, PyObject *kw) {
    static char *names[] = {"op", "mem", "drive", "offset", "length", "at", "verdict", "res", "lat",
                            "want", "poff", "plen", "sums", "into", NULL};
    int op;
    PyObject *mem, *drive, *off, *len, *at, *verdict, *res, *lat;
    PyObject *want = Py_None, *poff = Py_None, *plen = Py_None, *sums = Py_None, *into = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOOOOOOO|OOOOO", names, &op, &mem, &drive, &off, &len, &at,
                                     &verdict, &res, &lat, &want, &poff, &plen, &sums, &into))
        return NULL;
    if (r->fd < 0) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed");
        return NULL;
    }
    if (op != OP_READ && op != OP_WRITE) {
        PyErr_SetString(PyExc_ValueError, "op is 0 (read) or 1 (write)");
        return NULL;
    }
    Job *j = PyObject_New(Job, &JobType);
    if (j == NULL) return NULL;
    char *zero = (char *)j + offsetof(Job, mem);
    memset(zero, 0, sizeof(Job) - offsetof(Job, mem));
    j->ring = NULL;
    j->op = op;
    j->slot = -1;
    if (PyObject_GetBuffer(verdict, &j->verdict, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto fail;
    Py_ssize_t n = j->n = j->verdict.len;
    if (PyObject_GetBuffer(mem, &j->mem, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0
        || hold(drive, &j->drive, n, 8, 0, "drive") < 0 || hold(off, &j->off, n, 8, 0, "offset") < 0
        || hold(len, &j->len, n, 8, 0, "length") < 0 || hold(at, &j->at, n, 8, 0, "at") < 0
        || hold(res, &j->res, n, 8, 1, "res") < 0 || hold(lat, &j->lat, n, 8, 1, "lat") < 0)
        goto fail;
    j->check = op == OP_READ && sums != Py_None;
    if (j->check) {
        if ((want != Py_None && hold(want, &j->want, n, HEADER_BODY, 0, "want") < 0)
            || hold(poff, &j->poff, n, 8, 0, "poff") < 0 || hold(plen, &j->plen, n, 8, 0, "plen") < 0
            || hold(sums, &j->sum, n, 8, 0, "sums") < 0)
            goto fail;
    }
    const int64_t *o = j->off.buf, *l = j->len.buf, *a = j->at.buf;
    const int64_t *po = j->check ? j->poff.buf : NULL, *pl = j->check ? j->plen.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (o[i] < 0 || l[i] <= 0 || l[i] > 0x7fffffff || a[i] < 0 || a[i] > j->mem.len - l[i]) {
            PyErr_Format(PyExc_ValueError, "I/O %zd lies outside its buffer (at %lld, %lld bytes)", i,
                         (long long)a[i], (long long)l[i]);
            goto fail;
        }
        if (j->check && (po[i] < 0 || pl[i] < 0 || po[i] > l[i] - pl[i]
                         || (j->want.obj != NULL && l[i] < HEADER_BODY))) {
            PyErr_Format(PyExc_ValueError, "payload %zd lies outside its extent", i);
            goto fail;
        }
    }
    if (into != Py_None) {
        if (!j->check || !PyList_Check(into) || PyList_GET_SIZE(into) != n) {
            PyErr_SetString(PyExc_ValueError, "into: a list with one entry per verified read");
            goto fail;
        }
        if (scatter_alloc(&j->into, n) < 0) goto fail;
        for (Py_ssize_t i = 0; i < n; i++)
            if (scatter_hold(&j->into, i, PyList_GET_ITEM(into, i), pl[i]) < 0) goto fail;
    }
    memset(j->verdict.buf, V_QUEUED, (size_t)n);
    if (n == 0) {
        job_release(j);
        j->state = 1;
        return (PyObject *)j;
    }
    Py_INCREF(r);
    j->ring = r;
    int rc = 0;
    Job *failed[HARVEST];
    Py_ssize_t fidx[HARVEST];
    int nf = 0;
    pthread_mutex_lock(&r->mu);
    if (r->used_slots == MAX_JOBS) {
        pthread_mutex_unlock(&r->mu);
        PyErr_SetString(PyExc_RuntimeError, "too many batches in flight on one ring");
        goto fail;
    }
    while (r->slots[r->next_slot] != NULL) r->next_slot = (r->next_slot + 1) % MAX_JOBS;
    j->slot = (int)r->next_slot;
    r->slots[j->slot] = j;
    r->used_slots++;
    Py_INCREF(j); /* the ring's reference, dropped by collect() once the job is finished */
    j->held_ring = 1;
    r->queued += n;
    if (r->pend_tail != NULL) r->pend_tail->next_pend = j; else r->pend_head = j;
    r->pend_tail = j;
    if (ring_driven(r)) {
        pthread_cond_signal(&r->work_cv);
        pthread_mutex_unlock(&r->mu);
        return (PyObject *)j;
    }
    Py_BEGIN_ALLOW_THREADS /* the submission itself does the block layer's work per I/O */
    fill(r, failed, fidx, &nf, HARVEST);
    rc = flush_sq(r);
    pthread_mutex_unlock(&r->mu);
    settle(r, failed, fidx, nf);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError); /* the job stays queued: the next reap retries */
        Py_DECREF(j);
        return NULL;
    }
    return (PyObject *)j;
fail:
    Py_DECREF(j);
    return NULL;
}

static PyObject *ring_reap(Ring *r, PyObject *args) {
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &timeout)) return NULL;
    long long t = -1;
    if (timeout != Py_None) {
        double s = PyFloat_AsDouble(timeout);
        if (s == -1 && PyErr_Occurred()) return NULL;
        t = s <= 0 ? 0 : (long long)(s * 1e9);
    }
    if (r->fd < 0) return PyList_New(0);
    if (ring_driven(r)) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&r->mu);
        wait_done(r, t);
        pthread_mutex_unlock(&r->mu);
        Py_END_ALLOW_THREADS
        return collect(r);
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = reap_pass(r, t);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return collect(r);
}

static PyObject *ring_attach(Ring *r, PyObject *args) {
    int d, fd;
    if (!PyArg_ParseTuple(args, "ii", &d, &fd)) return NULL;
    if (d < 0 || d >= MAX_DRIVES) return PyErr_Format(PyExc_ValueError, "drive index %d out of range", d);
    pthread_mutex_lock(&r->mu);
    r->fds[d] = fd;
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *ring_set_depth(Ring *r, PyObject *args) {
    int depth;
    if (!PyArg_ParseTuple(args, "i", &depth)) return NULL;
    if (depth < 1) return PyErr_Format(PyExc_ValueError, "depth must be at least 1");
    pthread_mutex_lock(&r->mu);
    r->depth = depth;
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *ring_set_buckets(Ring *r, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "buckets: a sequence of latency bounds in seconds");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_BUCKETS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "at most %d latency buckets", MAX_BUCKETS);
    }
    int64_t b[MAX_BUCKETS];
    for (Py_ssize_t k = 0; k < n; k++) {
        double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, k));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        b[k] = (int64_t)(v * 1e9 + 0.5);
    }
    Py_DECREF(seq);
    pthread_mutex_lock(&r->mu);
    memcpy(r->bounds_ns, b, sizeof(int64_t) * (size_t)n);
    r->nbounds = (int)n;
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *ring_take_stats(Ring *r, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&r->mu);
    int top = r->acc_top;
    PyObject *out = PyBytes_FromStringAndSize((const char *)r->acc, (Py_ssize_t)(sizeof(Acc) * 2 * (size_t)top));
    if (out != NULL) {
        memset(r->acc, 0, sizeof(Acc) * 2 * (size_t)top);
        r->acc_top = 0;
    }
    pthread_mutex_unlock(&r->mu);
    return out;
}

static PyObject *ring_close(Ring *r, PyObject *unused) {
    (void)unused;
    ring_drain(r);
    helper_stop(r->helper);
    r->helper = NULL;
    ring_unmap(r);
    Py_RETURN_NONE;
}

static PyObject *ring_queued(Ring *r, void *closure) {
    (void)closure;
    pthread_mutex_lock(&r->mu);
    long long q = r->queued;
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromLongLong(q);
}

static PyObject *ring_helped(Ring *r, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(helper_helped(r->helper));
}

static PyObject *ring_completions(Ring *r, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(__atomic_load_n(&r->completions, __ATOMIC_RELAXED));
}

static PyObject *ring_busy(Ring *r, PyObject *args) {
    int d, op;
    if (!PyArg_ParseTuple(args, "ii", &d, &op)) return NULL;
    if (d < 0 || d >= MAX_DRIVES) return PyErr_Format(PyExc_ValueError, "drive index %d out of range", d);
    if (op != OP_READ && op != OP_WRITE) return PyErr_Format(PyExc_ValueError, "op %d is neither 0 nor 1", op);
    return PyLong_FromLong(__atomic_load_n(&r->busy[d][op], __ATOMIC_RELAXED));
}

static PyMethodDef ring_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))ring_submit, METH_VARARGS | METH_KEYWORDS, submit_doc},
    {"reap", (PyCFunction)ring_reap, METH_VARARGS,
     "reap(timeout=None) -> list[Job]: take completions in, refill and submit, verify what came back (GIL\n"
     "released); waits up to timeout s (None: a 10 ms slice) for a first completion.  Returns the jobs\n"
     "that finished since the last reap (each once, whichever thread finished it)."},
    {"attach", (PyCFunction)ring_attach, METH_VARARGS, "attach(drive, fd): I/O to drive goes to fd (-1: fails with EIO)"},
    {"set_depth", (PyCFunction)ring_set_depth, METH_VARARGS, "set_depth(n): I/Os per drive in the ring at most"},
    {"set_buckets", (PyCFunction)ring_set_buckets, METH_O,
     "set_buckets(bounds): latency histogram upper bounds in seconds (at most 32), for take_stats"},
    {"take_stats", (PyCFunction)ring_take_stats, METH_NOARGS,
     "take_stats() -> bytes: per drive below the highest one that completed I/O since the last call, per op\n"
     "(read, write), int64 ops, bytes, errors, latency sum (ns) and one count per latency bucket (its\n"
     "bounds, then one past the last); zeroed by the call"},
    {"busy", (PyCFunction)ring_busy, METH_VARARGS, "busy(drive, op) -> int: that drive's reads (op 0) or writes (1) in the ring"},
    {"close", (PyCFunction)ring_close, METH_NOARGS, "close(): wait out every I/O, then tear the ring down"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ring_getset[] = {
    {"queued", (getter)ring_queued, NULL, "I/Os submitted and not yet completed", NULL},
    {"completions", (getter)ring_completions, NULL, "I/Os completed so far", NULL},
    {"helped", (getter)ring_helped, NULL, "extents verified by the helper thread so far (0: none runs)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvswarm.io._batchio.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(entries=1024, depth=32, single_thread=False, driven=False): an io_uring for whole batches (see\n"
              "submit); driven: a thread of its own submits and reaps, reap() only waits for finished jobs",
    .tp_new = ring_new,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_getset = ring_getset,
};

/* ---- extents to write ------------------------------------------------------------------------ */

static void put16(char *p, uint16_t v) { p[0] = (char)v; p[1] = (char)(v >> 8); }
static void put32(char *p, uint32_t v) { for (int k = 0; k < 4; k++) p[k] = (char)(v >> (8 * k)); }
static void put64(char *p, uint64_t v) { for (int k = 0; k < 8; k++) p[k] = (char)(v >> (8 * k)); }

#define HEADER_SIZE 64
#define MAGIC 0x4B565357u
#define VERSION 1
#define FLAG_SECTOR_PAYLOAD 1

PyDoc_STRVAR(pack_doc,
"pack(mem, at, ext_len, poff, plen, sources, digests, obj_len, part, parts, gen, sums)\n\n"
"Lay out n extents for writing (docs/format.md), GIL released: extent i fills\n"
"mem[at[i]:at[i] + ext_len[i]]: its 64-byte header, zeros up to poff[i] (64, or 4096 for a payload\n"
"of whole sectors: the header flag says which), the payload gathered from sources[i] (a buffer of\n"
"plen[i] bytes, or (base, run_offsets, run_lengths)), then zeros to the end.  The header holds\n"
"digests[16 * i:16 * i + 16], obj_len[i] (the object's payload), part[i] of parts[i], gen[i] and\n"
"the payload's xxh3-64, which is also written to sums[i] (uint64, output); its last 8 bytes are the\n"
"xxh32 of the first 56, and zeros.  at, ext_len, poff, plen, obj_len, part, parts and gen are int64\n"
"arrays; everything is bounds-checked before any byte is written.");

/* The module's helper for pack (started on the first pack that could use it). */
static Helper *pack_helper = NULL;
static int pack_helper_tried = 0;

typedef struct {
    char *mem;
    const Scatter *src;
    const char *digests;
    const int64_t *at, *el, *po, *pl, *ol, *pt, *pts, *gen;
    uint64_t *sums;
} Packing;

/* Lay extents [lo, hi) out: payload gathered, padding zeroed, header packed, checksums. */
static void pack_range(void *ctx, int lo, int hi) {
    const Packing *k = ctx;
    for (int i = lo; i < hi; i++) {
        char *p = k->mem + k->at[i];
        const int64_t po = k->po[i], pl = k->pl[i];
        gather_copy(k->src, i, p + po);
        memset(p + HEADER_SIZE, 0, (size_t)(po - HEADER_SIZE));
        memset(p + po + pl, 0, (size_t)(k->el[i] - po - pl));
        uint64_t sum = hash_payload(p + po, (size_t)pl);
        k->sums[i] = sum;
        put32(p, MAGIC);
        put16(p + 4, VERSION);
        put16(p + 6, po > HEADER_SIZE ? FLAG_SECTOR_PAYLOAD : 0);
        memcpy(p + 8, k->digests + 16 * i, 16);
        put32(p + 24, (uint32_t)k->ol[i]);
        put16(p + 28, (uint16_t)k->pt[i]);
        put16(p + 30, (uint16_t)k->pts[i]);
        put64(p + 32, (uint64_t)k->gen[i]);
        put64(p + 40, sum);
        memset(p + 48, 0, 8);
        put32(p + 56, XXH32(p, HEADER_BODY, 0));
        memset(p + 60, 0, 4);
    }
}

static PyObject *pack_helped(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLongLong(helper_helped(pack_helper));
}

static PyObject *pack(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[12];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9],
                          &o[10], &o[11]))
        return NULL;
    Py_buffer mem = {0}, a[9];
    memset(a, 0, sizeof(a));
    Scatter src = {0};
    PyObject *ret = NULL;
    /* a: at, ext_len, poff, plen, obj_len, part, parts, gen (int64), sums (uint64, written) */
    PyObject *arrs[9] = {o[1], o[2], o[3], o[4], o[7], o[8], o[9], o[10], o[11]};
    const char *names[9] = {"at", "ext_len", "poff", "plen", "obj_len", "part", "parts", "gen", "sums"};
    Py_buffer dg = {0};
    if (PyObject_GetBuffer(o[0], &mem, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(arrs[0], &a[0], PyBUF_C_CONTIGUOUS) < 0) goto done;
    Py_ssize_t n = a[0].len / 8;
    for (int k = 1; k < 9; k++)
        if (hold(arrs[k], &a[k], n, 8, k == 8, names[k]) < 0) goto done;
    if (hold(o[6], &dg, n, 16, 0, "digests") < 0) goto done;
    if (!PyList_Check(o[5]) || PyList_GET_SIZE(o[5]) != n) {
        PyErr_SetString(PyExc_ValueError, "sources: a list with one entry per extent");
        goto done;
    }
    const int64_t *at = a[0].buf, *el = a[1].buf, *po = a[2].buf, *pl = a[3].buf, *ol = a[4].buf, *pt = a[5].buf,
                  *pts = a[6].buf, *gen = a[7].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0 || el[i] < HEADER_SIZE || at[i] > mem.len - el[i] || (po[i] != HEADER_SIZE && po[i] != 4096)
            || pl[i] < 0 || po[i] > el[i] - pl[i] || ol[i] < 0 || ol[i] > 0xffffffffLL || pt[i] < 0
            || pts[i] > 0xffff || pt[i] >= pts[i]) {
            PyErr_Format(PyExc_ValueError, "extent %zd does not fit its buffer or its header's fields", i);
            goto done;
        }
    }
    if (scatter_alloc(&src, n) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(o[5], i);
        if (b == Py_None) {
            PyErr_Format(PyExc_ValueError, "sources[%zd]: every extent needs its payload", i);
            goto done;
        }
        if (scatter_hold_as(&src, i, b, pl[i], 0) < 0) goto done;
    }
    if (pack_helper == NULL && !pack_helper_tried) { /* under the GIL: one start per process */
        pack_helper_tried = 1;
        pack_helper = helper_start();
    }
    Packing pk = {mem.buf, &src, dg.buf, at, el, po, pl, ol, pt, pts, gen, a[8].buf};
    Py_BEGIN_ALLOW_THREADS
    helper_run(n > INT_MAX ? NULL : pack_helper, pack_range, &pk, pl, (int)n);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    scatter_release(&src);
    if (dg.obj) PyBuffer_Release(&dg);
    for (int k = 0; k < 9; k++)
        if (a[k].obj) PyBuffer_Release(&a[k]);
    PyBuffer_Release(&mem);
    return ret;
}

static PyMethodDef module_methods[] = {
    {"pack", pack, METH_VARARGS, pack_doc},
    {"pack_helped", pack_helped, METH_NOARGS, "extents packed by pack()'s helper thread so far (0: none runs)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "kvswarm.io._batchio", .m_doc = "whole batches of verified O_DIRECT I/O on io_uring",
    .m_size = -1, .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__batchio(void) {
    payload_init();
    if (PyType_Ready(&JobType) < 0 || PyType_Ready(&RingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) return NULL;
    Py_INCREF(&JobType);
    if (PyModule_AddObject(m, "Job", (PyObject *)&JobType) < 0) return NULL;
    static const struct { const char *name; int v; } consts[] = {
        {"OK", V_OK}, {"SHORT", V_SHORT}, {"ERRNO", V_ERRNO}, {"BAD_HEADER", V_HEADER}, {"BAD_CHECKSUM", V_CHECKSUM},
        {"READ", OP_READ}, {"WRITE", OP_WRITE}, {"HEADER_BODY", HEADER_BODY}, {"MAX_BUCKETS", MAX_BUCKETS},
    };
    for (size_t k = 0; k < sizeof(consts) / sizeof(*consts); k++)
        if (PyModule_AddIntConstant(m, consts[k].name, consts[k].v) < 0) return NULL;
    return m;
}
