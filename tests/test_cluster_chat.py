"""A transformers ChatSession across two processes with the real SmolLM2 (the nodes of `kvswarm demo
--cluster`): node B's first turn for a prompt node A answered is served from the cluster, with the
first token of a from-scratch prefill."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_net import Cluster, node_env

pytestmark = pytest.mark.model
pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def model_present():
    from kvswarm.errors import KVSwarmError
    from kvswarm.model import find_gguf

    try:
        find_gguf()
    except KVSwarmError as e:
        pytest.skip(str(e))


def node(ns, role: str, tmp_path: Path, cfg: dict) -> subprocess.Popen:
    d = tmp_path / role
    d.mkdir()
    return subprocess.Popen([*ns.wrap(), sys.executable, "-m", "kvswarm.cluster.demo_node", role, str(d),
                             json.dumps(cfg), "150"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / f"{role}.log", "w"),
                            text=True, env=node_env())


def test_decode_node_first_turn_served_from_cluster(tmp_path):
    c = Cluster(tmp_path)
    procs = []
    try:
        ns = c.netns()
        c.master(ns)
        cfg = {"master": "127.0.0.1:50051", "segment_bytes": 64 << 20, "buffer_bytes": 16 << 20}
        procs.append(pa := node(ns, "prefill", tmp_path, cfg))
        a = json.loads(pa.stdout.readline())  # A stays up: its segment holds the published blocks
        procs.append(pb := node(ns, "decode", tmp_path, cfg | {"publish": "none"}))
        b = json.loads(pb.communicate(timeout=300)[0].strip().splitlines()[-1])
        pa.communicate("", timeout=60)
        assert a["reused_tokens"] == 0 and b["prompt_tokens"] == a["prompt_tokens"]
        # every full block but the last token's
        assert b["tiers"] == ["cluster"] and b["reused_tokens"] >= b["prompt_tokens"] - 16
        assert b["first_token"] == b["recompute_first_token"] and b["max_logit_diff"] < 1e-3
        assert b["reply"] == a["reply"]
    finally:
        for p in procs:
            p.kill()
        c.cleanup()
