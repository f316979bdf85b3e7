"""Clustering one layer's offloaded entries into units fetched together.

Strategies (``make_clusterer(name, **kw)``), compared by the sparse benchmark:

* ``greedy`` -- the Swarm paper's algorithm: density of an entry = its co-activation
  neighbours within distance ``tau``; medoids are taken by decreasing density; a cluster grows
  from its medoid by adding the candidate with the smallest average distance to the current
  members while that average stays <= ``tau``.  An entry already in a cluster may join another
  (up to ``max_copies`` clusters): overlapping clusters are the paper's selective replication.
* ``greedy`` with ``max_size`` / ``min_size`` -- the same, capped, with leftovers (clusters below
  ``min_size``) regrouped by activation frequency so that singletons do not cost an I/O each.
* ``frequency`` -- entries sorted by activation frequency, cut into groups of ``size``: the hot
  set together (the note's observation that much of co-activation is a hot set).
* ``partition`` -- balanced recursive bisection of the entries' activation profiles (their
  columns of the step x entry incidence, SVD-embedded): frequency and co-activation at once,
  with equal-size parts, like a graph partitioner on the co-activation graph.

Entries never active in the profile ("cold") go into blocks of consecutive positions (the
best one can do without evidence) in every strategy.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy import sparse

from kvswarm.registry import Registry
from kvswarm.swarm.coact import CoGraph


@dataclass
class Clusters:
    """One layer's clusters: member positions (sorted), a medoid each, and which are cold blocks."""

    members: list[np.ndarray]
    medoids: np.ndarray  # int64 position per cluster
    cold: np.ndarray  # bool per cluster: a block of never-active entries
    heat: np.ndarray  # float per cluster: share of profile steps in which any member was active

    def __len__(self) -> int:
        return len(self.members)

    def to_arrays(self, prefix: str = "", suffix: str = "") -> dict[str, np.ndarray]:
        """Named arrays for ``np.savez`` (members concatenated, sizes, medoids, cold, heat)."""
        flat = np.concatenate(self.members) if self.members else np.zeros(0, np.int64)
        return {f"{prefix}m{suffix}": flat, f"{prefix}s{suffix}": self.sizes, f"{prefix}d{suffix}": self.medoids,
                f"{prefix}c{suffix}": self.cold, f"{prefix}h{suffix}": self.heat}

    @classmethod
    def from_arrays(cls, z, prefix: str = "", suffix: str = "") -> Clusters:
        """Inverse of :meth:`to_arrays` (``z``: a loaded npz or a dict)."""
        sizes = z[f"{prefix}s{suffix}"]
        members = np.split(z[f"{prefix}m{suffix}"], np.cumsum(sizes)[:-1]) if len(sizes) else []
        return cls(members, z[f"{prefix}d{suffix}"], z[f"{prefix}c{suffix}"], z[f"{prefix}h{suffix}"])

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(m) for m in self.members], np.int64)

    @property
    def overlapping(self) -> bool:
        """Whether some entry sits in several clusters (selective replication)."""
        total = int(self.sizes.sum())
        return total > len(np.unique(np.concatenate(self.members))) if total else False

    def copies(self, universe: int) -> np.ndarray:
        """How many clusters hold each position (0 = uncovered, >1 = replicated by overlap)."""
        c = np.zeros(universe, np.int32)
        for m in self.members:
            c[m] += 1
        return c

    def membership(self, universe: int) -> sparse.csr_matrix:
        """[universe, clusters] 0/1: which clusters hold each position."""
        rows = np.concatenate(self.members) if self.members else np.zeros(0, np.int64)
        cols = np.repeat(np.arange(len(self.members)), self.sizes)
        return sparse.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(universe, len(self)))


class Clusterer(abc.ABC):
    name: ClassVar[str] = "?"

    def __init__(self, cold_block: int = 16) -> None:
        self.cold_block = cold_block

    @abc.abstractmethod
    def _active_clusters(self, g: CoGraph, x: sparse.csr_matrix, active: np.ndarray) -> list[np.ndarray]:
        """Clusters of the active entries (each active entry in at least one)."""

    def cluster(self, g: CoGraph, x: sparse.csr_matrix, positions: np.ndarray) -> Clusters:
        """Cluster the offloaded ``positions`` given their co-activation graph ``g`` and the
        profile's incidence ``x`` [steps, universe]."""
        positions = np.asarray(positions, np.int64)
        active = positions[g.freq[positions] > 0]
        groups = [np.unique(c) for c in self._active_clusters(g, x, active) if len(c)]
        cold_pos = positions[g.freq[positions] == 0]
        cold = [cold_pos[i:i + self.cold_block] for i in range(0, len(cold_pos), self.cold_block)]
        members = groups + cold
        heat = cluster_heat(x, groups) if groups else np.zeros(0)
        medoids = np.array([_medoid(g, m) for m in groups] + [int(c[len(c) // 2]) for c in cold], np.int64)
        return Clusters(members, medoids, np.array([False] * len(groups) + [True] * len(cold)),
                        np.concatenate([heat, np.zeros(len(cold))]))

    def describe(self) -> str:
        return self.name


def cluster_heat(x: sparse.csr_matrix, groups: list[np.ndarray]) -> np.ndarray:
    """Share of the profile's steps in which each group had an active member."""
    if x.shape[0] == 0:
        return np.zeros(len(groups))
    m = Clusters(groups, np.zeros(len(groups), np.int64), np.zeros(len(groups), bool),
                 np.zeros(len(groups))).membership(x.shape[1])
    return np.asarray(((x @ m) > 0).sum(0)).ravel() / x.shape[0]


def _medoid(g: CoGraph, members: np.ndarray) -> int:
    """The member with the largest co-activation with the others (ties: the most frequent)."""
    if len(members) == 1:
        return int(members[0])
    sub = g.p[members][:, members]
    score = np.asarray(sub.sum(1)).ravel() + 1e-6 * g.freq[members]
    return int(members[int(np.argmax(score))])


# ---- the paper's greedy density clustering --------------------------------------------------
class Greedy(Clusterer):
    name = "greedy"

    def __init__(self, tau: float = 0.5, max_copies: int = 2, max_size: int | None = None, min_size: int = 1,
                 leftover_size: int = 16, cold_block: int = 16) -> None:
        super().__init__(cold_block)
        if not 0 <= tau < 1:
            raise ValueError("tau must be in [0, 1)")
        self.tau, self.max_copies, self.max_size = tau, max_copies, max_size
        self.min_size, self.leftover_size = min_size, leftover_size

    def _active_clusters(self, g, x, active):
        p = g.p
        sim = 1.0 - self.tau
        dens = np.zeros(g.universe, np.int64)
        rows = np.repeat(np.arange(p.shape[0]), np.diff(p.indptr))
        np.add.at(dens, rows[p.data >= sim], 1)
        order = active[np.lexsort((-g.freq[active], -dens[active]))]
        copies = np.zeros(g.universe, np.int32)
        copies[np.setdiff1d(np.arange(g.universe), active)] = self.max_copies  # never join: not ours
        acc = np.zeros(g.universe, np.float64)
        cap = self.max_size or len(active)
        out = []
        for m in order:
            if copies[m]:
                continue
            members = [m]
            copies[m] += 1
            touched = set()
            self._add(p, m, acc, touched)
            while len(members) < cap and touched:
                cand = np.fromiter(touched, np.int64)
                cand = cand[copies[cand] < self.max_copies]
                if not len(cand):
                    break
                j = int(cand[np.argmax(acc[cand])])
                if 1.0 - acc[j] / len(members) > self.tau:
                    break
                members.append(j)
                copies[j] += 1
                touched.discard(j)
                self._add(p, j, acc, touched, members)
            acc[list(touched)] = 0.0
            acc[members] = 0.0
            out.append(np.array(members, np.int64))
        if self.min_size > 1:
            out = _regroup_small(out, g.freq, self.min_size, min(self.leftover_size, cap))
        return out

    @staticmethod
    def _add(p: sparse.csr_matrix, i: int, acc: np.ndarray, touched: set, members: list | None = None) -> None:
        lo, hi = p.indptr[i], p.indptr[i + 1]
        nb = p.indices[lo:hi]
        acc[nb] += p.data[lo:hi]
        touched.update(nb.tolist())
        if members:
            touched.difference_update(members)

    def describe(self) -> str:
        cap = f",max={self.max_size},min={self.min_size}" if self.max_size or self.min_size > 1 else ""
        return f"greedy(tau={self.tau:g},copies={self.max_copies}{cap})"


def _regroup_small(groups: list[np.ndarray], freq: np.ndarray, min_size: int, size: int) -> list[np.ndarray]:
    """Clusters below ``min_size`` are dissolved and their entries regrouped by frequency."""
    keep = [c for c in groups if len(c) >= min_size]
    held = np.zeros(len(freq), bool)
    for c in keep:
        held[c] = True
    loose = np.unique(np.concatenate([c for c in groups if len(c) < min_size] or [np.zeros(0, np.int64)]))
    loose = loose[~held[loose]]
    loose = loose[np.argsort(-freq[loose], kind="stable")]
    return keep + [loose[i:i + size] for i in range(0, len(loose), size)]


# ---- frequency (hot-set) grouping -------------------------------------------------------------
class Frequency(Clusterer):
    name = "frequency"

    def __init__(self, size: int = 16, cold_block: int = 16) -> None:
        super().__init__(cold_block)
        self.size = size

    def _active_clusters(self, g, x, active):
        order = active[np.lexsort((active, -g.freq[active]))]
        return [order[i:i + self.size] for i in range(0, len(order), self.size)]

    def describe(self) -> str:
        return f"frequency({self.size})"


# ---- balanced partition of activation profiles ----------------------------------------------
class Partition(Clusterer):
    """Recursive median bisection along the principal axis of the entries' profile embedding.

    Each active entry's column of the incidence (its on/off pattern over the profile steps) is
    embedded with a truncated SVD (``rank`` dimensions; the first one is essentially frequency);
    a part is split at the median of its own principal direction until it holds <= ``size``.
    Entries active at the same steps land together; parts have equal sizes.
    """

    name = "partition"

    def __init__(self, size: int = 16, rank: int = 8, cold_block: int = 16) -> None:
        super().__init__(cold_block)
        self.size, self.rank = size, rank

    def _active_clusters(self, g, x, active):
        if not len(active):
            return []
        cols = x.tocsc()[:, active].toarray().astype(np.float64)  # [steps, active]
        r = max(1, min(self.rank, *cols.shape))
        u, s, vt = np.linalg.svd(cols, full_matrices=False)
        emb = (vt[:r] * s[:r, None]).T  # [active, r]
        out: list[np.ndarray] = []
        stack = [np.arange(len(active))]
        while stack:
            idx = stack.pop()
            if len(idx) <= self.size:
                out.append(active[idx])
                continue
            e = emb[idx] - emb[idx].mean(0)
            axis = np.linalg.svd(e, full_matrices=False)[2][0] if e.any() else np.eye(r)[0]
            proj = e @ axis
            order = idx[np.argsort(proj, kind="stable")]
            # Cut at a multiple of ``size`` near the middle: parts stay full, sizes equal.
            half = max(self.size, (len(order) // 2) // self.size * self.size)
            stack += [order[:half], order[half:]]
        return out

    def describe(self) -> str:
        return f"partition({self.size},r={self.rank})"


CLUSTERERS = Registry("clusterer", Clusterer, Greedy, Frequency, Partition)
register = CLUSTERERS.register
make_clusterer = CLUSTERERS.make


def contiguous(positions: np.ndarray, size: int) -> Clusters:
    """Blocks of ``size`` consecutive positions as clusters (the layout without co-activation)."""
    members = [positions[i:i + size] for i in range(0, len(positions), size)]
    return Clusters(members, np.array([int(m[len(m) // 2]) for m in members], np.int64),
                    np.zeros(len(members), bool), np.zeros(len(members)))
