"""`kvswarm plan` on a cluster: the projection's arithmetic on a case worked by hand, input checks, and
single-node plans left as they were."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvswarm.errors import BadInput
from kvswarm.planner.cli import main
from kvswarm.planner.cluster import ClusterSpec, project_cluster, union_caps
from kvswarm.planner.cost import Mix
from kvswarm.planner.hardware import CatalogError, default_catalog_path, load_catalog, parse_catalog, tomllib
from kvswarm.planner.models import resolve_model
from kvswarm.planner.project import Planner, PlanSettings
from kvswarm.planner.workload import Workload

SMALL = ["--users", "10", "--context", "2048", "--turns", "3", "--session-s", "300", "--duration-s", "600",
         "--model", "Llama-3-8B", "--dram-gb", "0,32", "--ssd-counts", "1", "--hdd-counts", "4",
         "--finalists", "1", "--sim-requests", "50"]

# A model of 1 layer, 1 KV head of 64 dims in bf16: 2 (K, V) x 64 x 2 bytes = 256 bytes per token;
# 4-token blocks are 1,024 bytes.
TOKEN_B, BLOCK_T = 256, 4
BLOCK_B = TOKEN_B * BLOCK_T


@pytest.fixture(scope="module")
def cat():
    return load_catalog()


def _hand_workload() -> Workload:
    """Four requests of two blocks (8 input tokens) each, 10 s apart:
    r0 [1, 2], r1 [1, 2], r2 [1, 3], r3 [1, 2]."""
    blocks = [np.array(x, np.int64) for x in ([1, 2], [1, 2], [1, 3], [1, 2])]
    return Workload("hand", BLOCK_T, np.array([0.0, 10.0, 20.0, 30.0]), np.full(4, 8), np.full(4, 1), blocks)


@pytest.fixture(scope="module")
def hand(cat):
    model = resolve_model(None, layers=1, kv_heads=1, head_dim=64, q_heads=1, params_b=0.001)
    assert model.token_bytes == TOKEN_B
    return Planner(PlanSettings(_hand_workload(), model, cat.gpus["h100"], cat.links["gen5_x64"], cat))


def test_cluster_projection_matches_the_hand_computation(hand, cat):
    mix = Mix(1, cat.dram["ddr5"])  # 1 GB DRAM: every block of the tiny workload fits on each node
    bw = 8e9  # 64 Gbit/s, B/s
    spec = ClusterSpec(prefill_nodes=2, decode_nodes=1, nic_bytes_per_s=bw, segment_gb=0.5)
    # Union: 2 nodes x 1 GB DRAM tier + 3 nodes x 0.5 GB lent to the pool, in 1,024-byte blocks.
    assert union_caps(hand, mix, spec).dram == 2 * (10**9 // BLOCK_B) + int(1.5e9) // BLOCK_B
    c = project_cluster(hand, mix, spec)
    # Cluster-wide: r0 misses both, r1 hits both, r2 hits block 1 only, r3 hits both: 5 of 8.
    assert c.hit_rate == pytest.approx(5 / 8) and c.hit_rates["dram"] == pytest.approx(5 / 8)
    # Alone, node 0 serves r0 and r2 (1 hit of 4), node 1 serves r1 and r3 (2 of 4): 3 of 8.
    assert c.node_hit_rate == pytest.approx(3 / 8)
    # Half of the 5 hit blocks sit on the other prefill node; each request's 8 tokens of KV go to decode.
    assert c.remote_share == pytest.approx(0.5)
    remote = np.array([0, 2, 1, 2]) * BLOCK_B * 0.5
    kv = 8 * TOKEN_B
    assert c.network_mean_s == pytest.approx(remote.mean() / bw)
    assert c.kv_transfer_mean_s == pytest.approx(kv / bw)
    assert c.network_gb_per_request == pytest.approx((remote.sum() + 4 * kv) / 4 / 1e9)
    dur = 30.0
    assert c.utilisation["nic_prefill"] == pytest.approx((remote.sum() + 4 * kv) / (2 * bw * dur))
    assert c.utilisation["nic_decode"] == pytest.approx(4 * kv / (1 * bw * dur))
    # TTFT: no drives, so a load is the network fetch, then the hit bytes over the GPU link, then prefill.
    hits = np.array([0, 2, 1, 2])
    gpu = cat.gpus["h100"]
    new = 8 - hits * BLOCK_T
    compute = np.array([hand.s.model.prefill_flops(n, 8 - n) for n in new]) / gpu.flops
    ttft = remote / bw + hits * BLOCK_B / gpu.link().bandwidth + compute
    assert c.ttft_mean_s == pytest.approx(ttft.mean())
    # Capital cost: 2 prefill nodes' 1 GB + 3 x 0.5 GB of segments at the DRAM price; no NIC priced.
    assert c.kv_capex_usd == pytest.approx(3.5 * cat.dram["ddr5"].price_usd_per_gb) and c.nic_capex_usd == 0
    assert c.bound == "network"
    json.dumps(c.row())


def test_nics_are_priced_per_node(hand, cat):
    nic = cat.nics["cx7_400g"]
    assert nic.bytes_per_s == pytest.approx(400e9 / 8 * nic.efficiency)
    spec = ClusterSpec.from_args(cat, 3, 2, "cx7_400g", None, 0.0, 1)
    c = project_cluster(hand, Mix(1, cat.dram["ddr5"]), spec)
    assert c.nic_capex_usd == pytest.approx(5 * nic.price_usd)
    assert c.kv_capex_usd == pytest.approx(3 * cat.dram["ddr5"].price_usd_per_gb + 5 * nic.price_usd)


def test_slow_drives_or_a_slow_network_bind(hand, cat):
    """Hits from a slow SSD pool make the drives bind; a thin network makes the network bind."""
    slow_ssd = dataclasses.replace(cat.drives["pm9a3"], read_gbps=1e-6, write_gbps=1e-6)
    mix = Mix(0, cat.dram["ddr5"], slow_ssd, 1)
    fast = project_cluster(hand, mix, ClusterSpec(2, 0, 50e9))
    assert fast.hit_rates["ssd"] == pytest.approx(5 / 8) and fast.bound == "drives"
    thin = project_cluster(hand, Mix(0, cat.dram["ddr5"], cat.drives["pm9a3"], 1), ClusterSpec(2, 1, 1e3))
    # The single decode node takes 4 x 8 tokens of KV; each prefill node hands on half of that plus fetches.
    assert thin.bound == "network" and thin.busiest == "nic_decode"
    assert thin.ttft_mean_s > thin.network_mean_s == pytest.approx(np.mean([0, 2, 1, 2]) * BLOCK_B * 0.5 / 1e3)


def test_one_prefill_node_is_the_single_node_plan(hand, cat):
    """One prefill node (decode elsewhere): the same hits as the node's own plan, nothing fetched remotely."""
    mix = Mix(1, cat.dram["ddr5"])
    c = project_cluster(hand, mix, ClusterSpec(1, 1, 8e9))
    single = hand.screen(mix)
    assert c.hit_rates == single.hit_rates and c.node_hit_rate == c.hit_rate
    assert c.remote_share == 0 and c.network_mean_s == 0 and c.utilisation["nic_prefill"] > 0
    assert c.ttft_mean_s == pytest.approx(single.ttft_mean_s)


def test_help_lists_the_cluster_options(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--prefill-nodes", "--decode-nodes", "--nic", "--network-gbit", "--cluster-segment-gb",
                 "--cluster-replicas"):
        assert flag in out, flag


@pytest.mark.parametrize("args,msg", [
    (["--prefill-nodes", "0"], "--prefill-nodes must be >= 1"),
    (["--decode-nodes", "-1"], "--decode-nodes must be >= 0"),
    (["--prefill-nodes", "2"], "a cluster needs its network"),
    (["--nic", "cx7_400g"], "the cluster options need a cluster"),
    (["--prefill-nodes", "2", "--nic", "wifi"], "no nics entry 'wifi'"),
    (["--prefill-nodes", "2", "--nic", "cx7_400g", "--network-gbit", "100"], "not both"),
    (["--prefill-nodes", "2", "--network-gbit", "-5"], "--network-gbit must be positive"),
    (["--prefill-nodes", "2", "--network-gbit", "100", "--cluster-segment-gb", "-1"], "must be >= 0"),
    (["--prefill-nodes", "2", "--network-gbit", "100", "--cluster-replicas", "0"], "--cluster-replicas must be"),
])
def test_bad_cluster_inputs_give_one_line(args, msg, capsys):
    assert main([*SMALL, *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err


def test_spec_errors_are_kvswarm_errors(cat):
    with pytest.raises(BadInput):
        ClusterSpec(prefill_nodes=0)
    raw = tomllib.loads(default_catalog_path().read_text())
    raw["nics"]["cx7_400g"]["line_gbit"] = 0
    with pytest.raises(CatalogError, match=r"\[nics.cx7_400g\] line_gbit must be > 0"):
        parse_catalog(raw)
    del raw["nics"]  # optional: a catalog without NICs still plans single nodes
    assert parse_catalog(raw).nics == {}


def test_cli_cluster_section_and_unchanged_single_node(tmp_path, capsys):
    one, many = tmp_path / "one.json", tmp_path / "many.json"
    assert main([*SMALL, "--json", str(one), "--plot", str(tmp_path / "a.png")]) == 0
    single_text = capsys.readouterr().out
    assert "Cluster:" not in single_text
    assert main([*SMALL, "--prefill-nodes", "3", "--decode-nodes", "2", "--nic", "cx7_200g",
                 "--cluster-segment-gb", "32", "--json", str(many), "--plot", str(tmp_path / "b.png")]) == 0
    text = capsys.readouterr().out
    assert "Cluster: 3 prefill + 2 decode nodes" in text and "bound:" in text
    a, b = json.loads(one.read_text()), json.loads(many.read_text())
    assert "cluster" not in a
    # The node search is the single-node one: the same recommendation and figures with or without a cluster.
    assert a["recommended"] == b["recommended"] and a["summary"] == b["summary"]
    c = b["cluster"]
    assert (c["prefill_nodes"], c["decode_nodes"], c["nic"]) == (3, 2, "cx7_200g")
    assert c["hit_rate"] >= c["node_hit_rate"] and c["utilisation"]["nic_decode"] > 0
