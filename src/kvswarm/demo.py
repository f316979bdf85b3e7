"""The real model decoding from KV offloaded to N drives, with a sparse selector.

Loads SmolLM2-135M-Instruct, wraps a 4K-token real text (Python's reference docs) in a chat
prompt, prefills it once, offloads its KV entries to N drives (kernel-capped emulated drives
from kvswarm.testbed when root allows, else temp directories), then generates with a sparse
selector reading ~10% of the offloaded entries per step and layer.  The model's own decode
with the KV in memory answers the same prompt first (the dense reference); the sparse run
then replays that answer token by token and is scored on whether it would have chosen the
same next token (``--free``: it generates on its own instead).  Prints tokens/s, I/O time
and bytes per step, per-drive bytes/ops/latency, and quality against dense.
"""

from __future__ import annotations

import argparse
import json
import os
import time

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 4096; quick 512)")
    p.add_argument("--steps", type=int, default=None, help="tokens to generate (default 32; quick 8)")
    p.add_argument("--drives", type=int, default=4)
    p.add_argument("--drive-mode", choices=["auto", "testbed", "temp"], default="auto",
                   help="auto: kernel-capped testbed drives when root allows, else temp dirs")
    p.add_argument("--dir", default=None, help="parent directory of the drives (default: system temp)")
    p.add_argument("--selector", default="kmeans", help="sparse selector: oracle, blocks, kmeans, ...")
    p.add_argument("--sparsity", type=float, default=0.1, help="share of offloaded entries read per step")
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--source", default="pydoc", help="corpus source: pydoc, man, licenses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--backend", choices=["threads", "uring"], default="threads")
    p.add_argument("--free", action="store_true",
                   help="let the sparse run generate freely (default: replay the dense answer, score next tokens)")
    p.add_argument("--quick", action="store_true", help="small prompt and few steps (CI)")
    p.add_argument("--json", default=None, help="write the figures (a 'summary' of numbers) to this path")


def run(args: argparse.Namespace, lm=None) -> int:
    """``lm``: an already loaded model (tests); default: the embedded SmolLM2."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from kvswarm import corpus
    from kvswarm.bench.sparse_bench import open_drives, store_bytes_needed
    from kvswarm.model import load_default_model
    from kvswarm.offload import DriveMeter, OffloadedKVCache, StoreSequence, decode, make_recompute, prefill
    from kvswarm.sparse import make_selector
    from kvswarm.sparse.metrics import QualityAuditor, agreement, prefix_match

    console = Console()
    if not console.is_terminal:  # logs and CI: keep the wide tables readable
        console = Console(width=160)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = args.tokens or (512 if args.quick else 4096)
    steps = args.steps or (8 if args.quick else 32)
    t_all = time.perf_counter()
    t0 = time.perf_counter()
    lm = lm or load_default_model()
    console.print(f"[bold]model[/] {lm.model_id}: {lm.layout.num_layers} layers, {lm.layout.num_kv_heads} KV heads, "
                  f"{lm.layout.dtype} KV ({lm.layout.entry_bytes} B per token and layer), loaded in "
                  f"{time.perf_counter() - t0:.1f} s, {torch.get_num_threads()} threads")
    doc = corpus.make_document(lm.tokenizer, tokens, args.seed, args.source, chat=True)
    pf = prefill(lm.model, doc.prompt_ids)
    console.print(f"[bold]prompt[/] {len(doc)} tokens ({doc.source}: {', '.join(doc.titles[:3])}...), "
                  f"prefill {pf.seconds:.1f} s ({len(doc) / pf.seconds:.0f} tok/s)")
    need = store_bytes_needed(lm.layout, len(doc), args.page_bytes)
    summary: dict[str, float] = {}
    with open_drives(args.drives, args.drive_mode, need // args.drives + (32 << 20), args.dir) as drives:
        console.print(f"[bold]drives[/] {drives.describe}")
        store = drives.open_store(need // args.drives + (32 << 20), backend=args.backend)
        try:
            t0 = time.perf_counter()
            seq = StoreSequence.create(store, pf.kv(), doc.prompt_ids, lm.layout, window=args.window,
                                       page_bytes=args.page_bytes)
            wsec = time.perf_counter() - t0
            written = sum(d.bytes[1] for d in store.drive_stats)
            g = seq.geometry
            console.print(f"[bold]offload[/] {len(g.offloaded)} of {g.prompt_len} tokens x {lm.layout.num_layers} "
                          f"layers -> {seq.object_count()} pages over {args.drives} drives, {written / MiB:.0f} MiB in "
                          f"{wsec:.1f} s ({written / wsec / 1e6:.0f} MB/s); {g.sinks} sink + {g.window} window "
                          f"tokens stay in DRAM")
            # The model's own decode (KV in memory): the reference.
            ref = decode(lm.model, pf.cache, pf.logits, steps)
            sel = make_selector(args.selector)
            t0 = time.perf_counter()
            auditor = QualityAuditor(seq)
            cache = OffloadedKVCache(seq, "sparse", sel, sparsity=args.sparsity, observers=[auditor],
                                     recompute=make_recompute(lm.model, doc.prompt_ids))
            build_s = time.perf_counter() - t0
            meter = DriveMeter(store)
            with Progress(TextColumn("[bold]decode[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console) as prog:
                task = prog.add_task(f"{sel.describe()} @ {args.sparsity:.0%}", total=steps, rate="")

                def tick(i: int) -> None:
                    s = cache.steps[-1]
                    prog.update(task, advance=1, rate=f"I/O {1e3 * s.io_s:.0f} ms, {s.pages} pages")

                out = decode(lm.model, cache, pf.logits, steps, forced=None if args.free else ref.fed,
                             on_step=tick)
            per_drive = meter.delta()
            stats = store.stats()
        finally:
            store.close()
    t = cache.totals()
    wall = sum(out.step_s) - auditor.seconds
    tok_s = steps / wall
    n_off = len(seq.geometry.offloaded)
    dense_bytes = n_off * lm.layout.num_layers * lm.layout.entry_bytes
    console.print(f"[bold]sparse decode[/]: {tok_s:.2f} tokens/s (reference, KV in memory: {ref.tokens_per_s:.2f}); "
                  f"per step: I/O {1e3 * t.io_s / steps:.0f} ms, selection {1e3 * t.select_s / steps:.0f} ms, "
                  f"{t.pages / steps:.0f} pages, {per_drive[:, 1].sum() / steps / MiB:.2f} MiB read "
                  f"(a dense restore reads {dense_bytes / MiB:.1f} MiB of entries); budget {cache.budget} of {n_off} "
                  f"entries per layer; index {sel.index_bytes() / MiB:.1f} MiB DRAM, built in {build_s:.1f} s; "
                  f"misses {t.misses}")
    table = Table(title="drives during sparse decode")
    for col in ("drive", "read ops", "MiB read", "MiB/step", "mean lat ms", "p99 lat ms", "MB/s while reading"):
        table.add_column(col, justify="right")
    for i, d in enumerate(stats["drives"]):
        ops, nbytes = per_drive[i]
        table.add_row(str(d["drive"]), f"{ops}", f"{nbytes / MiB:.1f}", f"{nbytes / steps / MiB:.2f}",
                      f"{1e3 * d['read_lat_mean_s']:.2f}", f"{1e3 * d['read_lat_p99_s']:.2f}",
                      f"{nbytes / t.io_s / 1e6:.0f}" if t.io_s else "-")
    console.print(table)
    st = auditor.stats
    recall = (f"attention recall {st.mean('recall'):.3f} of all mass, {st.mean('recall_offloaded'):.3f} of the "
              f"offloaded entries' mass ({st.mean('recall_vs_oracle'):.3f} of the exact top-k's)")
    if args.free:
        agree = float(prefix_match(out.fed, ref.fed))
        console.print(f"[bold]quality vs dense[/]: same tokens for the first {agree:.0f} of {steps}; {recall}")
        console.print(f"[dim]dense :[/] {lm.tokenizer.decode(ref.fed)!r}")
        console.print(f"[dim]sparse:[/] {lm.tokenizer.decode(out.fed)!r}")
    else:
        agree = agreement(out.predicted, ref.predicted)
        console.print(f"[bold]quality vs dense[/]: replaying the dense answer, the sparse run picks the same next "
                      f"token at {agree:.0%} of {steps} steps; {recall}")
        console.print(f"[dim]dense answer:[/] {lm.tokenizer.decode(ref.fed)!r}")
    summary = {"prompt_tokens": float(len(doc)), "steps": float(steps), "prefill_s": pf.seconds,
               "offload_s": wsec, "tokens_per_s": tok_s, "reference_tokens_per_s": ref.tokens_per_s,
               "io_ms_per_step": 1e3 * t.io_s / steps, "select_ms_per_step": 1e3 * t.select_s / steps,
               "read_mib_per_step": float(per_drive[:, 1].sum()) / steps / MiB,
               "dense_mib_per_step": dense_bytes / MiB, "pages_per_step": t.pages / steps,
               ("prefix_match" if args.free else "agreement"): agree, "recall": st.mean("recall"),
               "recall_offloaded": st.mean("recall_offloaded"), "misses": float(t.misses),
               "seconds": time.perf_counter() - t_all}
    for i in range(len(per_drive)):
        summary[f"drive{i}_mib_per_step"] = float(per_drive[i, 1]) / steps / MiB
    console.print(f"{summary['seconds']:.0f} s in all")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "drives": drives.info, "selector": sel.describe(),
                       "sparsity": args.sparsity, "titles": list(doc.titles), "dense_text": lm.tokenizer.decode(ref.fed),
                       "sparse_text": lm.tokenizer.decode(out.fed) if args.free else None, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                      f, indent=1)
    return 0
