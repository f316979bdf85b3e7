"""The cluster level with real processes: a Mooncake master and kvswarm nodes, each in its own
process, inside network namespaces the tests make (loopback only)."""

from __future__ import annotations

import time

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


def test_flipped_bit_in_the_cluster_is_a_miss(cluster, tmp_path):
    ns = cluster.netns()
    cluster.master(ns)
    a, b, t = cluster.node(ns, "a"), cluster.node(ns, "b"), cluster.node(ns, "tamper")
    a.call("open", drives=drives(tmp_path, "a"), cluster=CFG)
    b.call("open", drives=drives(tmp_path, "b"), cluster=CFG | {"publish": "none"})
    a.call("put", seed=3, n=10)
    assert t.call("tamper", seed=3, i=4, master=CFG["master"])["rc"] == 0
    got = b.call("get", seed=3, n=10)
    assert got == {"served": 4, "tiers": {"cluster": 4}, "wrong": 0}  # the prefix up to the bad block
    assert b.call("stats")["counters"]["corrupt"] == 1


def test_node_killed_then_back(cluster, tmp_path):
    """Three nodes, two replicas: a node killed -9 leaves replicas or misses (never errors or wrong
    bytes); back on its drives, it re-publishes and its blocks are found again."""
    ns = cluster.netns()
    cluster.master(ns, client_ttl_s=2)
    cfg = CFG | {"replicas": 2}
    a, b, c = cluster.node(ns, "a"), cluster.node(ns, "b"), cluster.node(ns, "c")
    da = drives(tmp_path, "a")
    a.call("open", drives=da, cluster=cfg)
    b.call("open", drives=drives(tmp_path, "b"), cluster=cfg | {"publish": "none"})
    c.call("open", drives=drives(tmp_path, "c"), cluster=cfg | {"publish": "none"})
    a.call("put", seed=5, n=30)
    a.kill()
    got = b.call("get", seed=5, n=30, promote=False)  # at once: replicas, or misses
    assert got["wrong"] == 0 and set(got["tiers"]) <= {"cluster"}
    served = 0
    for _ in range(40):  # once the master has dropped A's segment, the other replicas serve
        got = b.call("get", seed=5, n=30, promote=False)
        assert got["wrong"] == 0
        served = got["served"]
        if served == 30:
            break
        time.sleep(0.25)
    assert served == 30
    a2 = cluster.node(ns, "a2")
    assert a2.call("open", drives=da, cluster=cfg)["republished"] == 30
    got = c.call("get", seed=5, n=30)
    assert got == {"served": 30, "tiers": {"cluster": 30}, "wrong": 0}


def test_master_killed_and_restarted(cluster, tmp_path):
    """Nodes keep serving from their own tiers while the master is down, rejoin it when it is back,
    and re-publish their durable blocks into its empty index."""
    ns = cluster.netns()
    m = cluster.master(ns, client_ttl_s=2)
    a, b = cluster.node(ns, "a"), cluster.node(ns, "b")
    a.call("open", drives=drives(tmp_path, "a"), cluster=CFG)
    b.call("open", drives=drives(tmp_path, "b"), cluster=CFG | {"publish": "none"})
    a.call("put", seed=7, n=20)
    assert b.call("get", seed=7, n=10)["tiers"] == {"cluster": 10}
    m.stop(kill=True)
    got = b.call("get", seed=7, n=20)  # the first 10 are B's own now; the rest miss, no error
    assert got == {"served": 10, "tiers": {"ssd": 10}, "wrong": 0}
    assert a.call("get", seed=7, n=20) == {"served": 20, "tiers": {"ssd": 20}, "wrong": 0}
    m.start()
    for _ in range(40):  # the clients rejoin; A finds its blocks unindexed and re-publishes them
        if a.call("maintain", seconds=0.5)["republished"] >= 20:
            break
    got = b.call("get", seed=7, n=20)
    assert got == {"served": 20, "tiers": {"ssd": 10, "cluster": 10}, "wrong": 0}
