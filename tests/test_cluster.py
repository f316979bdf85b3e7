"""The cluster level with real processes: a Mooncake master and kvswarm nodes, each in its own
process, inside network namespaces the tests make (loopback only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster_net import Cluster, ip, node_env, veth


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
    text = b.call("metrics")["text"]
    assert 'kvswarm_cluster_fetched_blocks_total{node="' in text
    fetched = [ln for ln in text.splitlines() if ln.startswith("kvswarm_cluster_fetched_blocks_total")]
    assert float(fetched[0].rsplit(" ", 1)[1]) == 40


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
    assert served_all(b, seed=5, n=30)["served"] == 30  # the other replicas serve
    a2 = cluster.node(ns, "a2")
    assert a2.call("open", drives=da, cluster=cfg)["republished"] == 30
    assert served_all(c, seed=5, n=30) == {"served": 30, "tiers": {"cluster": 30}, "wrong": 0}


def served_all(node, seed: int, n: int, tries: int = 40) -> dict:
    """``get`` until all ``n`` blocks are served (the master notices a dead node's replicas within its
    client TTL; until then a read may pick one and miss); never a wrong byte on the way."""
    got: dict = {}
    for _ in range(tries):
        got = node.call("get", seed=seed, n=n, promote=False)
        assert got["wrong"] == 0
        if got["served"] == n:
            break
        time.sleep(0.25)
    return got


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


def test_refused_republication_lands_once_the_cluster_has_room(cluster, tmp_path):
    """A node re-publishing into a cluster with no memory to lend (a restarted master before the
    nodes' segments are mounted again looks the same) is refused; it tries again every check
    interval, and its blocks land once a node lending memory joins."""
    ns = cluster.netns()
    cluster.master(ns)
    da = drives(tmp_path, "a")
    lends_nothing = CFG | {"segment_bytes": 0, "republish_retry_s": 60}
    a = cluster.node(ns, "a")
    a.call("open", drives=da, cluster=lends_nothing)
    a.call("put", seed=9, n=20)
    a.close()
    a2 = cluster.node(ns, "a2")
    with ThreadPoolExecutor(1) as ex:
        opening = ex.submit(a2.call, "open", drives=da, cluster=lends_nothing, timeout=120)
        time.sleep(2)
        assert not opening.done()  # refused so far, and trying again
        b = cluster.node(ns, "b")
        b.call("open", drives=drives(tmp_path, "b"), cluster=CFG | {"publish": "none"})
        assert opening.result()["republished"] == 20
    assert a2.call("stats")["counters"]["publish_failures"] >= 20
    assert served_all(b, seed=9, n=20) == {"served": 20, "tiers": {"cluster": 20}, "wrong": 0}


def test_partition_between_nodes(cluster, tmp_path):
    """Two namespaces joined by a veth pair (the test's own addresses): with the link down, the node
    cut off from the master and the other node serves its own blocks and misses the rest, within its
    rpc timeout; with the link back up, it reads the cluster again."""
    na, nb = cluster.netns(), cluster.netns()
    sub = f"10.213.{os.getpid() % 250}"
    la, _ = veth(na, nb, f"{sub}.1", f"{sub}.2")
    master = f"{sub}.1:50051"
    cluster.master(na, host=f"{sub}.1", client_ttl_s=2)
    a, b = cluster.node(na, "a"), cluster.node(nb, "b")
    a.call("open", drives=drives(tmp_path, "a"), cluster=CFG | {"master": master, "local_hostname": f"{sub}.1"})
    b.call("open", drives=drives(tmp_path, "b"), cluster=CFG | {
        "master": master, "local_hostname": f"{sub}.2", "publish": "none", "rpc_timeout_s": 1.0})
    a.call("put", seed=11, n=20)
    assert b.call("get", seed=11, n=10) == {"served": 10, "tiers": {"cluster": 10}, "wrong": 0}
    ip("-n", na.name, "link", "set", la, "down")
    try:
        t0 = time.monotonic()
        got = b.call("get", seed=11, n=20, timeout=30)
        assert got == {"served": 10, "tiers": {"ssd": 10}, "wrong": 0}
        assert time.monotonic() - t0 < 10
        assert a.call("get", seed=11, n=20) == {"served": 20, "tiers": {"ssd": 20}, "wrong": 0}
        a.call("put", seed=12, n=10)  # the master's side goes on publishing
    finally:
        ip("-n", na.name, "link", "set", la, "up")
    got = {}
    for _ in range(60):
        got = b.call("get", seed=12, n=10, promote=False, timeout=30)
        assert got["wrong"] == 0
        if got["served"] == 10:
            break
        time.sleep(0.5)
    assert got == {"served": 10, "tiers": {"cluster": 10}, "wrong": 0}


def test_master_failover_through_etcd(cluster, tmp_path):
    """Two masters elect a leader in etcd; the leader killed -9, the standby takes over (with an empty
    index): nodes follow it, and the publishing node re-publishes its durable blocks there."""
    ns = cluster.netns()
    etcd = cluster.etcd(ns)
    masters = [cluster.master(ns, port=p, client_ttl_s=2, etcd=etcd.endpoint) for p in (50051, 50061)]
    cfg = CFG | {"master": f"etcd://{etcd.endpoint}"}
    a, b = cluster.node(ns, "a"), cluster.node(ns, "b")
    a.call("open", drives=drives(tmp_path, "a"), cluster=cfg)
    b.call("open", drives=drives(tmp_path, "b"), cluster=cfg | {"publish": "none", "rpc_timeout_s": 1.0})
    a.call("put", seed=13, n=20)
    assert b.call("get", seed=13, n=10) == {"served": 10, "tiers": {"cluster": 10}, "wrong": 0}
    leader = subprocess.run([*ns.wrap(), "etcdctl", f"--endpoints={etcd.endpoint}", "get", "--print-value-only",
                             "mooncake-store/mooncake_cluster/master_view"], capture_output=True, text=True,
                            timeout=10).stdout.strip()
    next(m for m in masters if leader.endswith(f":{m.port}")).stop(kill=True)
    assert b.call("get", seed=13, n=20, timeout=60)["tiers"] == {"ssd": 10}  # its own blocks meanwhile
    for _ in range(60):
        if a.call("maintain", seconds=0.5, timeout=60)["republished"] >= 20:
            break
    got = b.call("get", seed=13, n=20, timeout=60)
    assert got == {"served": 20, "tiers": {"ssd": 10, "cluster": 10}, "wrong": 0}


def test_cli_cluster_up_and_status(cluster, tmp_path):
    ns = cluster.netns()
    cli = [*ns.wrap(), sys.executable, "-m", "kvswarm.cluster.cli"]  # what `kvswarm cluster` runs
    up = subprocess.Popen([*cli, "up", "--port", "50051"], stdout=subprocess.PIPE, text=True, env=node_env(),
                          start_new_session=True)
    try:
        assert up.stdout.readline().startswith("master on 127.0.0.1:50051")
        join = json.loads(up.stdout.readline().split(":", 1)[1])
        a = cluster.node(ns, "a")
        a.call("open", drives=drives(tmp_path, "a"), cluster=CFG | join)
        a.call("put", seed=17, n=12)
        assert a.call("get", seed=18, n=3)["served"] == 0  # never published: 3 index misses
        a.call("maintain", seconds=0.5)  # its checks publish its counters
        st = subprocess.run([*cli, "status", "--json"], capture_output=True, text=True, env=node_env(), timeout=60)
        s = json.loads(st.stdout)
        assert s["blocks"] == 12 and s["objects"] >= 12 and len(s["segments"]) == 1
        assert s["allocated_bytes"] >= 12 * (64 << 10)
        (node,) = s["nodes"].values()  # a's own report
        assert node["index_misses"] == 3 and node["published_blocks"] == 12 and node["corrupt"] == 0
        text = subprocess.run([*cli, "status"], capture_output=True, text=True, env=node_env(), timeout=60).stdout
        assert "12 KV blocks" in text and "1 node(s) reporting" in text
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(60)  # the master is given 10 s to stop, then killed: bounded, slower under load
    bad = subprocess.run([*cli, "status"], capture_output=True, text=True, env=node_env(), timeout=60)
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
