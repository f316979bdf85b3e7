"""``KVSwarmOffloadingSpec``: vLLM's tiered offloading with kvswarm as the SSD tier, on CPU or GPU.

Loaded by vLLM's ``OffloadingConnector`` from ``kv_connector_extra_config``::

    {"spec_name": "KVSwarmOffloadingSpec", "spec_module_path": "kvswarm.integrations.vllm",
     "cpu_bytes_to_use": 4294967296,
     "kvswarm": {"drives": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"], "capacity_per_drive": 68719476736}}

It is vLLM's ``TieringOffloadingSpec`` (CPU primary tier + secondary tiers) with three changes: the
``kvswarm`` section becomes a :class:`~kvswarm.integrations.vllm.tier.KVSwarmTierManager` secondary
tier; the scheduler-side manager is :class:`~kvswarm.integrations.vllm.promotion.InlinePromotionManager`
(vLLM's, completing a promotion from the kvswarm tier within the lookup that finds the chunk); and the
worker is :class:`~kvswarm.integrations.vllm.worker.KVSwarmOffloadingWorker`, which also runs where
vLLM's CUDA/XPU-only worker does not (the CPU backend).

``CPUTieringOffloadingSpec`` is the same without the ``kvswarm`` section: vLLM's own secondary
tiers (its ``fs`` tier) under the same worker, on the CPU backend too.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvswarm.integrations.vllm.promotion import InlinePromotionManager
from kvswarm.integrations.vllm.tier import MODULE_PATH, TIER_TYPE
from kvswarm.integrations.vllm.worker import KVSwarmOffloadingWorker


def with_kvswarm_tier(extra_config: dict) -> dict:
    """``extra_config`` with its ``kvswarm`` section turned into a secondary-tier entry."""
    extra = dict(extra_config)
    tiers = [dict(t) for t in extra.get("secondary_tiers", [])]
    section = extra.pop("kvswarm", None)
    if section is not None:
        if "drives" not in section:
            raise ValueError("kv_connector_extra_config.kvswarm needs 'drives': a list of directories or devices")
        if not any(t.get("type") == TIER_TYPE for t in tiers):
            tiers.append({"type": TIER_TYPE, "module_path": MODULE_PATH, **section})
    if not any(t.get("type") == TIER_TYPE for t in tiers):
        raise ValueError("KVSwarmOffloadingSpec needs a 'kvswarm' section (or a KVSwarmTierManager secondary tier)")
    extra["secondary_tiers"] = tiers
    return extra


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (any secondary tiers, vLLM's fs tier included) with kvswarm's
    worker, so that it also runs on vLLM's CPU backend (``spec_name: "CPUTieringOffloadingSpec"``).
    Its manager is :class:`~kvswarm.integrations.vllm.promotion.InlinePromotionManager`, which promotes
    exactly as vLLM's does from tiers that cannot bound a wait (vLLM's fs tier) and within the lookup from
    those that can (kvswarm's).  Tiers compared under it differ in the tier alone: same worker, same
    primary region, same manager."""

    def __init__(self, config: OffloadingConfig) -> None:
        if config.canonical_layout:
            raise ValueError(f"{type(self).__name__} stores each worker's direct layout; drop canonical_layout")
        super().__init__(config)
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        manager = super().get_manager()
        if type(manager) is TieringOffloadingManager:  # built by vLLM's spec: same tiers, our manager
            manager = self._manager = InlinePromotionManager(manager.primary_tier, manager.secondary_tiers)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._worker = KVSwarmOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
            except Exception:
                region.cleanup()
                raise
        return self._worker


class KVSwarmOffloadingSpec(CPUTieringOffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(dataclasses.replace(config, extra_config=with_kvswarm_tier(config.extra_config)))
