"""Publication policies: which blocks a node computes are published to the cluster.

* ``all``      every computed block, as it enters the node's tiers (write-through; prefill nodes);
* ``none``     never (a node that only reads the cluster, e.g. a decode node);
* ``sighted``  once the node has seen the block in ``k`` requests (``sighted:K``, default 2): one-off
  prompts never take the cluster's DRAM.

Published copies carry the replica count of :class:`~kvswarm.cluster.ClusterConfig`.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from kvswarm.registry import Registry


class PublicationPolicy(abc.ABC):
    name: ClassVar[str] = "?"

    @abc.abstractmethod
    def publish(self, sightings: int) -> bool:
        """Publish a block this node just computed, seen in ``sightings`` requests so far?"""

    def __repr__(self) -> str:
        return self.name


class PublishAll(PublicationPolicy):
    name = "all"

    def publish(self, sightings: int) -> bool:
        return True


class PublishNone(PublicationPolicy):
    name = "none"

    def publish(self, sightings: int) -> bool:
        return False


class PublishSighted(PublicationPolicy):
    name = "sighted"

    def __init__(self, k: int = 2) -> None:
        if k < 1:
            raise ValueError("sighted publication needs k >= 1")
        self.k = k

    def publish(self, sightings: int) -> bool:
        return sightings >= self.k

    def __repr__(self) -> str:
        return f"sighted(k={self.k})"


PUBLICATION: Registry[PublicationPolicy] = Registry("publication policy", PublicationPolicy,
                                                    PublishAll, PublishNone, PublishSighted)


def make_publication(spec: str | PublicationPolicy) -> PublicationPolicy:
    """A policy by name: ``all``, ``none``, ``sighted`` or ``sighted:K``."""
    if isinstance(spec, PublicationPolicy):
        return spec
    name, _, arg = spec.partition(":")
    return PUBLICATION.make(name, int(arg)) if arg else PUBLICATION.make(name)
