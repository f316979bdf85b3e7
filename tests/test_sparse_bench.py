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
