"""Small ext4 file systems on loop devices (root): a place to fill up (ENOSPC), to cut the power of
(``EXT4_IOC_SHUTDOWN`` without a log flush drops every write not yet synced) and to fail (after a
shutdown every I/O is EIO, also through a loop device whose backing file lives there).

Everything made here is removed by ``close()`` (also on errors, via ``with``); only devices and
mounts this object made are touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
import time

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2  # stop at once: the journal is not flushed, unsynced data is lost


def support() -> str | None:
    """Why loop-mounted file systems cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if not os.path.exists("/dev/loop-control"):
        return "no loop driver"
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def shutdown(path: str, flags: int = EXT4_GOING_FLAGS_NOLOGFLUSH) -> None:
    """Shut down the ext4 file system that ``path`` (a directory on it) lives on."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", flags))
    finally:
        os.close(fd)


class LoopDevice:
    """A loop block device over ``backing`` (a file), detached by ``close()``."""

    def __init__(self, backing: str) -> None:
        self.backing = backing
        self.path = _run("losetup", "--find", "--show", backing)

    def close(self) -> None:
        if self.path:
            for _ in range(50):  # udev may still hold it for a moment after a umount
                if subprocess.run(["losetup", "-d", self.path], capture_output=True).returncode == 0:
                    break
                time.sleep(0.05)
            self.path = ""

    def __enter__(self) -> LoopDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoopFS:
    """An ext4 file system of ``size_mib`` in ``root``/fs.img, mounted at ``root``/mnt."""

    def __init__(self, root: str, size_mib: int = 32) -> None:
        self.root = root
        self.image = os.path.join(root, "fs.img")
        self.mnt = os.path.join(root, "mnt")
        self.dev: LoopDevice | None = None
        self.mounted = False
        os.makedirs(self.mnt, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(size_mib << 20)
        try:
            _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard", self.image)
            self.dev = LoopDevice(self.image)
            self.mount()
        except BaseException:
            self.close()
            raise

    def mount(self) -> None:
        _run("mount", "-t", "ext4", self.dev.path, self.mnt)
        self.mounted = True

    def unmount(self) -> None:
        """Unmount (waiting up to 30 s for what still holds it, e.g. a killed process's I/O), else
        detach it lazily."""
        if self.mounted and os.path.ismount(self.mnt):
            end = time.monotonic() + 30
            while subprocess.run(["umount", self.mnt], capture_output=True).returncode != 0:
                if time.monotonic() > end:
                    subprocess.run(["umount", "-l", self.mnt], capture_output=True)
                    break
                time.sleep(0.05)
            self.mounted = False

    def shutdown(self) -> None:
        """From now on every I/O on this file system fails with EIO; unsynced writes are lost."""
        shutdown(self.mnt)

    def power_cut(self) -> None:
        """What a power cut leaves: shut down without flushing the log, then mount again (the
        journal replays what was committed; data not synced is gone)."""
        self.shutdown()
        self.unmount()
        self.mount()
        try:
            os.statvfs(self.mnt)
            os.listdir(self.mnt)
        except OSError as e:  # still the shut-down instance: something held it past the unmount
            raise RuntimeError(f"{self.mnt} did not come back from its power cut: {e}") from e

    def fill(self, leave: int = 0) -> str:
        """Fill the file system with a file until at most ``leave`` bytes are free; its path."""
        path = os.path.join(self.mnt, "filler")
        chunk = b"\xa5" * (1 << 20)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while True:
                st = os.statvfs(self.mnt)
                free = st.f_bavail * st.f_frsize
                if free <= leave:
                    break
                try:
                    os.write(fd, chunk[:max(4096, min(len(chunk), free - leave))])
                except OSError:  # ENOSPC: full
                    break
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.sync()
        return path

    def close(self) -> None:
        try:
            self.unmount()
        finally:  # the device goes even if the unmount raised
            if self.dev is not None:
                self.dev.close()
                self.dev = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.image)

    def __enter__(self) -> LoopFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
