"""What the layers above read of a store (its public views), on real files with O_DIRECT: where
objects are, oldest first, drive health, buffer room and batch sizes, capacity, and an I/O engine
wrapped through the config."""

from __future__ import annotations

import pytest

from kvswarm.buffers import BufferPoolExhausted
from kvswarm.catalog import Extent
from kvswarm.format import HEADER_SIZE, key_digest
from kvswarm.io.throttle import DriveCaps, DrivePacer, ThrottledEngine
from kvswarm.store import KVStore, BatchShape

MiB = 1 << 20


def _open(paths, **kw) -> KVStore:
    kw.setdefault("capacity_per_drive", 8 * MiB)
    kw.setdefault("buffer_pool_bytes", 4 * MiB)
    return KVStore.open(paths, **kw)


def test_locate_names_each_extent_and_entries_come_oldest_first(drive_dirs):
    with _open(drive_dirs(3), stripe_unit=64 * 1024) as s:
        keys = [b"a", b"b", b"c"]
        for k, n in zip(keys, (100, 200 * 1024, 5000)):  # b spans several extents
            assert s.put(k, bytes([k[0]]) * n)
        assert s.put(b"a", b"x" * 300)  # rewritten: now the newest
        a, b, c, missing = s.locate(keys + [b"absent"])
        assert missing is None and a.payload_len == 300 and b.payload_len == 200 * 1024
        assert len(b.extents) == 4 and all(isinstance(x, Extent) for x in b.extents)
        assert {x.drive for x in b.extents} == {0, 1, 2}  # striped
        assert all(x.length % 4096 == 0 and x.length >= HEADER_SIZE for x in a.extents + b.extents + c.extents)
        assert s.locate_digests([key_digest(b"b")]) == [b]
        assert [d for d, _ in s.entries_oldest_first()] == [key_digest(k) for k in (b"b", b"c", b"a")]
        assert key_digest(b"c") in s.digest_view() and s.generation > a.generation
        assert set(s.written_before(a.generation)) == {key_digest(b"b"), key_digest(b"c")}


def test_drive_health_counts_only_fall(drive_dirs):
    with _open(drive_dirs(3)) as s:
        assert s.num_drives == 3 and s.drive_health() == (True, True, True) and s.failed_drives() == frozenset()
        whole = s.capacity_objects(4000)
        s.fail_drive(1)
        assert s.drive_health() == (True, False, True) and s.failed_drives() == {1} and sum(s.drive_health()) == 2
        assert s.capacity_objects(4000) == whole * 2 // 3  # the failed drive's space is gone


def test_capacity_objects_counts_whole_objects(drive_dirs):
    with _open(drive_dirs(2), stripe_unit=1 * MiB) as s:
        per = s.object_bytes(100_000)
        usable = s.stats()["drives"][0]["capacity"] - s.stats()["drives"][0]["capacity"] % per  # upper bound
        n = s.capacity_objects(100_000)
        assert 0 < n <= 2 * usable // per
        for i in range(0, n, 16):  # every one of them fits
            assert all(s.put_many([(b"k%d" % j, b"\0" * 100_000) for j in range(i, min(n, i + 16))]))


def test_batch_len_follows_the_buffer_pools_room(drive_dirs):
    with _open(drive_dirs(1), buffer_pool_bytes=1 * MiB) as s:
        payload = 64 * 1024 - HEADER_SIZE
        per = s.object_bytes(payload)
        assert per == 64 * 1024 and s.buffer_bytes == 1 * MiB and s.room() == 1 * MiB
        assert s.batch_len(100, per) == 16 and s.batch_len(3, per) == 3
        assert s.batch_len(100, per, max_bytes=4 * per) == 4
        assert s.batch_len(100, per, max_bytes=per // 2) == 1  # at least one while one fits
        assert s.batch_len(7, 0) == 7  # object size unknown: all of them
        handle = s.submit_put([(b"k%d" % i, b"\0" * payload) for i in range(15)])  # 15 of 16 leases held
        assert s.room() == per and s.batch_len(100, per) == 1
        with pytest.raises(BufferPoolExhausted):
            s.submit_put([(b"x", b"\0" * payload), (b"y", b"\0" * payload)])
        assert all(handle.wait())
        assert s.batch_len(100, per) == 16 and s.warm_buffers() in (True, False)


def test_poll_reaps_for_handles_in_flight(drive_dirs):
    with _open(drive_dirs(2)) as s:
        assert s.put_many([(b"k%d" % i, b"v" * 8192) for i in range(8)])
        h = s.submit_get([b"k%d" % i for i in range(8)])
        while not h.done:
            s.poll(0.01)
        with h.wait() as r:
            assert r.misses == 0 and all(bytes(v) == b"v" * 8192 for v in r.views)


def test_wrap_engine_paces_every_io_of_the_store(drive_dirs):
    wrapped = []

    def pace(engine):
        wrapped.append(ThrottledEngine(engine, {0: DrivePacer(DriveCaps(write_iops=50))}))
        return wrapped[-1]

    with _open(drive_dirs(2), wrap_engine=pace) as s:
        assert len(wrapped) == 1
        assert s.put_many([(b"k%d" % i, b"v" * 4096) for i in range(10)])  # 5 writes on drive 0, paced
        assert wrapped[0].inner.stats[0].ops[1] == 5  # drives attached through the wrapper
        with s.get_many([b"k%d" % i for i in range(10)]) as r:
            assert r.misses == 0


def test_read_shape_keeps_every_drive_busy_within_the_pool(drive_dirs):
    """The store picks its own read batches: four times every healthy drive's depth outstanding in at
    least four batches, batches of 4-256 keys and at most 4 MiB, all of them within half the buffer pool."""
    with _open(drive_dirs(4), queue_depth=32, buffer_pool_bytes=64 << 20) as s:
        for size in (4096, 16384, 65536, 1 << 20):
            sh = s.read_shape(s.object_bytes(size - 64))
            assert 4 <= sh.keys <= 256 and sh.keys * size <= max(4 << 20, 4 * size)
            assert sh.keys * sh.inflight * size <= 32 << 20
            assert sh.keys * sh.inflight >= 4 * 4 * 32 or (sh.inflight + 1) * sh.keys * size > 32 << 20
            assert sh.inflight >= 4 or (sh.inflight + 1) * sh.keys * size > 32 << 20
        assert s.read_shape(s.object_bytes(65472)) == BatchShape(64, 8)
        s.fail_drive(0)
        assert s.read_shape(s.object_bytes(65472)) == BatchShape(64, 6)  # three drives to keep busy
        assert s.read_shape(4 << 20) == BatchShape(4, 2)  # four extents each: the pool bounds it


def test_write_shape_covers_the_drives_depth_within_the_pool(drive_dirs):
    """Put batches of up to 8 MiB and 2048 keys; small objects take four of them, large ones enough
    to fill every drive's depth once, all within half the buffer pool."""
    with _open(drive_dirs(4), queue_depth=32, buffer_pool_bytes=256 << 20) as s:
        for size in (4096, 16384, 65536, 1 << 20):
            sh = s.write_shape(s.object_bytes(size - 64))
            assert sh.keys == min(2048, (8 << 20) // size) and sh.keys * sh.inflight * size <= 128 << 20
        assert s.write_shape(s.object_bytes(4032)) == BatchShape(2048, 4)
        assert s.write_shape(s.object_bytes((1 << 20) - 64)) == BatchShape(8, 16)  # 4 drives x 32 extents
        s.fail_drive(0)
        assert s.write_shape(s.object_bytes((1 << 20) - 64)) == BatchShape(8, 12)  # three drives to fill
    with _open(drive_dirs(4), queue_depth=64, buffer_pool_bytes=256 << 20) as s:
        assert s.write_shape(s.object_bytes((1 << 20) - 64)) == BatchShape(8, 16)  # the pool's half bounds it
