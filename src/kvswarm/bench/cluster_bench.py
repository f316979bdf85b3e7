"""Across nodes: kvswarm's cluster level on Mooncake Store, side by side in one run.

Every process of the run (Mooncake masters, the prefill node, bare Mooncake clients and this
benchmark, which is node B) runs inside one network namespace of its own (``unshare -n``; only
loopback exists there): the command re-runs itself there when started outside one.  Nodes are
separate processes talking Mooncake's Transfer Engine over TCP on 127.0.0.1.

1. **TTFT on node B** for a ``--prefix-tokens`` real-text prefix (Python's pydoc prose) plus a
   short question that node A (another process) prefilled and published: (a) recompute, a plain
   transformers prefill of the whole prompt; (b) cluster, B's tiers empty, the prefix fetched
   from A's DRAM segment (B lends none, so every byte crosses the wire); (c) B's local SSD pool,
   after (b) promoted the blocks there and B's DRAM was emptied.  First tokens are checked
   against recompute's.  Target: cluster >= 10x faster than recompute.
2. **Fetch throughput** of the same prefix blocks: the cluster level (Mooncake TCP, framed and
   checksummed, verified), the same bytes from B's local kvswarm SSD pool (O_DIRECT), and
   Mooncake alone (a bare client process, ``batch_get_into`` a registered buffer, no checks).
   Every cluster-fetched block is compared byte for byte with the local copy (``wrong_bytes``).
3. **Writing 3x the DRAM pool**: a node lends a ``--dram-mib`` segment and writes 3x that in
   256 KiB objects, then reads them all back.  Mooncake's own SSD offload (master
   ``--enable_offload --offload_on_evict``, client offload directory on the same disk; each put
   retried for up to 0.25 s while the pool is full) against kvswarm's level (the same node's
   tiers: DRAM of the same size, its SSD pool on the same disk, write-through).  The share of
   objects readable afterwards (each checked against what was written) and read GB/s.
4. **Cluster warm restart**: a node holds ``--restart-blocks`` blocks on its drives and in the
   cluster; the master is killed and restarted (its index empty); the time from the restart
   until every block is found in the cluster again (the node rejoins, notices, re-publishes
   from its durable pool).

Ratios compare sides measured in this one run, on the same data, machine and disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvswarm.bench import write_json
from kvswarm.cluster import netns
from kvswarm.cluster.wire import FRAME_BYTES

MiB = 1 << 20
MASTER_PORT, OFFLOAD_PORT, RESTART_PORT = 50051, 50061, 50071


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer repeats (CI-sized)")
    p.add_argument("--json", metavar="FILE", help="write the JSON summary here")
    p.add_argument("--dir", help="scratch directory for drives (default: a temp dir)")
    p.add_argument("--prefix-tokens", type=int, default=4096)
    p.add_argument("--dram-mib", type=int, default=64, help="DRAM pool of part 3 (MiB)")
    p.add_argument("--restart-blocks", type=int, default=100_000)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--role", help=argparse.SUPPRESS)  # a helper process of this benchmark
    p.add_argument("--spec", help=argparse.SUPPRESS)


# ---- helpers -------------------------------------------------------------------------------
def _argv(args) -> list[str]:
    out = ["bench", "cluster", "--prefix-tokens", str(args.prefix_tokens), "--dram-mib", str(args.dram_mib),
           "--restart-blocks", str(args.restart_blocks), "--threads", str(args.threads)]
    out += ["--quick"] if args.quick else []
    out += ["--json", os.path.abspath(args.json)] if args.json else []
    out += ["--dir", os.path.abspath(args.dir)] if args.dir else []
    return out


def _helper(role: str, spec: dict, stdin=subprocess.PIPE) -> subprocess.Popen:
    env = dict(os.environ, GLOG_minloglevel="2")
    return subprocess.Popen([sys.executable, "-m", "kvswarm.bench.cluster_bench", "--role", role,
                             "--spec", json.dumps(spec)], stdin=stdin, stdout=subprocess.PIPE, text=True, env=env)


def _reply(p: subprocess.Popen, timeout: float = 1800) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"helper {p.args[5]} exited with {p.wait()}")
        if line.startswith("{"):
            return json.loads(line)
    raise TimeoutError("helper did not answer")


def _say(d: dict) -> None:
    print(json.dumps(d), flush=True)


def _cluster_cfg(port: int, **kw):
    from kvswarm.cluster import ClusterConfig

    return ClusterConfig(master=f"127.0.0.1:{port}", **kw)


def _prompt(tok, n: int) -> list[int]:
    from kvswarm.corpus import make_document

    prefix = list(make_document(tok, n, seed=0, source="pydoc").prompt_ids)
    return prefix + tok("\n\nQuestion: what is this about?\nAnswer:", add_special_tokens=False)["input_ids"]


def _tiers(drive: Path, block: int, dram: int, cluster=None, ssd_bytes: int = 2 << 30):
    from kvswarm.tiers import PrefetchPolicy
    from kvswarm.tiers.manager import TierConfig, TierManager
    from kvswarm.tiers.pools import PoolConfig

    drive.mkdir(parents=True, exist_ok=True)
    return TierManager(TierConfig(block_bytes=block, dram_bytes=dram, cluster=cluster,
                                  ssd=PoolConfig([str(drive)], capacity_per_drive=ssd_bytes,
                                                 buffer_pool_bytes=256 * MiB),
                                  prefetch=PrefetchPolicy("wait_complete")))


def _pattern_block(key: bytes, i: int, kv: int) -> bytearray:
    import numpy as np

    from kvswarm.prefix import new_block

    buf, view = new_block(key, b"bench-cluster-ns", 16, i, kv)
    view[:] = np.random.default_rng(i).integers(0, 256, kv, np.uint8).tobytes()
    return buf


# ---- helper roles (separate processes) ----------------------------------------------------
def role_prefill(spec: dict) -> None:
    """Node A: prefill the prompt, publish its blocks, stay up (its segment holds them)."""
    import torch

    from kvswarm.integrations.transformers_prefix import PrefixCache
    from kvswarm.model import load_default_model
    from kvswarm.prefix import HEADER_BYTES

    torch.set_num_threads(spec["threads"])
    lm = load_default_model()
    prompt = _prompt(lm.tokenizer, spec["prefix_tokens"])
    cfg = _cluster_cfg(MASTER_PORT, segment_bytes=spec["segment"], publish="all")
    tm = _tiers(Path(spec["dir"]), HEADER_BYTES + lm.layout.block_bytes, 64 * MiB, cfg)
    pc = PrefixCache(lm.model, lm.layout, tm)
    g = pc.generate(prompt, 1)
    tm.flush()  # waits for the publications
    _say({"prefill_s": g.ttft_s, "first_token": g.tokens[0], "published": tm.cluster.counters["published_blocks"]})
    sys.stdin.read()
    tm.close()


def role_raw_fetch(spec: dict) -> None:
    """Mooncake alone: a bare client fetching the given objects into a registered buffer."""
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    mc = MooncakeDistributedStore()
    assert mc.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 * MiB, "tcp", "", f"127.0.0.1:{MASTER_PORT}") == 0
    keys, size, chunk = spec["keys"], spec["size"], spec["chunk"]
    buf = np.zeros(size * chunk, np.uint8)
    mc.register_buffer(buf.ctypes.data, buf.nbytes)
    ptrs = [buf.ctypes.data + i * size for i in range(chunk)]
    samples, moved = [], 0
    for _ in range(spec["repeats"]):
        t0, moved = time.perf_counter(), 0
        for i in range(0, len(keys), chunk):
            ks = keys[i:i + chunk]
            moved += sum(max(0, n) for n in mc.batch_get_into(ks, ptrs[:len(ks)], [size] * len(ks)))
        samples.append(time.perf_counter() - t0)
    mc.close()
    _say({"bytes": moved, "seconds": samples})


def role_offload(spec: dict) -> None:
    """Mooncake's own SSD offload: write 3x the DRAM pool, read everything back."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"] = spec["dir"]
    mc = MooncakeDistributedStore()
    assert mc.setup("127.0.0.1", "P2PHANDSHAKE", spec["segment"], 64 * MiB, "tcp", "", f"127.0.0.1:{OFFLOAD_PORT}",
                    None, True, spec["dir"]) == 0
    rc_cfg = ReplicateConfig()
    n, size = spec["objects"], spec["size"]
    refused = 0
    t0 = time.perf_counter()
    for i in range(n):
        v = bytes(_pattern_block(f"o{i}".encode().ljust(16, b"."), i, size - 64))
        deadline = time.monotonic() + 0.25
        while (rc := mc.put(f"o{i}", v, rc_cfg)) != 0 and time.monotonic() < deadline:
            time.sleep(0.02)  # the pool is full: give eviction / offload a moment
        refused += rc != 0
    put_s = time.perf_counter() - t0
    time.sleep(2.0)  # let a pending offload finish
    t0 = time.perf_counter()  # the reads, checked after the clock stops
    got = {i: v for i in range(n) if (v := mc.get(f"o{i}"))}
    get_s = time.perf_counter() - t0
    nbytes = sum(map(len, got.values()))
    readable = sum(v == bytes(_pattern_block(f"o{i}".encode().ljust(16, b"."), i, size - 64)) for i, v in got.items())
    wrong = len(got) - readable
    on_disk = sum(f.stat().st_size for f in Path(spec["dir"]).rglob("*") if f.is_file())
    mc.close()
    _say({"objects": n, "refused_puts": refused, "readable": readable, "wrong": wrong, "put_s": put_s,
          "read_gbps": nbytes / get_s / 1e9 if get_s else 0.0, "offload_dir_bytes": on_disk})


def role_restart(spec: dict) -> None:
    """A node with many small blocks on its drive and in the cluster; once the bench has restarted
    the master (a line on stdin), the time until every block is found in the cluster again."""
    import random

    import xxhash

    from kvswarm.format import key_digest

    n, block = spec["blocks"], spec["block"]
    cfg = _cluster_cfg(RESTART_PORT, segment_bytes=spec["segment"], fetch_buffer_bytes=16 * MiB,
                       republish_batch=4096, check_interval_s=0.2)
    tm = _tiers(Path(spec["dir"]), block, 16 * MiB, cfg, ssd_bytes=spec["ssd_bytes"])
    keys = [xxhash.xxh3_128_digest(b"restart:%d" % i) for i in range(n)]
    digests = [key_digest(k) for k in keys]
    t0 = time.perf_counter()
    for i in range(0, n, 1024):
        tm.insert(keys[i:i + 1024], [_pattern_block(k, j, block - 64) for j, k in enumerate(keys[i:i + 1024], i)])
    tm.flush()
    insert_s = time.perf_counter() - t0

    def found() -> int:
        return sum(sum(tm.cluster.contains(digests[i:i + 8192])) for i in range(0, n, 8192))

    _say({"inserted": n, "insert_s": insert_s, "found_before": found()})
    sys.stdin.readline()  # the master has been restarted
    t0 = time.perf_counter()
    deadline, have = time.monotonic() + spec["timeout"], 0
    while time.monotonic() < deadline:
        if not tm.maintain(4096):
            have = found()
            if have == n:
                break
            time.sleep(0.05)
    took = time.perf_counter() - t0
    while tm.republishing and time.monotonic() < deadline:  # its publications collected and counted
        tm.maintain(4096)
        time.sleep(0.01)
    sample = random.Random(0).sample(range(n), min(1000, n))
    wrong = 0
    r = tm.cluster.fetch([digests[i] for i in sample], block)
    for i, v in zip(sample, r.views):
        if v is not None:
            ref = _pattern_block(keys[i], i, block - 64)
            wrong += sum(a != b for a, b in zip(bytes(v), ref)) if bytes(v) != ref else 0
    fetched = sum(v is not None for v in r.views)
    r.release()
    _say({"found": have, "seconds": took, "republished": tm.cluster.counters["republished_blocks"],
          "sample_fetched": fetched, "sample_wrong_bytes": wrong})
    tm.close()


ROLES = {"prefill": role_prefill, "raw_fetch": role_raw_fetch, "offload": role_offload, "restart": role_restart}


# ---- the parts, run in node B (this process) ---------------------------------------------
def part_ttft_and_fetch(args, root: Path, out: dict) -> None:
    import torch

    from kvswarm.format import key_digest
    from kvswarm.integrations.transformers_prefix import PrefixCache
    from kvswarm.model import load_default_model
    from kvswarm.prefix import HEADER_BYTES
    from kvswarm.tiers import Tier

    torch.set_num_threads(args.threads)
    reps = 1 if args.quick else 3
    lm = load_default_model()
    prompt = _prompt(lm.tokenizer, args.prefix_tokens)
    block = HEADER_BYTES + lm.layout.block_bytes
    nblocks = args.prefix_tokens // lm.layout.tokens_per_block
    kv_bytes = nblocks * block
    a = _helper("prefill", {"threads": args.threads, "prefix_tokens": args.prefix_tokens, "dir": str(root / "a"),
                            "segment": kv_bytes + 256 * MiB})
    try:
        ra = _reply(a)
        with torch.inference_mode():  # (a) recompute
            lm.model(input_ids=torch.tensor([prompt[:64]]))  # warm-up
            recompute = []
            for _ in range(reps):
                t0 = time.perf_counter()
                first_ref = int(lm.model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
                recompute.append(time.perf_counter() - t0)
        cfg = _cluster_cfg(MASTER_PORT, segment_bytes=0, publish="none", fetch_buffer_bytes=kv_bytes + 64 * MiB)
        cases: dict[str, dict] = {"recompute": {"ttft_s": recompute, "first_token_matches": True}}

        def measure(name: str, pc, prepare, want: str, n: int) -> None:
            samples, ok, tiers, reused = [], True, set(), 0
            for _ in range(n):
                prepare()
                g = pc.generate(prompt, 1, store=False)
                samples.append(g.ttft_s)
                ok &= g.tokens[0] == first_ref
                tiers |= {t.name.lower() for t in g.hit_tiers}
                reused = g.reused_tokens
            cases[name] = {"ttft_s": samples, "first_token_matches": ok, "served_from": "+".join(sorted(tiers)),
                           "reused_tokens": reused}
            if tiers != {want}:
                raise RuntimeError(f"{name}: served from {tiers}, not {want}")

        tm = None
        for r in range(reps):  # (b) cluster: B's tiers empty each time
            if tm is not None:
                tm.close()
            tm = _tiers(root / f"b{r}", block, kv_bytes + 8 * block, cfg)
            pc = PrefixCache(lm.model, lm.layout, tm)
            measure("cluster" if r == 0 else "_cluster", pc, lambda: None, "cluster", 1)
            if r:
                cases["cluster"]["ttft_s"] += cases.pop("_cluster")["ttft_s"]
        measure("local_ssd", pc, tm.clear_dram, "ssd", reps)  # (c) promoted into B's SSD pool by (b)

        # 2. fetch throughput of the same blocks
        digests = [key_digest(k) for k in pc.reusable_keys(prompt)][:nblocks]
        ssd, chunk = tm.stores[Tier.SSD], 16
        cl_s, lo_s, wrong = [], [], 0
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            hs = [tm.cluster.submit_fetch(digests[i:i + chunk], block) for i in range(0, nblocks, chunk)]
            got = [h.wait() for h in hs]
            cl_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hl = [ssd.submit_get_digests(digests[i:i + chunk]) for i in range(0, nblocks, chunk)]
            loc = [h.wait() for h in hl]
            lo_s.append(time.perf_counter() - t0)
            for g, lr in zip(got, loc):
                for v, w in zip(g.views, lr.views):
                    if v is None or w is None or bytes(v) != bytes(w):
                        wrong += block if v is None or w is None else sum(x != y for x, y in zip(bytes(v), bytes(w)))
                g.release()
                lr.release()
        raw = _helper("raw_fetch", {"keys": [tm.cluster.object_key(d) for d in digests], "size": block + FRAME_BYTES,
                                    "chunk": chunk, "repeats": reps + 1}, stdin=subprocess.DEVNULL)
        rr = _reply(raw)
        raw.wait(60)
        tm.close()
    finally:
        a.stdin.close()
        a.wait(120)
    payload = nblocks * block
    med = statistics.median
    out["ttft"] = {"model": lm.model_id, "dtype": lm.layout.dtype, "threads": args.threads,
                   "prompt_tokens": len(prompt), "blocks": nblocks, "block_bytes": block,
                   "prefill_node_ttft_s": ra["prefill_s"], "published": ra["published"], "cases": cases}
    out["fetch"] = {"blocks": nblocks, "bytes": payload, "chunk_blocks": chunk,
                    "cluster_s": cl_s, "local_s": lo_s, "mooncake_alone_s": rr["seconds"],
                    "mooncake_alone_bytes": rr["bytes"], "wrong_bytes": wrong}
    out["summary"] |= {
        "ttft_recompute_s": med(recompute), "ttft_cluster_s": med(cases["cluster"]["ttft_s"]),
        "ttft_local_ssd_s": med(cases["local_ssd"]["ttft_s"]),
        "ttft_speedup_cluster_vs_recompute": med(recompute) / med(cases["cluster"]["ttft_s"]),
        "ttft_speedup_local_ssd_vs_recompute": med(recompute) / med(cases["local_ssd"]["ttft_s"]),
        "first_tokens_match": all(c["first_token_matches"] for c in cases.values()),
        "cluster_fetch_gbps": payload / med(cl_s) / 1e9, "local_fetch_gbps": payload / med(lo_s) / 1e9,
        "mooncake_alone_fetch_gbps": rr["bytes"] / med(rr["seconds"]) / 1e9,
    }
    out["wrong_bytes"] += wrong


def part_flushed(args, root: Path, out: dict) -> None:
    from kvswarm.cluster.master import MasterProcess

    size = 256 << 10
    dram = args.dram_mib * MiB
    n = 3 * dram // size
    off_dir = root / "mooncake-offload"
    off_dir.mkdir(parents=True, exist_ok=True)
    with MasterProcess(port=OFFLOAD_PORT, metrics_port=OFFLOAD_PORT + 1, log_path=root / "offload-master.log",
                       extra=["--enable_offload=true", "--offload_on_evict=true"]):
        p = _helper("offload", {"dir": str(off_dir), "segment": dram, "objects": n, "size": size},
                    stdin=subprocess.DEVNULL)
        mc = _reply(p)
        p.wait(60)
    with MasterProcess(port=MASTER_PORT, metrics_port=MASTER_PORT + 1, log_path=root / "flush-master.log"):
        import xxhash

        tm = _tiers(root / "kvs-flush", size, dram, _cluster_cfg(MASTER_PORT, segment_bytes=dram,
                                                                 fetch_buffer_bytes=32 * MiB))
        keys = [xxhash.xxh3_128_digest(b"flush:%d" % i) for i in range(n)]
        t0 = time.perf_counter()
        for i in range(0, n, 32):
            tm.insert(keys[i:i + 32], [_pattern_block(k, j, size - 64) for j, k in enumerate(keys[i:i + 32], i)])
        tm.flush()
        put_s = time.perf_counter() - t0
        tm.clear_dram()
        tiers: dict[str, int] = {}
        got: dict[int, bytes] = {}
        t0 = time.perf_counter()  # the reads (copied out), checked after the clock stops
        for i in range(0, n, 16):
            hit = tm.lookup(keys[i:i + 16])
            for j, (v, t) in enumerate(zip(hit.views, hit.tiers), i):
                got[j] = bytes(v)
                tiers[t.name.lower()] = tiers.get(t.name.lower(), 0) + 1
            hit.release(promote=False)
        get_s = time.perf_counter() - t0
        tm.close()
        nbytes = sum(map(len, got.values()))
        ok = [j for j, v in got.items() if v == bytes(_pattern_block(keys[j], j, size - 64))]
        readable, wrong = len(ok), (len(got) - len(ok)) * size
    out["flushed"] = {"dram_pool_bytes": dram, "object_bytes": size, "objects": n,
                      "mooncake_offload": mc | {"master_flags": "--enable_offload=true --offload_on_evict=true"},
                      "kvswarm": {"readable": readable, "put_s": put_s, "read_gbps": nbytes / get_s / 1e9,
                                  "served_from": tiers, "wrong_bytes": wrong}}
    out["summary"] |= {"flushed_readable_kvswarm": readable / n,
                       "flushed_readable_mooncake_offload": mc["readable"] / n,
                       "flushed_read_gbps_kvswarm": nbytes / get_s / 1e9,
                       "flushed_read_gbps_mooncake_offload": mc["read_gbps"]}
    out["wrong_bytes"] += wrong + mc["wrong"] * size


def part_restart(args, root: Path, out: dict) -> None:
    from kvswarm.cluster.master import MasterProcess
    from kvswarm.format import HEADER_SIZE

    n = args.restart_blocks
    block = 4096 - HEADER_SIZE  # one 4 KiB extent per block
    m = MasterProcess(port=RESTART_PORT, metrics_port=RESTART_PORT + 1, log_path=root / "restart-master.log",
                      client_ttl_s=5).start()
    p = None
    try:
        p = _helper("restart", {"blocks": n, "block": block, "dir": str(root / "restart"),
                                "segment": n * (block + 64) * 3 // 2 + 64 * MiB,
                                "ssd_bytes": n * 4096 * 5 // 4 + 64 * MiB,
                                "timeout": 600})
        ready = _reply(p)
        m.stop(kill=True)
        m.start()
        p.stdin.write("restarted\n")
        p.stdin.flush()
        done = _reply(p)
        p.stdin.close()
        p.wait(120)
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        m.stop(kill=True)
    out["restart"] = {"blocks": n, "block_bytes": block} | ready | done
    key = f"restart_republish_s_{n // 1000}k" if n % 1000 == 0 else f"restart_republish_s_{n}"
    out["summary"][key] = done["seconds"] if done["found"] == n else None
    out["summary"]["restart_found"] = done["found"]
    out["wrong_bytes"] += done["sample_wrong_bytes"]


def run(args: argparse.Namespace) -> int:
    if args.role:
        ROLES[args.role](json.loads(args.spec))
        return 0
    if not netns.private():  # every process of the run goes into a network namespace of its own
        return netns.rerun_private(_argv(args))
    from kvswarm.cluster.master import MasterProcess

    os.environ.setdefault("GLOG_minloglevel", "2")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvswarm-cluster-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    out: dict = {"bench": "cluster", "quick": args.quick,
                 "setting": "every process in one private network namespace (loopback only); Mooncake Store "
                            "0.3.13 (CPU build), TCP on 127.0.0.1; drives are directories on this machine's disk "
                            "(O_DIRECT), no throttle",
                 "summary": {}, "wrong_bytes": 0}
    try:
        with MasterProcess(port=MASTER_PORT, metrics_port=MASTER_PORT + 1, log_path=root / "master.log"):
            part_ttft_and_fetch(args, root, out)
        part_flushed(args, root, out)
        part_restart(args, root, out)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    out["summary"]["wrong_bytes"] = out["wrong_bytes"]
    for k, v in out["summary"].items():
        print(f"{k:42s} {v:.3f}" if isinstance(v, float) else f"{k:42s} {v}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
