"""One SGLang server's HiCache backend on a cluster node (for test_cluster.py), through SGLang's own
backend factory and a real MHA host pool.

    python cluster_backend.py prefill|decode|restart|reopen DRIVE_DIR CLUSTER_JSON

``prefill``: stores 6 pages of a host pool filled from seed 0 (``batch_set_v1``), prints a JSON line
and stays in the cluster (its DRAM segment holds what it published) until stdin closes.  ``decode``:
a backend on empty drives starts, waits for a line on stdin (the prefill backend is done), then asks ``batch_exists`` and ``batch_get_v1`` for the same keys (zero-copy
runs into another pool) and the generic ``batch_get`` (flat copies), compares the bytes with the
seed-0 pages, and prints a JSON line.  ``restart``: stores the 6 pages and prints a JSON line, waits for a
line on stdin (the master has been restarted meanwhile: its index is empty), then waits until the
cluster holds the 6 again (re-published from the drives, with no call of SGLang's) and prints a
second line; at the next line it closes the backend and prints a third, and at the next (the master
restarted once more) it opens a new backend on the same drives, waits until the cluster holds the 6
again (re-published at start) and prints a fourth.
"""

from __future__ import annotations

import json
import sys

import time

from kvswarm.format import extent_size, key_digest
from kvswarm.integrations.sglang_cpu import allow_cpu_import

allow_cpu_import()

import sglang.srt.mem_cache.pool_host.base as pool_base  # noqa: E402
import torch  # noqa: E402

# The host pools here are a few MB; SGLang keeps 10 GiB of the machine's free memory for the rest of
# a server, which would make this test depend on what else runs on the machine.
pool_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
from test_backend import PAGE, host_pool, open_backend, page_data, pages  # noqa: E402

N = 6
REPUBLISH_WAIT_S = 60


def republished(b, keys: list[str], want: list[torch.Tensor], before: int) -> dict:
    """Wait (bounded) until the cluster holds every page of ``keys`` and the backend counted them
    re-published (``republished_blocks`` is counted when the re-publication collects them), then
    fetch them back from the cluster and compare their bytes with ``want``."""
    digests = [key_digest(b.keyspace.key(k)) for k in keys]
    pool, t0, found = b.cluster, time.monotonic(), 0
    while time.monotonic() - t0 < REPUBLISH_WAIT_S:
        found = sum(pool.contains(digests))
        if found == len(keys) and pool.counters["republished_blocks"] - before >= len(keys):
            break
        time.sleep(0.1)
    seconds = time.monotonic() - t0
    got = pool.fetch(digests, want[0].numel() * want[0].element_size())
    try:
        equal = all(v is not None and bytes(v) == w.view(-1).view(torch.uint8).numpy().tobytes()
                    for v, w in zip(got.views, want))
    finally:
        got.release()
    return {"indexed": found, "republished": pool.counters["republished_blocks"] - before, "seconds": seconds,
            "equal": equal}


def main(role: str, drive: str, cluster: str) -> None:
    cfg = json.loads(cluster)
    keys = [f"c{i:04d}" for i in range(N)]
    src = host_pool("page_first", seed=0)
    want = page_data(src, pages(src, 0, N), N)
    if role == "restart":
        # A buffer pool of 4 pages' leases: a re-publication batch (a quarter of it) holds one page, and
        # the rest of each republish_batch taken goes back.
        small = 4 * extent_size(want[0].numel() * want[0].element_size())
        b = open_backend([drive], src, cluster=cfg, buffer_pool_bytes=small)
        out = {"set": b.batch_set_v1(keys, pages(src, 0, N))}
        b.cluster.drain(30)
        out["indexed"] = sum(b.cluster.contains([key_digest(b.keyspace.key(k)) for k in keys]))
        print(json.dumps(out), flush=True)
        before = b.cluster.counters["republished_blocks"]
        sys.stdin.readline()  # the master has been restarted
        print(json.dumps(republished(b, keys, want, before)), flush=True)
        sys.stdin.readline()
        t0 = time.monotonic()
        b.close()  # stops the re-publication thread
        print(json.dumps({"close_s": time.monotonic() - t0}), flush=True)
        sys.stdin.readline()  # restarted again: no node holds the pages in the cluster, and the master knows none
        b = open_backend([drive], host_pool("page_first", seed=1), cluster=cfg, buffer_pool_bytes=small)
        print(json.dumps({"local": len(b.store)} | republished(b, keys, want, 0)), flush=True)
        b.close()
        return
    if role == "prefill":
        b = open_backend([drive], src, cluster=cfg)
        out = {"set": b.batch_set_v1(keys, pages(src, 0, N)), "exists": b.batch_exists(keys)}
        b.cluster.drain(30)
        out["counters"] = dict(b.cluster.counters)
        print(json.dumps(out), flush=True)
        sys.stdin.read()
        b.close()
        return
    pool = host_pool("page_first", seed=1)  # other bytes everywhere until the pages land
    b = open_backend([drive], pool, cluster=cfg)
    sys.stdin.readline()
    out = {"local_before": len(b.store), "exists": b.batch_exists(keys + ["never"])}
    dst = pages(pool, 10, N)
    out["get_v1"] = b.batch_get_v1(keys, dst)
    out["v1_equal"] = all(torch.equal(g, w) for g, w in zip(page_data(pool, dst, N), want))
    out["fetched_after_v1"] = b.cluster.counters["fetched_blocks"]
    out["local_after"] = len(b.store)  # promoted into this rank's drives
    flat = b.batch_get(keys)  # now from the drives
    out["generic_equal"] = all(t is not None and torch.equal(t.view(-1), w.view(-1)) for t, w in zip(flat, want))
    out["counters"] = dict(b.cluster.counters)
    out["page"] = PAGE
    print(json.dumps(out), flush=True)
    b.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
