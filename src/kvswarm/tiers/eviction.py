"""Eviction strategies: which resident block leaves a full tier.

A strategy is pure bookkeeping over hashable block ids, counted in blocks (all blocks
of one KV layout have the same size).  It does no I/O: :meth:`EvictionPolicy.insert`
returns the ids it pushed out, and the caller (the tier director, or a simulator)
decides what happens to them.  Implementations:

* ``lru``      least recently used (an ``OrderedDict``; entries may carry sizes);
* ``arc``      Adaptive Replacement Cache (Megiddo & Modha, FAST'03): recency and frequency
               lists with ghost lists that tune the split between them;
* ``s3fifo``   S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO with
               reinsertion, and a ghost FIFO; one-hit wonders leave quickly.

``cachetools`` offers LRU but neither ARC nor S3-FIFO, and its caches evict inside
``__setitem__`` (we need the victims back), so all three are written here compactly.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import ClassVar

from kvswarm.registry import Registry

Key = Hashable


class EvictionPolicy(abc.ABC):
    """Residency of at most ``capacity`` blocks; subclasses choose the victims."""

    name: ClassVar[str] = "?"

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity

    @abc.abstractmethod
    def insert(self, key: Key) -> list[Key]:
        """Make ``key`` resident (a hit if it already is); returns the keys evicted to make room.

        With ``capacity == 0`` nothing is ever resident: the key itself is returned.
        """

    @abc.abstractmethod
    def touch(self, key: Key) -> bool:
        """Record a hit on ``key``; False when it is not resident."""

    @abc.abstractmethod
    def remove(self, key: Key) -> bool:
        """Forget ``key`` (lost, dropped by the caller); False when it was not resident."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Key]:
        """Resident keys, the next victim first (approximately, for ARC and S3-FIFO)."""

    def keep(self, key: Key) -> None:
        """Take back ``key``, just evicted, evicting nothing for it: the tier is over its capacity until its
        next insertion evicts again.  The policies here make it that eviction's first victim."""
        self.capacity += 1
        try:
            self.insert(key)
        finally:
            self.capacity -= 1

    def resize(self, capacity: int) -> list[Key]:
        """Change the capacity; returns the keys evicted to fit a smaller one."""
        self.capacity = max(0, capacity)
        out: list[Key] = []
        while len(self) > self.capacity:
            out.append(self._evict_one())
        return out

    @abc.abstractmethod
    def _evict_one(self) -> Key:
        """Remove and return one victim (the structure is not empty)."""


class LRU(EvictionPolicy):
    """Least recently used.  ``insert`` takes an optional ``size`` (default 1: capacity counts
    blocks) for callers whose units differ in size (the swarm's ``sized_lru``); it evicts until
    the newcomer fits, and ``len`` is the size in use."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._d: OrderedDict[Key, int] = OrderedDict()  # key -> size
        self.used = 0

    def insert(self, key: Key, size: int = 1) -> list[Key]:
        if key in self._d:
            self._d.move_to_end(key)
            return []
        if size > self.capacity:
            return [key]
        out = []
        while self.used + size > self.capacity:
            out.append(self._evict_one())
        self._d[key] = size
        self.used += size
        return out

    def touch(self, key: Key) -> bool:
        if key in self._d:
            self._d.move_to_end(key)
            return True
        return False

    def keep(self, key: Key) -> None:
        if key not in self._d:
            self._d[key] = 1
            self._d.move_to_end(key, last=False)
            self.used += 1

    def remove(self, key: Key) -> bool:
        if key in self._d:
            self.used -= self._d.pop(key)
            return True
        return False

    def _evict_one(self) -> Key:
        k, s = self._d.popitem(last=False)
        self.used -= s
        return k

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return self.used

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._d))


class ARC(EvictionPolicy):
    """T1 (seen once recently), T2 (seen twice+), ghosts B1/B2; ``p`` is T1's target size."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.p = 0.0

    def _replace(self, in_b2: bool) -> Key | None:
        """Move one resident block to its ghost list (the paper's REPLACE); returns it."""
        t1 = len(self.t1)
        if t1 and (t1 > self.p or (in_b2 and t1 == int(self.p)) or not self.t2):
            k = self.t1.popitem(last=False)[0]
            self.b1[k] = None
            return k
        if self.t2:
            k = self.t2.popitem(last=False)[0]
            self.b2[k] = None
            return k
        return None

    def insert(self, key: Key) -> list[Key]:
        if self.touch(key):
            return []
        c = self.capacity
        if c == 0:
            return [key]
        out: list[Key] = []
        full = len(self.t1) + len(self.t2) >= c
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            if full and (v := self._replace(False)) is not None:
                out.append(v)
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            if full and (v := self._replace(True)) is not None:
                out.append(v)
            del self.b2[key]
            self.t2[key] = None
        else:
            if len(self.t1) + len(self.b1) >= c:
                if len(self.t1) < c:
                    self.b1.popitem(last=False)
                    if full and (v := self._replace(False)) is not None:
                        out.append(v)
                else:
                    out.append(self.t1.popitem(last=False)[0])  # T1 fills the cache: drop, no ghost
            else:
                total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
                if total >= c:
                    if total >= 2 * c and self.b2:
                        self.b2.popitem(last=False)
                    if full and (v := self._replace(False)) is not None:
                        out.append(v)
            self.t1[key] = None
        # Lists shrunk from outside (remove) may leave the cache full; keep the invariant.
        while len(self.t1) + len(self.t2) > c:
            out.append(self._evict_one())
        return out

    def touch(self, key: Key) -> bool:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
            return True
        if key in self.t2:
            self.t2.move_to_end(key)
            return True
        return False

    def remove(self, key: Key) -> bool:
        for d in (self.t1, self.t2):
            if key in d:
                del d[key]
                return True
        return False

    def keep(self, key: Key) -> None:
        if key not in self:
            self.b1.pop(key, None)  # resident again, not a ghost
            self.b2.pop(key, None)
            self.t1[key] = None
            self.t1.move_to_end(key, last=False)

    def resize(self, capacity: int) -> list[Key]:
        out = super().resize(capacity)
        self.p = min(self.p, self.capacity)
        for ghost in (self.b1, self.b2):
            while ghost and len(self.b1) + len(self.b2) > self.capacity:
                ghost.popitem(last=False)
        return out

    def _evict_one(self) -> Key:
        k = self._replace(False)
        assert k is not None
        return k

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self.t1) + list(self.t2))


class S3FIFO(EvictionPolicy):
    """Small FIFO (``small_ratio`` of the capacity), main FIFO, ghost FIFO; 2-bit frequencies."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1) -> None:
        super().__init__(capacity)
        self.small_ratio = small_ratio
        self.small: OrderedDict[Key, int] = OrderedDict()  # key -> frequency (0..3)
        self.main: OrderedDict[Key, int] = OrderedDict()
        self.ghost: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> list[Key]:
        if self.touch(key):
            return []
        if self.capacity == 0:
            return [key]
        out: list[Key] = []
        while len(self) >= self.capacity:
            out.append(self._evict_one())
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = 0
        else:
            self.small[key] = 0
        return out

    def touch(self, key: Key) -> bool:
        for d in (self.small, self.main):
            f = d.get(key)
            if f is not None:
                d[key] = min(f + 1, 3)
                return True
        return False

    def remove(self, key: Key) -> bool:
        return self.small.pop(key, None) is not None or self.main.pop(key, None) is not None

    def keep(self, key: Key) -> None:
        if key not in self:
            self.ghost.pop(key, None)
            self.small[key] = 0
            self.small.move_to_end(key, last=False)

    def _evict_one(self) -> Key:
        # Evict from the small queue while it holds more than its share (or main is empty).
        while self.small and (len(self.small) >= max(1, int(self.small_ratio * self.capacity)) or not self.main):
            k, f = self.small.popitem(last=False)
            if f > 0:  # seen again while on probation: promote to main
                self.main[k] = 0
                continue
            self.ghost[k] = None
            while len(self.ghost) > self.capacity:
                self.ghost.popitem(last=False)
            return k
        while True:
            k, f = self.main.popitem(last=False)
            if f > 0:  # lazy promotion: reinsert with one less credit
                self.main[k] = f - 1
                continue
            return k

    def __contains__(self, key: object) -> bool:
        return key in self.small or key in self.main

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self.small) + list(self.main))


POLICIES = Registry("eviction policy", EvictionPolicy, LRU, ARC, S3FIFO)
register = POLICIES.register  # makes an eviction strategy selectable by name
make_eviction = POLICIES.make  # ``make_eviction("lru"|"arc"|"s3fifo", capacity)``
