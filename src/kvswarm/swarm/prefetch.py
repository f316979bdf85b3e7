"""Cross-layer prefetch: guess layer L+1's pieces from layer L's selection while L computes.

Adjacent layers attend to overlapping positions (about half of layer L's top entries are in
layer L+1's on SmolLM2, against a tenth by chance), so the positions selected at layer L,
looked up in layer L+1's layout, name pieces that layer L+1 will likely read.  A piece of L+1
is predicted when it holds at least ``min_votes`` of L's selected positions (most votes first);
at most ``max_share`` of L's own read count, and no more than the drives can read while layer L
computes (``fit``): wasted or late reads cost bandwidth and time.  Reads for
the prediction are issued right after layer L's own reads, so they overlap with L's compute;
at layer L+1 the prefetched pieces count as in DRAM.
"""

from __future__ import annotations

import numpy as np
from scipy import sparse


class CrossLayerPrefetch:
    def __init__(self, holders: list[sparse.csr_matrix], min_votes: int = 2, max_share: float = 1.0) -> None:
        self.holders = [h.tocsr() for h in holders]  # per layer [universe, pieces]
        self.min_votes, self.max_share = min_votes, max_share

    def predict(self, layer: int, positions: np.ndarray, reads: int | None = None) -> np.ndarray:
        """Pieces of ``layer + 1`` to prefetch, given the positions ``layer`` selected."""
        if layer + 1 >= len(self.holders) or not len(positions):
            return np.zeros(0, np.int64)
        h = self.holders[layer + 1][np.asarray(positions, np.int64)]
        votes = np.bincount(h.indices, minlength=h.shape[1])
        cand = np.flatnonzero(votes >= self.min_votes)
        cand = cand[np.argsort(-votes[cand], kind="stable")]
        if reads is not None:
            cand = cand[:max(1, int(self.max_share * reads))]
        return cand  # most votes first

    @staticmethod
    def fit(pieces: np.ndarray, seconds: float, cost) -> np.ndarray:
        """The longest prefix of ``pieces`` whose reads take at most ``seconds`` (``cost(prefix)``):
        a prefetch that outlasts the compute it hides behind only delays the layer."""
        lo, hi = 0, len(pieces)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(pieces[:mid]) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return pieces[:lo]


def precision_recall(predicted: np.ndarray, needed: np.ndarray) -> tuple[float, float]:
    """Share of prefetched pieces that were needed, and of needed pieces that were prefetched."""
    if not len(predicted) and not len(needed):
        return 1.0, 1.0
    hit = len(np.intersect1d(predicted, needed))
    return (hit / len(predicted) if len(predicted) else 1.0), (hit / len(needed) if len(needed) else 1.0)
