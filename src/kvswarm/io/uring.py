"""io_uring backend (uring-api): one ring, per-drive queues with a depth cap each.

The caller's thread drives the ring (submit fills SQEs, poll reaps CQEs and refills),
so there are no worker threads and no GIL hand-offs; a lock lets several threads share it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence

from kvswarm.errors import KVSwarmError
from kvswarm.io.base import Batch, IOEngine, IORequest, Op, ReadBatch, now


def make_ring(entries: int, cq_entries: int, single_thread: bool = False):
    """A ring as kvswarm sets them up (the engine, and the raw baseline alike).

    ``single_thread``: one thread submits and reaps, so completions can wait until it next
    enters the kernel instead of interrupting it (COOP_TASKRUN; 4 KiB store reads: ~11 vs ~13 us
    of CPU per object).  With several threads that would be unsafe: a completion is run by the
    thread that submitted the I/O, and one that stays out of the kernel would hold up another's
    wait indefinitely.  Kernels before 5.19 refuse the flag; the ring is then made without it.
    """
    import uring_api

    if single_thread:
        with contextlib.suppress(OSError):
            return uring_api.Ring(entries=entries, cq_entries=cq_entries,
                                  flags=uring_api.IORING_SETUP_COOP_TASKRUN)
    return uring_api.Ring(entries=entries, cq_entries=cq_entries)


class UringEngine(IOEngine):
    name = "uring"

    def __init__(self, queue_depth: int = 32, ring_entries: int = 512, single_thread: bool = False) -> None:
        super().__init__(queue_depth)
        try:
            import uring_api
        except ImportError as e:  # optional dependency
            raise KVSwarmError("io_uring backend needs `pip install --pre uring-api`") from e
        if not uring_api.is_available():
            raise KVSwarmError("io_uring is not available to this process (kernel or seccomp)")
        self._ring = make_ring(ring_entries, ring_entries * 2, single_thread)
        self._ring_room = ring_entries
        self._pending: dict[int, deque[tuple]] = {}  # per drive: (op, buf, offset, owner, j), see _fill
        self._inflight = 0
        self._lock = threading.RLock()

    def attach(self, drive, fd, stats) -> None:
        super().attach(drive, fd, stats)
        self._pending[drive] = deque()

    def _submit(self, reqs: Sequence[IORequest]) -> None:
        with self._lock:
            pending = self._pending
            for r in reqs:
                r.result = None
                pending[r.drive].append((r.op, r.buf, r.offset, r, -1))
            self._inflight += len(reqs)
            self._fill()
            self._ring.submit()

    def submit_reads(self, drives: Sequence[int], offsets: Sequence[int], bufs: Sequence[memoryview]) -> ReadBatch:
        batch = ReadBatch(len(bufs))
        with self._lock:
            pending, read = self._pending, Op.READ
            for j, (d, off, buf) in enumerate(zip(drives, offsets, bufs)):
                pending[d].append((read, buf, off, batch, j))
            self._inflight += len(bufs)
            self._fill()
            self._ring.submit()
        return batch

    def _fill(self) -> None:
        """Move pending I/Os into the ring, each drive up to its depth cap.

        The ring is sized for several drives at full depth, so one drive's share
        rarely waits on another's; completions refill in the next poll.  A pending I/O is
        ``(op, buf, offset, owner, j)``: owner an IORequest (j = -1) or a ReadBatch (j = slot).
        A drive's ``stats.queue_depth`` is its I/Os in the ring; each I/O carries its drive's
        stats, so a completion updates them without a lookup.
        """
        ring, qd, room, t = self._ring, self.queue_depth, self._ring_room, now()
        prep_read, prep_write, read = ring.prepare_read, ring.prepare_write, Op.READ
        for d, pend in self._pending.items():
            st = self.stats[d]
            k = min(len(pend), qd - st.queue_depth, room)
            if k <= 0:
                continue
            fd, pop = self.fds[d], pend.popleft
            for _ in range(k):
                op, buf, off, owner, j = pop()
                (prep_read if op == read else prep_write)(fd, buf, off, (owner, j, st, t))
            st.queue_depth += k
            room -= k
            if not room:
                break
        self._ring_room = room

    def poll(self, timeout: float | None = 0.0) -> list[IORequest]:
        with self._lock:
            return [u[0] for c in self._reap(timeout) if (u := c.user_data)[1] < 0]

    def wait(self, batch: Batch | ReadBatch) -> None:
        while not batch.done:
            with self._lock:
                self._reap(None)

    def _reap(self, timeout: float | None) -> list:
        """Account the ring's completions (the caller holds the lock), refill and submit."""
        if not self._inflight:
            return []
        cqes = self._ring.wait(timeout)
        if not cqes:
            return []
        t = now()
        write = Op.WRITE
        for c in cqes:  # IOEngine._complete and DriveStats.record, inlined: this loop runs once per I/O
            owner, j, st, t0 = c.user_data
            res = c.res
            if j >= 0:  # a ReadBatch slot
                owner.results[j] = res
                owner.remaining -= 1
                op = 0
            else:
                owner.result = res
                owner.t_submit = t0
                b = owner.batch
                if b is not None:
                    b.remaining -= 1
                op = 1 if owner.op == write else 0
            st.queue_depth -= 1
            if res >= 0:
                st.ops[op] += 1
                st.bytes[op] += res
                st._pending_lat[op].append(t - t0)
            else:
                st.errors += 1
        for st in self.stats.values():
            st.fold_if_long()
        n = len(cqes)
        self.completions += n
        self._ring_room += n
        self._inflight -= n
        self._fill()
        self._ring.submit()
        return cqes

    def inflight(self) -> int:
        return self._inflight

    def close(self) -> None:
        with self._lock:
            while self._inflight:
                self.poll(None)
            self._ring.close()
