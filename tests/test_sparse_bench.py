import json

import pytest

from kvswarm.cli import build_parser

pytestmark = pytest.mark.model


def test_bench_sparse_small_run(lm, tmp_path):
    from kvswarm.bench import sparse_bench

    out = tmp_path / "b.json"
    args = build_parser().parse_args(
        ["bench", "sparse", "--mode", "decode", "--tokens", "128", "--steps", "3", "--selectors", "oracle,blocks", "--sparsity", "0.25",
         "--drives", "2", "--drive-mode", "temp", "--dir", str(tmp_path), "--window", "16", "--chunk", "2",
         "--json", str(out)])
    # Two rounds of interleaved configurations: the dense restore must still match the reference exactly.
    assert sparse_bench.run(args, lm) == 0  # non-zero when the dense restore is not exact
    r = json.load(open(out))
    s = r["summary"]
    assert s["dense_exact"] == 1.0 and s["dense_agreement"] == 1.0 and s["dense_ppl_diff"] == 0.0
    for k in ("oracle_025", "blocks_025"):
        assert s[f"{k}_read_mib_per_step"] < s["dense_read_mib_per_step"]
        assert s[f"{k}_bytes_reduction"] > 1 and s[f"{k}_io_ms_per_step"] > 0
        assert 0 < s[f"{k}_recall"] <= 1 and 0 <= s[f"{k}_agreement"] <= 1
    assert s["oracle_025_recall_vs_oracle"] == pytest.approx(1.0)
    assert [x["name"] for x in r["runs"]] == ["dense", "oracle@0.25", "blocks@0.25"]
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_bench_sparse_swarm_is_fair_on_the_testbed(lm, tmp_path, monkeypatch):
    """A small run of the co-activation benchmark on the testbed (kernel-capped drives where the
    machine allows): no point may read faster than the caps (utilisation <= 1.0: the throttle's
    idle credit is drained before every timed step), no strategy is evaluated on the text it was
    tuned on, and every ratio the README cites is written."""
    from kvswarm.bench import sparse_bench
    from kvswarm.errors import BadInput

    monkeypatch.setenv("KVSWARM_CACHE", str(tmp_path / "cache"))  # the test records its own captures
    out = tmp_path / "s.json"
    argv = ["bench", "sparse", "--quick", "--tokens", "256", "--capture-steps", "12", "--profile-steps", "6",
            "--io-steps", "2", "--drive-counts", "2", "--contexts", "", "--no-agreement", "--curve", "0.2",
            "--eval-texts", "licenses:0", "--json", str(out)]
    assert sparse_bench.run(build_parser().parse_args(argv), lm) == 0
    r = json.load(open(out))
    s = r["summary"]
    points = [v for per_s in r["io"].values() for per_p in per_s.values() for per_n in per_p.values()
              for per_sp in per_n.values() for v in per_sp.values()]
    assert len(points) >= 6 * 2 * 2 * 2  # strategies x cache policies x cold/warm x budgets
    assert all(0 < p["utilisation"] <= 1.0 for p in points) and s["max_utilisation"] <= 1.0
    assert s["evaluated_on_tuning_text"] == 0.0 and s["tuned_on"] == r["tuning"]["text"]
    assert r["tuning"]["text"] not in r["config"]["eval_texts"] and s["evaluated_on"] in r["config"]["eval_texts"]
    assert set(r["tuning"]["best"]) == {"token", "blocks", "kmeans", "raid0", "swarm", "kvswarm"}
    for state in ("cold", "warm"):
        for b in ("token", "blocks", "kmeans"):
            assert s[f"speedup_vs_{b}_{state}"] > 0 and s[f"model_speedup_vs_{b}_{state}"] > 0
    assert 0 < s["util_2_drives"] <= 1.0
    with pytest.raises(BadInput, match="also an evaluation text"):
        sparse_bench.run(build_parser().parse_args(argv[:-4] + ["--eval-texts", "pydoc:0"]), lm)
