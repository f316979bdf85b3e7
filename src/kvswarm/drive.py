"""One drive: a preallocated data file in a directory, or a block device / volume path.

The first 4 KiB hold a superblock that ties the drive to its store; the rest is data
space handed out by an :class:`ExtentAllocator`.  I/O is O_DIRECT; where the file
system refuses O_DIRECT the drive falls back to buffered I/O and says so in a warning.
"""

from __future__ import annotations

import errno
import glob
import logging
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field

import xxhash

from kvswarm.allocator import ExtentAllocator
from kvswarm.errors import DriveError, DriveUnavailable
from kvswarm.format import ALIGN, MAGIC
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
    reason: str = ""  # why it is out of service
    full: bool = False  # a write or sync hit ENOSPC: no new extents until the store reopens
    nospc: int = 0  # writes that failed with ENOSPC (errors, but not failures of the drive)
    alloc: ExtentAllocator | None = None
    stats: DriveStats = field(default_factory=lambda: DriveStats("?"))
    needs_format: bool = False  # opened for a new store: its superblock is written once the store opens
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of a directory drive's data file

    @property
    def data_start(self) -> int:
        return ALIGN

    @property
    def free_bytes(self) -> int:
        return self.alloc.free if self.alloc and self.healthy and not self.full else 0

    @property
    def data_path(self) -> str:
        return self.path if self.is_block_device else os.path.join(self.path, DATA_FILE)

    def fail(self, reason: str) -> None:
        if self.healthy:
            log.error("drive %d (%s) marked failed: %s", self.index, self.path, reason)
            self.reason = reason
        self.healthy = False

    def mark_full(self, what: str) -> None:
        """ENOSPC from the device or the file system under it (a thin volume, a sparse file): the drive
        keeps serving what it holds and takes no new extents.  A full drive is not a failed one."""
        if not self.full:
            log.warning("drive %d (%s) is full (%s): it takes no new writes until the store reopens",
                        self.index, self.path, what)
        self.full = True

    def unlinked(self) -> str | None:
        """Why this directory drive's data file is no longer the one open (removed, or replaced by
        another file), or None: writes to an unlinked file would vanish at close."""
        if self.is_block_device or self.identity is None or self.fd < 0:
            return None
        if os.fstat(self.fd).st_nlink == 0:
            return f"its data file {self.data_path} was removed"
        try:
            st = os.stat(self.data_path)
        except OSError as e:
            return f"its data file {self.data_path} is gone ({e.strerror})"
        if (st.st_dev, st.st_ino) != self.identity:
            return f"its data file {self.data_path} was replaced by another file"
        return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def failed_drive(index: int, path: str, kind: str, reason: str) -> Drive:
    """The place of a drive that could not be opened: out of service, holding nothing open."""
    return Drive(index=index, path=path, kind=kind, healthy=False, reason=reason,
                 stats=DriveStats(f"{index}:{os.path.basename(path) or path}"))


def block_device(path: str) -> tuple[str, int] | None:
    """The block device holding ``path`` (a block device itself, or a directory's file system) and how
    many requests it takes at once: its tags summed over its hardware queues (sysfs ``mq/*/nr_tags``),
    else its ``queue/nr_requests``; a partition answers for its disk.  None where sysfs names no block
    device (tmpfs, a network file system) or the path cannot be read."""
    try:
        st = os.stat(path)
        dev = st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev
        base = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        if not os.path.isdir(base):
            return None
        if os.path.exists(os.path.join(base, "partition")):
            base = os.path.dirname(base)
        tags = [_read_int(f) for f in glob.glob(os.path.join(base, "mq", "*", "nr_tags"))]
        return base, sum(tags) if tags else _read_int(os.path.join(base, "queue", "nr_requests"))
    except (OSError, ValueError):
        return None


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def _open(path: str, flags: int) -> tuple[int, bool]:
    try:
        return os.open(path, flags | os.O_DIRECT), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        log.warning("O_DIRECT refused on %s; falling back to buffered I/O (page cache in the way)", path)
        return os.open(path, flags), False


def open_drive(index: int, path: str, store_uuid: bytes, capacity: int, create: bool,
               kind: str = "ssd", made: list[str] | None = None) -> Drive:
    """Open the drive at ``path`` for the store ``store_uuid``.

    ``create`` (a new store): a directory drive's data file is made (its path appended to ``made``,
    for the caller to remove if the store's open fails) and a drive without a superblock is marked
    ``needs_format`` (see :func:`format_drive`); nothing else is written.  Raises
    :class:`DriveUnavailable` for a drive that cannot be read (I/O error, no valid superblock, a
    truncated or missing data file) and :class:`DriveError` for one that is not this store's or not
    usable at all; no descriptor stays open either way."""
    if not os.path.exists(path):
        raise DriveUnavailable(f"drive path {path!r} does not exist")
    st = os.stat(path)
    d = Drive(index=index, path=path, kind=kind, stats=DriveStats(f"{index}:{os.path.basename(path) or path}"))
    try:
        fresh = False
        if stat.S_ISDIR(st.st_mode):
            fresh = _open_file(d, capacity, create, made)
        elif stat.S_ISBLK(st.st_mode):
            d.is_block_device = True
            try:
                d.fd, d.direct = _open(path, os.O_RDWR)
                d.capacity = os.lseek(d.fd, 0, os.SEEK_END) // ALIGN * ALIGN
            except OSError as e:
                raise DriveUnavailable(f"cannot open block device {path!r}: {e.strerror}") from e
        else:
            raise DriveError(f"drive path {path!r} is neither a directory nor a block device")
        try:
            sb, blank = _read_superblock(d)
        except OSError as e:
            raise DriveUnavailable(f"cannot read the superblock of drive {path!r}: {e.strerror}") from e
        if sb is None:
            # A new store formats a new data file, a block device, or a data file never formatted (an
            # open that died before it wrote the superblock): never another file's bytes.
            if not (create and (fresh or d.is_block_device or blank)):
                raise DriveUnavailable(f"drive {path!r} has no valid kvswarm superblock")
            d.needs_format = True
        elif sb[0] != store_uuid or sb[1] != index:
            raise DriveError(f"drive {path!r} belongs to another store or slot (index {sb[1]}, want {index})")
        elif sb[2] > d.capacity:
            raise DriveUnavailable(f"drive {path!r} holds {d.capacity} B, its superblock says {sb[2]} B "
                                   f"(truncated)")
        return d
    except BaseException:
        d.close()
        raise


def _open_file(d: Drive, capacity: int, create: bool, made: list[str] | None) -> bool:
    """Open (``create``: make, if missing) a directory drive's data file; True if made here."""
    path = d.path
    if not os.access(path, os.W_OK | os.X_OK):
        raise DriveError(f"drive directory {path!r} is not writable")
    data = os.path.join(path, DATA_FILE)
    fresh = not os.path.exists(data)
    if fresh and not create:
        raise DriveUnavailable(f"drive {path!r} holds no kvswarm data file {DATA_FILE}")
    if create and (capacity < 2 * ALIGN or capacity % ALIGN):  # checked before anything is made
        raise DriveError(f"drive capacity {capacity} must be a multiple of 4 KiB and >= 8 KiB")
    try:
        d.fd, d.direct = _open(data, os.O_RDWR | (os.O_CREAT | os.O_EXCL if fresh else 0))
    except OSError as e:
        raise DriveUnavailable(f"cannot open {data!r}: {e.strerror}") from e
    if fresh and made is not None:
        made.append(data)
    # A new store also sizes an empty data file: one an open killed before its preallocation left.
    if fresh or create and os.fstat(d.fd).st_size == 0:
        try:
            os.posix_fallocate(d.fd, 0, capacity)
        except OSError as e:
            raise DriveError(f"cannot preallocate {capacity} B on {path!r}: {e.strerror}") from e
    st = os.fstat(d.fd)
    d.capacity = st.st_size // ALIGN * ALIGN
    d.identity = (st.st_dev, st.st_ino)
    return fresh


def format_drive(d: Drive, store_uuid: bytes) -> None:
    """Write the superblock of a drive opened for a new store (``needs_format``)."""
    try:
        _write_superblock(d, store_uuid)
    except OSError as e:
        raise DriveError(f"cannot write the superblock of drive {d.path!r}: {e.strerror}") from e
    d.needs_format = False


def read_superblock(path: str) -> tuple[bytes, int, int] | None:
    """(store uuid, drive index, capacity) from the superblock of the drive at ``path`` (a directory
    drive or a block device), read without opening it for writing; None if it has no valid one.
    Raises OSError when it cannot be read."""
    data = os.path.join(path, DATA_FILE) if os.path.isdir(path) else path
    with open(data, "rb", buffering=0) as f:
        buf = f.read(SUPERBLOCK.size)
    return parse_superblock(buf)


def ever_written(path: str) -> bool:
    """Whether the drive at ``path`` ever held an object: the allocator hands out its first extent at
    the start of the data space, so an extent header there means it did."""
    with open(os.path.join(path, DATA_FILE) if os.path.isdir(path) else path, "rb", buffering=0) as f:
        f.seek(ALIGN)
        head = f.read(4)
    return len(head) == 4 and struct.unpack("<I", head)[0] == MAGIC


def parse_superblock(buf) -> tuple[bytes, int, int] | None:
    """(store uuid, drive index, capacity) from a superblock's bytes; None unless it verifies."""
    if len(buf) < SUPERBLOCK.size:
        return None
    magic, uuid, idx, cap, csum = SUPERBLOCK.unpack_from(buf)
    if magic != SB_MAGIC or xxhash.xxh64_intdigest(bytes(buf[:SUPERBLOCK.size - 8])) != csum:
        return None
    return uuid, idx, cap


def _read_superblock(d: Drive) -> tuple[tuple[bytes, int, int] | None, bool]:
    """The parsed superblock (or None), and whether its sector is all zeros (never formatted)."""
    buf = mmap.mmap(-1, ALIGN)
    try:
        n = os.preadv(d.fd, [buf], 0)
        return parse_superblock(buf[:n]), n == ALIGN and buf[:] == bytes(ALIGN)
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
