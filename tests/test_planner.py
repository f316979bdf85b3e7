"""Planner: catalog validation, models, workloads, tier hit model, cost, projection and search."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswarm.planner.hardware import CatalogError, default_catalog_path, load_catalog, parse_catalog, tomllib
from kvswarm.planner.cost import Mix, enumerate_mixes
from kvswarm.planner.hits import HDD, MISS, SSD, DirectorHits, LRUHits, TierCaps, _prefix_cut, stack_distances
from kvswarm.planner.models import PRESETS, resolve_model
from kvswarm.planner.project import Planner, PlanSettings
from kvswarm.planner.search import pareto_front, search
from kvswarm.planner.workload import Workload, WorkloadError, load_trace, synthesize

MOONCAKE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake/conversation_trace.jsonl"


@pytest.fixture(scope="module")
def cat():
    return load_catalog()


@pytest.fixture(scope="module")
def small():
    return synthesize(users=12, context=3000, turns=4, reuse=0.3, session_s=300, duration_s=900, seed=1)


# ---- catalog ---------------------------------------------------------------------------------
def test_default_catalog_ships_and_names_its_sources(cat):
    assert default_catalog_path().is_file()
    pm = cat.drives["pm9a3"]
    assert (pm.read_gbps, pm.read_iops, pm.kind) == (6.9, 1_100_000, "ssd")
    assert cat.by_kind("hdd") and cat.dram and cat.links and cat.gpus
    for section in (cat.drives, cat.dram, cat.links, cat.gpus):
        for entry in section.values():
            assert entry.source and set(entry.assumed) <= set(vars(entry))


def _raw():
    return tomllib.loads(default_catalog_path().read_text())


def test_catalog_entry_missing_a_field_is_named():
    raw = _raw()
    del raw["drives"]["pm9a3"]["read_gbps"]
    with pytest.raises(CatalogError, match=r"\[drives.pm9a3\] is missing field\(s\) read_gbps"):
        parse_catalog(raw)


@pytest.mark.parametrize("section,key,field,value,msg", [
    ("drives", "pm9a3", "capacity_tb", -1.0, "capacity_tb must be > 0"),
    ("drives", "exos_x20", "queue_depth", 0, "queue_depth must be >= 1"),
    ("dram", "ddr5", "price_usd_per_gb", "cheap", "price_usd_per_gb must be a number"),
    ("drives", "pm9a3", "kind", "tape", "kind must be 'ssd' or 'hdd'"),
    ("gpus", "h100", "mfu", 0, "mfu must be > 0"),
])
def test_catalog_rejects_bad_values(section, key, field, value, msg):
    raw = _raw()
    raw[section][key][field] = value
    with pytest.raises(CatalogError, match=msg):
        parse_catalog(raw)


def test_catalog_rejects_unknown_fields_missing_tables_and_bad_files(tmp_path):
    raw = _raw()
    raw["links"]["gen4_x16"]["lanse"] = 16
    with pytest.raises(CatalogError, match="unknown field"):
        parse_catalog(raw)
    raw = _raw()
    del raw["gpus"]
    with pytest.raises(CatalogError, match="gpus"):
        parse_catalog(raw)
    with pytest.raises(CatalogError, match="does not exist"):
        load_catalog(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[drives.x\nname = 1")
    with pytest.raises(CatalogError, match="not valid TOML"):
        load_catalog(bad)
    with pytest.raises(CatalogError, match="no drives entry 'nvme9'"):
        load_catalog().get("drives", "nvme9")


# ---- models ----------------------------------------------------------------------------------
def test_presets_and_overrides():
    assert resolve_model("llama-3.1-70b").token_bytes == 320 * 1024  # 80 layers x 8 heads x 128 x 2 x bf16
    assert resolve_model("SmolLM2-135M").token_bytes == 30 * 3 * 64 * 2 * 2
    assert resolve_model("Qwen3-32B", dtype="float8").token_bytes == PRESETS["Qwen3-32B"].token_bytes // 2
    custom = resolve_model(None, layers=4, kv_heads=2, head_dim=64, q_heads=8, params_b=0.1)
    assert custom.token_bytes == 4 * 2 * 64 * 2 * 2
    # prefill cost grows with the cached context (attention) and is linear in params for short inputs
    m = PRESETS["Llama-3-8B"]
    assert m.prefill_flops(100, 10_000) > m.prefill_flops(100, 0) > 2 * m.params_b * 1e9 * 100


@pytest.mark.parametrize("kw,msg", [
    ({"name": "GPT-9"}, "unknown model preset 'GPT-9'"),
    ({"name": None, "layers": 4}, "missing"),
    ({"name": "Llama-3-8B", "layers": -2}, "num_layers must be positive"),
    ({"name": "Llama-3-8B", "dtype": "int3"}, "unsupported KV dtype"),
])
def test_bad_models_are_clear_errors(kw, msg):
    name = kw.pop("name")
    with pytest.raises(ValueError, match=msg):
        resolve_model(name, **kw)


# ---- workloads -------------------------------------------------------------------------------
@pytest.mark.skipif(not MOONCAKE.is_file(), reason="shared Mooncake trace not present")
def test_mooncake_trace_stats_match_its_source():
    w = load_trace(MOONCAKE)
    assert w.requests == 12_031 and w.block_tokens == 512
    assert w.ideal_hit_rate() == pytest.approx(0.366, abs=0.0005)
    # LRU hit rate at 10% of the distinct blocks, as SOURCE.md lists it (27.8%)
    hits = LRUHits(w)
    assert hits.hit_rate_curve(np.array([18_279]))[0] == pytest.approx(0.278, abs=0.001)


def test_bad_traces(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(WorkloadError, match="is empty"):
        load_trace(empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(WorkloadError, match="holds no requests"):
        load_trace(blank)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(WorkloadError, match="broken.jsonl:1: not a Mooncake trace record"):
        load_trace(broken)
    neg = tmp_path / "neg.jsonl"
    neg.write_text('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}\n')
    with pytest.raises(WorkloadError, match="negative"):
        load_trace(neg)
    with pytest.raises(WorkloadError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,1000,20\n"
                   "2023-11-16 18:15:47.0000000,600,10\n")
    w = load_trace(csv)
    assert w.requests == 2 and w.ideal_hit_rate() == 0.0 and "no reuse" in w.notes[0]


def test_trace_without_blocks_is_a_clear_error(tmp_path):
    zero = tmp_path / "zero.csv"
    zero.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,0,20\n"
                    "2023-11-16 18:15:47.0000000,0,10\n")
    nohash = tmp_path / "nohash.jsonl"
    nohash.write_text('{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": []}\n')
    for path in (zero, nohash):
        with pytest.raises(WorkloadError, match="no request with a KV block"):
            load_trace(path)
    # Requests without blocks among others are fine: they just have nothing to look up.
    mixed = tmp_path / "mixed.csv"
    mixed.write_text(zero.read_text() + "2023-11-16 18:15:48.0000000,1000,5\n")
    w = load_trace(mixed).scaled(2)
    assert w.requests == 6 and len(LRUHits(w).served(TierCaps(0, 10, 0))) == 4
    assert _prefix_cut(np.zeros(0, np.int8), np.zeros(0, np.int64)).tolist() == []


@pytest.mark.parametrize("kw", [{"users": -1}, {"reuse": 1.5}, {"context": 0}, {"turn_tokens": -3}])
def test_bad_workload_parameters(kw):
    args = dict(users=4, context=2000, turns=3, reuse=0.2, session_s=100, duration_s=300) | kw
    with pytest.raises(WorkloadError):
        synthesize(**args)


def test_synthetic_sessions_reuse_their_prefix(small):
    assert small.requests > 20
    assert small.ideal_hit_rate() > 0.5  # later turns resend the conversation so far
    two = small.scaled(2)
    assert two.requests == 2 * small.requests and two.distinct_blocks() == 2 * small.distinct_blocks()


# ---- tier hit model --------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=80))
def test_stack_distances_match_brute_force(ids):
    want = []
    for i, b in enumerate(ids):
        prev = max((j for j in range(i) if ids[j] == b), default=-1)
        want.append(-1 if prev < 0 else len(set(ids[prev + 1:i])))
    assert stack_distances(np.array(ids)).tolist() == want


def test_hits_use_the_longest_cached_prefix_only():
    w = Workload("t", 16, np.array([0.0, 1.0, 2.0]), np.array([48, 48, 48]), np.zeros(3, int),
                 [np.array([1, 2, 3]), np.array([9, 2, 3]), np.array([1, 2, 3])])
    tier = LRUHits(w).served(TierCaps(0, 100, 0))
    assert tier[3:6].tolist() == [MISS, MISS, MISS]  # block 9 misses, so 2 and 3 cannot be used
    assert tier[6:].tolist() == [SSD, SSD, SSD]


@pytest.mark.parametrize("caps", [TierCaps(0, 300, 0), TierCaps(40, 300, 0), TierCaps(20, 150, 600)])
def test_closed_form_lru_agrees_with_the_tier_director(small, caps):
    """The screening model and the tiers' own LRU/write-through/demotion code give the same tiers."""
    lru, director = LRUHits(small), DirectorHits(small)
    a, b = lru.served(caps), director.served(caps)
    assert (a == b).mean() > 0.97
    assert lru.writes(caps)[:, 0].sum() == pytest.approx(director.writes(caps)[:, 0].sum(), rel=0.05)


def test_director_takes_every_tier_policy(small):
    caps = TierCaps(20, 150, 600)
    rates = {}
    for ev in ("lru", "arc", "s3fifo"):
        t = DirectorHits(small, eviction=ev, write="selective:2", demotion="drop").served(caps)
        rates[ev] = (t != MISS).mean()
        assert (t == HDD).sum() == 0  # drop: nothing is demoted, so nothing is served from HDD
    assert all(0 < r <= small.ideal_hit_rate() + 1e-9 for r in rates.values())
    with pytest.raises(ValueError, match="unknown"):
        DirectorHits(small, eviction="mru")


# ---- cost, projection, search ----------------------------------------------------------------
def test_mix_cost_and_enumeration(cat):
    m = Mix(100, cat.dram["ddr5"], cat.drives["pm9a3"], 2, cat.drives["exos_x20"], 4)
    slot = cat.economics.drive_slot_usd
    want = 100 * 5.0 + 2 * (110 * 7.68 + slot) + 4 * (17 * 20 + slot)
    assert m.capex(cat) == pytest.approx(want)
    assert m.watts(0, 0) < m.watts(1, 1)
    with pytest.raises(ValueError, match="non-negative"):
        Mix(-1, cat.dram["ddr5"])
    mixes = enumerate_mixes(cat, [0, 64], [1, 2], [4])
    assert all(x.n_ssd or not x.n_hdd for x in mixes)  # no HDD pool without SSDs
    assert len(mixes) == 2 * (1 + 2 * len(cat.by_kind("ssd")) * 2)
    with pytest.raises(ValueError, match="max_gb"):
        enumerate_mixes(cat, [10**6], [1], [1])
    with pytest.raises(ValueError, match=">= 0"):
        enumerate_mixes(cat, [0], [-1], [1])


@pytest.fixture(scope="module")
def planner(cat, small):
    s = PlanSettings(small, resolve_model("Llama-3-8B"), cat.gpus["h100"], cat.links["gen5_x16"], cat)
    return Planner(s)


def test_more_capacity_never_lowers_the_hit_rate(planner, cat):
    prev = -1.0
    for n in (0, 1, 2, 4):
        p = planner.screen(Mix(0, cat.dram["ddr5"], cat.drives["pm9a3"] if n else None, n))
        hit = 1 - p.hit_rates["miss"]
        assert hit >= prev
        prev = hit
    assert prev > 0.5


def test_drive_utilisation_is_against_the_drives_not_the_host_link(small, cat):
    """A slow host link slows loads and saturates itself; the drives do the same work at their own rate."""
    tiny_ssd = dataclasses.replace(cat.drives["pm9a3"], capacity_tb=0.007)  # ~100 blocks: the rest spill to HDD
    mix = Mix(0, cat.dram["ddr5"], tiny_ssd, 1, cat.drives["exos_x20"], 4)
    slow_link = dataclasses.replace(cat.links["gen4_x16"], lanes=1, efficiency=0.05)  # ~0.1 GB/s
    fast, slow = (Planner(PlanSettings(small, resolve_model("Llama-3-8B"), cat.gpus["h100"], link, cat)).screen(mix)
                  for link in (cat.links["gen5_x64"], slow_link))
    assert fast.hit_rates["ssd"] > 0 and fast.hit_rates["hdd"] > 0
    assert slow.ttft_mean_s > fast.ttft_mean_s and slow.saturated == ["host_link"]
    for pool in ("ssd", "hdd"):
        assert slow.utilisation[pool] == pytest.approx(fast.utilisation[pool]) and fast.utilisation[pool] < 0.1
    assert slow.watts == pytest.approx(fast.watts)


def test_simulation_replays_the_trace_with_queueing(planner, cat):
    mix = Mix(16, cat.dram["ddr5"], cat.drives["pm9a3"], 2, cat.drives["exos_x20"], 4)
    closed = planner.screen(mix)
    sim = planner.simulate(closed)
    assert sim.method == "simulated" and sim.hit_rates == closed.hit_rates
    assert sim.ttft_mean_s >= closed.compute_mean_s  # at least the prefill of the uncached tokens
    assert 0 < sim.utilisation["gpu"] < 1 and sim.utilisation["ssd"] > 0
    win = planner.simulate(closed, max_requests=10)
    assert "last 10" in win.method


def test_search_recommends_within_budget_and_explains_runners_up(planner, cat):
    mixes = enumerate_mixes(cat, [0, 64], [1, 2], [4])
    res = search(planner, mixes, budget=2000, finalists=3, sim_requests=200)
    assert res.recommended is not None and res.recommended.storage_capex_usd <= 2000
    assert len(res.runners_up) == 2 and all(why for _, why in res.runners_up)
    front = pareto_front(res.screened)
    costs = [p.cost_per_mtok_usd for p in front]
    assert costs == sorted(costs) and [p.ttft_mean_s for p in front] == sorted((p.ttft_mean_s for p in front),
                                                                               reverse=True)
    none = search(planner, mixes, ttft_target=1e-6, finalists=2, sim_requests=100)
    assert none.recommended is None  # nothing reaches a microsecond TTFT
    json.dumps(res.recommended.row(), default=float)
