"""Metadata recovery: `kvswarm fsck` rebuilds a damaged catalog from the drives' extent headers,
reports first, and writes nothing before --repair (and nothing on the drives ever)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvswarm import KVStore
from kvswarm.catalog import CHECKPOINT, JOURNAL
from kvswarm.cli import main
from kvswarm.drive import DATA_FILE
from kvswarm.errors import MetadataError
from kvswarm.recovery import recover

MiB = 1 << 20
KW = dict(capacity_per_drive=32 * MiB, buffer_pool_bytes=16 * MiB, stripe_unit=64 << 10)


def _payload(i: int) -> bytes:
    rng = np.random.default_rng(i)
    return rng.bytes(int(rng.integers(1, 200_000)))  # one to four extents of a 64 KiB stripe unit


def _store(paths, n=150, ckpt_at=100):
    """``n`` flushed objects, the first ``ckpt_at`` in a checkpoint, the rest in the journal, and a
    few replaced (their older versions stay on the drives) as a crash would leave them."""
    s = KVStore.open(paths, **KW)
    assert all(s.put_many([(b"k%d" % i, _payload(i)) for i in range(ckpt_at)]))
    s.checkpoint()
    assert all(s.put_many([(b"k%d" % i, _payload(i)) for i in range(ckpt_at, n)]))
    assert all(s.put_many([(b"k%d" % i, _payload(1000 + i)) for i in range(5)]))  # replaced: the newest wins
    s.flush()
    return s


def _crash(s):
    """Let the store go as kill -9 would: no close, no checkpoint (the kernel drops the lock)."""
    s.engine.close()
    for d in s.drives:
        d.close()
    os.close(s.catalog._jfd)  # noqa: SLF001
    s._unlock_writer()  # noqa: SLF001


def _want(i: int) -> bytes:
    return _payload(1000 + i) if i < 5 else _payload(i)


def _meta_files(meta):
    return {f: open(os.path.join(meta, f), "rb").read() for f in sorted(os.listdir(meta))
            if os.path.isfile(os.path.join(meta, f)) and f != "writer.lock"}


def _drive_bytes(paths):
    return [open(os.path.join(p, DATA_FILE), "rb").read() for p in paths]


@pytest.mark.parametrize("damage", ["delete checkpoint", "flip journal magic", "delete manifest",
                                    "truncate checkpoint"])
def test_fsck_reports_then_repair_rebuilds_every_flushed_object(drive_dirs, damage, capsys):
    paths = drive_dirs(3)
    _crash(_store(paths))
    meta = paths[0]
    if damage == "delete checkpoint":
        os.remove(os.path.join(meta, CHECKPOINT))
    elif damage == "flip journal magic":
        with open(os.path.join(meta, JOURNAL), "r+b") as f:
            f.write(b"J")
    elif damage == "delete manifest":
        os.remove(os.path.join(meta, "store.json"))
    else:
        os.truncate(os.path.join(meta, CHECKPOINT), 30)
    with pytest.raises(MetadataError):
        KVStore.open(paths, **KW)
    before, drives = _meta_files(meta), _drive_bytes(paths)

    assert main(["fsck", *paths, "--meta-dir", meta, "--json"]) == 1  # the dry run: problems found
    report = json.loads(capsys.readouterr().out)
    assert report["objects"] == 150 and report["conflicts"] == 5 and report["incomplete"] == 0
    assert not report["consistent"] and not report["applied"]
    assert _meta_files(meta) == before and _drive_bytes(paths) == drives  # nothing written

    assert report["stripe_unit"] == 64 << 10  # from the manifest, or found from the drives without it
    assert main(["fsck", *paths, "--meta-dir", meta, "--repair"]) == 0
    out = capsys.readouterr().out
    assert "150 objects recovered" in out and "repaired" in out
    assert _drive_bytes(paths) == drives  # the drives are only read
    kept = [f for f in os.listdir(meta) if ".damaged-" in f]
    assert kept  # the old files, moved aside
    with KVStore.open(paths, **KW) as s:
        assert len(s) == 150
        with s.get_many([b"k%d" % i for i in range(150)]) as r:
            assert r.misses == 0 and all(bytes(v) == _want(i) for i, v in enumerate(r.views))
        assert s.put(b"after", b"x" * 70_000)  # new writes take free space only
        assert all(s.get(b"k%d" % i) == _want(i) for i in range(150))
    assert main(["fsck", *paths, "--meta-dir", meta]) == 0  # consistent now


def test_fsck_on_a_healthy_store_is_consistent_and_finds_a_corrupt_object(drive_dirs, capsys):
    paths = drive_dirs(2)
    s = _store(paths, n=40, ckpt_at=20)
    s.close()
    r = recover(paths, paths[0])
    assert r.consistent and r.objects == 40 and r.catalog_objects == 40
    with KVStore.open(paths, **KW) as s:  # rot one object's payload
        from kvswarm.format import key_digest

        drv, off, _, _ = s.catalog.get(key_digest(b"k30")).extents[0]
    with open(os.path.join(paths[drv], DATA_FILE), "r+b") as f:
        f.seek(off + 4096 + 10)
        f.write(b"\xff\xfe")
    r = recover(paths, paths[0])
    assert r.objects == 39 and r.not_on_drives == 1 and not r.consistent
    assert sum(d.corrupt for d in r.drives) >= 1
    assert main(["fsck", *paths]) == 1 and "1 of its objects not found" in capsys.readouterr().out


def test_fsck_refuses_an_open_store_and_a_wrong_drive_list(drive_dirs, capsys):
    paths = drive_dirs(2)
    s = _store(paths, n=10, ckpt_at=5)
    assert main(["fsck", *paths, "--repair"]) == 2
    assert "open for writing" in capsys.readouterr().err
    s.close()
    assert main(["fsck", *paths[::-1], "--meta-dir", paths[0]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "made with drives" in err
