"""Whole batches of O_DIRECT I/O on the native io_uring path (``kvswarm.io._batchio``, docs/native-io.md).

One call per batch: arrays in (drive, offset, length, where in a buffer; for verified reads the
expected header, payload span, checksum and the caller's buffers), one :class:`NativeBatch` out,
whose ``verdict`` per extent is final once it is ``done``.  Submission, reaping, header checks,
checksums and the copies run in C with the GIL released; Python sees one object per batch, never one
per I/O.  Submit, then poll: :meth:`NativeIO.poll` (or :meth:`NativeIO.wait`) drives read
completions in the caller's thread, as the ``uring`` engine does; writes go to a second ring that a
thread of its own drives where a core is spare, and polls only take its finished batches in.

The path exists where the extension was built and the kernel lets this process set up an io_uring
(5.11 or later); ``KVSWARM_NATIVE_IO=0`` in the environment turns it off (the Python engines then do
all I/O, as they do where it is missing).
"""

from __future__ import annotations

import functools
import os
import time
import numpy as np

from kvswarm.io.base import Op
from kvswarm.metrics import LATENCY_BUCKETS, READ, WRITE, DriveStats

try:
    from kvswarm.io import _batchio
except ImportError:  # built without a C compiler, or without Linux's io_uring header
    _batchio = None

ENV = "KVSWARM_NATIVE_IO"
FOLD_S = 0.05  # drive statistics lag the ring by at most this while it is polled (see NativeIO.fold_stats)
# Verdicts per extent (kvswarm.io._batchio's codes).
OK, SHORT, ERRNO, BAD_HEADER, BAD_CHECKSUM = 0, 1, 2, 3, 4


@functools.cache
def _ring_works() -> bool:
    try:
        _batchio.Ring(8, 1).close()
    except OSError:  # io_uring refused (seccomp, an old kernel)
        return False
    return True


def available() -> bool:
    """The extension is built and this process can set up its ring."""
    return _batchio is not None and _ring_works()


def enabled(wanted: bool = True) -> bool:
    """Whether a store that ``wanted`` the native path gets it: available, and not turned off by
    ``KVSWARM_NATIVE_IO=0``."""
    return wanted and os.environ.get(ENV, "1") != "0" and available()


class NativeBatch:
    """A batch on the ring.  ``verdict`` (per extent: OK, SHORT, ERRNO, BAD_HEADER, BAD_CHECKSUM) and
    ``res`` (bytes moved or -errno) are final once ``done``; ``done`` never blocks."""

    __slots__ = ("job", "op", "drive", "offset", "length", "verdict", "res", "lat")

    def __init__(self, job, op: Op, drive: np.ndarray, offset: np.ndarray, length: np.ndarray, verdict: np.ndarray,
                 res: np.ndarray, lat: np.ndarray) -> None:
        self.job, self.op, self.drive, self.offset, self.length = job, op, drive, offset, length
        self.verdict, self.res, self.lat = verdict, res, lat

    @property
    def done(self) -> bool:
        return self.job.done


def pack(mem: object, at: np.ndarray, ext_len: np.ndarray, poff: np.ndarray, plen: np.ndarray, sources: list,
         digests: bytes, obj_len: np.ndarray, part: np.ndarray, parts: np.ndarray, gen: np.ndarray) -> np.ndarray:
    """Lay extents out for writing in ``mem`` (header, payload gathered from ``sources``, padding; see
    ``kvswarm.io._batchio.pack``), GIL released; returns their payloads' xxh3-64."""
    sums = np.empty(len(at), np.uint64)
    _batchio.pack(mem, at, ext_len, poff, plen, sources, np.frombuffer(digests, np.uint8), obj_len, part, parts, gen,
                  sums)
    return sums


def pack_helped() -> int:
    """Extents :func:`pack` handed to its helper thread so far (a second core packing half of a batch
    of at least 512 KiB of payloads; none on one CPU or with ``KVSWARM_IO_HELPER=0``)."""
    return _batchio.pack_helped()


class NativeIO:
    """Two native rings for a set of drives (attached as the engines' are): reads on one, driven by
    the callers' polls; writes on the other, driven by a thread of its own where a core is spare
    (``Ring(driven=True)``: submitting a write batch costs the block layer's work per I/O, and a
    caller packing its next put batch would otherwise leave the drives idle).  Each drive has up to
    ``queue_depth`` reads and ``queue_depth`` writes in flight: a read never waits for a slot held
    by a write (a load queued behind a large store on a write-capped drive would wait for the
    store).  Drive statistics are kept as the engines keep them."""

    def __init__(self, queue_depth: int = 32, single_thread: bool = False, entries: int = 1024) -> None:
        self._reads = _batchio.Ring(entries, queue_depth, single_thread)
        try:
            self._writes = _batchio.Ring(entries, queue_depth, single_thread, driven=True)
        except BaseException:
            self._reads.close()
            raise
        self._rings = (self._reads, self._writes)
        for r in self._rings:
            r.set_buckets(LATENCY_BUCKETS.tolist())
        # per drive and op: ops, bytes, errors, latency sum, then the buckets' counts (see take_stats)
        self._fields = 4 + _batchio.MAX_BUCKETS + 1
        self._fold_at = 0.0
        self.queue_depth = queue_depth
        self.stats: dict[int, DriveStats] = {}

    def attach(self, drive: int, fd: int, stats: DriveStats) -> None:
        for r in self._rings:
            r.attach(drive, fd)
        self.stats[drive] = stats

    def detach(self, drive: int) -> None:
        """I/O queued for ``drive`` from now on fails with EIO at once (a drive taken out of service)."""
        for r in self._rings:
            r.attach(drive, -1)

    def set_depth(self, depth: int) -> None:
        for r in self._rings:
            r.set_depth(depth)
        self.queue_depth = depth

    def submit(self, op: Op, mem: object, drive: np.ndarray, offset: np.ndarray, length: np.ndarray,
               at: np.ndarray, want: np.ndarray | None = None, poff: np.ndarray | None = None,
               plen: np.ndarray | None = None, sums: np.ndarray | None = None,
               into: list | None = None) -> NativeBatch:
        """Queue a batch (int64 arrays; see ``kvswarm.io._batchio.Ring.submit``); returns at once.
        With ``sums`` the reads are verified (``want``: their expected 56-byte header bodies, or None)
        and each verified payload is copied to ``into[i]`` (None, a buffer, or (base, offsets, lengths))."""
        n = len(drive)
        verdict, res, lat = np.empty(n, np.uint8), np.empty(n, np.int64), np.empty(n, np.int64)
        ring = self._writes if op == Op.WRITE else self._reads
        job = ring.submit(int(op), mem, drive, offset, length, at, verdict, res, lat, want, poff, plen, sums, into)
        return NativeBatch(job, op, drive, offset, length, verdict, res, lat)

    def poll(self, timeout: float | None = 0.0, op: Op | None = None) -> int:
        """Take completions in, waiting up to ``timeout`` s (None: until one comes, or nothing is in
        flight) for one; returns how many I/Os completed.  The wait is on ``op``'s ring, else on the
        reads' while any are in flight (the writes' finished batches are taken in too, without
        waiting).  The rings wait in 10 ms slices, so a completion another thread takes in never
        leaves this one waiting."""
        before = self.completions
        while True:
            on_writes = op == Op.WRITE or (op is None and not self._reads.queued)
            if self._writes.queued:
                self._writes.reap(timeout if on_writes else 0)
            if self._reads.queued:
                self._reads.reap(0 if on_writes else timeout)
            if timeout is not None or self.completions != before or not self.inflight():
                break
        if time.monotonic() >= self._fold_at:
            self.fold_stats()
        return self.completions - before

    def wait(self, batch: NativeBatch) -> None:
        """Drive completions until ``batch`` is done.  A batch with failed I/O has the drives'
        statistics brought up to date at once: the store counts errors there to fail a drive."""
        while not batch.done:
            self.poll(None, batch.op)
        if len(batch.res) and batch.res.min() < 0:
            self.fold_stats()

    def inflight(self) -> int:
        """I/Os submitted and not yet completed (queued for a ring or in it)."""
        return self._reads.queued + self._writes.queued

    def busy(self, drive: int, op: Op = Op.READ) -> int:
        """``drive``'s reads (or writes) in the ring now (at most the queue depth)."""
        return (self._writes if op == Op.WRITE else self._reads).busy(drive, int(op))

    @property
    def completions(self) -> int:
        return self._reads.completions + self._writes.completions

    @property
    def helped(self) -> int:
        """Extents verified by the read ring's helper thread (a second core hashing half of a pass that
        took in at least 512 KiB of payloads; none on one CPU or with ``KVSWARM_IO_HELPER=0``)."""
        return self._reads.helped

    def close(self) -> None:
        for r in self._rings:
            r.close()
        self.fold_stats()

    def fold_stats(self) -> None:
        """Bring the drives' statistics up to date.  The ring counts completions per drive in C (ops,
        bytes, errors, latency histogram); they reach the DriveStats here, which polls do at most every
        FOLD_S (a dozen array operations per fold, none per I/O), and the store before it reports them."""
        self._fold_at = time.monotonic() + FOLD_S
        reads, writes = (np.frombuffer(r.take_stats(), np.int64).reshape(-1, 2, self._fields) for r in self._rings)
        acc = np.zeros((max(len(reads), len(writes)), 2, self._fields), np.int64)
        acc[:len(reads)] += reads
        acc[:len(writes)] += writes
        for d in np.flatnonzero(acc[:, :, :3].any(axis=(1, 2))).tolist():
            st = self.stats.get(d)
            if st is None:
                continue
            for op in (READ, WRITE):
                ops, nbytes, errors, lat_ns = acc[d, op, :4].tolist()
                st.errors += errors
                if ops:
                    st.add_folded(op, ops, nbytes, acc[d, op, 4:], lat_ns / 1e9)
