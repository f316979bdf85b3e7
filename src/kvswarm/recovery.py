"""Rebuild a store's catalog from its drives' self-describing extent headers (docs/format.md, "Recovery").

Every extent starts with a header that names its object's key digest, generation, length, part
and part count and carries its payload's xxh3-64; :func:`scan` walks each drive's data space
reading them, keeps the extents whose header checksum and payload checksum both verify, and
groups them into objects: for each digest, the newest generation whose parts are all there.  The
catalog is keyed by digest (a ``get(key)`` hashes the key first), so a rebuilt catalog serves
every recovered object by its key.

:func:`recover` reports what a scan found against what the catalog holds (a dry run: nothing is
written anywhere); with ``apply=True`` it moves the old catalog files aside (renamed, never
deleted or overwritten) and writes the rebuilt catalog as a new checkpoint.  Nothing on the
drives is ever written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kvswarm.catalog import CHECKPOINT, JOURNAL, Catalog, Entry
from kvswarm.drive import DATA_FILE, SUPERBLOCK, parse_superblock
from kvswarm.errors import ConfigError, KVSwarmError, MetadataError
from kvswarm.format import (
    ALIGN,
    FLAG_SECTOR_PAYLOAD,
    HEADER_SIZE,
    PAYLOAD_CHECKSUM,
    extent_size,
    header_candidates,
    parse_header,
    payload_offset,
)
from kvswarm.store import MANIFEST, WRITER_LOCK, write_manifest

CHUNK = 8 << 20  # bytes of a drive read at a time while looking for headers


@dataclass(frozen=True)
class DriveScan:
    index: int
    path: str
    store_uuid: str | None  # from its superblock; None when that is unreadable
    extents: int = 0  # extents whose header and payload verify
    corrupt: int = 0  # valid headers whose payload fails its checksum (torn, rotten or reused)
    error: str = ""  # why it was not (fully) scanned


@dataclass(frozen=True)
class RecoveryReport:
    """What a scan of the drives found, against the catalog in ``meta_dir``."""

    drives: tuple[DriveScan, ...]
    store_uuid: str | None  # the store the drives belong to
    stripe_unit: int | None  # the manifest's, or found from the drives (None: no object of several parts)
    objects: int  # objects recovered whole (newest complete generation per digest)
    extents: int  # their extents
    conflicts: int  # digests found in several generations: the newest complete one is kept
    incomplete: int  # digests of which no generation has every part (left out)
    catalog_objects: int | None  # objects the catalog holds (None: it cannot be read)
    catalog_error: str  # why it cannot be read ("" if it can)
    not_in_catalog: int  # recovered objects the catalog lacks
    not_on_drives: int  # catalog objects not found intact on the drives
    manifest_error: str = ""  # why the manifest is not intact ("" if it is)
    applied: bool = False  # the rebuilt catalog was written (the old files moved aside)
    moved_aside: tuple[str, ...] = field(default=())

    @property
    def consistent(self) -> bool:
        """The manifest and catalog are intact, and the catalog holds exactly the objects found on the drives."""
        return not (self.catalog_error or self.manifest_error or self.not_in_catalog or self.not_on_drives)

    def as_dict(self) -> dict:
        return asdict(self) | {"consistent": self.consistent}


def _data_path(path: str) -> str:
    return os.path.join(path, DATA_FILE) if os.path.isdir(path) else path


def _part_payload(fd: int, off: int, plen: int, part: int, parts: int, csum: int, unit: list[int]) -> int | None:
    """Payload bytes of this part: all of the object's if it has one part, else up to the stripe unit's
    share.  An unknown stripe unit (``unit == [0]``: no manifest says it) is found from the first part
    that is not its object's last: the power-of-two unit under which that part's payload verifies."""
    if parts == 1:
        return plen
    if not unit[0]:
        if part == parts - 1:
            return None
        for k in range(12, 31):
            u = (1 << k) - HEADER_SIZE
            if parts == -(-plen // u) and PAYLOAD_CHECKSUM(os.pread(fd, u, off + payload_offset(u))) == csum:
                unit[0] = u
                break
        else:
            return None
    u = unit[0]
    return min(u, plen - part * u) if parts == -(-plen // u) and part < parts else None


def _scan_drive(index: int, path: str, unit: list[int], found: list[tuple], want_uuid: bytes | None) -> DriveScan:
    """Append ``(digest, generation, payload_len, part, parts, drive, offset, length, checksum)`` for each
    extent of the drive at ``path`` that verifies whole; the drive is only read."""
    try:
        fd = os.open(_data_path(path), os.O_RDONLY)
    except OSError as e:
        return DriveScan(index, path, None, error=f"cannot open: {e.strerror}")
    try:
        st = os.fstat(fd)
        size = os.lseek(fd, 0, os.SEEK_END) if stat.S_ISBLK(st.st_mode) else st.st_size
        try:
            sb = parse_superblock(os.pread(fd, SUPERBLOCK.size, 0))
        except OSError as e:
            return DriveScan(index, path, None, error=f"cannot read: {e.strerror}")
        if sb is not None and (want_uuid is not None and sb[0] != want_uuid or sb[1] != index):
            return DriveScan(index, path, sb[0].hex(), error=f"its superblock names store {sb[0].hex()} "
                                                             f"slot {sb[1]}, not this one's slot {index}")
        good = bad = 0
        pos, nxt = ALIGN, ALIGN  # nxt: the end of the last extent verified (no header inside it counts)
        error = ""
        while pos < size:
            try:
                chunk = memoryview(os.pread(fd, min(CHUNK, size - pos) // ALIGN * ALIGN, pos))
            except OSError as e:
                error = f"read error at {pos}: {e.strerror} (scanned up to there)"
                break
            if not chunk:
                break
            for i in header_candidates(np.frombuffer(chunk, np.uint8).reshape(-1, ALIGN)).tolist():
                off = pos + i * ALIGN
                if off < nxt:
                    continue
                h = parse_header(chunk[i * ALIGN:i * ALIGN + HEADER_SIZE])
                if h is None:
                    continue
                flags, digest, plen, part, parts, gen, csum = h
                pp = _part_payload(fd, off, plen, part, parts, csum, unit)
                if pp is None or pp < 0 or bool(flags & FLAG_SECTOR_PAYLOAD) != (payload_offset(pp) == ALIGN):
                    continue  # a header of another stripe unit, or inconsistent: not usable
                length = extent_size(pp)
                if off + length > size:
                    continue
                at = i * ALIGN + payload_offset(pp)
                try:  # from the piece read, where it lies within it
                    payload = chunk[at:at + pp] if at + pp <= len(chunk) else os.pread(fd, pp, off + payload_offset(pp))
                except OSError:
                    bad += 1
                    continue
                if PAYLOAD_CHECKSUM(payload) != csum:
                    bad += 1
                    continue
                found.append((digest, gen, plen, part, parts, index, off, length, csum))
                good += 1
                nxt = off + length
            pos += len(chunk)
        return DriveScan(index, path, sb[0].hex() if sb else None, good, bad,
                         error or ("" if sb else "no valid superblock (scanned by its place in the list)"))
    finally:
        os.close(fd)


def _manifest(meta_dir: str) -> tuple[dict | None, str]:
    path = os.path.join(meta_dir, MANIFEST)
    if not os.path.exists(path):
        return None, f"{path} is missing"
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read().decode())
        bytes.fromhex(m["uuid"])
        if not isinstance(m["drives"], list):
            raise ValueError("no drive list")
        return m, ""
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{path} is damaged ({type(e).__name__}: {e})"


def scan(drives: list[str], meta_dir: str, stripe_unit: int | None = None) -> tuple[RecoveryReport, dict]:
    """Scan ``drives`` (in the store's order) and compare with the catalog in ``meta_dir``; returns the
    report and the recovered objects (digest -> :class:`Entry`).  Reads only."""
    if not drives:
        raise ConfigError("fsck needs the store's drive paths, in order")
    for p in drives:
        if not os.path.exists(p):
            raise KVSwarmError(f"drive path {p!r} does not exist")
    manifest, manifest_error = _manifest(meta_dir)
    if manifest is not None and manifest["drives"] != [os.path.abspath(p) for p in drives]:
        raise KVSwarmError(f"the store at {meta_dir} was made with drives {manifest['drives']}, not {drives}")
    known = stripe_unit or (manifest or {}).get("stripe_unit")
    unit = [known - HEADER_SIZE if known else 0]  # 0: found from the drives (see _part_payload)
    want = bytes.fromhex(manifest["uuid"]) if manifest else None
    found: list[tuple] = []
    scans = tuple(_scan_drive(i, p, unit, found, want) for i, p in enumerate(drives))
    if not known and unit[0]:  # found on the way: scan again, for the parts passed before it was known
        found.clear()
        scans = tuple(_scan_drive(i, p, unit, found, want) for i, p in enumerate(drives))
    uuids = {s.store_uuid for s in scans if s.store_uuid and not s.error}
    store_uuid = want.hex() if want else (uuids.pop() if len(uuids) == 1 else None)
    objects, conflicts, incomplete, nparts = _assemble(found)
    held: set[bytes] | None = None
    cat_error = ""
    try:
        cat = Catalog(meta_dir, follow=True, create=False)
        held = set(cat.digests())
        cat.close()
    except (KVSwarmError, OSError) as e:
        cat_error = str(e)
    report = RecoveryReport(
        scans, store_uuid, unit[0] + HEADER_SIZE if unit[0] else None, len(objects), nparts, conflicts, incomplete,
        None if held is None else len(held), cat_error,
        len(objects.keys() - held) if held is not None else len(objects),
        len(held - objects.keys()) if held is not None else 0, manifest_error)
    return report, objects


def _assemble(found: list[tuple]) -> tuple[dict[bytes, Entry], int, int, int]:
    """Objects from verified extents: per digest, the newest generation with every part."""
    by: dict[bytes, dict[int, dict]] = {}
    for digest, gen, plen, part, parts, drive, off, length, csum in found:
        g = by.setdefault(digest, {}).setdefault(gen, {"plen": plen, "parts": parts, "ext": {}})
        if g["plen"] == plen and g["parts"] == parts:
            g["ext"][part] = (drive, off, length, csum)
    objects: dict[bytes, Entry] = {}
    conflicts = incomplete = nparts = 0
    for digest, gens in by.items():
        conflicts += len(gens) > 1
        for gen in sorted(gens, reverse=True):
            g = gens[gen]
            if len(g["ext"]) == g["parts"]:
                objects[digest] = Entry(gen, g["plen"], tuple(g["ext"][p] for p in range(g["parts"])))
                nparts += g["parts"]
                break
        else:
            incomplete += 1
    return objects, conflicts, incomplete, nparts


def recover(drives: list[str], meta_dir: str, apply: bool = False, stripe_unit: int | None = None) -> RecoveryReport:
    """Scan (see :func:`scan`); with ``apply``, replace the catalog with the rebuilt one.

    Applying takes the store's writer lock (the store must not be open), renames the old catalog
    files (and a damaged or missing manifest's) to ``<name>.damaged-<unix time>``, writes the
    manifest again if it was not intact, and writes the recovered objects as a new checkpoint.
    The drives are not written."""
    report, objects = scan(drives, meta_dir, stripe_unit)
    if not apply:
        return report
    if report.store_uuid is None:
        raise KVSwarmError("cannot tell which store these drives belong to (no manifest, and their "
                           "superblocks disagree or are unreadable): nothing was written")
    try:
        os.makedirs(meta_dir, exist_ok=True)
        lock = os.open(os.path.join(meta_dir, WRITER_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise MetadataError(f"cannot write in meta_dir {meta_dir!r}: {e.strerror}") from e
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise KVSwarmError(f"the store at {meta_dir} is open for writing: close it before repairing") from None
        manifest, _ = _manifest(meta_dir)
        stamp = f"damaged-{int(time.time())}"
        names = [CHECKPOINT, JOURNAL] + ([] if manifest is not None else [MANIFEST])
        moved = []
        for name in names:
            src = os.path.join(meta_dir, name)
            if os.path.exists(src):
                os.rename(src, f"{src}.{stamp}")
                moved.append(f"{src}.{stamp}")
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(meta_dir, CHECKPOINT + ".tmp"))  # a checkpoint never finished
        try:
            cat = Catalog(meta_dir, create=True)
            cat.put_many(sorted(objects.items(), key=lambda kv: kv[1].generation))
            cat.next_generation = max((e.generation for e in objects.values()), default=0) + 1
            cat.checkpoint()
            cat.close()
            if manifest is None:
                write_manifest(meta_dir, bytes.fromhex(report.store_uuid), drives, report.stripe_unit or (1 << 20))
        except OSError as e:
            raise MetadataError(f"cannot write the rebuilt catalog in {meta_dir}: {e.strerror} "
                                f"(the old files are in {moved})") from e
    finally:
        os.close(lock)
    return RecoveryReport(**{**report.__dict__, "applied": True, "moved_aside": tuple(moved),
                             "not_in_catalog": 0, "not_on_drives": 0, "catalog_objects": len(objects),
                             "catalog_error": "", "manifest_error": ""})
