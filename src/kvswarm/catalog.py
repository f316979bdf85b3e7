"""Catalog: key digest -> extents, persisted as an append-only journal plus checkpoints.

Durability contract: records are appended (in memory, then to the journal file) only
after the object's data writes completed; :meth:`Catalog.sync` fsyncs the journal.
A checkpoint is written to a temporary file, fsynced and renamed over the old one, and
carries the *epoch* of the journal that continues it, so a crash between checkpoint and
journal reset never replays stale records.  Torn journal tails fail their checksum and
end the replay.  See docs/format.md.
"""

from __future__ import annotations

import contextlib
import gc
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from kvswarm.errors import KVSwarmError

JOURNAL = "catalog.journal"
CHECKPOINT = "catalog.ckpt"
_JHDR = struct.Struct("<8sQ")  # magic, epoch
_J_MAGIC = b"KVSWJRN1"
_C_MAGIC = b"KVSWCKP1"
_CHDR = struct.Struct("<8sQQQQ")  # magic, epoch (of the journal that follows), next generation, rows, xxh64(body)
_REC = struct.Struct("<IB16sQIH")  # record length, op, digest, generation, payload length, extent count
_EXT = struct.Struct("<HQIQ")  # drive, offset, length, payload checksum
_CRC = struct.Struct("<I")
OP_PUT, OP_DEL = 1, 2

# One checkpoint row per extent.
CKPT_DTYPE = np.dtype([("digest", "S16"), ("generation", "<u8"), ("payload_len", "<u4"), ("part", "<u2"),
                       ("parts", "<u2"), ("drive", "<u2"), ("offset", "<u8"), ("length", "<u4"), ("csum", "<u8")])

Extent = tuple[int, int, int, int]  # drive, offset, length on disk, payload checksum


@dataclass(slots=True)
class Entry:
    generation: int
    payload_len: int
    extents: tuple[Extent, ...]


class CatalogCorrupt(KVSwarmError):
    """The checkpoint file fails its checksum (the journal alone cannot rebuild it)."""


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


def _encode(op: int, digest: bytes, e: Entry | None, _rec=_REC.pack, _ext=_EXT.pack, _crc=_CRC.pack,
            _h32=xxhash.xxh32_intdigest) -> bytes:
    if e is None:
        body = _rec(_REC.size + _CRC.size, op, digest, 0, 0, 0)
    else:
        exts = e.extents
        body = _rec(_REC.size + len(exts) * _EXT.size + _CRC.size, op, digest, e.generation, e.payload_len, len(exts))
        body += _ext(*exts[0]) if len(exts) == 1 else b"".join([_ext(*x) for x in exts])
    return body + _crc(_h32(body))


class Catalog:
    def __init__(self, meta_dir: str, checkpoint_every: int = 500_000) -> None:
        self.meta_dir = meta_dir
        self.checkpoint_every = checkpoint_every
        self.entries: dict[bytes, Entry] = {}
        self.next_generation = 1
        self.epoch = 0
        self.replayed = 0
        self.torn_tail = False
        self._pending: list[bytes] = []
        self._records_since_ckpt = 0
        self._lock = threading.Lock()
        self._ckpt_extents: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._load()
        self._jfd = os.open(self._path(JOURNAL), os.O_WRONLY | os.O_APPEND)

    def _path(self, name: str) -> str:
        return os.path.join(self.meta_dir, name)

    # ---- recovery ------------------------------------------------------------------
    def _load(self) -> None:
        os.makedirs(self.meta_dir, exist_ok=True)
        with _no_gc():
            ck = self._path(CHECKPOINT)
            if os.path.exists(ck):
                self._load_checkpoint(ck)
            jp = self._path(JOURNAL)
            if os.path.exists(jp):
                with open(jp, "rb") as f:
                    data = f.read()
                if len(data) >= _JHDR.size and _JHDR.unpack_from(data)[0] == _J_MAGIC \
                        and _JHDR.unpack_from(data)[1] == self.epoch:
                    self._replay(data)
                    return
            self._reset_journal()

    def _load_checkpoint(self, path: str) -> None:
        with open(path, "rb") as f:
            head = f.read(_CHDR.size)
            body = f.read()
        magic, epoch, next_gen, rows, csum = _CHDR.unpack(head)
        if magic != _C_MAGIC or len(body) != rows * CKPT_DTYPE.itemsize or xxhash.xxh64_intdigest(body) != csum:
            raise CatalogCorrupt(f"checkpoint {path} is corrupt")
        self.epoch, self.next_generation = epoch, next_gen
        arr = np.frombuffer(body, CKPT_DTYPE)
        if not rows:
            return
        self._ckpt_extents = (arr["drive"].astype(np.int64), arr["offset"].astype(np.int64),
                              arr["length"].astype(np.int64))
        # Rows are grouped by object (parts in order), so an object starts where part == 0.
        starts = np.flatnonzero(arr["part"] == 0)
        # V16 keeps trailing NUL bytes of a digest (S16 would strip them).
        digests = arr["digest"][starts].astype("V16").tolist()
        exts = zip(arr["drive"].tolist(), arr["offset"].tolist(), arr["length"].tolist(), arr["csum"].tolist())
        counts = np.diff(np.append(starts, rows))
        k = int(counts[0])
        if (counts == k).all():  # every object has k extents: group them without a Python loop body
            grouped = zip(*[exts] * k)  # k consecutive extents per tuple
        else:
            ext_list = list(exts)
            grouped = (tuple(ext_list[a:a + n]) for a, n in zip(starts.tolist(), counts.tolist()))
        self.entries.update(zip(digests, map(Entry, arr["generation"][starts].tolist(),
                                             arr["payload_len"][starts].tolist(), grouped)))

    def _replay(self, data: bytes) -> None:
        pos, n = _JHDR.size, len(data)
        entries = self.entries
        view = memoryview(data)
        h32, rec_at, ext_at, crc_at, len_at = (xxhash.xxh32_intdigest, _REC.unpack_from, _EXT.unpack_from,
                                               _CRC.unpack_from, struct.Struct("<I").unpack_from)
        top_gen = self.next_generation - 1
        replayed = 0
        while pos + _REC.size + _CRC.size <= n:
            ln = len_at(data, pos)[0]
            if ln < _REC.size + _CRC.size or pos + ln > n:
                break
            if h32(view[pos:pos + ln - 4]) != crc_at(data, pos + ln - 4)[0]:
                break
            _, op, digest, gen, plen, nex = rec_at(data, pos)
            if op == OP_PUT:
                base = pos + _REC.size
                exts = (ext_at(data, base),) if nex == 1 else \
                    tuple(ext_at(data, base + i * _EXT.size) for i in range(nex))
                entries[digest] = Entry(gen, plen, exts)
                if gen > top_gen:
                    top_gen = gen
            elif op == OP_DEL:
                entries.pop(digest, None)
            pos += ln
            replayed += 1
        view.release()
        if replayed:
            self._ckpt_extents = None
        self.replayed += replayed
        self.next_generation = top_gen + 1
        self.torn_tail = pos != n
        if self.torn_tail:
            # Cut the torn record off so that later appends follow a valid one.
            with open(self._path(JOURNAL), "r+b") as f:
                f.truncate(pos)
                os.fsync(f.fileno())
        self._records_since_ckpt = self.replayed

    def _reset_journal(self) -> None:
        tmp = self._path(JOURNAL + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_JHDR.pack(_J_MAGIC, self.epoch))
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

    def put_many(self, items: list[tuple[bytes, Entry]]) -> list[Entry | None]:
        """:meth:`put` for a batch, under one lock round."""
        out: list[Entry | None] = []
        entries = self.entries
        with self._lock:
            for digest, entry in items:
                old = entries.get(digest)
                if old is not None and old.generation > entry.generation:
                    out.append(entry)
                    continue
                entries[digest] = entry
                self._append(_encode(OP_PUT, digest, entry))
                out.append(old)
        return out

    def put(self, digest: bytes, entry: Entry) -> Entry | None:
        """Record ``entry``; returns the entry it replaces (whose extents the caller frees)."""
        with self._lock:
            old = self.entries.get(digest)
            if old is not None and old.generation > entry.generation:
                return entry  # a newer write won the race: the caller frees this one
            self.entries[digest] = entry
            self._append(_encode(OP_PUT, digest, entry))
            return old

    def delete(self, digest: bytes) -> Entry | None:
        with self._lock:
            old = self.entries.pop(digest, None)
            if old is not None:
                self._append(_encode(OP_DEL, digest, None))
            return old

    def get(self, digest: bytes) -> Entry | None:
        return self.entries.get(digest)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[bytes, Entry]]:
        return iter(list(self.entries.items()))

    def take_checkpoint_extents(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(drive, offset, length) of every extent held, while the catalog is exactly the
        checkpoint it was loaded from (no replayed record, no change since); else None.
        Lets a reopen rebuild free space without walking the entries; given out once (memory)."""
        cols, self._ckpt_extents = self._ckpt_extents, None
        return cols

    def _append(self, rec: bytes) -> None:
        self._ckpt_extents = None
        self._pending.append(rec)
        self._records_since_ckpt += 1
        if len(self._pending) >= 4096:
            self._write_pending()

    def _write_pending(self) -> None:
        if self._pending:
            os.write(self._jfd, b"".join(self._pending))
            self._pending.clear()

    def sync(self) -> None:
        """Make every record appended so far durable (the caller synced the data first)."""
        with self._lock:
            self._write_pending()
            os.fsync(self._jfd)
            due = self._records_since_ckpt >= self.checkpoint_every
        if due:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Write the whole catalog as one checkpoint and start a fresh journal epoch."""
        with self._lock:
            self._write_pending()
            with _no_gc():
                rows_ = [(digest, e.generation, e.payload_len, part, len(e.extents), *x)
                         for digest, e in self.entries.items() for part, x in enumerate(e.extents)]
                rows = len(rows_)
                body = np.array(rows_, dtype=CKPT_DTYPE).tobytes() if rows_ else b""
                del rows_
            epoch = self.epoch + 1
            tmp = self._path(CHECKPOINT + ".tmp")
            with open(tmp, "wb") as f:
                f.write(_CHDR.pack(_C_MAGIC, epoch, self.next_generation, rows, xxhash.xxh64_intdigest(body)))
                f.write(body)
                os.fsync(f.fileno())
            os.replace(tmp, self._path(CHECKPOINT))
            self._fsync_dir()
            self.epoch = epoch
            os.close(self._jfd)
            self._reset_journal()
            self._jfd = os.open(self._path(JOURNAL), os.O_WRONLY | os.O_APPEND)
            self._records_since_ckpt = 0

    def close(self) -> None:
        if self._jfd >= 0:
            self.sync()
            os.close(self._jfd)
            self._jfd = -1
