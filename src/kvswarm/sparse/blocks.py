"""Fixed contiguous blocks with representative keys (InfLLM-like; Quest-style bounds).

Offloaded entries are cut into blocks of ``block_tokens`` consecutive positions.  Per block
and KV head the index keeps either the element-wise min and max of the keys (``rep="quest"``:
``sum_d max(q_d*min_d, q_d*max_d)`` bounds every member's logit from above) or their mean
(``rep="mean"``, InfLLM's representative-key idea reduced to one vector).  A step picks the
blocks with the largest estimated attention mass until ``budget`` entries are covered.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvswarm.sparse.base import Selection, Selector, StepQuery, gqa_logits, head_lse, register


@register
class BlockSelector(Selector):
    name = "blocks"

    def __init__(self, block_tokens: int = 16, rep: str = "quest") -> None:
        if rep not in ("quest", "mean"):
            raise ValueError(f"rep must be 'quest' or 'mean', got {rep!r}")
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.block_tokens, self.rep = block_tokens, rep
        self._reps: dict[int, tuple[torch.Tensor, ...]] = {}
        self._blocks: dict[int, list[np.ndarray]] = {}
        self._sizes: dict[int, torch.Tensor] = {}

    def build(self, layer: int, keys: torch.Tensor, positions: np.ndarray) -> None:
        n, b = keys.shape[1], self.block_tokens
        pad = (-n) % b
        k = keys.to(torch.float32)
        if self.rep == "quest":
            # Padding repeats the last key: it changes neither the min nor the max of its block.
            kp = torch.cat([k, k[:, -1:].expand(-1, pad, -1)], 1) if pad else k
            blocks = kp.reshape(k.shape[0], -1, b, k.shape[2])
            self._reps[layer] = (blocks.amin(2), blocks.amax(2))
        else:
            kp = torch.cat([k, k.new_zeros(k.shape[0], pad, k.shape[2])], 1) if pad else k
            counts = torch.full((math.ceil(n / b),), float(b))
            counts[-1] = b - pad
            self._reps[layer] = (kp.reshape(k.shape[0], -1, b, k.shape[2]).sum(2) / counts[None, :, None],)
        self._blocks[layer] = [np.asarray(positions[i:i + b], np.int64) for i in range(0, n, b)]
        self._sizes[layer] = torch.tensor([len(x) for x in self._blocks[layer]], dtype=torch.float32)

    def _block_logits(self, q: StepQuery) -> torch.Tensor:
        reps = self._reps[q.layer]
        if self.rep == "mean":
            return gqa_logits(q.query, reps[0], q.scale)
        lo, hi = reps
        kvh, nb, d = lo.shape
        qq = q.query.to(torch.float32).reshape(kvh, q.groups, 1, d)
        bound = torch.maximum(qq * lo[:, None], qq * hi[:, None]).sum(-1)  # [kvh, g, nb]
        return bound.reshape(kvh * q.groups, nb) * q.scale

    def select(self, q: StepQuery, budget: int) -> Selection:
        bl = self._block_logits(q)
        # A block's mass estimate: its logit bound counted once per member, normalised with the
        # resident entries per head, summed over heads.
        bl_all = bl + torch.log(self._sizes[q.layer])[None, :]
        lse = head_lse(bl_all, gqa_logits(q.query, q.resident_keys, q.scale))
        score = torch.exp(bl_all - lse[:, None]).sum(0)
        blocks = self._blocks[q.layer]
        nsel = min(len(blocks), math.ceil(budget / self.block_tokens))
        chosen = torch.topk(score, nsel).indices.sort().values.tolist()
        pos = np.concatenate([blocks[i] for i in chosen])
        sc = np.concatenate([np.full(len(blocks[i]), float(score[i]) / len(blocks[i]), np.float32) for i in chosen])
        return Selection(pos, sc)

    def index_bytes(self) -> int:
        return sum(t.numel() * 4 for reps in self._reps.values() for t in reps)

    def describe(self) -> str:
        return f"blocks({self.block_tokens},{self.rep})"
