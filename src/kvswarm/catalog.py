"""Catalog: key digest -> extents, persisted as an append-only journal plus checkpoints.

Durability contract: records are appended (in memory, then to the journal file) only
after the object's data writes completed; :meth:`Catalog.sync` fsyncs the journal.
A checkpoint is written to a temporary file, fsynced and renamed over the old one, and
carries the *epoch* of the journal that continues it, so a crash between checkpoint and
journal reset never replays stale records.  Torn journal tails fail their checksum and
end the replay.  See docs/format.md.

A catalog opened with ``follow=True`` belongs to a reader in another process: it writes
nothing, and :meth:`Catalog.refresh` applies what the writer has journaled since.  Across one
checkpoint of the writer's it finishes the journal the checkpoint replaced (it keeps that file
open) and goes on with the new one; further behind, it reloads whole.  Its view may lag the
writer's; the store's per-extent header check (digest, generation, checksum) turns a read
of an extent the writer has since reused into a miss.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash
from numpy.lib.stride_tricks import sliding_window_view

from kvswarm.catalog_format import (
    CHECKPOINT,
    CHECKPOINT_HEADER,
    CHECKPOINT_MAGIC,
    CKPT_DTYPE,
    CRC,
    EXTENT,
    EXTENT_NP,
    JOURNAL,
    JOURNAL_HEADER,
    JOURNAL_MAGIC,
    OP_DEL,
    OP_PUT,
    RECORD,
    RECORD_LEN,
    RECORD_NP,
    damaged_at,
    encode,
    encode_puts,
)
from kvswarm.digest_index import new_digest_index
from kvswarm.errors import KVSwarmError, MetadataError
from kvswarm.format import HEADER_SIZE

log = logging.getLogger(__name__)


class Extent(NamedTuple):
    """One piece of an object on a drive."""

    drive: int
    offset: int  # bytes from the start of the drive
    length: int  # bytes on disk: header, payload, padding to 4 KiB
    csum: int  # the payload's checksum (see kvswarm.format.PAYLOAD_CHECKSUM)


# The in-memory table: one row per object, its first (usually only) extent inline.  Rows
# in numpy instead of an object per entry: a large catalog stays a few compact arrays, so
# a lookup touches a dict slot and one 56-byte row rather than ~9 scattered Python objects
# (their cache misses were half of a 4 KiB read's CPU), and a checkpoint loads without
# building per-object Python objects.  parts == 0 marks a free row.
ROW_DTYPE = np.dtype([("digest", "V16"), ("generation", "<u8"), ("offset", "<u8"), ("csum", "<u8"),
                      ("payload_len", "<u4"), ("length", "<u4"), ("drive", "<u2"), ("parts", "<u2")])
# Rows as opaque 56-byte items: gathering those is a plain copy per row, where gathering
# records goes field by field (256 rows: 10 vs 50 us).
_ROW_BYTES = np.dtype(f"V{ROW_DTYPE.itemsize}")


@dataclass(slots=True)
class Entry:
    generation: int
    payload_len: int
    extents: tuple[Extent, ...]


@dataclass(slots=True)
class ExtentTable:
    """The extents of a set of objects as columns, objects' extents consecutive and in part
    order: what a batched read needs to issue and verify its I/Os without per-object lookups."""

    obj: np.ndarray  # index of the owning object (0..objects-1) per extent
    part: np.ndarray
    parts: np.ndarray
    drive: np.ndarray
    offset: np.ndarray
    length: np.ndarray  # bytes on disk (header + payload + padding)
    csum: np.ndarray
    part_payload: np.ndarray  # payload bytes held by this extent
    rows: np.ndarray  # the objects' catalog rows (digest, generation, payload_len ...)


def _row_extents(rows: np.ndarray) -> ExtentTable:
    """The extents of objects stored in one extent each: each row is its object's extent."""
    n = len(rows)
    return ExtentTable(np.arange(n), np.zeros(n, np.int64), rows["parts"], rows["drive"], rows["offset"],
                       rows["length"], rows["csum"], rows["payload_len"], rows)


class CatalogCorrupt(MetadataError):
    """The checkpoint or journal is missing, fails its checksum or does not continue the other: the
    catalog cannot be trusted to hold every flushed object, so the store refuses to open (nothing
    is rewritten; ``kvswarm fsck`` rebuilds the catalog from the drives)."""


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic GC while millions of small acyclic objects are built at once
    (otherwise it rescans them again and again: it tripled the 1M-object load time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Entries(Mapping[bytes, Entry]):
    """Read-only mapping view digest -> :class:`Entry` (built on access) over a catalog."""

    __slots__ = ("_cat",)

    def __init__(self, cat: Catalog) -> None:
        self._cat = cat

    def __getitem__(self, digest: bytes) -> Entry:
        return self._cat._entry(self._cat._index[digest])

    def __contains__(self, digest: object) -> bool:
        return digest in self._cat._index

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._cat._index))

    def __len__(self) -> int:
        return len(self._cat._index)


class Catalog:
    def __init__(self, meta_dir: str, checkpoint_every: int = 500_000, follow: bool = False,
                 create: bool = True) -> None:
        """``create=False``: the catalog must exist (a store's manifest says it was made): a missing
        journal is an error, not a new empty catalog."""
        self.meta_dir = meta_dir
        self.create = create
        self.checkpoint_every = checkpoint_every
        self.follow = follow
        self._lock = threading.Lock()
        self._index = new_digest_index()  # digest -> row
        self.entries = Entries(self)
        self._pending: list[bytes] = []  # journal records not written yet
        self._pending_records = 0
        self._clear()
        self._jfd = -1
        # follow: the journal's (inode, size) at the last look, and the bytes of it applied (None: it is
        # not this epoch's journal, so the follower waits for the next journal file)
        self._journal_seen: tuple[int, int] | None = None
        self._applied: int | None = None
        # follow: the journal being applied, kept open: after the writer's checkpoint has replaced
        # it, its last records are still read from here, and its inode number cannot be reused
        self._follow_fd = -1
        self._closed = False
        try:
            self._load()
            if not follow:
                self._jfd = os.open(self._path(JOURNAL), os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            self._keep_journal(-1)
            raise MetadataError(f"cannot open the catalog in {meta_dir}: {e.strerror} "
                                f"({e.filename or meta_dir})") from e
        except BaseException:
            self._keep_journal(-1)
            raise

    def _clear(self) -> None:
        """The empty table (the index is cleared in place: callers hold live views of its keys)."""
        self._index.clear()
        self._rows = np.zeros(1024, ROW_DTYPE)
        self._used = 0  # rows ever handed out (free rows below it are in _free_rows)
        self._free_rows: list[int] = []
        self._multi: dict[int, tuple[Extent, ...]] = {}  # row -> every extent, for objects of several
        self.next_generation = 1
        self.epoch = 0
        self.replayed = 0
        self.torn_tail = False
        self._records_since_ckpt = 0

    def _path(self, name: str) -> str:
        return os.path.join(self.meta_dir, name)

    # ---- the row table ---------------------------------------------------------------
    def _new_rows(self, n: int) -> list[int]:
        reuse = min(n, len(self._free_rows))
        out = [self._free_rows.pop() for _ in range(reuse)]
        fresh = n - reuse
        if self._used + fresh > len(self._rows):
            grown = np.zeros(max(2 * len(self._rows), self._used + fresh), ROW_DTYPE)
            grown[:self._used] = self._rows[:self._used]
            self._rows = grown
        out.extend(range(self._used, self._used + fresh))
        self._used += fresh
        return out

    def _set(self, rows: list[int], digests: list[bytes], entries: list[Entry]) -> None:
        """Write entries into their rows."""
        if rows:
            cols = {"digest": np.array(digests, "V16"), "generation": [e.generation for e in entries],
                    "payload_len": [e.payload_len for e in entries], "parts": [len(e.extents) for e in entries]}
            cols.update(zip(("drive", "offset", "length", "csum"), zip(*[e.extents[0] for e in entries])))
            self._set_columns(np.array(rows, np.int64), cols,
                              {r: tuple(map(Extent._make, e.extents)) for r, e in zip(rows, entries)
                               if len(e.extents) > 1})

    def _set_columns(self, idx: np.ndarray, cols: dict, multi: dict[int, tuple[Extent, ...]]) -> None:
        """Fill rows ``idx`` column by column; ``multi``: row -> extents of the multi-extent ones."""
        t = self._rows
        for name, col in cols.items():
            t[name][idx] = col
        if self._multi:
            for r in idx[t["parts"][idx] == 1].tolist():
                self._multi.pop(r, None)
        self._multi.update(multi)

    def _entry(self, row: int) -> Entry:
        _, gen, off, csum, plen, ln, drv, parts = self._rows[row].item()
        return Entry(gen, plen, self._multi[row] if parts > 1 else (Extent(drv, off, ln, csum),))

    def _drop(self, row: int) -> None:
        self._rows["parts"][row] = 0
        self._multi.pop(row, None)
        self._free_rows.append(row)

    # ---- recovery ------------------------------------------------------------------
    def _load(self) -> None:
        if not self.follow:
            os.makedirs(self.meta_dir, exist_ok=True)
        # A follower may read the writer's new checkpoint and the journal it is about to replace
        # (or the reverse): a few ms apart, so it tries again before settling for the checkpoint.
        for attempt in range(100 if self.follow else 1):
            if attempt:
                time.sleep(0.01)
                self._clear()
            self._mismatch = None
            if self._load_once():
                return
        if self._mismatch is not None:
            raise CatalogCorrupt(self._mismatch)

    def _load_once(self) -> bool:
        """Checkpoint, then the journal that continues it; False: a follower read a journal of
        another epoch (and then waits for the next journal file)."""
        self._journal_seen = self._applied = None
        self._keep_journal(-1)
        with _no_gc():
            ck = self._path(CHECKPOINT)
            has_ckpt = os.path.exists(ck)
            if has_ckpt:
                self._load_checkpoint(ck)
            jp = self._path(JOURNAL)
            if os.path.exists(jp):
                with open(jp, "rb") as f:
                    ino = os.fstat(f.fileno()).st_ino
                    data = f.read()
                    kept = os.dup(f.fileno()) if self.follow else -1
                self._journal_seen = (ino, len(data))
                self._keep_journal(kept)
                # The journal is always replaced whole (written aside, renamed): a bad header is damage.
                if len(data) < JOURNAL_HEADER.size or JOURNAL_HEADER.unpack_from(data)[0] != JOURNAL_MAGIC:
                    raise CatalogCorrupt(f"journal {jp} has no valid header (damaged)")
                epoch = JOURNAL_HEADER.unpack_from(data)[1]
                if epoch == self.epoch:
                    end = self._replay(data, JOURNAL_HEADER.size)
                    if self.torn_tail and damaged_at(data, end):
                        raise CatalogCorrupt(f"journal {jp} is damaged at byte {end}: valid records follow a bad one")
                    if self.follow:  # a torn tail is the writer's append in progress: read again later
                        self._applied = end
                    elif self.torn_tail:
                        self._cut_tail(jp, data, end)
                    return True
                # Only a crash between a checkpoint's rename and the journal's reset leaves a journal of
                # the epoch before the checkpoint's (stale: its records are in the checkpoint).  Any
                # other epoch means a checkpoint is missing or was replaced: refuse, rewrite nothing.
                if not (has_ckpt and epoch + 1 == self.epoch):
                    self._mismatch = (f"journal {jp} (epoch {epoch}) does not continue "
                                      + (f"checkpoint {ck} (epoch {self.epoch})" if has_ckpt
                                         else f"a checkpoint: {ck} is missing"))
                    if not self.follow:  # a follower looks again: the writer may be checkpointing
                        raise CatalogCorrupt(self._mismatch)
            elif has_ckpt or not self.create:
                raise CatalogCorrupt(f"journal {jp} is missing")
            if not self.follow:
                self._reset_journal()
                return True
            return self._journal_seen is None  # no journal yet: the writer has not started one

    def _cut_tail(self, path: str, data: bytes, end: int) -> None:
        """Cut a torn record off the journal's end, so that later appends follow a valid one.  A crash
        mid-append leaves one (a damaged record with valid ones after it was refused before this).  The
        bytes cut are kept aside (``<journal>.tail-<epoch>-<offset>``)."""
        aside = f"{path}.tail-{self.epoch}-{end}"
        with open(aside, "wb") as f:
            f.write(data[end:])
            f.flush()  # out of Python's buffer before the fsync
            os.fsync(f.fileno())
        log.warning("journal %s: %d B of a torn last record cut off (kept in %s)", path, len(data) - end, aside)
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())

    def refresh(self) -> bool:
        """A following catalog: apply the records the writer has journaled since the last call;
        True if there were any.  One ``stat`` when the journal has not changed.  After one
        checkpoint of the writer's, the journal it replaced is finished and the new epoch's
        followed (:meth:`_next_epoch`); anything else (more checkpoints since, a journal cut
        short by a writer's restart) reloads the whole catalog."""
        if not self.follow:
            raise KVSwarmError("refresh() is for a catalog opened with follow=True")
        jp = self._path(JOURNAL)
        try:
            st = os.stat(jp)
        except FileNotFoundError:
            return False
        with self._lock:
            seen, applied = self._journal_seen, self._applied
            if (st.st_ino, st.st_size) == seen:
                return False
            self._journal_seen = (st.st_ino, st.st_size)
            before = self.replayed
            if seen is not None and applied is not None and self._follow_fd >= 0:
                if st.st_ino == seen[0] and st.st_size > applied:  # the same file, grown
                    self._applied = applied + self._replay(os.pread(self._follow_fd, st.st_size - applied, applied), 0)
                    return self.replayed > before
                if st.st_ino != seen[0] and self._next_epoch(jp):
                    return self.replayed > before
            self._clear()
            self._load()
            return True

    def _next_epoch(self, path: str) -> bool:
        """The writer has checkpointed: apply the rest of the journal the checkpoint replaced (the
        writer wrote all of it before checkpointing), then follow the new journal if it continues
        that checkpoint.  The state is then the checkpoint's, without reading it (a reload of a
        1M-object catalog took a vLLM follower's driver thread 0.54-0.68 s, at every checkpoint).
        False where that would not be exact (a torn record at the old journal's end, a journal of
        a later epoch): the caller reloads."""
        old = self._follow_fd
        end = os.fstat(old).st_size
        if end > self._applied:
            rest = os.pread(old, end - self._applied, self._applied)
            if self._replay(rest, 0) != len(rest):
                return False
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        st = os.fstat(fd)
        data = os.pread(fd, st.st_size, 0)
        if len(data) < JOURNAL_HEADER.size or JOURNAL_HEADER.unpack_from(data) != (JOURNAL_MAGIC, self.epoch + 1):
            os.close(fd)
            return False
        self._keep_journal(fd)
        self.epoch += 1
        self._journal_seen = (st.st_ino, len(data))
        self._applied = self._replay(data, JOURNAL_HEADER.size)
        return True

    def _keep_journal(self, fd: int) -> None:
        """Hold ``fd`` (-1: none) as the journal this follower applies, closing the one held before."""
        if self._follow_fd >= 0:
            os.close(self._follow_fd)
        self._follow_fd = fd

    def _load_checkpoint(self, path: str) -> None:
        with open(path, "rb") as f:
            head = f.read(CHECKPOINT_HEADER.size)
            body = f.read()
        if len(head) < CHECKPOINT_HEADER.size:
            raise CatalogCorrupt(f"checkpoint {path} is truncated ({len(head)} B, its header is "
                                 f"{CHECKPOINT_HEADER.size} B)")
        magic, epoch, next_gen, rows, csum = CHECKPOINT_HEADER.unpack(head)
        if magic != CHECKPOINT_MAGIC or len(body) != rows * CKPT_DTYPE.itemsize or xxhash.xxh64_intdigest(body) != csum:
            raise CatalogCorrupt(f"checkpoint {path} is corrupt")
        self.epoch, self.next_generation = epoch, next_gen
        arr = np.frombuffer(body, CKPT_DTYPE)
        if not rows:
            return
        # Rows are grouped by object (parts in order), so an object starts where part == 0:
        # the object's first extent fills its row, whole columns at a time.
        starts = np.flatnonzero(arr["part"] == 0)
        n = len(starts)
        first = arr[starts]
        t = np.zeros(max(1024, n), ROW_DTYPE)
        for name in ("generation", "payload_len", "parts", "drive", "offset", "length", "csum"):
            t[name][:n] = first[name]
        t["digest"][:n] = first["digest"].view("V16")  # V16 keeps a digest's trailing NUL bytes
        self._rows, self._used = t, n
        for i in np.flatnonzero(first["parts"] > 1).tolist():
            s, k = int(starts[i]), int(first["parts"][i])
            self._multi[i] = tuple(map(Extent._make, zip(
                arr["drive"][s:s + k].tolist(), arr["offset"][s:s + k].tolist(), arr["length"][s:s + k].tolist(),
                arr["csum"][s:s + k].tolist())))
        self._index.update(zip(t["digest"][:n].tolist(), range(n)))

    def _replay(self, data: bytes, pos: int) -> int:
        """Apply the journal's records in ``data`` from ``pos``; returns where the last whole one
        ends.  One Python step per record finds and checks it; the records that survive (the last
        one per digest) are then parsed as arrays."""
        n = len(data)
        latest: dict[bytes, int] = {}  # digest -> its last put (index into ``puts``), -1: deleted
        puts: list[int] = []  # offsets of put records
        view = memoryview(data)
        h32, crc_at, len_at = xxhash.xxh32_intdigest, CRC.unpack_from, RECORD_LEN.unpack_from
        replayed = 0
        while pos + RECORD.size + CRC.size <= n:
            ln = len_at(data, pos)[0]
            if ln < RECORD.size + CRC.size or pos + ln > n:
                break
            if h32(view[pos:pos + ln - 4]) != crc_at(data, pos + ln - 4)[0]:
                break
            op = data[pos + 4]
            if op == OP_PUT:
                latest[data[pos + 5:pos + 21]] = len(puts)
                puts.append(pos)
            elif op == OP_DEL:
                latest[data[pos + 5:pos + 21]] = -1
            pos += ln
            replayed += 1
        view.release()
        index = self._index
        for digest in [d for d, i in latest.items() if i < 0]:
            row = index.pop(digest, None)
            if row is not None:
                self._drop(row)
        if puts:
            raw = np.frombuffer(data, np.uint8)
            at = np.array(puts, np.int64)
            # Each record's bytes as one row of a sliding window over the journal (a view, no copy).
            recs = sliding_window_view(raw, RECORD.size)[at].view(RECORD_NP)[:, 0]
            self.next_generation = max(self.next_generation, int(recs["generation"].max()) + 1)
            keep = [(d, i) for d, i in latest.items() if i >= 0]
            k = np.array([i for _, i in keep], np.int64)
            recs, at = recs[k], at[k] + RECORD.size
            exts = sliding_window_view(raw, EXTENT.size)[at].view(EXTENT_NP)[:, 0]  # each object's first extent
            digests = [d for d, _ in keep]
            new = [d for d in digests if d not in index]
            index.update(zip(new, self._new_rows(len(new))))
            rows = np.array([index[d] for d in digests], np.int64)
            multi = {int(rows[j]): tuple(Extent._make(EXTENT.unpack_from(data, int(at[j]) + p * EXTENT.size))
                                         for p in range(int(recs["parts"][j])))
                     for j in np.flatnonzero(recs["parts"] > 1).tolist()}
            self._set_columns(rows, {"digest": recs["digest"], "generation": recs["generation"],
                                     "payload_len": recs["payload_len"], "parts": recs["parts"],
                                     "drive": exts["drive"], "offset": exts["offset"], "length": exts["length"],
                                     "csum": exts["csum"]}, multi)
        self.replayed += replayed
        self.torn_tail = pos != n
        self._records_since_ckpt = self.replayed
        return pos

    def _reset_journal(self) -> None:
        tmp = self._path(JOURNAL + ".tmp")
        with open(tmp, "wb") as f:
            f.write(JOURNAL_HEADER.pack(JOURNAL_MAGIC, self.epoch))
            f.flush()  # out of Python's buffer before the fsync: else it reaches the disk only at close
            os.fsync(f.fileno())
        os.replace(tmp, self._path(JOURNAL))
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.meta_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- mutations -----------------------------------------------------------------
    def new_generation(self) -> int:
        with self._lock:
            g = self.next_generation
            self.next_generation += 1
            return g

    def new_generations(self, n: int) -> int:
        """The first of ``n`` consecutive fresh generations (one lock round for a batch)."""
        with self._lock:
            g = self.next_generation
            self.next_generation += n
            return g

    def put_many(self, items: Sequence[tuple[bytes, Entry]]) -> list[Entry | None]:
        """Record each ``(digest, entry)``; returns per item the entry it replaces (whose extents
        the caller frees), or the item's own entry when a newer write won the race.

        New digests enter the index only after their rows are written: a reader on another
        thread never finds a digest whose row is still empty."""
        if self.follow:
            raise KVSwarmError("a following catalog is read-only: its writer records puts")
        out: list[Entry | None] = []
        index = self._index
        if not items:
            return out
        with self._lock:
            if self._put_new(items):
                return [None] * len(items)
            rows: list[int] = []
            digests: list[bytes] = []
            entries: list[Entry] = []
            staged: dict[bytes, int] = {}  # digest -> its place in rows (a digest twice in one batch)
            new: list[int] = []  # places of digests the index does not hold yet
            for digest, entry in items:
                k = staged.get(digest)
                row = index.get(digest) if k is None else rows[k]
                old = entries[k] if k is not None else None if row is None else self._entry(row)
                if old is not None and old.generation > entry.generation:
                    out.append(entry)
                    continue
                out.append(old)
                if k is not None:
                    entries[k] = entry
                else:
                    staged[digest] = len(rows)
                    if row is None:
                        new.append(len(rows))
                    rows.append(-1 if row is None else row)
                    digests.append(digest)
                    entries.append(entry)
                self._append(encode(OP_PUT, digest, entry))
            for k, r in zip(new, self._new_rows(len(new))):
                rows[k] = r
            self._set(rows, digests, entries)
            index.update((digests[k], rows[k]) for k in new)
            self._write_if_many()
        return out

    def put(self, digest: bytes, entry: Entry) -> Entry | None:
        return self.put_many([(digest, entry)])[0]

    def delete(self, digest: bytes) -> Entry | None:
        return self.delete_many([digest])[0]

    def delete_many(self, digests: Sequence[bytes]) -> list[Entry | None]:
        """Drop each digest held, under one lock, their journal records appended together; per digest,
        the entry it had (None where it held none)."""
        out: list[Entry | None] = []
        with self._lock:
            for digest in digests:
                row = self._index.pop(digest, None)
                if row is None:
                    out.append(None)
                    continue
                out.append(self._entry(row))
                self._drop(row)
                if not self.follow:  # a follower only forgets it (until the writer journals it again)
                    self._append(encode(OP_DEL, digest, None))
            self._write_if_many()
        return out

    def get(self, digest: bytes) -> Entry | None:
        row = self._index.get(digest)
        return None if row is None else self._entry(row)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._index

    def digests(self) -> Collection[bytes]:
        """A live view of the digests held (``in`` on it is one probe in native code: hot lookups;
        iterating it walks a snapshot)."""
        return self._index

    def written_before(self, generation: int) -> Iterator[bytes]:
        """Digests of the objects written before ``generation`` (by an earlier process, say), row by
        row and lazily, without a copy of the catalog.  A row freed or reused after it was read is
        not seen again: callers check an object with :meth:`get` before acting on it."""
        r = 0
        while r < self._used:
            t = self._rows[r:min(r + 4096, self._used)]
            live = (t["parts"] > 0) & (t["generation"] < generation)
            r += len(t)
            yield from (d.tobytes() for d in t["digest"][live])

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[tuple[bytes, Entry]]:
        return iter(list(self.entries.items()))

    def locate(self, digests: Sequence[bytes]) -> tuple[list[int], ExtentTable]:
        """Positions in ``digests`` of the objects held, and the extents of those objects."""
        slots = np.empty(len(digests), np.int64)
        self._index.lookup(digests, slots)
        return self._located(slots, digests)

    def locate_keys(self, keys: Sequence[bytes]) -> tuple[list[int], ExtentTable]:
        """:meth:`locate` for keys: their digests are made and looked up in one native call."""
        slots = np.empty(len(keys), np.int64)
        digests = np.empty(len(keys), ROW_DTYPE["digest"])
        self._index.lookup_keys(keys, slots, digests)
        return self._located(slots, digests)

    def _located(self, slots: np.ndarray, digests: np.ndarray | Sequence[bytes]) -> tuple[list[int], ExtentTable]:
        """:meth:`locate`'s answer from each digest's row in the index (-1: not held); ``digests`` as
        bytes objects (of any length: one not 16 bytes long is simply not held) or a 16-byte array."""
        if (slots < 0).any():
            found = np.flatnonzero(slots >= 0).tolist()
            held = slots[found]
        else:
            found, held = list(range(len(slots))), slots
        # clip: a follower's reload may swap in a smaller table meanwhile; a row read from it fails the
        # digest check below (a miss), where an index error would fail the caller
        rows = self._rows.view(_ROW_BYTES).take(held, mode="clip").view(ROW_DTYPE)
        # A row deleted since the index lookup (parts 0), or reused by another key (another thread's
        # delete + put, a follower's reload): a miss.  Verification alone would not catch the reuse:
        # the headers it expects come from these rows, so another key's object would verify.
        if len(found) < len(digests):
            digests = digests[found] if isinstance(digests, np.ndarray) else [digests[i] for i in found]
        want = digests if isinstance(digests, np.ndarray) else np.frombuffer(b"".join(digests), ROW_DTYPE["digest"])
        live = (rows["parts"] > 0) & (rows["digest"] == want)
        if not live.all():
            idx = np.flatnonzero(live)
            found, held, rows = [found[i] for i in idx.tolist()], held[idx], rows[idx]
        parts = rows["parts"]
        n = len(rows)
        if n == 0 or (parts == 1).all():  # one extent per object: the row is the extent
            return found, _row_extents(rows)
        multi = self._multi
        keep = []
        obj: list[int] = []
        part: list[int] = []
        exts: list[Extent] = []
        sizes: list[int] = []  # payload bytes per extent: full extents up to the object's length
        for i, (r, k, plen) in enumerate(zip(held.tolist(), parts.tolist(), rows["payload_len"].tolist())):
            ext = multi.get(r) if k > 1 else (Extent._make(rows[["drive", "offset", "length", "csum"]][i].item()),)
            if ext is None or len(ext) != k:  # rewritten since this row was read: a miss, never part of it
                continue
            keep.append(i)
            for p, x in enumerate(ext):
                obj.append(len(keep) - 1)
                part.append(p)
                exts.append(x)
                sizes.append(min(plen, x.length - HEADER_SIZE))
                plen -= sizes[-1]
        if len(keep) < n:
            found, rows, parts = [found[i] for i in keep], rows[keep], parts[keep]
            if not keep:
                return found, _row_extents(rows)
        drv, off, ln, cs = (np.array(c, dt) for c, dt in zip(zip(*exts), (np.uint16, np.uint64, np.uint32,
                                                                           np.uint64)))
        obj_a = np.array(obj, np.int64)
        return found, ExtentTable(obj_a, np.array(part, np.int64), parts[obj_a], drv, off, ln, cs,
                                  np.array(sizes, np.int64), rows)

    def extent_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every extent held as (owner row, drive, offset, length) columns: what rebuilding free
        space needs, without an Entry per object (:meth:`digest_at` names an owner)."""
        live = np.flatnonzero(self._rows["parts"][:self._used] > 0)
        t = self._rows[live]
        single = t["parts"] == 1
        owner, drv, off, ln = live[single], t["drive"][single], t["offset"][single], t["length"][single]
        if not self._multi:
            return owner, drv.astype(np.int64), off.astype(np.int64), ln.astype(np.int64)
        rows = [r for r, ext in self._multi.items() for _ in ext]
        m = np.array([x[:3] for ext in self._multi.values() for x in ext], np.int64).reshape(-1, 3)
        return (np.concatenate([owner, np.array(rows, np.int64)]), np.concatenate([drv.astype(np.int64), m[:, 0]]),
                np.concatenate([off.astype(np.int64), m[:, 1]]), np.concatenate([ln.astype(np.int64), m[:, 2]]))

    def digests_on(self, drives: Sequence[int]) -> list[bytes]:
        """Digests of the objects with at least one extent on any of ``drives`` (a failed drive's objects),
        in one pass over the extent columns.  Under the lock: another thread's put or delete changes the
        map of multi-extent rows that pass walks, and may hand a row to another key before it is named."""
        with self._lock:
            owner, drv, _, _ = self.extent_columns()
            return [self.digest_at(r) for r in np.unique(owner[np.isin(drv, list(drives))]).tolist()]

    def written_since(self, generation: int, drives: Sequence[int]) -> list[bytes]:
        """Digests of the objects of ``generation`` or later with an extent on any of ``drives``: those
        a flush could not make durable when those drives failed it."""
        with self._lock:
            owner, drv, _, _ = self.extent_columns()
            new = self._rows["generation"][owner] >= generation
            return [self.digest_at(r) for r in np.unique(owner[new & np.isin(drv, list(drives))]).tolist()]

    def digest_at(self, row: int) -> bytes:
        return self._rows["digest"][row].tobytes()

    def _put_new(self, items: Sequence[tuple[bytes, Entry]]) -> bool:
        """Record a batch of new, distinct one-extent objects (most batches) at once; False, doing
        nothing, for any other batch.  Under the lock."""
        entries = [e for _, e in items]
        if any(len(e.extents) != 1 for e in entries):
            return False
        drive, offset, length, csum = zip(*[e.extents[0] for e in entries])
        return self._put_new_columns([d for d, _ in items], [e.generation for e in entries],
                                     [e.payload_len for e in entries], drive, offset, length, csum)

    def put_new_singles(self, digests: list[bytes], generation: np.ndarray, payload_len: np.ndarray,
                        drive: np.ndarray, offset: np.ndarray, length: np.ndarray, csum: np.ndarray) -> bool:
        """Record one-extent objects given as columns (a put batch as the store lays it out), when
        every digest is distinct and new to the catalog; False, recording nothing, otherwise (the
        caller then records them through :meth:`put_many`)."""
        if self.follow:
            raise KVSwarmError("a following catalog is read-only: its writer records puts")
        with self._lock:
            return self._put_new_columns(digests, generation, payload_len, drive, offset, length, csum)

    def _put_new_columns(self, digests: list[bytes], generation: object, payload_len: object, drive: object,
                         offset: object, length: object, csum: object) -> bool:
        """Rows, one block of journal records and the index for new, distinct one-extent objects;
        False, doing nothing, when a digest repeats or is held already.  Under the lock."""
        if len(set(digests)) < len(digests) or any(map(self._index.__contains__, digests)):
            return False
        rows = self._new_rows(len(digests))
        self._append(encode_puts(digests, generation, payload_len, drive, offset, length, csum), len(digests))
        self._set_columns(np.array(rows, np.int64), {
            "digest": np.array(digests, "V16"), "generation": generation, "payload_len": payload_len,
            "parts": 1, "drive": drive, "offset": offset, "length": length, "csum": csum}, {})
        self._index.update(zip(digests, rows))
        self._write_if_many()
        return True

    def _append(self, rec: bytes, records: int = 1) -> None:
        self._pending.append(rec)
        self._pending_records += records
        self._records_since_ckpt += records

    def _write_if_many(self) -> None:
        """Write pending records out once there are many, after the change they record is applied in
        memory.  A failed write is not raised here, where the caller could not tell what was applied:
        the records stay pending, and ``sync`` (a flush), which makes them durable, reports it."""
        if self._pending_records >= 4096:
            with contextlib.suppress(OSError):
                self._write_pending()

    def _write_pending(self) -> None:
        if not self._pending:
            return
        if self._jfd < 0:  # a checkpoint could not start its journal: start it now
            self._open_journal()
        start = os.lseek(self._jfd, 0, os.SEEK_END)
        try:
            view = memoryview(b"".join(self._pending))
            while view:  # a full disk may take part of a write: the rest, or an error, follows
                view = view[os.write(self._jfd, view):]
        except BaseException:  # no torn record before the ones a later write appends: cut back to them
            os.ftruncate(self._jfd, start)
            raise
        self._pending.clear()
        self._pending_records = 0

    def sync(self) -> None:
        """Make every record appended so far durable (the caller synced the data first)."""
        if self.follow:
            return
        with self._lock:
            try:
                self._write_pending()
                if self._jfd < 0:
                    self._open_journal()
                os.fsync(self._jfd)
            except OSError as e:
                raise MetadataError(f"cannot write the catalog's journal {self._path(JOURNAL)}: {e.strerror}") from e
            due = self._records_since_ckpt >= self.checkpoint_every
        if due:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Write the whole catalog as one checkpoint and start a fresh journal epoch."""
        if self.follow:
            raise KVSwarmError("a following catalog is read-only: its writer checkpoints")
        with self._lock:
            tmp = self._path(CHECKPOINT + ".tmp")
            try:
                self._write_pending()
                body = self._checkpoint_rows().tobytes()
                rows = len(body) // CKPT_DTYPE.itemsize
                epoch = self.epoch + 1
                try:
                    with open(tmp, "wb") as f:
                        f.write(CHECKPOINT_HEADER.pack(CHECKPOINT_MAGIC, epoch, self.next_generation, rows,
                                                       xxhash.xxh64_intdigest(body)))
                        f.write(body)
                        f.flush()  # out of Python's buffer before the fsync
                        os.fsync(f.fileno())
                except BaseException:  # e.g. a full disk: the old checkpoint and journal stay as they were
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                os.replace(tmp, self._path(CHECKPOINT))
                self._fsync_dir()
                # The new checkpoint holds everything: the old journal is stale from here on (a reopen
                # ignores it), and the next write starts the new epoch's journal if this one cannot.
                self.epoch = epoch
                if self._jfd >= 0:
                    os.close(self._jfd)
                    self._jfd = -1
                self._records_since_ckpt = 0
                self._open_journal()
            except OSError as e:
                raise MetadataError(f"cannot write the catalog's checkpoint in {self.meta_dir}: {e.strerror} "
                                    f"({e.filename or tmp})") from e

    def _open_journal(self) -> None:
        """Start this epoch's (empty) journal and open it for appends."""
        self._reset_journal()
        self._jfd = os.open(self._path(JOURNAL), os.O_WRONLY | os.O_APPEND)

    def _checkpoint_rows(self) -> np.ndarray:
        """One checkpoint row per extent, objects' parts consecutive: one-extent objects straight
        from the table's columns, the few multi-extent ones expanded in Python."""
        t = self._rows[:self._used]
        t = t[t["parts"] > 0]
        single = t[t["parts"] == 1]
        out = np.zeros(len(single), CKPT_DTYPE)
        out["digest"] = single["digest"].view("S16")
        out["parts"] = 1
        for name in ("generation", "payload_len", "drive", "offset", "length", "csum"):
            out[name] = single[name]
        if not self._multi:
            return out
        rows_ = [(self._rows["digest"][r].tobytes(), int(self._rows["generation"][r]),
                  int(self._rows["payload_len"][r]), part, len(ext), *x)
                 for r, ext in self._multi.items() for part, x in enumerate(ext)]
        return np.concatenate([out, np.array(rows_, CKPT_DTYPE)])

    def close(self) -> None:
        try:
            if not self.follow and not self._closed:
                self._closed = True
                self.sync()  # may raise (the journal's disk failing): the fds are closed all the same
        finally:
            if self._jfd >= 0:
                os.close(self._jfd)
                self._jfd = -1
            self._keep_journal(-1)
