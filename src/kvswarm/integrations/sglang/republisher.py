"""The SGLang backend's re-publication of its durable pages to the cluster, on a thread of its own.

SGLang calls its storage backend only while it serves (backups, prefetches, existence checks): an
idle server makes no call in which to notice that the cluster's master restarted.  So a writer rank
that publishes owns a :class:`Republisher`: a daemon thread that checks the master's index of this
node every ``check_interval_s`` (:meth:`ClusterPool.index_lost`, an RPC bounded by ``rpc_timeout_s``,
never on SGLang's threads) and, when it is lost, and at start, re-publishes the pages on the rank's
writable stores one batch at a time through
:class:`~kvswarm.cluster.republication.Republication`.  A batch is read back verified from its
store (``submit_get_digests``, within a quarter of the store's buffer pool, so SGLang's own reads
and backups keep the rest) and published; the next is read once that publication is done, so the
frames in flight stay one batch.  :class:`~kvswarm.store.KVStore` takes calls from several threads
at once (SGLang's backup and prefetch threads already share it); :meth:`Republisher.close` stops
the thread before the stores close.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvswarm.buffers import BufferPoolExhausted
from kvswarm.cluster.pool import ClusterPool
from kvswarm.cluster.republication import Republication
from kvswarm.store import KVStore

log = logging.getLogger(__name__)
BUSY_PAUSE_S = 0.05  # no room in a store's buffer pool for a batch: SGLang's calls hold it


class Republisher:
    """Re-publishes the pages of ``stores()`` (the writable stores open now) whenever the cluster no
    longer indexes this node, and at start (see the module doc).  :meth:`want` asks for another
    round (a store opened since); :meth:`close` stops it, within one step (the index check's RPCs,
    one batch read and its publication)."""

    def __init__(self, pool: ClusterPool, stores: Callable[[], Sequence[KVStore]]) -> None:
        self.pool = pool
        self._stores = stores
        self._rp = Republication(pool)
        self._wanted = threading.Event()
        self._wanted.set()  # at start: the cluster may have lost these pages while the server was down
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvswarm-sglang-cluster", daemon=True)
        self._thread.start()

    def want(self) -> None:
        """Re-publish every store's pages once more, after the round in progress."""
        self._wanted.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pause = self._step()
            except Exception:  # the thread outlives any failure: the next step tries again
                log.exception("kvswarm HiCache backend: re-publication step failed")
                pause = self.pool.config.check_interval_s
            self._stop.wait(pause)

    def _step(self) -> float:
        """One step: check the index or start a round, publish one batch; seconds until the next."""
        rp, cfg = self._rp, self.pool.config
        if not rp.active:
            if not self._wanted.is_set() and self.pool.index_lost():
                log.info("kvswarm HiCache backend: the cluster no longer indexes this node; re-publishing its pages")
                self._wanted.set()
            if not self._wanted.is_set():
                return cfg.check_interval_s
            self._wanted.clear()
            digests = [d for s in self._stores() for d in s.digests()]  # the pages on the drives now
            rp.start(digests)
            if not rp.active:  # none: marked indexed
                return cfg.check_interval_s
            log.info("kvswarm HiCache backend: re-publishing %d pages to the cluster", len(digests))
        pause = 0.0
        batch = rp.take(cfg.republish_batch)
        if batch and not self._send(batch):
            pause = BUSY_PAUSE_S
        if rp.poll():
            log.info("kvswarm HiCache backend: re-publication over (%s)",
                     "node indexed" if rp.complete else "the master left: started again at its return")
            return 0.0 if self._wanted.is_set() else cfg.check_interval_s
        due = rp.due_in()
        return max(pause, due or 0.0)

    def _send(self, batch: list[bytes]) -> bool:
        """Read ``batch`` back from the stores holding it and publish it, waiting for the publication;
        what finds no room now is put back.  False when nothing was read."""
        rp, sent = self._rp, False
        for store in self._stores():
            held = store.digest_view()
            mine = [d for d in batch if d in held]  # the others: deleted since, or in another store
            if not mine:
                continue
            per = store.object_bytes(max((e.payload_len for e in store.locate_digests(mine) if e is not None),
                                         default=0))
            if per > store.buffer_bytes:  # never readable through this buffer pool (a smaller one than wrote them)
                log.warning("kvswarm HiCache backend: %d pages of %d B do not fit the buffer pool: not re-published",
                            len(mine), per)
                continue
            n = store.batch_len(len(mine), per, store.buffer_bytes // 4)
            rp.put_back(mine[n:])
            if not n:
                continue
            try:
                result = store.submit_get_digests(mine[:n]).wait()
            except BufferPoolExhausted:
                rp.put_back(mine[:n])
                continue
            try:
                got = [(d, v) for d, v in zip(mine, result.views) if v is not None]  # misses: deleted or corrupt
                handle = self.pool.submit_publish([d for d, _ in got], [v for _, v in got]) if got else None
            finally:
                result.release()
            sent = True
            if handle is not None:
                rp.sent(handle)
                while not handle.poll() and not self._stop.is_set():
                    self.pool.progress(0.1)
        return sent
