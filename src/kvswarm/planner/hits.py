"""Which tier serves each block reference of a workload, and what each request writes, per capacity.

The hierarchy is the one of the tiered store: the SSD pool and the capacity (HDD) pool
form an exclusive chain (blocks evicted from SSD are demoted to HDD), and DRAM is an
inclusive cache in front (every block is written through to the first pool; a hit is
promoted to DRAM).  Under LRU at every level, the most recent blocks sit highest, so one
pass of exact LRU stack distances (Mattson et al., 1970) gives the serving tier of every
reference for every capacity vector at once: distance < C_dram -> DRAM, < C_ssd -> SSD,
< C_ssd + C_hdd -> HDD, else a miss.  A request uses only its longest cached prefix
(as the store's lookup does), so a block after the first miss is a miss too.

That closed form (:class:`LRUHits`) screens thousands of mixes.  :class:`DirectorHits`
replays the workload through the tiers' own :class:`~kvswarm.tiers.TierDirector` (the
eviction, write and demotion strategies the real TierManager executes: LRU, ARC, S3-FIFO;
write-through, write-back, selective; always, drop, cost-aware) and is used for the
finalists, with exact write traffic per tier.
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

    def writes(self, caps: TierCaps) -> np.ndarray:
        """(n_requests, 2) blocks each request writes to the SSD pool and the HDD pool, estimated
        for write-through and always-demote: every block computed or read from HDD is written to
        SSD; once the SSD pool is full each write there demotes one block to HDD."""
        tier = self.served(caps)
        counts = per_request(tier, self.req, self.n_requests)
        ssd = (counts[:, MISS] + counts[:, HDD]) if caps.ssd else np.zeros(self.n_requests, np.int64)
        out = np.zeros((self.n_requests, 2), np.float64)
        out[:, 0] = ssd
        total = ssd.sum()
        if caps.hdd and total:
            out[:, 1] = ssd * max(0.0, 1.0 - caps.ssd / total)
        return out

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


class DirectorHits:
    """Serving tiers and writes from a replay through :class:`~kvswarm.tiers.TierDirector`.

    Each request looks up its blocks (longest cached prefix), then every block enters DRAM
    (``admit``: from the tier that served it, or computed); the director's Copy actions
    into the SSD and capacity tiers are the request's writes.  Replays are memoised per
    capacity vector.
    """

    def __init__(self, workload: Workload, eviction: str = "lru", write: str = "write-through",
                 demotion: str = "always", demotion_kw: dict | None = None) -> None:
        from kvswarm.tiers import make_eviction, make_write_policy

        make_eviction(eviction, 1)  # unknown names fail here, before any replay
        make_write_policy(write)
        if demotion not in ("always", "drop", "cost-aware"):
            raise ValueError(f"unknown demotion policy {demotion!r}; one of always, drop, cost-aware")
        self.workload, self.eviction, self.write, self.demotion = workload, eviction, write, demotion
        self.demotion_kw = demotion_kw or {}
        _, self.req, self.pos = workload.refs()
        self.n_requests = workload.requests
        self.policy = f"{eviction}, {write}, demotion {demotion}"
        self._cache: dict[TierCaps, tuple[np.ndarray, np.ndarray, dict]] = {}

    def _replay(self, caps: TierCaps) -> tuple[np.ndarray, np.ndarray, dict]:
        if caps in self._cache:
            return self._cache[caps]
        from kvswarm.tiers import Copy, Tier, TierDirector, make_demotion

        if caps.hdd and not caps.ssd:
            raise ValueError("a capacity (HDD) pool needs an SSD pool above it")
        demotion = None
        if caps.hdd:
            demotion = make_demotion(self.demotion, **(self.demotion_kw if self.demotion == "cost-aware" else {}))
        d = TierDirector([caps.dram, caps.ssd, caps.hdd], eviction=self.eviction, write=self.write,
                         demotion=demotion)
        to_code = {Tier.DRAM: DRAM, Tier.SSD: SSD, Tier.CAPACITY: HDD}
        tier = np.full(len(self.req), MISS, np.int8)
        writes = np.zeros((self.n_requests, 2), np.float64)
        pos = 0
        for i, blocks in enumerate(self.workload.blocks):
            keys = blocks.tolist()
            got = d.lookup(keys)
            for j, t in enumerate(got):
                tier[pos + j] = to_code[t]
            w_ssd = w_hdd = 0
            for j, k in enumerate(keys):
                for a in d.admit(k, got[j] if j < len(got) else None):
                    if isinstance(a, Copy):
                        w_ssd += a.dst == Tier.SSD
                        w_hdd += a.dst == Tier.CAPACITY
            writes[i] = (w_ssd, w_hdd)
            pos += len(keys)
        out = (tier, writes, dict(d.counters))
        self._cache[caps] = out
        return out

    def served(self, caps: TierCaps) -> np.ndarray:
        return self._replay(caps)[0]

    def writes(self, caps: TierCaps) -> np.ndarray:
        return self._replay(caps)[1]

    def counters(self, caps: TierCaps) -> dict:
        return self._replay(caps)[2]


def _prefix_cut(tier: np.ndarray, req: np.ndarray) -> np.ndarray:
    """Make every reference after a request's first miss a miss."""
    if not len(tier):
        return tier.copy()
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
