"""Scale projection: sparse-decode read throughput from 1 to 64 drives, and where the host link binds.

Each decode step of ``--batch`` sequences reads ``--sparse-fraction`` of each one's
``--context``-token KV cache as co-activation clusters of ``--cluster-tokens`` tokens, layer
by layer (two layers in flight), from N simulated drives placed by the store's own
placement strategies.  Every layer reads the same amount, so ``--sim-layers`` layers of
each step are simulated (steady state) and the step time is scaled to all layers.
Swarm (arXiv 2603.17803) reports 37.67 GB/s from 8 SSDs; ``--swarm`` adds a run with the
per-drive rate set to that figure / 8, to compare shapes on equal footing.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvswarm.planner.report import console as make_console
from kvswarm.planner.report import new_figure, save_figure, write_outputs

HELP = "project sparse-decode read throughput for 1-64 drives; find where the host link binds"
SWARM_8_GBPS = 37.67  # Swarm, arXiv 2603.17803: 8 SSDs


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvswarm.planner.cli import _ints, _names, add_model_arguments

    add_model_arguments(p)
    p.add_argument("--drive", default="pm9a3", help="drive catalog key (default %(default)s)")
    p.add_argument("--drives", type=_ints, default=[1, 2, 4, 8, 16, 32, 64],
                   help="drive counts (default 1,2,4,8,16,32,64)")
    p.add_argument("--links", type=_names, help="host-link catalog keys (default: every link in the catalog)")
    p.add_argument("--placements", type=_names, default=["round_robin", "hash"],
                   help="store placement strategies to compare (default round_robin,hash)")
    p.add_argument("--context", type=int, default=32768, help="context tokens (default %(default)s)")
    p.add_argument("--sparse-fraction", type=float, default=0.1, help="share of the context read per step "
                   "(default %(default)s)")
    p.add_argument("--cluster-tokens", type=int, default=16, help="tokens per cluster read (default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences decoded together (default %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="decode steps simulated per point (default %(default)s)")
    p.add_argument("--sim-layers", type=int, default=4, help="layers simulated per step (default %(default)s)")
    p.add_argument("--swarm", action="store_true", help="also run with the per-drive read rate set to Swarm's "
                   f"{SWARM_8_GBPS} GB/s / 8")
    p.add_argument("--plot", metavar="PNG", help="plot path (default: next to --json)")


def project(drive, link, n: int, layout, reads_per_layer: int, cluster_tokens: int, steps: int, sim_layers: int,
            placement: str) -> dict:
    """Simulate ``steps`` sparse decode steps on ``n`` drives behind ``link``; throughput and utilisation."""
    from kvswarm.sim.replay import Request, replay
    from kvswarm.sim.system import SimStore, SystemModel

    size = cluster_tokens * layout.entry_bytes
    store = SimStore(SystemModel([drive] * n, capacity_per_drive=1 << 50, host_link=link,
                                 engine_depth=drive.queue_depth, placement=placement, coalesce=True))
    sim_layers = min(sim_layers, layout.num_layers)
    layers = [[b"L%d:%d" % (layer, i) for i in range(reads_per_layer)] for layer in range(sim_layers)]
    for keys in layers:
        store.preload([(k, size) for k in keys])
    stream = [Request("get", tuple(keys)) for _ in range(steps) for keys in layers]
    r = replay(store, stream, concurrency=2)
    util = store.utilisation()
    drives = [v for k, v in util.items() if k.startswith("drive")]
    return {"drives": n, "gbps": r["throughput_Bps"] / 1e9,
            "step_s": r["elapsed_s"] / steps * layout.num_layers / sim_layers,
            "host_link_util": util.get("host_link", 0.0), "drive_util_mean": sum(drives) / len(drives),
            "drive_util_max": max(drives)}


def run(args: argparse.Namespace) -> int:
    console = make_console()
    try:
        return _run(args, console)
    except (ValueError, OSError) as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    from kvswarm.placement import make_placement
    from kvswarm.planner.hardware import load_catalog
    from kvswarm.planner.models import resolve_model

    cat = load_catalog(args.catalog)
    model = resolve_model(args.model, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                          q_heads=args.q_heads, params_b=args.params_b, dtype=args.dtype)
    if min(args.context, args.cluster_tokens, args.steps, args.batch, args.sim_layers) <= 0 \
            or not 0 < args.sparse_fraction <= 1:
        raise ValueError("--context, --cluster-tokens, --batch, --steps and --sim-layers must be positive, "
                         "--sparse-fraction in (0, 1]")
    if not args.drives or min(args.drives) < 1:
        raise ValueError("--drives needs counts >= 1")
    for p in args.placements:
        make_placement(p)
    dt = cat.get("drives", args.drive)
    links = [cat.get("links", k) for k in (args.links or list(cat.links))]
    variants = [(dt.key, dt.model())]
    if args.swarm:
        variants.append((f"{dt.key}@swarm", dt.model().scaled(read_bw=SWARM_8_GBPS / 8 * 1e9)))
    layout = model.layout()
    per_layer = max(1, int(args.batch * args.context * args.sparse_fraction / args.cluster_tokens))
    console.print(f"{model.name}: {args.batch} sequences x {args.context} tokens, {args.sparse_fraction:.0%} read per "
                  f"step as {args.cluster_tokens}-token clusters of "
                  f"{args.cluster_tokens * layout.entry_bytes / 1024:.0f} KiB: {per_layer} reads per layer, "
                  f"{layout.num_layers} layers ({min(args.sim_layers, layout.num_layers)} simulated per step)")
    rows, series = [], {}
    for vname, dm in variants:
        for link in links:
            for placement in args.placements:
                pts = [project(dm, link.model(), n, layout, per_layer, args.cluster_tokens, args.steps,
                               args.sim_layers, placement) for n in sorted(set(args.drives))]
                base = pts[0]["gbps"] / pts[0]["drives"]
                knee = next((p["drives"] for p in pts if p["gbps"] < 0.9 * base * p["drives"]), None)
                bound = next((p["drives"] for p in pts if p["host_link_util"] > 0.9), None)
                name = f"{vname} / {link.key} / {placement}"
                series[name] = {"drive": vname, "link": link.key, "link_gbps": link.model().bandwidth / 1e9,
                                "placement": placement, "points": pts, "knee_drives": knee,
                                "link_bound_from": bound}
                rows.append(name)
    t = Table(title="Projected sparse-decode read throughput (GB/s) vs drives")
    t.add_column("drive / host link / placement")
    ns = sorted(set(args.drives))
    for n in ns:
        t.add_column(str(n), justify="right")
    t.add_column("scales to", justify="right")
    t.add_column("link bound from", justify="right")
    for name in rows:
        s = series[name]
        t.add_row(name, *[f"{p['gbps']:.1f}" for p in s["points"]],
                  f"<{s['knee_drives']}" if s["knee_drives"] else f">={ns[-1]}",
                  f"{s['link_bound_from']} ({s['link_gbps']:.0f} GB/s)" if s["link_bound_from"] else "-")
    console.print(t)
    console.print(f"Swarm reports {SWARM_8_GBPS} GB/s at 8 SSDs ({SWARM_8_GBPS / 8:.2f} GB/s per drive); "
                  "'scales to' = first count below 90% of linear scaling; 'link bound' = host link > 90% busy.")
    summary = {}
    for name, s in series.items():
        key = name.replace(" / ", "_").replace("@", "_")
        at = {p["drives"]: p["gbps"] for p in s["points"]}
        for n in (8, ns[-1]):
            if n in at:
                summary[f"{key}_gbps_at_{n}"] = at[n]
        summary[f"{key}_link_bound_from"] = s["link_bound_from"] or math.nan
    doc = {"context": {"model": model.name, "drive": dt.key, "context_tokens": args.context, "batch": args.batch,
                       "sparse_fraction": args.sparse_fraction, "cluster_tokens": args.cluster_tokens,
                       "swarm_8_gbps": SWARM_8_GBPS}, "summary": summary, "series": series}
    plot = args.plot or (str(Path(args.json).with_suffix("")) + "_scale.png" if args.json else None)
    write_outputs(console, doc, args.json, plot,
                  lambda path: _plot(series, path, f"{model.name}: sparse decode reads vs drives"))
    return 0


def _plot(series: dict, path: str, title: str) -> None:
    fig, ax = new_figure(path, figsize=(8, 5.5))
    # colour: host link; line: placement; marker: drive variant
    links = sorted({s["link"] for s in series.values()})
    drives = sorted({s["drive"] for s in series.values()})
    placements = sorted({s["placement"] for s in series.values()})
    for name, s in series.items():
        xs = [p["drives"] for p in s["points"]]
        ax.plot(xs, [p["gbps"] for p in s["points"]], ms=4, label=name, color=f"C{links.index(s['link'])}",
                linestyle=["-", "--", ":", "-."][placements.index(s["placement"]) % 4],
                marker="os^v"[drives.index(s["drive"]) % 4])
    ax.scatter([8], [SWARM_8_GBPS], marker="*", s=200, c="k", zorder=5, label="Swarm, 8 SSDs (reported)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("drives")
    ax.set_ylabel("read throughput (GB/s)")
    save_figure(fig, ax, path, title, legend_size=7)
