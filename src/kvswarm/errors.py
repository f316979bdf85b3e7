"""Exceptions raised by kvswarm; every failure a caller can act on has its own type."""


class KVSwarmError(Exception):
    """Base class of kvswarm errors."""


class DriveError(KVSwarmError):
    """A drive path is missing, not writable, of the wrong kind, or failed an I/O."""


class DriveFull(DriveError):
    """No drive has room for an object (ENOSPC on the pool)."""


class FlushError(DriveError):
    """A flush could not make everything written since the previous flush durable: ``drives`` (their
    indices) failed, their fdatasync or another I/O, after taking such writes.  The flush did the rest
    (the other drives and the catalog are synced), and the next flush reports only new failures."""

    def __init__(self, drives: list[int], message: str) -> None:
        super().__init__(message)
        self.drives = drives


class UnalignedBuffer(KVSwarmError, ValueError):
    """A buffer, offset or length breaks the 4 KiB O_DIRECT alignment rules."""


class CorruptExtent(KVSwarmError):
    """An extent's header or checksum does not match: the read is a miss, never data."""


class LayoutMismatch(KVSwarmError, ValueError):
    """Stored KV was written for another model or KV layout; it must never be served."""


class ClusterError(KVSwarmError):
    """The cluster level is misconfigured, or this node could not join the cluster (its master,
    metadata service or Transfer Engine).  Once joined, cluster failures are misses, never errors."""
