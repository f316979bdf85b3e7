"""Exceptions raised by kvswarm; every failure a caller can act on has its own type."""


class KVSwarmError(Exception):
    """Base class of kvswarm errors."""


class ConfigError(KVSwarmError, ValueError):
    """A configuration value or argument that cannot work (a queue depth of 0, a pool larger than memory,
    an object of more parts than a header can count, a key of the wrong length ...)."""


class MetadataError(KVSwarmError):
    """The store's metadata (manifest, checkpoint, journal, ``meta_dir``) is missing, damaged or cannot
    be written; the message names the file.  Nothing was rewritten: ``kvswarm fsck`` can rebuild the
    catalog from the drives."""


class DriveError(KVSwarmError):
    """A drive path is missing, not writable, of the wrong kind, or failed an I/O."""


class DriveUnavailable(DriveError):
    """A drive of an existing store cannot be read at open (I/O error, no valid superblock, a truncated
    or missing data file): the store opens without it (see ``KVStore.health``)."""


class DriveFull(DriveError):
    """No drive has room for an object (ENOSPC on the pool)."""


class FlushError(DriveError):
    """A flush could not make everything written since the previous flush durable: ``drives`` (their
    indices) failed, their fdatasync or another I/O, after taking such writes.  The flush did the rest
    (the other drives and the catalog are synced), and the next flush reports only new failures.
    ``dropped``: the digests of the objects written there since the previous flush, which the store
    deleted (journaled) rather than keep as misses."""

    def __init__(self, drives: list[int], message: str, dropped: list[bytes] | None = None) -> None:
        super().__init__(message)
        self.drives = drives
        self.dropped = dropped or []


class UnalignedBuffer(KVSwarmError, ValueError):
    """A buffer, offset or length breaks the 4 KiB O_DIRECT alignment rules."""


class CorruptExtent(KVSwarmError):
    """An extent's header or checksum does not match: the read is a miss, never data."""


class LayoutMismatch(KVSwarmError, ValueError):
    """Stored KV was written for another model or KV layout; it must never be served."""


class BadInput(KVSwarmError, ValueError):
    """A user's input (a text file, a source name, a size) cannot be used as given."""


class ClusterError(KVSwarmError):
    """The cluster level is misconfigured, or this node could not join the cluster (its master,
    metadata service or Transfer Engine).  Once joined, cluster failures are misses, never errors."""
