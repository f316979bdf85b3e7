"""`kvswarm bench sglang` end to end at toy sizes (figures are the benchmark's job, not asserted here)."""

from __future__ import annotations

import json

from kvswarm.bench.sglang_bench import main


def test_bench_sglang_runs_checks_and_reports(tmp_path):
    out = tmp_path / "sglang.json"
    assert main(["--pages", "6", "--rounds", "1", "--engine-load", "3/1", "--dir", str(tmp_path),
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    s = r["summary"]
    for layout in ("layer_first", "page_first"):
        for load in ("none", "3of1"):
            for what in ("backup", "restore"):
                for name in ("file", "kvswarm"):
                    assert s[f"sglang_{layout}_load_{load}_{name}_{what}_gbps"] > 0
                assert s[f"sglang_{layout}_load_{load}_{what}_speedup_vs_file"] > 0
    assert r["layouts"]["page_first"]["page_bytes"] == 30 * 2 * 64 * 3 * 64 * 2
    assert list(tmp_path.iterdir()) == [out]  # scratch directories removed
