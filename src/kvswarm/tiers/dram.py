"""DRAM tier: blocks in 4 KiB-aligned slots of one :class:`~kvswarm.buffers.BufferPool`.

Slots are zero-copy viewable (``Lease.numpy()`` / ``Lease.torch()``) and, on a GPU box,
DMA-able once the pool is page-locked.  A block handed to a reader is *pinned*: when
the director drops it meanwhile, its slot is freed only once the reader unpins it, so
a view never changes under its reader.  A block being written to a pool is *held* the
same way until its put is back: a failed write can then give the block back to DRAM.
The pool has a few slots of headroom for that.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvswarm.buffers import BufferPool, BufferPoolExhausted, Lease
from kvswarm.format import align_up


class Slot:
    __slots__ = ("lease", "nbytes", "pins", "holds", "dropped")

    def __init__(self, lease: Lease, nbytes: int) -> None:
        self.lease, self.nbytes, self.pins, self.holds, self.dropped = lease, nbytes, 0, 0, False

    @property
    def view(self) -> memoryview:
        return self.lease.view[:self.nbytes]

    def pin(self) -> Slot:
        self.pins += 1
        return self

    def unpin(self) -> None:
        self.pins -= 1
        self._free_if_unused()

    def hold(self) -> Slot:
        """Keep the bytes for a put of them in flight (a reader's pin, for a writer)."""
        self.holds += 1
        return self

    def let_go(self) -> None:
        self.holds -= 1
        self._free_if_unused()

    def _free_if_unused(self) -> None:
        if self.dropped and self.pins == 0 and self.holds == 0:
            self.lease.release()


class DramTier:
    def __init__(self, capacity_blocks: int, block_bytes: int, headroom_blocks: int = 16) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        slots = capacity_blocks + headroom_blocks if capacity_blocks else 0
        self.pool = BufferPool(slots * align_up(block_bytes)) if slots else None
        self._slots: dict[Hashable, Slot] = {}
        self.refused = 0  # puts that found no free slot (pinned slots held the headroom)

    def put(self, key: Hashable, data) -> bool:
        """Copy ``data`` into a slot; False when no slot is free (the block is then not in DRAM)."""
        mv = memoryview(data).cast("B")
        if self.pool is None:
            return False
        self.drop(key)
        try:
            lease = self.pool.lease(len(mv))
        except BufferPoolExhausted:
            self.refused += 1
            return False
        lease.view[:len(mv)] = mv
        self._slots[key] = Slot(lease, len(mv))
        return True

    def get(self, key: Hashable) -> memoryview | None:
        """A view of the block, valid until it is dropped (use :meth:`pin` to hold it longer)."""
        s = self._slots.get(key)
        return s.view if s else None

    def pin(self, key: Hashable) -> Slot | None:
        s = self._slots.get(key)
        return s.pin() if s is not None else None

    def hold(self, key: Hashable) -> Slot | None:
        s = self._slots.get(key)
        return s.hold() if s is not None else None

    def revive(self, key: Hashable, slot: Slot) -> None:
        """Take back a dropped slot that a hold kept intact (a block whose write below failed)."""
        assert slot.dropped and slot.holds and key not in self._slots
        slot.dropped = False
        self._slots[key] = slot

    def drop(self, key: Hashable) -> bool:
        s = self._slots.pop(key, None)
        if s is None:
            return False
        s.dropped = True
        s._free_if_unused()
        return True

    def clear(self) -> None:
        for k in list(self._slots):
            self.drop(k)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def bytes_used(self) -> int:
        return sum(s.nbytes for s in self._slots.values())
