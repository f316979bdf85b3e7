"""Block copier of the vLLM worker: host (memmove) path here, CUDA side-stream path where a GPU is.

No vLLM needed: the copier only sees int8 KV tensors and host chunk views, as the
worker hands them over (tests/vllm_engine/test_worker.py covers the plan from vLLM specs).
"""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest
import torch

from kvswarm.integrations.vllm.copier import CopyOps, CudaCopier, HostCopier, make_copier

PAGE, BLOCKS, BPC, CHUNKS = 8192, 64, 4, 24

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def host_region():
    """Page-aligned host chunks, like vLLM's shared offload region: 2 tensors per chunk row."""
    mm = mmap.mmap(-1, CHUNKS * 2 * BPC * PAGE)
    base = torch.frombuffer(mm, dtype=torch.int8)
    rows = base.view(CHUNKS, 2 * BPC * PAGE)
    return mm, base, [rows[:, :BPC * PAGE], rows[:, BPC * PAGE:]]


def ops_for(blocks, chunks, subs, sizes=(PAGE, PAGE)) -> CopyOps:
    n = len(blocks)
    return CopyOps(np.repeat([0, 1], n), np.tile(blocks, 2), np.tile(chunks, 2), np.tile(subs, 2),
                   np.repeat(sizes, n))


@pytest.mark.parametrize("device", DEVICES)
def test_store_and_load_round_trip(device):
    g = torch.Generator().manual_seed(3)
    kv = [torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, generator=g).to(device) for _ in range(2)]
    orig = [t.clone() for t in kv]
    mm, base, host = host_region()
    copier = make_copier(kv, host, BPC, (base.data_ptr(), base.numel()))
    assert isinstance(copier, CudaCopier if device == "cuda" else HostCopier)
    rng = np.random.default_rng(0)
    blocks = rng.choice(BLOCKS, 40, replace=False)
    slots = rng.choice(CHUNKS * BPC, 40, replace=False)
    chunks, subs = slots // BPC, slots % BPC
    copier.submit(1, ops_for(blocks, chunks, subs), to_host=True)
    copier.wait({1})
    done = copier.finished()
    assert [r.job_id for r in done] == [1] and done[0].nbytes == 2 * 40 * PAGE
    pages = base.view(CHUNKS, 2, BPC, PAGE)
    for b, c, s in zip(blocks, chunks, subs):
        assert torch.equal(pages[c, 0, s], orig[0][b].cpu()) and torch.equal(pages[c, 1, s], orig[1][b].cpu())
    for t in kv:
        t.zero_()
    dst = rng.permutation(BLOCKS)[:40]
    copier.submit(2, ops_for(dst, chunks, subs), to_host=False)
    deadline = time.time() + 30
    got = []
    while not got and time.time() < deadline:
        got = copier.finished()
    assert [r.job_id for r in got] == [2]
    for d, b in zip(dst, blocks):
        assert torch.equal(kv[0][d], orig[0][b]) and torch.equal(kv[1][d], orig[1][b])
    copier.close()
    del pages, base, host
    mm.close()


@pytest.mark.parametrize("device", DEVICES)
def test_partial_pages_copy_only_their_bytes(device):
    kv = [torch.full((BLOCKS, PAGE), 7, dtype=torch.int8, device=device) for _ in range(2)]
    mm, base, host = host_region()
    copier = make_copier(kv, host, BPC, (base.data_ptr(), base.numel()))
    copier.submit(1, ops_for([5], [2], [3], sizes=(PAGE, PAGE - 512)), to_host=True)
    copier.wait({1})
    pages = base.view(CHUNKS, 2, BPC, PAGE)
    assert int(pages[2, 0, 3].eq(7).sum()) == PAGE
    assert int(pages[2, 1, 3].eq(7).sum()) == PAGE - 512 and not pages[2, 1, 3, PAGE - 512:].any()
    copier.close()
    del pages, base, host
    mm.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_sees_kv_written_just_before_on_the_compute_stream():
    kv = [torch.zeros((BLOCKS, PAGE), dtype=torch.int8, device="cuda") for _ in range(2)]
    mm, base, host = host_region()
    copier = make_copier(kv, host, BPC, (base.data_ptr(), base.numel()))
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # keep the compute stream busy so an unordered copy would read zeros
        x = x @ x / 64
    kv[0][9].fill_(42)
    kv[1][9].fill_(-3)
    copier.submit(1, ops_for([9], [0], [0]), to_host=True)
    copier.wait({1})
    pages = base.view(CHUNKS, 2, BPC, PAGE)
    assert bool(pages[0, 0, 0].eq(42).all()) and bool(pages[0, 1, 0].eq(-3).all())
    assert copier._registered is not None  # the region was page-locked
    copier.close()
    del pages, base, host
    mm.close()
