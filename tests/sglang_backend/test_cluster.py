"""The SGLang backend's ``cluster`` section: two backend processes (SGLang's factory, real host pools),
each on its own drives, one Mooncake master, all inside a network namespace of the test's own: pages
one stored are found, fetched, verified and promoted by the other."""

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
