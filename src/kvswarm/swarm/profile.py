"""kvswarm's pipeline from a decode's attention to a stored layout: profile, clusters, placement, preload.

1. :class:`Profiler` watches a dense decode (a ``StepObserver`` of ``OffloadedKVCache``) and keeps,
   per step and layer, the exact attention mass of every offloaded entry (summed over query heads)
   and the query.  Its first steps are the co-activation profile; the queries of later steps let a
   caller score any selector against the exact attention.
2. :func:`coactivation_layouts` clusters each layer's profile activations (the exact top
   ``sparsity`` entries per step) and places the clusters over the drives (``plan_layout``,
   ``balanced``: co-activated clusters on different drives, replicas for the hottest).
3. :func:`preload_from_profile` fills a DRAM cache (``UnitCache``) with the pieces that held the
   most profile attention per entry, all layers ranked together, each with its profile read count
   (the cost-benefit policy's frequencies): the state that policy reaches after many steps, known
   at prefill.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import sparse

from kvswarm.sparse.base import StepQuery, attention_mass, budget_for, gqa_logits, head_lse
from kvswarm.swarm.cluster import Clusters, make_clusterer
from kvswarm.swarm.coact import cograph, incidence
from kvswarm.swarm.layout import LayerLayout, plan_layout
from kvswarm.swarm.retrieval import DriveModel, UnitCache


class Profiler:
    """Exact attention mass of the offloaded entries ``off`` (keys ``keys[layer]`` [kvh, n, d]) at
    every (step, layer) of a dense decode, and each step's query; steps are counted from 0."""

    def __init__(self, keys: list[torch.Tensor], off: np.ndarray) -> None:
        self.keys, self.off = keys, np.asarray(off, np.int64)
        self.mass: dict[tuple[int, int], np.ndarray] = {}
        self.queries: dict[tuple[int, int], StepQuery] = {}

    def on_select(self, q: StepQuery, sel) -> None:
        lo = gqa_logits(q.query, self.keys[q.layer], q.scale)
        lr = gqa_logits(q.query, q.resident_keys, q.scale)
        self.mass[(q.step, q.layer)] = attention_mass(lo, head_lse(lo, lr)).numpy()
        self.queries[(q.step, q.layer)] = q

    @property
    def steps(self) -> int:
        return 1 + max(s for s, _ in self.mass) if self.mass else 0

    def mass_array(self, steps: range) -> np.ndarray:
        """[steps, layers, n] mass of the offloaded entries."""
        return np.stack([np.stack([self.mass[(s, layer)] for layer in range(len(self.keys))]) for s in steps])

    def recall(self, step: int, layer: int, positions: np.ndarray) -> float:
        """Share of the offloaded attention mass at (step, layer) that attending ``positions`` holds."""
        m = self.mass[(step, layer)]
        tot = m.sum()
        return float(m[np.asarray(positions, np.int64) - self.off[0]].sum() / tot) if tot > 0 else 1.0

    def incidence(self, layer: int, steps: range, universe: int, sparsity: float = 0.1) -> sparse.csr_matrix:
        """[steps, universe] 0/1: the exact top-``sparsity`` offloaded entries of each profile step."""
        k = budget_for(sparsity, len(self.off))
        sets = [self.off[np.argpartition(-self.mass[(s, layer)], k - 1)[:k]] for s in steps]
        return incidence(sets, universe)


def coactivation_layouts(profiler: Profiler, steps: range, universe: int, drives: int, entry_bytes: int,
                         model: DriveModel, *, size: int = 12, piece_bytes: int = 48 << 10,
                         replicate: float = 0.15, sparsity: float = 0.1,
                         neighbours: int = 32) -> tuple[dict[int, Clusters], list[LayerLayout]]:
    """Per layer: ``partition`` clusters of ``size`` entries from the profile's activations, placed
    ``balanced`` over ``drives`` with ``replicate`` of the bytes as replicas of the hottest."""
    clusterer = make_clusterer("partition", size=size)
    cost = lambda b: max(b / model.read_bps, 1 / model.read_iops)  # noqa: E731
    clusters, layouts = {}, []
    for layer in range(len(profiler.keys)):
        x = profiler.incidence(layer, steps, universe, sparsity)
        cl = clusterer.cluster(cograph(x, neighbours), x, profiler.off)
        clusters[layer] = cl
        act = (x @ cl.membership(universe)) > 0
        layouts.append(plan_layout(cl, drives, entry_bytes, mode="balanced", piece_bytes=piece_bytes,
                                   max_piece_entries=max(1, ((1 << 20) - 64) // entry_bytes),
                                   replicate=replicate, activity=act, cost=cost))
    return clusters, layouts


def preload_from_profile(cache: UnitCache, layouts: list[LayerLayout], mass: np.ndarray,
                         active: list[sparse.csr_matrix], off: np.ndarray, universe: int) -> None:
    """Preload ``cache`` with the pieces holding the most profile attention per entry (all layers
    ranked together; a piece that does not fit is skipped, smaller ones may), each with the number
    of profile steps it held an active entry as its read count.  ``mass`` [steps, layers, n] over
    ``off``; ``active[layer]`` [steps, universe] the profile's activations."""
    share = mass / np.maximum(mass.sum(2, keepdims=True), 1e-30)
    dens, keys, reads = [], [], []
    for layer, lay in enumerate(layouts):
        hold = lay.holders(universe)[off]  # [n, pieces]
        sizes = np.maximum(np.asarray(hold.sum(0)).ravel(), 1)
        dens.append(np.asarray(share[:, layer].mean(0) @ hold).ravel() / sizes)
        keys.append(np.stack([np.full(len(sizes), layer), np.arange(len(sizes))], 1))
        act = active[layer][:, off] @ hold  # [profile steps, pieces]: active entries held
        reads.append(np.asarray((act > 0).sum(0)).ravel())
    dens_all, keys_all, reads_all = np.concatenate(dens), np.concatenate(keys), np.concatenate(reads)
    for i in np.argsort(-dens_all, kind="stable").tolist():
        cache.preload(int(keys_all[i, 0]), np.array([int(keys_all[i, 1])]), np.array([reads_all[i]]))
