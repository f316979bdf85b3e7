"""k-means clusters of keys, PQCache-style: product-quantized keys give approximate scores.

Per layer, KV head and subspace (``subspaces`` equal slices of the head dimension), k-means
(scipy) learns ``centroids`` codewords over the offloaded keys; each key is kept in DRAM as
one small code per subspace.  A step scores every offloaded entry with a lookup table
(query slice x codeword), turns the approximate logits into attention mass and takes the
top-``budget`` entries.  The index is the codebooks plus ``kv_heads * subspaces`` bytes per
entry, a few percent of the keys.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.cluster.vq import kmeans2

from kvswarm.sparse.base import Selection, Selector, StepQuery, attention_mass, gqa_logits, head_lse, register, \
    top_k


@register
class KMeansPQSelector(Selector):
    name = "kmeans"

    def __init__(self, centroids: int = 64, subspaces: int = 2, iters: int = 12, seed: int = 0) -> None:
        if centroids < 1 or centroids > 256 or subspaces < 1:
            raise ValueError("centroids must be in 1..256 and subspaces positive")
        self.centroids, self.subspaces, self.iters, self.seed = centroids, subspaces, iters, seed
        self._books: dict[int, torch.Tensor] = {}  # [kvh, m, c, d/m]
        self._codes: dict[int, torch.Tensor] = {}  # [kvh, m, n] int64 (uint8 on disk-equivalent)
        self._pos: dict[int, np.ndarray] = {}

    def build(self, layer: int, keys: torch.Tensor, positions: np.ndarray) -> None:
        kvh, n, d = keys.shape
        m = self.subspaces
        if d % m:
            raise ValueError(f"head_dim {d} is not divisible into {m} subspaces")
        c = min(self.centroids, n)
        x = keys.to(torch.float32).reshape(kvh, n, m, d // m).permute(0, 2, 1, 3).numpy()
        rng = np.random.default_rng([self.seed, layer])
        books = np.zeros((kvh, m, c, d // m), np.float32)
        codes = np.zeros((kvh, m, n), np.int64)
        for g in range(kvh):
            for s in range(m):
                books[g, s], codes[g, s] = kmeans2(x[g, s], c, iter=self.iters, minit="++", seed=rng)
        self._books[layer] = torch.from_numpy(books)
        self._codes[layer] = torch.from_numpy(codes)
        self._pos[layer] = np.asarray(positions, np.int64)

    def approx_logits(self, q: StepQuery) -> torch.Tensor:
        """Approximate scaled logits [q_heads, n] of the offloaded entries from their PQ codes."""
        books, codes = self._books[q.layer], self._codes[q.layer]
        kvh, m, c, ds = books.shape
        qq = q.query.to(torch.float32).reshape(kvh, q.groups, m, ds)
        lut = torch.einsum("gjsd,gscd->gjsc", qq, books)  # [kvh, g, m, c]
        idx = codes[:, None].expand(kvh, q.groups, m, codes.shape[-1])
        return torch.gather(lut, 3, idx).sum(2).reshape(kvh * q.groups, -1) * q.scale

    def select(self, q: StepQuery, budget: int) -> Selection:
        off = self.approx_logits(q)
        res = gqa_logits(q.query, q.resident_keys, q.scale)
        return top_k(self._pos[q.layer], attention_mass(off, head_lse(off, res)), budget)

    def index_bytes(self) -> int:
        # Codes count one byte each (centroids <= 256), as a deployed index would store them.
        return sum(b.numel() * 4 + self._codes[k].numel() for k, b in self._books.items())

    def describe(self) -> str:
        return f"kmeans(c={self.centroids},m={self.subspaces})"
