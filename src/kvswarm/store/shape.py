"""How callers should cut a stream of reads or writes into batches so that a store's drives stay busy:
keys per batch and batches in flight, from the object size, the drives' queue depth and the buffer pool
(:meth:`kvswarm.store.KVStore.read_shape` / :meth:`~kvswarm.store.KVStore.write_shape` apply it to an
open store)."""

from __future__ import annotations

from dataclasses import dataclass

from kvswarm.format import ALIGN


@dataclass(frozen=True)
class BatchShape:
    """``keys`` per submit_get / submit_put batch, ``inflight`` batches outstanding."""

    keys: int
    inflight: int


@dataclass(frozen=True)
class Resources:
    """What a shape is fitted to: the stripe unit, the healthy drives and each one's queue depth, and
    the buffer pool every batch in flight leases from."""

    stripe_unit: int
    healthy: int
    queue_depth: int
    pool_bytes: int


def read_shape(object_bytes: int, res: Resources) -> BatchShape:
    """For reads of objects taking ``object_bytes`` each: four times every healthy drive's queue depth
    of extents outstanding, in at least four batches, so that while the caller finishes one batch and
    submits the next the ring still has reads queued to refill from (two ring-fulls in two batches left
    the drives short: 4 KiB reads over four directories at 0.80-0.88 of raw's rate against 0.9-1.0 with
    four batches, 16 KiB 0.80 against 0.89-0.93).  Batches of at most 4 MiB and 256 keys (a batch's
    fixed cost shared by many keys) but at least 4 keys (one submission per few large objects), all
    within half the buffer pool."""
    return _shape(object_bytes, res, batch_bytes=4 << 20, min_keys=4, max_keys=256, cover=4)


def write_shape(object_bytes: int, res: Resources) -> BatchShape:
    """For a stream of puts of objects taking ``object_bytes`` each: batches of up to 8 MiB and 2048 keys
    (a put batch also allocates, packs and journals its objects, a larger fixed cost to share), at least
    four of them in flight and enough to fill every healthy drive's queue depth once, all within half
    the buffer pool.  Once; not four times as for reads: a put's bytes are packed before it is
    submitted, so queued batches have no refill gap to cover, and more bytes in flight only queue in
    the store (1 MiB objects over four directories, 8 MiB batches, against raw io_uring writes at depth
    32 and 128, all fdatasync'd: 4 in flight 0.81 of raw's rate, 16 (the drives' depth) 0.92-1.07, 32
    0.87-0.94)."""
    return _shape(object_bytes, res, batch_bytes=8 << 20, min_keys=1, max_keys=2048, cover=1)


def _shape(object_bytes: int, res: Resources, batch_bytes: int, min_keys: int, max_keys: int,
           cover: int) -> BatchShape:
    size = max(ALIGN, object_bytes)
    extents = max(1, -(-size // res.stripe_unit))
    keys = max(min_keys, min(max_keys, batch_bytes // size))
    want = cover * max(1, res.healthy) * res.queue_depth
    inflight = max(4, -(-want // (keys * extents)))
    room = res.pool_bytes // 2
    while inflight > 2 and keys * inflight * size > room:
        inflight -= 1
    while keys > 1 and keys * inflight * size > room:
        keys //= 2
    return BatchShape(keys, inflight)
