"""Project a workload onto a hardware mix: hit rates per tier, TTFT, throughput, cost, watts.

Two passes.  ``screen`` is closed-form and vectorised (every mix, in milliseconds): per
request, load time = pool latency + bytes / pool bandwidth + bytes / GPU link, compute
time = prefill FLOPs of the uncached tokens / sustained GPU FLOP/s; no queueing, but a
mix whose resources would run above 95% busy is flagged saturated.  ``simulate`` replays
the workload's requests at their arrival times through the discrete-event simulator:
SSD and HDD pools are simulated stores (the store's placement strategy, allocator and
extent sizes; :mod:`kvswarm.sim`), sharing the host link and the GPU link, and prefill
queues for the GPUs.  Loading and computing are not overlapped (a conservative TTFT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import simpy

from kvswarm.planner.hardware import GpuType, HardwareCatalog, LinkType
from kvswarm.planner.cost import Mix, gpu_hourly_usd, hourly_usd
from kvswarm.planner.hits import DRAM, HDD, MISS, SSD, TIER_NAMES, LRUHits, TierCaps, per_request
from kvswarm.planner.models import ModelSpec
from kvswarm.planner.workload import Workload
from kvswarm.sim.devices import SimLink
from kvswarm.sim.system import SimStore, SystemModel

SATURATED = 0.95
SIM_DRIVE_BYTES = 1 << 50  # simulated drives never fill: tier residency comes from the hit model


@dataclass
class PlanSettings:
    workload: Workload
    model: ModelSpec
    gpu: GpuType
    link: LinkType
    catalog: HardwareCatalog
    gpus: int | None = None  # None: sized per mix so prefill runs at gpu_util
    gpu_util: float = 0.7
    stripe_unit: int = 1 << 20
    placement: str = "round_robin"
    sparse_fraction: float = 0.1
    cluster_tokens: int = 16

    def __post_init__(self) -> None:
        if self.gpus is not None and self.gpus < 1:
            raise ValueError("--gpus must be >= 1")
        if not 0 < self.gpu_util <= 1:
            raise ValueError("--gpu-util must be in (0, 1]")
        if not 0 < self.sparse_fraction <= 1:
            raise ValueError("--sparse-fraction must be in (0, 1]")
        if self.cluster_tokens < 1:
            raise ValueError("--cluster-tokens must be >= 1")


@dataclass
class Projection:
    mix: Mix
    caps: TierCaps
    hit_rates: dict[str, float]  # share of block references served per tier (and missed)
    token_hit_rate: float
    gpus: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    load_mean_s: float
    compute_mean_s: float
    decode_io_s: float  # one sparse decode step's reads from the SSD pool (nan without SSDs)
    utilisation: dict[str, float]
    max_rate_rps: float  # request rate at which the busiest resource would be fully busy
    tokens_per_s: float  # at max_rate_rps: input + output tokens served per second
    storage_capex_usd: float
    gpu_capex_usd: float
    watts: float
    usd_per_hour: float
    cost_per_tb_usd: float
    cost_per_mtok_usd: float
    method: str = "analytic"
    notes: list[str] = field(default_factory=list)

    @property
    def saturated(self) -> list[str]:
        return [k for k, v in self.utilisation.items() if v > SATURATED]

    def row(self) -> dict:
        """Flat JSON-able view."""
        m = self.mix
        return {
            "mix": m.label, "dram_gb": m.dram_gb, "ssd": m.ssd.key if m.n_ssd else None, "n_ssd": m.n_ssd,
            "hdd": m.hdd.key if m.n_hdd else None, "n_hdd": m.n_hdd,
            "capacity_tb": {"dram": m.dram_bytes / 1e12, "ssd": m.ssd_bytes / 1e12, "hdd": m.hdd_bytes / 1e12},
            "capacity_blocks": {"dram": self.caps.dram, "ssd": self.caps.ssd, "hdd": self.caps.hdd},
            "hit_rates": self.hit_rates, "token_hit_rate": self.token_hit_rate, "gpus": self.gpus,
            "ttft_mean_s": self.ttft_mean_s, "ttft_p50_s": self.ttft_p50_s, "ttft_p90_s": self.ttft_p90_s,
            "load_mean_s": self.load_mean_s, "compute_mean_s": self.compute_mean_s,
            "decode_io_s": None if math.isnan(self.decode_io_s) else self.decode_io_s,
            "utilisation": self.utilisation, "saturated": self.saturated, "max_rate_rps": self.max_rate_rps,
            "tokens_per_s": self.tokens_per_s, "storage_capex_usd": self.storage_capex_usd,
            "gpu_capex_usd": self.gpu_capex_usd, "watts": self.watts, "usd_per_hour": self.usd_per_hour,
            "cost_per_tb_usd": self.cost_per_tb_usd, "cost_per_mtok_usd": self.cost_per_mtok_usd,
            "method": self.method, "notes": self.notes,
        }


def prefill_work(w: Workload, model: ModelSpec, gpu: GpuType, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cached tokens, prefill compute seconds) per request of ``w`` from its block counts by tier."""
    hit_blocks = counts[:, DRAM] + counts[:, SSD] + counts[:, HDD]
    cached = np.minimum(hit_blocks * w.block_tokens, w.input_len)
    new = w.input_len - cached
    return cached, model.prefill_flops(new.astype(float), cached.astype(float)) / gpu.flops


def pool_read_seconds(mix: Mix, link_bw: float, counts: np.ndarray, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request: seconds to read its SSD-pool and HDD-pool blocks (closed form, no queueing).

    A pool reads at the lower of its drives' aggregate rate and the host link's ``link_bw``; an
    HDD positions once per block per drive it holds part of.
    """
    ssd_b, hdd_b = counts[:, SSD] * block_bytes, counts[:, HDD] * block_bytes
    ssd_bw = min(mix.n_ssd * mix.ssd.read_gbps * 1e9 if mix.n_ssd else 0.0, link_bw)
    hdd_bw = min(mix.n_hdd * mix.hdd.read_gbps * 1e9 if mix.n_hdd else 0.0, link_bw)
    t_ssd = np.where(ssd_b > 0, (mix.ssd.read_latency_us * 1e-6 + ssd_b / ssd_bw) if mix.n_ssd else 0.0, 0.0)
    t_hdd = np.where(hdd_b > 0, (counts[:, HDD] / mix.hdd.read_iops + hdd_b / hdd_bw) if mix.n_hdd else 0.0, 0.0)
    return t_ssd, t_hdd


class Planner:
    """``hits`` (default: LRU stack distances) screens every mix; ``final_hits`` (default: the same)
    gives the finalists' tiers and writes, e.g. a :class:`~kvswarm.planner.hits.DirectorHits`
    replay through the tier policies."""

    def __init__(self, s: PlanSettings, hits: LRUHits | None = None, final_hits=None) -> None:
        self.s = s
        w = s.workload
        self.hits = hits or LRUHits(w)
        self.final_hits = final_hits or self.hits
        self.block_bytes = w.block_tokens * s.model.token_bytes
        self.duration = max(w.duration, 1.0)
        self.tokens = float(w.input_len.sum() + w.output_len.sum())
        self._decode_cache: dict[tuple, float] = {}

    def caps(self, mix: Mix) -> TierCaps:
        b = self.block_bytes
        return TierCaps(mix.dram_bytes // b, mix.ssd_bytes // b, mix.hdd_bytes // b)

    # ---- per-request quantities ----------------------------------------------------------
    def _requests(self, caps: TierCaps, hits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(per-request block counts by tier, cached tokens, prefill compute seconds)."""
        w = self.s.workload
        counts = per_request(hits.served(caps), hits.req, w.requests)
        return (counts, *prefill_work(w, self.s.model, self.s.gpu, counts))

    def screen(self, mix: Mix) -> Projection:
        s, b = self.s, self.block_bytes
        caps = self.caps(mix)
        counts, cached, compute = self._requests(caps, self.hits)
        wr = self.hits.writes(caps) * b  # bytes written per request to the SSD and HDD pools
        link_bw = s.link.model().bandwidth
        gpu_bw = s.gpu.link().bandwidth
        ssd_read = mix.n_ssd * mix.ssd.read_gbps * 1e9 if mix.n_ssd else 0.0
        hdd_read = mix.n_hdd * mix.hdd.read_gbps * 1e9 if mix.n_hdd else 0.0
        ssd_b, hdd_b, dram_b = counts[:, SSD] * b, counts[:, HDD] * b, counts[:, DRAM] * b
        t_ssd, t_hdd = pool_read_seconds(mix, link_bw, counts, b)
        load = np.maximum(t_ssd, t_hdd) + (ssd_b + hdd_b + dram_b) / gpu_bw
        gpus = s.gpus or max(1, math.ceil(compute.sum() / (self.duration * s.gpu_util)))
        util = {
            "gpu": compute.sum() / (self.duration * gpus),
            "gpu_link": (ssd_b + hdd_b + dram_b).sum() / gpu_bw / self.duration,
            "host_link": (ssd_b.sum() + hdd_b.sum() + wr.sum()) / link_bw / self.duration
            if mix.n_ssd or mix.n_hdd else 0.0,
        }
        if mix.n_ssd:
            util["ssd"] = (ssd_b.sum() / ssd_read + wr[:, 0].sum() / (mix.n_ssd * mix.ssd.write_gbps * 1e9)) \
                / self.duration
        if mix.n_hdd:
            util["hdd"] = (counts[:, HDD].sum() / mix.hdd.read_iops + hdd_b.sum() / hdd_read
                           + wr[:, 1].sum() / (mix.n_hdd * mix.hdd.write_gbps * 1e9)) / self.duration
        ttft = load + compute
        return self._finish(mix, caps, counts, cached, gpus, ttft, load, compute, util, "analytic")

    def _finish(self, mix: Mix, caps: TierCaps, counts: np.ndarray, cached: np.ndarray, gpus: int,
                ttft: np.ndarray, load: np.ndarray, compute: np.ndarray, util: dict[str, float],
                method: str, rate: float | None = None) -> Projection:
        """Assemble a projection: hit rates from the whole trace, timings from ``ttft``/``load``/``compute``
        (all requests or a replayed window whose arrival rate is ``rate``)."""
        s, w, cat = self.s, self.s.workload, self.s.catalog
        refs = counts.sum()
        hit_rates = {TIER_NAMES[t]: float(counts[:, t].sum() / refs) if refs else 0.0 for t in (DRAM, SSD, HDD, MISS)}
        token_hit = float(cached.sum() / max(1, w.input_len.sum()))
        busiest = max(util.values()) if util else 0.0
        rate = rate or w.requests / self.duration
        max_rate = rate / busiest if busiest > 0 else float("inf")
        capex = mix.capex(cat)
        watts = mix.watts(util.get("ssd", 0.0), util.get("hdd", 0.0))
        store_h = hourly_usd(capex, cat.economics.storage_amortization_years, watts, cat)
        gpu_h = gpu_hourly_usd(s.gpu, gpus, util["gpu"], cat)
        per_hour_tokens = self.tokens / self.duration * 3600
        usable_tb = (mix.dram_bytes + mix.ssd_bytes + mix.hdd_bytes) / 1e12
        p = Projection(
            mix=mix, caps=caps, hit_rates=hit_rates, token_hit_rate=token_hit, gpus=gpus,
            ttft_mean_s=float(ttft.mean()), ttft_p50_s=float(np.quantile(ttft, 0.5)),
            ttft_p90_s=float(np.quantile(ttft, 0.9)), load_mean_s=float(load.mean()),
            compute_mean_s=float(compute.mean()), decode_io_s=self.decode_io(mix), utilisation=util,
            max_rate_rps=max_rate, tokens_per_s=self.tokens / w.requests * max_rate,
            storage_capex_usd=capex, gpu_capex_usd=s.gpu.price_usd * gpus,
            watts=watts + s.gpu.watts * gpus * min(1.0, util["gpu"]), usd_per_hour=store_h + gpu_h,
            cost_per_tb_usd=capex / usable_tb if usable_tb else float("nan"),
            cost_per_mtok_usd=(store_h + gpu_h) / per_hour_tokens * 1e6, method=method)
        if p.saturated:
            p.notes.append(f"saturated: {', '.join(p.saturated)} above {SATURATED:.0%} busy")
        return p

    # ---- discrete-event replay -----------------------------------------------------------
    def simulate(self, proj: Projection, max_requests: int | None = None) -> Projection:
        """Replace ``proj``'s TTFT and utilisation figures by a discrete-event replay of the
        workload's last ``max_requests`` requests (all by default; tier residency still comes
        from the whole trace)."""
        s, w, b, mix = self.s, self.s.workload, self.block_bytes, proj.mix
        hits = self.final_hits
        counts, cached, compute = self._requests(proj.caps, hits)
        writes = np.rint(hits.writes(proj.caps)).astype(np.int64)
        n = w.requests if max_requests is None else max(1, min(w.requests, max_requests))
        lo = w.requests - n
        env = simpy.Environment()
        host = SimLink(env, s.link.model())
        gpu_link = SimLink(env, s.gpu.link())
        shared = {"host_link": host, "gpu": gpu_link}
        pools = {}
        for tier, d, k in ((SSD, mix.ssd, mix.n_ssd), (HDD, mix.hdd, mix.n_hdd)):
            if k:
                pools[tier] = SimStore(SystemModel([d.model()] * k, capacity_per_drive=SIM_DRIVE_BYTES,
                                                   engine_depth=d.queue_depth, stripe_unit=self.stripe_unit(k),
                                                   placement=s.placement, coalesce=True), env, shared)
        gpu = simpy.Resource(env, capacity=proj.gpus)
        gpu_busy = [0.0]
        ttft = np.zeros(n)
        load = np.zeros(n)
        tier_of = hits.served(proj.caps)
        first = np.r_[0, np.cumsum([len(x) for x in w.blocks])]
        t0 = float(w.t[lo])

        def request(i: int):
            yield env.timeout(float(w.t[i]) - t0)
            j = i - lo
            start = env.now
            ids = w.blocks[i]
            tiers = tier_of[first[i]:first[i + 1]]
            jobs = []
            for tier, store in pools.items():
                keys = [b"blk%d" % x for x in ids[tiers == tier]]
                if keys:
                    store.preload([(k, b) for k in keys if not store.contains(k)])
                    jobs.append(env.process(store.get(keys, to_gpu=True)))
            if counts[i, DRAM]:
                jobs.append(env.process(gpu_link.transfer(int(counts[i, DRAM]) * b)))
            if jobs:
                yield env.all_of(jobs)
            load[j] = env.now - start
            with gpu.request() as g:
                yield g
                gpu_busy[0] += compute[i]
                yield env.timeout(compute[i])
            ttft[j] = env.now - start
            # The tier policy's writes (new blocks, promotions, demotions) follow, off the TTFT path.
            for tier, col in ((SSD, 0), (HDD, 1)):
                if writes[i, col] and tier in pools:
                    env.process(pools[tier].put([(b"w%d:%d:%d" % (col, i, k), b) for k in range(writes[i, col])]))

        for i in range(lo, w.requests):
            env.process(request(i))
        env.run()
        span = max(env.now, 1e-9)
        util = {"gpu": gpu_busy[0] / (span * proj.gpus), "gpu_link": gpu_link.busy / span,
                "host_link": host.busy / span if pools else 0.0}
        for tier, name in ((SSD, "ssd"), (HDD, "hdd")):
            if tier in pools:
                util[name] = float(np.mean([d.busy for d in pools[tier].drives])) / span
        window = float(w.t[-1] - w.t[lo]) or 1.0
        out = self._finish(mix, proj.caps, counts, cached, proj.gpus, ttft, load, compute[lo:], util,
                           "simulated" if n == w.requests else f"simulated (last {n} requests)", rate=n / window)
        out.notes = [x for x in out.notes] + [x for x in proj.notes if not x.startswith("saturated")]
        return out

    def stripe_unit(self, drives: int) -> int:
        """The store's stripe unit, enlarged (in whole units) so a block has at most 4 parts per drive.

        Per-drive shares of a block stay those of the store's unit under round-robin
        striping; bookkeeping per 1 MiB extent of 100+ MiB blocks would dominate run time.
        """
        parts = -(-self.block_bytes // self.s.stripe_unit)
        return self.s.stripe_unit * max(1, -(-parts // (4 * drives)))

    def decode_io(self, mix: Mix) -> float:
        """Simulated time of one sparse decode step's reads from the SSD pool (nan without SSDs).

        The step reads ``sparse_fraction`` of a mean-length context, as clusters of
        ``cluster_tokens`` tokens per layer, placed by the store's placement strategy.
        """
        if not mix.n_ssd:
            return float("nan")
        s, w = self.s, self.s.workload
        key = (mix.ssd.key, mix.n_ssd)
        if key not in self._decode_cache:
            layout = s.model.layout()
            cluster = s.cluster_tokens * layout.entry_bytes
            n = max(1, int(float(w.input_len.mean()) * s.sparse_fraction / s.cluster_tokens)) * layout.num_layers
            store = SimStore(SystemModel([mix.ssd.model()] * mix.n_ssd, capacity_per_drive=SIM_DRIVE_BYTES,
                                         host_link=s.link.model(), gpu_link=s.gpu.link(),
                                         engine_depth=mix.ssd.queue_depth, stripe_unit=s.stripe_unit,
                                         placement=s.placement, coalesce=True))
            keys = [b"c%d" % i for i in range(n)]
            store.preload([(k, cluster) for k in keys])
            proc = store.env.process(store.get(keys, to_gpu=True))
            store.env.run(proc)
            self._decode_cache[key] = proc.value.seconds
        return self._decode_cache[key]
