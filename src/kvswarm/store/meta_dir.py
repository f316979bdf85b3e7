"""A store's metadata directory: the manifest that makes it a store, the lock its one writer holds,
and the checks an open makes before it trusts either (the catalog's files live beside them:
:mod:`kvswarm.catalog`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Sequence

from kvswarm.catalog_format import CHECKPOINT, JOURNAL, holds_nothing
from kvswarm.drive import ever_written, read_superblock
from kvswarm.errors import KVSwarmError, MetadataError

MANIFEST = "store.json"
WRITER_LOCK = "writer.lock"  # flock'd by the one process that writes the store


def write_manifest(meta_dir: str, store_uuid: bytes, drives: Sequence[str], stripe_unit: int) -> None:
    """Write a store's manifest (fsynced, renamed into place): what makes ``meta_dir`` a store."""
    path = os.path.join(meta_dir, MANIFEST)
    m = {"format": 1, "uuid": store_uuid.hex(), "drives": [os.path.abspath(p) for p in drives],
         "stripe_unit": stripe_unit}
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(m, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(meta_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise MetadataError(f"cannot write manifest {path}: {e.strerror}") from e


def prepare_meta_dir(meta_dir: str, creates: bool, follow: bool) -> None:
    """``meta_dir`` is a directory (made when ``creates``: a new store's writer) that this process can
    write (unless it only ``follow``s another's store)."""
    if os.path.exists(meta_dir) and not os.path.isdir(meta_dir):
        raise MetadataError(f"meta_dir {meta_dir!r} is not a directory")
    if creates:
        try:
            os.makedirs(meta_dir, exist_ok=True)
        except OSError as e:
            raise MetadataError(f"cannot make meta_dir {meta_dir!r}: {e.strerror}") from e
    if not follow and os.path.isdir(meta_dir) and not os.access(meta_dir, os.W_OK | os.X_OK):
        raise MetadataError(f"meta_dir {meta_dir!r} is not writable")


def lock_writer(meta_dir: str, creates: bool) -> int:
    """Take the store's writer lock, held while the store is open: two writers would hand out the
    same free space and interleave their journals.  Returns its fd (closing it releases the lock; the
    kernel drops it when the process dies)."""
    if not creates and not os.path.exists(os.path.join(meta_dir, MANIFEST)):
        raise KVSwarmError(f"no kvswarm store at {meta_dir} and create=False")  # leave no lock file
    path = os.path.join(meta_dir, WRITER_LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only or vanished meta_dir
        raise MetadataError(f"cannot open the writer lock {path}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise KVSwarmError(f"the store at {meta_dir} is open for writing elsewhere; open it with "
                           f"follow=True to read it alongside its writer") from None
    return fd


def read_manifest(meta_dir: str, drives: Sequence[str], creates: bool) -> bytes | None:
    """The store uuid its manifest names (its drive list checked against ``drives``), or None when
    there is no manifest and ``creates``.  A damaged manifest is an error naming it, never a new store."""
    path = os.path.join(meta_dir, MANIFEST)
    if not os.path.exists(path):
        if not creates:
            raise KVSwarmError(f"no kvswarm store at {meta_dir} and create=False (or follow=True)")
        return None
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read().decode())
        sid, listed = bytes.fromhex(m["uuid"]), m["drives"]
        if len(sid) != 16 or not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
            raise ValueError("bad uuid or drive list")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MetadataError(f"manifest {path} is damaged or unreadable ({type(e).__name__}: {e}); "
                            f"`kvswarm fsck` rebuilds it from the drives") from e
    wanted = [os.path.abspath(p) for p in drives]
    if listed != wanted:
        raise KVSwarmError(f"store at {meta_dir} was made with drives {listed}, not {wanted}")
    return sid


def unfinished_store(meta_dir: str, drives: Sequence[str]) -> bytes | None:
    """A store without a manifest is new, or the rest of an open that died making it (a catalog that
    records nothing, drives formatted for one store and never written): then its uuid, which the open
    goes on with.
    Anything more (records in the catalog, drives of several stores) means a store whose manifest was
    lost: making a new store over it would destroy its evidence, so that is refused, pointing at
    ``kvswarm fsck --repair``, which recovers it."""
    uuids = {}
    for i, p in enumerate(drives):
        with contextlib.suppress(OSError):
            if (sb := read_superblock(p)) is not None:
                uuids[p] = (sb[0], sb[1] == i and not ever_written(p))
    if holds_nothing(meta_dir) and len({u for u, _ in uuids.values()}) <= 1 and all(ok for _, ok in uuids.values()):
        return next(iter(uuids.values()))[0] if uuids else None
    left = [f for f in (JOURNAL, CHECKPOINT) if os.path.exists(os.path.join(meta_dir, f))]
    left += [f"drive {p} of store {u.hex()}" for p, (u, _) in uuids.items()]
    raise MetadataError(f"manifest {os.path.join(meta_dir, MANIFEST)} is missing but a store is "
                        f"there ({', '.join(left)}): run `kvswarm fsck --repair` to recover it")
