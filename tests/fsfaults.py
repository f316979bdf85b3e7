"""Real file systems and block devices that fail on demand, for fault tests (root only).

- :func:`small_fs`: a tmpfs of a few MiB (a real ENOSPC when it fills).
- :func:`ext4_fs`: an ext4 file system on a loop device over a file; :func:`shutdown_fs`
  (:func:`kvswarm.faults.loopfs.shutdown`) shuts it down, after which every read and write on it fails with EIO.
- :func:`loop_device`: a loop device over a file (a block-device drive); over a sparse file on a
  small file system it is a thin volume, whose writes fail with ENOSPC once that file system is full.

Everything is undone on exit, even when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

from kvswarm.faults.loopfs import shutdown as shutdown_fs  # noqa: F401  (the tests import it from here)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def small_fs(path: str, size: str = "8m") -> Iterator[str]:
    os.makedirs(path, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


@contextlib.contextmanager
def loop_device(backing: str, direct_io: bool = False) -> Iterator[str]:
    dev = _run("losetup", "-f", "--show", *(["--direct-io=on"] if direct_io else []), backing)
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


@contextlib.contextmanager
def ext4_fs(path: str, size_mib: int = 32) -> Iterator[str]:
    """An ext4 file system of ``size_mib`` MiB mounted at ``path`` (its image beside it)."""
    img = path.rstrip("/") + ".img"
    with open(img, "wb") as f:
        f.truncate(size_mib << 20)
    os.makedirs(path, exist_ok=True)
    try:
        with loop_device(img) as dev:
            _run("mkfs.ext4", "-q", "-F", dev)
            _run("mount", dev, path)
            try:
                yield path
            finally:
                subprocess.run(["umount", "-l", path], check=False)
    finally:
        os.remove(img)
