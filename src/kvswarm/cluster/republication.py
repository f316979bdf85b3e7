"""Re-publishing a node's durable blocks after the cluster lost them (its master restarted, failed
over, or took the node for dead), as a step machine its owner drives between requests.

    rp = Republication(pool)
    rp.start(digests)                  # the blocks on this node's drives now
    while rp.active:                   # the owner's loop, between requests
        batch = rp.take(n)             # digests to read back (verified) and publish now; [] while waiting
        rp.sent(pool.submit_publish(batch_digests_read, views))
        rp.poll()                      # True once over: the node is then marked indexed, or not

A restarted master refuses puts until the node's segment is mounted again (a second or more after
the restart): refused blocks are tried again every ``check_interval_s`` for ``republish_retry_s``.
Once the window is over, a master that still answers has no room for the rest (they stay on the
drives, served here) and the node is marked indexed; a master gone meanwhile leaves the marker
absent, so the next index check starts over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvswarm.cluster.pool import ClusterPool, PublishHandle
log = logging.getLogger(__name__)
now = time.monotonic


class Republication:
    """One node's re-publication (see the module doc).  Not thread-safe: one thread drives it."""

    def __init__(self, pool: ClusterPool) -> None:
        self.pool = pool
        self._pending: list[bytes] = []
        self._inflight: list[PublishHandle] = []
        self._started = 0.0
        self._retry_at = 0.0
        self._landed = 0
        self.complete: bool | None = None  # the last re-publication's outcome: marked indexed or not

    @property
    def active(self) -> bool:
        return bool(self._pending or self._inflight)

    def due_in(self) -> float | None:
        """Seconds until there is work for :meth:`take` or :meth:`poll` (0: now); None when over."""
        if self._inflight:
            return 0.0
        return max(0.0, self._retry_at - now()) if self._pending else None

    def start(self, digests: Sequence[bytes]) -> None:
        """Re-publish ``digests``; with none, the node is marked indexed now."""
        self._pending, self._inflight, self._landed = list(digests), [], 0
        self._started = self._retry_at = now()
        if not self._pending:
            self._finish(True)

    def take(self, n: int) -> list[bytes]:
        """Up to ``n`` digests to publish now ([] while none is due)."""
        if not self._pending or now() < self._retry_at:
            return []
        batch, self._pending = self._pending[:n], self._pending[n:]
        return batch

    def put_back(self, digests: Sequence[bytes]) -> None:
        """Digests taken but not sent (no buffer to read them into): taken again at the next step."""
        self._pending[:0] = digests

    def sent(self, handle: PublishHandle) -> None:
        self._inflight.append(handle)

    def poll(self, timeout: float = 0.0) -> bool:
        """Collect the publications once all are done (waiting up to ``timeout`` s for them); True when
        the re-publication is over (:attr:`complete` says whether the node was marked indexed)."""
        if self._pending or not self._inflight:
            return not self.active
        if not timeout and not all(h.poll() for h in self._inflight):
            return False
        deadline = now() + timeout
        try:
            refused = [d for h in self._inflight for d in h.refused(max(0.0, deadline - now()))]
        except TimeoutError:  # still running: asked again at the next poll
            return False
        self._landed += sum(h.wait() for h in self._inflight)
        self._inflight = []
        if refused and now() - self._started < self.pool.config.republish_retry_s and self.pool.healthy():
            self._pending, self._retry_at = refused, now() + self.pool.config.check_interval_s
            return False
        if refused:
            log.info("cluster: %d of %d re-published blocks were refused", len(refused), self._landed + len(refused))
        self._finish(not refused or self.pool.healthy())
        return True

    def _finish(self, complete: bool) -> None:
        self.pool.counters["republished_blocks"] += self._landed
        self.complete = complete and self.pool.mark_indexed()
