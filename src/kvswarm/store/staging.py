"""A put batch laid out in its buffer lease before it is written: each extent's payload gathered,
its header packed and its checksum taken, by the native module (one call per batch) or in Python.

Both take the batch as the store allocated it: per object ``(digest, generation, length, parts)``;
per extent ``(drive, offset, extent bytes, payload bytes)`` and its payload's source.  Both return
the staged objects (``(digest, Entry, parts)`` each, for the catalog once the writes land) and what
the write path submits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvswarm.buffers import Lease
from kvswarm.catalog import Entry, Extent
from kvswarm.format import ALIGN, HEADER_SIZE, PAYLOAD_CHECKSUM, pack_header, payload_offset, sector_payload
from kvswarm.io import IORequest, Op
from kvswarm.io import native as native_io
from kvswarm.store.runs import Bufs, Runs, runs_of

_ZEROS = bytes(ALIGN)  # extent padding (always shorter than 4 KiB)


@dataclass(frozen=True, slots=True, eq=False)
class Singles(Sequence):
    """A staged put batch of one-extent objects as columns (what the native path lays out), recorded
    in the catalog as columns; as a sequence, its ``(digest, Entry, 1)`` items, made on demand for
    the paths that handle objects one by one (a failed write, a digest written before)."""

    digests: list[bytes]
    generation: np.ndarray
    payload_len: np.ndarray
    drive: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    csum: np.ndarray

    def __len__(self) -> int:
        return len(self.digests)

    def __getitem__(self, i: int) -> tuple[bytes, Entry, int]:  # type: ignore[override]
        return self.digests[i], Entry(int(self.generation[i]), int(self.payload_len[i]), (Extent(
            int(self.drive[i]), int(self.offset[i]), int(self.length[i]), int(self.csum[i])),)), 1

    def __iter__(self) -> Iterator[tuple[bytes, Entry, int]]:
        cols = (self.generation, self.payload_len, self.drive, self.offset, self.length, self.csum)
        for digest, gen, n, drv, off, ln, cs in zip(self.digests, *(c.tolist() for c in cols)):
            yield digest, Entry(gen, n, (Extent(drv, off, ln, cs),)), 1


def stage_python(objs: list[tuple[bytes, int, int, int]], cols: list[tuple[int, int, int, int]],
                 srcs: list[Bufs], lease: Lease) -> tuple[list[tuple[bytes, Entry, int]], list[IORequest]]:
    """Lay the extents out in the lease (payload, header, checksum); the staged objects and the
    I/O engine's write requests."""
    # Payloads and headers are written through the pool's mmap (a plain buffer copy);
    # the I/O requests get memoryviews of the same bytes.
    mm, view, base = lease.view.obj, lease.view, lease.offset
    lease_arr = np.frombuffer(view, np.uint8)
    header, h3, write = pack_header, PAYLOAD_CHECKSUM, Op.WRITE
    staged: list[tuple[bytes, Entry, int]] = []
    reqs: list[IORequest] = []
    pos = k = 0
    for digest, gen, n, parts in objs:
        exts = []
        for part in range(parts):
            (drv, off, ext_len, c), chunk = cols[k], srcs[k]
            k += 1
            a = base + pos
            p = payload_offset(c)
            if isinstance(chunk, Runs):
                at = pos + p
                for run, m in runs_of(chunk):
                    lease_arr[at:at + m] = run
                    at += m
                chunk = view[pos + p:pos + p + c]  # hashed where it was gathered
            else:
                mm[a + p:a + p + c] = chunk
            if p > HEADER_SIZE:  # the header's sector: zeros after the header
                mm[a + HEADER_SIZE:a + p] = _ZEROS[:p - HEADER_SIZE]
            if pad := ext_len - p - c:
                mm[a + ext_len - pad:a + ext_len] = _ZEROS[:pad]
            csum = h3(chunk)
            mm[a:a + HEADER_SIZE] = header(digest, n, part, parts, gen, csum, p > HEADER_SIZE)
            exts.append(Extent(drv, off, ext_len, csum))
            reqs.append(IORequest(drv, write, off, view[pos:pos + ext_len]))
            pos += ext_len
        staged.append((digest, Entry(gen, n, tuple(exts)), parts))
    return staged, reqs


def stage_native(objs: list[tuple[bytes, int, int, int]], cols: list[tuple[int, int, int, int]],
                 srcs: list[Bufs], lease: Lease) -> tuple[Sequence[tuple[bytes, Entry, int]], tuple]:
    """The extents' layout (payload gathered, header packed, checksums) in kvswarm.io._batchio, one
    call per batch; the staged objects (as columns when each has one extent) and the native write
    batch's columns."""
    drive, offset, ext_len, plen = np.array(cols, np.int64).reshape(-1, 4).T.copy()  # rows contiguous
    at = lease.offset + np.cumsum(ext_len) - ext_len
    nparts = np.array([p for *_, p in objs], np.int64)
    part = np.arange(len(cols), dtype=np.int64) - np.repeat(np.cumsum(nparts) - nparts, nparts)

    def per_extent(values: list, dtype: object) -> np.ndarray:  # an object's value for each of its extents
        return np.repeat(np.array(values, dtype), nparts)

    obj_len = per_extent([n for _, _, n, _ in objs], np.int64)
    gen = per_extent([g for _, g, _, _ in objs], np.int64)
    sums = native_io.pack(lease.pool.array, at, ext_len, np.where(sector_payload(plen), ALIGN, HEADER_SIZE),
                          plen, srcs, per_extent([d for d, *_ in objs], "V16").tobytes(), obj_len, part,
                          np.repeat(nparts, nparts), gen)
    if len(cols) == len(objs):  # one extent per object
        singles = Singles([d for d, *_ in objs], gen, obj_len, drive, offset, ext_len, sums)
        return singles, (drive, offset, ext_len, at)
    csums = sums.tolist()
    staged: list[tuple[bytes, Entry, int]] = []
    k = 0
    for digest, gen, n, parts in objs:
        exts = tuple(Extent(d, o, ln, cs) for (d, o, ln, _), cs in zip(cols[k:k + parts], csums[k:k + parts]))
        staged.append((digest, Entry(gen, n, exts), parts))
        k += parts
    return staged, (drive, offset, ext_len, at)
