"""`kvswarm bench faults`: a small campaign through the CLI (every bad API and CLI input included);
its JSON's five counters are 0, and so are the refusals that changed a store and the unclear CLI
answers."""

import json

from kvswarm.cli import main

ZERO = ("wrong_bytes", "lost_flushed", "hangs", "raw_exceptions", "cli_tracebacks", "refused_changed", "fd_leaks",
        "cli_accepted", "cli_unclear", "full_drive_failed")


def test_bench_faults_small_campaign_reports_zeros(tmp_path):
    out = tmp_path / "faults.json"
    rc = main(["bench", "faults", "--crashes", "1", "--power-cuts", "1", "--corruptions", "6", "--enospc", "1",
               "--eio", "1", "--race-s", "0.5", "--dir", str(tmp_path), "--json", str(out)])
    res = json.loads(out.read_text())
    s = res["summary"]
    assert {k: s.get(k, 0) for k in ZERO} == dict.fromkeys(ZERO, 0), res["examples"]
    assert rc == 0
    inj = s["injections"]
    assert inj["crash"] == 1 and inj["power_cut"] == 1 and inj["corrupt"] == 6 and inj["enospc"] == 1
    assert inj["eio"] == 1 and inj["race"] == 2 and inj["bad_input"] >= 100
    assert res["injections"]["bad_input:api"] >= 50 and res["injections"]["bad_input:cli"] >= 50
