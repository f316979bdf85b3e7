"""The real model decoding from KV offloaded to N drives with kvswarm's co-activation layout.

Loads SmolLM2-135M-Instruct, wraps 2K tokens of real text (Python's reference docs, or any
UTF-8 file with ``--text-file``) in a chat prompt and prefills it once.  The model's own decode with the KV in
memory answers first (the dense reference) while a :class:`~kvswarm.swarm.profile.Profiler`
records the exact attention of every step.  Its first ``--profile-steps`` steps are the
co-activation profile: kvswarm clusters each layer's co-activated entries, places the clusters
over the drives (co-activated clusters apart, replicas for the hottest), writes the prompt's KV
to N drives (kernel-capped emulated drives from kvswarm.testbed when root allows, else temp
directories) and preloads its DRAM cache with the profile's hottest pieces.  The sparse decode
then replays the dense answer token by token through kvswarm's retrieval (cluster selection by
PQ codes, per-layer budgets, dedup against DRAM, replica choice per drive) and is scored on
whether it would have chosen the same next token.

On the steps after the profile, the demo then compares what the I/O costs: kvswarm's selections
and the baselines' (exact token top-k stored token by token, fixed 16-token blocks with
Quest-style bounds), each on its own layout on the same drives with the same DRAM budget and
the same preload from the profile, every entry fetched attended, the throttle's idle credit
drained before every step.  It prints kvswarm's I/O per step beside the best baseline's at the
same attention recall (interpolated on the baseline's recall/I-O curve).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

MiB = 1 << 20
SINKS = 4
BASELINE_BUDGETS = (0.05, 0.1, 0.2, 0.3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 2048; quick 512)")
    p.add_argument("--steps", type=int, default=None, help="decode steps after the profile (default 16; quick 4)")
    p.add_argument("--profile-steps", type=int, default=None, help="decode steps profiled (default 16; quick 4)")
    p.add_argument("--drives", type=int, default=4)
    p.add_argument("--drive-mode", choices=["auto", "testbed", "temp"], default="auto",
                   help="auto: kernel-capped testbed drives when root allows, else temp dirs")
    p.add_argument("--dir", default=None, help="parent directory of the drives (default: system temp)")
    p.add_argument("--budget", type=float, default=0.15, help="kvswarm's share of offloaded entries per step")
    p.add_argument("--dram", type=float, default=0.05, help="DRAM cache, share of the offloaded entries")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--source", default="pydoc", help="corpus source: pydoc, man, licenses")
    p.add_argument("--text-file", default=None, help="a UTF-8 text file to use as the prompt instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--backend", choices=["threads", "uring"], default="threads")
    p.add_argument("--quick", action="store_true", help="small prompt and few steps (CI)")
    p.add_argument("--json", default=None, help="write the figures (a 'summary' of numbers) to this path")


def run(args: argparse.Namespace, lm=None) -> int:
    """``lm``: an already loaded model (tests); default: the embedded SmolLM2."""
    import torch
    from rich.console import Console

    from kvswarm import corpus, testbed
    from kvswarm.model import load_default_model
    from kvswarm.offload import MemorySequence, OffloadedKVCache, decode, prefill
    from kvswarm.swarm.profile import Profiler

    console = Console()
    if not console.is_terminal:  # logs and CI: keep the wide tables readable
        console = Console(width=160)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = args.tokens or (512 if args.quick else 2048)
    steps = args.steps or (4 if args.quick else 16)
    pro = args.profile_steps or (4 if args.quick else 16)
    source = corpus.file_source(args.text_file) if args.text_file else args.source
    t_all = time.perf_counter()
    lm = lm or load_default_model()
    lay = lm.layout
    console.print(f"[bold]model[/] {lm.model_id}: {lay.num_layers} layers, {lay.num_kv_heads} KV heads, {lay.dtype} "
                  f"KV ({lay.entry_bytes} B per token and layer), {torch.get_num_threads()} threads")
    doc = corpus.make_document(lm.tokenizer, tokens, args.seed, source, chat=True)
    pf = prefill(lm.model, doc.prompt_ids)
    kv = pf.kv()
    console.print(f"[bold]prompt[/] {len(doc)} tokens ({', '.join(doc.titles[:3])}...), prefill {pf.seconds:.1f} s "
                  f"({len(doc) / pf.seconds:.0f} tok/s)")

    # The dense reference, profiled: exact attention of every step (the first ``pro``: the profile).
    mem = MemorySequence(kv, doc.prompt_ids, lay, SINKS, args.window)
    off = mem.geometry.offloaded
    prof = Profiler([mem.offloaded_keys(i) for i in range(lay.num_layers)], off)
    ref = decode(lm.model, OffloadedKVCache(mem, "dense", observers=[prof]), pf.logits, pro + steps)
    console.print(f"[bold]dense reference[/] {pro + steps} tokens at {ref.tokens_per_s:.2f} tok/s (KV in memory); "
                  f"profile: exact top-10% attention of the first {pro} steps")

    from kvswarm.swarm.layout import SwarmPlacement
    from kvswarm.swarm.profile import coactivation_layouts

    n = args.drives
    # kvswarm's pieces (+ replicas), token-level entries (a 4 KiB extent each) and 16-token blocks
    need = int(1.3 * lay.num_layers * len(doc) * (4096 + 3 * lay.entry_bytes) / n) + 64 * MiB
    with testbed.drives(n, args.drive_mode, need, args.dir) as tb:
        caps = getattr(tb, "caps", None)
        model = _drive_model(caps)
        console.print(f"[bold]drives[/] {tb.describe()}")
        t0 = time.perf_counter()
        clusters, layouts = coactivation_layouts(prof, range(pro), len(doc), n, lay.entry_bytes, model)
        sizes = [len(p.positions) for p in layouts[0].pieces]
        console.print(f"[bold]co-activation layout[/] {sum(len(x.pieces) for x in layouts)} pieces over {n} drives "
                      f"(layer 0: {len(clusters[0])} clusters, median piece {int(np.median(sizes))} entries, "
                      f"{sum(len(p.drives) > 1 for p in layouts[0].pieces)} replicated) in "
                      f"{time.perf_counter() - t0:.1f} s")
        store = tb.open_store(backend=args.backend, placement=SwarmPlacement())
        try:
            res = _run_on_drives(args, lm, doc, kv, pf, ref, prof, pro, steps, clusters, layouts, store, tb, model,
                                 console)
        finally:
            store.close()
        info = tb.info()
    res["summary"]["seconds"] = time.perf_counter() - t_all
    console.print(f"{res['summary']['seconds']:.0f} s in all")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**res, "drives": info, "titles": list(doc.titles),
                       "dense_text": lm.tokenizer.decode(ref.fed), "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f,
                      indent=1)
    return 0


def _drive_model(caps):
    from kvswarm.swarm.retrieval import DriveModel

    if caps is None or not caps.read_mbps or not caps.read_iops:
        return DriveModel()
    return DriveModel(caps.read_mbps * 1e6, caps.read_iops)


def _cache(layouts, capacity: int, model, lay, prof, pro: int, universe: int):
    """The DRAM cache every layout gets: cost-benefit, ``capacity`` entries, preloaded from the profile."""
    from kvswarm.swarm.cache import CostBenefit
    from kvswarm.swarm.profile import preload_from_profile
    from kvswarm.swarm.retrieval import UnitCache

    cache = UnitCache(CostBenefit(capacity, t_base=1 / model.read_iops, t_transfer=lay.entry_bytes / model.read_bps),
                      {i: np.array([len(p.positions) for p in x.pieces]) for i, x in enumerate(layouts)})
    preload_from_profile(cache, layouts, prof.mass_array(range(pro)),
                         [prof.incidence(i, range(pro), universe) for i in range(len(layouts))], prof.off, universe)
    return cache


def _run_on_drives(args, lm, doc, kv, pf, ref, prof, pro, steps, clusters, layouts, store, tb, model, console) -> dict:
    from rich.table import Table

    from kvswarm.offload import DriveMeter, OffloadedKVCache, decode
    from kvswarm.sparse.metrics import QualityAuditor, agreement
    from kvswarm.swarm.index import ClusterSelector, LayerAllocation
    from kvswarm.swarm.sequence import SwarmSequence

    lay = lm.layout
    universe = len(doc)
    capacity = int(args.dram * len(prof.off) * lay.num_layers)
    t0 = time.perf_counter()
    seq = SwarmSequence.create(store, kv, doc.prompt_ids, lay, layouts, sinks=SINKS, window=args.window,
                               cache=_cache(layouts, capacity, model, lay, prof, pro, universe), model=model)
    wsec = time.perf_counter() - t0
    loaded = seq.load_cached()
    console.print(f"[bold]offload[/] {seq.object_count()} objects in {wsec:.1f} s; DRAM cache ({args.dram:.0%} of the "
                  f"entries, cost-benefit) preloaded with the profile's {loaded} hottest pieces")
    alloc = LayerAllocation.from_profile(prof.mass_array(range(pro)))

    def selector():
        return ClusterSelector(clusters, score="pq", pick="density", centroids=256, subspaces=8, alloc=alloc)

    # The real decode through kvswarm's retrieval, teacher-forced on the dense answer.
    sel = selector()
    auditor = QualityAuditor(seq)
    cache = OffloadedKVCache(seq, "sparse", sel, sparsity=args.budget, observers=[auditor])
    meter = DriveMeter(store)
    out = decode(lm.model, cache, pf.logits, pro + steps, forced=ref.fed)
    per_drive = meter.delta()
    after = cache.steps[pro:]
    io_ms = 1e3 * float(np.mean([s.io_s for s in after]))
    agree = agreement(out.predicted[pro:], ref.predicted[pro:])
    wall = sum(out.step_s) - auditor.seconds
    console.print(f"[bold]kvswarm decode[/] {(pro + steps) / wall:.2f} tok/s; after the profile: I/O {io_ms:.1f} ms "
                  f"per step (drives idle while the model computes), {np.mean([s.pages for s in after]):.0f} reads; "
                  f"same next token as dense at "
                  f"{agree:.0%} of {steps} steps; attention recall {auditor.stats.mean('recall_offloaded'):.3f} of "
                  f"the offloaded mass")

    # The same steps' I/O, kvswarm against the baselines, on the dense run's queries.
    eval_steps = range(pro, pro + steps)
    def view(s, lays):  # the stored layout, read with a fresh cache of the same budget and preload
        v = s.view(cache=_cache(lays, capacity, model, lay, prof, pro, universe))
        v.load_cached()
        return v

    rows = {"kvswarm": [_replay(view(seq, layouts),
                                _built(selector(), seq, lay.num_layers), args.budget, prof, eval_steps, tb)]}
    from kvswarm.sparse import make_selector
    from kvswarm.swarm.cluster import contiguous
    from kvswarm.swarm.layout import plan_layout

    for name, block, make in (("token top-k", 1, lambda: make_selector("oracle")),
                              ("fixed blocks", 16, lambda: make_selector("blocks", block_tokens=16))):
        blays = [plan_layout(contiguous(prof.off, block), store.num_drives, lay.entry_bytes, mode="raid0")
                 for _ in range(lay.num_layers)]
        bseq = SwarmSequence.create(store, kv, doc.prompt_ids, lay, blays, sinks=SINKS, window=args.window,
                                    model=model, seq_id=f"demo/{name}".encode())
        rows[name] = [_replay(view(bseq, blays),
                              _built(make(), bseq, lay.num_layers), b, prof, eval_steps, tb)
                      for b in BASELINE_BUDGETS]
    kvp = rows["kvswarm"][0]
    t = Table(title=f"I/O per decode step after the profile ({steps} steps, {store.num_drives} drives, same DRAM "
                    f"and preload, every entry fetched attended, throttle credit drained)")
    for c in ("layout and retrieval", "budget", "I/O ms/step", "MB/step", "reads/step", "DRAM hit", "recall"):
        t.add_column(c, justify="right")
    for name, pts in rows.items():
        for p in pts:
            t.add_row(name, f"{p['budget']:g}", f"{p['io_ms']:.1f}", f"{p['mb']:.2f}", f"{p['reads']:.0f}",
                      f"{p['hit']:.2f}", f"{p['recall']:.3f}")
    console.print(t)
    at = {name: _at_recall(pts, kvp["recall"]) for name, pts in rows.items() if name != "kvswarm"}
    best = min(at, key=lambda k: at[k][0])
    console.print(f"[bold]at the same attention recall ({kvp['recall']:.3f})[/]: kvswarm {kvp['io_ms']:.1f} ms of I/O "
                  f"per step, the best baseline ({best}) {at[best][0]:.1f} ms ({at[best][1]}): "
                  f"{at[best][0] / kvp['io_ms']:.2f}x less I/O time with kvswarm")
    table = Table(title="drives during the kvswarm decode")
    for col in ("drive", "read ops", "MiB read", "MiB/step"):
        table.add_column(col, justify="right")
    for i, (ops, nbytes) in enumerate(per_drive):
        table.add_row(str(i), f"{ops}", f"{nbytes / MiB:.1f}", f"{nbytes / (pro + steps) / MiB:.2f}")
    console.print(table)
    console.print(f"[dim]dense answer:[/] {lm.tokenizer.decode(ref.fed)!r}")
    summary = {"prompt_tokens": float(len(doc)), "steps": float(steps), "profile_steps": float(pro),
               "prefill_s": pf.seconds, "offload_s": wsec, "kvswarm_decode_io_ms_per_step": io_ms,
               "agreement": agree, "recall": auditor.stats.mean("recall_offloaded"),
               "misses": float(cache.totals().misses),
               "kvswarm_io_ms": kvp["io_ms"], "kvswarm_recall": kvp["recall"], "best_baseline": best,
               "best_baseline_io_ms": at[best][0], "speedup_vs_best_baseline": at[best][0] / kvp["io_ms"]}
    for i in range(len(per_drive)):
        summary[f"drive{i}_mib_per_step"] = float(per_drive[i, 1]) / (pro + steps) / MiB
    return {"summary": summary, "compare": rows}


def _built(sel, seq, layers: int):
    for layer in range(layers):
        sel.build(layer, seq.offloaded_keys(layer), seq.geometry.offloaded)
    return sel


def _replay(seq, sel, budget: float, prof, steps: range, tb) -> dict:
    """Select on the dense run's queries, plan (booking the DRAM cache in decode order), then read
    each step on the drives right after draining the throttle's credit; recall over every entry
    fetched or served from DRAM."""
    from kvswarm.sparse.base import budget_for

    k = budget_for(budget, len(prof.off))
    plans, recall = [], []
    for s in steps:
        row = []
        for layer, ret in enumerate(seq.retrievers):
            pos = np.asarray(sel.select(prof.queries[(s, layer)], k).positions, np.int64)
            plan = seq.plan(layer, pos)
            got = ret.positions_of(np.concatenate([np.array([p for p, _ in plan.reads], np.int64), plan.cached_used]))
            recall.append(prof.recall(s, layer, np.union1d(got, pos)))
            row.append((layer, pos, plan))
        plans.append(row)
    io = []
    with tb.drain() as drain:
        for row in plans:
            drain()
            io.append(seq.read_step(row))
    ps = [p for row in plans for _, _, p in row]
    wanted = sum(p.wanted for p in ps)
    return {"budget": budget, "io_ms": 1e3 * float(np.mean(io)), "recall": float(np.mean(recall)),
            "mb": sum(sum(p.nbytes) for p in ps) / len(plans) / 1e6,
            "reads": sum(len(p.reads) for p in ps) / len(plans),
            "hit": sum(p.dram_hits for p in ps) / max(1, wanted)}


def _at_recall(pts: list[dict], recall: float) -> tuple[float, str]:
    """I/O time at ``recall`` on a curve of points (log-linear), and how it was found."""
    pts = sorted(pts, key=lambda p: p["recall"])
    r = np.maximum.accumulate([p["recall"] for p in pts])
    io = np.log([max(p["io_ms"], 1e-9) for p in pts])
    if recall > r[-1]:
        return float(np.exp(io[-1])), "never reaches it: a lower bound"
    if recall < r[0]:
        return float(np.exp(io[0])), "exceeds it at its smallest budget: an upper bound"
    return float(np.exp(np.interp(recall, r, io))), "interpolated"
