"""Raw O_DIRECT reads of a scratch file on the disk under test, and the drive model fitted to them.

Two kinds of run, both one io_uring at a request size and a queue depth, random offsets:

* :func:`closed_loop`: ``depth`` reads kept in flight for a while; throughput and mean latency.
* :func:`bursts`: ``depth`` reads submitted at once, then all reaped, again and again; the
  median time to the first completion.

The simulator's drive (:mod:`kvswarm.sim.devices`) serves reads with a fixed latency that they
spend in parallel, then a serial transfer stage.  :func:`fit_drive` takes both from one request
size and one queue depth: the serial stage's rate is the closed loop's throughput (the stage
that binds when the reads are kept in flight), and the fixed latency is a burst's first
completion less one transfer.  One request size cannot tell a per-op cost from a per-byte one,
so the fitted model has no separate IOPS ceiling: its serial stage is the fitted bandwidth.
Predictions at other sizes and depths show what that leaves out.
"""

from __future__ import annotations

import mmap
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import simpy

from kvswarm.sim.devices import DriveSpec, SimDrive

ALIGN = 4096
NO_IOPS_CEILING = 1e12  # ops/s: the fitted model's serial stage is its bandwidth alone


@dataclass(frozen=True)
class RawRun:
    """A closed-loop run: ``ops`` reads of ``size`` bytes, ``depth`` in flight, in ``seconds``."""

    size: int
    depth: int
    ops: int
    seconds: float

    @property
    def throughput_Bps(self) -> float:
        return self.ops * self.size / self.seconds

    @property
    def mean_latency_s(self) -> float:
        """Little's law: ops in flight / ops per second."""
        return self.depth * self.seconds / self.ops


@dataclass(frozen=True)
class BurstProfile:
    """Median time from submitting ``depth`` reads at once to the first completion (seconds)."""

    size: int
    depth: int
    bursts: int
    first_s: float


class ScratchFile:
    """A file of incompressible data on the disk under test, opened with O_DIRECT (its pages never
    come from the page cache)."""

    def __init__(self, directory: str | None, nbytes: int) -> None:
        fd, self.path = tempfile.mkstemp(prefix="kvswarm-validate-disk-", dir=directory)
        self.nbytes = nbytes // (1 << 20) * (1 << 20)
        with os.fdopen(fd, "wb") as f:
            chunk = os.urandom(16 << 20)
            for off in range(0, self.nbytes, len(chunk)):
                f.write(chunk[:min(len(chunk), self.nbytes - off)])
            f.flush()
            os.fsync(f.fileno())
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)

    def offsets(self, size: int, n: int, rng: random.Random) -> list[int]:
        slots = self.nbytes // size
        return [rng.randrange(slots) * size for _ in range(n)]

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


def _ring(depth: int):
    from kvswarm.io.uring import make_ring

    return make_ring(max(8, depth), max(16, 2 * depth), single_thread=True)


def _buffers(size: int, depth: int) -> tuple[mmap.mmap, list[memoryview]]:
    mm = mmap.mmap(-1, size * depth)  # page-aligned, as O_DIRECT needs
    for a in range(0, len(mm), ALIGN):
        mm[a] = 0  # faulted in before any timer starts
    view = memoryview(mm)
    return mm, [view[i * size:(i + 1) * size] for i in range(depth)]


def closed_loop(disk: ScratchFile, size: int, depth: int, seconds: float, rng: random.Random) -> RawRun:
    """``depth`` random reads of ``size`` kept in flight for ``seconds`` (after 0.1 s of warm-up)."""
    ring = _ring(depth)
    mm, bufs = _buffers(size, depth)
    offs = disk.offsets(size, 1 << 16, rng)
    n, ops, inflight, t_count = 0, 0, 0, None
    free = list(range(depth))
    now = time.perf_counter
    start = now()
    warm, stop = start + 0.1, start + 0.1 + seconds
    try:
        while True:
            t = now()
            if t_count is None and t >= warm:
                t_count, ops = t, 0
            while free and t < stop:
                s = free.pop()
                ring.prepare_read(disk.fd, bufs[s], offs[n % len(offs)], s)
                n += 1
                inflight += 1
            if not inflight:
                break
            for c in ring.wait(None) or ():
                if c.res != size:
                    raise OSError(f"raw read of {size} B returned {c.res}")
                free.append(c.user_data)
                inflight -= 1
                ops += 1
        elapsed = now() - (t_count or start)
    finally:
        ring.close()
        bufs.clear()
    del mm
    return RawRun(size, depth, ops, elapsed)


def bursts(disk: ScratchFile, size: int, depth: int, count: int, rng: random.Random) -> BurstProfile:
    """``count`` bursts of ``depth`` reads submitted at once (see the module doc)."""
    ring = _ring(depth)
    mm, bufs = _buffers(size, depth)
    firsts = []
    try:
        for _ in range(count + 2):  # the first two warm the ring and the disk up
            offs = disk.offsets(size, depth, rng)
            t0 = time.perf_counter()
            for s in range(depth):
                ring.prepare_read(disk.fd, bufs[s], offs[s], s)
            done, first = 0, None
            while done < depth:
                cs = ring.wait(None) or ()
                t = time.perf_counter()
                for c in cs:
                    if c.res != size:
                        raise OSError(f"raw read of {size} B returned {c.res}")
                    done += 1
                first = t if first is None else first
            firsts.append(first - t0)
    finally:
        ring.close()
        bufs.clear()
    del mm
    return BurstProfile(size, depth, count, statistics.median(firsts[2:]))


def fit_drive(profile: BurstProfile, run: RawRun, name: str = "disk") -> DriveSpec:
    """The simulator's drive fitted at one request size and depth (``profile`` and ``run`` of the
    same size and depth): serial transfer at the closed loop's throughput, fixed latency = the
    burst's first completion less one transfer."""
    if (profile.size, profile.depth) != (run.size, run.depth):
        raise ValueError("the drive model is fitted on one request size and queue depth")
    bw = run.throughput_Bps
    latency = max(0.0, profile.first_s - run.size / bw)
    return DriveSpec(name, bw, bw, NO_IOPS_CEILING, NO_IOPS_CEILING, latency, latency, queue_depth=4096)


def simulate_closed_loop(model: DriveSpec, size: int, depth: int, ops: int = 4000) -> RawRun:
    """The simulator's answer to :func:`closed_loop`: ``depth`` clients reading ``size`` back to back."""
    env = simpy.Environment()
    drive = SimDrive(env, 0, model)
    per = max(1, ops // depth)

    def client():
        for _ in range(per):
            yield from drive.serve(size, 1, False)

    env.run(env.all_of([env.process(client()) for _ in range(depth)]))
    return RawRun(size, depth, per * depth, env.now)
