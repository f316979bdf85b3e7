"""Request streams and their replay, against the simulator or against a real KVStore.

The same :class:`Request` list drives both, and both are summarised by
:func:`summarise`, so simulated and measured figures are comparable metric by metric.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvswarm.sim.system import BatchRecord, SimStore


@dataclass(frozen=True)
class Request:
    """One batch: ``get`` of ``keys``, or ``put`` of ``keys`` with ``sizes`` (bytes)."""

    op: str
    keys: tuple[bytes, ...]
    sizes: tuple[int, ...] = ()
    hints: tuple[object, ...] | None = None
    at: float | None = None  # arrival time in s for open-loop replay

    def __post_init__(self) -> None:
        if self.op not in ("get", "put"):
            raise ValueError(f"request op must be 'get' or 'put', not {self.op!r}")
        if self.op == "put" and len(self.sizes) != len(self.keys):
            raise ValueError("a put request needs one size per key")
        if any(s <= 0 for s in self.sizes):
            raise ValueError("object sizes must be positive")


def summarise(records: Sequence[BatchRecord], elapsed: float, op_latencies: Sequence[float] = ()) -> dict:
    """Throughput and I/O-time figures of a replay (same keys for simulated and measured runs)."""
    if not records:
        raise ValueError("nothing was replayed: the request stream is empty")
    secs = np.array([r.seconds for r in records])
    nbytes = sum(r.nbytes for r in records)
    return {
        "batches": len(records),
        "bytes": nbytes,
        "ops": sum(r.nops for r in records),
        "elapsed_s": elapsed,
        "throughput_Bps": nbytes / elapsed if elapsed > 0 else 0.0,
        "mean_io_time_s": float(secs.mean()),
        "median_io_time_s": float(np.median(secs)),
        "p99_io_time_s": float(np.quantile(secs, 0.99)),
        "mean_op_latency_s": float(np.mean(op_latencies)) if len(op_latencies) else float("nan"),
    }


def replay(store: SimStore, stream: Iterable[Request], concurrency: int = 1, to_gpu: bool = False) -> dict:
    """Run ``stream`` on the simulator and summarise it.

    Requests with an arrival time ``at`` are issued then (open loop); the others are
    issued by ``concurrency`` closed-loop clients, each waiting for its previous batch.
    """
    env = store.env
    timed, queued = [], []
    for r in stream:
        (timed if r.at is not None else queued).append(r)
    first = len(store.records)
    lat0 = len(store.op_latencies)
    t0 = env.now

    def issue(r: Request):
        if r.op == "get":
            return (yield from store.get(r.keys, to_gpu))
        return (yield from store.put(list(zip(r.keys, r.sizes)), r.hints))

    def arrival(r: Request):
        yield env.timeout(max(0.0, t0 + r.at - env.now))
        yield from issue(r)

    it = iter(queued)

    def client():
        for r in it:
            yield from issue(r)

    procs = [env.process(arrival(r)) for r in timed]
    procs += [env.process(client()) for _ in range(max(1, concurrency) if queued else 0)]
    env.run(env.all_of(procs))
    return summarise(store.records[first:], env.now - t0, store.op_latencies[lat0:])


def measure(kvstore, stream: Iterable[Request], concurrency: int = 1) -> dict:
    """Run ``stream`` on a real :class:`~kvswarm.store.KVStore` with ``concurrency`` batches in flight.

    Puts write zero-filled payloads of the given sizes; every get is verified by the
    store (checksums), and a miss is counted, never hidden.
    """
    records: list[BatchRecord] = []
    inflight: list[tuple[object, Request, float]] = []
    lat0 = [(s.ops[0], s.mean_latency(0)) for s in kvstore.drive_stats]
    payloads: dict[int, bytes] = {}

    def finish(h, r: Request, t: float) -> None:
        res = h.wait()
        end = time.perf_counter()
        if r.op == "get":
            hits = sum(v is not None for v in res.views)
            res.release()
            records.append(BatchRecord("get", t, end, _extent_bytes(kvstore, r.keys), _nextents(kvstore, r.keys),
                                       hits, len(r.keys) - hits))
        else:
            records.append(BatchRecord("put", t, end, _extent_bytes(kvstore, r.keys), _nextents(kvstore, r.keys),
                                       sum(res)))

    t_start = time.perf_counter()
    for r in stream:
        if len(inflight) >= max(1, concurrency):
            finish(*inflight.pop(0))
        t = time.perf_counter()
        if r.op == "get":
            h = kvstore.submit_get(list(r.keys))
        else:
            items = [(k, payloads.setdefault(n, bytes(n))) for k, n in zip(r.keys, r.sizes)]
            h = kvstore.submit_put(items, list(r.hints) if r.hints else None)
        inflight.append((h, r, t))
    while inflight:
        finish(*inflight.pop(0))
    elapsed = time.perf_counter() - t_start
    # Per-op read latency: the mean over the reads this run added (the store's own drive histograms).
    tot_ops, tot_lat = 0, 0.0
    for (ops0, mean0), s in zip(lat0, kvstore.drive_stats):
        n = s.ops[0] - ops0
        if n > 0:
            tot_lat += s.mean_latency(0) * s.ops[0] - mean0 * ops0
            tot_ops += n
    summary = summarise(records, elapsed)
    summary["mean_op_latency_s"] = tot_lat / tot_ops if tot_ops else float("nan")
    return summary


def _extent_bytes(kvstore, keys: Sequence[bytes]) -> int:
    return sum(x.length for e in kvstore.locate(keys) if e for x in e.extents)


def _nextents(kvstore, keys: Sequence[bytes]) -> int:
    return sum(len(e.extents) for e in kvstore.locate(keys) if e)
