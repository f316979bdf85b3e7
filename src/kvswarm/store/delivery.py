"""Where a read batch's verified payloads end up: read straight into the caller's buffers, copied
into them, or left in the batch's buffer lease (an object of several extents joined there)."""

from __future__ import annotations

import ctypes

import numpy as np

from kvswarm.buffers import Lease
from kvswarm.catalog import ExtentTable
from kvswarm.format import ALIGN, sector_payload
from kvswarm.store.runs import Bufs, bufs_len, runs_of


def direct_reads(ext: ExtentTable, bufs: list[Bufs | None]) -> np.ndarray:
    """Per extent: whether its payload can be read straight into its object's buffer (see
    KVStore.submit_get, ``in_place``): the object's only extent, a whole number of sectors on
    sectors of its own, and a plain writable buffer of exactly that length, 4 KiB-aligned."""
    pp = ext.part_payload
    direct = (ext.parts == 1) & sector_payload(pp)
    obj, lens = ext.obj.tolist(), pp.tolist()
    for i in np.flatnonzero(direct).tolist():
        b = bufs[obj[i]]
        direct[i] = (isinstance(b, memoryview) and len(b) == lens[i] and not b.readonly
                     and ctypes.addressof(ctypes.c_char.from_buffer(b)) % ALIGN == 0)
    return direct


def copy_into(views: list, found: list[int], good: list[int], into: list[Bufs | None]) -> int:
    """Hand verified payloads over in the caller's buffers; returns how many hits become
    misses because their buffer's length differs."""
    lost = 0
    for i in good:
        buf, v = into[i], views[found[i]]
        if buf is None:
            continue
        if bufs_len(buf) != len(v):
            views[found[i]] = None
            lost += 1
        else:
            src, at = np.frombuffer(v, np.uint8), 0
            for run, m in runs_of(buf):
                np.copyto(run, src[at:at + m])  # releases the GIL
                at += m
            views[found[i]] = buf
    return lost


def join_in_place(lease: Lease, spans: list[tuple[int, int]]) -> memoryview:
    """One contiguous view of a verified multi-extent object (``spans``: each part's payload as
    (pool offset, bytes)): later parts' payloads slide over the headers between them, inside the
    lease (no new allocation, one memmove each)."""
    base = lease.pool.base_address
    dst = spans[0][0] + spans[0][1]
    for src, size in spans[1:]:
        ctypes.memmove(base + dst, base + src, size)  # overlapping ranges: memmove semantics
        dst += size
    start = spans[0][0] - lease.offset
    return lease.view[start:start + dst - spans[0][0]]
