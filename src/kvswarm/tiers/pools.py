"""Pools: a tier's drives, built from paths, with a drive class and a performance model.

A pool is one :class:`~kvswarm.store.KVStore` over its drives; the store stripes a
request's blocks over all of them (round-robin placement: consecutive blocks go to
consecutive drives), checksums every read, and survives restarts.

Drive paths are directories (a preallocated data file is created in each) or block
devices.  Nothing else is needed for remote or logical volumes, because they *are*
block devices once attached:

* **NVMe-oF** (TCP or RDMA): ``nvme connect -t tcp -a <target-ip> -s 4420 -n <subsystem-nqn>``
  makes the remote namespace appear as ``/dev/nvmeXnY``; list that path in the pool
  (class ``remote``).  The fabric is invisible to kvswarm; O_DIRECT works as on a local drive.
* **LVM / dm / iSCSI / RBD / loop**: the ``/dev/...`` path of the volume.

All-block-device pools need ``meta_dir`` (a directory for the catalog).  The class
(``ssd`` / ``hdd`` / ``remote``) selects the default :class:`~kvswarm.tiers.costs.DriveCost`
the cost-aware policy reasons with; pass ``cost`` to use a measured one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvswarm.format import HEADER_SIZE, extent_size
from kvswarm.io import IOEngine
from kvswarm.store import KVStore, StoreConfig
from kvswarm.tiers.costs import DRIVE_CLASSES, DriveCost

GiB = 1 << 30
KINDS = ("ssd", "hdd", "remote")


@dataclass
class PoolConfig:
    drives: list[str]
    kind: str = "ssd"
    capacity_per_drive: int = 1 * GiB  # size of the data file made in a directory drive
    meta_dir: str | None = None
    backend: str = "threads"
    queue_depth: int = 32
    stripe_unit: int = 1 << 20
    buffer_pool_bytes: int = 256 << 20  # reads in flight land here: at least one request's prefix
    cost: DriveCost | None = None
    # Wraps the store's I/O engine (StoreConfig.wrap_engine), e.g. ``Testbed.wrap_engine`` (user-space pacing).
    wrap_engine: Callable[[IOEngine], IOEngine] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"drive class {self.kind!r}: one of {', '.join(KINDS)}")

    @property
    def drive_cost(self) -> DriveCost:
        return self.cost or DRIVE_CLASSES[self.kind]

    def open(self) -> KVStore:
        return KVStore(StoreConfig(
            drives=list(self.drives), meta_dir=self.meta_dir, capacity_per_drive=self.capacity_per_drive,
            backend=self.backend, queue_depth=self.queue_depth, stripe_unit=self.stripe_unit,
            placement="round_robin", buffer_pool_bytes=self.buffer_pool_bytes,
            drive_kinds=[self.kind] * len(self.drives), wrap_engine=self.wrap_engine))


def block_disk_bytes(payload_bytes: int, stripe_unit: int) -> int:
    """Bytes one block of ``payload_bytes`` takes on the drives (its extents, headers and padding)."""
    unit = stripe_unit - HEADER_SIZE
    full, rest = divmod(payload_bytes, unit)
    return full * extent_size(unit) + (extent_size(rest) if rest or not full else 0)


def block_capacity(store: KVStore, payload_bytes: int) -> int:
    """Blocks the pool's healthy drives hold, less a little slack.

    The slack keeps the allocator from running dry between flushes: freed extents are
    only reused after the next flush (the store's crash-safety rule), so a pool that is
    exactly full would fsync on every write.
    """
    total = store.capacity_objects(payload_bytes)
    slack = max(2 * sum(store.drive_health()), total // 16)
    return max(0, total - slack)
