"""Benchmarks write their --json results where asked, making the folder: a fresh clone has no results/."""

import json

from kvswarm.bench import write_json


def test_write_json_makes_the_folder_and_writes_numpy_floats(tmp_path):
    import numpy as np

    path = tmp_path / "results" / "sparse" / "run.json"
    write_json(str(path), {"ratio": np.float64(0.97), "n": 3})
    assert json.loads(path.read_text()) == {"ratio": 0.97, "n": 3}
