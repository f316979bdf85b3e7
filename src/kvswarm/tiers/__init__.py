"""Tiers: DRAM above an SSD pool above a capacity pool, driven by swappable policies.

Pure decisions (no I/O; the simulator and planner import these):
:mod:`~kvswarm.tiers.eviction` (LRU, ARC, S3-FIFO), :mod:`~kvswarm.tiers.admission`
(write-through, write-back, selective), :mod:`~kvswarm.tiers.demotion` (drop, always,
cost-aware), :mod:`~kvswarm.tiers.costs` (drive and recompute models),
:mod:`~kvswarm.tiers.prefetch` (best_effort / wait_complete / timeout) and
:mod:`~kvswarm.tiers.director`, which combines them into actions.

Execution on real drives: :mod:`~kvswarm.tiers.pools` (pools of drive paths),
:mod:`~kvswarm.tiers.dram` (the DRAM tier), :mod:`~kvswarm.tiers.manager` (TierManager).
"""

from kvswarm.tiers.admission import Selective, WriteBack, WritePolicy, WriteThrough, make_write_policy
from kvswarm.tiers.costs import DRIVE_CLASSES, ComputeModel, DriveCost
from kvswarm.tiers.demotion import AlwaysDemote, BlockInfo, CostAware, DemotionPolicy, NeverDemote, make_demotion
from kvswarm.tiers.director import TIERS, Action, Copy, Drop, Tier, TierDirector
from kvswarm.tiers.eviction import ARC, LRU, S3FIFO, EvictionPolicy, make_eviction
from kvswarm.tiers.prefetch import PrefetchPolicy

__all__ = [
    "ARC", "LRU", "S3FIFO", "DRIVE_CLASSES", "TIERS", "Action", "AlwaysDemote", "BlockInfo", "ComputeModel",
    "Copy", "CostAware", "DemotionPolicy", "DriveCost", "Drop", "EvictionPolicy", "NeverDemote", "PrefetchPolicy",
    "Selective", "Tier", "TierDirector", "WriteBack", "WritePolicy", "WriteThrough", "make_demotion",
    "make_eviction", "make_write_policy",
]
