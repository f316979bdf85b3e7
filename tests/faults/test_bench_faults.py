"""`kvswarm bench faults`: a small campaign through the CLI; its JSON's five counters are 0."""

import json

from kvswarm.cli import main


def test_bench_faults_small_campaign_reports_zeros(tmp_path):
    out = tmp_path / "faults.json"
    rc = main(["bench", "faults", "--crashes", "2", "--power-cuts", "1", "--corruptions", "10", "--enospc", "1",
               "--eio", "1", "--race-s", "0.5", "--dir", str(tmp_path), "--json", str(out)])
    res = json.loads(out.read_text())
    s = res["summary"]
    assert {k: s[k] for k in ("wrong_bytes", "lost_flushed", "hangs", "raw_exceptions", "cli_tracebacks")} == \
        dict.fromkeys(("wrong_bytes", "lost_flushed", "hangs", "raw_exceptions", "cli_tracebacks"), 0), res["examples"]
    assert rc == 0
    inj = s["injections"]
    assert inj["crash"] == 2 and inj["power_cut"] == 1 and inj["corrupt"] == 10 and inj["enospc"] == 1
    assert inj["eio"] == 1 and inj["race"] == 2 and inj["bad_input"] >= 100
