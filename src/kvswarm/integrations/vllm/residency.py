"""Which of a vLLM tier's chunks stay on the drives when the pool is full (:class:`Residency`)."""

from __future__ import annotations

from collections.abc import Callable, Collection

from kvswarm.format import KEY_DIGEST
from kvswarm.store import KVStore
from kvswarm.tiers.eviction import make_eviction


class Residency:
    """Which chunks stay on the pool when it is full: a :mod:`kvswarm.tiers` eviction policy over
    store keys, counted in chunks (all chunks of one engine are the same size).

    Chunks already in the store when the tier opens (an earlier process wrote them) count
    against the capacity, but their keys are unknown until a lookup meets them: until then they
    cannot be the policy's victims.  When the policy is full they go first instead, oldest row
    first (``delete_digest``): they are colder than anything this process touched, and may not even
    be this engine's (another model's or tenant's chunks, whose keys never come up), which would
    otherwise hold the pool for good.  Used by the driver thread only.
    """

    def __init__(self, policy: str, capacity: int, store: KVStore, delete_digest: Callable[[bytes], bool]) -> None:
        self.capacity = capacity
        self.unknown = min(len(store), capacity)
        self.policy = make_eviction(policy, capacity - self.unknown)
        self._store, self._held, self._delete = store, store.digest_view(), delete_digest
        self._opened_at = store.generation  # objects of older generations were there before
        self._older = store.written_before(self._opened_at)
        self._adopted: set[bytes] = set()  # digests of unknown chunks a lookup has met

    def seen(self, key: bytes) -> list[bytes]:
        """A lookup hit: refresh ``key``, adopting it if an earlier process stored it."""
        if self.policy.touch(key):
            return []
        if KEY_DIGEST(key) not in self._held:  # deleted since its lookup (a failed load or drive): not held
            return []
        if self.unknown:
            self.unknown -= 1
            self._adopted.add(KEY_DIGEST(key))
        return self.policy.resize(self.capacity - self.unknown) + self.policy.insert(key)

    def admit(self, key: bytes) -> list[bytes]:
        """A chunk about to be written; returns the victims (possibly ``key`` itself)."""
        if self.unknown and len(self.policy) >= self.policy.capacity and self._reclaim():
            self.policy.resize(self.capacity - self.unknown)
        return self.policy.insert(key)

    def _reclaim(self) -> bool:
        """Delete one chunk stored before the tier opened and not met since; False if none is left."""
        for d in self._older:
            e = self._store.locate_digests([d])[0]
            if e is None or e.generation >= self._opened_at or d in self._adopted:
                continue  # gone, rewritten by this process, or adopted: the policy's business now
            if self._delete(d):
                self.unknown -= 1
                return True
        self.unknown = 0  # the rest were deleted meanwhile or adopted
        return False

    def forget(self, key: bytes) -> None:
        self.policy.remove(key)

    def drop(self, digests: Collection[bytes], capacity: int) -> list[bytes]:
        """Chunks deleted with a failed drive, and the capacity of the drives left: the policy forgets the
        keys it holds among them (found by their digests), the rest were unknown ones; returns the victims
        of the smaller pool."""
        gone = set(digests)
        known = [k for k in self.policy if KEY_DIGEST(k) in gone]
        for k in known:
            self.policy.remove(k)
        self._adopted -= gone
        self.capacity = capacity
        self.unknown = min(max(0, self.unknown - (len(gone) - len(known))), capacity)
        return self.policy.resize(capacity - self.unknown)
