"""Device models for the simulator: drives (SSD / HDD) and links (PCIe, DRAM copy, GPU copy).

A drive serves an operation in two stages, which is enough to reproduce the usual
curves (latency at queue depth 1, IOPS-bound small I/O, bandwidth-bound large I/O):

1. a fixed per-op latency that up to ``queue_depth`` operations spend in parallel
   (SSD: flash read + controller; HDD: command overhead beyond the positioning time);
2. a serial transfer stage: ``max(bytes / bandwidth, ops / iops)`` for an SSD; for an
   HDD ``positioning + bytes / bandwidth`` where positioning (seek + rotation, taken as
   ``1 / iops``) is skipped when the op starts where the previous one ended (sequential).

A *paced* drive is a rate limiter instead, the Linux blkio throttle that caps emulated
drives: an op is dispatched once the budget allows it, then takes only the fixed latency.
The budget follows the kernel's slices (block/blk-throttle.c): a slice starts when an
idle group gets I/O, the allowance is rate x the time since the slice start rounded *up*
to whole ``slice_s`` windows (so each window's budget is granted at its start), bytes
and ops are checked apart, and whole elapsed windows are trimmed off as ops dispatch.

A link is one serial stage of ``max(bytes / bandwidth, ops / iops)`` plus a fixed
latency: the host's PCIe uplink to the drives, a DRAM memcpy, the PCIe link to the GPU,
or, when validating on emulated drives, the one physical disk they all share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import simpy

KIB = 1024
SMALL_IO = 4 * KIB  # the op size datasheets quote random IOPS at


@dataclass(frozen=True)
class DriveSpec:
    """Performance of one drive. Bandwidths in bytes/s, IOPS for random 4 KiB ops, latencies in s."""

    name: str
    read_bw: float
    write_bw: float
    read_iops: float
    write_iops: float
    read_latency: float
    write_latency: float
    queue_depth: int = 64
    kind: str = "ssd"  # "ssd" or "hdd"
    paced: bool = False  # rate-limited (blkio throttle) rather than a serial transfer stage
    slice_s: float = 0.1  # paced drives: the throttle's slice (the kernel's default for rotational queues)

    def __post_init__(self) -> None:
        if self.kind not in ("ssd", "hdd"):
            raise ValueError(f"drive model {self.name!r}: kind must be 'ssd' or 'hdd', not {self.kind!r}")
        for f in ("read_bw", "write_bw", "read_iops", "write_iops"):
            if not getattr(self, f) > 0:
                raise ValueError(f"drive model {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        for f in ("read_latency", "write_latency"):
            if getattr(self, f) < 0:
                raise ValueError(f"drive model {self.name!r}: {f} must be >= 0, got {getattr(self, f)}")
        if self.queue_depth < 1:
            raise ValueError(f"drive model {self.name!r}: queue_depth must be >= 1")
        if self.slice_s <= 0:
            raise ValueError(f"drive model {self.name!r}: slice_s must be > 0")

    def scaled(self, **changes: float) -> DriveSpec:
        return replace(self, **changes)

    def fixed_latency(self, write: bool) -> float:
        """Stage-1 time: the part of an op's latency that overlaps with other ops."""
        lat = self.write_latency if write else self.read_latency
        if self.kind == "hdd":
            return max(0.0, lat - 1.0 / (self.write_iops if write else self.read_iops))
        return lat

    def transfer_time(self, nbytes: int, nops: int, write: bool, seeks: int | None = None) -> float:
        """Stage-2 (serial) time of ``nops`` ops totalling ``nbytes``; an HDD positions ``seeks`` times
        (default: once per op)."""
        bw = self.write_bw if write else self.read_bw
        iops = self.write_iops if write else self.read_iops
        if self.kind == "hdd":
            return (nops if seeks is None else seeks) / iops + nbytes / bw
        return max(nbytes / bw, nops / iops)

    def qd1_latency(self, nbytes: int = SMALL_IO, write: bool = False) -> float:
        return self.fixed_latency(write) + self.transfer_time(nbytes, 1, write)


@dataclass(frozen=True)
class LinkModel:
    """A shared serial path: bandwidth in bytes/s, optional ops/s ceiling, fixed latency in s."""

    name: str
    bandwidth: float
    iops: float = 0.0  # 0: no per-op ceiling
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0, got {self.bandwidth}")
        if self.iops < 0 or self.latency < 0:
            raise ValueError(f"link {self.name!r}: iops and latency must be >= 0")

    def transfer_time(self, nbytes: int, nops: int = 1) -> float:
        t = nbytes / self.bandwidth
        return max(t, nops / self.iops) if self.iops else t


# PCIe payload bandwidth per lane after line coding, in bytes/s (PCI-SIG base specs):
# gen3 8 GT/s 128b/130b, gen4 16 GT/s, gen5 32 GT/s, gen6 64 GT/s (FLIT, ~same efficiency).
PCIE_LANE_BYTES = {3: 8e9 * 128 / 130 / 8, 4: 16e9 * 128 / 130 / 8, 5: 32e9 * 128 / 130 / 8,
                   6: 64e9 * 242 / 256 / 8}


def pcie_link(gen: int, lanes: int, efficiency: float = 0.85, name: str | None = None,
              latency: float = 1e-6) -> LinkModel:
    """A PCIe link; ``efficiency`` is the share left after TLP headers and flow control (assumed)."""
    if gen not in PCIE_LANE_BYTES:
        raise ValueError(f"unknown PCIe generation {gen}; one of {sorted(PCIE_LANE_BYTES)}")
    if lanes <= 0 or not 0 < efficiency <= 1:
        raise ValueError(f"PCIe link needs lanes > 0 and 0 < efficiency <= 1 (got {lanes}, {efficiency})")
    return LinkModel(name or f"pcie{gen}x{lanes}", PCIE_LANE_BYTES[gen] * lanes * efficiency, latency=latency)


class SimDrive:
    """A drive in a simpy environment; keeps busy time and byte/op counts."""

    def __init__(self, env: simpy.Environment, index: int, model: DriveSpec) -> None:
        self.env, self.index, self.model = env, index, model
        self.slots = simpy.Resource(env, capacity=model.queue_depth)
        self.channel = simpy.Resource(env, capacity=1)
        self.busy = 0.0
        self.bytes = [0, 0]
        self.ops = [0, 0]
        self._head = -1  # end offset of the last op: HDD sequential detection
        self._slice = [[-1.0, -1.0, 0.0, 0.0, -1.0], [-1.0, -1.0, 0.0, 0.0, -1.0]]  # paced, per direction:
        # slice start, slice end, bytes and ops dispatched in it, last dispatch time

    def serve(self, nbytes: int, nops: int, write: bool, offset: int = -1, seeks: int | None = None):
        """simpy process: ``nops`` ops of ``nbytes`` in all, served as one; they lie in ``seeks``
        contiguous runs (default: each op its own), the first starting at ``offset``."""
        m = self.model
        with self.slots.request() as slot:
            yield slot
            fixed = m.fixed_latency(write)
            if m.paced:
                start = self._throttle(nbytes, nops, write)
                yield self.env.timeout(start - self.env.now + fixed)
            else:
                if fixed:
                    yield self.env.timeout(fixed)
                with self.channel.request() as ch:
                    yield ch
                    seeks = nops if seeks is None else seeks
                    if offset >= 0 and offset == self._head:
                        seeks -= 1  # continues where the head is: no positioning
                    t = m.transfer_time(nbytes, nops, write, seeks)
                    self._head = offset + nbytes if offset >= 0 and seeks <= 1 else -1
                    self.busy += t
                    yield self.env.timeout(t)
        self.bytes[write] += nbytes
        self.ops[write] += nops

    def _throttle(self, nbytes: int, nops: int, write: bool) -> float:
        """Dispatch time of an op under the blkio throttle's slice accounting (see the module doc)."""
        m, now, st = self.model, self.env.now, self._slice[write]
        bw, iops, S = (m.write_bw, m.write_iops, m.slice_s) if write else (m.read_bw, m.read_iops, m.slice_s)
        if now > st[1] and st[4] <= now:  # slice over and nothing queued: a fresh slice
            st[:4] = [now, now + S, 0.0, 0.0]
        # Earliest t with rate x roundup(t - start, S) covering what was dispatched plus this op.
        windows = max(math.ceil((st[2] + nbytes) / (bw * S) - 1e-9), math.ceil((st[3] + nops) / (iops * S) - 1e-9))
        t = max(now, st[0] + (windows - 1) * S)
        st[2] += nbytes
        st[3] += nops
        st[1] = max(st[1], t + S)
        st[4] = t
        n = math.floor((t - st[0]) / S)  # trim whole windows that have passed
        if n > 0:
            st[0] += n * S
            st[2] = max(0.0, st[2] - bw * S * n)
            st[3] = max(0.0, st[3] - iops * S * n)
        self.busy += max(nbytes / bw, nops / iops)
        return t


class SimLink:
    def __init__(self, env: simpy.Environment, model: LinkModel) -> None:
        self.env, self.model = env, model
        self.res = simpy.Resource(env, capacity=1)
        self.busy = 0.0
        self.bytes = 0

    def transfer(self, nbytes: int, nops: int = 1):
        """simpy process: move ``nbytes`` across the link."""
        with self.res.request() as r:
            yield r
            t = self.model.transfer_time(nbytes, nops)
            self.busy += t
            yield self.env.timeout(t)
        self.bytes += nbytes
        if self.model.latency:
            yield self.env.timeout(self.model.latency)
