"""The I/O engine contract: submit a batch of requests to many drives, poll for completions.

Requests carry 4 KiB-aligned offsets and buffers (O_DIRECT rules). Each drive has its
own queue, so drives work in parallel; completion order is not submission order.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from kvswarm.errors import UnalignedBuffer
from kvswarm.format import ALIGN
from kvswarm.metrics import DriveStats


class Op(IntEnum):
    READ = 0
    WRITE = 1


@dataclass(slots=True, eq=False)
class IORequest:
    drive: int
    op: Op
    offset: int
    buf: memoryview
    tag: object = None
    result: int | None = None  # bytes transferred, or -errno; None while in flight
    t_submit: float = 0.0
    t_done: float = 0.0  # set by engines that know when the device finished (else: harvest time)
    batch: Batch | None = None

    @property
    def ok(self) -> bool:
        return self.result == len(self.buf)


class Batch:
    """Requests submitted together; lets many callers share one engine.

    It keeps no list of its requests: requests point at their batch, and a back-pointer
    would make every batch a reference cycle that only the cyclic GC frees (that cost
    ~20% of a 4 KiB read's CPU time).
    """

    __slots__ = ("remaining",)

    def __init__(self, reqs: Sequence[IORequest]) -> None:
        self.remaining = len(reqs)
        for r in reqs:
            r.batch = self

    @property
    def done(self) -> bool:
        return self.remaining == 0


class ReadBatch:
    """Reads submitted together through :meth:`IOEngine.submit_reads`: no request object per
    read (what a batch of small reads spends most of its CPU on), one result slot each."""

    __slots__ = ("remaining", "results")

    def __init__(self, n: int) -> None:
        self.results: list[int | None] = [None] * n  # bytes read, or -errno
        self.remaining = n

    @property
    def done(self) -> bool:
        return self.remaining == 0


class _RequestReads:
    """:class:`ReadBatch`'s interface over plain requests, for engines without a leaner path."""

    __slots__ = ("_batch", "_reqs")

    def __init__(self, reqs: list[IORequest], batch: Batch) -> None:
        self._reqs, self._batch = reqs, batch

    @property
    def results(self) -> list[int | None]:
        return [r.result for r in self._reqs]

    @property
    def done(self) -> bool:
        return self._batch.done


def check_aligned(req: IORequest) -> None:
    if req.offset % ALIGN or len(req.buf) % ALIGN or len(req.buf) == 0:
        raise UnalignedBuffer(f"I/O at offset {req.offset} of {len(req.buf)} B is not 4 KiB-aligned")


class IOEngine(abc.ABC):
    """Per-drive queues over file descriptors registered with :meth:`attach`."""

    name: str = "?"

    def __init__(self, queue_depth: int = 32) -> None:
        self.queue_depth = queue_depth
        self.fds: dict[int, int] = {}
        self.stats: dict[int, DriveStats] = {}
        self.completions = 0  # I/Os finished so far (both submit paths)

    def attach(self, drive: int, fd: int, stats: DriveStats) -> None:
        self.fds[drive] = fd
        self.stats[drive] = stats

    def submit(self, reqs: Sequence[IORequest], checked: bool = False) -> Batch:
        """Queue requests; returns at once. Raises UnalignedBuffer before queueing any.

        ``checked=True`` skips the per-request checks, for callers whose offsets come from an
        extent allocator and buffers from the aligned pool (the store's hot paths).
        """
        if not checked:
            for r in reqs:
                check_aligned(r)
                if r.drive not in self.fds:
                    raise ValueError(f"drive {r.drive} is not attached to this engine")
        batch = Batch(reqs)
        if reqs:
            self._submit(reqs)
        return batch

    def submit_reads(self, drives: Sequence[int], offsets: Sequence[int],
                     bufs: Sequence[memoryview]) -> ReadBatch | _RequestReads:
        """Queue reads of ``bufs[i]`` from ``drives[i]`` at ``offsets[i]``, already checked (offsets from an
        allocator, buffers from the aligned pool); results land in the returned batch's ``results``."""
        reqs = [IORequest(d, Op.READ, o, b) for d, o, b in zip(drives, offsets, bufs)]
        return _RequestReads(reqs, self.submit(reqs, checked=True))

    @abc.abstractmethod
    def _submit(self, reqs: Sequence[IORequest]) -> None:
        """Backend-specific queueing of already-checked requests."""

    @abc.abstractmethod
    def poll(self, timeout: float | None = 0.0) -> list[IORequest]:
        """Completed requests of :meth:`submit` (result set); waits up to ``timeout`` s (None: until
        an I/O completes).  Reads of :meth:`submit_reads` finish in their batch, and count in
        :attr:`completions` like every I/O."""

    @abc.abstractmethod
    def inflight(self) -> int:
        """Requests submitted and not yet returned by poll."""

    def wait(self, batch: Batch | ReadBatch | _RequestReads) -> None:
        """Drive completions until ``batch`` is done (completions of other batches are accounted too).

        Polls in short slices: when several threads share the engine, another one may take this
        batch's last completions, and a blocking poll would then wait for an I/O that never comes."""
        while not batch.done:
            self.poll(0.01)

    def run(self, reqs: Sequence[IORequest]) -> None:
        self.wait(self.submit(reqs))

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing
        pass

    def _complete(self, reqs: Sequence[IORequest], now: float) -> None:
        """Account finished requests (result set): their batches, queue depths, stats."""
        stats = self.stats
        self.completions += len(reqs)
        for r in reqs:
            b = r.batch
            if b is not None:
                b.remaining -= 1
            st = stats[r.drive]
            st.queue_depth -= 1
            res = r.result
            if res is not None and res >= 0:
                st.record(r.op, res, (r.t_done or now) - r.t_submit)
            else:
                st.errors += 1


now = time.perf_counter
