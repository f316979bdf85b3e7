"""Damage to every on-disk structure of a store (docs/format.md), one kind at a time.

Each injector takes the store's :class:`Layout` and a ``random.Random`` and damages one thing: an
extent's payload or header, a drive's superblock or data file, the checkpoint, the journal or the
manifest.  It returns what it hit, or None where the layout has no such target.  ``LOSSY`` kinds
damage what a crash could also have damaged (a torn journal tail): objects journaled there may be
missing or older afterwards, but never wrong.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvswarm.catalog import CHECKPOINT, JOURNAL
from kvswarm.drive import DATA_FILE
from kvswarm.format import ALIGN, HEADER_SIZE, extent_size, header_candidates, header_fields, payload_offset
from kvswarm.store import MANIFEST

JOURNAL_HEADER = 16  # magic, epoch (docs/format.md)
CHECKPOINT_HEADER = 40  # magic, epoch, next generation, rows, checksum
SUPERBLOCK_BYTES = 48  # magic, store id, drive index, capacity, checksum


@dataclass(frozen=True)
class Layout:
    drives: list[str]
    meta_dir: str

    def data(self, i: int) -> str:
        return os.path.join(self.drives[i], DATA_FILE)

    def meta(self, name: str) -> str:
        return os.path.join(self.meta_dir, name)


@dataclass(frozen=True)
class ExtentAt:
    path: str
    offset: int
    payload_len: int

    @property
    def size(self) -> int:
        return extent_size(self.payload_len)


def extents(layout: Layout) -> list[ExtentAt]:
    """The extents whose headers are on the drives (live or not), found by their magic."""
    out = []
    for i in range(len(layout.drives)):
        path = layout.data(i)
        if not os.path.exists(path):
            continue
        raw = np.fromfile(path, np.uint8)
        n = len(raw) // ALIGN
        for blk in header_candidates(raw[: n * ALIGN].reshape(n, ALIGN)).tolist():
            if blk:  # block 0 is the superblock
                out.append(ExtentAt(path, blk * ALIGN, header_fields(raw, blk * ALIGN).payload_len))
    return out


def _rw(path: str, offset: int, n: int, change: Callable[[bytearray], None]) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        buf = bytearray(f.read(n))
        change(buf)
        f.seek(offset)
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())


def _flip(rng: random.Random) -> Callable[[bytearray], None]:
    def change(buf: bytearray) -> None:
        if buf:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)

    return change


def _fill(byte_or_rng: int | random.Random) -> Callable[[bytearray], None]:
    def change(buf: bytearray) -> None:
        if isinstance(byte_or_rng, random.Random):
            buf[:] = byte_or_rng.randbytes(len(buf))
        else:
            buf[:] = bytes([byte_or_rng]) * len(buf)

    return change


def _an_extent(layout: Layout, rng: random.Random) -> ExtentAt | None:
    found = extents(layout)
    return rng.choice(found) if found else None


# ---- extents ------------------------------------------------------------------------------
def payload_bitflip(layout: Layout, rng: random.Random) -> str | None:
    e = _an_extent(layout, rng)
    if e is None or e.payload_len == 0:
        return None
    start = e.offset + payload_offset(e.payload_len)
    _rw(e.path, start, e.payload_len, _flip(rng))
    return f"{e.path}@{e.offset}: one payload bit"


def payload_zero_run(layout: Layout, rng: random.Random) -> str | None:
    e = _an_extent(layout, rng)
    if e is None or e.payload_len < 2:
        return None
    start = e.offset + payload_offset(e.payload_len)
    a = rng.randrange(e.payload_len - 1)
    _rw(e.path, start + a, min(512, e.payload_len - a), _fill(0))
    return f"{e.path}@{e.offset}: payload bytes zeroed"


def header_bitflip(layout: Layout, rng: random.Random) -> str | None:
    e = _an_extent(layout, rng)
    if e is None:
        return None
    _rw(e.path, e.offset, HEADER_SIZE, _flip(rng))
    return f"{e.path}@{e.offset}: one header bit"


def header_zeroed(layout: Layout, rng: random.Random) -> str | None:
    e = _an_extent(layout, rng)
    if e is None:
        return None
    _rw(e.path, e.offset, HEADER_SIZE, _fill(0))
    return f"{e.path}@{e.offset}: header zeroed"


def header_of_another(layout: Layout, rng: random.Random) -> str | None:
    """A valid header of another object over this one's: self-consistent, but not this key's."""
    found = extents(layout)
    if len(found) < 2:
        return None
    a, b = rng.sample(found, 2)
    with open(a.path, "rb") as f:
        f.seek(a.offset)
        head = f.read(HEADER_SIZE)
    _rw(b.path, b.offset, HEADER_SIZE, lambda buf: buf.__setitem__(slice(None), head))
    return f"{b.path}@{b.offset}: header of {a.path}@{a.offset}"


def extent_swapped(layout: Layout, rng: random.Random) -> str | None:
    """Two whole extents of the same size trade places (a misdirected write)."""
    found = extents(layout)
    by_size: dict[int, list[ExtentAt]] = {}
    for e in found:
        by_size.setdefault(e.size, []).append(e)
    pairs = [v for v in by_size.values() if len(v) >= 2]
    if not pairs:
        return None
    a, b = rng.sample(rng.choice(pairs), 2)
    with open(a.path, "rb") as f:
        f.seek(a.offset)
        da = f.read(a.size)
    with open(b.path, "rb") as f:
        f.seek(b.offset)
        db = f.read(b.size)
    _rw(a.path, a.offset, a.size, lambda buf: buf.__setitem__(slice(None), db))
    _rw(b.path, b.offset, b.size, lambda buf: buf.__setitem__(slice(None), da))
    return f"{a.path}@{a.offset} <-> {b.path}@{b.offset}"


def torn_extent(layout: Layout, rng: random.Random) -> str | None:
    """A torn write: the extent's later sectors still hold what was there before (here: zeros)."""
    e = _an_extent(layout, rng)
    if e is None or e.size < 2 * 512:
        return None
    cut = rng.randrange(1, e.size // 512) * 512
    _rw(e.path, e.offset + cut, e.size - cut, _fill(0))
    return f"{e.path}@{e.offset}: torn after {cut} B"


def garbage_block(layout: Layout, rng: random.Random) -> str | None:
    e = _an_extent(layout, rng)
    if e is None:
        return None
    blk = e.offset + rng.randrange(e.size // ALIGN) * ALIGN
    _rw(e.path, blk, ALIGN, _fill(rng))
    return f"{e.path}@{blk}: 4 KiB of random bytes"


# ---- drives -------------------------------------------------------------------------------
def _a_drive(layout: Layout, rng: random.Random) -> int | None:
    live = [i for i in range(len(layout.drives)) if os.path.exists(layout.data(i))]
    return rng.choice(live) if live else None


def superblock_bitflip(layout: Layout, rng: random.Random) -> str | None:
    i = _a_drive(layout, rng)
    if i is None:
        return None
    _rw(layout.data(i), 0, SUPERBLOCK_BYTES, _flip(rng))
    return f"drive {i}: one superblock bit"


def superblock_zeroed(layout: Layout, rng: random.Random) -> str | None:
    i = _a_drive(layout, rng)
    if i is None:
        return None
    _rw(layout.data(i), 0, ALIGN, _fill(0))
    return f"drive {i}: superblock zeroed"


def superblock_of_another(layout: Layout, rng: random.Random) -> str | None:
    """Drive j's superblock on drive i (drives swapped, a copy gone wrong)."""
    if len(layout.drives) < 2:
        return None
    i, j = rng.sample(range(len(layout.drives)), 2)
    with open(layout.data(j), "rb") as f:
        sb = f.read(ALIGN)
    _rw(layout.data(i), 0, ALIGN, lambda buf: buf.__setitem__(slice(None), sb))
    return f"drive {i}: superblock of drive {j}"


def data_file_truncated(layout: Layout, rng: random.Random) -> str | None:
    i = _a_drive(layout, rng)
    if i is None:
        return None
    size = os.path.getsize(layout.data(i))
    keep = rng.choice([0, ALIGN, size // 2 // ALIGN * ALIGN, size - ALIGN])
    os.truncate(layout.data(i), keep)
    return f"drive {i}: data file truncated to {keep} B"


def data_file_deleted(layout: Layout, rng: random.Random) -> str | None:
    i = _a_drive(layout, rng)
    if i is None:
        return None
    os.unlink(layout.data(i))
    return f"drive {i}: data file deleted"


# ---- catalog: checkpoint and journal -------------------------------------------------------------
def _meta_file(layout: Layout, name: str) -> str | None:
    p = layout.meta(name)
    return p if os.path.exists(p) else None


def _bitflip_in(name: str, lo: int, hi: int | None = None, keep_lowest_bit: bool = False):
    """One bit flipped in bytes [lo, hi) of a metadata file.  ``keep_lowest_bit``: never bit 0 of byte
    ``lo`` (for the journal's epoch: epoch - 1 is what a crash between a checkpoint and the reset of
    its journal leaves, a stale journal a store must ignore)."""

    def inject(layout: Layout, rng: random.Random) -> str | None:
        p = _meta_file(layout, name)
        if p is None:
            return None
        end = os.path.getsize(p) if hi is None else min(hi, os.path.getsize(p))
        if end <= lo:
            return None
        at = rng.randrange(lo, end)
        bit = rng.randrange(1 if keep_lowest_bit and at == lo else 0, 8)
        _rw(p, at, 1, lambda buf: buf.__setitem__(0, buf[0] ^ (1 << bit)))
        return f"{name}: bit {bit} flipped at byte {at}"

    return inject


def journal_records(path: str) -> list[tuple[int, int]]:
    """(offset, length) of the journal's records: each starts with its length, a u32."""
    with open(path, "rb") as f:
        data = f.read()
    out, o = [], JOURNAL_HEADER
    while o + 4 <= len(data):
        n = int.from_bytes(data[o:o + 4], "little")
        if n < 8 or o + n > len(data):
            break
        out.append((o, n))
        o += n
    return out


def _record_bitflip(last: bool):
    """One bit in a journal record: a record followed by others (damage, not a torn tail), or the last
    one (which a crash's torn append also leaves)."""

    def inject(layout: Layout, rng: random.Random) -> str | None:
        p = _meta_file(layout, JOURNAL)
        recs = journal_records(p) if p else []
        if len(recs) < 2:
            return None
        o, n = recs[-1] if last else rng.choice(recs[:-1])
        at = o + rng.randrange(n)
        _rw(p, at, 1, lambda buf: buf.__setitem__(0, buf[0] ^ (1 << rng.randrange(8))))
        return f"journal: bit flipped at byte {at} (record at {o})"

    return inject


def _truncated(name: str, below: int | None = None, tail: bool = False):
    def inject(layout: Layout, rng: random.Random) -> str | None:
        p = _meta_file(layout, name)
        if p is None:
            return None
        size = os.path.getsize(p)
        if tail:
            if size <= JOURNAL_HEADER + 1:
                return None
            keep = size - rng.randrange(1, min(64, size - JOURNAL_HEADER))
        else:
            keep = rng.randrange(0, below if below is not None else max(1, size))
        os.truncate(p, keep)
        return f"{name}: truncated to {keep} of {size} B"

    return inject


def _deleted(name: str):
    def inject(layout: Layout, rng: random.Random) -> str | None:
        p = _meta_file(layout, name)
        if p is None:
            return None
        os.unlink(p)
        return f"{name}: deleted"

    return inject


def _garbage(name: str, append: bool = False):
    def inject(layout: Layout, rng: random.Random) -> str | None:
        p = _meta_file(layout, name)
        if p is None:
            return None
        if append:
            junk = rng.randbytes(rng.randrange(1, 200))
            with open(p, "ab") as f:
                f.write(junk)
            return f"{name}: {len(junk)} random bytes appended"
        junk = rng.randbytes(max(64, os.path.getsize(p)))
        with open(p, "wb") as f:
            f.write(junk)
        return f"{name}: replaced by {len(junk)} random bytes"

    return inject


def _manifest_edit(change: Callable[[dict, random.Random], None], what: str):
    def inject(layout: Layout, rng: random.Random) -> str | None:
        p = _meta_file(layout, MANIFEST)
        if p is None:
            return None
        with open(p) as f:
            m = json.load(f)
        change(m, rng)
        with open(p, "w") as f:
            json.dump(m, f)
        return f"manifest: {what}"

    return inject


def _reorder(m: dict, rng: random.Random) -> None:
    m["drives"] = m["drives"][1:] + m["drives"][:1]


def _new_uuid(m: dict, rng: random.Random) -> None:
    m["uuid"] = rng.randbytes(16).hex()


def _emptied(m: dict, rng: random.Random) -> None:
    m.clear()


def _manifest_truncated(layout: Layout, rng: random.Random) -> str | None:
    p = _meta_file(layout, MANIFEST)
    if p is None:
        return None
    size = os.path.getsize(p)
    os.truncate(p, rng.randrange(0, size))
    return "manifest: truncated"


Injector = Callable[[Layout, random.Random], "str | None"]

KINDS: dict[str, Injector] = {
    "payload_bitflip": payload_bitflip,
    "payload_zero_run": payload_zero_run,
    "header_bitflip": header_bitflip,
    "header_zeroed": header_zeroed,
    "header_of_another": header_of_another,
    "extent_swapped": extent_swapped,
    "torn_extent": torn_extent,
    "garbage_block": garbage_block,
    "superblock_bitflip": superblock_bitflip,
    "superblock_zeroed": superblock_zeroed,
    "superblock_of_another": superblock_of_another,
    "data_file_truncated": data_file_truncated,
    "data_file_deleted": data_file_deleted,
    "checkpoint_header_bitflip": _bitflip_in(CHECKPOINT, 0, CHECKPOINT_HEADER),
    "checkpoint_body_bitflip": _bitflip_in(CHECKPOINT, CHECKPOINT_HEADER),
    "checkpoint_below_header": _truncated(CHECKPOINT, below=CHECKPOINT_HEADER),
    "checkpoint_truncated": _truncated(CHECKPOINT),
    "checkpoint_deleted": _deleted(CHECKPOINT),
    "checkpoint_garbage": _garbage(CHECKPOINT),
    "journal_magic_bitflip": _bitflip_in(JOURNAL, 0, 8),
    "journal_epoch_bitflip": _bitflip_in(JOURNAL, 8, JOURNAL_HEADER, keep_lowest_bit=True),
    "journal_record_bitflip": _record_bitflip(last=False),
    "journal_last_record_bitflip": _record_bitflip(last=True),
    "journal_torn_tail": _truncated(JOURNAL, tail=True),
    "journal_deleted": _deleted(JOURNAL),
    "journal_garbage": _garbage(JOURNAL),
    "journal_garbage_appended": _garbage(JOURNAL, append=True),
    "manifest_empty_object": _manifest_edit(_emptied, "{}"),
    "manifest_drives_reordered": _manifest_edit(_reorder, "drive list reordered"),
    "manifest_other_store": _manifest_edit(_new_uuid, "another store's id"),
    "manifest_garbage": _garbage(MANIFEST),
    "manifest_truncated": _manifest_truncated,
    "manifest_deleted": _deleted(MANIFEST),
}
# A crash can leave these too (a torn journal tail): what was journaled there may be gone or older.
LOSSY = frozenset({"journal_torn_tail", "journal_last_record_bitflip"})
