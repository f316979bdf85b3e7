"""`kvswarm cluster up` starts a Mooncake master for a one-machine cluster and prints how to join it;
`kvswarm cluster status` prints what a master holds (objects, bytes, the nodes' segments) and each
node's counters (index hits and misses, fetches, publications), which the nodes publish as small
objects ``<prefix>:stats:<node>`` in the cluster itself (read here as a client lending no memory)."""

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
    st.add_argument("--port", type=int, default=50051, help="the master's RPC port (to read the nodes' counters)")
    st.add_argument("--prefix", default="kvs", help="the deployment's object prefix (ClusterConfig.prefix)")
    st.add_argument("--json", action="store_true", help="print JSON instead of text")


def _get(host: str, port: int, path: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/{path}", timeout=5) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise ClusterError(f"no master metrics at {host}:{port}: {e}") from None


def _metrics(host: str, port: int) -> dict:
    """The master's prometheus metrics: name -> value, and per-segment (node) bytes."""
    text = _get(host, port, "metrics")
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


def _keys(host: str, port: int) -> list[str]:
    """Every object name the master indexes (its HTTP ``get_all_keys``: one per line)."""
    return [k for k in _get(host, port, "get_all_keys").split() if k]


def _node_reports(host: str, rpc_port: int, keys: list[str]) -> list[dict]:
    """The nodes' published counters, read as a cluster client that lends no memory."""
    if not keys:
        return []
    from kvswarm.cluster.config import ClusterConfig
    from kvswarm.cluster.pool import ClusterPool

    cfg = ClusterConfig(master=f"{host}:{rpc_port}", local_hostname=host, segment_bytes=0, buffer_bytes=4 << 20,
                        fetch_buffer_bytes=1 << 20, publish="none")
    with ClusterPool(cfg, threads=1) as pool:
        return pool.reports(keys)


def node_view(report: dict, now: float) -> dict:
    """A node's report as status shows it: index hits and misses, fetches, publications."""
    c = report.get("counters", {})
    asked, found = int(c.get("lookup_blocks", 0)), int(c.get("lookup_found", 0))
    return {"host": report.get("host", "?"), "age_s": round(max(0.0, now - float(report.get("time", now))), 1),
            "index_hits": found, "index_misses": asked - found, "fetched_blocks": int(c.get("fetched_blocks", 0)),
            "fetch_misses": int(c.get("fetch_misses", 0)), "corrupt": int(c.get("corrupt", 0)),
            "published_blocks": int(c.get("published_blocks", 0)),
            "republished_blocks": int(c.get("republished_blocks", 0)), "timeouts": int(c.get("timeouts", 0))}


def status(host: str, port: int, rpc_port: int = 50051, prefix: str = "kvs") -> dict:
    m = _metrics(host, port)
    keys = _keys(host, port)
    mine = [k for k in keys if k.startswith(f"{prefix}:")]
    stats = [k for k in mine if k.startswith(f"{prefix}:stats:")]
    reports = _node_reports(host, rpc_port, stats)
    t = time.time()
    return {"objects": int(m.get("master_key_count", 0)),
            "blocks": sum(1 for k in mine if not k.startswith((f"{prefix}:stats:", f"{prefix}:node:"))),
            "allocated_bytes": int(m.get("master_allocated_bytes", 0)),
            "capacity_bytes": int(m.get("master_total_capacity_bytes", 0)),
            "segments": {seg: {"allocated_bytes": int(v.get("allocated_bytes", 0)),
                               "capacity_bytes": int(v.get("total_capacity_bytes", 0))}
                         for seg, v in sorted(m["segments"].items())},
            "nodes": {r["node"]: node_view(r, t) for r in sorted(reports, key=lambda r: r["node"])}}


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "status":
            s = status(args.host, args.metrics_port, args.port, args.prefix)
            if args.json:
                print(json.dumps(s, indent=1))
                return 0
            print(f"objects {s['objects']} ({s['blocks']} KV blocks), {s['allocated_bytes'] / 1e6:.1f} MB of "
                  f"{s['capacity_bytes'] / 1e6:.1f} MB in {len(s['segments'])} node segment(s)")
            for seg, v in s["segments"].items():
                print(f"  {seg:24s} {v['allocated_bytes'] / 1e6:10.1f} MB of {v['capacity_bytes'] / 1e6:.1f} MB")
            print(f"{len(s['nodes'])} node(s) reporting: index hits/misses, fetched (misses, corrupt), published")
            for node, v in s["nodes"].items():
                print(f"  {node} {v['host']:15s} {v['index_hits']:8d}/{v['index_misses']:<8d} {v['fetched_blocks']:8d} "
                      f"({v['fetch_misses']}, {v['corrupt']}) {v['published_blocks']:8d}   {v['age_s']:.0f} s ago")
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
