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
    out, small = tmp_path / "r.json", tmp_path / "small.json"
    assert main(["bench", "prefix", "--quick", "--skip-ttft", "--requests", "150", "--sizes", "0.1",
                 "--json", str(out), "--summary", str(small), "--dir", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert {"trace_hit_rate", "trace_ideal_hit_rate", "trace_lru_1drive_hit_rate"} <= s.keys()
    assert (tmp_path / "r_hit_rate.png").stat().st_size > 0
    # Equal SSD size and equal cost, both ways, every configuration priced from the catalog.
    runs = {r["family"]: r for r in doc["trace"]["runs"]}
    assert set(runs) == {"lru-1drive", "kvswarm", "lru-1drive-samecost", "kvswarm-samecost"}
    block_usd = doc["trace"]["cost_block_bytes"] / 1e9 * doc["trace"]["prices"]["ssd_usd_per_gb"]
    assert runs["lru-1drive-samecost"]["cost_usd"] == pytest.approx(runs["kvswarm"]["cost_usd"], abs=block_usd)
    assert runs["kvswarm-samecost"]["cost_usd"] <= runs["lru-1drive"]["cost_usd"] * 1.001
    assert runs["kvswarm"]["cost_vs_lru_1drive"] == pytest.approx(s["trace_cost_kvswarm_vs_lru_1drive"])
    assert s["trace_lru_equal_cost_hit_rate"] == runs["lru-1drive-samecost"]["hit_rate"]["total"]
    assert s["trace_hit_rate_vs_lru_equal_cost"] == pytest.approx(
        s["trace_hit_rate"] / s["trace_lru_equal_cost_hit_rate"])
    assert s["trace_kvswarm_at_lru_cost_hit_rate"] == runs["kvswarm-samecost"]["hit_rate"]["total"]
    assert "trace_hit_rate_equal_cost_kvswarm_vs_lru" in s
    assert all(v for v in doc["trace"]["prices"]["sources"].values())
    kept = json.loads(small.read_text())
    assert kept["summary"] == s and set(kept) == {"command", "date", "settings", "summary"}
    assert kept["settings"]["prices"] == doc["trace"]["prices"] and "runs" not in kept["settings"]


def test_prices_come_from_the_catalog_and_ttft_is_blended_by_tier_shares():
    from kvswarm.bench.prefix_cost import Prices, modelled_ttft
    from kvswarm.planner.hardware import load_catalog

    p, cat = Prices.from_catalog(), load_catalog()
    assert p.dram_usd_per_gb == cat.dram["ddr5"].price_usd_per_gb
    assert p.ssd_usd_per_gb == cat.drives["pm9a3"].price_usd_per_tb / 1000
    assert p.hdd_usd_per_gb == cat.drives["exos_x20"].price_usd_per_tb / 1000
    assert cat.drives["pm9a3"].price_source in p.sources["ssd"]
    assert p.cost(1, 2, 3, 10**9) == pytest.approx(p.dram_usd_per_gb + 2 * p.ssd_usd_per_gb + 3 * p.hdd_usd_per_gb)
    assert p.ssd_blocks_for(p.cost(0, 100, 0, 4096), 4096) in (99, 100)
    ttft = {"dram": 0.1, "ssd": 0.2, "capacity": 0.5, "recompute": 2.0}
    assert modelled_ttft({"dram": 0.1, "ssd": 0.2, "capacity": 0.1, "total": 0.4}, ttft) == pytest.approx(
        0.01 + 0.04 + 0.05 + 0.6 * 2.0)


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
