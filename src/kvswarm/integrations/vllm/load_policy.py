"""Whether a block the tier holds is worth loading, or cheaper to recompute (the tier's ``load_policy``).

A lookup hit makes vLLM wait for the block's load before the request's prefill can use it.  When the
drives are busy (a deep queue of loads, slow or throttled drives) a block may arrive later than the
engine would have recomputed it, so waiting for it only adds to time to first token.  A policy answers,
for each block a lookup finds, "load it" (HIT) or "recompute it" (the tier answers MISS; vLLM recomputes
that block and every later one of the request, as with any miss).

- ``always``: every block found is loaded (vLLM's tiers behave so).
- ``deadline``: a cost model.  The block's arrival is estimated as the bytes queued ahead of it (loads
  in flight, and this request's blocks found before it) over the tier's measured load rate; its
  recompute as the tokens up to and including it over ``recompute_tokens_per_s`` (the engine's
  prefill rate, given in the tier's config).  A block that cannot arrive before its recompute would
  finish is recomputed.  The load rate is an exponential average of finished load jobs' bytes over
  their time from submission to completion (a job waiting behind others reads slower, so a busy tier
  estimates conservatively); before the first load finishes, every block is loaded.  A policy that
  declines every block would never see a load again, so one slow job (a cold first read after a
  restart) would make it recompute everything from then on: when no load has finished for
  ``probe_interval_s``, the next block it would decline is loaded as a probe, and its job refreshes
  the estimate.

Policies are used by the scheduler thread (``worth_loading``) and the tier's driver thread
(``observe``); both only read and write plain floats.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvswarm.registry import Registry


class LoadRate:
    """The rate loads come in at: an exponential average of finished load jobs' bytes over their time
    from submission to completion (a job waiting behind others reads slower, so a busy tier estimates
    conservatively).  ``bytes_per_s`` is None until a load finishes."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.bytes_per_s: float | None = None

    def observe(self, nbytes: int, seconds: float) -> bool:
        """Take in a finished job; False (nothing taken) for one that moved nothing or took no time."""
        if nbytes <= 0 or seconds <= 0:
            return False
        rate, prev = nbytes / seconds, self.bytes_per_s
        self.bytes_per_s = rate if prev is None else prev + self.smoothing * (rate - prev)
        return True


class LoadPolicy:
    """Base: load everything."""

    name = "base"
    probes = 0  # blocks loaded only to refresh the policy's estimate (a policy that keeps one)

    def worth_loading(self, queued_bytes: int, block_bytes: int, tokens: int) -> bool:
        """``queued_bytes``: bytes to load ahead of this block (in flight and this request's earlier
        blocks); ``tokens``: the request's tokens up to the end of this block (what recomputing costs)."""
        return True

    def observe(self, nbytes: int, seconds: float) -> None:
        """A load job of ``nbytes`` finished ``seconds`` after it was submitted."""


class AlwaysLoad(LoadPolicy):
    name = "always"


class DeadlineLoad(LoadPolicy):
    """Recompute a block that cannot arrive before recomputing it would finish (see the module doc)."""

    name = "deadline"

    def __init__(self, recompute_tokens_per_s: float | None = None, smoothing: float = 0.2,
                 probe_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not recompute_tokens_per_s or recompute_tokens_per_s <= 0:
            raise ValueError("load_policy 'deadline' needs recompute_tokens_per_s > 0 (the engine's prefill rate)")
        self.recompute_tokens_per_s = float(recompute_tokens_per_s)
        self.rate = LoadRate(smoothing)
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self._last_news = clock()  # the last finished load, or the last probe sent

    @property
    def bytes_per_s(self) -> float | None:
        """The measured load rate; None until a load finishes."""
        return self.rate.bytes_per_s

    def worth_loading(self, queued_bytes: int, block_bytes: int, tokens: int) -> bool:
        if self.bytes_per_s is None:
            return True
        arrival = (queued_bytes + block_bytes) / self.bytes_per_s
        if arrival <= tokens / self.recompute_tokens_per_s:
            return True
        now = self._clock()
        if now - self._last_news < self.probe_interval_s:
            return False
        self._last_news = now
        self.probes += 1
        return True

    def observe(self, nbytes: int, seconds: float) -> None:
        if self.rate.observe(nbytes, seconds):
            self._last_news = self._clock()


LOAD_POLICIES: Registry[LoadPolicy] = Registry("load policy", LoadPolicy, AlwaysLoad, DeadlineLoad)


def make_load_policy(name: str | LoadPolicy, recompute_tokens_per_s: float | None = None) -> LoadPolicy:
    """The policy named ``name`` (``always`` takes no parameter)."""
    if name == DeadlineLoad.name:
        return LOAD_POLICIES.make(name, recompute_tokens_per_s)
    return LOAD_POLICIES.make(name)
