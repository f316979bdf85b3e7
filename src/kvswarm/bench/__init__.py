"""Benchmarks: each runs the baseline and kvswarm in one run on the same data and prints the ratio."""

import json
import os


def write_json(path: str, results: dict) -> None:
    """A benchmark's results as JSON at ``path``, its folder made if need be (``results/`` is not in
    the repository: a fresh clone has none)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=float)


def write_summary(path: str, command: str, settings: dict, summary: dict) -> None:
    """The small record of a run kept as evidence (``benchmarks/results/<bench>-<date>.json``): the
    command, its settings and its summary figures, none of the per-round detail of ``--json``."""
    import time

    write_json(path, {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": settings,
                      "summary": summary})
