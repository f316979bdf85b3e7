"""Co-activation placement and retrieval (the Swarm core) against the paper's baselines.

Data: real decodes of SmolLM2-135M-Instruct over real texts (chat-framed prompts from the
corpus), captured once per text (:mod:`kvswarm.swarm.capture`; cached): every layer's query
per step, the prompt KV, the tokens.  The first ``profile_steps`` decode steps of a text are its
co-activation profile (exact top-10% attention); later steps are the evaluation.  kvswarm's
knobs are tuned on the *profile text* only (cost model, no I/O) and then evaluated on the
other texts.

Strategies, side by side on the same selections' queries and the same drives:
token top-k (No Cluster), fixed blocks (InfLLM/Quest-like), k-means keys (PQCache-like),
RAID-0 without co-activation, Swarm as published (greedy clusters, medoid index, striping,
bucket scheduler, cost-benefit cache) with no-balance / no-dedup ablations, kvswarm's best.

I/O is real: each strategy's layout of the text's real KV is written to N emulated drives
(loop devices capped in the kernel by blkio, see :mod:`kvswarm.testbed`; caps stated in the
output), then every evaluation step is replayed layer by layer -- plan, one ``submit_get``
batch over all drives, wait -- and timed.  Per strategy: I/O time per step, effective
bandwidth and its share of the aggregate cap, read amplification, DRAM hit rate, attention
recall (share of the offloaded attention mass attended, exact from the captured queries)
and next-token agreement with the dense model (teacher-forced decode through the offloaded
cache).  Speedups compare kvswarm's operating point with each baseline's I/O time at the
same attention recall, interpolated on that baseline's recall/I-O curve.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvswarm.bench import write_json
from kvswarm.io.throttle import DriveCaps
from kvswarm.sparse.base import budget_for, small_ops
from kvswarm.swarm.capture import DecodeCapture, TextSpec, cached_capture
from kvswarm.swarm.experiment import (
    SINKS,
    WINDOW,
    IOResult,
    Selections,
    Strategy,
    TextData,
    build_layouts,
    build_pq,
    default_strategies,
    make_cache,
    plan_steps,
    retrievers,
    run_selector,
    simulated_drives,
)
from kvswarm.swarm.retrieval import DriveModel

MiB = 1 << 20
# io_steps: timed steps per point (+1 untimed warm-up); the full run is sized to finish in ~20-25
# min on the shared 2-core machine (most of it the token and no-dedup baselines' many small reads).
QUICK = {"io_steps": 4, "curve": [0.05, 0.1, 0.2, 0.3], "agreement_steps": 8, "contexts": [1024, 4096],
         "eval_texts": ["man:0", "licenses:0"], "tune": "small", "online_layers": 4}
FULL = {"io_steps": 6, "curve": [0.05, 0.1, 0.2, 0.3, 0.4], "agreement_steps": 16,
        "contexts": [1024, 2048, 4096, 8192], "eval_texts": ["man:0", "licenses:0", "pydoc:1"], "tune": "full",
        "online_layers": 6}
BASELINES = ("token", "blocks", "kmeans")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the co-activation benchmark (``--quick``, ``--json``, ``--tokens`` and ``--backend``
    are shared with the decode benchmark and registered by ``kvswarm.bench.sparse_bench``)."""
    p.add_argument("--drive-counts", default="1,2,4,8", help="numbers of emulated drives")
    # Low enough that the drives, not the store's ~50-100 us of Python per read on a busy 2-core
    # machine, bound the replay; the 20 KB bandwidth/IOPS crossover of the testbed's defaults is kept.
    p.add_argument("--cap-mbps", type=float, default=40.0, help="per-drive read cap, MB/s")
    p.add_argument("--cap-iops", type=float, default=2000.0, help="per-drive read cap, IOPS")
    p.add_argument("--emulation", choices=["auto", "kernel", "user-space"], default="auto")
    # The kernel's blkio throttle grants up to one 100 ms slice of budget after an idle gap, so
    # 1-20 ms per-layer batches waited for one by one pass partly unthrottled (measured 1.3-2x the
    # cap on 1-2 drives); a whole step in flight keeps the drives busy (see replay()).
    p.add_argument("--replay", choices=["step", "layer"], default="step",
                   help="time a step with all its layers in flight (default) or layer after layer")
    p.add_argument("--profile-text", default="pydoc:0", help="SOURCE:SEED of the text kvswarm is tuned on")
    p.add_argument("--eval-texts", default=None, help="SOURCE:SEED,... evaluated (first one: I/O on drives)")
    p.add_argument("--budget", type=float, default=0.1, help="kvswarm's operating budget (share of context)")
    p.add_argument("--dram", type=float, default=0.05, help="DRAM cache, share of the offloaded entries")
    p.add_argument("--profile-steps", type=int, default=32)
    p.add_argument("--compute-ms", type=float, default=1.0, help="per-layer compute time the prefetch overlaps")
    p.add_argument("--no-agreement", action="store_true", help="skip the decode runs for token agreement")


# ---- captures --------------------------------------------------------------------------------
def parse_text(s: str, tokens: int) -> TextSpec:
    src, _, seed = s.partition(":")
    return TextSpec(src, int(seed or 0), tokens)


class ModelOnce:
    def __init__(self) -> None:
        self.lm = None

    def __call__(self):
        if self.lm is None:
            from kvswarm.model import load_default_model

            self.lm = load_default_model()
        return self.lm


def load_text(spec: TextSpec, model: ModelOnce, log, profile_steps: int, steps: int = 64) -> TextData:
    cap = cached_capture(spec, steps, model, log=log)
    return TextData(cap, spec.label, SINKS, WINDOW, profile_steps)


# ---- per-text strategy runs ------------------------------------------------------------------
@dataclass
class TextRun:
    td: TextData
    pq: object  # the default (64, 2) PQ index (the k-means baseline's)
    clusters: dict = field(default_factory=dict)  # clustering function -> per-layer clusters
    pqs: dict = field(default_factory=dict)  # (centroids, subspaces) -> other PQ indexes of the text
    selections: dict[tuple[str, float], Selections] = field(default_factory=dict)
    cluster_s: dict[str, float] = field(default_factory=dict)

    def clusters_of(self, st: Strategy) -> dict:
        """The strategy's clusters (strategies sharing a clustering function share the result)."""
        if st.clusters not in self.clusters:
            t0 = time.perf_counter()
            self.clusters[st.clusters] = st.clusters(self.td)
            self.cluster_s[st.name] = time.perf_counter() - t0
        return self.clusters[st.clusters]

    def pq_of(self, st: Strategy):
        """The text's PQ index with the strategy's code configuration (built once per configuration)."""
        if tuple(st.pq) == (64, 2):
            return self.pq
        if tuple(st.pq) not in self.pqs:
            self.pqs[tuple(st.pq)] = build_pq(self.td, *st.pq)
        return self.pqs[tuple(st.pq)]

    def selector(self, st: Strategy):
        return st.selector(self.clusters_of(st), self.pq_of(st), self.td)

    def select(self, st: Strategy, strategies: dict[str, Strategy], sparsity: float, steps: range) -> Selections:
        owner = strategies[st.selection_of] if st.selection_of else st
        k = (owner.name, sparsity)
        if k not in self.selections:
            with small_ops():
                self.selections[k] = run_selector(self.td, self.selector(owner), sparsity, steps,
                                                  build=not owner.prebuilt)
        return self.selections[k]


def estimate(run: TextRun, st: Strategy, strategies, sparsity: float, steps: range, drives: int, model: DriveModel,
             dram: float) -> tuple[Selections, dict]:
    """Recall and modelled I/O of a strategy (no drives): for tuning on the profile text."""
    td = run.td
    sel = run.select(st, strategies, sparsity, steps)
    lays = build_layouts(st, td, run.clusters_of(st), drives, entry_bytes(td), model)
    rets = retrievers(st, lays, simulated_drives(lays, drives), td.cap.prompt_len, entry_bytes(td), drives, model)
    cache = make_cache(st, int(dram * td.n * td.layers), lays, model, entry_bytes(td), td)
    return sel, plan_steps(rets, sel, cache, None, model).summary(drives, model, entry_bytes(td))


def entry_bytes(td: TextData) -> int:
    return 2 * td.cap.k.shape[1] * td.cap.k.shape[3] * td.cap.k.dtype.itemsize


# ---- tuning on the profile text -------------------------------------------------------------
def tune(run: TextRun, grid: list[dict], sparsities: list[float], steps: range, model: DriveModel, dram: float,
         target: float, log) -> tuple[dict, list[dict]]:
    """kvswarm's knobs with the least modelled I/O at ``target`` recall on the profile text."""
    rows = []
    for knobs in grid:
        st = next(s for s in default_strategies(knobs) if s.name == "kvswarm")
        run.selections = {k: v for k, v in run.selections.items() if k[0] != "kvswarm"}
        pts = []
        for sp in sparsities:
            sel, est = estimate(run, st, {"kvswarm": st}, sp, steps, 8, model, dram)
            pts.append((float(sel.recall.mean()), est["io_ms"]))
        io = interp_io(pts, target)
        rows.append({"knobs": knobs, "io_ms_at_target": io[0], "reached": io[1], "points": pts})
        log(f"  tune {knobs}: {io[0]:.1f} ms at recall {target:.3f} ({io[1]})")
    best = min(rows, key=lambda r: (r["reached"] != "interpolated", r["io_ms_at_target"]))
    run.selections = {k: v for k, v in run.selections.items() if k[0] != "kvswarm"}
    return best["knobs"], rows


def interp_io(points: list[tuple[float, float]], target: float) -> tuple[float, str]:
    """I/O time at ``target`` recall on a curve of (recall, io) points (log-linear in io)."""
    pts = sorted(points)
    r = np.array([p[0] for p in pts])
    io = np.log(np.maximum([p[1] for p in pts], 1e-9))
    if target > r[-1]:
        return float(np.exp(io[-1])), "not reached (lower bound)"
    if target < r[0]:
        return float(np.exp(io[0])), "exceeded at smallest budget (upper bound)"
    # recall is not always monotone in budget for estimators: use the running max envelope
    return float(np.exp(np.interp(target, np.maximum.accumulate(r), io))), "interpolated"


# ---- real I/O on emulated drives -------------------------------------------------------------
@contextlib.contextmanager
def testbed(n: int, drive_bytes: int, caps: DriveCaps, mode: str) -> Iterator[object]:
    from kvswarm.testbed import Testbed

    with Testbed(n, drive_bytes=drive_bytes, caps=caps, mode=mode) as tb:
        yield tb


def kv_of(cap: DecodeCapture) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.from_numpy(cap.k[i])[None], torch.from_numpy(cap.v[i])[None]) for i in range(cap.layers)]


def kv_layout(cap: DecodeCapture):
    from kvswarm.layout import KVLayout
    from kvswarm.model import DEFAULT_MODEL_ID

    return KVLayout(cap.layers, cap.k.shape[1], cap.k.shape[3], "float32", model_id=DEFAULT_MODEL_ID)


def layout_key(st: Strategy) -> tuple:
    return (st.clusters, st.layout, st.piece_bytes, st.replicate)


def write_sequence(store, run: TextRun, st: Strategy, n: int, model: DriveModel, dram: float, written: dict):
    """The strategy's sequence on ``store``: written once per layout, then viewed with the
    strategy's own retrieval (replica choice, dedup) and a fresh DRAM cache."""
    from kvswarm.swarm.sequence import SwarmSequence

    td = run.td
    key = layout_key(st)
    write_s = 0.0
    if key not in written:
        lays = build_layouts(st, td, run.clusters_of(st), n, entry_bytes(td), model)
        t0 = time.perf_counter()
        written[key] = SwarmSequence.create(store, kv_of(td.cap), td.cap.tokens, kv_layout(td.cap), lays,
                                            sinks=SINKS, window=WINDOW, seq_id=f"{td.label}/{st.name}".encode(),
                                            model=model)
        write_s = time.perf_counter() - t0
    base = written[key]
    cache = make_cache(st, int(dram * td.n * td.layers), base.layouts, model, entry_bytes(td), td)
    seq = base.view(assign=st.assign, dedup=st.dedup, cache=cache)
    seq.load_cached()  # a preloaded cache's pieces are read now (at prefill), not during the timed steps
    return seq, write_s


def replay(seq, sel: Selections, model: DriveModel, warm: int = 1, mode: str = "step") -> IOResult:
    """Replay every step of ``sel`` on the drives and time it.

    All steps are planned first (planning books the DRAM cache in decode order), then executed
    back to back, so the drives never sit idle while Python plans (a kernel throttle would credit
    that idle time).  ``mode="step"``: a step's reads for all layers are in flight together (one
    batch per layer, as with cross-layer prefetch) and the step lasts until the last is verified;
    ``mode="layer"``: each layer's batch is waited for before the next is submitted.  The first
    ``warm`` steps are executed but not counted (they start the throttle's accounting)."""
    steps: list[list] = []

    def collect(plans):
        steps.append(plans)
        return 0.0

    r = plan_steps(seq.retrievers, sel, seq.cache, collect, model, seq.book)
    for i, plans in enumerate(steps):
        t0 = time.perf_counter()
        if mode == "layer":
            for layer, pos, plan in plans:
                seq.submit_plan(layer, pos, plan).wait()
        else:
            for h in [seq.submit_plan(layer, pos, plan) for layer, pos, plan in plans]:
                h.wait()
        r.io_s[i] = time.perf_counter() - t0
    keep = slice(warm, None)
    return IOResult(r.io_s[keep], r.nbytes[keep], r.reads[keep], r.entries_read[keep], r.wanted[keep],
                    r.hits[keep], r.model_s[keep], r.plan_s, r.per_drive_bytes)


def stored_bytes(run: TextRun, strategies: list[Strategy], n: int, model: DriveModel) -> int:
    from kvswarm.format import extent_size

    eb = entry_bytes(run.td)
    total = 0
    seen = set()
    for st in strategies:
        if layout_key(st) in seen:
            continue
        seen.add(layout_key(st))
        for lay in build_layouts(st, run.td, run.clusters_of(st), n, eb, model):
            total += sum(extent_size(len(p.positions) * eb) * len(p.drives) for p in lay.pieces)
    return total


def prefetch_model(rets, sel: Selections, cache, model: DriveModel, compute_s: float, min_votes: int = 2) -> dict:
    """Cross-layer prefetch on the drive model: while layer L computes (``compute_s``), layer L+1's
    predicted pieces are read; what layer L+1 still misses is read when its selection is known.
    Exposed I/O per layer: without prefetch its whole read; with, the rest plus any prefetch time
    beyond the compute it overlapped.  Precision/recall compare predicted and needed pieces."""
    from kvswarm.swarm.prefetch import CrossLayerPrefetch, precision_recall

    pf = CrossLayerPrefetch([r.holders for r in rets], min_votes=min_votes)
    without = with_ = 0.0
    prec, rec, wasted = [], [], 0
    for row in sel.positions:
        for layer, pos in enumerate(row):
            need = rets[layer].plan(pos, cache, layer)
            t_need = need.makespan(model)
            without += t_need
            if layer == 0:
                with_ += t_need
            else:
                held = cache.mask(layer, len(rets[layer].sizes)) if cache is not None else None
                pred = pf.predict(layer - 1, row[layer - 1], len(need.reads) + len(need.cached_used))
                if held is not None:
                    pred = pred[~held[pred]]
                pred = pf.fit(pred, compute_s, lambda p, r=rets[layer]: r.plan_pieces(p).makespan(model))
                t_pref = rets[layer].plan_pieces(pred).makespan(model)
                rest = rets[layer].plan(pos, cache, layer, available=pred)
                with_ += rest.makespan(model) + max(0.0, t_pref - compute_s)
                needed = np.array([p for p, _ in need.reads], np.int64)
                pr, rc = precision_recall(pred, needed)
                prec.append(pr)
                rec.append(rc)
                wasted += len(np.setdiff1d(pred, needed))
            if cache is not None:
                cache.after_read(layer, [p for p, _ in need.reads], need.cached_used)
        if cache is not None and hasattr(cache.policy, "tick"):
            cache.policy.tick()
    steps = max(1, len(sel.positions))
    return {"exposed_io_ms_without": 1e3 * without / steps, "exposed_io_ms_with": 1e3 * with_ / steps,
            "hidden_ms": 1e3 * (without - with_) / steps, "hidden_share": (without - with_) / without if without else 0.0,
            "precision": float(np.mean(prec)) if prec else float("nan"),
            "recall": float(np.mean(rec)) if rec else float("nan"), "wasted_reads_per_step": wasted / steps,
            "compute_ms_per_layer": 1e3 * compute_s}


# ---- token agreement (real decode through the offloaded cache) -------------------------------
def agreement(run: TextRun, st: Strategy, strategies, sparsity: float, steps: int, model: ModelOnce) -> float:
    from kvswarm.offload import MemorySequence, OffloadedKVCache, decode

    td, cap = run.td, run.td.cap
    lm = model()
    owner = strategies[st.selection_of] if st.selection_of else st
    p = td.profile_steps
    steps = min(steps, cap.steps - p)
    # The profile steps' tokens join the resident window (their KV as the dense run made it), so
    # the sparse decode starts where the evaluation starts and the offloaded range is unchanged.
    kv = [(torch.from_numpy(np.concatenate([cap.k[i], cap.dk[i, :, :p]], 1))[None],
           torch.from_numpy(np.concatenate([cap.v[i], cap.dv[i, :, :p]], 1))[None]) for i in range(cap.layers)]
    tokens = np.concatenate([cap.tokens, cap.fed[:p]])
    src = MemorySequence(kv, tokens, kv_layout(cap), SINKS, WINDOW + p)
    sel = run.selector(owner)
    if not owner.prebuilt:
        for layer in range(td.layers):
            sel.build(layer, td.keys[layer], td.off)
    cache = OffloadedKVCache(src, "sparse", sel, budget=budget_for(sparsity, td.n), build_index=False)
    res = decode(lm.model, cache, torch.zeros(1), steps, forced=cap.fed[p:p + steps].tolist())
    return float(np.mean(np.asarray(res.predicted) == cap.pred[p:p + steps]))


# ---- online maintenance (trace-driven, no I/O) -----------------------------------------------
def online_experiment(run: TextRun, best: Strategy, layers: list[int], sparsity: float) -> dict:
    """Static profile clusters vs online maintenance (window tokens join clusters, re-clustering on
    drift) on the evaluation steps: entries read per entry needed when fetching the clusters that
    hold each step's exact top-k (a layout's efficiency, independent of the selector)."""
    from kvswarm.swarm.cluster import make_clusterer
    from kvswarm.swarm.online import OnlineMaintainer

    td, cap = run.td, run.td.cap
    k = budget_for(sparsity, td.n)
    static_ra, online_ra, joined, joined_hit = [], [], 0, 0
    reclusters = 0
    for layer in layers:
        cl0 = run.clusters_of(best)[layer]
        clusterer = make_clusterer("partition", size=int(np.median(cl0.sizes[~cl0.cold]) or 12))
        om = OnlineMaintainer(_copy_clusters(cl0), td.off, clusterer, window_steps=16, history=32)
        for s in range(td.profile_steps):
            om.coact.add(td.active[s, layer])
        for s in td.eval_steps:
            # decoded tokens: active when their mass beats the k-th offloaded entry's
            kth = np.partition(td.mass[s, layer], -k)[-k]
            dm = _decoded_mass(cap, layer, s, td)
            new_active = cap.prompt_len + np.flatnonzero(dm[:s] > kth)
            need = td.active[s, layer]
            static_ra.append(_fetched(cl0, need, cap.prompt_len + cap.steps) / len(need))
            known = np.concatenate([need, new_active[np.isin(new_active, om.positions)]])
            online_ra.append(_fetched(om.clusters, known, cap.prompt_len + cap.steps) / max(1, len(known)))
            om.new_token(cap.prompt_len + s, s)
            left = om.observe(s, np.concatenate([need, new_active]), int(online_ra[-1] * len(known)), len(known))
            for pos, _ in left:
                joined += 1
                joined_hit += int(pos in set(new_active.tolist()))
            if om.drifted():
                om.recluster()
        reclusters += om.reclusters
    return {"static_read_per_needed": float(np.mean(static_ra)), "online_read_per_needed": float(np.mean(online_ra)),
            "tokens_joined": joined, "reclusters": reclusters, "layers": layers}


def _copy_clusters(cl):
    from kvswarm.swarm.cluster import Clusters

    return Clusters([m.copy() for m in cl.members], cl.medoids.copy(), cl.cold.copy(), cl.heat.copy())


def _decoded_mass(cap: DecodeCapture, layer: int, step: int, td: TextData) -> np.ndarray:
    from kvswarm.sparse.base import attention_mass, gqa_logits, head_lse

    q = cap.query(layer, step)
    lo = gqa_logits(q, torch.from_numpy(cap.k[layer][:, td.base:td.base + td.n]), cap.scale)
    lr = gqa_logits(q, cap.resident_keys(layer, step, td.sinks, td.window), cap.scale)
    return attention_mass(lr, head_lse(lo, lr)).numpy()[td.sinks + td.window:]


def _fetched(cl, need: np.ndarray, universe: int) -> int:
    memb = cl.membership(universe)
    hit = np.unique(memb[need].indices)
    return int(cl.sizes[hit].sum())


# ---- clustering strategies compared (layout quality, selector-independent) -------------------
CLUSTERINGS = [("greedy", {"tau": 0.3}), ("greedy", {"tau": 0.5}), ("greedy", {"tau": 0.7}),
               ("greedy", {"tau": 0.5, "max_size": 24, "min_size": 6, "leftover_size": 12}),
               ("frequency", {"size": 12}), ("partition", {"size": 12}), ("partition", {"size": 24})]


def clustering_experiment(run: TextRun, budget: float, model: DriveModel, drives: int = 8) -> dict:
    """Per clusterer: fetch, each evaluation step and layer, every cluster holding an entry of the
    exact top-``budget`` attention (the oracle's needs): entries read per entry needed, reads per
    step when clusters are striped over all drives (paper) or kept whole (one read per cluster),
    and the modelled I/O time of both layouts."""
    from kvswarm.format import extent_size
    from kvswarm.swarm.experiment import coactivation_clusters

    td = run.td
    eb = entry_bytes(td)
    k = budget_for(budget, td.n)
    out = {}
    for name, kw in CLUSTERINGS:
        t0 = time.perf_counter()
        cls = coactivation_clusters(td, name, **kw)
        secs = time.perf_counter() - t0
        ra, reads_stripe, reads_whole, t_stripe, t_whole = [], 0, 0, 0.0, 0.0
        steps = list(td.eval_steps)
        for layer in range(td.layers):
            cl = cls[layer]
            memb = cl.membership(td.cap.prompt_len)
            sizes = cl.sizes
            for s in steps:
                need = np.argpartition(-td.mass[s, layer], k - 1)[:k] + td.base
                hit = np.unique(memb[need].indices)
                ra.append(sizes[hit].sum() / k)
                per = np.minimum(sizes[hit], drives)
                reads_stripe += int(per.sum())
                reads_whole += len(hit)
                # striped: every drive reads one piece of each cluster; whole: clusters spread evenly
                piece = np.array([extent_size(int(-(-z // p)) * eb) for z, p in zip(sizes[hit], per)])
                t_stripe += max(piece.sum() / model.read_bps / drives * 1.0, per.sum() / drives / model.read_iops)
                whole = np.array([extent_size(int(z) * eb) for z in sizes[hit]])
                t_whole += max(whole.sum() / drives / model.read_bps, len(hit) / drives / model.read_iops)
        n = len(steps)
        c0 = cls[0]
        out[make_name(name, kw)] = {
            "read_per_needed": float(np.mean(ra)), "reads_per_step_striped": reads_stripe / n,
            "reads_per_step_whole": reads_whole / n, "io_model_ms_striped": 1e3 * t_stripe / n,
            "io_model_ms_whole": 1e3 * t_whole / n, "clusters_layer0": len(c0),
            "median_size": float(np.median(c0.sizes[~c0.cold])) if (~c0.cold).any() else 0.0,
            "replicated_share": float((c0.copies(td.cap.prompt_len) > 1).sum() / td.n), "seconds": secs}
    return out


def make_name(name: str, kw: dict) -> str:
    return name + "(" + ",".join(f"{k}={v}" for k, v in kw.items()) + ")"


# ---- the benchmark ---------------------------------------------------------------------------
def bench(args: argparse.Namespace, console) -> dict:
    cfg = dict(QUICK if args.quick else FULL)
    log = lambda s: console.print(s)  # noqa: E731
    model = DriveModel(args.cap_mbps * 1e6, args.cap_iops)
    caps = DriveCaps(read_mbps=args.cap_mbps, read_iops=args.cap_iops)
    drives = [int(x) for x in args.drive_counts.split(",")]
    lm = ModelOnce()
    evals = (args.eval_texts or ",".join(cfg["eval_texts"])).split(",")
    args.tokens = args.tokens or 4096
    args.backend = args.backend or "uring"
    out: dict = {"config": {**cfg, "drives": drives, "cap_mbps": args.cap_mbps, "cap_iops": args.cap_iops,
                            "tokens": args.tokens, "profile_text": args.profile_text, "eval_texts": evals,
                            "sparsity": args.budget, "dram": args.dram, "profile_steps": args.profile_steps,
                            "date": time.strftime("%Y-%m-%d %H:%M:%S")}}
    torch.set_num_threads(1)

    # 1. tune kvswarm on the profile text (cost model only)
    t0 = time.perf_counter()
    prof = TextRun(load_text(parse_text(args.profile_text, args.tokens), lm, log, args.profile_steps), None)
    prof.pq = build_pq(prof.td)
    tsteps = range(prof.td.profile_steps, prof.td.profile_steps + 6)
    tok = next(s for s in default_strategies() if s.name == "token")
    target = float(run_selector(prof.td, tok.selector(None, None, prof.td), args.budget, tsteps).recall.mean())
    grid = [{"clusterer": "partition", "size": 12}, {"clusterer": "frequency", "size": 12},
            {"clusterer": "partition", "size": 20}]
    if cfg["tune"] == "full":
        grid += [{"clusterer": "partition", "size": 8}, {"clusterer": "partition", "size": 16},
                 {"clusterer": "partition", "size": 12, "piece_bytes": 24 << 10, "replicate": 0.3},
                 {"clusterer": "partition", "size": 12, "piece_bytes": 96 << 10, "replicate": 0.0}]
    log(f"tuning kvswarm on {prof.td.label} (target recall {target:.3f}: the token oracle at {args.budget:g})")
    best, rows = tune(prof, grid, [args.budget, 1.5 * args.budget, 2 * args.budget, 3 * args.budget],
                      tsteps, model, args.dram, target, log)
    pts = sorted(next(r for r in rows if r["knobs"] == best)["points"])
    sps = sorted([args.budget, 1.5 * args.budget, 2 * args.budget, 3 * args.budget])
    rec_at = [p[0] for p in sorted(zip([p[0] for p in pts], sps))]
    # kvswarm's operating budget: where, on the profile text, it attends the mass of the exact top-k
    op = float(np.interp(target, np.maximum.accumulate(rec_at), sps)) if target <= max(rec_at) else sps[-1]
    args.op_budget = round(np.ceil(op / 0.005) * 0.005, 3)
    out["tuning"] = {"text": prof.td.label, "target_recall": target, "rows": rows, "best": best,
                     "op_budget": args.op_budget, "seconds": time.perf_counter() - t0}
    log(f"kvswarm best on the profile text: {best}, operating budget {args.op_budget:g} (its recall there "
        f"matches the token oracle's at {args.budget:g})")
    strategies = default_strategies(best)
    by_name = {s.name: s for s in strategies}

    phase = {"tune": time.perf_counter() - t0}
    t_ph = time.perf_counter()

    # 2. evaluation texts: selections and recall curves
    runs: dict[str, TextRun] = {}
    eval_steps_all: dict[str, range] = {}
    out["recall"] = {}
    for spec in evals:
        td = load_text(parse_text(spec, args.tokens), lm, log, args.profile_steps)
        run = TextRun(td, build_pq(td))
        runs[td.label] = run
        steps = range(td.profile_steps, min(td.cap.steps, td.profile_steps + cfg["io_steps"] + 1))
        eval_steps_all[td.label] = steps
        rec = {}
        for st in strategies:
            for sp in curve_for(st, cfg, args):
                sel = run.select(st, by_name, sp, steps)
                rec.setdefault(st.name, {})[str(sp)] = {"recall": float(sel.recall.mean()), "entries": sel.entries,
                                                         "select_ms": 1e3 * sel.select_s}
        out["recall"][td.label] = rec
        log(f"{td.label}: recall at {args.budget:g} (kvswarm, raid0: {args.op_budget:g}): " + ", ".join(
            f"{k} {v[str(op_for(by_name[k], args))]['recall']:.3f}" for k, v in rec.items()))
    io_run = runs[next(iter(runs))]
    out["clustering"] = {label: clustering_experiment(r, args.budget, model) for label, r in runs.items()}
    for label, per in out["clustering"].items():
        log(f"clusterings on {label} (fetching the clusters of the exact top-{args.budget:g}):")
        for name, v in per.items():
            log(f"  {name:55s} read/needed {v['read_per_needed']:.2f}  reads/step striped "
                f"{v['reads_per_step_striped']:.0f} whole {v['reads_per_step_whole']:.0f}  model ms striped "
                f"{v['io_model_ms_striped']:.1f} whole {v['io_model_ms_whole']:.1f}")

    phase["selections_clusterings"] = time.perf_counter() - t_ph
    t_ph = time.perf_counter()

    # 3. real I/O: every strategy on N drives; the full recall/I-O curve on the largest N
    out["io"] = {}
    nmax = max(drives)
    for n in drives:
        need = stored_bytes(io_run, strategies, n, model)
        drive_bytes = int((need / n) * 1.3 + 64 * MiB) // 4096 * 4096
        with testbed(n, drive_bytes, caps, args.emulation) as tb:
            out.setdefault("testbed", {})[str(n)] = {"describe": tb.describe(), **tb.info()}
            from kvswarm.swarm.layout import SwarmPlacement

            store = tb.open_store(backend=args.backend, placement=SwarmPlacement(), queue_depth=64,
                                  buffer_pool_bytes=256 * MiB)
            written: dict = {}
            try:
                for st in strategies:
                    sps = curve_for(st, cfg, args) if n == nmax else [op_for(st, args)]
                    for sp in sps:
                        sel = io_run.select(st, by_name, sp, eval_steps_all[io_run.td.label])
                        seq, write_s = write_sequence(store, io_run, st, n, model, args.dram, written)
                        r = replay(seq, sel, model, mode=args.replay)
                        summ = r.summary(n, model, entry_bytes(io_run.td))
                        summ.update(recall=float(sel.recall[1:].mean()), entries=sel.entries,
                                    read_amplification_vs_budget=float(r.entries_read.mean() / (
                                        io_run.td.layers * budget_for(sp, io_run.td.n))),
                                    write_s=write_s, objects=seq.object_count())
                        out["io"].setdefault(st.name, {}).setdefault(str(n), {})[str(sp)] = summ
                        log(f"  N={n} {st.name:16s} s={sp:<5g} io {summ['io_ms']:7.1f} ms  util "
                            f"{summ['utilisation']:.2f}  recall {summ['recall']:.3f}  hit {summ['dram_hit_rate']:.2f}")
                    if n == nmax and st.name == "kvswarm":
                        out["prefetch"] = prefetch_experiment(seq, io_run, st, by_name, args, model)
            finally:
                store.close()

    phase["io"] = time.perf_counter() - t_ph
    t_ph = time.perf_counter()

    # 4. utilisation vs context length (largest N, operating budget)
    out["context"] = context_experiment(args, cfg, strategies, by_name, lm, log, model, caps, nmax)
    phase["context"] = time.perf_counter() - t_ph
    t_ph = time.perf_counter()

    # 5. quality: token agreement (decode through the offloaded cache), online maintenance
    if not args.no_agreement:
        out["agreement"] = {}
        for st in strategies:
            if st.selection_of:
                continue
            with small_ops():
                out["agreement"][st.name] = agreement(io_run, st, by_name, op_for(st, args), cfg["agreement_steps"],
                                                      lm)
            log(f"  agreement {st.name}: {out['agreement'][st.name]:.3f}")
    layers = list(np.linspace(1, io_run.td.layers - 1, cfg["online_layers"]).astype(int))
    out["online"] = online_experiment(io_run, by_name["kvswarm"], [int(x) for x in layers], args.budget)
    out["config"]["op_budget"] = args.op_budget
    phase["agreement_online"] = time.perf_counter() - t_ph
    phase["total"] = time.perf_counter() - t0
    out["phase_s"] = phase
    log("phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in phase.items()))
    out["summary"] = summarize(out, args, nmax)
    return out


def prefetch_experiment(seq, run: TextRun, st, by_name, args, model) -> dict:
    sel = run.select(st, by_name, args.op_budget, range(run.td.profile_steps, run.td.profile_steps + 4))
    cache = make_cache(st, int(args.dram * run.td.n * run.td.layers), seq.layouts, model, entry_bytes(run.td),
                       run.td)
    return prefetch_model(seq.retrievers, sel, cache, model, args.compute_ms / 1e3)


def context_experiment(args, cfg, strategies, by_name, lm, log, model, caps, n) -> dict:
    res = {}
    names = ["token", "blocks", "kmeans", "swarm", "kvswarm"]
    src = (args.eval_texts or cfg["eval_texts"][0]).split(",")[0]
    for ctx in cfg["contexts"]:
        spec = parse_text(src, ctx)
        td = load_text(spec, lm, log, args.profile_steps)
        run = TextRun(td, build_pq(td))
        steps = range(td.profile_steps, td.profile_steps + 4)
        sts = [by_name[x] for x in names]
        need = stored_bytes(run, sts, n, model)
        with testbed(n, int((need / n) * 1.3 + 64 * MiB) // 4096 * 4096, caps, args.emulation) as tb:
            from kvswarm.swarm.layout import SwarmPlacement

            store = tb.open_store(backend=args.backend, placement=SwarmPlacement(), queue_depth=64,
                                  buffer_pool_bytes=256 * MiB)
            written: dict = {}
            try:
                for st in sts:
                    sel = run.select(st, by_name, op_for(st, args), steps)
                    seq, _ = write_sequence(store, run, st, n, model, args.dram, written)
                    summ = replay(seq, sel, model, mode=args.replay).summary(n, model, entry_bytes(td))
                    summ.update(recall=float(sel.recall[1:].mean()), select_ms=1e3 * sel.select_s)
                    res.setdefault(st.name, {})[str(ctx)] = summ
                    log(f"  ctx {ctx} {st.name:8s} io {summ['io_ms']:7.1f} ms util {summ['utilisation']:.2f} "
                        f"select {summ['select_ms']:.2f} ms")
            finally:
                store.close()
    return res


def summarize(out: dict, args, n: int) -> dict:
    io = out["io"]
    sp = str(args.op_budget)
    best = io["kvswarm"][str(n)][sp]
    s = {"util_8_drives" if n == 8 else f"util_{n}_drives": best["utilisation"],
         "kvswarm_io_ms": best["io_ms"], "kvswarm_recall": best["recall"]}
    for name in io:
        pts = [(v["recall"], v["io_ms"]) for v in io[name][str(n)].values()]
        own = str(op_for(by_name_of(name), args))
        s[f"attention_mass_{name}"] = io[name][str(n)].get(own, {}).get("recall", float("nan"))
        s[f"io_ms_{name}"] = io[name][str(n)].get(own, {}).get("io_ms", float("nan"))
        if name in BASELINES or name in ("raid0", "swarm"):
            at, how = interp_io(pts, best["recall"])
            key = {"token": "speedup_vs_token", "blocks": "speedup_vs_block", "kmeans": "speedup_vs_kmeans"}.get(
                name, f"speedup_vs_{name}")
            s[key] = at / best["io_ms"]
            s[key + "_basis"] = how
            at_m, _ = interp_io([(v["recall"], v["io_model_ms"]) for v in io[name][str(n)].values()], best["recall"])
            s[key.replace("speedup", "model_speedup")] = at_m / best["io_model_ms"]
    if "kvswarm_cold" in io and "blocks" in io:  # ablation: kvswarm without the preloaded DRAM cache
        cold = io["kvswarm_cold"][str(n)][sp]
        at, _ = interp_io([(v["recall"], v["io_ms"]) for v in io["blocks"][str(n)].values()], cold["recall"])
        s["cold_speedup_vs_block"] = at / cold["io_ms"]
    s["kvswarm_budget"] = args.op_budget
    s["token_budget"] = args.budget
    for nn, per in io["kvswarm"].items():
        if sp in per:
            s[f"kvswarm_io_ms_{nn}_drives"] = per[sp]["io_ms"]
    if "prefetch" in out:
        s["prefetch_precision"] = out["prefetch"]["precision"]
        s["prefetch_recall"] = out["prefetch"]["recall"]
        s["prefetch_hidden_share"] = out["prefetch"]["hidden_share"]
    for k, v in out.get("agreement", {}).items():
        s[f"agreement_{k}"] = v
    return {k: (float(v) if isinstance(v, (int, float, np.floating)) else v) for k, v in s.items()}


def op_for(st: Strategy, args) -> float:
    """A strategy's operating budget: kvswarm's (and RAID-0's, which reads kvswarm's selection) was
    set on the profile text; the baselines run at ``--budget``."""
    return args.op_budget if (st.selection_of or st.name) == "kvswarm" else args.budget


def curve_for(st: Strategy, cfg: dict, args) -> list[float]:
    return sorted(set(cfg["curve"]) | {op_for(st, args)})


def by_name_of(name: str) -> Strategy:
    return Strategy(name, name, None, None, selection_of="kvswarm" if name in ("raid0", "kvswarm_cold") else None)


# ---- output ----------------------------------------------------------------------------------
def print_tables(out: dict, args, console) -> None:
    from rich.table import Table

    n = str(max(int(x) for x in args.drive_counts.split(",")))
    sp = str(args.budget)
    t = Table(title=f"sparse decode I/O on {n} drives, budget {sp} (kvswarm, raid0: {args.op_budget:g}) "
                    f"({out['config']['eval_texts'][0]}; "
                    f"caps {args.cap_mbps:g} MB/s, {args.cap_iops:g} IOPS per drive)")
    for c in ("strategy", "I/O ms/step", "MB/step", "reads/step", "util", "RA", "DRAM hit", "recall",
              "agreement"):
        t.add_column(c, justify="right")
    for name, per in out["io"].items():
        v = per[n].get(str(op_for(by_name_of(name), args)))
        if v is None:
            continue
        t.add_row(name, f"{v['io_ms']:.1f}", f"{v['mb_per_step']:.1f}", f"{v['reads_per_step']:.0f}",
                  f"{v['utilisation']:.2f}", f"{v['read_amplification_vs_budget']:.2f}", f"{v['dram_hit_rate']:.2f}",
                  f"{v['recall']:.3f}", f"{out.get('agreement', {}).get(name, float('nan')):.2f}")
    console.print(t)
    s = out["summary"]
    console.print(
        f"kvswarm vs token / blocks / k-means at equal attention recall ({s['kvswarm_recall']:.3f}): "
        f"{s['speedup_vs_token']:.2f}x / {s['speedup_vs_block']:.2f}x / {s['speedup_vs_kmeans']:.2f}x "
        f"lower I/O time (targets 4.0x / 2.7x / 1.6x); vs Swarm as published {s.get('speedup_vs_swarm', 0):.2f}x; "
        f"utilisation on {n} drives {s.get('util_8_drives', float('nan')):.2f} (target 0.90)")


def plot(out: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = os.path.splitext(path)[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per in out["io"].items():
        own = str(op_for(by_name_of(name), args))
        ns = sorted((int(k) for k in per if own in per[k]))
        ax.plot(ns, [per[str(k)][own]["io_ms"] for k in ns], marker="o", label=name)
    ax.set(xlabel="drives", ylabel="I/O time per step (ms)", yscale="log", title="I/O time vs drives")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(base + "-drives.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per in out.get("context", {}).items():
        cs = sorted(int(k) for k in per)
        ax.plot(cs, [per[str(c)]["utilisation"] for c in cs], marker="o", label=name)
    ax.set(xlabel="context tokens", ylabel="bandwidth utilisation", xscale="log", title="utilisation vs context")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(base + "-context.png", dpi=120)
    n = str(max(int(x) for x in args.drive_counts.split(",")))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per in out["io"].items():
        pts = sorted((v["recall"], v["io_ms"]) for v in per[n].values())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set(xlabel="attention recall (offloaded mass attended)", ylabel="I/O time per step (ms)", yscale="log",
           title=f"I/O time vs attention mass, {n} drives")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(base + "-curve.png", dpi=120)
    plt.close("all")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    out = bench(args, console)
    print_tables(out, args, console)
    if args.json:
        write_json(args.json, out)
        plot(out, args, args.json)
        console.print(f"wrote {args.json} (+ plots)")
    return 0
