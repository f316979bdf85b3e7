"""kvswarm.buffers: backing a shared-memory file with 2 MiB pages (collapse_shared_file), and a batch's
payload views made on demand (LeaseViews), alone and as a store's read results."""

import mmap
import os

import numpy as np
import pytest

from kvswarm.buffers import HUGE_PAGE, BufferPool, LeaseViews, collapse_shared_file
from kvswarm.store import KVStore


def _shm(nbytes: int) -> tuple[int, mmap.mmap]:
    """A shared-memory file (a memfd; vLLM's offload region is a /dev/shm one) mapped shared and faulted in."""
    fd = os.memfd_create("kvswarm-test")
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    mm.madvise(23, 0, nbytes)  # MADV_POPULATE_WRITE
    return fd, mm


def _shmem_huge_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("ShmemHugePages:"))


def test_collapse_keeps_the_bytes_and_makes_the_pages_huge():
    n = 2 * HUGE_PAGE + 12288  # a tail short of 2 MiB stays in small pages
    fd, mm = _shm(n)
    try:
        data = np.random.default_rng(0).integers(0, 256, n, np.uint8)
        mm[:] = data.tobytes()
        before = _shmem_huge_kib()
        got = collapse_shared_file(fd, n)
        if got == 0:
            pytest.skip("this kernel does not collapse shared memory into huge pages (MADV_COLLAPSE, Linux 6.1)")
        assert got == 2 * HUGE_PAGE
        assert _shmem_huge_kib() - before >= 2 * HUGE_PAGE // 1024 - 2048  # (other processes' may come and go)
        assert mm[:] == data.tobytes()  # the caller's own mapping sees the same bytes
        mm[5:9] = b"abcd"  # and still writes to the file
        assert os.pread(fd, 4, 5) == b"abcd"
        assert collapse_shared_file(fd, n) == 2 * HUGE_PAGE  # already huge: nothing to do, same answer
    finally:
        mm.close()
        os.close(fd)


def test_less_than_one_huge_page_or_a_bad_fd_is_nothing():
    fd, mm = _shm(HUGE_PAGE - 4096)
    try:
        assert collapse_shared_file(fd, HUGE_PAGE - 4096) == 0
    finally:
        mm.close()
        os.close(fd)
    assert collapse_shared_file(-1, HUGE_PAGE) == 0


def test_lease_views_behave_as_a_list_of_views_made_when_asked_for():
    pool = BufferPool(1 << 20)
    lease = pool.lease(3 * 4096)
    lease.numpy()[:] = np.arange(3 * 4096) % 251
    views = LeaseViews(lease.view, np.array([0, 4096, 8192]), np.array([10, 20, 30]))
    assert len(views) == 3 and "0 made" in repr(views)
    assert bytes(views[1]) == bytes(lease.view[4096:4116]) and "1 made" in repr(views)
    assert views[-1] is views[2] and len(views[2]) == 30
    assert [len(v) for v in views] == [10, 20, 30] and [len(v) for v in views[1:]] == [20, 30]
    assert views == [lease.view[0:10], lease.view[4096:4116], lease.view[8192:8222]]
    views[0] = None  # handed over elsewhere
    assert views[0] is None and views != [None, None, None]
    with pytest.raises(IndexError):
        views[3]
    kept = views[1]
    views.release()
    with pytest.raises(ValueError):
        bytes(kept)  # released with the lease: never a view of reused memory
    unmade = LeaseViews(lease.view, np.array([0]), np.array([10]))
    unmade.release()
    with pytest.raises(ValueError):
        unmade[0]  # nor one made after
    lease.release()


def test_a_read_result_makes_views_on_demand_and_releases_them(drive_dirs):
    items = [(b"k%d" % i, bytes([i]) * (1000 + i)) for i in range(64)]
    with KVStore.open(drive_dirs(2), capacity_per_drive=8 << 20, buffer_pool_bytes=4 << 20) as s:
        s.put_many(items)
        with s.get_many([k for k, _ in items]) as r:
            assert r.misses == 0 and [bytes(v) for v in r.views] == [v for _, v in items]
            first = r.views[0]
        with pytest.raises(ValueError):
            bytes(first)
        bufs = [bytearray(len(v)) for _, v in items[:4]]
        with s.submit_get([k for k, _ in items[:4]], into=bufs).wait() as r:
            assert [bytes(b) for b in bufs] == [v for _, v in items[:4]]
            assert all(bytes(v) == bytes(b) for v, b in zip(r.views, bufs))
