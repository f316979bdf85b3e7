"""Free space rebuilt from the catalog at open (kvswarm.store.space): what a drive holds is not free,
objects past a drive's end are dropped, and extents that cannot be the catalog's are refused."""

from __future__ import annotations

import dataclasses

import pytest

from kvswarm.errors import MetadataError
from kvswarm.format import key_digest
from kvswarm.store import KVStore
from kvswarm.store.space import rebuild_allocators

PAYLOAD = 60_000


def _filled(drive_dirs, n: int = 24) -> tuple[KVStore, list[bytes]]:
    s = KVStore.open(drive_dirs(2), capacity_per_drive=8 << 20, backend="threads")
    keys = [b"space/%d" % i for i in range(n)]
    assert all(s.put_many([(k, bytes([i]) * PAYLOAD) for i, k in enumerate(keys)]))
    return s, keys


def test_free_space_is_each_drive_minus_what_the_catalog_holds(drive_dirs):
    s, keys = _filled(drive_dirs)
    try:
        before = [d.alloc.free for d in s.drives]
        drives = [dataclasses.replace(d, alloc=None) for d in s.drives]
        rebuild_allocators(s.catalog, drives)
        assert [d.alloc.free for d in drives] == before
        held = [sum(x.length for e in s.locate(keys) for x in e.extents if x.drive == d.index) for d in drives]
        assert [d.capacity - d.data_start - h for d, h in zip(drives, held)] == before
    finally:
        s.close()


def test_objects_past_a_drives_end_are_dropped_and_the_rest_kept(drive_dirs):
    s, keys = _filled(drive_dirs)
    try:
        located = dict(zip(keys, s.locate(keys)))
        on1 = sorted((x.offset + x.length, k) for k, e in located.items() for x in e.extents if x.drive == 1)
        end = on1[len(on1) // 2][0]  # drive 1 as if it had shrunk to half of what it holds
        drives = [dataclasses.replace(d, alloc=None) for d in s.drives]
        drives[1] = dataclasses.replace(drives[1], capacity=end)
        rebuild_allocators(s.catalog, drives)
        gone = {k for k, e in located.items() if any(x.drive == 1 and x.offset + x.length > end for x in e.extents)}
        assert gone and len(gone) < len(keys)
        assert [key_digest(k) in s.catalog for k in keys] == [k not in gone for k in keys]
        kept_on1 = sum(x.length for k, e in located.items() if k not in gone for x in e.extents if x.drive == 1)
        assert drives[1].alloc.free == end - drives[1].data_start - kept_on1
    finally:
        s.close()


def test_extents_in_front_of_a_drives_data_region_are_a_damaged_catalog(drive_dirs):
    s, _ = _filled(drive_dirs)
    try:
        drives = [dataclasses.replace(d, alloc=None) for d in s.drives]
        first = min(x.offset for e in s.locate([b"space/0", b"space/1"]) for x in e.extents)
        drives = [_starting_at(d, first + 4096) for d in drives]
        with pytest.raises(MetadataError, match="overlapping extents"):
            rebuild_allocators(s.catalog, drives)
    finally:
        s.close()


def _starting_at(d, start: int):
    """A drive whose data region starts at ``start``: the catalog's first extents then lie in front of it."""
    cls = type("Shifted", (type(d),), {"data_start": property(lambda self: start)})
    return cls(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)})
