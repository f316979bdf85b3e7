"""User-space drive model: per-drive bandwidth/IOPS pacing plus a fixed latency.

This is the fallback emulation for machines without loop devices or the blkio
controller (see :mod:`kvswarm.testbed`).  A :class:`DrivePacer` schedules each I/O
like the kernel throttle does (a request may start once the drive's budget for the
previous ones is spent) and adds a fixed latency before the request reaches the
disk, as a remote drive would.  :class:`ThrottledEngine` applies the models to any
:class:`IOEngine` by holding requests until their start time, so the store's code
path stays the production one; raw baselines call :meth:`DrivePacer.schedule` directly.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvswarm.io.base import IOEngine, IORequest, Op
from kvswarm.metrics import DriveStats


@dataclass(frozen=True)
class DriveCaps:
    """Per-drive limits; ``None`` = unlimited. MB are 10**6 bytes (as in fio and the kernel)."""

    read_mbps: float | None = None
    write_mbps: float | None = None
    read_iops: float | None = None
    write_iops: float | None = None
    latency_ms: float = 0.0  # user-space model only: the kernel throttle has no latency knob

    def describe(self) -> str:
        def f(v: float | None, unit: str) -> str:
            return "unlimited" if v is None else f"{v:g} {unit}"

        s = (f"read {f(self.read_mbps, 'MB/s')}, {f(self.read_iops, 'IOPS')}; "
             f"write {f(self.write_mbps, 'MB/s')}, {f(self.write_iops, 'IOPS')}")
        return s + (f"; +{self.latency_ms:g} ms latency" if self.latency_ms else "")


@dataclass
class DrivePacer:
    """Pacing for one drive: an I/O of n bytes costs max(n / bandwidth, 1 / IOPS) of drive time."""

    caps: DriveCaps
    _next: list[float] = field(default_factory=lambda: [0.0, 0.0])  # per op: when the drive is free again
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def schedule(self, op: int, nbytes: int, now: float) -> float:
        """Reserve drive time for one I/O submitted at ``now``; returns when it may be issued."""
        c = self.caps
        bps, iops = (c.read_mbps, c.read_iops) if op == Op.READ else (c.write_mbps, c.write_iops)
        cost = max(nbytes / (bps * 1e6) if bps else 0.0, 1.0 / iops if iops else 0.0)
        with self._lock:
            start = max(now, self._next[op])
            self._next[op] = start + cost
        return max(start, now + c.latency_ms / 1e3)


class ThrottledEngine(IOEngine):
    """Wraps an engine: each request is handed to it only when its drive's model lets it start."""

    def __init__(self, inner: IOEngine, models: dict[int, DrivePacer]) -> None:
        super().__init__(inner.queue_depth)
        self.inner = inner
        self.name = f"{inner.name}+model"
        self.fds, self.stats = inner.fds, inner.stats  # drives already attached to the inner engine
        self.models = models
        self._held: list[tuple[float, int, IORequest]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def attach(self, drive: int, fd: int, stats: DriveStats) -> None:
        self.inner.attach(drive, fd, stats)

    def _submit(self, reqs: Sequence[IORequest]) -> None:
        t = time.perf_counter()
        with self._lock:
            for r in reqs:
                m = self.models.get(r.drive)
                due = m.schedule(r.op, len(r.buf), t) if m else t
                heapq.heappush(self._held, (due, next(self._seq), r))
        self._release()

    def _release(self) -> float | None:
        """Hand due requests to the inner engine; returns the next due time (None: nothing held)."""
        t = time.perf_counter()
        due: list[IORequest] = []
        with self._lock:
            while self._held and self._held[0][0] <= t:
                due.append(heapq.heappop(self._held)[2])
            nxt = self._held[0][0] if self._held else None
        if due:
            self.inner._submit(due)  # the outer submit already checked them and made the batch
        return nxt

    def poll(self, timeout: float | None = 0.0) -> list[IORequest]:
        nxt = self._release()
        if nxt is not None:
            wait = max(0.0, nxt - time.perf_counter())
            timeout = wait if timeout is None else min(timeout, wait)
        if self.inner.inflight():
            out = self.inner.poll(timeout)
        else:
            if timeout:
                time.sleep(timeout)
            out = []
        self._release()
        self.completions = self.inner.completions
        return out

    def inflight(self) -> int:
        with self._lock:
            return len(self._held) + self.inner.inflight()

    def close(self) -> None:
        while self.inflight():
            self.poll(None)
        self.inner.close()
