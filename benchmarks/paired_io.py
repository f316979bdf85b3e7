"""Paired ``kvswarm bench io`` runs of two git revisions, alternating, on one machine.

A code move must not cost speed; a single run of each side cannot show that (the disk drifts by
10% between runs). This exports both revisions, builds each one's native module, then runs
``bench io`` for A, B, A, B, ... under the same interpreter and drives, and reports per key the
runs of each side and the ratio of their medians (B over A).

    python benchmarks/paired_io.py REV_A REV_B --pairs 3 --json OUT [-- extra bench io args]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("ratio", "store_gbps", "raw_gbps", "store_cpu_s_per_gb", "write_ratio", "store_write_gbps")


def export(rev: str, into: Path) -> Path:
    """Extract ``rev``'s tree into ``into`` and build its native module in place."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=into, check=True,
                   capture_output=True)
    return into


def run_once(tree: Path, out: Path, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    subprocess.run([sys.executable, "-m", "kvswarm.cli", "bench", "io", "--quick", "--json", str(out), *extra],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json", required=True)
    ap.add_argument("extra", nargs="*", help="arguments passed to bench io (after --)")
    args = ap.parse_args()
    revs = {side: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                                 capture_output=True, text=True).stdout.strip()
            for side, rev in (("a", args.rev_a), ("b", args.rev_b))}
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = []
    with tempfile.TemporaryDirectory(prefix="paired-io-") as tmp:
        trees = {side: export(revs[side], Path(tmp) / side) for side in "ab"}
        for i in range(args.pairs):
            for side in ("ab" if i % 2 == 0 else "ba"):
                load.append(os.getloadavg()[0])
                runs[side].append(run_once(trees[side], Path(tmp) / f"{side}{i}.json", args.extra))
                print(f"pair {i} {side} ({revs[side]}) done", flush=True)
    summary = {}
    for key in sorted(runs["a"][0]):
        if not key.startswith(KEYS) or not all(key in r for r in runs["a"] + runs["b"]):
            continue
        a = [r[key] for r in runs["a"]]
        b = [r[key] for r in runs["b"]]
        summary[key] = {f"a_{revs['a']}": a, f"b_{revs['b']}": b,
                        "b_over_a": statistics.median(b) / statistics.median(a) if statistics.median(a) else None}
    result = {"what": f"kvswarm bench io --quick, {revs['a']} vs {revs['b']}, alternating in one run",
              "command": "python benchmarks/paired_io.py " + " ".join(sys.argv[1:]),
              "date": started, "pairs": args.pairs, "load_avg_1min": load, "summary": summary}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    for key, row in summary.items():
        if key.startswith(("ratio_", "write_ratio_")):
            print(f"{key:18s} b/a {row['b_over_a']:.3f}")


if __name__ == "__main__":
    main()
