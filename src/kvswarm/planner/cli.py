"""Project TTFT, throughput, hit rates and cost for a workload; recommend a DRAM/SSD/HDD mix.

Inputs: a model KV layout (a preset or the layer/head numbers), a workload (a trace
file, or users/context/turns/reuse/session parameters), the hardware catalog (an
editable TOML file with a source for every figure), and a budget and/or TTFT target.
Every candidate mix is screened in closed form; the best are replayed through the
discrete-event simulator (kvswarm.sim, which uses the store's own placement code).

Subcommands: `kvswarm plan scale` (throughput from 1 to 64 drives and where the host
link binds) and `kvswarm plan validate` (simulator vs a measured multi-drive run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvswarm.planner.args import add_common, add_model_arguments, floats, ints, names
from kvswarm.planner.report import console as make_console
from kvswarm.planner.report import print_error

DEFAULT_TRACE = "shared/traces/mooncake/conversation_trace.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    add_model_arguments(parser)
    w = parser.add_argument_group("workload (a trace file, or parameters for synthetic multi-turn chats)")
    w.add_argument("--trace", metavar="PATH", help="Mooncake JSONL (timestamp, input_length, output_length, "
                   "hash_ids) or Azure LLM CSV trace; default: ../shared/traces/mooncake/conversation_trace.jsonl "
                   "when no workload parameter is given")
    w.add_argument("--block-tokens", type=int, default=512, help="tokens per KV block / trace hash (default 512)")
    w.add_argument("--users", type=int, help="synthetic: concurrently active users (sessions)")
    w.add_argument("--context", type=int, default=8192, help="synthetic: input tokens of a session's first "
                   "request (default %(default)s)")
    w.add_argument("--turns", type=int, default=4, help="synthetic: requests per session (default %(default)s)")
    w.add_argument("--reuse", type=float, default=0.25, help="synthetic: share of the first request shared by all "
                   "sessions, e.g. a system prompt (0-1, default %(default)s)")
    w.add_argument("--session-s", type=float, default=900, help="synthetic: session lifetime in s over which its "
                   "turns arrive (default %(default)s)")
    w.add_argument("--duration-s", type=float, default=3600, help="synthetic: workload length in s "
                   "(default %(default)s)")
    w.add_argument("--turn-tokens", type=int, help="synthetic: new input tokens per later turn (default context/4)")
    w.add_argument("--output-tokens", type=int, default=300, help="synthetic: output tokens per request "
                   "(default %(default)s)")
    w.add_argument("--tenants", type=int, default=1, help="replay this many independent copies of the workload at "
                   "once (scales rate and working set; default 1)")
    h = parser.add_argument_group("hardware and targets")
    h.add_argument("--gpu", default="h100", help="GPU catalog key for prefill and the host->GPU link "
                   "(default %(default)s)")
    h.add_argument("--gpus", type=int, help="prefill GPUs (default: per mix, enough to run prefill at --gpu-util)")
    h.add_argument("--gpu-util", type=float, default=0.7, help="target prefill GPU utilisation when sizing GPUs "
                   "(default %(default)s)")
    h.add_argument("--link", default="gen5_x64", help="catalog key of the host link between drive pools and "
                   "host memory (default %(default)s)")
    h.add_argument("--budget", type=float, metavar="USD", help="most the KV tier (DRAM + drives + slots) may cost")
    h.add_argument("--ttft-target", type=float, metavar="S", help="TTFT p90 the recommendation must meet")
    c = parser.add_argument_group("cluster (Mooncake Store across nodes; docs/planner.md, \"Clusters\")")
    c.add_argument("--prefill-nodes", type=int, default=1, help="prefill nodes sharing their KV; each gets the "
                   "recommended mix (default 1)")
    c.add_argument("--decode-nodes", type=int, default=0, help="decode nodes reading each request's KV over the "
                   "network (default 0: decode on the prefill node)")
    c.add_argument("--nic", metavar="KEY", help="catalog key of every node's NIC, e.g. cx7_400g (priced)")
    c.add_argument("--network-gbit", type=float, metavar="G", help="per-node network payload rate in Gbit/s, "
                   "instead of --nic (unpriced)")
    c.add_argument("--cluster-segment-gb", type=float, default=0.0, metavar="GB", help="DRAM each node lends to "
                   "the cluster pool (default 0)")
    c.add_argument("--cluster-replicas", type=int, default=1, help="copies of each block in the cluster pool "
                   "(default 1)")
    s = parser.add_argument_group("search space")
    s.add_argument("--dram-gb", type=floats, default=[0, 256, 512, 1024, 2048],
                   help="DRAM tier sizes to try, GB (default 0,256,512,1024,2048)")
    s.add_argument("--ssd-counts", type=ints, default=[1, 2, 4, 8, 16], help="SSD pool sizes (default 1,2,4,8,16)")
    s.add_argument("--hdd-counts", type=ints, default=[4, 8, 16, 32], help="HDD pool sizes (default 4,8,16,32)")
    s.add_argument("--ssd-types", type=names, help="SSD catalog keys to try (default: every SSD)")
    s.add_argument("--hdd-types", type=names, help="HDD catalog keys to try (default: every HDD)")
    s.add_argument("--finalists", type=int, default=4, help="mixes replayed in the simulator (default %(default)s)")
    s.add_argument("--sim-requests", type=int, default=1500, help="requests replayed per finalist: the trace's "
                   "last N (default %(default)s; 0 = all)")
    s.add_argument("--eviction", default="lru", help="tier eviction policy of kvswarm.tiers: lru, arc, s3fifo "
                   "(default %(default)s)")
    s.add_argument("--write-policy", default="write-through", help="tier write policy: write-through, write-back, "
                   "selective[:K] (default %(default)s)")
    s.add_argument("--demotion", default="always", help="SSD -> HDD demotion policy: always, drop, cost-aware "
                   "(default %(default)s)")
    s.add_argument("--placement", default="round_robin", help="store placement strategy used by the simulator "
                   "(default %(default)s)")
    s.add_argument("--stripe-unit", type=int, default=1 << 20, help="store stripe unit in bytes (default 1 MiB)")
    s.add_argument("--sparse-fraction", type=float, default=0.1, help="share of the context a sparse decode step "
                   "reads (decode I/O projection; default %(default)s)")
    s.add_argument("--cluster-tokens", type=int, default=16, help="tokens per co-activation cluster read "
                   "(default %(default)s)")
    parser.add_argument("--plot", metavar="PNG", help="Pareto plot path (default: next to --json, else none)")
    sub = parser.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")
    from kvswarm.planner import scale, validate

    for name, mod in (("scale", scale), ("validate", validate)):
        sp = sub.add_parser(name, help=mod.HELP, description=(mod.__doc__ or mod.HELP).strip())
        add_common(sp)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)


def default_trace() -> Path | None:
    env = os.environ.get("KVSWARM_TRACES")
    cands = [Path(env) / "mooncake/conversation_trace.jsonl"] if env else []
    here = Path.cwd()
    cands += [p / DEFAULT_TRACE for p in (here, *here.parents)]
    return next((c for c in cands if c.is_file()), None)


def load_workload(args: argparse.Namespace):
    from kvswarm.planner.workload import WorkloadError, load_trace, synthesize

    if args.block_tokens <= 0:
        raise WorkloadError("--block-tokens must be positive")
    if args.users is not None:
        if args.trace:
            raise WorkloadError("give either --trace or synthetic parameters (--users ...), not both")
        wl = synthesize(args.users, args.context, args.turns, args.reuse, args.session_s, args.duration_s,
                        args.turn_tokens, args.output_tokens, args.block_tokens)
    else:
        path = args.trace or default_trace()
        if path is None:
            raise WorkloadError("no workload: give --trace PATH or --users N (the default Mooncake trace "
                                f"{DEFAULT_TRACE} was not found above {Path.cwd()})")
        wl = load_trace(path, args.block_tokens)
    return wl.scaled(args.tenants)


def director_hits(args: argparse.Namespace, wl, model, cat, settings):
    """The finalists' tier model: None (LRU stack distances, exact for the default policies) or a
    replay through the tier director with the chosen eviction / write / demotion strategies."""
    from kvswarm.planner.hits import DirectorHits

    if (args.eviction, args.write_policy, args.demotion) == ("lru", "write-through", "always"):
        return None
    kw = {}
    if args.demotion == "cost-aware":
        from kvswarm.tiers import ComputeModel, DriveCost

        ssd = cat.get("drives", args.ssd_types[0]) if args.ssd_types else cat.by_kind("ssd")[0]
        hdd = cat.get("drives", args.hdd_types[0]) if args.hdd_types else cat.by_kind("hdd")[0]
        flops = settings.gpu.flops
        q = model.num_q_heads * model.head_dim
        # prefill_flops(n) = (2P + 2Lq) n + 2Lq n^2: the tiers' T(n) = a n + b n^2
        compute = ComputeModel((2 * model.params_b * 1e9 + 2 * model.num_layers * q) / flops,
                               2 * model.num_layers * q / flops)

        def cost(d):
            return DriveCost(d.kind, d.read_gbps * 1e3, d.write_gbps * 1e3, d.read_latency_us * 1e-6,
                             d.write_latency_us * 1e-6, d.read_iops, d.write_iops)

        kw = {"compute": compute, "tokens_per_block": wl.block_tokens,
              "block_bytes": wl.block_tokens * model.token_bytes, "ssd": cost(ssd), "capacity": cost(hdd)}
    return DirectorHits(wl, args.eviction, args.write_policy, args.demotion, kw)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "plan_command", None):
        return args._run(args)
    console = make_console()
    try:
        return _plan(args, console)
    except (ValueError, OSError) as e:  # CatalogError, WorkloadError and bad numbers are ValueErrors
        print_error("plan", e)
        return 2


def _plan(args: argparse.Namespace, console: Console) -> int:
    from kvswarm.planner.hardware import load_catalog
    from kvswarm.planner.cost import enumerate_mixes
    from kvswarm.planner.models import resolve_model
    from kvswarm.planner.project import Planner, PlanSettings
    from kvswarm.planner.report import plan_json, plot_pareto, print_cluster, print_result, write_outputs
    from kvswarm.planner.search import search

    t0 = time.perf_counter()
    cat = load_catalog(args.catalog)
    model = resolve_model(args.model, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                          q_heads=args.q_heads, params_b=args.params_b, dtype=args.dtype)
    for name, v in (("--budget", args.budget), ("--ttft-target", args.ttft_target)):
        if v is not None and v <= 0:
            raise ValueError(f"{name} must be positive, got {v:g}")
    if args.finalists < 1 or args.sim_requests < 0 or args.stripe_unit <= 0 or args.tenants < 1:
        raise ValueError("--finalists and --tenants must be >= 1, --sim-requests >= 0, --stripe-unit > 0")
    from kvswarm.planner.cluster import ClusterSpec, project_cluster

    cluster = ClusterSpec.from_args(cat, args.prefill_nodes, args.decode_nodes, args.nic, args.network_gbit,
                                    args.cluster_segment_gb, args.cluster_replicas)
    wl = load_workload(args)
    mixes = enumerate_mixes(cat, args.dram_gb, args.ssd_counts, args.hdd_counts, args.ssd_types, args.hdd_types)
    settings = PlanSettings(wl, model, cat.get("gpus", args.gpu), cat.get("links", args.link), cat, args.gpus,
                            args.gpu_util, args.stripe_unit, args.placement, args.sparse_fraction,
                            args.cluster_tokens)
    from kvswarm.placement import make_placement

    make_placement(args.placement)  # unknown names fail here, clearly
    final_hits = director_hits(args, wl, model, cat, settings)
    block_mib = wl.block_tokens * model.token_bytes / 2**20
    console.print(f"model {model.name}: {model.token_bytes / 1024:.0f} KiB KV per token, {block_mib:.0f} MiB per "
                  f"{wl.block_tokens}-token block; workload {wl.name}: {wl.requests} requests over "
                  f"{wl.duration:.0f} s, ideal hit rate {wl.ideal_hit_rate():.1%}")
    for n in wl.notes:
        console.print(f"note: {n}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        task = prog.add_task("LRU stack distances", total=len(mixes) + args.finalists + 1)
        planner = Planner(settings, final_hits=final_hits)
        prog.update(task, advance=1, description="screening mixes")

        def tick(stage: str) -> None:
            prog.update(task, advance=1, description="screening mixes" if stage == "screen"
                        else "simulating finalists")

        res = search(planner, mixes, args.budget, args.ttft_target, args.finalists, args.sim_requests or None, tick)
        prog.update(task, completed=len(mixes) + args.finalists + 1, description="done")
    ctx = {"model": model.name, "token_bytes": model.token_bytes, "block_bytes": planner.block_bytes,
           "workload": wl.name, "workload_stats": wl.stats(), "ideal_hit_rate": wl.ideal_hit_rate(),
           "capacity_95_tb": planner.hits.capacity_for(0.95) * planner.block_bytes / 1e12, "gpu": args.gpu,
           "link": args.link, "catalog": cat.path, "budget_usd": args.budget, "ttft_target_s": args.ttft_target,
           "placement": args.placement, "sim_requests": args.sim_requests, "notes": wl.notes,
           "tier_policy": final_hits.policy if final_hits else "lru, write-through, demotion always (closed form)",
           "seconds": time.perf_counter() - t0}
    print_result(console, res, ctx)
    doc = plan_json(res, ctx)
    target = res.recommended or (res.finalists[0] if res.finalists else None)
    if cluster.active and target is not None:
        cp = project_cluster(planner, target.mix, cluster)
        print_cluster(console, cp)
        doc["cluster"] = cp.row()
    plot = args.plot or (str(Path(args.json).with_suffix("")) + "_pareto.png" if args.json else None)
    write_outputs(console, doc, args.json, plot,
                  lambda path: plot_pareto(res, path, f"{model.name} on {wl.name}: cost vs TTFT"))
    console.print(f"planned in {time.perf_counter() - t0:.1f} s")
    return 0 if res.recommended else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m kvswarm.planner.cli ...`: the same as `kvswarm plan ...`."""
    parser = argparse.ArgumentParser(prog="kvswarm plan", description=(__doc__ or "").strip())
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
