"""Demotion policies: what happens to a block the SSD pool evicts.

* ``drop``        it is gone (recomputed if it comes back);
* ``always``      it moves to the capacity pool (a plain inclusive cascade);
* ``cost-aware``  it moves only when that is expected to pay:

      P(return) * (recompute_s - capacity_read_s)  >  ssd_read_s + capacity_write_s

  ``recompute_s`` comes from a :class:`~kvswarm.tiers.costs.ComputeModel` at the block's
  position in its prefix (deep blocks attend to more tokens and cost more to recompute),
  the I/O terms from the pools' :class:`~kvswarm.tiers.costs.DriveCost`.  P(return) is
  learned online: evicted blocks are remembered in a bounded ghost list (its length is
  the capacity pool's, since a block that returns later would be gone from there anyway)
  and counted per sighting bucket; P = (returned + 1) / (evicted + 2) for the block's
  bucket (1, 2, 3 or 4+ sightings).  Blocks seen once in a long prompt rarely return; a
  shared system prompt seen thousands of times nearly always does.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

from kvswarm.tiers.costs import ComputeModel, DriveCost


@dataclass(slots=True)
class BlockInfo:
    """What the director knows of a block when it asks a policy."""

    sightings: int = 0  # requests that referenced it (hit or miss)
    position: int = 0  # block index inside its prefix, at the last sighting


class DemotionPolicy(abc.ABC):
    name: ClassVar[str] = "?"

    @abc.abstractmethod
    def demote(self, key: Hashable, info: BlockInfo) -> bool:
        """The SSD pool evicts ``key``: move it to the capacity pool (True) or drop it?"""

    def on_sighting(self, key: Hashable, info: BlockInfo) -> None:  # noqa: B027 - optional learning hook
        """A request referenced ``key`` (called for every block of every lookup)."""

    def __repr__(self) -> str:
        return self.name


class NeverDemote(DemotionPolicy):
    name = "drop"

    def demote(self, key, info):
        return False


class AlwaysDemote(DemotionPolicy):
    name = "always"

    def demote(self, key, info):
        return True


def _bucket(sightings: int) -> int:
    return min(max(sightings, 1), 4) - 1


class CostAware(DemotionPolicy):
    name = "cost-aware"

    def __init__(self, compute: ComputeModel, tokens_per_block: int, block_bytes: int,
                 ssd: DriveCost, capacity: DriveCost, ghost_size: int = 100_000) -> None:
        self.compute, self.tokens_per_block, self.block_bytes = compute, tokens_per_block, block_bytes
        self.ssd, self.capacity = ssd, capacity
        self.ghost_size = ghost_size
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()  # evicted key -> sighting bucket
        self.evicted = [0, 0, 0, 0]
        self.returned = [0, 0, 0, 0]
        self.decisions = {"demoted": 0, "dropped": 0}

    def p_return(self, info: BlockInfo) -> float:
        b = _bucket(info.sightings)
        return (self.returned[b] + 1) / (self.evicted[b] + 2)

    def worth(self, info: BlockInfo) -> tuple[float, float]:
        """(expected seconds saved by keeping the block on the capacity pool, seconds the move costs)."""
        recompute = self.compute.block_seconds(info.position * self.tokens_per_block, self.tokens_per_block)
        gain = self.p_return(info) * (recompute - self.capacity.read_seconds(self.block_bytes))
        return gain, self.ssd.read_seconds(self.block_bytes) + self.capacity.write_seconds(self.block_bytes)

    def demote(self, key, info):
        gain, cost = self.worth(info)
        b = _bucket(info.sightings)
        self.evicted[b] += 1
        self._ghost[key] = b
        self._ghost.move_to_end(key)
        while len(self._ghost) > self.ghost_size:
            self._ghost.popitem(last=False)
        out = gain > cost
        self.decisions["demoted" if out else "dropped"] += 1
        return out

    def on_sighting(self, key, info):
        b = self._ghost.pop(key, None)
        if b is not None:
            self.returned[b] += 1


def make_demotion(spec: str | DemotionPolicy, **cost_kw) -> DemotionPolicy:
    """``drop``, ``always``, or ``cost-aware`` (needs the :class:`CostAware` keyword arguments)."""
    if isinstance(spec, DemotionPolicy):
        return spec
    if spec == NeverDemote.name:
        return NeverDemote()
    if spec == AlwaysDemote.name:
        return AlwaysDemote()
    if spec == CostAware.name:
        return CostAware(**cost_kw)
    raise ValueError(f"unknown demotion policy {spec!r}; one of drop, always, cost-aware")
