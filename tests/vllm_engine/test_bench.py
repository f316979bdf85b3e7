"""`kvswarm bench vllm` end to end at toy sizes (figures are the benchmark's job, not asserted here)."""

from __future__ import annotations

import json

from kvswarm.bench.vllm_bench import main


def test_bench_vllm_runs_and_reports(tmp_path):
    out = tmp_path / "vllm.json"
    rc = main(["--block-sizes", "64", "--restore-mib", "4", "--lookup-blocks", "128",
               "--rounds", "1", "--fresh-rounds", "1", "--no-testbed", "--dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    s = r["summary"]
    for key in ("restore_ratio_vs_raw_64k", "raw_gbps_64k", "fs_restore_gbps_64k", "kvswarm_restore_gbps_64k",
                "raw_delivered_gbps_64k", "restore_ratio_vs_raw_delivered_64k", "restart_lookup_speedup_vs_fs",
                "engine_load_none_restore_speedup_vs_fs", "engine_load_1of1_kvswarm_restore_gbps",
                "engine_load_3of1_fs_restore_gbps", "engine_load_3of1_restore_speedup_vs_fs",
                "restart_lookup_fresh_process_speedup_vs_fs", "raw_one_request_burst_ms_64k",
                "kvswarm_single_request_speed_vs_raw_burst_64k", "fs_single_request_speed_vs_raw_burst_64k"):
        assert s[key] > 0, key
    assert set(r["one_drive"][0]["engine_load"]["loads"]) == {"none", "1/1", "3/1"}
    assert r["restart"]["kvswarm"]["hits"] == r["restart"]["fs"]["hits"] == 128
    assert r["restart"]["kvswarm"]["fresh_process"]["hits"] == r["restart"]["fs"]["fresh_process"]["hits"] == 128
    assert (tmp_path / "vllm.png").stat().st_size > 0


def test_raw_delivery_reference_lands_every_block_in_its_chunk(tmp_path):
    """The raw + delivery reference does a load's work: after one sample the primary region holds
    every block again, read from kvswarm's extents (so the reference cannot be cheaper than a load)."""
    from kvswarm.bench.vllm_bench import Bench, RawCeiling, TierCase, kv_config, layout_for

    bench = Bench(layout_for(64 << 10), 48)
    try:
        (tmp_path / "kv").mkdir()
        case = TierCase(bench, kv_config([str(tmp_path / "kv")], "uring", 64 << 20))
        raw = RawCeiling(case.run.tier.store, bench.deliverer(bench.extents(case.run.tier)))
        raw.method = ("random", "threads", 4)
        bench.primary.mm[:] = bytes(len(bench.primary.mm))
        raw.measure_delivered()
        assert len(raw.delivered) == 1 and raw.delivered[0] > 0
        for i in range(bench.nblocks):
            assert hash(bytes(bench.primary.chunk(i)[:4096])) == bench.digest[i], i
        assert raw.result()["delivered"]["method"] == "threads_4_random"
        case.run.tier.shutdown()
    finally:
        bench.close()


def test_engine_load_argument_is_checked():
    import argparse

    import pytest

    from kvswarm.bench.engine_host import engine_loads

    assert engine_loads("1/1,3/0.5") == [(1.0, 1.0), (3.0, 0.5)]
    assert engine_loads("") == []
    for bad in ("3-1", "0/1", "1/-1", "a/b"):
        with pytest.raises(argparse.ArgumentTypeError):
            engine_loads(bad)
