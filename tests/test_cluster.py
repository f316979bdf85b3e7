"""The cluster level with real processes: a Mooncake master and kvswarm nodes, each in its own
process, inside network namespaces the tests make (loopback only)."""

from __future__ import annotations

import pytest

from cluster_net import Cluster


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()


def drives(tmp_path, name: str, n: int = 2) -> list[str]:
    out = []
    for i in range(n):
        d = tmp_path / f"{name}-d{i}"
        d.mkdir()
        out.append(str(d))
    return out


CFG = {"master": "127.0.0.1:50051", "segment_bytes": 64 << 20, "buffer_bytes": 16 << 20, "replicas": 1,
       "check_interval_s": 0.2}


def test_decode_node_reads_what_prefill_node_published(cluster, tmp_path):
    ns = cluster.netns()
    cluster.master(ns)
    a, b = cluster.node(ns, "a"), cluster.node(ns, "b")
    a.call("open", drives=drives(tmp_path, "a"), cluster=CFG)
    b.call("open", drives=drives(tmp_path, "b"), cluster=CFG | {"publish": "none"})
    a.call("put", seed=1, n=40)
    got = b.call("get", seed=1, n=40)
    assert got == {"served": 40, "tiers": {"cluster": 40}, "wrong": 0}
    # promoted into B's own SSD pool: served locally now
    got = b.call("get", seed=1, n=40)
    assert got["served"] == 40 and got["wrong"] == 0 and set(got["tiers"]) == {"ssd"}
    # never published: a miss everywhere
    assert b.call("get", seed=2, n=5)["served"] == 0
