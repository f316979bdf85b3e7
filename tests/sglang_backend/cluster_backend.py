"""One SGLang server's HiCache backend on a cluster node (for test_cluster.py), through SGLang's own
backend factory and a real MHA host pool.

    python cluster_backend.py prefill|decode DRIVE_DIR CLUSTER_JSON

``prefill``: stores 6 pages of a host pool filled from seed 0 (``batch_set_v1``), prints a JSON line
and stays in the cluster (its DRAM segment holds what it published) until stdin closes.  ``decode``:
a backend on empty drives starts, waits for a line on stdin (the prefill backend is done), then asks ``batch_exists`` and ``batch_get_v1`` for the same keys (zero-copy
runs into another pool) and the generic ``batch_get`` (flat copies), compares the bytes with the
seed-0 pages, and prints a JSON line.
"""

from __future__ import annotations

import json
import sys

from kvswarm.integrations.sglang_cpu import allow_cpu_import

allow_cpu_import()

import sglang.srt.mem_cache.pool_host.base as pool_base  # noqa: E402
import torch  # noqa: E402

# The host pools here are a few MB; SGLang keeps 10 GiB of the machine's free memory for the rest of
# a server, which would make this test depend on what else runs on the machine.
pool_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
from test_backend import PAGE, host_pool, open_backend, page_data, pages  # noqa: E402

N = 6


def main(role: str, drive: str, cluster: str) -> None:
    cfg = json.loads(cluster)
    keys = [f"c{i:04d}" for i in range(N)]
    src = host_pool("page_first", seed=0)
    want = page_data(src, pages(src, 0, N), N)
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
