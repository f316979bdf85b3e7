"""The plugin with ``compression: zstd`` under LMCache's own StorageManager: chunks stored as frames
(kvswarm.codec), read back exact, corrupt frames a miss, and the codec part of every key."""

from __future__ import annotations

import time

import numpy as np
import torch
from test_plugin import CHUNK, open_manager, retrieve, store

from kvswarm.format import ALIGN
from kvswarm.integrations.lmcache.backend import store_dir
from kvswarm.integrations.lmcache.harness import (
    SMOLLM2,
    allocate_chunk,
    chunk_bytes,
    chunk_keys,
    obj_bytes,
    text_tokens,
)


def kv_like(index: int, nbytes: int) -> np.ndarray:
    """bf16 values of a normal distribution: compressible as real KV is (shared exponents), unlike random bytes."""
    g = torch.Generator().manual_seed(index)
    return torch.randn(nbytes // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy()


def test_compressed_chunks_round_trip_through_the_storage_manager(drives):
    sm, cfg, meta = open_manager(drives, compression="zstd")
    plugin = sm.storage_backends["kvswarm"]
    assert plugin.codec is not None
    size = SMOLLM2.chunk_bytes(CHUNK)
    data = [kv_like(i, size) if i % 2 == 0 else chunk_bytes(i, size) for i in range(6)]  # odd: incompressible
    keys = chunk_keys(cfg, meta, text_tokens(6 * CHUNK, seed=21))
    objs = [allocate_chunk(sm, meta, d) for d in data]
    sm.batched_put(keys, objs)  # the cache engine's store: CPU tier and kvswarm
    deadline = time.monotonic() + 30
    while any(plugin.exists_in_put_tasks(k) for k in keys):  # until encoded, written and flushed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sm.batched_remove(keys, locations=["LocalCPUBackend"])
    got = retrieve(sm, keys)
    assert {loc for loc, _ in got.values()} == {"kvswarm"}
    for k, d in zip(keys, data):
        assert np.array_equal(obj_bytes(got[k][1]), d)
    lengths = [plugin.store.length(plugin._key(k)) for k in keys]
    assert all(n < size * 0.9 for n in lengths[0::2])  # compressible chunks shrank
    assert all(n > size for n in lengths[1::2])  # random ones are stored as they are, behind a frame header
    c = plugin.counters
    assert c["stored_bytes_written"] < c["chunk_bytes_written"]
    sm.close()


def test_a_partial_compressed_chunk_comes_back_with_its_own_length(drives):
    sm, cfg, meta = open_manager(drives, compression="zstd")
    plugin = sm.storage_backends["kvswarm"]
    keys = chunk_keys(cfg, meta, text_tokens(2 * CHUNK, seed=22))
    part = kv_like(7, SMOLLM2.chunk_bytes(CHUNK // 4))
    obj = allocate_chunk(sm, meta, part, tokens=CHUNK // 4)
    [f] = plugin.batched_submit_put_task(keys[:1], [obj])
    obj.ref_count_down()
    assert f.result(timeout=30) == [True]
    [back] = plugin.batched_get_blocking(keys[:1])
    assert tuple(back.get_shape()) == tuple(meta.get_shapes(CHUNK // 4)[0])
    assert np.array_equal(obj_bytes(back), part)
    sm.close()


def test_a_corrupt_frame_is_a_miss_and_dropped(drives, overwrite):
    sm, cfg, meta = open_manager(drives, compression="zstd")
    keys = chunk_keys(cfg, meta, text_tokens(4 * CHUNK, seed=23))
    store(sm, keys, meta)
    plugin = sm.storage_backends["kvswarm"]
    [entry] = plugin.store.locate([plugin._key(keys[1])])
    ext = entry.extents[0]
    sm.close()
    overwrite(f"{drives[ext.drive]}/{store_dir(meta)}", ext.offset + ALIGN + 64, b"\xde\xad\xbe\xef")
    sm, cfg, meta = open_manager(drives, compression="zstd")
    plugin = sm.storage_backends["kvswarm"]
    got = plugin.batched_get_blocking(keys)
    assert got[1] is None  # the frame's checksum failed: a miss, never wrong KV
    for i in (0, 2, 3):
        assert np.array_equal(obj_bytes(got[i]), chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK)))
    assert plugin.batched_contains(keys) == 1  # dropped: LMCache recomputes it
    sm.close()


def test_the_codec_is_part_of_the_key(drives):
    """A process configured without compression misses on chunks stored as frames (and the other way
    round) instead of handing frames to LMCache as KV; with the same setting it hits them."""
    sm, cfg, meta = open_manager(drives, compression="zstd")
    keys = chunk_keys(cfg, meta, text_tokens(3 * CHUNK, seed=24))
    store(sm, keys, meta)
    sm.close()
    sm, cfg, meta = open_manager(drives)
    assert sm.storage_backends["kvswarm"].batched_contains(keys) == 0
    sm.close()
    sm, cfg, meta = open_manager(drives, compression="zstd")
    plugin = sm.storage_backends["kvswarm"]
    assert plugin.batched_contains(keys) == 3
    got = plugin.batched_get_blocking(keys)
    assert all(np.array_equal(obj_bytes(g), chunk_bytes(i, SMOLLM2.chunk_bytes(CHUNK))) for i, g in enumerate(got))
    sm.close()
