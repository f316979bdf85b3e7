"""What ``KVStore.submit_get`` / ``submit_put`` return: handles on batches in flight, and a read's
outcome.

Submit, then poll: ``done`` and ``poll()`` never block; ``wait()`` blocks until the batch is over and
gives its outcome (a :class:`GetResult`, or per item whether it was stored).  A handle dropped or
failed unfinished goes to the store's :mod:`~kvswarm.store.quarantine`: its buffers and extents are
reused only once none of its I/O or verification can still touch them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvswarm.buffers import Lease, LeaseViews
from kvswarm.catalog import ExtentTable
from kvswarm.errors import KVSwarmError
from kvswarm.io import native as native_io
from kvswarm.io.base import Batch, ReadBatch
from kvswarm.store import verify
from kvswarm.store.quarantine import Abandoned
from kvswarm.store.runs import Bufs
from kvswarm.store.verify import Check, Reads, check_batch

if TYPE_CHECKING:
    from kvswarm.store.store import KVStore


@dataclass
class GetResult:
    """Payload views for the requested keys (``None`` = miss), backed by one buffer lease.

    Views stay valid until :meth:`release`; drop numpy arrays or tensors made from them first
    (a buffer still exported by one makes ``release`` raise ``BufferError``).  An object made of several extents is
    made contiguous in the lease after verification (later parts slide over the headers between them).
    """

    keys: Sequence[bytes]
    views: Sequence[memoryview | bytes | Bufs | None]  # a LeaseViews when every key hit
    lease: Lease | None
    misses: int = 0
    corrupt: int = 0
    # Keys (indices) that are stored but read back corrupt, torn or not at all (I/O error, failed
    # drive): a caller may drop them.  A miss for a buffer of the wrong length is not one of them.
    failed: list[int] = field(default_factory=list)

    def release(self) -> None:
        if self.lease is not None:
            if isinstance(self.views, LeaseViews):
                self.views.release()
            else:
                for v in self.views:
                    if isinstance(v, memoryview):
                        v.release()
            self.lease.release()
            self.lease = None

    def __enter__(self) -> GetResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Handle:
    """A batch in flight: ``done`` and ``poll()`` never block, ``wait()`` gives the outcome."""

    _store: KVStore
    _batch: Batch

    @property
    def done(self) -> bool:
        """All I/Os are back (no system call: completions are taken in by poll/wait/progress)."""
        return self._batch.done

    def poll(self) -> bool:
        if not self._batch.done:
            self._store.engine.poll(0)
        return self.done


class GetHandle(_Handle):
    """A batched read in flight; ``wait()`` returns the :class:`GetResult`.

    Once its reads are back, the first ``done`` or ``poll()`` that sees it hands the batch to
    verification (the native worker's, when built); ``done`` holds once that has finished too.
    """

    def __init__(self, store: KVStore, keys: Sequence[bytes], found: list[int], ext: ExtentTable,
                 reads: Reads, batch: ReadBatch, live: list[int] | None, lease: Lease | None) -> None:
        self._store, self._keys, self._found, self._ext, self._reads = store, keys, found, ext, reads
        self._batch, self._live, self._lease = batch, live, lease
        self._check: Check | None = None
        self._checking = False
        self._result: GetResult | None = None
        self._failed = False

    @property
    def done(self) -> bool:
        if not self._checking:
            if not self._batch.done:
                return False
            self._start_check()
        return self._check is None or self._check.done

    @property
    def reads_back(self) -> bool:
        """Whether every read of the batch has completed (its verification may still be running): a
        caller keeping a drive's queue full submits its next batch now, not after ``wait()``."""
        return self._checking or self._batch.done

    def _start_check(self) -> None:
        results = self._batch.results
        if self._live is not None:  # extents on drives out of service were not read: EIO
            full: list[int | None] = [-5] * len(self._ext.length)
            for i, r in zip(self._live, results):
                full[i] = r
            results = full
        self._check = check_batch(self._store.pool.array, self._ext, self._reads, results, self._lease)
        self._checking = True
        if self._check is not None and self._check.jobs:
            # Finished jobs leave here too, not only in progress(): callers that only wait() on their
            # handles would otherwise grow the queue without end.
            self._store._drop_verified()
            self._store._verifying.extend(self._check.jobs)

    def wait(self) -> GetResult:
        """The batch's outcome.  If this raises, the batch's buffers go back to the pool once none of
        its reads or verify jobs can still touch them (see Quarantine.give_back); waiting again raises."""
        if self._result is None:
            if self._failed:
                raise KVSwarmError("this read failed earlier; its buffers have gone back to the pool")
            try:
                self._store.engine.wait(self._batch)
                if not self._checking:
                    self._start_check()
                if self._check is not None and self._check.jobs:
                    while not self._check.done and verify.verify_assist():  # this thread would only wait
                        pass
                    for job in self._check.jobs:
                        job.wait()
                self._result = self._store._finish_get(self._keys, self._found, self._ext, self._reads,
                                                       self._check, self._lease)
            except BaseException:
                self._failed = self._checking = True  # done from now on, and no check starts on the lease
                self._store.quarantine.give_back(self._remains())
                self._check = self._lease = None
                raise
        return self._result

    def _remains(self) -> Abandoned:
        return Abandoned(self._batch, self._check.jobs if self._check is not None else (), self._lease, [])

    def __del__(self) -> None:
        # Dropped unfinished: its buffers go back once its reads are over.  Only queued here: a finalizer
        # may run while this thread holds the pool's allocator lock.
        if self._result is None and self._lease is not None:
            self._store.quarantine.hold(self._remains())


class NativeGetHandle:
    """A batched read on the native path (KVStore._submit_get_native): its I/O, header and checksum
    checks and copies into the caller's buffers all run in kvswarm.io._batchio; ``wait()`` turns the
    per-extent verdicts into the :class:`GetResult`, as :class:`GetHandle` does."""

    def __init__(self, store: KVStore, keys: Sequence[bytes], found: list[int], ext: ExtentTable, reads: Reads,
                 batch: native_io.NativeBatch | None, lease: Lease | None, payload_at: np.ndarray,
                 dst: list[Bufs | None] | None) -> None:
        self._store, self._keys, self._found, self._ext, self._reads = store, keys, found, ext, reads
        self._batch, self._lease, self._at, self._dst = batch, lease, payload_at, dst
        self._result: GetResult | None = None
        self._failed = False

    @property
    def done(self) -> bool:
        return self._failed or self._batch is None or self._batch.done

    @property
    def reads_back(self) -> bool:
        """Whether every read of the batch has completed: here, as each read is verified when it is
        taken in, the same as ``done``."""
        return self.done

    def poll(self) -> bool:
        if not self.done:
            self._store.native.poll(0)
        return self.done

    def wait(self) -> GetResult:
        """The batch's outcome.  If this raises, the batch's buffers go back to the pool once its reads are
        over (see Quarantine.give_back); waiting again raises."""
        if self._result is None:
            if self._failed:
                raise KVSwarmError("this read failed earlier; its buffers have gone back to the pool")
            try:
                self._result = self._outcome()
            except BaseException:
                self._failed = True
                if self._lease is not None:
                    self._store.quarantine.give_back(Abandoned(self._batch, (), self._lease, []))
                    self._lease = None
                raise
        return self._result

    def _outcome(self) -> GetResult:
        check = None
        if self._batch is not None:
            b = self._batch
            self._store.native.wait(b)
            ok = b.verdict == native_io.OK
            io_ok = ok | (b.verdict >= native_io.BAD_HEADER)
            lv, base = self._lease.view, self._lease.offset
            payloads = LeaseViews(lv, self._at - base, self._ext.part_payload)
            single = len(self._ext.obj) == len(self._ext.rows)
            check = Check(b.res, io_ok, ok, single, self._at, payloads, self._dst, ())
        return self._store._finish_get(self._keys, self._found, self._ext, self._reads, check, self._lease)

    def __del__(self) -> None:
        # Dropped unfinished: its buffers go back once its reads are over (see GetHandle.__del__).
        if self._result is None and self._lease is not None and self._batch is not None:
            self._store.quarantine.hold(Abandoned(self._batch, (), self._lease, []))


class PutHandle(_Handle):
    """A batched write in flight, on the Python engine (``batch`` a Batch) or the native ring (a
    NativeBatch); ``wait()`` records what was written in the catalog."""

    def __init__(self, store: KVStore, batch: Batch | native_io.NativeBatch, staged: tuple) -> None:
        self._store, self._batch = store, batch
        self._io = store.native if isinstance(batch, native_io.NativeBatch) else store.engine
        self._staged: tuple | None = staged  # None once finished or failed
        self._done: list[bool] | None = None

    def poll(self) -> bool:
        if not self._batch.done:
            self._io.poll(0)
        return self.done

    def wait(self) -> list[bool]:
        """Per item: True when stored (the catalog now points at it).  If the engine raises, nothing is
        stored; the buffers and extents go back once none of its writes can still run (a late write
        from a reused buffer, or into a reused extent, would store wrong bytes)."""
        if self._done is None:
            if self._staged is None:
                raise KVSwarmError("this put failed earlier")
            try:
                self._io.wait(self._batch)
            except BaseException:
                self._store.counters["put_failures"] += len(self._staged[0])
                self._store.quarantine.give_back(self._remains())
                self._staged = None
                raise
            staged, self._staged = self._staged, None
            self._done = self._store._finish_put(staged)
        return self._done

    def _remains(self) -> Abandoned:
        items, _, lease = self._staged
        return Abandoned(self._batch, (), lease, [e for _, e, _ in items])

    def __del__(self) -> None:
        # Dropped unfinished: nothing is stored, and its buffers and extents go back once its writes
        # are over (queued only, as GetHandle.__del__).
        if self._staged is not None:
            self._store.quarantine.hold(self._remains())
