"""k-means clusters of keys, PQCache-style: product-quantized keys give approximate scores.

Per layer, KV head and subspace (``subspaces`` equal slices of the head dimension), k-means
learns ``centroids`` codewords on a sample of the offloaded keys (k-means++ seeding, Lloyd
iterations, all heads and subspaces of a layer batched in torch: scipy's one-codebook-at-a-
time k-means took ~30x longer); each key is then kept in DRAM as one code per subspace.  A step scores every offloaded entry with a lookup table
(query slice x codeword), turns the approximate logits into attention mass and takes the
top-``budget`` entries.  The index is the codebooks plus ``kv_heads * subspaces`` bytes per
entry, a few percent of the keys.
"""

from __future__ import annotations

import numpy as np
import torch

from kvswarm.sparse.base import Selection, Selector, StepQuery, attention_mass, gqa_logits, head_lse, register, \
    top_k


@register
class KMeansPQSelector(Selector):
    name = "kmeans"

    def __init__(self, centroids: int = 64, subspaces: int = 2, iters: int = 10, train_points: int = 1024,
                 seed: int = 0) -> None:
        if centroids < 1 or centroids > 256 or subspaces < 1:
            raise ValueError("centroids must be in 1..256 and subspaces positive")
        self.centroids, self.subspaces, self.iters, self.seed = centroids, subspaces, iters, seed
        self.train_points = train_points
        self._books: dict[int, torch.Tensor] = {}  # [kvh, m, c, d/m]
        self._codes: dict[int, torch.Tensor] = {}  # [kvh, m, n] int64 (uint8 on disk-equivalent)
        self._pos: dict[int, np.ndarray] = {}

    def build(self, layer: int, keys: torch.Tensor, positions: np.ndarray) -> None:
        kvh, n, d = keys.shape
        m = self.subspaces
        if d % m:
            raise ValueError(f"head_dim {d} is not divisible into {m} subspaces")
        c = min(self.centroids, n)
        x = keys.to(torch.float32).reshape(kvh, n, m, d // m).permute(0, 2, 1, 3).reshape(kvh * m, n, d // m)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        train = x if n <= self.train_points else x[:, torch.randperm(n, generator=gen)[:self.train_points]]
        books = kmeans(train, c, self.iters, gen)
        self._books[layer] = books.reshape(kvh, m, c, d // m)
        self._codes[layer] = nearest(x, books).reshape(kvh, m, n)
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


def nearest(x: torch.Tensor, books: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codeword: x [B, n, d], books [B, c, d] -> [B, n]."""
    return (-2 * x @ books.transpose(1, 2) + (books * books).sum(-1)[:, None, :]).argmin(2)


def kmeans(x: torch.Tensor, k: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    """Batched k-means (k-means++ seeding, Lloyd steps) of x [B, n, d] -> codebooks [B, k, d]."""
    b, n, d = x.shape
    rows = torch.arange(b)
    c = torch.empty(b, k, d)
    c[:, 0] = x[rows, torch.randint(n, (b,), generator=gen)]
    dmin = ((x - c[:, :1]) ** 2).sum(-1)
    for j in range(1, k):
        c[:, j] = x[rows, torch.multinomial(dmin + 1e-12, 1, generator=gen)[:, 0]]
        dmin = torch.minimum(dmin, ((x - c[:, j:j + 1]) ** 2).sum(-1))
    ones = torch.ones(b, n)
    for _ in range(iters):
        codes = nearest(x, c)
        sums = torch.zeros(b, k, d).scatter_add_(1, codes[..., None].expand(-1, -1, d), x)
        counts = torch.zeros(b, k).scatter_add_(1, codes, ones)
        c = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], c)  # empty: keep
    return c
