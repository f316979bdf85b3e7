"""One drive: a preallocated data file in a directory, or a block device / volume path.

The first 4 KiB hold a superblock that ties the drive to its store; the rest is data
space handed out by an :class:`ExtentAllocator`.  I/O is O_DIRECT; where the file
system refuses O_DIRECT the drive falls back to buffered I/O and says so in a warning.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field

import xxhash

from kvswarm.allocator import ExtentAllocator
from kvswarm.errors import DriveError
from kvswarm.format import ALIGN
from kvswarm.metrics import DriveStats

log = logging.getLogger(__name__)

DATA_FILE = "kvswarm.data"
SUPERBLOCK = struct.Struct("<8s16sIQQ")  # magic, store uuid, drive index, capacity, xxh64 of the rest
SB_MAGIC = b"KVSWDRV1"


@dataclass
class Drive:
    index: int
    path: str
    kind: str = "ssd"  # drive class: ssd / hdd / remote
    fd: int = -1
    capacity: int = 0
    direct: bool = True
    is_block_device: bool = False
    healthy: bool = True
    alloc: ExtentAllocator | None = None
    stats: DriveStats = field(default_factory=lambda: DriveStats("?"))

    @property
    def data_start(self) -> int:
        return ALIGN

    @property
    def free_bytes(self) -> int:
        return self.alloc.free if self.alloc else 0

    def fail(self, reason: str) -> None:
        if self.healthy:
            log.error("drive %d (%s) marked failed: %s", self.index, self.path, reason)
        self.healthy = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open(path: str, flags: int) -> tuple[int, bool]:
    try:
        return os.open(path, flags | os.O_DIRECT), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        log.warning("O_DIRECT refused on %s; falling back to buffered I/O (page cache in the way)", path)
        return os.open(path, flags), False


def open_drive(index: int, path: str, store_uuid: bytes, capacity: int, create: bool,
               kind: str = "ssd") -> Drive:
    """Open (and on first use format) the drive at ``path`` for the store ``store_uuid``."""
    if not os.path.exists(path):
        raise DriveError(f"drive path {path!r} does not exist")
    st = os.stat(path)
    d = Drive(index=index, path=path, kind=kind, stats=DriveStats(f"{index}:{os.path.basename(path) or path}"))
    if stat.S_ISDIR(st.st_mode):
        if not os.access(path, os.W_OK | os.X_OK):
            raise DriveError(f"drive directory {path!r} is not writable")
        data = os.path.join(path, DATA_FILE)
        fresh = not os.path.exists(data)
        if fresh and not create:
            raise DriveError(f"drive {path!r} holds no kvswarm data file and create=False")
        try:
            d.fd, d.direct = _open(data, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise DriveError(f"cannot open {data!r}: {e.strerror}") from e
        if fresh:
            if capacity < 2 * ALIGN or capacity % ALIGN:
                raise DriveError(f"drive capacity {capacity} must be a multiple of 4 KiB and >= 8 KiB")
            try:
                os.posix_fallocate(d.fd, 0, capacity)
            except OSError as e:
                os.close(d.fd)
                os.unlink(data)
                raise DriveError(f"cannot preallocate {capacity} B on {path!r}: {e.strerror}") from e
        d.capacity = os.fstat(d.fd).st_size // ALIGN * ALIGN
    elif stat.S_ISBLK(st.st_mode):
        d.is_block_device = True
        try:
            d.fd, d.direct = _open(path, os.O_RDWR)
        except OSError as e:
            raise DriveError(f"cannot open block device {path!r}: {e.strerror}") from e
        d.capacity = os.lseek(d.fd, 0, os.SEEK_END) // ALIGN * ALIGN
        fresh = False
    else:
        raise DriveError(f"drive path {path!r} is neither a directory nor a block device")

    sb = _read_superblock(d)
    if sb is None:
        if not (create and (fresh or d.is_block_device)):
            os.close(d.fd)
            raise DriveError(f"drive {path!r} has no valid kvswarm superblock")
        _write_superblock(d, store_uuid)
    elif sb[0] != store_uuid or sb[1] != index:
        os.close(d.fd)
        raise DriveError(f"drive {path!r} belongs to another store or slot (index {sb[1]}, want {index})")
    return d


def _read_superblock(d: Drive) -> tuple[bytes, int] | None:
    buf = mmap.mmap(-1, ALIGN)
    try:
        os.preadv(d.fd, [buf], 0)
        magic, uuid, idx, cap, csum = SUPERBLOCK.unpack_from(buf)
        if magic != SB_MAGIC or xxhash.xxh64_intdigest(buf[:SUPERBLOCK.size - 8]) != csum:
            return None
        return uuid, idx
    finally:
        buf.close()


def _write_superblock(d: Drive, store_uuid: bytes) -> None:
    buf = mmap.mmap(-1, ALIGN)
    try:
        SUPERBLOCK.pack_into(buf, 0, SB_MAGIC, store_uuid, d.index, d.capacity, 0)
        csum = xxhash.xxh64_intdigest(buf[:SUPERBLOCK.size - 8])
        struct.pack_into("<Q", buf, SUPERBLOCK.size - 8, csum)
        os.pwritev(d.fd, [buf], 0)
        os.fsync(d.fd)
    finally:
        buf.close()
