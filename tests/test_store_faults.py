"""Store-side faults: bad configuration, damaged metadata, full and failing drives, degraded open.

Every case ends in exact bytes, a counted miss or a clear error of kvswarm's own classes, and a
refused call leaves the store (and the files behind it) as they were.
"""

from __future__ import annotations

import gc
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
    ("flip a journal record's length", "journal .*catalog.journal is damaged at byte"),
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
    elif damage == "flip a journal record":
        _flip(jn, 16 + 8)  # a byte of the first record's digest: its CRC fails, valid ones follow
    else:
        _flip(jn, 16 + 1, 0x10)  # the first record's length: it now claims ~4 KiB more than it holds
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


# ---- degraded open: one unreadable drive does not keep the others from serving -------------------
def _on_drive(s, keys):
    """key -> the drives its object's extents are on."""
    from kvswarm.format import key_digest

    return {k: {x[0] for x in s.catalog.get(key_digest(k)).extents} for k in keys}


def _check_degraded(paths, keys, where, bad: int, why: str, **kw):
    with _open(paths, **kw) as s:
        h = s.health()
        assert [x.healthy for x in h] == [i != bad for i in range(len(paths))]
        assert why in h[bad].reason and h[bad].path == paths[bad]
        assert s.stats()["drives"][bad]["reason"] == h[bad].reason
        lost = [k for k in keys if bad in where[k]]
        assert 0 < len(lost) < len(keys)
        with s.get_many(keys) as r:
            for k, v in zip(keys, r.views):
                assert (v is None) if k in lost else bytes(v) == _payload(int(k[1:]))
            assert r.misses == len(lost)
        assert s.counters["misses"] == len(lost)
        assert s.put(b"new", b"n" * 9000) and s.get(b"new") == b"n" * 9000  # writes go to the others


@pytest.mark.parametrize("damage", ["superblock", "truncated", "data file removed", "drive removed"])
def test_a_store_opens_without_an_unreadable_drive(drive_dirs, damage, caplog):
    paths = drive_dirs(3)
    keys = [b"k%d" % i for i in range(30)]
    with _open(paths) as s:
        assert all(s.put_many([(k, _payload(int(k[1:]))) for k in keys]))
        where = _on_drive(s, keys)
    data = os.path.join(paths[2], DATA_FILE)
    if damage == "superblock":
        _flip(data, 3)
        why = "no valid kvswarm superblock"
    elif damage == "truncated":
        os.truncate(data, os.path.getsize(data) // 2)
        why = "truncated"
    elif damage == "data file removed":
        os.remove(data)
        why = "holds no kvswarm data file"
    else:
        import shutil

        shutil.rmtree(paths[2])
        why = "does not exist"
    _check_degraded(paths, keys, where, 2, why)
    assert f"opens without drive 2 ({paths[2]})" in caplog.text
    with _open(paths, follow=True) as f:  # a follower too
        assert not f.health()[2].healthy
        assert all(f.get(k) == _payload(int(k[1:])) for k in keys if 2 not in where[k])
    if damage == "data file removed":
        assert not os.path.exists(data)  # nothing was made in its place


def test_a_new_store_or_one_without_any_readable_drive_is_refused(drive_dirs):
    paths = drive_dirs(2)
    with open(os.path.join(paths[1], DATA_FILE), "wb") as f:
        f.write(b"not a kvswarm drive" * 1000)
    with pytest.raises(DriveError, match="no valid kvswarm superblock"):
        _open(paths)  # a new store is never made degraded
    os.remove(os.path.join(paths[1], DATA_FILE))
    with _open(paths) as s:
        s.put(b"a", b"1")
    for p in paths:
        _flip(os.path.join(p, DATA_FILE), 3)
    with pytest.raises(DriveError, match="no drive of the store can be opened"):
        _open(paths)


def test_tiers_open_with_an_unreadable_pool_drive(tmp_path):
    from kvswarm.prefix import PrefixKeyer, new_block
    from kvswarm.layout import KVLayout
    from kvswarm.tiers import Tier
    from kvswarm.tiers.manager import TierConfig, TierManager
    from kvswarm.tiers.pools import PoolConfig

    keyer = PrefixKeyer(KVLayout(2, 1, 8, "float32", tokens_per_block=16, model_id="test"))
    kv = keyer.layout.block_bytes
    paths = []
    for i in range(3):
        os.makedirs(tmp_path / f"ssd{i}")
        paths.append(str(tmp_path / f"ssd{i}"))
    cfg = TierConfig(block_bytes=kv + 64, dram_bytes=0, ssd=PoolConfig(paths, capacity_per_drive=4 * MiB,
                                                                       buffer_pool_bytes=4 * MiB))
    keys = keyer.block_keys(np.arange(16 * 12))
    blocks = []
    for i, k in enumerate(keys):
        buf, body = new_block(k, keyer.namespace, 16, i, kv)
        body[:] = np.random.default_rng(i).bytes(kv)
        blocks.append(buf)
    tm = TierManager(cfg)
    tm.insert(keys, blocks)
    tm.flush()
    for s in tm.stores.values():
        s.close()
    _flip(os.path.join(paths[1], DATA_FILE), 3)
    tm = TierManager(cfg)
    pool = tm.stores[Tier.SSD]
    assert [h.healthy for h in pool.health()] == [True, False, True]
    with tm.lookup(keys) as hit:  # the prefix up to the first block on the bad drive, exact
        assert 0 < len(hit) < len(keys) or len(hit) == 0
        for i, v in enumerate(hit.views):
            assert bytes(v) == bytes(blocks[i])
    for s in tm.stores.values():
        s.close()


# ---- real devices: EIO at open, ENOSPC on a thin volume ------------------------------------------
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts file systems and makes loop devices")


@needs_root
def test_a_block_device_failing_with_eio_is_named_leaks_nothing_and_the_store_opens_without_it(tmp_path,
                                                                                               drive_dirs):
    """The volume is a loop device over a file on an ext4 file system that is then shut down
    (EXT4_IOC_SHUTDOWN): every read of the device fails with EIO, as a dead disk's would."""
    from fsfaults import ext4_fs, loop_device, shutdown_fs

    from kvswarm.drive import open_drive
    from kvswarm.errors import DriveUnavailable

    d0 = drive_dirs(1)[0]
    with ext4_fs(str(tmp_path / "ext"), 32) as mnt:
        img = os.path.join(mnt, "vol.img")
        with open(img, "wb") as f:
            f.truncate(16 * MiB)
        with loop_device(img, direct_io=True) as dev:
            paths = [d0, dev]
            keys = [b"k%d" % i for i in range(30)]
            with _open(paths) as s:
                assert all(s.put_many([(k, _payload(int(k[1:]))) for k in keys]))
                where = _on_drive(s, keys)
                uuid = s.store_uuid
            shutdown_fs(mnt)
            fds = _fds()
            for _ in range(3):
                with pytest.raises(DriveUnavailable, match=f"{dev}.*Input/output error"):
                    open_drive(1, dev, uuid, 0, create=False)
            assert _fds() == fds
            _check_degraded(paths, keys, where, 1, "Input/output error")
            assert _fds() == fds


@needs_root
def test_a_full_thin_volume_is_full_not_failed(tmp_path, drive_dirs):
    """Drive 1 is a thin volume: a loop device over a 64 MiB sparse file on a ~8 MiB tmpfs, whose
    writes fail with ENOSPC once the tmpfs is full.  Puts that land there are reported not stored;
    the drive stays in service, everything stored stays readable, and new puts go to the other drive."""
    from fsfaults import loop_device, small_fs

    d0 = drive_dirs(1)[0]
    # The tmpfs holds the superblock's page and 32 extents of 65 pages exactly: the loop driver reports
    # a write cut short by the full tmpfs as done (a device that lies: its object would read back as a
    # counted corrupt miss), so the volume fills at an extent's start, where the write fails whole.
    with small_fs(str(tmp_path / "thin"), str((1 + 65 * 32) * 4096)) as mnt:
        img = os.path.join(mnt, "vol.img")
        with open(img, "wb") as f:
            f.truncate(64 * MiB)
        with loop_device(img) as dev:
            paths = [d0, dev]
            obj = 256 << 10
            stored = {}
            with _open(paths, capacity_per_drive=64 * MiB, buffer_pool_bytes=8 * MiB) as s:
                for i in range(80):
                    k = b"k%d" % i
                    if s.put(k, _payload(i, obj)):
                        stored[k] = i
                    if i % 10 == 9:
                        s.flush()
                h = s.health()[1]
                assert h.healthy and h.full and s.stats()["drives"][1]["full"]
                assert 60 <= len(stored) < 80  # the puts that hit the full volume, and only those, failed
                assert s.counters["put_failures"] == 80 - len(stored)
                assert all(s.get(k) == _payload(i, obj) for k, i in stored.items())
                assert s.put(b"after", b"a" * obj) and 1 not in _on_drive(s, [b"after"])[b"after"]
                assert any(1 in w for w in _on_drive(s, list(stored)).values())
            with _open(paths, capacity_per_drive=64 * MiB, buffer_pool_bytes=8 * MiB) as s:
                assert all(h.healthy for h in s.health())
                assert all(s.get(k) == _payload(i, obj) for k, i in stored.items())


# ---- flushes that cannot make writes durable --------------------------------------------------------
def test_objects_a_flush_reports_not_durable_leave_the_catalog(drive_dirs, fdatasync_fails):
    from kvswarm.errors import FlushError

    paths = drive_dirs(2)
    first = [b"a%d" % i for i in range(20)]
    then = [b"b%d" % i for i in range(20)]
    with _open(paths) as s:
        assert all(s.put_many([(k, _payload(i)) for i, k in enumerate(first)]))
        s.flush()
        assert all(s.put_many([(k, _payload(100 + i)) for i, k in enumerate(then)]))
        where = _on_drive(s, then)
        fdatasync_fails(s.drives[1].fd)
        with pytest.raises(FlushError, match="drive 1"):
            s.flush()
        lost = [k for k in then if 1 in where[k]]
        assert lost and all(k not in s for k in lost)
    with _open(paths) as s:  # after a restart: not in the catalog, rather than a miss on every read
        assert all(k not in s for k in lost) and len(s) == len(first) + len(then) - len(lost)
        assert all(s.get(k) == _payload(i) for i, k in enumerate(first))
        assert all(s.get(k) == _payload(100 + i) for i, k in enumerate(then) if k not in lost)


def test_a_drive_directory_removed_while_open_is_taken_out_of_service(drive_dirs):
    import shutil

    from kvswarm.errors import FlushError

    paths = drive_dirs(3)
    first = [b"a%d" % i for i in range(20)]
    with _open(paths[1:], meta_dir=paths[0]) as s:
        assert all(s.put_many([(k, _payload(i)) for i, k in enumerate(first)]))
        s.flush()
        shutil.rmtree(paths[2])  # the writes below would go to an unlinked file and vanish at close
        then = [b"b%d" % i for i in range(20)]
        assert all(s.put_many([(k, _payload(100 + i)) for i, k in enumerate(then)]))
        where = _on_drive(s, first + then)
        with pytest.raises(FlushError, match="drive 1 .*removed"):
            s.flush()
        h = s.health()[1]
        assert not h.healthy and "removed" in h.reason
        assert all(k not in s for k in then if 1 in where[k])
        assert all(s.get(k) == _payload(i) for i, k in enumerate(first) if 1 not in where[k])
        assert s.put(b"c", b"c" * 5000) and 0 in _on_drive(s, [b"c"])[b"c"]
    with _open(paths[1:], meta_dir=paths[0]) as s:
        assert not s.health()[1].healthy
        assert all(s.get(k) == _payload(i) for i, k in enumerate(first) if 1 not in where[k])


def test_an_open_that_died_making_a_store_does_not_block_the_next(drive_dirs, tmp_path):
    """Killed after the drives were formatted and the journal started, before the manifest: the next
    open goes on with that store; a store that held objects is never taken for one."""
    paths = drive_dirs(2)
    with _open(paths) as s:
        uuid = s.store_uuid
    os.remove(os.path.join(paths[0], "store.json"))
    os.remove(os.path.join(paths[0], "catalog.ckpt"))  # as an open that died before its first close
    with open(os.path.join(paths[0], "catalog.journal"), "wb") as f:
        f.write(b"KVSWJRN1" + bytes(8))  # the first epoch's journal, empty
    with _open(paths) as s:
        assert s.store_uuid == uuid and s.put(b"a", b"1")
    with _open(paths) as s:
        assert s.get(b"a") == b"1"
    fresh = [str(tmp_path / "e0"), str(tmp_path / "e1")]
    for p in fresh:
        os.makedirs(p)
    open(os.path.join(fresh[1], DATA_FILE), "wb").close()  # killed between making a data file and sizing it
    with _open(fresh) as s:
        assert s.drives[1].capacity == 16 * MiB and s.put(b"b", b"2") and s.get(b"b") == b"2"


@needs_root
def test_a_full_metadata_disk_is_a_clear_error_and_loses_nothing_flushed(tmp_path, drive_dirs):
    """meta_dir on a 1 MiB tmpfs that a filler fills: flush, checkpoint and close raise MetadataError
    naming the catalog file; once there is room again, everything flushed before is there."""
    from fsfaults import small_fs

    from kvswarm.errors import MetadataError

    paths = drive_dirs(2)
    with small_fs(str(tmp_path / "meta"), "1m") as meta:
        fds = _fds()
        s = _open(paths, meta_dir=meta)
        assert all(s.put_many([(b"a%d" % i, _payload(i)) for i in range(50)]))
        s.checkpoint()
        filler = os.path.join(meta, "filler")
        with open(filler, "wb") as f:
            with pytest.raises(OSError):
                while True:
                    f.write(bytes(64 << 10))
                    f.flush()
        for j in range(0, 3000, 500):  # journal records, more than the filled disk takes
            assert all(s.put_many([(b"b%d" % i, b"b" * 100) for i in range(j, j + 500)]))
        with pytest.raises(MetadataError, match="catalog.journal.*No space left"):
            s.flush()
        with pytest.raises(MetadataError, match="No space left"):
            s.checkpoint()
        with pytest.raises(MetadataError, match="No space left"):
            s.close()
        assert _fds() == fds  # closed all the same
        os.remove(filler)
        with _open(paths, meta_dir=meta) as s:
            assert all(s.get(b"a%d" % i) == _payload(i) for i in range(50))


def test_catalog_files_reach_the_disk_before_their_fsync(tmp_path, monkeypatch):
    """Every fsync of a checkpoint or journal finds the file's bytes written (not still in Python's
    buffer, where a power cut right after the fsync would lose them)."""
    from kvswarm.catalog import CKPT_DTYPE, Catalog, Entry

    sizes = []
    real = os.fsync

    def fsync(fd):
        sizes.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    c = Catalog(str(tmp_path))
    c.put(b"d" * 16, Entry(c.new_generation(), 10, ((0, 4096, 4096, 7),)))
    c.checkpoint()
    c.close()
    files = {os.path.basename(p): n for p, n in sizes if os.path.basename(p).startswith("catalog")}
    assert files["catalog.journal.tmp"] == 16 and files["catalog.ckpt.tmp"] == 40 + CKPT_DTYPE.itemsize
