"""One kvswarm node for the cluster tests: a TierManager (DRAM + SSD pool + cluster level) driven
over JSON lines on stdin/stdout (see tests/cluster_net.py).

Blocks are made deterministically from (seed, index), so any node can tell the right bytes
from wrong ones: ``get`` answers which level served each block and how many were wrong.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import xxhash

from kvswarm.cluster import ClusterConfig
from kvswarm.cluster.pool import ClusterPool
from kvswarm.errors import ClusterError
from kvswarm.prefix import new_block
from kvswarm.tiers import PrefetchPolicy
from kvswarm.tiers.manager import TierConfig, TierManager
from kvswarm.tiers.pools import PoolConfig

NS = b"cluster-test-ns!"
KV_BYTES = 64 * 1024 - 64
BLOCK = KV_BYTES + 64


def key(seed: int, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{seed}:{i}".encode())


def payload(seed: int, i: int) -> bytearray:
    buf, kv = new_block(key(seed, i), NS, 16, i, KV_BYTES)
    kv[:] = np.random.default_rng([seed, i]).integers(0, 256, KV_BYTES, np.uint8).tobytes()
    return buf


class NodeServer:
    def __init__(self) -> None:
        self.tm: TierManager | None = None

    def open(self, drives: list[str], cluster: dict, dram_bytes: int = 16 << 20,
             join_timeout: float = 30.0) -> dict:
        cfg = ClusterConfig.from_dict(cluster)
        deadline = time.monotonic() + join_timeout
        while True:  # the master may still be starting
            try:
                pool = ClusterPool(cfg)
                break
            except ClusterError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        t0 = time.monotonic()
        self.tm = TierManager(TierConfig(block_bytes=BLOCK, dram_bytes=dram_bytes,
                                         ssd=PoolConfig(drives, capacity_per_drive=64 << 20),
                                         prefetch=PrefetchPolicy("wait_complete")), cluster=pool)
        self.tm.republish()
        return {"republished": self.tm.cluster.counters["republished_blocks"], "open_s": time.monotonic() - t0}

    def put(self, seed: int, n: int, start: int = 0) -> dict:
        idx = range(start, start + n)
        self.tm.insert([key(seed, i) for i in idx], [payload(seed, i) for i in idx])
        self.tm.flush()
        return {"stats": self.tm.cluster.stats()["counters"]}

    def get(self, seed: int, n: int, start: int = 0, promote: bool = True, drop_dram: bool = True) -> dict:
        if drop_dram:
            self.tm.clear_dram()
        idx = list(range(start, start + n))
        hit = self.tm.lookup([key(seed, i) for i in idx])
        tiers: dict[str, int] = {}
        wrong = 0
        for i, v, t in zip(idx, hit.views, hit.tiers):
            tiers[t.name.lower()] = tiers.get(t.name.lower(), 0) + 1
            wrong += bytes(v) != bytes(payload(seed, i))
        served = len(hit)
        hit.release(promote=promote)
        return {"served": served, "tiers": tiers, "wrong": wrong}

    def maintain(self, seconds: float) -> dict:
        """Run the node's upkeep (as its request loop would) for up to ``seconds``."""
        c = self.tm.cluster.counters
        deadline, before = time.monotonic() + seconds, c["republished_blocks"]
        while time.monotonic() < deadline:
            if not self.tm.maintain():
                time.sleep(0.1)
        return {"republished": c["republished_blocks"] - before}

    def tamper(self, seed: int, i: int, master: str, bit: int = 1000) -> dict:
        """Overwrite block ``i``'s cluster object with its frame with one bit flipped, as a corrupting
        link or a bad DIMM would leave it; with a bare Mooncake client, in a process of its own."""
        import os

        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        from kvswarm.cluster import wire
        from kvswarm.format import key_digest

        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        mc = MooncakeDistributedStore()
        assert mc.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master) == 0
        d = key_digest(key(seed, i))
        frame = wire.pack(d, payload(seed, i))
        frame[wire.FRAME_BYTES + bit // 8] ^= 1 << (bit % 8)
        rc = mc.upsert(f"kvs:{d.hex()}", frame, ReplicateConfig())
        mc.close()
        return {"rc": rc}

    def metrics(self) -> dict:
        """This node's cluster counters in the prometheus exposition format."""
        from prometheus_client import generate_latest

        return {"text": generate_latest(self.tm.cluster.registry()).decode()}

    def stats(self) -> dict:
        return self.tm.stats()["cluster"] | {"healthy": self.tm.cluster.healthy()}

    def close(self) -> dict:
        if self.tm is not None:
            self.tm.close()
        return {}


def main() -> None:
    srv = NodeServer()
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        try:
            reply = getattr(srv, cmd)(**req)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if cmd == "close":
            break


if __name__ == "__main__":
    main()
