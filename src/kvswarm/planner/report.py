"""Planner output: rich tables, JSON documents and matplotlib plots (PNG)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvswarm.planner.search import SearchResult


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _s(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _per_tb(x: float) -> str:
    return "-" if math.isnan(x) else f"${x:,.0f}/TB"


def finalists_table(res: SearchResult) -> Table:
    t = Table(title="Finalists (simulated): best first", show_lines=False)
    for col in ("mix", "hit DRAM/SSD/HDD", "TTFT mean", "TTFT p90", "decode I/O", "GPUs", "KV tier $", "$/TB",
                "$/Mtok", "kW", "max req/s"):
        t.add_column(col, justify="left" if col == "mix" else "right")
    for p in res.finalists:
        h = p.hit_rates
        mark = "* " if p is res.recommended else ""
        t.add_row(mark + p.mix.label, f"{_pct(h['dram'])}/{_pct(h['ssd'])}/{_pct(h['hdd'])}", _s(p.ttft_mean_s),
                  _s(p.ttft_p90_s), _s(p.decode_io_s), str(p.gpus), f"{p.storage_capex_usd:,.0f}",
                  f"{p.cost_per_tb_usd:,.0f}" if not math.isnan(p.cost_per_tb_usd) else "-",
                  f"{p.cost_per_mtok_usd:.4f}", f"{p.watts / 1e3:.1f}", f"{p.max_rate_rps:.2f}")
    return t


def print_result(console: Console, res: SearchResult, context: dict) -> None:
    console.print(finalists_table(res))
    if res.rejected:
        console.print("screened out: " + ", ".join(f"{v} {k}" for k, v in sorted(res.rejected.items())))
    r = res.recommended
    if r is None:
        console.print("[bold red]No mix meets the budget and target.[/] Closest: "
                      + (f"{res.finalists[0].mix.label} ({res.runners_up[0][1] if res.runners_up else ''})"
                         if res.finalists else "none (every mix saturates or is over budget)"))
        return
    u = ", ".join(f"{k} {v:.0%}" for k, v in r.utilisation.items())
    console.print(f"\n[bold green]Recommended:[/] {r.mix.label}\n"
                  f"  model {context['model']}, workload {context['workload']}, {r.gpus}x {context['gpu']} "
                  f"for prefill, host link {context['link']}\n"
                  f"  hit rate {_pct(1 - r.hit_rates['miss'])} of block references (DRAM {_pct(r.hit_rates['dram'])}, "
                  f"SSD {_pct(r.hit_rates['ssd'])}, HDD {_pct(r.hit_rates['hdd'])}; ideal "
                  f"{_pct(context['ideal_hit_rate'])}), token hit rate {_pct(r.token_hit_rate)}\n"
                  f"  TTFT mean {_s(r.ttft_mean_s)}, p50 {_s(r.ttft_p50_s)}, p90 {_s(r.ttft_p90_s)} "
                  f"(load {_s(r.load_mean_s)} + prefill {_s(r.compute_mean_s)} + queueing; {r.method}); "
                  f"sparse decode I/O per step {_s(r.decode_io_s)}\n"
                  f"  capacity {r.mix.dram_bytes / 1e12 + r.mix.ssd_bytes / 1e12 + r.mix.hdd_bytes / 1e12:.1f} TB "
                  f"(95% of ideal hit rate needs {context['capacity_95_tb']:.1f} TB); KV tier "
                  f"${r.storage_capex_usd:,.0f} ({_per_tb(r.cost_per_tb_usd)}), ${r.cost_per_mtok_usd:.4f} per "
                  f"million tokens incl. prefill GPUs, {r.watts / 1e3:.1f} kW\n"
                  f"  busy: {u}; sustains up to {r.max_rate_rps:.2f} req/s ({r.tokens_per_s:,.0f} tokens/s)")
    for p, why in res.runners_up:
        console.print(f"  runner-up {p.mix.label}: {why}")
    for n in r.notes:
        console.print(f"  note: {n}")


def print_cluster(console: Console, c) -> None:
    """The cluster section: a :class:`~kvswarm.planner.cluster.ClusterProjection`."""
    s = c.spec
    net = f"{s.nic.key} ({s.nic.name})" if s.nic else "a bare network rate"
    u = ", ".join(f"{k} {v:.0%}" for k, v in c.utilisation.items())
    console.print(f"\n[bold]Cluster:[/] {s.prefill_nodes} prefill + {s.decode_nodes} decode nodes, each with "
                  f"{net} at {s.nic_bytes_per_s / 1e9:.1f} GB/s per direction; cluster pool {s.segment_gb:g} GB "
                  f"lent per node x{s.replicas}; every prefill node: {c.mix.label}, {c.gpus_per_node} GPUs\n"
                  f"  hit rate cluster-wide {_pct(c.hit_rate)} vs {_pct(c.node_hit_rate)} per node alone "
                  f"(DRAM {_pct(c.hit_rates['dram'])}, SSD {_pct(c.hit_rates['ssd'])}, HDD {_pct(c.hit_rates['hdd'])}); "
                  f"{_pct(c.remote_share)} of hit bytes come from another node\n"
                  f"  TTFT mean {_s(c.ttft_mean_s)}, p90 {_s(c.ttft_p90_s)} (closed form; nodes alone: mean "
                  f"{_s(c.node_ttft_mean_s)}); network per request {_s(c.network_mean_s)} fetching, "
                  f"{_s(c.kv_transfer_mean_s)} handing KV to decode, {c.network_gb_per_request:.2f} GB\n"
                  f"  busy per node: {u}; bound: {c.bound} (busiest: {c.busiest}); sustains up to "
                  f"{c.max_rate_rps:.2f} req/s\n"
                  f"  KV tiers + segments + NICs ${c.kv_capex_usd:,.0f} (NICs ${c.nic_capex_usd:,.0f}), "
                  f"{c.watts / 1e3:.1f} kW, ${c.cost_per_mtok_usd:.4f} per million tokens incl. prefill GPUs")


def plan_json(res: SearchResult, context: dict) -> dict:
    r = res.recommended
    summary = {"mixes_screened": len(res.screened), "finalists": len(res.finalists)}
    if r is not None:
        summary |= {"ttft_mean_s": r.ttft_mean_s, "ttft_p90_s": r.ttft_p90_s, "hit_rate": 1 - r.hit_rates["miss"],
                    "token_hit_rate": r.token_hit_rate, "gpus": r.gpus, "storage_capex_usd": r.storage_capex_usd,
                    "cost_per_tb_usd": r.cost_per_tb_usd, "cost_per_mtok_usd": r.cost_per_mtok_usd,
                    "watts": r.watts, "max_rate_rps": r.max_rate_rps,
                    "decode_io_s": None if math.isnan(r.decode_io_s) else r.decode_io_s}
    return {
        "context": context, "summary": summary,
        "recommended": r.row() if r else None,
        "runners_up": [{"why": why} | p.row() for p, why in res.runners_up],
        "pareto_front": [p.row() for p in res.front],
        "rejected": res.rejected,
        "screened": [p.row() for p in res.screened],
    }


def write_json(path: str | Path, doc: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=_jsonable))


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(f"not JSON-serialisable: {type(o)}")


def new_figure(path: str | Path, **subplots: object):
    """(figure, axes) from matplotlib's file-only backend, with ``path``'s folder made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return plt.subplots(**subplots)


def save_figure(fig, ax, path: str | Path, title: str, legend_size: int = 8) -> None:
    """Title, grid and legend on ``ax``, then write ``fig`` to ``path`` and free it."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(console: Console, doc: dict, json_path: str | None, plot_path: str | None, draw) -> None:
    """Draw the plot (``draw(path)``) and write the JSON document, each only where a path was given."""
    if plot_path:
        draw(plot_path)
        doc["plots"] = [plot_path]
        console.print(f"plot: {plot_path}")
    if json_path:
        write_json(json_path, doc)
        console.print(f"json: {json_path}")


def plot_pareto(res: SearchResult, path: str | Path, title: str) -> None:
    fig, ax = new_figure(path, figsize=(8, 5.5))
    ok = [p for p in res.screened if not p.saturated]
    ax.scatter([p.cost_per_mtok_usd for p in ok], [p.ttft_mean_s for p in ok], s=12, c="0.7",
               label="screened mixes (closed form)")
    f = res.front
    ax.plot([p.cost_per_mtok_usd for p in f], [p.ttft_mean_s for p in f], "o-", c="tab:blue", ms=4,
            label="Pareto front (closed form)")
    ax.scatter([p.cost_per_mtok_usd for p in res.finalists], [p.ttft_mean_s for p in res.finalists], marker="s",
               c="tab:orange", label="finalists (simulated: queueing, writes)", zorder=3)
    closed = {p.mix: p for p in res.screened}
    for p in res.finalists:  # from each finalist's closed-form point to its simulated one
        c = closed.get(p.mix)
        if c is not None:
            ax.plot([c.cost_per_mtok_usd, p.cost_per_mtok_usd], [c.ttft_mean_s, p.ttft_mean_s], ":", c="tab:orange",
                    lw=1)
    if res.recommended:
        r = res.recommended
        ax.scatter([r.cost_per_mtok_usd], [r.ttft_mean_s], marker="*", s=220, c="tab:red", zorder=4,
                   label=f"recommended: {r.mix.label}")
    ax.set_xlabel("cost per million tokens served (USD, KV tier + prefill GPUs)")
    ax.set_ylabel("mean TTFT (s)")
    save_figure(fig, ax, path, title)


def console() -> Console:
    """A console wide enough for the tables when output is not a terminal (logs, CI)."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=150)


def print_error(command: str, e: BaseException) -> None:
    """A planner command's error: one line on stderr, as every kvswarm command's."""
    import sys

    print(f"kvswarm {command}: error: {' '.join(str(e).split())}", file=sys.stderr)
