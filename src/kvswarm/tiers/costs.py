"""Performance models the policies reason with: drive classes and prefill recompute.

:class:`DriveCost` is one drive's service time per I/O (latency + bytes / bandwidth,
floored by 1 / IOPS).  :data:`DRIVE_CLASSES` gives a default per class; the figures
are the ones in ``kvswarm/data/hardware.toml`` (Samsung PM9A3 for ``ssd``, Seagate Exos
X20 for ``hdd``; ``remote`` is that SSD behind NVMe-oF/TCP on 25 GbE, its link and the
added fabric latency assumed).  Benchmarks build models from what they measured or
from the emulation's caps (:meth:`DriveCost.from_caps`) instead.

:class:`ComputeModel` is prefill time as a function of length, fitted from measured
prefills: recomputing a block deep in a long prompt costs more than one at its start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DriveCost:
    kind: str
    read_mbps: float  # MB = 1e6 B
    write_mbps: float
    read_latency_s: float = 0.0
    write_latency_s: float = 0.0
    read_iops: float | None = None
    write_iops: float | None = None

    def read_seconds(self, nbytes: int) -> float:
        return self.read_latency_s + max(nbytes / (self.read_mbps * 1e6), 1 / self.read_iops if self.read_iops else 0)

    def write_seconds(self, nbytes: int) -> float:
        return self.write_latency_s + max(nbytes / (self.write_mbps * 1e6),
                                          1 / self.write_iops if self.write_iops else 0)

    @classmethod
    def from_caps(cls, kind: str, caps: object, fallback: DriveCost | None = None) -> DriveCost:
        """From an emulation's :class:`kvswarm.io.throttle.DriveCaps` (unset fields: ``fallback``'s)."""
        fb = fallback or DRIVE_CLASSES[kind]
        lat = getattr(caps, "latency_ms", 0.0) / 1e3
        return cls(kind, getattr(caps, "read_mbps", None) or fb.read_mbps,
                   getattr(caps, "write_mbps", None) or fb.write_mbps,
                   lat or fb.read_latency_s, lat or fb.write_latency_s,
                   getattr(caps, "read_iops", None) or fb.read_iops, getattr(caps, "write_iops", None) or fb.write_iops)


DRIVE_CLASSES: dict[str, DriveCost] = {
    # hardware.toml [drives.pm9a3]: 6.9 / 4.1 GB/s, 1.1M / 200k IOPS, ~85 us QD1 read (assumed)
    "ssd": DriveCost("ssd", 6900, 4100, 85e-6, 20e-6, 1_100_000, 200_000),
    # hardware.toml [drives.exos_x20]: 285 MB/s, 168 / 550 IOPS, ~12.2 ms seek + rotation (assumed)
    "hdd": DriveCost("hdd", 285, 285, 12.2e-3, 12.2e-3, 168, 550),
    # assumed: the ssd above over NVMe-oF/TCP on a 25 GbE link (~3 GB/s usable) with ~100 us fabric latency
    "remote": DriveCost("remote", 3000, 3000, 185e-6, 120e-6, 400_000, 150_000),
}


@dataclass(frozen=True)
class ComputeModel:
    """Prefill time ``T(n) = a*n + b*n**2`` seconds for ``n`` tokens (linear layers + attention)."""

    a: float
    b: float = 0.0

    def prefill_seconds(self, n: int) -> float:
        return self.a * n + self.b * n * n

    def block_seconds(self, start: int, tokens: int) -> float:
        """Recompute time of ``tokens`` tokens that follow ``start`` cached ones."""
        return self.prefill_seconds(start + tokens) - self.prefill_seconds(start)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> ComputeModel:
        """Least-squares fit (non-negative) to measured ``(tokens, seconds)`` prefills."""
        n = np.array([p[0] for p in points], float)
        t = np.array([p[1] for p in points], float)
        if len(points) == 1:
            return cls(float(t[0] / n[0]))
        (a, b), *_ = np.linalg.lstsq(np.stack([n, n * n], 1), t, rcond=None)
        if b < 0:
            return cls(float((t * n).sum() / (n * n).sum()))
        if a < 0:
            return cls(0.0, float((t * n * n).sum() / (n ** 4).sum()))
        return cls(float(a), float(b))
