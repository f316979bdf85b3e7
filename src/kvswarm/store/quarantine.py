"""Batches nobody will finish (a wait() that raised, a handle dropped unfinished): their buffers, and
a put's extents, go back to the store only once none of their I/O or verify jobs can still touch them.
A late DMA into a reused buffer would be wrong data, so a batch whose I/O cannot be confirmed over
stays held until a later pass finds it over."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from kvswarm.buffers import Lease
from kvswarm.catalog import Entry
from kvswarm.io.base import Batch, ReadBatch

log = logging.getLogger(__name__)
SETTLE_S = 5.0  # how long a failed batch's I/O is waited for before its buffers are held back


class Abandoned(NamedTuple):
    """A batch nobody will finish, and what it holds."""

    batch: Batch | ReadBatch  # or a kvswarm.io.native.NativeBatch
    jobs: tuple  # kvswarm.store._verify.Job
    lease: Lease | None
    extents: list[Entry]  # a put's objects, never in the catalog


class Quarantine:
    """The store's abandoned batches.

    ``poll(batch, seconds)`` takes in completions of the engine ``batch`` runs on, waiting up to
    ``seconds``; ``free(entry)`` gives a put's extent back to its drive's allocator; ``counters`` is
    the store's, whose ``"quarantined"`` counts batches held back."""

    def __init__(self, poll: Callable[[object, float], object], free: Callable[[Entry], None],
                 counters: dict[str, int]) -> None:
        self._poll = poll
        self._free = free
        self._counters = counters
        self._held: deque[Abandoned] = deque()

    def __len__(self) -> int:
        """Batches held now."""
        return len(self._held)

    def give_back(self, a: Abandoned) -> None:
        """A batch whose wait() raised: wait out its I/Os and verify jobs (up to ``SETTLE_S``), then give
        back its buffers and extents; held back (and counted) if its I/O is not confirmed over."""
        if self._settled(a, SETTLE_S):
            self._release(a)
            return
        self._counters["quarantined"] += 1
        log.warning("a failed batch's I/O is not confirmed over: %d B of buffers quarantined until it is",
                    a.lease.nbytes if a.lease is not None else 0)
        self._held.append(a)

    def hold(self, a: Abandoned) -> None:
        """A batch dropped unfinished: held until a later pass finds its I/O over.  Only queued, never
        waited on: a finalizer may run while this thread holds the pool's allocator lock."""
        self._held.append(a)

    def reclaim(self, timeout: float) -> None:
        """Give back what held batches hold once their I/O is over, waiting up to ``timeout`` s for each."""
        q = self._held
        for _ in range(len(q)):
            try:
                a = q.popleft()
            except IndexError:  # another thread took the rest
                return
            if self._settled(a, timeout):
                self._release(a)
            else:
                q.append(a)

    def _settled(self, a: Abandoned, timeout: float) -> bool:
        """Drive completions until ``a``'s I/Os are back (up to ``timeout`` s); True once they are and its
        verify jobs (CPU work that always ends: waited for unless ``timeout`` is 0) are done."""
        end = time.monotonic() + timeout
        try:
            while not a.batch.done:
                self._poll(a.batch, max(0.0, min(end - time.monotonic(), 0.01)))
                if not a.batch.done and time.monotonic() >= end:
                    return False
        except Exception:  # a broken (or closed) engine: its I/O cannot be confirmed over
            return False
        if timeout:
            for job in a.jobs:
                job.wait()
        return all(job.done for job in a.jobs)

    def _release(self, a: Abandoned) -> None:
        if a.lease is not None:
            a.lease.release()
        for e in a.extents:
            self._free(e)
