"""The catalog's files as bytes (see docs/format.md): the journal's header and records, the
checkpoint's header and rows; encoding records, and telling a whole, valid record from a torn or
damaged one.  :mod:`kvswarm.catalog` keeps the catalog itself, in memory."""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:
    from kvswarm.catalog import Entry

JOURNAL = "catalog.journal"
CHECKPOINT = "catalog.ckpt"
JOURNAL_HEADER = struct.Struct("<8sQ")  # magic, epoch
JOURNAL_MAGIC = b"KVSWJRN1"
CHECKPOINT_MAGIC = b"KVSWCKP1"
# magic, epoch (of the journal that follows), next generation, rows, xxh64(body)
CHECKPOINT_HEADER = struct.Struct("<8sQQQQ")
RECORD = struct.Struct("<IB16sQIH")  # record length, op, digest, generation, payload length, extent count
EXTENT = struct.Struct("<HQIQ")  # drive, offset, length, payload checksum
# The same two layouts as numpy records (packed), for parsing many journal records at once.
RECORD_NP = np.dtype([("len", "<u4"), ("op", "u1"), ("digest", "V16"), ("generation", "<u8"), ("payload_len", "<u4"),
                    ("parts", "<u2")])
EXTENT_NP = np.dtype([("drive", "<u2"), ("offset", "<u8"), ("length", "<u4"), ("csum", "<u8")])
assert RECORD_NP.itemsize == RECORD.size and EXTENT_NP.itemsize == EXTENT.size
CRC = struct.Struct("<I")
RECORD_LEN = struct.Struct("<I")  # a record's first field: its whole length, CRC included
OP_PUT, OP_DEL = 1, 2
# A put record of a one-extent entry, whole (record, extent, CRC over the rest): encoded by the batch.
PUT1_NP = np.dtype(RECORD_NP.descr + EXTENT_NP.descr + [("crc", "<u4")])

# One checkpoint row per extent.
CKPT_DTYPE = np.dtype([("digest", "S16"), ("generation", "<u8"), ("payload_len", "<u4"), ("part", "<u2"),
                       ("parts", "<u2"), ("drive", "<u2"), ("offset", "<u8"), ("length", "<u4"), ("csum", "<u8")])


def encode(op: int, digest: bytes, e: Entry | None, _rec=RECORD.pack, _ext=EXTENT.pack, _crc=CRC.pack,
            _h32=xxhash.xxh32_intdigest) -> bytes:
    if e is None:
        body = _rec(RECORD.size + CRC.size, op, digest, 0, 0, 0)
    else:
        exts = e.extents
        body = _rec(RECORD.size + len(exts) * EXTENT.size + CRC.size, op, digest, e.generation, e.payload_len,
                    len(exts))
        body += _ext(*exts[0]) if len(exts) == 1 else b"".join([_ext(*x) for x in exts])
    return body + _crc(_h32(body))


def encode_puts(digests: list[bytes], generation: object, payload_len: object, drive: object, offset: object,
                 length: object, csum: object, _h32=xxhash.xxh32_intdigest) -> bytes:
    """``encode(OP_PUT, d, e)`` for one-extent objects given as columns (sequences or arrays), at once."""
    rec = np.zeros(len(digests), PUT1_NP)
    rec["len"], rec["op"], rec["parts"] = PUT1_NP.itemsize, OP_PUT, 1
    rec["digest"] = np.array(digests, "V16")
    rec["generation"], rec["payload_len"] = generation, payload_len
    rec["drive"], rec["offset"], rec["length"], rec["csum"] = drive, offset, length, csum
    size, body = PUT1_NP.itemsize, PUT1_NP.itemsize - CRC.size
    mv = memoryview(rec.view(np.uint8))
    rec["crc"] = [_h32(mv[o:o + body]) for o in range(0, len(digests) * size, size)]
    return rec.tobytes()


def record_end(data: bytes, pos: int) -> int | None:
    """Where the journal record at ``pos`` ends, if a whole, valid one starts there."""
    if pos + RECORD.size + CRC.size > len(data):
        return None
    ln = CRC.unpack_from(data, pos)[0]
    if ln < RECORD.size + CRC.size or pos + ln > len(data):
        return None
    return pos + ln if xxhash.xxh32_intdigest(data[pos:pos + ln - 4]) == CRC.unpack_from(data, pos + ln - 4)[0] \
        else None


def holds_nothing(meta_dir: str) -> bool:
    """``meta_dir`` has no checkpoint and no journal record: no object was ever recorded there (what an
    open that died while making a new store leaves)."""
    jp = os.path.join(meta_dir, JOURNAL)
    if os.path.exists(os.path.join(meta_dir, CHECKPOINT)):
        return False
    if not os.path.exists(jp):
        return True
    with open(jp, "rb") as f:
        data = f.read(JOURNAL_HEADER.size + 1)
    return data == JOURNAL_HEADER.pack(JOURNAL_MAGIC, 0)  # the first epoch's journal, without a record


MIN_RECORD, MAX_RECORD = RECORD.size + CRC.size, RECORD.size + 0xFFFF * EXTENT.size + CRC.size


def damaged_at(data: bytes, end: int, window: int = 1 << 20) -> bool:
    """The bad record at ``end`` is damage, not a torn tail: a whole, valid record follows it.  A crash
    mid-append leaves only part of one record at the end; a bit flipped in a record (its length
    field too) leaves the records after it intact.  Looked for at every byte after ``end`` whose
    length and op fields are plausible (numpy, a window at a time), then by its CRC."""
    n = len(data)
    for at in range(end + 1, n - MIN_RECORD + 1, window):
        b = np.frombuffer(data, np.uint8, count=min(window + 4, n - at), offset=at)
        m = len(b) - 4
        if m <= 0:
            break
        ln = b[:m].astype(np.uint32) | b[1:m + 1].astype(np.uint32) << 8 | b[2:m + 2].astype(np.uint32) << 16 \
            | b[3:m + 3].astype(np.uint32) << 24
        op = b[4:m + 4]
        pos = np.arange(at, at + m)
        cand = np.flatnonzero((ln >= MIN_RECORD) & (ln <= MAX_RECORD) & ((op == OP_PUT) | (op == OP_DEL))
                              & (pos + ln <= n))
        if any(record_end(data, at + int(c)) is not None for c in cand.tolist()):
            return True
    return False
