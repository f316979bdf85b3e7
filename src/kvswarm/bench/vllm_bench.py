"""vLLM's built-in ``fs`` offloading tier vs kvswarm's tier, both through vLLM's own tier interfaces.

Both tiers are built by vLLM's ``SecondaryTierFactory`` over the same primary-tier
chunks and driven the way vLLM's tiering manager drives them (``submit_store`` /
``submit_load`` jobs, ``get_finished_jobs`` polling, ``lookup`` with RETRY):

1. One drive, same disk: restore throughput (many requests' loads in flight) and one
   request's load, per block size, next to the raw O_DIRECT ceiling over the same data
   (``kvswarm.io.raw`` reading kvswarm's own extents: tuned threads and io_uring depths,
   file and random order; the method that tuned best, sampled before and after the tiers'
   restores in every round).  Two references that do a load's work: "raw landed", each block's
   payload read straight into its own primary-tier chunk (tuned by its own sweep, sampled before
   and after the tiers' restores as raw is), and "raw + delivery", the same reads each followed
   by a copy of the block into its chunk.  They are references, not ceilings: a tier's load must
   land in vLLM's primary region, and this VM reads into a large region of fresh memory slower
   than into a few reused buffers.  One request's load (nothing else in flight) is set beside the same
   request's reads issued raw as one io_uring burst.
2. Restart: a fresh tier instance after the page cache is dropped looks up every block
   (vLLM's fs tier: one file probe per block; kvswarm: its catalog), with device reads
   counted from /proc/diskstats; in this process, and in fresh ones.
3. Eight drives on kernel-throttled loop devices (``kvswarm.testbed``), equal caps per
   drive: vLLM's fs tier on one drive (ext4 on one loop device: it has one root directory and
   cannot stripe) vs kvswarm striped over all eight.  Beside the speedup (what striping buys),
   each tier's efficiency: its GB/s per GB/s of the caps of the drives it uses.
4. Engine load, with part 1's tiers at the first block size: restores while another thread of
   the process holds the GIL much of the time, as vLLM's engine-core loop does in the process
   that hosts the tiers (:class:`EngineLoad`).

vLLM is imported only inside ``.venv-vllm`` (scripts/setup-vllm.sh); run from another
interpreter this command re-executes itself there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvswarm.bench.engine_host import (
    EngineLoad,
    drop_caches,
    engine_loads,
    finish,
    load_name,
    reexec_in_engine_venv,
    standalone_main,
)
from kvswarm.bench import write_summary
from kvswarm.io.raw import cpu_time
from kvswarm.format import ALIGN
from kvswarm.layout import KVLayout

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REQUEST_BLOCKS = 16  # blocks per request: one vLLM job


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes (about a minute or two)")
    p.add_argument("--json", metavar="PATH", help="write results (with a 'summary' dict) here; plots beside it")
    p.add_argument("--summary", metavar="PATH", help="also write a small JSON here: the summary and the settings")
    p.add_argument("--dir", help="scratch directory on the disk under test (default: a temp dir in /var/tmp)")
    p.add_argument("--block-sizes", default=None, help="comma-separated KiB per block (default 256,2048)")
    p.add_argument("--restore-mib", type=int, default=None, help="MiB restored per block size")
    p.add_argument("--lookup-blocks", type=int, default=None, help="blocks looked up after a restart")
    p.add_argument("--fresh-rounds", type=int, default=3,
                   help="restarts in fresh processes, besides the in-process ones (0 to skip)")
    p.add_argument("--kv-backend", default="uring", choices=["uring", "threads"], help="kvswarm I/O backend")
    p.add_argument("--rounds", type=int, default=None,
                   help="measurement rounds, the median kept (default 15; eight drives: 5, or 3 with --quick)")
    p.add_argument("--no-testbed", action="store_true", help="skip the eight-drive loop-device part")
    p.add_argument("--engine-load", type=engine_loads, default="1/1,3/1", metavar="HOLD/IDLE,...",
                   help="GIL duty cycles of the emulated engine thread, ms held / ms idle, measured at the first "
                        "block size ('' to skip)")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        return reexec_in_engine_venv("kvswarm.bench.vllm_bench", "vllm")
    from rich.console import Console

    console = Console(width=max(150, Console().width))
    quick = args.quick
    sizes = [int(s) * KiB for s in (args.block_sizes or "256,2048").split(",")]
    restore = (args.restore_mib or (256 if quick else 1024)) * MiB
    lookups = args.lookup_blocks or 16384
    # A noisy shared disk (+-15% from one second to the next; per-round ratios 0.7-1.2): the median
    # of 9 rounds moved +-0.04 between runs of the same code, of 15 about a quarter less.
    rounds = args.rounds or 15
    tb_rounds = args.rounds or (3 if quick else 5)  # throttled drives vary little, and are slow
    root = tempfile.mkdtemp(prefix="kvswarm-bench-vllm-", dir=args.dir or "/var/tmp")
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": quick, "kv_backend": args.kv_backend,
                     "request_blocks": REQUEST_BLOCKS, "rounds": rounds, "one_drive": [], "restart": None,
                     "eight_drives": None}
    try:
        for size in sizes:
            console.print(f"[bold]one drive, same disk: {size // KiB} KiB blocks, {restore // MiB} MiB[/bold]")
            results["one_drive"].append(one_drive(root, size, restore, args.kv_backend, rounds, console,
                                                  args.engine_load if size == sizes[0] else [], tb_rounds))
        console.print(f"[bold]restart: cold lookup of {lookups} blocks[/bold]")
        results["restart"] = restart_lookup(root, lookups, args.kv_backend, rounds, console, args.fresh_rounds)
        if not args.no_testbed:
            console.print("[bold]eight drives (kernel-throttled loop devices)[/bold]")
            results["eight_drives"] = eight_drives(256 * KiB, (256 if quick else 1024) * MiB, args.kv_backend,
                                                   tb_rounds, console)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rc = finish(results, summarize, report, console, args.json, plot)
    if args.summary:
        write_summary(args.summary, "kvswarm bench vllm" + (" --quick" if quick else ""), settings(results, args),
                      results["summary"])
        console.print(f"wrote {args.summary}")
    return rc


def settings(r: dict, args: argparse.Namespace) -> dict:
    """What a run measured with: sizes, rounds, backends, the references' tuned methods, the testbed."""
    out = {k: r[k] for k in ("quick", "kv_backend", "request_blocks", "rounds")}
    out |= {"block_kib": [w["block_kib"] for w in r["one_drive"]],
            "restore_mib": args.restore_mib or (256 if args.quick else 1024), "fresh_rounds": args.fresh_rounds,
            "engine_load": args.engine_load, "load_avg": os.getloadavg(), "cpus": os.cpu_count()}
    for w in r["one_drive"]:
        k = f"{w['block_kib']}k"
        out[f"blocks_{k}"] = w["blocks"]
        out[f"raw_method_{k}"], out[f"raw_landed_method_{k}"] = w["raw"]["method"], w["raw"]["landed"]["method"]
        out[f"raw_delivered_method_{k}"] = w["raw"]["delivered"]["method"]
    e = r["eight_drives"]
    if e:
        out["eight_drives"] = {"emulation": e["testbed"]["emulation"], "caps": e["testbed"]["caps"],
                               "block_kib": e["block_kib"], "blocks": e["blocks"]}
    return out


# ---- tiers ------------------------------------------------------------------------------
def layout_for(block_bytes: int) -> KVLayout:
    """A layout whose block is exactly ``block_bytes`` (I/O cost depends on bytes, not on the shape)."""
    layout = KVLayout(1, 1, block_bytes // 4, "bfloat16", 1, model_id=f"bench-{block_bytes // KiB}KiB")
    assert layout.block_bytes == block_bytes
    return layout


def fs_config(root: str) -> dict:
    return {"type": "fs", "root_dir": root}


def kv_config(drives: list[str], backend: str, capacity: int, meta_dir: str | None = None) -> dict:
    """kvswarm's tier as the benchmark configures it (its queue depth is the tier's default)."""
    from kvswarm.integrations.vllm.tier import MODULE_PATH, TIER_TYPE

    return {"type": TIER_TYPE, "module_path": MODULE_PATH, "drives": drives, "capacity_per_drive": capacity,
            "backend": backend, "meta_dir": meta_dir, "buffer_pool_bytes": 512 * MiB}


@dataclass
class Bench:
    """One primary region and one job stream, replayed against any tier."""

    layout: KVLayout
    nblocks: int

    def __post_init__(self) -> None:
        from kvswarm.integrations.vllm.harness import Primary, keys_for, offloading_spec

        self.bs = self.layout.block_bytes
        self.primary = Primary.create(self.nblocks, self.bs)
        rng = np.random.default_rng(7)
        for i in range(self.nblocks):  # distinct, incompressible blocks
            self.primary.chunk(i)[:] = rng.integers(0, 256, self.bs, dtype=np.uint8)
        self.keys = keys_for(self.nblocks)
        self.spec = offloading_spec(self.layout, self.nblocks * self.bs)
        self.digest = [hash(bytes(self.primary.chunk(i)[:4096])) for i in range(self.nblocks)]

    def open(self, config: dict):
        from kvswarm.integrations.vllm.harness import JobRunner, make_tier

        return JobRunner(make_tier(config, self.primary, self.spec))

    def requests(self) -> list[list[int]]:
        return [list(range(i, min(i + REQUEST_BLOCKS, self.nblocks))) for i in range(0, self.nblocks, REQUEST_BLOCKS)]

    def store(self, run) -> float:
        """Store every block, one job per request, all in flight; seconds until all done."""
        t0 = time.perf_counter()
        ids = [run.submit([self.keys[i] for i in r], r, load=False) for r in self.requests()]
        res = run.wait(ids)
        assert all(r.success for r in res.values()), "store failed"
        return time.perf_counter() - t0

    def restore(self, run, settle: Callable[[], None] | None = None) -> tuple[float, float]:
        """Load every block back (into the same slots), all requests in flight; verify a sample.
        Returns seconds and the process's CPU seconds over the same span.  ``settle`` runs just
        before the timer starts (a :class:`kvswarm.testbed.CreditDrain`)."""
        self.primary.mm[:] = bytes(len(self.primary.mm))
        if settle is not None:
            settle()
        c0, t0 = cpu_time(), time.perf_counter()
        ids = [run.submit([self.keys[i] for i in r], r, load=True) for r in self.requests()]
        res = run.wait(ids)
        dt, cpu = time.perf_counter() - t0, cpu_time() - c0
        assert all(r.success for r in res.values()), "restore failed"
        for i in range(0, self.nblocks, max(1, self.nblocks // 16)):
            assert hash(bytes(self.primary.chunk(i)[:4096])) == self.digest[i], f"block {i} differs"
        return dt, cpu

    def extents(self, tier) -> list[tuple[int, int]]:
        """Each block's one extent in kvswarm's tier, as (drive, offset)."""
        return [e.extents[0][:2] for e in tier.store.locate([tier.keyspace.key(k) for k in self.keys])]

    def deliverer(self, extents: list[tuple[int, int]]) -> Callable[[tuple[int, int], memoryview], None]:
        """For the raw + delivery reference: copies the block in a buffer read from kvswarm's extent
        (drive, offset) into that block's chunk of the primary region, as a load must.  ``extents``:
        :meth:`extents` of the tier."""
        from kvswarm.format import payload_offset

        poff = payload_offset(self.bs)
        chunk = {io: i for i, io in enumerate(extents)}

        def deliver(io: tuple[int, int], buf: memoryview) -> None:
            # A view per call: one held between calls would keep the primary region from closing.
            np.copyto(self.primary.chunk(chunk[io]), np.frombuffer(buf, np.uint8, self.bs, poff))  # releases the GIL

        return deliver

    @contextlib.contextmanager
    def lander(self, extents: list[tuple[int, int]]):
        """For the raw landed reference: ``with bench.lander(ext) as chunk_of``, ``chunk_of((drive,
        offset))`` is the chunk of the primary region that block loads into (views released on exit:
        one left would keep the region from closing)."""
        chunk = {io: i for i, io in enumerate(extents)}
        flat, views = self.primary.view.cast("B"), []

        def chunk_of(io: tuple[int, int]) -> memoryview:
            i = chunk[io]
            views.append(v := flat[i * self.bs:(i + 1) * self.bs])
            return v

        try:
            yield chunk_of
        finally:
            for v in views:
                v.release()
            flat.release()

    def sample_requests(self, reps: int = 5) -> list[list[int]]:
        """The requests one-request loads are timed on (spread over the blocks)."""
        reqs = self.requests()
        return [reqs[(k * 7) % len(reqs)] for k in range(reps)]

    def single_request(self, run) -> float:
        """Median seconds of one request's load with nothing else in flight."""
        times = []
        for r in self.sample_requests():
            t0 = time.perf_counter()
            assert run.run([self.keys[i] for i in r], r, load=True).success
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def close(self) -> None:
        self.primary.close()


class TierCase:
    """A tier under test: stored once, then measured in rounds interleaved with the others."""

    def __init__(self, bench: Bench, config: dict, settle: Callable[[], None] | None = None) -> None:
        self.bench, self.run, self.settle = bench, bench.open(config), settle
        pool = getattr(getattr(self.run.tier, "store", None), "pool", None)
        if pool is not None:  # kvswarm's tier faults its buffer pool in as it starts: wait for that
            pool.populate()
        c0 = cpu_time()
        self.store_s = bench.store(self.run)
        self.store_cpu = cpu_time() - c0
        # One untimed restore: a tier's buffers are faulted in before it is timed, as the raw
        # loops fault theirs in before their timers (a long-lived tier has them resident).
        bench.restore(self.run)
        ready = getattr(self.run.tier, "region_ready", None)
        if ready is not None:  # kvswarm's tier backs the region with 2 MiB pages from its first load on: once
            ready.wait()       # that is done, every round (and every tier's) reads into the region as it stays
            bench.restore(self.run)
        self.restores: list[tuple[float, float]] = []  # (seconds, cpu seconds)
        self.singles: list[float] = []

    def measure_restore(self) -> None:
        drop_caches()
        self.restores.append(self.bench.restore(self.run, self.settle))

    def measure_restore_window(self, window_s: float) -> None:
        """Restores back to back for at least ``window_s`` after one drain, the gaps between them
        (page-cache drop, zeroing the region) counted as time: a restore of a few tenths of a second
        would otherwise be timed mostly on the throttle's credit, which after any gap is at most one
        slice of budget, a small share of a window of several seconds.  Each pass is verified."""
        if self.settle is not None:
            self.settle()
        t0, c0, n = time.perf_counter(), cpu_time(), 0
        while n == 0 or time.perf_counter() - t0 < window_s:
            drop_caches()
            self.bench.restore(self.run)
            n += 1
        self.restores.append(((time.perf_counter() - t0) / n, (cpu_time() - c0) / n))

    def measure_single(self) -> None:
        drop_caches()
        self.singles.append(self.bench.single_request(self.run))

    def result(self) -> dict:
        total = self.bench.nblocks * self.bench.bs
        dt, cpu = (float(np.median([x[i] for x in self.restores])) for i in (0, 1))
        single = float(np.median(self.singles))
        self.run.tier.shutdown()
        return {"store_gbps": total / self.store_s / 1e9, "store_cpu_s_per_gb": self.store_cpu / (total / 1e9),
                "restore_gbps": total / dt / 1e9, "restore_cpu_s_per_gb": cpu / (total / 1e9),
                "restore_gbps_best": total / min(self.restores)[0] / 1e9,
                "restore_gbps_rounds": [total / t / 1e9 for t, _ in self.restores],
                "single_request_ms": single * 1e3,
                "single_request_gbps": REQUEST_BLOCKS * self.bench.bs / single / 1e9}


def measure_rounds(cases: dict[str, TierCase], rounds: int, ceiling: RawCeiling | None = None) -> None:
    """Per round: every case's restore bracketed by the raw ceiling and the raw landed reference,
    each sampled just before and just after (raw, landed | tiers | landed, raw: so a restore is
    compared with the disk as it was around it, and neither reference sits closer to the tiers),
    then the raw + delivery reference, then every case's one-request load.  The cases' order is reversed
    every other round, so drift and neighbours' load hit all alike; each case's figure is its
    median round (:func:`results`)."""
    for r in range(rounds):
        order = list(cases.values()) if r % 2 == 0 else list(cases.values())[::-1]
        if ceiling is not None:
            ceiling.measure()
            ceiling.measure_landed()
        for c in order:
            c.measure_restore()
        if ceiling is not None:
            ceiling.measure_landed()
            ceiling.measure()
            ceiling.measure_delivered()
        for c in order:
            c.measure_single()
        if ceiling is not None:
            ceiling.measure_burst()


def results(cases: dict[str, TierCase]) -> dict:
    """Every case's figures (medians of its rounds); shuts the tiers down."""
    return {name: c.result() for name, c in cases.items()}


# ---- 1. one drive, same disk ---------------------------------------------------------------
class RawCeiling:
    """The raw O_DIRECT ceiling over the same data: kvswarm's own extents in its data file, read
    with no store in the way, as ``kvswarm bench io`` does.

    Tuned first (threads 8-32, io_uring depth 16-128, in file order and in random order, three
    passes each, the median kept); the best method is then sampled twice per round, before
    and after the tiers' restores, and a round's ceiling is the mean of the two.  Each tier's ratio
    is the median of its per-round ratios.  The method is chosen on the tuning samples, not on the
    measured ones: the best of several methods' medians would be biased upwards by the noise it
    picks.

    With ``deliver`` (see :meth:`Bench.deliverer`) it also samples raw + delivery once per round:
    the tuned number of threads (the best threaded setting if io_uring tuned best), each copying
    the block it read into its primary-tier chunk before its next read.

    With ``land`` (see :meth:`Bench.lander`) it also measures raw landed: each block's payload read
    straight into its own chunk of the primary region, as a load must land it.  It gets the same
    tuning sweep as the ceiling, its own (a method that is best into reused buffers need not be best
    into fresh memory), and is sampled twice per round like the ceiling, before and after the tiers'
    restores; a round's reference is the mean of the two.  The ceiling itself reads into a few
    buffers it reuses, which stay in the CPU's cache; on this VM, a disk serving 3-4 GB/s then reads
    1 GiB into memory of its own at only 0.5-0.8 of that (docs/integrations.md), a cost no load can
    avoid.

    With ``requests`` (each a request's extents) it times, once per round, each request's reads
    issued as one io_uring burst (all in flight at once), the raw side of one request's load.
    """

    THREADS, DEPTHS = (8, 16, 32), (16, 32, 64, 128)

    def __init__(self, store, deliver: Callable[[tuple[int, int], memoryview], None] | None = None,
                 requests: Sequence[Sequence[tuple[int, int]]] = (),
                 land: Callable[[], contextlib.AbstractContextManager[Callable[[tuple[int, int]], memoryview]]]
                 | None = None) -> None:
        exts = sorted(x[:3] for _, e in store.entries_oldest_first() for x in e.extents)
        sizes = {x[2] for x in exts}
        assert len(sizes) == 1, "one extent size per tier"
        self.size = sizes.pop()
        self.fds = [d.fd for d in store.drives]
        ios = [(d, o) for d, o, _ in exts]
        self.orders = {"file": ios, "random": [ios[i] for i in np.random.default_rng(0).permutation(len(ios))]}
        self.tuning: dict[str, float] = {}
        self.method: tuple[str, str, int] | None = None
        self.samples: list[float] = []
        self.deliver = deliver
        self.delivered: list[float] = []
        self.land = land
        self.landed_tuning: dict[str, float] = {}
        self.landed_method: tuple[str, str, int] | None = None
        self.landed: list[float] = []
        self.requests = requests
        self.bursts: list[float] = []  # per round, the median seconds of one request's burst

    def _sample(self, order: str, kind: str, n: int, landed: bool = False) -> float:
        from kvswarm.io.raw import run_threads, run_uring
        from kvswarm.io.base import Op

        ios = self.orders[order]
        drop_caches()
        if kind == "delivered":  # threads, each handing every block it read to self.deliver
            return run_threads(self.fds, ios, self.size, Op.READ, n, 10.0,
                               deliver=lambda i, buf: self.deliver(ios[i], buf)).gbps
        fn = run_threads if kind == "threads" else run_uring
        if not landed:
            return fn(self.fds, ios, self.size, Op.READ, n, 10.0).gbps
        # Each block's payload (its extent past the header's sector) straight into its own chunk.
        with self.land() as chunk_of:
            into = [chunk_of(io) for io in ios]
            return fn(self.fds, [(d, o + ALIGN) for d, o in ios], self.size - ALIGN, Op.READ, n, 10.0,
                      into=into).gbps

    @staticmethod
    def _name(method: tuple[str, str, int]) -> str:
        order, kind, n = method
        return f"{kind}_{n}_{order}"

    def tune(self) -> None:
        from kvswarm.io.raw import tune_passes

        configs = [(order, kind, n) for order in self.orders
                   for kind, ns in (("threads", self.THREADS), ("uring", self.DEPTHS)) for n in ns]
        got = tune_passes(configs, lambda c: self._sample(*c), passes=3)
        self.tuning = {self._name(c): g for c, g in got.items()}
        self.method = max(got, key=got.get)
        if self.land is not None:  # the same sweep, into the primary region
            got = tune_passes(configs, lambda c: self._sample(*c, landed=True), passes=3)
            self.landed_tuning = {self._name(c): g for c, g in got.items()}
            self.landed_method = max(got, key=got.get)

    def measure(self) -> None:
        self.samples.append(self._sample(*self.method))

    def _delivery_threads(self) -> int:
        order, kind, n = self.method
        if kind == "threads":
            return n
        return max(self.THREADS, key=lambda t: self.tuning[self._name((order, "threads", t))])

    def measure_delivered(self) -> None:
        if self.deliver is not None:
            self.delivered.append(self._sample(self.method[0], "delivered", self._delivery_threads()))

    def measure_landed(self) -> None:
        if self.land is not None:
            self.landed.append(self._sample(*self.landed_method, landed=True))

    def measure_burst(self) -> None:
        from kvswarm.io.raw import run_uring
        from kvswarm.io.base import Op

        if self.requests:
            drop_caches()
            self.bursts.append(float(np.median([run_uring(self.fds, ios, self.size, Op.READ, len(ios), 10.0).seconds
                                                for ios in self.requests])))

    @staticmethod
    def _pairs(samples: list[float]) -> list[float]:
        return [(a + b) / 2 for a, b in zip(samples[::2], samples[1::2])]

    def rounds(self) -> list[float]:
        """Each round's ceiling: the mean of its two samples."""
        return self._pairs(self.samples)

    def landed_rounds(self) -> list[float]:
        """Each round's raw landed reference: the mean of its two samples."""
        return self._pairs(self.landed)

    def result(self) -> dict:
        out = {"gbps": float(np.median(self.rounds())), "method": self._name(self.method), "samples": self.samples,
               "round_gbps": self.rounds(), "tuning": self.tuning, "extent_bytes": self.size,
               "note": "method tuned first (median of three passes), then sampled before and after the tiers' "
                       "restores in each round; reads kvswarm's own extents"}
        if self.bursts:
            out["one_request_burst_ms"] = float(np.median(self.bursts)) * 1e3
            out["one_request_burst_ms_rounds"] = [b * 1e3 for b in self.bursts]
        if self.delivered:
            out["delivered"] = {"gbps": float(np.median(self.delivered)), "round_gbps": self.delivered,
                                "method": f"threads_{self._delivery_threads()}_{self.method[0]}",
                                "note": "the same reads, each block then copied into its primary-tier chunk"}
        if self.landed:
            out["landed"] = {"gbps": float(np.median(self.landed_rounds())), "round_gbps": self.landed_rounds(),
                             "samples": self.landed, "method": self._name(self.landed_method),
                             "tuning": self.landed_tuning,
                             "note": "each block's payload read straight into its own primary-tier chunk (no "
                                     "buffer reused, nothing verified); its own tuning sweep (median of three "
                                     "passes), sampled before and after the tiers' restores in each round"}
        return out


def one_drive(root: str, size: int, total: int, backend: str, rounds: int, console,
              loads: Sequence[tuple[float, float]] = (), load_rounds: int = 3) -> dict:
    bench = Bench(layout_for(size), max(REQUEST_BLOCKS, total // size))
    out = {"block_kib": size // KiB, "blocks": bench.nblocks, "rounds": rounds}
    kv_dir = os.path.join(root, f"kv-{size}")
    os.makedirs(kv_dir)
    try:
        cases = {"fs": TierCase(bench, fs_config(os.path.join(root, f"fs-{size}"))),
                 "kvswarm": TierCase(bench, kv_config([kv_dir], backend,
                                                      bench.nblocks * (size + 64 * KiB) + 64 * MiB))}
        kv_tier = cases["kvswarm"].run.tier
        ext = bench.extents(kv_tier)
        raw = RawCeiling(kv_tier.store, bench.deliverer(ext),
                         [[ext[i] for i in r] for r in bench.sample_requests()], lambda: bench.lander(ext))
        raw.tune()
        measure_rounds(cases, rounds, raw)
        if loads:
            out["engine_load"] = engine_load(bench, cases, loads, load_rounds, console)
        out.update(results(cases))
        out["raw"] = raw.result()
    finally:
        bench.close()
        shutil.rmtree(os.path.join(root, f"fs-{size}"), ignore_errors=True)
        shutil.rmtree(kv_dir, ignore_errors=True)
    rawg, delivered, landed = out["raw"]["gbps"], out["raw"]["delivered"], out["raw"]["landed"]
    for t in ("fs", "kvswarm"):
        for name, ref in (("raw", out["raw"]["round_gbps"]), ("raw_delivered", delivered["round_gbps"]),
                          ("raw_landed", landed["round_gbps"])):
            per_round = [g / r for g, r in zip(out[t]["restore_gbps_rounds"], ref)]
            out[t][f"restore_ratio_vs_{name}_rounds"] = per_round
            out[t][f"restore_ratio_vs_{name}"] = float(np.median(per_round))
        out[t]["single_request_ratio_vs_raw"] = out[t]["single_request_gbps"] / rawg
        out[t]["single_request_speed_vs_raw_burst"] = out["raw"]["one_request_burst_ms"] / out[t]["single_request_ms"]
    console.print(f"  raw {rawg:.2f} GB/s ({out['raw']['method']}), raw landed {landed['gbps']:.2f} "
                  f"({landed['method']}), raw + delivery "
                  f"{delivered['gbps']:.2f}; restore "
                  f"fs {out['fs']['restore_gbps']:.2f}, kvswarm {out['kvswarm']['restore_gbps']:.2f} GB/s "
                  f"(medians of {rounds} rounds)")
    return out


# ---- 2. restart lookup -------------------------------------------------------------------------
def disk_reads() -> int:
    """Reads completed on every whole disk (not partitions) since boot."""
    total = 0
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            name = p[2]
            if name.startswith(("loop", "ram", "dm-", "sr")) or name[-1].isdigit() and not name.startswith("nvme"):
                continue
            if name.startswith("nvme") and "p" in name[4:]:
                continue
            total += int(p[3])
    return total


def restart_lookup(root: str, n: int, backend: str, rounds: int, console, fresh_rounds: int = 3) -> dict:
    """Store ``n`` blocks in each tier, then per round: drop caches, open a new tier, look every block up.
    The same again in ``fresh_rounds`` fresh processes (:func:`fresh_process_lookup`), where nothing
    of an earlier tier is left in memory.

    Device reads are counted machine-wide (/proc/diskstats): on a shared machine others' reads count too.
    """
    bench = Bench(layout_for(4 * KiB), n)
    kv_dir = os.path.join(root, "kv-lookup")
    os.makedirs(kv_dir)
    configs = {"fs": fs_config(os.path.join(root, "fs-lookup")),
               "kvswarm": kv_config([kv_dir], backend, n * 8 * KiB + 64 * MiB)}
    try:
        for cfg in configs.values():
            run = bench.open(cfg)
            bench.store(run)
            run.tier.shutdown()
        samples: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(rounds):
            for name, cfg in configs.items():
                samples[name].append(timed_restart(bench, cfg))
        fresh = {name: [fresh_process_lookup(cfg, n) for _ in range(fresh_rounds)] for name, cfg in configs.items()}
    finally:
        bench.close()
        shutil.rmtree(kv_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(root, "fs-lookup"), ignore_errors=True)
    out: dict = {"blocks": n, "rounds": rounds}
    for name, xs in samples.items():
        out[name] = m = _median_round(xs)
        console.print(f"  {name}: {n} lookups after restart in {m['seconds'] * 1e3:.0f} ms (median; opening the tier "
                      f"{m['open_s'] * 1e3:.0f} ms of it), {m['device_reads']} device reads, {m['hits']} hits")
        if fresh[name]:
            out[name]["fresh_process"] = f = _median_round(fresh[name])
            console.print(f"    in a fresh process: {f['seconds'] * 1e3:.0f} ms (median of {len(fresh[name])}; opening "
                          f"{f['open_s'] * 1e3:.0f} ms), {f['device_reads']} device reads, {f['hits']} hits")
    return out


def timed_restart(bench: Bench, config: dict) -> dict:
    """Drop the page cache, open a new tier (the restarted engine's) and look every block up."""
    drop_caches()
    r0, t0 = disk_reads(), time.perf_counter()
    run = bench.open(config)
    t1 = time.perf_counter()
    found = run.lookup(bench.keys)
    dt = time.perf_counter() - t0
    reads = disk_reads() - r0
    catalog_s = getattr(getattr(run.tier, "store", None), "reopen_seconds", None)
    run.tier.shutdown()
    return {"seconds": dt, "open_s": t1 - t0, "device_reads": reads, "hits": sum(r.name == "HIT" for r in found),
            "catalog_load_s": catalog_s}


def _median_round(xs: list[dict]) -> dict:
    """The round with the median time, and every round's time."""
    return {**sorted(xs, key=lambda x: x["seconds"])[len(xs) // 2], "seconds_rounds": [x["seconds"] for x in xs]}


_FRESH_CHILD = """
import json, sys
from kvswarm.bench.vllm_bench import _fresh_child
print(json.dumps(_fresh_child(json.loads(sys.argv[1]), int(sys.argv[2]))))
"""


def fresh_process_lookup(config: dict, n: int) -> dict:
    """A restart for real: a new interpreter opens the tier and looks the ``n`` blocks up.  The
    tiers' modules are imported before the page cache is dropped and the clock starts, as an engine
    imports them at start-up, long before its first lookup."""
    out = subprocess.run([sys.executable, "-c", _FRESH_CHILD, json.dumps(config), str(n)], capture_output=True,
                         text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fresh_child(config: dict, n: int) -> dict:
    import vllm.v1.kv_offload.tiering.fs.manager  # noqa: F401 - imported at start-up, as above

    import kvswarm.integrations.vllm.tier  # noqa: F401

    bench = Bench(layout_for(4 * KiB), n)
    try:
        return timed_restart(bench, config)
    finally:
        bench.close()


# ---- 3. eight drives ---------------------------------------------------------------------------
def measure_windows(case: TierCase, rounds: int, window_s: float) -> None:
    """``rounds`` windowed restore samples and one-request loads of one tier."""
    for _ in range(rounds):
        case.measure_restore_window(window_s)
        case.measure_single()


def eight_drives(size: int, total: int, backend: str, rounds: int, console, window_s: float = 3.0) -> dict:
    from kvswarm.testbed import KERNEL, Testbed

    bench = Bench(layout_for(size), max(REQUEST_BLOCKS, total // size))
    drive_bytes = max(256 * MiB, 2 * bench.nblocks * size)
    try:
        with Testbed(drives=8, drive_bytes=drive_bytes, mode=KERNEL) as tb:
            out = {"testbed": tb.info(), "block_kib": size // KiB, "blocks": bench.nblocks, "window_s": window_s}
            mnt = os.path.join(tb.root, "fs-mnt")
            os.makedirs(mnt)
            subprocess.run(["mkfs.ext4", "-q", "-F", tb.paths[0]], check=True)
            subprocess.run(["mount", tb.paths[0], mnt], check=True)
            # A drive idle for a throttle slice lets about one 100 ms slice of budget through at once,
            # which a restore of a few tenths of a second would count as speed: each figure is a window
            # of back-to-back restores after a drain (TierCase.measure_restore_window).
            settle = tb.drain()
            try:
                try:
                    fs_case = TierCase(bench, fs_config(os.path.join(mnt, "kv")), settle)
                    measure_windows(fs_case, rounds, window_s)
                    out["fs_1_drive"] = results({"fs": fs_case})["fs"]
                finally:
                    subprocess.run(["umount", mnt], check=True)
                kv_case = TierCase(bench, kv_config(list(tb.paths), backend, drive_bytes, meta_dir=tb.meta_dir),
                                   settle)
                measure_windows(kv_case, rounds, window_s)
                out["kvswarm_8_drives"] = results({"kv": kv_case})["kv"]
            finally:
                settle.close()
    finally:
        bench.close()
    out["restore_speedup"] = out["kvswarm_8_drives"]["restore_gbps"] / out["fs_1_drive"]["restore_gbps"]
    # Efficiency: GB/s per GB/s of read caps of the drives the tier uses (fs: its one drive).
    cap_gbps = out["testbed"]["caps"]["read_mbps"] / 1e3
    out["efficiency_fs"] = out["fs_1_drive"]["restore_gbps"] / cap_gbps
    out["efficiency_kvswarm"] = out["kvswarm_8_drives"]["restore_gbps"] / (8 * cap_gbps)
    console.print(f"  restore fs (1 drive) {out['fs_1_drive']['restore_gbps']:.3f} GB/s, kvswarm (8 drives) "
                  f"{out['kvswarm_8_drives']['restore_gbps']:.3f} GB/s: x{out['restore_speedup']:.2f} (striping: "
                  f"vLLM's fs tier has one root and cannot stripe); per drive cap: fs {out['efficiency_fs']:.2f}, "
                  f"kvswarm {out['efficiency_kvswarm']:.2f}")
    return out


# ---- 4. engine load (EngineLoad: kvswarm.bench.engine_host) -----------------------------------
def engine_load(bench: Bench, cases: dict[str, TierCase], loads: Sequence[tuple[float, float]], rounds: int,
                console) -> dict:
    """Restores of the given tiers with no load and under each GIL duty cycle, interleaved per round
    (the cases' order reversed every other round)."""
    seen: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for hold, idle in [(0.0, 0.0), *loads]:
            name = load_name(hold, idle)
            for t, c in (cases.items() if r % 2 == 0 else list(cases.items())[::-1]):
                drop_caches()
                with EngineLoad(hold, idle):
                    dt, _ = bench.restore(c.run)
                seen.setdefault(name, {}).setdefault(t, []).append(bench.nblocks * bench.bs / dt / 1e9)
    out: dict = {"block_kib": bench.bs // KiB, "rounds": rounds, "loads": {}}
    for name, per in seen.items():
        row = {t: float(np.median(g)) for t, g in per.items()}
        row["rounds"] = per
        row["kv_vs_fs"] = row["kvswarm"] / row["fs"]
        out["loads"][name] = row
        console.print(f"  engine holding the GIL {name} ms: restore fs {row['fs']:.2f}, kvswarm {row['kvswarm']:.2f} "
                      f"GB/s (x{row['kv_vs_fs']:.2f}; medians of {rounds})")
    return out


# ---- output ------------------------------------------------------------------------------------
def summarize(r: dict) -> dict:
    s: dict = {}
    for row in r["one_drive"]:
        k = f"{row['block_kib']}k"
        s[f"raw_gbps_{k}"] = row["raw"]["gbps"]
        s[f"raw_delivered_gbps_{k}"] = row["raw"]["delivered"]["gbps"]
        s[f"raw_landed_gbps_{k}"] = row["raw"]["landed"]["gbps"]
        for t in ("fs", "kvswarm"):
            s[f"{t}_restore_gbps_{k}"] = row[t]["restore_gbps"]
            s[f"{t}_store_gbps_{k}"] = row[t]["store_gbps"]
            s[f"{t}_restore_ratio_vs_raw_{k}"] = row[t]["restore_ratio_vs_raw"]
            s[f"{t}_restore_ratio_vs_raw_delivered_{k}"] = row[t]["restore_ratio_vs_raw_delivered"]
            s[f"{t}_restore_ratio_vs_raw_landed_{k}"] = row[t]["restore_ratio_vs_raw_landed"]
            s[f"{t}_single_request_ratio_vs_raw_{k}"] = row[t]["single_request_ratio_vs_raw"]
            s[f"{t}_single_request_speed_vs_raw_burst_{k}"] = row[t]["single_request_speed_vs_raw_burst"]
        s[f"raw_one_request_burst_ms_{k}"] = row["raw"]["one_request_burst_ms"]
        s[f"restore_ratio_vs_raw_{k}"] = row["kvswarm"]["restore_ratio_vs_raw"]
        s[f"restore_ratio_vs_raw_delivered_{k}"] = row["kvswarm"]["restore_ratio_vs_raw_delivered"]
        s[f"restore_ratio_vs_raw_landed_{k}"] = row["kvswarm"]["restore_ratio_vs_raw_landed"]
        s[f"restore_speedup_vs_fs_1drive_{k}"] = row["kvswarm"]["restore_gbps"] / row["fs"]["restore_gbps"]
    rs = r["restart"]
    if rs:
        s["restart_lookup_speedup_vs_fs"] = rs["fs"]["seconds"] / rs["kvswarm"]["seconds"]
        s["restart_lookup_fs_s"], s["restart_lookup_kvswarm_s"] = rs["fs"]["seconds"], rs["kvswarm"]["seconds"]
        s["restart_device_reads_fs"] = rs["fs"]["device_reads"]
        s["restart_device_reads_kvswarm"] = rs["kvswarm"]["device_reads"]
        if "fresh_process" in rs["kvswarm"]:
            f, k = rs["fs"]["fresh_process"]["seconds"], rs["kvswarm"]["fresh_process"]["seconds"]
            s["restart_lookup_fresh_process_fs_s"], s["restart_lookup_fresh_process_kvswarm_s"] = f, k
            s["restart_lookup_fresh_process_speedup_vs_fs"] = f / k
    e = r["eight_drives"]
    if e:
        s["restore_speedup_vs_fs_8drives"] = e["restore_speedup"]
        s["efficiency_8_drives_kvswarm"], s["efficiency_8_drives_fs"] = e["efficiency_kvswarm"], e["efficiency_fs"]
        s["fs_1drive_restore_gbps_8drive_testbed"] = e["fs_1_drive"]["restore_gbps"]
        s["kvswarm_8drives_restore_gbps"] = e["kvswarm_8_drives"]["restore_gbps"]
    for name, row in _engine_load(r).get("loads", {}).items():
        k = name.replace("/", "of")
        s[f"engine_load_{k}_fs_restore_gbps"], s[f"engine_load_{k}_kvswarm_restore_gbps"] = row["fs"], row["kvswarm"]
        s[f"engine_load_{k}_restore_speedup_vs_fs"] = row["kv_vs_fs"]
    return s


def _engine_load(r: dict) -> dict:
    """Part 4's figures (measured with the first block size's tiers), or {} when it was skipped."""
    return next((row["engine_load"] for row in r["one_drive"] if "engine_load" in row), {})


def report(r: dict, console) -> None:
    from rich.table import Table

    t = Table(title="vLLM offloading tier: fs (vLLM built-in) vs kvswarm, through vLLM's tier interfaces")
    t.caption = ("restores in GB/s; ratios are medians of per-round ratios; raw: the fio-like ceiling; raw landed "
                 "(a reference, not a ceiling; its own tuning): each block's payload read straight into its own "
                 "primary-tier chunk; raw+deliv.: the raw reads, each block then copied into its chunk; 8 loop drives: "
                 "vLLM's fs tier has one root and cannot stripe, eff. = GB/s per GB/s of its drives' caps (fs / kv)")
    for c in ("case", "raw", "raw landed", "raw+deliv.", "fs", "kvswarm", "kv/raw", "fs/raw", "kv/landed",
              "fs/landed", "kv/fs", "eff. fs / kv", "1-req kv/raw", "1-req fs/raw", "store fs / kv"):
        t.add_column(c)
    for row in r["one_drive"]:
        f, k, raw = row["fs"], row["kvswarm"], row["raw"]
        t.add_row(f"1 drive, {row['block_kib']} KiB", f"{raw['gbps']:.2f}", f"{raw['landed']['gbps']:.2f}",
                  f"{raw['delivered']['gbps']:.2f}", f"{f['restore_gbps']:.2f}", f"{k['restore_gbps']:.2f}",
                  f"{k['restore_ratio_vs_raw']:.2f}", f"{f['restore_ratio_vs_raw']:.2f}",
                  f"{k['restore_ratio_vs_raw_landed']:.2f}", f"{f['restore_ratio_vs_raw_landed']:.2f}",
                  f"x{k['restore_gbps'] / f['restore_gbps']:.2f}", "", f"{k['single_request_ratio_vs_raw']:.2f}",
                  f"{f['single_request_ratio_vs_raw']:.2f}", f"{f['store_gbps']:.2f} / {k['store_gbps']:.2f}")
    e = r["eight_drives"]
    if e:
        f, k = e["fs_1_drive"], e["kvswarm_8_drives"]
        t.add_row(f"8 loop drives, {e['block_kib']} KiB", "", "", "", f"{f['restore_gbps']:.3f}",
                  f"{k['restore_gbps']:.3f}", "", "", "", "", f"x{e['restore_speedup']:.2f}",
                  f"{e['efficiency_fs']:.2f} / {e['efficiency_kvswarm']:.2f}", "", "",
                  f"{f['store_gbps']:.3f} / {k['store_gbps']:.3f}")
    console.print(t)
    for row in r["one_drive"]:
        console.print(f"one request ({REQUEST_BLOCKS} blocks of {row['block_kib']} KiB, nothing else in flight): raw "
                      f"io_uring burst of its reads {row['raw']['one_request_burst_ms']:.1f} ms, fs "
                      f"{row['fs']['single_request_ms']:.1f} ms, kvswarm {row['kvswarm']['single_request_ms']:.1f} ms "
                      f"(medians)")
    rs = r["restart"]
    if rs:
        console.print(f"restart, {rs['blocks']} blocks: fs {rs['fs']['seconds'] * 1e3:.0f} ms "
                      f"({rs['fs']['device_reads']} device reads), kvswarm {rs['kvswarm']['seconds'] * 1e3:.0f} ms "
                      f"({rs['kvswarm']['device_reads']} reads): x{r['summary']['restart_lookup_speedup_vs_fs']:.1f}")
        if "restart_lookup_fresh_process_speedup_vs_fs" in r["summary"]:
            sm = r["summary"]
            console.print(f"restart in fresh processes: fs {sm['restart_lookup_fresh_process_fs_s'] * 1e3:.0f} ms, "
                          f"kvswarm {sm['restart_lookup_fresh_process_kvswarm_s'] * 1e3:.0f} ms: "
                          f"x{sm['restart_lookup_fresh_process_speedup_vs_fs']:.1f}")
    if e:
        console.print(f"eight drives: {e['testbed']['emulation']} emulation, caps {e['testbed']['caps']}")
    el = _engine_load(r)
    for name, row in el.get("loads", {}).items():
        console.print(f"engine load {name} (ms holding the GIL / ms idle), {el['block_kib']} KiB: restore fs "
                      f"{row['fs']:.2f}, kvswarm {row['kvswarm']:.2f} GB/s: x{row['kv_vs_fs']:.2f}")
    console.print("kvswarm stores are durable (fdatasync + catalog sync before a store job is reported); "
                  "vLLM's fs tier does not fsync.")


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["one_drive"]
    el = _engine_load(r)
    loads = el.get("loads", {})
    fig, ax = plt.subplots(1, 3 if loads else 2, figsize=(16 if loads else 11, 4))
    x = np.arange(len(rows))
    for j, (name, get) in enumerate((("raw O_DIRECT", lambda w: w["raw"]["gbps"]),
                                     ("raw landed", lambda w: w["raw"]["landed"]["gbps"]),
                                     ("raw + delivery", lambda w: w["raw"]["delivered"]["gbps"]),
                                     ("vLLM fs tier", lambda w: w["fs"]["restore_gbps"]),
                                     ("kvswarm tier", lambda w: w["kvswarm"]["restore_gbps"]))):
        ax[0].bar(x + (j - 2) * 0.16, [get(w) for w in rows], 0.16, label=name)
    ax[0].set_xticks(x, [f"{w['block_kib']} KiB" for w in rows])
    ax[0].set_ylabel("restore GB/s (one drive, same disk)")
    ax[0].legend()
    e = r["eight_drives"]
    if e:
        ax[1].bar(["vLLM fs, 1 drive", "kvswarm, 8 drives"],
                  [e["fs_1_drive"]["restore_gbps"], e["kvswarm_8_drives"]["restore_gbps"]], color=["C2", "C3"])
        ax[1].set_ylabel("restore GB/s (throttled loop drives)")
    if loads:
        x = np.arange(len(loads))
        for j, (t, label) in enumerate((("fs", "vLLM fs tier"), ("kvswarm", "kvswarm tier"))):
            ax[2].bar(x + (j - 0.5) * 0.35, [row[t] for row in loads.values()], 0.35, label=label, color=f"C{j + 2}")
        ax[2].set_xticks(x, [f"{n} ms" if n != "none" else "no load" for n in loads])
        ax[2].set_xlabel("engine thread: ms holding the GIL / ms idle")
        ax[2].set_ylabel(f"restore GB/s, {el['block_kib']} KiB (one drive)")
        ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("vllm", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
