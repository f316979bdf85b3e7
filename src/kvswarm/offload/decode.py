"""Driving a model over an offloaded cache: prefill, decode loop, recompute path, drive meter.

``decode`` runs one token per step through the model with any cache (a plain DynamicCache
for the reference, an OffloadedKVCache for kvswarm) and records, per step, the token fed,
the model's argmax prediction, the log-probability of the next token when it is known
(teacher forcing on held-out text) and the wall time.  The same loop serves free-running
generation (greedy or sampled).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from kvswarm.entry_source import LayerKV
from kvswarm.offload.attention import kvswarm_attention
from kvswarm.offload.cache import OffloadedKVCache
from kvswarm.offload.sequence import kv_from_cache


@dataclass
class Prefill:
    token_ids: list[int]
    cache: object  # the model's own DynamicCache after the prompt
    logits: torch.Tensor  # [vocab] at the last prompt position
    seconds: float

    def kv(self) -> list[LayerKV]:
        return kv_from_cache(self.cache)


@torch.inference_mode()
def prefill(model, token_ids: Sequence[int]) -> Prefill:
    """Run the prompt once (one forward, sdpa) and keep the model's own cache."""
    t0 = time.perf_counter()
    out = model(torch.tensor([list(token_ids)]), use_cache=True, logits_to_keep=1)
    return Prefill(list(token_ids), out.cache, out.logits[0, -1].float(), time.perf_counter() - t0)


def make_recompute(model, token_ids: Sequence[int]) -> Callable[[], list[LayerKV]]:
    """The recompute path for misses: the prompt's KV again from its token ids (same shapes as the
    original prefill, hence the same bits)."""
    ids = list(token_ids)

    def recompute() -> list[LayerKV]:
        with torch.inference_mode():
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return kv_from_cache(out.cache)

    return recompute


@dataclass
class DecodeResult:
    fed: list[int] = field(default_factory=list)  # token fed at each step
    predicted: list[int] = field(default_factory=list)  # argmax after each step
    logprob_next: list[float] = field(default_factory=list)  # log p(next forced token) after each step
    step_s: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # kept when keep_logits
    last_logits: torch.Tensor | None = None  # to continue decoding with another decode() call

    def extend(self, more: DecodeResult) -> None:
        """Append a later ``decode`` call's steps (one continued decode in several calls)."""
        self.fed += more.fed
        self.predicted += more.predicted
        self.logprob_next += more.logprob_next
        self.step_s += more.step_s
        self.logits += more.logits
        self.last_logits = more.last_logits

    @property
    def tokens_per_s(self) -> float:
        return len(self.step_s) / sum(self.step_s) if self.step_s else 0.0

    def perplexity(self) -> float:
        return float(np.exp(-np.mean(self.logprob_next))) if self.logprob_next else float("nan")


@torch.inference_mode()
def decode(model, cache, first_logits: torch.Tensor, steps: int, *, forced: Sequence[int] | None = None,
           temperature: float = 0.0, seed: int = 0, keep_logits: bool = False,
           on_step: Callable[[int], None] | None = None) -> DecodeResult:
    """Feed ``steps`` tokens one at a time.

    ``forced``: feed these tokens (teacher forcing; ``forced[i+1]`` is scored after step i);
    otherwise feed the argmax of the previous logits (``temperature=0``) or a sample.
    """
    if forced is not None and len(forced) < steps:
        raise ValueError(f"{len(forced)} forced tokens for {steps} steps")
    gen = torch.Generator().manual_seed(seed)
    offloaded = isinstance(cache, OffloadedKVCache)
    extra = {"kvswarm": cache} if offloaded else {}
    res = DecodeResult()
    logits = first_logits
    with kvswarm_attention(model) if offloaded else nullcontext():
        for i in range(steps):
            if forced is not None:
                tok = int(forced[i])
            elif temperature > 0:
                tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            else:
                tok = int(torch.argmax(logits))
            t0 = time.perf_counter()
            out = model(torch.tensor([[tok]]), cache=cache, use_cache=True, **extra)
            res.step_s.append(time.perf_counter() - t0)
            logits = out.logits[0, -1].float()
            res.fed.append(tok)
            res.predicted.append(int(torch.argmax(logits)))
            if forced is not None and i + 1 < len(forced):
                res.logprob_next.append(float(torch.log_softmax(logits, -1)[int(forced[i + 1])]))
            if keep_logits:
                res.logits.append(logits)
            if on_step is not None:
                on_step(i)
    res.last_logits = logits
    return res


class DriveMeter:
    """Per-drive read bytes/ops between two points (a decode run, a step)."""

    def __init__(self, store) -> None:
        self.store = store
        self.reset()

    def _snap(self) -> np.ndarray:
        return np.array([[s.ops[0], s.bytes[0]] for s in self.store.drive_stats], np.int64)

    def reset(self) -> None:
        self._t0 = time.perf_counter()
        self._base = self._snap()

    def delta(self) -> np.ndarray:
        """[drives, 2] (read ops, read bytes) since the last reset."""
        return self._snap() - self._base
