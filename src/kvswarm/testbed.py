"""N emulated drives on one physical disk, as real block devices where the kernel allows.

Kernel emulation (root, loop devices, cgroup v1 blkio): each drive is a loop device
(``losetup --direct-io=on``) over a preallocated file, capped by the blkio throttle
(``blkio.throttle.{read,write}_{bps,iops}_device`` keyed by the loop device's MAJ:MIN)
of a cgroup that this process joins.  The caps live in the kernel, so they bind the
store, raw baselines and any other software run from this process alike.

User-space emulation (fallback where any of that is missing): each drive is a
directory, and a per-drive model (bandwidth, IOPS, latency; see
:mod:`kvswarm.io.throttle`) paces the I/O of stores opened through
:meth:`Testbed.open_store` and of raw baselines that pass :attr:`Testbed.models`.

``mode="none"`` gives the same N drives as plain directories with no caps at all: a
benchmark's uncapped run on the local disk, with the same setup and cleanup.

Either way ``with Testbed(...) as tb:`` always cleans up (loop devices detached,
group removed, files deleted), on exceptions, Ctrl-C and SIGTERM too; leftovers of
a process killed with SIGKILL are removed by the next testbed (:func:`cleanup_stale`).

    with Testbed(drives=8) as tb:
        print(tb.describe())
        store = tb.open_store(backend="uring")

Run ``python -m kvswarm.testbed`` to build a testbed and measure that its caps bind.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import glob
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from kvswarm.io.base import IOEngine, Op
from kvswarm.io.raw import run_threads
from kvswarm.io.throttle import DriveCaps, DrivePacer, ThrottledEngine

log = logging.getLogger(__name__)

BLKIO = "/sys/fs/cgroup/blkio"
PREFIX = "kvswarm-testbed-"
KERNEL, USERSPACE, UNCAPPED = "kernel", "user-space", "none"
GiB = 1 << 30

# What this machine's one disk sustains (measured: ~1.1-1.5 GB/s, ~60-86k IOPS at 4 KiB);
# default caps keep the drives' sum under ~80% of it so each drive's cap is what binds.
DISK_MBPS, DISK_IOPS = 1000.0, 50_000.0

__all__ = ["CreditDrain", "DriveCaps", "Testbed", "cleanup_stale", "default_caps", "drives", "kernel_support",
           "KERNEL", "UNCAPPED", "USERSPACE"]
MiB = 1 << 20


def default_caps(drives: int, disk_mbps: float = DISK_MBPS, disk_iops: float = DISK_IOPS,
                 share: float = 0.8) -> DriveCaps:
    """Per-drive caps (<= 100 MB/s, <= 5000 IOPS) whose sum stays below ``share`` of the disk."""
    mbps = min(100.0, share * disk_mbps / drives)
    iops = float(int(min(5000.0, share * disk_iops / drives)))
    return DriveCaps(read_mbps=mbps, write_mbps=mbps, read_iops=iops, write_iops=iops)


def kernel_support() -> str | None:
    """Why kernel emulation is unavailable here, or None when it is available."""
    if os.geteuid() != 0:
        return "not root (loop devices and cgroups need root)"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (loop driver missing)"
    if shutil.which("losetup") is None:
        return "losetup (util-linux) not installed"
    if not os.path.exists(os.path.join(BLKIO, "blkio.throttle.read_bps_device")):
        return f"no cgroup v1 blkio throttle at {BLKIO}"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    m = re.match(re.escape(PREFIX) + r"(\d+)-", os.path.basename(name))
    return int(m.group(1)) if m else None


def cleanup_stale() -> list[str]:
    """Remove testbeds left by dead processes (loop devices, cgroups, files); returns what went."""
    removed: list[str] = []
    if shutil.which("losetup"):
        out = subprocess.run(["losetup", "-J", "-l"], capture_output=True, text=True).stdout
        for dev in (json.loads(out)["loopdevices"] if out.strip() else []):
            back = dev.get("back-file") or ""
            pid = _owner(os.path.dirname(back))
            if pid is not None and not _pid_alive(pid):
                subprocess.run(["losetup", "-d", dev["name"]], capture_output=True)
                removed.append(dev["name"])
    for g in glob.glob(os.path.join(BLKIO, PREFIX + "*")):
        pid = _owner(g)
        if pid is not None and not _pid_alive(pid):
            with contextlib.suppress(OSError):
                os.rmdir(g)
                removed.append(g)
    for d in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        pid = _owner(d)
        if pid is not None and not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _blkio_cgroup_of(pid: int) -> str:
    """This process's blkio cgroup directory (to return to on exit)."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if "blkio" in ctrls.split(","):
                return os.path.join(BLKIO, path.lstrip("/"))
    return BLKIO


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@dataclass(frozen=True)
class CapCheck:
    """A measured cap: what a load that would exceed it actually got."""

    what: str
    cap: float
    measured: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.measured / self.cap if self.cap else 0.0


class Testbed:
    """N drives for a run: capped loop devices + blkio (kernel), directories + a drive model (user
    space), or plain directories with no caps (``mode="none"``).

    ``paths`` are the drive paths to give a store, ``meta_dir`` a directory for its
    catalog (loop devices hold no file system), ``models`` the per-drive models in
    user-space mode (None otherwise: in kernel mode the kernel does the capping).
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, drives: int = 8, drive_bytes: int = 2 * GiB, caps: DriveCaps | None = None,
                 mode: str = "auto", root: str | None = None, preallocate: bool = True,
                 join: bool = True) -> None:
        if drives < 1:
            raise ValueError("a testbed needs at least one drive")
        if drive_bytes % 4096 or drive_bytes < 1 << 20:
            raise ValueError("drive_bytes must be a multiple of 4 KiB and at least 1 MiB")
        if mode not in ("auto", KERNEL, USERSPACE, UNCAPPED):
            raise ValueError(f"mode must be 'auto', {KERNEL!r}, {USERSPACE!r} or {UNCAPPED!r}")
        self.n = drives
        self.drive_bytes = drive_bytes
        self.caps = DriveCaps() if mode == UNCAPPED else caps or default_caps(drives)
        self.requested_mode = mode
        self.parent = root or tempfile.gettempdir()
        self.preallocate = preallocate
        self.join_group = join
        self.emulation: str | None = None
        self.fallback_reason: str | None = None
        self.root = ""
        self.paths: list[str] = []
        self.devices: list[str] = []  # MAJ:MIN per drive (kernel mode)
        self.models: list[DrivePacer] | None = None
        self.group: str | None = None
        self._home_group: str | None = None
        self._old_sigterm: object = None
        self._lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Testbed:
        cleanup_stale()
        reason = kernel_support()
        if self.requested_mode == KERNEL and reason:
            raise RuntimeError(f"kernel emulation unavailable: {reason}")
        self.root = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.parent)
        self.meta_dir = os.path.join(self.root, "meta")
        os.makedirs(self.meta_dir)
        atexit.register(self.stop)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM would skip cleanup; turn it into SystemExit so ``with`` unwinds.
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            if self.requested_mode == UNCAPPED:
                self._start_directories(UNCAPPED)
            elif self.requested_mode == USERSPACE or reason:
                self.fallback_reason = reason if self.requested_mode != USERSPACE else "requested"
                self._start_userspace()
            else:
                self._start_kernel()
        except BaseException:
            self.stop()
            raise
        log.info("%s", self.describe())
        return self

    def _start_kernel(self) -> None:
        self.emulation = KERNEL
        for i in range(self.n):
            img = os.path.join(self.root, f"drive{i}.img")
            fd = os.open(img, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if self.preallocate:
                    os.posix_fallocate(fd, 0, self.drive_bytes)
                else:
                    os.ftruncate(fd, self.drive_bytes)
            finally:
                os.close(fd)
            p = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", img],
                               capture_output=True, text=True)
            if p.returncode:
                raise RuntimeError(f"losetup failed: {p.stderr.strip()}")
            dev = p.stdout.strip()
            self.paths.append(dev)
            rdev = os.stat(dev).st_rdev
            self.devices.append(f"{os.major(rdev)}:{os.minor(rdev)}")
            with contextlib.suppress(OSError):
                with open(f"/sys/block/{os.path.basename(dev)}/loop/dio") as f:
                    if f.read().strip() != "1":
                        log.warning("%s: direct I/O to its backing file refused; reads may hit the page cache",
                                    dev)
        self.group = os.path.join(BLKIO, os.path.basename(self.root))
        os.mkdir(self.group)
        c = self.caps
        for name, value in (("read_bps", c.read_mbps and c.read_mbps * 1e6), ("write_bps", c.write_mbps and
                            c.write_mbps * 1e6), ("read_iops", c.read_iops), ("write_iops", c.write_iops)):
            if value:
                for dev in self.devices:
                    _write(os.path.join(self.group, f"blkio.throttle.{name}_device"), f"{dev} {int(value)}\n")
        if self.caps.latency_ms:
            log.warning("the kernel throttle has no latency knob: latency_ms=%g is ignored", self.caps.latency_ms)
        if self.join_group:
            self.join()

    def _start_userspace(self) -> None:
        self._start_directories(USERSPACE)
        self.models = [DrivePacer(self.caps) for _ in range(self.n)]

    def _start_directories(self, emulation: str) -> None:
        self.emulation = emulation
        for i in range(self.n):
            d = os.path.join(self.root, f"drive{i}")
            os.makedirs(d)
            self.paths.append(d)

    def join(self, pid: int | None = None) -> None:
        """Move a process (default: this one, all its threads) into the throttled group."""
        if self.group is None:
            return
        pid = pid or os.getpid()
        if pid == os.getpid() and self._home_group is None:
            self._home_group = _blkio_cgroup_of(pid)
        _write(os.path.join(self.group, "cgroup.procs"), f"{pid}\n")

    def leave(self) -> None:
        if self.group is None or self._home_group is None:
            return
        with contextlib.suppress(OSError):
            _write(os.path.join(self._home_group, "cgroup.procs"), f"{os.getpid()}\n")
        self._home_group = None

    def stop(self) -> None:
        """Detach, remove and delete everything this testbed made; safe to call twice."""
        with self._lock:
            if not self.root:
                return
            self.leave()
            if self.group:
                self._remove_group()
            for dev in self.paths if self.emulation == KERNEL else ():
                p = subprocess.run(["losetup", "-d", dev], capture_output=True, text=True)
                if p.returncode:
                    log.warning("losetup -d %s: %s", dev, p.stderr.strip())
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = ""
            self.paths, self.devices, self.group = [], [], None
            atexit.unregister(self.stop)
            if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._old_sigterm)  # type: ignore[arg-type]
                self._old_sigterm = None

    def _remove_group(self) -> None:
        assert self.group is not None
        # Processes started inside the group (children) go back to the root group first.
        with contextlib.suppress(OSError):
            with open(os.path.join(self.group, "cgroup.procs")) as f:
                for pid in f.read().split():
                    with contextlib.suppress(OSError):
                        _write(os.path.join(BLKIO, "cgroup.procs"), pid + "\n")
        for _ in range(50):
            try:
                os.rmdir(self.group)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        log.warning("could not remove cgroup %s", self.group)

    # ---- use -------------------------------------------------------------------------
    def describe(self) -> str:
        if self.emulation == UNCAPPED:
            return f"no emulation: {self.n} directories on the local disk ({self.root}), no caps"
        if self.emulation == KERNEL:
            how = (f"kernel emulation: {self.n} loop devices (direct I/O) over preallocated files in {self.root}, "
                   f"each capped by cgroup v1 blkio throttle ({self.group})")
        else:
            why = f" (fallback: {self.fallback_reason})" if self.fallback_reason else ""
            how = f"user-space emulation{why}: {self.n} directories in {self.root}, each paced by a drive model"
        return f"{how}; per-drive caps: {self.caps.describe()}"

    def info(self) -> dict:
        """Machine-readable description (for benchmark JSON)."""
        c = self.caps
        return {"emulation": self.emulation, "drives": self.n, "paths": list(self.paths),
                "devices": list(self.devices), "fallback_reason": self.fallback_reason,
                "caps": {"read_mbps": c.read_mbps, "write_mbps": c.write_mbps, "read_iops": c.read_iops,
                         "write_iops": c.write_iops, "latency_ms": c.latency_ms}}

    def store_config(self, **kw):
        """A StoreConfig over these drives (capacity: the whole drive, catalog in ``meta_dir``; in
        user-space mode, I/O paced by the drive models: ``wrap_engine``)."""
        from kvswarm.store import StoreConfig

        kw.setdefault("meta_dir", self.meta_dir)
        kw.setdefault("capacity_per_drive", self.drive_bytes)
        kw.setdefault("wrap_engine", self.wrap_engine)
        return StoreConfig(drives=list(self.paths), **kw)

    def open_store(self, **kw):
        """A KVStore on these drives (see :meth:`store_config`)."""
        from kvswarm.store import KVStore

        return KVStore(self.store_config(**kw))

    def wrap_engine(self, engine: IOEngine) -> IOEngine:
        """``engine`` paced by the user-space drive models; itself in kernel mode, where the kernel
        paces every I/O.  For ``StoreConfig.wrap_engine`` (and ``PoolConfig.wrap_engine``)."""
        if self.models is None:
            return engine
        return ThrottledEngine(engine, dict(enumerate(self.models)))

    def drain(self, seconds: float = 0.15) -> CreditDrain:
        """A :class:`CreditDrain` over these drives (a no-op in user-space emulation); close it after use."""
        return CreditDrain(list(self.paths), seconds, kernel=self.emulation == KERNEL)

    def raw_path(self, i: int) -> str:
        """The file or device holding drive ``i``'s bytes (for raw baselines); dirs get a scratch file."""
        if self.emulation == KERNEL:
            return self.paths[i]
        return os.path.join(self.paths[i], "raw.scratch")

    def verify(self, seconds: float = 1.0, drive: int = 0, threads: int = 8, write: bool = False,
               span: int = 64 << 20, warmup: float = 0.25) -> list[CapCheck]:
        """Measure one drive under loads that exceed its caps: 1 MiB I/O vs MB/s, 4 KiB I/O vs IOPS.

        ``write=True`` also checks the write caps by overwriting the first ``span`` bytes of
        the drive: only on a drive that holds nothing yet. Each load runs ``warmup`` seconds
        before the ``seconds`` it is measured over.
        """
        import random

        path = self.raw_path(drive)
        span = min(span, self.drive_bytes) // (1 << 20) * (1 << 20)
        if self.emulation != KERNEL:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            os.posix_fallocate(fd, 0, span)
        else:
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        models = [self.models[drive]] if self.models else None
        rng = random.Random(drive)
        checks = []
        try:
            ops = [Op.READ, Op.WRITE] if write else [Op.READ]
            for op in ops:
                name = op.name.lower()
                for size, cap, unit in ((1 << 20, getattr(self.caps, f"{name}_mbps"), "MB/s"),
                                        (4096, getattr(self.caps, f"{name}_iops"), "IOPS")):
                    if not cap:
                        continue
                    ios = [(0, rng.randrange(span // size) * size) for _ in range(int(cap * seconds * 4) + 64)]
                    # blk-throttle lets a first burst through a freshly loaded group; spend it unmeasured.
                    run_threads([fd], ios, size, op, threads, warmup, models)
                    r = run_threads([fd], ios, size, op, threads, seconds, models)
                    got = r.nbytes / r.seconds / 1e6 if unit == "MB/s" else r.iops
                    checks.append(CapCheck(f"{name} {'1 MiB' if size > 4096 else '4 KiB'}", cap, got, unit))
        finally:
            os.close(fd)
            if self.emulation != KERNEL:
                os.unlink(path)
        return checks


class CreditDrain:
    """Spends the kernel throttle's idle credit right before a timed operation.

    blk-throttle lets a drive that idled through a slice dispatch about one 100 ms slice of
    budget at once (docs/testbed.md), so an operation timed after an idle gap runs partly on
    credit and reads faster than the cap.  Calling the drain keeps every drive reading
    ``block``-sized O_DIRECT reads (``depth`` threads per drive, above any cap) for a little over
    one slice; the timed operation then starts with no credit left but the throttle's admission
    granularity, under one drain read (128 KiB: 3 ms at 40 MB/s).  Reads only: safe on drives in use.
    In user-space emulation the drive models grant no credit and the drain does nothing."""

    def __init__(self, paths: list[str], seconds: float = 0.15, kernel: bool = True, depth: int = 4,
                 block: int = 128 << 10) -> None:
        import mmap

        self.seconds, self.block = seconds, block
        self.fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths] if kernel else []
        self.blocks = [max(1, min(512, os.lseek(fd, 0, os.SEEK_END) // block)) for fd in self.fds]
        # ``depth`` reads in flight per drive: the throttle's queue never runs dry, even when a
        # loaded machine is slow to wake the thread whose read just completed.
        self.jobs = [(i, j) for i in range(len(self.fds)) for j in range(depth)]
        self.bufs = [mmap.mmap(-1, block) for _ in self.jobs]  # page-aligned, as O_DIRECT needs

    def __call__(self) -> None:
        if not self.fds:
            return
        end = time.monotonic() + self.seconds

        def read(job: int) -> None:
            i, k = self.jobs[job]
            while time.monotonic() < end:
                os.preadv(self.fds[i], [self.bufs[job]], (k % self.blocks[i]) * self.block)
                k += len(self.jobs)

        threads = [threading.Thread(target=read, args=(j,)) for j in range(len(self.jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        for b in self.bufs:
            b.close()
        self.fds, self.bufs = [], []

    def __enter__(self) -> CreditDrain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def drives(n: int, mode: str = "auto", drive_bytes: int = GiB, parent: str | None = None,
           caps: DriveCaps | None = None):
    """N drives for a run, always cleaned up: the one way benchmarks and the demo get drives.

    ``auto``: kernel-capped loop devices when this process may make them (root, loop driver,
    cgroup v1 blkio), else plain temp directories; ``testbed``: a testbed in any emulation it
    can get (kernel, or its user-space drive model); ``kernel`` / ``user-space``: that emulation
    only; ``temp``: plain temp directories on the local disk, uncapped.  Yields a
    :class:`Testbed` (``paths``, ``meta_dir``, ``describe()``, ``info()``, ``open_store``) or,
    for temp directories, a :class:`TempDrives` with the same methods."""
    if mode not in ("auto", "testbed", "temp", KERNEL, USERSPACE):
        raise ValueError(f"drive mode must be auto, testbed, temp, {KERNEL} or {USERSPACE}, got {mode!r}")
    drive_bytes = max(MiB, (drive_bytes + 4095) // 4096 * 4096)
    if mode in (KERNEL, USERSPACE, "testbed") or (mode == "auto" and kernel_support() is None):
        with Testbed(n, drive_bytes=drive_bytes, caps=caps or default_caps(n),
                     mode=mode if mode in (KERNEL, USERSPACE) else "auto", root=parent) as tb:
            yield tb
        return
    td = TempDrives(n, drive_bytes, parent)
    try:
        yield td
    finally:
        td.stop()


class TempDrives:
    """Plain directories on the local disk, one O_DIRECT data file each, uncapped."""

    emulation = "none"
    models = None

    def __init__(self, n: int, drive_bytes: int, parent: str | None = None) -> None:
        self.n, self.drive_bytes = n, drive_bytes
        self.root = tempfile.mkdtemp(prefix="kvswarm-drives-", dir=parent)
        self.paths = [os.path.join(self.root, f"drive{i}") for i in range(n)]
        for p in self.paths:
            os.makedirs(p)
        self.meta_dir = os.path.join(self.root, "meta")

    def describe(self) -> str:
        return (f"no emulation: {self.n} directories on the local disk ({self.root}), one O_DIRECT data file each, "
                "uncapped")

    def info(self) -> dict:
        return {"emulation": "none", "drives": self.n, "paths": list(self.paths)}

    def store_config(self, **kw):
        from kvswarm.store import StoreConfig

        kw.setdefault("meta_dir", self.meta_dir)
        kw.setdefault("capacity_per_drive", self.drive_bytes)
        return StoreConfig(drives=list(self.paths), **kw)

    def open_store(self, **kw):
        from kvswarm.store import KVStore

        return KVStore(self.store_config(**kw))

    def drain(self) -> CreditDrain:
        return CreditDrain([], kernel=False)

    def stop(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _sigterm_to_exit(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(prog="python -m kvswarm.testbed", description="Build a testbed and check its caps.")
    ap.add_argument("--drives", type=int, default=8)
    ap.add_argument("--cap-mbps", type=float, default=None, help="per-drive MB/s (default: fit to the disk)")
    ap.add_argument("--cap-iops", type=float, default=None, help="per-drive IOPS (default: fit to the disk)")
    ap.add_argument("--mode", choices=["auto", KERNEL, USERSPACE], default="auto")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--write", action="store_true", help="also check the write caps")
    args = ap.parse_args(argv)
    d = default_caps(args.drives)
    mbps, iops = args.cap_mbps or d.read_mbps, args.cap_iops or d.read_iops
    caps = DriveCaps(read_mbps=mbps, write_mbps=mbps, read_iops=iops, write_iops=iops)
    console = Console()
    with Testbed(args.drives, drive_bytes=256 << 20, caps=caps, mode=args.mode) as tb:
        console.print(tb.describe())
        t = Table(title="cap check (drive 0, 8 threads)")
        for col in ("load", "cap", "measured", "measured/cap"):
            t.add_column(col, justify="right")
        for c in tb.verify(args.seconds, write=args.write):
            t.add_row(c.what, f"{c.cap:g} {c.unit}", f"{c.measured:.0f} {c.unit}", f"{c.ratio:.2f}")
        console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
