"""Co-activation statistics of one layer's KV entries.

An *activation* is the set of entries a decode step needed (e.g. the exact top-k of the
dense attention, or what a selector fetched).  Over a window of steps, per layer:

* ``freq[i]``: steps in which entry ``i`` was active;
* ``C[i, j]``: steps in which ``i`` and ``j`` were active together;
* ``P(i, j) = C[i, j] / (freq[i] + freq[j] - C[i, j])``: how often the two are activated
  together when either is (Jaccard, symmetric, in [0, 1]); distance ``d = 1 - P``.

Memory stays bounded for long contexts: the counts are computed block by block of rows
from a sparse incidence matrix (``scipy.sparse``) and only each entry's ``neighbours``
strongest partners are kept, so the graph holds ``n * neighbours`` pairs, never ``n * n``.
Online, :class:`CoActivation` keeps the last ``history`` activations in a ring and rebuilds
the graph on demand (``graph()``), e.g. when drift is detected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy import sparse


@dataclass
class CoGraph:
    """Top-k co-activation neighbours of each entry: ``P`` as a CSR matrix over positions."""

    p: sparse.csr_matrix  # [universe, universe], symmetric, P(i, j) on the kept pairs, 0 diagonal
    freq: np.ndarray  # int32 [universe]
    steps: int  # activations counted

    @property
    def universe(self) -> int:
        return self.p.shape[0]

    @property
    def active(self) -> np.ndarray:
        """Entries active at least once."""
        return np.flatnonzero(self.freq > 0)

    def distance(self, i: int, j: int) -> float:
        return 1.0 - float(self.p[i, j])

    def nbytes(self) -> int:
        return self.p.data.nbytes + self.p.indices.nbytes + self.p.indptr.nbytes + self.freq.nbytes


def incidence(sets: Iterable[np.ndarray], universe: int) -> sparse.csr_matrix:
    """[steps, universe] 0/1 CSR matrix of activation sets (duplicate ids count once)."""
    rows, cols = [], []
    n = 0
    for s, ids in enumerate(sets):
        ids = np.unique(np.asarray(ids, np.int64))
        rows.append(np.full(len(ids), s, np.int64))
        cols.append(ids)
        n = s + 1
    if not n:
        return sparse.csr_matrix((0, universe), dtype=np.float32)
    r, c = np.concatenate(rows), np.concatenate(cols)
    if len(c) and (c.min() < 0 or c.max() >= universe):
        raise ValueError(f"entry ids outside [0, {universe})")
    return sparse.csr_matrix((np.ones(len(r), np.float32), (r, c)), shape=(n, universe))


def cograph(x: sparse.csr_matrix, neighbours: int = 32, min_count: int = 1, block: int = 1024) -> CoGraph:
    """Co-activation graph of an incidence matrix, keeping each entry's ``neighbours`` best partners.

    Pairs seen together fewer than ``min_count`` times are dropped (one shared step is noise
    when steps are many).  Work and memory per block of ``block`` entries stay bounded.
    """
    steps, n = x.shape
    xc = x.tocsc()
    freq = np.asarray(xc.sum(0)).ravel().astype(np.int32)
    active = np.flatnonzero(freq)
    rows, cols, vals = [], [], []
    xa = xc[:, active]
    xat = xa.T.tocsr()
    for b in range(0, len(active), block):
        blk = active[b:b + block]
        c = (xat[b:b + block] @ xa).tocoo()  # co-counts of this block's entries with all active ones
        i, j = blk[c.row], active[c.col]
        keep = (i != j) & (c.data >= min_count)
        i, j, cnt = i[keep], j[keep], c.data[keep]
        p = cnt / (freq[i] + freq[j] - cnt)
        if neighbours and len(p):
            order = np.lexsort((-p, i))  # by row, strongest first
            i, j, p = i[order], j[order], p[order]
            starts = np.searchsorted(i, i, side="left")
            rank = np.arange(len(i)) - starts
            sel = rank < neighbours
            i, j, p = i[sel], j[sel], p[sel]
        rows.append(i)
        cols.append(j)
        vals.append(p.astype(np.float32))
    if rows:
        i, j, p = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    else:
        i = j = np.zeros(0, np.int64)
        p = np.zeros(0, np.float32)
    m = sparse.coo_matrix((p, (i, j)), shape=(n, n)).tocsr()
    m = m.maximum(m.T).tocsr()  # symmetric: a pair kept by either side is kept
    m.sort_indices()
    return CoGraph(m, freq, steps)


class CoActivation:
    """Online co-activation statistics of one layer: a ring of the last ``history`` activations."""

    def __init__(self, universe: int, history: int | None = 64, neighbours: int = 32) -> None:
        self.universe = universe
        self.neighbours = neighbours
        self.sets: deque[np.ndarray] = deque(maxlen=history)
        self.total_steps = 0

    def add(self, active: np.ndarray) -> None:
        a = np.unique(np.asarray(active, np.int64))
        if len(a) and a[-1] >= self.universe:
            self.grow(int(a[-1]) + 1)
        self.sets.append(a)
        self.total_steps += 1

    def grow(self, universe: int) -> None:
        """New entries (decoded tokens) extend the universe."""
        self.universe = max(self.universe, universe)

    def incidence(self) -> sparse.csr_matrix:
        return incidence(self.sets, self.universe)

    def graph(self, min_count: int = 1) -> CoGraph:
        return cograph(self.incidence(), self.neighbours, min_count)

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sets)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a ∩ b| / |a ∪ b| of two id sets."""
    if not len(a) and not len(b):
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)
