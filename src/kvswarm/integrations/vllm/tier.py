"""kvswarm as a vLLM secondary offloading tier (``SecondaryTierManager``).

vLLM's tiering manager keeps a CPU primary tier (a shared mmap region of chunks) and
cascades stored chunks to secondary tiers, promoting them back on a hit.  This tier
puts each chunk into a :class:`~kvswarm.store.KVStore` striped over all its drives:
O_DIRECT, checksummed, durable when reported stored, found again after a restart
through the store's catalog rather than one file probe per block.

All scheduler-facing methods only queue work.  One driver thread owns the store: it
submits batched reads and writes (``submit_get`` / ``submit_put``), keeps several jobs
in flight and reports results that ``get_finished_jobs`` hands back.  Loads land in the
primary region's chunks through the store's ``into`` reads, verified: copied from its buffer pool,
or, once the region is in 2 MiB pages (from the first load on), read straight into the chunks.  A block whose read
fails its checksum, or whose drive failed, is deleted and reported failed, so vLLM
recomputes it and the next lookup is a miss (never wrong KV, never a promotion loop).

With ``load_policy: "deadline"`` (and ``recompute_tokens_per_s``, the engine's prefill rate) a block that
cannot arrive before recomputing it would finish is answered MISS, so vLLM recomputes it rather than
waits for it (:mod:`~kvswarm.integrations.vllm.load_policy`; ``load_stats`` counts how often).

With ``follow: true`` the tier reads another engine's store without writing to it (a decode
instance reading what a prefill instance stores, on the same drives): its driver thread takes
in the writer's flushes every ``refresh_interval`` seconds, and it reports every store job as
not stored.

With a ``cluster`` section (:mod:`~kvswarm.integrations.vllm.cluster`) the tier also reads what
engines on other nodes published: a chunk its drives lack is looked up in the cluster (RETRY until the
index answers), fetched and verified into vLLM's chunk, and written to this tier's drives; the chunks
it stores are published; its durable chunks are re-published when the cluster's master lost them.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent import futures
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvswarm.buffers import BufferPoolExhausted, collapse_shared_file
from kvswarm.cluster.pool import FetchHandle
from kvswarm.cluster.republication import Republication
from kvswarm.errors import FlushError
from kvswarm.format import KEY_DIGEST, extent_size
from kvswarm.integrations.keys import KeySpace, layout_dtype
from kvswarm.integrations.vllm.cluster import ClusterLink
from kvswarm.integrations.vllm.load_policy import LoadRate, make_load_policy
from kvswarm.integrations.vllm.residency import Residency
from kvswarm.layout import KVLayout
from kvswarm.store import GetHandle, KVStore, PutHandle, StoreConfig, verify_submit

# Enum members as module constants: ``LookupResult.HIT`` costs a class-attribute lookup (~0.1 us)
# in a method the scheduler calls for every block of every request.
_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

TIER_TYPE = "KVSwarmTierManager"
MODULE_PATH = "kvswarm.integrations.vllm.tier"


def vllm_layout(spec: OffloadingSpec, chunk_bytes: int, model_id: str | None = None) -> KVLayout:
    """The KVLayout whose fingerprint keys this engine's chunks.

    vLLM's offloading config gives bytes, not heads: the per-token K+V width of all
    heads is folded into ``head_dim`` of one KV head (same bytes, same fingerprint
    for the same model), and everything else that changes a chunk's bytes (model,
    parallelism, cache layout, chunk size) goes into ``model_id``.  ``cfg.model.dtype`` is
    the KV cache dtype (vLLM's ``cache_dtype`` unless ``auto``); the weights' quantization
    and revision are not in vLLM 0.32's offloading config: serving one model name with
    several takes a ``model_id`` per variant (docs/integrations.md).
    """
    cfg = spec.config
    dtype = layout_dtype(cfg.model.dtype)
    layers = sum(len(g.layer_names) for g in cfg.groups)
    tokens = cfg.groups[0].tokens_per_block * cfg.cache.blocks_per_chunk
    width = cfg.worker_kv_bytes_per_block // max(1, cfg.groups[0].tokens_per_block * layers * 2
                                                 * KVLayout(1, 1, 1, dtype).dtype_bytes)
    p = cfg.parallel
    ident = "|".join([
        f"vllm:{model_id or cfg.model.name}", f"dtype={cfg.model.dtype}", f"layout={cfg.kv_cache_layout}",
        f"canonical={cfg.canonical_layout}", f"replicated={cfg.replicated_layout}",
        f"world={p.world_size},tp={p.tp_size},pp={p.pp_size},pcp={p.pcp_size},dcp={p.dcp_size}",
        f"groups={[(g.tokens_per_block, len(g.layer_names)) for g in cfg.groups]}",
        f"chunk_bytes={chunk_bytes}", f"worker_block_bytes={cfg.worker_kv_bytes_per_block}",
    ])
    return KVLayout(num_layers=max(1, layers), num_kv_heads=1, head_dim=max(1, width), dtype=dtype,
                    tokens_per_block=tokens, model_id=ident)


def auto_queue_depth(chunk_bytes: int, inflight_bytes: int = 96 << 20) -> int:
    """Reads in flight per drive: about 96 MiB of chunks, 8 to 128 of them.

    Small chunks need the depth to keep the drive busy; large ones gain nothing past a few dozen
    in flight, and the byte budget keeps a restore's verification close behind its reads
    (measurements: docs/results.md).
    """
    return max(8, min(128, inflight_bytes // extent_size(chunk_bytes)))


@dataclass
class _Job:
    """One vLLM job, run as one or more store batches (so no job outgrows the buffer pool)."""

    job: TransferJob
    load: bool
    keys: list[OffloadKey]
    offsets: list[int]
    t0: float = field(default_factory=time.perf_counter)
    pos: int = 0  # next key to submit
    # start, end, handle, keys put
    batches: list[tuple[int, int, GetHandle | PutHandle, list[bytes]]] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)  # per key, filled as batches complete
    written: set[bytes] = field(default_factory=set)  # puts: keys this job wrote
    flush_failures: int = 0  # the tier's failed flushes when this job first wrote
    t_done: float = 0.0
    local: int = -1  # keys read from the drives (the first ones; the rest come from the cluster)
    fetch: tuple[list[int], FetchHandle] | None = None  # the cluster's part of a load: key indices, handle
    internal: bool = False  # the tier's own store (a promotion from the cluster): not reported to vLLM

    def __post_init__(self) -> None:
        if self.local < 0:
            self.local = len(self.keys)

    @property
    def done(self) -> bool:
        return self.pos == self.local and not self.batches and self.fetch is None


class KVSwarmTierManager(SecondaryTierManager):
    """Secondary tier on a kvswarm SSD pool; configure it in ``secondary_tiers``::

        {"type": "KVSwarmTierManager", "module_path": "kvswarm.integrations.vllm.tier",
         "drives": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"], "capacity_per_drive": 68719476736,
         "tenant": "team-a",
         "cluster": {"master": "10.0.0.1:50051", "local_hostname": "10.0.0.7", "publish": "all"}}

    ``cluster`` (optional) is a :class:`~kvswarm.cluster.ClusterConfig` section (docs/cluster.md).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 drives: list[str], capacity_per_drive: int = 1 << 30, meta_dir: str | None = None,
                 backend: str = "auto", queue_depth: int | None = None, stripe_unit: int | None = None,
                 placement: str = "round_robin", buffer_pool_bytes: int = 256 << 20, tenant: str = "",
                 model_id: str | None = None, durable: bool = True, flush_interval: float = 0.02,
                 max_inflight_jobs: int = 16, max_batch_bytes: int = 16 << 20, eviction: str = "lru",
                 enable_kv_events: bool = False, locality: str | None = None, follow: bool = False,
                 refresh_interval: float = 0.05, huge_pages: bool = True, load_policy: str = "always",
                 recompute_tokens_per_s: float | None = None, inline_wait_s: float = 0.05,
                 cluster: dict | None = None, backpressure_detector: BackpressureDetector | None = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.load_policy = make_load_policy(load_policy, recompute_tokens_per_s)  # first: a bad one opens nothing
        if inline_wait_s < 0:
            raise ValueError(f"inline_wait_s must be >= 0, not {inline_wait_s}")
        # How long the scheduler may wait, within a lookup, for a promotion from this tier (InlinePromotionManager):
        # the wait stops the whole engine, so it pays only for reads shorter than a fraction of a busy step.
        self.inline_wait_s = float(inline_wait_s)
        # vLLM's scheduler-side region (set by TieringOffloadingSpec.get_manager before it makes its tiers): its
        # file is what _huge_primary collapses.  None elsewhere (a tier built over another view).
        region = getattr(offloading_spec, "_scheduler_mmap", None) if huge_pages else None
        self._region_file = (region.fd, region.total_size_bytes) if getattr(region, "fd", None) is not None else None
        self.in_place = False  # loads read straight into the chunks (set once _huge_primary is done)
        # _huge_primary runs beside the driver from the first load on (the kernel's copy takes seconds per GiB, and
        # loads meanwhile copy): an engine that only stores (a prefill instance) never pays it, nor does a start-up.
        self._huge: threading.Thread | None = None
        self.region_ready = threading.Event()  # _huge_primary has finished, either way
        self.locality = Locality(locality) if locality is not None else None
        self._flat = primary_kv_view.cast("B")
        self.layout = vllm_layout(offloading_spec, self.block_size_bytes, model_id)
        self.keyspace = KeySpace.of("vllm", self.layout, tenant)
        self._prefix = self.keyspace.prefix
        self.store = KVStore(StoreConfig(
            drives=list(drives), meta_dir=meta_dir, capacity_per_drive=int(capacity_per_drive), backend=backend,
            queue_depth=queue_depth or auto_queue_depth(self.block_size_bytes), placement=placement,
            single_thread_io=True, follow=follow,  # only the driver thread does I/O
            # One extent per chunk by default: reads then land in place, with no join of parts.
            stripe_unit=stripe_unit or max(1 << 20, extent_size(self.block_size_bytes)),
            buffer_pool_bytes=max(int(buffer_pool_bytes), 4 * self.block_size_bytes)))
        self._catalog = self.store.digest_view()  # live: `in` is one C-level dict probe
        self._chunk_extent_bytes = self.store.object_bytes(self.block_size_bytes)  # on a drive and in a lease
        self.durable = durable
        self.flush_interval = flush_interval
        self.follow = follow
        self.refresh_interval = refresh_interval
        # A batch is verified once all its reads are back, and costs the driver ~0.3 ms of Python:
        # 16 MiB batches (7 chunks of 2 MiB, or a whole job of 256 KiB ones) restored 2 MiB chunks
        # at 0.97-1.01 of raw vs 0.88-0.95 with one chunk per batch (CPU 0.33 vs 0.45 s/GB); 32 MiB
        # left too little overlap (0.95).
        self.max_batch_bytes = max_batch_bytes
        self._events: list[OffloadingEvent] | None = (
            [] if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events else None)
        self._max_inflight = max(1, max_inflight_jobs)  # stores; loads are never held back
        self._active: list[_Job] = []  # jobs in flight (driver thread only)
        self._stores_waiting: deque[_Job] = deque()  # stores past max_inflight_jobs (driver thread only)
        # Stores lease at most half of the buffer pool: the rest is room for loads.
        self._store_pool_bytes = max(self._chunk_extent_bytes, self.store.buffer_bytes // 2)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey]]] = queue.SimpleQueue()
        self._pending = 0  # jobs queued or in flight, for drain_jobs
        self._loads_open = 0  # vLLM's load jobs queued or in flight, for wait_loads
        self._idle = threading.Condition()
        self._writing: set[bytes] = set()  # keys of puts in flight (driver thread only)
        # Lookup hits, for the eviction policy (a deque: append/popleft are atomic, and cheaper than a queue).
        # A follower evicts nothing (its writer owns the space): maxlen=0 drops them without a branch in lookup.
        self._seen: deque[bytes] = deque(maxlen=0 if follow else None)
        self._delete_after_write: set[bytes] = set()
        self._evicted_since_flush = 0
        self._healthy = self.store.num_drives  # healthy drives when their unreadable chunks were last dropped
        self.residency = Residency(eviction, self._capacity_chunks(), self.store, self._delete_digest)
        self._flush_failures = 0  # flushes that raised: stores written before one are not durable
        # Flushes run on a thread of their own, so the driver goes on serving loads meanwhile: an
        # fdatasync waits for the writes queued before it, 80-280 ms behind a write-capped drive.
        self._flusher = futures.ThreadPoolExecutor(1, thread_name_prefix="kvswarm-flush")
        self._unflushed: list[_Job] = []  # finished stores that wait for a flush (driver thread only)
        # The flush in flight: its future, the stores it makes durable, the deletes before it began.
        self._flushing: tuple[futures.Future, list[_Job], int] | None = None
        self._chunk_tokens = self.layout.tokens_per_block
        # Load bytes queued: submitted (scheduler thread) minus finished (driver thread), each written by one thread.
        self._load_bytes_submitted = 0
        self._load_bytes_finished = 0
        self._found: dict[str, int] = {}  # per request: blocks this tier's lookups found (and kept) so far
        self._lookup_hits = 0
        self._declined = 0  # blocks found but answered MISS: the load policy chose to recompute them
        self._load_jobs = 0
        self._load_ms = 0  # summed over load jobs, submit to finish
        self._load_ms_max = 0.0
        self._load_rate = LoadRate()  # what wait_loads predicts with, whatever the load policy
        self._inline_skips = 0  # wait_loads calls answered at once: the open loads would outlast the bound
        self._flushes = 0  # flushes, and their summed and longest time (ms; on the flusher thread)
        self._flush_ms = 0.0
        self._flush_ms_max = 0.0
        self._drop_unreadable()  # a drive unreadable at open (the store opened without it): its chunks miss
        self.cluster: ClusterLink | None = None
        if cluster is not None:
            try:
                self.cluster = ClusterLink(cluster, self._digest, tier_type)
            except BaseException:
                self.store.close()
                raise
        self._cluster_missed: deque[OffloadKey] = deque()  # fetches that failed: lookups now miss them
        # The chunks on the drives at open are re-published (the cluster may have lost them while the
        # node was down); chunks stored from now on are published as they are stored.
        self._republication: Republication | None = None
        if self.cluster is not None and not follow:
            self._republication = Republication(self.cluster.pool)
            self._republication.start(list(self._catalog))
            if not self._republication.active:
                self.cluster.republished()
        # The buffer pool is faulted in beside the driver, not in the first jobs: a fresh tier's first stores
        # spread over the whole pool (0.24 vs 1.8-1.9 GB/s once resident, see BufferPool.populate), and not
        # before them either: a restarted engine's first load waited up to 2.8 s for the pool on the driver.
        self.buffers_ready = threading.Event()  # the pool is faulted in (or cannot be ahead)
        self._warm = threading.Thread(target=self._warm_buffers, name="kvswarm-vllm-tier-warm", daemon=True)
        self._warm.start()
        self._driver = threading.Thread(target=self._run, name="kvswarm-vllm-tier", daemon=True)
        self._driver.start()
        log.info("kvswarm vLLM tier: %d drives, %d objects, chunk %d B, catalog loaded in %.3f s",
                 len(drives), len(self.store), self.block_size_bytes, self.store.reopen_seconds)

    # ---- scheduler-facing (non-blocking) -------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._found[req_context.req_id] = 0
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._found.pop(req_context.req_id, None)
        if self.cluster is not None:
            self.cluster.lookups.cleanup(req_context.req_id)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # The catalog is in memory: a lookup is one digest and a dict probe, even right after a
        # restart (inlined: the scheduler looks up every block of every new request).
        sk = self._prefix + key
        if KEY_DIGEST(sk) not in self._catalog:
            if self.cluster is None:
                return _MISS
            found = self.cluster.lookups.lookup(key, req_context)  # None: asked, not answered yet
            return _RETRY if found is None else _HIT if found else _MISS
        n = self._found.get(req_context.req_id, 0)
        bs = self.block_size_bytes
        queued = self._load_bytes_submitted - self._load_bytes_finished + n * bs
        if not self.load_policy.worth_loading(queued, bs, (n + 1) * self._chunk_tokens):
            self._declined += 1
            return _MISS  # recomputed: this block would arrive after its recompute
        self._found[req_context.req_id] = n + 1
        self._lookup_hits += 1
        self._seen.append(sk)  # recency is the driver's business: the scheduler thread only queues
        return _HIT

    def load_stats(self) -> dict[str, int | float]:
        """Lookup hits answered HIT (probes of the load policy's estimate among them), blocks found but
        recomputed by the load policy, load bytes submitted, load jobs finished with their summed and
        longest time from submit to finish (ms), and the flushes with their summed and longest time (ms)."""
        return {"lookup_hits": self._lookup_hits, "deadline_recomputes": self._declined,
                "deadline_probes": self.load_policy.probes,
                "load_bytes_submitted": self._load_bytes_submitted, "load_jobs": self._load_jobs,
                "load_ms": self._load_ms, "load_ms_max": self._load_ms_max, "inline_skips": self._inline_skips,
                "flushes": self._flushes, "flush_ms": round(self._flush_ms, 1),
                "flush_ms_max": round(self._flush_ms_max, 1)}

    def _digest(self, key: OffloadKey) -> bytes:
        return KEY_DIGEST(self._prefix + key)

    def on_schedule_end(self, context) -> None:
        if self.cluster is not None:
            self.cluster.lookups.flush()  # this step's cluster lookups, as one index query

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._enqueue(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._enqueue(job_metadata, load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if self._cluster_missed and self.cluster is not None:  # on the scheduler thread, which owns the lookups' verdicts
            missed = []
            with contextlib.suppress(IndexError):
                while True:
                    missed.append(self._cluster_missed.popleft())
            self.cluster.lookups.mark_miss(missed)
        out = []
        while True:
            try:
                result, stored = self._finished.get_nowait()
            except queue.Empty:
                return out
            out.append(result)
            if self._events is not None and stored:
                self._events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False,
                                                    locality=self.locality))

    def has_pending_work(self) -> bool:
        return self._pending > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            yield from self._events
            self._events.clear()

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def wait_loads(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every load job submitted so far is finished (its
        result then waits in ``get_finished_jobs``); True if they all are.  Used by
        :class:`~kvswarm.integrations.vllm.promotion.InlinePromotionManager` to complete a promotion
        within the lookup that found the chunk (``inline_wait_s`` bounds it).

        Answers False at once when the open loads' bytes, at the rate finished loads came in, would
        take longer than ``timeout``: a wait bound to run out only stops the engine (one capped drive
        reads a request's blocks in 150-240 ms; the promotion then completes at a later step)."""
        rate = self._load_rate.bytes_per_s
        if rate is not None and (self._load_bytes_submitted - self._load_bytes_finished) / rate > timeout:
            self._inline_skips += 1
            return False
        with self._idle:
            return self._idle.wait_for(lambda: self._loads_open == 0, timeout)

    def shutdown(self) -> None:
        self._warm.join()  # it maps the pool: done before the store unmaps it
        if self._driver.is_alive():
            self.drain_jobs()
            self._queue.put(None)
            self._driver.join()
        self._flusher.shutdown()  # idle: the driver took every flush in before it ended
        if self._huge is not None:
            self._huge.join()  # it maps the region's file: done before vLLM may close it
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        self.store.close()  # once only: a closed store's close returns at once
        self._flat.release()  # else vLLM cannot unmap its primary region

    def get_stats(self):
        return None

    def _capacity_chunks(self) -> int:
        """Chunks the pool's healthy drives hold."""
        return self.store.capacity_objects(self.block_size_bytes)

    def _enqueue(self, job: TransferJob, load: bool) -> None:
        keys = list(job.keys)
        bs = self.block_size_bytes
        offsets = [int(c) * bs for c in job.chunk_ids]
        if len(offsets) != len(keys) or any(o < 0 or o + bs > len(self._flat) for o in offsets):
            raise ValueError(f"job {job.job_id}: chunk ids do not match keys or lie outside the primary tier")
        with self._idle:
            self._pending += 1
            self._loads_open += load
        if load:
            self._load_bytes_submitted += len(keys) * bs
        if self.follow and not load:  # another engine writes this store: nothing stored, nothing lost
            self._report(JobResult(job.job_id, False, None, 0.0, 0), [])
            return
        self._queue.put(_Job(job, load, keys, offsets))

    def _warm_buffers(self) -> None:
        try:
            if not self.store.warm_buffers():  # contents are kept: safe beside the driver's leases
                log.info("kvswarm tier: this kernel cannot fault the buffer pool in ahead (MADV_POPULATE_WRITE)")
        finally:
            self.buffers_ready.set()

    # ---- driver thread: the only user of the store -------------------------------------
    def _run(self) -> None:
        if verify_submit is None:
            log.warning("kvswarm tier: kvswarm.store._verify was not built (no C compiler at install): payloads are "
                        "verified on this thread, which a busy engine thread slows down (docs/integrations.md)")
        active = self._active
        next_refresh = 0.0
        while True:
            if self.follow and time.perf_counter() >= next_refresh:
                try:
                    self.store.refresh()  # the writer's flushes since: one stat when there are none
                except Exception:  # serve the catalog as it is; the next interval tries again
                    log.exception("kvswarm tier: catalog refresh failed")
                next_refresh = time.perf_counter() + self.refresh_interval
            # An unexpected error ends this iteration, never the thread: a dead driver would leave
            # vLLM's promotions pending and drain_jobs (reset_cache, shutdown) waiting forever.
            try:
                if not self._step(active):
                    return
            except Exception:
                log.exception("kvswarm tier: driver iteration failed")
                time.sleep(0.01)  # a persistent error neither spins nor floods the log

    def _step(self, active: list[_Job]) -> bool:
        """One turn of the driver loop; False once shutdown is asked for."""
        cluster = self.cluster
        try:
            due = self._republication.due_in() if self._republication is not None else None
            block = not active and not self._stores_waiting and self._flushing is None and due != 0
            wake = self.refresh_interval if self.follow else None  # an idle follower still refreshes
            if cluster is not None:  # an idle node still re-publishes when the master asks
                wake = min(wake or 1e9, cluster.pool.config.check_interval_s, 1e9 if due is None else due)
            while True:
                item = self._queue.get(block=block, timeout=wake if block else None)
                block = False
                if item is None:
                    return False
                if item.load:  # a load never waits behind stores: a request's first token waits for it
                    self._activate(item, active)
                else:
                    self._stores_waiting.append(item)
        except queue.Empty:
            pass
        stores = sum(not j.load for j in active)
        while self._stores_waiting and stores < self._max_inflight:
            self._activate(self._stores_waiting.popleft(), active)
            stores += 1
        with contextlib.suppress(IndexError):
            while True:
                self._evict(self.residency.seen(self._seen.popleft()))
        for j in sorted(active, key=lambda j: not j.load):  # loads first, into the pool's free room
            self._submit_batches(j, force=not any(x.batches for x in active))
        progressed = False
        if any(j.batches for j in active):
            self.store.poll(0)  # one reap for every batch: `done` below makes no system call
        # Any finished batch, not only the oldest: the disk completes deep queues out of order,
        # and a batch left waiting behind another adds its verify and copy to the tail.  `done`
        # hands each batch whose reads are back to verification: every batch is asked before any
        # is completed, so none waits for verification to start while earlier ones complete.
        states = [[b[2].done for b in j.batches] for j in active]
        for j, done in zip(active, states):
            if any(done):
                ready = [b for b, d in zip(j.batches, done) if d]
                j.batches = [b for b, d in zip(j.batches, done) if not d]  # first: none is completed twice
                for b in ready:
                    # A completion that raises (a journal write, a delete) fails the batch's keys not
                    # marked done yet; the job goes on, and is reported like any other.
                    try:
                        if j.load:
                            self._complete_load(j, *b[:3])
                            # Refill the drives between verifications (each ~0.3 ms at 2 MiB) rather
                            # than after all of them: restores of 2 MiB chunks 0.98 vs 0.90 of raw.
                            self.store.progress(0)
                        else:
                            self._complete_put(j, *b)
                    except Exception:
                        log.exception("kvswarm tier: job %d batch failed to complete", j.job.job_id)
                        if not j.load:
                            self._put_failed(b[3])
                progressed = True
        if cluster is not None:
            spawned: list[_Job] = []
            for j in active:
                if j.fetch is not None and j.fetch[1].done:
                    self._complete_fetch(j, spawned)
                    progressed = True
            active.extend(spawned)
            if not self.follow and not any(j.load for j in active):
                self._republish_step()  # between loads, which a request waits for
        self._drop_unreadable()  # before any job is reported: a drive may have failed in its I/O
        finished = [j for j in active if j.done]
        for j in finished:
            active.remove(j)
            if self.durable and j.written:
                j.t_done = time.perf_counter()
                self._unflushed.append(j)  # reported once a flush makes it durable
            else:
                self._finish(j)
        progressed |= self._end_flush(wait=False)
        # One flush at a time covers every store finished before it began: it begins when no write
        # is in flight, or when the oldest finished store has waited flush_interval (bounds its latency).
        if self._unflushed and self._flushing is None and (
                not any(not j.load for j in active)
                or time.perf_counter() - self._unflushed[0].t_done > self.flush_interval):
            self._start_flush()
        elif not finished and not progressed:
            if any(j.fetch is not None for j in active) and not any(j.batches for j in active):
                cluster.pool.progress(0.001)  # only the cluster's transfers are in flight
            elif self._flushing is not None and not any(j.batches for j in active):
                futures.wait([self._flushing[0]], timeout=0.001)  # only the flush is running
            else:
                self.store.progress(0.001)  # the next I/O back, or else the next batch verified
        return True

    # ---- the cluster level (driver thread) ----------------------------------------------
    def _start_fetch(self, j: _Job) -> None:
        """Move a load's keys that the drives lack to its end and start fetching them from the cluster."""
        catalog = self._catalog
        local = [i for i, k in enumerate(j.keys) if KEY_DIGEST(self._prefix + k) in catalog]
        if len(local) == len(j.keys):
            return
        held = set(local)
        order = local + [i for i in range(len(j.keys)) if i not in held]
        j.keys, j.offsets = [j.keys[i] for i in order], [j.offsets[i] for i in order]
        j.local = len(local)
        far = list(range(j.local, len(j.keys)))
        try:
            handle = self.cluster.pool.submit_fetch([self._digest(j.keys[i]) for i in far], self.block_size_bytes)
        except Exception:  # a closed pool: these keys fail, vLLM recomputes them
            log.exception("kvswarm tier: job %d: cluster fetch failed to submit", j.job.job_id)
            self._cluster_missed.extend(j.keys[i] for i in far)
            return
        j.fetch = (far, handle)

    def _complete_fetch(self, j: _Job, spawned: list[_Job]) -> None:
        """Copy a load's verified cluster chunks into vLLM's chunks, and write them to the drives."""
        far, handle = j.fetch
        j.fetch = None
        bs = self.block_size_bytes
        got: list[int] = []
        try:
            result = handle.wait()
        except Exception:
            log.exception("kvswarm tier: job %d: cluster fetch failed", j.job.job_id)
            self._cluster_missed.extend(j.keys[i] for i in far)
            return
        try:
            for i, view in zip(far, result.views):
                if view is None or len(view) != bs:  # absent, unreachable or corrupt: recomputed
                    self._cluster_missed.append(j.keys[i])
                    continue
                self._flat[j.offsets[i]:j.offsets[i] + bs] = view
                j.ok[i] = True
                got.append(i)
        finally:
            result.release()
        if got and not self.follow:
            self._promote(j, got, spawned)

    def _promote(self, j: _Job, got: list[int], spawned: list[_Job]) -> None:
        """Write fetched chunks to the drives, from vLLM's chunks while the load still holds them (the
        put copies them before it returns): as many as one batch of the buffer pool takes now."""
        n = self.store.batch_len(len(got), self._chunk_extent_bytes, self.max_batch_bytes)
        if not n:
            return
        p = _Job(j.job, False, [j.keys[i] for i in got[:n]], [j.offsets[i] for i in got[:n]], internal=True)
        p.ok = [False] * n
        try:
            handle, put = self._submit_put(p, 0, n)
        except Exception:  # a full pool: the chunks stay in the cluster only
            log.exception("kvswarm tier: promotion of %d cluster chunks failed to submit", n)
            return
        p.pos = n
        if handle is not None:
            p.batches.append((0, n, handle, put))
        with self._idle:
            self._pending += 1
        spawned.append(p)

    def _publish(self, keys: list[bytes], views: list[memoryview]) -> None:
        """Publish chunks just stored (copied into frames before this returns)."""
        try:
            self.cluster.pool.submit_publish([KEY_DIGEST(k) for k in keys], views)
        except Exception:  # a closed pool: the chunks stay on this node's drives
            log.exception("kvswarm tier: publication of %d chunks failed", len(keys))

    def _republish_step(self) -> None:
        """Re-publish one batch of the node's durable chunks when the cluster lost them (read back
        verified; see :class:`~kvswarm.cluster.republication.Republication`)."""
        link, rp = self.cluster, self._republication
        if not rp.active:
            if not link.republish_wanted():
                return
            rp.start(list(self._catalog))  # a snapshot of the chunks on the drives now
            if not rp.active:
                link.republished()
                return
        n = self.store.batch_len(link.pool.config.republish_batch, self._chunk_extent_bytes, self.max_batch_bytes)
        batch = rp.take(n) if n else []
        if batch:
            try:
                result = self.store.submit_get_digests(batch).wait()
            except BufferPoolExhausted:
                rp.put_back(batch)
                return
            except Exception:  # deleted meanwhile: not re-published
                log.exception("kvswarm tier: reading %d chunks to re-publish failed", len(batch))
                return
            try:
                ok = [(d, v) for d, v in zip(batch, result.views) if v is not None]
                if ok:
                    rp.sent(link.pool.submit_publish([d for d, _ in ok], [v for _, v in ok]))
            finally:
                result.release()
        if rp.poll():
            link.republished()

    def start_huge_pages(self) -> None:
        """Start backing vLLM's region with 2 MiB pages now, beside the driver (it does at the first load
        otherwise); ``region_ready`` is set once that is done.  Only the driver thread, or a caller that
        knows it is idle (warm-up), calls this."""
        if self._huge is None:
            self._huge = threading.Thread(target=self._huge_primary, name="kvswarm-vllm-huge-pages", daemon=True)
            self._huge.start()

    def _huge_primary(self) -> None:
        """Back vLLM's primary region with 2 MiB pages, and if the kernel does, read loads straight into
        the chunks from then on (``in_place``): no copy, no pool buffer.

        vLLM maps its region in 4 KiB pages, and an O_DIRECT read into those is cut into several device
        requests: on this machine such reads ran at 0.75-0.94 of reads into huge pages, which is why loads
        read through the buffer pool and copy.  In 2 MiB pages they read as fast as into the pool, and the
        copy's memory traffic and CPU go (docs/integrations.md).  The kernel copies each piece once (about
        2.7 s per GiB here, on a thread of its own from the first load: jobs go on meanwhile, loads by
        copy); where it refuses (pages pinned for a GPU, no free 2 MiB of memory, a kernel before 6.1),
        loads copy as before.
        """
        try:
            if self._region_file is None or verify_submit is None:
                return
            fd, size = self._region_file
            t0 = time.perf_counter()
            huge = 0
            for _ in range(3):  # a piece a load's read has pinned meanwhile is refused whole: again, once it is over
                with contextlib.suppress(OSError):
                    huge = collapse_shared_file(fd, size)
                if huge:
                    break
            self.in_place = size == len(self._flat) and huge > 0  # a tail short of 2 MiB stays in 4 KiB pages
            log.info("kvswarm tier: %d of %d MiB of the primary region in 2 MiB pages (%.2f s); loads %s",
                     huge >> 20, size >> 20, time.perf_counter() - t0,
                     "read in place" if self.in_place else "copied from the buffer pool")
        finally:
            self.region_ready.set()

    def _activate(self, j: _Job, active: list[_Job]) -> None:
        j.ok = [False] * len(j.keys)
        active.append(j)
        if j.load:
            if self.cluster is not None:
                self._start_fetch(j)
            self.start_huge_pages()

    def _submit_batches(self, j: _Job, force: bool) -> None:
        """Submit the job's next batches while the buffer pool has room for them; stores hold at most
        half of it, so that a load finds room at once rather than after stores drain through a
        write-capped drive."""
        while j.pos < j.local:  # a load's other keys come from the cluster
            n = self.store.batch_len(j.local - j.pos, self._chunk_extent_bytes, self.max_batch_bytes)
            if not j.load:
                n = min(n, max(0, self._store_pool_bytes - self._store_leased()) // self._chunk_extent_bytes)
            if not n:
                if not (force and not j.batches):
                    return
                n = 1  # the pool is held by other jobs' batches: this one tries, or fails its chunk
            start, end = j.pos, j.pos + n
            j.pos = end
            try:
                if j.load:  # verified payloads are copied into the primary tier's chunks
                    bs, flat = self.block_size_bytes, self._flat
                    handle = self.store.submit_get([self.keyspace.key(k) for k in j.keys[start:end]],
                                                   into=[flat[o:o + bs] for o in j.offsets[start:end]],
                                                   in_place=self.in_place)
                    put = []
                else:
                    handle, put = self._submit_put(j, start, end)
            except Exception:  # a full pool or a failed submit fails these keys, never the tier
                log.exception("kvswarm tier: job %d batch failed to submit", j.job.job_id)
                continue
            if handle is not None:
                j.batches.append((start, end, handle, put))
            force = False

    def _store_leased(self) -> int:
        """Pool bytes leased by store batches in flight."""
        return sum(b[1] - b[0] for j in self._active for b in j.batches if not j.load) * self._chunk_extent_bytes

    def _submit_put(self, j: _Job, start: int, end: int) -> tuple[PutHandle | None, list[bytes]]:
        bs = self.block_size_bytes
        items, skipped = [], []
        try:
            for i in range(start, end):
                sk = self.keyspace.key(j.keys[i])
                if sk in self._writing or self.store.contains(sk):
                    skipped.append(i)  # already stored, or being stored by another job
                    continue
                victims = self.residency.admit(sk)
                if sk in victims:  # the policy keeps nothing of this size right now: reported not stored
                    continue
                items.append((sk, self._flat[j.offsets[i]:j.offsets[i] + bs]))
                self._evict(victims)
            if not items:
                handle = None
            else:
                if self._evicted_since_flush:
                    self._flush_now()  # deleted extents become reusable at a flush
                handle = self.store.submit_put(items)
        except BaseException:
            for k, _ in items:  # admitted but never written: the policy must not count them
                self.residency.forget(k)
            raise
        for i in skipped:
            j.ok[i] = True
        if handle is None:
            return None, []
        put = [k for k, _ in items]
        self._writing.update(put)
        return handle, put

    def _complete_load(self, j: _Job, start: int, end: int, handle: GetHandle) -> None:
        """A finished load batch, verified in its chunks: a key that missed is forgotten, so vLLM recomputes it."""
        missed = []
        with handle.wait() as result:
            for i, view in zip(range(start, end), result.views):
                if view is not None:
                    j.ok[i] = True
                else:  # corrupt, torn, on a failed drive
                    missed.append(i)
        # Deleted only once every verified key is marked: a delete that raises fails no good chunk.
        for i in missed:
            sk = self.keyspace.key(j.keys[i])
            self.store.delete(sk)
            self.residency.forget(sk)

    def _complete_put(self, j: _Job, start: int, end: int, handle: PutHandle, put: list[bytes]) -> None:
        keys = [self.keyspace.key(j.keys[i]) for i in range(start, end)]
        oks = dict(zip(put, handle.wait()))
        self._writing.difference_update(put)
        for k, ok in oks.items():
            if not ok:
                self.residency.forget(k)
        if not j.written:
            j.flush_failures = self._flush_failures
        for i, k in zip(range(start, end), keys):
            if k in oks:
                j.ok[i] = oks[k]
                if oks[k]:
                    j.written.add(k)
        if self.cluster is not None and self.cluster.publishes and not j.internal:
            # vLLM's chunks hold these bytes until the job is reported: published from there
            bs = self.block_size_bytes
            pub = [(k, self._flat[j.offsets[i]:j.offsets[i] + bs]) for i, k in zip(range(start, end), keys)
                   if oks.get(k)]
            if pub:
                self._publish([k for k, _ in pub], [v for _, v in pub])
        self._evict([k for k in put if k in self._delete_after_write])

    def _put_failed(self, put: list[bytes]) -> None:
        """A put batch whose completion raised: a key the catalog took is resident (the next flush
        journals it), one it did not take is forgotten."""
        self._writing.difference_update(put)
        for k in put:
            if not self.store.contains(k):
                self.residency.forget(k)
                self._delete_after_write.discard(k)
        self._evict([k for k in put if k in self._delete_after_write])

    def _evict(self, victims: list[bytes]) -> None:
        """Delete evicted chunks (driver thread); one still being written goes once its write ends."""
        now = []
        for v in victims:
            if v in self._writing:
                self._delete_after_write.add(v)
            else:
                self._delete_after_write.discard(v)
                now.append(v)
        if now:
            self._evicted_since_flush += sum(self.store.delete_many(now))

    def _drop_unreadable(self) -> None:
        """Once a drive has failed (seen in the count of healthy drives: a few attribute reads a step), delete
        the chunks with an extent on it, so that lookups miss on them rather than schedule loads that fail
        and recompute; the policy shrinks to the drives left."""
        healthy = sum(self.store.drive_health())
        if healthy == self._healthy:
            return
        self._healthy = healthy  # first: a drop that raises is not retried every step (failed loads delete)
        dropped = self.store.drop_unreadable()
        log.warning("kvswarm tier: %d of %d drives healthy; forgot the %d chunks on the failed ones", healthy,
                    self.store.num_drives, len(dropped))
        self._evict(self.residency.drop(dropped, self._capacity_chunks()))

    def _delete_digest(self, digest: bytes) -> bool:
        """Delete a chunk known by its digest only (:class:`Residency`); its space is reusable after a flush."""
        if self.store.delete_digest(digest):
            self._evicted_since_flush += 1
            return True
        return False

    def _start_flush(self) -> None:
        """Begin a flush on the flusher thread for every store finished so far."""
        self._flushing = (self._flusher.submit(self._timed_flush), self._unflushed, self._evicted_since_flush)
        self._unflushed = []

    def _timed_flush(self) -> None:
        """The flusher thread's work: ``store.flush()`` (the store takes calls from several threads)."""
        t0 = time.perf_counter()
        try:
            self.store.flush()
        finally:
            ms = (time.perf_counter() - t0) * 1000
            self._flushes += 1
            self._flush_ms += ms
            self._flush_ms_max = max(self._flush_ms_max, ms)

    def _end_flush(self, wait: bool) -> bool:
        """Take in the flush in flight once it has finished (``wait``: wait for it): count a failure,
        forget what it dropped, report the stores it made durable.  False when none finished."""
        if self._flushing is None or not (wait or self._flushing[0].done()):
            return False
        future, jobs, evicted = self._flushing
        self._flushing = None
        try:
            future.result()
            self._evicted_since_flush -= evicted  # their extents are reusable now
        except FlushError as e:  # the stores it was to make durable are reported not stored
            self._flush_failures += 1
            log.error("kvswarm tier: %s", e)
            if e.dropped:  # deleted by the store as not durable: forgotten here too
                self._evict(self.residency.drop(e.dropped, self._capacity_chunks()))
        except Exception:  # the stores it was to make durable are reported not stored
            self._flush_failures += 1
            log.exception("kvswarm tier: flush failed")
        self._drop_unreadable()  # a drive failing its fdatasync: gone before the stores are reported
        for j in jobs:
            if j.flush_failures != self._flush_failures:
                # A flush failed since it wrote (this one or an earlier one): a later fsync that
                # succeeds does not vouch for pages an earlier one failed to write back.
                j.ok = [False] * len(j.keys)
                j.written.clear()  # no 'stored' events
            self._finish(j)
        return True

    def _flush_now(self) -> None:
        """Flush and wait for it (after the one in flight, if any)."""
        self._end_flush(wait=True)
        self._start_flush()
        self._end_flush(wait=True)

    def _finish(self, j: _Job) -> None:
        if j.internal:
            self._report(None, [])
            return
        ok_keys = [k for k, ok in zip(j.keys, j.ok) if ok]
        success = len(ok_keys) == len(j.keys)
        result = JobResult(j.job.job_id, success, None if success or not j.load else tuple(ok_keys),
                           time.perf_counter() - j.t0, len(ok_keys) * self.block_size_bytes)
        if j.load:
            self.load_policy.observe(len(ok_keys) * self.block_size_bytes, result.transfer_time)
            self._load_rate.observe(len(ok_keys) * self.block_size_bytes, result.transfer_time)
            self._load_bytes_finished += len(j.keys) * self.block_size_bytes
            self._load_jobs += 1
            self._load_ms += round(result.transfer_time * 1000)
            self._load_ms_max = max(self._load_ms_max, result.transfer_time * 1000)
        # Loads write nothing: no store keys to work out for them.
        stored = [k for k in j.keys if self.keyspace.key(k) in j.written] if j.written else []
        self._report(result, stored, load=j.load)

    def _report(self, result: JobResult | None, stored: list[OffloadKey], load: bool = False) -> None:
        """A job is over: its result for vLLM (None: the tier's own job, only counted)."""
        if result is not None:
            self._finished.put((result, stored))
        with self._idle:
            self._pending -= 1
            self._loads_open -= load
            if self._pending == 0 or (load and self._loads_open == 0):
                self._idle.notify_all()
