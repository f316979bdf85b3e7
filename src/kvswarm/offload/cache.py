"""OffloadedKVCache: a transformers ``Cache`` whose prompt KV lives on the drives.

Built from an ``EntrySource`` (an offloaded prompt, see sequence.py), it keeps only the
sink tokens, the recent window and the tokens decoded since in DRAM.

* ``mode="dense"``: every layer's ``update`` restores all offloaded entries (one batched read
  per layer across the drives) and returns the full KV in position order, so attention is
  exactly the model's own (tested bit-for-bit against generation without offloading).
* ``mode="sparse"``: ``update`` returns the resident KV only; the kvswarm attention hook
  (attention.py) then asks the selector for about ``budget`` offloaded entries given the
  step's query, fetches just those pages and attends over sinks + selected + window.
  Layers listed in ``dense_layers`` and multi-token calls attend densely.  With
  ``whole_pages=True`` attention also reads the other entries of every page fetched (they
  arrive anyway: more recall for no extra I/O).

A page that is missing, torn or fails its checksum is a counted miss: the prompt's KV is
recomputed from its token ids (``recompute``), used for the step, and the bad pages are
rewritten.  Without a recompute path the step fails with ``KVMissing``; wrong KV is never used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvswarm.entry_source import EntrySource, Fetched, KVMissing, LayerKV
from kvswarm.errors import LayoutMismatch
from kvswarm.offload.sequence import TORCH_DTYPES
from kvswarm.sparse.base import (Selection, Selector, StepQuery, attention_mass, budget_for, gqa_logits, head_lse,
                                 make_selector, small_ops)

Recompute = Callable[[], Sequence[LayerKV]]  # the prompt's KV per layer, [1, kv_heads, prompt_len, head_dim]


class StepObserver:
    """Receives every (step, layer) selection; trace recorders and quality auditors implement it."""

    def on_select(self, q: StepQuery, sel: Selection) -> None: ...


@dataclass
class StepStats:
    """Counters of one decode step, summed over layers."""

    step: int
    select_s: float = 0.0  # selector time
    io_s: float = 0.0  # submit -> entries verified in DRAM
    pages: int = 0  # store objects read
    entries: int = 0  # offloaded entries attention read
    payload_bytes: int = 0  # bytes of pages read (entries x entry bytes)
    misses: int = 0  # entries whose page was missing/corrupt
    pages_missing: int = 0
    recomputes: int = 0  # prompt KV recomputations (at most one per step)
    repaired_pages: int = 0
    dense_layers: int = 0  # layers attended densely (dense mode, dense_layers, multi-token calls)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class OffloadedLayer(CacheLayerMixin):
    """One layer: resident sinks and tail (window + decoded tokens) in DRAM."""

    is_sliding = False

    def __init__(self, owner: OffloadedKVCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer
        k, v = owner.source.resident(layer)
        s = owner.geometry.off_start
        self.sink_k, self.sink_v = k[None, :, :s].contiguous(), v[None, :, :s].contiguous()
        self.tail_k, self.tail_v = k[None, :, s:].contiguous(), v[None, :, s:].contiguous()
        self.length = owner.geometry.prompt_len
        self.device = k.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # resident KV is loaded at construction
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner._update(self, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def resident_kv(self) -> LayerKV:
        return torch.cat([self.sink_k, self.tail_k], 2), torch.cat([self.sink_v, self.tail_v], 2)


class OffloadedKVCache(Cache):
    def __init__(self, source: EntrySource, mode: str = "dense", selector: str | Selector | None = None, *,
                 sparsity: float = 0.1, budget: int | None = None, dense_layers: Collection[int] = (),
                 observers: Sequence[StepObserver] = (), recompute: Recompute | None = None,
                 build_index: bool = True, whole_pages: bool = False) -> None:
        if mode not in ("dense", "sparse"):
            raise ValueError(f"mode must be 'dense' or 'sparse', got {mode!r}")
        if mode == "sparse" and selector is None:
            raise ValueError("sparse mode needs a selector")
        self.source, self.layout, self.geometry = source, source.layout, source.geometry
        self.mode = mode
        self.selector = make_selector(selector) if selector is not None else None
        n_off = len(self.geometry.offloaded)
        self.budget = budget if budget is not None else (budget_for(sparsity, n_off) if n_off else 0)
        self.dense_layers = frozenset(dense_layers)
        self.observers = list(observers)
        self.recompute = recompute
        self.whole_pages = whole_pages
        self.steps: list[StepStats] = []
        self._recomputed: Sequence[LayerKV] | None = None
        self._pending: int | None = None
        self._dtype = TORCH_DTYPES[self.layout.dtype]
        if self.selector is not None and build_index and n_off:
            self.selector.bind(source)
            with small_ops():
                for layer in range(self.layout.num_layers):
                    self.selector.build(layer, source.offloaded_keys(layer), self.geometry.offloaded)
        super().__init__(layers=[OffloadedLayer(self, i) for i in range(self.layout.num_layers)])

    # ---- per step bookkeeping ----
    def _stats(self, step: int) -> StepStats:
        if not self.steps or self.steps[-1].step != step:
            self.steps.append(StepStats(step))
            self._recomputed = None  # recomputed prompt KV only serves the step that needed it
        return self.steps[-1]

    # ---- called by transformers through OffloadedLayer.update ----
    def _update(self, lay: OffloadedLayer, k: torch.Tensor, v: torch.Tensor) -> LayerKV:
        lo = self.layout
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[1] != lo.num_kv_heads or k.shape[3] != lo.head_dim \
                or k.dtype != self._dtype:
            raise LayoutMismatch(f"model KV {tuple(k.shape)} {k.dtype} does not match the offloaded layout {lo}")
        if self._pending is not None:
            raise RuntimeError("sparse decoding needs kvswarm's attention hook: run the model under "
                               "kvswarm_attention(model) and pass kvswarm=cache to its forward")
        q_len = k.shape[2]
        stats = self._stats(lay.length - self.geometry.prompt_len)
        lay.tail_k = torch.cat([lay.tail_k, k], 2)
        lay.tail_v = torch.cat([lay.tail_v, v], 2)
        lay.length += q_len
        if self.mode == "dense" or q_len > 1 or lay.layer in self.dense_layers or not self.budget:
            stats.dense_layers += 1
            f = self._fetch(lay.layer, self.geometry.offloaded, stats)
            return (torch.cat([lay.sink_k, f.keys[None], lay.tail_k], 2),
                    torch.cat([lay.sink_v, f.values[None], lay.tail_v], 2))
        self._pending = lay.layer
        return lay.resident_kv()

    # ---- called by the attention hook (attention.py) ----
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        lay: OffloadedLayer = self.layers[layer]
        scale = scale if scale is not None else 1 / math.sqrt(self.layout.head_dim)
        step = lay.length - self.geometry.prompt_len - query.shape[2]
        if self._pending is None:  # this layer attended densely in _update
            if self.observers and query.shape[2] == 1:
                q = StepQuery(layer, step, query[0, :, 0], lay.resident_kv()[0][0], scale)
                sel = Selection(self.geometry.offloaded)
                with small_ops():
                    for o in self.observers:
                        o.on_select(q, sel)
            return key, value, mask
        if self._pending != layer:
            raise RuntimeError(f"attention for layer {layer} while layer {self._pending} is pending")
        self._pending = None
        stats = self.steps[-1]
        q = StepQuery(layer, step, query[0, :, 0], key[0], scale)
        with small_ops():
            t0 = time.perf_counter()
            sel = self.selector.select(q, self.budget)
            stats.select_s += time.perf_counter() - t0
        if self.whole_pages:
            sel = Selection(self.source.expand(layer, sel.positions))
        f = self._fetch(layer, sel.positions, stats)
        with small_ops():
            for o in self.observers:
                o.on_select(q, sel)
            if self.selector.wants_feedback:
                off = gqa_logits(q.query, f.keys, scale)
                mass = attention_mass(off, head_lse(off, gqa_logits(q.query, q.resident_keys, scale)))
                self.selector.feedback(layer, step, sel.positions, mass.numpy())
        s = self.geometry.off_start
        keys = torch.cat([lay.sink_k, f.keys[None], lay.tail_k], 2)
        values = torch.cat([lay.sink_v, f.values[None], lay.tail_v], 2)
        if mask is not None:  # keep the columns of the entries actually attended
            cols = np.concatenate([np.arange(s), sel.positions, np.arange(self.geometry.off_end, lay.length)])
            mask = mask[..., torch.from_numpy(cols)]
        return keys, values, mask

    # ---- reads, misses and recompute ----
    def _fetch(self, layer: int, positions: np.ndarray, stats: StepStats) -> Fetched:
        f = self.source.fetch(layer, positions)
        stats.io_s += f.io_s
        stats.pages += f.pages
        stats.entries += len(positions)
        stats.payload_bytes += f.payload_bytes
        if len(f.missing):
            stats.misses += len(f.missing)
            stats.pages_missing += f.pages_missing
            if self.recompute is None:
                raise KVMissing(f"layer {layer}: {len(f.missing)} offloaded entries are missing or corrupt "
                                "and no recompute path was given")
            if self._recomputed is None:
                self._recomputed = self.recompute()
                stats.recomputes += 1
            k, v = self._recomputed[layer]
            miss_pos = torch.from_numpy(positions[f.missing])
            rows = torch.from_numpy(f.missing)
            f.keys[:, rows] = k[0].index_select(1, miss_pos).to(f.keys.dtype)
            f.values[:, rows] = v[0].index_select(1, miss_pos).to(f.values.dtype)
            stats.repaired_pages += self.source.repair(layer, positions[f.missing], (k, v))
        return f

    def totals(self) -> StepStats:
        """All steps' counters summed (step = number of steps)."""
        t = StepStats(len(self.steps))
        for s in self.steps:
            for fld in fields(s):
                if fld.name != "step":
                    setattr(t, fld.name, getattr(t, fld.name) + getattr(s, fld.name))
        return t
