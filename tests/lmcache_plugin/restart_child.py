"""A process of its own for the restart test: ``store N`` stores N chunks through LMCache, waits until
kvswarm reports each stored, then dies without closing anything; ``read N`` opens LMCache afresh and
reads them back.  Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

t0 = time.perf_counter()

import numpy as np  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

from kvswarm.integrations.lmcache.harness import (  # noqa: E402
    SMOLLM2,
    allocate_chunk,
    chunk_bytes,
    chunk_keys,
    kvswarm_config,
    metadata,
    obj_bytes,
    text_tokens,
)


def main() -> None:
    drives, chunk, mode, n = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    cfg = kvswarm_config(drives, chunk_size=chunk, cpu_gb=0.1, capacity_per_drive=64 << 20,
                         buffer_pool_bytes=8 << 20)
    meta = metadata(SMOLLM2, chunk_size=chunk)
    size = SMOLLM2.chunk_bytes(chunk)
    t_open = time.perf_counter()
    sm = StorageManager(cfg, meta, EventManager())
    plugin = sm.storage_backends["kvswarm"]
    keys = chunk_keys(cfg, meta, text_tokens(n * chunk, seed=11))
    if mode == "store":
        done = threading.Semaphore(0)
        objs = [allocate_chunk(sm, meta, chunk_bytes(i, size)) for i in range(n)]
        plugin.batched_submit_put_task(keys, objs, on_complete_callback=lambda k: done.release())
        stored = sum(done.acquire(timeout=30) for _ in keys)
        print(json.dumps({"stored": stored}), flush=True)
        os._exit(0)  # killed: no close, no catalog checkpoint
    contains = plugin.batched_contains(keys)
    got = sm.batched_get(keys, location="kvswarm")
    t_hit = time.perf_counter()
    wrong = sum(int(np.count_nonzero(obj_bytes(g) != chunk_bytes(i, size))) for i, g in enumerate(got) if g is not None)
    print(json.dumps({"contains": contains, "hits": sum(g is not None for g in got), "wrong": wrong,
                      "seconds_to_hit": t_hit - t_open, "seconds_with_imports": t_hit - t0}), flush=True)
    sm.close()


if __name__ == "__main__":
    main()
