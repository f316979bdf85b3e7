"""Strategies of the sparse benchmark and the machinery to run them on a captured decode.

A *strategy* is what a deployment would configure: a selector (who is needed), a layout
(which entries share a store object, on which drive, how many copies), a retrieval (dedup,
replica choice) and a DRAM cache policy.  The baselines and kvswarm run through the same
code: selections come from each selector on the real model's captured queries
(:class:`~kvswarm.bench.capture.DecodeCapture`); reads are planned by the
:class:`~kvswarm.swarm.retrieval.Retriever` and either executed on a real store
(:class:`~kvswarm.swarm.sequence.SwarmSequence`) or costed with the drive model
(``estimate``, used to tune on the profile text only).

Activation traces for co-activation profiling are the exact top-``profile_sparsity`` entries
of the dense attention during the first ``profile_steps`` decode steps of each text; the
evaluation uses later steps of the same text (and the strategies' knobs are fixed on one
text and evaluated on others).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvswarm.bench.capture import DecodeCapture
from kvswarm.placement import DriveView
from kvswarm.sparse.base import Selector, StepQuery, budget_for, make_selector
from kvswarm.sparse.kmeans import KMeansPQSelector
from kvswarm.swarm.cache import CostBenefit, PerLayerLRU
from kvswarm.swarm.cluster import Clusters, cluster_heat, contiguous, make_clusterer
from kvswarm.swarm.coact import cograph, incidence
from kvswarm.swarm.index import ClusterSelector, LayerAllocation
from kvswarm.swarm.layout import LayerLayout, SwarmPlacement, copy_hints, plan_layout
from kvswarm.swarm.profile import preload_from_profile
from kvswarm.swarm.retrieval import DriveModel, ReadPlan, Retriever, UnitCache

SINKS, WINDOW = 4, 64


# ---- one text's captured decode, with exact attention -------------------------------------
class TextData:
    def __init__(self, cap: DecodeCapture, label: str, sinks: int = SINKS, window: int = WINDOW,
                 profile_steps: int = 32, profile_sparsity: float = 0.1) -> None:
        self.cap, self.label, self.sinks, self.window = cap, label, sinks, window
        self.profile_sparsity = profile_sparsity
        self.off = cap.offloaded(sinks, window)
        self.n = len(self.off)
        self.base = int(self.off[0])
        self.profile_steps = min(profile_steps, cap.steps - 1)
        self.mass = np.zeros((cap.steps, cap.layers, self.n), np.float32)
        self.off_mass = np.zeros((cap.steps, cap.layers))
        for s in range(cap.steps):
            for layer in range(cap.layers):
                self.mass[s, layer], self.off_mass[s, layer] = cap.dense_mass(layer, s, sinks, window)
        k = budget_for(profile_sparsity, self.n)
        top = np.argpartition(-self.mass, k - 1, axis=2)[:, :, :k]
        self.active = np.sort(top, axis=2) + self.base  # [steps, layers, k] positions
        self.keys = [torch.from_numpy(np.ascontiguousarray(cap.k[layer][:, self.base:self.base + self.n]))
                     for layer in range(cap.layers)]

    @property
    def layers(self) -> int:
        return self.cap.layers

    @property
    def eval_steps(self) -> range:
        return range(self.profile_steps, self.cap.steps)

    def profile_incidence(self, layer: int):
        return incidence(self.active[:self.profile_steps, layer], self.cap.prompt_len)

    def recall(self, step: int, layer: int, positions: np.ndarray) -> float:
        """Share of the offloaded attention mass that attending ``positions`` captures."""
        tot = self.mass[step, layer].sum()
        return float(self.mass[step, layer, positions - self.base].sum() / tot) if tot > 0 else 1.0

    def query(self, layer: int, step: int) -> StepQuery:
        return StepQuery(layer, step, self.cap.query(layer, step),
                         self.cap.resident_keys(layer, step, self.sinks, self.window), self.cap.scale)


# ---- clusters of a text -------------------------------------------------------------------
def _cached(td: TextData, name: str, make: Callable[[], dict[int, Clusters]]) -> dict[int, Clusters]:
    """Per-layer clusters of a captured text, computed once (derived data next to the captures),
    keyed by everything they depend on: the capture, the offloaded range (sinks, window) and the
    profile (steps, sparsity), and the clusterer (``name``)."""
    from kvswarm.bench import capture

    key = td.cap.meta.get("cache_key")
    if not key:
        return make()
    profile = f"s{td.sinks}-w{td.window}-p{td.profile_steps}-ps{td.profile_sparsity:g}"
    path = capture.capture_dir() / "derived" / f"{key}-{profile}-{name}-v1.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as z:
            return {layer: Clusters.from_arrays(z, suffix=str(layer)) for layer in range(td.layers)}
    out = make()
    path.parent.mkdir(exist_ok=True)
    arrays = {}
    for layer, cl in out.items():
        arrays.update(cl.to_arrays(suffix=str(layer)))
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return out


def coactivation_clusters(td: TextData, clusterer: str, neighbours: int = 32, **kw) -> dict[int, Clusters]:
    c = make_clusterer(clusterer, **kw)

    def make():
        out = {}
        for layer in range(td.layers):
            x = td.profile_incidence(layer)
            out[layer] = c.cluster(cograph(x, neighbours), x, td.off)
        return out

    return _cached(td, f"{c.describe()}-n{neighbours}", make)


def kmeans_labels(x: torch.Tensor, k: int, iters: int = 10, seed: int = 0) -> np.ndarray:
    """Lloyd's k-means on rows of ``x`` (torch matmuls; random distinct rows as seeds)."""
    g = torch.Generator().manual_seed(seed)
    c = x[torch.randperm(len(x), generator=g)[:k]].clone()
    for _ in range(iters):
        lab = torch.cdist(x, c).argmin(1)
        cnt = torch.bincount(lab, minlength=k).clamp(min=1).to(x.dtype)
        new = torch.zeros_like(c).index_add_(0, lab, x) / cnt[:, None]
        c = torch.where(torch.bincount(lab, minlength=k)[:, None] > 0, new, c)
    return torch.cdist(x, c).argmin(1).numpy()


def key_clusters(td: TextData, size: int = 16, seed: int = 0) -> dict[int, Clusters]:
    """Entries grouped by k-means of their keys (all KV heads), cut to ``size``: the layout of a
    key-clustering index (PQCache/ClusterKV-like) -- tokens with similar keys share a page."""
    return _cached(td, f"keykmeans{size}-{seed}", lambda: _key_clusters(td, size, seed))


def _key_clusters(td: TextData, size: int, seed: int) -> dict[int, Clusters]:
    out = {}
    for layer in range(td.layers):
        x = td.keys[layer].permute(1, 0, 2).reshape(td.n, -1).to(torch.float32)
        k = max(1, td.n // size)
        lab = kmeans_labels(x, k, seed=seed * 1000 + layer)
        members = []
        for c in range(k):
            m = td.off[lab == c]
            members += [m[i:i + size] for i in range(0, len(m), size)]
        x_inc = td.profile_incidence(layer)
        out[layer] = Clusters(members, np.array([int(m[0]) for m in members], np.int64),
                              np.zeros(len(members), bool), cluster_heat(x_inc, members))
    return out


def position_blocks(td: TextData, size: int) -> dict[int, Clusters]:
    return {layer: contiguous(td.off, size) for layer in range(td.layers)}


# ---- strategies -----------------------------------------------------------------------------
CACHE_POLICIES = ("per_layer_lru", "cost_benefit")  # every strategy is run with each


@dataclass
class Strategy:
    name: str
    label: str
    # (clusters, the text's PQ index of ``pq`` codes, the text) -> selector
    selector: Callable[[dict[int, Clusters] | None, KMeansPQSelector, TextData], Selector]
    clusters: Callable[[TextData], dict[int, Clusters]]
    clusters_id: tuple  # what ``clusters`` computes (equal ids, equal clusters: computed and stored once)
    layout: str = "raid0"  # raid0 | stripe | balanced
    piece_bytes: int = 32 << 10
    replicate: float = 0.0
    assign: str = "primary"
    dedup: bool = True
    cache: str = "cost_benefit"  # one of CACHE_POLICIES, or none
    selection_of: str | None = None  # reuse another strategy's selections (same selector)
    prebuilt: bool = False  # the selector is the text's shared PQ index, already built
    pq: tuple[int, int] = (64, 2)  # (centroids, subspaces) of the text's PQ index the selector uses
    warm: bool = False  # DRAM cache preloaded with the profile's hottest pieces (warm_cache)
    knobs: dict = field(default_factory=dict)  # the tuned settings this strategy was built from

    def variant(self, cache: str, warm: bool) -> Strategy:
        """The same strategy with another DRAM cache policy / preload."""
        return replace(self, cache=cache, warm=warm)


# What the tuning pass may choose per strategy, on the profile text (the first entry: the
# published default).  token: packing of token-level entries into pages of consecutive tokens;
# blocks: block size; kmeans: PQ index size and key-cluster (page) size; raid0: stripe unit;
# swarm: the clustering threshold; kvswarm: clusterer, cluster size, piece size, replication.
GRIDS: dict[str, list[dict]] = {
    "token": [{"block": 1}, {"block": 2}, {"block": 4}],
    "blocks": [{"block": 16}, {"block": 8}, {"block": 32}],
    "kmeans": [{"pq": (64, 2), "size": 16}, {"pq": (256, 8), "size": 16}, {"pq": (64, 2), "size": 32}],
    "raid0": [{"block": 16}, {"block": 32}],
    "swarm": [{"tau": 0.5}, {"tau": 0.3}, {"tau": 0.7}],
    "kvswarm": [{"clusterer": "partition", "size": 12}, {"clusterer": "frequency", "size": 12},
                {"clusterer": "partition", "size": 20}, {"clusterer": "partition", "size": 8},
                {"clusterer": "partition", "size": 12, "piece_bytes": 96 << 10, "replicate": 0.0},
                {"clusterer": "partition", "size": 12, "pq": (64, 2)},
                {"clusterer": "partition", "size": 12, "alloc": False}],
}
QUICK_GRIDS = {k: v[:2] for k, v in GRIDS.items()}
ORDER = ("token", "blocks", "kmeans", "swarm", "kvswarm", "raid0")  # tuning order (raid0 reads kvswarm's selection)


def make_strategy(name: str, knobs: dict | None = None) -> Strategy:
    """One strategy with ``knobs`` over its grid's first (published) entry."""
    k = dict(GRIDS[name][0])
    k.update(knobs or {})
    if name == "token":
        b = k["block"]
        return Strategy("token", "token top-k (No Cluster)", lambda cl, pq, td: make_selector("oracle"),
                        lambda td: position_blocks(td, b), ("blocks", b), knobs=k)
    if name == "blocks":
        b = k["block"]
        return Strategy("blocks", "fixed blocks (InfLLM/Quest-like)",
                        lambda cl, pq, td: make_selector("blocks", block_tokens=b),
                        lambda td: position_blocks(td, b), ("blocks", b), knobs=k)
    if name == "kmeans":
        size = k["size"]
        return Strategy("kmeans", "k-means keys (PQCache-like)", lambda cl, pq, td: pq,
                        lambda td: key_clusters(td, size), ("keys", size), prebuilt=True, pq=tuple(k["pq"]),
                        knobs=k)
    if name == "swarm":
        tau = k["tau"]
        return Strategy("swarm", "Swarm as published", lambda cl, pq, td: ClusterSelector(cl, score="medoid",
                                                                                          pick="mass"),
                        lambda td: coactivation_clusters(td, "greedy", tau=tau, max_copies=2),
                        ("greedy", tau), layout="stripe", assign="bucket", knobs=k)
    kv = dict(GRIDS["kvswarm"][0], score="pq", pick="density", piece_bytes=48 << 10, replicate=0.15,
              pq=(256, 8), alloc=True)
    kv.update((knobs or {}).get("kvswarm", {}) if name == "raid0" else k)

    def sel(cl, pq, td):
        alloc = LayerAllocation.from_profile(td.mass[:td.profile_steps]) if kv.get("alloc") else None
        return ClusterSelector(cl, score=kv["score"], pick=kv["pick"], pq=pq, history=kv.get("history", 0.0),
                               alloc=alloc)

    if name == "raid0":
        b = k["block"]
        return Strategy("raid0", "RAID-0, no co-activation", sel, lambda td: position_blocks(td, b),
                        ("blocks", b), selection_of="kvswarm", pq=tuple(kv["pq"]), knobs=k)
    if name != "kvswarm":
        raise ValueError(f"unknown strategy {name!r}; one of {ORDER}")
    ckw = {"size": kv["size"]} if kv["clusterer"] in ("partition", "frequency") else dict(kv.get("cluster_kw", {}))
    return Strategy("kvswarm", "kvswarm", sel, lambda td: coactivation_clusters(td, kv["clusterer"], **ckw),
                    (kv["clusterer"], tuple(sorted(ckw.items()))), layout="balanced", assign="makespan",
                    piece_bytes=kv["piece_bytes"], replicate=kv["replicate"], pq=tuple(kv["pq"]), knobs=kv)


def default_strategies(tuned: dict[str, dict] | None = None) -> list[Strategy]:
    """Every strategy with its tuned knobs (``tuned``: name -> knobs; raid0 also reads
    ``tuned["kvswarm"]``, whose selection it lays out), else the published defaults."""
    tuned = tuned or {}
    return [make_strategy(n, {**tuned.get(n, {}), "kvswarm": tuned.get("kvswarm", {})} if n == "raid0"
                          else tuned.get(n)) for n in ORDER]


# ---- selections -----------------------------------------------------------------------------
@dataclass
class Selections:
    positions: list[list[np.ndarray]]  # [eval step][layer]
    recall: np.ndarray  # [eval steps, layers]
    select_s: float  # mean selector time per (step, layer)
    index_bytes: int
    entries: float  # mean entries selected per (step, layer)
    steps: range  # the decode steps selected for


def build_pq(td: TextData, centroids: int = 64, subspaces: int = 2) -> KMeansPQSelector:
    """The text's PQ index (the k-means baseline's selector, shared with PQ-scored cluster selectors)."""
    pq = make_selector("kmeans", centroids=centroids, subspaces=subspaces)
    for layer in range(td.layers):
        pq.build(layer, td.keys[layer], td.off)
    return pq


def run_selector(td: TextData, selector: Selector, sparsity: float, steps: range, build: bool = True) -> Selections:
    budget = budget_for(sparsity, td.n)
    for layer in range(td.layers if build else 0):
        selector.build(layer, td.keys[layer], td.off)
    pos, rec, t = [], np.zeros((len(steps), td.layers)), 0.0
    for i, s in enumerate(steps):
        row = []
        for layer in range(td.layers):
            q = td.query(layer, s)
            t0 = time.perf_counter()
            sel = selector.select(q, budget)
            t += time.perf_counter() - t0
            row.append(np.asarray(sel.positions, np.int64))
            rec[i, layer] = td.recall(s, layer, row[-1])
            if selector.wants_feedback:  # what attention then gave the attended entries (exact)
                selector.feedback(layer, s, row[-1], td.mass[s, layer, row[-1] - td.base])
        pos.append(row)
    n = max(1, len(steps) * td.layers)
    return Selections(pos, rec, t / n, selector.index_bytes(), float(np.mean([len(p) for r in pos for p in r])), steps)


# ---- layouts and retrieval -------------------------------------------------------------------
def build_layouts(st: Strategy, td: TextData, clusters: dict[int, Clusters], drives: int, entry_bytes: int,
                  model: DriveModel) -> list[LayerLayout]:
    cost = lambda b: max(b / model.read_bps, 1 / model.read_iops)  # noqa: E731
    out = []
    for layer in range(td.layers):
        cl = clusters[layer]
        act = None
        if st.layout == "balanced":
            x = td.profile_incidence(layer)
            act = (x @ cl.membership(td.cap.prompt_len)) > 0
        out.append(plan_layout(cl, drives, entry_bytes, mode=st.layout, piece_bytes=st.piece_bytes,
                               max_piece_entries=max(1, ((1 << 20) - 64) // entry_bytes),
                               replicate=st.replicate, activity=act, cost=cost))
    return out


def simulated_drives(layouts: list[LayerLayout], drives: int) -> list[list[list[int]]]:
    """Drive of every copy as SwarmPlacement would place them on ``drives`` empty drives, in write order."""
    pl = SwarmPlacement()
    views = [DriveView(i, 1 << 40, True) for i in range(drives)]
    return [[[pl.place(b"", 1, views, h)[0] for h in copy_hints(p.drives)] for p in lay.pieces] for lay in layouts]


def make_cache(st: Strategy, capacity: int, layouts: list[LayerLayout], model: DriveModel,
               entry_bytes: int, td: TextData | None = None) -> UnitCache | None:
    """The strategy's DRAM cache of ``capacity`` entries (all layers together), preloaded from the
    profile when the strategy is ``warm``."""
    if st.cache == "none" or capacity <= 0:
        return None
    if st.cache == "cost_benefit":
        pol = CostBenefit(capacity, t_base=1 / model.read_iops, t_transfer=entry_bytes / model.read_bps)
    elif st.cache == "per_layer_lru":
        pol = PerLayerLRU(capacity, len(layouts))
    else:
        raise ValueError(f"cache policy must be one of {CACHE_POLICIES} or none, got {st.cache!r}")
    cache = UnitCache(pol, {i: np.array([len(p.positions) for p in lay.pieces]) for i, lay in enumerate(layouts)})
    if st.warm and td is not None:
        warm_cache(cache, layouts, td)
    return cache


def warm_cache(cache: UnitCache, layouts: list[LayerLayout], td: TextData) -> None:
    """Preload the DRAM cache from the text's profile (``swarm.profile.preload_from_profile``): the
    pieces with the most profile attention per entry, known at prefill (when the KV is in memory)."""
    p = td.profile_steps
    preload_from_profile(cache, layouts, td.mass[:p], [td.profile_incidence(layer) for layer in range(td.layers)],
                         td.off, td.cap.prompt_len)


def retrievers(st: Strategy, layouts: list[LayerLayout], copy_drives: list[list[list[int]]], universe: int,
               entry_bytes: int, drives: int, model: DriveModel) -> list[Retriever]:
    return [Retriever(lay.holders(universe), np.array([len(p.positions) for p in lay.pieces]), cd, entry_bytes,
                      drives, model, st.assign, st.dedup) for lay, cd in zip(layouts, copy_drives)]


@dataclass
class IOResult:
    """Per eval step sums over layers."""

    io_s: np.ndarray  # measured (store) or modelled (estimate) I/O time per step
    nbytes: np.ndarray  # bytes read per step (extents)
    reads: np.ndarray  # I/Os per step
    entries_read: np.ndarray
    wanted: np.ndarray
    hits: np.ndarray  # DRAM cache hits (entries)
    recall: np.ndarray  # attention recall of every entry fetched or served from DRAM (mean over layers)
    model_s: np.ndarray | None = None  # the same reads under the drive model (throttle arithmetic)
    plan_s: float = 0.0  # mean planning time per (step, layer)
    per_drive_bytes: np.ndarray | None = None  # [drives] totals

    def summary(self, drives: int, model: DriveModel, entry_bytes: int) -> dict:
        t = float(self.io_s.mean())
        bw = float(self.nbytes.sum() / max(self.io_s.sum(), 1e-12))
        return {"io_ms": 1e3 * t, "recall": float(self.recall.mean()),
                "io_model_ms": 1e3 * float(self.model_s.mean()) if self.model_s is not None else t * 1e3,
                "mb_per_step": float(self.nbytes.mean() / 1e6),
                "reads_per_step": float(self.reads.mean()), "bandwidth_mbps": bw / 1e6,
                "utilisation": bw / (drives * model.read_bps),
                "model_utilisation": float(self.model_s.sum() / max(self.io_s.sum(), 1e-12))
                if self.model_s is not None else 1.0,
                "read_amplification": float(self.entries_read.sum() / max(1, self.wanted.sum() - self.hits.sum())),
                "dram_hit_rate": float(self.hits.sum() / max(1, self.wanted.sum())),
                "plan_ms": 1e3 * self.plan_s}


def plan_steps(rets: list[Retriever], sel: Selections, cache: UnitCache | None,
               run: Callable[[list[tuple[int, np.ndarray, ReadPlan]]], float] | None,
               model: DriveModel, td: TextData, book: Callable[[int, ReadPlan], None] | None = None) -> IOResult:
    """Plan every eval step's reads layer after layer (each plan books its reads in the DRAM cache
    before the next layer is planned, as in a decode; ``book`` does it for a store-backed sequence)
    and, with ``run``, execute the step's plans; without, cost them with ``model`` (the sum of each
    layer's slowest drive).  Attention covers every entry of every piece read or used from DRAM
    (no strategy pays for bytes it does not attend); ``recall`` is that set's share of the mass."""
    e = len(sel.positions)
    r = IOResult(*(np.zeros(e) for _ in range(6)), recall=np.zeros(e), model_s=np.zeros(e))
    pdb = np.zeros(rets[0].drives)
    plan_t = 0.0
    for i, (row, step) in enumerate(zip(sel.positions, sel.steps)):
        plans = []
        for layer, pos in enumerate(row):
            t0 = time.perf_counter()
            plan = rets[layer].plan(pos, cache, layer)
            plan_t += time.perf_counter() - t0
            plans.append((layer, pos, plan))
            r.model_s[i] += plan.makespan(model)
            attended = rets[layer].positions_of(np.concatenate([np.array([p for p, _ in plan.reads], np.int64),
                                                                plan.cached_used]))
            r.recall[i] += td.recall(step, layer, np.union1d(attended, pos)) / len(row)
            if book is not None:
                book(layer, plan)
            elif cache is not None:
                cache.after_read(layer, [p for p, _ in plan.reads], plan.cached_used)
            r.nbytes[i] += sum(plan.nbytes)
            r.reads[i] += len(plan.reads)
            r.entries_read[i] += plan.entries_read
            r.wanted[i] += plan.wanted
            r.hits[i] += plan.dram_hits
            pdb += plan.per_drive_bytes
        r.io_s[i] = run(plans) if run is not None else r.model_s[i]
        if cache is not None and hasattr(cache.policy, "tick"):
            cache.policy.tick()
    r.plan_s = plan_t / max(1, e * len(rets))
    r.per_drive_bytes = pdb
    return r
