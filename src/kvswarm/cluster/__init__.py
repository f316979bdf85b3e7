"""The cluster level: a pool shared by many nodes, on Mooncake Store.

Prefill nodes publish the blocks they compute (:mod:`~kvswarm.cluster.publication`); any node
looks there after its DRAM and SSD pool and before its capacity pool and recomputation
(:class:`~kvswarm.tiers.manager.TierManager` with a ``cluster`` config).  Every value is a
checksummed frame (:mod:`~kvswarm.cluster.wire`); kvswarm's drives stay each node's durable
tier, from which a restarted cluster is re-filled.  See docs/cluster.md.
"""

from kvswarm.cluster.config import ClusterConfig
from kvswarm.cluster.publication import PUBLICATION, PublicationPolicy, make_publication

__all__ = ["PUBLICATION", "ClusterConfig", "PublicationPolicy", "make_publication"]
