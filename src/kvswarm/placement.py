"""Placement strategies: which drive each extent of an object goes to.

The store asks a strategy for one drive per extent; the co-activation strategy of the
Swarm core plugs in through the same interface (using ``hint``, e.g. a cluster id).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvswarm.registry import Registry


@dataclass(frozen=True, slots=True)
class DriveView:
    """What a strategy may know of a drive."""

    index: int
    free_bytes: int
    healthy: bool
    kind: str = "ssd"


class PlacementStrategy(abc.ABC):
    name: str = "?"

    @abc.abstractmethod
    def place(self, digest: bytes, parts: int, drives: Sequence[DriveView], hint: object = None) -> list[int]:
        """One drive index per part, chosen among ``drives`` (all healthy, all with room)."""

    def place_many(self, digests: Sequence[bytes], drives: Sequence[DriveView],
                   hints: Sequence[object] | None = None) -> list[int]:
        """One drive per object for a batch of one-extent objects (the store's common put); the
        same choices as :meth:`place` one by one, which a strategy may make in one step."""
        place = self.place
        if hints is None:
            return [place(d, 1, drives)[0] for d in digests]
        return [place(d, 1, drives, h)[0] for d, h in zip(digests, hints)]


class RoundRobinStriping(PlacementStrategy):
    """RAID-0-like: consecutive extents, and consecutive objects, go to consecutive drives."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()  # threads putting at once still take distinct starts

    def _take(self, n: int) -> int:
        with self._lock:
            start = self._next
            self._next += n
            return start

    def place(self, digest, parts, drives, hint=None):
        start = self._take(1)
        return [drives[(start + i) % len(drives)].index for i in range(parts)]

    def place_many(self, digests, drives, hints=None):
        start, index = self._take(len(digests)), [d.index for d in drives]
        n = len(index)
        return [index[(start + i) % n] for i in range(len(digests))]


class HashPlacement(PlacementStrategy):
    """Stateless: an extent's drive is a hash of its key and part (rendezvous hashing).

    Removing or adding a drive only moves the extents that hashed to it.
    """

    name = "hash"

    def place(self, digest, parts, drives, hint=None):
        out = []
        for part in range(parts):
            salt = digest + part.to_bytes(2, "little")
            best = max(drives, key=lambda d: xxhash.xxh3_64_intdigest(salt + d.index.to_bytes(2, "little")))
            out.append(best.index)
        return out


PLACEMENTS = Registry("placement", PlacementStrategy, RoundRobinStriping, HashPlacement)
register = PLACEMENTS.register  # makes a strategy selectable by name in StoreConfig / CLI
make_placement = PLACEMENTS.make
