"""Validate the simulator against measurement: calibrate on one emulated drive, predict N drives.

1. Host cost: the store's per-op CPU (submit, header check) is timed on a memory-backed
   drive, and its per-byte CPU is the xxh3 checksum it runs on every payload.
2. Drive model: one emulated drive (kvswarm.testbed: a loop device capped by the blkio
   throttle, or the user-space model where the kernel cannot) is measured through the real
   KVStore: 1 MiB reads (bandwidth), 4 KiB reads in batches (IOPS), single 4 KiB reads
   (latency).  Bandwidth and IOPS are fitted so the simulator, whose paced drive follows
   the throttle's slice accounting, reproduces those runs.
   ``--calibration BENCH_JSON`` takes bandwidth and IOPS from `kvswarm bench io --json`
   results instead (run on the same kind of drive).
3. Validation: for each configuration (by default 1, 2 and 4 drives with 256 KiB objects,
   and the largest with 16 KiB objects, IOPS-bound), a fresh testbed is built, the store
   writes a data set, and a stream of random batched gets is timed.  The simulator, with
   the calibrated model, the same placement strategy and the same request stream,
   predicts it.  Reported per metric: throughput, mean I/O time per batch, mean per-op
   latency; ``summary.max_error`` is the largest relative error on the two target
   metrics (throughput, mean I/O time), ``summary.max_error_all`` includes op latency.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvswarm.format import HEADER_SIZE, payload_checksum
from kvswarm.planner.report import console as make_console
from kvswarm.planner.report import new_figure, write_outputs
from kvswarm.sim.devices import DriveSpec, LinkModel
from kvswarm.sim.replay import Request, measure, replay
from kvswarm.sim.system import SimStore, SystemModel

HELP = "simulator vs a measured run on emulated drives: prediction error per metric"
KiB, MiB = 1 << 10, 1 << 20
TARGET_METRICS = ("throughput_Bps", "mean_io_time_s")
METRICS = (*TARGET_METRICS, "mean_op_latency_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvswarm.planner.cli import _ints

    p.add_argument("--quick", action="store_true", help="short runs (about a minute in all)")
    p.add_argument("--drives", type=_ints, default=[1, 2, 4], help="drive counts to validate (default 1,2,4)")
    p.add_argument("--object-kib", type=int, default=256, help="object size for the drive-count configurations "
                   "(extent on disk, KiB; default %(default)s)")
    p.add_argument("--small-kib", type=int, default=16, help="object size of the extra IOPS-bound configuration "
                   "on the most drives (0 = none; default %(default)s)")
    p.add_argument("--batch-per-drive", type=int, default=16, help="objects per get batch per drive "
                   "(default %(default)s)")
    p.add_argument("--batches", type=int, help="timed batches per configuration (default 24, quick 12), and "
                   "at least --seconds of them at the caps")
    p.add_argument("--seconds", type=float, help="least timed seconds per run at the caps (default 2, quick 1)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration; the median is kept "
                   "(default %(default)s)")
    p.add_argument("--cap-mbps", type=float, default=100.0, help="per-drive MB/s cap (default %(default)s)")
    p.add_argument("--cap-iops", type=float, default=2000.0, help="per-drive IOPS cap (default %(default)s)")
    p.add_argument("--emulation", choices=["auto", "kernel", "user-space"], default="auto",
                   help="testbed emulation (default auto: kernel where possible)")
    p.add_argument("--backend", choices=["threads", "uring"], default="threads", help="store I/O backend")
    p.add_argument("--placement", default="round_robin", help="store placement strategy (default %(default)s)")
    p.add_argument("--calibration", metavar="BENCH_JSON", help="take per-drive bandwidth and IOPS from "
                   "`kvswarm bench io --json` results instead of measuring them")
    p.add_argument("--dir", help="where the testbed files go (default: the temp dir)")
    p.add_argument("--seed", type=int, default=0)


@dataclass
class HostCost:
    cpu_per_op: float
    cpu_per_byte: float


def measure_host_cost(backend: str, quick: bool) -> HostCost:
    """Per-byte: the store's payload checksum; per-op: a get batch on a memory-backed drive."""
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
                                    capacity_per_drive=64 * MiB, backend=backend, buffer_pool_bytes=32 * MiB))
        try:
            keys = [b"host/%d" % i for i in range(256)]
            store.put_many([(k, bytes(4 * KiB - HEADER_SIZE)) for k in keys])
            rng = random.Random(1)
            store.get_many(keys[:64]).release()
            times = []
            for _ in range(20 if quick else 80):
                batch = rng.sample(keys, 64)
                t0 = time.perf_counter()
                store.get_many(batch).release()
                times.append(time.perf_counter() - t0)
            per_op = float(np.median(times)) / 64 - per_byte * (4 * KiB - HEADER_SIZE)
        finally:
            store.close()
    finally:
        drive_log.setLevel(level)
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return HostCost(max(0.0, per_op), per_byte)


def _disk_link() -> LinkModel:
    from kvswarm.testbed import DISK_IOPS, DISK_MBPS

    # All emulated drives share the one physical disk (testbed's measured ceiling).
    return LinkModel("disk", DISK_MBPS * 1e6, iops=DISK_IOPS)


def _system(drive: DriveSpec, n: int, cost: HostCost, depth: int, capacity: int, placement: str,
            backend: str) -> SystemModel:
    return SystemModel([drive] * n, capacity_per_drive=capacity, host_link=_disk_link(), engine_depth=depth,
                       chunked=backend == "threads", cpu_per_op=cost.cpu_per_op, cpu_per_byte=cost.cpu_per_byte,
                       placement=placement)


def _engine_depth(store) -> int:
    return getattr(store.engine, "workers_per_drive", None) or getattr(getattr(store.engine, "inner", None),
                                                                        "workers_per_drive", None) \
        or store.config.queue_depth


@dataclass
class Workload:
    """A data set and a stream of batched random gets over it; the first ``warmup`` batches are run
    but not timed (they use up the allowance of the throttle's first slice, and warm the engine)."""

    items: list[tuple[bytes, int]]  # (key, payload bytes), in write order
    stream: list[Request]
    warmup: int = 0


def make_workload(prefix: str, n_drives: int, extent_kib: int, per_drive: int, batch_per_drive: int,
                  batches: int, rng: random.Random, single: bool = False, caps=None,
                  min_seconds: float = 0.0) -> Workload:
    """At least ``batches`` timed batches of ``batch_per_drive`` x ``n_drives`` random keys, and at least
    ``min_seconds`` of them at the drives' caps (the throttle grants its budget in 100 ms windows: a
    run of a few windows measures their quantisation), after 0.25 s of warm-up batches."""
    payload = extent_kib * KiB - HEADER_SIZE
    n_obj = max(per_drive * n_drives, batch_per_drive * n_drives * 2)
    keys = [f"{prefix}/{i}".encode() for i in range(n_obj)]
    k = 1 if single else batch_per_drive * n_drives
    warm = 0
    if caps is not None and not single:
        per_drive = k / n_drives
        batch_s = max(per_drive * extent_kib * KiB / (caps.read_mbps * 1e6), per_drive / caps.read_iops)
        warm = max(2, math.ceil(0.25 / batch_s))
        batches = max(batches, math.ceil(min_seconds / batch_s))
    stream = [Request("get", tuple(rng.sample(keys, k))) for _ in range(warm + batches)]
    return Workload([(key, payload) for key in keys], stream, warm)


def run_measured(tb, wl: Workload, backend: str, placement: str, rounds: int = 1) -> tuple[dict, int]:
    """Write the data set, warm up, then time the stream ``rounds`` times; the median round (by
    throughput) is kept, so a burst of I/O from elsewhere on the shared disk does not decide it."""
    store = tb.open_store(backend=backend, placement=placement, buffer_pool_bytes=64 * MiB)
    try:
        blob = os.urandom(max(n for _, n in wl.items))
        for i in range(0, len(wl.items), 64):
            chunk = wl.items[i:i + 64]
            if not all(store.put_many([(k, memoryview(blob)[:n]) for k, n in chunk])):
                raise RuntimeError("validation data set could not be written")
        store.flush()
        if wl.warmup:
            measure(store, wl.stream[:wl.warmup])
        ms = sorted((measure(store, wl.stream[wl.warmup:]) for _ in range(rounds)), key=lambda m: m["throughput_Bps"])
        m = ms[(len(ms) - 1) // 2] | {"rounds": rounds,
                                       "round_throughputs_Bps": [x["throughput_Bps"] for x in ms]}
        return m, _engine_depth(store)
    finally:
        store.close()


def simulate(model: SystemModel, wl: Workload) -> dict:
    sim = SimStore(model)
    sim.preload(wl.items)
    if wl.warmup:
        replay(sim, wl.stream[:wl.warmup])
    return replay(sim, wl.stream[wl.warmup:])


def rates_from_bench(doc: dict) -> tuple[float, float, int]:
    """Per-drive read bytes/s and IOPS from `kvswarm bench io --json` results (its raw O_DIRECT
    ceiling at 1 MiB and 4 KiB, over the drives it ran on: use ``--drives 1`` and the same caps)."""
    try:
        nd = int(doc.get("drives", {}).get("drives", 1)) or 1
        s = doc["summary"]
        return s["raw_gbps_1m"] * 1e9 / nd, s["raw_iops_4k"] / nd, nd
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not `kvswarm bench io --json` results (need summary.raw_gbps_1m and raw_iops_4k): {e}") \
            from None


def _seconds(args: argparse.Namespace) -> float:
    return args.seconds if args.seconds is not None else 1.0 if args.quick else 2.0


def _fit(lo: float, hi: float, target: float, predict, iters: int = 16) -> float:
    """Geometric bisection for x in [lo, hi] with predict(x) == target, predict increasing in x."""
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if predict(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def calibrate(tb_factory, caps, cost: HostCost, args: argparse.Namespace, rng: random.Random,
              console: Console) -> tuple[DriveSpec, dict]:
    """Fit a paced drive model to measured runs on one emulated drive (or to bench io results).

    Rates come from back-to-back batches (1 MiB: bytes/s; 4 KiB: ops/s), each fitted by
    bisection on the simulator's prediction of the measured run; the throttle's slice is
    the kernel's constant for the loop device's (rotational) queue; latency comes from
    single 4 KiB reads.
    """
    quick = args.quick
    n = 6 if quick else 12
    span = _seconds(args)
    runs = {
        "bandwidth": make_workload("cal-bw", 1, 1024, 32, 8, n, rng, caps=caps, min_seconds=span),
        "iops": make_workload("cal-iops", 1, 4, 256, 64, n, rng, caps=caps, min_seconds=span),
        "latency": make_workload("cal-lat", 1, 4, 64, 1, 30 if quick else 80, rng, single=True),
    }
    measured = {}
    with tb_factory(1) as tb:
        for name, wl in runs.items():
            measured[name], depth = run_measured(tb, wl, args.backend, args.placement, args.rounds)
    cap = tb.drive_bytes
    lat = measured["latency"]["median_io_time_s"] - cost.cpu_per_op - cost.cpu_per_byte * (4 * KiB - HEADER_SIZE) \
        - 4 * KiB / _disk_link().bandwidth
    model = DriveSpec("emulated", caps.read_mbps * 1e6, caps.write_mbps * 1e6, caps.read_iops, caps.write_iops,
                       max(lat, 1e-6), 0.0, queue_depth=128, paced=True)

    def predict(field: str, run: str):
        return lambda x: simulate(_system(replace(model, **{field: x}), 1, cost, depth, cap, args.placement,
                                          args.backend), runs[run])["throughput_Bps"]

    source = "measured through the store on one emulated drive"
    if args.calibration:
        bw, iops, nd = rates_from_bench(json.loads(Path(args.calibration).read_text()))
        model = replace(model, read_bw=bw, read_iops=iops)
        source = f"rates from {args.calibration} ({nd} drive(s)); latency measured"
    else:
        t = measured["bandwidth"]["throughput_Bps"]
        model = replace(model, read_bw=_fit(t / 4, t * 4, t, predict("read_bw", "bandwidth")))
        t = measured["iops"]["throughput_Bps"]
        model = replace(model, read_iops=_fit(caps.read_iops / 8, caps.read_iops * 8, t, predict("read_iops", "iops")))
    info = {"source": source, "read_bw_MBps": model.read_bw / 1e6, "read_iops": model.read_iops,
            "read_latency_us": model.read_latency * 1e6, "slice_ms": model.slice_s * 1e3, "engine_depth": depth,
            "cpu_per_op_us": cost.cpu_per_op * 1e6, "cpu_per_byte_ns": cost.cpu_per_byte * 1e9,
            "measured": measured}
    return model, info | {"_depth": depth, "_capacity": cap}


def run(args: argparse.Namespace) -> int:
    console = make_console()
    try:
        return _run(args, console)
    except (ValueError, OSError, RuntimeError) as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    from kvswarm.io.throttle import DriveCaps
    from kvswarm.placement import make_placement
    from kvswarm.testbed import Testbed

    if not args.drives or min(args.drives) < 1:
        raise ValueError("--drives needs counts >= 1")
    if args.cap_mbps <= 0 or args.cap_iops <= 0 or args.object_kib < 4 or args.small_kib < 0 \
            or args.batch_per_drive < 1 or (args.batches is not None and args.batches < 2) or args.rounds < 1 \
            or (args.seconds is not None and args.seconds < 0):
        raise ValueError("caps must be positive, object sizes >= 4 KiB, batches >= 2, rounds >= 1, seconds >= 0")
    make_placement(args.placement)
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    caps = DriveCaps(read_mbps=args.cap_mbps, write_mbps=args.cap_mbps, read_iops=args.cap_iops,
                     write_iops=args.cap_iops)
    batches = args.batches or (12 if args.quick else 24)
    largest = max(args.drives)
    per_drive = 48
    drive_bytes = max(64 * MiB, (per_drive * 2 * max(args.object_kib, 1024) * KiB * 2) // MiB * MiB)

    def testbed(n: int) -> Testbed:
        return Testbed(n, drive_bytes=drive_bytes, caps=caps, mode=args.emulation, root=args.dir)

    with console.status("timing the store's host-side cost per op and per byte"):
        cost = measure_host_cost(args.backend, args.quick)
    with console.status("calibrating the drive model on one emulated drive"):
        model, cal = calibrate(testbed, caps, cost, args, rng, console)
    depth, capacity = cal.pop("_depth"), cal.pop("_capacity")
    configs = [(n, args.object_kib) for n in sorted(set(args.drives))]
    if args.small_kib:
        configs.append((largest, args.small_kib))
    results, emulation = [], None
    for n, kib in configs:
        wl = make_workload(f"val-{n}-{kib}", n, kib, per_drive, args.batch_per_drive, batches, rng, caps=caps,
                           min_seconds=_seconds(args))
        with console.status(f"measuring {n} drive(s), {kib} KiB objects"):
            with testbed(n) as tb:
                emulation = emulation or tb.describe()
                m, _ = run_measured(tb, wl, args.backend, args.placement, args.rounds)
        s = simulate(_system(model, n, cost, depth, capacity, args.placement, args.backend), wl)
        errs = {k: abs(s[k] - m[k]) / m[k] for k in METRICS if m[k] and not math.isnan(m[k])}
        results.append({"name": f"{n} drive(s), {kib} KiB objects, {args.batch_per_drive * n} per batch",
                        "drives": n, "object_kib": kib, "measured": m, "simulated": s, "error": errs})
    t = Table(title="Simulator vs measured (same request stream, same placement strategy)")
    for col in ("configuration", "metric", "measured", "simulated", "error"):
        t.add_column(col, justify="left" if col in ("configuration", "metric") else "right")
    fmt = {"throughput_Bps": lambda v: f"{v / 1e6:.1f} MB/s", "mean_io_time_s": lambda v: f"{v * 1e3:.2f} ms",
           "mean_op_latency_s": lambda v: f"{v * 1e3:.2f} ms"}
    for r in results:
        for k in METRICS:
            if k in r["error"]:
                t.add_row(r["name"] if k == METRICS[0] else "", k, fmt[k](r["measured"][k]), fmt[k](r["simulated"][k]),
                          f"{r['error'][k]:.1%}")
    console.print(f"emulation: {emulation}")
    console.print(f"drive model ({cal['source']}): {cal['read_bw_MBps']:.1f} MB/s, {cal['read_iops']:.0f} IOPS, "
                  f"{cal['read_latency_us']:.0f} us latency, throttle slice {cal['slice_ms']:.0f} ms; "
                  f"host {cal['cpu_per_op_us']:.1f} us/op + "
                  f"{cal['cpu_per_byte_ns']:.3f} ns/B; engine depth {depth} per drive")
    console.print(t)
    target = [r["error"][k] for r in results for k in TARGET_METRICS if k in r["error"]]
    every = [v for r in results for v in r["error"].values()]
    summary = {"max_error": max(target), "max_error_all": max(every), "mean_error": sum(target) / len(target),
               "configurations": len(results), "seconds": time.perf_counter() - t_start}
    for r in results:
        for k, v in r["error"].items():
            summary[f"error_{r['drives']}d_{r['object_kib']}k_{k}"] = v
    verdict = "within" if summary["max_error"] <= 0.15 else "OUTSIDE"
    console.print(f"largest error on throughput / mean I/O time: {summary['max_error']:.1%} ({verdict} the 15% "
                  f"target); including per-op latency: {summary['max_error_all']:.1%}")
    doc = {"summary": summary, "emulation": emulation, "calibration": cal, "configs": results,
           "caps": {"read_mbps": args.cap_mbps, "read_iops": args.cap_iops}, "backend": args.backend,
           "placement": args.placement}
    plot = str(Path(args.json).with_suffix("")) + "_validate.png" if args.json else None
    write_outputs(console, doc, args.json, plot, lambda path: _plot(results, path))
    return 0


def _plot(results: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = new_figure(path, ncols=2, figsize=(10, 4))
    names = [f"{r['drives']}d/{r['object_kib']}K" for r in results]
    x = range(len(results))
    for ax, key, scale, unit in ((axes[0], "throughput_Bps", 1e6, "MB/s"), (axes[1], "mean_io_time_s", 1e-3, "ms")):
        ax.bar([i - 0.2 for i in x], [r["measured"][key] / scale for r in results], 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [r["simulated"][key] / scale for r in results], 0.4, label="simulated")
        ax.set_xticks(list(x), names)
        ax.set_ylabel(f"{key} ({unit})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("kvswarm simulator vs measured store on emulated drives", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
