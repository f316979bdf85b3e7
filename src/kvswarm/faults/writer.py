"""A store writer to crash: ``python -m kvswarm.faults.writer CONFIG_JSON`` puts, overwrites,
deletes, flushes and checkpoints in deterministic rounds until it is killed.

Before each step it prints ``AT <step> <round>`` (put, delete, flush, checkpoint) and after a flush
returns ``FLUSHED <round>`` (and ``CHECKPOINTED <round>`` after a checkpoint), each line flushed at
once: the parent knows which rounds may have reached the drives and which are durable, and can kill
it at a named step.  Round ``r``'s
operations are :func:`ops` ``(r)``; payloads come from :mod:`kvswarm.faults.payloads`.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvswarm.faults.payloads import key, payload
from kvswarm.store import KVStore, StoreConfig

STEPS = ("put", "delete", "flush", "checkpoint")


def ops(rnd: int, nkeys: int) -> list[tuple[int, str]]:
    """Round ``rnd``: (key number, "put" or "del") for 8 distinct keys; puts first, then deletes."""
    rng = np.random.default_rng(rnd)
    keys = rng.choice(nkeys, size=min(8, nkeys), replace=False)
    return [(int(k), "del" if rng.random() < 0.15 else "put") for k in keys]


def store_config(cfg: dict) -> StoreConfig:
    return StoreConfig(drives=cfg["drives"], meta_dir=cfg.get("meta_dir"), backend=cfg.get("backend", "threads"),
                       capacity_per_drive=cfg.get("capacity", 16 << 20), buffer_pool_bytes=8 << 20,
                       stripe_unit=16384, checkpoint_every=cfg.get("checkpoint_every", 200),
                       follow=cfg.get("follow", False))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    nkeys, rnd = cfg["nkeys"], cfg["start"]
    flush_every, ckpt_every = cfg.get("flush_every", 3), cfg.get("ckpt_every", 7)

    def at(step: str) -> None:
        print(f"AT {step} {rnd}", flush=True)

    s = KVStore(store_config(cfg))
    print("OPEN", flush=True)
    while True:
        batch = ops(rnd, nkeys)
        at("put")
        s.put_many([(key(k), payload(k, rnd)) for k, op in batch if op == "put"])
        at("delete")
        for k, op in batch:
            if op == "del":
                s.delete(key(k))
        if rnd % flush_every == 0:
            at("flush")
            s.flush()
            print(f"FLUSHED {rnd}", flush=True)
        if rnd % ckpt_every == 0:
            at("checkpoint")
            s.checkpoint()  # flushes first
            print(f"FLUSHED {rnd}", flush=True)
            print(f"CHECKPOINTED {rnd}", flush=True)
        rnd += 1


if __name__ == "__main__":
    main()
