"""KVSwarmOffloadingWorker: vLLM load/store specs -> page copies between KV tensors and
vLLM's shared offload region (CPU path here; the CUDA path is the same plan on a side stream)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from kvswarm.integrations.vllm.worker import KVSwarmOffloadingWorker, plan_ops

PAGE, BLOCKS, BPC, CHUNKS = 4096, 16, 2, 8


def kv_caches(unpadded: int = PAGE) -> CanonicalKVCaches:
    g = torch.Generator().manual_seed(0)
    tensors = [CanonicalKVCacheTensor(torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, generator=g), PAGE)
               for _ in range(2)]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, unpadded)]])


@pytest.fixture
def worker_for():
    made = []

    def make(caches):
        region = SharedOffloadRegion(engine_id=f"kvswarm-test-{uuid.uuid4().hex}", num_chunks=CHUNKS, rank=0,
                                     kv_bytes_per_chunk=2 * PAGE * BPC, cpu_page_size=2 * PAGE * BPC)
        w = KVSwarmOffloadingWorker(caches, BPC, region)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


def test_plan_follows_vllm_chunk_addressing():
    caches = kv_caches()
    # Group starts at logical block 1: its first block is the second page of host chunk 7.
    ops = plan_ops(caches, BPC, GPULoadStoreSpec([5, 3, 9], [3], [1]), CPULoadStoreSpec([7, 2]))
    rows = sorted(zip(ops.tensor.tolist(), ops.block.tolist(), ops.chunk.tolist(), ops.sub.tolist()))
    assert rows == sorted((t, b, c, s) for t in (0, 1) for b, c, s in [(5, 7, 1), (3, 2, 0), (9, 2, 1)])
    with pytest.raises(ValueError):
        plan_ops(caches, BPC, GPULoadStoreSpec([5, 3, 9], [3], [1]), CPULoadStoreSpec([7]))


@pytest.mark.parametrize("unpadded", [PAGE, PAGE - 96])
def test_store_then_load_restores_pages(worker_for, unpadded):
    caches = kv_caches(unpadded)
    kv = [t.tensor for t in caches.tensors]
    orig = [t.clone() for t in kv]
    w = worker_for(caches)
    assert w.submit_store(1, GPULoadStoreSpec([5, 3, 9], [3], [1]), CPULoadStoreSpec([7, 2]))
    for t in kv:
        t.zero_()
    assert w.submit_load(2, CPULoadStoreSpec([7, 2]), GPULoadStoreSpec([10, 11, 12], [3], [1]))
    w.wait({1, 2})
    done = {r.job_id: r for r in w.get_finished()}
    assert set(done) == {1, 2} and all(r.success for r in done.values())
    assert done[1].transfer_size == 3 * (PAGE + unpadded)
    for dst, src in [(10, 5), (11, 3), (12, 9)]:
        assert torch.equal(kv[0][dst], orig[0][src])
        assert torch.equal(kv[1][dst, :unpadded], orig[1][src, :unpadded])
    untouched = [b for b in range(BLOCKS) if b not in (10, 11, 12)]
    assert not kv[0][untouched].any()
    # The pages sit in vLLM's shared region where the tiering manager's chunks are.
    host = w.region.base_tensor.numpy().reshape(CHUNKS, 2, BPC, PAGE)
    assert np.array_equal(host[7, 0, 1], orig[0][5].numpy())
