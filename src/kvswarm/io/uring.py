"""io_uring backend (uring-api): one ring, per-drive queues with a depth cap each.

The caller's thread drives the ring (submit fills SQEs, poll reaps CQEs and refills),
so there are no worker threads and no GIL hand-offs; a lock lets several threads share it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from kvswarm.errors import KVSwarmError
from kvswarm.io.base import IOEngine, IORequest, Op, now


class UringEngine(IOEngine):
    name = "uring"

    def __init__(self, queue_depth: int = 32, ring_entries: int = 512) -> None:
        super().__init__(queue_depth)
        try:
            import uring_api
        except ImportError as e:  # optional dependency
            raise KVSwarmError("io_uring backend needs `pip install --pre uring-api`") from e
        if not uring_api.is_available():
            raise KVSwarmError("io_uring is not available to this process (kernel or seccomp)")
        self._ring = uring_api.Ring(entries=ring_entries, cq_entries=ring_entries * 2)
        self._ring_room = ring_entries
        self._pending: dict[int, deque[IORequest]] = {}
        self._drive_inflight: dict[int, int] = {}
        self._inflight = 0
        self._lock = threading.RLock()

    def attach(self, drive, fd, stats) -> None:
        super().attach(drive, fd, stats)
        self._pending[drive] = deque()
        self._drive_inflight[drive] = 0

    def _submit(self, reqs: Sequence[IORequest]) -> None:
        with self._lock:
            for r in reqs:
                r.result = None
                self._pending[r.drive].append(r)
                self.stats[r.drive].queue_depth += 1
            self._inflight += len(reqs)
            self._fill()
            self._ring.submit()

    def _fill(self) -> None:
        """Move pending requests into the ring, round-robin over drives, each under its depth cap."""
        ring, qd, t = self._ring, self.queue_depth, now()
        busy = True
        while busy and self._ring_room:
            busy = False
            for d, pend in self._pending.items():
                if pend and self._drive_inflight[d] < qd and self._ring_room:
                    r = pend.popleft()
                    r.t_submit = t
                    if r.op == Op.READ:
                        ring.prepare_read(self.fds[d], r.buf, r.offset, r)
                    else:
                        ring.prepare_write(self.fds[d], r.buf, r.offset, r)
                    self._drive_inflight[d] += 1
                    self._ring_room -= 1
                    busy = True

    def poll(self, timeout: float | None = 0.0) -> list[IORequest]:
        with self._lock:
            if not self._inflight:
                return []
            cqes = self._ring.wait(timeout)
            t = now()
            out = []
            for c in cqes or ():
                r: IORequest = c.user_data
                r.result = c.res
                self._drive_inflight[r.drive] -= 1
                self._ring_room += 1
                self._account(r, t)
                out.append(r)
            self._inflight -= len(out)
            if out:
                self._fill()
                self._ring.submit()
            return out

    def inflight(self) -> int:
        return self._inflight

    def close(self) -> None:
        with self._lock:
            while self._inflight:
                self.poll(None)
            self._ring.close()
