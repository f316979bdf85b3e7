"""StoreConfig: what a KVStore is opened with, checked before anything is opened or written."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvswarm.drive import block_device
from kvswarm.errors import ConfigError
from kvswarm.format import ALIGN
from kvswarm.io import IOEngine
from kvswarm.placement import PlacementStrategy

GiB = 1 << 30


@dataclass(frozen=True)
class StoreConfig:
    drives: list[str]
    meta_dir: str | None = None  # catalog + manifest; default: the first drive that is a directory
    capacity_per_drive: int = 1 * GiB  # size of the data file created in a directory drive
    backend: str = "threads"  # "threads", "uring" or "auto" (see kvswarm.io.make_engine)
    queue_depth: int | None = None  # I/Os in flight per drive; None: from its device (device_queue_depth)
    stripe_unit: int = 1 << 20  # largest extent on disk; bigger objects are split and striped
    placement: str | PlacementStrategy = "round_robin"
    buffer_pool_bytes: int = 256 << 20
    create: bool = True
    checkpoint_every: int = 500_000
    drive_kinds: list[str] | None = None  # per drive class (ssd / hdd / remote), default all ssd
    error_threshold: int = 8  # I/O errors after which a drive is taken out of service
    # The store's I/O is driven from one thread only (a driver thread, a benchmark loop): lets the
    # io_uring engine leave completions until that thread next enters the kernel (less CPU).
    single_thread_io: bool = False
    # Reads and writes as whole batches on the native io_uring path (kvswarm.io.native: submission,
    # header packing and checks, checksums and copies in C), where it is built and the kernel allows
    # it; False, or KVSWARM_NATIVE_IO=0 in the environment, keeps them on the Python engine.  Not where
    # wrap_engine wraps the engine (a user-space drive model paces the Python engine's requests).
    native_io: bool = True
    # Read another process's store (its one writer keeps it): nothing is written, not even the
    # catalog; refresh() takes in what the writer has journaled since (see kvswarm.catalog).
    follow: bool = False
    # Wraps the I/O engine before any drive is attached, e.g. a testbed's user-space drive pacing
    # (kvswarm.io.throttle.ThrottledEngine): the store's code path stays the production one.
    wrap_engine: Callable[[IOEngine], IOEngine] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Values that cannot work are refused here, before anything is opened or written."""
        if isinstance(self.drives, (str, bytes)) or not self.drives:
            raise ConfigError("a store needs a list of at least one drive path")
        if len(set(map(os.path.abspath, self.drives))) != len(self.drives):
            raise ConfigError(f"a drive path appears twice in {self.drives}")
        qd = self.queue_depth
        if qd is not None and (not isinstance(qd, int) or isinstance(qd, bool) or qd < 1):
            raise ConfigError(f"StoreConfig.queue_depth must be an integer >= 1 or None, not {self.queue_depth!r}")
        for name, low in (("stripe_unit", ALIGN), ("buffer_pool_bytes", ALIGN),
                          ("capacity_per_drive", 2 * ALIGN), ("checkpoint_every", 1), ("error_threshold", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"StoreConfig.{name} must be an integer >= {low}, not {v!r}")
        if self.stripe_unit % ALIGN or self.capacity_per_drive % ALIGN:
            raise ConfigError(f"stripe_unit ({self.stripe_unit}) and capacity_per_drive "
                              f"({self.capacity_per_drive}) must be multiples of 4 KiB")
        if self.backend not in ("threads", "uring", "auto"):
            raise ConfigError(f"unknown I/O backend {self.backend!r}: use 'threads', 'uring' or 'auto'")
        if self.drive_kinds is not None and len(self.drive_kinds) != len(self.drives):
            raise ConfigError("drive_kinds must name one class per drive")


def device_queue_depth(paths: Sequence[str]) -> int:
    """I/Os in flight per drive for drives at ``paths``: each device's hardware queue shared among the
    drives on it (directories on one disk share its queue: past its tags deeper queues only cost CPU;
    16 KiB reads over four directories on a 128-tag disk ran at 0.94 of raw with 32 each against 0.90
    with 64), 8 to 128 per drive, the lowest over the drives; 32 where no device says."""
    devices = [block_device(p) for p in paths]
    sharing = Counter(d[0] for d in devices if d is not None)
    depths = [max(8, min(128, tags // sharing[dev])) for dev, tags in (d for d in devices if d is not None)]
    return min(depths) if depths else 32
