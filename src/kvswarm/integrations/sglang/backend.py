"""kvswarm as an SGLang HiCache storage backend (L3 below SGLang's host-memory pool).

Loaded by ``--hicache-storage-backend dynamic`` with the extra config::

    {"backend_name": "kvswarm", "module_path": "kvswarm.integrations.sglang",
     "class_name": "KVSwarmHiCacheStorage", "interface_v1": 1,
     "drives": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"], "capacity_per_drive": 68719476736, "tenant": ""}

One page is one store object, keyed by SGLang's page hash plus the layout
fingerprint (model, TP/PP rank, host-pool type and layout, page size, heads, dtype, and the
server arguments that change a page's bytes: weights, quantization, KV cache dtype) and the
tenant salt.  A page's bytes are the host pool's flat data page (for MHA: all K, then all
V), whichever interface moved it, so the zero-copy path (``batch_get_v1`` /
``batch_set_v1``, and ``_v2`` for hybrid models' pools: straight between the pool's runs
and the store's aligned buffers) and the generic tensor path (``get`` / ``batch_get`` /
``set`` / ``batch_set``) read each other's pages.  A pool without zero-copy runs in that
order (Mamba state pools, whose pages are assembled copies) moves its pages through its
flat-page methods instead.  Reads are checksummed by the store, and verified pages are copied
into the pool (or the caller's tensors) by its native worker, without the GIL: a bad
page is deleted and reported missing, so SGLang recomputes it.  Each TP/PP rank is its own process and
opens its own store, in a ``<model>/rank<tp>-pp<pp>...`` directory on every drive; but MLA models' KV is the
same on every TP rank and SGLang backs it up from one writer rank, so their ranks share that rank's
store (the others follow it read-only: ``StoreConfig.follow``).

With a ``"cluster": {...}`` section (a :class:`~kvswarm.cluster.ClusterConfig`, docs/cluster.md) the
backend also reads what servers on other nodes published to the cluster's Mooncake Store: a page its
drives lack counts in ``batch_exists`` when the cluster holds it, is fetched (its frame verified) into
the host pool on a read and written to this rank's drives; the pages it writes are published
(``publish``: ``all`` or ``none``).  A writer rank that publishes also re-publishes the pages on its
drives at start and whenever the master no longer indexes the node (it restarted, failed over, or
took the node for dead), from a thread of its own (:class:`~.republisher.Republisher`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvswarm.buffers import BufferPoolExhausted
from kvswarm.cluster.config import ClusterConfig
from kvswarm.cluster.pool import ClusterPool
from kvswarm.errors import ClusterError, FlushError, KVSwarmError
from kvswarm.format import key_digest
from kvswarm.integrations.keys import KeySpace, layout_dtype
from kvswarm.integrations.sglang.republisher import Republisher
from kvswarm.layout import KVLayout
from kvswarm.store import KVStore, Runs, StoreConfig

log = logging.getLogger(__name__)


def model_dir(cfg: HiCacheStorageConfig) -> str:
    """The model's directory on every drive: servers of other models on the same drives keep stores
    of their own (a store has one writer)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.model_name or "").strip("-.") or "model"


def rank_dir(cfg: HiCacheStorageConfig) -> str:
    """This rank's own store: every page of a TP-sharded model, TP-sharded pools (Mamba state) of MLA ones."""
    return os.path.join(model_dir(cfg), f"rank{cfg.tp_rank}of{cfg.tp_size}-pp{cfg.pp_rank}of{cfg.pp_size}"
                                        f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}-dp{cfg.dp_rank}")


def shared_dir(cfg: HiCacheStorageConfig) -> str:
    """The store of an MLA model's rank-replicated pages: one per DCP shard (and PP stage, CP rank,
    DP group), written by that shard's writer rank (``is_storage_writer``) and read by its TP ranks."""
    return os.path.join(model_dir(cfg), f"mla-dcp{cfg.dcp_rank}of{cfg.dcp_size}-pp{cfg.pp_rank}of{cfg.pp_size}"
                                        f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}-dp{cfg.dp_rank}")


# Server arguments that change a page's bytes but neither the model name nor the host pool: the
# weights (path, revision, load format, dtype, quantization, config overrides), the KV cache's
# scales and the KV cache dtype.  The host pool holds every fp8 KV cache as uint8 (SGLang's
# store_dtype), so only kv_cache_dtype tells fp8_e4m3 pages from fp8_e5m2 ones.
VARIANT_ARGS = ("model_path", "revision", "load_format", "dtype", "quantization", "modelopt_quant",
                "quantization_param_path", "json_model_override_args", "kv_cache_dtype")


def server_variant() -> str:
    """This server's ``VARIANT_ARGS`` as SGLang resolved them (its ``model`` namespace); empty in a
    process that has published none (not an SGLang server)."""
    from sglang.srt.runtime_context import get_model

    try:
        args = get_model()
    except ValueError:  # not published
        return ""
    return ",".join(f"{name}={getattr(args, name, None)}" for name in VARIANT_ARGS)


def pool_layout(cfg: HiCacheStorageConfig, pool: Any | None) -> KVLayout:
    """The layout whose fingerprint keys this rank's pages (pool geometry when registered).  MLA's
    KV is the same on every TP rank of a DCP shard: its keys leave the TP rank out."""
    tp = f"dcp={cfg.dcp_rank}/{cfg.dcp_size}" if cfg.is_mla_model else f"tp={cfg.tp_rank}/{cfg.tp_size}"
    ident = (f"sglang:{cfg.model_name}|{tp}|pp={cfg.pp_rank}/{cfg.pp_size}"
             f"|cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}|dcp={cfg.dcp_rank}/{cfg.dcp_size}|mla={cfg.is_mla_model}"
             f"|args={server_variant()}")
    if pool is None:
        return KVLayout(1, 1, 1, "int8", model_id=ident)
    return KVLayout(num_layers=pool.layer_num, num_kv_heads=getattr(pool, "head_num", 1),
                    head_dim=getattr(pool, "head_dim", 1), dtype=layout_dtype(str(pool.dtype)),
                    tokens_per_block=pool.page_size,
                    model_id=f"{ident}|layout={pool.layout}|{type(pool).__name__}|bytes=flat-page")


def view_runs(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(address, bytes)`` of a strided tensor's contiguous runs, in its flat (row-major) order."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    run = 1
    while dims and dims[-1][1] == run:  # trailing dims laid out densely make one run
        run *= dims.pop()[0]
    offs = np.zeros(1, np.int64)
    for n, s in dims:
        offs = (offs[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    size = run * t.element_size()
    at = t.data_ptr() + offs * t.element_size()
    first = np.flatnonzero(np.r_[True, at[1:] != at[:-1] + size])  # runs that follow on in memory are one
    return list(zip(at[first].tolist(), (np.diff(np.r_[first, len(at)]) * size).tolist()))


def flat_order(pool: Any) -> np.ndarray | None:
    """Which of a page's zero-copy runs (``get_page_buffer_meta``) hold its flat data page
    (``get_data_page(flat=True)``, the bytes the generic path stores), in that page's order: so
    both paths store the same bytes per page.  MHA pools list a page's runs K, V per layer, while
    its flat page holds every K, then every V; MLA's are in order already.  Derived from host page
    0's unflattened page, a view into the pool.  None when the pool has no such runs (its meta
    raises, or its page is a copy, or other bytes): its pages then move through
    ``get_data_page`` / ``set_from_flat_data_page``."""
    try:
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
        runs = view_runs(pool.get_data_page(0, flat=False))
        column = {(int(p), int(n)): j for j, (p, n) in enumerate(zip(ptrs, sizes))}
    except (NotImplementedError, ValueError, TypeError, AttributeError):
        return None
    order = [column.get(r) for r in runs]
    if None in order or sorted(order) != list(range(len(column))):
        return None
    return np.array(order, np.int64)


class KVSwarmHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.drives = extra.get("drives") or [p for p in os.environ.get("KVSWARM_DRIVES", "").split(",") if p]
        if not self.drives:
            raise ValueError("kvswarm HiCache backend needs 'drives' in the extra config (or KVSWARM_DRIVES)")
        self.config = storage_config
        self.tenant = extra.get("tenant", "")
        self.durable = bool(extra.get("durable", True))
        # Pages per store batch within one batch_get: SGLang's calls are synchronous, so a call's
        # first batches are verified and copied while its later ones are still being read.
        self.read_split = int(extra.get("read_split", 16))
        # Store batches of one call in flight at once (each also within the buffer pool's room).
        self.batches_in_flight = int(extra.get("batches_in_flight", 8))
        for name in ("read_split", "batches_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"kvswarm HiCache backend: {name} must be >= 1, not {getattr(self, name)}")
        self._store_options = dict(
            capacity_per_drive=int(extra.get("capacity_per_drive", 1 << 30)), backend=extra.get("io_backend", "auto"),
            queue_depth=int(extra.get("queue_depth", 32)),
            buffer_pool_bytes=int(extra.get("buffer_pool_bytes", 256 << 20)))
        # MLA's KV is replicated over TP ranks and SGLang backs it up from one writer rank only: the
        # other ranks follow the writer's store (read-only, refreshed as they use it).  "follow"
        # makes every store a follower: a server reading another server's stores on the same drives.
        self.replicated = bool(storage_config.is_mla_model)
        self.follow = bool(extra.get("follow", False))
        self.writer = storage_config.is_storage_writer and not self.follow
        self._shared_dir, self._rank_dir = shared_dir(storage_config), rank_dir(storage_config)
        self._stores: dict[str, KVStore] = {}  # by directory under each drive
        self._opening = threading.Lock()  # SGLang's backup and prefetch threads may both open a store first
        self._healthy: dict[str, int] = {}  # per store: its healthy drives when its unreadable pages were dropped
        self._dropping = threading.Lock()  # one thread drops them, the others wait for it
        self.mem_pool_host = None
        self._orders: dict[int, np.ndarray | None] = {}  # per host pool (by id), see flat_order
        self.keyspace = KeySpace.of("sglang", pool_layout(storage_config, None), self.tenant)
        self.cluster: ClusterPool | None = None
        self._publish = False
        self._republisher: Republisher | None = None
        if extra.get("cluster") is not None:
            cfg = ClusterConfig.from_dict(extra["cluster"])
            if cfg.publish not in ("all", "none"):
                raise ClusterError(f"the SGLang backend's cluster publication is 'all' or 'none', not {cfg.publish!r}")
            self.cluster = ClusterPool(cfg)
            self._publish = cfg.publish == "all" and self.writer
        first = self._store(PoolName.KV)
        if self._publish:
            self._republisher = Republisher(self.cluster, self._written_stores)
        log.info("kvswarm HiCache backend: %d drives, %s%s store, %d pages", len(self.drives),
                 "MLA ranks' shared" if self.replicated else "this rank's",
                 " (written here)" if self.writer else " (followed: written by another process)",
                 len(first) if first else 0)

    def _open(self, sub: str, follow: bool) -> KVStore:
        paths = [os.path.join(d, sub) for d in self.drives]
        if not follow:
            for p in paths:
                os.makedirs(p, exist_ok=True)
        store = KVStore(StoreConfig(drives=paths, follow=follow, **self._store_options))
        # At start-up rather than in the first batch: see BufferPool.populate (SGLang gives its
        # backends no thread to do it in the background).
        store.warm_buffers()
        return store

    def _store(self, pool: str | PoolName = PoolName.KV) -> KVStore | None:
        """The store of ``pool``'s pages on this rank: for MLA models the store their TP ranks
        share, but for TP-sharded Mamba state; otherwise this rank's own.  A follower takes in what
        its writer has flushed (one ``stat`` when nothing); None while the writer has not made its
        store yet.  Once one of its drives has failed, the pages on it are dropped first (see
        ``_drop_unreadable``)."""
        shared = self.replicated and str(pool) != PoolName.MAMBA.value
        sub, follow = (self._shared_dir, not self.writer) if shared else (self._rank_dir, self.follow)
        store = self._stores.get(sub)
        if store is None:
            with self._opening:
                if (store := self._stores.get(sub)) is None:
                    try:
                        store = self._stores[sub] = self._open(sub, follow)
                    except (KVSwarmError, OSError):
                        if not follow:
                            raise
                        return None  # its writer has not made it yet: a miss for now
                    if self._republisher is not None and not follow:
                        self._republisher.want()  # the pages already on its drives
        elif follow:
            store.refresh()
        if sum(store.drive_health()) != self._healthy.get(sub, store.num_drives):
            self._drop_unreadable(sub, store)
        return store

    def _written_stores(self) -> list[KVStore]:
        """The stores open now that this process writes (what it publishes, and re-publishes)."""
        with self._opening:
            return [s for s in self._stores.values() if not s.config.follow]

    def _drop_unreadable(self, sub: str, store: KVStore) -> None:
        """Delete the pages with an extent on a failed drive of ``store``, so existence checks miss on them
        rather than SGLang scheduling reads that fail and then recomputing.  A follower only forgets them: its
        writer may journal more there, which then fail their reads and are deleted."""
        with self._dropping:
            healthy = sum(store.drive_health())
            if healthy == self._healthy.get(sub, store.num_drives):
                return  # another thread dropped them meanwhile
            try:
                dropped = store.drop_unreadable()
            except (KVSwarmError, OSError) as e:  # a journal write: their reads fail and delete them instead
                log.error("kvswarm HiCache backend: dropping the pages on a failed drive failed: %s", e)
                return
            finally:
                self._healthy[sub] = healthy  # tried once per failure, not once per call
        log.warning("kvswarm HiCache backend: %s: %d of %d drives healthy; forgot the %d pages on the failed ones",
                    sub, healthy, store.num_drives, len(dropped))

    @property
    def store(self) -> KVStore | None:
        """The store of the KV pool's pages."""
        return self._store(PoolName.KV)

    # ---- host pools ----------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.keyspace = KeySpace.of("sglang", pool_layout(self.config, mem_pool_host), self.tenant)

    def _key(self, key: str, pool: str | PoolName = PoolName.KV) -> bytes:
        name = str(pool)
        return self.keyspace.key(key if name == PoolName.KV.value else f"{key}.{name}")

    # ---- store plumbing ------------------------------------------------------------
    def _batches(self, store: KVStore, n: int, page_bytes: int, cap: int, submit: Callable[[int, int], Any],
                 finish: Callable[[int, int, Any], None]) -> None:
        """Move pages ``[0, n)`` as store batches ``submit(a, b)`` (a handle), each finished in order
        by ``finish(a, b, handle)``, which releases its buffer lease.  A batch holds at most ``cap``
        pages and what the buffer pool has room for (``page_bytes`` per page, 0: unknown), and no more
        than half the pool: the next one is submitted while it is in flight, and another thread's
        batch finds room.  A batch the pool cannot lease waits for this call's earlier ones, else is
        halved; a page that does not fit on its own fails.  Any other failure fails only that
        batch's pages, and every batch submitted is finished, whatever happens."""
        per = store.object_bytes(page_bytes) if page_bytes else 0
        if per > store.buffer_bytes:
            log.warning("kvswarm HiCache backend: pages of %d B do not fit its buffer pool (buffer_pool_bytes: "
                        "%d B): %d pages fail", page_bytes, store.buffer_bytes, n)
            return
        inflight: deque[tuple[int, int, Any]] = deque()
        pos = 0
        try:
            while pos < n or inflight:
                if pos < n and len(inflight) < self.batches_in_flight:
                    m = store.batch_len(min(cap, n - pos), per, store.buffer_bytes // 2)
                    if m or not inflight:
                        m = max(m, 1)
                        try:
                            inflight.append((pos, pos + m, submit(pos, pos + m)))
                            pos += m
                            continue
                        except BufferPoolExhausted:
                            if not inflight:  # no lease of this call's to wait for
                                if m == 1:
                                    log.warning("kvswarm HiCache backend: no room for a page in the buffer pool "
                                                "(%d B free of %d B)", store.room(), store.buffer_bytes)
                                    pos += 1
                                cap = max(1, m // 2)
                                continue
                        except Exception:  # e.g. no healthy drive: these pages fail, not the backend
                            log.exception("kvswarm HiCache backend: a batch of %d pages failed to submit", m)
                            pos += m
                            continue
                self._finish(finish, *inflight.popleft())  # its lease makes room for the next batch
        finally:
            while inflight:
                self._finish(finish, *inflight.popleft())

    @staticmethod
    def _finish(finish: Callable[[int, int, Any], None], a: int, b: int, handle: Any) -> None:
        try:
            finish(a, b, handle)
        except Exception:  # its pages not yet reported stay failed
            log.exception("kvswarm HiCache backend: a batch of %d pages failed", b - a)

    def _read(self, pool: str | PoolName, keys: Sequence[bytes], into: Sequence[Any] | None = None,
              sink=None, page_bytes: int = 0) -> list[bool]:
        """Read ``keys`` of ``pool``'s pages.  The store copies each verified hit into its ``into``
        buffer, or scatters it over its ``Runs`` in the host pool (see ``KVStore.submit_get``), on
        its native worker without the GIL, which SGLang's scheduler thread holds most of the time;
        ``sink(i, memoryview)`` consumes the hits without one (False: wrong size).  Bad pages are
        deleted; a page that does not fit its target is a miss, and stays.  Batches are sized by
        the largest ``into`` buffer, else by ``page_bytes`` (0: unknown)."""
        ok = [False] * len(keys)
        store = self._store(pool)
        if into is not None:
            page_bytes = max((_nbytes(t) for t in into if t is not None), default=page_bytes)
        if store is None:
            self._from_cluster(pool, keys, list(range(len(keys))), into, sink, ok, page_bytes)
            return ok

        def submit(a: int, b: int):
            return store.submit_get(keys[a:b], None if into is None else into[a:b])

        def finish(a: int, b: int, handle) -> None:
            with handle.wait() as res:
                for i in res.failed:  # corrupt or unreadable: recompute rather than loop on it
                    store.delete(keys[a + i])
                for i, view in enumerate(res.views, a):
                    if view is None:
                        continue
                    if sink is None or (into is not None and into[i] is not None) or sink(i, view) is not False:
                        ok[i] = True

        self._batches(store, len(keys), page_bytes, self.read_split, submit, finish)
        self._from_cluster(pool, keys, [i for i, hit in enumerate(ok) if not hit], into, sink, ok, page_bytes)
        return ok

    def _from_cluster(self, pool: str | PoolName, keys: Sequence[bytes], idx: list[int],
                      into: Sequence[Any] | None, sink, ok: list[bool], page_bytes: int) -> None:
        """Fetch pages ``idx`` (the drives' misses) from the cluster into their targets, as ``_read`` places
        its hits, and write those fetched to this rank's drives (not published again)."""
        if self.cluster is None or not idx:
            return
        if not page_bytes and self.mem_pool_host is not None:
            page_bytes = _nbytes(self.mem_pool_host.get_dummy_flat_data_page())
        if not page_bytes:
            return
        result = self.cluster.fetch([key_digest(keys[i]) for i in idx], page_bytes)
        try:
            got: list[tuple[int, memoryview]] = []
            for i, view in zip(idx, result.views):
                if view is None:  # absent, unreachable or corrupt: recomputed
                    continue
                target = None if into is None else into[i]
                if target is None:
                    placed = sink is not None and sink(i, view) is not False
                else:
                    placed = _place(target, view)
                if placed:
                    ok[i] = True
                    got.append((i, view))
            if got:
                self._write(pool, [keys[i] for i, _ in got], lambda j: got[j][1], page_bytes, publish=False)
        finally:
            result.release()

    def _write(self, pool: str | PoolName, keys: Sequence[bytes], payloads, page_bytes: int,
               publish: bool = True) -> list[bool]:
        """Write ``payloads(i)`` (at most ``page_bytes`` each) for keys not stored yet; durable before
        returning when ``durable``; then published to the cluster (with ``publish``, if it publishes).
        A follower writes nothing (SGLang backs MLA's KV up from its writer rank only; a server
        configured to follow has no store of its own)."""
        store = self._store(pool)
        if store is None or store.config.follow:
            return [False] * len(keys)
        todo = [i for i, k in enumerate(keys) if not store.contains(k)]
        ok = [True] * len(keys)
        for i in todo:
            ok[i] = False

        def submit(a: int, b: int):
            return store.submit_put([(keys[i], payloads(i)) for i in todo[a:b]])

        def finish(a: int, b: int, handle) -> None:
            for i, done in zip(todo[a:b], handle.wait()):
                ok[i] = done

        if todo:
            self._batches(store, len(todo), page_bytes, len(todo), submit, finish)
            if self.durable and any(ok[i] for i in todo):
                self._make_durable(store, keys, todo, ok)
            if publish and self._publish:
                pub = [i for i in todo if ok[i]]
                if pub:  # copied into frames before this returns
                    self.cluster.submit_publish([key_digest(keys[i]) for i in pub], [_flat(payloads(i)) for i in pub])
        return ok

    @staticmethod
    def _make_durable(store: KVStore, keys: Sequence[bytes], todo: list[int], ok: list[bool]) -> None:
        """Flush the pages written.  Those the flush did not make durable (on a drive that failed, or all
        of them when the catalog's sync failed) are deleted and reported failed: held as stored, a retry
        would skip them and report them stored."""
        try:
            store.flush()
            return
        except FlushError as e:  # the other drives and the catalog are synced
            log.error("kvswarm HiCache backend: %s", e)
            gone = set(e.dropped)  # deleted by the store as not durable
            for i in todo:
                if ok[i] and key_digest(keys[i]) in gone:
                    ok[i] = False
            failed: frozenset[int] | None = store.failed_drives()
        except (KVSwarmError, OSError) as e:
            log.error("kvswarm HiCache backend: flush failed: %s", e)
            failed = None
        for i, entry in zip(todo, store.locate([keys[i] for i in todo])):
            if ok[i] and entry is not None and (failed is None or any(x.drive in failed for x in entry.extents)):
                store.delete(keys[i])
                ok[i] = False

    # ---- generic (tensor) interface ------------------------------------------------
    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        dtype = self.mem_pool_host.dtype if self.mem_pool_host is not None else torch.uint8

        def sink(i: int, view: memoryview) -> bool:  # no target: a tensor of its own
            targets[i] = torch.frombuffer(view, dtype=torch.uint8).clone().view(dtype)
            return True

        into = [None if t is None else t.view(-1).view(torch.uint8).numpy() for t in targets]
        ok = self._read(PoolName.KV, [self._key(k) for k in keys], into, sink)
        return [t if hit else None for t, hit in zip(targets, ok)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        if values is None:
            return False
        return all(self._write(PoolName.KV, [self._key(k) for k in keys], lambda i: _tensor_bytes(values[i]),
                               max(map(_nbytes, values), default=0)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        store = self._store(PoolName.KV)
        n = 0
        if store is not None:
            while n < len(keys) and store.contains(self._key(keys[n])):
                n += 1
        if self.cluster is not None and n < len(keys):  # the pages past the drives' prefix
            held = self.cluster.contains([key_digest(self._key(k)) for k in keys[n:]])
            n += next((i for i, h in enumerate(held) if not h), len(held))
        return n

    def _held(self, pool: str | PoolName, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` this rank's drives hold, or else the cluster (one index query for the others)."""
        store = self._store(pool)
        have = [store is not None and store.contains(k) for k in keys]
        far = [i for i, h in enumerate(have) if not h]
        if self.cluster is not None and far:
            for i, h in zip(far, self.cluster.contains([key_digest(keys[i]) for i in far])):
                have[i] = h
        return have

    # ---- pages of a host pool: zero-copy runs where the pool has them, else flat pages ------
    def _flat_order(self, pool) -> np.ndarray | None:
        """The pool's :func:`flat_order`, derived once per pool."""
        key = id(pool)
        if key not in self._orders:
            self._orders[key] = flat_order(pool)
            if self._orders[key] is None:
                log.info("kvswarm HiCache backend: %s (%s) has no zero-copy runs in flat-page order; its pages "
                         "move through get_data_page / set_from_flat_data_page", type(pool).__name__,
                         getattr(pool, "layout", "?"))
        return self._orders[key]

    def _page_runs(self, pool, order: np.ndarray, host_indices: torch.Tensor, n: int) -> list[Runs]:
        """Per page, its runs in the host pool (located with ``get_page_buffer_meta``) in flat-page
        order, as :class:`Runs` of one view over the pool: the store scatters into them and
        gathers from them."""
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        at = np.asarray(ptrs, np.int64).reshape(n, -1)[:, order]
        size = np.asarray(sizes, np.int64).reshape(n, -1)[:, order]
        lo, hi = int(at.min()), int((at + size).max())
        base = memoryview((ctypes.c_char * (hi - lo)).from_address(lo)).cast("B")
        at -= lo
        return [Runs(base, at[p], size[p]) for p in range(n)]

    def _pages(self, pool, keys: Sequence[Any], host_indices: torch.Tensor | None
               ) -> tuple[list[int], list[Runs] | None] | None:
        """Each page's first host index, and its zero-copy runs where the pool has them (else None);
        None (and logged) when the indices do not match the keys."""
        page = getattr(pool, "page_size", 1) or 1
        if host_indices is None or host_indices.numel() != len(keys) * page:
            log.error("kvswarm HiCache backend: %d host indices for %d pages of %d tokens",
                      0 if host_indices is None else host_indices.numel(), len(keys), page)
            return None
        order = self._flat_order(pool)
        runs = None if order is None else self._page_runs(pool, order, host_indices, len(keys))
        return host_indices[::page].tolist(), runs

    def _get_pages(self, name: str | PoolName, pool, keys: list[bytes],
                   host_indices: torch.Tensor | None) -> list[bool]:
        if (pages := self._pages(pool, keys, host_indices)) is None:
            return [False] * len(keys)
        starts, runs = pages
        if runs is not None:
            return self._read(name, keys, runs)
        dummy = pool.get_dummy_flat_data_page()
        nbytes = _nbytes(dummy)

        def sink(i: int, view: memoryview) -> bool:
            if len(view) != nbytes:
                return False
            pool.set_from_flat_data_page(starts[i], torch.frombuffer(view, dtype=torch.uint8).view(dummy.dtype))
            return True

        return self._read(name, keys, sink=sink, page_bytes=nbytes)

    def _put_pages(self, name: str | PoolName, pool, keys: list[bytes],
                   host_indices: torch.Tensor | None) -> list[bool]:
        if (pages := self._pages(pool, keys, host_indices)) is None:
            return [False] * len(keys)
        starts, runs = pages
        if runs is not None:
            return self._write(name, keys, runs.__getitem__, max(map(_nbytes, runs)))  # gathered by the store
        return self._write(name, keys, lambda i: _tensor_bytes(pool.get_data_page(starts[i], flat=True)),
                           _nbytes(pool.get_dummy_flat_data_page()))

    # ---- v1: the anchor (KV) pool ------------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._get_pages(PoolName.KV, self.mem_pool_host, [self._key(k) for k in keys], host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._put_pages(PoolName.KV, self.mem_pool_host, [self._key(k) for k in keys], host_indices)

    # ---- v2: several host pools (hybrid models, sidecar pools) --------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        kv = self.batch_exists(keys)
        hits: dict[str, int] = {PoolName.KV: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or []:
            have = self._held(t.name, [self._key(keys[i], t.name) for i in range(kv)])
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                edge = next((i for i, h in enumerate(have) if not h), kv)
                pool_ok = set(range(1, edge + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                tail = max(1, len(t.keys) if t.keys else 1)
                pool_ok = {n for n in range(1, kv + 1) if all(have[max(0, n - tail):n])}
                edge = max(pool_ok, default=0)
            else:
                raise ValueError(f"kvswarm HiCache backend: unsupported hit policy {t.hit_policy}")
            if edge:
                hits[str(t.name)] = edge
            restorable &= pool_ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._each_transfer(transfers, self._get_pages)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._each_transfer(transfers, self._put_pages)

    def _each_transfer(self, transfers: list[PoolTransfer], run) -> dict[str, list[bool]]:
        """``run(name, pool, keys, host_indices)`` per transfer; one whose pool is not registered fails whole."""
        out = {}
        pools = getattr(self, "registered_pools", {})
        for t in transfers:
            pool = pools.get(t.name) or (self.mem_pool_host if t.name == PoolName.KV else None)
            keys = [self._key(k, t.name) for k in t.keys or []]
            if pool is None:
                log.error("kvswarm HiCache backend: pool %s is not registered", t.name)
                out[t.name] = [False] * len(keys)
            else:
                out[t.name] = run(t.name, pool, keys, t.host_indices)
        return out

    # ---- housekeeping (clear() stays the base no-op: the store is persistent) ---------
    def forget(self, keys: list[str]) -> int:
        """Drop these pages (SGLang 0.5's interface has no delete); returns how many were stored."""
        store = self._store(PoolName.KV)
        if store is None:
            return 0
        n = sum(store.delete_many([self._key(k) for k in keys]))
        try:
            store.flush()  # their space is reused only once the deletes are durable
        except (KVSwarmError, OSError) as e:  # the deletes stand (a failed catalog sync: the next flush frees)
            log.error("kvswarm HiCache backend: flush failed: %s", e)
        return n

    def get_stats(self):
        return None

    def close(self) -> None:
        if self._republisher is not None:
            self._republisher.close()  # before the pool and the stores it uses
            self._republisher = None
        if self.cluster is not None:
            self.cluster.close()  # publications in flight land first (bounded)
            self.cluster = None
        for store in self._stores.values():
            store.close()  # a closed store's close returns at once


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()


def _flat(page: np.ndarray | memoryview | Runs):
    """A page's bytes as one buffer (its runs gathered)."""
    if isinstance(page, Runs):
        return b"".join(page.base[o:o + n] for o, n in zip(page.off.tolist(), page.lens.tolist()))
    return memoryview(page).cast("B")


def _place(target: np.ndarray | Runs, view: memoryview) -> bool:
    """Copy a page fetched from the cluster into its target buffer, or scatter it over its runs; False
    when the sizes differ."""
    if _nbytes(target) != len(view):
        return False
    if isinstance(target, Runs):
        at = 0
        for o, n in zip(target.off.tolist(), target.lens.tolist()):
            target.base[o:o + n] = view[at:at + n]
            at += n
    else:
        memoryview(target).cast("B")[:] = view
    return True


def _nbytes(page: torch.Tensor | np.ndarray | Runs) -> int:
    """A page's bytes: a tensor's, an array's, or its runs' in the host pool."""
    if isinstance(page, Runs):
        return int(page.lens.sum())
    if isinstance(page, torch.Tensor):
        return page.numel() * page.element_size()
    return page.nbytes
