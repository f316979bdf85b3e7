"""Which tier serves each block reference of a workload, for any DRAM / SSD / HDD capacity.

The hierarchy is the one of the tiered store: the SSD pool and the capacity (HDD) pool
form an exclusive chain (blocks evicted from SSD are demoted to HDD), and DRAM is an
inclusive cache in front (every block is written through to the first pool; a hit is
promoted to DRAM).  Under LRU at every level, the most recent blocks sit highest, so one
pass of exact LRU stack distances (Mattson et al., 1970) gives the serving tier of every
reference for every capacity vector at once: distance < C_dram -> DRAM, < C_ssd -> SSD,
< C_ssd + C_hdd -> HDD, else a miss.  A request uses only its longest cached prefix
(as the store's lookup does), so a block after the first miss is a miss too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvswarm.planner.workload import Workload

DRAM, SSD, HDD, MISS = 0, 1, 2, 3
TIER_NAMES = ("dram", "ssd", "hdd", "miss")


def stack_distances(ids: np.ndarray) -> np.ndarray:
    """Per reference: distinct other blocks used since its block's previous use; -1 on first use.

    A Fenwick tree over time marks each block's latest use; a reference's distance is the
    number of marks after its previous use.  O(n log n).
    """
    n = len(ids)
    _, inv = np.unique(ids, return_inverse=True)
    tree = [0] * (n + 1)
    last = [-1] * (int(inv.max()) + 1 if n else 0)
    out = [-1] * n
    live = 0
    for i, b in enumerate(inv.tolist()):
        j = last[b]
        if j >= 0:
            s, k = 0, j + 1
            while k > 0:
                s += tree[k]
                k -= k & -k
            out[i] = live - s
            k = j + 1
            while k <= n:
                tree[k] -= 1
                k += k & -k
            live -= 1
        k = i + 1
        while k <= n:
            tree[k] += 1
            k += k & -k
        live += 1
        last[b] = i
    return np.asarray(out, dtype=np.int64)


@dataclass(frozen=True)
class TierCaps:
    """Tier capacities in blocks."""

    dram: int = 0
    ssd: int = 0
    hdd: int = 0

    def __post_init__(self) -> None:
        if min(self.dram, self.ssd, self.hdd) < 0:
            raise ValueError(f"tier capacities must be >= 0, got {self}")


class LRUHits:
    """Serving tier of every reference of ``workload`` under LRU, for any :class:`TierCaps`."""

    policy = "lru"

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        ids, self.req, self.pos = workload.refs()
        self.dist = stack_distances(ids)
        # First reference of each request, to cut at the first miss (longest cached prefix).
        self.n_requests = workload.requests

    def served(self, caps: TierCaps) -> np.ndarray:
        """Per reference: DRAM, SSD, HDD or MISS (prefix rule applied)."""
        d = self.dist
        tier = np.full(len(d), MISS, np.int8)
        seen = d >= 0
        pools = caps.ssd + caps.hdd
        tier[seen & (d < pools)] = HDD
        tier[seen & (d < caps.ssd)] = SSD
        tier[seen & (d < caps.dram)] = DRAM  # DRAM is inclusive: it shadows the pools
        return _prefix_cut(tier, self.req)

    def hit_rate_curve(self, capacities: np.ndarray) -> np.ndarray:
        """Hit rate of one LRU cache (no prefix cut) for each capacity in blocks."""
        d = np.sort(self.dist[self.dist >= 0])
        return np.searchsorted(d, capacities, side="left") / max(1, len(self.dist))

    def capacity_for(self, share_of_ideal: float) -> int:
        """Smallest LRU capacity in blocks whose hit rate reaches ``share_of_ideal`` of the infinite cache's."""
        d = np.sort(self.dist[self.dist >= 0])
        if not len(d):
            return 0
        k = int(np.ceil(share_of_ideal * len(d))) - 1
        return int(d[max(0, k)]) + 1


def _prefix_cut(tier: np.ndarray, req: np.ndarray) -> np.ndarray:
    """Make every reference after a request's first miss a miss."""
    miss = tier == MISS
    # cumulative count of misses within each request
    csum = np.cumsum(miss)
    starts = np.r_[0, np.flatnonzero(np.diff(req)) + 1]
    base = np.repeat(csum[starts] - miss[starts], np.diff(np.r_[starts, len(req)]))
    out = tier.copy()
    out[(csum - base) > 0] = MISS
    return out


def per_request(tier: np.ndarray, req: np.ndarray, n_requests: int) -> np.ndarray:
    """(n_requests, 4) block counts served by DRAM, SSD, HDD and missed."""
    idx = req.astype(np.int64) * 4 + tier
    return np.bincount(idx, minlength=n_requests * 4).reshape(n_requests, 4)
