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
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1  # one line on stderr


def test_empty_trace_and_broken_catalog(tmp_path, capsys):
    empty = tmp_path / "t.jsonl"
    empty.write_text("")
    assert main(["--trace", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
    cat = tmp_path / "c.toml"
    from kvswarm.planner.hardware import default_catalog_path

    cat.write_text(default_catalog_path().read_text().replace("read_gbps = 6.9 ", "", 1))
    assert main([*SMALL, "--catalog", str(cat)]) == 2
    assert "[drives.pm9a3] is missing field(s) read_gbps" in capsys.readouterr().err


@pytest.mark.parametrize("tenants", ["1", "3"])
def test_trace_without_blocks_is_a_clear_error(tmp_path, capsys, tenants):
    zero = tmp_path / "zero.csv"
    zero.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,0,20\n")
    assert main(["--trace", str(zero), "--tenants", tenants]) == 2
    assert "no request with a KV block" in capsys.readouterr().err


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


def test_scale_says_how_many_cores_each_read_path_needs(tmp_path, capsys):
    """Cores per drive set = projected reads/s x measured CPU per op + bytes/s x CPU per byte, for each
    read path measured here (the Python uring engine and the native batch path)."""
    out = tmp_path / "scale.json"
    assert main(["scale", "--drives", "1,4", "--links", "gen5_x64", "--placements", "round_robin",
                 "--model", "Llama-3-8B", "--context", "8192", "--steps", "1", "--sim-layers", "2",
                 "--cpu-paths", "uring,native", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    size = 16 * doc_entry_bytes(doc)
    for path in ("uring", "native"):
        assert s[f"cpu_per_op_us_{path}"] > 0 and s[f"cpu_per_byte_ns_{path}"] > 0
        for n in (1, 4):
            gbps = doc["series"]["pm9a3 / gen5_x64 / round_robin"]["points"][[1, 4].index(n)]["gbps"]
            want = gbps * 1e9 / size * s[f"cpu_per_op_us_{path}"] * 1e-6 + gbps * s[f"cpu_per_byte_ns_{path}"]
            assert s[f"cores_{path}_at_{n}"] == pytest.approx(want, rel=1e-6)
        assert s[f"cores_{path}_at_4"] > 3 * s[f"cores_{path}_at_1"]
    assert "cores needed" in capsys.readouterr().out
    assert main(["scale", "--drives", "1", "--cpu-paths", "disk"]) == 2


def doc_entry_bytes(doc: dict) -> int:
    """Bytes of one token's KV entry of the scale run's model (Llama-3-8B: 32 layers x 8 KV heads x 128)."""
    from kvswarm.planner.models import resolve_model

    return resolve_model(doc["context"]["model"]).layout().entry_bytes


def test_validate_predicts_only_what_it_was_not_fitted_on(tmp_path, capsys):
    """A tiny validation on the real disk: the report's shape and the fit/prediction split, not its
    accuracy (that is the command's).  No fit point is among the predictions, and summary.max_error
    is exactly the largest error over the predictions."""
    out = tmp_path / "val.json"
    assert main(["validate", "--quick", "--fit-kib", "4,64", "--fit-depths", "4", "--sizes", "4,64", "--depths", "1,4",
                 "--object-kib", "16", "--batches", "3", "--seconds", "0.1", "--file-mib", "64", "--dir",
                 str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    s, fit = doc["summary"], doc["fit"]
    assert {(p["size_kib"], p["depth"]) for p in fit["points"]} == {(4, 4), (64, 4)}
    assert fit["read_iops"] > 0 and fit["read_bw_MBps"] > 0
    raw = {(r["size_kib"], r["depth"]) for r in doc["raw"]}
    assert raw == {(4, 1), (64, 1)}  # (4, 4) and (64, 4) are fit points: not predictions
    errors = [r["error"]["throughput_Bps"] for r in doc["raw"]] + [v for r in doc["store"] for v in r["error"].values()]
    assert s["predictions"] == len(errors) == 4 and s["fit_points"] == 2
    assert s["max_error"] == pytest.approx(max(errors))
    assert s["max_error_raw"] == pytest.approx(max(errors[:2]))
    assert "error_raw_64k_qd4" not in s and "fit_reproduction_error" in s
    store = doc["store"][0]
    assert store["measured"]["batches"] == store["simulated"]["batches"] == 3
    assert 0 < store["simulated_cpu_util"] <= 1 and s["cpu_per_op_us"] > 0  # the host cost is in the model
    assert doc["settings"]["fit_kib"] == [4, 64] and "load_avg_start" in doc["settings"]
    assert "never fitted on" in capsys.readouterr().out
    assert not list(tmp_path.glob("kvswarm-validate-*"))  # scratch file and store removed


def test_drive_fit_recovers_latency_bandwidth_and_iops_ceiling():
    """Runs made by a known drive (closed form, as the simulator serves them) give that drive back;
    the fit needs two request sizes, since one cannot tell a per-op cost from a per-byte one."""
    from kvswarm.planner.disk import RawRun, closed_loop_ops, fit_drive, simulate_closed_loop
    from kvswarm.sim.devices import DriveSpec

    true = DriveSpec("t", 400e6, 400e6, 15_000, 15_000, 200e-6, 200e-6, queue_depth=4096)
    runs = [RawRun(kib << 10, d, round(closed_loop_ops(true, kib << 10, d) * 10), 10.0)
            for kib in (4, 256) for d in (2, 8)]
    m = fit_drive(runs)
    assert m.read_bw == pytest.approx(400e6, rel=0.02)
    assert m.read_iops == pytest.approx(15_000, rel=0.02)
    assert m.read_latency == pytest.approx(200e-6, rel=0.05)
    for kib, d in ((16, 1), (64, 16), (1024, 4)):  # held out: the simulator agrees with the drive made them
        want = closed_loop_ops(true, kib << 10, d) * (kib << 10)
        assert simulate_closed_loop(m, kib << 10, d).throughput_Bps == pytest.approx(want, rel=0.05)
    with pytest.raises(ValueError, match="two request sizes"):
        fit_drive([r for r in runs if r.size == 4096])


def test_scale_swarm_comes_from_the_datasheet_and_the_cpu_cost(tmp_path):
    """--swarm: 8 x PM9A3 from the catalog's datasheet figures and the given host CPU cost, never from
    the paper's 37.67 GB/s (a different catalog figure moves it; the CPU cost caps it)."""
    def swarm(cpu_us: str, catalog=None) -> dict:
        out = tmp_path / f"s{cpu_us}.json"
        argv = ["scale", "--swarm", "--drives", "1,8", "--links", "gen5_x64", "--placements", "round_robin",
                "--model", "Llama-3-8B", "--context", "8192", "--steps", "1", "--sim-layers", "2",
                "--cpu-per-op-us", cpu_us, "--cpu-per-byte-ns", "0", "--json", str(out)]
        assert main(argv + (["--catalog", str(catalog)] if catalog else [])) == 0
        return json.loads(out.read_text())["summary"]

    free, costly = swarm("0"), swarm("20")
    assert free["swarm_8_device_only_gbps"] == pytest.approx(8 * 6.9, rel=0.2)
    assert free["swarm_8_modelled_gbps"] == pytest.approx(free["swarm_8_device_only_gbps"], rel=0.02)
    assert costly["swarm_8_modelled_gbps"] < 0.5 * free["swarm_8_modelled_gbps"] and costly["swarm_8_cpu_util"] > 0.9
    assert costly["swarm_8_reported_gbps"] == 37.67
    from kvswarm.planner.hardware import default_catalog_path

    cat = tmp_path / "cat.toml"
    cat.write_text(default_catalog_path().read_text().replace("read_gbps = 6.9 ", "read_gbps = 3.45 "))
    assert swarm("0", cat)["swarm_8_modelled_gbps"] == pytest.approx(free["swarm_8_modelled_gbps"] / 2, rel=0.15)


def test_gpu_probe_refuses_cleanly_without_cuda(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would run")
    from kvswarm.planner.gpuprobe import main as probe

    assert probe([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
