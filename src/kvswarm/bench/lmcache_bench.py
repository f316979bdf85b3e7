"""``kvswarm bench lmcache``: kvswarm's LMCache storage plugin against LMCache's own LocalDiskBackend.

One run, the same kernel-throttled drives (kvswarm.testbed: loop devices capped by cgroup v1 blkio,
each formatted ext4 and mounted): both back ends are built by LMCache's own factory
(``CreateStorageBackends``, the plugin through its plugin launcher) above LMCache's CPU back end,
and driven through the calls LMCache's storage manager makes: ``batched_submit_put_task`` (a request's
chunks, 16 at a time, timed until each chunk's completion callback) and ``batched_get_blocking``
(16 chunks at a time, every byte then checked).  Chunks are 256 tokens of SmolLM2-135M's and
Llama-3-8B's KV geometry (bf16), 1 GiB of each per case (512 MiB with --quick: 16 Llama-3-8B chunks,
four per drive), and their bytes are real KV: windows, one per chunk at its own offset, of the KV
SmolLM2 computes over 4,096 tokens of English text (bf16, in LMCache's [2, layers, tokens, hidden]
order; made once and cached).  Llama-3-8B's chunks hold SmolLM2's values too (no Llama weights
here): the same bytes for both sides, which matters to the compressing case alone.  Every timed
phase starts with the throttle's idle credit drained.  Per round, each
case's back end stores the chunks (timed alone), then each case's retrieve is timed in units of
back-to-back passes over every stored chunk, as many passes as last ``--window`` seconds at the
drives' caps (5: one 100 ms throttle slice, the drain's granularity, is then under 2% of a unit;
one pass on one drive, four on four), every pass's bytes checked after its unit.  The cases' units
take turns, twice, the order reversed the second time, so that a slow spell of the shared machine
falls on every case alike.  Cases, their order alternating per round, the median kept:

- ``lmcache_disk``: LocalDiskBackend on drive 0 (it takes one path), with its O_DIRECT option on
  (without it, reads of chunks just written come from the page cache, not the drive); no fsync: a
  chunk is reported stored once written, and its index lives in the process only.
- ``kvswarm_1drive``: the plugin on drive 0, as shipped: every store flushed (drive and catalog
  fdatasync'd) before it is reported, every read checksummed.
- ``kvswarm_1drive_unflushed``: the same with ``durable: false`` (no flush per store), LMCache's own
  durability, for a like-for-like store figure.
- ``kvswarm_4drives``: the plugin striped over all four drives, as shipped.
- ``kvswarm_1drive_zstd`` / ``kvswarm_4drives_zstd``: the same with ``compression: zstd`` (chunks
  stored as Blosc2 frames, kvswarm.codec; every read verified, every store flushed).

Restart: N chunks (16,384; 1,024 with --quick; 8-token chunks of SmolLM2's geometry, so that they fit
the drives) are stored by each back end, then a fresh process builds the back end again and looks
them up; timed from the start of building it until all N are found and the first 16 read back verified.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from kvswarm.bench import engine_host as host
from kvswarm.bench import write_summary

MiB, GiB = 1 << 20, 1 << 30
BATCH = 16  # chunks per call: a 4,096-token request's chunks, as LMCache's engine batches them
CHUNK = 256
RESTART_CHUNK = 8
DRIVES = 4
CASES = ("lmcache_disk", "kvswarm_1drive", "kvswarm_1drive_unflushed", "kvswarm_4drives", "kvswarm_1drive_zstd",
         "kvswarm_4drives_zstd")
KV_TOKENS = 4096  # tokens of real text whose SmolLM2 KV the chunks' bytes come from
KV_PROMPT = 2048  # tokens per forward pass that makes it
WINDOW_S = 5.0  # timed retrieve seconds per case: a throttle slice (100 ms) is under 2% of it
MIN_TURNS = 2  # timed retrieve units per case, taking turns in reversed order: a drift of the machine falls on all alike


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes (a couple of minutes)")
    p.add_argument("--json", metavar="PATH", help="write results (with a 'summary' dict) here")
    p.add_argument("--summary", metavar="PATH", help="also write a small JSON here: the summary and the settings")
    p.add_argument("--mib", type=int, default=None,
                   help="MiB of chunks per case and geometry (default 1024, quick 512)")
    p.add_argument("--window", type=float, default=WINDOW_S,
                   help="timed retrieve seconds per case, in passes over the stored chunks (default %(default)s; "
                        f"{MIN_TURNS} timed units of back-to-back passes lasting this long at the caps)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per case, the median kept (default 3, quick 1)")
    p.add_argument("--restart-chunks", type=int, default=None,
                   help="chunks for the restart (default 16384, quick 1024)")
    p.add_argument("--restart-child", help=argparse.SUPPRESS)  # internal: the restarted process


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("lmcache") is None:
        return host.reexec_in_engine_venv("kvswarm.bench.lmcache_bench", "lmcache", ".venv-lmcache",
                                          "scripts/setup-lmcache.sh")
    if args.restart_child:
        print(json.dumps(restart_child(json.loads(args.restart_child))), flush=True)
        return 0
    from rich.console import Console

    from kvswarm.integrations.lmcache.harness import LLAMA3_8B, SMOLLM2
    from kvswarm.testbed import KERNEL, Testbed, kernel_support

    if reason := kernel_support():
        print(f"kvswarm bench lmcache: needs kernel drive emulation (LMCache's disk I/O can only be capped "
              f"by the kernel): {reason}", file=sys.stderr)
        return 2
    console = Console(width=max(150, Console().width))
    budget = (args.mib or (512 if args.quick else 1024)) * MiB
    rounds = args.rounds or (1 if args.quick else 3)
    n_restart = args.restart_chunks or (1024 if args.quick else 16384)
    restart_bytes = n_restart * SMOLLM2.chunk_bytes(RESTART_CHUNK)
    # Drive 0 holds four one-drive cases' chunks at once (and a quarter of two four-drive cases'), each in
    # a store 1.25x their size, then the restart's.
    drive_bytes = max(4 * GiB, int(5.7 * budget) + GiB, 2 * restart_bytes + GiB) // MiB * MiB
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": rounds, "batch_chunks": BATCH,
                     "chunk_tokens": CHUNK, "bytes_per_case": budget, "retrieve_window_s": args.window,
                     "load_avg_start": os.getloadavg(), "geometries": {}}
    with Testbed(drives=DRIVES, drive_bytes=drive_bytes, mode=KERNEL, preallocate=False) as tb:
        results["testbed"] = tb.info()
        console.print(tb.describe())
        mounts = mount_drives(tb)
        settle = tb.drain()  # the throttle's idle credit spent before each timed restore
        try:
            pool = kv_pool()
            for geo in (SMOLLM2, LLAMA3_8B):
                n = max(2, budget // geo.chunk_bytes(CHUNK))
                console.print(f"[bold]{geo.name}: {n} chunks of {geo.chunk_bytes(CHUNK) / MiB:.2f} MiB[/bold]")
                results["geometries"][geo.tag] = measure_geometry(geo, n, rounds, mounts, settle, console,
                                                                  args.window, results["testbed"]["caps"], pool)
            results["restart"] = measure_restart(SMOLLM2, n_restart, mounts, console)
            results["load_avg_end"] = os.getloadavg()
        finally:
            settle.close()
            for m in mounts:
                subprocess.run(["umount", m], check=False)
    code = host.finish(results, summarize, report, console, args.json)
    if args.summary:
        write_summary(args.summary, command(args), settings(results, args), results["summary"])
        console.print(f"wrote {args.summary}")
    return code


def command(args: argparse.Namespace) -> str:
    """The command line of this run, but for where it writes."""
    opts = [("--quick", args.quick), ("--rounds", args.rounds), ("--mib", args.mib),
            ("--window", args.window if args.window != WINDOW_S else None), ("--restart-chunks", args.restart_chunks)]
    return " ".join(["kvswarm bench lmcache"] + [k if v is True else f"{k} {v:g}" for k, v in opts if v])


def settings(r: dict, args: argparse.Namespace) -> dict:
    """What a run measured with: sizes, rounds, timing, the testbed and each side's configuration."""
    rs = r["restart"]
    return {"quick": args.quick, "rounds": r["rounds"], "batch_chunks": BATCH, "chunk_tokens": CHUNK,
            "bytes_per_case": r["bytes_per_case"], "retrieve_window_s": r["retrieve_window_s"],
            "retrieve_turns": MIN_TURNS,
            "geometries": {tag: {"model": g["model"], "chunks": g["chunks"], "chunk_bytes": g["chunk_bytes"]}
                           for tag, g in r["geometries"].items()},
            "restart": {"chunks": rs["chunks"], "chunk_tokens": rs["chunk_tokens"], "chunk_bytes": rs["chunk_bytes"]},
            "testbed": {"emulation": r["testbed"]["emulation"], "drives": r["testbed"]["drives"],
                        "caps": r["testbed"]["caps"], "file_system": "ext4 on each drive"},
            "sides": {"lmcache": "0.5.6 LocalDiskBackend on drive 0, use_odirect on, its default I/O threads; "
                                 "no fsync, index in process memory",
                      "kvswarm": "plugin defaults (io_backend auto, queue_depth 32, buffer_pool 256 MiB), one extent "
                                 "per chunk read in place, every read verified; durable = flushed before reported; "
                                 "the _zstd cases with compression: zstd (Blosc2 frames, read through the pool, "
                                 "decoded into LMCache's memory object)"},
            "chunk_data": f"windows of SmolLM2-135M's real bf16 KV over {KV_TOKENS} tokens of English text",
            "load_avg_start": r["load_avg_start"], "load_avg_end": r["load_avg_end"], "cpus": os.cpu_count()}


def mount_drives(tb) -> list[str]:
    mounts = []
    for i, dev in enumerate(tb.paths):
        m = os.path.join(tb.root, f"mnt{i}")
        os.makedirs(m)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev], check=True)
        subprocess.run(["mount", dev, m], check=True)
        mounts.append(m)
    return mounts


# ---- one back end, built by LMCache --------------------------------------------------------------
def backend_config(case: str, dirs: list[str], chunk: int, cpu_bytes: int, capacity: int):
    """LMCache's configuration of ``case``'s disk back end (with its CPU back end)."""
    from kvswarm.codec import Compression
    from kvswarm.integrations.lmcache.harness import kvswarm_config, local_disk_config

    if case == "lmcache_disk":
        return local_disk_config(dirs[0], chunk_size=chunk, cpu_gb=cpu_bytes / GiB, disk_gb=capacity / GiB,
                                 local_cpu=False, use_odirect=True)
    return kvswarm_config(dirs, chunk_size=chunk, cpu_gb=cpu_bytes / GiB, local_cpu=False,
                          capacity_per_drive=capacity, durable=case != "kvswarm_1drive_unflushed",
                          compression=(Compression.ZSTD if case.endswith("_zstd") else Compression.NONE).value)


def case_drives(case: str) -> int:
    return DRIVES if case.startswith("kvswarm_4drives") else 1


# ---- the chunks' bytes: real KV -------------------------------------------------------------------
def kv_pool() -> np.ndarray:
    """SmolLM2's KV of KV_TOKENS tokens of English text (two prompts of KV_PROMPT tokens), bf16 in
    LMCache's [2, layers, tokens, hidden] order, as bytes; computed once, then read from the cache."""
    from kvswarm.model import cache_root

    path = cache_root() / f"lmcache-bench-kv-{KV_TOKENS}.npy"
    if not path.exists():
        ensure_model()
        import torch

        from kvswarm.integrations.lmcache.harness import text_tokens
        from kvswarm.model import load_default_model

        lm = load_default_model(torch.bfloat16)
        text = bytes(text_tokens(64 * KV_TOKENS)).decode(errors="ignore")
        ids = lm.tokenizer(text, return_tensors="pt").input_ids[0]
        parts = []
        with torch.no_grad():
            for a in range(0, KV_TOKENS, KV_PROMPT):
                cache = lm.model(ids[a:a + KV_PROMPT][None], use_cache=True).past_key_values
                k = torch.stack([layer.keys[0] for layer in cache.layers])  # [L, H, T, D]
                v = torch.stack([layer.values[0] for layer in cache.layers])
                kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4)  # [2, L, T, H, D]
                parts.append(kv.reshape(*kv.shape[:3], -1))
        pool = torch.cat(parts, dim=2).contiguous().view(torch.int16).numpy().view(np.uint8).ravel()
        tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
        np.save(tmp, pool)
        tmp.replace(path)
    return np.load(path)


def ensure_model() -> None:
    """SmolLM2's bf16 checkpoint, which this venv can load; made by the main venv (which has the GGUF
    package and its reader) when this one cannot make it."""
    from kvswarm.errors import KVSwarmError
    from kvswarm.model import default_model_dir

    try:
        default_model_dir()
    except (ImportError, KVSwarmError, FileNotFoundError):
        main_py = os.path.join(host.repo_root(), ".venv", "bin", "python")
        subprocess.run([main_py, "-c", "from kvswarm.model import default_model_dir; default_model_dir()"], check=True)


def kv_chunks(pool: np.ndarray, n: int, nbytes: int) -> list[np.ndarray]:
    """``n`` chunks of ``nbytes`` each: windows of ``pool`` at offsets spread over it (whole bf16 values)."""
    if nbytes > len(pool):
        raise ValueError(f"chunks of {nbytes} B need more than the {len(pool)} B of real KV")
    span = (len(pool) - nbytes) // 2 + 1
    return [pool[o:o + nbytes].copy() for o in (2 * ((i * 2654435761) % span) for i in range(n))]


def lmcache_keys(config, meta, n: int, seed: int) -> list:
    """LMCache's keys of ``n`` distinct chunks of real text (requests of BATCH chunks each)."""
    from kvswarm.integrations.lmcache.harness import chunk_keys, text_tokens

    out: dict = {}  # distinct keys only: a repeated chunk is stored once, and reported once
    req = 0
    while len(out) < n:
        for k in chunk_keys(config, meta, text_tokens(BATCH * meta.chunk_size, seed * 1000 + req)):
            out.setdefault(k, None)
        req += 1
    return list(out)[:n]


class Backend:
    """A disk back end built by LMCache's ``CreateStorageBackends`` (with its CPU back end, the
    allocator every chunk lives in), on an event loop thread of its own as LMCache runs it."""

    def __init__(self, case: str, geo, chunk: int, dirs: list[str], cpu_bytes: int, capacity: int) -> None:
        from lmcache.v1.storage_backend import CreateStorageBackends

        from kvswarm.integrations.lmcache.harness import metadata

        self.config = backend_config(case, dirs, chunk, cpu_bytes, capacity)
        name = "LocalDiskBackend" if case == "lmcache_disk" else "kvswarm"
        self.meta = metadata(geo, chunk_size=chunk)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.backends = CreateStorageBackends(self.config, self.meta, self.loop, dst_device="cpu")
        if name not in self.backends:
            raise RuntimeError(f"LMCache built no {name} (see its log): {list(self.backends)}")
        self.disk = self.backends[name]
        self.cpu = self.backends["LocalCPUBackend"]

    def keys(self, n: int, seed: int) -> list:
        return lmcache_keys(self.config, self.meta, n, seed)

    def store(self, keys: list, data: list[np.ndarray]) -> float:
        """Seconds until every chunk is reported stored (its completion callback)."""
        from kvswarm.integrations.lmcache.harness import allocate_chunk

        objs = [allocate_chunk(self.cpu, self.meta, d) for d in data]
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        for a in range(0, len(keys), BATCH):
            self.disk.batched_submit_put_task(keys[a:a + BATCH], objs[a:a + BATCH],
                                              on_complete_callback=lambda k: done.release())
            for o in objs[a:a + BATCH]:
                o.ref_count_down()  # what LMCache's storage manager does once it has handed them over
        for _ in keys:
            if not done.acquire(timeout=600):
                raise RuntimeError("a store was never reported done")
        return time.perf_counter() - t0

    def retrieve(self, keys: list, passes: int = 1) -> tuple[float, list[list]]:
        """``passes`` back-to-back reads of every key, BATCH at a time: (seconds, each pass's objects)."""
        t0 = time.perf_counter()
        out = []
        for _ in range(passes):
            got = []
            for a in range(0, len(keys), BATCH):
                got += self.disk.batched_get_blocking(keys[a:a + BATCH])
            out.append(got)
        return time.perf_counter() - t0, out

    def close(self) -> float:
        t0 = time.perf_counter()
        for b in self.backends.values():
            b.close()
        dt = time.perf_counter() - t0
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        return dt


def check(got: list, data: list[np.ndarray]) -> tuple[int, int]:
    """(misses, wrong bytes) of a retrieve; every hit's memory object goes back to the allocator."""
    from kvswarm.integrations.lmcache.harness import obj_bytes

    misses = wrong = 0
    for g, d in zip(got, data):
        if g is None:
            misses += 1
            continue
        b = obj_bytes(g)
        wrong += int(np.count_nonzero(b != d)) + abs(len(b) - len(d))
        g.ref_count_down()
    return misses, wrong


def case_dirs(case: str, mounts: list[str], tag: str) -> list[str]:
    used = mounts[:case_drives(case)]
    dirs = [os.path.join(m, f"{case}-{tag}") for m in used]
    for d in dirs:
        os.makedirs(d)
    return dirs


def passes_per_unit(window: float, nbytes: int, drives: int, caps) -> int:
    """Back-to-back passes in one timed unit so that, at the drives' read cap, it lasts ``window``
    seconds: a unit starts on a drained throttle, whose admission granularity (about one 100 ms
    slice) is then under 2% of it however fast a pass is."""
    return max(1, math.ceil(window * drives * caps["read_mbps"] * 1e6 / nbytes))


def timed_retrieves(live: dict[str, tuple[Backend, list, int]], data: list[np.ndarray], settle) -> dict:
    """Timed units of back-to-back retrieve passes over every stored chunk, for each back end in
    ``live`` (case -> back end, keys, passes per unit), MIN_TURNS turns, the order reversed every
    turn, so that a slow spell of the shared machine falls on every case alike.  Each unit starts
    with the throttle's credit drained; every pass's bytes are checked after the unit."""
    acc = {c: {"seconds": 0.0, "hit_chunks": 0, "misses": 0, "wrong": 0, "passes": 0} for c in live}
    names = list(live)
    for turn in range(MIN_TURNS):
        for c in names if turn % 2 == 0 else names[::-1]:
            b, keys, passes = live[c]
            settle()
            t, got = b.retrieve(keys, passes)
            a = acc[c]
            a["seconds"] += t
            a["passes"] += passes
            for g in got:
                m, w = check(g, data)
                a["misses"] += m
                a["wrong"] += w
                a["hit_chunks"] += len(keys) - m
    return acc


def measure_geometry(geo, n: int, rounds: int, mounts: list[str], settle, console, window: float, caps,
                     pool: np.ndarray) -> dict:
    """Per round, every case's back end is built and stores the same chunks (each store timed
    alone, drained first), then their retrieve passes take turns (:func:`timed_retrieves`)."""
    size = geo.chunk_bytes(CHUNK)
    data = kv_chunks(pool, n, size)
    total = n * size
    seen: dict[str, dict[str, list]] = {c: {"store_gbps": [], "retrieve_gbps": [], "close_s": [],
                                            "retrieve_s": [], "retrieve_passes": [], "stored_fraction": []}
            for c in CASES}
    misses = wrong = 0
    units = {c: passes_per_unit(window, total, case_drives(c), caps) for c in CASES}
    for r in range(rounds):
        order = CASES if r % 2 == 0 else CASES[::-1]
        live: dict[str, tuple[Backend, list, int]] = {}
        dirs: dict[str, list[str]] = {}
        try:
            for case in order:
                dirs[case] = case_dirs(case, mounts, f"{geo.layers}-{r}")
                capacity = int(total * 1.25 / len(dirs[case])) + 64 * MiB
                # LMCache's CPU back end here is the allocator retrieved chunks land in (no caching:
                # local_cpu off), sized for one unit's chunks; LMCache touches all of it at start.
                b = Backend(case, geo, CHUNK, dirs[case], int(total * 1.1) * units[case] + 256 * MiB, capacity)
                live[case] = (b, b.keys(n, seed=r), units[case])
                settle()
                seen[case]["store_gbps"].append(total / b.store(live[case][1], data) / 1e9)
            got = timed_retrieves(live, data, settle)
        finally:
            for case, (b, _, _) in live.items():
                seen[case]["close_s"].append(b.close())
                if case != "lmcache_disk":  # the bytes it stored over the chunks' bytes
                    c = b.disk.counters
                    seen[case]["stored_fraction"].append(c["stored_bytes_written"] / max(1, c["chunk_bytes_written"]))
            for ds in dirs.values():
                for d in ds:
                    shutil.rmtree(d, ignore_errors=True)
        for case in order:
            g = got[case]
            misses += g["misses"]
            wrong += g["wrong"]
            gbps = g["hit_chunks"] * size / g["seconds"] / 1e9
            seen[case]["retrieve_gbps"].append(gbps)
            seen[case]["retrieve_s"].append(g["seconds"])
            seen[case]["retrieve_passes"].append(g["passes"])
            console.print(f"  round {r + 1} {case:26s} store {seen[case]['store_gbps'][-1]:6.3f} GB/s  retrieve "
                          f"{gbps:6.3f} GB/s ({g['passes']} passes, {g['seconds']:.1f} s)  misses {g['misses']}  "
                          f"wrong bytes {g['wrong']}")
    out: dict = {"model": geo.name, "chunks": n, "chunk_bytes": size, "bytes_per_case": total, "misses": misses,
                 "wrong_bytes": wrong}
    for case, per in seen.items():
        out[case] = {k: statistics.median(v) for k, v in per.items() if v} | {"rounds": per}
    base = out["lmcache_disk"]["retrieve_gbps"]
    out["retrieve_ratio_vs_lmcache_disk_1drive"] = out["kvswarm_1drive"]["retrieve_gbps"] / base
    out["retrieve_speedup_vs_lmcache_disk_4drives"] = out["kvswarm_4drives"]["retrieve_gbps"] / base
    out["store_ratio_vs_lmcache_disk_1drive"] = out["kvswarm_1drive"]["store_gbps"] / out["lmcache_disk"]["store_gbps"]
    out["store_ratio_unflushed_vs_lmcache_disk_1drive"] = (out["kvswarm_1drive_unflushed"]["store_gbps"]
                                                           / out["lmcache_disk"]["store_gbps"])
    out["store_speedup_vs_lmcache_disk_4drives"] = (out["kvswarm_4drives"]["store_gbps"]
                                                    / out["lmcache_disk"]["store_gbps"])
    out["retrieve_ratio_zstd_vs_lmcache_disk_1drive"] = out["kvswarm_1drive_zstd"]["retrieve_gbps"] / base
    out["retrieve_speedup_zstd_vs_lmcache_disk_4drives"] = out["kvswarm_4drives_zstd"]["retrieve_gbps"] / base
    out["store_ratio_zstd_vs_lmcache_disk_1drive"] = (out["kvswarm_1drive_zstd"]["store_gbps"]
                                                      / out["lmcache_disk"]["store_gbps"])
    out["zstd_stored_fraction"] = out["kvswarm_1drive_zstd"]["stored_fraction"]
    return out


# ---- restart --------------------------------------------------------------------------------------
def measure_restart(geo, n: int, mounts: list[str], console) -> dict:
    from kvswarm.integrations.lmcache.harness import chunk_bytes

    size = geo.chunk_bytes(RESTART_CHUNK)
    data = [chunk_bytes(i, size) for i in range(n)]
    out: dict = {"chunks": n, "chunk_tokens": RESTART_CHUNK, "chunk_bytes": size}
    for case in ("lmcache_disk", "kvswarm_4drives"):
        dirs = case_dirs(case, mounts, "restart")
        capacity = int(n * size * 1.25 / len(dirs)) + 64 * MiB
        # The restarted process reads BATCH chunks; the storing one holds all N in LMCache's allocator.
        spec = {"case": case, "dirs": dirs, "n": n, "capacity": capacity, "cpu_bytes": 4 * BATCH * size + 64 * MiB}
        try:
            b = Backend(case, geo, RESTART_CHUNK, dirs, n * size + 256 * MiB, capacity)
            try:
                t_store = b.store(b.keys(n, seed=99), data)
            finally:
                b.close()
            host.drop_caches()  # a restart after the machine's page cache is gone
            p = subprocess.run([sys.executable, "-m", "kvswarm.bench.lmcache_bench", "--restart-child",
                                json.dumps(spec)], capture_output=True, text=True, timeout=1200)
            if p.returncode:
                raise RuntimeError(f"restarted process failed: {p.stderr[-2000:]}")
            row = json.loads(p.stdout.strip().splitlines()[-1])
        finally:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
        row["store_s"] = t_store
        out[case] = row
        hit = f"{row['hit_s']:.2f} s" if row["hit_s"] is not None else "never"
        console.print(f"  restart {case:16s} found {row['found']} of {n} chunks, first {BATCH} read back "
                      f"{row['read_ok']} ok; hits after {hit} (back end built in {row['build_s']:.2f} s)")
    return out


def restart_child(spec: dict) -> dict:
    """In a fresh process: build the back end over the stored chunks, look them all up, read the
    first BATCH back; seconds from the start of building it until that is done.  The requests' keys
    (LMCache hashing their tokens, the same for both back ends) are computed before the clock starts."""
    from kvswarm.integrations.lmcache.harness import SMOLLM2, chunk_bytes, metadata, obj_bytes

    size = SMOLLM2.chunk_bytes(RESTART_CHUNK)
    keys = lmcache_keys(backend_config(spec["case"], spec["dirs"], RESTART_CHUNK, spec["cpu_bytes"], spec["capacity"]),
                        metadata(SMOLLM2, chunk_size=RESTART_CHUNK), spec["n"], seed=99)
    t0 = time.perf_counter()
    b = Backend(spec["case"], SMOLLM2, RESTART_CHUNK, spec["dirs"], spec["cpu_bytes"], spec["capacity"])
    build = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        found = sum(b.disk.batched_contains(keys[a:a + 256]) for a in range(0, len(keys), 256))
        got = b.disk.batched_get_blocking(keys[:BATCH]) if found else [None] * BATCH
        ok = 0
        for i, g in enumerate(got):
            if g is not None:
                ok += bool(np.array_equal(obj_bytes(g), chunk_bytes(i, size)))
                g.ref_count_down()
        t_end = time.perf_counter()
    finally:
        with contextlib.suppress(Exception):
            b.close()
    hit = found == spec["n"] and ok == BATCH
    return {"found": found, "read_ok": ok, "build_s": build, "lookup_s": t_end - t1,
            "hit_s": t_end - t0 if hit else None}


# ---- output ---------------------------------------------------------------------------------------
RATIOS = ("retrieve_ratio_vs_lmcache_disk_1drive", "retrieve_speedup_vs_lmcache_disk_4drives",
          "store_ratio_vs_lmcache_disk_1drive", "store_speedup_vs_lmcache_disk_4drives",
          "retrieve_ratio_zstd_vs_lmcache_disk_1drive", "retrieve_speedup_zstd_vs_lmcache_disk_4drives",
          "store_ratio_zstd_vs_lmcache_disk_1drive")


def summarize(r: dict) -> dict:
    s: dict = {}
    geos = r["geometries"]
    for tag, g in geos.items():
        for case in CASES:
            s[f"{tag}_{case}_store_gbps"] = g[case]["store_gbps"]
            s[f"{tag}_{case}_retrieve_gbps"] = g[case]["retrieve_gbps"]
        for k in RATIOS + ("store_ratio_unflushed_vs_lmcache_disk_1drive", "zstd_stored_fraction"):
            s[f"{tag}_{k}"] = g[k]
    # Headlines: the lower of the two geometries'.
    for k in RATIOS:
        s[k] = min(g[k] for g in geos.values())
    rs = r["restart"]
    s["restart_chunks"] = rs["chunks"]
    s["restart_hit_s_kvswarm"] = rs["kvswarm_4drives"]["hit_s"]
    s["restart_hit_s_lmcache_disk"] = rs["lmcache_disk"]["hit_s"]  # None: its restarted process finds nothing
    s["restart_found_lmcache_disk"] = rs["lmcache_disk"]["found"]
    s["restart_found_kvswarm"] = rs["kvswarm_4drives"]["found"]
    s["chunks_per_case"] = {tag: g["chunks"] for tag, g in geos.items()}
    s["bytes_per_case"] = r["bytes_per_case"]
    s["retrieve_window_s"] = r["retrieve_window_s"]
    s["load_avg_start"], s["load_avg_end"] = r["load_avg_start"], r["load_avg_end"]
    s["misses"] = sum(g["misses"] for g in geos.values())
    s["wrong_bytes"] = sum(g["wrong_bytes"] for g in geos.values())
    s["chunk_data"] = (f"real KV: windows of SmolLM2-135M's bf16 KV over {KV_TOKENS} tokens of English text, "
                       "the same bytes for both sides (Llama-3-8B's geometry filled with SmolLM2's values)")
    s["durable_stores"] = {"kvswarm": "flushed (drives and catalog fdatasync'd) before each store is reported",
                           "lmcache_disk": "no fsync; index in process memory only (lost at restart)"}
    return s


def report(r: dict, console) -> None:
    from rich.table import Table

    t = Table(title="LMCache disk tier: chunks per second through LMCache's back-end calls (GB/s, medians)")
    for col in ("geometry", "case", "drives", "store", "retrieve", "retrieve x", "stored / chunk bytes"):
        t.add_column(col)
    for g in r["geometries"].values():
        base = g["lmcache_disk"]["retrieve_gbps"]
        for case in CASES:
            frac = g[case].get("stored_fraction")
            t.add_row(g["model"], case, str(case_drives(case)), f"{g[case]['store_gbps']:.3f}",
                      f"{g[case]['retrieve_gbps']:.3f}", f"{g[case]['retrieve_gbps'] / base:.2f}",
                      "-" if frac is None else f"{frac:.3f}")
    console.print(t)
    s = r["summary"]
    lm = s["restart_hit_s_lmcache_disk"]
    console.print(f"restart ({s['restart_chunks']} chunks): kvswarm hits after {s['restart_hit_s_kvswarm']:.2f} s; "
                  f"LMCache's disk back end {'never (found ' + str(s['restart_found_lmcache_disk']) + ')' if lm is None else f'{lm:.2f} s'}")
    console.print(f"misses {s['misses']}, wrong bytes {s['wrong_bytes']}; " + r["testbed"]["emulation"]
                  + " emulation, caps " + json.dumps(r["testbed"]["caps"]))


def main(argv: list[str] | None = None) -> int:
    return host.standalone_main("lmcache", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
