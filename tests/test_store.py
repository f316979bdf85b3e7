"""KVStore behaviour on real files with O_DIRECT, for both I/O backends, verified by the native
worker and by the Python fallback alike."""

import mmap
import os
import stat

import numpy as np
import pytest

import kvswarm.store.handles as store_handles
import kvswarm.store.verify as store_verify
from kvswarm import DriveError, DriveFull, FlushError, KVStore, KVSwarmError, UnalignedBuffer
from kvswarm.digest_index import DictDigestIndex
from kvswarm.drive import DATA_FILE
from kvswarm.format import FLAG_SECTOR_PAYLOAD, extent_size, payload_offset
from kvswarm.io import IORequest, Op, make_engine
from kvswarm.metrics import FOLD_EVERY, DriveStats
from kvswarm.store import Runs

BACKENDS = ["threads", "uring"]
MiB = 1 << 20


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(autouse=True, params=["batch", "native", "python"])
def verifier(request, monkeypatch):
    """Every test runs on the native batch path (kvswarm.io._batchio: I/O, checks and copies in C), with the
    Python engine and the native verify worker, and with the pure-Python checks (a build without a C
    compiler); the native modules must have been built."""
    from kvswarm.io import native

    assert store_verify.verify_submit is not None, "kvswarm.store._verify was not built"
    assert native.available(), "kvswarm.io._batchio was not built, or io_uring is refused"
    if request.param != "batch":
        monkeypatch.setenv(native.ENV, "0")
    if request.param == "python":
        monkeypatch.setattr(store_verify, "verify_submit", None)
    return request.param


def _open(paths, backend, **kw):
    kw.setdefault("capacity_per_drive", 16 * MiB)
    kw.setdefault("buffer_pool_bytes", 32 * MiB)
    return KVStore.open(paths, backend=backend, **kw)


def _payload(key: bytes, n: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8].ljust(8, b"\0"), "little")).bytes(n)


def test_roundtrip_striped_over_all_drives(backend, drive_dirs):
    paths = drive_dirs(4)
    sizes = [1, 100, 4032, 4033, 16000, 65536, 300_000, 2 * MiB + 17]
    items = [(f"key-{i}".encode(), _payload(f"key-{i}".encode(), n)) for i, n in enumerate(sizes * 3)]
    with _open(paths, backend, stripe_unit=256 * 1024) as s:
        assert all(s.put_many(items))
        with s.get_many([k for k, _ in items] + [b"absent"]) as r:
            for (k, v), got in zip(items, r.views):
                assert bytes(got) == v
            assert r.views[-1] is None and r.misses == 1 and r.corrupt == 0
        per_drive = [d["write_ops"] for d in s.stats()["drives"]]
        assert all(n > 0 for n in per_drive), per_drive  # every drive took a share
        assert all(d["direct_io"] for d in s.stats()["drives"])


def test_async_handles_overlap(backend, drive_dirs):
    with _open(drive_dirs(2), backend) as s:
        h1 = s.submit_put([(b"a%d" % i, _payload(b"a%d" % i, 5000)) for i in range(50)])
        h2 = s.submit_put([(b"b%d" % i, _payload(b"b%d" % i, 9000)) for i in range(50)])
        assert all(h2.wait()) and all(h1.wait())
        g1 = s.submit_get([b"a%d" % i for i in range(50)])
        g2 = s.submit_get([b"b%d" % i for i in range(50)])
        while not (g1.poll() and g2.poll()):
            pass
        for h, pre, n in ((g1, b"a", 5000), (g2, b"b", 9000)):
            with h.wait() as r:
                assert [bytes(v) for v in r.views] == [_payload(pre + b"%d" % i, n) for i in range(50)]


def test_numpy_and_torch_views_are_zero_copy(drive_dirs):
    torch = pytest.importorskip("torch")
    arr = np.arange(2048, dtype=np.float32)
    with _open(drive_dirs(1), "threads") as s:
        s.put(b"arr", arr)
        with s.get_many([b"arr"]) as r:
            got = np.frombuffer(r.views[0], np.float32)
            np.testing.assert_array_equal(got, arr)
            assert got.ctypes.data % 64 == 0  # payload starts 64 B into a 4 KiB-aligned extent
            t = torch.frombuffer(r.views[0], dtype=torch.float32)
            assert t.data_ptr() == got.ctypes.data


def test_overwrite_delete_and_reopen(backend, drive_dirs):
    paths = drive_dirs(3)
    with _open(paths, backend) as s:
        s.put(b"k", b"old" * 1000)
        s.put(b"k", b"new" * 2000)
        s.put(b"gone", b"x" * 10)
        assert s.delete(b"gone") and not s.delete(b"gone")
        s.flush()  # replaced/deleted extents are freed once the change is durable
        used = sum(d["capacity"] - d["free_bytes"] for d in s.stats()["drives"])
    with _open(paths, backend) as s:
        assert s.get(b"k") == b"new" * 2000 and s.get(b"gone") is None and len(s) == 1
        assert sum(d["capacity"] - d["free_bytes"] for d in s.stats()["drives"]) == used


def test_delete_many_drops_a_batch_durably_and_frees_its_space_after_the_flush(backend, drive_dirs):
    paths = drive_dirs(2)
    keys = [b"d%d" % i for i in range(50)]
    with _open(paths, backend) as s:
        s.put_many([(k, _payload(k, 9000)) for k in keys])
        s.flush()
        free = sum(d["free_bytes"] for d in s.stats()["drives"])
        gone = keys[::2] + [b"never stored"]
        assert s.delete_many(gone) == [True] * 25 + [False]
        assert s.delete_many(keys[:2]) == [False, True]  # d0 went above, d1 goes now
        assert sum(d["free_bytes"] for d in s.stats()["drives"]) == free  # reused only once durable
        s.flush()
        assert sum(d["free_bytes"] for d in s.stats()["drives"]) > free
    with _open(paths, backend) as s:
        dropped = set(keys[::2]) | {keys[1]}
        assert len(s) == 50 - len(dropped)
        with s.get_many(keys) as r:
            for k, v in zip(keys, r.views):
                assert (v is None) == (k in dropped) and (v is None or bytes(v) == _payload(k, 9000))


def test_handles_finish_in_completion_order(backend, drive_dirs):
    with _open(drive_dirs(2), backend) as s:
        s.put_many([(b"o%d" % i, _payload(b"o%d" % i, 5000)) for i in range(40)])
        assert s.progress(0) == 0  # nothing in flight: returns at once
        live = [s.submit_get([b"o%d" % i for i in range(j, j + 10)]) for j in range(0, 40, 10)]
        seen = 0
        while live:
            ready = [h for h in live if h.done]
            if not ready:
                assert s.progress() > 0  # blocks until at least one read is back
                continue
            for h in ready:
                live.remove(h)
                with h.wait() as r:
                    assert r.misses == 0
                    seen += len(r.views)
        assert seen == 40


def test_reads_back_holds_once_the_io_is_back_and_before_the_result(backend, drive_dirs):
    """``reads_back``: a caller may submit its next batch once a handle's I/O is back, before
    waiting for its verification; the handle's result is the same."""
    with _open(drive_dirs(2), backend) as s:
        s.put_many([(b"r%d" % i, _payload(b"r%d" % i, 70000)) for i in range(16)])
        h = s.submit_get([b"r%d" % i for i in range(16)])
        while not h.reads_back:
            s.progress(0.05)
        assert h.reads_back  # stays so, whatever verification does
        with s.submit_get([b"r0"]).wait() as r2, h.wait() as r:
            assert bytes(r2.views[0]) == _payload(b"r0", 70000)
            assert [bytes(v) for v in r.views] == [_payload(b"r%d" % i, 70000) for i in range(16)]


def test_corrupted_extent_is_a_counted_miss(backend, overwrite, drive_dirs):
    paths = drive_dirs(2)
    with _open(paths, backend) as s:
        items = [(b"c%d" % i, _payload(b"c%d" % i, 6000)) for i in range(20)]
        s.put_many(items)
        s.flush()
        # Flip payload bytes of every object in the middle of drive 0's data file.
        for drv, off, ln, _ in [x for k, _ in items for x in s.catalog.get(_digest(k)).extents]:
            if drv == 0:
                overwrite(paths[0], off + 64 + 100, b"\xff\x00\xff")
        with s.get_many([k for k, _ in items]) as r:
            assert r.corrupt > 0 and r.corrupt == r.misses
            for (k, v), got in zip(items, r.views):
                assert got is None or bytes(got) == v  # never wrong bytes
        assert sum(d.misses for d in s.drive_stats) == r.corrupt


def test_multi_extent_objects_are_joined_in_place_and_verified_per_part(backend, overwrite, drive_dirs):
    paths = drive_dirs(3)
    with _open(paths, backend, stripe_unit=64 * 1024) as s:
        items = [(b"m%d" % i, _payload(b"m%d" % i, 200_000 + i)) for i in range(6)]  # 4 extents each
        s.put_many(items)
        for k, v in items:  # what a caller sizes its batches by: the extents' bytes, as leased
            assert s.object_bytes(len(v)) == sum(e[2] for e in s.catalog.get(_digest(k)).extents)
        with s.get_many([k for k, _ in items]) as r:
            assert r.misses == 0
            for (_, v), got in zip(items, r.views):
                assert isinstance(got, memoryview) and bytes(got) == v  # a view of the lease, not a copy
        # Corrupt the third extent of object 0: that object is a miss, the others are intact.
        drv, off, _, _ = s.catalog.get(_digest(items[0][0])).extents[2]
        overwrite(paths[drv], off + 64 + 10, b"\x00\xff")
        with s.get_many([k for k, _ in items]) as r:
            assert r.views[0] is None and r.corrupt == 1
            assert all(bytes(got) == v for (_, v), got in zip(items[1:], r.views[1:]))


def test_single_thread_io_store_round_trips(backend, drive_dirs):
    """A store driven from one thread may let io_uring defer completions to that thread's next
    system call (COOP_TASKRUN): reads and writes must still complete while it waits."""
    with _open(drive_dirs(2), backend, single_thread_io=True) as s:
        items = [(b"s%d" % i, _payload(b"s%d" % i, 5000 + i)) for i in range(64)]
        assert all(s.submit_put(items).wait())
        handles = [s.submit_get([k for k, _ in items[i:i + 8]]) for i in range(0, 64, 8)]
        for i, h in enumerate(handles):
            with h.wait() as r:
                assert [bytes(v) for v in r.views] == [v for _, v in items[i * 8:i * 8 + 8]]


def test_whole_sector_payloads_start_on_their_own_sector(drive_dirs):
    """A payload of whole 4 KiB sectors starts at 4096 in its extent (flagged in the header, the
    header's sector zero-padded) in as many bytes as the packed layout; others follow the header."""
    paths = drive_dirs(1)
    with _open(paths, "threads") as s:
        s.put_many([(b"sec", _payload(b"sec", 8192)), (b"packed", _payload(b"packed", 4032))])
        s.flush()
        with open(os.path.join(paths[0], DATA_FILE), "rb") as f:
            for key, n, poff, flags in ((b"sec", 8192, 4096, FLAG_SECTOR_PAYLOAD), (b"packed", 4032, 64, 0)):
                (_, off, ln, _), = s.catalog.get(_digest(key)).extents
                assert ln == extent_size(n) == -(-(64 + n) // 4096) * 4096 and payload_offset(n) == poff
                f.seek(off)
                ext = f.read(ln)
                assert int.from_bytes(ext[6:8], "little") == flags
                assert ext[poff:poff + n] == _payload(key, n)
                assert not any(ext[64:poff]) and not any(ext[poff + n:])


def _aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n))  # page-aligned


def test_reads_into_caller_buffers(backend, drive_dirs):
    """`into`: every verified payload lands in its caller's buffer (whole-sector, packed,
    multi-extent, an unaligned buffer alike), read through the pool and copied there."""
    paths = drive_dirs(3)
    with _open(paths, backend, stripe_unit=64 * 1024) as s:
        sizes = {b"sectors": 16384, b"packed": 6000, b"multi": 150_000, b"unaligned": 8192}
        s.put_many([(k, _payload(k, n)) for k, n in sizes.items()])
        bufs = {k: _aligned(n) for k, n in sizes.items()}
        bufs[b"unaligned"] = memoryview(bytearray(8193))[1:]  # any buffer will do
        reads_before = sum(d["read_ops"] for d in s.stats()["drives"])
        keys = [*sizes, b"absent"]
        with s.submit_get(keys, into=[bufs.get(k) for k in keys]).wait() as r:
            assert r.misses == 1 and r.views[-1] is None
            for k, got in zip(sizes, r.views):
                assert got.obj is bufs[k].obj and bytes(bufs[k]) == _payload(k, sizes[k]), k
        # One read per extent.
        multi_parts = len(s.catalog.get(_digest(b"multi")).extents)
        assert sum(d["read_ops"] for d in s.stats()["drives"]) - reads_before == 3 + multi_parts
        # A None buffer reads into the lease as usual; a buffer of another length is a miss.
        with s.submit_get([b"sectors", b"packed"], into=[None, _aligned(4096)]).wait() as r:
            assert bytes(r.views[0]) == _payload(b"sectors", 16384) and r.views[1] is None and r.misses == 1
            assert r.failed == []  # the buffer was wrong, not the object
        with pytest.raises(ValueError):
            s.submit_get([b"sectors"], into=[])


def _scattered(n: int, base: bytearray, at: int) -> Runs:
    """Runs of ``base`` for an object of ``n`` bytes: three runs in reverse order, with gaps."""
    a, b = n // 4, n // 2
    lens = np.array([a, b, n - a - b], np.int64)
    off = np.array([at + 2 * n, at + n // 2 + 10, at], np.int64)
    return Runs(memoryview(base), off, lens)


def _gather(r: Runs) -> bytes:
    return b"".join(bytes(r.base[o:o + n]) for o, n in zip(r.off.tolist(), r.lens.tolist()))


def test_reads_scattered_over_runs(backend, overwrite, drive_dirs):
    """Runs receive their object in order (one extent or several; every run a slice of one base
    buffer); runs that do not add up to the object's length, or a corrupt payload, are misses that
    leave the runs as they were."""
    paths = drive_dirs(2)
    with _open(paths, backend, stripe_unit=64 * 1024) as s:
        sizes = {b"page": 16384, b"multi": 150_000, b"short": 8192, b"rot": 8192, b"multi_rot": 150_000}
        s.put_many([(k, _payload(k, n)) for k, n in sizes.items()])
        s.flush()
        (d, off, _, _), = s.catalog.get(_digest(b"rot")).extents
        overwrite(paths[d], off + payload_offset(8192) + 100, b"\xff\x00")
        d, off, _, _ = s.catalog.get(_digest(b"multi_rot")).extents[1]  # one bad extent of three
        overwrite(paths[d], off + 4096, b"\xff\x00")
        base = bytearray(b"\x5a" * 4 * 1024 * 1024)
        runs = {k: _scattered(n, base, 600_000 * i) for i, (k, n) in enumerate(sizes.items())}
        runs[b"short"] = Runs(memoryview(base), np.array([3_000_000], np.int64), np.array([8191], np.int64))
        keys = list(sizes)
        with s.submit_get(keys, into=[runs[k] for k in keys]).wait() as r:
            assert r.misses == 3 and r.corrupt == 2 and r.views[2:] == [None] * 3
            for k in (b"page", b"multi"):
                assert _gather(runs[k]) == _payload(k, sizes[k])
                got = r.views[keys.index(k)]  # the hit's view: the caller's runs
                assert isinstance(got, Runs) and got.base.obj is base and (got.off == runs[k].off).all()
        for k in (b"short", b"rot"):
            assert _gather(runs[k]) == b"\x5a" * int(runs[k].lens.sum())
        # One extent per object in the batch: the native worker scatters, when built.
        again = _scattered(16384, bytearray(64 * 1024), 0)
        with s.submit_get([b"page"], into=[again]).wait() as r:
            assert r.misses == 0 and _gather(again) == _payload(b"page", 16384)


def test_put_gathers_runs(backend, drive_dirs):
    """Runs are stored as their concatenation (one extent or several), checksummed."""
    with _open(drive_dirs(2), backend, stripe_unit=64 * 1024) as s:
        small, big = _payload(b"small", 12288), _payload(b"big", 150_000)
        base = bytearray(1 << 20)
        rs, rb = _scattered(len(small), base, 0), _scattered(len(big), base, 100_000)
        for r, data in ((rs, small), (rb, big)):
            at = 0
            for o, n in zip(r.off.tolist(), r.lens.tolist()):
                base[o:o + n] = data[at:at + n]
                at += n
        assert s.put_many([(b"small", rs), (b"big", rb)]) == [True] * 2
        s.flush()
        assert s.get(b"small") == small and s.get(b"big") == big
        assert s.verify([_digest(b"small"), _digest(b"big")]) == 0


@pytest.mark.parametrize("job_bytes", [4 << 20, 8192])
def test_reads_into_caller_buffers_are_verified(backend, overwrite, job_bytes, monkeypatch, drive_dirs):
    """A corrupt payload or a header that no longer matches is a counted miss, and the caller's
    buffer is left as it was: never a hit with wrong bytes.  Also with a batch verified as one
    native job per payload (``job_bytes`` 8192)."""
    monkeypatch.setattr(store_verify, "VERIFY_JOB_BYTES", job_bytes)
    paths = drive_dirs(1)
    with _open(paths, backend) as s:
        items = [(b"v%d" % i, _payload(b"v%d" % i, 8192)) for i in range(4)]
        s.put_many(items)
        s.flush()
        (_, off0, _, _), = s.catalog.get(_digest(b"v0")).extents
        (_, off1, _, _), = s.catalog.get(_digest(b"v1")).extents
        overwrite(paths[0], off0 + payload_offset(8192) + 5000, b"\xff\x00")  # payload bit rot
        overwrite(paths[0], off1 + 30, b"\x09")  # header: another part index
        bufs = [_aligned(8192) for _ in items]
        for b in bufs:
            b[:] = b"\x5a" * 8192
        with s.submit_get([k for k, _ in items], into=bufs).wait() as r:
            assert r.views[0] is None and r.views[1] is None and r.corrupt == 2 and r.failed == [0, 1]
            assert bytes(bufs[0]) == bytes(bufs[1]) == b"\x5a" * 8192
            assert [bytes(v) for v in r.views[2:]] == [v for _, v in items[2:]]
        s.fail_drive(0)
        with s.submit_get([b"v2", b"absent"], into=[_aligned(8192), None]).wait() as r:
            assert r.views == [None, None] and r.misses == 2 and r.failed == [0]


def test_reads_in_place_land_straight_in_the_callers_buffers(backend, overwrite, verifier, drive_dirs):
    """``in_place``: a one-extent, whole-sector object read into an aligned buffer of its length goes
    straight there with O_DIRECT (no pool space, the payload alone: one read per object), verified in
    place; the others (packed, several extents, an unaligned buffer) go through the pool as before.
    A corrupt payload or a stale checksum is still a counted miss.  Without the native worker every
    read goes through the pool (in_place batches take the Python engine, also where the native batch
    path is on)."""
    paths = drive_dirs(2)
    with _open(paths, backend, stripe_unit=64 * 1024) as s:
        sizes = {b"a": 16384, b"b": 8192, b"rot": 8192, b"packed": 6000, b"multi": 150_000, b"unaligned": 8192}
        s.put_many([(k, _payload(k, n)) for k, n in sizes.items()])
        s.flush()
        (d, off, _, _), = s.catalog.get(_digest(b"rot")).extents
        overwrite(paths[d], off + payload_offset(8192) + 100, b"\xff\x00")
        bufs = {k: _aligned(n) for k, n in sizes.items()}
        bufs[b"unaligned"] = memoryview(bytearray(8193))[1:]
        keys = [*sizes, b"absent"]
        pool_before = s.pool.in_use
        h = s.submit_get(keys, into=[bufs.get(k) for k in keys], in_place=True)
        direct = 3 if verifier != "python" else 0  # a, b and rot
        # Pool space for the others only: the packed object, the unaligned one and the extents of multi.
        others = extent_size(6000) + extent_size(8192) + sum(e[2] for e in s.catalog.get(_digest(b"multi")).extents)
        assert s.pool.in_use - pool_before == others + (0 if direct else 2 * extent_size(8192) + extent_size(16384))
        with h.wait() as r:
            assert r.misses == 2 and r.corrupt == 1 and r.failed == [keys.index(b"rot")] and r.views[-1] is None
            for k in sizes:
                if k != b"rot":
                    got = r.views[keys.index(k)]
                    assert got.obj is bufs[k].obj and bytes(bufs[k]) == _payload(k, sizes[k]), k
        assert s.pool.in_use == pool_before
        # The header sector is not read: a header that no longer matches the catalog goes unseen in place,
        # where the payload's checksum (the catalog's) still vouches for the bytes.
        (d, off, _, _), = s.catalog.get(_digest(b"b")).extents
        overwrite(paths[d], off + 30, b"\x09")
        out = _aligned(8192)
        with s.submit_get([b"b"], into=[out], in_place=True).wait() as r:
            assert (r.misses == 0 and bytes(out) == _payload(b"b", 8192)) if direct else r.corrupt == 1
        s.fail_drive(d)
        with s.submit_get([b"b"], into=[_aligned(8192)], in_place=True).wait() as r:
            assert r.views == [None] and r.failed == [0]


def test_enospc_gives_drivefull_and_store_survives(backend, drive_dirs):
    with _open(drive_dirs(2), backend, capacity_per_drive=64 * 1024) as s:
        stored = 0
        with pytest.raises(DriveFull):
            for i in range(100):
                s.put(b"f%d" % i, b"z" * 8000)
                stored += 1
        assert 0 < stored < 100
        assert s.get(b"f0") == b"z" * 8000
        s.delete(b"f0")
        assert s.put(b"again", b"y" * 8000)


def test_failed_drive_degrades_not_crashes(backend, drive_dirs):
    with _open(drive_dirs(4), backend) as s:
        items = [(b"h%d" % i, _payload(b"h%d" % i, 5000)) for i in range(40)]
        s.put_many(items)
        s.fail_drive(1)
        with s.get_many([k for k, _ in items]) as r:
            assert 0 < r.misses < len(items)
            for (k, v), got in zip(items, r.views):
                assert got is None or bytes(got) == v
        assert all(s.put_many([(b"n%d" % i, b"q" * 100) for i in range(8)]))
        assert all(e[0] != 1 for i in range(8) for e in s.catalog.get(_digest(b"n%d" % i)).extents)


def _attach(s, drive: int, engine_fd: int, native_fd: int) -> None:
    """Point a store's I/O for ``drive`` at other descriptors, on the engine and the native ring alike."""
    s.engine.fds[drive] = engine_fd
    if s.native is not None:
        s.native.attach(drive, native_fd, s.drive_stats[drive])


def test_real_io_errors_are_counted_and_isolated(backend, drive_dirs):
    paths = drive_dirs(2)
    with _open(paths, backend, error_threshold=2) as s:
        s.put_many([(b"e%d" % i, b"v" * 5000) for i in range(10)])
        # Swap drive 0's descriptor for a read-only one: its writes now fail with EBADF in the kernel.
        ro = os.open(os.path.join(paths[0], DATA_FILE), os.O_RDONLY | os.O_DIRECT)
        own = s.engine.fds[0], s.drives[0].fd
        _attach(s, 0, ro, ro)
        results = s.put_many([(b"w%d" % i, b"v" * 5000) for i in range(10)])
        assert not all(results) and any(results)
        assert s.drive_stats[0].errors > 0 and not s.drives[0].healthy
        assert all(s.put_many([(b"x%d" % i, b"v" * 5000) for i in range(4)]))  # drive 0 avoided now
        _attach(s, 0, *own)
        os.close(ro)


def test_drop_unreadable_deletes_exactly_the_objects_on_a_failed_drive(backend, drive_dirs):
    """Every object with an extent on a drive out of service (any of its parts) is deleted, journaled, and
    named; the others stay readable.  Nothing to do while every drive is healthy, nor a second time."""
    paths = drive_dirs(4)
    with _open(paths, backend, stripe_unit=8192) as s:
        items = [(b"u%d" % i, _payload(b"u%d" % i, 20000 if i % 2 else 5000)) for i in range(24)]  # 3 parts or 1
        assert all(s.put_many(items))
        s.flush()
        assert s.drop_unreadable() == []
        drives = {k: [x[0] for x in s.catalog.get(_digest(k)).extents] for k, _ in items}
        lost = {k for k, on in drives.items() if 1 in on}
        assert 0 < len(lost) < len(items) and any(drives[k][0] != 1 for k in lost)  # some on 1 by a later part
        s.fail_drive(1)
        dropped = s.drop_unreadable()
        assert sorted(dropped) == sorted(_digest(k) for k in lost)
        assert s.drop_unreadable() == []
        kept = [(k, v) for k, v in items if k not in lost]
        assert len(s) == len(kept) and not any(k in s for k in lost)
        with s.get_many([k for k, _ in kept]) as r:
            assert r.misses == 0 and [bytes(v) for v in r.views] == [v for _, v in kept]
    with _open(paths, backend, stripe_unit=8192) as s:  # drive 1 back in service: the deletes were journaled
        assert len(s) == len(kept) and not any(k in s for k in lost)
        with s.get_many([k for k, _ in kept]) as r:
            assert r.misses == 0 and [bytes(v) for v in r.views] == [v for _, v in kept]


def test_a_put_landing_on_a_drive_failed_meanwhile_is_not_stored(backend, drive_dirs):
    """A drive taken out of service while a put's writes are in flight: the objects with an extent there
    are reported not stored and their other extents freed, never put in the catalog to fail every read."""
    with _open(drive_dirs(3), backend, stripe_unit=8192) as s:
        items = [(b"m%d" % i, _payload(b"m%d" % i, 20000 if i % 3 == 0 else 5000)) for i in range(9)]  # 3 parts or 1
        free = [d.alloc.free for d in s.drives]
        h = s.submit_put(items)
        s.fail_drive(1)
        oks = h.wait()
        assert 0 < sum(oks) < len(items) and s.counters["put_failures"] == len(items) - sum(oks)
        assert len(s) == sum(oks) and s.drop_unreadable() == []
        stored = [(k, v) for (k, v), ok in zip(items, oks) if ok]
        for i in (0, 2):  # the healthy drives hold the stored objects' extents, nothing more
            held = sum(x[2] for k, _ in stored for x in s.catalog.get(_digest(k)).extents if x[0] == i)
            assert s.drives[i].alloc.free == free[i] - held
        with s.get_many([k for k, _ in stored]) as r:
            assert r.misses == 0 and [bytes(v) for v in r.views] == [v for _, v in stored]


def test_a_follower_drops_unreadable_objects_from_its_own_view_only(backend, drive_dirs):
    """A follower writes nothing: it forgets the objects on a drive it took out of service, and its
    writer's catalog keeps them."""
    paths = drive_dirs(2)
    with _open(paths, backend) as s:
        assert all(s.put_many([(b"f%d" % i, b"f" * 5000) for i in range(6)]))
    with _open(paths, backend, follow=True) as f:
        f.fail_drive(1)
        dropped = f.drop_unreadable()
        assert 0 < len(dropped) < 6 and len(f) == 6 - len(dropped)
        assert not any(f.catalog.get(d) for d in dropped)
    with _open(paths, backend) as s:
        assert len(s) == 6 and all(s.catalog.get(d) for d in dropped)


def test_bad_drive_paths(tmp_path):
    with pytest.raises(DriveError, match="does not exist"):
        KVStore.open([str(tmp_path / "missing")])
    f = tmp_path / "plainfile"
    f.write_bytes(b"x")
    with pytest.raises(DriveError, match="neither a directory nor a block device"):
        KVStore.open([str(f)], meta_dir=str(tmp_path / "meta"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.geteuid() != 0:  # root may write anywhere; the check is for ordinary users
        with pytest.raises(DriveError, match="not writable"):
            KVStore.open([str(ro)])
    with pytest.raises(ValueError):
        KVStore.open([])


def test_auto_backend_is_uring_where_available():
    from kvswarm.io import uring_available

    eng = make_engine("auto")
    try:
        assert eng.name == ("uring" if uring_available() else "threads")
    finally:
        eng.close()
    with pytest.raises(ValueError, match="auto"):
        make_engine("spdk")


def test_unaligned_requests_rejected(tmp_path, backend):
    eng = make_engine(backend)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 1 << 16)
    eng.attach(0, fd, DriveStats("t"))
    buf = memoryview(bytearray(8192))
    with pytest.raises(UnalignedBuffer):
        eng.submit([IORequest(0, Op.READ, 100, buf[:4096])])
    with pytest.raises(UnalignedBuffer):
        eng.submit([IORequest(0, Op.READ, 0, buf[:1000])])
    eng.close()
    os.close(fd)


def test_prometheus_export(drive_dirs):
    from prometheus_client import generate_latest

    with _open(drive_dirs(2), "threads") as s:
        s.put_many([(b"p%d" % i, b"x" * 4000) for i in range(10)])
        s.get_many([b"p%d" % i for i in range(10)]).release()
        text = generate_latest(s.registry()).decode()
    assert 'kvswarm_drive_ops_total{drive="0:d0",op="read"}' in text
    assert "kvswarm_drive_latency_seconds_bucket" in text


def test_latency_samples_are_folded_without_a_reader():
    st = DriveStats("t")
    for _ in range(FOLD_EVERY + 10):
        st.record(0, 4096, 1e-4)
    assert len(st._pending_lat[0]) < FOLD_EVERY  # memory stays bounded on a long run nobody scrapes
    counts, total = st.histogram(0)
    assert counts.sum() == FOLD_EVERY + 10 and total == pytest.approx((FOLD_EVERY + 10) * 1e-4)


def test_reads_leave_no_reference_cycles(backend, drive_dirs):
    """A batch's requests must be freed by refcounting: cycles made the cyclic GC cost ~20% of a 4 KiB read."""
    import gc

    with _open(drive_dirs(2), backend) as s:
        s.put_many([(b"c%d" % i, b"x" * 4000) for i in range(64)])
        s.get_many([b"c%d" % i for i in range(64)]).release()
        gc.collect()
        gc.disable()
        try:
            gc.set_debug(gc.DEBUG_SAVEALL)
            for _ in range(3):
                s.get_many([b"c%d" % i for i in range(64)]).release()
            s.put_many([(b"c%d" % i, b"y" * 4000) for i in range(8)])
            gc.collect()
            leaked = [o for o in gc.garbage if type(o).__module__.startswith("kvswarm")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert leaked == []


def _digest(k):
    from kvswarm.format import key_digest

    return key_digest(k)


def test_reads_racing_writes_and_deletes_on_another_thread_never_return_wrong_bytes(backend, drive_dirs):
    """The vLLM tier looks up and reads on one thread while its driver writes and evicts on
    another: a racing read may miss, never return another object's or version's bytes."""
    import threading

    keys = [b"race%d" % i for i in range(64)]

    def payload(key: bytes, version: int) -> bytes:
        return (key + b"/v%d/" % version) * (5000 // len(key))

    with _open(drive_dirs(2), backend, stripe_unit=16 * 1024) as s:  # some objects span extents
        s.put_many([(k, payload(k, 0)) for k in keys])
        stop = threading.Event()

        def churn() -> None:
            v = 1
            while not stop.is_set():
                for k in keys[v % 4::4]:
                    s.put(k, payload(k, v))
                s.delete(keys[v % len(keys)])
                s.flush()  # frees the extents of replaced objects: their space gets reused
                v += 1

        t = threading.Thread(target=churn)
        t.start()
        try:
            served = 0
            for _ in range(60):
                with s.get_many(keys) as r:
                    for k, v in zip(keys, r.views):
                        if v is not None:
                            b = bytes(v)
                            assert b.startswith(k + b"/v") and b == payload(k, int(b[len(k) + 2:].split(b"/")[0]))
                            served += 1
            assert served > 0
        finally:
            stop.set()
            t.join()


def test_buffer_pool_populate_faults_the_region_in_and_keeps_contents():
    from kvswarm.buffers import BufferPool

    def rss_kib() -> int:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Rss:"))

    pool = BufferPool(64 << 20)
    with pool.lease(4096) as lease:
        lease.numpy()[:] = 7
        before = rss_kib()
        if not pool.populate(step=3 << 20):  # in steps that do not divide the region: the tail too
            pytest.skip("kernel before 5.14: no MADV_POPULATE_WRITE")
        assert rss_kib() - before >= 60 << 10  # nearly all of the 64 MiB became resident
        assert (lease.numpy() == 7).all()


# ---- races and failures a long-running server meets -------------------------------------------
class _Meddler(DictDigestIndex):  # a dict whose lookups (batched or one at a time) go through get
    """A catalog dict that runs ``act`` once, at its next ``get`` (after the lookup, or before it with
    ``first``): what another thread, or a follower's reload, may do between two steps of a read's
    catalog lookup."""

    def __init__(self, d: dict, act, first: bool = False) -> None:
        super().__init__(d)
        self.act, self.first = act, first

    def get(self, k, default=None):
        if self.first and self.act is not None:
            act, self.act = self.act, None
            act()
        r = super().get(k, default)
        if self.act is not None:
            act, self.act = self.act, None
            act()
        return r


def test_a_row_reused_by_another_key_during_a_lookup_is_a_miss(backend, drive_dirs):
    with _open(drive_dirs(1), backend) as s:
        s.put(b"K", b"K-value" * 100)

        def delete_and_reuse() -> None:  # after the index gave K's row, before the row is read
            s.delete(b"K")
            s.put(b"OTHER", b"other-data" * 70)  # takes K's freed row

        s.catalog._index = _Meddler(s.catalog._index, delete_and_reuse)
        with s.get_many([b"K"]) as r:
            assert r.views == [None] and r.misses == 1  # never OTHER's bytes as K's
        assert s.get(b"OTHER") == b"other-data" * 70


def test_a_multi_extent_object_rewritten_during_a_lookup_is_a_miss_not_a_short_hit(backend, drive_dirs):
    big = _payload(b"M", 256 << 10)
    with _open(drive_dirs(1), backend, stripe_unit=64 << 10) as s:
        s.put(b"M", big)  # five extents
        s.put(b"N", b"n" * 5000)
        # after the row was read as five parts, before its extents are looked up: now one extent
        s.catalog._multi = _Meddler(s.catalog._multi, lambda: s.put(b"M", b"small"), first=True)
        with s.get_many([b"M", b"N"]) as r:
            assert r.views[0] is None and bytes(r.views[1]) == b"n" * 5000
        assert s.get(b"M") == b"small"


def test_verification_jobs_do_not_pile_up_when_callers_only_wait(backend, verifier, drive_dirs):
    with _open(drive_dirs(1), backend) as s:
        s.put(b"a", b"x" * 5000)
        for _ in range(200):
            with s.get_many([b"a"]) as r:
                assert bytes(r.views[0]) == b"x" * 5000
        assert len(s._verifying) <= 1


def test_a_drive_filling_midway_through_an_object_gives_back_its_earlier_extents(backend, drive_dirs):
    with _open(drive_dirs(1), backend, capacity_per_drive=8 * MiB, stripe_unit=MiB) as s:
        free = s.drives[0].alloc.free
        with pytest.raises(DriveFull):
            s.put(b"big", b"y" * (9 * MiB))  # parts 1-7 fit, the ninth does not
        assert s.drives[0].alloc.free == free and s.pool.in_use == 0 and len(s) == 0
        assert s.put(b"fits", b"z" * (6 * MiB)) and s.get(b"fits") == b"z" * (6 * MiB)


def test_a_failed_open_holds_nothing(drive_dirs):
    paths = drive_dirs(1)
    KVStore.open(paths, capacity_per_drive=MiB).close()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="unknown I/O backend"):
        KVStore.open(paths, capacity_per_drive=MiB, backend="bogus")
    assert len(os.listdir("/proc/self/fd")) == fds  # drives, journal and writer lock all closed
    KVStore.open(paths, capacity_per_drive=MiB, backend="threads").close()  # the lock was let go


def test_a_failed_catalog_sync_keeps_the_frees_it_was_to_make_durable(backend, monkeypatch, drive_dirs):
    with _open(drive_dirs(1), backend) as s:
        s.put(b"k", b"a" * 5000)
        s.put(b"k", b"b" * 5000)  # the first version's extent is freed at the next flush
        free = s.drives[0].alloc.free
        sync = s.catalog.sync

        def failing() -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(s.catalog, "sync", failing)
        with pytest.raises(OSError):
            s.flush()
        assert s.drives[0].alloc.free == free  # not freed: the replacement is not durable
        monkeypatch.setattr(s.catalog, "sync", sync)
        s.flush()
        assert s.drives[0].alloc.free > free


def test_a_drive_failing_its_fdatasync_fails_the_flush_once_the_rest_is_done(backend, monkeypatch, fdatasync_fails,
                                                                              drive_dirs):
    """A normal return vouches for every write before the flush: a drive whose fdatasync fails is taken
    out and named by a FlushError, raised only after the other drives, the catalog and the frees made
    durable are done.  The next flush has nothing new to report."""
    paths = drive_dirs(3)
    with _open(paths, backend) as s:
        items = [(b"f%d" % i, _payload(b"f%d" % i, 5000)) for i in range(9)]
        assert all(s.put_many(items))
        s.put(b"f0", b"x" * 5000)  # the first version's extent is freed at the next flush
        free = sum(d.alloc.free for d in s.drives)
        catalog_syncs = []
        sync = s.catalog.sync
        monkeypatch.setattr(s.catalog, "sync", lambda: (catalog_syncs.append(1), sync())[1])
        on_1 = {k for k, _ in items[1:] if s.catalog.get(_digest(k)).extents[0][0] == 1}
        synced = fdatasync_fails(s.drives[1].fd)
        with pytest.raises(FlushError) as e:
            s.flush()
        assert e.value.drives == [1] and paths[1] in str(e.value)
        assert on_1 and not any(k in s for k in on_1)  # not durable: out of the catalog
        assert synced == [d.fd for d in s.drives]  # the drives after the failed one too
        assert catalog_syncs == [1] and sum(d.alloc.free for d in s.drives) > free
        assert [d.healthy for d in s.drives] == [True, False, True]
        s.flush()
        assert all(s.put_many([(b"n%d" % i, b"q" * 100) for i in range(4)]))
        s.flush()  # the failed drive took none of these
        with s.get_many([k for k, _ in items[1:]]) as r:
            for (k, v), got in zip(items[1:], r.views):
                assert (got is None) if k in on_1 else bytes(got) == v


def test_a_drive_failing_after_taking_writes_fails_the_next_flush(backend, drive_dirs):
    """Writes acknowledged on a drive that then fails (an I/O error, or taken out) before a flush were
    never made durable: that flush fails.  A drive that failed holding only flushed writes does not."""
    with _open(drive_dirs(3), backend) as s:
        assert all(s.put_many([(b"a%d" % i, b"a" * 100) for i in range(6)]))
        s.flush()
        s.fail_drive(2)
        s.flush()
        assert all(s.put_many([(b"b%d" % i, b"b" * 100) for i in range(6)]))  # on drives 0 and 1
        s.fail_drive(1)
        with pytest.raises(FlushError) as e:
            s.flush()
        assert e.value.drives == [1]
        s.flush()


def test_a_fdatasync_failing_in_the_flush_a_full_pool_makes_itself_fails_the_next_flush(backend, fdatasync_fails,
                                                                                       drive_dirs):
    """A full pool flushes to reuse the space of deleted objects; a drive failing there does not fail
    the put that needed the room, but the caller's next flush reports it."""
    with _open(drive_dirs(2), backend, capacity_per_drive=5 * 4096) as s:  # 4 extents per drive
        keys = [b"p%d" % i for i in range(8)]
        assert all(s.put_many([(k, b"v" * 100) for k in keys]))
        assert all(d.free_bytes == 0 for d in s.drives)
        for k in keys[:4]:
            s.delete(k)
        fdatasync_fails(s.drives[1].fd)
        assert s.put(b"more", b"w" * 100)
        assert not s.drives[1].healthy
        with pytest.raises(FlushError):
            s.flush()


def test_close_logs_a_failed_flush_and_still_closes(backend, monkeypatch, caplog, fdatasync_fails, drive_dirs):
    paths = drive_dirs(2)
    s = _open(paths, backend)
    assert all(s.put_many([(b"c%d" % i, b"c" * 100) for i in range(4)]))
    on_0 = [b"c%d" % i for i in range(4) if s.catalog.get(_digest(b"c%d" % i)).extents[0][0] == 0]
    fdatasync_fails(s.drives[1].fd)
    s.close()
    assert "fdatasync" in caplog.text
    monkeypatch.undo()
    with _open(paths, backend) as s:  # closed: the writer lock was let go, and the catalog kept (but for
        assert sorted(s.digests()) == sorted(map(_digest, on_0))  # the writes drive 1 did not make durable)


@pytest.mark.parametrize("fails", ["sync", "checkpoint"])
def test_close_closes_everything_when_the_catalog_cannot_be_synced(backend, monkeypatch, fails, drive_dirs):
    """The catalog's journal sync or checkpoint raising (its disk full or failing) reaches the caller, and
    the store still lets go of its drives, journal and writer lock: the next open finds what was journaled."""
    paths = drive_dirs(2)
    fds = len(os.listdir("/proc/self/fd"))
    s = _open(paths, backend)
    assert all(s.put_many([(b"j%d" % i, b"j" * 100) for i in range(4)]))
    s.flush()

    def broken() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(s.catalog, fails, broken)
    with pytest.raises(OSError, match="No space"):
        s.close()
    assert len(os.listdir("/proc/self/fd")) == fds  # drives, journal and writer lock all closed
    s.close()  # closed already: nothing to do
    monkeypatch.undo()
    with _open(paths, backend) as s:  # the writer lock was let go
        assert len(s) == 4 and s.get(b"j3") == b"j" * 100


def test_thread_workers_keep_their_own_handle_on_the_drive(tmp_path):
    """A worker stuck on a failing drive past close() must not later write into whatever file
    reuses the store's fd number: workers hold duplicates of it."""
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"q" * 8192)
    fd = os.open(path, os.O_RDONLY)
    eng = make_engine("threads", 4)
    eng.attach(0, fd, DriveStats(0))
    os.close(fd)  # the owner's fd goes (and its number may be reused): the workers still read the file
    buf = bytearray(4096)
    req = IORequest(0, Op.READ, 4096, memoryview(buf))
    eng.submit([req])
    while not eng.poll(0.1):
        pass
    assert req.result == 4096 and bytes(buf) == b"q" * 4096
    eng.close()


def _fail_once(monkeypatch, obj, name: str, exc: BaseException) -> None:
    """``obj.name`` raises ``exc`` on its first call, then behaves as before."""
    orig, calls = getattr(obj, name), []

    def flaky(*a, **kw):
        if not calls:
            calls.append(1)
            raise exc
        return orig(*a, **kw)

    monkeypatch.setattr(obj, name, flaky)


KEYS8 = [b"k%d" % i for i in range(8)]


def _pool_sized_for_one_batch(paths, backend):
    """A store whose buffer pool holds one batch of KEYS8 (832 KiB of a MiB), stored: a batch that kept its
    lease makes the next one fail."""
    s = _open(paths, backend, buffer_pool_bytes=MiB)
    assert all(s.put_many([(k, _payload(k, 100_000)) for k in KEYS8]))
    return s


def _io_of(s):
    """What a store's reads and writes go through: the native batch ring, or the Python engine."""
    return s.native if s.native is not None else s.engine


def _all_read_back(s) -> bool:
    with s.get_many(KEYS8) as r:
        return all(v is not None and bytes(v) == _payload(k, 100_000) for k, v in zip(KEYS8, r.views))


@pytest.mark.parametrize("stage", ["engine", "verify", "finish"])
def test_a_get_whose_wait_raises_gives_its_buffers_back(backend, monkeypatch, stage, drive_dirs):
    """wait() raising (the engine, the verification pass, the result's assembly) must not cost the pool
    that batch's buffers for good: they go back once none of its reads can still land there."""
    with _pool_sized_for_one_batch(drive_dirs(2), backend) as s:
        io = _io_of(s)
        # On the native path verification runs inside the ring's reaping (poll).
        verify = (store_handles, "check_batch") if s.native is None else (io, "poll")
        obj, name = {"engine": (io, "wait"), "verify": verify, "finish": (s, "_finish_get")}[stage]
        _fail_once(monkeypatch, obj, name, OSError(5, "injected"))
        h = s.submit_get(KEYS8)
        with pytest.raises(OSError, match="injected"):
            h.wait()
        assert s.pool.in_use == 0 and not io.inflight()  # the reads were waited out, then let go
        assert h.done
        with pytest.raises(KVSwarmError, match="failed"):
            h.wait()  # no result from buffers that went back
        assert _all_read_back(s) and s.pool.in_use == 0
        assert s.counters["quarantined"] == 0


def test_a_get_whose_reads_cannot_be_confirmed_back_keeps_its_buffers_until_they_are(backend, monkeypatch, drive_dirs):
    """An engine that cannot say whether a batch's reads are over: its buffers stay out of the pool (a read
    may still land there), counted, until its completions come in."""
    with _pool_sized_for_one_batch(drive_dirs(2), backend) as s:
        broken = [True]
        io = _io_of(s)
        poll, wait = io.poll, io.wait

        def broken_poll(*args, **kw):
            if broken[0]:
                raise OSError(5, "engine broken")
            return poll(*args, **kw)

        def broken_wait(batch):
            if broken[0]:
                raise OSError(5, "engine broken")
            return wait(batch)

        monkeypatch.setattr(io, "poll", broken_poll)
        monkeypatch.setattr(io, "wait", broken_wait)
        h = s.submit_get(KEYS8)
        with pytest.raises(OSError, match="broken"):
            h.wait()
        assert s.pool.in_use > 0 and s.counters["quarantined"] == 1
        del h
        broken[0] = False
        assert _all_read_back(s)  # the pool is short: waits for the quarantined batch, then reuses its buffers
        assert s.pool.in_use == 0


@pytest.mark.parametrize("polled", [False, True])
def test_a_get_dropped_without_wait_gives_its_buffers_back(backend, polled, drive_dirs):
    with _pool_sized_for_one_batch(drive_dirs(2), backend) as s:
        h = s.submit_get(KEYS8)
        while polled and not h.poll():  # its reads are back and verification has started
            s.progress(0.01)
        del h
        assert _all_read_back(s) and s.pool.in_use == 0


def test_a_put_whose_wait_raises_gives_back_its_buffers_and_extents(backend, monkeypatch, drive_dirs):
    with _open(drive_dirs(2), backend, buffer_pool_bytes=MiB) as s:
        items = [(k, _payload(k, 100_000)) for k in KEYS8]
        free = [d.alloc.free for d in s.drives]
        io = _io_of(s)
        _fail_once(monkeypatch, io, "wait", OSError(5, "injected"))
        h = s.submit_put(items)
        with pytest.raises(OSError, match="injected"):
            h.wait()
        assert s.pool.in_use == 0 and not io.inflight() and len(s) == 0
        assert [d.alloc.free for d in s.drives] == free  # nothing was stored: its extents are free again
        assert s.counters["put_failures"] == len(items)
        with pytest.raises(KVSwarmError, match="failed"):
            h.wait()
        assert all(s.put_many(items)) and _all_read_back(s) and s.pool.in_use == 0


def test_a_put_dropped_without_wait_gives_back_its_buffers_and_extents(backend, drive_dirs):
    with _open(drive_dirs(2), backend, buffer_pool_bytes=MiB) as s:
        items = [(k, _payload(k, 100_000)) for k in KEYS8]
        free = sum(d.alloc.free for d in s.drives)
        h = s.submit_put(items)
        del h  # never completed: nothing stored, and its extents must not stay taken
        assert all(s.put_many(items))  # the pool is short: waits for the dropped batch, then reuses its buffers
        assert s.pool.in_use == 0 and _all_read_back(s)
        assert sum(d.alloc.free for d in s.drives) == free - sum(s.object_bytes(100_000) for _ in items)
