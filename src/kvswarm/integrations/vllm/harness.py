"""Drive vLLM secondary tiers outside an engine, through vLLM's own tier interfaces.

The benchmark and the tier tests build tiers exactly as vLLM's ``TieringOffloadingSpec``
does (``SecondaryTierFactory.create_secondary_tier`` over a primary-tier view) and call
them as its scheduler-side manager does: ``lookup`` (retrying RETRY across
``on_schedule_end``), ``submit_store`` / ``submit_load`` with ``TransferJob`` s, and
``get_finished_jobs`` polling.  vLLM's fs tier and kvswarm's tier go through the same
calls on the same primary chunks.
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvswarm.layout import KVLayout

_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def offloading_config(layout: KVLayout, cpu_bytes: int, engine_id: str = "kvswarm-harness",
                      extra: dict | None = None) -> OffloadingConfig:
    """vLLM's offloading config for a one-worker engine whose chunks are ``layout`` blocks
    (``extra``: more of ``kv_connector_extra_config``, e.g. ``secondary_tiers``)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(layout.tokens_per_block,
                                      tuple(f"model.layers.{i}.self_attn.attn" for i in range(layout.num_layers)), 0),),
        worker_kv_bytes_per_block=layout.block_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_bytes, **(extra or {})}, engine_id=engine_id,
        model=OffloadingModelConfig(name=layout.model_id or "kvswarm-harness", dtype=layout.dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=layout.tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def offloading_spec(layout: KVLayout, cpu_bytes: int, engine_id: str = "kvswarm-harness") -> TieringOffloadingSpec:
    """vLLM's scheduler-side spec for a one-worker engine whose chunks are ``layout`` blocks."""
    return TieringOffloadingSpec(offloading_config(layout, cpu_bytes, engine_id))


_regions = itertools.count()


@dataclass
class Primary:
    """The primary tier's region as vLLM's scheduler side makes it (a ``SharedOffloadRegion``: a
    ``/dev/shm`` file mapped shared, in 4 KiB pages, faulted in), of ``num_chunks`` chunks."""

    region: SharedOffloadRegion
    mm: mmap.mmap
    view: memoryview  # (num_chunks, chunk_bytes), as CPUPrimaryTierOffloadingManager exposes it
    chunk_bytes: int

    @classmethod
    def create(cls, num_chunks: int, chunk_bytes: int) -> Primary:
        # A barrier, as the engine passes one: the file's name goes once it is mapped (nothing left in /dev/shm).
        region = SharedOffloadRegion(engine_id=f"kvswarm-harness-{os.getpid()}-{next(_regions)}",
                                     num_chunks=num_chunks, rank=None, kv_bytes_per_chunk=chunk_bytes,
                                     cpu_page_size=chunk_bytes, barrier=lambda: None)
        return cls(region, region.mmap_obj, region.create_kv_memoryview(), chunk_bytes)

    def chunk(self, i: int) -> np.ndarray:
        return np.frombuffer(self.mm, np.uint8, self.chunk_bytes, i * self.chunk_bytes)

    def close(self) -> None:
        self.view.release()
        self.region.cleanup()


def make_tier(tier_config: dict, primary: Primary, spec: TieringOffloadingSpec) -> SecondaryTierManager:
    """A tier over ``primary``, made as ``TieringOffloadingSpec.get_manager`` makes it (which sets the
    spec's scheduler-side region first)."""
    spec._scheduler_mmap = primary.region
    return SecondaryTierFactory.create_secondary_tier(dict(tier_config), primary.view, spec)


def keys_for(n: int, salt: int = 0) -> list[OffloadKey]:
    """Distinct block keys shaped like vLLM's (32-byte hash + group index)."""
    return [make_offload_key(int(salt).to_bytes(8, "big") + i.to_bytes(24, "big"), 0) for i in range(n)]


class JobRunner:
    """Submits jobs and polls a tier as vLLM's tiering manager does."""

    def __init__(self, tier: SecondaryTierManager) -> None:
        self.tier = tier
        self._next = 0
        self.ctx = ReqContext(req_id="harness")

    def submit(self, keys: Sequence[OffloadKey], chunks: Sequence[int], load: bool) -> int:
        self._next += 1
        job = TransferJob(self._next, list(keys), np.asarray(chunks, dtype=np.int32), load, self.ctx)
        (self.tier.submit_load if load else self.tier.submit_store)(job)
        return self._next

    def wait(self, job_ids: Sequence[int], timeout: float = 600.0) -> dict[int, JobResult]:
        want, got = set(job_ids), {}
        deadline = time.perf_counter() + timeout
        while want - got.keys():
            for r in self.tier.get_finished_jobs():
                got[r.job_id] = r
            if want - got.keys():
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"jobs {sorted(want - got.keys())} did not finish")
                self.tier.on_schedule_end(_END)
                time.sleep(0.0005)  # about a scheduler step: vLLM polls tiers once per step
        return got

    def run(self, keys: Sequence[OffloadKey], chunks: Sequence[int], load: bool) -> JobResult:
        return self.wait([self.submit(keys, chunks, load)])[self._next]

    def lookup(self, keys: Sequence[OffloadKey], timeout: float = 600.0) -> list[LookupResult]:
        """Resolve every key (RETRY is polled again after a scheduler step, as vLLM does)."""
        self.tier.on_new_request(self.ctx)
        out: list[LookupResult | None] = [None] * len(keys)
        deadline = time.perf_counter() + timeout
        todo = list(range(len(keys)))
        while todo:
            left = []
            for i in todo:
                r = self.tier.lookup(keys[i], self.ctx)
                if r is LookupResult.RETRY:
                    left.append(i)
                else:
                    out[i] = r
            todo = left
            if todo:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{len(todo)} lookups still RETRY")
                self.tier.on_schedule_end(_END)
                time.sleep(0.0005)  # about a scheduler step: vLLM polls tiers once per step
        self.tier.on_request_finished(self.ctx)
        return out  # type: ignore[return-value]
