"""Serving under load: the real vLLM CPU engine replays the Mooncake conversation trace, with no
offload, with vLLM's fs tier and with kvswarm's tier, each also restarted half-way.

Every configuration serves the same requests (:mod:`kvswarm.bench.serve_trace`: the trace scaled to
this machine, the scaling stated in the output) with the same engine settings: SmolLM2-135M-Instruct
in fp32, the same small KV space for vLLM's own blocks (and, where there is offload, the same CPU
primary tier) so that the trace overflows it.  Configurations:

- ``no_offload``: vLLM's prefix cache only;
- ``fs_1drive``: vLLM's ``fs`` secondary tier on ext4 on one drive;
- ``kvswarm_1drive`` and ``kvswarm_4drives``: kvswarm's tier on one and on four drives.

vLLM's own offloading worker is CUDA/XPU-only, so on the CPU build both tiers run under
``CPUTieringOffloadingSpec`` (fs) and ``KVSwarmOffloadingSpec`` (kvswarm): the same tiering manager
(:class:`~kvswarm.integrations.vllm.promotion.InlinePromotionManager`: vLLM's, which promotes from the
kvswarm tier within the lookup that finds a block, ``--inline-wait``, and from the fs tier as vLLM
does), CPU primary region and kvswarm CPU worker; they differ in the secondary tier alone.  Drives
are loop devices capped by the kernel's blkio throttle (:mod:`kvswarm.testbed`), the same caps for
every drive of every configuration; the engines run inside the throttled group.

The trace is served in two halves.  Without a restart one engine serves both (its tiers settled in
between, as at the restart point); with a restart the first engine stops after the first half, the
page cache is dropped, and a new engine process serves the second half (the durable tiers keep their
blocks; the fs tier's files are found again by cold file probes).  Arrival times restart from zero in
the second half, so the engine's start is not counted in any TTFT.

Before the configurations an engine without offload times its prefill rate (the fastest of three
warm-up prompts); the
arrivals are compressed so that the requests' prompt tokens arrive at ``--load`` times that rate (1.0
by default: an engine without any cache would be just saturated), so the load is the same relative to
the engine whatever the machine's speed (``--compression`` fixes the factor instead).

kvswarm's tier runs with the ``deadline`` load policy (a block that cannot arrive before recomputing
it would finish is recomputed: :mod:`kvswarm.integrations.vllm.load_policy`), its recompute rate the
measured prefill rate; how often it recomputes is reported.  Greedy outputs of every
configuration are compared with the no-offload run's (``wrong_outputs``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np

from kvswarm.argtypes import positive_float, positive_int
from kvswarm.bench import write_summary
from kvswarm.bench.engine_host import drop_caches, finish, reexec_in_engine_venv, standalone_main
from kvswarm.bench.serve_trace import (TRACE, Scaling, build_requests, compression_for_load, load_records,
                                      reuse, text_pool)

MiB = 1 << 20
SCALES = {
    # At the trace's own pace: the run compresses arrivals to the offered load (--load) or by --compression.
    "smoke": Scaling(window_s=300, conversation_sample=50, time_compression=1, block_tokens=32, max_blocks=4,
                     max_output=2),
    "quick": Scaling(window_s=600, conversation_sample=30, time_compression=1, block_tokens=32, max_blocks=8,
                     max_output=4),
    "full": Scaling(window_s=1200, conversation_sample=30, time_compression=1, block_tokens=32, max_blocks=8,
                    max_output=8),
}
ENGINE = {"block_size": 32, "dtype": "float32", "max_num_seqs": 4}
KV_TOKENS = 1024  # vLLM's own KV space, in tokens (the trace's distinct blocks overflow it)
CPU_TIER_TOKENS = 1024  # the CPU primary tier of the offloading configurations (as large as vLLM's own)
CONFIGS = ("no_offload", "fs_1drive", "kvswarm_1drive", "kvswarm_4drives")


@dataclass(frozen=True)
class Config:
    name: str
    tier: str | None  # None, "fs", "kvswarm"
    drives: int
    restart: bool

    @property
    def label(self) -> str:
        return self.name + ("_restart" if self.restart else "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true",
                      help="a dozen requests; no offload, and fs and kvswarm (4 drives) restarted only (CI)")
    size.add_argument("--quick", action="store_true",
                      help="71 requests; no offload, fs and kvswarm on 4 drives, with and without a restart")
    p.add_argument("--json", metavar="PATH", help="write results (with a 'summary' dict) here; a plot beside it")
    p.add_argument("--summary", metavar="PATH", help="also write a small JSON here: the summary and the settings")
    p.add_argument("--dir", help="scratch directory (default: a temp dir in /var/tmp)")
    p.add_argument("--trace", default=str(TRACE), help="Mooncake conversation trace (JSONL)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated subset of {','.join(CONFIGS)} (no_offload always runs first)")
    p.add_argument("--restarts", choices=["both", "only", "none"], default=None,
                   help="run the tiers' configurations without and with a restart (both; default), or one of them "
                        "(--smoke: only)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--load", type=positive_float, default=1.0, metavar="RHO",
                      help="offered load: arrivals compressed so that the prompt tokens arrive at RHO times the "
                           "engine's prefill rate, measured before the configurations (default 1.0)")
    pace.add_argument("--compression", type=positive_float, default=None, metavar="C",
                      help="compress the trace's arrival times by C instead, whatever the engine's speed")
    p.add_argument("--load-policy", default="deadline", choices=["deadline", "always"],
                   help="kvswarm tier's load policy")
    p.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                   help="serve every configuration N times, the order reversed every other round, so that the "
                        "shared machine's drift falls on every configuration alike; percentiles pool the rounds")
    p.add_argument("--inline-wait", type=float, default=0.05, metavar="S",
                   help="kvswarm tier's inline_wait_s: how long a lookup may wait for its promotion (0: deferred to "
                        "the next step, as vLLM's manager does for every tier)")


def scale_of(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def configs_of(args: argparse.Namespace) -> list[Config]:
    names = args.configs.split(",") if args.configs else (
        list(CONFIGS) if scale_of(args) == "full" else ["no_offload", "fs_1drive", "kvswarm_4drives"])
    restarts = args.restarts or ("only" if args.smoke else "both")
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"kvswarm bench serve: unknown configuration {bad[0]!r}; one of {', '.join(CONFIGS)}")
    names = ["no_offload"] + [n for n in names if n != "no_offload"]
    out = []
    for n in names:
        tier = None if n == "no_offload" else n.split("_")[0]
        drives = 4 if n.endswith("4drives") else 1 if tier else 0
        if tier is None or restarts != "only":
            out.append(Config(n, tier, drives, False))
        if tier is not None and restarts != "none":
            out.append(Config(n, tier, drives, True))
    return out


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        from kvswarm.model import default_model_dir

        default_model_dir()  # made here: the engine's venv does not carry the GGUF package
        return reexec_in_engine_venv("kvswarm.bench.serve_bench", "serve")
    from rich.console import Console
    from transformers import AutoTokenizer

    from kvswarm.corpus import make_document
    from kvswarm.model import default_model_dir
    from kvswarm.testbed import default_caps

    console = Console(width=max(150, Console().width))
    scale = SCALES[scale_of(args)]
    model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    records, pool = load_records(args.trace), text_pool(tok, 100_000)
    requests = build_requests(records, scale, pool)  # at the trace's pace
    warm = [list(make_document(tok, 256, seed=s, source="pydoc").prompt_ids) for s in (7, 8, 9, 10)]
    max_len = scale.max_blocks * scale.block_tokens + scale.max_output + ENGINE["block_size"]
    kv_bytes_per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64, fp32
    engine = {**ENGINE, "max_model_len": max(max_len, 256 + 8), "kv_cache_bytes": KV_TOKENS * kv_bytes_per_token}
    job = {"model": model, "engine": engine, "warmup_prompts": warm[:2]}
    root = tempfile.mkdtemp(prefix="kvswarm-bench-serve-", dir=args.dir or "/var/tmp")
    try:
        prefill_tps = calibrate(dict(job, warmup_prompts=warm), root)
        compression = args.compression or compression_for_load(requests, args.load, prefill_tps)
        scale = replace(scale, time_compression=round(compression, 3))
        requests = build_requests(records, scale, pool)
        tokens = sum(len(r.prompt) for r in requests)
        offered = tokens / max(requests[-1].arrival_s, 1e-9) / prefill_tps
        half = len(requests) // 2
        phases = [requests[:half], requests[half:]]
        t_half = phases[1][0].arrival_s
        job_phases = [[{"rid": r.rid, "arrival_s": r.arrival_s - (t_half if p else 0.0), "prompt": list(r.prompt),
                        "max_tokens": r.max_tokens} for r in ph] for p, ph in enumerate(phases)]
        caps = default_caps(4)
        drive_bytes = max(256 * MiB, int(2.5 * tokens * kv_bytes_per_token) // 4096 * 4096)
        results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "scale": scale_of(args),
                         "scaling": scale.as_dict(), "scaling_text": scale.describe(), "engine": engine,
                         "cpu_tier_bytes": CPU_TIER_TOKENS * kv_bytes_per_token, "requests": len(requests),
                         "prompt_tokens": tokens, "trace_reuse": reuse(requests), "load_policy": args.load_policy,
                         "inline_wait_s": args.inline_wait, "drive_bytes": drive_bytes, "second_half_at_s": t_half,
                         "recompute_tokens_per_s": prefill_tps, "offered_load": offered, "runs": {}}
        console.print(f"[bold]{scale.describe()}[/bold]: {len(requests)} requests over {requests[-1].arrival_s:.0f} s, "
                      f"{tokens} prompt tokens ({offered:.2f} of the engine's measured {prefill_tps:.0f} prefill "
                      f"tokens/s), block reuse {results['trace_reuse']:.2f}; engine {engine}")
        results["load_avg_start"] = os.getloadavg()
        results["rounds"] = args.rounds
        configs = configs_of(args)
        per_round: dict[str, list[dict]] = {c.label: [] for c in configs}
        options = {"load_policy": args.load_policy, "inline_wait_s": args.inline_wait}
        for rnd in range(args.rounds):
            for cfg in configs if rnd % 2 == 0 else configs[::-1]:
                console.print(f"[bold]{cfg.label}[/bold]" + (f" (round {rnd + 1})" if args.rounds > 1 else ""))
                r = run_config(cfg, job, job_phases, results, root, caps, drive_bytes, prefill_tps, options, console)
                per_round[cfg.label].append(r)
        results["runs"] = {label: pool_rounds(runs) for label, runs in per_round.items()}
        results["load_avg_end"] = os.getloadavg()
        rc = finish(results, summarize, report, console, args.json, plot)
        if args.summary:
            write_summary(args.summary, command(args), settings(results), results["summary"])
            console.print(f"wrote {args.summary}")
        return rc
    finally:
        shutil.rmtree(root, ignore_errors=True)


def calibrate(job: dict, root: str) -> float:
    """The engine's prefill rate (tokens/s), the fastest of its timed warm-up prompts in an engine without
    offload (one timing fell to 388 tokens/s where the same engine had prefilled 575-673 minutes before): it paces
    the arrivals (``--load``) and is the recompute rate of kvswarm's deadline policy."""
    work = tempfile.mkdtemp(prefix="calibrate-", dir=root)
    return _child(dict(job, connector=None, phases=[]), work, "calibrate")["prefill_tokens_per_s"]


def command(args: argparse.Namespace) -> str:
    """The command line that makes this run's workload again (its scale, rounds and pace)."""
    words = ["kvswarm bench serve"] + ([] if scale_of(args) == "full" else [f"--{scale_of(args)}"])
    words += [f"--rounds {args.rounds}"] if args.rounds > 1 else []
    words += [f"--compression {args.compression:g}"] if args.compression else [f"--load {args.load:g}"]
    return " ".join(words)


def settings(r: dict) -> dict:
    return {k: r[k] for k in ("scale", "scaling", "scaling_text", "engine", "cpu_tier_bytes", "requests",
                              "prompt_tokens", "trace_reuse", "load_policy", "inline_wait_s", "rounds", "drive_bytes",
                              "recompute_tokens_per_s", "offered_load", "second_half_at_s", "testbed", "how_run",
                              "load_avg_start", "load_avg_end")
            if k in r} | {"cpus": os.cpu_count()}


# ---- one configuration -------------------------------------------------------------------------
def connector(cfg: Config, paths: list[str], meta_dir: str | None, drive_bytes: int, prefill_tps: float | None,
              options: dict, cpu_bytes: int) -> dict | None:
    """The engine's ``kv_connector_extra_config`` (None: no offload); ``options``: the kvswarm tier's
    ``load_policy`` and ``inline_wait_s``."""
    if cfg.tier is None:
        return None
    if cfg.tier == "fs":
        return {"spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "kvswarm.integrations.vllm",
                "cpu_bytes_to_use": cpu_bytes, "secondary_tiers": [{"type": "fs", "root_dir": paths[0]}]}
    section = {"drives": paths, "meta_dir": meta_dir, "capacity_per_drive": drive_bytes, "tenant": "bench-serve",
               **options}
    if options["load_policy"] == "deadline":
        section["recompute_tokens_per_s"] = prefill_tps
    return {"spec_name": "KVSwarmOffloadingSpec", "spec_module_path": "kvswarm.integrations.vllm",
            "cpu_bytes_to_use": cpu_bytes, "kvswarm": section}


def run_config(cfg: Config, job: dict, phases: list[list[dict]], results: dict, root: str, caps, drive_bytes: int,
               prefill_tps: float | None, options: dict, console) -> dict:
    from kvswarm.testbed import KERNEL, Testbed

    work = tempfile.mkdtemp(prefix=cfg.label + "-", dir=root)
    if cfg.tier is None:
        return _run_engines(cfg, dict(job, connector=None), phases, work, [], console)
    with Testbed(drives=cfg.drives, drive_bytes=drive_bytes, caps=caps, mode=KERNEL) as tb:
        results["testbed"] = {k: v for k, v in tb.info().items() if k not in ("paths", "devices")}
        mnt = None
        if cfg.tier == "fs":
            mnt = os.path.join(tb.root, "fs-mnt")
            os.makedirs(mnt)
            subprocess.run(["mkfs.ext4", "-q", "-F", tb.paths[0]], check=True)
            subprocess.run(["mount", tb.paths[0], mnt], check=True)
            paths = [os.path.join(mnt, "kv")]
        else:
            paths = list(tb.paths)
        results["how_run"] = HOW_RUN
        try:
            conn = connector(cfg, paths, tb.meta_dir, drive_bytes, prefill_tps, options, results["cpu_tier_bytes"])
            return _run_engines(cfg, dict(job, connector=conn), phases, work, list(tb.paths), console)
        finally:
            if mnt is not None:
                subprocess.run(["umount", mnt], check=True)


HOW_RUN = ("both tiers under InlinePromotionManager (vLLM's TieringOffloadingManager; it promotes from a tier that "
           "bounds its wait, kvswarm's, within the lookup that finds a block, and from vLLM's fs tier at the step's end "
           "as vLLM does) with kvswarm's CPU worker: fs as a secondary tier of CPUTieringOffloadingSpec, kvswarm's tier "
           "under KVSwarmOffloadingSpec; same CPU primary tier size; engines run inside the testbed's blkio group "
           "(kernel-throttled loop devices); fs on ext4 on one loop device (O_DIRECT, which vLLM's fs tier probes for "
           "and uses), kvswarm O_DIRECT on the raw loop devices")


def _run_engines(cfg: Config, job: dict, phases: list[list[dict]], work: str, devices: list[str], console) -> dict:
    io0, load0 = disk_io(devices), os.getloadavg()
    parts = []
    if cfg.restart:
        for i, ph in enumerate(phases):
            if i:
                drop_caches()
            parts.append(_child(dict(job, phases=[ph]), work, f"phase{i}"))
    else:
        parts.append(_child(dict(job, phases=phases), work, "both"))
    io1 = disk_io(devices)
    per_drive = [{"read_bytes": b[0] - a[0], "written_bytes": b[1] - a[1]} for a, b in zip(io0, io1)]
    phase_runs = [p for part in parts for p in part["phases"]]
    out = {"config": cfg.name, "restart": cfg.restart, "drives": cfg.drives, "per_drive": per_drive,
           "load_avg": [load0, os.getloadavg()],
           "engine_start_s": [p["engine_start_s"] for p in parts],
           "buffers_ready_s": [p["buffers_ready_s"] for p in parts],
           "region_ready_s": [p["region_ready_s"] for p in parts],
           "prefill_tokens_per_s": parts[0]["prefill_tokens_per_s"], "phases": phase_runs}
    m = metrics([r for p in phase_runs for r in p["requests"]], sum(p["replay_s"] for p in phase_runs))
    console.print(f"  TTFT p50 {m['ttft_p50_s']:.2f} p90 {m['ttft_p90_s']:.2f} p99 {m['ttft_p99_s']:.2f} s, "
                  f"{m['req_per_s']:.2f} req/s, {m['tokens_per_s']:.1f} tok/s; read "
                  f"{sum(d['read_bytes'] for d in per_drive) / MiB:.0f} MiB, written "
                  f"{sum(d['written_bytes'] for d in per_drive) / MiB:.0f} MiB")
    return out


def pool_rounds(runs: list[dict]) -> dict:
    """One configuration's rounds as one run: phases in round order (first half, second half, ...),
    bytes per drive summed, the load average from the first round's start to the last one's end."""
    out = dict(runs[0])
    out["phases"] = [p for r in runs for p in r["phases"]]
    out["per_drive"] = [{k: sum(r["per_drive"][i][k] for r in runs) for k in ("read_bytes", "written_bytes")}
                        for i in range(len(runs[0]["per_drive"]))]
    out["load_avg"] = [runs[0]["load_avg"][0], runs[-1]["load_avg"][1]]
    out["engine_start_s"] = [t for r in runs for t in r["engine_start_s"]]
    for k in ("buffers_ready_s", "region_ready_s"):
        out[k] = [t for r in runs for t in r[k]]
    out["prefill_tokens_per_s"] = [r["prefill_tokens_per_s"] for r in runs]
    return out


def _child(job: dict, work: str, name: str) -> dict:
    jp, op = os.path.join(work, name + ".job.json"), os.path.join(work, name + ".out.json")
    with open(jp, "w") as f:
        json.dump(job, f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with open(os.path.join(work, name + ".log"), "w") as log:
        proc = subprocess.run([sys.executable, "-m", "kvswarm.bench.serve_engine", jp, op], env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode:
        with open(os.path.join(work, name + ".log")) as f:
            raise RuntimeError(f"engine {name} failed:\n{f.read()[-6000:]}")
    with open(op) as f:
        return json.load(f)


def disk_io(paths: list[str]) -> list[tuple[int, int]]:
    """(bytes read, bytes written) of each block device in ``paths``, from /proc/diskstats."""
    names = [os.path.basename(os.path.realpath(p)) for p in paths]
    stats = {}
    with open("/proc/diskstats") as f:
        for line in f:
            w = line.split()
            stats[w[2]] = (int(w[5]) * 512, int(w[9]) * 512)
    return [stats.get(n, (0, 0)) for n in names]


# ---- figures -----------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def metrics(reqs: list[dict], span_s: float) -> dict:
    ttft = [r["ttft_s"] for r in reqs]
    e2e = [r["e2e_s"] for r in reqs]
    out_tokens = sum(len(r["tokens"]) for r in reqs)
    return {"requests": len(reqs), "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "ttft_p99_s": pct(ttft, 99), "e2e_p50_s": pct(e2e, 50), "e2e_p90_s": pct(e2e, 90),
            "e2e_p99_s": pct(e2e, 99), "req_per_s": len(reqs) / span_s, "tokens_per_s": out_tokens / span_s,
            "prefill_tokens_per_s": (sum(r["prompt_tokens"] for r in reqs)) / span_s}


def tier_rates(run: dict, block_tokens: int) -> dict:
    """Prefix hits as shares of the prompt tokens: vLLM's own KV blocks, the CPU primary tier, the drive tier."""
    q = sum(p["cache"]["local_queries"] for p in run["phases"])
    local = sum(p["cache"]["local_hits"] for p in run["phases"])
    conn = sum(p["cache"]["connector_hits"] for p in run["phases"])
    drive = sum(t["loaded_blocks"] for p in run["phases"] for t in p["tiers"]) * block_tokens
    declined = sum(t.get("deadline_recomputes", 0) for p in run["phases"] for t in p["tiers"])
    found = sum(t.get("lookup_hits", 0) for p in run["phases"] for t in p["tiers"])
    out = {"hit_rate_vllm_blocks": local / q if q else 0.0, "hit_rate_offload": conn / q if q else 0.0,
           "hit_rate_drive_tier": drive / q if q else 0.0, "hit_rate_cpu_tier": max(0, conn - drive) / q if q else 0.0}
    if found or declined:
        out["deadline_recomputes"] = declined
        out["deadline_recompute_share"] = declined / (declined + found)
    return out


def summarize(r: dict) -> dict:
    s: dict = {}
    bt = r["engine"]["block_size"]
    ref = {q["rid"]: q["tokens"] for p in r["runs"]["no_offload"]["phases"] for q in p["requests"]}
    wrong = 0
    for label, run in r["runs"].items():
        reqs = [q for p in run["phases"] for q in p["requests"]]
        m = metrics(reqs, sum(p["replay_s"] for p in run["phases"]))
        m |= tier_rates(run, bt)
        m["wrong_outputs"] = sum(q["tokens"] != ref[q["rid"]] for q in reqs)
        wrong += m["wrong_outputs"]
        m["read_mib_per_drive"] = [d["read_bytes"] / MiB for d in run["per_drive"]]
        m["written_mib_per_drive"] = [d["written_bytes"] / MiB for d in run["per_drive"]]
        second = [q for p in run["phases"][1::2] for q in p["requests"]]  # every round's second half
        m["second_half_ttft_p90_s"] = pct([q["ttft_s"] for q in second], 90)
        m["second_half_ttft_p50_s"] = pct([q["ttft_s"] for q in second], 50)
        m["load_avg_1min"] = [run["load_avg"][0][0], run["load_avg"][1][0]]
        s[label] = m
    s["wrong_outputs"] = wrong
    kv, fs, none = s.get("kvswarm_4drives"), s.get("fs_1drive"), s["no_offload"]
    if kv and fs:
        s["ttft_p90_ratio_vs_fs"] = kv["ttft_p90_s"] / fs["ttft_p90_s"]
    if kv:
        s["ttft_p90_ratio_vs_no_offload"] = kv["ttft_p90_s"] / none["ttft_p90_s"]
    kvr, fsr = s.get("kvswarm_4drives_restart"), s.get("fs_1drive_restart")
    if kvr and fsr:
        s["ttft_p90_ratio_after_restart_vs_fs"] = kvr["second_half_ttft_p90_s"] / fsr["second_half_ttft_p90_s"]
    if kvr:
        s["ttft_p90_ratio_after_restart_vs_no_offload"] = (kvr["second_half_ttft_p90_s"]
                                                           / none["second_half_ttft_p90_s"])
    return s


def report(r: dict, console) -> None:
    from rich.table import Table

    s = r["summary"]
    t = Table(title=f"vLLM CPU engine serving the Mooncake trace: {r['requests']} requests ({r['scaling_text']})")
    t.caption = ("TTFT / e2e in s over all requests; 2nd-half p90: the requests after the restart point (restart "
                 "runs: served by a new engine); hits: shares of prompt tokens from vLLM's own blocks / the CPU "
                 f"tier / the drive tier; recomputed: blocks found but recomputed by the load policy. {r['how_run']}"
                 if "how_run" in r else "")
    for c in ("config", "TTFT p50", "p90", "p99", "2nd-half p90", "e2e p50", "p90", "req/s", "tok/s",
              "hits vllm/cpu/drive", "recomputed", "read / written MiB per drive", "wrong"):
        t.add_column(c)
    for label in r["runs"]:
        m = s[label]
        t.add_row(label, f"{m['ttft_p50_s']:.2f}", f"{m['ttft_p90_s']:.2f}", f"{m['ttft_p99_s']:.2f}",
                  f"{m['second_half_ttft_p90_s']:.2f}", f"{m['e2e_p50_s']:.2f}", f"{m['e2e_p90_s']:.2f}",
                  f"{m['req_per_s']:.3f}", f"{m['tokens_per_s']:.2f}",
                  f"{m['hit_rate_vllm_blocks']:.2f}/{m['hit_rate_cpu_tier']:.2f}/{m['hit_rate_drive_tier']:.2f}",
                  str(m.get("deadline_recomputes", "")),
                  " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(m["read_mib_per_drive"], m["written_mib_per_drive"])),
                  str(m["wrong_outputs"]))
    console.print(t)
    for k in ("ttft_p90_ratio_vs_fs", "ttft_p90_ratio_vs_no_offload", "ttft_p90_ratio_after_restart_vs_fs",
              "ttft_p90_ratio_after_restart_vs_no_offload", "wrong_outputs"):
        if k in s:
            console.print(f"{k}: {s[k]:.3f}" if isinstance(s[k], float) else f"{k}: {s[k]}")
    if "testbed" in r:
        console.print(f"drives: {r['testbed']['emulation']} emulation, caps {r['testbed']['caps']}")
    console.print(f"load average: start {r['load_avg_start']}, end {r['load_avg_end']}; per configuration (1 min, "
                  "start/end): " + ", ".join(f"{k} {v['load_avg'][0][0]:.1f}/{v['load_avg'][1][0]:.1f}"
                                             for k, v in r["runs"].items()))


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=True)
    boundary = r["second_half_at_s"]
    for ax, restart in zip(axes, (False, True)):
        for label, run in r["runs"].items():
            if run["restart"] != restart and run["config"] != "no_offload":
                continue
            xs, ys = [], []
            for i, p in enumerate(run["phases"][:2]):  # the first round, on the trace's arrival schedule
                xs += [q["arrival_s"] + (boundary if i else 0.0) for q in p["requests"]]
                ys += [q["ttft_s"] for q in p["requests"]]
            order = np.argsort(xs, kind="stable")
            ax.plot(np.asarray(xs)[order], np.asarray(ys)[order], ".-", label=label, alpha=0.8)
        ax.axvline(boundary, color="k", ls="--", lw=1)
        ax.text(boundary, ax.get_ylim()[1] * 0.95, " restart" if restart else " half-way", fontsize=8)
        ax.set_xlabel("arrival time, s (replayed trace; the second half's clock starts at the dashed line)")
        ax.set_title("engine restarted half-way" if restart else "one engine throughout")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("TTFT, s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("serve", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
