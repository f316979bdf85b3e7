"""Prefix reuse: a real trace replayed through the tiers, and real TTFT on SmolLM2 per tier.

1. **Trace replay** of the Mooncake FAST'25 conversation trace (12,031 requests, 512-token
   prefix-chained block ids).  Every request looks up its longest cached prefix, reads it
   (real O_DIRECT reads, every byte checked), and writes its missing blocks (real writes).
   The per-block payload is scaled down (``--payload-kib``, default 4 KiB on disk per
   512-token block - one extent; a real model's block is tens of MiB) so that a dozen
   replays of the whole trace fit this machine's one shared disk; hit rates do not
   depend on the payload size.  Capacities are fractions of the
   replayed window's distinct blocks.  Side by side at each SSD size: plain LRU on one
   drive (the baseline) and kvswarm's tiers (DRAM = SSD/10, SSD pool striped over
   ``--ssd-drives``, capacity pool = 3 x SSD), through the same TierManager code path;
   the full run adds plain LRU on one drive as large as all three tiers together, and
   policy variants at one size.
   Requests are replayed in timestamp order as fast as possible with ``wait_complete``
   prefetch (no compute time is simulated, so no block can be late).  Drives are
   directories under ``--dir``.  The ideal (infinite cache) hit rate of the replayed
   window is computed in the same run; over the whole trace it is 36.6%.

2. **TTFT** on SmolLM2-135M-Instruct (fp32, this CPU): a prompt of a ``--prefix-tokens``
   real-text prefix (Python's pydoc prose) plus a short question.  (a) recompute: a
   plain transformers prefill of the whole prompt (no kvswarm); (b) prefix in DRAM;
   (c) prefix on the SSD pool (DRAM emptied; O_DIRECT reads, so the page cache is never
   involved); (d) prefix on the capacity pool (demoted there through the production
   eviction path), whose drives are throttled loop devices (kernel blkio caps of an HDD)
   when the testbed is available; (e) the SSD case again after closing and reopening
   the store (warm restart; reopen time reported).  TTFT = from request arrival to the
   first token's logits, including lookup, reads, cache rebuild and the prefill of the
   rest of the prompt; prefetch waits for every block (``wait_complete``), so each case
   is served wholly by its tier.  Each hit's first token is checked against recompute's.
   Recompute is timed once in ``--quick`` (it takes a minute), hit cases three times.
   One torch thread by default (``--threads``): on a shared machine, OpenMP threads that
   spin while other processes hold the cores make multi-threaded timings meaningless.

Plots (PNG, next to the JSON): hit rate vs capacity, and TTFT per tier.
"""


from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvswarm.bench import write_json, write_summary
from kvswarm.bench.prefix_cost import Prices, modelled_ttft
from kvswarm.layout import KVLayout
from kvswarm.prefix import HEADER_BYTES, PrefixKeyer, new_block
from kvswarm.tiers import DRIVE_CLASSES, ComputeModel, CostAware, DriveCost, PrefetchPolicy, Tier
from kvswarm.tiers.manager import TierConfig, TierManager
from kvswarm.tiers.pools import PoolConfig, block_disk_bytes

KiB, MiB = 1 << 10, 1 << 20
TRACE_BLOCK_TOKENS = 512
FULL_TRACE_IDEAL = 0.366  # SOURCE.md: infinite-cache block hit rate of the whole conversation trace
DEFAULT_TRACE = Path(__file__).resolve().parents[3].parent / "shared/traces/mooncake/conversation_trace.jsonl"
# Seagate Exos X20 (hardware.toml): 285 MB/s, 168 random-read / 550 random-write IOPS per drive
HDD_CAPS = {"read_mbps": 285.0, "write_mbps": 285.0, "read_iops": 168.0, "write_iops": 550.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="reduced run (a few minutes): first 4,000 trace requests, 2 sizes, 1 TTFT sample per tier")
    p.add_argument("--json", default=None, help="write results (with a 'summary' of numbers) here; plots go next to it")
    p.add_argument("--dir", default=None,
                   help="parent directory for the temporary drives (default: the system temp dir)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake conversation_trace.jsonl")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests (default: all)")
    p.add_argument("--sizes", default=None,
                   help="SSD capacities as fractions of the replayed distinct blocks (default 0.02,0.05,0.1,0.2)")
    p.add_argument("--payload-kib", type=int, default=4, help="on-disk KiB per 512-token trace block (default 4)")
    p.add_argument("--ssd-drives", type=int, default=4, help="drives in the SSD pool")
    p.add_argument("--capacity-drives", type=int, default=2, help="drives in the capacity pool")
    p.add_argument("--prefix-tokens", type=int, default=4096, help="shared real-text prefix for the TTFT part")
    p.add_argument("--repeats", type=int, default=None, help="TTFT samples per case (default 3; quick: recompute once)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the TTFT part (default 1: on a shared box, OpenMP threads that spin "
                        "while other processes hold the cores make multi-threaded timings meaningless)")
    p.add_argument("--catalog", default=None, help="hardware catalog TOML the configurations are priced from "
                   "(default: the shipped one)")
    p.add_argument("--summary", metavar="PATH", default=None,
                   help="also write a small JSON here: the summary and the settings, no per-run detail")
    p.add_argument("--skip-trace", action="store_true")
    p.add_argument("--skip-ttft", action="store_true")


# ---- part 1: trace replay -----------------------------------------------------------------
@dataclass
class Setup:
    name: str
    family: str  # "lru-1drive" (baseline) or "kvswarm"
    fraction: float  # SSD capacity / distinct blocks
    dram: int  # blocks
    ssd: int
    ssd_drives: int
    capacity: int
    capacity_drives: int
    eviction: str = "lru"  # of the SSD pool
    write: str = "write-through"
    demotion: str = "always"


def load_trace(path: str | os.PathLike, limit: int | None = None) -> list[list[int]]:
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs.sort(key=lambda r: r["timestamp"])  # stable: equal timestamps keep file order
    return [r["hash_ids"] for r in recs[:limit]]


def ideal_hit_rate(reqs: Sequence[Sequence[int]]) -> tuple[float, int]:
    """(infinite-cache prefix hit rate, distinct blocks) of a request sequence."""
    seen: set[int] = set()
    hits = refs = 0
    for ids in reqs:
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits += n
        refs += len(ids)
        seen.update(ids)
    return hits / max(refs, 1), len(seen)


def setup_cost(s: Setup, prices: Prices, block_bytes: int) -> float:
    """US$ of the capacity a setup provisions (DRAM, SSD pool, capacity pool of HDDs)."""
    return prices.cost(s.dram, s.ssd, s.capacity, block_bytes)


def _drives(root: Path, name: str, n: int) -> list[str]:
    out = []
    for i in range(n):
        p = root / f"{name}{i}"
        p.mkdir(parents=True, exist_ok=True)
        out.append(str(p))
    return out


def _drive_bytes(blocks: int, drives: int, disk_per_block: int) -> int:
    """Per-drive size so that the pool holds ``blocks`` after block_capacity's slack."""
    per_drive = -(-blocks * 17 // 16 // drives) + 3
    return (per_drive + 1) * disk_per_block + 4096


def _pool(root: Path, name: str, blocks: int, drives: int, payload: int, kind: str) -> PoolConfig | None:
    if not blocks:
        return None
    return PoolConfig(_drives(root, name, drives), kind=kind, buffer_pool_bytes=64 * MiB,
                      capacity_per_drive=_drive_bytes(blocks, drives, block_disk_bytes(payload, 1 << 20)))


def replay(reqs: Sequence[Sequence[int]], s: Setup, root: Path, payload: int,
           compute: ComputeModel | None) -> dict:
    """Replay ``reqs`` through one tier setup on real drives; every served byte is checked."""
    lay = KVLayout(1, 1, 1, "int8", TRACE_BLOCK_TOKENS, model_id="mooncake-conversation-trace")
    keyer = PrefixKeyer(lay)
    kv_bytes = payload - HEADER_BYTES
    demotion: object = s.demotion
    if s.demotion == "cost-aware":
        if compute is None:
            raise ValueError("cost-aware demotion needs a compute model (run the TTFT part)")
        demotion = CostAware(compute, TRACE_BLOCK_TOKENS, payload, DRIVE_CLASSES["ssd"], DRIVE_CLASSES["hdd"],
                             ghost_size=max(s.capacity, 1))
    d = root / s.name
    tm = TierManager(TierConfig(
        block_bytes=payload, dram_bytes=s.dram * payload,
        ssd=_pool(d, "ssd", s.ssd, s.ssd_drives, payload, "ssd"),
        capacity=_pool(d, "cap", s.capacity, s.capacity_drives, payload, "hdd"),
        eviction=("lru", s.eviction, "lru"), write=s.write, demotion=demotion,
        prefetch=PrefetchPolicy("wait_complete")))
    wrong = 0
    t0 = time.perf_counter()
    try:
        for ids in reqs:
            keys = keyer.external_keys(ids)
            hit = tm.lookup(keys)
            for k, v in zip(hit.keys, hit.views):
                wrong += bytes(v[HEADER_BYTES:HEADER_BYTES + 16]) != k
            n = len(hit)
            hit.release()
            blocks = []
            for i in range(n, len(keys)):
                buf, body = new_block(keys[i], keyer.namespace, TRACE_BLOCK_TOKENS, i, kv_bytes)
                body[:16] = keys[i]
                blocks.append(buf)
            tm.insert(keys[n:], blocks)
        tm.flush()
        wall = time.perf_counter() - t0
        st = tm.stats()
    finally:
        tm.close()
        shutil.rmtree(d, ignore_errors=True)
    dc = st["director"]
    drives = [{"pool": pool, "drive": dr["drive"], "read_ops": dr["read_ops"], "read_bytes": dr["read_bytes"],
               "write_ops": dr["write_ops"], "write_bytes": dr["write_bytes"]}
              for pool, ps in st["pools"].items() for dr in ps["drives"]]
    out = asdict(s) | {
        "capacity_blocks": st["capacity_blocks"],
        "hit_rate": st["hit_rate"],
        "wrong_bytes_served": wrong,
        "failures": {k: st["served"].get(k, 0) for k in ("put_failures", "copy_failures", "rejected",
                                                          "buffer_exhausted", "moves_kept", "moves_lost")}
        | {f"lost_{t}": dc[f"lost_{t}"] for t in ("dram", "ssd", "capacity")},
        "evictions": {t: dc[f"evictions_{t}"] for t in ("dram", "ssd", "capacity")},
        "demotions": dc["demotions"],
        "writes_blocks": {t: dc[f"writes_{t}"] for t in ("ssd", "capacity")},
        "promotions": {"ssd": dc["promotions_ssd"], "capacity": dc["promotions_capacity"]},
        "drives": drives,
        "wall_s": wall,
        "requests_per_s": len(reqs) / wall,
    }
    if isinstance(demotion, CostAware):
        out["cost_aware"] = {"decisions": demotion.decisions, "evicted_by_sightings": demotion.evicted,
                             "returned_by_sightings": demotion.returned}
    return out


def trace_part(args, root: Path, console, compute: ComputeModel | None) -> dict:
    limit = args.requests or (4000 if args.quick else None)
    reqs = load_trace(args.trace, limit)
    ideal, distinct = ideal_hit_rate(reqs)
    sizes = [float(x) for x in (args.sizes or ("0.05,0.2" if args.quick else "0.02,0.05,0.1,0.2")).split(",")]
    payload = args.payload_kib * KiB - 64  # one extent of that size on disk
    demotion = "cost-aware" if compute is not None else "always"
    prices = Prices.from_catalog(args.catalog)
    disk_block = payload + 64
    setups = []
    for f in sizes:
        ssd = int(distinct * f)
        lru = Setup(f"lru-1drive@{f:g}", "lru-1drive", f, 0, ssd, 1, 0, 0)
        tiers = Setup(f"kvswarm@{f:g}", "kvswarm", f, ssd // 10, ssd, args.ssd_drives, 3 * ssd,
                      args.capacity_drives, "lru", "write-through", demotion)
        setups += [lru, tiers]
        # Equal cost both ways: one plain SSD drive bought with the tiers' money, and the tiers
        # (every tier in the same proportion) shrunk to the plain drive's money.
        same = prices.ssd_blocks_for(setup_cost(tiers, prices, disk_block), disk_block)
        setups.append(Setup(f"lru-1drive-samecost@{f:g}", "lru-1drive-samecost", f, 0, same, 1, 0, 0))
        k = setup_cost(lru, prices, disk_block) / setup_cost(tiers, prices, disk_block)
        setups.append(replace(tiers, name=f"kvswarm-samecost@{f:g}", family="kvswarm-samecost",
                              dram=int(tiers.dram * k), ssd=max(1, int(tiers.ssd * k)),
                              capacity=int(tiers.capacity * k)))
        if not args.quick:  # one drive as large as all three tiers together
            setups.append(Setup(f"lru-1drive-total@{f:g}", "lru-1drive-total", f, 0, ssd + ssd // 10 + 3 * ssd,
                                1, 0, 0))
    if not args.quick:  # policy variants at one size, same code path
        f = 0.1 if 0.1 in sizes else sizes[len(sizes) // 2]
        ssd = int(distinct * f)
        base = dict(family="variant", fraction=f, dram=ssd // 10, ssd=ssd, ssd_drives=args.ssd_drives,
                    capacity=3 * ssd, capacity_drives=args.capacity_drives)
        for name, kw in [("arc", {"eviction": "arc"}), ("s3fifo", {"eviction": "s3fifo"}),
                         ("demote-always", {"demotion": "always"}), ("demote-drop", {"demotion": "drop"}),
                         ("selective-2", {"write": "selective:2"}), ("write-back", {"write": "write-back"})]:
            setups.append(Setup(f"{name}@{f:g}", **base, **({"demotion": demotion} | kw)))
    runs = []
    for s in setups:
        console.print(f"[dim]replaying {len(reqs):,} requests through {s.name} "
                      f"(DRAM {s.dram:,} / SSD {s.ssd:,} x{s.ssd_drives} / capacity {s.capacity:,} blocks)[/dim]")
        runs.append(replay(reqs, s, root, payload, compute) | {"cost_usd": setup_cost(s, prices, disk_block)})
    for r in runs:  # each configuration's cost against a plain SSD cache of the same SSD size
        base = next(x for x in runs if x["family"] == "lru-1drive" and x["fraction"] == r["fraction"])
        r["cost_vs_lru_1drive"] = r["cost_usd"] / base["cost_usd"]
    return {"prices": prices.as_dict(), "cost_block_bytes": disk_block,
            "cost_note": "US$ of each configuration's provisioned capacity at the replayed block size "
                         "(linear in block bytes: ratios hold for any block size)",
            "trace": str(args.trace), "requests": len(reqs), "distinct_blocks": distinct,
            "ideal_hit_rate": ideal, "full_trace_ideal_hit_rate": FULL_TRACE_IDEAL,
            "payload_bytes_on_disk_per_block": payload + 64, "drives": f"directories under {root}",
            "prefetch": "wait_complete (no compute time simulated)", "runs": runs}


# ---- part 2: TTFT on the real model -------------------------------------------------------
@contextlib.contextmanager
def capacity_drives(root: Path, n: int, drive_bytes: int):
    """(PoolConfig kwargs, description) of HDD-like capacity drives: throttled loop devices when possible."""
    try:
        from kvswarm.io.throttle import DriveCaps
        from kvswarm.testbed import Testbed

        caps = DriveCaps(**HDD_CAPS)
        tb = Testbed(drives=n, drive_bytes=drive_bytes, caps=caps, root=str(root)).start()
    except (ImportError, RuntimeError, OSError) as e:
        yield ({"drives": _drives(root, "cap", n), "capacity_per_drive": drive_bytes},
               f"unthrottled directories under {root} (no testbed: {e})")
        return
    try:
        yield ({"drives": list(tb.paths), "meta_dir": tb.meta_dir, "capacity_per_drive": drive_bytes,
                "wrap_engine": tb.wrap_engine, "cost": DriveCost.from_caps("hdd", caps)}, tb.describe())
    finally:
        tb.stop()


def _time_prefill(model, ids) -> tuple[float, object]:
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        first = int(out.logits[0, -1].argmax())
        return time.perf_counter() - t0, (first, out.cache)


def ttft_part(args, root: Path, console) -> tuple[dict, ComputeModel]:
    import torch

    from kvswarm.corpus import make_document
    from kvswarm.integrations.transformers_prefix import PrefixCache
    from kvswarm.model import load_default_model

    torch.set_num_threads(args.threads)
    repeats = args.repeats or 3  # hit cases: seconds each
    recompute_repeats = args.repeats or (1 if args.quick else 3)  # a minute each on this CPU
    lm = load_default_model()
    tok, lay = lm.tokenizer, lm.layout
    prefix = list(make_document(tok, args.prefix_tokens, seed=0, source="pydoc").prompt_ids)
    question = tok("\n\nQuestion: what is this about?\nAnswer:", add_special_tokens=False)["input_ids"]
    prompt = prefix + question
    console.print(f"[dim]TTFT: SmolLM2 {lay.dtype}, {torch.get_num_threads()} threads; prompt = "
                  f"{len(prefix)}-token pydoc prefix + {len(question)}-token question[/dim]")
    _time_prefill(lm.model, prompt[:64])  # warm-up (kernel selection, allocator)
    t512, _ = _time_prefill(lm.model, prefix[:512])
    recompute = []
    for _ in range(recompute_repeats):
        t, (first_ref, cache) = _time_prefill(lm.model, prompt)
        recompute.append(t)
    compute = ComputeModel.fit([(512, t512), (len(prompt), statistics.median(recompute))])

    kv_bytes = len(prefix) * lay.token_bytes
    block = HEADER_BYTES + lay.block_bytes
    nblocks = len(prefix) // lay.tokens_per_block
    per_ssd = _drive_bytes(nblocks * 2, args.ssd_drives, block_disk_bytes(block, 1 << 20))
    per_cap = _drive_bytes(nblocks * 2, args.capacity_drives, block_disk_bytes(block, 1 << 20))
    out: dict = {"model": lm.model_id, "dtype": lay.dtype, "threads": torch.get_num_threads(),
                 "prefix_tokens": len(prefix), "question_tokens": len(question), "kv_bytes": kv_bytes,
                 "blocks": nblocks, "block_bytes": block, "repeats": repeats, "recompute_repeats": recompute_repeats,
                 "compute_model": {"a_s_per_token": compute.a, "b_s_per_token2": compute.b}}
    cases: dict[str, dict] = {"recompute": {"ttft_s": recompute, "served_from": "prefill of the whole prompt"}}
    with capacity_drives(root, args.capacity_drives, per_cap) as (cap_kw, cap_desc):
        out["capacity_pool"] = cap_desc
        out["ssd_pool"] = f"{args.ssd_drives} directories under {root} (O_DIRECT)"
        cfg = TierConfig(block_bytes=block, dram_bytes=(nblocks + 8) * block,
                         ssd=PoolConfig(_drives(root, "ssd", args.ssd_drives), capacity_per_drive=per_ssd,
                                        buffer_pool_bytes=kv_bytes + 64 * MiB),
                         capacity=PoolConfig(kind="hdd", buffer_pool_bytes=kv_bytes + 64 * MiB, **cap_kw),
                         write="write-through", demotion="always", prefetch=PrefetchPolicy("wait_complete"))
        tm = TierManager(cfg)
        pc = PrefixCache(lm.model, lay, tm)
        pc.save(prefix, cache)  # the KV the recompute produced: what a first request leaves behind
        del cache
        tm.flush()
        keys = pc.reusable_keys(prompt)

        def measure(name: str, prepare, policy: PrefetchPolicy | None = None, n: int = repeats) -> None:
            samples, parts, tiers, ok, reused = [], [], set(), True, 0
            for _ in range(n):
                prepare()
                g = pc.generate(prompt, 1, store=False, policy=policy)
                samples.append(g.ttft_s)
                parts.append((g.load_s, g.restore_s, g.prefill_s))
                tiers |= {t.name.lower() for t in g.hit_tiers}
                ok &= g.tokens[0] == first_ref
                reused = g.reused_tokens
            best = min(range(n), key=lambda i: samples[i])  # breakdown of the fastest sample
            cases[name] = {"ttft_s": samples, "served_from": "+".join(sorted(tiers)) or "miss",
                           "reused_tokens": reused, "first_token_matches_recompute": ok,
                           "load_s": parts[best][0], "restore_s": parts[best][1], "prefill_s": parts[best][2]}

        def to_capacity() -> None:
            tm.clear_dram()
            tm.evict(keys, Tier.SSD)  # demotion path: SSD -> capacity pool (or just dropped if already there)

        measure("dram", lambda: None)
        measure("ssd", tm.clear_dram)
        measure("capacity", to_capacity)
        if not args.quick:  # a deadline shorter than the capacity pool needs: late blocks are recomputed
            deadline = cases["capacity"]["load_s"] / 2
            measure(f"capacity_timeout_{deadline * 1e3:.0f}ms", to_capacity, PrefetchPolicy("timeout", deadline), 1)
        with tm.lookup(keys, PrefetchPolicy("wait_complete")):
            pass  # promote every block (a capacity hit is written through to the SSD pool too)...
        tm.clear_dram()  # ...then leave them on the SSD pool only
        tm.close()
        t0 = time.perf_counter()
        tm = TierManager(cfg)
        out["reopen_s"] = time.perf_counter() - t0
        out["reopen_blocks"] = tm.director.resident(Tier.SSD)
        pc = PrefixCache(lm.model, lay, tm)
        measure("ssd_after_restart", tm.clear_dram)
        pools = tm.stats()["pools"]
        out["pools_after"] = {p: [{k: d[k] for k in ("drive", "read_ops", "read_bytes", "write_ops", "write_bytes",
                                                       "direct_io")} for d in ps["drives"]] for p, ps in pools.items()}
        tm.close()
    rec = statistics.median(recompute)
    for c in cases.values():
        c["median_s"] = statistics.median(c["ttft_s"])
        c["speedup_vs_recompute"] = rec / c["median_s"]
    out["cases"] = cases
    return out, compute


# ---- output -------------------------------------------------------------------------------
def print_tables(results: dict, console) -> None:
    from rich.table import Table

    tr = results.get("trace")
    if tr:
        t = Table(title=f"Trace replay: {tr['requests']:,} Mooncake conversation requests, "
                        f"{tr['distinct_blocks']:,} distinct 512-token blocks; ideal hit rate "
                        f"{tr['ideal_hit_rate']:.1%} (whole trace {tr['full_trace_ideal_hit_rate']:.1%})")
        for c in ("setup", "DRAM/SSD/cap blocks", "SSD drives", "hit DRAM", "hit SSD", "hit cap", "hit total",
                  "of ideal", "cost x", "SSD evict", "demoted", "SSD writes", "req/s"):
            t.add_column(c, justify="right" if c != "setup" else "left")
        for r in tr["runs"]:
            cb, h = r["capacity_blocks"], r["hit_rate"]
            t.add_row(r["name"], f"{cb['dram']:,}/{cb['ssd']:,}/{cb['capacity']:,}", str(r["ssd_drives"]),
                      f"{h['dram']:.1%}", f"{h['ssd']:.1%}", f"{h['capacity']:.1%}", f"{h['total']:.1%}",
                      f"{h['total'] / tr['ideal_hit_rate']:.0%}", f"{r['cost_vs_lru_1drive']:.2f}",
                      f"{r['evictions']['ssd']:,}",
                      f"{r['demotions']:,}", f"{r['writes_blocks']['ssd']:,}", f"{r['requests_per_s']:.0f}")
        t.caption = (f"cost x: provisioned capacity's price over the plain SSD drive's of the same SSD size "
                     f"(US$/GB: DRAM {tr['prices']['dram_usd_per_gb']:g}, SSD {tr['prices']['ssd_usd_per_gb']:g}, "
                     f"HDD {tr['prices']['hdd_usd_per_gb']:g}; {tr['prices']['sources']['catalog']})")
        console.print(t)
        main = [r for r in tr["runs"] if r["family"] == "kvswarm"][-1]
        base = [r for r in tr["runs"] if r["family"] == "lru-1drive"][-1]
        d = Table(title=f"Per-drive I/O: {base['name']} vs {main['name']}")
        for c in ("setup", "pool", "drive", "read ops", "read MB", "write ops", "write MB"):
            d.add_column(c, justify="right" if c not in ("setup", "pool") else "left")
        for r in (base, main):
            for x in r["drives"]:
                d.add_row(r["name"], x["pool"], x["drive"], f"{x['read_ops']:,}", f"{x['read_bytes'] / 1e6:.1f}",
                          f"{x['write_ops']:,}", f"{x['write_bytes'] / 1e6:.1f}")
        console.print(d)
    tt = results.get("ttft")
    if tt:
        t = Table(title=f"TTFT, {tt['model']} ({tt['dtype']}, {tt['threads']} threads), "
                        f"{tt['prefix_tokens']}-token shared prefix ({tt['kv_bytes'] / 1e6:.0f} MB of KV)")
        for c in ("case", "served from", "reused tokens", "TTFT (median)", "load / restore / prefill (best)",
                  "speedup vs recompute", "same first token"):
            t.add_column(c, justify="left" if c in ("case", "served from") else "right")
        for name, c in tt["cases"].items():
            parts = "-" if name == "recompute" else \
                " / ".join(f"{c[k] * 1e3:.0f}" for k in ("load_s", "restore_s", "prefill_s")) + " ms"
            t.add_row(name, c["served_from"], str(c.get("reused_tokens", 0)), f"{c['median_s'] * 1e3:.0f} ms", parts,
                      f"{c['speedup_vs_recompute']:.1f}x", "-" if name == "recompute" else
                      ("yes" if c["first_token_matches_recompute"] else "NO"))
        console.print(t)
        console.print(f"SSD pool: {tt['ssd_pool']}\ncapacity pool: {tt['capacity_pool']}\n"
                      f"warm restart: reopened {tt['reopen_blocks']} blocks in {tt['reopen_s'] * 1e3:.0f} ms")


def plot(results: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    tr = results.get("trace")
    if tr:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        labels = {"lru-1drive": "plain LRU, one drive of the SSD size",
                  "lru-1drive-total": "plain LRU, one drive as large as all kvswarm tiers",
                  "lru-1drive-samecost": "plain LRU, one SSD drive costing as much as kvswarm's tiers",
                  "kvswarm": "kvswarm: DRAM (SSD/10) + SSD pool + capacity pool (3x SSD)",
                  "kvswarm-samecost": "kvswarm's tiers costing as much as the plain drive of the SSD size"}
        for fam, style in (("lru-1drive", "o--"), ("lru-1drive-total", "^:"), ("lru-1drive-samecost", "v:"),
                           ("kvswarm", "s-"), ("kvswarm-samecost", "D-")):
            rs = sorted((r for r in tr["runs"] if r["family"] == fam), key=lambda r: r["fraction"])
            if rs:
                ax.plot([r["fraction"] * 100 for r in rs], [r["hit_rate"]["total"] * 100 for r in rs], style,
                        label=labels[fam])
        ax.axhline(tr["ideal_hit_rate"] * 100, color="gray", ls=":", label=f"ideal {tr['ideal_hit_rate']:.1%}")
        ax.set_xlabel("SSD capacity (% of distinct blocks)")
        ax.set_ylabel("block hit rate (%)")
        ax.set_title(f"Mooncake conversation trace, {tr['requests']:,} requests")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        p = f"{stem}_hit_rate.png"
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    tt = results.get("ttft")
    if tt:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        names = list(tt["cases"])
        vals = [tt["cases"][n]["median_s"] * 1e3 for n in names]
        bars = ax.bar(names, vals, color=["#999"] + ["#4878d0"] * (len(names) - 1))
        for b, n in zip(bars, names):
            ax.annotate(f"{tt['cases'][n]['speedup_vs_recompute']:.1f}x", (b.get_x() + b.get_width() / 2,
                        b.get_height()), ha="center", va="bottom", fontsize=9)
        ax.set_yscale("log")
        ax.set_ylim(bottom=10)
        ax.set_ylabel("TTFT (ms, median)")
        ax.set_title(f"SmolLM2 TTFT with a {tt['prefix_tokens']}-token cached prefix")
        fig.tight_layout()
        p = f"{stem}_ttft.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def summarize(results: dict) -> dict[str, float]:
    s: dict[str, float] = {}
    tt = results.get("ttft")
    if tt:
        c = tt["cases"]
        s |= {"ttft_recompute_s": c["recompute"]["median_s"], "ttft_dram_s": c["dram"]["median_s"],
              "ttft_ssd_s": c["ssd"]["median_s"], "ttft_capacity_s": c["capacity"]["median_s"],
              "ttft_speedup_dram_vs_recompute": c["dram"]["speedup_vs_recompute"],
              "ttft_speedup_ssd_vs_recompute": c["ssd"]["speedup_vs_recompute"],
              "ttft_speedup_capacity_vs_recompute": c["capacity"]["speedup_vs_recompute"],
              "ttft_speedup_ssd_after_restart_vs_recompute": c["ssd_after_restart"]["speedup_vs_recompute"],
              "reopen_s": tt["reopen_s"],
              "first_tokens_match": float(all(v.get("first_token_matches_recompute", True) for v in c.values()))}
    tr = results.get("trace")
    if tr:
        runs = tr["runs"]
        main = max((r for r in runs if r["family"] == "kvswarm"), key=lambda r: r["fraction"])

        def at(family: str) -> dict | None:
            return next((r for r in runs if r["family"] == family and r["fraction"] == main["fraction"]), None)

        base, same, shrunk, total = at("lru-1drive"), at("lru-1drive-samecost"), at("kvswarm-samecost"), \
            at("lru-1drive-total")
        rate = {name: r["hit_rate"]["total"] for name, r in (("kv", main), ("lru", base), ("same", same),
                                                                ("shrunk", shrunk), ("total", total)) if r}
        s |= {"trace_hit_rate": rate["kv"], "trace_ideal_hit_rate": tr["ideal_hit_rate"],
              "trace_lru_1drive_hit_rate": rate["lru"],
              "trace_hit_rate_vs_lru_1drive": rate["kv"] / max(rate["lru"], 1e-9),
              "trace_fraction_of_ideal": rate["kv"] / tr["ideal_hit_rate"],
              "trace_ssd_fraction": main["fraction"],
              "trace_cost_usd_kvswarm": main["cost_usd"], "trace_cost_usd_lru_1drive": base["cost_usd"],
              "trace_cost_kvswarm_vs_lru_1drive": main["cost_vs_lru_1drive"],
              # equal cost, both ways: a plain SSD drive bought with the tiers' money ...
              "trace_lru_equal_cost_hit_rate": rate["same"],
              "trace_hit_rate_vs_lru_equal_cost": rate["kv"] / max(rate["same"], 1e-9),
              # ... and the tiers shrunk to the plain SSD drive's money
              "trace_kvswarm_at_lru_cost_hit_rate": rate["shrunk"],
              "trace_hit_rate_equal_cost_kvswarm_vs_lru": rate["shrunk"] / max(rate["lru"], 1e-9),
              "trace_wrong_bytes_served": float(sum(r["wrong_bytes_served"] for r in runs))}
        if total:
            s |= {"trace_lru_total_hit_rate": rate["total"],
                  "trace_hit_rate_vs_lru_total": rate["kv"] / max(rate["total"], 1e-9)}
        if tt:
            ttft = {t: tt["cases"][t]["median_s"] for t in ("dram", "ssd", "capacity", "recompute")}
            m = {name: modelled_ttft(r["hit_rate"], ttft) for name, r in (("kv", main), ("lru", base), ("same", same),
                                                                           ("shrunk", shrunk)) if r}
            s |= {"trace_ttft_model_kvswarm_s": m["kv"], "trace_ttft_model_lru_1drive_s": m["lru"],
                  "trace_ttft_model_lru_equal_cost_s": m["same"], "trace_ttft_model_kvswarm_at_lru_cost_s": m["shrunk"],
                  "trace_ttft_speedup_vs_lru_1drive": m["lru"] / m["kv"],
                  "trace_ttft_speedup_vs_lru_equal_cost": m["same"] / m["kv"],
                  "trace_ttft_speedup_equal_cost_kvswarm_vs_lru": m["lru"] / m["shrunk"]}
    return s


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 150)
    root = Path(tempfile.mkdtemp(prefix="kvswarm-prefix-", dir=args.dir))
    results: dict = {"command": "kvswarm bench prefix" + (" --quick" if args.quick else ""),
                     "date": time.strftime("%Y-%m-%d %H:%M:%S"), "scratch": str(root),
                     "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
    try:
        compute = None
        if not args.skip_ttft:
            results["ttft"], compute = ttft_part(args, root, console)
        if not args.skip_trace:
            results["trace"] = trace_part(args, root, console, compute)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["load_avg_end"] = os.getloadavg()  # other work on the machine skews timings: say how much
    results["summary"] = summarize(results)
    print_tables(results, console)
    for k, v in results["summary"].items():
        console.print(f"  {k}: {v:.4g}")
    console.print(f"load average (1/5/15 min) at start {results['load_avg_start']}, end {results['load_avg_end']} "
                  f"on {results['cpus']} CPUs")
    if args.json:
        write_json(args.json, results)
        stem = os.path.splitext(args.json)[0]
        for p in plot(results, stem):
            console.print(f"plot: {p}")
        console.print(f"results: {args.json}")
    if args.summary:
        settings = {k: getattr(args, k) for k in ("quick", "requests", "sizes", "payload_kib", "ssd_drives",
                                                   "capacity_drives", "prefix_tokens", "repeats", "threads",
                                                   "skip_trace", "skip_ttft")}
        tr = results.get("trace", {})
        settings |= {k: tr[k] for k in ("requests", "distinct_blocks", "prices", "cost_note") if k in tr}
        settings |= {k: results[k] for k in ("cpus", "load_avg_start", "load_avg_end")}
        write_summary(args.summary, results["command"], settings, results["summary"])
        console.print(f"summary: {args.summary}")
    return 0
