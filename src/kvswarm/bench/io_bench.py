"""Raw O_DIRECT ceiling vs the store's batched get/put, side by side on the same disk and data.

For each object size the store writes a data set, then random reads are timed in
rounds that alternate between the raw baseline and the store:

* raw: parallel O_DIRECT reads of the very extents the store wrote (same drives, same
  offsets, random order), like fio: ``os.preadv`` from several thread counts and one
  io_uring ring at several queue depths; the best configuration is "raw".
* store: ``KVStore.submit_get`` batches kept in flight (the async API, as a caller that
  overlaps I/O with work would use it), every object verified (header + xxh3), for
  each read path (the Python engines ``threads`` and ``uring``, and the ``native`` batch
  path); the best path is "store".  Its shape (keys per batch, batches in flight) is the
  store's own choice for its drives (``KVStore.read_shape``), not tuned, after an untimed pass
  that faults the new store's buffer pool in (the raw loops fault theirs before timing).

store/raw is the median over rounds of the store's sample divided by the raw sample taken
in the same round (the disk's speed drifts between rounds); ``ratio_of_medians_*`` is also kept.

Object size means the extent on disk: a "4 KiB object" is one 4 KiB extent holding
a 64-byte header and 4032 B of payload.  The store's GB/s counts payload bytes only,
the raw baseline counts every byte it reads, so the ratio slightly favours raw (by
1.6% at 4 KiB).  CPU: ``cpu_ratio_*`` is the store's CPU seconds per GB over raw's (per
path: ``cpu_ratio_<path>_*``); ``native_vs_python_*`` (and ``_cpu_*``) compare the native path
with the best Python engine in the same run.  Writes, durable on both sides: raw O_DIRECT
pwritev (16 threads) and io_uring (32 deep, and as deep as the store's rings go: its queue depth on
every drive), each sample writing as many objects of the size as the store's data set into the
blocks that data set then occupies, fdatasync'd at the end, vs ``submit_put`` of the whole data
set in the store's own shape (``KVStore.write_shape``) plus ``flush()`` (fdatasync, then the
catalog's journal), on the last read path's store (native where it is available); one store
sample after each raw one (the data set deleted and flushed in between, untimed), each side's best
counts.  Before any write is timed every block of the drives is written once (preconditioned, see
``precondition``), so both sides write into written blocks.  Catalog reopen time is measured for 100k and 1M objects.

Drives: temp directories on the local disk (default), or ``--drives N`` emulated,
capped drives from :mod:`kvswarm.testbed` (loop devices + blkio throttle, or the
user-space model where the kernel cannot).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvswarm.argtypes import comma_list, existing_dir, non_negative_int, positive_float, positive_int
from kvswarm.bench import write_json
from kvswarm.catalog import Catalog, Entry
from kvswarm.drive import DATA_FILE
from kvswarm.format import HEADER_SIZE, key_digest
from kvswarm.errors import KVSwarmError
from kvswarm.io import Op, uring_available
from kvswarm.io import native as native_io
from kvswarm.io.raw import RawResult, cpu_time, run_threads, run_uring, tune_passes
from kvswarm.io.throttle import DriveCaps, DrivePacer
from kvswarm.store import KVStore, StoreConfig
from kvswarm.testbed import UNCAPPED, Testbed, default_caps

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
RAW_DEPTHS = (8, 16, 32, 64, 128, 256)  # io_uring queue depths the raw baseline is tuned over
SIZE_NAMES = {4 * KiB: "4k", 16 * KiB: "16k", 64 * KiB: "64k", 1 * MiB: "1m"}


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": KiB, "m": MiB, "g": GiB}.get(s[-1:], 1)
    try:
        n = int(float(s.rstrip("kmg")) * mult)
    except (ValueError, OverflowError):  # not a number, or inf
        raise argparse.ArgumentTypeError(f"object size {s!r} is not a size such as 4k, 64k or 1m") from None
    if n % 4096 or n <= 0:
        raise argparse.ArgumentTypeError(f"object size {s} must be a positive multiple of 4 KiB")
    return n


def parse_count(s: str) -> int:
    s = s.strip().lower()
    try:
        n = int(float(s.rstrip("km")) * {"k": 1000, "m": 1_000_000}.get(s[-1:], 1))
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"object count {s!r} is not a count such as 2k, 100k or 1m") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"object count must be positive, got {s!r}")
    return n


BACKENDS = ("threads", "uring", "native")  # native: the store's reads on kvswarm.io._batchio (io.native)


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"backends are some of {', '.join(BACKENDS)}, got {text!r}")
    return names


def count_name(n: int) -> str:
    return f"{n // 1_000_000}m" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=comma_list(parse_size), default="4k,16k,64k,1m",
                   help="object (extent) sizes, comma-separated multiples of 4 KiB (default %(default)s)")
    p.add_argument("--data-mib", type=positive_int, default=None,
                   help="data set per size in MiB (default 1024 below 64 KiB, 3072 from 64 KiB; quick: 64)")
    p.add_argument("--seconds", type=positive_float, default=None,
                   help="seconds per timed sample (default 1.5, 3 on a testbed; quick 0.3)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="raw/store sample pairs per size and backend (default 5; quick 1)")
    p.add_argument("--backends", type=_backends, default=None,
                   help="store read paths, comma-separated: threads and uring (the Python engines), native "
                        "(kvswarm.io._batchio) (default: each that is available)")
    add_drive_arguments(p, ["auto", "kernel", "user-space"])
    p.add_argument("--reopen", type=comma_list(parse_count, allow_empty=True), default=None,
                   help="object counts for the reopen test, e.g. 100k,1m ('' to skip; default 100k,1m)")
    p.add_argument("--reopen-via", choices=["store", "catalog"], default=None,
                   help="build the reopen stores through the store's put path (default) or the catalog only "
                        "(default with --quick)")
    p.add_argument("--quick", action="store_true", help="short run (< 1 min): small data, one round")
    p.add_argument("--json", default=None, help="write results (with a 'summary' of numbers) to this path")
    p.add_argument("--seed", type=int, default=0)


def add_drive_arguments(p: argparse.ArgumentParser, emulations: list[str]) -> None:
    """The options :class:`Drives` reads: temp directories, or capped emulated drives."""
    p.add_argument("--dirs", type=positive_int, default=4, metavar="N",
                   help="how many temp drive directories to use when not on a testbed (default %(default)s)")
    p.add_argument("--dir", type=existing_dir, default=None,
                   help="existing directory to make the temp drive directories in (default: system temp)")
    p.add_argument("--drives", type=non_negative_int, default=0,
                   help="run on N emulated capped drives (kvswarm.testbed)")
    p.add_argument("--cap-mbps", type=positive_float, default=None,
                   help="testbed per-drive MB/s cap (default: fit disk)")
    p.add_argument("--cap-iops", type=positive_float, default=None,
                   help="testbed per-drive IOPS cap (default: fit disk)")
    p.add_argument("--emulation", choices=emulations, default="auto", help="capped drives' emulation")


# ---------------------------------------------------------------------------------------------
@dataclass
class Sample:
    gbps: float
    iops: float
    cpu_s_per_gb: float
    method: str = ""


def _median(samples: Sequence[Sample], upper: bool) -> Sample:
    """The sample with the median throughput (keeps its own IOPS/CPU figures).

    With an even count the raw side takes the upper and the store the lower middle
    sample, so ties never favour the store.
    """
    s = sorted(samples, key=lambda x: x.gbps)
    return s[len(s) // 2 if upper else (len(s) - 1) // 2]


def lower_median(xs: Sequence[float]) -> float:
    """Median; with an even count the lower middle value (ties never favour the store)."""
    return sorted(xs)[(len(xs) - 1) // 2]


def _from_raw(r: RawResult) -> Sample:
    return Sample(r.gbps, r.iops, r.cpu_s_per_gb, r.method)


@dataclass
class SizeRun:
    size: int
    keys: list[bytes]
    ios: list[tuple[int, int]] = field(default_factory=list)  # (drive, offset) per key, for raw
    raw_writes: list[Sample] = field(default_factory=list)  # one per raw method
    store_writes: list[Sample] = field(default_factory=list)  # as many, each taken after a raw one
    best_threads: int = 16
    best_depth: int = 32
    store: dict[str, list[Sample]] = field(default_factory=dict)
    store_shape: dict[str, tuple[int, int]] = field(default_factory=dict)  # per backend: (keys per batch, batches)
    # Raw samples per store backend (the rounds they shared), per method: "preadv", "io_uring".
    raw_by_backend: dict[str, dict[str, list[Sample]]] = field(default_factory=dict)

    @property
    def raw_write(self) -> Sample:
        return max(self.raw_writes, key=lambda s: s.gbps)

    @property
    def store_write(self) -> Sample:
        return max(self.store_writes, key=lambda s: s.gbps)

    @property
    def raw(self) -> dict[str, list[Sample]]:
        """Every raw sample per method, backend after backend."""
        out: dict[str, list[Sample]] = {}
        for per_method in self.raw_by_backend.values():
            for m, ss in per_method.items():
                out.setdefault(m, []).extend(ss)
        return out


class Drives:
    """Where the bench runs (a :class:`kvswarm.testbed.Testbed`): capped drives with ``--drives N``,
    else ``--dirs`` uncapped directories on the local disk."""

    def __init__(self, args: argparse.Namespace, drive_bytes: int) -> None:
        if args.drives:
            d = default_caps(args.drives)
            mbps, iops = args.cap_mbps or d.read_mbps, args.cap_iops or d.read_iops
            caps = DriveCaps(read_mbps=mbps, write_mbps=mbps, read_iops=iops, write_iops=iops)
            self.testbed = Testbed(args.drives, drive_bytes=drive_bytes, caps=caps, mode=args.emulation, root=args.dir)
        else:
            self.testbed = Testbed(args.dirs, drive_bytes=drive_bytes, mode=UNCAPPED, root=args.dir)
        self.testbed.start()
        self.capped = self.testbed.emulation != UNCAPPED
        self.paths = list(self.testbed.paths)
        self.meta_dir = self.testbed.meta_dir
        self.models: list[DrivePacer] | None = self.testbed.models
        self.describe = self.testbed.describe()
        self.info = self.testbed.info()
        self.capacity = drive_bytes

    @staticmethod
    def native_possible(args: argparse.Namespace) -> bool:
        """The native path takes no user-space drive pacing (kernel caps bind it as any software)."""
        return not args.drives or args.emulation != "user-space"

    def open_store(self, backend: str) -> KVStore:
        """``native``: reads on the native batch path (its writes on the uring engine); the others keep
        every I/O on that Python engine.  The queue depth per drive is the store's own choice from its
        drives' devices (``device_queue_depth``: a capped loop device's 128 tags each, a disk's split
        among the directories on it)."""
        native = backend == "native"
        engine = ("uring" if uring_available() else "threads") if native else backend
        cfg = StoreConfig(drives=self.paths, meta_dir=self.meta_dir, capacity_per_drive=self.capacity,
                          backend=engine, buffer_pool_bytes=512 * MiB,
                          checkpoint_every=10**9, single_thread_io=True, wrap_engine=self.testbed.wrap_engine,
                          native_io=native)
        store = KVStore(cfg)
        store.warm_buffers()  # untimed, as the raw loops fault their buffers in before their timers
        if native and store.native is None:
            store.close()
            raise KVSwarmError("bench io: the native read path is not available here (kvswarm.io._batchio not "
                               "built, io_uring refused, KVSWARM_NATIVE_IO=0, or user-space drive pacing)")
        return store

    def raw_fds(self, write: bool = False) -> list[int]:
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT
        return [os.open(p if not os.path.isdir(p) else os.path.join(p, DATA_FILE), flags) for p in self.paths]

    def close(self) -> None:
        self.testbed.stop()


# ---- the store's side -------------------------------------------------------------------------
def store_write(store: KVStore, keys: Sequence[bytes], payload: int, rng: random.Random) -> Sample:
    """Put every key (distinct random payloads) in the store's own batch shape
    (:meth:`KVStore.write_shape`), then flush.

    The batches' (key, payload) items are made before the clock starts, as the raw writes' list of
    extents is: the timer measures the store, not the making of the data set."""
    pool = os.urandom(8 * MiB + payload)
    pv = memoryview(pool)
    shape = store.write_shape(store.object_bytes(payload))
    batch, inflight = shape.keys, shape.inflight
    at = [rng.randrange(8 * MiB // 64) * 64 for _ in keys]
    batches = [[(k, pv[o:o + payload]) for k, o in zip(keys[i:i + batch], at[i:i + batch])]
               for i in range(0, len(keys), batch)]
    q: deque = deque()
    c0, t0 = cpu_time(), time.perf_counter()
    ok = 0
    for items in batches:
        q.append(store.submit_put(items))
        if len(q) >= inflight:
            ok += sum(q.popleft().wait())
    while q:
        ok += sum(q.popleft().wait())
    store.flush()
    el, cpu = time.perf_counter() - t0, cpu_time() - c0
    if ok != len(keys):
        raise RuntimeError(f"store write: only {ok} of {len(keys)} puts succeeded")
    nbytes = len(keys) * payload
    return Sample(nbytes / el / 1e9, len(keys) / el, cpu / (nbytes / 1e9),
                  f"submit_put {batch} keys x {inflight} in flight + flush")


def store_read(store: KVStore, keys: Sequence[bytes], payload: int, batch: int, inflight: int,
               seconds: float) -> Sample:
    """Random batched gets with ``inflight`` submit_get batches outstanding; every hit verified.

    Batches are finished as they complete, not in submission order (as a server with
    independent requests would), so one slow read never holds the queue's refill.
    """
    live: list = []
    n = len(keys)
    i = got = 0
    now = time.perf_counter
    c0, t0 = cpu_time(), now()
    stop = t0 + seconds
    while True:
        while len(live) < inflight and i < n and now() < stop:
            live.append(store.submit_get(keys[i:i + batch]))
            i += batch
        if not live:
            break
        ready = [h for h in live if h.done]
        if not ready:
            store.progress()
            continue
        for h in ready:
            live.remove(h)
            with h.wait() as res:
                if res.misses:
                    raise RuntimeError(f"store read: {res.misses} misses ({res.corrupt} corrupt) on stored keys")
                got += len(res.views)
            store.progress(0)
    el, cpu = now() - t0, cpu_time() - c0
    nbytes = got * payload
    return Sample(nbytes / el / 1e9, got / el, cpu / (nbytes / 1e9) if nbytes else 0.0)


# ---- the run ----------------------------------------------------------------------------------
def _tune_raw(drives: Drives, run: SizeRun, seconds: float, rng: random.Random, use_uring: bool,
              fds: list[int]) -> None:
    """Pick the raw baseline's best thread count and io_uring depth for this size, over two passes
    (a noisy sample could pick a shallow depth the disk was merely slow for, and understate the ceiling)."""
    def best(settings: Sequence[int], sample) -> int:
        got = tune_passes(settings, sample)
        return max(got, key=got.get)

    run.best_threads = best((4, 8, 16, 32), lambda t: run_threads(
        fds, shuffled(run.ios, rng), run.size, Op.READ, t, seconds, drives.models).gbps)
    if use_uring:
        run.best_depth = best(RAW_DEPTHS, lambda d: run_uring(
            fds, shuffled(run.ios, rng), run.size, Op.READ, d, seconds, drives.models).gbps)


def precondition(store: KVStore, fds: Sequence[int], chunk: int = 8 * MiB) -> float:
    """Write every block of a new, empty store's drives once (its data region: the superblock stays),
    then fdatasync; the seconds it took.

    A file system's preallocated blocks are unwritten extents, and the virtual disk's host maps a
    block on its first write: a first write into them ran at 2.1-2.2 GB/s here where a rewrite ran
    at 3.7-4.0 (1 MiB objects).  The raw write samples write a region before the store does, so
    unless the drives are written once first the raw side alone pays first writes.  As SSD benchmarks
    precondition a drive, both sides then write into written blocks.  One thread per drive."""
    block = mmap.mmap(-1, chunk)
    block.write(os.urandom(chunk))  # not zeros: a host may skip writing zero blocks

    def fill(d: int) -> None:
        drive = store.drives[d]
        for at in range(drive.data_start, drive.capacity, chunk):
            os.pwritev(fds[d], [memoryview(block)[:min(chunk, drive.capacity - at)]], at)
        os.fdatasync(fds[d])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(fds)) as ex:
        list(ex.map(fill, range(len(fds))))
    block.close()
    return time.perf_counter() - t0


WHOLE_REGION_S = 3600.0  # a raw write sample's time bound: it ends when it has written its region


def _raw_write_region(frontier: Sequence[int], n: int, size: int) -> list[tuple[int, int]]:
    """``n`` extents of ``size`` bytes from each drive's ``frontier`` up, dealt over the drives in turn:
    the blocks the store's data set of ``n`` objects is about to occupy (its allocator fills a
    fresh drive from the bottom), so that both sides write as many bytes over the same blocks: the
    virtual disk's host caches recent writes, so how much and where a side writes can move its speed."""
    return [(j % len(frontier), frontier[j % len(frontier)] + (j // len(frontier)) * size) for j in range(n)]


def _sync(fds: Sequence[int]) -> float:
    t0 = time.perf_counter()
    for fd in fds:
        os.fdatasync(fd)
    return time.perf_counter() - t0


def shuffled(xs: Sequence, rng: random.Random) -> list:
    out = list(xs)
    rng.shuffle(out)
    return out


def bench(args: argparse.Namespace, console) -> dict:
    quick = args.quick
    sizes = args.sizes
    # Capped drives get longer samples: blk-throttle lets ~0.1 s worth of budget through at once.
    seconds = args.seconds or (0.3 if quick else 3.0 if args.drives else 1.5)
    rounds = args.rounds or (1 if quick else 5)
    use_uring = uring_available()
    native_ok = native_io.enabled() and Drives.native_possible(args)
    backends = args.backends or ["threads"] + (["uring"] if use_uring else []) + (["native"] if native_ok else [])
    rng = random.Random(args.seed)

    def data_bytes(size: int) -> int:
        if args.data_mib:
            return args.data_mib * MiB
        full = 64 * MiB if quick else (1 * GiB if size < 64 * KiB else 3 * GiB)
        if args.drives:  # capped drives: about 10 s of the caps' aggregate write rate
            d = default_caps(args.drives)
            per_drive = min((args.cap_mbps or d.write_mbps) * 1e6, (args.cap_iops or d.write_iops) * size)
            full = min(full, max(16 * MiB, int(10 * args.drives * per_drive)) // MiB * MiB)
        return full

    ndrives = args.drives or args.dirs
    need = sum(data_bytes(s) for s in sizes) // ndrives
    drive_bytes = (need * 11 // 10 + 64 * MiB) // MiB * MiB
    drives = Drives(args, drive_bytes)
    console.print(f"[bold]drives[/]: {drives.describe}")
    if drives.capped and not quick:
        with console.status("checking the testbed's caps"):
            drives.info["cap_check"] = [vars(c) | {"ratio": c.ratio} for c in drives.testbed.verify(1.5)]
    results: dict = {"drives": drives.info, "sizes": {}, "config": {
        "seconds": seconds, "rounds": rounds, "backends": backends, "quick": quick,
        "durability": "writes durable on both sides: raw O_DIRECT writes fdatasync'd at the end of each sample, "
                      "the store's puts flushed (fdatasync + catalog sync) at the end of its data set; each raw "
                      "sample writes as many objects as the store's data set, into the blocks it then occupies",
        "object_size": "extent on disk; payload = size - 64 B header"}}
    runs: list[SizeRun] = []
    try:
        # 1. writes: raw into free space at the top of each drive, then the store's data set.
        store = drives.open_store(backends[-1])
        results["config"]["store_queue_depth_per_drive"] = store.queue_depth
        wfds = drives.raw_fds(write=True)
        try:
            with console.status("preconditioning the drives (every block written once)"):
                results["config"]["precondition_s"] = precondition(store, wfds)
            frontier = [d.data_start for d in store.drives]  # where each drive's next data set lands
            for size in sizes:
                payload = size - HEADER_SIZE
                n = data_bytes(size) // size
                run = SizeRun(size, [b"io-bench/%d/%d" % (size, i) for i in range(n)])
                region = _raw_write_region(frontier, n, size)
                methods = [lambda: run_threads(wfds, region, size, Op.WRITE, 16, WHOLE_REGION_S, drives.models)]
                if use_uring:  # 32 deep, and as deep as the store's rings go (its depth on every drive)
                    methods += [lambda depth=depth: run_uring(wfds, region, size, Op.WRITE, depth, WHOLE_REGION_S,
                                                              drives.models)
                                for depth in sorted({32, ndrives * store.queue_depth})]
                # Raw and store samples alternate, as many of each (the host's speed drifts), each side's
                # best counts.  Between store samples the data set is deleted and flushed, untimed: the
                # allocator hands the same blocks out again.
                for i, method in enumerate(methods):
                    with console.status(f"writing {n} x {_fmt_size(size)} objects raw, then through the store"):
                        if i:
                            store.delete_many(run.keys)
                            store.flush()
                        w = method()
                        w.seconds += _sync(wfds)  # durable, as the store's flush makes its writes
                        if w.ops != n:
                            raise RuntimeError(f"a raw write sample wrote {w.ops} of {n} objects of {_fmt_size(size)}")
                        run.raw_writes.append(_from_raw(w))
                        run.store_writes.append(store_write(store, run.keys, payload, rng))
                located = store.locate(run.keys)
                run.ios = [(e.extents[0].drive, e.extents[0].offset) for e in located]
                lo, hi = list(frontier), list(frontier)
                for e in located:
                    for x in e.extents:
                        lo[x.drive] = min(lo[x.drive], x.offset)
                        hi[x.drive] = max(hi[x.drive], x.offset + x.length)
                results["config"].setdefault("write_regions", {})[_fmt_size(size)] = {
                    "raw": [[frontier[d], frontier[d] + len(range(d, n, ndrives)) * size] for d in range(ndrives)],
                    "store": [[lo[d], hi[d]] for d in range(ndrives)]}
                frontier = hi
                runs.append(run)
        finally:
            for fd in wfds:
                os.close(fd)
            store.close()

        # 2. tune the raw baseline, 3. timed rounds alternating raw and store.
        fds = drives.raw_fds()
        try:
            for run in runs:
                with console.status(f"tuning the raw baseline at {_fmt_size(run.size)}"):
                    _tune_raw(drives, run, seconds / 2, rng, use_uring, fds)
            for backend in backends:
                store = drives.open_store(backend)
                try:
                    for run in runs:
                        shape = store.read_shape(store.object_bytes(run.size - HEADER_SIZE))
                        batch, inflight = run.store_shape[backend] = (shape.keys, shape.inflight)
                        with console.status(f"{backend}: warming the store's reads at {_fmt_size(run.size)}"):
                            # Untimed: the new store's buffer pool is faulted in here, not in a timed sample
                            # (the raw loops fault their buffers in before their timers start).
                            store_read(store, shuffled(run.keys, rng), run.size - HEADER_SIZE, batch, inflight,
                                       seconds / 2)
                        with console.status(f"{backend}: {_fmt_size(run.size)} rounds"):
                            for r in range(rounds):
                                order = [0, 1] if r % 2 == 0 else [1, 0]
                                for which in order:
                                    if which == 0:
                                        for m, smp in _raw_samples(drives, run, fds, seconds, rng, use_uring):
                                            run.raw_by_backend.setdefault(backend, {}).setdefault(m, []).append(smp)
                                    else:
                                        keys = shuffled(run.keys, rng)
                                        s = store_read(store, keys, run.size - HEADER_SIZE, batch, inflight,
                                                       seconds)
                                        s.method = f"submit_get {batch} keys x {inflight} in flight"
                                        run.store.setdefault(backend, []).append(s)
                finally:
                    store.close()
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        drives.close()

    summary: dict[str, float] = {}
    for run in runs:
        name = SIZE_NAMES.get(run.size, f"{run.size // KiB}k")
        # Each side: the median of each of its methods, then the best method.
        all_raw = run.raw
        raw_m = max(all_raw, key=lambda m: _median(all_raw[m], upper=True).gbps)
        raw = _median(all_raw[raw_m], upper=True)
        per_backend = {b: _median(ss, upper=False) for b, ss in run.store.items()}
        best_b = max(per_backend, key=lambda b: per_backend[b].gbps)
        st = per_backend[best_b]
        # The ratio pairs each store sample with the best raw method's sample of the same round: the
        # disk's speed drifts between rounds, and a ratio of medians over different rounds shows the drift.
        paired = {b: lower_median([x.gbps / y.gbps for x, y in zip(ss, run.raw_by_backend[b][raw_m])])
                  for b, ss in run.store.items()}
        summary |= {
            f"ratio_{name}": paired[best_b],
            f"ratio_of_medians_{name}": st.gbps / raw.gbps,
            f"raw_gbps_{name}": raw.gbps, f"raw_iops_{name}": raw.iops, f"raw_cpu_s_per_gb_{name}": raw.cpu_s_per_gb,
            f"store_gbps_{name}": st.gbps, f"store_iops_{name}": st.iops,
            f"store_cpu_s_per_gb_{name}": st.cpu_s_per_gb,
            f"raw_write_gbps_{name}": run.raw_write.gbps, f"store_write_gbps_{name}": run.store_write.gbps,
            f"write_ratio_{name}": run.store_write.gbps / run.raw_write.gbps,
            f"cpu_ratio_{name}": st.cpu_s_per_gb / raw.cpu_s_per_gb,
        }
        for b, s in per_backend.items():
            summary[f"store_{b}_gbps_{name}"] = s.gbps
            summary[f"ratio_{b}_{name}"] = paired[b]
            summary[f"cpu_ratio_{b}_{name}"] = s.cpu_s_per_gb / raw.cpu_s_per_gb
        python = [b for b in per_backend if b != "native"]
        if "native" in per_backend and python:  # the paired comparison: native vs the best Python path
            best_py = max(python, key=lambda b: per_backend[b].gbps)
            summary[f"native_vs_python_{name}"] = per_backend["native"].gbps / per_backend[best_py].gbps
            summary[f"native_vs_python_cpu_{name}"] = (per_backend["native"].cpu_s_per_gb
                                                       / per_backend[best_py].cpu_s_per_gb)
        results["sizes"][name] = {
            "extent_bytes": run.size, "payload_bytes": run.size - HEADER_SIZE, "objects": len(run.keys),
            "raw_samples": {m: [vars(s) for s in ss] for m, ss in all_raw.items()}, "raw_median": vars(raw),
            "raw_best_threads": run.best_threads, "raw_best_depth": run.best_depth,
            "store_samples": {b: [vars(s) for s in ss] for b, ss in run.store.items()},
            "store_best_backend": best_b, "store_shape": run.store_shape,
            "raw_write": vars(run.raw_write), "store_write": vars(run.store_write),
            "raw_write_samples": [vars(x) for x in run.raw_writes],
            "store_write_samples": [vars(x) for x in run.store_writes],
        }
    results["summary"] = summary
    return results


def _raw_samples(drives: Drives, run: SizeRun, fds: list[int], seconds: float, rng: random.Random,
                 use_uring: bool) -> list[tuple[str, Sample]]:
    """One sample of each raw method at its tuned setting (each gets half the store's sample time)."""
    out = [("preadv", _from_raw(run_threads(fds, shuffled(run.ios, rng), run.size, Op.READ, run.best_threads,
                                            seconds / 2, drives.models)))]
    if use_uring:
        out.append(("io_uring", _from_raw(run_uring(fds, shuffled(run.ios, rng), run.size, Op.READ,
                                                    run.best_depth, seconds / 2, drives.models))))
    return out


def _crash_copy(meta: str, to: str) -> None:
    """Copy the catalog files as a crash right after the last flush would leave them."""
    for f in ("catalog.ckpt", "catalog.journal"):
        if os.path.exists(os.path.join(meta, f)):
            shutil.copy(os.path.join(meta, f), to)


# ---- catalog reopen -----------------------------------------------------------------------------
def reopen_bench(counts: Sequence[int], via: str, parent: str | None, console, ndirs: int = 4) -> dict[str, float]:
    """Time reopening a store of ``count`` 4 KiB objects, after a clean close and after a crash.

    ``reopen_s``: ``KVStore.open`` after ``close()`` (checkpoint load + allocator rebuild).
    ``replay_s``: ``Catalog`` rebuilt from the journal alone, as after a crash before any
    checkpoint (the journal is copied aside after the last flush).
    ``via='store'``: the objects are real, written through ``submit_put`` + ``flush``.
    ``via='catalog'``: the store's catalog is filled directly with one-extent entries
    (drives preallocated, no data written); the reopen path timed is the same.
    ``follow_refresh_s`` / ``follow_reload_s``: :func:`follow_bench`.
    """
    out: dict[str, float] = {}
    rng = random.Random(1)
    for count in counts:
        name = count_name(count)
        tmp = tempfile.mkdtemp(prefix="kvswarm-bench-reopen-", dir=parent)
        try:
            side = os.path.join(tmp, "journal-copy")
            os.makedirs(side)
            paths = [os.path.join(tmp, f"d{i}") for i in range(ndirs)]
            for p in paths:
                os.makedirs(p)
            kw = dict(meta_dir=os.path.join(tmp, "meta"), capacity_per_drive=(count // ndirs + 1024) * 4096,
                      checkpoint_every=10**9)
            meta = kw["meta_dir"]

            store = KVStore.open(paths, backend="auto", **kw)
            with console.status(f"reopen test: {count} objects ({via})"):
                t0 = time.perf_counter()
                if via == "store":
                    store_write(store, [b"reopen/%d" % i for i in range(count)], 4096 - HEADER_SIZE, rng)
                    _crash_copy(meta, side)
                    store.close()
                else:
                    store.close()
                    cat = Catalog(meta, checkpoint_every=10**9)
                    _put_entries(cat, b"reopen", count, ndirs)
                    cat.sync()
                    _crash_copy(meta, side)
                    cat.close()  # checkpoints
                out[f"reopen_build_s_{name}"] = time.perf_counter() - t0
            c0, t0 = cpu_time(), time.perf_counter()
            store = KVStore.open(paths, create=False, **kw)
            out[f"reopen_s_{name}"] = time.perf_counter() - t0
            out[f"reopen_cpu_s_{name}"] = cpu_time() - c0
            if len(store) != count:
                raise RuntimeError(f"reopened store holds {len(store)} objects, not {count}")
            store.close()
            c0, t0 = cpu_time(), time.perf_counter()
            cat = Catalog(side)
            out[f"replay_s_{name}"] = time.perf_counter() - t0
            out[f"replay_cpu_s_{name}"] = cpu_time() - c0
            if len(cat) != count:
                raise RuntimeError(f"journal replay recovered {len(cat)} objects, not {count}")
            cat.close()
            out |= {f"{k}_{name}": v for k, v in follow_bench(os.path.join(tmp, "follow"), count, ndirs).items()}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _put_entries(cat: Catalog, name: bytes, n: int, ndirs: int) -> None:
    """Catalog entries for ``name/0`` .. ``name/<n-1>``, one 4 KiB extent each, spread over ``ndirs``
    drives (no data behind them), each with a fresh generation."""
    g0 = cat.new_generations(n)
    cat.put_many([(key_digest(b"%s/%d" % (name, i)),
                   Entry(g0 + i, 4096 - HEADER_SIZE, ((i % ndirs, 4096 * (1 + i // ndirs), 4096, i),)))
                  for i in range(n)])


def follow_bench(meta: str, count: int, ndirs: int, changes: int = 1000) -> dict[str, float]:
    """A follower (a decode instance reading a prefill instance's store) refreshing across one of
    its writer's checkpoints, on a catalog of ``count`` one-extent entries (catalog only, no data).

    The writer changes ``changes`` entries, checkpoints, and changes as many again.
    ``follow_refresh_s``: the follower's next ``refresh()``, which finishes the replaced journal and
    follows the new one.  ``follow_reload_s``: what every checkpoint cost a follower before, and
    still costs one that fell two checkpoints behind: the whole catalog loaded again (a follower
    opened afresh, checkpoint and journal).
    """
    writer = Catalog(meta, checkpoint_every=10**9)
    try:
        _put_entries(writer, b"follow", count, ndirs)
        writer.sync()
        follower = Catalog(meta, follow=True)
        # Re-puts (new generations of objects the follower holds) on both sides of the checkpoint.
        _put_entries(writer, b"follow", changes, ndirs)
        writer.checkpoint()
        _put_entries(writer, b"follow", changes, ndirs)
        writer.sync()
        t0 = time.perf_counter()
        follower.refresh()
        out = {"follow_refresh_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        fresh = Catalog(meta, follow=True)
        out["follow_reload_s"] = time.perf_counter() - t0
        for c in (follower, fresh):
            if len(c) != count or c.epoch != writer.epoch or c.get(key_digest(b"follow/0")) != writer.get(
                    key_digest(b"follow/0")):
                raise RuntimeError("a follower does not hold its writer's catalog after the checkpoint")
            c.close()
    finally:
        writer.close()
    return out


# ---- output -----------------------------------------------------------------------------------------
def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def print_tables(results: dict, console) -> None:
    from rich.table import Table

    s = results["summary"]
    t = Table(title="random reads: raw O_DIRECT vs KVStore.submit_get (store GB/s counts payload only)")
    for col in ("object", "raw GB/s", "raw IOPS", "raw CPU s/GB", "store GB/s", "store IOPS", "store CPU s/GB",
                "store/raw (per round)"):
        t.add_column(col, justify="right")
    for name, r in results["sizes"].items():
        raw = r["raw_median"]
        ratio = s[f"ratio_{name}"]
        target = 0.95 if r["extent_bytes"] >= 64 * KiB else 0.85
        color = "green" if ratio >= target else "red"
        t.add_row(_fmt_size(r["extent_bytes"]), f"{raw['gbps']:.3f}", f"{raw['iops']:,.0f}",
                  f"{raw['cpu_s_per_gb']:.2f}", f"{s[f'store_gbps_{name}']:.3f}", f"{s[f'store_iops_{name}']:,.0f}",
                  f"{s[f'store_cpu_s_per_gb_{name}']:.2f}", f"[{color}]{ratio:.2f}[/] (>={target})")
    console.print(t)
    d = Table(title="read details (medians of the timed rounds)")
    for col in ("object", "payload", "raw best", "store paths GB/s (ratio, CPU/GB over raw's)", "store batches"):
        d.add_column(col, justify="right")
    for name, r in results["sizes"].items():
        per_b = ", ".join(f"{b} {s[f'store_{b}_gbps_{name}']:.3f} ({s[f'ratio_{b}_{name}']:.2f}, "
                          f"CPU x{s[f'cpu_ratio_{b}_{name}']:.2f})" for b in r["store_samples"])
        shape = next(iter(r["store_samples"].values()))[0]["method"].replace("submit_get ", "")
        d.add_row(_fmt_size(r["extent_bytes"]), f"{r['payload_bytes']} B", r["raw_median"]["method"], per_b, shape)
    console.print(d)
    w = Table(title="writes: raw O_DIRECT vs KVStore.submit_put + flush (store GB/s counts payload only)")
    for col in ("object", "raw GB/s", "raw best", "store GB/s", "store objects/s", "store CPU s/GB", "store/raw"):
        w.add_column(col, justify="right")
    for r in results["sizes"].values():
        rw, sw = r["raw_write"], r["store_write"]
        w.add_row(_fmt_size(r["extent_bytes"]), f"{rw['gbps']:.3f}", rw["method"], f"{sw['gbps']:.3f}",
                  f"{sw['iops']:,.0f}", f"{sw['cpu_s_per_gb']:.2f}", f"{sw['gbps'] / rw['gbps']:.2f}")
    console.print(w)
    console.print(results["config"]["durability"])
    counts = sorted({k.rsplit("_", 1)[1] for k in s if k.startswith("reopen_s_")}, key=parse_count)
    if counts:
        t = Table(title="catalog reopen")
        for col in ("objects", "build s", "reopen s (CPU s)", "journal replay s (CPU s)",
                    "follower across a checkpoint: refresh / reload s"):
            t.add_column(col, justify="right")
        for c in counts:
            fr, fl = s[f"follow_refresh_s_{c}"], s[f"follow_reload_s_{c}"]
            t.add_row(c, f"{s[f'reopen_build_s_{c}']:.1f}", f"{s[f'reopen_s_{c}']:.2f} ({s[f'reopen_cpu_s_{c}']:.2f})",
                      f"{s[f'replay_s_{c}']:.2f} ({s[f'replay_cpu_s_{c}']:.2f})",
                      f"{fr * 1e3:.1f} ms / {fl * 1e3:.0f} ms (x{fl / fr:.0f})")
        console.print(t)
        console.print(f"reopen objects: {results.get('reopen_via')}")
    cc = results["drives"].get("cap_check")
    if cc:
        t = Table(title="testbed cap check (drive 0, 8 threads of raw O_DIRECT)")
        for col in ("load", "cap", "measured", "measured/cap"):
            t.add_column(col, justify="right")
        for c in cc:
            t.add_row(c["what"], f"{c['cap']:g} {c['unit']}", f"{c['measured']:.0f} {c['unit']}", f"{c['ratio']:.2f}")
        console.print(t)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["sizes"])
    s = results["summary"]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [s[f"raw_gbps_{n}"] for n in names], 0.4, label="raw O_DIRECT (best)")
    ax.bar([i + 0.2 for i in x], [s[f"store_gbps_{n}"] for n in names], 0.4, label="KVStore get (payload)")
    for i, n in enumerate(names):
        ax.text(i + 0.2, s[f"store_gbps_{n}"], f"{s[f'ratio_{n}']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("GB/s")
    ax.set_title(f"random reads ({results['drives']['emulation']} emulation, {results['drives']['drives']} drives)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    counts = args.reopen if args.reopen is not None else [100_000, 1_000_000]
    results = bench(args, console)
    via = args.reopen_via or ("catalog" if args.quick else "store")
    results["reopen_via"] = ("4 KiB objects written through KVStore.submit_put" if via == "store" else
                             "catalog filled directly, no data written") + \
        "; reopen = KVStore.open after close (checkpoint + allocators); replay = Catalog from the journal alone"
    if counts:
        results["summary"] |= reopen_bench(counts, via, args.dir, console)
    results["seconds"] = time.perf_counter() - t0
    # Other work on the machine skews both sides, the store (more CPU per I/O) more: say how busy it was.
    results["load_avg_1min"] = [load0, os.getloadavg()[0]]
    results["cpus"] = os.cpu_count()
    results["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print_tables(results, console)
    console.print(f"drives: {results['drives']['emulation']} emulation; {results['config']['object_size']}; "
                  f"{results['seconds']:.0f} s; load average {load0:.1f} -> {results['load_avg_1min'][1]:.1f} "
                  f"on {results['cpus']} CPUs")
    if args.json:
        write_json(args.json, results)
        plot(results, os.path.splitext(args.json)[0] + ".png")
        console.print(f"wrote {args.json}")
    return 0

