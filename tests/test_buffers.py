"""kvswarm.buffers: backing a shared-memory file with 2 MiB pages (collapse_shared_file)."""

import mmap
import os

import numpy as np
import pytest

from kvswarm.buffers import HUGE_PAGE, collapse_shared_file


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
