"""Raw O_DIRECT reads of a scratch file on the disk under test, and the drive model fitted to them.

:func:`closed_loop` keeps ``depth`` random reads of one size in flight on one io_uring for a
while: throughput and mean latency.  The simulator's drive (:mod:`kvswarm.sim.devices`) serves
reads with a fixed latency that they spend in parallel, then a serial stage of
``max(bytes / bandwidth, 1 / iops)``.  :func:`fit_drive` fits all three to closed-loop runs at two
request sizes or more (one size cannot tell a per-op cost from a per-byte one): large requests pin
the bandwidth, small ones the IOPS ceiling, shallow queues the latency.  ``plan validate`` fits on
one set of runs and predicts others.
"""

from __future__ import annotations

import mmap
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import simpy

from kvswarm.sim.devices import DriveSpec, SimDrive

ALIGN = 4096


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


def closed_loop_ops(model: DriveSpec, size: int, depth: int) -> float:
    """Reads per second of :func:`simulate_closed_loop`'s steady state, in closed form: ``depth``
    clients each spend the fixed latency, then queue for the serial stage, so the loop runs at
    ``min(depth / (latency + T), 1 / T)`` with ``T = max(size / bw, 1 / iops)``."""
    t = model.transfer_time(size, 1, False)
    return min(depth / (model.read_latency + t), 1.0 / t)


def _loop_ops(lat: np.ndarray, per_byte: np.ndarray, per_op: np.ndarray, size: int, depth: int) -> np.ndarray:
    t = np.maximum(size * per_byte, per_op)
    return np.minimum(depth / (lat + t), 1.0 / t)


def fit_drive(runs: Sequence[RawRun], name: str = "disk") -> DriveSpec:
    """The simulator's drive fitted to closed-loop ``runs`` at two request sizes or more: the fixed
    latency, the serial stage's bandwidth and its IOPS ceiling that minimise the squared log error
    of :func:`closed_loop_ops` over the runs (a log-spaced grid search, zoomed in three times).
    Large requests pin the bandwidth, small ones the IOPS ceiling, shallow queues the latency."""
    if len({r.size for r in runs}) < 2:
        raise ValueError("the drive model is fitted on two request sizes or more (bandwidth and IOPS ceiling)")
    meas = np.log([r.ops / r.seconds for r in runs])
    top_bps = max(r.throughput_Bps for r in runs)
    top_ops = max(r.ops / r.seconds for r in runs)
    # Per byte and per op in seconds, latency in seconds: wide log ranges around what was measured.
    lo = np.log([0.05 / top_bps, 0.02 / top_ops, 1e-6])
    hi = np.log([20.0 / top_bps, 5.0 / top_ops, 0.1])
    best = None
    for _ in range(4):
        axes = [np.linspace(a, b, 48) for a, b in zip(lo, hi)]
        pb, po, lat = np.meshgrid(*(np.exp(a) for a in axes), indexing="ij")
        err = sum((np.log(_loop_ops(lat, pb, po, r.size, r.depth)) - m) ** 2 for r, m in zip(runs, meas))
        i = np.unravel_index(int(np.argmin(err)), err.shape)
        best = [pb[i], po[i], lat[i]]
        step = [(b - a) / 47 for a, b in zip(lo, hi)]
        lo = np.log(best) - 2 * np.array(step)
        hi = np.log(best) + 2 * np.array(step)
    bw, iops, latency = 1.0 / best[0], 1.0 / best[1], float(best[2])
    return DriveSpec(name, bw, bw, iops, iops, latency, latency, queue_depth=4096)


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
