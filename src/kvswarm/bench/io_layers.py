"""`kvswarm bench io-layers`: where the store's reads lose to the raw ceiling, one layer at a time.

For each object size the store writes a data set (as ``bench io`` does); then rounds alternate, on
the very extents the store wrote, between:

* ``raw``: one io_uring as deep as the store's rings together (every drive's queue depth), reading
  into ``depth`` buffers it reuses (``bench io``'s raw io_uring);
* ``raw_span``: the same, each read into its own buffer across as many bytes as the store's reads
  queued in its read shape (a store delivers every object into memory of its own);
* ``ring``: the native ring the store reads through (``kvswarm.io.native.NativeIO``), in the store's
  read shape, no catalog and no checks;
* ``ring_verified``: the same ring checking every payload against the catalog's checksum;
* ``store``: ``KVStore.submit_get`` on the native path, headers and checksums verified.

Each layer's ratio is the lower median over rounds of its sample over that round's ``raw``.  The
ring reports the reads it kept in flight (Little's law: completions per second x mean time from
submission to reaping).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvswarm.argtypes import comma_list, positive_float, positive_int
from kvswarm.bench import write_json
from kvswarm.bench.io_bench import (
    SIZE_NAMES,
    Drives,
    MiB,
    Sample,
    add_drive_arguments,
    lower_median,
    parse_size,
    precondition,
    shuffled,
    store_read,
    store_write,
)
from kvswarm.buffers import BufferPool
from kvswarm.errors import KVSwarmError
from kvswarm.format import HEADER_SIZE, payload_offset
from kvswarm.io import Op
from kvswarm.io import native as native_io
from kvswarm.io.raw import cpu_time, run_uring
from kvswarm.metrics import DriveStats
from kvswarm.store import KVStore
from kvswarm.store.shape import BatchShape

LAYERS = ("raw", "raw_span", "ring", "ring_verified", "store")


def ring_read(fds: Sequence[int], ios: Sequence[tuple[int, int]], sums: np.ndarray | None, size: int,
              queue_depth: int, keys: int, inflight: int, seconds: float) -> tuple[Sample, float]:
    """Batches of ``keys`` reads of ``ios`` (in order, wrapping), ``inflight`` of them queued on one
    native ring ``queue_depth`` deep per drive, each batch into its own slice of one pool; with ``sums``
    every payload is checked against its checksum (a failed check raises).  The sample and the reads
    the ring kept in flight on average."""
    io = native_io.NativeIO(queue_depth=queue_depth, single_thread=True)
    pool = BufferPool(keys * inflight * size)
    pool.populate()
    try:
        for d, fd in enumerate(fds):
            io.attach(d, fd, DriveStats(d))
        plen = size - HEADER_SIZE
        length = np.full(keys, size, np.int64)
        poff = np.full(keys, payload_offset(plen), np.int64)
        plens = np.full(keys, plen, np.int64)
        drive = np.array([d for d, _ in ios], np.int64)
        offset = np.array([o for _, o in ios], np.int64)
        free, live, lat_sum, got, i = list(range(inflight)), [], 0.0, 0, 0
        now = time.perf_counter
        c0, t0 = cpu_time(), now()
        stop = t0 + seconds
        while True:
            while free and now() < stop:
                q = free.pop()
                idx = (np.arange(keys) + i) % len(ios)
                i = (i + keys) % len(ios)
                at = q * keys * size + np.arange(keys, dtype=np.int64) * size
                check = (poff, plens, np.ascontiguousarray(sums[idx])) if sums is not None else (None, None, None)
                live.append((q, io.submit(Op.READ, pool.array, drive[idx], offset[idx], length, at, None, *check)))
            if not live:
                break
            io.poll(None)
            for q, b in [x for x in live if x[1].done]:
                live.remove((q, b))
                free.append(q)
                if (b.verdict != native_io.OK).any() or (b.res != size).any():
                    raise KVSwarmError(f"bench io-layers: a ring read of {size} B failed or did not verify")
                got += keys
                lat_sum += float(b.lat.sum())
        el, cpu = now() - t0, cpu_time() - c0
    finally:
        io.close()
    nbytes = got * size
    return Sample(nbytes / el / 1e9, got / el, cpu / (nbytes / 1e9)), (got / el) * (lat_sum / got / 1e9)


@dataclass(frozen=True)
class DataSet:
    """One size's objects as the store wrote them: keys, each one's extent (drive, offset) and checksum,
    and the store's read shape for them."""

    size: int
    keys: list[bytes]
    ios: list[tuple[int, int]]
    sums: np.ndarray
    shape: BatchShape


def write_data_set(store: KVStore, size: int, nbytes: int, rng: random.Random) -> DataSet:
    keys = [b"io-layers/%d/%d" % (size, i) for i in range(nbytes // size)]
    store_write(store, keys, size - HEADER_SIZE, rng)
    located = store.locate(keys)
    return DataSet(size, keys, [(e.extents[0].drive, e.extents[0].offset) for e in located],
                   np.array([e.extents[0].csum for e in located], np.uint64),
                   store.read_shape(store.object_bytes(size - HEADER_SIZE)))


def measure(layer: str, ds: DataSet, store: KVStore, fds: Sequence[int], seconds: float,
            rng: random.Random) -> tuple[Sample, float | None]:
    """One timed sample of ``layer`` over ``ds`` (a fresh random order), and for the ring layers the
    reads it kept in flight."""
    size, (keys, inflight), depth = ds.size, (ds.shape.keys, ds.shape.inflight), store.queue_depth
    if layer == "store":
        return store_read(store, shuffled(ds.keys, rng), size - HEADER_SIZE, keys, inflight, seconds), None
    if layer in ("ring", "ring_verified"):
        order = shuffled(range(len(ds.ios)), rng)
        return ring_read(fds, [ds.ios[j] for j in order], ds.sums[order] if layer == "ring_verified" else None,
                         size, depth, keys, inflight, seconds)
    into = None
    if layer == "raw_span":  # each read into its own buffer, over as many as the store's reads queued
        span = keys * inflight
        pool = BufferPool(span * size)
        pool.populate()
        into = [pool.view[(j % span) * size:(j % span + 1) * size] for j in range(len(ds.ios))]
    x = run_uring(fds, shuffled(ds.ios, rng), size, Op.READ, len(fds) * depth, seconds, into=into)
    return Sample(x.gbps, x.iops, x.cpu_s_per_gb, x.method), None


def layers_bench(args: argparse.Namespace, console) -> dict:
    """The layers' samples and ratios per size (see the module's doc)."""
    if not (native_io.enabled() and Drives.native_possible(args)):
        raise KVSwarmError("bench io-layers needs the native read path (kvswarm.io._batchio built, io_uring)")
    quick = args.quick
    seconds = args.seconds or (0.3 if quick else 1.5)
    rounds = args.rounds or (1 if quick else 9)
    rng = random.Random(args.seed)

    def data_bytes(size: int) -> int:
        if args.data_mib:
            return args.data_mib * MiB
        return 64 * MiB if quick else (1024 if size < 64 << 10 else 2048) * MiB

    ndrives = args.drives or args.dirs
    drive_bytes = (sum(data_bytes(s) for s in args.sizes) // ndrives * 11 // 10 + 64 * MiB) // MiB * MiB
    results: dict = {"sizes": {}, "summary": {}, "config": {
        "seconds": seconds, "rounds": rounds, "layers": list(LAYERS),
        "object_size": "extent on disk; payload = size - 64 B header; every layer counts whole extents "
                       "but the store (payload bytes)"}}
    with contextlib.ExitStack() as stack:
        drives = Drives(args, drive_bytes)
        stack.callback(drives.close)
        console.print(f"[bold]drives[/]: {drives.describe}")
        results["drives"] = drives.info
        store = drives.open_store("native")
        stack.callback(store.close)
        wfds = drives.raw_fds(write=True)
        try:
            results["config"]["precondition_s"] = precondition(store, wfds)
        finally:
            for fd in wfds:
                os.close(fd)
        data_sets = [write_data_set(store, size, data_bytes(size), rng) for size in args.sizes]
        fds = drives.raw_fds()
        for fd in fds:
            stack.callback(os.close, fd)
        for ds in data_sets:
            name = SIZE_NAMES.get(ds.size, f"{ds.size // 1024}k")
            samples: dict[str, list[Sample]] = {m: [] for m in LAYERS}
            in_flight: list[float] = []
            with console.status(f"layers at {name}: {rounds} rounds of {len(LAYERS)}"):
                store_read(store, shuffled(ds.keys, rng), ds.size - HEADER_SIZE, ds.shape.keys, ds.shape.inflight,
                           seconds / 2)  # untimed: the store's pool faulted in
                for r in range(rounds):
                    for layer in (LAYERS if r % 2 == 0 else LAYERS[::-1]):
                        sample, held = measure(layer, ds, store, fds, seconds, rng)
                        samples[layer].append(sample)
                        if held is not None:
                            in_flight.append(held)
            results["summary"] |= _summary(name, samples, in_flight)
            results["sizes"][name] = {
                "extent_bytes": ds.size, "objects": len(ds.keys), "raw_depth": ndrives * store.queue_depth,
                "store_shape": [ds.shape.keys, ds.shape.inflight], "queue_depth_per_drive": store.queue_depth,
                "raw_span_buffers": ds.shape.keys * ds.shape.inflight,
                "samples": {m: [vars(s) for s in ss] for m, ss in samples.items()}}
    return results


def _summary(name: str, samples: dict[str, list[Sample]], in_flight: list[float]) -> dict[str, float]:
    """Per layer: the lower median of its per-round ratio to raw, and of its CPU per GB."""
    raw = samples["raw"]
    out = {f"layer_ratio_{m}_{name}": lower_median([a.gbps / b.gbps for a, b in zip(ss, raw)])
           for m, ss in samples.items() if m != "raw"}
    out |= {f"layer_cpu_s_per_gb_{m}_{name}": lower_median([a.cpu_s_per_gb for a in ss]) for m, ss in samples.items()}
    out[f"ring_reads_in_flight_{name}"] = lower_median(in_flight)
    return out


def print_layers(results: dict, console) -> None:
    from rich.table import Table

    t = Table(title="store reads by layer: ratio to raw io_uring (paired per round), CPU s/GB")
    t.add_column("object")
    for m in LAYERS[1:]:
        t.add_column(m, justify="right")
    t.add_column("raw CPU", justify="right")
    t.add_column("ring in flight", justify="right")
    s = results["summary"]
    for name in results["sizes"]:
        t.add_row(name, *(f"{s[f'layer_ratio_{m}_{name}']:.3f} / {s[f'layer_cpu_s_per_gb_{m}_{name}']:.3f}"
                          for m in LAYERS[1:]),
                  f"{s[f'layer_cpu_s_per_gb_raw_{name}']:.3f}", f"{s[f'ring_reads_in_flight_{name}']:.1f}")
    console.print(t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=comma_list(parse_size), default="4k,16k,64k",
                   help="object (extent) sizes, comma-separated multiples of 4 KiB (default %(default)s)")
    p.add_argument("--data-mib", type=positive_int, default=None,
                   help="data set per size in MiB (default 1024 below 64 KiB, else 2048; quick: 64)")
    p.add_argument("--seconds", type=positive_float, default=None,
                   help="seconds per timed sample (default 1.5; quick 0.3)")
    p.add_argument("--rounds", type=positive_int, default=None, help="rounds of every layer (default 9; quick 1)")
    add_drive_arguments(p, ["auto", "kernel"])  # the native ring takes no user-space pacing
    p.add_argument("--quick", action="store_true", help="short run: small data, one round")
    p.add_argument("--json", default=None, help="write results (with a 'summary' of numbers) to this path")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    results = layers_bench(args, console)
    results |= {"seconds": time.perf_counter() - t0, "load_avg_1min": [load0, os.getloadavg()[0]],
                "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print_layers(results, console)
    console.print(f"drives: {results['drives']['emulation']} emulation; {results['config']['object_size']}; "
                  f"{results['seconds']:.0f} s")
    if args.json:
        write_json(args.json, results)
        console.print(f"wrote {args.json}")
    return 0
