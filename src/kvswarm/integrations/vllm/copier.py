"""Block copies between an engine's KV tensors and host chunk buffers, submit-then-poll.

A copy *op* moves one block page of one KV tensor: ``(tensor, device block,
host chunk, sub-block, bytes)``.  The host side of each tensor is a 2-D int8 view
``(num_chunks, blocks_per_chunk * page)`` into page-aligned host memory.

- :class:`HostCopier` (KV cache in host memory, vLLM's CPU backend): one vectorised
  gather/scatter per tensor (a memmove per page), done at submit; ``finished()``
  reports it on the next poll.
- :class:`CudaCopier` (KV cache on a GPU): the host region is page-locked once
  (``cudaHostRegister``); each job's copies run asynchronously on a side stream that
  first waits for the compute stream, in submission order, and complete through an
  event that ``finished()`` polls.

No engine imports here: the worker plans ops, a copier executes them.
"""

from __future__ import annotations

import abc
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass
class CopyOps:
    """Ops of one job, as parallel arrays (one entry per block page)."""

    tensor: np.ndarray  # tensor index
    block: np.ndarray  # device (KV cache) block id
    chunk: np.ndarray  # host chunk id
    sub: np.ndarray  # sub-block inside the host chunk
    nbytes: np.ndarray  # bytes to copy (a tensor's un-padded page)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


@dataclass
class CopyResult:
    job_id: int
    nbytes: int
    seconds: float


class BlockCopier(abc.ABC):
    def __init__(self, device_tensors: list[torch.Tensor], host_tensors: list[torch.Tensor],
                 blocks_per_chunk: int) -> None:
        if len(device_tensors) != len(host_tensors):
            raise ValueError("one host view per device tensor")
        for d, h in zip(device_tensors, host_tensors):
            if d.dtype != torch.int8 or h.dtype != torch.int8 or d.ndim != 2 or h.ndim != 2:
                raise ValueError("KV tensors and host views must be 2-D int8 (blocks, page bytes)")
            if h.shape[1] != d.shape[1] * blocks_per_chunk or h.stride(1) != 1 or d.stride(1) != 1:
                raise ValueError("a host chunk must hold blocks_per_chunk contiguous device pages")
        self.device = device_tensors
        self.host = host_tensors
        self.blocks_per_chunk = blocks_per_chunk

    def _host_pages(self, t: int) -> torch.Tensor:
        """(num_chunks, blocks_per_chunk, page) view of host tensor ``t``."""
        h, page = self.host[t], self.device[t].shape[1]
        return h.as_strided((h.shape[0], self.blocks_per_chunk, page), (h.stride(0), page, 1))

    @abc.abstractmethod
    def submit(self, job_id: int, ops: CopyOps, to_host: bool) -> None:
        """Start copying; ``to_host`` stores device pages into host chunks, else loads them back."""

    @abc.abstractmethod
    def finished(self) -> list[CopyResult]:
        """Jobs completed since the last call, in submission order."""

    @abc.abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs have completed."""

    def close(self) -> None:
        """Drop the tensor views, so the memory behind the host views can be unmapped."""
        self.device, self.host = [], []


class HostCopier(BlockCopier):
    """KV cache in host memory: copy at submit, one indexed copy per tensor."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._done: list[CopyResult] = []

    def submit(self, job_id: int, ops: CopyOps, to_host: bool) -> None:
        t0 = time.perf_counter()
        for t in np.unique(ops.tensor):
            sel = ops.tensor == t
            blocks = torch.from_numpy(ops.block[sel].astype(np.int64))
            chunks = torch.from_numpy(ops.chunk[sel].astype(np.int64))
            subs = torch.from_numpy(ops.sub[sel].astype(np.int64))
            sizes = ops.nbytes[sel]
            dev, host = self.device[t], self._host_pages(int(t))
            n = int(sizes[0])
            if (sizes == n).all():
                if to_host:
                    host[chunks, subs, :n] = dev[blocks, :n]
                else:
                    dev[blocks, :n] = host[chunks, subs, :n]
                continue
            for b, c, s, size in zip(blocks.tolist(), chunks.tolist(), subs.tolist(), sizes.tolist()):
                if to_host:
                    host[c, s, :size].copy_(dev[b, :size])
                else:
                    dev[b, :size].copy_(host[c, s, :size])
        self._done.append(CopyResult(job_id, ops.total_bytes, time.perf_counter() - t0))

    def finished(self) -> list[CopyResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # copies complete at submit


@dataclass
class _CudaJob:
    job_id: int
    nbytes: int
    start: torch.cuda.Event
    end: torch.cuda.Event


class CudaCopier(BlockCopier):
    """KV cache on a GPU: async copies from/to page-locked host chunks on a side stream."""

    def __init__(self, device_tensors: list[torch.Tensor], host_tensors: list[torch.Tensor],
                 blocks_per_chunk: int, host_region: tuple[int, int] | None = None) -> None:
        super().__init__(device_tensors, host_tensors, blocks_per_chunk)
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopier needs CUDA")
        self.stream = torch.cuda.Stream(device=device_tensors[0].device)
        self._jobs: deque[_CudaJob] = deque()
        self._registered: int | None = None
        if host_region is not None:  # (address, bytes) of the host buffers: pin them once
            addr, size = host_region
            rc = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
            if int(rc) != 0:
                log.warning("cudaHostRegister of %d B failed (%s): host copies stay synchronous", size, rc)
            else:
                self._registered = addr

    def submit(self, job_id: int, ops: CopyOps, to_host: bool) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Stores read KV the model just wrote; loads overwrite blocks the model may still touch.
        self.stream.wait_stream(torch.cuda.current_stream(self.device[0].device))
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for t in np.unique(ops.tensor):
                sel = ops.tensor == t
                dev, host = self.device[int(t)], self._host_pages(int(t))
                for b, c, s, size in zip(ops.block[sel].tolist(), ops.chunk[sel].tolist(), ops.sub[sel].tolist(),
                                         ops.nbytes[sel].tolist()):
                    if to_host:
                        host[c, s, :size].copy_(dev[b, :size], non_blocking=True)
                    else:
                        dev[b, :size].copy_(host[c, s, :size], non_blocking=True)
            end.record(self.stream)
        self._jobs.append(_CudaJob(job_id, ops.total_bytes, start, end))

    def finished(self) -> list[CopyResult]:
        out = []
        while self._jobs and self._jobs[0].end.query():  # one stream: completion is in order
            j = self._jobs.popleft()
            out.append(CopyResult(j.job_id, j.nbytes, j.start.elapsed_time(j.end) / 1e3))
        return out

    def wait(self, job_ids: set[int]) -> None:
        for j in list(self._jobs):
            if j.job_id in job_ids:
                j.end.synchronize()

    def close(self) -> None:
        self.stream.synchronize()
        self._jobs.clear()
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        super().close()


def make_copier(device_tensors: list[torch.Tensor], host_tensors: list[torch.Tensor], blocks_per_chunk: int,
                host_region: tuple[int, int] | None = None) -> BlockCopier:
    """The copier for where the KV cache lives."""
    if device_tensors and device_tensors[0].is_cuda:
        return CudaCopier(device_tensors, host_tensors, blocks_per_chunk, host_region)
    if device_tensors and device_tensors[0].device.type != "cpu":
        raise NotImplementedError(f"KV cache on {device_tensors[0].device}: only CPU and CUDA are supported")
    return HostCopier(device_tensors, host_tensors, blocks_per_chunk)
