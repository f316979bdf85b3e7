"""The selector interface: which offloaded KV entries a decode step's attention reads.

Vocabulary.  An *entry* is one token's K and V in one layer (all KV heads); its id is the
token position.  At offload time the cache hands each selector the keys of the entries it
moved to the drives (``build``); at every decode step and layer it asks for a set of at
most ~``budget`` entry ids (``select``).  Sink tokens and the recent window stay resident in
DRAM and are always attended: selectors only choose among offloaded entries.  After the
step's attention, selectors that set ``wants_feedback`` receive the attention mass each
attended offloaded entry actually got (history-based selectors learn from it).

Selectors keep their index in DRAM (all keys for the oracle, block bounds, PQ codes); its
size is reported by ``index_bytes`` so benchmarks can charge it.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvswarm.registry import Registry


@dataclass
class StepQuery:
    """What a selector may know at one decode step and layer."""

    layer: int
    step: int
    query: torch.Tensor  # [q_heads, head_dim], post-RoPE, one decode token
    resident_keys: torch.Tensor  # [kv_heads, r, head_dim]: sinks + recent window (+ this token)
    scale: float  # softmax scale of the model's attention (1/sqrt(head_dim) for Llama)

    @property
    def groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.query.shape[0] // self.resident_keys.shape[0]


@dataclass
class Selection:
    """Selected entry ids (token positions), sorted and unique, with optional per-entry scores."""

    positions: np.ndarray  # int64
    scores: np.ndarray | None = None  # float32, aligned with positions: the selector's estimate

    def __len__(self) -> int:
        return len(self.positions)


class Selector(abc.ABC):
    """Strategy: picks the offloaded entries attention reads, per decode step and layer."""

    name: ClassVar[str] = "?"
    wants_feedback: ClassVar[bool] = False

    def bind(self, source) -> None:
        """Called once before ``build`` with the cache's ``EntrySource``: selectors that reason
        about the storage layout (which entries share a page, e.g. co-activation clusters) read
        ``source.groups(layer)`` here."""

    @abc.abstractmethod
    def build(self, layer: int, keys: torch.Tensor, positions: np.ndarray) -> None:
        """Index the offloaded entries of ``layer``: ``keys`` [kv_heads, n, head_dim] (post-RoPE)
        at ``positions`` (sorted int64, n of them).  Called once per layer at offload time."""

    @abc.abstractmethod
    def select(self, q: StepQuery, budget: int) -> Selection:
        """About ``budget`` offloaded entry ids to attend (block selectors round up to whole blocks)."""

    def feedback(self, layer: int, step: int, positions: np.ndarray, mass: np.ndarray) -> None:
        """Attention mass (summed over query heads) that each attended offloaded entry received."""

    def index_bytes(self) -> int:
        """DRAM this selector's index takes."""
        return 0

    def describe(self) -> str:
        return self.name


# ---- scoring helpers shared by selectors, the oracle and the quality metrics ------------------
def gqa_logits(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled logits [q_heads, n] of each query head against its KV head's keys [kv_heads, n, d]."""
    kvh, n, d = keys.shape
    g = query.shape[0] // kvh
    q = query.reshape(kvh, g, d).to(torch.float32)
    return (q @ keys.to(torch.float32).transpose(1, 2)).reshape(kvh * g, n) * scale


def head_lse(*logits: torch.Tensor) -> torch.Tensor:
    """Per-head log-sum-exp over the concatenation of several [q_heads, n_i] logit blocks."""
    return torch.logsumexp(torch.cat([x for x in logits if x.shape[1]], dim=1), dim=1)


def attention_mass(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Attention probability of each entry summed over query heads: [n] (sums to q_heads overall)."""
    return torch.exp(logits - lse[:, None]).sum(0)


def budget_for(sparsity: float, n_offloaded: int) -> int:
    """Entries to select for a sparsity fraction of the offloaded context (at least one)."""
    if not 0 < sparsity <= 1:
        raise ValueError(f"sparsity must be in (0, 1], got {sparsity}")
    return max(1, min(n_offloaded, math.ceil(sparsity * n_offloaded)))


def top_k(positions: np.ndarray, scores: torch.Tensor, k: int) -> Selection:
    """The k best-scoring positions, returned sorted by position."""
    k = min(k, len(positions))
    idx = torch.topk(scores, k).indices.numpy() if k < len(positions) else np.arange(len(positions))
    idx.sort()
    return Selection(positions[idx], scores.numpy()[idx].astype(np.float32))


@contextmanager
def small_ops() -> Iterator[None]:
    """Run a block of small tensor ops (selection, scoring) on one intra-op thread.

    On tensors of a few thousand elements the threads spend longer synchronizing than
    computing: measured 5-15x slower with 2 threads than with 1 on a busy 2-core machine.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# ---- registry ---------------------------------------------------------------------------------
SELECTORS = Registry("selector", Selector)
register = SELECTORS.register  # makes a selector constructible by name: ``make_selector(name, **kw)``
make_selector = SELECTORS.make
selector_names = SELECTORS.names
