"""``kvswarm demo --cluster``: prefill on one node, decode on another, with the real SmolLM2.

A Mooncake master and two kvswarm nodes (:mod:`kvswarm.cluster.demo_node`, each a process with its
own drive) run inside a network namespace of the demo's own (only loopback).  Node A answers a chat
message carrying a real document: it computes the prompt's KV, stores it and publishes it.  Node B,
on an empty drive, answers the same message with the prompt's KV fetched from the cluster; the
demo prints both times to first token, B's from-scratch prefill of the same prompt, and whether
B's first token is the recomputed one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvswarm.cluster import netns
from kvswarm.errors import ClusterError

PORT = 50051


def _node(role: str, root: Path, cfg: dict, tokens: int) -> subprocess.Popen:
    d = root / role
    d.mkdir()
    env = dict(os.environ, GLOG_minloglevel="2")  # Mooncake logs errors only
    return subprocess.Popen([sys.executable, "-m", "kvswarm.cluster.demo_node", role, str(d), json.dumps(cfg),
                             str(tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(root / f"{role}.log", "w"), text=True, env=env)


def _line(p: subprocess.Popen, log: Path) -> dict:
    line = p.stdout.readline()
    if not line:
        raise ClusterError(f"a demo node exited ({p.wait()}); its log: {log}")
    return json.loads(line)


def run(args: argparse.Namespace) -> int:
    tokens = args.tokens or (512 if args.quick else 2048)
    if not netns.private():  # the master and both nodes in a network namespace of their own
        return netns.rerun_private(["demo", "--cluster", "--tokens", str(tokens)]
                                   + (["--json", os.path.abspath(args.json)] if args.json else []))
    from kvswarm.cluster.master import MasterProcess

    root = Path(tempfile.mkdtemp(prefix="kvswarm-cluster-demo-", dir=args.dir))
    cfg = {"master": f"127.0.0.1:{PORT}", "segment_bytes": 128 << 20, "buffer_bytes": 32 << 20,
           "fetch_buffer_bytes": 128 << 20}
    procs: list[subprocess.Popen] = []
    try:
        with MasterProcess(port=PORT, metrics_port=PORT + 1, log_path=root / "master.log"):
            print(f"cluster demo: a Mooncake master and two nodes in a private network namespace (files in {root})")
            procs.append(pa := _node("prefill", root, cfg, tokens))
            a = _line(pa, root / "prefill.log")
            print(f"node A (prefill): {a['prompt_tokens']} prompt tokens computed in {a['ttft_s']:.2f} s, "
                  f"{a['cluster'].get('published_blocks', 0)} blocks published")
            procs.append(pb := _node("decode", root, cfg | {"publish": "none"}, tokens))
            b = _line(pb, root / "decode.log")
            pa.communicate("", timeout=60)
            same = b["first_token"] == b["recompute_first_token"]
            print(f"node B (decode):  {b['reused_tokens']} of {b['prompt_tokens']} prompt tokens from "
                  f"{', '.join(b['tiers']) or 'nowhere'}: first token after {b['ttft_s']:.2f} s "
                  f"(fetch {b['load_s']:.2f} s) vs {b['recompute_s']:.2f} s to recompute "
                  f"(x{b['recompute_s'] / max(b['ttft_s'], 1e-9):.1f}); first token "
                  f"{'equal to' if same else 'DIFFERENT from'} the recomputed one (max logit diff "
                  f"{b['max_logit_diff']:.1e})")
            print(f"node B's reply: {b['reply']!r}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"demo": "cluster", "prefill": a, "decode": b, "summary": {
                        "prompt_tokens": b["prompt_tokens"], "reused_tokens": b["reused_tokens"],
                        "ttft_cluster_s": b["ttft_s"], "recompute_s": b["recompute_s"],
                        "first_token_equal": same}}, f, indent=1)
            ok = same and b["reused_tokens"] > 0
            if ok and not args.dir:
                shutil.rmtree(root, ignore_errors=True)  # kept (drives, logs) when something went wrong
            return 0 if ok else 1
    except ClusterError as e:
        print(f"kvswarm demo --cluster: {e}", file=sys.stderr)
        return 2
    finally:
        for p in procs:
            p.kill()
