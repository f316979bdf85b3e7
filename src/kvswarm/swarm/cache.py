"""DRAM hot-cluster cache policies with sizes, behind the tiers' ``EvictionPolicy`` interface.

Units (cluster pieces, pages) have different sizes here, so both policies take
``insert(key, size)`` and count capacity in the caller's unit (entries or bytes).

* ``sized_lru`` -- least recently used, evicting until the newcomer fits.
* ``per_layer_lru`` -- one ``sized_lru`` per layer, each with an equal share of the capacity
  (keys are ``(layer, unit)``): a decode that sweeps the layers in order cannot let one layer's
  reads evict every other layer's units.
* ``cost_benefit`` -- the Swarm paper's score ``S = (f * T_base + s * T_transfer) / s`` for a
  unit of size ``s`` read ``f`` times (decayed): the I/O time caching it saves per unit of
  DRAM, where a read costs a fixed ``T_base`` (per-I/O latency, or 1/IOPS) plus ``s *
  T_transfer``.  The lowest score leaves first, and a newcomer is admitted only if it beats
  what it would displace (``admit``), so one-off reads of big units do not flush small hot
  ones.  Frequencies are kept for every resident unit and for at most ``ghosts`` non-resident
  ones (the most recently read or evicted); ``decay`` is in (0, 1].

The simulator imports these like the tiers' own policies (``make_eviction("cost_benefit", n)``).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator

from kvswarm.tiers.eviction import LRU, EvictionPolicy, register

Key = Hashable


@register
class SizedLRU(LRU):
    """The tiers' :class:`LRU` (which takes sizes), with the ``admit`` test the unit cache asks."""

    name = "sized_lru"

    def admit(self, key: Key, size: int = 1) -> bool:
        return size <= self.capacity

    def fits(self, key: Key, size: int) -> bool:
        """Whether ``key`` of ``size`` fits beside what is resident, evicting nothing."""
        return self.used + size <= self.capacity


@register
class PerLayerLRU(EvictionPolicy):
    """A :class:`SizedLRU` per layer (``layers`` of them, ``capacity // layers`` each); keys are
    ``(layer, unit)`` tuples."""

    name = "per_layer_lru"

    def __init__(self, capacity: int, layers: int = 1) -> None:
        super().__init__(capacity)
        if layers < 1:
            raise ValueError(f"per_layer_lru needs at least one layer, got {layers}")
        self.parts = [SizedLRU(capacity // layers) for _ in range(layers)]

    def _part(self, key: Key) -> SizedLRU:
        return self.parts[key[0]]  # type: ignore[index]

    def insert(self, key: Key, size: int = 1) -> list[Key]:
        return self._part(key).insert(key, size)

    def admit(self, key: Key, size: int = 1) -> bool:
        return self._part(key).admit(key, size)

    def fits(self, key: Key, size: int) -> bool:
        return self._part(key).fits(key, size)

    def touch(self, key: Key) -> bool:
        return self._part(key).touch(key)

    def remove(self, key: Key) -> bool:
        return self._part(key).remove(key)

    def _evict_one(self) -> Key:
        return max(self.parts, key=len)._evict_one()

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and 0 <= key[0] < len(self.parts) and key in self.parts[key[0]]

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __iter__(self) -> Iterator[Key]:
        return (k for p in self.parts for k in p)


@register
class CostBenefit(EvictionPolicy):
    name = "cost_benefit"

    def __init__(self, capacity: int, t_base: float = 1.0, t_transfer: float = 0.0, decay: float = 0.98,
                 ghosts: int = 1 << 16) -> None:
        super().__init__(capacity)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"cost_benefit decay must be in (0, 1], got {decay!r}")
        self.t_base, self.t_transfer, self.decay, self.ghosts = t_base, t_transfer, decay, ghosts
        self._size: dict[Key, int] = {}  # resident
        # Frequencies are kept scaled to epoch 0 (f * decay**-epoch): decay is the same for every
        # key, so the order of scores never changes by itself and a lazy heap stays valid.  The
        # scale is folded back into the counts before it passes 1e100 (or every 4096 steps).
        self._fref: dict[Key, float] = {}
        self._rescale_at = 4096 if decay == 1.0 else max(1, min(4096, int(100 * math.log(10) / -math.log(decay))))
        self._ghost: OrderedDict[Key, None] = OrderedDict()  # non-resident keys with a count, oldest first
        self._heap: list[tuple[float, int, Key]] = []
        self._seq = 0
        self.epoch = 0
        self.used = 0

    # ---- frequencies ----
    def tick(self) -> None:
        """One decode step passed: older reads weigh ``decay`` less."""
        self.epoch += 1
        if self.epoch >= self._rescale_at:  # rescale before decay**-epoch grows large
            k = self.decay ** self.epoch
            for key in self._fref:
                self._fref[key] *= k
            self.epoch = 0
            self._heap = []
            for key in self._size:
                self._push(key)

    def freq(self, key: Key) -> float:
        return self._fref.get(key, 0.0) * self.decay ** self.epoch

    def record(self, key: Key, count: float = 1.0) -> None:
        """Count ``count`` reads of ``key`` (resident or not)."""
        self._fref[key] = self._fref.get(key, 0.0) + count * self.decay ** -self.epoch
        if key in self._size:
            self._push(key)
        else:
            self._to_ghost(key)

    def _to_ghost(self, key: Key) -> None:
        """``key`` (with a count, not resident) is now the newest ghost; the oldest beyond
        ``ghosts`` are forgotten (residents' counts never are)."""
        self._ghost[key] = None
        self._ghost.move_to_end(key)
        while len(self._ghost) > self.ghosts:
            del self._fref[self._ghost.popitem(last=False)[0]]

    def score(self, key: Key, size: int) -> float:
        return (self.freq(key) * self.t_base + size * self.t_transfer) / max(size, 1)

    def _ref(self, key: Key) -> float:
        return self._fref.get(key, 0.0) / max(self._size[key], 1)

    def _push(self, key: Key) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self._ref(key), self._seq, key))

    def _pop_valid(self) -> tuple[float, int, Key] | None:
        while self._heap:
            r, q, k = heapq.heappop(self._heap)
            if k in self._size and r == self._ref(k):
                return r, q, k
        return None

    # ---- residency ----
    def _victims(self, size: int) -> list[Key]:
        """The lowest-scoring residents that must leave for ``size`` to fit (heap restored)."""
        need = self.used + size - self.capacity
        taken: list[tuple[float, int, Key]] = []
        freed = 0
        while freed < need and (item := self._pop_valid()) is not None:
            taken.append(item)
            freed += self._size[item[2]]
        for item in taken:
            heapq.heappush(self._heap, item)
        return [k for _, _, k in taken]

    def admit(self, key: Key, size: int = 1) -> bool:
        """Whether ``key`` should enter: it fits, or it scores above everything it would evict."""
        if key in self._size:
            return True
        if size > self.capacity:
            return False
        mine = self.score(key, size)
        return all(self.score(k, self._size[k]) < mine for k in self._victims(size))

    def insert(self, key: Key, size: int = 1) -> list[Key]:
        if key in self._size:
            return []
        if size > self.capacity:
            return [key]
        out = self._victims(size)
        self._ghost.pop(key, None)
        self._size[key] = size
        self.used += size
        self._fref.setdefault(key, 0.0)
        self._push(key)
        for k in out:
            self.used -= self._size.pop(k)
            self._to_ghost(k)
        return out

    def touch(self, key: Key) -> bool:
        self.record(key)
        return key in self._size

    def fits(self, key: Key, size: int) -> bool:
        """Whether ``key`` of ``size`` fits beside what is resident, evicting nothing."""
        return self.used + size <= self.capacity

    def remove(self, key: Key) -> bool:
        if key in self._size:
            self.used -= self._size.pop(key)
            self._to_ghost(key)
            return True
        return False

    def _evict_one(self) -> Key:
        item = self._pop_valid()
        assert item is not None
        self.used -= self._size.pop(item[2])
        self._to_ghost(item[2])
        return item[2]

    def __contains__(self, key: object) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return self.used

    def __iter__(self) -> Iterator[Key]:
        return iter(sorted(self._size, key=lambda k: self.score(k, self._size[k])))
