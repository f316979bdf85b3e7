"""A read batch's verification: arrays in (the catalog's extents, what the reads returned, where
they landed), verdicts out (per extent: read in full, header and payload as the catalog says).

Headers are compared here; payload checksums are checked by the native worker
(``kvswarm/native/verify.c``) where the build compiled it, which also copies each verified payload
into the caller's buffer, else here in Python.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvswarm.buffers import Lease, LeaseViews
from kvswarm.catalog import ExtentTable
from kvswarm.format import ALIGN, HEADER_COLUMNS, HEADER_SIZE, PAYLOAD_CHECKSUM, expected_headers, sector_payload
from kvswarm.store.runs import Bufs, part_of, sized

try:  # the native verify-and-copy worker (kvswarm/native/verify.c), where the build compiled it
    from kvswarm.store._verify import assist as verify_assist
    from kvswarm.store._verify import drain as _drain_verify
    from kvswarm.store._verify import submit as verify_submit

    atexit.register(_drain_verify)  # no job may still be reading the pool while the interpreter frees it
except ImportError:  # the Python checks alone; nothing then asks for the worker's help
    verify_submit = verify_assist = None

VERIFY_JOB_BYTES = 4 << 20  # payload bytes per native verify job (see check_batch)


@dataclass(slots=True)
class Check:
    """A batch under verification (see check_batch); ``ok`` and the caller's buffers in
    ``dst`` are final once its ``jobs`` (the native worker's, if any) are done."""

    results: Sequence[int | None]  # per extent: bytes read or -errno
    io_ok: np.ndarray
    ok: np.ndarray  # per extent: read in full, header and payload as the catalog says
    single: bool  # one extent per object
    at: np.ndarray  # per extent: where its payload lies in the pool
    payloads: Sequence  # per extent: its payload's view (LeaseViews) or the caller's buffer it was read into
    dst: list[Bufs | None] | None  # per object, the caller's buffer the worker copies its verified extents into
    jobs: tuple  # kvswarm.store._verify.Job, each for a run of the extents
    in_place: tuple[np.ndarray, np.ndarray] | None = None  # extents read into the caller's buffers, and their outcome

    @property
    def done(self) -> bool:
        return all(job.done for job in self.jobs)

    def outcome(self) -> np.ndarray:
        """``ok``, once the jobs are done: every extent read in full and verified."""
        if self.in_place is not None:
            idx, got = self.in_place
            self.ok[idx] = got
            self.in_place = None
        return self.ok


@dataclass(slots=True)
class Reads:
    """How a batch's extents were read: where each starts in the lease, and the caller's
    buffers that verified payloads are copied into."""

    starts: np.ndarray
    into: list[Bufs | None] | None = None  # per located object, the caller's buffer (or runs)
    direct: np.ndarray | None = None  # per extent: its payload was read straight into the caller's buffer


def verify_jobs(src: object, offs: np.ndarray, lens: np.ndarray, sums: np.ndarray, oks: np.ndarray,
                 into: list[Bufs | None] | None) -> tuple:
    """A batch's payloads handed to the native worker (``src`` None: each verified in its ``into``
    buffer) as jobs of about VERIFY_JOB_BYTES each: a big batch (the last of a restore, or a lone
    request's) is then verified by the worker and an assisting thread together."""
    k = len(lens)
    cuts = np.searchsorted(np.cumsum(lens), np.arange(VERIFY_JOB_BYTES, int(lens.sum()), VERIFY_JOB_BYTES),
                           side="right").tolist()
    return tuple(verify_submit(src, offs[a:b], lens[a:b], sums[a:b], oks[a:b], None if into is None else into[a:b])
                 for a, b in zip([0, *cuts], [*cuts, k]) if b > a)



def hand_over(views: list, found: list[int], good: list[int], into: list[Bufs | None],
               dst: list[Bufs | None]) -> int:
    """Point verified hits at the buffers the native pass copied them into; returns how many
    hits become misses because their buffer's length differs."""
    lost = 0
    for i in good:
        if dst[i] is not None:
            views[found[i]] = dst[i]
        elif into[i] is not None:
            views[found[i]] = None
            lost += 1
    return lost


def check_batch(pool: np.ndarray, ext: ExtentTable, reads: Reads, results: Sequence[int | None],
                lease: Lease | None) -> Check | None:
    """Start verifying a batch whose reads are back, in a few array operations: each extent
    must have read in full and its header must equal the one the catalog predicts (every
    field, byte for byte), checked here; its payload must match the checksum, hashed per
    extent by the native worker if there is one (which also copies each verified extent's
    payload into its part of the caller's buffer), else here.  ``pool`` is the buffer pool's
    bytes (``BufferPool.array``) the batch's lease lies in."""
    if not len(ext.length):
        return None
    k, starts, pp, direct = len(ext.length), reads.starts, ext.part_payload, reads.direct
    io_ok = np.array(results, np.int64) == (ext.length if direct is None else np.where(direct, pp, ext.length))
    sector = sector_payload(pp)
    single = len(ext.obj) == len(ext.rows)  # one extent per object: extents and rows line up
    rows = ext.rows if single else ext.rows[ext.obj]
    hdr = expected_headers(rows["digest"], rows["payload_len"], ext.part, ext.parts, rows["generation"], ext.csum,
                           sector)
    at = (lease.offset if lease is not None else 0) + starts
    poff = np.where(sector, ALIGN, HEADER_SIZE)
    payload_at = at + poff
    if direct is None:
        ok = io_ok & (pool[at[:, None] + HEADER_COLUMNS] == hdr).all(1)
        lv = lease.view
        payloads = LeaseViews(lv, starts + poff, pp)
    else:  # a payload read in place came without its header: the catalog's checksum alone vouches for it
        ok = io_ok.copy()
        pooled = np.flatnonzero(~direct)
        ok[pooled] &= (pool[at[pooled][:, None] + HEADER_COLUMNS] == hdr[pooled]).all(1)
        lv, obj = lease.view if lease is not None else None, ext.obj.tolist()
        payloads = [reads.into[obj[i]] if d else lv[a:a + m]
                    for i, (a, m, d) in enumerate(zip((starts + poff).tolist(), pp.tolist(), direct.tolist()))]
    dst = parts = None
    if verify_submit is not None and reads.into is not None:
        dst = sized(reads.into, ext.rows["payload_len"])
        parts = dst
        if not single:  # each extent's payload goes to its own slice of the object's buffer
            cs = np.cumsum(pp) - pp
            at_obj = (cs - cs[np.flatnonzero(ext.part == 0)][ext.obj]).tolist()
            parts = [None if dst[o] is None else part_of(dst[o], a, n)
                     for o, a, n in zip(ext.obj.tolist(), at_obj, pp.tolist())]
    jobs: tuple = ()
    in_place = None
    if verify_submit is not None:
        lens, sums = pp.astype(np.int64), np.ascontiguousarray(ext.csum, np.uint64)
        if direct is not None:  # verified where they lie, by jobs of their own; the pool's skip them
            d = np.flatnonzero(direct)
            in_place = (d, ok[d])
            ok[d] = False
            parts = [None if x else q for q, x in zip(parts, direct.tolist())]
            jobs = verify_jobs(None, np.zeros(len(d), np.int64), lens[d], sums[d], in_place[1].view(np.uint8),
                                [payloads[i] for i in d.tolist()])
        if direct is None or not direct.all():
            jobs += verify_jobs(pool, payload_at, lens, sums, ok.view(np.uint8), parts)
    else:
        ok &= np.fromiter(map(PAYLOAD_CHECKSUM, payloads), np.uint64, k) == ext.csum
    return Check(results, io_ok, ok, single, payload_at, payloads, dst, jobs, in_place)
