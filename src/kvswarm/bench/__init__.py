"""Benchmarks: each runs the baseline and kvswarm in one run on the same data and prints the ratio."""

import json
import os


def write_json(path: str, results: dict) -> None:
    """A benchmark's results as JSON at ``path``, its folder made if need be (``results/`` is not in
    the repository: a fresh clone has none)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=float)
