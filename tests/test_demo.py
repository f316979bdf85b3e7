import json

import pytest

from kvswarm.cli import build_parser

pytestmark = pytest.mark.model


def test_demo_small_run(lm, tmp_path, capsys):
    from kvswarm import demo

    out = tmp_path / "demo.json"
    args = build_parser().parse_args(["demo", "--tokens", "160", "--steps", "3", "--drives", "2", "--drive-mode",
                                      "temp", "--dir", str(tmp_path), "--window", "16", "--json", str(out)])
    assert args._run is demo.run
    assert demo.run(args, lm) == 0
    text = capsys.readouterr().out
    for needle in ("prefill", "offload", "sparse decode", "tokens/s", "drives during sparse decode", "quality vs dense"):
        assert needle in text
    s = json.load(open(out))["summary"]
    assert s["prompt_tokens"] == 160 and s["steps"] == 3 and s["misses"] == 0
    assert 0 < s["read_mib_per_step"] < s["dense_mib_per_step"] and s["tokens_per_s"] > 0
    assert s["drive0_mib_per_step"] > 0 and s["drive1_mib_per_step"] > 0  # reads spread over both drives
    assert 0.5 < s["recall"] <= 1.0 and 0 <= s["agreement"] <= 1
    assert not list(tmp_path.glob("kvswarm-drives-*"))  # temp drives removed
