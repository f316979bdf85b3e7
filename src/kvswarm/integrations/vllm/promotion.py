"""``InlinePromotionManager``: vLLM's tiering manager, promoting a chunk within the lookup that finds it.

vLLM's ``TieringOffloadingManager`` answers a lookup that finds a chunk in a secondary tier with
HIT_PENDING and submits its promotion (secondary -> CPU primary tier) at the end of the scheduler
step; the scheduler defers the request, sees the promotion finished at its next step, and the CPU->KV
copy lands one step after that.  A hit from a tier thus costs the request two engine steps, seconds
under load, whatever the tier's speed.

This manager submits such a promotion at once and, for a tier that can bound its wait
(:class:`InlineLoads`: the kvswarm tier, whose read of a chunk takes milliseconds), waits up to the
tier's ``inline_wait_s`` for it within the lookup.  Finished and verified, the chunk is a HIT there
and then, so the request is scheduled one step earlier; a chunk that fails its read is a MISS
(recomputed); a promotion still running at the bound stays HIT_PENDING, vLLM's way.  The lookup that
finds a request's first chunk in the tier also promotes the request's following chunks the tier holds,
as one job read from all drives at once and waited for once (the scheduler's lookups of them then hit
the primary tier).  Promoting within a
lookup allocates primary chunks in the middle of the scheduler's pass, where it may evict a chunk an
earlier lookup answered HIT and no load has pinned yet, so every HIT is held in the primary tier until
the step ends (its request's load pins it meanwhile; a request left waiting looks it up again).

The wait holds the scheduler, and so the engine, for the read of the chunks found in the tier: a step
sooner for the request, engine time for every other one (a saturated engine on one capped drive lost
more than it gained: docs/serve.md).  The tier's load policy (``deadline``) declines chunks whose load
would take longer than recomputing them.  Tiers without ``wait_loads`` (vLLM's fs tier) are promoted
exactly as vLLM does.

It relies on three of the vLLM manager's own methods (``_initiate_promotion``, which queues a
promotion, ``_flush_pending_promotions`` and ``_process_finished_jobs``, which submit and complete it);
``tests/vllm_engine/test_promotion.py`` pins their behaviour for the vLLM version the setup installs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager


@runtime_checkable
class InlineLoads(Protocol):
    """A secondary tier whose promotions a lookup may wait for."""

    inline_wait_s: float  # the longest wait within one lookup; 0: promote as vLLM does

    def wait_loads(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every submitted load job is finished; True if all are."""
        ...


class InlinePromotionManager(TieringOffloadingManager):
    """``TieringOffloadingManager`` whose lookups complete promotions from :class:`InlineLoads` tiers
    (see the module doc).  ``inline_promotions`` counts chunks promoted within their lookup,
    ``inline_timeouts`` waits that ran out (those chunks then came the deferred way)."""

    def __init__(self, primary_tier: CPUPrimaryTierOffloadingManager,
                 secondary_tiers: list[SecondaryTierManager] | None = None) -> None:
        super().__init__(primary_tier, secondary_tiers)
        self._inline = {i: t for i, t in enumerate(self.secondary_tiers)
                        if isinstance(t, InlineLoads) and t.inline_wait_s > 0}
        self._settled: OffloadKey | None = None  # the chunk the current lookup promoted and completed
        self._pins: list[tuple[OffloadKey, ReqContext]] = []  # HITs held in the primary tier until the step ends
        self.inline_promotions = 0
        self.inline_timeouts = 0

    def lookup(self, key: OffloadKey, req_context: ReqContext, *,
               exclude_tier_idx: int | None = None) -> LookupResult:
        result = super().lookup(key, req_context, exclude_tier_idx=exclude_tier_idx)
        if result is LookupResult.HIT_PENDING and self._settled == key:
            self._settled = None
            # HIT once its promotion wrote it; MISS when the read failed (the primary dropped the slot).
            result = self.primary_tier.lookup(key, req_context)
        if result is LookupResult.HIT and self._inline:
            # A HIT must still be in the primary tier when its request's load pins it, later in this step;
            # an inline promotion meanwhile allocates primary chunks and may evict unpinned ones (which
            # vLLM's deferred promotion never does within a step), so a HIT is held until the step ends.
            self.primary_tier.prepare_read([key], req_context)
            self._pins.append((key, req_context))
        return result

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._release_pins()  # this step's loads have pinned their chunks by now
        super().on_schedule_end(context)

    def reset_cache(self) -> None:
        self._release_pins()
        super().reset_cache()

    def _release_pins(self) -> None:
        for key, req_context in self._pins:
            self.primary_tier.complete_read([key], req_context)
        self._pins.clear()

    def _initiate_promotion(self, tier_idx: int, key: OffloadKey, req_context: ReqContext) -> bool:
        if not super()._initiate_promotion(tier_idx, key, req_context):
            return False
        tier = self._inline.get(tier_idx)
        if tier is None:
            return True
        following = self._promote_following(tier_idx, tier, key, req_context)
        self._flush_pending_promotions()  # this step's queued promotions, these among them: one job per request
        if not tier.wait_loads(tier.inline_wait_s):
            self.inline_timeouts += 1
            return True  # still loading: HIT_PENDING, completed at a later step as vLLM does
        self._process_finished_jobs()  # the primary tier takes the promoted chunks (or drops failed ones)
        self._settled = key
        self.inline_promotions += 1
        for k in following:
            # Held like a HIT until the step ends: the scheduler's lookup of it comes later in this pass,
            # after other promotions that could evict it meanwhile.  A failed read was dropped: a MISS then.
            if self.primary_tier.lookup(k, req_context) is LookupResult.HIT:
                self.primary_tier.prepare_read([k], req_context)
                self._pins.append((k, req_context))
                self.inline_promotions += 1
        return True

    def _promote_following(self, tier_idx: int, tier: SecondaryTierManager, key: OffloadKey,
                           req_context: ReqContext) -> list[OffloadKey]:
        """Queue the promotions of the request's chunks after ``key`` that ``tier`` holds, up to the first
        it lacks (the scheduler stops its prefix there) or the first the primary tier has no room for.

        The scheduler looks a request's chunks up one by one; promoted one per lookup, each would be
        its own job and its own wait, the drives reading one chunk at a time.  Queued together they are
        one job (vLLM's flush makes one per tier and request), read from all drives at once, waited for
        once.  vLLM records the request's chunk keys, in prompt order, only in
        ``ReqContext._offload_key_positions``; without it a chunk is promoted alone."""
        keys = list(getattr(req_context, "_offload_key_positions", ()))
        try:
            after = keys[keys.index(key) + 1:]
        except ValueError:
            return []
        queued = []
        for k in after:
            if self.primary_tier.lookup(k, req_context) is not LookupResult.MISS:
                continue  # in the primary tier already, or on its way
            if (tier.lookup(k, req_context) is not LookupResult.HIT
                    or not super()._initiate_promotion(tier_idx, k, req_context)):
                break
            queued.append(k)
        return queued
