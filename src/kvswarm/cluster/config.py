"""Cluster configuration: where the Mooncake master is and how this node joins it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvswarm.errors import ClusterError

PROTOCOLS = ("tcp", "rdma")
MiB = 1 << 20


@dataclass(frozen=True)
class ClusterConfig:
    """One node's view of the cluster.

    * ``master``: the Mooncake master's ``host:port`` (``etcd://host:port[;host:port]`` with master
      failover: the client follows the leader elected in etcd).
    * ``metadata``: the Transfer Engine's metadata service: ``P2PHANDSHAKE`` (peers exchange it
      directly; no service to run) or ``etcd://host:port``.
    * ``protocol``: ``tcp`` (any network) or ``rdma`` (``rdma_devices`` names the NICs, e.g. ``mlx5_0``).
    * ``local_hostname``: the address this node's Transfer Engine listens on and advertises.
    * ``segment_bytes``: the DRAM this node lends to the cluster's pool (0: it only reads and
      publishes into the others'); ``buffer_bytes``: Mooncake's staging buffer for transfers;
      ``fetch_buffer_bytes``: registered memory that fetched blocks land in (a request's fetches in
      flight must fit, else they fall back to a slower copying path).
    * ``replicas``: copies of each published block, on distinct nodes where there are enough.
    * ``publish``: the publication policy (:mod:`kvswarm.cluster.publication`).
    * ``prefix``: names this deployment's objects (``<prefix>:<key digest hex>``).
    * ``rpc_timeout_s``: a lookup the master has not answered by then is a miss (a partitioned
      or stalled master degrades service; it never blocks a request for long).
    * ``check_interval_s``: how often the node checks that the master still indexes it (else it
      re-publishes its durable blocks); ``republish_batch``: blocks re-published per step;
      ``republish_retry_s``: how long blocks the cluster refused are tried again (a restarted master
      takes puts only once the node's segment is mounted again).
    """

    master: str = "127.0.0.1:50051"
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 256 * MiB
    buffer_bytes: int = 64 * MiB
    fetch_buffer_bytes: int = 256 * MiB
    replicas: int = 1
    publish: str = "all"
    prefix: str = "kvs"
    rpc_timeout_s: float = 2.0
    check_interval_s: float = 1.0
    republish_batch: int = 256
    republish_retry_s: float = 30.0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ClusterError(f"cluster protocol {self.protocol!r}: one of {', '.join(PROTOCOLS)}")
        if self.replicas < 1:
            raise ClusterError("cluster replicas must be >= 1")
        if self.segment_bytes < 0 or self.buffer_bytes <= 0 or self.fetch_buffer_bytes <= 0:
            raise ClusterError("cluster segment_bytes must be >= 0, buffer_bytes and fetch_buffer_bytes > 0")
        if not self.master or not self.metadata:
            raise ClusterError("cluster master and metadata must be set")
        if (self.rpc_timeout_s <= 0 or self.check_interval_s <= 0 or self.republish_batch < 1
                or self.republish_retry_s < 0):
            raise ClusterError("cluster rpc_timeout_s, check_interval_s and republish_batch must be positive, "
                               "republish_retry_s >= 0")

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> ClusterConfig:
        """From an engine's ``"cluster": {...}`` section; unknown keys are an error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ClusterError(f"unknown cluster option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**d)  # type: ignore[arg-type]
