"""KVStore: open, put, get, flush, delete, health, poll.

Reads and writes are batched and asynchronous: ``submit_get`` / ``submit_put`` return a
handle (:mod:`kvswarm.store.handles`) at once; ``poll()`` / ``wait()`` on it drive completions.  ``get_many`` and
``put_many`` are the blocking forms.  A read whose header or checksum does not match
is a counted miss, never data (the checks: :mod:`kvswarm.store.verify`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
import uuid
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvswarm.allocator import ExtentAllocator
from kvswarm.buffers import BufferPool, BufferPoolExhausted, Lease
from kvswarm.catalog import CHECKPOINT, JOURNAL, Catalog, Entry, Extent, ExtentTable
from kvswarm.drive import Drive, failed_drive, format_drive, open_drive
from kvswarm.errors import (
    ConfigError,
    DriveError,
    DriveFull,
    DriveUnavailable,
    FlushError,
    KVSwarmError,
)
from kvswarm.format import (
    ALIGN,
    HEADER_SIZE,
    KEY_DIGEST,
    expected_headers,
    extent_size,
    key_digest,
    sector_payload,
)
from kvswarm.io import IOEngine, IORequest, Op, make_engine
from kvswarm.io import native as native_io
from kvswarm.metrics import DriveStats, registry_for
from kvswarm.placement import DriveView, make_placement
from kvswarm.store import delivery, shape, staging, verify
from kvswarm.store.config import StoreConfig, device_queue_depth
from kvswarm.store.handles import GetHandle, GetResult, NativeGetHandle, PutHandle
from kvswarm.store.meta_dir import (
    MANIFEST,
    lock_writer,
    prepare_meta_dir,
    read_manifest,
    unfinished_store,
    write_manifest,
)
from kvswarm.store.quarantine import SETTLE_S, Quarantine
from kvswarm.store.runs import Bufs, as_bufs, bufs_len, part_of, sized
from kvswarm.store.space import rebuild_allocators
from kvswarm.store.verify import Check, Reads, hand_over

log = logging.getLogger(__name__)
MAX_PARTS = 0xFFFF  # an extent header's part count is a u16
MAX_OBJECT = 0xFFFFFFFF  # and its object length a u32


@dataclass(frozen=True)
class DriveHealth:
    """A drive's state as :meth:`KVStore.health` reports it."""

    index: int
    path: str
    healthy: bool
    reason: str  # why it is out of service ("" while healthy)
    full: bool = False  # ENOSPC met: no new writes until the store reopens


class KVStore:
    """Objects (bytes keys -> bytes payloads) striped over a set of drives, verified on every read,
    durable on :meth:`flush`.

    **Submit, then poll.**  :meth:`submit_put` and :meth:`submit_get` queue one batch of I/O and
    return a :class:`PutHandle` / :class:`GetHandle` at once; they block only to lease buffer pool
    space (raising :class:`~kvswarm.buffers.BufferPoolExhausted` when a batch cannot have it) and,
    for a put, when free space waits on a flush (:class:`~kvswarm.errors.DriveFull` when no drive
    has room).  ``handle.done`` never makes a system call;
    ``handle.poll()``, :meth:`poll` and :meth:`progress` take completions in; ``handle.wait()``
    returns the outcome.  ``get_many`` / ``put_many`` / ``get`` / ``put`` are the blocking forms.

    **What wait() gives and raises.**  ``PutHandle.wait()`` returns, per item, whether it is stored
    (a failed write, a full or failed drive: ``False``, never an exception).  ``GetHandle.wait()``
    returns a :class:`GetResult` whose misses are ``None``: a key not stored, or stored and read
    back short, torn, corrupt or from a drive out of service (listed in ``GetResult.failed``).
    Wrong bytes are never returned as data.  ``wait()`` raises only when the machinery fails (the
    I/O engine or a verify pass raising, e.g. ``OSError``); the batch's buffers and extents then go
    back to the pool once none of its I/O can still touch them, and waiting again raises
    :class:`~kvswarm.errors.KVSwarmError`.  Operations on a closed store raise ``KVSwarmError``;
    bad arguments raise :class:`~kvswarm.errors.ConfigError`.

    **Buffers.**  A put copies its payloads into the store's pool before ``submit_put`` returns:
    the caller may reuse them at once.  A ``GetResult``'s views lie in one pool lease and stay
    valid until ``release()`` (or its ``with`` block ends); drop arrays made from them first.
    ``into=`` buffers stay the caller's: a hit's verified payload is copied there (or, with
    ``in_place=True``, read there directly); a miss leaves them as they were, except an
    ``in_place`` buffer, which may then hold unverified bytes.

    **Threads.**  Several threads may submit, poll and wait on one store at once; a handle is
    finished by one thread.  Completions are taken in by whichever thread polls; the native
    verify worker checks payloads off the GIL.  ``close()`` must not race other calls.

    **Durability.**  An object is in the catalog once its put's ``wait()`` returned ``True``, and
    survives a crash once a later :meth:`flush` has returned (fdatasync of the drives, then the
    catalog's journal).  A drive that fails before then is named in the
    :class:`~kvswarm.errors.FlushError` that ``flush()`` raises, and what was written to it since
    the last flush is deleted.  One process writes a store (an ``flock``); others read it with
    ``StoreConfig(follow=True)`` and :meth:`refresh`.
    """

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.queue_depth = config.queue_depth or device_queue_depth(config.drives)  # per drive
        meta = config.meta_dir or next((p for p in config.drives if os.path.isdir(p)), None)
        for p in config.drives:
            # A drive gone from an existing store leaves it open without that drive (see _open_drives).
            if not os.path.exists(p) and not (meta and os.path.exists(os.path.join(meta, MANIFEST))):
                raise DriveError(f"drive path {p!r} does not exist")
            if os.path.exists(p) and not (os.path.isdir(p) or stat.S_ISBLK(os.stat(p).st_mode)):
                raise DriveError(f"drive path {p!r} is neither a directory nor a block device")
        if meta is None:
            raise KVSwarmError("all drives are block devices: set StoreConfig.meta_dir for the catalog")
        self.meta_dir = meta
        prepare_meta_dir(meta, self._creates, config.follow)
        self._writer_lock = -1 if config.follow else lock_writer(meta, self._creates)
        kinds = config.drive_kinds or ["ssd"] * len(config.drives)
        self.drives: list[Drive] = []
        made: list[str] = []  # files this open made, removed if it fails (a new store's data files)
        new = False
        try:
            manifest = read_manifest(meta, config.drives, self._creates)
            new = manifest is None
            if new:
                self.store_uuid = unfinished_store(meta, config.drives) or uuid.uuid4().bytes
            else:
                self.store_uuid = manifest
            self._open_drives(kinds, new, made)
            t0 = time.perf_counter()
            self.catalog = Catalog(meta, config.checkpoint_every, follow=config.follow, create=new)
            if new:
                made += [os.path.join(meta, f) for f in (JOURNAL, CHECKPOINT)]
            # A follower allocates nothing, but reports free space as of its open.
            rebuild_allocators(self.catalog, self.drives)
            self.reopen_seconds = time.perf_counter() - t0
            plain = make_engine(config.backend, self.queue_depth, config.single_thread_io)
            self.engine: IOEngine = plain if config.wrap_engine is None else config.wrap_engine(plain)
            for d in self.drives:
                if d.fd >= 0:
                    self.engine.attach(d.index, d.fd, d.stats)
            self.native: native_io.NativeIO | None = None
            if self.engine is plain and native_io.enabled(config.native_io):  # unwrapped: nothing paces it
                self.native = native_io.NativeIO(self.queue_depth, config.single_thread_io)
                for d in self.drives:
                    if d.fd >= 0:
                        self.native.attach(d.index, d.fd, d.stats)
            self.placement = make_placement(config.placement)
            self.pool = BufferPool(config.buffer_pool_bytes)
            if new:  # the store exists once its manifest does: written last
                for d in self.drives:
                    if d.needs_format:
                        format_drive(d, self.store_uuid)
                write_manifest(meta, self.store_uuid, config.drives, config.stripe_unit)
        except BaseException:  # e.g. io_uring refused, a bad backend name: nothing stays held, not even the lock
            if getattr(self, "engine", None) is not None:
                self.engine.close()
            if getattr(self, "native", None) is not None:
                self.native.close()
            if getattr(self, "catalog", None) is not None:
                with contextlib.suppress(KVSwarmError, OSError):
                    self.catalog.close()
            for d in self.drives:
                d.close()
            if new:  # nothing of a store that was never made stays to block the corrected retry
                for f in made:
                    with contextlib.suppress(OSError):
                        os.unlink(f)
            self._unlock_writer()
            raise
        self._lock = threading.Lock()
        self._deferred: list[Entry] = []  # extents to free at the next flush
        self._written: set[int] = set()  # drives that took writes since they were last synced
        self._not_durable: set[int] = set()  # drives failed holding unsynced writes, for flush() to report
        self._synced_gen = self.catalog.next_generation  # objects from this generation on await a flush
        self._dropped: list[bytes] = []  # digests deleted as not durable, for flush() to report
        # quarantined: failed batches whose buffers were held back, their I/O not confirmed over
        self.counters = {"gets": 0, "hits": 0, "misses": 0, "corrupt": 0, "puts": 0, "put_failures": 0,
                         "quarantined": 0}
        self._verifying: deque = deque()  # batches with the native verify worker, oldest first
        self.quarantine = Quarantine(self._poll_batch, self._free, self.counters)

    def _unlock_writer(self) -> None:
        if self._writer_lock >= 0:
            os.close(self._writer_lock)  # releases the flock
            self._writer_lock = -1

    @property
    def _creates(self) -> bool:
        return self.config.create and not self.config.follow

    @classmethod
    def open(cls, drives: Sequence[str], **kw) -> KVStore:
        return cls(StoreConfig(drives=list(drives), **kw))

    # ---- setup -----------------------------------------------------------------------
    def _open_drives(self, kinds: list[str], new: bool, made: list[str]) -> None:
        """Open every drive.  A drive of an existing store that cannot be read is left out of service
        (logged, and listed by :meth:`health`): the store opens with the others.  A new store, or one
        none of whose drives opens, is refused."""
        config = self.config
        for i, p in enumerate(config.drives):
            try:
                d = open_drive(i, p, self.store_uuid, config.capacity_per_drive, new, kinds[i], made)
            except DriveUnavailable as e:
                if new:
                    raise
                log.error("store at %s opens without drive %d (%s): %s", self.meta_dir, i, p, e)
                d = failed_drive(i, p, kinds[i], str(e))
            self.drives.append(d)
        if not any(d.healthy for d in self.drives):
            raise DriveError("no drive of the store can be opened: " + "; ".join(d.reason for d in self.drives))

    # ---- writes ----------------------------------------------------------------------
    def _views(self) -> list[DriveView]:
        return [DriveView(d.index, d.free_bytes, d.healthy, d.kind) for d in self.drives if d.healthy]

    def object_bytes(self, length: int) -> int:
        """Bytes an object of ``length`` takes: its extents (headers, payload, alignment) on the
        drives, and its lease in the buffer pool while it is written or read."""
        unit = self.config.stripe_unit - HEADER_SIZE
        full, rest = divmod(length, unit)
        return full * extent_size(unit) + (extent_size(rest) if rest or not full else 0)

    def submit_put(self, items: Sequence[tuple[bytes, object]], hints: Sequence[object] | None = None) -> PutHandle:
        """Write ``(key, data)`` items; returns at once. Raises DriveFull when the pool has no room.

        ``data`` is bytes-like, or :class:`Runs` gathered in order (an engine page's runs, copied
        straight into the store's buffers)."""
        self._check_open()
        if self.config.follow:
            raise KVSwarmError("this store follows another process's: only its writer puts")
        if hints is not None and len(hints) != len(items):
            raise ConfigError(f"{len(hints)} placement hints for {len(items)} items")
        unit = self.config.stripe_unit - HEADER_SIZE
        mvs = [as_bufs(data) for _, data in items]
        lens = [bufs_len(mv) for mv in mvs]
        if max(lens, default=0) > min(MAX_OBJECT, MAX_PARTS * unit):  # the header: u32 length, u16 part count
            key, n = next((k, n) for (k, _), n in zip(items, lens) if n > min(MAX_OBJECT, MAX_PARTS * unit))
            raise ConfigError(f"object {key[:32]!r} of {n} B is too large: at most {MAX_OBJECT} B and "
                              f"{MAX_PARTS} parts of stripe_unit - 64 = {unit} B")
        # One extent per object (most batches): their sizes at once, for the lease and the allocation.
        single = np.fromiter(lens, np.int64, len(lens))
        single = (single + (HEADER_SIZE + ALIGN - 1)) // ALIGN * ALIGN if (single <= unit).all() else None
        lease = self._lease(int(single.sum()) if single is not None else sum(map(self.object_bytes, lens)))
        try:
            objs, cols, srcs = self._allocate_extents(items, hints, mvs, lens, unit,
                                                      None if single is None else single.tolist())
        except BaseException:
            lease.release()
            raise
        stage = staging.stage_native if self.native is not None else staging.stage_python
        try:
            staged, writes = stage(objs, cols, srcs, lease)
        except BaseException:  # every extent taken goes back
            self._free(Entry(0, 0, tuple(Extent(d, o, ln, 0) for d, o, ln, _ in cols)))
            lease.release()
            raise
        if self.native is not None:
            batch = self.native.submit(Op.WRITE, lease.pool.array, *writes)
            return PutHandle(self, batch, (staged, batch, lease))
        return PutHandle(self, self.engine.submit(writes, checked=True), (staged, writes, lease))

    def _allocate_extents(self, items: Sequence[tuple[bytes, object]], hints: Sequence[object] | None,
                          mvs: list[Bufs], lens: list[int], unit: int, single: list[int] | None
                          ) -> tuple[list[tuple[bytes, int, int, int]], list[tuple[int, int, int, int]], list[Bufs]]:
        """Place and allocate every extent of a put batch (``single``: each object's one extent size,
        when every object has one): per object (digest, generation, length, parts); per extent (drive,
        offset, extent bytes, payload bytes) and its payload's source.  On an error (DriveFull in a
        later part) every extent taken so far goes back."""
        views = self._placement_views()  # once per batch; _alloc spills if a drive fills meanwhile
        allocs = [d.alloc for d in self.drives]
        gen0 = self.catalog.new_generations(len(items))
        if single is not None:
            return self._allocate_single(items, hints, mvs, lens, single, views, allocs, gen0)
        place = self.placement.place
        objs: list[tuple[bytes, int, int, int]] = []
        cols: list[tuple[int, int, int, int]] = []
        srcs: list[Bufs] = []
        try:
            for j, ((key, _), mv, n) in enumerate(zip(items, mvs, lens)):
                digest = KEY_DIGEST(key)
                parts = max(1, -(-n // unit))
                targets = place(digest, parts, views, hints[j] if hints else None)
                for part in range(parts):
                    chunk = part_of(mv, part * unit, unit) if parts > 1 else mv
                    c = min(unit, n - part * unit)
                    ext_len = extent_size(c)
                    drv = targets[part]
                    off = allocs[drv].alloc(ext_len)
                    if off is None:  # the chosen drive is full: spill (or make deferred frees durable)
                        drv, off = self._alloc(drv, ext_len)
                    cols.append((drv, off, ext_len, c))
                    srcs.append(chunk)
                objs.append((digest, gen0 + j, n, parts))
        except BaseException:
            self._free(Entry(0, 0, tuple(Extent(d, o, ln, 0) for d, o, ln, _ in cols)))
            raise
        return objs, cols, srcs

    def _allocate_single(self, items: Sequence[tuple[bytes, object]], hints: Sequence[object] | None,
                         mvs: list[Bufs], lens: list[int], single: list[int], views: list[DriveView],
                         allocs: list[ExtentAllocator], gen0: int
                         ) -> tuple[list[tuple[bytes, int, int, int]], list[tuple[int, int, int, int]], list[Bufs]]:
        """:meth:`_allocate_extents` for a batch of one-extent objects: placed in one strategy call and
        allocated in one allocator call per drive."""
        digests = [KEY_DIGEST(key) for key, _ in items]
        drvs = self.placement.place_many(digests, views, hints)
        offs: list[int | None] = [None] * len(items)
        on: dict[int, list[int]] = {}  # drive -> the objects placed on it
        for j, d in enumerate(drvs):
            on.setdefault(d, []).append(j)
        try:
            for d, js in on.items():
                for j, off in zip(js, allocs[d].alloc_many([single[j] for j in js])):
                    offs[j] = off
            for j in [j for j, off in enumerate(offs) if off is None]:  # a chosen drive is full: spill
                drvs[j], offs[j] = self._alloc(drvs[j], single[j])
        except BaseException:  # every extent taken goes back
            self._free(Entry(0, 0, tuple(Extent(d, o, ln, 0) for d, o, ln in zip(drvs, offs, single)
                                         if o is not None)))
            raise
        objs = [(digest, gen0 + j, n, 1) for j, (digest, n) in enumerate(zip(digests, lens))]
        return objs, list(zip(drvs, offs, single, lens)), mvs

    def put_many(self, items: Sequence[tuple[bytes, object]], hints: Sequence[object] | None = None) -> list[bool]:
        return self.submit_put(items, hints).wait()

    def put(self, key: bytes, data: object, hint: object = None) -> bool:
        return self.put_many([(key, data)], [hint])[0]

    def _placement_views(self) -> list[DriveView]:
        views = [v for v in self._views() if v.free_bytes >= ALIGN]
        if not views and self._deferred:
            self._sync()
            views = [v for v in self._views() if v.free_bytes >= ALIGN]
        if not views:
            raise DriveFull("no healthy drive has free space")
        return views

    def _alloc(self, drive: int, nbytes: int) -> tuple[int, int]:
        """(drive, offset) of a new extent: on the chosen drive, else spilled to the emptiest."""
        off = self.drives[drive].alloc.alloc(nbytes)
        if off is not None:
            return drive, off
        for d in sorted(self.drives, key=lambda d: -d.free_bytes):
            if d.healthy and not d.full and (off := d.alloc.alloc(nbytes)) is not None:
                return d.index, off
        if self._deferred:  # space waits on a flush: make the frees durable, then retry
            self._sync()
            return self._alloc(drive, nbytes)
        raise DriveFull(f"no drive has {nbytes} B free (pool full)")

    def _finish_put(self, staged: tuple[list[tuple[bytes, Entry, int]], list[IORequest] | native_io.NativeBatch,
                                        Lease]) -> list[bool]:
        items, io, lease = staged
        try:
            landed = self._all_landed(io)
            if isinstance(items, staging.Singles) and landed and self.catalog.put_new_singles(
                    items.digests, items.generation, items.payload_len, items.drive, items.offset, items.length,
                    items.csum):  # most batches: new one-extent objects, recorded as columns
                self.counters["puts"] += len(items)
                with self._lock:
                    self._written.update(np.unique(items.drive).tolist())
                return [True] * len(items)
            done, out = self._landed(items, io, landed)
            # may raise (a journal write failed): the lease still goes
            self._free_after_flush(self.catalog.put_many(done))
            self.counters["puts"] += len(done)
            with self._lock:
                self._written.update(drv for _, e in done for drv, _, _, _ in e.extents)
        finally:
            lease.release()
        return out

    def _landed(self, items: list[tuple[bytes, Entry, int]], io: list[IORequest] | native_io.NativeBatch,
                all_landed: bool) -> tuple[list[tuple[bytes, Entry]], list[bool]]:
        """The objects of a finished put batch whose every extent landed on a drive still in service,
        and per object whether it did; the others' extents go back (a full or failed drive noted).
        ``all_landed``: ``_all_landed(io)``, which the caller has asked already."""
        if isinstance(io, native_io.NativeBatch):
            if all_landed:  # most batches
                return [(digest, entry) for digest, entry, _ in items], [True] * len(items)
            drives, offsets = io.drive.tolist(), io.offset.tolist()
            lengths, results = io.length.tolist(), io.res.tolist()
        else:
            drives, offsets = [r.drive for r in io], [r.offset for r in io]
            lengths, results = [len(r.buf) for r in io], [r.result for r in io]
        out = []
        done: list[tuple[bytes, Entry]] = []
        k = 0
        for digest, entry, parts in items:
            ok = True
            for x in range(k, k + parts):
                drv, res = drives[x], results[x]
                if res == -errno.ENOSPC:  # a thin volume out of space: full, not failed
                    d = self.drives[drv]
                    d.nospc += 1
                    d.mark_full(f"a write at {offsets[x]}")
                    ok = False
                elif res != lengths[x]:
                    self._io_error(drv, offsets[x], res)
                    ok = False
                elif not self.drives[drv].healthy:  # failed while it was written: never readable
                    ok = False
            k += parts
            if ok:
                done.append((digest, entry))
            else:
                self._free(entry)
                self.counters["put_failures"] += 1
            out.append(ok)
        return done, out

    def _all_landed(self, io: list[IORequest] | native_io.NativeBatch) -> bool:
        """A native batch whose every write landed whole on a drive still in service."""
        return (isinstance(io, native_io.NativeBatch) and bool((io.res == io.length).all())
                and all(self.drives[d].healthy for d in np.unique(io.drive).tolist()))

    def _free(self, e: Entry) -> None:
        for drv, off, ln, _ in e.extents:
            if (a := self.drives[drv].alloc) is not None:  # a drive unreadable since the open has none
                a.release(off, ln)

    def _lease(self, nbytes: int) -> Lease:
        """A pool lease for a new batch.  Batches in quarantine give their buffers back first, once their
        I/O is over: checked in passing, waited for (a bounded while) when the pool is short."""
        if self.quarantine:
            self.quarantine.reclaim(0.0)
        try:
            return self.pool.lease(nbytes)
        except BufferPoolExhausted:
            if not self.quarantine:
                raise
            self.quarantine.reclaim(SETTLE_S)
            return self.pool.lease(nbytes)

    def _poll_batch(self, batch: object, timeout: float) -> None:
        """Take in completions of the engine ``batch`` runs on, waiting up to ``timeout`` s."""
        if isinstance(batch, native_io.NativeBatch):
            self.native.poll(timeout)
        else:
            self.engine.poll(timeout)

    def _free_after_flush(self, replaced: Iterable[Entry | None]) -> None:
        """Free replaced or deleted objects' extents (None: nothing was there) only once that change is
        durable.

        Until the next flush, a crash recovers the catalog as it was, still pointing at these
        extents: reusing them earlier would let a newer object's data destroy a flushed one.
        """
        gone = [e for e in replaced if e is not None]
        if gone:
            with self._lock:
                self._deferred.extend(gone)

    # ---- reads -----------------------------------------------------------------------
    def submit_get(self, keys: Sequence[bytes], into: Sequence[object | None] | None = None,
                   in_place: bool = False) -> GetHandle | NativeGetHandle:
        """Read ``keys`` in one batch; returns at once (``handle.wait()`` gives the GetResult).

        ``into``: per key, a writable buffer of exactly the object's length (or None) to receive
        that object's payload, copied there once verified (by a copy that releases the GIL); the
        result's views are then those buffers.  :class:`Runs` whose lengths add up to the
        object's receive it scattered over them in order (an engine's page in per-layer runs);
        that hit's view is then the Runs.  The extents are read into the buffer pool, not
        into the caller's memory: on this test machine O_DIRECT reads straight into 4 KiB-page
        shared memory (vLLM's primary tier) restored 5-12% slower than pool reads plus a copy (see
        docs/testbed.md).  On a miss the buffer is left as it was (but for the verified extents of an
        object stored in several, which may have been copied); an object whose length differs from
        its buffer's is a miss.

        ``in_place``: a payload that can be is read with O_DIRECT straight into its buffer and
        verified there, with no pool buffer and no copy: an object stored as one extent with its
        payload on its own sectors (docs/format.md), into a plain buffer of exactly its length at a
        4 KiB-aligned address (a vLLM chunk in huge-page memory).  Its header sector is not read:
        the payload's xxh3-64 is checked against the catalog's.  On a miss such a buffer holds
        whatever was read, so use it for buffers that a miss leaves unused.  Needs the native
        verify worker; without it, and for the other objects, reads go through the pool.
        """
        if self.engine is None:
            self._check_open()
        return self._submit_located(keys, *self.catalog.locate_keys(keys), into, in_place)

    def submit_get_digests(self, digests: Sequence[bytes], keys: Sequence[bytes] | None = None,
                           into: Sequence[object | None] | None = None,
                           in_place: bool = False) -> GetHandle | NativeGetHandle:
        """Like submit_get, for callers that hold key digests (scrubbing, catalog walks)."""
        if self.engine is None:
            self._check_open()
        return self._submit_located(keys if keys is not None else digests, *self.catalog.locate(digests), into,
                                    in_place)

    def _submit_located(self, keys: Sequence[bytes], found: list[int], ext: ExtentTable,
                        into: Sequence[object | None] | None, in_place: bool) -> GetHandle | NativeGetHandle:
        """submit_get of ``keys`` (the result's names) whose held objects ``catalog.locate`` found."""
        if self.native is not None and not (in_place and verify.verify_submit is not None):
            return self._submit_get_native(keys, found, ext, into)
        span = ext.length.astype(np.int64)  # lease bytes per extent
        bufs_in: list[memoryview | None] | None = None
        direct = None
        if into is not None:
            if len(into) != len(keys):
                raise ValueError(f"{len(into)} buffers for {len(keys)} keys")
            bufs_in = [None if into[i] is None else as_bufs(into[i], True) for i in found]
            if in_place and verify.verify_submit is not None and len(span):
                direct = delivery.direct_reads(ext, bufs_in)
                span[direct] = 0  # no pool space
        starts = np.cumsum(span) - span  # extent offsets in the lease, in catalog order
        reads = Reads(starts, bufs_in, direct)
        nbytes = int(starts[-1] + span[-1]) if len(span) else 0
        lease = self._lease(nbytes) if nbytes else None
        drives, offsets = ext.drive.tolist(), ext.offset.tolist()
        view = lease.view if lease is not None else None
        bufs: list = [view[p:p + n] if n else None for p, n in zip(starts.tolist(), span.tolist())]
        if direct is not None:
            obj = ext.obj.tolist()
            for i in np.flatnonzero(direct).tolist():  # the payload alone, past its header's sector
                bufs[i] = bufs_in[obj[i]]
                offsets[i] += ALIGN
        live = None
        if not all(d.healthy for d in self.drives):
            healthy = [d.healthy for d in self.drives]
            live = [i for i, d in enumerate(drives) if healthy[d]]
            drives, offsets, bufs = [drives[i] for i in live], [offsets[i] for i in live], [bufs[i] for i in live]
        # Offsets come from the allocator and buffers from the pool: aligned by construction.
        batch = self.engine.submit_reads(drives, offsets, bufs)
        return GetHandle(self, keys, found, ext, reads, batch, live, lease)

    def _submit_get_native(self, keys: Sequence[bytes], found: list[int], ext: ExtentTable,
                           into: Sequence[object | None] | None) -> NativeGetHandle:
        """submit_get on the native path: the batch's extents, their expected headers, payload spans,
        checksums and the caller's buffers as arrays, handed to kvswarm.io._batchio in one call."""
        span = ext.length.astype(np.int64)
        bufs_in: list[Bufs | None] | None = None
        if into is not None:
            if len(into) != len(keys):
                raise ValueError(f"{len(into)} buffers for {len(keys)} keys")
            bufs_in = [None if into[i] is None else as_bufs(into[i], True) for i in found]
        k = len(span)
        starts = np.cumsum(span) - span
        reads = Reads(starts, bufs_in)
        if not k:
            return NativeGetHandle(self, keys, found, ext, reads, None, None, starts, None)
        lease = self._lease(int(starts[-1] + span[-1]))
        pp = ext.part_payload
        sector = sector_payload(pp)
        single = len(ext.obj) == len(ext.rows)
        rows = ext.rows if single else ext.rows[ext.obj]
        want = expected_headers(rows["digest"], rows["payload_len"], ext.part, ext.parts, rows["generation"], ext.csum,
                                sector)
        at = lease.offset + starts
        poff = np.where(sector, ALIGN, HEADER_SIZE).astype(np.int64)
        dst = parts = None
        if bufs_in is not None:
            dst = parts = sized(bufs_in, ext.rows["payload_len"])
            if not single:  # each extent's payload goes to its own slice of the object's buffer
                cs = np.cumsum(pp) - pp
                at_obj = (cs - cs[np.flatnonzero(ext.part == 0)][ext.obj]).tolist()
                parts = [None if dst[o] is None else part_of(dst[o], a, n)
                         for o, a, n in zip(ext.obj.tolist(), at_obj, pp.tolist())]
        drive = ext.drive.astype(np.int64)
        if not all(d.healthy for d in self.drives):  # extents on drives out of service are not read: EIO
            drive[~np.array([d.healthy for d in self.drives])[drive]] = -1
        batch = self.native.submit(Op.READ, lease.pool.array, drive, ext.offset.astype(np.int64), span, at,
                                   want, poff, pp.astype(np.int64), np.ascontiguousarray(ext.csum, np.uint64), parts)
        return NativeGetHandle(self, keys, found, ext, reads, batch, lease, at + poff, dst)

    def progress(self, timeout: float | None = None) -> int:
        """Take in I/O completions, waiting up to ``timeout`` s (None: until one) while any I/O is in
        flight, else for the next batch under verification; returns how many I/Os or batches
        finished.  With ``handle.done`` a caller finishes handles in the order they complete, so one
        slow read does not hold up the others."""
        if self.native is not None and self.native.inflight():
            return self.native.poll(timeout)
        if self.engine.inflight():
            before = self.engine.completions
            self.engine.poll(timeout)
            return self.engine.completions - before
        v = self._verifying
        # The drives are idle: verify a queued batch on this thread rather than wait for the
        # worker.  A deep queue's last burst of reads then is verified on two cores, not one.
        with contextlib.suppress(IndexError):
            if not v[0].done and not verify.verify_assist():
                v[0].wait(timeout)
        return self._drop_verified()

    def _drop_verified(self) -> int:
        """Forget the finished jobs at the head of the verification queue; how many.  Threads sharing
        the store may race for the same job: one that finds the queue emptied under it stops."""
        v, n = self._verifying, 0
        try:  # a bare try: this runs once per batch read
            while v[0].done:
                v.popleft()
                n += 1
        except IndexError:
            pass
        return n

    def get_many(self, keys: Sequence[bytes]) -> GetResult:
        return self.submit_get(keys).wait()

    def get(self, key: bytes) -> bytes | None:
        """One object as a copy (None on a miss); for hot paths use get_many/submit_get."""
        with self.get_many([key]) as r:
            v = r.views[0]
            return bytes(v) if v is not None else None

    def _finish_get(self, keys: Sequence[bytes], found: list[int], ext: ExtentTable, reads: Reads,
                    check: Check | None, lease: Lease | None) -> GetResult:
        """The outcome of a batch whose verification has finished: views of the verified payloads
        (or the caller's buffers they were copied into), each failure counted once, by cause."""
        n = len(keys)
        views: list[memoryview | bytes | None] = [None] * n
        hits = corrupt = 0
        failed: list[int] = []
        if check is not None:
            ok, single, payloads = check.outcome(), check.single, check.payloads
            if single:
                obj_ok, first = ok, None
            else:
                first = np.flatnonzero(ext.part == 0)
                obj_ok = np.logical_and.reduceat(ok, first)
            good = np.flatnonzero(obj_ok).tolist()
            hits = len(good)
            if single and hits == n and reads.into is None:  # every key found and verified
                views = payloads  # made when the caller asks for them
            elif single:
                dst = check.dst
                for i in good:
                    if dst is None or dst[i] is None:  # handed over in the caller's buffer below
                        views[found[i]] = payloads[i]
            else:
                pp = ext.part_payload
                for i in good:
                    if check.dst is not None and check.dst[i] is not None:
                        continue  # the worker copied it into the caller's buffer: handed over below
                    j, parts = int(first[i]), int(ext.parts[first[i]])
                    views[found[i]] = payloads[j] if parts == 1 else delivery.join_in_place(
                        lease, [(int(check.at[x]), int(pp[x])) for x in range(j, j + parts)])
            if check.dst is not None:
                hits -= hand_over(views, found, good, reads.into, check.dst)
            elif reads.into is not None:
                hits -= delivery.copy_into(views, found, good, reads.into)
            for i in np.flatnonzero(~obj_ok).tolist():  # the first bad extent of the object says why
                failed.append(found[i])
                j = i if single else int(first[i])
                while ok[j]:
                    j += 1
                if not check.io_ok[j]:
                    self._read_failed(int(ext.drive[j]), int(ext.offset[j]), check.results[j])
                else:
                    self.drives[int(ext.drive[j])].stats.misses += 1
                    corrupt += 1
        self.counters["gets"] += n
        self.counters["hits"] += hits
        self.counters["misses"] += n - hits
        self.counters["corrupt"] += corrupt
        return GetResult(keys, views, lease, n - hits, corrupt, failed)

    def _read_failed(self, drive: int, offset: int, result: int | None) -> None:
        """A read that did not return its whole extent: an I/O error unless its drive is out of service."""
        if result is not None and result >= 0 or self.drives[drive].healthy:
            self._io_error(drive, offset, result)

    def _io_error(self, drive: int, offset: int, result: int | None) -> None:
        d = self.drives[drive]
        log.warning("I/O error on drive %d (%s) at %d: result %s", d.index, d.path, offset, result)
        if result is not None and result >= 0:
            d.stats.errors += 1  # a short transfer: the engine counted bytes, not an error
        if d.stats.errors - d.nospc >= self.config.error_threshold:
            d.fail(f"{d.stats.errors - d.nospc} I/O errors")

    def verify(self, digests: Sequence[bytes], batch: int = 256) -> int:
        """Read and verify the objects with these digests; returns how many are corrupt or unreadable."""
        bad = 0
        for i in range(0, len(digests), batch):
            with self.submit_get_digests(digests[i:i + batch]).wait() as r:
                bad += r.misses
        return bad

    # ---- catalog ---------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key_digest(key) in self.catalog

    def __contains__(self, key: bytes) -> bool:
        return self.contains(key)

    def length(self, key: bytes) -> int | None:
        """Payload bytes of ``key``'s object (a catalog lookup, no I/O); None when it is not stored.
        Lets a caller size the buffer a read lands in (``submit_get(into=...)``) before reading."""
        e = self.catalog.get(key_digest(key))
        return None if e is None else e.payload_len

    def __len__(self) -> int:
        return len(self.catalog)

    def delete(self, key: bytes) -> bool:
        """Drop ``key``; a follower only forgets it, until its writer journals it again.  Its extents
        are reused once the delete is durable (the next flush)."""
        return self.delete_digests([key_digest(key)])[0]

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`delete` for a batch (an eviction, a forgotten set of pages): one catalog lock for all,
        their journal records appended together; per key, whether it was stored."""
        return self.delete_digests([key_digest(k) for k in keys])

    def delete_digest(self, digest: bytes) -> bool:
        """Drop the object whose key digest is ``digest`` (a restart recovers digests, not keys)."""
        return self.delete_digests([digest])[0]

    def delete_digests(self, digests: Sequence[bytes]) -> list[bool]:
        """:meth:`delete_digest` for a batch."""
        self._check_open()
        old = self.catalog.delete_many(digests)
        if not self.config.follow:
            self._free_after_flush(old)
        return [e is not None for e in old]

    def refresh(self) -> bool:
        """A follower (``StoreConfig.follow``): take in what its writer has journaled since the
        last call; True if anything."""
        return self.catalog.refresh()

    def flush(self) -> None:
        """Everything written before this call survives a crash after it returns.

        Raises FlushError, once all else is done, when a drive that took writes since the last flush
        failed (its fdatasync here, or another I/O meanwhile): those writes are not durable."""
        self._check_open()
        if self.config.follow:
            return
        self._sync()
        with self._lock:
            lost, self._not_durable = sorted(self._not_durable), set()
            dropped, self._dropped = self._dropped, []
        if lost:
            raise FlushError(lost, f"writes not durable ({len(dropped)} objects deleted): " + ", ".join(
                f"drive {i} ({self.drives[i].path}) " + ("full" if self.drives[i].healthy else
                                                         f"failed: {self.drives[i].reason}") for i in lost),
                             dropped)

    def _sync(self) -> None:
        """fdatasync the healthy drives, sync the catalog, then free the extents that waited on it.  A
        drive failing its fdatasync (full: ENOSPC), failed since it took writes, or whose data file was
        removed, is noted for flush() to report, and the objects written to it since the last flush are
        deleted (journaled): they are not durable, and would be misses after every restart."""
        with self._lock:
            written, self._written = self._written, set()
            since, self._synced_gen = self._synced_gen, self.catalog.next_generation
        lost: set[int] = set()
        for d in self.drives:
            if not d.healthy:
                continue
            if (why := d.unlinked()) is not None:  # writes to an unlinked file vanish at close
                d.fail(why)
                continue
            try:
                os.fdatasync(d.fd)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    d.mark_full("fdatasync")
                else:
                    d.fail(f"fdatasync failed: {e.strerror}")
                lost.add(d.index)
        with self._lock:
            lost.update(i for i in written if not self.drives[i].healthy)
            self._not_durable.update(lost)
        if lost:
            written = self.catalog.written_since(since, sorted(lost))
            dropped = [dg for dg, held in zip(written, self.delete_digests(written)) if held]
            with self._lock:
                self._dropped += dropped
            log.error("%d objects written to drives %s since the last flush are not durable: deleted",
                      len(dropped), sorted(lost))
        with self._lock:
            # The frees stay safe after a failed fdatasync: the deletes and replacements they wait on
            # are in the catalog synced below, which then points at none of them, and a failed drive
            # is never allocated from again.
            deferred, self._deferred = self._deferred, []
        try:
            self.catalog.sync()
        except BaseException:  # the frees are not durable yet: they wait for the next flush
            with self._lock:
                self._deferred[:0] = deferred
            raise
        for e in deferred:
            self._free(e)

    def checkpoint(self) -> None:
        self.flush()
        self.catalog.checkpoint()

    def _check_open(self) -> None:
        if self.engine is None:
            raise KVSwarmError(f"the store at {self.meta_dir} is closed")

    def close(self) -> None:
        if getattr(self, "engine", None) is None:
            return
        self.engine.close()
        if self.native is not None:
            self.native.close()
        while self._verifying:  # the worker holds views of the pool until it is done
            self._verifying.popleft().wait()
        try:
            if not self.config.follow:
                try:
                    self.flush()
                except FlushError as e:  # closed all the same: a caller that needs durability flushes first
                    log.error("closing the store: %s", e)
                self.catalog.checkpoint()
        finally:
            # A catalog sync that raises (its disk full or failing) still closes the rest, and the
            # error reaches the caller: a half-closed store would keep its drives' fds and the writer
            # lock, so no process could open the store for writing until this one exits.  What the
            # journal already holds is found again at the next open.
            try:
                self.catalog.close()
            finally:
                for d in self.drives:
                    d.close()
                self._unlock_writer()
                self.engine = None  # type: ignore[assignment]

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- health and metrics ------------------------------------------------------------
    def fail_drive(self, index: int, reason: str = "taken out of service") -> None:
        """Stop using a drive: its objects become misses, new writes avoid it."""
        if not isinstance(index, int) or not 0 <= index < len(self.drives):
            raise ConfigError(f"no drive {index!r}: this store has drives 0-{len(self.drives) - 1}")
        self.drives[index].fail(reason)

    def unreadable_digests(self) -> list[bytes]:
        """Digests of the objects with an extent on a drive out of service; [] at once while every drive is
        healthy (one pass over the catalog's extent columns otherwise, not an Entry per object)."""
        dead = [d.index for d in self.drives if not d.healthy]
        return self.catalog.digests_on(dead) if dead else []

    def drop_unreadable(self) -> list[bytes]:
        """Delete the objects that :meth:`unreadable_digests` names, as :meth:`delete_digest` does (journaled; a
        follower only forgets them, until its writer journals them again), and return their digests: a
        lookup then misses on them, where it would have found objects whose every read fails.  [] at once
        while every drive is healthy; else a pass over the catalog, so callers call it when a drive failed.
        A put in flight meanwhile may still land on the failed drive: its reads fail, and callers delete it."""
        out = []
        for dg in self.unreadable_digests():
            # Rewritten on healthy drives since (another thread's put): kept.
            e = self.catalog.get(dg)
            if e is not None and any(not self.drives[x[0]].healthy for x in e.extents) and self.delete_digest(dg):
                out.append(dg)
        return out

    def health(self) -> list[DriveHealth]:
        """Every drive's state: out of service since the open (unreadable then) or since (I/O errors,
        a failed flush, its data file removed), with the reason, and whether it is full (ENOSPC: it
        serves what it holds, and takes no new writes).  Objects on a drive out of service are misses."""
        return [DriveHealth(d.index, d.path, d.healthy, d.reason, d.full) for d in self.drives]

    @property
    def drive_stats(self) -> list[DriveStats]:
        if getattr(self, "native", None) is not None:
            self.native.fold_stats()
        return [d.stats for d in self.drives]

    def registry(self):
        """A prometheus CollectorRegistry with this store's per-drive metrics."""
        return registry_for(self.drive_stats)

    def stats(self) -> dict:
        return {
            "objects": len(self.catalog),
            "counters": dict(self.counters),
            "drives": [st.snapshot() | {"healthy": d.healthy, "reason": d.reason, "full": d.full,
                                        "free_bytes": d.free_bytes, "capacity": d.capacity,
                                        "direct_io": d.direct, "kind": d.kind}
                       for d, st in zip(self.drives, self.drive_stats)],
        }

    def digests(self) -> Iterable[bytes]:
        return list(self.catalog.digests())

    # ---- views for the layers above: what tiers, integrations, offload, swarm, sim and the
    # benchmarks need of the drives, the catalog, the engine and the buffer pool, read here
    # rather than through those parts -------------------------------------------------------
    @property
    def drive_depth(self) -> int:
        """Requests each drive has in flight at most: the thread engine's workers per drive, else the
        configured queue depth (a pacing wrapper's inner engine decides)."""
        engine = getattr(self.engine, "inner", self.engine)
        return getattr(engine, "workers_per_drive", None) or self.queue_depth

    @property
    def num_drives(self) -> int:
        """Drives the store was opened with, in service or not (their indexes: ``range(num_drives)``)."""
        return len(self.drives)

    def drive_health(self) -> tuple[bool, ...]:
        """Per drive, whether it is in service.  A drive taken out of service stays out while the
        store is open, so ``sum(drive_health())`` only falls: a caller that remembers it learns
        that a drive failed since it last looked."""
        return tuple(d.healthy for d in self.drives)

    def failed_drives(self) -> frozenset[int]:
        """Indexes of the drives out of service."""
        return frozenset(d.index for d in self.drives if not d.healthy)

    def locate(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """Per key, its catalog entry (generation, payload length, extents on the drives), or None
        when the store does not hold it."""
        get = self.catalog.get
        return [get(key_digest(k)) for k in keys]

    def locate_digests(self, digests: Sequence[bytes]) -> list[Entry | None]:
        """:meth:`locate` by key digests (a restart recovers digests, not keys)."""
        get = self.catalog.get
        return [get(d) for d in digests]

    def entries_oldest_first(self) -> list[tuple[bytes, Entry]]:
        """``(digest, entry)`` of every object, the oldest write first: the order in which a warm
        restart replays recency."""
        return sorted(self.catalog, key=lambda de: de[1].generation)

    def digest_view(self) -> Collection[bytes]:
        """The digests of the objects held, as a live view: ``in`` is one index probe, with no copy
        (a lookup path's test; :meth:`digests` is a snapshot)."""
        return self.catalog.digests()

    @property
    def generation(self) -> int:
        """The generation the next write gets: objects of smaller ones were written before now."""
        return self.catalog.next_generation

    def written_before(self, generation: int) -> Iterator[bytes]:
        """Digests of the objects written before ``generation``, lazily (see
        :meth:`kvswarm.catalog.Catalog.written_before`): check one with :meth:`locate_digests`
        before acting on it."""
        return self.catalog.written_before(generation)

    def capacity_objects(self, length: int) -> int:
        """Objects of ``length`` payload bytes the drives in service hold when empty: whole objects
        per drive while an object is one extent (extents of one size never fragment), else the
        drives' space over the object's."""
        per = self.object_bytes(length)
        healthy = [d for d in self.drives if d.healthy]
        if length <= self.config.stripe_unit - HEADER_SIZE:
            return sum((d.capacity - d.data_start) // per for d in healthy)
        return sum(d.capacity - d.data_start for d in healthy) // per

    def poll(self, timeout: float | None = 0.0) -> None:
        """Reap I/O completions, waiting up to ``timeout`` seconds for one (None: until one comes):
        a caller with many handles in flight reaps once, then asks each handle's ``done`` (no
        system call) rather than ``poll`` per handle."""
        if self.native is not None and self.native.inflight():
            self.native.poll(timeout)
            if not self.engine.inflight():
                return
            timeout = 0.0  # the engine's completions too, without a second wait
        self.engine.poll(timeout)

    def warm_buffers(self) -> bool:
        """Fault the buffer pool's memory in now rather than in the first reads and writes (see
        :meth:`kvswarm.buffers.BufferPool.populate`); False where the kernel cannot do it ahead."""
        return self.pool.populate()

    @property
    def buffer_bytes(self) -> int:
        """Size of the buffer pool: what reads and writes in flight lease together at most."""
        return self.pool.capacity

    def room(self) -> int:
        """Bytes of the largest lease the buffer pool grants now (one free run of it)."""
        return self.pool.largest_free

    def read_shape(self, object_bytes: int) -> shape.BatchShape:
        """How to cut reads of objects taking ``object_bytes`` each (:meth:`object_bytes`) to keep
        this store's healthy drives busy (:func:`kvswarm.store.shape.read_shape`)."""
        return shape.read_shape(object_bytes, self._shape_resources())

    def write_shape(self, object_bytes: int) -> shape.BatchShape:
        """How to cut a stream of puts of objects taking ``object_bytes`` each
        (:func:`kvswarm.store.shape.write_shape`)."""
        return shape.write_shape(object_bytes, self._shape_resources())

    def _shape_resources(self) -> shape.Resources:
        return shape.Resources(self.config.stripe_unit, sum(d.healthy for d in self.drives), self.queue_depth,
                               self.config.buffer_pool_bytes)

    def batch_len(self, n: int, object_bytes: int, max_bytes: int | None = None) -> int:
        """How many of ``n`` objects taking ``object_bytes`` each (:meth:`object_bytes`; 0: unknown,
        all ``n``) the next batch should hold: what one lease of the buffer pool holds now, capped
        at ``max_bytes`` worth but at least one.  0 when not even one object fits now: the caller
        waits for a batch of its own in flight, or submits one object, which may raise
        :class:`~kvswarm.buffers.BufferPoolExhausted`.  A lease is one run of the pool, so the
        room is the largest free run, not the free bytes (batches released out of order leave
        runs each too short)."""
        if object_bytes <= 0:
            return n
        room = self.pool.largest_free
        if room < object_bytes:
            return 0
        fit = room // object_bytes
        if max_bytes is not None:
            fit = min(fit, max(1, max_bytes // object_bytes))
        return min(n, fit)
