"""`kvswarm cluster up` starts a Mooncake master for a one-machine cluster and prints how to join it;
`kvswarm cluster status` prints what a master holds (objects, bytes, the nodes' segments)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

from kvswarm.errors import ClusterError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start a master (foreground; Ctrl-C stops it) and print the join config")
    up.add_argument("--host", default="127.0.0.1", help="address the master binds (default: loopback only)")
    up.add_argument("--port", type=int, default=50051)
    up.add_argument("--metrics-port", type=int, default=9003)
    up.add_argument("--etcd", help="etcd endpoints (host:port[;...]): run as one of several HA masters")
    up.add_argument("--log", help="master log file (default: discarded)")
    st = sub.add_parser("status", help="objects, bytes and nodes of a running master")
    st.add_argument("--host", default="127.0.0.1")
    st.add_argument("--metrics-port", type=int, default=9003)
    st.add_argument("--json", action="store_true", help="print JSON instead of text")


def _metrics(host: str, port: int) -> dict:
    """The master's prometheus metrics: name -> value, and per-segment (node) bytes."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise ClusterError(f"no master metrics at {host}:{port}: {e}") from None
    out: dict = {"segments": {}}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        if name.startswith("segment_") and '{segment="' in name:
            metric, seg = name.split('{segment="')
            out["segments"].setdefault(seg.rstrip('"}'), {})[metric.removeprefix("segment_")] = v
        elif "{" not in name:
            out[name] = v
    return out


def status(host: str, port: int) -> dict:
    m = _metrics(host, port)
    return {"objects": int(m.get("master_key_count", 0)), "allocated_bytes": int(m.get("master_allocated_bytes", 0)),
            "capacity_bytes": int(m.get("master_total_capacity_bytes", 0)),
            "nodes": {seg: {"allocated_bytes": int(v.get("allocated_bytes", 0)),
                            "capacity_bytes": int(v.get("total_capacity_bytes", 0))}
                      for seg, v in sorted(m["segments"].items())}}


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "status":
            s = status(args.host, args.metrics_port)
            if args.json:
                print(json.dumps(s, indent=1))
                return 0
            print(f"objects {s['objects']}, {s['allocated_bytes'] / 1e6:.1f} MB of {s['capacity_bytes'] / 1e6:.1f} MB "
                  f"in {len(s['nodes'])} node segment(s)")
            for seg, v in s["nodes"].items():
                print(f"  {seg:24s} {v['allocated_bytes'] / 1e6:10.1f} MB of {v['capacity_bytes'] / 1e6:.1f} MB")
            return 0
        from kvswarm.cluster.master import MasterProcess

        m = MasterProcess(host=args.host, port=args.port, metrics_port=args.metrics_port, etcd=args.etcd,
                          log_path=args.log).start()
        master = f"etcd://{args.etcd}" if args.etcd else m.address
        print(f"master on {m.address} (metrics on {args.host}:{args.metrics_port}); join with:")
        join = {"master": master, "metadata": "P2PHANDSHAKE", "protocol": "tcp", "local_hostname": args.host}
        print(f'  "cluster": {json.dumps(join)}')
        print("Ctrl-C stops it.", flush=True)
        try:
            while m.proc is not None and m.proc.poll() is None:
                time.sleep(0.5)
            print(f"kvswarm cluster: the master exited ({m.proc.returncode if m.proc else '?'})", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            m.stop()
    except ClusterError as e:
        print(f"kvswarm cluster: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python -m kvswarm.cluster.cli`: the same, without loading the other subcommands
    parser = argparse.ArgumentParser(prog="kvswarm cluster", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
