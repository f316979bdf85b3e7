"""`kvswarm bench vllm` end to end at toy sizes (figures are the benchmark's job, not asserted here)."""

from __future__ import annotations

import json

from kvswarm.bench.vllm_bench import main


def test_bench_vllm_runs_and_reports(tmp_path):
    out = tmp_path / "vllm.json"
    rc = main(["--block-sizes", "64", "--restore-mib", "4", "--lookup-blocks", "128",
               "--rounds", "1", "--no-testbed", "--dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    s = r["summary"]
    for key in ("restore_ratio_vs_raw_64k", "raw_gbps_64k", "fs_restore_gbps_64k", "kvswarm_restore_gbps_64k",
                "restart_lookup_speedup_vs_fs"):
        assert s[key] > 0, key
    assert r["restart"]["kvswarm"]["hits"] == r["restart"]["fs"]["hits"] == 128
    assert (tmp_path / "vllm.png").stat().st_size > 0
