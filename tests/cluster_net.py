"""Network namespaces, Mooncake masters and kvswarm node processes for the cluster tests.

Every process of a cluster test runs inside network namespaces the test makes itself
(``ip netns add``; only loopback, plus veth pairs with the test's own addresses where a
partition is tested), so no traffic can leave them.  Nodes are ``tests/cluster_node.py``
processes driven over JSON lines on stdin/stdout; every call has a timeout, and the
fixtures kill every process and delete every namespace in ``finally``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

from kvswarm.cluster.master import EtcdProcess, MasterProcess

ROOT = Path(__file__).resolve().parents[1]
NODE = Path(__file__).with_name("cluster_node.py")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, timeout=10, capture_output=True)


class Netns:
    """A named network namespace with its loopback up."""

    def __init__(self) -> None:
        self.name = f"kvs-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        ip("netns", "add", self.name)
        ip("-n", self.name, "link", "set", "lo", "up")

    def wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], timeout=10, capture_output=True)


def veth(a: Netns, b: Netns, addr_a: str, addr_b: str) -> tuple[str, str]:
    """Join ``a`` and ``b`` by a veth pair with ``addr_a`` / ``addr_b`` (/24); the two link names."""
    tag = uuid.uuid4().hex[:6]
    la, lb = f"kva{tag}", f"kvb{tag}"
    ip("link", "add", la, "netns", a.name, "type", "veth", "peer", "name", lb, "netns", b.name)
    for ns, link, addr in ((a, la, addr_a), (b, lb, addr_b)):
        ip("-n", ns.name, "addr", "add", f"{addr}/24", "dev", link)
        ip("-n", ns.name, "link", "set", link, "up")
    return la, lb


def node_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    env["GLOG_minloglevel"] = "2"  # Mooncake logs errors only
    env.pop("MC_TCP_BIND_ADDRESS", None)  # each node binds its own address (ClusterConfig.local_hostname)
    return env


class Node:
    """One kvswarm node process in ``ns``; :meth:`call` sends a command and waits for its answer."""

    def __init__(self, ns: Netns, log_path: Path) -> None:
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([*ns.wrap(), sys.executable, "-u", str(NODE)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=node_env(), cwd=ROOT,
                                     start_new_session=True)
        self._out: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._out.put(line)
        self._out.put(None)

    def call(self, cmd: str, timeout: float = 60.0, **kw) -> dict:
        self.proc.stdin.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        try:
            line = self._out.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"node: no answer to {cmd} within {timeout} s") from None
        if line is None:
            raise RuntimeError(f"node exited ({self.proc.wait()}) during {cmd}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"node: {cmd}: {reply['error']}")
        return reply

    def kill(self) -> None:
        """kill -9, as a crash."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close", timeout=timeout)
                self.proc.wait(timeout)
            except (TimeoutError, RuntimeError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Cluster:
    """Namespaces, masters, etcd and nodes of one test; :meth:`cleanup` ends all of them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.namespaces: list[Netns] = []
        self.masters: list[MasterProcess] = []
        self.etcds: list[EtcdProcess] = []
        self.nodes: list[Node] = []

    def netns(self) -> Netns:
        ns = Netns()
        self.namespaces.append(ns)
        return ns

    def master(self, ns: Netns, host: str = "127.0.0.1", port: int = 50051, **kw) -> MasterProcess:
        m = MasterProcess(host=host, port=port, metrics_port=port + 1, log_path=self.tmp / f"master-{port}.log",
                          wrap=ns.wrap(), **kw)
        self.masters.append(m)
        return m.start()

    def etcd(self, ns: Netns, port: int = 2379) -> EtcdProcess:
        e = EtcdProcess(self.tmp / f"etcd-{port}", port=port, peer_port=port + 1,
                        log_path=self.tmp / f"etcd-{port}.log", wrap=ns.wrap())
        self.etcds.append(e)
        return e.start()

    def node(self, ns: Netns, name: str) -> Node:
        n = Node(ns, self.tmp / f"node-{name}.log")
        self.nodes.append(n)
        return n

    def cleanup(self) -> None:
        for n in self.nodes:
            n.kill()
        for m in self.masters:
            m.stop(kill=True)
        for e in self.etcds:
            e.stop()
        for ns in self.namespaces:
            ns.delete()
