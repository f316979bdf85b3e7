"""kvswarm as an LMCache storage plugin (``StoragePluginInterface``, LMCache 0.5.6).

LMCache's plugin launcher builds it from configuration (``storage_plugins: ["kvswarm"]`` and
``storage_plugin.kvswarm.module_path`` / ``class_name`` in ``extra_config``; see docs/lmcache.md)
below its local CPU back end.  Each LMCache chunk is one :class:`~kvswarm.store.KVStore` object,
striped over every configured drive, keyed by LMCache's chunk key (``CacheEngineKey.to_string()``)
behind the layout fingerprint and the tenant salt (:mod:`kvswarm.integrations.keys`).  An object
holds the chunk's bytes exactly as LMCache's memory object has them; its geometry on the way back
(tokens, hence shapes) follows from its length and this worker's metadata, which the fingerprint
pins, so a restarted process reads what an earlier one stored with nothing but the store's catalog.

Stores are asynchronous: ``batched_submit_put_task`` queues the chunks (holding a reference on
each memory object) for one writer thread, which writes them in pool-sized batches and flushes
before it reports them (``on_complete_callback``, the returned futures), so a chunk LMCache hears
is stored survives a crash.  Reads land in memory objects from LMCache's CPU allocator: verified
by the store's checksums, then copied there by its native worker (or read there with O_DIRECT and
verified in place when the buffer is 4 KiB-aligned).  A corrupt, torn or unreadable chunk is a
miss and is deleted, so LMCache recomputes it; a failed drive's chunks stop being found.

With ``compression: zstd`` each chunk is stored as a frame of :mod:`kvswarm.codec` (Blosc2's byte
shuffle and zstd), for tiers whose drives, not the CPU, bind: the writer thread encodes, and a read
goes through the store's buffer pool (the stored length is the frame's, not the chunk's) and is
decoded straight into the memory object it then allocates.  The codec is part of the key's layout,
so a process configured otherwise misses on these chunks rather than misreading them.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import os
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvswarm.buffers import BufferPoolExhausted
from kvswarm.codec import Codec, Compression
from kvswarm.errors import FlushError, KVSwarmError
from kvswarm.format import ALIGN, extent_size, key_digest
from kvswarm.integrations.keys import KeySpace, layout_dtype
from kvswarm.integrations.lmcache.settings import PluginSettings
from kvswarm.layout import KVLayout
from kvswarm.store import KVStore, StoreConfig

log = logging.getLogger(__name__)

MODULE_PATH = "kvswarm.integrations.lmcache"
CLASS_NAME = "KVSwarmLMCacheBackend"
# Reads go in batches of one chunk per drive (chunks are placed round-robin), this many with their I/O
# in flight at once: the next batch is submitted as soon as the oldest's reads are back, and the oldest is
# verified while it is read, so a drive never idles on verification (a chunk is many bios already: a
# deeper queue of whole chunks only makes them finish together).
READS_IN_FLIGHT = 2
ROOM_WAIT_S = 5.0  # how long a batch waits for buffer-pool room (other threads' leases) before it fails


@dataclass(frozen=True)
class ChunkGeometry:
    """How a stored chunk's length maps back to the shapes LMCache allocates for it."""

    shapes_of: Callable[[int], list]  # tokens -> shapes (LMCacheMetadata.get_shapes)
    dtypes: list
    fmt: MemoryFormat | None  # None: the CPU allocator's default, as LMCache's cache engine passes
    token_bytes: int
    chunk_tokens: int

    def tokens(self, length: int) -> int | None:
        """Tokens in a chunk of ``length`` bytes; None for a length no chunk of this geometry has."""
        n, rest = divmod(length, self.token_bytes)
        return n if not rest and 0 < n <= self.chunk_tokens else None


def _geometry(metadata: Any) -> ChunkGeometry:
    one = metadata.get_shapes(1)
    dtypes = metadata.get_dtypes()
    token_bytes = sum(math.prod(s) * d.itemsize for s, d in zip(one, dtypes))
    return ChunkGeometry(metadata.get_shapes, dtypes, MemoryFormat.KV_MLA_FMT if metadata.use_mla else None,
                         token_bytes, metadata.chunk_size)


def _layout(metadata: Any, geometry: ChunkGeometry, codec: Codec | None = None) -> KVLayout:
    """The layout whose fingerprint keys this worker's chunks: model, rank, KV shape, dtypes, format,
    and the codec chunks are stored with (none: the chunk's bytes)."""
    layers, _, chunk, heads, head_dim = metadata.kv_shape
    ident = (f"lmcache:{metadata.model_name}|rank={metadata.worker_id}/{metadata.world_size}|mla={metadata.use_mla}"
             f"|shapes={[tuple(s) for s in metadata.get_shapes()]}|dtypes={[str(d) for d in geometry.dtypes]}"
             f"|fmt={geometry.fmt}" + (f"|codec={codec.name}" if codec else ""))
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                    dtype=layout_dtype(str(metadata.kv_dtype)), tokens_per_block=chunk, model_id=ident)


def store_dir(metadata: Any) -> str:
    """This worker's store under each drive: ``lmcache/<model>/rank<w>of<n>`` (a store has one writer
    process, and each tensor-parallel worker is one)."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", metadata.model_name or "").strip("-.") or "model"
    return os.path.join("lmcache", model, f"rank{metadata.worker_id}of{metadata.world_size}")


def _buffer(obj: MemoryObj):
    """The memory object's bytes, writable, without a copy (LMCache's ``byte_array``)."""
    return obj.byte_array


def _in_place(buf: memoryview) -> bool:
    """Whether the store reads a chunk straight into ``buf`` (``submit_get(in_place=True)``: a 4 KiB-aligned
    buffer of whole sectors, the chunk one extent), so its read takes no buffer-pool room."""
    return len(buf) % ALIGN == 0 and ctypes.addressof(ctypes.c_char.from_buffer(buf)) % ALIGN == 0


@dataclass
class _PutJob:
    items: list[tuple[CacheEngineKey, bytes, MemoryObj]]  # LMCache key, store key, memory object (one ref held)
    callback: Callable[[CacheEngineKey], None] | None
    future: Future


class KVSwarmLMCacheBackend(StoragePluginInterface):
    """LMCache chunks in a kvswarm store striped over every configured drive (see the module doc)."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if config is None or metadata is None:
            raise ValueError("kvswarm LMCache plugin: needs LMCache's config and metadata")
        if local_cpu_backend is None:
            raise ValueError("kvswarm LMCache plugin: needs LMCache's local CPU back end (max_local_cpu_size > 0) "
                             "to allocate the chunks it reads")
        if getattr(config, "use_layerwise", False):
            raise ValueError("kvswarm LMCache plugin: use_layerwise is not supported (whole chunks only)")
        self.settings = PluginSettings.from_extra_config(config.extra_config)
        self.geometry = _geometry(metadata)
        self.codec = (Codec(typesize=self.geometry.dtypes[0].itemsize)
                      if self.settings.compression is Compression.ZSTD else None)
        self.keyspace = KeySpace.of("lmcache", _layout(metadata, self.geometry, self.codec), self.settings.tenant)
        paths = [os.path.join(d, store_dir(metadata)) for d in self.settings.drives]
        for p in paths:
            os.makedirs(p, exist_ok=True)
        s = self.settings
        # One extent per chunk: a batch's chunks spread over the drives, and each is read with O_DIRECT
        # straight into LMCache's (4 KiB-aligned) buffer, its payload on sectors of its own.
        chunk_bytes = self.geometry.token_bytes * self.geometry.chunk_tokens
        self.store = KVStore(StoreConfig(drives=paths, capacity_per_drive=s.capacity_per_drive,
                                         backend=s.io_backend, queue_depth=s.queue_depth,
                                         stripe_unit=max(1 << 20, extent_size(chunk_bytes)),
                                         buffer_pool_bytes=s.buffer_pool_bytes))
        self.store.warm_buffers()  # at start-up, not in the first store
        self._lock = threading.Lock()  # the in-flight set and pins
        self._inflight: set[bytes] = set()  # store keys queued or being written
        self._pins: Counter[bytes] = Counter()
        self._healthy = self.store.num_drives  # healthy drives when unreadable chunks were last dropped
        self._dropping = threading.Lock()
        self._puts: queue.SimpleQueue[_PutJob | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._deadline = math.inf  # when close() stops waiting for queued stores
        self._writer = threading.Thread(target=self._write_loop, name="kvswarm-lmcache-put", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvswarm-lmcache-get")
        self._closed = False
        self.counters = Counter()
        log.info("kvswarm LMCache plugin: %d drives, %d chunks stored, %s stores, %s", len(paths), len(self.store),
                 "durable" if s.durable else "unflushed", self.codec.name if self.codec else "uncompressed")

    def __str__(self) -> str:
        return "KVSwarmLMCacheBackend"

    def _key(self, key: CacheEngineKey) -> bytes:
        return self.keyspace.key(key.to_string())

    # ---- lookups -------------------------------------------------------------------
    def _check_drives(self) -> None:
        """Once a drive has failed, forget the chunks with an extent on it (journaled), so lookups miss
        on them rather than LMCache scheduling reads that fail."""
        if sum(self.store.drive_health()) == self._healthy:
            return
        with self._dropping:
            healthy = sum(self.store.drive_health())
            if healthy == self._healthy:
                return
            self._healthy = healthy
            try:
                dropped = self.store.drop_unreadable()
            except (KVSwarmError, OSError) as e:  # their reads fail instead, and delete them
                log.error("kvswarm LMCache plugin: dropping the chunks on a failed drive failed: %s", e)
                return
        log.warning("kvswarm LMCache plugin: %d of %d drives healthy; forgot the %d chunks on the failed ones",
                    healthy, self.store.num_drives, len(dropped))

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Chunks stored, as a prefix of ``keys`` (LMCache's prefix match); ``pin`` pins them."""
        self._check_drives()
        n = 0
        for k in keys:
            sk = self._key(k)
            if not self.store.contains(sk):
                break
            if pin:
                with self._lock:
                    self._pins[sk] += 1
            n += 1
        return n

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return self.batched_contains(keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return self._key(key) in self._inflight

    def pin(self, key: CacheEngineKey) -> bool:
        """Keep ``key`` from a non-forced ``remove``; False when it is not stored."""
        sk = self._key(key)
        if not self.store.contains(sk):
            return False
        with self._lock:
            self._pins[sk] += 1
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        sk = self._key(key)
        with self._lock:
            if self._pins[sk] > 1:
                self._pins[sk] -= 1
            else:
                self._pins.pop(sk, None)
        return self.store.contains(sk)

    def touch_cache(self) -> None:
        """No recency to update: the store keeps every chunk until it is removed."""

    # ---- stores --------------------------------------------------------------------
    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
                                transfer_spec: Any = None,
                                on_complete_callback: Callable[[CacheEngineKey], None] | None = None
                                ) -> list[Future] | None:
        """Queue the chunks not stored or queued yet; returns at once.  The writer thread calls
        ``on_complete_callback(key)`` per chunk once it is stored (and flushed, when durable); the one
        future returned gives, per queued chunk, whether it was stored.  None when nothing was queued."""
        items = []
        with self._lock:
            if self._closing.is_set():
                return None
            for k, obj in zip(keys, objs):
                sk = self._key(k)
                if sk in self._inflight or self.store.contains(sk):
                    continue
                self._inflight.add(sk)
                obj.ref_count_up()  # LMCache's storage manager drops its own reference when this returns
                items.append((k, sk, obj))
        if not items:
            return None
        job = _PutJob(items, on_complete_callback, Future())
        self._puts.put(job)
        return [job.future]

    async def async_batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
                                            transfer_spec: Any = None,
                                            on_complete_callback: Callable[[CacheEngineKey], None] | None = None
                                            ) -> None:
        for f in self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback) or ():
            await asyncio.wrap_future(f)

    def _write_loop(self) -> None:
        stop = False
        while not stop:
            job = self._puts.get()
            jobs = []
            while job is not None:  # every job queued by now is written in one go, with one flush
                jobs.append(job)
                try:
                    job = self._puts.get_nowait()
                except queue.Empty:
                    break
            else:
                stop = True
            if jobs:
                self._write(jobs)

    def _write(self, jobs: list[_PutJob]) -> None:
        items = [it for j in jobs for it in j.items]
        ok = [False] * len(items)
        try:
            if time.monotonic() < self._deadline:
                self._batches([self.store.object_bytes(self.codec.max_frame_bytes(obj.get_size()) if self.codec
                                                       else obj.get_size()) for _, _, obj in items],
                              lambda a, b: self.store.submit_put([(sk, self._payload(obj)) for _, sk, obj in items[a:b]]),
                              lambda a, b, h: ok.__setitem__(slice(a, b), h.wait()))
                if self.settings.durable and any(ok):
                    self._make_durable(items, ok)
        except Exception:  # these chunks fail, the writer goes on
            log.exception("kvswarm LMCache plugin: a store of %d chunks failed", len(items))
        self.counters["stored"] += sum(ok)
        self.counters["store_failed"] += ok.count(False)
        with self._lock:
            for _, sk, _ in items:
                self._inflight.discard(sk)
        for _, _, obj in items:
            obj.ref_count_down()
        pos = 0
        for j in jobs:
            res = ok[pos:pos + len(j.items)]
            pos += len(j.items)
            if j.callback is not None:
                for (key, _, _), done in zip(j.items, res):
                    if done:
                        try:
                            j.callback(key)
                        except Exception:
                            log.exception("kvswarm LMCache plugin: on_complete_callback failed for %s", key)
            j.future.set_result(res)

    def _payload(self, obj: MemoryObj):
        """What the store keeps of a chunk: its bytes, or their frame when compressing."""
        data = _buffer(obj)
        payload = self.codec.encode(data) if self.codec else data
        self.counters["chunk_bytes_written"] += len(data)
        self.counters["stored_bytes_written"] += len(payload)
        return payload

    def _make_durable(self, items: list, ok: list[bool]) -> None:
        """Flush what was written; a chunk the flush did not make durable (its drive failed, or the
        catalog's sync failed) is deleted and fails."""
        try:
            self.store.flush()
            return
        except FlushError as e:
            log.error("kvswarm LMCache plugin: %s", e)
            lost = set(self.store.failed_drives())
        except (KVSwarmError, OSError) as e:
            log.error("kvswarm LMCache plugin: flush failed: %s", e)
            lost = None
        unreadable = set(self.store.unreadable_digests()) if lost else set()
        gone = [i for i, (_, sk, _) in enumerate(items) if ok[i] and (lost is None or key_digest(sk) in unreadable)]
        self.store.delete_many([items[i][1] for i in gone])
        for i in gone:
            ok[i] = False

    def _batches(self, costs: list[int], submit: Callable[[int, int], Any],
                 finish: Callable[[int, int, Any], None], per_batch: int = 0, in_flight: int = 2,
                 reads_back: Callable[[Any], None] | None = None) -> None:
        """Move objects ``[0, len(costs))`` as store batches, ``costs`` being each one's buffer-pool
        bytes (0: read in place), at most half the pool and ``per_batch`` objects (0: any) a batch,
        ``in_flight`` of them at once: ``submit(a, b)`` gives a handle, ``finish(a, b, handle)`` takes
        its outcome, in order.  With ``reads_back(handle)`` (returns once the handle's I/O is back),
        a batch counts as in flight until its I/O is back rather than until it is finished: the next
        batch is submitted before the oldest is verified, so the drives do not idle meanwhile.  A
        batch the pool has no room for (other threads' leases) waits for this call's earlier batch,
        else is halved, else (one object) waits up to ROOM_WAIT_S for room, else fails."""
        cap = max(1, self.store.buffer_bytes // 2)
        todo: list[tuple[int, int]] = []
        a, acc = 0, 0
        for i, c in enumerate(costs):
            if i > a and (acc + c > cap or (per_batch and i - a >= per_batch)):
                todo.append((a, i))
                a, acc = i, 0
            acc += c
        if costs:
            todo.append((a, len(costs)))
        todo.reverse()  # a stack: halves go back on top
        inflight: list[tuple[int, int, Any]] = []  # oldest first; with reads_back, the head may be verifying
        back = 0  # 1 when the head of inflight has its I/O back and waits to be finished
        waited: float | None = None
        try:
            while todo:
                a, b = todo.pop()
                try:
                    inflight.append((a, b, submit(a, b)))
                    waited = None
                except BufferPoolExhausted:
                    if inflight:
                        finish(*inflight.pop(0))
                        back = 0
                        todo.append((a, b))
                    elif b - a > 1:
                        m = (a + b) // 2
                        todo += [(m, b), (a, m)]
                    else:
                        waited = waited or time.monotonic()
                        if time.monotonic() - waited > ROOM_WAIT_S:
                            raise
                        time.sleep(0.001)
                        todo.append((a, b))
                    continue
                if back:  # verified while the batch just submitted is being read
                    finish(*inflight.pop(0))
                    back = 0
                if len(inflight) >= in_flight:
                    if reads_back is None:
                        finish(*inflight.pop(0))
                    else:
                        reads_back(inflight[0][2])
                        back = 1
        finally:
            while inflight:
                finish(*inflight.pop(0))

    # ---- reads ---------------------------------------------------------------------
    def _read(self, keys: list[CacheEngineKey], busy_loop: bool) -> list[MemoryObj | None]:
        """Read ``keys`` into memory objects of LMCache's CPU allocator; None per miss.  A chunk that
        reads back corrupt or not at all is deleted: a miss now and at the next lookup."""
        self._check_drives()
        out = (self._read_in_place if self.codec is None else self._read_frames)(keys, busy_loop)
        hits = sum(o is not None for o in out)
        self.counters["hits"] += hits
        self.counters["misses"] += len(keys) - hits
        return out

    def _drop(self, sk: bytes) -> None:
        """A chunk that read back corrupt, not at all, or not as a chunk of this geometry."""
        self.counters["corrupt_or_unreadable"] += 1
        self.store.delete(sk)

    def _read_in_place(self, keys: list[CacheEngineKey], busy_loop: bool) -> list[MemoryObj | None]:
        """:meth:`_read` of uncompressed chunks: each read straight into its memory object."""
        out: list[MemoryObj | None] = [None] * len(keys)
        want: list[tuple[int, bytes, MemoryObj]] = []
        for i, k in enumerate(keys):
            sk = self._key(k)
            n = self.store.length(sk)
            tokens = None if n is None else self.geometry.tokens(n)
            if tokens is None:
                continue
            obj = self.local_cpu_backend.allocate(self.geometry.shapes_of(tokens), self.geometry.dtypes,
                                                  self.geometry.fmt, busy_loop=busy_loop)
            if obj is None:
                log.warning("kvswarm LMCache plugin: LMCache's CPU allocator is full: %d chunks not read",
                            len(keys) - i)
                break
            want.append((i, sk, obj))
        bufs = [_buffer(obj) for _, _, obj in want]
        settled = [False] * len(want)

        def finish(a: int, b: int, handle) -> None:
            with handle.wait() as res:
                bad = set(res.failed)
                for j, view in enumerate(res.views):
                    i, sk, obj = want[a + j]
                    settled[a + j] = True
                    if view is not None:
                        out[i] = obj
                        continue
                    obj.ref_count_down()
                    if j in bad:
                        self._drop(sk)

        try:
            self._batches([0 if _in_place(b) else self.store.object_bytes(len(b)) for b in bufs],
                          lambda a, b: self.store.submit_get([sk for _, sk, _ in want[a:b]], bufs[a:b], in_place=True),
                          finish, per_batch=self.store.num_drives, in_flight=READS_IN_FLIGHT,
                          reads_back=self._reads_back)
        except Exception:  # the chunks of the batches not read go back to LMCache's allocator, as misses
            log.exception("kvswarm LMCache plugin: a read of %d chunks failed", len(want))
            for (_, _, obj), done in zip(want, settled):
                if not done:
                    obj.ref_count_down()
        return out

    def _read_frames(self, keys: list[CacheEngineKey], busy_loop: bool) -> list[MemoryObj | None]:
        """:meth:`_read` of chunks stored as frames: each is read into the store's pool and verified
        there, then its memory object is allocated (its length is in the frame's header) and the frame
        decoded into it.  A frame that does not decode to a chunk of this geometry is deleted too."""
        out: list[MemoryObj | None] = [None] * len(keys)
        want = [(i, sk, n) for i, k in enumerate(keys) if (n := self.store.length(sk := self._key(k))) is not None]
        full = False

        def finish(a: int, b: int, handle) -> None:
            nonlocal full
            with handle.wait() as res:
                bad = set(res.failed)
                for j, view in enumerate(res.views):
                    i, sk, _ = want[a + j]
                    if view is None:
                        if j in bad:
                            self._drop(sk)
                        continue
                    length = Codec.decoded_length(view)
                    tokens = None if length is None else self.geometry.tokens(length)
                    if tokens is None:
                        self._drop(sk)
                        continue
                    obj = None if full else self.local_cpu_backend.allocate(
                        self.geometry.shapes_of(tokens), self.geometry.dtypes, self.geometry.fmt, busy_loop=busy_loop)
                    if obj is None:
                        if not full:
                            log.warning("kvswarm LMCache plugin: LMCache's CPU allocator is full: chunks not read")
                        full = True
                        continue
                    if self.codec.decode_into(view, _buffer(obj)):
                        out[i] = obj
                    else:
                        obj.ref_count_down()
                        self._drop(sk)

        try:
            self._batches([self.store.object_bytes(n) for _, _, n in want],
                          lambda a, b: self.store.submit_get([sk for _, sk, _ in want[a:b]]),
                          finish, per_batch=self.store.num_drives, in_flight=READS_IN_FLIGHT,
                          reads_back=self._reads_back)
        except Exception:  # the chunks not decoded are misses
            log.exception("kvswarm LMCache plugin: a read of %d chunks failed", len(want))
        return out

    def _reads_back(self, handle) -> None:
        """Returns once ``handle``'s reads are all back (taking the store's I/O completions meanwhile)."""
        while not handle.reads_back:
            self.store.progress(0.05)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self._read([key], busy_loop=True)[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return self._read(list(keys), busy_loop=True)

    def get_non_blocking(self, key: CacheEngineKey, location: str | None = None) -> Future | None:
        if not self.store.contains(self._key(key)):
            return None
        return self._readers.submit(lambda: self._read([key], busy_loop=False)[0])

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        """The chunks read, as a prefix of ``keys`` (LMCache's prefetch counts chunks up to the first
        miss); each returned object pinned, as LMCache's disk back end hands them over.  The keys'
        pins from the lookup are released."""
        objs = await asyncio.wrap_future(self._readers.submit(self._read, list(keys), False))
        out = []
        for obj in objs:
            if obj is None:
                break
            obj.pin()
            out.append(obj)
        for obj in objs[len(out):]:
            if obj is not None:
                obj.ref_count_down()
        for k in keys:
            self.unpin(k)
        return out

    # ---- removal -------------------------------------------------------------------
    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Delete ``key`` (journaled; durable at the next store's flush); a pinned chunk only when
        ``force``."""
        sk = self._key(key)
        with self._lock:
            if not force and self._pins.get(sk):
                return False
            self._pins.pop(sk, None)
        return self.store.delete(sk)

    def get_allocator_backend(self):
        return self.local_cpu_backend

    # ---- shut-down -----------------------------------------------------------------
    def close(self) -> None:
        """Write what is queued, flush and close the store, all within ``close_timeout`` seconds:
        stores still queued at the deadline are dropped (reported not stored), and a store whose
        drives do not answer is left to the process's exit (logged), never waited for."""
        if self._closed:
            return
        self._closed = True
        t_end = time.monotonic() + self.settings.close_timeout
        with self._lock:
            self._closing.set()
        self._deadline = t_end - self.settings.close_timeout / 4  # leaves time for the final flush below
        self._puts.put(None)
        self._writer.join(max(0.0, t_end - time.monotonic()))
        self._readers.shutdown(wait=False, cancel_futures=True)
        if self._writer.is_alive():
            log.error("kvswarm LMCache plugin: stores still in flight after %.1f s; the store is left open",
                      self.settings.close_timeout)
            return
        closer = threading.Thread(target=self._close_store, name="kvswarm-lmcache-close", daemon=True)
        closer.start()
        closer.join(max(0.0, t_end - time.monotonic()))
        if closer.is_alive():
            log.error("kvswarm LMCache plugin: closing the store took over %.1f s; left to finish on its own",
                      self.settings.close_timeout)

    def _close_store(self) -> None:
        try:
            self.store.close()
        except (KVSwarmError, OSError) as e:
            log.error("kvswarm LMCache plugin: closing the store: %s", e)
