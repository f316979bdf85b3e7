import json

import pytest

from kvswarm.cli import build_parser

pytestmark = pytest.mark.model


def test_demo_small_run(lm, tmp_path, capsys):
    from kvswarm import demo

    out = tmp_path / "demo.json"
    args = build_parser().parse_args(["demo", "--tokens", "160", "--steps", "3", "--profile-steps", "3", "--drives",
                                      "2", "--drive-mode", "temp", "--dir", str(tmp_path), "--window", "16",
                                      "--json", str(out)])
    assert args._run is demo.run
    assert demo.run(args, lm) == 0
    text = capsys.readouterr().out
    for needle in ("prefill", "co-activation layout", "offload", "kvswarm decode", "best baseline",
                   "at the same attention recall", "drives during the kvswarm decode"):
        assert needle in text
    r = json.load(open(out))
    s = r["summary"]
    assert s["prompt_tokens"] == 160 and s["steps"] == 3 and s["misses"] == 0
    assert s["drive0_mib_per_step"] > 0 and s["drive1_mib_per_step"] > 0  # reads spread over both drives
    assert 0.5 < s["recall"] <= 1.0 and 0 <= s["agreement"] <= 1
    assert s["kvswarm_io_ms"] > 0 and s["best_baseline_io_ms"] > 0 and s["best_baseline"] in r["compare"]
    for pts in r["compare"].values():  # every layout read something and attended what it read
        assert all(p["mb"] > 0 and 0 < p["recall"] <= 1 for p in pts)
    assert not list(tmp_path.glob("kvswarm-drives-*"))  # temp drives removed


def test_demo_takes_a_text_file(lm, tmp_path, capsys):
    from kvswarm import demo

    text = tmp_path / "mine.txt"
    lines = " ".join(f"Line {i}: the cache keeps entry {i % 7} warm." for i in range(80))
    text.write_text("Über die Drives. " + lines, encoding="utf-8")
    args = build_parser().parse_args(["demo", "--text-file", str(text), "--tokens", "160", "--steps", "2",
                                      "--profile-steps", "2", "--drives", "2", "--drive-mode", "temp", "--dir",
                                      str(tmp_path), "--window", "16"])
    assert demo.run(args, lm) == 0
    assert "file:mine.txt" in capsys.readouterr().out


def test_cli_refuses_a_bad_text_file(tmp_path, capsys):
    from kvswarm.cli import main

    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00 not text")
    assert main(["demo", "--text-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not UTF-8 text" in err and "Traceback" not in err
