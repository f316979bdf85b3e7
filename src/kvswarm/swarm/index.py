"""The cluster index: a selector that picks whole co-activation clusters per decode step.

DRAM holds, per layer, one representative per cluster, never all keys:

* ``score="medoid"`` (the Swarm paper): each cluster's medoid key.  A cluster's attention mass
  is estimated as if every member had the medoid's logit (``|c| * exp(logit)``, normalised with
  the resident entries), per query head, summed over heads.
* ``score="pq"`` (kvswarm): product-quantized codes of every entry (the k-means/PQ index of
  :mod:`kvswarm.sparse.kmeans`, a few percent of the keys); a cluster's estimate is the sum
  of its members' approximate attention mass.

Clusters are taken by decreasing estimated mass per entry (``pick="density"``, the greedy
knapsack answer to "most mass for the bytes") or by mass (``pick="mass"``) until ``budget``
entries are covered (``mode="topk"``), or every cluster whose estimate reaches ``threshold``
of the estimated offloaded mass is taken (``mode="threshold"``).  The selection is the union
of the chosen clusters' members; ``last`` keeps the chosen cluster ids for the retrieval path.

With a :class:`LayerAllocation` (``alloc``), the step's budget is split over the layers by how
concentrated each layer's attention was in the profile: a layer whose top entries hold most of
its mass gets fewer entries, a diffuse one more, for the same total (the greedy answer to "most
mean recall for the bytes").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvswarm.sparse.base import Selection, Selector, StepQuery, gqa_logits, head_lse, register
from kvswarm.sparse.kmeans import KMeansPQSelector
from kvswarm.swarm.cluster import Clusters

ClusterSource = Callable[[int], Clusters]  # layer -> that layer's clusters


@register
class ClusterSelector(Selector):
    name = "swarm"

    def __init__(self, clusters: ClusterSource | dict[int, Clusters] | None = None, score: str = "medoid",
                 pick: str = "density", mode: str = "topk", threshold: float = 0.01, centroids: int = 64,
                 subspaces: int = 2, pq: KMeansPQSelector | None = None, history: float = 0.0,
                 decay: float = 0.5, alloc: LayerAllocation | None = None) -> None:
        if score not in ("medoid", "pq") or pick not in ("density", "mass") or mode not in ("topk", "threshold"):
            raise ValueError(f"bad ClusterSelector options score={score!r} pick={pick!r} mode={mode!r}")
        self._source = clusters.__getitem__ if isinstance(clusters, dict) else clusters
        self.score, self.pick, self.mode, self.threshold = score, pick, mode, threshold
        self.alloc = alloc
        # history > 0: blend each cluster's estimate with the attention mass its members actually got
        # when last attended (exponential average, ``decay`` per observation): activations are stable
        # from step to step, so what a cluster drew last time predicts it better than codes alone.
        self.history, self.decay = history, decay
        self.wants_feedback = history > 0
        self._hist: dict[int, np.ndarray] = {}
        self._seen: dict[int, np.ndarray] = {}
        self._owner: dict[int, np.ndarray] = {}
        # ``pq``: an index the caller already built over the same keys (shared with a PQ selector).
        self._pq = (pq or KMeansPQSelector(centroids, subspaces)) if score == "pq" else None
        self._pq_shared = pq is not None
        self._clusters: dict[int, Clusters] = {}
        self._medoid_keys: dict[int, torch.Tensor] = {}
        self._member_idx: dict[int, torch.Tensor] = {}  # concatenated member indices (into positions)
        self._seg: dict[int, torch.Tensor] = {}  # cluster id of each concatenated member
        self._sizes: dict[int, torch.Tensor] = {}
        self._base: dict[int, int] = {}
        self._overlap: dict[int, bool] = {}
        self.last: dict[int, np.ndarray] = {}

    def bind(self, source) -> None:
        """Without explicit clusters, use the ones a SwarmSequence stored the entries by."""
        if self._source is None and hasattr(source, "layouts"):
            self._source = lambda layer: source.layouts[layer].clusters

    def build(self, layer: int, keys: torch.Tensor, positions: np.ndarray) -> None:
        if self._source is None:
            raise ValueError("ClusterSelector needs each layer's clusters (a co-activation profile or a "
                             "SwarmSequence to bind to)")
        cl = self._source(layer)
        positions = np.asarray(positions, np.int64)
        base = int(positions[0]) if len(positions) else 0
        if len(positions) and not np.array_equal(positions, np.arange(base, base + len(positions))):
            raise ValueError("ClusterSelector expects the offloaded positions to be one contiguous range")
        self._clusters[layer], self._base[layer] = cl, base
        self._overlap[layer] = cl.overlapping
        med = torch.from_numpy(cl.medoids - base)
        self._medoid_keys[layer] = keys.to(torch.float32).index_select(1, med).contiguous()
        self._sizes[layer] = torch.from_numpy(cl.sizes.astype(np.float32))
        if self.history > 0:
            self._hist[layer] = np.zeros(len(cl))
            self._seen[layer] = np.zeros(len(cl), bool)
            owner = np.full(int(max(m.max() for m in cl.members)) + 1, -1, np.int64)
            for c, m in enumerate(cl.members):
                owner[m] = c
            self._owner[layer] = owner
        if self._pq is not None:
            if not self._pq_shared:
                self._pq.build(layer, keys, positions)
            self._member_idx[layer] = torch.from_numpy(np.concatenate(cl.members) - base)
            self._seg[layer] = torch.from_numpy(np.repeat(np.arange(len(cl)), cl.sizes))

    def cluster_mass(self, q: StepQuery) -> torch.Tensor:
        """Estimated attention mass of each cluster (summed over query heads)."""
        res = gqa_logits(q.query, q.resident_keys, q.scale)
        if self._pq is None:
            ml = gqa_logits(q.query, self._medoid_keys[q.layer], q.scale) + torch.log(self._sizes[q.layer])[None]
            return torch.exp(ml - head_lse(ml, res)[:, None]).sum(0)
        off = self._pq.approx_logits(q)
        mass = torch.exp(off - head_lse(off, res)[:, None]).sum(0)
        out = torch.zeros(len(self._sizes[q.layer]))
        return out.index_add_(0, self._seg[q.layer], mass[self._member_idx[q.layer]])

    def feedback(self, layer: int, step: int, positions: np.ndarray, mass: np.ndarray) -> None:
        if self.history <= 0 or layer not in self._hist:
            return
        owner = self._owner[layer]
        pos = np.asarray(positions, np.int64)
        ok = pos < len(owner)
        c = owner[pos[ok]]
        keep = c >= 0
        got = np.bincount(c[keep], weights=np.asarray(mass, np.float64)[ok][keep], minlength=len(self._hist[layer]))
        seen = np.bincount(c[keep], minlength=len(self._hist[layer])) > 0
        h = self._hist[layer]
        h[seen] = np.where(self._seen[layer][seen], (1 - self.decay) * h[seen] + self.decay * got[seen], got[seen])
        self._seen[layer] |= seen

    def select(self, q: StepQuery, budget: int) -> Selection:
        cl = self._clusters[q.layer]
        est = self.cluster_mass(q)
        if self.history > 0 and self._seen[q.layer].any():
            seen = torch.from_numpy(self._seen[q.layer])
            hist = torch.from_numpy(self._hist[q.layer]).to(est.dtype)
            est = torch.where(seen, (1 - self.history) * est + self.history * hist, est)
        sizes = self._sizes[q.layer]
        if self.alloc is not None:
            budget = self.alloc.budget(q.layer, budget)
        if self.mode == "threshold":
            chosen = torch.nonzero(est >= self.threshold * est.sum()).ravel().numpy()
        else:
            key = est / sizes if self.pick == "density" else est
            order = torch.argsort(key, descending=True).numpy()
            chosen = _cover(cl, order, budget, self._overlap[q.layer])
        self.last[q.layer] = np.sort(chosen)
        pos = np.concatenate([cl.members[c] for c in chosen]) if len(chosen) else np.zeros(0, np.int64)
        sc = np.concatenate([np.full(len(cl.members[c]), float(est[c]) / len(cl.members[c]), np.float32)
                             for c in chosen]) if len(chosen) else np.zeros(0, np.float32)
        pos, first = np.unique(pos, return_index=True)  # overlapping clusters: each entry once
        return Selection(pos, sc[first])

    def index_bytes(self) -> int:
        n = sum(k.numel() * 4 for k in self._medoid_keys.values())
        return n + (self._pq.index_bytes() if self._pq is not None else 0)

    def describe(self) -> str:
        h = f",history={self.history:g}" if self.history > 0 else ""
        a = ",alloc" if self.alloc is not None else ""
        return f"swarm({self.score},{self.pick},{self.mode}{h}{a})"


class LayerAllocation:
    """Per-layer share of a decode step's entry budget, from a profile of exact attention.

    ``curves[layer, r]`` is the mean (over profile steps) share of the layer's offloaded mass held
    by its ``r``-th heaviest entry.  For a mean budget of ``b`` entries per layer, the
    ``layers * b`` largest values over all layers are taken (the marginal recall of one more entry
    falls with rank, so this maximises the summed recall); each layer gets the count of its own,
    at least ``floor * b``, rescaled to the total."""

    def __init__(self, curves: np.ndarray, floor: float = 0.25) -> None:
        self.curves = np.asarray(curves, np.float64)
        self.floor = floor
        self._memo: dict[int, np.ndarray] = {}

    @classmethod
    def from_profile(cls, mass: np.ndarray, floor: float = 0.25) -> LayerAllocation:
        """``mass[steps, layers, n]``: exact attention mass of the offloaded entries per profile step."""
        share = mass / np.maximum(mass.sum(2, keepdims=True), 1e-30)
        return cls(-np.sort(-share, axis=2).mean(0), floor)

    def budgets(self, budget: int) -> np.ndarray:
        if budget not in self._memo:
            layers, n = self.curves.shape
            b = min(budget, n)
            low = min(b, max(1, int(self.floor * b)))  # every layer's floor, then the rest greedily
            rest = self.curves[:, low:]
            more = layers * (b - low)
            k = np.full(layers, low, np.int64)
            if more > 0 and rest.size:
                top = np.argpartition(-rest.ravel(), more - 1)[:more]
                k += np.bincount(top // rest.shape[1], minlength=layers)
            self._memo[budget] = k
        return self._memo[budget]

    def budget(self, layer: int, budget: int) -> int:
        return int(self.budgets(int(budget))[layer]) if layer < len(self.curves) else budget


def _cover(cl: Clusters, order: np.ndarray, budget: int, overlapping: bool) -> np.ndarray:
    """The prefix of ``order`` whose clusters cover at least ``budget`` distinct entries."""
    if not overlapping:
        return order[:int(np.searchsorted(np.cumsum(cl.sizes[order]), budget)) + 1]
    seen: set[int] = set()
    for i, c in enumerate(order.tolist()):
        seen.update(cl.members[c].tolist())
        if len(seen) >= budget:
            return order[:i + 1]
    return order
