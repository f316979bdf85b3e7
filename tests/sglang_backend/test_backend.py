"""KVSwarmHiCacheStorage against SGLang 0.5.x's real HiCacheStorage contract, backend factory
and host pools (CPU: MHA, MLA, Mamba): round trips on every host layout, zero-copy and generic
paths reading each other's pages, prefix existence, persistence, isolation, corruption, v2 pools."""

from __future__ import annotations

import os

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.runtime_context import get_context

from kvswarm.buffers import BufferPoolExhausted
from kvswarm.drive import DATA_FILE
from kvswarm.format import extent_size, key_digest, payload_offset
from kvswarm.integrations.sglang import KVSwarmHiCacheStorage
from kvswarm.integrations.sglang.backend import flat_order

PAGE, LAYERS, HEADS, DIM = 16, 3, 2, 64
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
POOLS = [("mha", layout) for layout in [*LAYOUTS, "page_head"]] + [("mla", layout) for layout in LAYOUTS]


def host_pool(layout: str, seed: int = 0, kind: str = "mha",
              dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    if kind == "mla":  # DeepSeek-style latent KV: one run per layer, no K/V split
        dev = MLATokenToKVPool(256, PAGE, dtype, DIM, DIM // 2, LAYERS, "cpu", False, start_layer=0,
                               end_layer=LAYERS - 1)
        pool = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                    pin_memory=False, device_capacity_tokens=dev.size, start_layer=0,
                                    end_layer=LAYERS - 1, target_layer_num=LAYERS)
    else:
        dev = MHATokenToKVPool(256, PAGE, dtype, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                               end_layer=LAYERS - 1)
        pool = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                    pin_memory=False, device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                    end_layer=dev.end_layer, write_back_staging=dev.hicache_write_back_staging)
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))
    return pool


def mamba_pool(seed: int = 0) -> MambaPoolHost:
    """A hybrid model's Mamba state pool: one state per page, assembled from two buffers by copy."""
    info = MambaStateBufferInfo(temporal=torch.zeros(LAYERS, 8, 4, DIM), conv=(torch.zeros(LAYERS, 8, 3, DIM),))
    pool = MambaPoolHost(info, 2, 0, device_capacity=8, pin_memory=False, layout="page_first")
    g = torch.Generator().manual_seed(seed)
    for buf in (pool.temporal_buffer, *pool.conv_buffer):
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    return pool


def storage_config(drives, model="tiny-llama", tp=(0, 1), mla=False, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=model,
        extra_config={"backend_name": "kvswarm", "module_path": "kvswarm.integrations.sglang",
                      "class_name": "KVSwarmHiCacheStorage", "interface_v1": 1, "drives": drives,
                      "capacity_per_drive": 16 << 20, **extra})


def open_backend(drives, pool, **kw) -> KVSwarmHiCacheStorage:
    """As SGLang's cache controller does: factory, then register the host pool."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(drives, **kw), pool)
    b.register_mem_pool_host(pool)
    return b


def pages(pool, first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def page_data(pool, idx: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [pool.get_data_page(int(idx[i * PAGE]), flat=True).clone() for i in range(n)]


def lease_bytes(pool) -> int:
    """What one page takes in the store's buffer pool while it is read or written."""
    page = pool.get_dummy_flat_data_page()
    return extent_size(page.numel() * page.element_size())


@pytest.fixture
def drives(drive_dirs):
    return drive_dirs(2)


def test_dynamic_loading_gives_a_hicache_storage(drives):
    pool = host_pool("page_first")
    b = open_backend(drives, pool)
    assert isinstance(b, HiCacheStorage) and isinstance(b, KVSwarmHiCacheStorage)
    assert [os.listdir(os.path.join(d, "tiny-llama")) for d in drives] == [["rank0of1-pp0of1-cp0of1-dp0"]] * 2
    b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_and_prefix_exists(drives, layout):
    pool = host_pool(layout)
    b = open_backend(drives, pool)
    keys = [f"h{i:04d}" for i in range(6)]
    src = pages(pool, 0, 6)
    want = page_data(pool, src, 6)
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, src) == [True] * 6
    assert b.batch_exists(keys) == 6 and b.batch_exists(keys[:2] + ["nope"] + keys[2:]) == 2
    dst = pages(pool, 10, 6)
    assert b.batch_get_v1(keys, dst) == [True] * 6
    for i, got in enumerate(page_data(pool, dst, 6)):
        assert torch.equal(got, want[i])
    assert b.store.counters["puts"] == 6
    assert b.batch_set_v1(keys, src) == [True] * 6  # present already: nothing rewritten
    assert b.store.counters["puts"] == 6
    b.close()


def test_zero_copy_runs_follow_the_flat_page():
    assert flat_order(host_pool("layer_first")).tolist() == [0, 2, 4, 1, 3, 5]  # K, V per layer -> K..., V...
    assert flat_order(host_pool("page_first")).tolist() == [0, 1]
    assert flat_order(host_pool("layer_first", kind="mla")).tolist() == [0, 1, 2]  # layers in order
    assert flat_order(mamba_pool()) is None  # its pages are copies: moved through its flat-page methods


@pytest.mark.parametrize("kind,layout", POOLS)
def test_generic_and_zero_copy_paths_share_pages(drives, kind, layout):
    pool = host_pool(layout, kind=kind)
    b = open_backend(drives, pool)
    src = pages(pool, 0, 2)
    want = page_data(pool, src, 2)
    assert b.batch_set(["a", "b"], want)  # generic path: flat data pages
    assert b.batch_get_v1(["a", "b"], pages(pool, 4, 2)) == [True, True]
    assert all(torch.equal(g, w) for g, w in zip(page_data(pool, pages(pool, 4, 2), 2), want))
    assert b.batch_set_v1(["c"], pages(pool, 1, 1)) == [True]  # zero-copy write, generic read
    dummy = pool.get_dummy_flat_data_page()
    got = b.get("c", dummy)
    assert got is dummy and torch.equal(got, want[1])
    assert b.get("missing", pool.get_dummy_flat_data_page()) is None
    got = b.batch_get(["a", "c"])  # no targets: tensors of their own
    assert torch.equal(got[0].view(-1), want[0].view(-1)) and torch.equal(got[1].view(-1), want[1].view(-1))
    assert b.get("b", torch.zeros(dummy.numel() - 1, dtype=dummy.dtype)) is None  # a target of the wrong size
    assert b.exists("b")  # ... is a miss, not a bad page
    b.close()


def test_pages_persist_and_keys_are_isolated(drives):
    pool = host_pool("page_first")
    b = open_backend(drives, pool)
    src = pages(pool, 0, 3)
    want = page_data(pool, src, 3)
    assert all(b.batch_set_v1(["x", "y", "z"], src))
    b.close()
    b = open_backend(drives, pool)  # restarted server
    assert b.batch_exists(["x", "y", "z"]) == 3
    assert b.batch_get_v1(["x", "y", "z"], pages(pool, 8, 3)) == [True] * 3
    assert all(torch.equal(g, w) for g, w in zip(page_data(pool, pages(pool, 8, 3), 3), want))
    b.close()
    for other in ({"model": "another-model"}, {"tenant": "b"}):
        b = open_backend(drives, pool, **other)
        assert b.batch_exists(["x", "y", "z"]) == 0
        b.close()
    b = open_backend(drives, host_pool("layer_first"))  # same model, other host layout: other bytes
    assert b.batch_exists(["x"]) == 0
    b.close()


def test_servers_share_drives_but_each_store_has_one_writer(drives):
    pool = host_pool("page_first")
    a = open_backend(drives, pool)
    b = open_backend(drives, pool, model="org/other-model")  # a store of its own beside a's
    assert a.batch_set_v1(["p"], pages(pool, 0, 1)) == [True] and b.batch_exists(["p"]) == 0
    with pytest.raises(Exception, match="follow=True"):  # a second server of a's model: one writer per store
        open_backend(drives, pool)
    other = host_pool("page_first", seed=5)
    r = open_backend(drives, other, follow=True)  # ... configured to follow: it reads a's store
    assert r.batch_exists(["p"]) == 1 and r.batch_get_v1(["p"], pages(other, 3, 1)) == [True]
    assert torch.equal(page_data(other, pages(other, 3, 1), 1)[0], page_data(pool, pages(pool, 0, 1), 1)[0])
    assert r.batch_set_v1(["q"], pages(other, 4, 1)) == [False] and not a.exists("q")
    assert a.batch_set_v1(["q"], pages(pool, 1, 1)) == [True] and r.exists("q")  # a's flushes reach r
    assert sorted(os.listdir(drives[0])) == ["org-other-model", "tiny-llama"]
    for x in (r, a, b):
        x.close()


@pytest.mark.parametrize("io_backend", ["threads", "auto"])
def test_backup_and_prefetch_threads_share_the_backend(drives, io_backend):
    """SGLang's cache controller backs pages up on one thread while it prefetches on another, and
    reads are split into several store batches (read_split): every page still lands whole."""
    import threading

    pool = host_pool("layer_first")
    b = open_backend(drives, pool, io_backend=io_backend, read_split=3)
    old = [f"old{i}" for i in range(8)]
    assert all(b.batch_set_v1(old, pages(pool, 0, 8)))
    want = page_data(pool, pages(pool, 0, 8), 8)
    errors: list[BaseException] = []

    def backup() -> None:
        try:
            for r in range(6):
                assert all(b.batch_set_v1([f"new{r}-{i}" for i in range(2)], pages(pool, 2 * r, 2)))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    t = threading.Thread(target=backup)
    t.start()
    for _ in range(6):
        assert b.batch_get_v1(old, pages(pool, 16, 8)) == [True] * 8
        assert all(torch.equal(g, w) for g, w in zip(page_data(pool, pages(pool, 16, 8), 8), want))
    t.join()
    assert not errors, errors
    assert b.batch_exists([f"new{r}-{i}" for r in range(6) for i in range(2)]) == 12
    b.close()


def test_corrupt_page_is_a_miss_and_dropped(drives):
    pool = host_pool("page_first")
    b = open_backend(drives, pool)
    keys = ["p0", "p1", "p2", "p3"]
    assert all(b.batch_set_v1(keys, pages(pool, 0, 4)))
    entry = b.store.catalog.entries[key_digest(b._key("p2"))]
    drv, off, _, _ = entry.extents[0]
    b.close()
    path = os.path.join(drives[drv], "tiny-llama", "rank0of1-pp0of1-cp0of1-dp0", DATA_FILE)
    with open(path, "r+b") as f:
        f.seek(off + payload_offset(entry.payload_len) + 33)
        f.write(b"\xde\xad")
    b = open_backend(drives, pool)
    dst = pages(pool, 8, 4)
    before = page_data(pool, dst, 4)
    assert b.batch_get_v1(keys, dst) == [True, True, False, True]
    assert torch.equal(page_data(pool, dst, 4)[2], before[2])  # a bad page never lands in the pool
    assert b.store.counters["corrupt"] == 1
    assert b.batch_exists(keys) == 2  # dropped: SGLang recomputes it and may store it again
    assert b.batch_set_v1(["p2"], pages(pool, 2, 1)) == [True]
    assert b.batch_exists(keys) == 4
    assert b.forget(["p1", "p3", "never-stored"]) == 2 and b.batch_exists(keys) == 1
    b.close()


def test_pages_on_a_failed_drive_stop_existing_at_once(drives):
    """A drive taken out of service: the next call drops the pages on it (journaled), so existence checks
    miss on them rather than SGLang scheduling reads that fail; the other pages stay, also after a restart."""
    pool = host_pool("page_first")
    b = open_backend(drives, pool)
    keys = [f"x{i}" for i in range(6)]
    assert all(b.batch_set_v1(keys, pages(pool, 0, 6)))
    store = b.store
    on_1 = [store.catalog.get(key_digest(b._key(k))).extents[0][0] == 1 for k in keys]
    assert any(on_1) and not all(on_1)
    store.fail_drive(1)
    assert b.batch_exists(keys) == on_1.index(True)
    assert b.batch_exists_v2(keys).kv_hit_pages == on_1.index(True)
    assert [b.exists(k) for k in keys] == [not x for x in on_1]
    assert store.counters["gets"] == 0 and len(store) == on_1.count(False)
    b.close()
    b = open_backend(drives, pool)  # drive 1 back in service: what was dropped stays gone
    assert [b.exists(k) for k in keys] == [not x for x in on_1]
    b.close()


def test_v2_pools_and_trailing_hit_policy(drives):
    kv, swa = host_pool("page_first", 1), host_pool("page_first", 2)
    b = open_backend(drives, kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    keys = [f"k{i}" for i in range(4)]
    idx = pages(kv, 0, 4)
    res = b.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=idx, keys=keys),
                          PoolTransfer(PoolName.SWA, host_indices=idx[-PAGE:], keys=keys[-1:])])
    assert res == {PoolName.KV: [True] * 4, PoolName.SWA: [True]}
    hit = b.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys[-1:],
                                                hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert hit.kv_hit_pages == 4 and hit.restorable_prefix_pages == [4]
    hit = b.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert hit.kv_hit_pages == 0
    want = page_data(swa, idx[-PAGE:], 1)[0]
    out = b.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=pages(swa, 9, 1), keys=keys[-1:])])
    assert out == {PoolName.SWA: [True]}
    assert torch.equal(page_data(swa, pages(swa, 9, 1), 1)[0], want)
    b.close()


def test_mla_tp_ranks_read_their_writers_pages(drives):
    """MLA's KV is the same on every TP rank, and SGLang backs it up from rank 0 only: the other
    ranks read rank 0's store (following it), while TP-sharded Mamba state stays per rank."""
    pools = [host_pool("page_first", seed, kind="mla") for seed in (0, 1)]
    follower = open_backend(drives, pools[1], tp=(1, 2), mla=True)  # may start before its writer
    keys = [f"m{i}" for i in range(3)]
    assert follower.batch_exists(keys) == 0 and follower.store is None
    writer = open_backend(drives, pools[0], tp=(0, 2), mla=True)
    want = page_data(pools[0], pages(pools[0], 0, 3), 3)
    assert writer.batch_set_v1(keys, pages(pools[0], 0, 3)) == [True] * 3
    assert follower.batch_exists(keys) == 3  # the writer's flush made them visible
    assert follower.batch_get_v1(keys, pages(pools[1], 5, 3)) == [True] * 3
    assert all(torch.equal(g, w) for g, w in zip(page_data(pools[1], pages(pools[1], 5, 3), 3), want))
    assert follower.batch_set_v1(["x"], pages(pools[1], 0, 1)) == [False]  # a follower writes nothing
    assert follower.store.config.follow and not writer.store.config.follow
    assert writer.forget(["m1"]) == 1 and follower.batch_exists(keys) == 1
    mamba = mamba_pool(4)
    follower.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    state = mamba.get_data_page(2, flat=True).clone()
    transfer = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([2]), keys=["m0"])
    assert follower.batch_set_v2([transfer]) == {PoolName.MAMBA: [True]}  # its own shard, its own store
    out = follower.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([7]), keys=["m0"])])
    assert out == {PoolName.MAMBA: [True]} and torch.equal(mamba.get_data_page(7, flat=True), state)
    assert sorted(os.listdir(os.path.join(drives[0], "tiny-llama"))) == ["mla-dcp0of1-pp0of1-cp0of1-dp0",
                                                                          "rank1of2-pp0of1-cp0of1-dp0"]
    follower.close()
    writer.close()


def test_v2_pool_without_zero_copy_runs_moves_flat_pages(drives):
    kv, mamba = host_pool("page_first"), mamba_pool(3)
    b = open_backend(drives, kv)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    keys = ["m0", "m1"]
    want = [mamba.get_data_page(i, flat=True).clone() for i in (1, 2)]
    assert b.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1, 2]), keys=keys)]) == \
        {PoolName.MAMBA: [True, True]}
    out = b.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5, 6]), keys=keys)])
    assert out == {PoolName.MAMBA: [True, True]}
    assert all(torch.equal(mamba.get_data_page(i, flat=True), w) for i, w in zip((5, 6), want))
    bad = b.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys)])
    assert bad == {PoolName.MAMBA: [False, False]}  # indices that do not match the keys: nothing moved
    b.close()


@pytest.mark.parametrize("pool_pages", [5, 1.5])
def test_calls_larger_than_the_buffer_pool(drives, pool_pages):
    """A big model's pages (8 MiB each for Llama-3-8B at page size 64) outgrow the buffer pool
    within one call: batches are sized by its room, so backups and restores of more pages than it
    holds come out whole on every path, and every lease goes back."""
    pool = host_pool("layer_first")
    b = open_backend(drives, pool, buffer_pool_bytes=int(pool_pages * lease_bytes(pool)), read_split=4)
    want = page_data(pool, pages(pool, 0, 8), 8)
    for r in range(3):
        keys = [f"r{r}-{i}" for i in range(8)]
        assert b.batch_set_v1(keys[:6], pages(pool, 0, 6)) == [True] * 6
        assert b.batch_set(keys[6:], want[6:])
        assert b.batch_get_v1(keys, pages(pool, 8, 8)) == [True] * 8
        assert all(torch.equal(g, w) for g, w in zip(page_data(pool, pages(pool, 8, 8), 8), want))
        got = b.batch_get(keys)  # no targets: page sizes unknown up front
        assert all(torch.equal(g.view(-1), w.view(-1)) for g, w in zip(got, want))
        got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert b.store.pool.in_use == 0
    b.close()


def test_page_larger_than_the_buffer_pool_fails_cleanly(drives):
    pool = host_pool("page_first")
    b = open_backend(drives, pool)
    assert all(b.batch_set_v1(["a", "b"], pages(pool, 0, 2)))
    b.close()
    b = open_backend(drives, pool, buffer_pool_bytes=lease_bytes(pool) // 2)
    assert b.batch_set_v1(["c", "d"], pages(pool, 0, 2)) == [False, False]
    assert not b.batch_set(["e"], page_data(pool, pages(pool, 0, 1), 1))
    assert b.batch_get_v1(["a", "b"], pages(pool, 4, 2)) == [False, False]
    assert b.batch_get(["a"]) == [None]
    assert b.batch_exists(["a", "b", "c"]) == 2  # stored pages that could not be read stay
    assert b.store.pool.in_use == 0
    b.close()


def test_failed_batch_fails_its_pages_only_and_leaks_no_lease(drives, monkeypatch):
    """A lease refused mid-call waits for the call's earlier batches; any other failure of a batch
    fails only its pages, never raises into SGLang, and every batch submitted gives its lease back."""
    pool = host_pool("page_first")
    b = open_backend(drives, pool, buffer_pool_bytes=5 * lease_bytes(pool), read_split=2)
    store = b.store
    keys = [f"p{i}" for i in range(6)]
    want = page_data(pool, pages(pool, 0, 6), 6)
    submit_put, submit_get, lease = store.submit_put, store.submit_get, store.pool.lease

    def failing(real, fail, on: int):
        calls = 0

        def call(*args, **kw):
            nonlocal calls
            calls += 1
            if calls == on:
                raise fail
            return real(*args, **kw)

        return call

    monkeypatch.setattr(store, "submit_put", failing(submit_put, OSError("no healthy drive"), 1))
    done = b.batch_set_v1(keys, pages(pool, 0, 6))  # two pages per batch: the pool's half
    assert done == [False, False, True, True, True, True]
    monkeypatch.setattr(store, "submit_put", submit_put)
    assert b.batch_set_v1(keys, pages(pool, 0, 6)) == [True] * 6
    monkeypatch.setattr(store.pool, "lease", failing(lease, BufferPoolExhausted("held by another thread"), 2))
    assert b.batch_get_v1(keys, pages(pool, 8, 6)) == [True] * 6
    assert all(torch.equal(g, w) for g, w in zip(page_data(pool, pages(pool, 8, 6), 6), want))
    monkeypatch.setattr(store, "submit_get", failing(submit_get, OSError("engine gone"), 2))
    before = page_data(pool, pages(pool, 16, 6), 6)
    assert b.batch_get_v1(keys, pages(pool, 16, 6)) == [True, True, False, False, True, True]
    got = page_data(pool, pages(pool, 16, 6), 6)
    assert all(torch.equal(got[i], (before if i in (2, 3) else want)[i]) for i in range(6))
    assert store.pool.in_use == 0
    b.close()


def test_a_failed_flush_fails_the_pages_it_did_not_make_durable(drives, monkeypatch, fdatasync_fails):
    """A set is reported stored once durable.  A drive failing its fdatasync in that flush: the pages written
    to it are reported failed and dropped (a retry writes them again, on the other drive), the others are
    durable and stored.  A failed catalog sync fails (and drops) them all.  Nothing raises into SGLang."""
    pool = host_pool("page_first")
    b = open_backend(drives, pool)
    store = b.store
    keys = [f"d{i}" for i in range(6)]
    src = pages(pool, 0, 6)
    real = os.fdatasync
    fdatasync_fails(store.drives[1].fd)
    done = b.batch_set_v1(keys, src)
    assert done.count(True) == 3 and not store.drives[1].healthy
    assert [b.exists(k) for k in keys] == done
    monkeypatch.setattr(os, "fdatasync", real)
    assert b.batch_set_v1(keys, src) == [True] * 6
    assert b.batch_get_v1(keys, pages(pool, 8, 6)) == [True] * 6
    assert all(torch.equal(g, w) for g, w in zip(page_data(pool, pages(pool, 8, 6), 6), page_data(pool, src, 6)))
    sync = store.catalog.sync

    def failing() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.catalog, "sync", failing)
    more = [f"e{i}" for i in range(2)]
    assert b.batch_set_v1(more, pages(pool, 6, 2)) == [False, False]
    assert not any(b.exists(k) for k in more)  # a retry after the catalog recovers writes them again
    monkeypatch.setattr(store.catalog, "sync", sync)
    assert b.batch_set_v1(more, pages(pool, 6, 2)) == [True, True]
    b.close()


def test_kv_cache_dtype_and_weights_key_pages_apart(drives):
    """SGLang's host pool holds every fp8 KV cache as uint8: an fp8_e5m2 server must not read the
    pages an fp8_e4m3 one left on the same drives, nor must a server of other weights (quantization,
    revision) of the same model name."""
    keys = ["f0", "f1"]
    e4m3 = {"kv_cache_dtype": "fp8_e4m3"}
    with get_context().override_server_args(**e4m3):
        pool = host_pool("page_first", dtype=torch.float8_e4m3fn)
        b = open_backend(drives, pool)
        assert all(b.batch_set_v1(keys, pages(pool, 0, 2)))
        b.close()
    for args, dtype in [({"kv_cache_dtype": "fp8_e5m2"}, torch.float8_e5m2),
                        ({**e4m3, "quantization": "awq"}, torch.float8_e4m3fn),
                        ({**e4m3, "revision": "v2"}, torch.float8_e4m3fn),
                        (e4m3, torch.float8_e4m3fn)]:
        with get_context().override_server_args(**args):
            b = open_backend(drives, host_pool("page_first", dtype=dtype))
            assert b.batch_exists(keys) == (2 if args == e4m3 else 0), args
            b.close()


def test_a_drive_unreadable_at_open_leaves_the_backend_serving_the_others(drives):
    """The restarted server finds drive 1's superblock damaged: the backend opens on the other drives,
    the pages that were on drive 1 stop existing, the rest come back exactly."""
    import glob

    pool = host_pool("page_first")
    b = open_backend(drives, pool)
    keys = [f"x{i}" for i in range(6)]
    src = pages(pool, 0, 6)
    want = page_data(pool, src, 6)
    assert all(b.batch_set_v1(keys, src))
    on_1 = [b.store.catalog.get(key_digest(b._key(k))).extents[0][0] == 1 for k in keys]
    assert any(on_1) and not all(on_1)
    b.close()
    (data,) = glob.glob(os.path.join(drives[1], "**", DATA_FILE), recursive=True)
    with open(data, "r+b") as f:
        f.write(b"XXXX")  # the superblock's magic
    b = open_backend(drives, pool)
    health = b.store.health()
    assert [h.healthy for h in health] == [True, False] and "superblock" in health[1].reason
    assert [b.exists(k) for k in keys] == [not x for x in on_1]
    kept = [i for i, x in enumerate(on_1) if not x]
    got = b.batch_get_v1([keys[i] for i in kept], pages(pool, 8, len(kept)))
    assert got == [True] * len(kept)
    assert all(torch.equal(g, want[i]) for g, i in zip(page_data(pool, pages(pool, 8, len(kept)), len(kept)), kept))
    b.close()
