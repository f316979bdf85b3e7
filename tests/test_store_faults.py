"""Store-side faults: bad configuration, damaged metadata, full and failing drives, degraded open.

Every case ends in exact bytes, a counted miss or a clear error of kvswarm's own classes, and a
refused call leaves the store (and the files behind it) as they were.
"""

from __future__ import annotations

import gc
import json
import mmap
import os

import numpy as np
import pytest

from kvswarm import KVStore
from kvswarm.drive import DATA_FILE
from kvswarm.errors import ConfigError, DriveError, KVSwarmError
from kvswarm.store import StoreConfig

MiB = 1 << 20


def _open(paths, backend="threads", **kw):
    kw.setdefault("capacity_per_drive", 16 * MiB)
    kw.setdefault("buffer_pool_bytes", 16 * MiB)
    return KVStore.open(paths, backend=backend, **kw)


def _payload(i: int, n: int = 5000) -> bytes:
    return np.random.default_rng(i).bytes(n)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("queue_depth", 0), ("queue_depth", -3), ("buffer_pool_bytes", 0),
                                         ("capacity_per_drive", 4096), ("capacity_per_drive", 5000),
                                         ("stripe_unit", 0), ("checkpoint_every", 0), ("error_threshold", -1),
                                         ("backend", "bogus"), ("queue_depth", 2.5)])
def test_nonsensical_config_is_refused_before_anything_is_touched(drive_dirs, field, value):
    paths = drive_dirs(1)
    with pytest.raises(ConfigError, match=field if field != "backend" else "backend"):
        KVStore(StoreConfig(drives=paths, **{field: value}))
    assert os.listdir(paths[0]) == []  # no data file, manifest, lock or journal


def test_queue_depth_zero_with_uring_does_not_hang(drive_dirs):
    """``auto`` picks uring, which with a depth cap of 0 never submitted and waited forever."""
    with pytest.raises(ConfigError, match="queue_depth"):
        StoreConfig(drives=drive_dirs(1), backend="auto", queue_depth=0)


def test_absurd_buffer_pool_is_a_clear_error_and_holds_nothing(drive_dirs):
    paths = drive_dirs(1)
    fds = _fds()
    with pytest.raises(ConfigError, match="buffer pool"):
        _open(paths, buffer_pool_bytes=10**18)
    assert _fds() == fds
    _open(paths).close()  # the corrected retry opens


def test_an_object_of_too_many_parts_is_refused_and_nothing_is_stored(drive_dirs):
    with _open(drive_dirs(1), stripe_unit=4096, capacity_per_drive=64 * MiB,
               buffer_pool_bytes=64 * MiB) as s:
        free = s.drives[0].free_bytes
        with pytest.raises(ConfigError, match="parts"):
            s.put(b"big", bytes(65536 * (4096 - 64)))
        assert len(s) == 0 and s.drives[0].free_bytes == free and s.pool.in_use == 0
        assert s.put(b"small", b"x" * 100) and s.get(b"small") == b"x" * 100


# ---- reads in place ----------------------------------------------------------------------------
def test_a_missed_in_place_read_lets_go_of_the_callers_buffer(drive_dirs, overwrite):
    """threads backend: an idle worker held its last chunk of requests, so a caller's buffer read
    in place stayed exported after release() and could not be unmapped."""
    paths = drive_dirs(1)
    with _open(paths) as s:
        s.put(b"k", _payload(1, 8192))
        s.flush()
        entry = next(iter(s.catalog))[1]
        overwrite(paths[0], entry.extents[0][1] + 4096, b"\xff" * 16)  # the payload, past its header sector
        buf = mmap.mmap(-1, 8192)
        view = memoryview(buf)
        r = s.submit_get([b"k"], into=[view], in_place=True).wait()
        assert r.views[0] is None and r.misses == 1
        r.release()
        del r
        view.release()
        gc.collect()
        buf.close()  # BufferError while anything still exports it


# ---- damaged metadata: an error naming the file, the evidence untouched -------------------------
def _stored(paths, n=150, ckpt_at=100, **kw):
    """A store with ``n`` flushed objects, ``ckpt_at`` of them in a checkpoint, the rest in the journal."""
    with _open(paths, **kw) as s:
        assert all(s.put_many([(b"k%d" % i, _payload(i)) for i in range(ckpt_at)]))
        s.checkpoint()
        assert all(s.put_many([(b"k%d" % i, _payload(i)) for i in range(ckpt_at, n)]))
        s.flush()
        s._unlock_writer()  # noqa: SLF001 - leave it as a crash would: no close, no new checkpoint
        s.engine.close()
        for d in s.drives:
            d.close()
        s.catalog._keep_journal(-1)  # noqa: SLF001
        os.close(s.catalog._jfd)  # noqa: SLF001
        s.engine = None
    return paths[0]


def _files(meta):
    out = {}
    for f in sorted(os.listdir(meta)):
        p = os.path.join(meta, f)
        if os.path.isfile(p) and f != "writer.lock":
            with open(p, "rb") as fh:
                out[f] = fh.read()
    return out


def _flip(path, offset, bit=1):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ bit]))


@pytest.mark.parametrize("damage,match", [
    ("delete checkpoint", "catalog.ckpt is missing"),
    ("flip journal magic", "journal .*catalog.journal has no valid header"),
    ("truncate checkpoint", "checkpoint .*catalog.ckpt is truncated"),
    ("truncate journal", "journal .*catalog.journal has no valid header"),
    ("delete journal", "journal .*catalog.journal is missing"),
    ("flip a journal record", "journal .*catalog.journal is damaged at byte"),
])
def test_damaged_catalog_is_an_error_naming_the_file_and_nothing_is_rewritten(drive_dirs, damage, match):
    from kvswarm.catalog import CHECKPOINT, JOURNAL
    from kvswarm.errors import MetadataError

    paths = drive_dirs(2)
    meta = _stored(paths)
    ck, jn = os.path.join(meta, CHECKPOINT), os.path.join(meta, JOURNAL)
    if damage == "delete checkpoint":
        os.remove(ck)
    elif damage == "flip journal magic":
        _flip(jn, 0)
    elif damage == "truncate checkpoint":
        os.truncate(ck, 20)
    elif damage == "truncate journal":
        os.truncate(jn, 10)
    elif damage == "delete journal":
        os.remove(jn)
    else:
        _flip(jn, 16 + 8)  # a byte of the first record's digest: its CRC fails, valid ones follow
    before = _files(meta)
    fds = _fds()
    for follow in (False, True):
        with pytest.raises(MetadataError, match=match):
            _open(paths, follow=follow)
    assert _files(meta) == before and _fds() == fds


def test_a_torn_last_record_is_cut_and_kept_aside(drive_dirs):
    from kvswarm.catalog import JOURNAL

    paths = drive_dirs(1)
    meta = _stored(paths, n=20, ckpt_at=10)
    jn = os.path.join(meta, JOURNAL)
    with open(jn, "ab") as f:
        f.write(b"\x50\x00\x00\x00\x01torn")  # an append cut short by a crash
    with _open(paths) as s:
        assert len(s) == 20 and all(s.get(b"k%d" % i) == _payload(i) for i in range(20))
    assert [f for f in os.listdir(meta) if f.startswith(JOURNAL + ".tail-")]


@pytest.mark.parametrize("content", [b"{}", b"\xff\xfe garbage \x00", b'{"uuid": "zz", "drives": []}', b"[1, 2]"])
def test_a_damaged_manifest_is_an_error_naming_it(drive_dirs, content):
    from kvswarm.errors import MetadataError

    paths = drive_dirs(1)
    meta = _stored(paths, n=4, ckpt_at=2)
    with open(os.path.join(meta, "store.json"), "wb") as f:
        f.write(content)
    before = _files(meta)
    with pytest.raises(MetadataError, match="manifest .*store.json is damaged"):
        _open(paths)
    assert _files(meta) == before


def test_a_deleted_manifest_is_not_recreated_with_a_new_store_id(drive_dirs):
    from kvswarm.errors import MetadataError

    paths = drive_dirs(2)
    meta = _stored(paths, n=4, ckpt_at=2)
    os.remove(os.path.join(meta, "store.json"))
    before = _files(meta)
    with pytest.raises(MetadataError, match="store.json is missing .*fsck"):
        _open(paths)
    assert _files(meta) == before and "store.json" not in before
    os.remove(os.path.join(meta, "catalog.journal"))
    os.remove(os.path.join(meta, "catalog.ckpt"))
    with pytest.raises(MetadataError, match="drive .* of store"):  # the drives still say whose they are
        _open(paths)


def test_meta_dir_problems_are_errors_naming_it(tmp_path, drive_dirs):
    from kvswarm.errors import MetadataError

    paths = drive_dirs(1)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for meta, match in ((afile, "not a directory"), (afile / "sub", "cannot make meta_dir")):
        with pytest.raises(MetadataError, match=match):
            _open(paths, meta_dir=str(meta))
    ro = tmp_path / "ro"
    ro.mkdir()
    os.system(f"mount -t tmpfs -o ro,size=64k tmpfs {ro}")  # read-only even for root
    try:
        with pytest.raises(MetadataError, match="ro"):
            _open(paths, meta_dir=str(ro))
    finally:
        os.system(f"umount {ro}")
    assert os.listdir(paths[0]) == []


# ---- a refused open leaves nothing that blocks the corrected retry --------------------------------
def test_a_refused_open_leaves_nothing_behind(drive_dirs, tmp_path):
    paths = drive_dirs(2)
    fds = _fds()
    with pytest.raises(KVSwarmError):
        _open(paths, capacity_per_drive=1000)  # refused by the config
    with pytest.raises(DriveError):
        _open(paths + ["/etc/hostname"])  # a regular file is no drive
    with pytest.raises(KVSwarmError):  # the pool fails last, after the drives' files were made
        _open(paths, buffer_pool_bytes=10**18)
    assert _fds() == fds
    assert all(os.listdir(p) in ([], ["writer.lock"]) for p in paths)
    with _open(paths) as s:  # the corrected retry
        assert s.put(b"a", b"1") and s.get(b"a") == b"1"
    with pytest.raises(KVSwarmError, match="store.json is missing but a store is there"):
        _open(paths[::-1])  # its meta_dir would be d1, which holds no manifest: nothing is made there
    assert sorted(os.listdir(paths[1])) == ["kvswarm.data", "writer.lock"]
    with _open(paths) as s:  # the refused reordering changed nothing
        assert s.get(b"a") == b"1"
    meta = str(tmp_path / "meta")
    extra = str(tmp_path / "extra")
    os.makedirs(extra)
    with pytest.raises(DriveError):  # a drive list with a bad path: refused before a manifest is made
        _open([extra, "/nonexistent"], meta_dir=meta)
    with _open([extra], meta_dir=meta) as s:  # the corrected list
        assert s.put(b"b", b"2")
    with pytest.raises(KVSwarmError, match="made with drives"):
        _open([extra, paths[0]], meta_dir=meta)
    with _open([extra], meta_dir=meta) as s:
        assert s.get(b"b") == b"2"
