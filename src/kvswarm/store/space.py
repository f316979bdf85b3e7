"""A store's free space at open: each drive minus the extents its catalog holds, one allocator per
drive (vectorised over the catalog's columns: a million objects open in well under a second)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvswarm.allocator import ExtentAllocator
from kvswarm.catalog import Catalog
from kvswarm.drive import Drive
from kvswarm.errors import MetadataError


def rebuild_allocators(catalog: Catalog, drives: Sequence[Drive]) -> None:
    """Give every open drive (``fd >= 0``) an allocator of what ``catalog`` leaves free on it.

    Objects with an extent past their drive's end (the drive shrank, or is gone from the list) are
    deleted from the catalog; a drive unreadable at open keeps its objects (misses until it is back),
    so its unknown size drops none of them.  Overlapping extents mean a damaged catalog:
    :class:`~kvswarm.errors.MetadataError`."""
    owner, drv, off, ln = catalog.extent_columns()
    caps = np.array([d.capacity if d.fd >= 0 else 1 << 62 for d in drives], np.int64)
    stale = (drv >= len(drives)) | (off + ln > caps[np.minimum(drv, len(drives) - 1)])
    if stale.any():
        bad = np.unique(owner[stale])
        catalog.delete_many([catalog.digest_at(row) for row in bad.tolist()])
        keep = ~np.isin(owner, bad)
        drv, off, ln = drv[keep], off[keep], ln[keep]
    for d in drives:
        if d.fd < 0:
            continue
        mine = drv == d.index
        o, end = off[mine], off[mine] + ln[mine]
        order = np.argsort(o, kind="stable")
        o, end = o[order], end[order]
        if len(o) and (o[0] < d.data_start or (o[1:] < end[:-1]).any()):
            raise MetadataError(f"the catalog in {catalog.meta_dir} has overlapping extents on drive {d.index}")
        # Adjacent extents merge into runs, so the allocator sees one entry per gap.
        first = np.ones(len(o), bool)
        first[1:] = o[1:] != end[:-1]
        starts = np.flatnonzero(first)
        lasts = np.append(starts[1:] - 1, len(o) - 1) if len(o) else starts
        runs = zip(o[starts].tolist(), (end[lasts] - o[starts]).tolist())
        d.alloc = ExtentAllocator.from_used(d.capacity - d.data_start, runs, start=d.data_start)
