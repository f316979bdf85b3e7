"""The contract between where a prompt's offloaded KV entries live and what reads them.

An :class:`EntrySource` holds the entries of one prompt's offloaded positions (on the drives,
striped or in co-activation clusters, or in memory) and answers a submit-then-wait ``fetch``
by position; the offloaded decode (:mod:`kvswarm.offload`), the Swarm layout
(:mod:`kvswarm.swarm`) and the sparse selectors (:mod:`kvswarm.sparse`) meet here.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from kvswarm.errors import KVSwarmError
from kvswarm.layout import KVLayout

LayerKV = tuple[torch.Tensor, torch.Tensor]  # K, V: [1, kv_heads, tokens, head_dim]


class KVMissing(KVSwarmError):
    """Offloaded entries could not be read back and no recompute path was given."""


@dataclass(frozen=True)
class Geometry:
    """Which prompt positions stay resident and which are offloaded."""

    prompt_len: int
    sinks: int = 4
    window: int = 64

    def __post_init__(self) -> None:
        if min(self.prompt_len, self.sinks, self.window) < 0:
            raise ValueError("prompt_len, sinks and window must be non-negative")

    @property
    def off_start(self) -> int:
        return min(self.sinks, self.prompt_len)

    @property
    def off_end(self) -> int:
        return max(self.off_start, self.prompt_len - self.window)

    @property
    def offloaded(self) -> np.ndarray:
        return np.arange(self.off_start, self.off_end, dtype=np.int64)

    @property
    def resident(self) -> np.ndarray:
        return np.concatenate([np.arange(self.off_start), np.arange(self.off_end, self.prompt_len)]).astype(np.int64)


@dataclass
class Fetched:
    """Entries read for one layer, in the order requested; rows listed in ``missing`` are zero
    and must not be used (their pages were missing, torn or corrupt)."""

    keys: torch.Tensor  # [kv_heads, m, head_dim]
    values: torch.Tensor
    missing: np.ndarray  # indices into the request
    pages: int = 0
    pages_missing: int = 0
    payload_bytes: int = 0  # bytes of entries read (pages x entries x entry bytes)
    io_s: float = 0.0  # submit -> data verified in DRAM


class FetchHandle(abc.ABC):
    @abc.abstractmethod
    def poll(self) -> bool:
        """Non-blocking: True when ``wait`` will not block."""

    @abc.abstractmethod
    def wait(self) -> Fetched: ...


class EntrySource(abc.ABC):
    """Where the offloaded entries of one prompt live."""

    layout: KVLayout
    geometry: Geometry
    token_ids: np.ndarray

    @abc.abstractmethod
    def resident(self, layer: int) -> LayerKV:
        """K, V [kv_heads, r, head_dim] of the resident prompt positions (``geometry.resident``)."""

    @abc.abstractmethod
    def submit(self, layer: int, positions: np.ndarray) -> FetchHandle:
        """Start reading the entries of ``positions`` (offloaded positions of ``layer``)."""

    def fetch(self, layer: int, positions: np.ndarray) -> Fetched:
        return self.submit(layer, positions).wait()

    @abc.abstractmethod
    def offloaded_keys(self, layer: int) -> torch.Tensor:
        """Keys [kv_heads, n, head_dim] of all offloaded entries (to build a selector's index)."""

    def repair(self, layer: int, positions: np.ndarray, kv: LayerKV) -> int:
        """Rewrite the storage holding ``positions`` from recomputed prompt KV; returns objects written."""
        return 0

    def groups(self, layer: int) -> list[np.ndarray] | None:
        """Positions of each stored object (page) of ``layer``, or None when there are no pages."""
        return None

    def expand(self, layer: int, positions: np.ndarray) -> np.ndarray:
        """All positions stored together with ``positions`` (what reading them brings in anyway)."""
        return positions

    def object_count(self) -> int:
        return 0
