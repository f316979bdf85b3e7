"""KVSwarmTierManager through vLLM's secondary-tier interfaces (no engine): round trip,
restart, corruption, failed drive, tenant isolation, jobs larger than the buffer pool, store
errors that fail jobs but not the tier, chunks no lookup meets making room, chunks the eviction policy refuses."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvswarm.drive import DATA_FILE
from kvswarm.format import key_digest, payload_offset
from kvswarm.integrations.vllm.harness import (
    JobRunner,
    Primary,
    keys_for,
    make_tier,
    offloading_spec,
)
from kvswarm.integrations.vllm.tier import MODULE_PATH, TIER_TYPE, auto_queue_depth
from kvswarm.io import uring_available
from kvswarm.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", tokens_per_block=32,
                  model_id="tier-test")  # 64 KiB chunks
CHUNKS = 32


@pytest.fixture
def drives(drive_dirs):
    return drive_dirs(3)


@pytest.fixture
def primary():
    p = Primary.create(CHUNKS, LAYOUT.block_bytes)
    yield p
    p.close()


def tier_config(drives, **kw):
    return {"type": TIER_TYPE, "module_path": MODULE_PATH, "drives": drives, "capacity_per_drive": 16 << 20, **kw}


def open_tier(drives, primary, **kw):
    return make_tier(tier_config(drives, **kw), primary, offloading_spec(LAYOUT, CHUNKS * LAYOUT.block_bytes))


def fill(primary, chunks, seed=0):
    rng = np.random.default_rng(seed)
    data = {c: rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for c in chunks}
    for c, d in data.items():
        primary.chunk(c)[:] = d
    return data


def test_store_lookup_load_round_trip_and_restart(drives, primary):
    keys = keys_for(8)
    data = fill(primary, range(8))
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    assert run.lookup(keys) == [LookupResult.MISS] * 8
    res = run.run(keys, range(8), load=False)
    assert res.success and res.transfer_bytes == 8 * LAYOUT.block_bytes
    assert run.lookup(keys + keys_for(1, salt=9)) == [LookupResult.HIT] * 8 + [LookupResult.MISS]
    assert {i for i, st in enumerate(tier.store.drive_stats) if st.ops[1]} == {0, 1, 2}  # striped over all drives
    tier.shutdown()

    primary.mm[:] = bytes(len(primary.mm))
    tier = open_tier(drives, primary)  # a restarted engine: same drives, new process state
    run = JobRunner(tier)
    assert run.lookup(keys) == [LookupResult.HIT] * 8
    res = run.run(keys, range(16, 24), load=True)
    assert res.success
    for i in range(8):
        assert np.array_equal(primary.chunk(16 + i), data[i])
    assert run.run(keys, range(8), load=False).success  # already stored: nothing rewritten
    assert tier.store.counters["puts"] == 0
    tier.shutdown()


@pytest.mark.parametrize("huge_pages", [True, False])
def test_loads_read_in_place_once_the_region_is_in_huge_pages(drives, huge_pages):
    """The tier backs vLLM's region with 2 MiB pages and then reads loads straight into their chunks,
    no pool buffer leased; with ``huge_pages`` off (or where the kernel refuses) it copies from the pool.
    Either way every chunk comes back as stored, and a corrupt one is a failed key, never a hit."""
    n = 3 * (2 << 20) // LAYOUT.block_bytes  # three huge pages of chunks
    primary = Primary.create(n, LAYOUT.block_bytes)
    try:
        rng = np.random.default_rng(3)
        data = {c: rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for c in range(16)}
        for c, d in data.items():
            primary.chunk(c)[:] = d
        tier = make_tier(tier_config(drives, huge_pages=huge_pages), primary,
                         offloading_spec(LAYOUT, n * LAYOUT.block_bytes))
        run = JobRunner(tier)
        keys = keys_for(16)
        assert run.run(keys, range(16), load=False).success
        assert not tier.region_ready.is_set()  # a tier that has not loaded leaves the region as it is
        assert run.run(keys, range(16, 32), load=True).success  # the first load starts it
        assert tier.region_ready.wait(60)
        if huge_pages and not tier.in_place:
            pytest.skip("this kernel does not collapse shared memory into huge pages (MADV_COLLAPSE)")
        assert tier.in_place == huge_pages
        entry = tier.store.catalog.entries[key_digest(tier.keyspace.key(keys[5]))]
        drv, off, _, _ = entry.extents[0]
        with open(os.path.join(drives[drv], DATA_FILE), "r+b") as f:
            f.seek(off + payload_offset(entry.payload_len) + 99)
            f.write(b"\x55\xaa")
        leased = []  # pool bytes in use once each load batch is submitted
        submit = tier.store.submit_get
        tier.store.submit_get = lambda *a, **kw: (h := submit(*a, **kw), leased.append(tier.store.pool.in_use))[0]
        res = run.run(keys, range(n - 16, n), load=True)
        assert leased and (max(leased) == 0) == huge_pages
        assert set(res.successful_keys) == set(keys) - {keys[5]}
        for i in set(range(16)) - {5}:
            assert np.array_equal(primary.chunk(n - 16 + i), data[i])
        assert tier.store.pool.in_use == 0 and tier.store.counters["corrupt"] == 1
        assert run.lookup([keys[5]]) == [LookupResult.MISS]
        tier.shutdown()
    finally:
        primary.close()


def test_corrupt_extent_is_a_miss_and_forgotten(drives, primary):
    keys = keys_for(6)
    data = fill(primary, range(6))
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    assert run.run(keys, range(6), load=False).success
    entry = tier.store.catalog.entries[key_digest(tier.keyspace.key(keys[2]))]
    drv, off, _, _ = entry.extents[0]
    tier.shutdown()
    with open(os.path.join(drives[drv], DATA_FILE), "r+b") as f:
        f.seek(off + payload_offset(entry.payload_len) + 7)
        f.write(b"\x55\xaa")

    primary.mm[:] = bytes(len(primary.mm))
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    res = run.run(keys, range(10, 16), load=True)
    assert not res.success
    assert set(res.successful_keys) == set(keys) - {keys[2]}
    assert tier.store.counters["corrupt"] == 1
    assert run.lookup([keys[2]]) == [LookupResult.MISS]  # no promotion loop on a bad block
    for i in (0, 1, 3, 4, 5):
        assert np.array_equal(primary.chunk(10 + i), data[i])
    tier.shutdown()


def stored_then_drive_failed(drives, primary):
    """A tier holding 9 chunks striped over the drives, then drive 1 out of service."""
    keys = keys_for(9)
    fill(primary, range(9))
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    assert run.run(keys, range(9), load=False).success
    tier.store.fail_drive(1)
    return tier, run, keys


def test_failed_drive_degrades_to_misses(drives, primary):
    tier, run, keys = stored_then_drive_failed(drives, primary)
    res = run.run(keys, range(16, 25), load=True)
    assert not res.success and 0 < len(res.successful_keys) < 9
    more = keys_for(4, salt=1)
    assert run.run(more, range(4), load=False).success  # writes avoid the failed drive
    assert run.lookup(more) == [LookupResult.HIT] * 4
    tier.shutdown()


def test_chunks_on_a_failed_drive_miss_at_once_without_a_load(drives, primary, fdatasync_fails):
    """A drive failing its fdatasync in the driver's flush: the chunks on it are forgotten before that store
    job is reported, so lookups miss on them with no load scheduled (nor failed) and hit on the others; the
    eviction policy forgets them too, and shrinks to the drives left."""
    keys = keys_for(9)
    fill(primary, range(13))
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    assert run.run(keys, range(9), load=False).success
    on_1 = {k for k in keys if tier.store.catalog.entries[key_digest(tier.keyspace.key(k))].extents[0][0] == 1}
    assert 0 < len(on_1) < 9
    capacity = tier.residency.capacity
    fdatasync_fails(tier.store.drives[1].fd)
    assert not run.run(keys_for(4, salt=1), range(9, 13), load=False).success  # its flush fails drive 1
    assert not tier.store.drives[1].healthy
    assert run.lookup(keys) == [LookupResult.MISS if k in on_1 else LookupResult.HIT for k in keys]
    assert tier.store.counters["gets"] == 0
    assert len(tier.residency.policy) == len(tier.store) and tier.residency.capacity == capacity * 2 // 3
    tier.shutdown()


def test_tenant_and_layout_isolate_keys(drives, primary):
    keys = keys_for(3)
    fill(primary, range(3))
    tier = open_tier(drives, primary, tenant="a")
    run = JobRunner(tier)
    assert run.run(keys, range(3), load=False).success
    tier.shutdown()
    tier = open_tier(drives, primary, tenant="b")
    assert JobRunner(tier).lookup(keys) == [LookupResult.MISS] * 3
    tier.shutdown()
    tier = open_tier(drives, primary, tenant="a", model_id="another-model")
    assert JobRunner(tier).lookup(keys) == [LookupResult.MISS] * 3
    tier.shutdown()


def test_jobs_larger_than_the_buffer_pool_run_in_batches(drives, primary):
    keys = keys_for(CHUNKS)
    data = fill(primary, range(CHUNKS))
    tier = open_tier(drives, primary, buffer_pool_bytes=4 * LAYOUT.block_bytes)
    run = JobRunner(tier)
    assert run.run(keys, range(CHUNKS), load=False).success
    primary.mm[:] = bytes(len(primary.mm))
    assert run.run(keys, list(reversed(range(CHUNKS))), load=True).success
    for i in range(CHUNKS):
        assert np.array_equal(primary.chunk(CHUNKS - 1 - i), data[i])
    tier.shutdown()


def test_a_load_passes_stores_held_in_flight(drives, primary, monkeypatch):
    """Stores whose writes are held (a write-capped drive) neither queue a load behind them (it does not
    count against max_inflight_jobs) nor take the buffer pool it needs (stores lease at most half)."""
    keys = keys_for(CHUNKS)
    data = fill(primary, range(CHUNKS))
    tier = open_tier(drives, primary, buffer_pool_bytes=10 * LAYOUT.block_bytes, max_inflight_jobs=1,
                     huge_pages=False)  # loads copy from the pool, so they need its room
    run = JobRunner(tier)
    assert run.run(keys[:4], range(4), load=False).success
    release = threading.Event()
    submit_put = tier.store.submit_put

    class Held:
        def __init__(self, handle):
            self._handle = handle

        @property
        def done(self) -> bool:
            return release.is_set() and self._handle.done

        def __getattr__(self, name):
            return getattr(self._handle, name)

    monkeypatch.setattr(tier.store, "submit_put", lambda *a, **kw: Held(submit_put(*a, **kw)))
    held = [run.submit(keys[4:16], range(4, 16), load=False), run.submit(keys[16:24], range(16, 24), load=False)]
    primary.mm[:4 * LAYOUT.block_bytes] = bytes(4 * LAYOUT.block_bytes)
    deadline = time.perf_counter() + 10
    while tier.store.room() == tier.store.buffer_bytes and time.perf_counter() < deadline:
        time.sleep(0.001)  # the first store's batches hold their share of the pool
    load = run.submit(keys[:4], range(4), load=True)
    got = run.wait([load], timeout=10)
    assert got[load].success and not set(held) & got.keys()
    for i in range(4):
        assert np.array_equal(primary.chunk(i), data[i])
    release.set()
    assert all(r.success for r in run.wait(held, timeout=10).values())
    assert run.lookup(keys[:24]) == [LookupResult.HIT] * 24
    tier.shutdown()


def test_loads_go_on_while_a_flush_runs(drives, primary, monkeypatch):
    """A flush runs beside the driver: a store waits for it to be reported, a load does not."""
    keys = keys_for(8)
    data = fill(primary, range(8))
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    assert run.run(keys[:4], range(4), load=False).success
    release, flushing = threading.Event(), threading.Event()
    flush = tier.store.flush

    def held_flush():
        flushing.set()
        assert release.wait(10)
        flush()

    monkeypatch.setattr(tier.store, "flush", held_flush)
    store = run.submit(keys[4:], range(4, 8), load=False)
    assert flushing.wait(10)
    primary.mm[:4 * LAYOUT.block_bytes] = bytes(4 * LAYOUT.block_bytes)
    load = run.submit(keys[:4], range(4), load=True)
    got = run.wait([load], timeout=10)
    assert got[load].success and store not in got
    for i in range(4):
        assert np.array_equal(primary.chunk(i), data[i])
    release.set()
    assert run.wait([store], timeout=10)[store].success
    assert tier.load_stats()["flushes"] >= 2
    tier.shutdown()


def test_full_pool_evicts_least_recently_used_chunks(drives, primary):
    per_drive = 4 * (LAYOUT.block_bytes + 4096) + 4096  # room for 4 chunks on each of 3 drives: 12
    data = fill(primary, range(CHUNKS))
    keys = keys_for(CHUNKS)
    tier = open_tier(drives, primary, capacity_per_drive=per_drive)
    assert tier.residency.capacity == 12
    run = JobRunner(tier)
    for i in range(0, 8):  # 8 chunks, one job each
        assert run.run(keys[i:i + 1], [i], load=False).success
    assert run.lookup(keys[:2]) == [LookupResult.HIT] * 2  # 0 and 1 are now the most recent
    for i in range(8, 14):  # 6 more: 14 > 12, so the two least recent (2, 3) go
        assert run.run(keys[i:i + 1], [i], load=False).success
    assert len(tier.store) == 12
    assert run.lookup(keys[:14]) == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2 + [LookupResult.HIT] * 10
    primary.mm[:] = bytes(len(primary.mm))
    assert run.run(keys[:2] + keys[4:14], list(range(12)), load=True).success
    for slot, i in enumerate([0, 1] + list(range(4, 14))):
        assert np.array_equal(primary.chunk(slot), data[i])
    tier.shutdown()

    tier = open_tier(drives, primary, capacity_per_drive=per_drive)  # restart: 12 chunks of unknown keys
    run = JobRunner(tier)
    assert tier.residency.unknown == 12
    assert run.lookup(keys[4:8]) == [LookupResult.HIT] * 4  # adopted: the policy's now
    fill(primary, range(14, 18), seed=1)
    assert run.run(keys[14:18], range(14, 18), load=False).success
    # Chunks no lookup has met since the restart are the coldest: four of them went, not 4-7.
    assert run.lookup(keys[4:8] + keys[14:18]) == [LookupResult.HIT] * 8
    older = run.lookup(keys[:2] + keys[8:14])
    assert older.count(LookupResult.MISS) == 4 and len(tier.store) == 12
    tier.shutdown()


def test_default_depth_is_about_96_mib_of_chunks_per_drive(drives, primary):
    """Large chunks run shallower than small ones (a deep queue of 2 MiB reads comes back in bursts)."""
    assert auto_queue_depth(2 << 20) == 47 and auto_queue_depth(256 << 10) == 128
    assert auto_queue_depth(64 << 20) == 8 and auto_queue_depth(4096) == 128
    tier = open_tier(drives, primary)
    assert tier.store.engine.queue_depth == auto_queue_depth(LAYOUT.block_bytes) == 128
    assert tier.store.engine.name == ("uring" if uring_available() else "threads")  # backend "auto"
    tier.shutdown()
    tier = open_tier(drives, primary, queue_depth=7)
    assert tier.store.engine.queue_depth == 7
    tier.shutdown()


def test_follower_reads_a_live_writers_chunks_and_stores_nothing(drives):
    """A decode engine's tier following a prefill engine's store on the same drives: it finds and
    loads the writer's chunks as the writer flushes them, and its own store jobs store nothing."""
    a, b = Primary.create(CHUNKS, LAYOUT.block_bytes), Primary.create(CHUNKS, LAYOUT.block_bytes)
    try:
        data = fill(a, range(16))
        writer = open_tier(drives, a)
        follower = open_tier(drives, b, follow=True, refresh_interval=0.01)
        w, f = JobRunner(writer), JobRunner(follower)
        keys = keys_for(16)
        assert f.lookup(keys) == [LookupResult.MISS] * 16
        assert w.run(keys[:8], range(8), load=False).success  # reported once durable
        deadline = time.monotonic() + 5
        while f.lookup(keys[:8]) != [LookupResult.HIT] * 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f.lookup(keys) == [LookupResult.HIT] * 8 + [LookupResult.MISS] * 8
        assert f.run(keys[:8], range(8, 16), load=True).success
        assert all(np.array_equal(b.chunk(8 + i), data[i]) for i in range(8))
        fill(b, range(8, 16), seed=3)
        assert not f.run(keys[8:], range(8, 16), load=False).success  # the writer's store: not written
        assert len(writer.store) == 8 and follower.store.counters["puts"] == 0
        assert w.run(keys[8:], range(8, 16), load=False).success
        deadline = time.monotonic() + 5
        while f.lookup(keys[8:]) != [LookupResult.HIT] * 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f.run(keys[8:], range(16, 24), load=True).success
        assert all(np.array_equal(b.chunk(16 + i), data[8 + i]) for i in range(8))
        follower.shutdown()
        writer.shutdown()
    finally:
        a.close()
        b.close()


def test_many_jobs_on_a_small_pool_all_succeed(drives):
    """Jobs in flight together lease and release pool runs out of order, so the pool's free bytes
    can lie in runs that are each too short for the next batch: it waits for one long enough
    rather than failing its chunks."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", tokens_per_block=128,
                      model_id="tier-test-256k")  # 256 KiB chunks: an extent is barely bigger than its chunk
    n, bs = 256, layout.block_bytes
    primary = Primary.create(n, bs)
    try:
        rng = np.random.default_rng(3)
        data = [rng.integers(0, 256, bs, dtype=np.uint8) for _ in range(n)]
        for i, d in enumerate(data):
            primary.chunk(i)[:] = d
        keys = keys_for(n)
        tier = make_tier(tier_config(drives[:1], capacity_per_drive=128 << 20, buffer_pool_bytes=8 << 20),
                         primary, offloading_spec(layout, n * bs))
        try:
            run = JobRunner(tier)
            jobs = [list(range(i, i + 16)) for i in range(0, n, 16)]
            for load in (False, True):
                if load:
                    primary.mm[:] = bytes(len(primary.mm))
                ids = [run.submit([keys[i] for i in c], c, load=load) for c in jobs]
                assert all(r.success for r in run.wait(ids).values())
            for i in range(n):
                assert np.array_equal(primary.chunk(i), data[i])
        finally:
            tier.shutdown()
    finally:
        primary.close()


def fail_once(monkeypatch, obj, name: str, exc: Exception) -> list[int]:
    """Make ``obj.name`` raise ``exc`` on its first call only; returns a one-item call counter."""
    real, calls = getattr(obj, name), [0]

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] == 1:
            raise type(exc)(*exc.args)  # a fresh one: a raised exception keeps the failed frames
        return real(*a, **kw)

    monkeypatch.setattr(obj, name, flaky)
    return calls


def run_within(run: JobRunner, keys, chunks, load: bool, timeout: float = 10.0):
    """``run.run`` that fails rather than hangs when the tier's driver thread is gone."""
    job = run.submit(keys, chunks, load)
    return run.wait([job], timeout)[job]


def drained(tier, timeout: float = 10.0) -> bool:
    """drain_jobs returned within ``timeout`` (it blocks forever once the driver thread is gone)."""
    t = threading.Thread(target=tier.drain_jobs, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def test_a_failing_catalog_write_fails_its_store_job_not_the_tier(drives, primary, monkeypatch):
    """The journal's disk full (ENOSPC) as the catalog records a batch of new blocks (one call,
    ``put_new_singles``): that store job fails, and the driver thread goes on."""
    keys = keys_for(8)
    fill(primary, range(8))
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    calls = fail_once(monkeypatch, tier.store.catalog, "put_new_singles", OSError(errno.ENOSPC, "No space left on device"))
    res = run_within(run, keys[:4], range(4), load=False)
    assert calls[0] == 1 and not res.success
    assert run_within(run, keys[4:], range(4, 8), load=False).success
    assert drained(tier)
    assert run.lookup(keys[4:]) == [LookupResult.HIT] * 4
    assert run.run(keys[:4], range(4), load=False).success  # retried once the journal has room
    tier.shutdown()


def test_a_failing_delete_during_a_load_reports_the_verified_chunks(drives, primary, monkeypatch):
    tier, run, keys = stored_then_drive_failed(drives, primary)
    healthy = {k for k in keys
               if tier.store.catalog.entries[key_digest(tier.keyspace.key(k))].extents[0][0] != 1}
    assert 0 < len(healthy) < 9
    fail_once(monkeypatch, tier.store, "delete", OSError(errno.EIO, "Input/output error"))
    # pytest keeps log records, whose tracebacks would keep this load's views of the primary region
    # alive past the test (the region then cannot be unmapped): the error goes to stderr instead.
    monkeypatch.setattr(logging.getLogger("kvswarm.integrations.vllm.tier"), "propagate", False)
    res = run_within(run, keys, range(16, 25), load=True)
    assert not res.success and set(res.successful_keys) == healthy
    assert drained(tier)
    more = keys_for(4, salt=1)
    assert run_within(run, more, range(4), load=False).success  # later jobs still run
    tier.shutdown()


def _fail_catalog_sync(tier, monkeypatch, fdatasync_fails) -> Callable[[], bool]:
    fail_once(monkeypatch, tier.store.catalog, "sync", OSError(errno.EIO, "Input/output error"))
    return lambda: True


def _fail_a_drives_fdatasync(tier, monkeypatch, fdatasync_fails) -> Callable[[], bool]:
    fdatasync_fails(tier.store.drives[1].fd)
    return lambda: not tier.store.drives[1].healthy  # taken out of service; later stores avoid it


@pytest.mark.parametrize("inject", [_fail_catalog_sync, _fail_a_drives_fdatasync],
                         ids=["catalog sync", "a drive's fdatasync"])
def test_a_failing_flush_reports_its_stores_not_stored(drive_dirs, primary, monkeypatch, fdatasync_fails, inject):
    """Stores are reported once durable: a flush that fails fails them, and emits no 'stored' event for
    them; later stores are stored."""
    spec = offloading_spec(LAYOUT, CHUNKS * LAYOUT.block_bytes)
    spec = TieringOffloadingSpec(dataclasses.replace(spec.config, enable_kv_cache_events=True))
    tier = make_tier(tier_config(drive_dirs(3), enable_kv_events=True), primary, spec)
    keys = keys_for(8)
    fill(primary, range(8))
    run = JobRunner(tier)
    injected = inject(tier, monkeypatch, fdatasync_fails)
    assert not run_within(run, keys[:4], range(4), load=False).success
    assert list(tier.take_events()) == [] and injected()
    assert run_within(run, keys[4:], range(4, 8), load=False).success
    assert [(e.keys, e.removed) for e in tier.take_events()] == [(keys[4:], False)]
    tier.shutdown()


def test_chunks_nobody_looks_up_make_room_for_this_engines(drives, primary):
    """Drives filled by another tenant (or model), whose keys this tier never looks up: they are
    evicted for this engine's chunks rather than holding the pool for good."""
    per_drive = 4 * (LAYOUT.block_bytes + 4096) + 4096  # 12 chunks over 3 drives
    fill(primary, range(16))
    keys = keys_for(16)
    tier = open_tier(drives, primary, capacity_per_drive=per_drive, tenant="a")
    assert JobRunner(tier).run(keys[:12], range(12), load=False).success
    tier.shutdown()
    tier = open_tier(drives, primary, capacity_per_drive=per_drive, tenant="b")
    assert tier.residency.unknown == 12
    run = JobRunner(tier)
    res = run.run(keys[12:], range(12, 16), load=False)
    assert res.success and res.transfer_bytes == 4 * LAYOUT.block_bytes
    assert run.lookup(keys[12:]) == [LookupResult.HIT] * 4
    assert len(tier.store) == 12 and tier.residency.unknown == 8
    tier.shutdown()
    tier = open_tier(drives, primary, capacity_per_drive=per_drive, tenant="a")
    assert JobRunner(tier).lookup(keys[:12]).count(LookupResult.HIT) == 8
    tier.shutdown()


def test_a_pool_too_small_for_a_chunk_reports_stores_not_stored(drives, primary):
    """What the eviction policy has no room for is not stored, and the store job says so (vLLM must
    not count on this tier for it)."""
    fill(primary, range(4))
    keys = keys_for(4)
    tier = open_tier(drives, primary, capacity_per_drive=LAYOUT.block_bytes // 2)
    assert tier.residency.capacity == 0
    run = JobRunner(tier)
    res = run.run(keys, range(4), load=False)
    assert not res.success and res.transfer_bytes == 0
    assert run.lookup(keys) == [LookupResult.MISS] * 4
    tier.shutdown()


def test_a_drive_unreadable_at_open_leaves_the_tier_serving_the_others(drives, primary):
    """The restarted tier finds drive 2's superblock damaged: it opens on the other drives (the store
    says which drive and why), misses on the chunks that were there, and serves the rest exactly."""
    keys = keys_for(9)
    data = fill(primary, range(9))
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    assert run.run(keys, range(9), load=False).success
    on_2 = {k for k in keys if tier.store.catalog.entries[key_digest(tier.keyspace.key(k))].extents[0][0] == 2}
    assert 0 < len(on_2) < 9
    tier.shutdown()
    with open(os.path.join(drives[2], DATA_FILE), "r+b") as f:
        f.write(b"XXXX")  # the superblock's magic
    tier = open_tier(drives, primary)
    run = JobRunner(tier)
    health = tier.store.health()
    assert [h.healthy for h in health] == [True, True, False] and "superblock" in health[2].reason
    assert run.lookup(keys) == [LookupResult.MISS if k in on_2 else LookupResult.HIT for k in keys]
    hits = [i for i, k in enumerate(keys) if k not in on_2]
    assert run.run([keys[i] for i in hits], range(16, 16 + len(hits)), load=True).success
    for j, i in enumerate(hits):
        assert np.array_equal(primary.chunk(16 + j), data[i])
    more = keys_for(3, salt=2)
    fill(primary, range(25, 28), seed=5)
    assert run.run(more, range(25, 28), load=False).success  # writes go to the readable drives
    tier.shutdown()


def test_deadline_policy_recomputes_blocks_that_would_arrive_too_late(drives, primary):
    """With a prefill rate far above what the drives deliver, every block found after the first
    measured load is answered MISS (recomputed) and counted; the default policy loads them all."""
    keys = keys_for(8)
    fill(primary, range(8))
    tier = open_tier(drives, primary, load_policy="deadline", recompute_tokens_per_s=1e12)
    tier.load_policy.probe_interval_s = 1e9  # no probe of the estimate: every late block is declined
    run = JobRunner(tier)
    assert run.run(keys, range(8), load=False).success
    assert run.lookup(keys) == [LookupResult.HIT] * 8  # no load measured yet: loaded
    assert run.run(keys, range(8), load=True).success
    assert tier.load_policy.bytes_per_s > 0
    assert run.lookup(keys) == [LookupResult.MISS] * 8  # recomputing 32 tokens takes ~0 s here
    stats = tier.load_stats()
    assert stats["deadline_recomputes"] == 8 and stats["lookup_hits"] == 8 and stats["deadline_probes"] == 0
    assert stats["load_bytes_submitted"] == 8 * LAYOUT.block_bytes
    tier.shutdown()
    tier = open_tier(drives, primary)  # "always", the default
    run = JobRunner(tier)
    assert run.lookup(keys) == [LookupResult.HIT] * 8
    assert tier.load_stats()["deadline_recomputes"] == 0
    tier.shutdown()


def test_deadline_policy_needs_a_prefill_rate(drives, primary):
    with pytest.raises(ValueError, match="recompute_tokens_per_s"):
        open_tier(drives, primary, load_policy="deadline")
