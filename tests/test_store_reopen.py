"""Reopen after a clean close rebuilds free space from the checkpoint's columns (no walk over
the entries); it must match the rebuild from the entries exactly."""

from __future__ import annotations

import os

from kvswarm.catalog import Catalog
from kvswarm.store import KVStore

MiB = 1 << 20


def test_reopen_from_checkpoint_matches_entry_walk(tmp_path):
    drives = [str(tmp_path / f"d{i}") for i in range(2)]
    for d in drives:
        os.makedirs(d)
    kw = dict(capacity_per_drive=16 * MiB, stripe_unit=256 << 10)
    with KVStore.open(drives, **kw) as s:
        # one-extent and multi-extent objects, then a hole from a delete
        s.put_many([(b"k%d" % i, os.urandom(3000 + i * 50_000)) for i in range(24)])
        s.delete(b"k5")
        s.flush()
    with KVStore.open(drives, **kw) as s:  # a clean close: the catalog is exactly its checkpoint
        fast = [d.alloc.free_runs() for d in s.drives]
        assert s.catalog.take_checkpoint_extents() is None  # given out once
        s._rebuild_allocators()  # now from the entries
        assert [d.alloc.free_runs() for d in s.drives] == fast
        assert all(s.put(b"n%d" % i, os.urandom(200_000)) for i in range(8))  # never onto live extents
        assert s.get(b"k5") is None
        assert all(s.get(b"k%d" % i) is not None for i in range(24) if i != 5)
    with KVStore.open(drives, **kw) as s:
        assert all(s.get(b"n%d" % i) is not None for i in range(8))


def test_any_change_drops_the_checkpoint_columns(tmp_path):
    d = str(tmp_path / "d")
    os.makedirs(d)
    with KVStore.open([d], capacity_per_drive=8 * MiB) as s:
        s.put(b"a", b"x" * 5000)
    c = Catalog(d)  # the catalog alone: nothing takes its columns
    drv, off, ln = c._ckpt_extents
    assert drv.tolist() == [0] and ln.tolist() == [8192] and off.tolist() == [c.get(next(iter(c.entries))).extents[0][1]]
    c.put(b"\1" * 16, c.get(next(iter(c.entries))))
    assert c.take_checkpoint_extents() is None
    c.close()
    c = Catalog(d)  # the journal holds a record now: replayed, so no columns either
    assert c.replayed and c.take_checkpoint_extents() is None
    c.close()
