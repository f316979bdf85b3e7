"""The SGLang backend's ``cluster`` section: two backend processes (SGLang's factory, real host pools),
each on its own drives, one Mooncake master, all inside a network namespace of the test's own: pages
one stored are found, fetched, verified and promoted by the other; and a backend re-publishes the pages on
its drives after the master restarted, and at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cluster_net import Cluster, node_env

from kvswarm.errors import ClusterError

NODE = os.path.join(os.path.dirname(__file__), "cluster_backend.py")
CFG = {"master": "127.0.0.1:50051", "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20,
       "fetch_buffer_bytes": 16 << 20}


def node(ns, role: str, drive: str, cfg: dict, log: str) -> subprocess.Popen:
    os.makedirs(drive)
    return subprocess.Popen([*ns.wrap(), sys.executable, NODE, role, drive, json.dumps(cfg)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=node_env(),
                            cwd=os.path.dirname(__file__))


def test_decode_backend_reads_pages_the_prefill_backend_stored(tmp_path):
    c = Cluster(tmp_path)
    procs = []
    try:
        ns = c.netns()
        c.master(ns)
        procs.append(pa := node(ns, "prefill", str(tmp_path / "a"), CFG, str(tmp_path / "a.log")))
        # B starts beside A and asks once A is done
        procs.append(pb := node(ns, "decode", str(tmp_path / "b"), CFG | {"publish": "none"}, str(tmp_path / "b.log")))
        line = pa.stdout.readline()
        assert line, (tmp_path / "a.log").read_text()[-4000:]
        a = json.loads(line)
        assert a["set"] == [True] * 6 and a["exists"] == 6 and a["counters"]["published_blocks"] == 6
        out, _ = pb.communicate("go\n", timeout=300)
        assert out.strip(), (tmp_path / "b.log").read_text()[-4000:]
        b = json.loads(out.strip().splitlines()[-1])
        pa.communicate("", timeout=60)
        assert b["local_before"] == 0 and b["exists"] == 6  # all from the cluster, the unknown key not
        assert b["get_v1"] == [True] * 6 and b["v1_equal"]
        assert b["fetched_after_v1"] == 6 and b["counters"].get("corrupt", 0) == 0
        assert b["local_after"] == 6 and b["generic_equal"]  # promoted, then read from its own drives
        assert b["counters"].get("published_blocks", 0) == 0
    finally:
        for p in procs:
            p.kill()
        c.cleanup()


def test_bad_cluster_section_is_a_clear_error(drive_dirs):
    from test_backend import storage_config

    from kvswarm.integrations.sglang import KVSwarmHiCacheStorage

    drives = drive_dirs(1)
    with pytest.raises(ClusterError, match="unknown cluster option"):
        KVSwarmHiCacheStorage(storage_config(drives, cluster={"mastr": "x:1"}))
    with pytest.raises(ClusterError, match="'all' or 'none'"):
        KVSwarmHiCacheStorage(storage_config(drives, cluster={"publish": "sighted:2"}))


def test_backend_republishes_its_pages_after_a_master_restart_and_at_start(tmp_path):
    """The master restarted (its index is empty): the backend's own thread finds the node's marker gone
    and re-publishes the pages on its drives, with no call of SGLang's; and a backend opened on drives
    that hold pages (into a master that lost them) re-publishes them at start."""
    c = Cluster(tmp_path)
    p = None
    log = tmp_path / "a.log"

    def say(line: str) -> dict:
        p.stdin.write(line + "\n")
        p.stdin.flush()
        out = p.stdout.readline()
        assert out, log.read_text()[-4000:]
        return json.loads(out)

    try:
        ns = c.netns()
        m = c.master(ns)
        p = node(ns, "restart", str(tmp_path / "a"), CFG | {"check_interval_s": 0.2, "republish_batch": 4}, str(log))
        line = p.stdout.readline()
        assert line, log.read_text()[-4000:]
        assert json.loads(line) == {"set": [True] * 6, "indexed": 6}
        m.stop(kill=True)
        m.start()
        after = say("restarted")
        assert after["indexed"] == 6 and after["republished"] >= 6 and after["equal"], after
        assert say("close")["close_s"] < 10  # the thread stops within one step
        m.stop(kill=True)  # the pages left the cluster with the backend's segment; the new master knows none
        m.start()
        opened = say("restarted")
        assert opened["local"] == 6 and opened["indexed"] == 6 and opened["republished"] >= 6 and opened["equal"]
        p.stdin.close()
        assert p.wait(60) == 0, log.read_text()[-4000:]
        print(f"re-published after a master restart in {after['seconds']:.2f} s, at start in "
              f"{opened['seconds']:.2f} s")
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        c.cleanup()
