"""The store's host-side CPU cost: per op (submit, header check) and per byte (the payload checksum),
per read path: ``threads`` and ``uring`` (the Python engines) and ``native`` (kvswarm.io._batchio).

A store on fast drives is CPU-bound: the simulator charges the cost on the CPUs it may use (one for
the Python paths, under the GIL), so ``plan validate`` and ``plan scale`` model the store, not just
its drives, and ``plan scale`` says how many cores a drive set needs on each path.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from kvswarm.format import HEADER_SIZE, payload_checksum

KiB, MiB = 1 << 10, 1 << 20


PATHS = ("threads", "uring", "native")  # the store's read paths


def engine_of(path: str) -> str:
    """The Python engine a read path's store is opened with (native reads: their writes' engine)."""
    return "uring" if path == "native" else path


@dataclass(frozen=True)
class HostCost:
    """Seconds of host CPU per extent read and per payload byte."""

    cpu_per_op: float
    cpu_per_byte: float

    def cores(self, ops_per_s: float, bytes_per_s: float) -> float:
        """CPUs kept busy serving ``ops_per_s`` extents of ``bytes_per_s`` payload in all."""
        return ops_per_s * self.cpu_per_op + bytes_per_s * self.cpu_per_byte


def measure_host_cost(backend: str, quick: bool) -> HostCost:
    """Per-byte: the store's payload checksum; per-op: a get batch on a memory-backed drive, on read
    path ``backend`` (one of PATHS)."""
    # Minimum over repetitions: the machine is shared, and descheduled time is not a cost per byte.
    buf = os.urandom(4 * MiB)
    times = []
    for _ in range(10 if quick else 30):
        t0 = time.perf_counter()
        payload_checksum(buf)
        times.append(time.perf_counter() - t0)
    per_byte = min(times) / len(buf)
    from kvswarm.store import KVStore, StoreConfig

    root = tempfile.mkdtemp(prefix="kvswarm-validate-host-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    drive_log = logging.getLogger("kvswarm.drive")
    level = drive_log.level
    drive_log.setLevel(logging.ERROR)  # tmpfs refuses O_DIRECT; the buffered fallback is what we want here
    try:
        os.makedirs(os.path.join(root, "d0"))
        store = KVStore(StoreConfig(drives=[os.path.join(root, "d0")], meta_dir=os.path.join(root, "m"),
                                    capacity_per_drive=64 * MiB, backend=engine_of(backend),
                                    buffer_pool_bytes=32 * MiB, native_io=backend == "native"))
        if backend == "native" and store.native is None:
            store.close()
            raise ValueError("the native read path is not available here (kvswarm.io._batchio not built, io_uring "
                             "refused, or KVSWARM_NATIVE_IO=0)")
        try:
            keys = [b"host/%d" % i for i in range(256)]
            store.put_many([(k, bytes(4 * KiB - HEADER_SIZE)) for k in keys])
            rng = random.Random(1)
            store.get_many(keys[:64]).release()
            times = []
            for _ in range(20 if quick else 80):
                batch = rng.sample(keys, 64)
                t0 = time.process_time()  # CPU of every thread (engine workers too); not time descheduled
                store.get_many(batch).release()
                times.append(time.process_time() - t0)
            per_op = float(np.median(times)) / 64 - per_byte * (4 * KiB - HEADER_SIZE)
        finally:
            store.close()
    finally:
        drive_log.setLevel(level)
        shutil.rmtree(root, ignore_errors=True)
    return HostCost(max(0.0, per_op), per_byte)
