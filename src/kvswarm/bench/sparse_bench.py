"""Sparse decode from offloaded KV, in two modes (``--mode``):

* ``swarm`` (default): co-activation placement and retrieval (the Swarm core) against the paper's
  baselines -- token top-k, fixed blocks, k-means keys, RAID-0 without co-activation, Swarm as
  published (+ no-balance / no-dedup) and kvswarm's best -- on real activation traces and real KV
  of SmolLM2 over several real texts, with 1/2/4/8 emulated drives; see
  :mod:`kvswarm.bench.swarm_bench` and docs/swarm.md.
* ``decode``: dense restore vs each sparse selector decoding through the offloaded cache (the
  first version, below).

Decode mode.  One real-text prompt (held-out continuation kept for scoring) is prefilled once by the real
model; its KV is offloaded once per grouping to the same drives; then every configuration
decodes the same continuation, teacher-forced, through the same production code path
(``OffloadedKVCache`` + ``KVStore``):

* baseline ``dense``: every step restores all offloaded entries of every layer;
* ``<selector>@<sparsity>``: each step and layer reads only the pages holding the selector's
  entries (sinks and the recent window stay in DRAM).

Per configuration: I/O time per step (submit -> verified in DRAM, summed over layers), bytes
read per step (from the drives' own counters), effective bandwidth, selector time, and
quality against the model's own in-memory decode of the same tokens: attention-mass recall
(whole context, offloaded entries, vs the exact top-k of the same size), next-token
agreement, perplexity of the held-out text.  The ratios printed are dense / sparse.
Configurations take turns in rounds of ``--chunk`` steps (order rotated each round), so a
change in the machine's background load during the run falls on all of them alike.

Extension points (the co-activation issue adds to them, same harness): ``--selectors``
takes any registered ``kvswarm.sparse`` selector, ``--groupings`` any registered
``kvswarm.offload.grouping`` layout (each grouping is offloaded and decoded separately),
``--placement`` any registered store placement.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvswarm.bench import write_json

MiB = 1 << 20
QUICK = {"tokens": 1024, "steps": 8}
FULL = {"tokens": 4096, "steps": 32}


# ---- drives (kvswarm.testbed.drives) -----------------------------------------------------------
def store_bytes_needed(layout, prompt_len: int, page_bytes: int) -> int:
    """On-drive bytes of one offloaded prompt (pages of every layer plus residents), generously."""
    from kvswarm.format import extent_size
    from kvswarm.offload.grouping import entries_per_page

    cap = entries_per_page(page_bytes, layout.entry_bytes)
    pages = -(-prompt_len // cap)
    return layout.num_layers * (pages * extent_size(cap * layout.entry_bytes) + extent_size(
        prompt_len * layout.entry_bytes // 8)) + (16 << 20)


# ---- one configuration ------------------------------------------------------------------------
@dataclass
class RunResult:
    name: str
    selector: str
    sparsity: float
    grouping: str
    steps: int
    budget: int
    io_ms_per_step: float
    select_ms_per_step: float
    read_bytes_per_step: float  # from the drives' counters (extents incl. headers/padding)
    payload_bytes_per_step: float
    pages_per_step: float
    entries_per_step: float
    read_gbps: float  # read bytes / I/O time
    decode_tok_s: float  # wall time minus the auditor's
    recall: float
    recall_offloaded: float
    recall_vs_oracle: float
    agreement: float
    ppl: float
    misses: int
    index_mib: float = 0.0
    build_s: float = 0.0
    per_drive_read_bytes: list[int] = field(default_factory=list)
    per_drive_read_ops: list[int] = field(default_factory=list)
    recall_per_layer: list[float] = field(default_factory=list)


class ConfigRun:
    """One configuration decoding the forced tokens in chunks, so configurations can be interleaved
    (round by round) and drift in the machine's background load falls on all of them alike."""

    def __init__(self, lm, seq, store, forced: Sequence[int], first_logits, *, name: str, mode: str,
                 selector=None, sparsity: float = 1.0, auditor=None, dense_layers=(), whole_pages: bool = False,
                 build_s: float = 0.0) -> None:
        from kvswarm.offload import DecodeResult, OffloadedKVCache

        self.lm, self.seq, self.store, self.forced = lm, seq, store, list(forced)
        self.name, self.selector, self.sparsity, self.auditor, self.build_s = name, selector, sparsity, auditor, build_s
        self.cache = OffloadedKVCache(seq, mode, selector, sparsity=sparsity, observers=[auditor] if auditor else [],
                                      dense_layers=dense_layers, build_index=False, whole_pages=whole_pages)
        self.steps = len(self.forced) - 1
        self.done = 0
        self.out = DecodeResult(last_logits=first_logits)  # the chunks' steps, joined
        self.per_drive = None

    def advance(self, n: int, on_step=None) -> None:
        from kvswarm.offload import DriveMeter, decode

        k = min(n, self.steps - self.done)
        if k <= 0:
            return
        meter = DriveMeter(self.store)
        out = decode(self.lm.model, self.cache, self.out.last_logits, k,
                     forced=self.forced[self.done:self.done + k + 1], on_step=on_step)
        delta = meter.delta()
        self.per_drive = delta if self.per_drive is None else self.per_drive + delta
        self.out.extend(out)
        self.done += k

    def result(self, ref_pred: Sequence[int]) -> RunResult:
        from kvswarm.sparse.metrics import agreement

        t = self.cache.totals()
        n = max(1, self.done)
        wall = sum(self.out.step_s) - (self.auditor.seconds if self.auditor else 0.0)
        per_drive = self.per_drive if self.per_drive is not None else [[0, 0]] * self.store.num_drives
        read_bytes = int(sum(d[1] for d in per_drive))
        st = self.auditor.stats if self.auditor and self.auditor.stats.recall else None
        sel = self.selector
        return RunResult(
            name=self.name, selector=sel.describe() if sel else "dense", sparsity=self.sparsity if sel else 1.0,
            grouping=getattr(self.seq, "grouping", "memory"), steps=self.done, budget=self.cache.budget,
            io_ms_per_step=1e3 * t.io_s / n, select_ms_per_step=1e3 * t.select_s / n,
            read_bytes_per_step=read_bytes / n, payload_bytes_per_step=t.payload_bytes / n,
            pages_per_step=t.pages / n, entries_per_step=t.entries / n,
            read_gbps=read_bytes / t.io_s / 1e9 if t.io_s else 0.0, decode_tok_s=self.done / wall if wall > 0 else 0.0,
            recall=st.mean("recall") if st else 1.0, recall_offloaded=st.mean("recall_offloaded") if st else 1.0,
            recall_vs_oracle=st.mean("recall_vs_oracle") if st else 1.0,
            agreement=agreement(self.out.predicted, ref_pred), ppl=self.out.perplexity(), misses=t.misses,
            index_mib=(sel.index_bytes() / MiB) if sel else 0.0, build_s=self.build_s,
            per_drive_read_bytes=[int(d[1]) for d in per_drive], per_drive_read_ops=[int(d[0]) for d in per_drive],
            recall_per_layer=(st.per_layer("recall_offloaded", self.seq.layout.num_layers).round(4).tolist()
                              if st else []))


# ---- the benchmark ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvswarm.bench import swarm_bench

    p.add_argument("--mode", choices=["swarm", "decode"], default="swarm",
                   help="swarm: co-activation placement vs the paper's baselines over 1-8 drives (the full "
                        "benchmark); decode: dense restore vs selectors through the offloaded cache")
    g = p.add_argument_group("swarm mode")
    swarm_bench.add_arguments(g)
    p = p.add_argument_group("decode mode")
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 4096; quick 1024)")
    p.add_argument("--steps", type=int, default=None, help="decode steps per configuration (default 32; quick 8)")
    p.add_argument("--selectors", default="oracle,blocks,kmeans", help="registered selectors, comma-separated")
    p.add_argument("--sparsity", default="0.05,0.1,0.2", help="shares of the offloaded entries, comma-separated")
    p.add_argument("--groupings", default="contiguous", help="registered page groupings, comma-separated")
    p.add_argument("--page-bytes", type=int, default=4096, help="extent size of one page of entries")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--dense-layers", default="", help="layers always attended densely, e.g. 0")
    p.add_argument("--whole-pages", action="store_true",
                   help="attend to every entry of each page read (free context), not only the selected ones")
    p.add_argument("--drives", type=int, default=4)
    p.add_argument("--drive-mode", choices=["auto", "testbed", "temp"], default="auto",
                   help="auto: kernel-capped testbed drives when root allows, else temp dirs")
    p.add_argument("--dir", default=None, help="parent directory of the drives (default: system temp)")
    p.add_argument("--backend", choices=["threads", "uring"], default=None,
                   help="store I/O engine (default: threads for decode, uring for swarm)")
    p.add_argument("--placement", default="round_robin")
    p.add_argument("--source", default="pydoc", help="corpus source of the prompt: pydoc, man, licenses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--chunk", type=int, default=4,
                   help="steps per configuration per round; configurations take turns round by round")
    p.add_argument("--quick", action="store_true",
                   help="reduced run: a few minutes (decode: 1K-token prompt, 8 steps; swarm: see swarm_bench)")
    p.add_argument("--json", default=None, help="write results (with a 'summary' of numbers) here; plot beside it")


def _parse(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else FULL
    return {"tokens": args.tokens or base["tokens"], "steps": args.steps or base["steps"],
            "selectors": [s for s in args.selectors.split(",") if s],
            "sparsity": [float(x) for x in args.sparsity.split(",") if x],
            "groupings": [g for g in args.groupings.split(",") if g],
            "dense_layers": [int(x) for x in args.dense_layers.split(",") if x.strip()]}


def bench(args: argparse.Namespace, console, lm=None) -> dict:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvswarm import corpus, testbed
    from kvswarm.model import load_default_model
    from kvswarm.offload import StoreSequence, decode, prefill
    from kvswarm.sparse import make_selector
    from kvswarm.sparse.base import small_ops
    from kvswarm.sparse.metrics import QualityAuditor

    cfg = _parse(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    lm = lm or load_default_model()
    doc = corpus.make_document(lm.tokenizer, cfg["tokens"], args.seed, args.source, chat=False,
                               holdout=cfg["steps"] + 1)
    forced = list(doc.continuation_ids)
    console.print(f"model {lm.model_id} ({lm.layout.dtype} KV, {lm.layout.entry_bytes} B/entry), "
                  f"{torch.get_num_threads()} threads; prompt {len(doc)} tokens of {doc.source} "
                  f"({', '.join(doc.titles[:3])}...), {cfg['steps']} teacher-forced steps on the held-out text")
    pf = prefill(lm.model, doc.prompt_ids)
    console.print(f"prefill: {pf.seconds:.1f} s ({len(doc) / pf.seconds:.0f} tok/s)")
    kv = pf.kv()
    need = store_bytes_needed(lm.layout, len(doc), args.page_bytes) * len(cfg["groupings"])
    out: dict = {"config": cfg | {"page_bytes": args.page_bytes, "sinks": args.sinks, "window": args.window,
                                  "whole_pages": args.whole_pages,
                                  "drives": args.drives, "backend": args.backend, "placement": args.placement,
                                  "source": doc.source, "titles": list(doc.titles), "seed": args.seed,
                                  "model": lm.model_id, "kv_dtype": lm.layout.dtype,
                                  "threads": torch.get_num_threads()},
                 "prefill_s": pf.seconds, "runs": []}
    with testbed.drives(args.drives, args.drive_mode, need // args.drives + (64 << 20), args.dir) as drives:
        console.print(f"drives: {drives.describe()}")
        out["drives"] = drives.info()
        store = drives.open_store(backend=args.backend,
                                  placement=args.placement)
        try:
            configs: list[ConfigRun] = []
            for grouping in cfg["groupings"]:
                t0 = time.perf_counter()
                seq = StoreSequence.create(store, kv, doc.prompt_ids, lm.layout, sinks=args.sinks,
                                           window=args.window, page_bytes=args.page_bytes, grouping=grouping)
                wsec = time.perf_counter() - t0
                wbytes = sum(d.bytes[1] for d in store.drive_stats)
                console.print(f"offload ({seq.grouping} grouping): {seq.object_count()} pages of "
                              f"{seq.tables[0].pages[0].size} entries over {args.drives} drives in {wsec:.1f} s "
                              f"({wbytes / wsec / 1e9:.2f} GB/s written so far)")
                out.setdefault("offload", {})[seq.grouping] = {"seconds": wsec, "pages": seq.object_count()}
                auditor = QualityAuditor(seq)
                suffix = f"/{seq.grouping}" if len(cfg["groupings"]) > 1 else ""
                if not configs:
                    configs.append(ConfigRun(lm, seq, store, forced, pf.logits, name="dense", mode="dense"))
                for name in cfg["selectors"]:
                    sel = make_selector(name)
                    sel.bind(seq)
                    t0 = time.perf_counter()
                    with small_ops():
                        for layer in range(lm.layout.num_layers):
                            sel.build(layer, seq.offloaded_keys(layer), seq.geometry.offloaded)
                    build_s = time.perf_counter() - t0
                    for sp in cfg["sparsity"]:
                        configs.append(ConfigRun(lm, seq, store, forced, pf.logits, name=f"{name}@{sp:g}{suffix}",
                                                 mode="sparse", selector=sel, sparsity=sp, auditor=auditor.fork(),
                                                 dense_layers=cfg["dense_layers"], whole_pages=args.whole_pages,
                                                 build_s=build_s))
            # The model's own decode, KV in memory: the quality reference (after offloading, which
            # reads the prefill KV this decode extends).
            ref = decode(lm.model, pf.cache, pf.logits, len(forced) - 1, forced=forced)
            out["reference"] = {"ppl": ref.perplexity(), "tok_s": ref.tokens_per_s}
            steps = len(forced) - 1
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as prog:
                task = prog.add_task(f"{len(configs)} configurations, rounds of {args.chunk} steps",
                                     total=steps * len(configs))
                for r in range(-(-steps // args.chunk)):
                    k = r % len(configs)  # rotate the order: no configuration always runs first
                    for c in configs[k:] + configs[:k]:
                        c.advance(args.chunk, on_step=lambda i: prog.advance(task))
            runs = [c.result(ref.predicted) for c in configs]
        finally:
            out["store"] = store.stats()
            store.close()
    out["runs"] = [asdict(r) for r in runs]
    out["summary"] = summarize(runs, ref.perplexity())
    out["seconds"] = time.perf_counter() - t_start
    out["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return out


def summarize(runs: Sequence[RunResult], ref_ppl: float) -> dict[str, float]:
    dense = next(r for r in runs if r.selector == "dense")
    s: dict[str, float] = {"reference_ppl": ref_ppl}
    for r in runs:
        k = r.name.replace("@", "_").replace("/", "_").replace(".", "")
        s |= {f"{k}_io_ms_per_step": r.io_ms_per_step, f"{k}_read_mib_per_step": r.read_bytes_per_step / MiB,
              f"{k}_read_gbps": r.read_gbps, f"{k}_pages_per_step": r.pages_per_step,
              f"{k}_recall": r.recall, f"{k}_recall_offloaded": r.recall_offloaded,
              f"{k}_agreement": r.agreement, f"{k}_ppl_diff": r.ppl - ref_ppl, f"{k}_decode_tok_s": r.decode_tok_s}
        if r is not dense:
            s[f"{k}_io_speedup"] = dense.io_ms_per_step / r.io_ms_per_step if r.io_ms_per_step else 0.0
            s[f"{k}_bytes_reduction"] = dense.read_bytes_per_step / r.read_bytes_per_step \
                if r.read_bytes_per_step else 0.0
            s[f"{k}_select_ms_per_step"] = r.select_ms_per_step
            s[f"{k}_recall_vs_oracle"] = r.recall_vs_oracle
    s["dense_exact"] = float(dense.agreement == 1.0 and abs(dense.ppl - ref_ppl) < 1e-9)
    return s


def print_table(results: dict, console) -> None:
    from rich.table import Table

    runs = [RunResult(**r) for r in results["runs"]]
    dense = next(r for r in runs if r.selector == "dense")
    t = Table(title=f"sparse decode from offloaded KV: {results['config']['tokens']}-token prompt, "
                    f"{results['config']['steps']} steps, {results['config']['drives']} drives "
                    f"(ratios: dense / configuration)")
    t.add_column("configuration", no_wrap=True)
    for col in ("entries /step", "pages /step", "MiB /step", "I/O ms /step", "I/O x", "bytes x", "GB/s",
                "select ms", "recall", "recall off", "vs oracle", "agree", "Δppl", "tok/s"):
        t.add_column(col, justify="right")
    ref_ppl = results["reference"]["ppl"]
    for r in runs:
        t.add_row(r.name, f"{r.entries_per_step:.0f}", f"{r.pages_per_step:.0f}",
                  f"{r.read_bytes_per_step / MiB:.1f}", f"{r.io_ms_per_step:.0f}",
                  f"{dense.io_ms_per_step / r.io_ms_per_step:.1f}" if r.io_ms_per_step else "-",
                  f"{dense.read_bytes_per_step / r.read_bytes_per_step:.1f}" if r.read_bytes_per_step else "-",
                  f"{r.read_gbps:.2f}", f"{r.select_ms_per_step:.0f}", f"{r.recall:.3f}",
                  f"{r.recall_offloaded:.3f}", f"{r.recall_vs_oracle:.3f}", f"{r.agreement:.3f}",
                  f"{r.ppl - ref_ppl:+.3f}", f"{r.decode_tok_s:.2f}")
    console.print(t)
    s = results["summary"]
    console.print(f"reference (KV in memory): ppl {ref_ppl:.3f}, {results['reference']['tok_s']:.2f} tok/s; "
                  f"dense restore exact: {'yes' if s['dense_exact'] else 'NO'}")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = [RunResult(**r) for r in results["runs"]]
    dense = next(r for r in runs if r.selector == "dense")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for sel in dict.fromkeys(r.selector for r in runs if r is not dense):
        rs = sorted((r for r in runs if r.selector == sel), key=lambda r: r.sparsity)
        a.plot([100 * r.sparsity for r in rs], [r.io_ms_per_step for r in rs], "o-", label=sel)
        b.plot([r.read_bytes_per_step / MiB for r in rs], [r.recall_offloaded for r in rs], "o-", label=sel)
    a.axhline(dense.io_ms_per_step, color="k", ls="--", label="dense restore")
    b.plot([dense.read_bytes_per_step / MiB], [1.0], "ks", label="dense restore")
    a.set(xlabel="entries selected (% of offloaded)", ylabel="I/O ms per decode step (log)", yscale="log",
          title="I/O time per step")
    b.set(xlabel="MiB read per decode step", ylabel="attention recall (offloaded entries)", xscale="log",
          title="quality vs bytes")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    b.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    b.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    emu = results["drives"].get("emulation")
    fig.suptitle(f"kvswarm bench sparse: {results['config']['tokens']}-token prompt, {results['config']['steps']} "
                 f"steps, {results['config']['drives']} drives ({'uncapped' if emu == 'none' else emu + ' caps'})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace, lm=None) -> int:
    """``lm``: an already loaded model (tests); default: the embedded SmolLM2."""
    from rich.console import Console

    if args.mode == "swarm":
        from kvswarm.bench import swarm_bench

        return swarm_bench.run(args, lm)
    args.backend = args.backend or "threads"
    console = Console()
    if not console.is_terminal:  # logs and CI: keep the wide tables readable
        console = Console(width=160)
    results = bench(args, console, lm)
    print_table(results, console)
    console.print(f"{results['seconds']:.0f} s in all")
    if args.json:
        write_json(args.json, results)
        png = os.path.splitext(args.json)[0] + ".png"
        plot(results, png)
        console.print(f"wrote {args.json} and {png}")
    return 0 if results["summary"]["dense_exact"] else 1
