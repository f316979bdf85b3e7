"""The tier director: every placement decision of the DRAM -> SSD pool -> capacity pool hierarchy.

The director is pure Python and does no I/O.  It tracks which tier holds which block
(through one :class:`~kvswarm.tiers.eviction.EvictionPolicy` per tier), asks the write
and demotion policies, and answers each event with the list of :data:`Action`\\ s that
must happen, in order.  :class:`~kvswarm.tiers.manager.TierManager` executes them on
real stores; a simulator executes them on modelled drives: both share these decisions.

Events:

* :meth:`lookup` - a request arrives with its block keys: which tiers serve its longest
  cached prefix (every block is also counted as a *sighting*);
* :meth:`admit`  - a block's bytes are now in hand (computed, or read from a lower tier)
  and enter DRAM; returns the writes and evictions that follows;
* :meth:`lost`   - a tier could not serve a block it was thought to hold (corrupt,
  failed drive, deadline): forget it there;
* :meth:`keep`   - a block leaving a tier could not be written where it went: it stays;
* :meth:`evict`, :meth:`flush`, :meth:`resize`, :meth:`restore` - explicit moves, write-back of
  DRAM, capacity changes (a failed drive), and state rebuilt after a restart.

The hierarchy is *inclusive*: a block promoted from the SSD pool to DRAM keeps its SSD
copy (it costs nothing to keep and makes the next DRAM eviction free).  Actions are
``Copy(key, src, dst)`` (``src=None``: the caller's buffer) and ``Drop(key, tier)``; a
``Copy`` is always listed before a ``Drop`` of its source, and a tier's victims are
dropped before the block that displaced them is copied in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from kvswarm.tiers.admission import WritePolicy, make_write_policy
from kvswarm.tiers.demotion import AlwaysDemote, BlockInfo, DemotionPolicy, NeverDemote, make_demotion
from kvswarm.tiers.eviction import EvictionPolicy, make_eviction


class Tier(IntEnum):
    DRAM = 0
    SSD = 1
    CAPACITY = 2
    CLUSTER = 3  # the pool shared by many nodes: served by the manager, not placed by the director


TIERS = (Tier.DRAM, Tier.SSD, Tier.CAPACITY)  # the node's own tiers, which the director places


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy ``key``'s bytes from ``src`` (None: the caller's buffer) into tier ``dst``."""

    key: Hashable
    src: Tier | None
    dst: Tier


@dataclass(frozen=True, slots=True)
class Drop:
    """Remove ``key`` from ``tier``."""

    key: Hashable
    tier: Tier


Action = Copy | Drop


class TierDirector:
    """Decisions for three tiers of ``capacities[tier]`` blocks each (0 = tier absent).

    ``eviction`` is one policy name for all tiers or one per tier.  ``demotion`` defaults
    to ``always`` when there is a capacity pool.  ``track`` bounds the per-block statistics
    (sightings, position) kept for the policies.
    """

    def __init__(self, capacities: Sequence[int], eviction: str | Sequence[str | EvictionPolicy] = "lru",
                 write: str | WritePolicy = "write-through", demotion: str | DemotionPolicy | None = None,
                 track: int | None = None) -> None:
        if len(capacities) != 3:
            raise ValueError("capacities: one per tier (DRAM, SSD, capacity)")
        if capacities[Tier.CAPACITY] and not capacities[Tier.SSD]:
            raise ValueError("a capacity pool needs an SSD pool above it")
        evs = [eviction] * 3 if isinstance(eviction, str) else list(eviction)
        self.tiers: list[EvictionPolicy] = [make_eviction(e, c) for e, c in zip(evs, capacities)]
        self.write = make_write_policy(write)
        if demotion is None:
            demotion = AlwaysDemote() if capacities[Tier.CAPACITY] else NeverDemote()
        self.demotion = make_demotion(demotion)
        self.track = track or max(100_000, 4 * sum(capacities))
        self._info: OrderedDict[Hashable, BlockInfo] = OrderedDict()
        self._incoming: Hashable | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            ["requests", "blocks", "located_dram", "located_ssd", "located_capacity", "misses",
             "writes_dram", "writes_ssd", "writes_capacity", "evictions_dram", "evictions_ssd",
             "evictions_capacity", "demotions", "promotions_ssd", "promotions_capacity", "promotions_cluster",
             "lost_dram", "lost_ssd", "lost_capacity", "kept_dram", "kept_ssd"], 0)

    # ---- queries ---------------------------------------------------------------------------
    def has(self, tier: Tier) -> bool:
        return self.tiers[tier].capacity > 0

    def locate(self, key: Hashable) -> Tier | None:
        """The fastest tier holding ``key``, or None."""
        for t in TIERS:
            if key in self.tiers[t]:
                return t
        return None

    def info(self, key: Hashable) -> BlockInfo:
        return self._info.get(key) or BlockInfo()

    def capacity(self, tier: Tier) -> int:
        return self.tiers[tier].capacity

    def resident(self, tier: Tier) -> int:
        return len(self.tiers[tier])

    # ---- events ----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[Hashable]) -> list[Tier]:
        """Tiers serving the longest cached prefix of ``keys`` (one per hit block, in order).

        Every key counts as a sighting (for selective admission and cost-aware demotion),
        and each hit refreshes the block in the tier that serves it.
        """
        for i, k in enumerate(keys):
            self._sight(k, i)
        out: list[Tier] = []
        for k in keys:
            t = self.locate(k)
            if t is None:
                break
            self.tiers[t].touch(k)
            out.append(t)
        c = self.counters
        c["requests"] += 1
        c["blocks"] += len(keys)
        for t in out:
            c[f"located_{t.name.lower()}"] += 1
        c["misses"] += len(keys) - len(out)
        return out

    def admit(self, key: Hashable, source: Tier | None = None) -> list[Action]:
        """``key``'s bytes are in the caller's hands and enter DRAM.

        ``source`` is the tier they were read from (None: computed); it only counts
        promotions.  Copies out of the caller's buffer carry ``src=None``.
        """
        acts: list[Action] = []
        if source is not None and source != Tier.DRAM:
            self.counters[f"promotions_{source.name.lower()}"] += 1
        s = self.info(key).sightings
        ssd_src: Tier | None = None
        if self.has(Tier.DRAM):
            dram = self.tiers[Tier.DRAM]
            if key in dram:
                dram.touch(key)
                return acts
            self._incoming = key  # in DRAM's policy before its bytes are: a demotion must read the buffer
            for v in dram.insert(key):
                acts += self._out(Tier.DRAM, v)
            self._incoming = None
            acts.append(Copy(key, None, Tier.DRAM))
            self.counters["writes_dram"] += 1
            ssd_src = Tier.DRAM
            to_ssd = self.write.write_on_admit(s)
        else:  # no DRAM tier: the block leaves "DRAM" as soon as it arrives
            to_ssd = self.write.write_on_admit(s) or self.write.write_on_evict(s)
        if to_ssd and self.has(Tier.SSD) and key not in self.tiers[Tier.SSD]:
            acts += self._place(Tier.SSD, key, ssd_src)
        return acts

    def lost(self, key: Hashable, tier: Tier) -> None:
        """``tier`` could not produce ``key`` (corrupt, unreadable, failed drive): forget it there."""
        if self.tiers[tier].remove(key):
            self.counters[f"lost_{tier.name.lower()}"] += 1

    def keep(self, key: Hashable, tier: Tier) -> None:
        """``key`` left ``tier`` but its write below failed: it stays in ``tier``, over its capacity and as
        the first victim of its next eviction, which tries the move again."""
        self.tiers[tier].keep(key)
        self.counters[f"kept_{tier.name.lower()}"] += 1

    def evict(self, key: Hashable, tier: Tier) -> list[Action]:
        """Push ``key`` out of ``tier`` now, with the usual consequences (write-back, demotion)."""
        if not self.tiers[tier].remove(key):
            return []
        return self._out(tier, key)

    def flush(self) -> list[Action]:
        """Writes that make every DRAM block the write policy would keep durable on the SSD pool."""
        acts: list[Action] = []
        if self.has(Tier.DRAM) and self.has(Tier.SSD):
            ssd = self.tiers[Tier.SSD]
            for k in self.tiers[Tier.DRAM]:
                if k not in ssd and self.write.write_on_evict(self.info(k).sightings):
                    acts += self._place(Tier.SSD, k, Tier.DRAM)
        return acts

    def resize(self, tier: Tier, capacity: int) -> list[Action]:
        """New capacity for ``tier`` (e.g. a drive failed); returns the evictions it forces."""
        acts: list[Action] = []
        for v in self.tiers[tier].resize(capacity):
            acts += self._out(tier, v)
        return acts

    def restore(self, tier: Tier, keys: Iterable[Hashable]) -> list[Action]:
        """Seed ``tier`` with blocks found after a restart (oldest first); drops any that do not fit."""
        acts: list[Action] = []
        pol = self.tiers[tier]
        for k in keys:
            acts += [Drop(v, tier) for v in pol.insert(k)]
        return acts

    # ---- internals -------------------------------------------------------------------------
    def _sight(self, key: Hashable, position: int) -> None:
        inf = self._info.get(key)
        if inf is None:
            inf = self._info[key] = BlockInfo()
            if len(self._info) > self.track:
                self._info.popitem(last=False)
        else:
            self._info.move_to_end(key)
        inf.sightings += 1
        inf.position = position
        self.demotion.on_sighting(key, inf)

    def _place(self, tier: Tier, key: Hashable, src: Tier | None) -> list[Action]:
        acts: list[Action] = []
        for w in self.tiers[tier].insert(key):
            acts += self._out(tier, w)
        acts.append(Copy(key, src, tier))
        self.counters[f"writes_{tier.name.lower()}"] += 1
        return acts

    def _out(self, tier: Tier, key: Hashable) -> list[Action]:
        """``key`` has left ``tier``'s policy: what must happen to its bytes."""
        acts: list[Action] = []
        self.counters[f"evictions_{tier.name.lower()}"] += 1
        if tier == Tier.DRAM:
            if self.has(Tier.SSD) and key not in self.tiers[Tier.SSD] \
                    and self.write.write_on_evict(self.info(key).sightings):
                acts += self._place(Tier.SSD, key, Tier.DRAM)
        elif tier == Tier.SSD:
            if self.has(Tier.CAPACITY) and key not in self.tiers[Tier.CAPACITY] \
                    and self.demotion.demote(key, self.info(key)):
                self.counters["demotions"] += 1
                src = None if key == self._incoming else Tier.DRAM if key in self.tiers[Tier.DRAM] else Tier.SSD
                acts += self._place(Tier.CAPACITY, key, src)
        acts.append(Drop(key, tier))
        return acts
