"""Quality of sparse decoding against dense decoding of the same prompt.

* attention recall: share of the exact attention mass (softmax over the whole context,
  summed over query heads) that the attended entries hold, per step and layer; reported over
  the whole context (resident + selected) and over the offloaded entries alone, and relative
  to the oracle top-k of the same size.
* next-token agreement: teacher-forced on the same tokens, how often the sparse run's argmax
  equals the dense run's.
* perplexity of held-out real text under both runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvswarm.entry_source import EntrySource
from kvswarm.sparse.base import Selection, StepQuery, attention_mass, gqa_logits, head_lse


@dataclass
class RecallStats:
    recall: list[float] = field(default_factory=list)  # (resident + selected) / all
    recall_offloaded: list[float] = field(default_factory=list)  # selected / offloaded
    recall_vs_oracle: list[float] = field(default_factory=list)  # selected / top-|selected| exact
    layer: list[int] = field(default_factory=list)

    def mean(self, name: str) -> float:
        v = getattr(self, name)
        return float(np.mean(v)) if v else float("nan")

    def per_layer(self, name: str, layers: int) -> np.ndarray:
        v, lay = np.asarray(getattr(self, name)), np.asarray(self.layer)
        return np.array([v[lay == i].mean() if (lay == i).any() else np.nan for i in range(layers)])


class QualityAuditor:
    """Step observer that scores each selection against exact attention over all keys.

    Holds every offloaded key in DRAM: a measuring instrument outside the I/O path (its time
    is kept in ``seconds`` so benchmarks can leave it out of decode timings)."""

    def __init__(self, source: EntrySource) -> None:
        self._pos = source.geometry.offloaded
        self._keys = [source.offloaded_keys(layer).to(torch.float32) for layer in range(source.layout.num_layers)]
        self.stats = RecallStats()
        self.seconds = 0.0

    def fork(self) -> QualityAuditor:
        """A new auditor with its own statistics sharing this one's keys (one per configuration)."""
        other = object.__new__(QualityAuditor)
        other._pos, other._keys, other.stats, other.seconds = self._pos, self._keys, RecallStats(), 0.0
        return other

    def on_select(self, q: StepQuery, sel: Selection) -> None:
        t0 = time.perf_counter()
        off = gqa_logits(q.query, self._keys[q.layer], q.scale)
        res = gqa_logits(q.query, q.resident_keys, q.scale)
        lse = head_lse(off, res)
        m_off = attention_mass(off, lse)
        m_res = float(attention_mass(res, lse).sum())
        idx = torch.from_numpy(np.searchsorted(self._pos, sel.positions))
        got = float(m_off[idx].sum()) if len(idx) else 0.0
        total_off = float(m_off.sum())
        best = float(torch.topk(m_off, len(idx)).values.sum()) if len(idx) else 0.0
        heads = q.query.shape[0]
        self.stats.recall.append((m_res + got) / heads)
        self.stats.recall_offloaded.append(got / total_off if total_off > 0 else 1.0)
        self.stats.recall_vs_oracle.append(got / best if best > 0 else 1.0)
        self.stats.layer.append(q.layer)
        self.seconds += time.perf_counter() - t0


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of positions where two prediction sequences agree."""
    n = min(len(a), len(b))
    return float(np.mean(np.asarray(a[:n]) == np.asarray(b[:n]))) if n else float("nan")


def prefix_match(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens two free-running generations share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
