"""Child process for test_crash: writes, overwrites, deletes and flushes until killed.

After each flush returns it prints `FLUSHED <round>` so the parent knows which state is durable.
Payloads are a pure function of (key, version), so any object read back can be checked.
"""

import sys

import numpy as np

from kvswarm import KVStore

FLUSH_EVERY = 3


def payload(key: int, version: int) -> bytes:
    rng = np.random.default_rng(key * 1_000_003 + version)
    return rng.bytes(int(rng.integers(1, 40_000)))


def state_after(rnd: int, nkeys: int) -> dict[int, int | None]:
    """Which version of each key is live after round ``rnd`` (None = deleted / never written)."""
    live: dict[int, int | None] = {}
    for r in range(max(rnd + 1, 0)):
        for k, op in ops(r, nkeys):
            live[k] = r if op == "put" else None
    return live


def ops(rnd: int, nkeys: int) -> list[tuple[int, str]]:
    rng = np.random.default_rng(rnd)
    keys = rng.choice(nkeys, size=12, replace=False)
    return [(int(k), "del" if rng.random() < 0.15 else "put") for k in keys]


def main() -> None:
    paths, backend, nkeys, start = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    s = KVStore.open(paths, backend=backend, capacity_per_drive=64 << 20, buffer_pool_bytes=16 << 20,
                     checkpoint_every=200, stripe_unit=16384)
    rnd = start
    while True:
        batch = ops(rnd, nkeys)
        s.put_many([(b"key%d" % k, payload(k, rnd)) for k, op in batch if op == "put"])
        for k, op in batch:
            if op == "del":
                s.delete(b"key%d" % k)
        if rnd % FLUSH_EVERY == 0:
            s.flush()
            print(f"FLUSHED {rnd}", flush=True)
        rnd += 1


if __name__ == "__main__":
    main()
