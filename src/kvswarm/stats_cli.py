"""Open an existing store and print its per-drive state and metrics.

`--scrub N` reads and verifies N objects (all with 0) first, so the table shows live latency,
throughput and any corrupt extents; `--prometheus` prints the metrics in the exposition format.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from rich.console import Console
from rich.table import Table

from kvswarm.argtypes import check_drive_paths, non_negative_int
from kvswarm.store import KVStore, StoreConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drives", nargs="+", help="the store's drive paths, in order")
    p.add_argument("--meta-dir", help="catalog directory (needed when every drive is a block device)")
    p.add_argument("--backend", choices=["threads", "uring"], default="threads")
    p.add_argument("--scrub", type=non_negative_int, default=None, metavar="N",
                   help="read and verify N random objects (0 = all) before printing")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--prometheus", action="store_true", help="print prometheus exposition text")


def drive_table(store: KVStore, seconds: float | None = None) -> Table:
    """Per-drive bytes/ops/latency table, shared by `kvswarm stats` and the demo."""
    t = Table(title="per-drive I/O")
    for col in ("drive", "kind", "health", "read ops", "read MB", "write ops", "write MB", "lat mean ms",
                "lat p99 ms", "corrupt", "errors", "free GB") + (("read MB/s",) if seconds else ()):
        t.add_column(col, justify="right")
    for s in store.stats()["drives"]:
        row = [s["drive"], s["kind"], "ok" if s["healthy"] else "FAILED", str(s["read_ops"]),
               f"{s['read_bytes'] / 1e6:.1f}", str(s["write_ops"]), f"{s['write_bytes'] / 1e6:.1f}",
               f"{s['read_lat_mean_s'] * 1e3:.2f}", f"{s['read_lat_p99_s'] * 1e3:.2f}", str(s["misses"]),
               str(s["errors"]), f"{s['free_bytes'] / 1e9:.2f}"]
        if seconds:
            row.append(f"{s['read_bytes'] / 1e6 / seconds:.0f}")
        t.add_row(*row)
    return t


def run(args: argparse.Namespace) -> int:
    from prometheus_client import generate_latest

    check_drive_paths(args.drives, args.meta_dir)
    # A follower: it writes nothing, so it is safe on a store that its engine is using right now.
    store = KVStore(StoreConfig(drives=args.drives, meta_dir=args.meta_dir, backend=args.backend, follow=True))
    try:
        seconds = None
        scrub = {}
        if args.scrub is not None:
            digests = store.digests()
            if args.scrub:
                digests = random.sample(digests, min(args.scrub, len(digests)))
            t0 = time.perf_counter()
            corrupt = store.verify(digests)
            seconds = time.perf_counter() - t0
            scrub = {"verified": len(digests), "corrupt": corrupt, "seconds": seconds}
        if args.prometheus:
            print(generate_latest(store.registry()).decode(), end="")
        elif args.json:
            print(json.dumps(store.stats() | {"scrub": scrub, "reopen_seconds": store.reopen_seconds}, indent=1))
        else:
            c = Console()
            c.print(f"{len(store)} objects on {store.num_drives} drives; catalog opened in "
                    f"{store.reopen_seconds * 1e3:.0f} ms")
            c.print(drive_table(store, seconds))
            if scrub:
                c.print(f"scrub: {scrub['verified']} objects verified in {seconds:.2f} s, {scrub['corrupt']} corrupt")
    finally:
        store.close()
    return 0
