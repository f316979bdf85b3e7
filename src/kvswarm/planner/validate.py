"""Validate the simulator against the real disk: fit the drive model on a few points, predict the rest.

1. Host cost: the store's CPU per op (submit, header check), timed on a memory-backed drive,
   and per byte (the xxh3 checksum it runs on every payload).  A store on fast drives is
   CPU-bound, so the simulated store pays both on one serial CPU (one GIL).
2. Fit: the drive model (fixed latency, bandwidth, IOPS ceiling) is fitted on the real,
   unthrottled disk (a scratch file under ``--dir``, O_DIRECT) to closed-loop reads at the fit
   points only: two request sizes or more by one queue depth or more (``--fit-kib``,
   ``--fit-depths``; default 4 and 256 KiB at depths 2 and 8, :mod:`kvswarm.planner.disk`).
3. Predictions, each measured on the same disk and never fitted on:
   * raw reads at the other request sizes and queue depths (closed loop, io_uring): the drive
     model alone;
   * the store's own batched random gets (a KVStore on one directory of the same disk, its
     own engine and depth) at two object sizes: the drive model plus the host cost.
   ``summary.max_error`` is the largest relative error over these predictions (raw
   throughput; the store's throughput and mean I/O time per batch); the fit points' own
   reproduction is reported apart (``fit``) and counts in no error figure.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvswarm.format import HEADER_SIZE
from kvswarm.planner.disk import ScratchFile, closed_loop, fit_drive, simulate_closed_loop
from kvswarm.planner.hostcost import HostCost, engine_of, measure_host_cost
from kvswarm.planner.report import console as make_console
from kvswarm.planner.report import new_figure, print_error, write_outputs
from kvswarm.sim.devices import DriveSpec
from kvswarm.sim.replay import Request, measure, replay
from kvswarm.sim.system import SimStore, SystemModel

HELP = "simulator vs the real disk: fit the drive model at two request sizes, predict other sizes and depths"
KiB, MiB = 1 << 10, 1 << 20
TARGET_METRICS = ("throughput_Bps", "mean_io_time_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvswarm.planner.args import ints

    p.add_argument("--quick", action="store_true", help="fewer and shorter runs (a minute or two in all)")
    p.add_argument("--fit-kib", type=ints, default=[4, 256], help="request sizes the drive model is fitted at "
                   "(KiB, two or more; default 4,256)")
    p.add_argument("--fit-depths", "--fit-depth", type=ints, default=[2, 8], help="queue depths the drive model "
                   "is fitted at (default 2,8)")
    p.add_argument("--sizes", type=ints, help="raw request sizes to predict, KiB (default 4,16,64,256,1024; "
                   "quick 4,64,1024)")
    p.add_argument("--depths", type=ints, help="raw queue depths to predict (default 1,4,16; quick 1,16)")
    p.add_argument("--object-kib", type=ints, default=[256, 16], help="store object sizes to predict "
                   "(extent on disk, KiB; default 256,16)")
    p.add_argument("--batch", type=int, default=16, help="objects per store get batch (default %(default)s)")
    p.add_argument("--batches", type=int, help="timed store batches per object size (default 48, quick 16)")
    p.add_argument("--seconds", type=float, help="seconds per raw run (default 1, quick 0.4)")
    p.add_argument("--rounds", type=int, help="rounds per measurement, the median kept (default 3, quick 1; "
                   "raw reads at least 5, interleaved over all points)")
    p.add_argument("--backend", choices=["threads", "uring", "native"], default="threads",
                   help="store read path: a Python engine (threads, uring) or the native batch path (native)")
    p.add_argument("--placement", default="round_robin", help="store placement strategy (default %(default)s)")
    p.add_argument("--file-mib", type=int, default=1024, help="scratch file the raw reads range over "
                   "(default %(default)s)")
    p.add_argument("--dir", help="a directory on the disk under test (default /var/tmp)")
    p.add_argument("--seed", type=int, default=0)


@dataclass
class BatchedGets:
    """A data set and a stream of batched random gets over it; the first ``warmup`` batches are run
    but not timed (they warm the engine and the buffer pool)."""

    items: list[tuple[bytes, int]]  # (key, payload bytes), in write order
    stream: list[Request]
    warmup: int = 2


def make_batched_gets(prefix: str, extent_kib: int, batch: int, batches: int, rng: random.Random,
                      span: int) -> BatchedGets:
    """``batches`` timed batches of ``batch`` random keys over a data set of ``span`` bytes (the raw
    reads' scratch file: the same footprint on the disk, and so the same share of any cache under
    it, as the runs the drive model was fitted on) or 8 batches."""
    payload = extent_kib * KiB - HEADER_SIZE
    n_obj = max(8 * batch, span // (extent_kib * KiB))
    keys = [f"{prefix}/{i}".encode() for i in range(n_obj)]
    stream = [Request("get", tuple(rng.sample(keys, batch))) for _ in range(2 + batches)]
    return BatchedGets([(key, payload) for key in keys], stream)


def run_store(directory: str, wl: BatchedGets, backend: str, placement: str, rounds: int) -> tuple[dict, int]:
    """A KVStore on one directory of the disk under test writes the data set, warms up, then times
    the stream ``rounds`` times; the median round (by throughput) is kept."""
    from kvswarm.store import KVStore, StoreConfig

    root = tempfile.mkdtemp(prefix="kvswarm-validate-store-", dir=directory)
    total = sum(n for _, n in wl.items)
    try:
        os.makedirs(os.path.join(root, "d0"))
        store = KVStore(StoreConfig(drives=[os.path.join(root, "d0")], meta_dir=os.path.join(root, "meta"),
                                    capacity_per_drive=(2 * total // MiB + 64) * MiB, backend=engine_of(backend),
                                    placement=placement, buffer_pool_bytes=64 * MiB,
                                    native_io=backend == "native"))
        try:
            blob = os.urandom(max(n for _, n in wl.items))
            for i in range(0, len(wl.items), 64):
                chunk = wl.items[i:i + 64]
                if not all(store.put_many([(k, memoryview(blob)[:n]) for k, n in chunk])):
                    raise RuntimeError("validation data set could not be written")
            store.flush()
            _drop_caches()
            measure(store, wl.stream[:wl.warmup])
            ms = sorted((measure(store, wl.stream[wl.warmup:]) for _ in range(rounds)),
                        key=lambda m: m["throughput_Bps"])
            m = ms[(len(ms) - 1) // 2] | {"rounds": rounds, "round_throughputs_Bps": [x["throughput_Bps"] for x in ms]}
            return m, store.drive_depth
        finally:
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass  # not root: reads are O_DIRECT anyway


def simulate_store(drive: DriveSpec, cost: HostCost, depth: int, backend: str, placement: str,
                   wl: BatchedGets) -> tuple[dict, float]:
    """The simulator's answer to :func:`run_store`, and its CPU utilisation over the timed stream."""
    total = sum(n for _, n in wl.items)
    model = SystemModel([drive], capacity_per_drive=(2 * total // MiB + 64) * MiB, engine_depth=depth,
                        chunked=backend == "threads", cpu_per_op=cost.cpu_per_op, cpu_per_byte=cost.cpu_per_byte,
                        placement=placement)
    sim = SimStore(model)
    sim.preload(wl.items)
    replay(sim, wl.stream[:wl.warmup])
    busy0, t0 = sim.cpu_busy, sim.env.now
    out = replay(sim, wl.stream[wl.warmup:])
    return out, (sim.cpu_busy - busy0) / max(sim.env.now - t0, 1e-12)


def _median_run(runs: list) -> object:
    return sorted(runs, key=lambda r: r.throughput_Bps)[(len(runs) - 1) // 2]


def _spread(runs: list) -> float:
    """(largest - smallest) / median throughput over a point's rounds: how much the disk moved under it."""
    t = sorted(r.throughput_Bps for r in runs)
    return (t[-1] - t[0]) / t[(len(t) - 1) // 2]


def _err(sim: float, meas: float) -> float:
    return abs(sim - meas) / meas if meas and not math.isnan(meas) else float("nan")


def run(args: argparse.Namespace) -> int:
    console = make_console()
    try:
        return _run(args, console)
    except (ValueError, OSError, RuntimeError) as e:
        print_error("plan validate", e)
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    from kvswarm.placement import make_placement

    quick = args.quick
    sizes = args.sizes or ([4, 64, 1024] if quick else [4, 16, 64, 256, 1024])
    depths = args.depths or ([1, 16] if quick else [1, 4, 16])
    seconds = args.seconds if args.seconds is not None else 0.4 if quick else 1.0
    rounds = args.rounds or (1 if quick else 3)
    raw_rounds = max(5, rounds)  # raw runs are short: at least 5 rounds, so one stall never becomes the median
    batches = args.batches or (16 if quick else 48)
    fit_points = [(kib, depth) for kib in args.fit_kib for depth in args.fit_depths]
    if min(sizes + args.fit_kib + args.object_kib) < 4 or min(depths + args.fit_depths) < 1 \
            or len(set(args.fit_kib)) < 2 or args.batch < 1 or batches < 2 or rounds < 1 or seconds <= 0 \
            or args.file_mib < 64:
        raise ValueError("sizes and objects >= 4 KiB, two fit sizes or more, depths >= 1, batch >= 1, "
                         "batches >= 2, rounds >= 1, seconds > 0, file >= 64 MiB")
    make_placement(args.placement)
    directory = args.dir or "/var/tmp"
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    load0 = os.getloadavg()
    with console.status("timing the store's host-side cost per op and per byte"):
        cost = measure_host_cost(args.backend, quick)
    with console.status(f"writing a {args.file_mib} MiB scratch file in {directory}"):
        disk = ScratchFile(directory, args.file_mib * MiB)
    try:
        _drop_caches()
        # Every raw point, fitted or predicted, is run once per round, the rounds interleaved: a stall
        # of the shared disk then lands on one round of many points, and each point's median drops it.
        pred_points = [(kib, depth) for kib in sizes for depth in depths if (kib, depth) not in fit_points]
        runs: dict[tuple[int, int], list] = {pt: [] for pt in fit_points + pred_points}
        for r in range(raw_rounds):
            for kib, depth in runs:
                with console.status(f"raw reads, round {r + 1} of {raw_rounds}: {kib} KiB at queue depth {depth}"):
                    runs[(kib, depth)].append(closed_loop(disk, kib * KiB, depth, seconds, rng))
        fitted = [_median_run(runs[pt]) for pt in fit_points]
        model = fit_drive(fitted)
        fit_rows = []
        for (kib, depth), m in zip(fit_points, fitted):
            s = simulate_closed_loop(model, kib * KiB, depth)
            fit_rows.append({"size_kib": kib, "depth": depth, "measured_throughput_Bps": m.throughput_Bps,
                             "simulated_throughput_Bps": s.throughput_Bps, "spread": _spread(runs[(kib, depth)]),
                             "reproduction_error": _err(s.throughput_Bps, m.throughput_Bps)})
        fit = {"points": fit_rows, "rounds": raw_rounds, "read_bw_MBps": model.read_bw / 1e6,
               "read_iops": model.read_iops, "read_latency_us": model.read_latency * 1e6,
               "reproduction_error": max(r["reproduction_error"] for r in fit_rows),
               "note": "fitted here: counts in no error figure"}
        raw = []
        for kib, depth in pred_points:  # a fit point is not a prediction
            m = _median_run(runs[(kib, depth)])
            s = simulate_closed_loop(model, kib * KiB, depth)
            raw.append({"size_kib": kib, "depth": depth, "measured_throughput_Bps": m.throughput_Bps,
                        "simulated_throughput_Bps": s.throughput_Bps,
                        "measured_latency_us": m.mean_latency_s * 1e6,
                        "simulated_latency_us": s.mean_latency_s * 1e6, "spread": _spread(runs[(kib, depth)]),
                        "error": {"throughput_Bps": _err(s.throughput_Bps, m.throughput_Bps)}})
    finally:
        disk.close()
    stores = []
    for kib in args.object_kib:
        wl = make_batched_gets(f"val-{kib}", kib, args.batch, batches, rng, args.file_mib * MiB)
        with console.status(f"the store: batches of {args.batch} x {kib} KiB objects"):
            m, depth = run_store(directory, wl, args.backend, args.placement, rounds)
        s, cpu_util = simulate_store(model, cost, depth, args.backend, args.placement, wl)
        stores.append({"object_kib": kib, "batch": args.batch, "engine_depth": depth, "measured": m, "simulated": s,
                       "simulated_cpu_util": cpu_util,
                       "error": {k: _err(s[k], m[k]) for k in TARGET_METRICS}})
    _print(console, cost, fit, raw, stores, args)
    raw_errs = [r["error"]["throughput_Bps"] for r in raw]
    store_errs = [v for r in stores for v in r["error"].values()]
    every = raw_errs + store_errs
    summary = {"max_error": max(every), "mean_error": float(np.mean(every)),
               "max_error_raw": max(raw_errs, default=0.0),
               "max_error_store": max(store_errs, default=0.0), "predictions": len(every),
               "fit_reproduction_error": fit["reproduction_error"], "fit_points": len(fit_points),
               "max_spread_raw": max(r["spread"] for r in fit_rows + raw),
               "cpu_per_op_us": cost.cpu_per_op * 1e6, "cpu_per_byte_ns": cost.cpu_per_byte * 1e9,
               "drive_read_bw_MBps": fit["read_bw_MBps"], "drive_read_iops": fit["read_iops"],
               "drive_read_latency_us": fit["read_latency_us"],
               "seconds": time.perf_counter() - t_start}
    for r in raw:
        summary[f"error_raw_{r['size_kib']}k_qd{r['depth']}"] = r["error"]["throughput_Bps"]
    for r in stores:
        for k, v in r["error"].items():
            summary[f"error_store_{r['object_kib']}k_{k}"] = v
        summary[f"store_{r['object_kib']}k_simulated_cpu_util"] = r["simulated_cpu_util"]
    console.print(f"largest error over {len(every)} predictions (none fitted on): {summary['max_error']:.1%} "
                  f"(raw {summary['max_error_raw']:.1%}, store {summary['max_error_store']:.1%}); the "
                  f"{len(fit_points)} fit points reproduce within {fit['reproduction_error']:.1%}")
    settings = {"fit_kib": args.fit_kib, "fit_depths": args.fit_depths, "sizes_kib": sizes, "depths": depths,
                "object_kib": args.object_kib, "batch": args.batch, "batches": batches, "seconds": seconds,
                "rounds": rounds, "raw_rounds": raw_rounds, "backend": args.backend, "placement": args.placement,
                "file_mib": args.file_mib, "dir": directory, "quick": quick, "load_avg_start": load0, "load_avg_end": os.getloadavg(),
                "cpus": os.cpu_count(), "disk": "the real disk under --dir (unthrottled, O_DIRECT; shared with "
                                                "whatever else runs on the machine)"}
    doc = {"summary": summary, "settings": settings, "fit": fit, "host_cost": {"cpu_per_op_us": cost.cpu_per_op * 1e6,
           "cpu_per_byte_ns": cost.cpu_per_byte * 1e9}, "raw": raw, "store": stores}
    plot = str(Path(args.json).with_suffix("")) + "_validate.png" if args.json else None
    write_outputs(console, doc, args.json, plot, lambda path: _plot(raw, stores, path))
    return 0


def _print(console: Console, cost: HostCost, fit: dict, raw: list[dict], stores: list[dict],
           args: argparse.Namespace) -> None:
    console.print(f"drive model fitted at {len(fit['points'])} points: {fit['read_bw_MBps']:.0f} MB/s and "
                  f"{fit['read_iops']:.0f} IOPS serial stage, {fit['read_latency_us']:.0f} us fixed latency; "
                  f"host {cost.cpu_per_op * 1e6:.1f} us/op + {cost.cpu_per_byte * 1e9:.3f} ns/B")
    t = Table(title="Predicted (never fitted on) vs measured on the same disk")
    for col in ("case", "measured", "simulated", "error", "note"):
        t.add_column(col, justify="left" if col in ("case", "note") else "right")
    for r in fit["points"]:
        t.add_row(f"fit: raw {r['size_kib']} KiB qd{r['depth']}", f"{r['measured_throughput_Bps'] / 1e6:.0f} MB/s",
                  f"{r['simulated_throughput_Bps'] / 1e6:.0f} MB/s", f"({r['reproduction_error']:.1%})", "fitted")
    for r in raw:
        t.add_row(f"raw {r['size_kib']} KiB qd{r['depth']}", f"{r['measured_throughput_Bps'] / 1e6:.0f} MB/s",
                  f"{r['simulated_throughput_Bps'] / 1e6:.0f} MB/s", f"{r['error']['throughput_Bps']:.1%}", "")
    for r in stores:
        m, s = r["measured"], r["simulated"]
        t.add_row(f"store {r['batch']} x {r['object_kib']} KiB ({args.backend}, depth {r['engine_depth']})",
                  f"{m['throughput_Bps'] / 1e6:.0f} MB/s", f"{s['throughput_Bps'] / 1e6:.0f} MB/s",
                  f"{r['error']['throughput_Bps']:.1%}", f"simulated CPU busy {r['simulated_cpu_util']:.0%}")
        t.add_row("  mean I/O time per batch", f"{m['mean_io_time_s'] * 1e3:.2f} ms",
                  f"{s['mean_io_time_s'] * 1e3:.2f} ms", f"{r['error']['mean_io_time_s']:.1%}", "")
    console.print(t)


def _plot(raw: list[dict], stores: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = new_figure(path, ncols=2, figsize=(11, 4))
    names = [f"{r['size_kib']}K/qd{r['depth']}" for r in raw]
    x = range(len(raw))
    ax = axes[0]
    ax.bar([i - 0.2 for i in x], [r["measured_throughput_Bps"] / 1e6 for r in raw], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["simulated_throughput_Bps"] / 1e6 for r in raw], 0.4, label="predicted")
    ax.set_xticks(list(x), names, rotation=45, fontsize=7)
    ax.set_ylabel("raw read MB/s")
    ax.legend(fontsize=8)
    x = range(len(stores))
    ax = axes[1]
    ax.bar([i - 0.2 for i in x], [r["measured"]["throughput_Bps"] / 1e6 for r in stores], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["simulated"]["throughput_Bps"] / 1e6 for r in stores], 0.4, label="predicted")
    ax.set_xticks(list(x), [f"store {r['object_kib']}K" for r in stores])
    ax.set_ylabel("store get MB/s")
    ax.legend(fontsize=8)
    fig.suptitle("kvswarm simulator: drive model fitted at two sizes, predictions at other sizes and depths",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
