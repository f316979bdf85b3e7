"""`kvswarm bench cluster --quick`, CI-sized: a Mooncake master and the benchmark's nodes in a network
namespace of their own, real SmolLM2 prefill on node A, node B served from the cluster and from its
own SSD pool, Mooncake's SSD offload against kvswarm's level, and a master restart with re-publication.
(Figures are the benchmark's business: only what must hold is asserted.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_venv import ROOT

pytestmark = [pytest.mark.model, pytest.mark.root]


def test_quick_run_serves_node_b_from_the_cluster_and_loses_nothing(tmp_path):
    out = tmp_path / "cluster.json"
    proc = subprocess.run([sys.executable, "-m", "kvswarm.cli", "bench", "cluster", "--quick", "--prefix-tokens", "512",
                           "--dram-mib", "16", "--restart-blocks", "2000", "--json", str(out), "--dir",
                           str(tmp_path / "scratch")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    s = r["summary"]
    assert s["wrong_bytes"] == 0 and s["first_tokens_match"]
    assert r["ttft"]["cases"]["cluster"]["served_from"] == "cluster"
    assert r["ttft"]["cases"]["cluster"]["reused_tokens"] == 512
    assert s["flushed_readable_kvswarm"] == 1.0
    assert s["ttft_speedup_cluster_vs_recompute"] > 0 and s["cluster_fetch_gbps"] > 0
    # The master restarted with an empty index: every block is found again, re-published from the drive.
    assert r["restart"]["found"] == 2000 and r["restart"]["republished"] >= 2000
    assert r["restart"]["sample_wrong_bytes"] == 0
