"""Two real vLLM CPU engines, two processes, each with its own kvswarm drives, sharing one Mooncake
master inside a network namespace of the test's own: engine B's first request for a prompt that
engine A prefilled is served from the cluster, with the logprobs of A's from-scratch prefill.  And a
tier re-publishes its chunks after the master restarted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from cluster_net import Cluster, node_env
from test_engine import BLOCKS, engine_command

HERE = os.path.dirname(__file__)

CFG = {"master": "127.0.0.1:50051", "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20,
       "fetch_buffer_bytes": 16 << 20}


def wait_for(path: str, proc: subprocess.Popen, log) -> dict:
    deadline = time.monotonic() + 600
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert os.path.exists(path), log.read_text()[-6000:]
    with open(path) as f:
        return json.load(f)


def test_engine_b_first_request_served_from_what_engine_a_published(model_dir, tmp_path):
    c = Cluster(tmp_path)
    procs: list[subprocess.Popen] = []
    stop, go = str(tmp_path / "stop"), str(tmp_path / "go")
    try:
        ns = c.netns()
        c.master(ns)
        runs = {}
        for name, phase, cfg in (("a", "serve", CFG), ("b", "read", CFG | {"publish": "none"})):
            drives = [str(tmp_path / f"{name}{i}") for i in range(2)]
            for d in drives:
                os.makedirs(d)
            out = str(tmp_path / f"{name}.json")
            cmd, env = engine_command(model_dir, drives, phase, out)
            extra = ["--stop", stop] if name == "a" else ["--go", go]  # B starts beside A, asks once A is done
            with open(tmp_path / f"{name}.log", "w") as log:  # A stays up: its segment holds what it published
                procs.append(subprocess.Popen([*ns.wrap(), *cmd, *extra, "--cluster", json.dumps(cfg)], env=env,
                                              stdout=log, stderr=subprocess.STDOUT))
            runs[name] = out
        a, b = procs
        ra = wait_for(runs["a"], a, tmp_path / "a.log")
        assert ra["first"]["cached_tokens"] == 0 and ra["objects_after_write"] == BLOCKS
        assert ra["cluster"]["published_blocks"] == BLOCKS
        open(go, "w").close()
        assert b.wait(600) == 0, (tmp_path / "b.log").read_text()[-6000:]
        with open(runs["b"]) as f:
            rb = json.load(f)
        assert rb["objects_before"] == 0  # B's own drives start empty
        assert rb["cluster"]["fetched_blocks"] == BLOCKS and rb["cluster"].get("corrupt", 0) == 0
        assert rb["first"]["cached_tokens"] == BLOCKS * 32  # every full block from the cluster
        assert rb["first"]["tokens"] == ra["first"]["tokens"]
        assert rb["first"]["logprobs"] == ra["first"]["logprobs"]
        assert rb["objects_after"] == BLOCKS  # promoted into B's own drives
        assert rb["cluster"].get("published_blocks", 0) == 0  # publish: none
    finally:
        open(stop, "w").close()
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
        c.cleanup()


def test_tier_republishes_its_chunks_after_a_master_restart(tmp_path):
    """The master restarted (its index is empty): the tier finds its marker gone and re-publishes the
    chunks on its drives."""
    c = Cluster(tmp_path)
    p = None
    try:
        ns = c.netns()
        m = c.master(ns)
        (tmp_path / "d").mkdir()
        cfg = CFG | {"check_interval_s": 0.2}
        p = subprocess.Popen([*ns.wrap(), sys.executable, os.path.join(HERE, "cluster_tier.py"), str(tmp_path / "d"),
                              json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=open(tmp_path / "tier.log", "w"), text=True, env=node_env())
        line = p.stdout.readline()
        assert line, (tmp_path / "tier.log").read_text()[-4000:]
        assert json.loads(line) == {"stored": True, "published": 8, "indexed": 8}
        m.stop(kill=True)
        m.start()
        p.stdin.write("restarted\n")
        p.stdin.flush()
        after = json.loads(p.stdout.readline())
        assert after["indexed"] == 8 and after["republished"] >= 8, after
        p.stdin.close()
        assert p.wait(60) == 0
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        c.cleanup()
