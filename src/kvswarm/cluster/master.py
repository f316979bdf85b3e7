"""Start and stop a Mooncake master (and etcd) process: for `kvswarm cluster up`, tests and benchmarks.

Everything binds to the address given (127.0.0.1 by default).  ``etcd`` starts the master with
``--enable_ha`` against those endpoints; several such masters elect one leader.  ``wrap`` is a
command prefix the process runs under (e.g. ``ip netns exec NAME``).  A wrapped master (its port is
in another namespace) or an HA one (a standby listens only once elected) is not waited for here:
its clients retry joining.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvswarm.errors import ClusterError


def find_binary(name: str) -> str:
    """``mooncake_master`` (or another Mooncake tool) beside this Python, in the mooncake package, or on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    try:
        import mooncake
        pkg = Path(mooncake.__file__).parent / name
        if pkg.exists():
            return str(pkg)
    except ImportError:
        pass
    found = shutil.which(name)
    if not found:
        raise ClusterError(f"{name} not found: install the cluster extra (pip install 'kvswarm[cluster]')")
    return found


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``host:port`` accepts connections (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ClusterError(f"{proc.args[0]} exited with {proc.returncode} before listening on {host}:{port}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise ClusterError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


class _ServiceProcess:
    """A child service in a process group of its own: ``args``, ``host``, ``port``, ``log_path`` and
    ``wait`` (whether ``start`` waits for its port) are set by the subclass."""

    args: list[str]
    host: str
    port: int
    log_path: str | os.PathLike | None
    wait: bool
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0):
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        if self.wait:
            wait_port(self.host, self.port, timeout, self.proc)
        return self

    def stop(self, kill: bool = False, timeout: float = 10.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        os.killpg(p.pid, signal.SIGKILL if kill else signal.SIGTERM)  # its group: a wrapper's child too
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MasterProcess(_ServiceProcess):
    """A ``mooncake_master`` child process; ``stop(kill=True)`` is a kill -9."""

    def __init__(self, host: str = "127.0.0.1", port: int = 50051, metrics_port: int = 9003,
                 log_path: str | os.PathLike | None = None, client_ttl_s: int = 10,
                 etcd: str | None = None, extra: list[str] | None = None, wrap: list[str] | None = None) -> None:
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.args = [find_binary("mooncake_master"), f"--rpc_address={host}", f"--rpc_port={port}",
                     f"--metrics_host={host}", f"--metrics_port={metrics_port}", f"--client_ttl={client_ttl_s}"]
        if etcd:
            self.args += ["--enable_ha=true", f"--etcd_endpoints={etcd}"]
        self.args = [*(wrap or []), *self.args, *(extra or [])]
        self.wait = not wrap and not etcd  # a standby master listens only once elected
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class EtcdProcess(_ServiceProcess):
    """A one-member etcd on ``host:port`` with its data in ``data_dir``."""

    def __init__(self, data_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 2379,
                 peer_port: int = 2380, log_path: str | os.PathLike | None = None,
                 wrap: list[str] | None = None) -> None:
        self.host, self.port, self.log_path = host, port, log_path
        binary = shutil.which("etcd")
        if not binary:
            raise ClusterError("etcd not found: scripts/setup.sh installs Debian's etcd-server")
        url, peer = f"http://{host}:{port}", f"http://{host}:{peer_port}"
        self.wait = not wrap
        self.args = [*(wrap or []), binary, "--data-dir", str(data_dir), "--listen-client-urls", url,
                     "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", f"default={peer}", "--name", "default"]
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

