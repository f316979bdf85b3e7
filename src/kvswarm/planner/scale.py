"""Scale projection: sparse-decode read throughput from 1 to 64 drives, and where the host link binds.

Each decode step of ``--batch`` sequences reads ``--sparse-fraction`` of each one's
``--context``-token KV cache as co-activation clusters of ``--cluster-tokens`` tokens, layer
by layer (two layers in flight), from N simulated drives placed by the store's own
placement strategies.  Every layer reads the same amount, so ``--sim-layers`` layers of
each step are simulated (steady state) and the step time is scaled to all layers.
Swarm (arXiv 2603.17803) reports 37.67 GB/s from 8 SSDs.  ``--swarm`` adds kvswarm's own
answer for that hardware: PM9A3 drives as their datasheet in the hardware catalog gives them,
and the store's host CPU per op and per byte (measured on this machine as ``plan validate``
measures it, or given with ``--cpu-per-op-us`` / ``--cpu-per-byte-ns``) paid on one serial CPU.
The paper's figure is printed beside it for comparison and is never an input.

Cores per drive set: the store's host CPU per op and per byte, measured here for each read path
(``--cpu-paths``: the Python ``uring`` engine, whose work holds the GIL, and the ``native`` batch
path), turns each drive count's projected throughput into the CPU cores serving it needs; where a
Python path needs more than one, the GIL, not the drives, binds a store process.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvswarm.planner.hostcost import HostCost
from kvswarm.planner.report import console as make_console
from kvswarm.planner.report import new_figure, print_error, save_figure, write_outputs

HELP = "project sparse-decode read throughput for 1-64 drives; find where the host link binds"
SWARM_8_GBPS = 37.67  # Swarm, arXiv 2603.17803: 8 SSDs (a reference to compare with, never an input)
SWARM_DRIVE = "pm9a3"  # the SSD of Swarm's 8-drive figure


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvswarm.planner.args import add_model_arguments, ints, names

    add_model_arguments(p)
    p.add_argument("--drive", default="pm9a3", help="drive catalog key (default %(default)s)")
    p.add_argument("--drives", type=ints, default=[1, 2, 4, 8, 16, 32, 64],
                   help="drive counts (default 1,2,4,8,16,32,64)")
    p.add_argument("--links", type=names, help="host-link catalog keys (default: every link in the catalog)")
    p.add_argument("--placements", type=names, default=["round_robin", "hash"],
                   help="store placement strategies to compare (default round_robin,hash)")
    p.add_argument("--context", type=int, default=32768, help="context tokens (default %(default)s)")
    p.add_argument("--sparse-fraction", type=float, default=0.1, help="share of the context read per step "
                   "(default %(default)s)")
    p.add_argument("--cluster-tokens", type=int, default=16, help="tokens per cluster read (default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences decoded together (default %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="decode steps simulated per point (default %(default)s)")
    p.add_argument("--sim-layers", type=int, default=4, help="layers simulated per step (default %(default)s)")
    p.add_argument("--swarm", action="store_true", help="also project PM9A3 drives from their datasheet with the "
                   f"store's host CPU cost, beside Swarm's reported {SWARM_8_GBPS} GB/s at 8 SSDs")
    p.add_argument("--cpu-per-op-us", type=float, help="--swarm: host CPU per extent read, us (default: measured "
                   "here, on a memory-backed drive)")
    p.add_argument("--cpu-per-byte-ns", type=float, help="--swarm: host CPU per payload byte, ns (default: the "
                   "checksum measured here)")
    p.add_argument("--cpu-paths", type=names, default=None,
                   help="read paths whose measured host CPU gives the cores each drive set needs, of threads, "
                        "uring, native (default: uring, and native where available; '' for none)")
    p.add_argument("--plot", metavar="PNG", help="plot path (default: next to --json)")


def project(drive, link, n: int, layout, reads_per_layer: int, cluster_tokens: int, steps: int, sim_layers: int,
            placement: str, cpu: HostCost | None = None) -> dict:
    """Simulate ``steps`` sparse decode steps on ``n`` drives behind ``link``; throughput and utilisation.
    ``cpu``: the store's host cost, paid per extent and per byte on one serial CPU (none: drives only)."""
    from kvswarm.sim.replay import Request, replay
    from kvswarm.sim.system import SimStore, SystemModel

    size = cluster_tokens * layout.entry_bytes
    store = SimStore(SystemModel([drive] * n, capacity_per_drive=1 << 50, host_link=link,
                                 engine_depth=drive.queue_depth, placement=placement, coalesce=True,
                                 cpu_per_op=cpu.cpu_per_op if cpu else 0.0,
                                 cpu_per_byte=cpu.cpu_per_byte if cpu else 0.0))
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
            "host_link_util": util.get("host_link", 0.0), "cpu_util": util.get("cpu", 0.0),
            "drive_util_mean": sum(drives) / len(drives),
            "drive_util_max": max(drives)}


def run(args: argparse.Namespace) -> int:
    console = make_console()
    try:
        return _run(args, console)
    except (ValueError, OSError) as e:
        print_error("plan scale", e)
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
    variants: list[tuple[str, object, HostCost | None]] = [(dt.key, dt.model(), None)]
    cpu = None
    if args.swarm:
        cpu = host_cost(args)
        swarm_drive = cat.get("drives", SWARM_DRIVE)
        if dt.key != SWARM_DRIVE:
            variants.append((SWARM_DRIVE, swarm_drive.model(), None))
        variants.append((f"{SWARM_DRIVE}+cpu", swarm_drive.model(), cpu))
    layout = model.layout()
    per_layer = max(1, int(args.batch * args.context * args.sparse_fraction / args.cluster_tokens))
    console.print(f"{model.name}: {args.batch} sequences x {args.context} tokens, {args.sparse_fraction:.0%} read per "
                  f"step as {args.cluster_tokens}-token clusters of "
                  f"{args.cluster_tokens * layout.entry_bytes / 1024:.0f} KiB: {per_layer} reads per layer, "
                  f"{layout.num_layers} layers ({min(args.sim_layers, layout.num_layers)} simulated per step)")
    rows, series = [], {}
    for vname, dm, vcpu in variants:
        for link in links:
            for placement in args.placements:
                pts = [project(dm, link.model(), n, layout, per_layer, args.cluster_tokens, args.steps,
                               args.sim_layers, placement, vcpu) for n in sorted(set(args.drives))]
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
    console.print("'scales to' = first count below 90% of linear scaling; 'link bound' = host link > 90% busy.")
    summary = {}
    paths = args.cpu_paths if args.cpu_paths is not None else default_cpu_paths()
    if paths:
        summary |= cores_table(console, series, dt.key, ns, args.cluster_tokens * layout.entry_bytes, paths)
    if cpu is not None:
        summary |= swarm_summary(series, cpu)
        console.print(f"8 x {SWARM_DRIVE} from the datasheet: {summary['swarm_8_device_only_gbps']:.1f} GB/s for the "
                      f"drives alone; with the store's host CPU ({cpu.cpu_per_op * 1e6:.1f} us/op + "
                      f"{cpu.cpu_per_byte * 1e9:.3f} ns/B on one CPU) {summary['swarm_8_modelled_gbps']:.1f} GB/s "
                      f"(CPU busy {summary['swarm_8_cpu_util']:.0%}); Swarm reports {SWARM_8_GBPS} GB/s.")
    for name, s in series.items():
        key = name.replace(" / ", "_").replace("@", "_")
        at = {p["drives"]: p["gbps"] for p in s["points"]}
        for n in (8, ns[-1]):
            if n in at:
                summary[f"{key}_gbps_at_{n}"] = at[n]
        summary[f"{key}_link_bound_from"] = s["link_bound_from"] or math.nan
    doc = {"context": {"model": model.name, "drive": dt.key, "context_tokens": args.context, "batch": args.batch,
                       "sparse_fraction": args.sparse_fraction, "cluster_tokens": args.cluster_tokens,
                       "swarm_8_reported_gbps": SWARM_8_GBPS}, "summary": summary, "series": series}
    plot = args.plot or (str(Path(args.json).with_suffix("")) + "_scale.png" if args.json else None)
    write_outputs(console, doc, args.json, plot,
                  lambda path: _plot(series, path, f"{model.name}: sparse decode reads vs drives"))
    return 0


def default_cpu_paths() -> list[str]:
    from kvswarm.io import native

    return ["uring"] + (["native"] if native.enabled() else [])


def cores_table(console: Console, series: dict, drive: str, ns: list[int], size: int, paths: list[str]) -> dict:
    """Cores each drive count needs on each read path: its best projected throughput (drives alone, over
    the links and placements) at ``size``-byte reads, times the host CPU per op and per byte measured
    here for that path."""
    from kvswarm.planner.hostcost import PATHS, measure_host_cost

    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise ValueError(f"--cpu-paths are some of {', '.join(PATHS)}, not {', '.join(bad)}")
    best = {n: max(p["gbps"] for s in series.values() if s["drive"] == drive for p in s["points"] if p["drives"] == n)
            for n in ns}
    t = Table(title=f"Host CPU cores needed at the projected throughput ({size // 1024} KiB reads, {drive})")
    t.add_column("read path (CPU per op + per byte, measured here)")
    for n in ns:
        t.add_column(f"{n} ({best[n]:.0f} GB/s)", justify="right")
    out: dict = {}
    for path in paths:
        cost = measure_host_cost(path, quick=True)
        cores = {n: cost.cores(best[n] * 1e9 / size, best[n] * 1e9) for n in ns}
        gil = path != "native"
        t.add_row(f"{path}: {cost.cpu_per_op * 1e6:.1f} us + {cost.cpu_per_byte * 1e9:.3f} ns/B"
                  + (" (GIL: 1 core per process)" if gil else ""),
                  *[(f"[red]{c:.1f}[/]" if gil and c > 1 else f"{c:.1f}") for c in cores.values()])
        out |= {f"cpu_per_op_us_{path}": cost.cpu_per_op * 1e6, f"cpu_per_byte_ns_{path}": cost.cpu_per_byte * 1e9}
        out |= {f"cores_{path}_at_{n}": c for n, c in cores.items()}
    console.print(t)
    console.print("cores = reads/s x CPU per op + bytes/s x CPU per byte; a Python path above 1 (red) is bound by "
                  "the GIL of its store process, not by its drives.")
    return out


def host_cost(args: argparse.Namespace) -> HostCost:
    """The store's host CPU cost: as given, or measured here the way ``plan validate`` does."""
    from kvswarm.planner.hostcost import measure_host_cost

    measured = measure_host_cost("uring", quick=True) \
        if args.cpu_per_op_us is None or args.cpu_per_byte_ns is None else None
    per_op = args.cpu_per_op_us * 1e-6 if args.cpu_per_op_us is not None else measured.cpu_per_op
    per_byte = args.cpu_per_byte_ns * 1e-9 if args.cpu_per_byte_ns is not None else measured.cpu_per_byte
    if per_op < 0 or per_byte < 0:
        raise ValueError("--cpu-per-op-us and --cpu-per-byte-ns must be >= 0")
    return HostCost(per_op, per_byte)


def swarm_summary(series: dict, cpu: HostCost) -> dict:
    """8 drives of Swarm's SSD from its datasheet: the best link and placement, with and without the
    store's host CPU cost, beside the paper's figure."""

    def best(drive: str) -> dict:
        pts = [p for s in series.values() if s["drive"] == drive for p in s["points"] if p["drives"] == 8]
        if not pts:
            raise ValueError("--swarm needs 8 in --drives")
        return max(pts, key=lambda p: p["gbps"])

    with_cpu, device = best(f"{SWARM_DRIVE}+cpu"), best(SWARM_DRIVE)
    return {"swarm_8_modelled_gbps": with_cpu["gbps"], "swarm_8_cpu_util": with_cpu["cpu_util"],
           "swarm_8_reported_gbps": SWARM_8_GBPS, "swarm_8_modelled_vs_reported": with_cpu["gbps"] / SWARM_8_GBPS,
           "cpu_per_op_us": cpu.cpu_per_op * 1e6, "cpu_per_byte_ns": cpu.cpu_per_byte * 1e9,
           "swarm_8_device_only_gbps": device["gbps"]}


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
