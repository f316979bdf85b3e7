"""Worker side of the kvswarm offloading spec: KV tensors <-> the primary tier's chunks.

vLLM's own ``CPUOffloadingWorker`` runs only on CUDA/XPU (it relies on device copy
kernels).  This worker plans the same page copies from vLLM's load/store specs and
hands them to a :mod:`~kvswarm.integrations.vllm.copier`: memmoves when the KV cache
is in host memory (vLLM's CPU backend), async side-stream copies from page-locked
chunks when it is on a GPU.  The chunks live in vLLM's shared offload region, which
the scheduler-side tiering manager and the kvswarm tier read and write.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from kvswarm.integrations.vllm.copier import BlockCopier, CopyOps, make_copier

log = logging.getLogger(__name__)


def plan_ops(kv_caches: CanonicalKVCaches, blocks_per_chunk: int, device_spec: GPULoadStoreSpec,
             host_spec: BlockIDsLoadStoreSpec) -> CopyOps:
    """Page copies for one job, matching vLLM's chunk addressing.

    Device blocks come grouped by KV cache group (``group_sizes``); each group's
    first block sits at logical index ``block_indices[g]`` of its request, so it may
    start part-way into its first host chunk (``block_indices[g] % blocks_per_chunk``).
    """
    dev_ids, host_ids = device_spec.block_ids, host_spec.block_ids
    cols: list[list[int]] = [[], [], [], [], []]
    d_off = h_off = 0
    for g, (size, first) in enumerate(zip(device_spec.group_sizes, device_spec.block_indices)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        n_chunks = -(-(size + skip) // blocks_per_chunk)
        if d_off + size > len(dev_ids) or h_off + n_chunks > len(host_ids):
            raise ValueError("load/store spec has fewer blocks than its group sizes say")
        logical = np.arange(size) + skip
        blocks = dev_ids[d_off:d_off + size]
        chunks = host_ids[h_off + logical // blocks_per_chunk]
        subs = logical % blocks_per_chunk
        for ref in kv_caches.group_data_refs[g]:
            cols[0].extend([ref.tensor_idx] * size)
            cols[1].extend(blocks.tolist())
            cols[2].extend(chunks.tolist())
            cols[3].extend(subs.tolist())
            cols[4].extend([ref.page_size_bytes] * size)
        d_off += size
        h_off += n_chunks
    if d_off != len(dev_ids) or h_off != len(host_ids):
        raise ValueError("load/store spec block counts do not match its group sizes")
    return CopyOps(*(np.asarray(c, dtype=np.int64) for c in cols))


class KVSwarmOffloadingWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        self.kv_caches = kv_caches
        self.blocks_per_chunk = blocks_per_chunk
        self.region = region
        device, host = [], []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            device.append(t.tensor.view(torch.int8).view(-1, page))
            host.append(region.create_next_worker_view(page * blocks_per_chunk))
        base = region.base_tensor
        self.copier: BlockCopier = make_copier(device, host, blocks_per_chunk,
                                               (base.data_ptr(), base.numel()))

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        self.copier.submit(job_id, plan_ops(self.kv_caches, self.blocks_per_chunk, src_spec, dst_spec), True)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        self.copier.submit(job_id, plan_ops(self.kv_caches, self.blocks_per_chunk, dst_spec, src_spec), False)
        return True

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(r.job_id, True, r.nbytes, r.seconds) for r in self.copier.finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.copier.wait(job_ids)

    def shutdown(self) -> None:
        self.copier.close()
        self.region.cleanup()
