"""Pool of 4 KiB-aligned host buffers that O_DIRECT reads land in directly.

The pool is one anonymous mmap (page-aligned by construction); leases are aligned
slices of it, viewable as numpy arrays or torch tensors without copies.  On a GPU box
the whole region can be page-locked once (``cudaHostRegister``) and every lease is
then DMA-able.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvswarm.allocator import ExtentAllocator
from kvswarm.errors import ConfigError, KVSwarmError
from kvswarm.format import ALIGN, align_up

if TYPE_CHECKING:
    import torch


class BufferPoolExhausted(KVSwarmError):
    """The pool has no aligned run large enough; release leases or grow the pool."""


class Lease:
    """An aligned slice of the pool; release it (or use ``with``) when done."""

    __slots__ = ("pool", "offset", "nbytes", "view", "_released")

    def __init__(self, pool: BufferPool, offset: int, nbytes: int) -> None:
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.view = pool.view[offset:offset + nbytes]
        self._released = False

    def numpy(self, dtype: np.dtype | str = np.uint8, offset: int = 0, count: int = -1) -> np.ndarray:
        return np.frombuffer(self.view, dtype=dtype, count=count, offset=offset)

    def torch(self, dtype: torch.dtype | None = None, offset: int = 0, count: int = -1) -> torch.Tensor:
        import torch

        return torch.frombuffer(self.view, dtype=dtype or torch.uint8, count=count, offset=offset)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.view.release()
            self.pool._alloc.release(self.offset, self.nbytes)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseViews(Sequence):
    """Views of spans of a lease (``at``: offsets into it, ``lengths``), each made when first asked
    for, so that a batch of small objects costs no Python object per object that its caller does
    not look at (with a memoryview made and released per object, finishing a 256-key batch of 16 KiB
    objects took 100-480 us, 26-60 us this way).  Behaves as a list of memoryviews: indexing, slices (lists), iteration,
    ``==`` with a list; an item can be replaced (``views[i] = buf``).  :meth:`release` releases the
    views it made; later items cannot be made."""

    __slots__ = ("_view", "_at", "_lengths", "_made")

    def __init__(self, view: memoryview, at: np.ndarray, lengths: np.ndarray) -> None:
        self._view: memoryview | None = view
        self._at, self._lengths = at, lengths
        self._made: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._at)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._at)))]
        n = len(self._at)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("LeaseViews index out of range")
        try:
            return self._made[i]
        except KeyError:
            if self._view is None:
                raise ValueError("operation forbidden on released memoryview object") from None
            a = int(self._at[i])
            v = self._made[i] = self._view[a:a + int(self._lengths[i])]
            return v

    def __setitem__(self, i: int, value: object) -> None:
        self._made[i + len(self._at) if i < 0 else i] = value

    def __iter__(self) -> Iterator[object]:
        return (self[i] for i in range(len(self._at)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LeaseViews({len(self._at)} spans, {len(self._made)} made)"

    def release(self) -> None:
        for v in self._made.values():
            if isinstance(v, memoryview):
                v.release()
        self._view = None


HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11's mmap lacks the name


@functools.cache
def _libc_madvise():
    """libc's madvise through ctypes, which releases the GIL (``mmap.madvise`` holds it)."""
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


MADV_COLLAPSE = 25  # Linux 6.1


@functools.cache
def _libc_mmap():
    libc = ctypes.CDLL(None, use_errno=True)
    mm, unmap = libc.mmap, libc.munmap
    mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    mm.restype = ctypes.c_void_p
    unmap.argtypes, unmap.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    return mm, unmap


def collapse_shared_file(fd: int, length: int) -> int:
    """Back the first ``length`` bytes of a shared-memory file (``/dev/shm``, a memfd) with 2 MiB
    pages; returns how many bytes are now in them (the whole 2 MiB pieces, or 0).

    Why: an O_DIRECT read into 4 KiB pages is cut into requests of at most ``max_segments`` pages
    (254 on a virtio disk: a 2 MiB read becomes three), which read 0.75-0.94 as fast as reads into
    huge pages here; the same memory in huge pages reads as fast as the pool's.  The kernel only
    makes such a file's pages huge at a 2 MiB-aligned address (``MADV_COLLAPSE``, Linux 6.1; tmpfs
    mounts without ``huge=`` refuse it at fault time, not here), and any mapping of the file then
    sees the huge pages: so this maps the file once more, aligned, collapses it there and unmaps.
    The bytes stay as they were.  Pages that are pinned (``cudaHostRegister``), or no free 2 MiB
    of memory, make the kernel refuse: then 0, and the file stays as it was.
    """
    n = length // HUGE_PAGE * HUGE_PAGE
    if n == 0:
        return 0
    mm, unmap = _libc_mmap()
    reserve = mm(None, n + HUGE_PAGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # PROT_NONE: address space only
    if reserve in (None, ctypes.c_void_p(-1).value):
        return 0
    try:
        at = -(-reserve // HUGE_PAGE) * HUGE_PAGE
        fixed = 0x10  # MAP_FIXED: into the reservation, at the aligned address
        if mm(at, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | fixed, fd, 0) != at:
            return 0
        return n if _libc_madvise()(at, n, MADV_COLLAPSE) == 0 else 0
    finally:
        unmap(reserve, n + HUGE_PAGE)


class BufferPool:
    def __init__(self, capacity: int) -> None:
        capacity = align_up(max(capacity, ALIGN))
        # The mapping is a whole number of huge pages; leases stay within ``capacity``.
        try:
            self._mmap = mmap.mmap(-1, align_up(capacity, HUGE_PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, OverflowError) as e:
            raise ConfigError(f"cannot map a buffer pool of {capacity} B: {e}") from e
        # Transparent huge pages: an O_DIRECT read into scattered 4 KiB pages needs one DMA
        # segment per page, and a device with few segments per request (virtio: 254) splits a
        # 1 MiB read into two requests; physically contiguous 2 MiB pages doubled 1-2 MiB read
        # throughput here.  A no-op where THP is off.
        with contextlib.suppress(AttributeError, OSError):
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._mmap)
        self._alloc = ExtentAllocator(capacity, lowest_first=True)

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def in_use(self) -> int:
        return self._alloc.used

    @property
    def largest_free(self) -> int:
        """The largest lease the pool can give now: leases released out of order split its free bytes."""
        return self._alloc.largest_free

    def populate(self, step: int = 2 << 20) -> bool:
        """Fault the whole region in now rather than in the first I/Os into it; False where the
        kernel cannot (before 5.14), and the pages then fault in on first use as before.

        Huge pages may need the kernel to compact memory first: on this VM the first 512 MiB took
        1.5 s (later ones 45-50 ms), and a new vLLM tier's first stores, which spread over the whole
        pool, ran at 0.24 GB/s against 1.8-1.9 GB/s once it was resident.  Contents are kept (it only
        faults pages in), so it is safe while leases are in use; the GIL is released meanwhile.

        It goes ``step`` bytes (one huge page) at a time: the kernel holds the process's memory-map
        lock while it populates, and every other thread that maps memory (Python's allocator does,
        for arenas) waits for it.  Populated in one call by its driver thread, a new vLLM tier's
        512 MiB pool kept the thread that opened the tier waiting: 2.2 s to open in a fresh process;
        38-45 ms 2 MiB at a time (54 ms 8 MiB at a time, 29 ms without populating).  A restart's
        open and 16k lookups in a fresh process: 54-66 ms, as without populating (48-66 ms); 90-182 ms
        8 MiB at a time.
        """
        madvise, base, size = _libc_madvise(), self.base_address, len(self._mmap)
        return all(madvise(base + at, min(step, size - at), MADV_POPULATE_WRITE) == 0 for at in range(0, size, step))

    def lease(self, nbytes: int) -> Lease:
        nbytes = align_up(max(nbytes, 1))
        off = self._alloc.alloc(nbytes)
        if off is None:
            raise BufferPoolExhausted(
                f"buffer pool of {self.capacity} B cannot lease {nbytes} B ({self.in_use} B in use)")
        return Lease(self, off, nbytes)

    def address(self) -> int:
        """Base address of the region (for cudaHostRegister / GPUDirect registration)."""
        return self.base_address

    @functools.cached_property
    def array(self) -> np.ndarray:
        """The whole region as one uint8 array (batched reads gather their headers from it)."""
        return np.frombuffer(self._mmap, np.uint8)

    @functools.cached_property
    def base_address(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
