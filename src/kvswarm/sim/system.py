"""A simulated KVStore: the store's data path in simulated time, with the store's own strategies.

Placement goes through the same :class:`~kvswarm.placement.PlacementStrategy` objects
(``make_placement``), free space through the same :class:`~kvswarm.allocator.ExtentAllocator`,
keys through the same digest and extents through the same on-disk sizes
(:func:`~kvswarm.format.extent_size`), so a strategy's simulated and measured results
come from one code path.  Only the device time is modelled (:mod:`kvswarm.sim.devices`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy

from kvswarm.allocator import ExtentAllocator
from kvswarm.errors import DriveFull
from kvswarm.format import ALIGN, HEADER_SIZE, extent_size, key_digest
from kvswarm.placement import DriveView, PlacementStrategy, make_placement
from kvswarm.sim.devices import DriveSpec, LinkModel, SimDrive, SimLink

GiB = 1 << 30


@dataclass
class SystemModel:
    """Hardware and host-side parameters of a simulated store."""

    drives: list[DriveSpec]
    capacity_per_drive: int = 1 * GiB
    host_link: LinkModel | None = None  # drives -> host memory (PCIe uplink / HBA / shared disk)
    dram_copy: LinkModel | None = None  # memcpy: joining multi-extent objects, DRAM tier copies
    gpu_link: LinkModel | None = None  # host memory -> GPU
    engine_depth: int = 4  # ops in flight per drive from the host (thread workers / io_uring depth)
    # The thread engine's way: a drive's share of a batch is cut into engine_depth chunks, each
    # read in order by one worker and completed as a whole (each op's latency is its own service
    # time).  False: io_uring-like, each op completes on its own.
    chunked: bool = False
    cpu_per_op: float = 0.0  # host seconds per extent to submit and verify
    cpu_per_byte: float = 0.0  # host seconds per payload byte (checksum)
    # CPUs that cost may use at once: 1 for the Python read paths (their work holds the GIL); more for
    # the native path, whose submission, checks and copies run without it in each reaping thread.
    cpu_cores: int = 1
    stripe_unit: int = 1 << 20
    placement: str | PlacementStrategy = "round_robin"
    coalesce: bool = False  # merge a batch's extents per drive into one op (large-scale planning)

    def __post_init__(self) -> None:
        if not self.drives:
            raise ValueError("a simulated store needs at least one drive")
        if self.capacity_per_drive < 2 * ALIGN or self.capacity_per_drive % ALIGN:
            raise ValueError(f"capacity_per_drive {self.capacity_per_drive} must be a multiple of 4 KiB >= 8 KiB")
        if self.engine_depth < 1:
            raise ValueError("engine_depth must be >= 1")
        if self.cpu_per_op < 0 or self.cpu_per_byte < 0:
            raise ValueError("cpu_per_op and cpu_per_byte must be >= 0")
        if self.cpu_cores < 1:
            raise ValueError("cpu_cores must be >= 1")


@dataclass
class BatchRecord:
    """One completed batch: what it moved and how long it took (simulated seconds)."""

    op: str
    start: float
    end: float
    nbytes: int
    nops: int
    hits: int = 0
    misses: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class _Obj:
    nbytes: int
    extents: tuple[tuple[int, int, int], ...]  # (drive, offset, length) per part, in part order
    runs: tuple[tuple[int, int, int, int], ...]  # (drive, offset, length, parts): its extents per drive


@dataclass
class SimStore:
    """``shared`` lends links by name (``host_link``, ``dram``, ``gpu``) that several simulated
    stores use at once, e.g. an SSD pool and an HDD pool behind one host."""

    model: SystemModel
    env: simpy.Environment = field(default_factory=simpy.Environment)
    shared: dict[str, SimLink] = field(default_factory=dict)

    def __post_init__(self) -> None:
        m, env = self.model, self.env
        self.drives = [SimDrive(env, i, d) for i, d in enumerate(m.drives)]
        self.engine = [simpy.Resource(env, capacity=m.engine_depth) for _ in m.drives]
        self.allocs = [ExtentAllocator(m.capacity_per_drive - ALIGN, start=ALIGN) for _ in m.drives]
        self.healthy = [True] * len(m.drives)
        # A fresh strategy object per store, exactly as KVStore builds it from the config.
        self.placement = make_placement(m.placement)
        own = {"host_link": m.host_link, "dram": m.dram_copy, "gpu": m.gpu_link}
        links = {k: self.shared.get(k) or (SimLink(env, v) if v else None) for k, v in own.items()}
        self.host_link, self.dram, self.gpu = links["host_link"], links["dram"], links["gpu"]
        self.cpu = simpy.Resource(env, capacity=m.cpu_cores)
        self.cpu_busy = 0.0
        self.catalog: dict[bytes, _Obj] = {}
        self.records: list[BatchRecord] = []
        self.op_latencies: list[float] = []

    # ---- placement: the store's rules, the store's strategy objects ----------------------
    def _views(self) -> list[DriveView]:
        return [DriveView(i, a.free, True, self.model.drives[i].kind)
                for i, a in enumerate(self.allocs) if self.healthy[i] and a.free >= ALIGN]

    def _alloc(self, drive: int, nbytes: int) -> tuple[int, int]:
        off = self.allocs[drive].alloc(nbytes)
        if off is not None:
            return drive, off
        for i in sorted(range(len(self.allocs)), key=lambda i: -self.allocs[i].free):
            if self.healthy[i] and (off := self.allocs[i].alloc(nbytes)) is not None:
                return i, off
        raise DriveFull(f"no simulated drive has {nbytes} B free")

    def _place(self, key: bytes, nbytes: int, hint: object) -> _Obj:
        """Split and place an object as KVStore.submit_put does (same unit, sizes, strategy).

        An object's extents on one drive are allocated as one run: the store allocates
        them one after another, which the allocator's bump pointer makes contiguous.
        """
        unit = self.model.stripe_unit - HEADER_SIZE
        parts = max(1, -(-nbytes // unit))
        views = self._views()
        if not views:
            raise DriveFull("no healthy simulated drive has free space")
        chosen = self.placement.place(key_digest(key), parts, views, hint)
        sizes = [extent_size(min(unit, nbytes - p * unit)) for p in range(parts)]
        by_drive: defaultdict[int, list[int]] = defaultdict(list)
        for p, d in enumerate(chosen):
            by_drive[d].append(p)
        exts: list[tuple[int, int, int]] = [(0, 0, 0)] * parts
        runs = []
        for d, ps in by_drive.items():
            total = sum(sizes[p] for p in ps)
            drv, off = self._alloc(d, total)
            runs.append((drv, off, total, len(ps)))
            for p in ps:
                exts[p] = (drv, off, sizes[p])
                off += sizes[p]
        digest = key_digest(key)
        old = self.catalog.pop(digest, None)
        if old is not None:
            self._free(old)
        obj = _Obj(nbytes, tuple(exts), tuple(runs))
        self.catalog[digest] = obj
        return obj

    def _free(self, obj: _Obj) -> None:
        for drv, off, ln, _ in obj.runs:
            self.allocs[drv].release(off, ln)

    def preload(self, items: Sequence[tuple[bytes, int]], hints: Sequence[object] | None = None) -> None:
        """Place objects without spending simulated time (state before a measured phase)."""
        for j, (key, n) in enumerate(items):
            self._place(key, n, hints[j] if hints else None)

    def delete(self, key: bytes) -> bool:
        obj = self.catalog.pop(key_digest(key), None)
        if obj is not None:
            self._free(obj)
        return obj is not None

    def contains(self, key: bytes) -> bool:
        return key_digest(key) in self.catalog

    def fail_drive(self, index: int) -> None:
        self.healthy[index] = False

    # ---- timed operations (simpy processes) ----------------------------------------------
    def put(self, items: Sequence[tuple[bytes, int]], hints: Sequence[object] | None = None):
        """simpy process: write objects of the given sizes; returns a BatchRecord."""
        t0 = self.env.now
        objs = [self._place(k, n, hints[j] if hints else None) for j, (k, n) in enumerate(items)]
        total = sum(r[2] for o in objs for r in o.runs)
        nops = sum(len(o.extents) for o in objs)
        yield from self._cpu(nops, sum(n for _, n in items))
        yield self.env.all_of(self._submit(self._ops(objs), write=True))
        rec = BatchRecord("put", t0, self.env.now, total, nops, hits=len(items))
        self.records.append(rec)
        return rec

    def get(self, keys: Sequence[bytes], to_gpu: bool = False):
        """simpy process: read objects (misses cost nothing); returns a BatchRecord."""
        t0 = self.env.now
        objs, payload, joined = [], 0, 0
        for k in keys:
            obj = self.catalog.get(key_digest(k))
            if obj is None or not all(self.healthy[r[0]] for r in obj.runs):
                continue
            objs.append(obj)
            payload += obj.nbytes
            if len(obj.extents) > 1:
                joined += obj.nbytes  # the store returns such objects as a joined copy
        nops = sum(len(o.extents) for o in objs)
        if objs:
            yield self.env.all_of(self._submit(self._ops(objs), write=False))
            yield from self._cpu(nops, payload)
            if joined and self.dram:
                yield from self.dram.transfer(joined)
            if to_gpu and self.gpu:
                yield from self.gpu.transfer(payload)
        total = sum(r[2] for o in objs for r in o.runs)
        rec = BatchRecord("get", t0, self.env.now, total, nops, len(objs), len(keys) - len(objs))
        self.records.append(rec)
        return rec

    def read(self, extents: Sequence[tuple[int, int]], to_gpu: bool = False):
        """simpy process: read extents ``(drive, bytes)`` chosen by a retrieval strategy (e.g. the
        replica each piece is read from, as in :class:`kvswarm.swarm.retrieval.ReadPlan`'s
        ``drive_of`` / ``nbytes``); returns a BatchRecord."""
        t0 = self.env.now
        ops = [(d, -1, n, 1, 1) for d, n in extents if self.healthy[d]]
        total = sum(op[2] for op in ops)
        if ops:
            yield self.env.all_of(self._submit(ops, write=False))
            yield from self._cpu(len(ops), total)
            if to_gpu and self.gpu:
                yield from self.gpu.transfer(total)
        rec = BatchRecord("get", t0, self.env.now, total, len(ops), len(ops), len(extents) - len(ops))
        self.records.append(rec)
        return rec

    def _ops(self, objs: list[_Obj]) -> list[tuple[int, int, int, int, int]]:
        """(drive, offset, bytes, nops, seeks) per I/O: one per extent, as the store issues them,
        or per drive one merged op when coalescing."""
        if not self.model.coalesce:
            return [(d, off, ln, 1, 1) for o in objs for d, off, ln in o.extents]
        per: defaultdict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for o in objs:
            for d, off, ln, n in o.runs:
                per[d].append((off, ln, n))
        out = []
        for d, runs in per.items():
            runs.sort()
            # Runs that continue one another are read in one sweep: an HDD positions once.
            seeks = 1 + sum(a[0] + a[1] != b[0] for a, b in zip(runs, runs[1:]))
            out.append((d, runs[0][0], sum(r[1] for r in runs), sum(r[2] for r in runs), seeks))
        return out

    def _submit(self, ops: list[tuple[int, int, int, int, int]], write: bool) -> list:
        if not self.model.chunked:
            return [self.env.process(self._io(*op, write=write)) for op in ops]
        per: defaultdict[int, list[tuple]] = defaultdict(list)
        for op in ops:
            per[op[0]].append(op)
        procs = []
        for rs in per.values():
            step = -(-len(rs) // min(self.model.engine_depth, len(rs)))
            procs += [self.env.process(self._chunk(rs[i:i + step], write)) for i in range(0, len(rs), step)]
        return procs

    def _chunk(self, ops: list[tuple[int, int, int, int, int]], write: bool):
        for op in ops:
            yield from self._io(*op, write=write)

    def _io(self, drive: int, offset: int, nbytes: int, nops: int, seeks: int, write: bool):
        with self.engine[drive].request() as slot:
            yield slot
            # Latency from the moment the op holds an engine slot, as the engines stamp it: a
            # thread worker when it starts the op, io_uring when the op enters the ring.
            t0 = self.env.now
            serve = self.drives[drive].serve(nbytes, nops, write, offset, seeks)
            if self.host_link is None:
                yield from serve
            elif self.model.coalesce:
                # A merged op is many extents: they stream through the link while the drive works.
                env = self.env
                yield env.all_of([env.process(serve), env.process(self.host_link.transfer(nbytes, nops))])
            elif write:
                yield from self.host_link.transfer(nbytes, nops)
                yield from serve
            else:
                yield from serve
                yield from self.host_link.transfer(nbytes, nops)
        self.op_latencies.append(self.env.now - t0)

    def _cpu(self, nops: int, nbytes: int):
        t = self.model.cpu_per_op * nops + self.model.cpu_per_byte * nbytes
        if t > 0:
            with self.cpu.request() as r:
                yield r
                self.cpu_busy += t
                yield self.env.timeout(t)

    # ---- results -------------------------------------------------------------------------
    def utilisation(self) -> dict[str, float]:
        """Busy share of each resource over the simulated time so far."""
        now = self.env.now or 1.0
        out = {f"drive{d.index}": d.busy / now for d in self.drives}
        for name, link in (("host_link", self.host_link), ("dram", self.dram), ("gpu", self.gpu)):
            if link:
                out[name] = link.busy / now
        out["cpu"] = self.cpu_busy / (now * self.model.cpu_cores)
        return out
