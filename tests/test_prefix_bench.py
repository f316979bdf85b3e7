"""kvswarm bench prefix, trace part: the ideal matches the trace's SOURCE.md, replays are exact."""

from __future__ import annotations

import json

import pytest

from kvswarm.bench import prefix_bench as pb
from kvswarm.cli import main

pytestmark = pytest.mark.skipif(not pb.DEFAULT_TRACE.exists(), reason="Mooncake trace not present")


def test_ideal_hit_rate_of_the_whole_trace_matches_its_source():
    reqs = pb.load_trace(pb.DEFAULT_TRACE)
    ideal, distinct = pb.ideal_hit_rate(reqs)
    assert len(reqs) == 12_031 and distinct == 182_790
    assert round(ideal, 3) == pb.FULL_TRACE_IDEAL


def test_replay_tiers_vs_one_drive_lru(tmp_path):
    reqs = pb.load_trace(pb.DEFAULT_TRACE, 300)
    ideal, distinct = pb.ideal_hit_rate(reqs)
    ssd = distinct // 10
    base = pb.replay(reqs, pb.Setup("b", "lru-1drive", 0.1, 0, ssd, 1, 0, 0), tmp_path, 4032, None)
    tiers = pb.replay(reqs, pb.Setup("k", "kvswarm", 0.1, ssd // 10, ssd, 4, 3 * ssd, 2), tmp_path, 4032, None)
    for r in (base, tiers):
        assert r["wrong_bytes_served"] == 0
        h = r["hit_rate"]
        assert h["total"] <= ideal + 1e-9
        assert h["total"] == pytest.approx(h["dram"] + h["ssd"] + h["capacity"])
    assert tiers["hit_rate"]["total"] > base["hit_rate"]["total"]
    writes = [d["write_ops"] for d in tiers["drives"] if d["pool"] == "ssd"]
    assert len(writes) == 4 and max(writes) - min(writes) <= 0.05 * max(writes) + 2  # striped evenly


def test_cli_quick_trace_only_writes_summary_and_plot(tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "prefix", "--quick", "--skip-ttft", "--requests", "150", "--sizes", "0.1",
                 "--json", str(out), "--dir", str(tmp_path)]) == 0
    s = json.loads(out.read_text())["summary"]
    assert {"trace_hit_rate", "trace_ideal_hit_rate", "trace_lru_1drive_hit_rate"} <= s.keys()
    assert (tmp_path / "r_hit_rate.png").stat().st_size > 0


@pytest.mark.parametrize("write", ["write-through", "write-back", "selective:2"])
def test_real_tiers_serve_exactly_what_the_director_decides(tmp_path, write):
    """The TierManager on real drives hits exactly where the pure director (the simulator's model) does."""
    from kvswarm.tiers import TierDirector

    reqs = pb.load_trace(pb.DEFAULT_TRACE, 250)
    _, distinct = pb.ideal_hit_rate(reqs)
    ssd = distinct // 20
    r = pb.replay(reqs, pb.Setup("k", "kvswarm", 0.05, ssd // 10, ssd, 4, 3 * ssd, 2, "s3fifo", write, "always"),
                  tmp_path, 4032, None)
    caps = r["capacity_blocks"]
    d = TierDirector([caps["dram"], caps["ssd"], caps["capacity"]], eviction=("lru", "s3fifo", "lru"), write=write,
                     demotion="always")
    hits = 0
    for ids in reqs:
        got = d.lookup(ids)
        hits += len(got)
        for j, k in enumerate(ids):
            d.admit(k, got[j] if j < len(got) else None)
    assert r["hit_rate"]["total"] == pytest.approx(hits / sum(map(len, reqs)))
    assert not any(r["failures"].values())
