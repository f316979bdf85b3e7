"""Oracle token top-k: exact attention scores over every offloaded key (the Swarm paper's
"No Cluster" baseline).  Its index is all offloaded keys in DRAM, half the KV itself: it is the
quality ceiling that cheaper selectors are measured against, not a deployable design."""

from __future__ import annotations

import numpy as np
import torch

from kvswarm.sparse.base import Selection, Selector, StepQuery, attention_mass, gqa_logits, head_lse, register, \
    top_k


@register
class OracleTopK(Selector):
    name = "oracle"

    def __init__(self) -> None:
        self._keys: dict[int, torch.Tensor] = {}
        self._pos: dict[int, np.ndarray] = {}

    def build(self, layer: int, keys: torch.Tensor, positions: np.ndarray) -> None:
        self._keys[layer] = keys.to(torch.float32).contiguous()
        self._pos[layer] = np.asarray(positions, np.int64)

    def select(self, q: StepQuery, budget: int) -> Selection:
        off = gqa_logits(q.query, self._keys[q.layer], q.scale)
        res = gqa_logits(q.query, q.resident_keys, q.scale)
        return top_k(self._pos[q.layer], attention_mass(off, head_lse(off, res)), budget)

    def index_bytes(self) -> int:
        return sum(k.numel() * k.element_size() for k in self._keys.values())
