"""`kvswarm bench lmcache` end to end at toy sizes (figures are the benchmark's job, not asserted here)."""

from __future__ import annotations

import json

from kvswarm.bench.lmcache_bench import main


def test_bench_lmcache_runs_checks_and_reports(tmp_path):
    out = tmp_path / "lmcache.json"
    assert main(["--quick", "--mib", "40", "--window", "0", "--restart-chunks", "48", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    s = r["summary"]
    for k in ("retrieve_ratio_vs_lmcache_disk_1drive", "retrieve_speedup_vs_lmcache_disk_4drives",
              "smollm2_kvswarm_1drive_unflushed_store_gbps", "llama3_8b_kvswarm_4drives_retrieve_gbps",
              "retrieve_ratio_zstd_vs_lmcache_disk_1drive", "retrieve_speedup_zstd_vs_lmcache_disk_4drives"):
        assert s[k] > 0, k
    assert s["wrong_bytes"] == 0 and s["misses"] == 0
    assert s["smollm2_zstd_stored_fraction"] < 0.9  # the chunks are real KV, which compresses
    for g in r["geometries"].values():  # every case's retrieve passes took turns: at least two each
        assert all(g[c]["retrieve_passes"] >= 2 for c in ("lmcache_disk", "kvswarm_1drive", "kvswarm_4drives",
                                                          "kvswarm_1drive_zstd", "kvswarm_4drives_zstd"))
    assert s["restart_found_kvswarm"] == 48 and s["restart_hit_s_kvswarm"] > 0
    assert s["restart_found_lmcache_disk"] == 0 and s["restart_hit_s_lmcache_disk"] is None
    assert r["testbed"]["emulation"] == "kernel"
