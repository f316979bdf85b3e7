"""Per-drive I/O statistics, cheap on the hot path, exported through prometheus-client.

The hot path only appends to Python lists and bumps integers; histograms are folded
lazily when someone reads them (a scrape, ``kvswarm stats``, the demo table).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

# Latency bucket upper bounds in seconds (10 us .. 1 s).
LATENCY_BUCKETS = np.array([1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                            2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0])
READ, WRITE = 0, 1
FOLD_EVERY = 1 << 16  # latencies kept unfolded per op
_OPS = ("read", "write")


@dataclass(slots=True)  # slots: the I/O engines update these per completion
class DriveStats:
    name: str
    ops: list[int] = field(default_factory=lambda: [0, 0])
    bytes: list[int] = field(default_factory=lambda: [0, 0])
    errors: int = 0
    misses: int = 0  # reads rejected by checksum / header checks
    queue_depth: int = 0
    _pending_lat: list[list[float]] = field(default_factory=lambda: [[], []])
    _hist: np.ndarray = field(default_factory=lambda: np.zeros((2, len(LATENCY_BUCKETS) + 1), np.int64))
    _lat_sum: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, op: int, nbytes: int, latency: float) -> None:
        self.ops[op] += 1
        self.bytes[op] += nbytes
        self._pending_lat[op].append(latency)
        self.fold_if_long()

    def add_folded(self, op: int, ops: int, nbytes: int, counts: np.ndarray, lat_sum: float) -> None:
        """Completed I/Os of ``op``, already folded: ``counts`` per latency bucket (LATENCY_BUCKETS'
        bounds, then one past the last; extra trailing zeros are ignored) and their latency sum in s."""
        self.ops[op] += ops
        self.bytes[op] += nbytes
        with self._lock:
            self._hist[op] += counts[:self._hist.shape[1]]
            self._lat_sum[op] += lat_sum

    def fold_if_long(self) -> None:
        """Bound the memory of unread latencies (a long run that nobody scrapes)."""
        if len(self._pending_lat[READ]) >= FOLD_EVERY or len(self._pending_lat[WRITE]) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        with self._lock:
            for op in (READ, WRITE):
                pending, self._pending_lat[op] = self._pending_lat[op], []
                if pending:
                    lat = np.asarray(pending)
                    idx = np.searchsorted(LATENCY_BUCKETS, lat, side="left")
                    self._hist[op] += np.bincount(idx, minlength=len(LATENCY_BUCKETS) + 1)
                    self._lat_sum[op] += float(lat.sum())

    def histogram(self, op: int) -> tuple[np.ndarray, float]:
        """(per-bucket counts incl. +Inf, latency sum) for ``op``."""
        self._fold()
        return self._hist[op].copy(), self._lat_sum[op]

    def mean_latency(self, op: int) -> float:
        counts, total = self.histogram(op)
        n = int(counts.sum())
        return total / n if n else 0.0

    def latency_quantile(self, op: int, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q``."""
        counts, _ = self.histogram(op)
        n = counts.sum()
        if not n:
            return 0.0
        i = int(np.searchsorted(np.cumsum(counts), q * n))
        return float(LATENCY_BUCKETS[min(i, len(LATENCY_BUCKETS) - 1)])

    def snapshot(self) -> dict[str, float]:
        return {
            "drive": self.name,
            "read_ops": self.ops[READ], "read_bytes": self.bytes[READ],
            "write_ops": self.ops[WRITE], "write_bytes": self.bytes[WRITE],
            "errors": self.errors, "misses": self.misses, "queue_depth": self.queue_depth,
            "read_lat_mean_s": self.mean_latency(READ), "read_lat_p99_s": self.latency_quantile(READ, 0.99),
            "write_lat_mean_s": self.mean_latency(WRITE),
        }


class DriveStatsCollector(Collector):
    """Exposes a set of DriveStats as prometheus metric families."""

    def __init__(self, stats: Iterable[DriveStats], prefix: str = "kvswarm_drive") -> None:
        self._stats = list(stats)
        self._prefix = prefix

    def collect(self) -> Iterator:
        p = self._prefix
        ops = CounterMetricFamily(f"{p}_ops", "I/O operations completed", labels=["drive", "op"])
        nbytes = CounterMetricFamily(f"{p}_bytes", "bytes transferred", labels=["drive", "op"])
        errs = CounterMetricFamily(f"{p}_errors", "failed I/O operations", labels=["drive"])
        miss = CounterMetricFamily(f"{p}_corrupt_reads", "reads rejected by header/checksum checks",
                                   labels=["drive"])
        qd = GaugeMetricFamily(f"{p}_queue_depth", "I/Os in flight", labels=["drive"])
        lat = HistogramMetricFamily(f"{p}_latency_seconds", "I/O latency", labels=["drive", "op"])
        for s in self._stats:
            for op, name in enumerate(_OPS):
                ops.add_metric([s.name, name], s.ops[op])
                nbytes.add_metric([s.name, name], s.bytes[op])
                counts, total = s.histogram(op)
                cum = np.cumsum(counts)
                buckets = [(repr(float(b)), int(c)) for b, c in zip(LATENCY_BUCKETS, cum[:-1])]
                buckets.append(("+Inf", int(cum[-1])))
                lat.add_metric([s.name, name], buckets, total)
            errs.add_metric([s.name], s.errors)
            miss.add_metric([s.name], s.misses)
            qd.add_metric([s.name], s.queue_depth)
        yield from (ops, nbytes, errs, miss, qd, lat)


def registry_for(stats: Iterable[DriveStats]) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(DriveStatsCollector(stats))
    return reg
