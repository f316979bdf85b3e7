"""kvswarm as an SGLang HiCache storage backend (L3 below SGLang's host-memory pool).

Loaded by ``--hicache-storage-backend dynamic`` with the extra config::

    {"backend_name": "kvswarm", "module_path": "kvswarm.integrations.sglang",
     "class_name": "KVSwarmHiCacheStorage", "interface_v1": 1,
     "drives": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"], "capacity_per_drive": 68719476736, "tenant": ""}

One page is one store object, keyed by SGLang's page hash plus the layout
fingerprint (model, TP/PP rank, host-pool layout, page size, heads, dtype) and the
tenant salt.  A page's bytes are the host pool's flat data page (all K, then all V),
whichever interface moved it, so the zero-copy path (``batch_get_v1`` /
``batch_set_v1``, straight between the pool's K/V runs and the store's aligned buffers)
and the generic tensor path (``get`` / ``batch_get`` / ``set`` / ``batch_set``) read
each other's pages.  Reads are checksummed by the store, and verified pages are copied
into the pool (or the caller's tensors) by its native worker, without the GIL: a bad
page is deleted and reported missing, so SGLang recomputes it.  Each TP/PP rank is its own process and
opens its own store, in a ``rank<tp>-pp<pp>...`` directory on every drive.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
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

from kvswarm.integrations.keys import KeySpace, layout_dtype
from kvswarm.layout import KVLayout
from kvswarm.store import KVStore, Runs, StoreConfig

log = logging.getLogger(__name__)


def rank_dir(cfg: HiCacheStorageConfig) -> str:
    return (f"rank{cfg.tp_rank}of{cfg.tp_size}-pp{cfg.pp_rank}of{cfg.pp_size}"
            f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}-dp{cfg.dp_rank}")


def pool_layout(cfg: HiCacheStorageConfig, pool: Any | None) -> KVLayout:
    """The layout whose fingerprint keys this rank's pages (pool geometry when registered)."""
    ident = (f"sglang:{cfg.model_name}|tp={cfg.tp_rank}/{cfg.tp_size}|pp={cfg.pp_rank}/{cfg.pp_size}"
             f"|cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}|dcp={cfg.dcp_rank}/{cfg.dcp_size}|mla={cfg.is_mla_model}")
    if pool is None:
        return KVLayout(1, 1, 1, "int8", model_id=ident)
    return KVLayout(num_layers=pool.layer_num, num_kv_heads=getattr(pool, "head_num", 1),
                    head_dim=getattr(pool, "head_dim", 1), dtype=layout_dtype(str(pool.dtype)),
                    tokens_per_block=pool.page_size,
                    model_id=f"{ident}|layout={pool.layout}|{type(pool).__name__}")


class KVSwarmHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        drives = extra.get("drives") or [p for p in os.environ.get("KVSWARM_DRIVES", "").split(",") if p]
        if not drives:
            raise ValueError("kvswarm HiCache backend needs 'drives' in the extra config (or KVSWARM_DRIVES)")
        sub = rank_dir(storage_config)
        paths = [os.path.join(d, sub) for d in drives]
        for p in paths:
            os.makedirs(p, exist_ok=True)
        self.config = storage_config
        self.tenant = extra.get("tenant", "")
        self.durable = bool(extra.get("durable", True))
        # Pages per store batch within one batch_get: SGLang's calls are synchronous, so a call's
        # first batches are verified and copied while its later ones are still being read.
        self.read_split = int(extra.get("read_split", 16))
        if self.read_split < 1:
            raise ValueError(f"kvswarm HiCache backend: read_split must be >= 1, not {self.read_split}")
        self.store = KVStore(StoreConfig(
            drives=paths, capacity_per_drive=int(extra.get("capacity_per_drive", 1 << 30)),
            backend=extra.get("io_backend", "auto"), queue_depth=int(extra.get("queue_depth", 32)),
            buffer_pool_bytes=int(extra.get("buffer_pool_bytes", 256 << 20))))
        # At start-up rather than in the first batch_set: see BufferPool.populate (SGLang's backends
        # have no thread of their own to do it in the background).
        self.store.pool.populate()
        self.mem_pool_host = None
        self.keyspace = KeySpace.of("sglang", pool_layout(storage_config, None), self.tenant)
        log.info("kvswarm HiCache backend: %d drives, %d pages, catalog loaded in %.3f s",
                 len(paths), len(self.store), self.store.reopen_seconds)

    # ---- host pools ----------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.keyspace = KeySpace.of("sglang", pool_layout(self.config, mem_pool_host), self.tenant)

    def _key(self, key: str, pool: str | PoolName = PoolName.KV) -> bytes:
        name = str(pool)
        return self.keyspace.key(key if name == PoolName.KV.value else f"{key}.{name}")

    # ---- store plumbing ------------------------------------------------------------
    def _read(self, keys: Sequence[bytes], into: Sequence[Any] | None = None, sink=None) -> list[bool]:
        """Read ``keys``.  The store copies each verified hit into its ``into`` buffer, or scatters
        it over its ``Runs`` in the host pool (see ``KVStore.submit_get``), on its native worker
        without the GIL, which SGLang's scheduler thread holds most of the time; ``sink(i,
        memoryview)`` consumes the hits without one (False: wrong size).  Bad pages are deleted; a
        page that does not fit its target is a miss, and stays."""
        ok = [False] * len(keys)
        step = self.read_split
        handles = [(a, self.store.submit_get(keys[a:a + step], None if into is None else into[a:a + step]))
                   for a in range(0, len(keys), step)]
        for a, h in handles:
            with h.wait() as res:
                for i, view in enumerate(res.views, a):
                    if view is None:
                        continue
                    if sink is None or (into is not None and into[i] is not None) or sink(i, view) is not False:
                        ok[i] = True
                for i in res.failed:  # corrupt or unreadable: recompute rather than loop on it
                    self.store.delete(keys[a + i])
        return ok

    def _write(self, keys: Sequence[bytes], payloads) -> list[bool]:
        """Write ``payloads(i)`` for keys not stored yet; durable before returning when ``durable``."""
        todo = [i for i, k in enumerate(keys) if not self.store.contains(k)]
        ok = [True] * len(keys)
        if todo:
            try:
                done = self.store.put_many([(keys[i], payloads(i)) for i in todo])
            except Exception:  # pool full, no healthy drive: a failed write, not a dead backend
                log.exception("kvswarm HiCache backend: write of %d pages failed", len(todo))
                done = [False] * len(todo)
            for i, d in zip(todo, done):
                ok[i] = d
            if self.durable and any(done):
                self.store.flush()
        return ok

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
        ok = self._read([self._key(k) for k in keys], into, sink)
        return [t if hit else None for t, hit in zip(targets, ok)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        if values is None:
            return False
        return all(self._write([self._key(k) for k in keys], lambda i: _tensor_bytes(values[i])))

    def exists(self, key: str) -> bool:
        return self.store.contains(self._key(key))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        for i, k in enumerate(keys):
            if not self.store.contains(self._key(k)):
                return i
        return len(keys)

    # ---- v1: pages moved straight between the host pool and the store ----------------
    def _page_runs(self, host_indices: torch.Tensor, n: int) -> list[Runs]:
        """Per page, its runs in the host pool (located with ``get_page_buffer_meta``) in flat-page
        order, every K run then every V run, as :class:`Runs` of one view over the pool: the store
        scatters into them and gathers from them."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        at = np.asarray(ptrs, np.int64).reshape(n, -1)
        size = np.asarray(sizes, np.int64).reshape(n, -1)
        # The meta alternates K and V runs; a flat page holds every K run, then every V run.
        at, size = np.hstack([at[:, 0::2], at[:, 1::2]]), np.hstack([size[:, 0::2], size[:, 1::2]])
        lo, hi = int(at.min()), int((at + size).max())
        base = memoryview((ctypes.c_char * (hi - lo)).from_address(lo)).cast("B")
        at -= lo
        return [Runs(base, at[p], size[p]) for p in range(n)]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._read([self._key(k) for k in keys], self._page_runs(host_indices, len(keys)))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        runs = self._page_runs(host_indices, len(keys))
        return self._write([self._key(k) for k in keys], runs.__getitem__)  # gathered by the store

    # ---- v2: several host pools (hybrid models, sidecar pools) --------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        kv = self.batch_exists(keys)
        hits: dict[str, int] = {PoolName.KV: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or []:
            have = [self.store.contains(self._key(keys[i], t.name)) for i in range(kv)]
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
        def get(t: PoolTransfer, pool, offsets: list[int]) -> list[bool]:
            dummy = pool.get_dummy_flat_data_page()
            nbytes = dummy.numel() * dummy.element_size()

            def sink(i: int, view: memoryview) -> bool:
                if len(view) != nbytes:
                    return False
                page = torch.frombuffer(view, dtype=torch.uint8).view(dummy.dtype)
                pool.set_from_flat_data_page(offsets[i], page)
                return True

            return self._read([self._key(k, t.name) for k in t.keys], sink=sink)

        return self._each_transfer(transfers, get)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        def put(t: PoolTransfer, pool, offsets: list[int]) -> list[bool]:
            return self._write([self._key(k, t.name) for k in t.keys],
                               lambda i: _tensor_bytes(pool.get_data_page(offsets[i], flat=True)))

        return self._each_transfer(transfers, put)

    def _each_transfer(self, transfers: list[PoolTransfer], run) -> dict[str, list[bool]]:
        """``run(transfer, pool, offsets)`` per transfer; one whose pool pages are unknown fails whole."""
        out = {}
        for t in transfers:
            pool, offsets = self._pool_pages(t)
            out[t.name] = [False] * len(t.keys or []) if offsets is None else run(t, pool, offsets)
        return out

    def _pool_pages(self, t: PoolTransfer) -> tuple[Any, list[int] | None]:
        pools = getattr(self, "registered_pools", {})
        pool = pools.get(t.name) or (self.mem_pool_host if t.name == PoolName.KV else None)
        keys = t.keys or []
        page = getattr(pool, "page_size", 1) or 1
        if pool is None or t.host_indices is None or t.host_indices.numel() != len(keys) * page:
            log.error("kvswarm HiCache backend: pool %s not registered or indices do not match keys", t.name)
            return pool, None
        return pool, [int(t.host_indices[i * page]) for i in range(len(keys))]

    # ---- housekeeping (clear() stays the base no-op: the store is persistent) ---------
    def forget(self, keys: list[str]) -> int:
        """Drop these pages (SGLang 0.5's interface has no delete); returns how many were stored."""
        n = sum(self.store.delete(self._key(k)) for k in keys)
        self.store.flush()  # their space is reused only once the deletes are durable
        return n

    def get_stats(self):
        return None

    def close(self) -> None:
        if self.store.engine is not None:
            self.store.close()


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
