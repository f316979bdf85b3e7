"""kvswarm under LMCache 0.5.6's own StorageManager: loaded by its plugin launcher from configuration,
below its CPU back end, storing and retrieving chunks keyed by its token database."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from lmcache.v1.event_manager import EventManager
from lmcache.v1.pin_monitor import PinMonitor
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
from lmcache.v1.storage_backend.storage_manager import StorageManager

from kvswarm.drive import DATA_FILE
from kvswarm.errors import KVSwarmError
from kvswarm.integrations.lmcache import KVSwarmLMCacheBackend
from kvswarm.integrations.lmcache.backend import store_dir
from kvswarm.integrations.lmcache.harness import (
    SMOLLM2,
    allocate_chunk,
    chunk_bytes,
    chunk_keys,
    kvswarm_config,
    metadata,
    obj_bytes,
    text_tokens,
)

CHUNK = 32  # tokens per chunk: SmolLM2's geometry at 32 tokens, 368,640 B a chunk
HERE = os.path.dirname(os.path.abspath(__file__))


def open_manager(drives, **plugin):
    plugin.setdefault("capacity_per_drive", 64 << 20)
    plugin.setdefault("buffer_pool_bytes", 8 << 20)
    cfg = kvswarm_config(drives, chunk_size=CHUNK, cpu_gb=0.1, **plugin)
    meta = metadata(SMOLLM2, chunk_size=CHUNK)
    PinMonitor.GetOrCreate(cfg)  # as LMCache's cache engine makes it, before any memory object is pinned
    sm = StorageManager(cfg, meta, EventManager())
    assert list(sm.storage_backends) == ["LocalCPUBackend", "kvswarm"]  # the launcher built it, in its place
    return sm, cfg, meta


def store(sm, keys, meta, first: int = 0) -> list:
    """Put chunks through the storage manager (as the cache engine's store does) and wait until kvswarm
    reports each stored (its completion callback runs after the flush)."""
    done = threading.Semaphore(0)
    plugin = sm.storage_backends["kvswarm"]
    objs = [allocate_chunk(sm, meta, chunk_bytes(first + i, SMOLLM2.chunk_bytes(CHUNK))) for i in range(len(keys))]
    futures = plugin.batched_submit_put_task(keys, objs, on_complete_callback=lambda k: done.release())
    for o in objs:
        o.ref_count_down()
    assert all(all(f.result(timeout=30)) for f in futures)
    for _ in keys:
        assert done.acquire(timeout=30)
    return objs


def retrieve(sm, keys):
    """What LMCache's cache engine does to retrieve: a block mapping by prefix over its back ends, then
    a batched get from each location."""
    mapping = sm.get_block_mapping([(k, i * CHUNK, (i + 1) * CHUNK) for i, k in enumerate(keys)])
    got = {}
    for location, blocks in mapping.items():
        ks = [k for k, _, _ in blocks]
        for k, obj in zip(ks, sm.batched_get(ks, location=location)):
            got[k] = (location, obj)
    return got


def test_the_plugin_is_lmcaches_interface_in_full():
    assert issubclass(KVSwarmLMCacheBackend, StoragePluginInterface)
    assert not KVSwarmLMCacheBackend.__abstractmethods__
    for name in ("batched_async_contains", "batched_get_non_blocking", "get_non_blocking", "touch_cache",
                 "async_batched_submit_put_task", "batched_contains", "batched_get_blocking"):
        assert getattr(KVSwarmLMCacheBackend, name) is not getattr(StoragePluginInterface, name), name


def test_store_and_retrieve_through_the_storage_manager(drives):
    sm, cfg, meta = open_manager(drives)
    keys = chunk_keys(cfg, meta, text_tokens(6 * CHUNK))
    assert len(keys) == 6
    plugin = sm.storage_backends["kvswarm"]
    objs = [allocate_chunk(sm, meta, chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK))) for i in range(6)]
    sm.batched_put(keys, objs)  # the cache engine's store: CPU tier and kvswarm
    deadline = time.monotonic() + 30
    while any(plugin.exists_in_put_tasks(k) for k in keys):  # until written and flushed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert plugin.batched_contains(keys) == 6
    assert sm.batched_contains(keys)[0] == 6
    sm.batched_remove(keys, locations=["LocalCPUBackend"])  # gone from DRAM: kvswarm serves them
    got = retrieve(sm, keys)
    assert {loc for loc, _ in got.values()} == {"kvswarm"}
    for i, k in enumerate(keys):
        obj = got[k][1]
        assert tuple(obj.get_shape()) == tuple(meta.get_shapes(CHUNK)[0])
        assert np.array_equal(obj_bytes(obj), chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK)))
    # LMCache wrote what it got from kvswarm back to its CPU tier: the next lookup is served from DRAM.
    assert list(sm.get_block_mapping([(k, 0, CHUNK) for k in keys])) == ["LocalCPUBackend"]
    stripes = [len(os.listdir(os.path.join(d, store_dir(meta)))) for d in drives]
    assert all(stripes)  # every drive holds a store part
    assert plugin.store.stats()["counters"]["hits"] == 6
    sm.close()


def test_async_prefetch_pins_and_partial_chunks(drives):
    sm, cfg, meta = open_manager(drives)
    plugin = sm.storage_backends["kvswarm"]
    tokens = text_tokens(3 * CHUNK + 10, seed=3)
    keys = chunk_keys(cfg, meta, tokens)
    store(sm, keys, meta)
    # A last partial chunk (LMCache stores one with save_unfull_chunk): 10 tokens, found again as 10.
    part_key = keys[0].__class__(keys[0].model_name, 1, 0, 12345, keys[0].dtype)
    obj = allocate_chunk(sm, meta, chunk_bytes(99, SMOLLM2.chunk_bytes(10)), tokens=10)
    assert all(plugin.batched_submit_put_task([part_key], [obj])[0].result(timeout=30))
    obj.ref_count_down()
    got = plugin.get_blocking(part_key)
    assert got.get_shape()[2] == 10 and np.array_equal(obj_bytes(got), chunk_bytes(99, SMOLLM2.chunk_bytes(10)))
    got.ref_count_down()

    import asyncio

    async def prefetch():
        n = await plugin.batched_async_contains("req", keys, pin=True)
        return n, await plugin.batched_get_non_blocking("req", keys[:n])

    n, objs = asyncio.run_coroutine_threadsafe(prefetch(), sm.loop).result(timeout=30)
    assert n == 3 and len(objs) == 3
    for i, o in enumerate(objs):
        assert np.array_equal(obj_bytes(o), chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK)))
        o.unpin()
        o.ref_count_down()
    assert plugin.get_non_blocking(keys[1]).result(timeout=30) is not None
    assert plugin.pin(keys[0]) and not plugin.remove(keys[0], force=False)  # pinned: kept
    assert plugin.unpin(keys[0]) and plugin.remove(keys[0], force=False)
    assert plugin.batched_contains(keys) == 0 and plugin.batched_contains(keys[1:]) == 2
    assert plugin.get_blocking(keys[0]) is None
    sm.close()


def _find(drives, meta, data: np.ndarray) -> tuple[str, int]:
    """Where a chunk's bytes lie on the drives (a distinctive run of them), found by scanning the data files."""
    probe = data[4096:4096 + 256].tobytes()
    for d in drives:
        path = os.path.join(d, store_dir(meta), DATA_FILE)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            at = m.find(probe)
            if at >= 0:
                return os.path.join(d, store_dir(meta)), at
    raise AssertionError("chunk not found on any drive")


def test_corrupt_chunk_is_a_miss_and_dropped(drives, overwrite):
    sm, cfg, meta = open_manager(drives)
    keys = chunk_keys(cfg, meta, text_tokens(4 * CHUNK, seed=5))
    store(sm, keys, meta)
    sm.close()
    drive, at = _find(drives, meta, chunk_bytes(2, SMOLLM2.chunk_bytes(CHUNK)))
    overwrite(drive, at, b"\xde\xad\xbe\xef")  # bit rot in chunk 2's payload
    sm, cfg, meta = open_manager(drives)
    plugin = sm.storage_backends["kvswarm"]
    assert plugin.batched_contains(keys) == 4  # the catalog still lists it: only the read can tell
    got = sm.batched_get(keys, location="kvswarm")
    assert got[2] is None  # a miss, never the corrupt bytes
    for i in (0, 1, 3):
        assert np.array_equal(obj_bytes(got[i]), chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK)))
    assert plugin.store.stats()["counters"]["corrupt"] == 1
    assert plugin.batched_contains(keys) == 2  # dropped: LMCache recomputes it and stores it again
    store(sm, keys[2:3], meta, first=2)
    assert np.array_equal(obj_bytes(plugin.get_blocking(keys[2])), chunk_bytes(2, SMOLLM2.chunk_bytes(CHUNK)))
    sm.close()


def _child(drives, *args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    p = subprocess.run([sys.executable, os.path.join(HERE, "restart_child.py"), json.dumps(drives), str(CHUNK),
                        *args], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_restarted_process_hits_what_a_killed_one_stored(drives):
    """One process stores through LMCache, hears each chunk stored and is killed (os._exit: no close, no
    checkpoint); a fresh process finds every chunk in kvswarm and reads the same bytes back."""
    wrote = _child(drives, "store", "8")
    assert wrote["stored"] == 8
    read = _child(drives, "read", "8")
    assert read["contains"] == 8 and read["hits"] == 8 and read["wrong"] == 0
    assert read["seconds_to_hit"] < 30


def test_a_failed_drive_degrades_to_misses(drives):
    sm, cfg, meta = open_manager(drives)
    plugin = sm.storage_backends["kvswarm"]
    keys = chunk_keys(cfg, meta, text_tokens(9 * CHUNK, seed=7))
    store(sm, keys, meta)
    # Drive 2 loses its data (its file cut to nothing): every read there fails, and is a miss.
    os.truncate(os.path.join(drives[2], store_dir(meta), DATA_FILE), 0)
    got = plugin.batched_get_blocking(keys)
    lost = [g is None for g in got]
    assert any(lost) and not all(lost)
    for i, g in enumerate(got):
        if g is not None:
            assert np.array_equal(obj_bytes(g), chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK)))
            g.ref_count_down()
    assert [plugin.contains(k) for k in keys] == [not x for x in lost]  # failed reads dropped them
    # Drive 1 taken out of service: its chunks stop being found at the next lookup, nothing raises.
    plugin.store.fail_drive(1)
    n = plugin.batched_contains(keys)
    assert n < len(keys)
    assert all(g is None or np.array_equal(obj_bytes(g), chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK)))
               for i, g in enumerate(plugin.batched_get_blocking(keys)))
    new = chunk_keys(cfg, meta, text_tokens(3 * CHUNK, seed=8))
    store(sm, new, meta, first=100)  # stores go on, to the healthy drive
    assert plugin.batched_contains(new) == 3
    sm.close()


def test_chunks_a_failed_flush_left_not_durable_fail_and_are_dropped(drives, monkeypatch):
    sm, cfg, meta = open_manager(drives)
    plugin = sm.storage_backends["kvswarm"]
    kept = chunk_keys(cfg, meta, text_tokens(2 * CHUNK, seed=10))
    store(sm, kept, meta)

    def sync_fails() -> None:
        raise KVSwarmError("catalog sync failed")

    monkeypatch.setattr(plugin.store, "flush", sync_fails)
    lost = chunk_keys(cfg, meta, text_tokens(3 * CHUNK, seed=11))
    objs = [allocate_chunk(sm, meta, chunk_bytes(50 + i, SMOLLM2.chunk_bytes(CHUNK))) for i in range(len(lost))]
    futures = plugin.batched_submit_put_task(lost, objs)
    for o in objs:
        o.ref_count_down()
    assert [r for f in futures for r in f.result(timeout=30)] == [False] * len(lost)
    assert [plugin.contains(k) for k in lost] == [False] * len(lost)  # deleted, as one batch
    assert plugin.batched_contains(kept) == len(kept)  # what an earlier flush made durable stays
    monkeypatch.undo()
    sm.close()


def test_close_returns_within_its_bound_when_the_drives_hang(drives, monkeypatch):
    sm, cfg, meta = open_manager(drives, close_timeout=2.0)
    plugin = sm.storage_backends["kvswarm"]
    keys = chunk_keys(cfg, meta, text_tokens(4 * CHUNK, seed=9))
    release = threading.Event()
    monkeypatch.setattr(plugin.store, "flush", lambda: release.wait(60))  # a drive that never answers its sync
    objs = [allocate_chunk(sm, meta, chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK))) for i in range(4)]
    futures = plugin.batched_submit_put_task(keys[:2], objs[:2])
    time.sleep(0.2)
    plugin.batched_submit_put_task(keys[2:], objs[2:])  # queued behind the hung one
    t0 = time.monotonic()
    sm.close()  # LMCache's own shut-down, which closes every back end
    assert time.monotonic() - t0 < 2.0 + 1.0
    assert not futures[0].done()  # it never heard it was stored: it was not
    release.set()


def test_bad_configuration_is_refused_with_a_clear_error(tmp_path):
    from kvswarm.codec import Compression
    from kvswarm.integrations.lmcache.settings import PluginSettings

    with pytest.raises(ValueError, match="drives"):
        PluginSettings.from_extra_config({})
    with pytest.raises(ValueError, match="queue_depth"):
        PluginSettings.from_extra_config({"storage_plugin.kvswarm.drives": str(tmp_path),
                                          "storage_plugin.kvswarm.queue_depth": 0})
    with pytest.raises(ValueError, match="compression must be one of"):
        PluginSettings.from_extra_config({"storage_plugin.kvswarm.drives": str(tmp_path),
                                          "storage_plugin.kvswarm.compression": "gzip"})
    s = PluginSettings.from_extra_config({"storage_plugin.kvswarm.drives": "/a, /b",
                                          "storage_plugin.kvswarm.durable": "false",
                                          "storage_plugin.kvswarm.compression": "ZSTD"})
    assert s.drives == ("/a", "/b") and not s.durable and s.compression is Compression.ZSTD
