"""Keep a run's cluster traffic on loopback: run it inside a network namespace of its own."""

from __future__ import annotations

import socket
import subprocess
import sys


def private() -> bool:
    """Only loopback here: a network namespace of our own (or one as closed)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def rerun_private(argv: list[str]) -> int:
    """Run ``python -m kvswarm.cli ARGV`` in a new network namespace (``unshare -n``, loopback up);
    its exit status."""
    return subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                           sys.executable, "-m", "kvswarm.cli", *argv]).returncode
