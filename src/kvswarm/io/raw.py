"""Raw O_DIRECT load generators: the fio-like baselines the benchmarks and the testbed measure with.

Two ways to drive the disk as hard as a program can: ``threads`` workers each issuing
``os.preadv``/``os.pwritev`` back to back, and one ``io_uring`` ring kept at a fixed
queue depth.  Both walk a list of (drive, offset) I/Os of one size, in the given
order, for a fixed time or until the list is done; neither verifies anything.  Where
the drives are emulated in user space, each I/O first waits for its drive model
(:class:`kvswarm.io.throttle.DrivePacer`), as the store's I/O does.
"""

from __future__ import annotations

import heapq
import itertools
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvswarm.buffers import BufferPool
from kvswarm.format import ALIGN
from kvswarm.io.base import Op
from kvswarm.io.throttle import DrivePacer

T = TypeVar("T")


@dataclass
class RawResult:
    method: str
    ops: int
    nbytes: int
    seconds: float
    cpu_seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def iops(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_seconds / (self.nbytes / 1e9) if self.nbytes else 0.0


def cpu_time() -> float:
    """User + system CPU seconds of this process, all threads (io_uring work included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def tune_passes(settings: Sequence[T], sample: Callable[[T], float], passes: int = 2) -> dict[T, float]:
    """Each setting sampled ``passes`` times, every other pass in reverse order (drift favours neither
    end).  The point is that one odd sample does not decide: of two passes the better is kept (one
    noisy sample could reject a setting the disk was merely slow for); of three or more the median
    (nor can one lucky sample pick a setting that then runs slower when it is measured again)."""
    got: dict[T, list[float]] = {s: [] for s in settings}
    for p in range(passes):
        for s in settings if p % 2 == 0 else settings[::-1]:
            got[s].append(sample(s))
    return {s: max(v) if passes <= 2 else statistics.median(v) for s, v in got.items()}


def _buffers(nbytes: int, fill: bytes = b"") -> BufferPool:
    """I/O buffers from the store's own :class:`BufferPool` (same memory, same page layout), faulted
    in before the timer starts: faults in the timed loop, or pages laid out differently from the
    store's, move this disk's large-read throughput by up to 2x on their own."""
    pool = BufferPool(nbytes)
    mm = pool.view.obj
    if fill:
        for a in range(0, nbytes, len(fill)):
            mm[a:a + len(fill)] = fill
    else:
        for a in range(0, len(mm), ALIGN):
            mm[a] = 0
    return pool


def run_threads(fds: Sequence[int], ios: Sequence[tuple[int, int]], size: int, op: Op, threads: int,
                seconds: float, models: Sequence[DrivePacer] | None = None,
                deliver: Callable[[int, memoryview], None] | None = None,
                into: Sequence[memoryview] | None = None) -> RawResult:
    """``threads`` workers share ``ios`` (drive, offset) and issue one blocking preadv/pwritev each.

    ``deliver(i, buf)``, if given, runs in the worker after I/O ``i`` with its buffer, before the
    buffer is reused: the least a consumer of the data must do with it (a copy to where it is used).
    ``into``: I/O ``i`` reads into (or writes from) ``into[i]`` (``size`` bytes, aligned) rather than
    its worker's one buffer: data landing where it is used, every I/O in memory of its own.
    """
    nxt = itertools.count()  # next() on a count is atomic under the GIL
    done = [0] * threads
    stop = time.perf_counter() + seconds
    n = len(ios)
    # With ``into`` every I/O has a buffer of its own: the workers' reused ones would go unused.
    pool = _buffers(size * threads, os.urandom(size) if op == Op.WRITE else b"") if into is None else None

    def worker(w: int) -> None:
        buf = pool.view[w * size:(w + 1) * size] if pool is not None else None
        io = os.preadv if op == Op.READ else os.pwritev
        count, now = 0, time.perf_counter
        while (i := next(nxt)) < n and now() < stop:
            d, off = ios[i]
            if models is not None:
                due = models[d].schedule(op, size, now())
                if (dt := due - now()) > 0:
                    time.sleep(dt)
            if io(fds[d], [buf if into is None else into[i]], off) != size:
                raise OSError(f"short {op.name.lower()} at drive {d} offset {off}")
            if deliver is not None:
                deliver(i, buf)
            count += 1
        done[w] = count

    ts = [threading.Thread(target=worker, args=(w,), name=f"raw-{w}") for w in range(threads)]
    c0, t0 = cpu_time(), time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    el, cpu = time.perf_counter() - t0, cpu_time() - c0
    ops = sum(done)
    return RawResult(f"preadv x{threads}" if op == Op.READ else f"pwritev x{threads}", ops, ops * size, el, cpu)


def run_uring(fds: Sequence[int], ios: Sequence[tuple[int, int]], size: int, op: Op, depth: int,
              seconds: float, models: Sequence[DrivePacer] | None = None,
              into: Sequence[memoryview] | None = None) -> RawResult:
    """One io_uring kept ``depth`` I/Os deep over all drives (``into``: as for :func:`run_threads`)."""
    from kvswarm.io.uring import make_ring

    ring = make_ring(max(8, depth), max(16, 2 * depth), single_thread=True)
    slots: list[memoryview] = []  # the reused buffers, without ``into``
    if into is None:
        view = _buffers(size * depth, os.urandom(size) if op == Op.WRITE else b"").view
        slots = [view[s * size:(s + 1) * size] for s in range(depth)]
    prep = ring.prepare_read if op == Op.READ else ring.prepare_write
    n, i, ops, inflight = len(ios), 0, 0, 0
    held: list[tuple[float, int, int, int, int]] = []  # (due, slot, I/O, drive, offset): held back by a drive model
    free = list(range(depth))
    now = time.perf_counter
    c0, t0 = cpu_time(), now()
    stop = t0 + seconds
    try:
        while True:
            t = now()
            while free and i < n and t < stop:
                s = free.pop()
                d, off = ios[i]
                i += 1
                buf = slots[s] if into is None else into[i - 1]
                if models is None:
                    prep(fds[d], buf, off, (s, d, off))
                    inflight += 1
                else:
                    heapq.heappush(held, (models[d].schedule(op, size, t), s, i - 1, d, off))
            while held and held[0][0] <= t:
                _, s, j, d, off = heapq.heappop(held)
                prep(fds[d], slots[s] if into is None else into[j], off, (s, d, off))
                inflight += 1
            if not inflight and not held:
                break
            timeout = max(0.0, held[0][0] - t) if held else None
            if inflight:
                for c in ring.wait(timeout) or ():
                    if c.res != size:
                        raise OSError(-c.res if c.res < 0 else 5, f"raw io_uring I/O failed: {c.res}")
                    free.append(c.user_data[0])
                    inflight -= 1
                    ops += 1
            elif timeout:
                time.sleep(timeout)
        el, cpu = now() - t0, cpu_time() - c0
    finally:
        ring.close()  # the buffers go with the last reference (completions may still hold views)
    return RawResult(f"io_uring qd{depth}", ops, ops * size, el, cpu)
