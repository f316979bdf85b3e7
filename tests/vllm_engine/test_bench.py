"""`kvswarm bench vllm` end to end at toy sizes (figures are the benchmark's job, not asserted here)."""

from __future__ import annotations

import json
import os

import pytest

from kvswarm.bench.vllm_bench import main


def test_bench_vllm_runs_and_reports(tmp_path):
    out = tmp_path / "vllm.json"
    rc = main(["--block-sizes", "64", "--restore-mib", "4", "--lookup-blocks", "128",
               "--rounds", "1", "--fresh-rounds", "1", "--no-testbed", "--dir", str(tmp_path), "--json", str(out),
               "--summary", str(tmp_path / "small.json")])
    assert rc == 0
    r = json.loads(out.read_text())
    s = r["summary"]
    for key in ("restore_ratio_vs_raw_64k", "raw_gbps_64k", "fs_restore_gbps_64k", "kvswarm_restore_gbps_64k",
                "raw_delivered_gbps_64k", "restore_ratio_vs_raw_delivered_64k", "restart_lookup_speedup_vs_fs",
                "raw_landed_gbps_64k", "restore_ratio_vs_raw_landed_64k", "fs_restore_ratio_vs_raw_landed_64k",
                "engine_load_none_restore_speedup_vs_fs", "engine_load_1of1_kvswarm_restore_gbps",
                "engine_load_3of1_fs_restore_gbps", "engine_load_3of1_restore_speedup_vs_fs",
                "restart_lookup_fresh_process_speedup_vs_fs", "raw_one_request_burst_ms_64k",
                "kvswarm_single_request_speed_vs_raw_burst_64k", "fs_single_request_speed_vs_raw_burst_64k"):
        assert s[key] > 0, key
    raw = r["one_drive"][0]["raw"]
    # Raw landed: its own sweep over the same methods as raw, sampled before and after the tiers' restores.
    assert set(raw["landed"]["tuning"]) == set(raw["tuning"])
    assert raw["landed"]["method"] == max(raw["landed"]["tuning"], key=raw["landed"]["tuning"].get)
    assert len(raw["landed"]["samples"]) == len(raw["samples"]) == 2 * len(raw["landed"]["round_gbps"])
    assert r["one_drive"][0]["kvswarm"]["restore_ratio_vs_raw_landed"] == s["restore_ratio_vs_raw_landed_64k"]
    assert set(r["one_drive"][0]["engine_load"]["loads"]) == {"none", "1/1", "3/1"}
    assert r["restart"]["kvswarm"]["hits"] == r["restart"]["fs"]["hits"] == 128
    assert r["restart"]["kvswarm"]["fresh_process"]["hits"] == r["restart"]["fs"]["fresh_process"]["hits"] == 128
    assert (tmp_path / "vllm.png").stat().st_size > 0
    small = json.loads((tmp_path / "small.json").read_text())
    assert small["summary"] == s and small["settings"]["raw_landed_method_64k"] == raw["landed"]["method"]


@pytest.mark.parametrize("kind", ["threads", "uring"])
def test_raw_delivery_and_landed_references_land_every_block_in_its_chunk(tmp_path, kind):
    """Raw + delivery and raw landed do a load's work: after each sample the primary region holds
    every block again, read from kvswarm's extents (so neither reference can be cheaper than a load)."""
    from kvswarm.bench.vllm_bench import Bench, RawCeiling, TierCase, kv_config, layout_for

    bench = Bench(layout_for(64 << 10), 48)
    try:
        (tmp_path / "kv").mkdir()
        case = TierCase(bench, kv_config([str(tmp_path / "kv")], "uring", 64 << 20))
        ext = bench.extents(case.run.tier)
        raw = RawCeiling(case.run.tier.store, bench.deliverer(ext), land=lambda: bench.lander(ext))
        raw.method = raw.landed_method = ("random", kind, 4)
        raw.tuning = {f"threads_{t}_random": float(t == 8) for t in raw.THREADS}  # raw + delivery's threads, if uring
        for only in ("deliver", "land"):  # one reference at a time, each into a zeroed region
            bench.primary.mm[:] = bytes(len(bench.primary.mm))
            other = "land" if only == "deliver" else "deliver"
            kept, raw.__dict__[other] = raw.__dict__[other], None
            raw.measure_delivered()
            raw.measure_landed()
            raw.__dict__[other] = kept
            for i in range(bench.nblocks):
                assert hash(bytes(bench.primary.chunk(i)[:4096])) == bench.digest[i], (only, i)
        assert len(raw.delivered) == len(raw.landed) == 1 and raw.delivered[0] > 0 and raw.landed[0] > 0
        res = raw.result()
        assert res["delivered"]["method"] == ("threads_4_random" if kind == "threads" else "threads_8_random")
        assert res["landed"]["method"] == f"{kind}_4_random"
        case.run.tier.shutdown()
    finally:
        bench.close()


def test_eight_drives_reports_efficiency_per_drive_cap(tmp_path):
    """The eight-drive part: each tier's GB/s per GB/s of the caps of the drives it uses, beside the
    speedup; the summary and the small summary file carry both."""
    from rich.console import Console

    from kvswarm.bench.vllm_bench import eight_drives, summarize

    e = eight_drives(64 << 10, 8 << 20, "uring", 1, Console(file=open(os.devnull, "w")), window_s=2.0)
    cap = e["testbed"]["caps"]["read_mbps"] / 1e3
    assert e["efficiency_fs"] == pytest.approx(e["fs_1_drive"]["restore_gbps"] / cap)
    assert e["efficiency_kvswarm"] == pytest.approx(e["kvswarm_8_drives"]["restore_gbps"] / (8 * cap))
    # Restores timed over a 2 s window after a drain: at most one 100 ms slice of credit beyond the caps.
    assert 0 < e["efficiency_kvswarm"] <= 1.05 and 0 < e["efficiency_fs"] <= 1.05
    s = summarize({"one_drive": [], "restart": None, "eight_drives": e})
    assert s["efficiency_8_drives_kvswarm"] == e["efficiency_kvswarm"] and s["efficiency_8_drives_fs"] > 0
    assert s["restore_speedup_vs_fs_8drives"] == pytest.approx(e["restore_speedup"])


def test_engine_load_argument_is_checked():
    import argparse

    import pytest

    from kvswarm.bench.engine_host import engine_loads

    assert engine_loads("1/1,3/0.5") == [(1.0, 1.0), (3.0, 0.5)]
    assert engine_loads("") == []
    for bad in ("3-1", "0/1", "1/-1", "a/b"):
        with pytest.raises(argparse.ArgumentTypeError):
            engine_loads(bad)
