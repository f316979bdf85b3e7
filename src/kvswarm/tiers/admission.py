"""Write policies: when a block that is in DRAM gets written to the SSD pool.

* ``write-through``  at once, as the block enters DRAM (computed, or promoted from the
  capacity pool): the SSD copy exists before anyone could lose it.
* ``write-back``     only when DRAM evicts the block (or on :meth:`TierManager.flush`):
  blocks that die in DRAM never cost a drive write.
* ``selective``      like write-through, but only once the block has been *seen* ``k``
  times (a sighting = one request that referenced it, hit or miss); a block seen fewer
  times that leaves DRAM is dropped.  One-off prompts then never wear the SSDs.

Policies are pure decisions over a block's sighting count; the director asks them.
"""

from __future__ import annotations

import abc
from typing import ClassVar


class WritePolicy(abc.ABC):
    name: ClassVar[str] = "?"

    @abc.abstractmethod
    def write_on_admit(self, sightings: int) -> bool:
        """Write to the SSD pool as the block enters DRAM?"""

    @abc.abstractmethod
    def write_on_evict(self, sightings: int) -> bool:
        """Write to the SSD pool as the block leaves DRAM (when it is not there yet)?"""

    def __repr__(self) -> str:
        return self.name


class WriteThrough(WritePolicy):
    name = "write-through"

    def write_on_admit(self, sightings: int) -> bool:
        return True

    def write_on_evict(self, sightings: int) -> bool:
        return True  # a block whose through-write failed still gets a second chance


class WriteBack(WritePolicy):
    name = "write-back"

    def write_on_admit(self, sightings: int) -> bool:
        return False

    def write_on_evict(self, sightings: int) -> bool:
        return True


class Selective(WritePolicy):
    """Admit to the SSD pool after ``k`` sightings (k=1 is write-through)."""

    name = "selective"

    def __init__(self, k: int = 2) -> None:
        if k < 1:
            raise ValueError("selective admission needs k >= 1")
        self.k = k

    def write_on_admit(self, sightings: int) -> bool:
        return sightings >= self.k

    def write_on_evict(self, sightings: int) -> bool:
        return sightings >= self.k

    def __repr__(self) -> str:
        return f"selective(k={self.k})"


def make_write_policy(spec: str | WritePolicy) -> WritePolicy:
    """``write-through``, ``write-back``, ``selective`` (k=2) or ``selective:K``."""
    if isinstance(spec, WritePolicy):
        return spec
    name, _, arg = spec.partition(":")
    if name == WriteThrough.name:
        return WriteThrough()
    if name == WriteBack.name:
        return WriteBack()
    if name == Selective.name:
        return Selective(int(arg) if arg else 2)
    raise ValueError(f"unknown write policy {spec!r}; one of write-through, write-back, selective[:K]")
