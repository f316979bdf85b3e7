"""Cluster projection: a node's KV-tier mix on N prefill nodes sharing their KV through Mooncake Store,
with D decode nodes reading each request's KV over the network (closed form, no queueing).

The model (docs/planner.md, "Clusters"):

* requests are spread round-robin over the prefill nodes; a block computed on any node is
  reusable by all, so the cluster-wide serving tier of every reference comes from the same LRU
  hit model as one node's, over the union of the capacities: every node's DRAM tier plus the
  cluster pool (each of the N nodes lends ``segment_gb``, stored ``replicas`` times), and every
  prefill node's SSD and HDD pools.  The per-node hit rate is each node alone on its share of
  the requests, with the same DRAM (its tier plus what it would otherwise lend);
* a hit's block sits on the prefill node that computed it, one of P alike, so a share
  (P - 1) / P of the hit bytes crosses the network: out of the owner's NIC, into the reader's;
  a fetch streams at the lower of the owner's drive read (for blocks on its drives) and the
  NIC rate;
* with decode nodes, each request's prompt KV (input tokens x KV bytes per token) leaves its
  prefill node and enters a decode node after prefill: it delays the first decode step, not
  the first token;
* NICs are full duplex: a node's network utilisation is its busier direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvswarm.errors import BadInput
from kvswarm.planner.cost import Mix, gpu_hourly_usd, hourly_usd
from kvswarm.planner.hardware import HardwareCatalog, NicType
from kvswarm.planner.hits import DRAM, HDD, MISS, SSD, TIER_NAMES, LRUHits, TierCaps, per_request
from kvswarm.planner.project import Planner, pool_read_seconds, prefill_work


@dataclass(frozen=True)
class ClusterSpec:
    """Node counts and the network of a cluster; ``nic`` prices the NICs (None: a bare ``--network-gbit``)."""

    prefill_nodes: int = 1
    decode_nodes: int = 0
    nic_bytes_per_s: float = 0.0  # payload rate per node and direction
    nic: NicType | None = None
    segment_gb: float = 0.0  # DRAM each node lends to the cluster pool
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.prefill_nodes < 1:
            raise BadInput(f"--prefill-nodes must be >= 1, got {self.prefill_nodes}")
        if self.decode_nodes < 0:
            raise BadInput(f"--decode-nodes must be >= 0, got {self.decode_nodes}")
        if self.segment_gb < 0:
            raise BadInput(f"--cluster-segment-gb must be >= 0, got {self.segment_gb:g}")
        if self.replicas < 1:
            raise BadInput(f"--cluster-replicas must be >= 1, got {self.replicas}")
        if self.active and self.nic_bytes_per_s <= 0:
            raise BadInput("a cluster needs its network: give --nic KEY or --network-gbit G (> 0)")

    @property
    def active(self) -> bool:
        return self.prefill_nodes > 1 or self.decode_nodes > 0

    @property
    def nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    @classmethod
    def from_args(cls, cat: HardwareCatalog, prefill_nodes: int, decode_nodes: int, nic: str | None,
                  network_gbit: float | None, segment_gb: float, replicas: int) -> ClusterSpec:
        """Validate the CLI's cluster options (one clear error each) and build the spec."""
        if nic is not None and network_gbit is not None:
            raise BadInput("give --nic KEY or --network-gbit G, not both")
        if network_gbit is not None and network_gbit <= 0:
            raise BadInput(f"--network-gbit must be positive, got {network_gbit:g}")
        spec_nic = cat.get("nics", nic) if nic is not None else None
        rate = spec_nic.bytes_per_s if spec_nic else (network_gbit or 0.0) * 1e9 / 8
        spec = cls(prefill_nodes, decode_nodes, rate, spec_nic, segment_gb, replicas)
        if not spec.active and (nic is not None or network_gbit is not None or segment_gb or replicas != 1):
            raise BadInput("the cluster options need a cluster: --prefill-nodes > 1 or --decode-nodes >= 1")
        return spec


@dataclass(frozen=True)
class ClusterProjection:
    spec: ClusterSpec
    mix: Mix  # every prefill node's tiers
    caps: TierCaps  # the union, blocks
    hit_rates: dict[str, float]  # cluster-wide share of block references per tier (and missed)
    hit_rate: float  # cluster-wide
    node_hit_rate: float  # each prefill node alone on its share of the requests
    remote_share: float  # of hit bytes, fetched from another node
    gpus_per_node: int
    ttft_mean_s: float
    ttft_p90_s: float
    node_ttft_mean_s: float  # the nodes alone (no sharing, no network)
    network_mean_s: float  # per request: remote fetch time
    kv_transfer_mean_s: float  # per request: prompt KV to its decode node (0 without decode nodes)
    network_gb_per_request: float  # remote fetch + KV transfer, GB
    utilisation: dict[str, float]  # per node of each kind; nic_* is the busier direction
    bound: str  # "network" or "drives": which binds the cluster's KV movement first
    busiest: str
    max_rate_rps: float
    kv_capex_usd: float  # every node's KV tier, cluster segments and NICs
    nic_capex_usd: float
    watts: float
    cost_per_mtok_usd: float

    def row(self) -> dict:
        s = self.spec
        return {
            "prefill_nodes": s.prefill_nodes, "decode_nodes": s.decode_nodes,
            "nic": s.nic.key if s.nic else None, "network_gb_per_s_per_node": s.nic_bytes_per_s / 1e9,
            "segment_gb": s.segment_gb, "replicas": s.replicas, "mix_per_prefill_node": self.mix.label,
            "capacity_blocks": {"dram": self.caps.dram, "ssd": self.caps.ssd, "hdd": self.caps.hdd},
            "hit_rates": self.hit_rates, "hit_rate": self.hit_rate, "node_hit_rate": self.node_hit_rate,
            "remote_share": self.remote_share, "gpus_per_node": self.gpus_per_node,
            "ttft_mean_s": self.ttft_mean_s, "ttft_p90_s": self.ttft_p90_s, "node_ttft_mean_s": self.node_ttft_mean_s,
            "network_mean_s": self.network_mean_s, "kv_transfer_mean_s": self.kv_transfer_mean_s,
            "network_gb_per_request": self.network_gb_per_request, "utilisation": self.utilisation,
            "bound": self.bound, "busiest": self.busiest, "max_rate_rps": self.max_rate_rps,
            "kv_capex_usd": self.kv_capex_usd, "nic_capex_usd": self.nic_capex_usd, "watts": self.watts,
            "cost_per_mtok_usd": self.cost_per_mtok_usd,
        }


def union_caps(planner: Planner, mix: Mix, spec: ClusterSpec) -> TierCaps:
    """The cluster's tiers as one: every node's DRAM tier and the cluster pool, every prefill node's pools."""
    node = planner.caps(mix)
    pool = int(spec.nodes * spec.segment_gb * 1e9 / spec.replicas) // planner.block_bytes
    p = spec.prefill_nodes
    return TierCaps(p * node.dram + pool, p * node.ssd, p * node.hdd)


def _nodes_alone(planner: Planner, mix: Mix, spec: ClusterSpec) -> tuple[float, float]:
    """(hit rate, mean TTFT) of the prefill nodes alone, each on its round-robin share of the requests,
    with the DRAM it would lend to the cluster kept as its own tier."""
    s, b = planner.s, planner.block_bytes
    node = planner.caps(mix)
    caps = TierCaps(node.dram + int(spec.segment_gb * 1e9) // b, node.ssd, node.hdd)
    hits = refs = 0
    ttft = []
    for k in range(spec.prefill_nodes):
        w = s.workload.share(k, spec.prefill_nodes)
        model = planner.hits if spec.prefill_nodes == 1 else LRUHits(w)
        counts = per_request(model.served(caps), model.req, w.requests)
        hits += counts[:, :MISS].sum()
        refs += counts.sum()
        _, compute = prefill_work(w, s.model, s.gpu, counts)
        t_ssd, t_hdd = pool_read_seconds(mix, s.link.model().bandwidth, counts, b)
        ttft.append(np.maximum(t_ssd, t_hdd) + counts[:, :MISS].sum(axis=1) * b / s.gpu.link().bandwidth + compute)
    return float(hits / refs) if refs else 0.0, float(np.concatenate(ttft).mean())


def project_cluster(planner: Planner, mix: Mix, spec: ClusterSpec) -> ClusterProjection:
    """Project ``mix`` on every prefill node of ``spec``'s cluster, serving ``planner``'s workload."""
    s, w, b, cat = planner.s, planner.s.workload, planner.block_bytes, planner.s.catalog
    p, d = spec.prefill_nodes, spec.decode_nodes
    dur = planner.duration
    caps = union_caps(planner, mix, spec)
    counts = per_request(planner.hits.served(caps), planner.hits.req, w.requests)
    _, compute = prefill_work(w, s.model, s.gpu, counts)
    refs = counts.sum()
    hit_rates = {TIER_NAMES[t]: float(counts[:, t].sum() / refs) if refs else 0.0 for t in (DRAM, SSD, HDD, MISS)}
    hit_b = counts[:, :MISS].sum(axis=1) * b
    remote = (p - 1) / p
    remote_b = remote * hit_b
    kv_b = w.input_len * s.model.token_bytes if d else np.zeros(w.requests)
    bw = spec.nic_bytes_per_s
    # A remote block's bytes stream from its owner's drives (or DRAM) through both NICs: the fetch takes the
    # longer of the drive read and the network transfer.
    t_ssd, t_hdd = pool_read_seconds(mix, s.link.model().bandwidth, counts, b)
    t_drives = np.maximum(t_ssd, t_hdd)
    t_net = remote_b / bw
    load = np.maximum(t_drives, t_net) + hit_b / s.gpu.link().bandwidth
    ttft = load + compute
    gpus = max(1, math.ceil(compute.sum() / (dur * s.gpu_util * p)))
    util = {"gpu": compute.sum() / (dur * gpus * p),
            "nic_prefill": (remote_b.sum() + kv_b.sum()) / (p * bw * dur)}  # out: fetches served + KV handed on
    if d:
        util["nic_decode"] = kv_b.sum() / (d * bw * dur)
    wr = planner.hits.writes(caps) * b
    if mix.n_ssd:
        util["ssd"] = (counts[:, SSD].sum() * b / (mix.n_ssd * mix.ssd.read_gbps * 1e9)
                       + wr[:, 0].sum() / (mix.n_ssd * mix.ssd.write_gbps * 1e9)) / (p * dur)
    if mix.n_hdd:
        util["hdd"] = (counts[:, HDD].sum() / mix.hdd.read_iops + counts[:, HDD].sum() * b
                       / (mix.n_hdd * mix.hdd.read_gbps * 1e9) + wr[:, 1].sum()
                       / (mix.n_hdd * mix.hdd.write_gbps * 1e9)) / (p * dur)
    net = max(v for k, v in util.items() if k.startswith("nic"))
    drives = max([util.get("ssd", 0.0), util.get("hdd", 0.0)])
    busiest = max(util, key=util.get)
    rate = w.requests / dur
    nic_usd = spec.nic.price_usd * spec.nodes if spec.nic else 0.0
    segment_usd = spec.nodes * spec.segment_gb * mix.dram.price_usd_per_gb
    capex = p * mix.capex(cat) + segment_usd + nic_usd
    watts = (p * mix.watts(util.get("ssd", 0.0), util.get("hdd", 0.0))
             + spec.nodes * (spec.segment_gb * mix.dram.watts_per_gb + (spec.nic.watts if spec.nic else 0.0)))
    per_hour = (hourly_usd(capex, cat.economics.storage_amortization_years, watts, cat)
                + gpu_hourly_usd(s.gpu, gpus * p, util["gpu"], cat))
    node_hit, node_ttft = _nodes_alone(planner, mix, spec)
    return ClusterProjection(
        spec=spec, mix=mix, caps=caps, hit_rates=hit_rates, hit_rate=1.0 - hit_rates["miss"], node_hit_rate=node_hit,
        remote_share=remote, gpus_per_node=gpus, ttft_mean_s=float(ttft.mean()),
        ttft_p90_s=float(np.quantile(ttft, 0.9)), node_ttft_mean_s=node_ttft, network_mean_s=float(t_net.mean()),
        kv_transfer_mean_s=float((kv_b / bw).mean()) if d else 0.0,
        network_gb_per_request=float((remote_b + kv_b).mean() / 1e9), utilisation=util,
        bound="network" if net >= drives else "drives", busiest=busiest,
        max_rate_rps=rate / util[busiest] if util[busiest] > 0 else float("inf"), kv_capex_usd=capex,
        nic_capex_usd=nic_usd, watts=watts, cost_per_mtok_usd=per_hour / (planner.tokens / dur * 3600) * 1e6)
