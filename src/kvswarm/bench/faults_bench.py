"""Fault campaign: the store and the CLI under crashes, power cuts, corruption, full and failing
file systems, races and bad input; every outcome counted.

* crashes: a writer process (``kvswarm.faults.writer``) killed with SIGKILL at random moments and at
  each named step (put, delete, flush, checkpoint), the store reopened and every key checked;
* power cuts: the same on a loop-mounted ext4 that is then shut down with ``EXT4_IOC_SHUTDOWN`` and
  ``EXT4_GOING_FLAGS_NOLOGFLUSH`` (unsynced data is really lost), unmounted and mounted again;
* corruption: one injector of ``kvswarm.faults.corrupt.KINDS`` at a time on a copy of one store
  (extent payloads and headers, superblocks, data files, checkpoint, journal, manifest);
* ENOSPC: full data and metadata file systems, and a drive too large for its file system;
* EIO: a loop block device whose backing file system was shut down (at open and while open), and a
  directory drive on a file system shut down while the store is open;
* races: threads writing, deleting and reading the same keys; a follower reading beside its writer;
* bad input: the API's and the CLI's (each CLI case: one line on stderr, non-zero exit, no traceback).

``summary`` counts ``wrong_bytes`` (bytes served that no write of that key wrote, or an older version
than a flush made durable), ``lost_flushed`` (a flushed object gone without a counted miss, or a store
that no longer opens after a crash), ``hangs`` (a step past its time bound), ``raw_exceptions``
(anything but kvswarm's own errors) and ``cli_tracebacks``: each must be 0.  ``injections`` counts
the faults per kind.  Needs root (loop devices, mounts).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from kvswarm.argtypes import existing_dir, non_negative_int, positive_float
from kvswarm.bench import write_json

QUICK = {"crashes": 30, "power_cuts": 10, "corruptions": 210, "enospc": 6, "eio": 6, "race_s": 3.0}
FULL = {"crashes": 60, "power_cuts": 30, "corruptions": 600, "enospc": 15, "eio": 15, "race_s": 20.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    for name in ("crashes", "power-cuts", "corruptions", "enospc", "eio"):
        p.add_argument(f"--{name}", type=non_negative_int, default=None, metavar="N",
                       help=f"how many (default {FULL[name.replace('-', '_')]}; --quick "
                            f"{QUICK[name.replace('-', '_')]})")
    p.add_argument("--race-s", type=positive_float, default=None, help="seconds of each race")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--dir", type=existing_dir, default=None, help="where to make the stores (default: temp)")
    p.add_argument("--json", default=None, help="write the results (with a 'summary') to this path")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvswarm.errors import KVSwarmError
    from kvswarm.faults.campaign import Plan, run_campaign
    from kvswarm.faults.loopfs import support
    from kvswarm.faults.outcome import MUST_BE_ZERO

    why = support()
    if why:
        raise KVSwarmError(f"bench faults needs loop-mounted file systems: {why}")
    base = QUICK if args.quick else FULL
    counts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    plan = Plan(seed=args.seed, **counts)
    console = Console(stderr=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvswarm-faults-", dir=args.dir) as root:
        tally, seconds = run_campaign(root, plan, progress=lambda part: console.print(f"[bold]{part}[/] ..."))
    summary = tally.summary()
    kinds: dict[str, int] = {}
    for name, n in tally.injections.items():
        group = name.split(":")[0]
        kinds[group] = kinds.get(group, 0) + n
    results = {
        "summary": summary | {"injections": kinds},
        "injections": dict(sorted(tally.injections.items())),
        "examples": tally.examples,
        "settings": {"plan": plan.__dict__, "quick": args.quick},
        "seconds": {k: round(v, 1) for k, v in seconds.items()} | {"total": round(time.perf_counter() - t0, 1)},
        "load_avg_1min": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Console()
    t = Table(title="fault campaign")
    t.add_column("outcome")
    t.add_column("count", justify="right")
    for k, v in summary.items():
        style = "bold red" if k in MUST_BE_ZERO and v else ""
        t.add_row(k, f"[{style}]{v}[/]" if style else str(v))
    out.print(t)
    out.print("injections: " + ", ".join(f"{k} {v}" for k, v in kinds.items()))
    for k, ex in tally.examples.items():
        for e in ex[:3]:
            out.print(f"  {k}: {e}", markup=False)
    if args.json:
        write_json(args.json, results)
        out.print(f"wrote {args.json}")
    return 0 if all(summary[k] == 0 for k in MUST_BE_ZERO) else 1
