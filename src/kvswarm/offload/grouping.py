"""How offloaded entries are grouped into store objects (pages), one strategy per layout.

A read costs one I/O per object, and the drive moves whole 4 KiB-aligned extents: one
entry (1.5 KiB in fp32, 768 B in bf16 for SmolLM2) alone would waste most of an extent and
cost an I/O per entry.  Entries are therefore written in *pages* of several entries of one
layer.  Which entries share a page decides the read amplification of sparse decoding: a
step fetches every page that holds a selected entry.  ``ContiguousPages`` groups consecutive
positions (what block-sparse attention wants); the co-activation layout of the Swarm design
plugs in as another ``Grouping`` that puts entries activated together in the same page, and
may pass a placement hint per page (e.g. a cluster id) down to the store's placement strategy.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from kvswarm.format import HEADER_SIZE, extent_size
from kvswarm.registry import Registry


@dataclass
class Group:
    """Entries (token positions) of one layer stored together as one object, in this order."""

    positions: np.ndarray  # int64
    hint: object = None  # passed to the store's placement strategy
    # Placement hints of extra copies of the same object (selective replication): a read takes
    # one copy, and another when that one is missing or corrupt.
    copies: list = field(default_factory=list)


def entries_per_page(page_bytes: int, entry_bytes: int) -> int:
    """Entries that fit one extent of ``page_bytes`` together with the extent header."""
    return max(1, (page_bytes - HEADER_SIZE) // entry_bytes)


class Grouping(abc.ABC):
    """Strategy: partition one layer's offloaded entries into store objects."""

    name: ClassVar[str] = "?"

    @abc.abstractmethod
    def group(self, layer: int, positions: np.ndarray, keys: torch.Tensor, capacity: int) -> list[Group]:
        """Cover ``positions`` (sorted, each exactly once) with groups of at most ``capacity``
        entries.  ``keys`` [kv_heads, n, head_dim] are the entries' keys, for content-aware
        layouts."""

    def describe(self) -> str:
        return self.name


class ContiguousPages(Grouping):
    """Consecutive positions, ``capacity`` per page (the block layout)."""

    name = "contiguous"

    def group(self, layer, positions, keys, capacity):
        return [Group(positions[i:i + capacity]) for i in range(0, len(positions), capacity)]


GROUPINGS = Registry("grouping", Grouping, ContiguousPages)
register = GROUPINGS.register  # makes a grouping constructible by name (benchmarks, CLI)
make_grouping = GROUPINGS.make


@dataclass
class PageTable:
    """Where each offloaded entry of one layer lives: page index and slot within the page."""

    page_of: np.ndarray  # int32 [universe], -1 = not offloaded
    slot_of: np.ndarray  # int32 [universe]
    pages: list[np.ndarray]  # positions of each page, in slot order
    extra: np.ndarray | None = None  # int16 [pages]: extra copies of each page (None: none)

    def copies(self, page: int) -> int:
        """Stored copies of ``page`` (1 without replication)."""
        return 1 + (int(self.extra[page]) if self.extra is not None else 0)

    @classmethod
    def from_groups(cls, groups: list[Group], universe: int, capacity: int) -> PageTable:
        page_of = np.full(universe, -1, np.int32)
        slot_of = np.full(universe, -1, np.int32)
        for i, g in enumerate(groups):
            if not 0 < len(g.positions) <= capacity:
                raise ValueError(f"group {i} has {len(g.positions)} entries; pages hold 1..{capacity}")
            if (page_of[g.positions] != -1).any():
                raise ValueError(f"group {i} repeats an entry already placed in another group")
            page_of[g.positions] = i
            slot_of[g.positions] = np.arange(len(g.positions), dtype=np.int32)
        extra = np.array([len(g.copies) for g in groups], np.int16)
        if (extra > 255).any():
            raise ValueError("a page has more than 255 extra copies")
        return cls(page_of, slot_of, [np.asarray(g.positions, np.int64) for g in groups],
                   extra if extra.any() else None)

    def payload_bytes(self, page: int, entry_bytes: int) -> int:
        return len(self.pages[page]) * entry_bytes

    def extent_bytes(self, page: int, entry_bytes: int) -> int:
        return extent_size(self.payload_bytes(page, entry_bytes))
