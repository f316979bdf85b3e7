"""ClusterPool: this node's client of the cluster-wide pool, a Mooncake Store.

The master keeps the objects' index, placement, eviction and the nodes' heartbeats; every
node lends ``segment_bytes`` of DRAM to the pool and moves bytes with the Transfer Engine.
kvswarm adds what a KV block needs on top: keys that are the store's key digests (so its
fingerprinted, tenant-salted keys), a checksummed frame on every value (:mod:`~kvswarm.cluster.wire`),
and failure as a miss: once this node has joined, no cluster call raises.

Submit-then-poll, like :class:`~kvswarm.store.KVStore`::

    h = pool.submit_fetch(digests)   # returns at once; transfers run on the pool's worker threads
    h.poll()                          # True once done (never blocks)
    pool.progress(0.01)               # wait up to 10 ms for any transfer in flight to finish
    r = h.wait()                      # r.views[i]: block i's verified payload, or None (a miss)
    r.release()

``submit_publish`` copies the payloads into frames before it returns, so callers may reuse
their buffers at once.  ``contains`` is the synchronous index query; it gives up after
``rpc_timeout_s`` (all misses) and skips the master while an earlier query is still stuck,
so a partitioned master costs a request at most that timeout once.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvswarm.cluster import wire
from kvswarm.cluster.config import ClusterConfig
from kvswarm.errors import ClusterError

log = logging.getLogger(__name__)
now = time.monotonic
STATS = "stats"  # object names of the nodes' counters: <prefix>:stats:<node id>


class _Arena:
    """The registered memory fetches land in: first-fit ranges, freed per batch."""

    def __init__(self, nbytes: int) -> None:
        self.buf = np.zeros(nbytes, np.uint8)  # touched now: registration pins it
        self.ptr = self.buf.ctypes.data
        self.view = memoryview(self.buf)
        self._taken: list[tuple[int, int]] = []  # sorted (offset, length)
        self._lock = threading.Lock()

    def take(self, n: int) -> int | None:
        with self._lock:
            off = 0
            for i, (o, ln) in enumerate(self._taken):
                if o - off >= n:
                    self._taken.insert(i, (off, n))
                    return off
                off = o + ln
            if len(self.buf) - off >= n:
                self._taken.append((off, n))
                return off
            return None

    def give(self, off: int) -> None:
        with self._lock:
            self._taken = [r for r in self._taken if r[0] != off]


@dataclass
class FetchResult:
    """Verified payloads (``None`` = miss: absent, unreachable or corrupt) for the digests asked.

    The views point into the pool's fetch arena until :meth:`release`; copy what you keep first.
    """

    views: list[memoryview | None]
    _arena: _Arena | None = None
    _offset: int = 0

    def release(self) -> None:
        for v in self.views:
            if v is not None:
                v.release()
        self.views = []
        if self._arena is not None:
            self._arena.give(self._offset)
            self._arena = None


class FetchHandle:
    """A batch of fetches in flight; see the module doc."""

    def __init__(self, future: cf.Future) -> None:
        self._future = future

    def poll(self) -> bool:
        return self._future.done()

    @property
    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> FetchResult:
        """The batch's result; ``None`` views for any block that could not be fetched intact."""
        return self._future.result(timeout)


class PublishHandle:
    """A batch of publications in flight: ``wait()`` gives how many blocks the cluster now holds,
    ``refused()`` the digests it did not take (both block until the batch is done, or ``timeout``)."""

    def __init__(self, future: cf.Future, digests: Sequence[bytes]) -> None:
        self._future, self._digests = future, list(digests)

    def poll(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> int:
        return sum(self._future.result(timeout))

    def refused(self, timeout: float | None = None) -> list[bytes]:
        return [d for d, ok in zip(self._digests, self._future.result(timeout)) if not ok]


class ClusterPool:
    """This node's handle on the cluster pool (see the module doc).  Raises :class:`ClusterError`
    only when it cannot join (no Mooncake installed, master unreachable at start, bad config)."""

    def __init__(self, config: ClusterConfig, threads: int = 2) -> None:
        self.config = config
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise ClusterError(f"the cluster level needs Mooncake Store (pip install 'kvswarm[cluster]'): {e}") \
                from None
        if config.protocol == "tcp":  # else the engine advertises the host's outward address
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        self._mc = MooncakeDistributedStore()
        rc = self._mc.setup(config.local_hostname, config.metadata, config.segment_bytes, config.buffer_bytes,
                            config.protocol, config.rdma_devices, config.master)
        if rc != 0:
            raise ClusterError(f"could not join the cluster at {config.master} (metadata {config.metadata}, "
                               f"{config.protocol}): Mooncake setup returned {rc}")
        # Fetches land in registered memory: Mooncake then copies once, outside the GIL (into fresh
        # bytes objects, get_batch moves ~10x fewer GB/s).
        self._arena = _Arena(config.fetch_buffer_bytes)
        if self._mc.register_buffer(self._arena.ptr, config.fetch_buffer_bytes) != 0:
            self._mc.close()
            raise ClusterError("could not register the cluster fetch buffer with the Transfer Engine")
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replicas
        self._pin = ReplicateConfig()
        self._pin.replica_num = 1
        self._pin.with_hard_pin = True  # the index marker is never evicted
        self._exec = cf.ThreadPoolExecutor(threads, thread_name_prefix="kvswarm-cluster")
        self._lookup = cf.ThreadPoolExecutor(1, thread_name_prefix="kvswarm-cluster-lookup")
        self._stuck: cf.Future | None = None  # a lookup that outlived its timeout
        self._inflight: set[cf.Future] = set()
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.node_id = uuid.uuid4().hex[:16]
        self._marker = f"{config.prefix}:node:{self.node_id}"
        self.stats_key = f"{config.prefix}:{STATS}:{self.node_id}"
        self._next_check = 0.0
        self._closed = False

    # ---- keys ------------------------------------------------------------------------------
    def object_key(self, digest: bytes) -> str:
        return f"{self.config.prefix}:{digest.hex()}"

    # ---- the index -------------------------------------------------------------------------
    def contains(self, digests: Sequence[bytes]) -> list[bool]:
        """Which blocks the cluster holds now (a master that does not answer: none)."""
        if not digests:
            return []
        self.counters["lookups"] += 1
        self.counters["lookup_blocks"] += len(digests)
        res = self._query(self._mc.batch_is_exist, [self.object_key(d) for d in digests])
        if res is None or len(res) != len(digests):
            return [False] * len(digests)
        found = [r == 1 for r in res]
        self.counters["lookup_found"] += sum(found)
        return found

    def _query(self, fn, *args):
        """``fn(*args)`` on the lookup thread, bounded by ``rpc_timeout_s``; None when it failed."""
        if self._stuck is not None:
            if not self._stuck.done():
                self.counters["lookups_skipped"] += 1
                return None
            self._stuck = None
        try:
            f = self._lookup.submit(fn, *args)
        except RuntimeError:  # the pool is closed, or the interpreter is exiting
            return None
        try:
            return f.result(self.config.rpc_timeout_s)
        except cf.TimeoutError:
            self._stuck = f
            self.counters["timeouts"] += 1
            log.warning("cluster master %s did not answer within %.1f s", self.config.master,
                        self.config.rpc_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure of the cluster is a miss
            self.counters["errors"] += 1
            log.warning("cluster query failed: %s", e)
        return None

    def healthy(self) -> bool:
        """The master answers (Mooncake's health check)."""
        return self._query(self._mc.health_check) == 0

    def index_lost(self) -> bool:
        """True when the master answers but no longer indexes this node's blocks (it restarted, or this
        node was declared dead), so they should be re-published.  Checked at most every
        ``check_interval_s``; between checks, False."""
        t = now()
        if t < self._next_check:
            return False
        self._next_check = t + self.config.check_interval_s
        if not self.healthy():
            return False
        self.report()
        res = self._query(self._mc.is_exist, self._marker)
        return res == 0

    def report(self) -> bool:
        """Publish this node's counters (JSON, a few hundred bytes, pinned) as ``<prefix>:stats:<node>``:
        ``kvswarm cluster status`` reads them.  :meth:`index_lost` does it at every check."""
        body = json.dumps({"node": self.node_id, "host": self.config.local_hostname, "time": time.time(),
                           "replicas": self.config.replicas, "counters": dict(self.counters)}).encode()
        return self._query(self._mc.upsert, self.stats_key, body, self._pin) == 0

    def reports(self, keys: Sequence[str]) -> list[dict]:
        """The nodes' reports under ``keys`` (see :meth:`report`); unreadable ones are left out."""
        out = []
        for k in keys:
            try:
                out.append(json.loads(bytes(self._query(self._mc.get, k) or b"{}")))
            except ValueError:
                continue
        return [r for r in out if "node" in r]

    def mark_indexed(self) -> bool:
        """Record (pinned, in the cluster) that the master indexes this node's blocks now."""
        rc = self._query(self._mc.upsert, self._marker, b"1", self._pin)
        return rc == 0

    # ---- transfers -------------------------------------------------------------------------
    def submit_fetch(self, digests: Sequence[bytes], block_bytes: int) -> FetchHandle:
        """Start fetching ``digests``, blocks of at most ``block_bytes`` payload bytes; see :class:`FetchHandle`."""
        return FetchHandle(self._submit(self._fetch, list(digests), block_bytes))

    def fetch(self, digests: Sequence[bytes], block_bytes: int) -> FetchResult:
        return self.submit_fetch(digests, block_bytes).wait()

    def _fetch(self, digests: list[bytes], block_bytes: int) -> FetchResult:
        c = self.counters
        size = wire.FRAME_BYTES + block_bytes
        keys = [self.object_key(d) for d in digests]
        off = self._arena.take(size * len(digests))
        values: list = []
        try:
            if off is None:  # the arena is full: fresh bytes objects instead
                c["arena_full"] += 1
                values = self._mc.get_batch(keys)
            else:
                got = self._mc.batch_get_into(keys, [self._arena.ptr + off + i * size for i in range(len(keys))],
                                              [size] * len(keys))
                values = [self._arena.view[off + i * size: off + i * size + n] if n > 0 else b""
                          for i, n in enumerate(got)]
        except Exception as e:  # noqa: BLE001
            c["errors"] += 1
            log.warning("cluster fetch of %d blocks failed: %s", len(digests), e)
            values = [b""] * len(digests)
        views: list[memoryview | None] = []
        for d, v in zip(digests, values):
            if not len(v):
                c["fetch_misses"] += 1
                views.append(None)
                continue
            p = wire.unpack(d, v)
            if p is None:
                c["corrupt"] += 1
            else:
                c["fetched_blocks"] += 1
                c["fetched_bytes"] += len(p)
            views.append(p)
        return FetchResult(views, self._arena if off is not None else None, off or 0)

    def submit_publish(self, digests: Sequence[bytes], payloads: Sequence[object]) -> PublishHandle:
        """Publish blocks with the configured replica count; the payloads are copied before this returns."""
        frames = [wire.pack(d, p) for d, p in zip(digests, payloads)]
        return PublishHandle(self._submit(self._publish, [self.object_key(d) for d in digests], frames), digests)

    def _publish(self, keys: list[str], frames: list[bytearray]) -> list[bool]:
        c = self.counters
        try:
            rcs = self._put_each(keys, frames)
        except Exception as e:  # noqa: BLE001
            log.warning("cluster publication of %d blocks failed: %s", len(keys), e)
            rcs = [-1] * len(keys)
        ok = sum(rc == 0 for rc in rcs)  # a block published already counts as published (rc 0)
        c["published_blocks"] += ok
        c["published_bytes"] += sum(len(f) for f, rc in zip(frames, rcs) if rc == 0)
        c["publish_failures"] += len(keys) - ok
        return [rc == 0 for rc in rcs]

    def _put_each(self, keys: list[str], frames: list[bytearray]) -> list[int]:
        # put_batch reports one code for the batch: a failed batch is retried block by block, so the
        # blocks that fit are published and the failures are counted per block.
        rc = self._mc.put_batch(keys, frames, self._replicate)
        if rc == 0:
            return [0] * len(keys)
        return [self._mc.put(k, f, self._replicate) for k, f in zip(keys, frames)]

    def _submit(self, fn, *args) -> cf.Future:
        if self._closed:
            raise ClusterError("the cluster pool is closed")
        f = self._exec.submit(fn, *args)
        with self._lock:
            self._inflight.add(f)
        f.add_done_callback(self._done)
        return f

    def _done(self, f: cf.Future) -> None:
        with self._lock:
            self._inflight.discard(f)

    def progress(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` s for any transfer in flight to finish; how many are done."""
        with self._lock:
            fs = list(self._inflight)
        if not fs:
            return 0
        done, _ = cf.wait(fs, timeout, return_when=cf.FIRST_COMPLETED)
        return len(done)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every transfer in flight; False when some are still running after ``timeout``."""
        with self._lock:
            fs = list(self._inflight)
        _, pending = cf.wait(fs, timeout)
        return not pending

    # ---- reporting -------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"node": self.node_id, "master": self.config.master, "protocol": self.config.protocol,
                "replicas": self.config.replicas, "counters": dict(self.counters)}

    def registry(self) -> CollectorRegistry:
        """A prometheus registry with this node's cluster counters (``kvswarm_cluster_*``)."""
        reg = CollectorRegistry(auto_describe=True)
        reg.register(_ClusterCollector(self))
        return reg

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain(self.config.rpc_timeout_s * 4)
        self._exec.shutdown(wait=False, cancel_futures=True)
        self._lookup.shutdown(wait=False, cancel_futures=True)
        try:
            self._mc.close()
        except Exception as e:  # noqa: BLE001 - leaving a cluster that is gone is no failure
            log.warning("leaving the cluster: %s", e)

    def __enter__(self) -> ClusterPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ClusterCollector(Collector):
    COUNTERS = {
        "lookups": "index queries", "lookup_blocks": "blocks asked of the index",
        "lookup_found": "blocks the index had", "fetched_blocks": "blocks fetched intact",
        "fetched_bytes": "payload bytes fetched", "fetch_misses": "fetches that found no object",
        "corrupt": "fetched values failing their checksum (served as misses)",
        "published_blocks": "blocks published (or already there)", "published_bytes": "frame bytes published",
        "publish_failures": "blocks the cluster refused", "republished_blocks": "blocks re-published from drives",
        "timeouts": "index queries past rpc_timeout_s", "errors": "cluster calls that failed",
    }

    def __init__(self, pool: ClusterPool) -> None:
        self.pool = pool

    def collect(self):
        c = self.pool.counters
        for name, doc in self.COUNTERS.items():
            m = CounterMetricFamily(f"kvswarm_cluster_{name}", doc, labels=["node"])
            m.add_metric([self.pool.node_id], c[name])
            yield m
        g = GaugeMetricFamily("kvswarm_cluster_replicas", "copies made of each published block", labels=["node"])
        g.add_metric([self.pool.node_id], self.pool.config.replicas)
        yield g
