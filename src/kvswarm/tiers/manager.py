"""TierManager: runs the director's decisions on DRAM and real SSD / capacity pools.

One request's life::

    pf = tm.prefetch(keys)        # as soon as the request is known: reads start now
    ...                           # (queueing, other work)
    hit = pf.result()             # when it is scheduled: waits as the PrefetchPolicy says
    use(hit.views)                # the usable cached prefix (header + KV per block)
    hit.release()                 # promotes SSD / capacity hits to DRAM, frees the buffers
    tm.insert(new_keys, payloads) # blocks computed for the rest of the prompt

Block identities inside the tiers are the store's key digests (``format.key_digest``),
so the state can be rebuilt from the pools' catalogs after a restart; a block's key
travels in its payload header (:mod:`kvswarm.prefix.block`) for moves between pools.
With a cluster level (``TierConfig.cluster``), a node looks up DRAM, then its SSD pool, then the
cluster's pool, then its capacity pool, then recomputes; blocks it computes are published as the
publication policy says, and blocks fetched from the cluster enter DRAM (and the SSD pool, as the
write policy says) like any other hit.  :meth:`TierManager.maintain` re-publishes the node's durable
blocks when the cluster's master has lost them (it restarted).

Any block that cannot be read back intact - missing, corrupt, on a failed drive, of
another namespace or size - is a miss (counted), and its tier forgets it.  A block moving
down whose write there fails, or is not made durable, stays where it was (counted
``moves_kept``); if its retried move fails too, it is let go (``moves_lost``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvswarm.buffers import BufferPoolExhausted
from kvswarm.cluster.config import ClusterConfig
from kvswarm.cluster.pool import ClusterPool
from kvswarm.cluster.publication import make_publication
from kvswarm.cluster.republication import Republication
from kvswarm.errors import ConfigError, DriveFull, FlushError, KVSwarmError
from kvswarm.format import key_digest
from kvswarm.prefix.block import block_key, matches
from kvswarm.prefix.keys import KEY_BYTES
from kvswarm.store import GetHandle, KVStore
from kvswarm.tiers.admission import WritePolicy
from kvswarm.tiers.demotion import DemotionPolicy
from kvswarm.tiers.director import TIERS, Action, Copy, Tier, TierDirector
from kvswarm.tiers.dram import DramTier, Slot
from kvswarm.tiers.pools import PoolConfig, block_capacity
from kvswarm.tiers.prefetch import PrefetchPolicy

log = logging.getLogger(__name__)
now = time.perf_counter
POOL_TIERS = (Tier.SSD, Tier.CAPACITY)
PUT_BATCH = 32  # pool writes submitted together


@dataclass
class TierConfig:
    block_bytes: int  # payload bytes of one block (64-byte header + KV)
    dram_bytes: int = 256 << 20
    ssd: PoolConfig | None = None
    capacity: PoolConfig | None = None
    eviction: str | Sequence[str] = "lru"  # one name, or one per tier (DRAM, SSD, capacity)
    write: str | WritePolicy = "write-through"
    demotion: str | DemotionPolicy | None = None  # default: always demote when there is a capacity pool
    prefetch: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    chunk_blocks: int = 8  # blocks per read batch: the granularity at which a late prefix is cut
    cluster: ClusterConfig | None = None  # the pool shared with other nodes (Mooncake Store)


class PrefixHit:
    """The usable cached prefix of one request: ``views[i]`` is block ``i``'s payload."""

    def __init__(self, mgr: TierManager, keys: Sequence[bytes], digests: Sequence[bytes], views: list,
                 tiers: list[Tier], pins: list, results: list, located: int, late: int, rejected: int) -> None:
        self._mgr, self.keys, self._digests = mgr, list(keys), list(digests)
        self.views, self.tiers = views, tiers
        self._pins, self._results = pins, results
        self.located, self.late, self.rejected = located, late, rejected

    def __len__(self) -> int:
        return len(self.views)

    def release(self, promote: bool = True) -> None:
        """Promote the blocks read from the pools into DRAM (unless ``promote=False``), free buffers."""
        if self._mgr is None:
            return
        try:
            if promote:
                acts: list = []
                bufs = {}
                for d, v, t in zip(self._digests, self.views, self.tiers):
                    if t != Tier.DRAM:
                        bufs[d] = v
                        acts += self._mgr.director.admit(d, t)
                self._mgr._execute(acts, bufs)
        finally:  # a failed promotion too lets go of the pins and buffers
            self.views = []
            for s in self._pins:
                s.unpin()
            for r in self._results:
                r.release()
            self._pins, self._results, self._mgr = [], [], None

    def __enter__(self) -> PrefixHit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Prefetch:
    """Reads of one request's cached prefix, started at construction; see :meth:`result`.

    A prefetch that will not be consumed is cancelled (:meth:`cancel`, or leaving its ``with`` block);
    one merely dropped is cancelled at the manager's next request.
    """

    def __init__(self, mgr: TierManager, keys: Sequence[bytes], digests: list[bytes], tiers: list[Tier],
                 arrival: float, policy: PrefetchPolicy) -> None:
        self._pins: list[tuple[int, Slot]] = []  # set first: __del__ reads them
        self._chunks: list[tuple[int, int, Tier, GetHandle]] = []
        self._mgr: TierManager | None = mgr  # None once cancelled or consumed
        self._keys, self._digests = list(keys), digests
        self.arrival, self.policy = arrival, policy
        n = len(tiers)
        self._views: list = [None] * n
        self._tiers = tiers
        i = 0
        try:
            while i < n:
                t = tiers[i]
                if t == Tier.DRAM:
                    slot = mgr.dram.pin(digests[i])
                    if slot is None:  # the director had it in DRAM but its put found no slot
                        mgr.director.lost(digests[i], Tier.DRAM)
                        n = i
                        break
                    self._pins.append((i, slot))
                    self._views[i] = slot.view
                    i += 1
                    continue
                j = i
                while j < n and tiers[j] == t and j - i < mgr.config.chunk_blocks:
                    j += 1
                try:
                    self._chunks.append((i, j, t, mgr._submit_get(t, digests[i:j])))
                except BufferPoolExhausted:  # the pool's read buffers are full: the rest is recomputed
                    mgr.counters["buffer_exhausted"] += 1
                    n = i
                    break
                i = j
        except BaseException:  # e.g. a read that could not be submitted: what was taken so far goes back
            self.cancel()
            raise
        self.located = n

    def cancel(self) -> None:
        """Abandon the prefetch: its DRAM blocks are unpinned now and nothing is promoted; its reads go
        to the manager, which frees their buffers once they are back.  No read lands in a DRAM slot (reads
        fill the pool's own buffers; only a consumed hit's release copies blocks into DRAM), so no slot
        is left half filled.  Idempotent; a no-op once :meth:`result` was called."""
        mgr, self._mgr = self._mgr, None
        if mgr is None:
            return
        mgr._abandon([s for _, s in self._pins], [h for *_, h in self._chunks])
        self._pins, self._chunks = [], []

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        # Dropped unconsumed: cancelled at the manager's next request, not here, as unpinning may free a
        # DRAM slot (taking the DRAM pool's allocator lock, which this thread may hold as the finalizer runs).
        if self._mgr is not None and (self._pins or self._chunks):
            self._mgr._dropped.append(([s for _, s in self._pins], [h for *_, h in self._chunks]))

    def poll(self) -> bool:
        """True once every read has completed (never blocks)."""
        return all(h.poll() for *_, h in self._chunks)

    def result(self) -> PrefixHit:
        """Wait per the policy, then the longest prefix that arrived intact (call once).  If it raises,
        the prefetch's pins and buffers are given back as by :meth:`cancel`."""
        mgr, self._mgr = self._mgr, None
        if mgr is None:
            raise KVSwarmError("this prefetch was cancelled, or its result was taken already")
        deadline = self.policy.deadline(self.arrival)
        usable, late, rejected = self.located, 0, 0
        results = []
        taken = 0  # chunks seen: the rest are orphaned if this raises
        try:
            for i, j, t, h in self._chunks:
                taken += 1
                if i >= usable or not _wait(h, mgr._progress(t), deadline):
                    if i < usable:
                        late = usable - i
                        usable = i
                    mgr._orphans.append(h)  # reaped (and its buffer freed) later
                    continue
                r = h.wait()
                results.append(r)
                for idx in range(i, j):
                    v = r.views[idx - i]
                    if v is None or len(v) != mgr.config.block_bytes or not matches(v, self._keys[idx]):
                        mgr._lost_in_pool(self._digests[idx], t)
                        rejected += 1
                        usable = min(usable, idx)
                    elif idx < usable:
                        self._views[idx] = v
        except BaseException:
            # The chunk that raised gave its buffers back (GetHandle.wait), or its store takes them back
            # once its handle is dropped (below); those not reached yet are orphaned.
            for r in results:
                r.release()
            mgr._abandon([s for _, s in self._pins], [h for *_, h in self._chunks[taken:]])
            self._chunks = []
            raise
        pins = [s for i, s in self._pins if i < usable]
        for i, s in self._pins:
            if i >= usable:
                s.unpin()
        c = mgr.counters
        c["requests"] += 1
        c["blocks"] += len(self._keys)
        for t in self._tiers[:usable]:
            c[f"hit_{t.name.lower()}"] += 1
        c["misses"] += len(self._keys) - usable
        c["late"] += late
        c["rejected"] += rejected
        return PrefixHit(mgr, self._keys[:usable], self._digests[:usable], self._views[:usable],
                         self._tiers[:usable], pins, results, self.located, late, rejected)


def _check_keys(keys: Sequence[bytes]) -> None:
    """Block keys are KEY_BYTES bytes (a block's header holds the key whole): any other is refused, as it
    would be stored under a key its header cannot carry and never be found again below DRAM."""
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ConfigError(f"a block key is {KEY_BYTES} bytes, not {k!r}")


def _wait(h, progress: Callable[[float], object], deadline: float) -> bool:
    """Drive completions (``progress(timeout)``) until ``h`` is done or ``deadline`` passes; True when done."""
    if deadline == math.inf:
        return True
    while not h.poll():
        rem = deadline - now()
        if rem <= 0:
            return False
        progress(min(rem, 0.05))
    return True


class TierManager:
    """DRAM + SSD pool + capacity pool for blocks of ``config.block_bytes``.

    ``stores`` may supply already-open pools (tests, testbeds); otherwise they are
    opened from ``config.ssd`` / ``config.capacity``.  Opening existing pools restores
    every flushed block (see :attr:`reopen_seconds`).  ``cluster`` may supply an already-joined
    cluster pool; otherwise one joins ``config.cluster`` (and re-publishes the durable blocks).
    """

    def __init__(self, config: TierConfig, stores: dict[Tier, KVStore] | None = None,
                 cluster: ClusterPool | None = None) -> None:
        t0 = now()
        self.config = config
        self.stores: dict[Tier, KVStore] = dict(stores or {})
        for t, pc in ((Tier.SSD, config.ssd), (Tier.CAPACITY, config.capacity)):
            if t not in self.stores and pc is not None:
                self.stores[t] = pc.open()
        bb = config.block_bytes
        dram_blocks = config.dram_bytes // bb
        caps = [dram_blocks] + [block_capacity(self.stores[t], bb) if t in self.stores else 0 for t in POOL_TIERS]
        self.director = TierDirector(caps, config.eviction, config.write, config.demotion)
        self.dram = DramTier(dram_blocks, bb)
        self.counters: Counter[str] = Counter()
        # Puts in flight: (pool, digests, handle, per block the DRAM slot its bytes came from, held till reaped)
        self._puts: list[tuple[Tier, list[bytes], object, list[Slot | None]]] = []
        self._pending: dict[Tier, Counter[bytes]] = {t: Counter() for t in POOL_TIERS}
        self._doomed: dict[Tier, set[bytes]] = {t: set() for t in POOL_TIERS}
        # Per pool, blocks being copied into it from another pool that has dropped them (a demotion):
        # digest -> that pool, whose copy is deleted only once this pool's copy is durable.
        self._moving: dict[Tier, dict[bytes, Tier]] = {t: {} for t in POOL_TIERS}
        self._kept: set[bytes] = set()  # blocks kept where they were after a failed move, until the next one ends
        self._queued: dict[Tier, dict[bytes, tuple]] | None = None  # _execute's queued writes, while it runs
        self._orphans: list[GetHandle] = []
        # Pins and reads of prefetches dropped unconsumed, to let go at the next prefetch (see Prefetch.__del__)
        self._dropped: deque[tuple[list[Slot], list[GetHandle]]] = deque()
        self._healthy = {t: sum(s.drive_health()) for t, s in self.stores.items()}
        for t, s in self.stores.items():  # warm restart: oldest first, so recency survives roughly
            self._execute(self.director.restore(t, [d for d, _ in s.entries_oldest_first()]), {})
        self.reopen_seconds = now() - t0
        if cluster is None and config.cluster is not None:
            cluster = ClusterPool(config.cluster)
        self.cluster = cluster
        self.publication = make_publication(cluster.config.publish if cluster else "none")
        # The durable blocks are re-published after a start: the cluster may have lost this node's
        # blocks while it was down.
        self._republication = Republication(cluster) if cluster else None
        if self._republication is not None:
            self._republication.start(self._durable_digests())

    # ---- the request path ------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes], arrival: float | None = None,
                 policy: PrefetchPolicy | None = None) -> Prefetch:
        """Locate the cached prefix of ``keys`` and start reading it; ``arrival`` defaults to now."""
        _check_keys(keys)
        while self._dropped:
            self._abandon(*self._dropped.popleft())
        self._reap(wait=False)
        self._check_health()
        digests = [key_digest(k) for k in keys]
        tiers = self.director.lookup(digests)
        if self.cluster is not None:
            self.maintain()
            tiers = self._with_cluster(digests, tiers)
        for t in POOL_TIERS:  # a block is readable once its put completed
            pending = self._pending[t]
            if pending and any(p == t and pending[d] for d, p in zip(digests, tiers)):
                self._reap(t)
        return Prefetch(self, keys, digests, tiers, now() if arrival is None else arrival,
                        policy or self.config.prefetch)

    def lookup(self, keys: Sequence[bytes], policy: PrefetchPolicy | None = None) -> PrefixHit:
        return self.prefetch(keys, policy=policy).result()

    def insert(self, keys: Sequence[bytes], payloads: Sequence[object]) -> None:
        """Blocks computed for a request enter DRAM, and the pools as the write policy says."""
        _check_keys(keys)
        if len(keys) != len(payloads):
            raise ConfigError(f"{len(keys)} keys for {len(payloads)} payloads")
        bb = self.config.block_bytes
        for k, p in zip(keys, payloads):
            if (n := memoryview(p).nbytes) != bb:
                raise ConfigError(f"the payload of block {k.hex()} is {n} B; this manager's blocks are {bb} B")
        self._check_health()
        acts: list[Action] = []
        bufs: dict[bytes, object] = {}
        for k, p in zip(keys, payloads):
            d = key_digest(k)
            bufs[d] = p
            acts += self.director.admit(d, None)
        self._execute(acts, bufs)
        if self.cluster is not None:
            pub = [(d, p) for d, p in bufs.items() if self.publication.publish(self.director.info(d).sightings)]
            if pub:
                self.cluster.submit_publish([d for d, _ in pub], [p for _, p in pub])

    # ---- the cluster level -----------------------------------------------------------------
    def _with_cluster(self, digests: list[bytes], tiers: list[Tier]) -> list[Tier]:
        """The node's own tiers for ``digests`` (its longest local prefix), with the cluster serving the
        blocks that its capacity pool holds or that no local tier holds (a contiguous prefix again)."""
        ask = [i for i, t in enumerate(tiers) if t == Tier.CAPACITY] + list(range(len(tiers), len(digests)))
        if not ask:
            return tiers
        held = dict(zip(ask, self.cluster.contains([digests[i] for i in ask])))
        out: list[Tier] = []
        for i in range(len(digests)):
            t = tiers[i] if i < len(tiers) else None
            if t in (Tier.DRAM, Tier.SSD):
                out.append(t)
            elif held.get(i):
                out.append(Tier.CLUSTER)
            elif t is not None:
                out.append(t)
            else:
                break
        return out

    def _submit_get(self, tier: Tier, digests: Sequence[bytes]):
        if tier == Tier.CLUSTER:
            return self.cluster.submit_fetch(digests, self.config.block_bytes)
        return self.stores[tier].submit_get_digests(digests)

    def _progress(self, tier: Tier) -> Callable[[float], object]:
        return self.cluster.progress if tier == Tier.CLUSTER else self.stores[tier].poll

    def _durable_digests(self) -> list[bytes]:
        seen: dict[bytes, None] = {}
        for t in POOL_TIERS:
            if t in self.stores:
                seen.update(dict.fromkeys(self.director.tiers[t]))
        return list(seen)

    def maintain(self, budget: int | None = None) -> int:
        """Cluster upkeep (each prefetch calls it): once the master no longer indexes this node's
        blocks (it restarted, failed over, or took this node for dead), re-publish the node's durable
        blocks, reading up to ``budget`` (default ``republish_batch``) per call so that requests never
        wait for all of them (:class:`~kvswarm.cluster.republication.Republication`).  Returns how
        many blocks this call handed to the cluster."""
        rp = self._republication
        if rp is None:
            return 0
        if not rp.active and self.cluster.index_lost():
            rp.start(self._durable_digests())
        batch = rp.take(budget or self.cluster.config.republish_batch)
        sent = self._publish_from_pools(batch) if batch else 0
        rp.poll()
        return sent

    @property
    def republishing(self) -> bool:
        """A re-publication is under way (:meth:`maintain` drives it)."""
        return self._republication is not None and self._republication.active

    def republish(self) -> int:
        """Re-publish every durable block now and wait until the re-publication is over (blocks the
        cluster refuses are tried again for ``republish_retry_s``); how many were handed to the cluster
        (``cluster.counters["republished_blocks"]`` counts those that landed)."""
        rp = self._republication
        if rp is None:
            return 0
        rp.start(self._durable_digests())
        done = 0
        while rp.active:
            done += self.maintain(self.cluster.config.republish_batch)
            if not rp.poll(self.cluster.config.rpc_timeout_s) and (due := rp.due_in()):
                time.sleep(due)  # refused blocks, tried again shortly
        return done

    def _publish_from_pools(self, digests: list[bytes]) -> int:
        """Read ``digests`` back from the pools (verified) and publish them; how many were handed over."""
        self._reap()  # a block being written is only readable once its put completed
        by_tier: dict[Tier, list[bytes]] = {}
        for d in digests:
            t = next((t for t in POOL_TIERS if t in self.stores and d in self.director.tiers[t]), None)
            if t is not None:
                by_tier.setdefault(t, []).append(d)
        sent = 0
        for t, ds in by_tier.items():
            try:
                r = self.stores[t].submit_get_digests(ds).wait()
            except BufferPoolExhausted:
                self._republication.put_back(ds)  # tried again at the next step
                continue
            try:
                ok = [(d, v) for d, v in zip(ds, r.views)
                      if v is not None and (k := block_key(v)) is not None and key_digest(k) == d]
                if ok:
                    h = self.cluster.submit_publish([d for d, _ in ok], [v for _, v in ok])
                    self._republication.sent(h)
                    sent += len(ok)
            finally:
                r.release()
        return sent

    def evict(self, keys: Sequence[bytes], tier: Tier) -> None:
        """Push blocks out of ``tier`` now, with the usual write-back / demotion consequences."""
        _check_keys(keys)
        acts: list[Action] = []
        for k in keys:
            acts += self.director.evict(key_digest(k), tier)
        self._execute(acts, {})

    def clear_dram(self) -> None:
        """Evict every DRAM block (write-back applies): DRAM is then cold, as after a restart."""
        acts: list[Action] = []
        for d in list(self.director.tiers[Tier.DRAM]):
            acts += self.director.evict(d, Tier.DRAM)
        self._execute(acts, {})

    def flush(self) -> None:
        """Write back what the write policy keeps, then make every pool durable.  A drive failing meanwhile
        costs the blocks written to it (forgotten, as any failed drive's), never the call."""
        self._execute(self.director.flush(), {})
        self._reap()
        failed = False
        for t, s in self.stores.items():
            try:
                s.flush()
            except FlushError as e:
                log.error("%s pool: %s", t.name, e)
                for dg in e.dropped:  # not durable: the store deleted them
                    self._lost_in_pool(dg, t)
                failed = True
        if failed:
            self._check_health()
        if self.cluster is not None:
            self.cluster.drain(self.cluster.config.rpc_timeout_s * 4)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if not self.stores:
            return
        self.flush()
        for s in self.stores.values():
            s.close()
        self.stores = {}
        self.dram.clear()

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- execution of actions --------------------------------------------------------------
    def _execute(self, acts: list[Action], bufs: dict[bytes, object]) -> None:
        """Run actions in order.  The pool reads they need are issued first, one batch per pool;
        pool writes are queued and submitted in batches (a queued block is read from its queue)."""
        results: list = []
        pre = self._preread(acts, results)
        queued: dict[Tier, dict[bytes, tuple]] = {t: {} for t in POOL_TIERS}
        self._queued = queued  # for _submit: a full pool may wait on writes queued for the one below
        try:
            for a in acts:
                if isinstance(a, Copy):
                    data = self._source(a.key, a.src, bufs, pre, queued, results)
                    if data is None:
                        self.counters["copy_failures"] += 1
                        self.director.lost(a.key, a.dst)
                    elif a.dst == Tier.DRAM:
                        if not self.dram.put(a.key, data):
                            # Write-backs hold dropped slots until their puts are back (a failed one keeps
                            # its block in DRAM): write out the queued ones, wait for all, try again.
                            for t in POOL_TIERS:
                                self._submit(t, queued[t])
                            self._reap()
                            if not self.dram.put(a.key, data):
                                self.director.lost(a.key, Tier.DRAM)
                    else:
                        self._queue(a.dst, a.key, data, a.src, queued)
                elif a.tier == Tier.DRAM:
                    self.dram.drop(a.key)
                elif (q := queued[a.tier].pop(a.key, None)) is not None:
                    if q[2] is not None:  # never written: let go of its DRAM slot
                        q[2].let_go()
                    self._moved(a.tier, a.key)  # nor will be: a pool it was leaving lets it go now
                elif self._pending[a.tier][a.key]:
                    self._doomed[a.tier].add(a.key)
                elif (dst := next((t for t in POOL_TIERS if t != a.tier and (
                        a.key in queued[t] or self._pending[t][a.key])), None)) is not None:
                    # Demoted: this copy goes once the one below is durable, so a failed write or a
                    # crash in between loses nothing.
                    self._moving[dst][a.key] = a.tier
                else:
                    self.stores[a.tier].delete_digest(a.key)
        finally:
            for t in POOL_TIERS:
                self._submit(t, queued[t])
            self._queued = None
            for r in results:
                r.release()

    def _preread(self, acts: list[Action], results: list) -> dict[tuple[bytes, Tier], object]:
        """Issue the pool reads ``acts`` will need, as one batch per pool (blocks written earlier
        in ``acts`` or still being written are left to the in-order path)."""
        want: dict[Tier, list[bytes]] = {t: [] for t in POOL_TIERS}
        seen: set[tuple[bytes, Tier]] = set()
        for a in acts:
            if isinstance(a, Copy):
                if a.src in want and (a.key, a.src) not in seen and not self._pending[a.src][a.key]:
                    want[a.src].append(a.key)
                if a.dst in want:
                    seen.add((a.key, a.dst))
                seen.add((a.key, a.src))
        handles = []
        for t, ds in want.items():
            if ds:
                try:
                    handles.append((t, ds, self.stores[t].submit_get_digests(ds)))
                except BufferPoolExhausted:  # too much at once: these go through the in-order path
                    continue
        views: dict[tuple[bytes, Tier], object] = {}
        for t, ds, h in handles:
            r = h.wait()
            results.append(r)
            views.update(((d, t), v) for d, v in zip(ds, r.views))
        return views

    def _source(self, digest: bytes, src: Tier | None, bufs: dict, pre: dict, queued: dict, results: list):
        """The bytes of ``digest`` in ``src`` (None: the caller's buffer), or None when unreadable."""
        if src is None:
            return bufs.get(digest)
        if src == Tier.DRAM:
            return self.dram.get(digest)
        if (q := queued[src].get(digest)) is not None:
            return q[1]
        if (digest, src) in pre:
            v = pre[digest, src]
        else:
            if self._pending[src][digest]:
                self._reap(src)  # a block being written is only readable once its put completed
            try:
                r = self.stores[src].submit_get_digests([digest]).wait()
            except BufferPoolExhausted:
                self.counters["buffer_exhausted"] += 1
                return None
            results.append(r)
            v = r.views[0]
        if v is None or (k := block_key(v)) is None or key_digest(k) != digest:
            self._lost_in_pool(digest, src)
            return None
        return v

    def _abandon(self, pins: list[Slot], reads: list[GetHandle]) -> None:
        """Let go of an unconsumed prefetch's DRAM pins now; its reads' buffers go once they are back."""
        for s in pins:
            s.unpin()
        self._orphans += reads

    def _lost_in_pool(self, digest: bytes, tier: Tier) -> None:
        """A pool block read back missing, corrupt or not the block asked for: the director forgets
        it, and its store drops it (else its extents stay taken, counted by nobody, until the key is
        written again; a restart would count it again, and fail it again).  The cluster's blocks are
        not the director's: one that fails is a miss, counted by the cluster pool."""
        if tier == Tier.CLUSTER:
            return
        self.director.lost(digest, tier)
        if self._pending[tier][digest]:
            self._doomed[tier].add(digest)  # a newer write is in flight: dropped once it completes
        else:
            self.stores[tier].delete_digest(digest)

    def _queue(self, tier: Tier, digest: bytes, data, src: Tier | None, queued: dict) -> None:
        key = block_key(data)
        if key is None or key_digest(key) != digest:
            self.counters["copy_failures"] += 1
            self.director.lost(digest, tier)
            return
        # A DRAM block's slot is held until its put is back (it may be dropped meanwhile: a failed write
        # gives it back to DRAM), also when it comes by way of another pool's queued write (a block
        # demoted further down before its own write-back went out): dropping that write lets go of it.
        if src == Tier.DRAM:
            slot = self.dram.hold(digest)
        elif src in queued and (q := queued[src].get(digest)) is not None and q[2] is not None:
            slot = q[2].hold()
        else:
            slot = None
        queued[tier][digest] = (key, data, slot)
        if len(queued[tier]) >= PUT_BATCH:
            self._submit(tier, queued[tier])

    def _submit(self, tier: Tier, q: dict[bytes, tuple]) -> None:
        if not q:
            return
        items = list(q.items())
        q.clear()
        store = self.stores[tier]
        self._reap(tier, wait=False)  # finished puts give their staging buffers back
        taken = 0  # items registered: the DRAM slots they hold go with their puts, let go when reaped

        def register(batch: list[tuple[bytes, tuple]], h) -> None:
            nonlocal taken
            ds = [d for d, _ in batch]
            for d in ds:
                self._doomed[tier].discard(d)
                self._pending[tier][d] += 1
            self._puts.append((tier, ds, h, [slot for _, (_, _, slot) in batch]))
            taken += len(batch)

        try:
            try:
                register(items, store.submit_put([(k, v) for _, (k, v, _) in items]))
            except (DriveFull, BufferPoolExhausted):  # one at a time: as many as fit
                for item in items:
                    _, (k, v, _) = item
                    try:
                        try:
                            h = store.submit_put([(k, v)])
                        except (DriveFull, BufferPoolExhausted):
                            # Puts in flight hold staging buffers, blocks dropped while their put was
                            # in flight still hold extents, and so do blocks demoted to another pool
                            # until their write there is durable: write, complete them all, try again.
                            for other in POOL_TIERS:
                                if other != tier and self._queued is not None:
                                    self._submit(other, self._queued[other])
                            self._reap()
                            h = store.submit_put([(k, v)])
                    except (DriveFull, BufferPoolExhausted):
                        # Reaped later as a failed write, like one that came back so: by then the Drop
                        # of a demoted block above (listed right after its Copy) has marked it moving,
                        # and it stays there.
                        h = _REFUSED
                    register([item], h)
        finally:
            for _, (_, _, slot) in items[taken:]:  # never submitted
                if slot is not None:
                    slot.let_go()

    def _reap(self, tier: Tier | None = None, wait: bool = True) -> None:
        """Complete the puts in flight (of one tier, or all; with ``wait=False`` only those already
        done) and free abandoned reads."""
        keep = []
        landed: dict[Tier, list[bytes]] = {t: [] for t in POOL_TIERS}  # demoted blocks now written
        for put in self._puts:
            t, ds, h, slots = put
            if tier is not None and t != tier or not wait and not h.poll():
                keep.append(put)
                continue
            try:
                oks = h.wait()
            except (KVSwarmError, OSError) as e:  # nothing of the batch was stored
                log.warning("%s pool: a put of %d blocks failed: %s", t.name, len(ds), e)
                oks = [False] * len(ds)
            for d, ok, slot in zip(ds, oks, slots):
                self._pending[t][d] -= 1
                last = not self._pending[t][d]  # no other write of it into t is out
                if last:
                    del self._pending[t][d]
                if not ok:
                    self.counters["put_failures"] += 1
                    self.director.lost(d, t)
                if last and d in self._doomed[t]:  # dropped from t while written: its move ends here too
                    self._doomed[t].discard(d)
                    self.stores[t].delete_digest(d)
                    self._moved(t, d)
                elif last and ok and d in self._moving[t]:
                    landed[t].append(d)
                elif ok:
                    self._kept.discard(d)
                elif last:
                    self._stay(t, d, slot)
                if slot is not None:
                    slot.let_go()
        self._puts = keep
        for t, ds in landed.items():
            if ds:
                self._land(t, ds)
        if tier is None:
            left = []
            for h in self._orphans:
                try:
                    if wait or h.poll():
                        h.wait().release()
                    else:
                        left.append(h)
                except Exception as e:  # nobody wants this read any more; its store took its buffers back
                    log.warning("an abandoned prefix read failed: %s", e)
            self._orphans = left

    def _land(self, tier: Tier, ds: list[bytes]) -> None:
        """Blocks demoted into ``tier`` are written: once durable there, their copies above go.  One that
        the flush does not make durable (on a drive that failed, or the catalog's sync failed) stays above."""
        store = self.stores[tier]
        lost = False
        try:
            store.flush()
        except FlushError as e:  # the other drives and the catalog are synced; the store deleted the rest
            log.error("%s pool: %s", tier.name, e)
            lost = True
            for dg in set(e.dropped) - set(ds):  # blocks written there before: not durable either
                self._lost_in_pool(dg, tier)
        except (KVSwarmError, OSError) as e:  # the catalog: none of them is durable yet
            log.error("%s pool: flush failed: %s", tier.name, e)
            for d in ds:
                self._stay(tier, d, None)
            return
        dead = store.failed_drives()
        for d, e in zip(ds, store.locate_digests(ds) if dead or lost else [None] * len(ds)):
            if lost and e is None or e is not None and any(x.drive in dead for x in e.extents):
                self._stay(tier, d, None)
            else:
                self._moved(tier, d)

    def _stay(self, tier: Tier, digest: bytes, slot: Slot | None) -> None:
        """``digest``'s write into ``tier`` failed, or did not become durable.  A block moving down stays
        where it was: in the pool it was leaving (whose copy is kept till then), or in DRAM when its bytes
        came from a slot DRAM dropped (the write's hold kept it) and no tier holds it.  It stays as its
        tier's next victim, so the next eviction there tries the move again; a block whose retried move
        fails too is let go, counted: a failing tier below costs a block per eviction above, never a
        growing backlog of retries."""
        src = self._moving[tier].pop(digest, None)
        if src is not None:
            if digest in self.director.tiers[src] or self._pending[src][digest] \
                    or digest not in self.stores[src].digest_view():
                return  # taken back meanwhile, or gone with a failed drive
            back = src
        elif slot is not None and slot.dropped and digest not in self.dram and self.director.locate(digest) is None:
            back = Tier.DRAM
        else:
            return  # a copy that was not leaving anywhere (a write-through), or one another tier holds
        if digest in self._kept:
            self._kept.discard(digest)
            self.counters["moves_lost"] += 1
            if back != Tier.DRAM:
                self.stores[back].delete_digest(digest)
            return
        self._kept.add(digest)
        self.counters["moves_kept"] += 1
        if back == Tier.DRAM:
            self.dram.revive(digest, slot)
        self.director.keep(digest, back)

    def _moved(self, tier: Tier, digest: bytes) -> None:
        """``digest``'s copy into ``tier`` is durable, or its move is over (cancelled, or the block dropped
        from ``tier`` meanwhile): delete the copy in the pool it was demoted from, unless that pool has
        taken the block back meanwhile."""
        self._kept.discard(digest)
        src = self._moving[tier].pop(digest, None)
        if src is not None and digest not in self.director.tiers[src] and not self._pending[src][digest]:
            self.stores[src].delete_digest(digest)

    def _check_health(self) -> None:
        """After a drive failure: forget its blocks and shrink the pool's capacity."""
        for t, s in self.stores.items():
            healthy = sum(s.drive_health())
            if healthy == self._healthy[t]:
                continue
            self._healthy[t] = healthy
            self._reap(t)
            for dg in s.unreadable_digests():
                self._lost_in_pool(dg, t)  # its puts were reaped above: dropped at once
            log.warning("%s pool: %d of %d drives healthy", t.name, healthy, s.num_drives)
            self._execute(self.director.resize(t, block_capacity(s, self.config.block_bytes)), {})

    # ---- reporting -------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        blocks = c["blocks"] or 1
        return {
            "served": dict(c),
            "hit_rate": {t.name.lower(): c[f"hit_{t.name.lower()}"] / blocks for t in Tier}
            | {"total": sum(c[f"hit_{t.name.lower()}"] for t in Tier) / blocks},
            "director": dict(self.director.counters),
            "resident": {t.name.lower(): self.director.resident(t) for t in TIERS},
            "capacity_blocks": {t.name.lower(): self.director.capacity(t) for t in TIERS},
            "pools": {t.name.lower(): s.stats() for t, s in self.stores.items()},
        } | ({"cluster": self.cluster.stats()} if self.cluster is not None else {})


class _Refused:
    """The handle of a put its pool refused (no room, no staging buffer): failed at once, and reaped
    like a write that came back failed."""

    @staticmethod
    def poll() -> bool:
        return True

    @staticmethod
    def wait() -> list[bool]:
        return [False]


_REFUSED = _Refused()

