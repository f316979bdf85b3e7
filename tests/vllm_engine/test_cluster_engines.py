"""Two real vLLM CPU engines, two processes, each with its own kvswarm drives, sharing one Mooncake
master inside a network namespace of the test's own: engine B's first request for a prompt that
engine A prefilled is served from the cluster, with the logprobs of A's from-scratch prefill."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from cluster_net import Cluster
from test_engine import BLOCKS, engine_command

CFG = {"master": "127.0.0.1:50051", "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20,
       "fetch_buffer_bytes": 16 << 20}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tiny_model import build

    return build(str(tmp_path_factory.mktemp("tiny-llama")))


def test_engine_b_first_request_served_from_what_engine_a_published(model_dir, tmp_path, drive_dirs):
    c = Cluster(tmp_path)
    a = None
    try:
        ns = c.netns()
        c.master(ns)
        ready, stop = str(tmp_path / "a.json"), str(tmp_path / "stop")
        cmd, env = engine_command(model_dir, drive_dirs(2), "serve", ready)
        with open(tmp_path / "a.log", "w") as log:  # A stays up: its DRAM segment holds what it published
            a = subprocess.Popen([*ns.wrap(), *cmd, "--stop", stop, "--cluster", json.dumps(CFG)], env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not os.path.exists(ready) and a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(ready), (tmp_path / "a.log").read_text()[-6000:]
        with open(ready) as f:
            ra = json.load(f)
        assert ra["first"]["cached_tokens"] == 0 and ra["objects_after_write"] == BLOCKS
        assert ra["cluster"]["published_blocks"] == BLOCKS

        b_drives = [str(tmp_path / "b0"), str(tmp_path / "b1")]
        for d in b_drives:
            os.makedirs(d)
        out = str(tmp_path / "b.json")
        cmd, env = engine_command(model_dir, b_drives, "read", out)
        proc = subprocess.run([*ns.wrap(), *cmd, "--cluster", json.dumps(CFG | {"publish": "none"})], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        with open(out) as f:
            rb = json.load(f)
        assert rb["objects_before"] == 0  # B's own drives start empty
        assert rb["cluster"]["fetched_blocks"] == BLOCKS and rb["cluster"].get("corrupt", 0) == 0
        assert rb["first"]["cached_tokens"] == BLOCKS * 32  # every full block from the cluster
        assert rb["first"]["tokens"] == ra["first"]["tokens"]
        assert rb["first"]["logprobs"] == ra["first"]["logprobs"]
        assert rb["objects_after"] == BLOCKS  # promoted into B's own drives
        assert rb["cluster"].get("published_blocks", 0) == 0  # publish: none
    finally:
        if a is not None:
            open(stop, "w").close()
            try:
                a.wait(timeout=120)
            except subprocess.TimeoutExpired:
                a.kill()
        c.cleanup()
