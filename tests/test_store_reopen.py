"""Reopen rebuilds free space from the catalog's columns: after a clean close (checkpoint) and
after a crash (journal replay) it must come out the same, and never hand out a live extent."""

from __future__ import annotations

import os
import shutil

from kvswarm.catalog import CHECKPOINT, JOURNAL, Catalog
from kvswarm.store import KVStore

MiB = 1 << 20


def test_reopen_from_checkpoint_matches_journal_replay(tmp_path, drive_dirs):
    drives = drive_dirs(2)
    side = tmp_path / "crash"
    side.mkdir()
    kw = dict(capacity_per_drive=16 * MiB, stripe_unit=256 << 10)
    with KVStore.open(drives, **kw) as s:
        # one-extent and multi-extent objects, then a hole from a delete
        s.put_many([(b"k%d" % i, os.urandom(3000 + i * 50_000)) for i in range(24)])
        s.delete(b"k5")
        s.flush()
        for f in (CHECKPOINT, JOURNAL):  # the catalog files as a crash right now would leave them
            if os.path.exists(os.path.join(s.meta_dir, f)):
                shutil.copy(os.path.join(s.meta_dir, f), side / f)
        meta = s.meta_dir
    with KVStore.open(drives, **kw) as s:  # a clean close: loaded from the checkpoint
        assert not s.catalog.replayed
        from_ckpt = [d.alloc.free_runs() for d in s.drives]
        entries = dict(s.catalog.entries)
    os.remove(os.path.join(meta, CHECKPOINT))
    for f in os.listdir(side):
        shutil.copy(side / f, os.path.join(meta, f))
    with KVStore.open(drives, **kw) as s:  # the crash: rebuilt from the journal
        assert s.catalog.replayed
        assert [d.alloc.free_runs() for d in s.drives] == from_ckpt
        assert dict(s.catalog.entries) == entries
        assert all(s.put(b"n%d" % i, os.urandom(200_000)) for i in range(8))  # never onto live extents
        assert s.get(b"k5") is None
        assert all(s.get(b"k%d" % i) is not None for i in range(24) if i != 5)
    with KVStore.open(drives, **kw) as s:
        assert all(s.get(b"n%d" % i) is not None for i in range(8))
        assert all(s.get(b"k%d" % i) is not None for i in range(24) if i != 5)


def test_objects_pointing_past_a_drive_are_dropped_on_reopen(tmp_path):
    from kvswarm.catalog import Entry
    from kvswarm.format import key_digest

    d = str(tmp_path / "d")
    os.makedirs(d)
    with KVStore.open([d], capacity_per_drive=8 * MiB) as s:
        s.put_many([(b"keep%d" % i, os.urandom(9000)) for i in range(4)])
    c = Catalog(d)  # a catalog that outlived its drive's old size, as after the drive shrank
    c.put(key_digest(b"gone"), Entry(c.new_generation(), 100, ((0, 64 * MiB, 4096, 1),)))
    c.put(key_digest(b"gone2"), Entry(c.new_generation(), 5000, ((0, 8192, 4096, 1), (0, 32 * MiB, 4096, 2))))
    c.checkpoint()
    c.close()
    with KVStore.open([d], capacity_per_drive=8 * MiB) as s:
        assert len(s) == 4 and b"gone" not in s and b"gone2" not in s
        assert all(s.get(b"keep%d" % i) is not None for i in range(4))
