/* kvswarm.store._verify: verify a read batch's payloads and copy the good ones into the caller's
 * buffers, on native worker threads that never take the GIL.
 *
 * Why native, and why threads of its own: per payload, xxhash and numpy each release and retake
 * the GIL.  When another thread holds the GIL most of the time (vLLM's scheduler loop, in the
 * process that runs the offloading tiers), every retake waits for it, and a store thread that
 * verified 256 KiB payloads one by one fell to half the speed of vLLM's own file tier.  Here the
 * driver thread hands a whole batch over in one call and polls `done`; the hashing and copying
 * run meanwhile on other cores, whoever holds the GIL.  Jobs start in the order they were handed
 * over; with several workers they may finish in another.  A thread with nothing else to do (a
 * driver whose drives are idle) can run queued jobs too, with `assist`: the disk's last burst of
 * completions is then verified on two cores, not queued behind one worker.
 */
#include "payload.h"
#include <errno.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include <stdlib.h>

typedef struct Job {
    PyObject_HEAD
    Py_buffer src, off, len, sum, ok;
    Scatter into;      /* per payload, where it is copied to (or, in place, where it lies) */
    Py_ssize_t n;      /* payloads */
    int held;       /* how many of src, ok, off, len, sum are held */
    int inplace;    /* no src: payload i is into[i] itself, verified where it lies and copied nowhere */
    int queued;     /* handed to the worker: freeing it must wait until it is finished */
    int state;      /* 0 queued or running, 1 finished; written by the worker (atomics) */
    struct Job *next;
} Job;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER, finished = PTHREAD_COND_INITIALIZER;
/* Workers: one per spare core, at most MAX_WORKERS (one thread hashes ~15 GB/s and copies ~8 GB/s
 * here; a server's drives can deliver several times that).  KVSWARM_VERIFY_THREADS overrides. */
#define MAX_WORKERS 8
#define MAX_HELPERS 8 /* threads inside `assist` at once; slots after the workers' in `running` */
static Job *head = NULL, *tail = NULL, *running[MAX_WORKERS + MAX_HELPERS];
static int started = 0, busy = 0;

static void run(Job *j) {
    const char *base = j->src.buf;
    const int64_t *o = j->off.buf, *l = j->len.buf;
    const uint64_t *want = j->sum.buf;
    uint8_t *good = j->ok.buf;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        if (!good[i]) continue;
        const char *p = j->inplace ? j->into.dst[i].buf : base + o[i];
        if (hash_payload(p, (size_t)l[i]) != want[i]) { good[i] = 0; continue; }
        if (!j->inplace) scatter_copy(&j->into, i, p);
    }
    copies_fence();
}

/* Take the queue's head into running[slot] and run it (called with mu held, returns with it held). */
static void run_head(int slot) {
    Job *j = head;
    head = j->next;
    if (head == NULL) tail = NULL;
    running[slot] = j;
    busy++;
    pthread_mutex_unlock(&mu);
    run(j);
    pthread_mutex_lock(&mu);
    running[slot] = NULL;
    busy--;
    __atomic_store_n(&j->state, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&finished);
}

static void *worker(void *arg) {
    int me = (int)(intptr_t)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (head == NULL) pthread_cond_wait(&work, &mu);
        run_head(me);
    }
    return NULL;
}

static int wanted_workers(void) {
    const char *env = getenv("KVSWARM_VERIFY_THREADS");
    long n = env != NULL ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN) - 1;
    return n < 1 ? 1 : n > MAX_WORKERS ? MAX_WORKERS : (int)n;
}

/* A child of fork() has no worker threads: jobs it inherited never ran there, so they fail
 * (verification failed is a miss, never wrong data) and new workers start on first use. */
static void fail_unrun(Job *j) {
    memset(j->ok.buf, 0, (size_t)j->n);
    j->state = 1;
}

static void after_fork_child(void) {
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&work, NULL);
    pthread_cond_init(&finished, NULL);
    for (int w = 0; w < MAX_WORKERS + MAX_HELPERS; w++)
        if (running[w] != NULL) fail_unrun(running[w]);
    for (Job *j = head; j != NULL; j = j->next) fail_unrun(j);
    memset(running, 0, sizeof(running));
    head = tail = NULL;
    started = busy = 0;
}

/* Wait (GIL released) until the job is finished, or timeout seconds (< 0: no limit) have passed. */
static int wait_job(Job *j, double timeout) {
    if (__atomic_load_n(&j->state, __ATOMIC_ACQUIRE)) return 1;
    struct timespec until;
    if (timeout >= 0) {
        clock_gettime(CLOCK_REALTIME, &until);
        double t = until.tv_nsec / 1e9 + timeout;
        until.tv_sec += (time_t)t;
        until.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
    }
    int done;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    while (!(done = __atomic_load_n(&j->state, __ATOMIC_ACQUIRE))) {
        if (timeout < 0) pthread_cond_wait(&finished, &mu);
        else if (pthread_cond_timedwait(&finished, &mu, &until) == ETIMEDOUT) break;
    }
    done = __atomic_load_n(&j->state, __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    return done;
}

static void job_release(Job *j) {
    scatter_release(&j->into);
    Py_buffer *bufs[] = {&j->src, &j->ok, &j->off, &j->len, &j->sum};
    for (int k = 0; k < j->held; k++) PyBuffer_Release(bufs[k]);
    j->held = 0;
}

static void job_dealloc(Job *j) {
    if (j->queued) wait_job(j, -1); /* never free buffers the worker may still touch */
    job_release(j);
    Py_TYPE(j)->tp_free((PyObject *)j);
}

/* A finished job lets go of the buffers at once (the caller's memoryviews can then be released). */
static PyObject *job_done(Job *j, void *closure) {
    (void)closure;
    int done = __atomic_load_n(&j->state, __ATOMIC_ACQUIRE);
    if (done) job_release(j);
    return PyBool_FromLong(done);
}

static PyObject *job_wait(Job *j, PyObject *args) {
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &timeout)) return NULL;
    double t = -1;
    if (timeout != Py_None) {
        t = PyFloat_AsDouble(timeout);
        if (t == -1 && PyErr_Occurred()) return NULL;
        if (t < 0) t = 0;
    }
    int done = wait_job(j, t);
    if (done) job_release(j);
    return PyBool_FromLong(done);
}

static PyGetSetDef job_getset[] = {
    {"done", (getter)job_done, NULL, "the worker has finished this batch (never blocks); a finished job holds no buffers", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef job_methods[] = {
    {"wait", (PyCFunction)job_wait, METH_VARARGS,
     "wait(timeout=None) -> bool: block (GIL released) until the batch is finished or timeout s have passed"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvswarm.store._verify.Job",
    .tp_basicsize = sizeof(Job),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "one batch handed to the verify worker; ok and the caller's buffers are final once done",
    .tp_dealloc = (destructor)job_dealloc,
    .tp_getset = job_getset,
    .tp_methods = job_methods,
};

static int hold_array(Job *j, PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
                      const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    j->held++;
    if (view->len != j->n * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes", what, j->n, itemsize);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(submit_doc,
"submit(src, offsets, lengths, checksums, ok, into) -> Job\n\n"
"Queue a batch for the worker threads and return at once.  For each i with ok[i]: ok[i] becomes\n"
"xxh3_64(src[offsets[i]:offsets[i] + lengths[i]]) == checksums[i]; where it still holds and\n"
"into[i] is not None, that payload is copied into into[i]: a writable buffer of exactly\n"
"lengths[i] bytes, or (base, run_offsets, run_lengths), a writable buffer and two int64 arrays:\n"
"the payload is scattered over those runs of base in order (an engine page's runs in its KV\n"
"pool; the lengths sum to lengths[i]).  With src None the payloads were read straight into their\n"
"buffers: each into[i] (a buffer of exactly lengths[i] bytes) is verified where it lies, offsets\n"
"are not used and nothing is copied.  offsets and lengths are int64 arrays, checksums uint64,\n"
"ok uint8, updated in place: read it, and the buffers, only once the job is done.  Everything is bounds-checked\n"
"here; the job holds every buffer until it is freed (freeing an unfinished job waits for it).");

static PyObject *submit(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src, *off, *len, *sum, *ok, *into;
    if (!PyArg_ParseTuple(args, "OOOOOO", &src, &off, &len, &sum, &ok, &into)) return NULL;
    Job *j = PyObject_New(Job, &JobType);
    if (j == NULL) return NULL;
    memset(&j->into, 0, sizeof(j->into));
    j->n = 0;
    j->held = j->queued = j->state = 0;
    j->next = NULL;
    j->inplace = src == Py_None;
    memset(&j->src, 0, sizeof(j->src)); /* in place: no src (releasing a buffer without an object is a no-op) */
    if (!j->inplace && PyObject_GetBuffer(src, &j->src, PyBUF_SIMPLE) < 0) goto fail;
    j->held = 1;
    if (PyObject_GetBuffer(ok, &j->ok, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto fail;
    j->held = 2;
    j->n = j->ok.len;
    if (hold_array(j, off, &j->off, 8, 0, "offsets") < 0 || hold_array(j, len, &j->len, 8, 0, "lengths") < 0
        || hold_array(j, sum, &j->sum, 8, 0, "checksums") < 0)
        goto fail;
    const int64_t *o = j->off.buf, *l = j->len.buf;
    for (Py_ssize_t i = 0; i < j->n && !j->inplace; i++) {
        if (o[i] < 0 || l[i] < 0 || o[i] > j->src.len - l[i]) {
            PyErr_Format(PyExc_ValueError, "payload %zd lies outside the source buffer", i);
            goto fail;
        }
    }
    if (into != Py_None || j->inplace) {
        if (!PyList_Check(into) || PyList_GET_SIZE(into) != j->n) {
            PyErr_SetString(PyExc_ValueError, "into must be a list with one entry per payload");
            goto fail;
        }
        for (Py_ssize_t i = 0; i < j->n && j->inplace; i++) {
            PyObject *b = PyList_GET_ITEM(into, i);
            if (b == Py_None || PyTuple_Check(b)) {
                PyErr_Format(PyExc_ValueError, "into[%zd]: verified in place, so a buffer of its own", i);
                goto fail;
            }
        }
        if (scatter_alloc(&j->into, j->n) < 0) goto fail;
        for (Py_ssize_t i = 0; i < j->n; i++)
            if (scatter_hold(&j->into, i, PyList_GET_ITEM(into, i), l[i]) < 0) goto fail;
    }
    int err = 0;
    pthread_mutex_lock(&mu);
    if (!started) { /* the workers start with the first job (and again in a forked child) */
        for (int n = wanted_workers(); started < n; started++) {
            pthread_t t;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            err = pthread_create(&t, &attr, worker, (void *)(intptr_t)started);
            pthread_attr_destroy(&attr);
            if (err) break;
        }
        if (err && started > 0) err = 0; /* fewer workers than wanted still serve */
    }
    if (!err) {
        if (tail != NULL) tail->next = j; else head = j;
        tail = j;
        j->queued = 1;
        pthread_cond_signal(&work);
    }
    pthread_mutex_unlock(&mu);
    if (err) {
        PyErr_Format(PyExc_OSError, "cannot start the verify worker thread (error %d)", err);
        goto fail;
    }
    return (PyObject *)j;
fail:
    Py_DECREF(j); /* never queued: its buffers are released at once */
    return NULL;
}

static PyObject *drain(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    while (head != NULL || busy > 0) pthread_cond_wait(&finished, &mu);
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *assist(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    int ran = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    for (int slot = MAX_WORKERS; head != NULL && slot < MAX_WORKERS + MAX_HELPERS; slot++) {
        if (running[slot] == NULL) {
            run_head(slot);
            ran = 1;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ran);
}

static PyMethodDef methods[] = {
    {"submit", submit, METH_VARARGS, submit_doc},
    {"assist", assist, METH_NOARGS,
     "assist() -> bool: run the oldest queued job on this thread (GIL released), as a worker would; False if "
     "none was queued (or MAX_HELPERS threads are assisting already)"},
    {"drain", drain, METH_NOARGS,
     "drain(): wait until every job handed over so far is finished (run at exit: the worker must not touch "
     "memory the interpreter is tearing down)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_verify", .m_doc = "native verify-and-copy worker", .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__verify(void) {
    payload_init();
    if (PyType_Ready(&JobType) < 0) return NULL;
    static int atfork = 0;
    if (!atfork && pthread_atfork(NULL, NULL, after_fork_child) == 0) atfork = 1;
    return PyModule_Create(&module);
}
