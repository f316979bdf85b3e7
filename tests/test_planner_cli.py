"""`kvswarm plan`, `plan scale` and `plan validate` end to end (small inputs)."""

from __future__ import annotations

import json
import re

import pytest

from kvswarm.planner.cli import main

SMALL = ["--users", "10", "--context", "2048", "--turns", "3", "--session-s", "300", "--duration-s", "600",
         "--model", "Llama-3-8B", "--dram-gb", "0,32", "--ssd-counts", "1,2", "--hdd-counts", "4",
         "--finalists", "2", "--sim-requests", "100"]


def test_help_documents_every_input(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--catalog", "--model", "--layers", "--kv-heads", "--head-dim", "--dtype", "--trace", "--users",
                 "--context", "--turns", "--reuse", "--session-s", "--budget", "--ttft-target", "--gpu", "--link",
                 "--dram-gb", "--ssd-counts", "--hdd-counts", "--eviction", "--write-policy", "--demotion", "--json"):
        assert re.search(re.escape(flag) + r"\b.*\n?.*\w", out), flag
    assert "scale" in out and "validate" in out


def test_plan_writes_table_json_and_pareto_plot(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*SMALL, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Recommended:" in text and "runner-up" in text
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["mixes_screened"] > 4 and s["ttft_mean_s"] > 0 and 0 <= s["hit_rate"] <= 1
    assert doc["recommended"]["method"].startswith("simulated") and doc["pareto_front"]
    assert (tmp_path / "plan_pareto.png").stat().st_size > 10_000


def test_plan_with_tier_director_policies(tmp_path):
    out = tmp_path / "p.json"
    assert main([*SMALL, "--eviction", "s3fifo", "--write-policy", "selective:2", "--demotion", "cost-aware",
                 "--json", str(out)]) == 0
    assert "s3fifo" in json.loads(out.read_text())["context"]["tier_policy"]


@pytest.mark.parametrize("args,msg", [
    (["--model", "GPT-9"], "unknown model preset 'GPT-9'"),
    (["--ssd-counts", "-2"], None),  # argparse rejects it (exit 2)
    (["--budget", "-5"], "--budget must be positive"),
    (["--gpu", "tpu9"], "no gpus entry 'tpu9'"),
    (["--eviction", "mru"], "unknown eviction"),
    (["--placement", "nowhere"], "unknown placement"),
])
def test_bad_inputs_give_clear_errors(args, msg, capsys):
    try:
        rc = main([*SMALL, *args])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    if msg:
        assert msg in capsys.readouterr().out


def test_empty_trace_and_broken_catalog(tmp_path, capsys):
    empty = tmp_path / "t.jsonl"
    empty.write_text("")
    assert main(["--trace", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().out
    cat = tmp_path / "c.toml"
    from kvswarm.planner.hardware import default_catalog_path

    cat.write_text(default_catalog_path().read_text().replace("read_gbps = 6.9 ", "", 1))
    assert main([*SMALL, "--catalog", str(cat)]) == 2
    assert "[drives.pm9a3] is missing field(s) read_gbps" in capsys.readouterr().out


@pytest.mark.parametrize("tenants", ["1", "3"])
def test_trace_without_blocks_is_a_clear_error(tmp_path, capsys, tenants):
    zero = tmp_path / "zero.csv"
    zero.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,0,20\n")
    assert main(["--trace", str(zero), "--tenants", tenants]) == 2
    assert "no request with a KV block" in capsys.readouterr().out


def test_scale_projection_finds_the_link_bound(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["scale", "--drives", "1,4,16", "--links", "gen4_x16", "--placements", "round_robin",
                 "--model", "Llama-3-8B", "--context", "8192", "--steps", "1", "--sim-layers", "2",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    pts = doc["series"]["pm9a3 / gen4_x16 / round_robin"]["points"]
    gbps = [p["gbps"] for p in pts]
    assert gbps[0] == pytest.approx(6.9, rel=0.15) and gbps[-1] <= 27.0  # 16 drives: the x16 gen4 link binds
    assert doc["series"]["pm9a3 / gen4_x16 / round_robin"]["link_bound_from"] in (4, 16)
    assert (tmp_path / "scale_scale.png").is_file()


def test_validate_quick_reports_errors_per_metric(tmp_path, capsys):
    """A tiny validation (fast caps, few batches): the report's shape, not its accuracy (that is the command's)."""
    out = tmp_path / "val.json"
    assert main(["validate", "--quick", "--drives", "1,2", "--small-kib", "0", "--batches", "3", "--seconds", "0.2",
                 "--rounds", "1", "--cap-mbps", "400", "--cap-iops", "8000", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["configurations"] == 2 and 0 <= s["max_error"] <= s["max_error_all"]
    for c in doc["configs"]:
        assert set(c["error"]) >= {"throughput_Bps", "mean_io_time_s"}
        assert c["measured"]["batches"] == c["simulated"]["batches"] >= 3
    assert doc["calibration"]["read_bw_MBps"] > 0 and "emulation" in doc["emulation"]
    assert "Simulator vs measured" in capsys.readouterr().out


def test_gpu_probe_refuses_cleanly_without_cuda(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would run")
    from kvswarm.planner.gpuprobe import main as probe

    assert probe([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_calibration_from_bench_io_results():
    from kvswarm.planner.validate import rates_from_bench

    doc = {"drives": {"emulation": "kernel", "drives": 2}, "summary": {"raw_gbps_1m": 0.2, "raw_iops_4k": 4000.0}}
    assert rates_from_bench(doc) == (1e8, 2000.0, 2)
    with pytest.raises(ValueError, match="raw_gbps_1m"):
        rates_from_bench({"summary": {}})
