"""The vLLM tier's cluster level: chunks that other engines published, found and fetched through
Mooncake Store (:class:`~kvswarm.cluster.pool.ClusterPool`).

The tier's ``"cluster": {...}`` section is a :class:`~kvswarm.cluster.ClusterConfig`.  A chunk the
tier's own drives lack is looked up in the cluster without blocking the scheduler: vLLM's
``AsyncLookupManager`` batches one step's lookups into one index query on its own thread and the
tier answers RETRY until it is back.  The tier's driver thread fetches hits (verified frames) into
vLLM's chunks, writes them to its own drives (promotion), publishes the chunks it stores (``publish``:
``all`` or ``none``; an engine's store jobs carry no sightings), and re-publishes its durable chunks
whenever the master no longer indexes this node (it restarted, or took the node for dead), and at start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from kvswarm.cluster.config import ClusterConfig
from kvswarm.cluster.pool import ClusterPool
from kvswarm.errors import ClusterError

log = logging.getLogger(__name__)


class ClusterLookups(AsyncLookupManager):
    """One index query (``batch_is_exist``) per scheduler step's new keys, on vLLM's lookup thread."""

    def __init__(self, pool: ClusterPool, digest: Callable[[OffloadKey], bytes], tier_type: str) -> None:
        self._pool, self._digest = pool, digest
        super().__init__(tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._pool.contains([self._digest(k) for k in keys])


class ClusterLink:
    """The tier's handle on the cluster: the pool, its asynchronous lookups, whether stored chunks are
    published, and when the node's durable chunks are to be re-published (:meth:`republish_wanted`)."""

    def __init__(self, section: Mapping[str, object], digest: Callable[[OffloadKey], bytes], tier_type: str) -> None:
        config = ClusterConfig.from_dict(section)
        if config.publish not in ("all", "none"):
            raise ClusterError(f"the vLLM tier's cluster publication is 'all' or 'none', not {config.publish!r}")
        self.pool = ClusterPool(config)
        self.publishes = config.publish == "all"
        self.lookups = ClusterLookups(self.pool, digest, tier_type)
        self._wanted = threading.Event()
        self._wanted.set()  # at start: the cluster may have lost this node's chunks while it was down
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_index, name="kvswarm-vllm-cluster", daemon=True)
        self._watch.start()

    def _watch_index(self) -> None:
        # The index check is an RPC bounded by rpc_timeout_s: here, not on the driver thread, so a
        # stalled master never holds up the drives.
        while not self._stop.wait(self.pool.config.check_interval_s):
            if not self._wanted.is_set() and self.pool.index_lost():
                log.info("kvswarm tier: the cluster no longer indexes this node; re-publishing its chunks")
                self._wanted.set()

    def republish_wanted(self) -> bool:
        """True once (until :meth:`republished`) when the node's durable chunks should be re-published."""
        return self._wanted.is_set()

    def republished(self) -> None:
        """The re-publication is over (:class:`~kvswarm.cluster.republication.Republication` marked the
        node indexed, or left the marker absent for the next check to ask for another)."""
        self._wanted.clear()

    def close(self) -> None:
        self._stop.set()
        self._watch.join()
        self.lookups.shutdown()
        self.pool.close()
