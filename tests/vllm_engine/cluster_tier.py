"""A vLLM tier with a cluster section, through vLLM's tier interfaces (no engine), for
test_cluster_engines.py: it stores 8 chunks (published), prints a JSON line, waits for a line on stdin
(the test restarts the master meanwhile), then waits until the cluster indexes the 8 again (the tier
re-publishes them from its drives) and prints a second line.

    python cluster_tier.py DRIVE_DIR CLUSTER_JSON
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from kvswarm.format import key_digest
from kvswarm.integrations.vllm.harness import JobRunner, Primary, keys_for, make_tier, offloading_spec
from kvswarm.integrations.vllm.tier import MODULE_PATH, TIER_TYPE
from kvswarm.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", tokens_per_block=32,
                  model_id="cluster-tier-test")  # 64 KiB chunks
N = 8


def main(drive: str, cluster: str) -> None:
    primary = Primary.create(N, LAYOUT.block_bytes)
    for c in range(N):
        primary.chunk(c)[:] = np.random.default_rng(c).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
    tier = make_tier({"type": TIER_TYPE, "module_path": MODULE_PATH, "drives": [drive], "capacity_per_drive": 16 << 20,
                      "cluster": json.loads(cluster)}, primary, offloading_spec(LAYOUT, N * LAYOUT.block_bytes))
    try:
        keys = keys_for(N)
        digests = [key_digest(tier.keyspace.key(k)) for k in keys]
        stored = JobRunner(tier).run(keys, range(N), load=False).success
        tier.cluster.pool.drain(30)
        pool = tier.cluster.pool
        print(json.dumps({"stored": stored, "published": pool.counters["published_blocks"],
                          "indexed": sum(pool.contains(digests))}), flush=True)
        sys.stdin.readline()  # the master has been restarted: its index is empty
        t0 = time.monotonic()
        found = 0
        while time.monotonic() - t0 < 60:
            found = sum(pool.contains(digests))
            if found == N and pool.counters["republished_blocks"] >= N:  # counted once the tier collects them
                break
            time.sleep(0.2)
        print(json.dumps({"indexed": found, "seconds": time.monotonic() - t0,
                          "republished": pool.counters["republished_blocks"]}), flush=True)
    finally:
        tier.shutdown()
        primary.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
