"""A put batch staged by the native module and by Python lays out the same bytes and the same catalog entries."""

import numpy as np
import pytest
import xxhash

from kvswarm.buffers import BufferPool
from kvswarm.format import extent_size
from kvswarm.io import native as native_io
from kvswarm.store import staging
from kvswarm.store.runs import Runs

UNIT = 16384 - 64  # stripe unit minus the header: an object larger than this has several parts


def _batch(rng: np.random.Generator):
    """Objects of one part (odd lengths, whole sectors, one given as Runs) and of three parts; each
    extent on a drive at an offset as the allocator would give them."""
    lens = [100, 4096, 8000, 3 * UNIT - 7, 12288, 1]
    datas = [rng.bytes(n) for n in lens]
    page = bytearray(rng.bytes(20000))  # object 4's bytes as runs of an engine's page, out of order
    datas[4] = bytes(page[12000:16096]) + bytes(page[0:8192])
    runs = {4: Runs(memoryview(page), np.array([12000, 0], np.int64), np.array([4096, 8192], np.int64))}
    objs, cols, srcs, off = [], [], [], 0
    for j, (data, n) in enumerate(zip(datas, lens)):
        parts = max(1, -(-n // UNIT))
        mv = memoryview(data)
        for part in range(parts):
            c = min(UNIT, n - part * UNIT)
            cols.append((j % 3, off, extent_size(c), c))
            srcs.append(runs[j] if j in runs else mv[part * UNIT:part * UNIT + c] if parts > 1 else mv)
            off += extent_size(c)
        objs.append((bytes([j]) * 16, 1000 + j, n, parts))
    return objs, cols, srcs, datas


@pytest.mark.skipif(not native_io.enabled(), reason="the native module is not built")
def test_native_and_python_staging_lay_out_the_same_bytes_and_entries():
    objs, cols, srcs, datas = _batch(np.random.default_rng(7))
    total = sum(c[2] for c in cols)
    leases = []
    for stage in (staging.stage_python, staging.stage_native):
        pool = BufferPool(total + 8192)
        pool.array[:] = 0xEE  # stale bytes that padding must overwrite
        pool.lease(4096)  # the batch's lease does not start at the pool's start
        lease = pool.lease(total)
        staged, _ = stage(objs, cols, srcs, lease)
        leases.append((bytes(lease.view), [(d, e, p) for d, e, p in staged]))
    (py_bytes, py_staged), (nat_bytes, nat_staged) = leases
    assert py_bytes == nat_bytes
    assert py_staged == nat_staged
    for (digest, entry, parts), data in zip(py_staged, datas):
        assert entry.payload_len == len(data) and len(entry.extents) == parts
        at = 0
        for x in entry.extents:
            c = min(UNIT, len(data) - at)
            assert x.csum == xxhash.xxh3_64_intdigest(data[at:at + c])
            at += c


@pytest.mark.skipif(not native_io.enabled(), reason="the native module is not built")
def test_one_extent_objects_stage_natively_as_columns_that_read_as_entries():
    rng = np.random.default_rng(8)
    objs = [(bytes([j]) * 16, 7 + j, 5000, 1) for j in range(4)]
    cols = [(j % 2, j * 8192, 8192, 5000) for j in range(4)]
    srcs = [memoryview(rng.bytes(5000)) for _ in range(4)]
    pool = BufferPool(4 * 8192)
    staged, (drive, offset, length, at) = staging.stage_native(objs, cols, srcs, pool.lease(4 * 8192))
    assert isinstance(staged, staging.Singles) and len(staged) == 4
    assert list(staged) == [staged[i] for i in range(4)]
    assert [(e.generation, x.drive, x.offset, x.csum) for _, e, _ in staged for x in e.extents] == [
        (7 + j, j % 2, j * 8192, xxhash.xxh3_64_intdigest(srcs[j])) for j in range(4)]
    assert drive.tolist() == [0, 1, 0, 1] and at.tolist() == [0, 8192, 16384, 24576]
