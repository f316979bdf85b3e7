"""The emulated-drive testbed: loop devices capped by blkio (as root) and the user-space drive model."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from kvswarm.io.base import Op
from kvswarm.io.throttle import DriveCaps, DrivePacer
from kvswarm.testbed import BLKIO, KERNEL, PREFIX, USERSPACE, Testbed, cleanup_stale, default_caps, kernel_support

MiB = 1 << 20
NO_KERNEL = kernel_support()
needs_kernel = pytest.mark.skipif(NO_KERNEL is not None, reason=f"kernel emulation unavailable: {NO_KERNEL}")


def _loop_backing_files() -> dict[str, str]:
    out = subprocess.run(["losetup", "-J", "-l"], capture_output=True, text=True).stdout
    return {d["name"]: d.get("back-file") or "" for d in (json.loads(out)["loopdevices"] if out.strip() else [])}


def _my_blkio_group() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.strip().split(":", 2)
            if "blkio" in ctrls.split(","):
                return path
    return "/"


def test_default_caps_fit_under_the_disk():
    for n in (1, 4, 8, 16):
        c = default_caps(n, disk_mbps=1000, disk_iops=50_000)
        assert n * c.read_mbps <= 800 and n * c.read_iops <= 40_000
        assert c.read_mbps <= 100 and c.read_iops <= 5000
    assert default_caps(8).read_mbps == 100 and default_caps(8).read_iops == 5000


def test_drive_model_paces_bandwidth_iops_and_latency():
    m = DrivePacer(DriveCaps(read_mbps=100, read_iops=1000, write_mbps=50, latency_ms=5))
    # 1 MB at 100 MB/s costs 10 ms of drive time; back-to-back requests queue behind each other.
    dues = [m.schedule(Op.READ, 1_000_000, 0.0) for _ in range(10)]
    assert dues[0] == pytest.approx(0.005)  # the latency, no queue yet
    assert dues[-1] == pytest.approx(0.09)
    # 4 KiB is IOPS-bound: 1 ms each.
    m2 = DrivePacer(DriveCaps(read_iops=1000))
    assert [m2.schedule(Op.READ, 4096, 0.0) for _ in range(3)] == pytest.approx([0.0, 0.001, 0.002])
    # Reads and writes have separate budgets (as the kernel throttle's files do); idle time is not banked.
    assert m.schedule(Op.WRITE, 1_000_000, 0.0) == pytest.approx(0.005)
    assert m.schedule(Op.WRITE, 1_000_000, 10.0) == pytest.approx(10.005)


def test_userspace_testbed_limits_rate_and_cleans_up():
    caps = DriveCaps(read_mbps=80, write_mbps=80, read_iops=1500, write_iops=1500)
    with Testbed(drives=2, drive_bytes=64 * MiB, caps=caps, mode=USERSPACE) as tb:
        root = tb.root
        assert tb.emulation == USERSPACE and tb.models is not None
        assert all(os.path.isdir(p) for p in tb.paths)
        assert "user-space" in tb.describe() and "80 MB/s" in tb.describe()
        checks = tb.verify(seconds=0.4, write=True)
        assert [c.what for c in checks] == ["read 1 MiB", "read 4 KiB", "write 1 MiB", "write 4 KiB"]
        for c in checks:  # the cap must bind; the floor is loose because CI machines are busy
            assert 0.5 <= c.ratio <= 1.1, c
    assert not os.path.exists(root) and tb.paths == []


def test_userspace_model_binds_the_store_and_adds_latency():
    caps = DriveCaps(read_iops=400, write_iops=400, latency_ms=30)
    with Testbed(drives=2, drive_bytes=16 * MiB, caps=caps, mode=USERSPACE) as tb:
        with tb.open_store(backend="threads", buffer_pool_bytes=8 * MiB) as s:
            assert s.engine.name == "threads+model"
            t0 = time.perf_counter()
            assert s.get(b"absent") is None and s.put(b"k0", b"v" * 100)
            assert time.perf_counter() - t0 >= 0.03  # the put paid the drive latency
            items = [(b"k%d" % i, bytes([i]) * 3000) for i in range(200)]
            assert all(s.put_many(items))
            t0 = time.perf_counter()
            with s.get_many([k for k, _ in items]) as r:
                assert [bytes(v) for v in r.views] == [v for _, v in items]
            # 200 reads over 2 drives at 400 IOPS each take >= ~0.25 s (plus the latency).
            assert time.perf_counter() - t0 >= 0.24


@needs_kernel
def test_kernel_testbed_builds_caps_and_tears_down_loop_devices():
    home = _my_blkio_group()
    caps = DriveCaps(read_mbps=60, write_mbps=60, read_iops=1200, write_iops=1200)
    with Testbed(drives=2, drive_bytes=64 * MiB, caps=caps, mode=KERNEL) as tb:
        root, group, devs = tb.root, tb.group, list(tb.paths)
        assert tb.emulation == KERNEL and tb.models is None
        backing = _loop_backing_files()
        for dev, majmin in zip(devs, tb.devices):
            assert stat.S_ISBLK(os.stat(dev).st_mode)
            assert backing[dev].startswith(root)
            with open(f"/sys/block/{os.path.basename(dev)}/loop/dio") as f:
                assert f.read().strip() == "1"  # direct I/O to the backing file
            for name, value in (("read_bps", 60_000_000), ("read_iops", 1200), ("write_bps", 60_000_000)):
                with open(os.path.join(group, f"blkio.throttle.{name}_device")) as f:
                    assert f"{majmin} {value}" in f.read()
        with open(os.path.join(group, "cgroup.procs")) as f:
            assert str(os.getpid()) in f.read().split()
        checks = tb.verify(seconds=0.6, write=True)
        for c in checks:  # verify() spends blk-throttle's first burst unmeasured; the floor is loose for busy CI
            assert 0.5 <= c.ratio <= 1.2, c
    assert not os.path.exists(group) and not os.path.exists(root)
    assert not set(devs) & {d for d, b in _loop_backing_files().items() if b.startswith(root)}
    assert _my_blkio_group() == home


@needs_kernel
@pytest.mark.parametrize("backend", ["threads", "uring"])
def test_store_runs_on_loop_devices_and_the_kernel_caps_bind_it(backend):
    if backend == "uring":
        pytest.importorskip("uring_api")
    with Testbed(drives=2, drive_bytes=32 * MiB, caps=DriveCaps(read_iops=500), mode=KERNEL) as tb:
        with tb.open_store(backend=backend, buffer_pool_bytes=16 * MiB) as s:
            assert s.meta_dir == tb.meta_dir and all(d.is_block_device for d in s.drives)
            items = [(b"%d" % i, os.urandom(3000 + i)) for i in range(400)]
            assert all(s.put_many(items))
            t0 = time.perf_counter()
            with s.get_many([k for k, _ in items]) as r:
                assert [bytes(v) for v in r.views] == [v for _, v in items]
            # 200 reads per drive at 500 IOPS: 0.4 s unthrottled-free; the kernel's first slice may burst.
            assert time.perf_counter() - t0 >= 0.2
            assert all(d["read_ops"] == 200 for d in s.stats()["drives"])


@needs_kernel
def test_credit_drain_keeps_every_drive_reading_and_leaves_no_credit():
    """The drain every timed benchmark step follows: every throttled drive reads for the whole
    span, and a read timed right after an idle gap plus a drain goes no faster than the cap."""
    import mmap

    def reads(dev: str) -> int:
        with open(f"/sys/block/{os.path.basename(dev)}/stat") as f:
            return int(f.read().split()[0])

    with Testbed(drives=2, drive_bytes=64 * MiB, caps=DriveCaps(read_mbps=50), mode=KERNEL) as tb:
        with tb.drain(0.2) as drain:
            before = [reads(p) for p in tb.paths]
            t0 = time.perf_counter()
            drain()
            assert time.perf_counter() - t0 >= 0.2
            assert all(reads(p) - b >= 20 for p, b in zip(tb.paths, before))  # 128 KiB reads at 50 MB/s
            fd = os.open(tb.paths[0], os.O_RDONLY | os.O_DIRECT)
            buf = mmap.mmap(-1, 4 * MiB)
            try:
                time.sleep(0.3)  # idle: the throttle would grant this as credit
                drain()
                t0 = time.perf_counter()
                os.preadv(fd, [buf], 8 * MiB)
                assert 4 * MiB / (time.perf_counter() - t0) <= 50e6 * 1.1
            finally:
                os.close(fd)
                buf.close()


def test_cleanup_on_exception_and_of_dead_processes(tmp_path):
    mode = KERNEL if NO_KERNEL is None else USERSPACE
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(drives=1, drive_bytes=8 * MiB, mode=mode) as tb:
            root, group = tb.root, tb.group
            raise RuntimeError("boom")
    assert not os.path.exists(root) and (group is None or not os.path.exists(group))

    # A testbed process killed with SIGKILL leaves everything behind; the next one removes it.
    code = ("import os, sys; from kvswarm.testbed import Testbed; "
            f"tb = Testbed(drives=1, drive_bytes=8 * 2**20, mode={mode!r}).start(); "
            "print(tb.root, tb.group or '', *tb.paths, flush=True); os.kill(os.getpid(), 9)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == -9, p.stderr
    root, *rest = p.stdout.split()
    assert os.path.basename(root).startswith(PREFIX) and os.path.exists(root)
    removed = cleanup_stale()
    assert root in removed and not os.path.exists(root)
    if mode == KERNEL:
        group, dev = rest
        assert group.startswith(BLKIO) and not os.path.exists(group)
        assert dev in removed and dev not in _loop_backing_files()
