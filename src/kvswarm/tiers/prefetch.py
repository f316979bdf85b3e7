"""Prefetch policy: how long a request waits for its cached prefix to reach DRAM.

A request's lookup starts the reads of its cached prefix at once (as soon as the
request is known, before it is scheduled); when it is scheduled, the policy says how
long to wait for them.  Blocks not in memory by then are recomputed.  The modes mirror
SGLang HiCache's ``hicache_storage_prefetch_policy``:

* ``best_effort``    take whatever has arrived, never wait;
* ``wait_complete``  wait for every read;
* ``timeout``        wait until ``timeout_s`` after the request arrived, then take what arrived.

Only a contiguous run from the first block is usable (a block's KV is only valid after
all earlier blocks), so a late block also discards every block after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class PrefetchPolicy:
    mode: str = "timeout"
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"prefetch mode {self.mode!r}: one of {', '.join(MODES)}")
        if self.timeout_s < 0:
            raise ValueError("timeout_s must be >= 0")

    def deadline(self, arrival: float) -> float:
        """Absolute time (same clock as ``arrival``) after which late blocks are recomputed."""
        if self.mode == "wait_complete":
            return math.inf
        if self.mode == "best_effort":
            return -math.inf
        return arrival + self.timeout_s

    @classmethod
    def parse(cls, spec: str) -> PrefetchPolicy:
        """``best_effort``, ``wait_complete``, ``timeout`` or ``timeout:SECONDS``."""
        mode, _, arg = spec.partition(":")
        return cls(mode, float(arg)) if arg else cls(mode)
