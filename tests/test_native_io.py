"""The native batch path (kvswarm.io._batchio through kvswarm.io.native) on its own: real files with
O_DIRECT, verdicts per extent, per-drive depth, EIO for drives without a file, statistics, threads."""

import os
import threading
import time

import numpy as np
import pytest
import xxhash

from kvswarm.buffers import BufferPool
from kvswarm.format import pack_header
from kvswarm.io import Op
from kvswarm.io import native
from kvswarm.metrics import DriveStats

SZ = 8192
HDR = 56



@pytest.fixture
def files(tmp_path):
    """Two files of 64 random 8 KiB extents each, opened O_DIRECT; their bytes."""
    rng = np.random.default_rng(7)
    data, fds = [], []
    for d in range(2):
        b = rng.bytes(64 * SZ)
        p = tmp_path / f"d{d}"
        p.write_bytes(b)
        data.append(b)
        fds.append(os.open(p, os.O_RDWR | os.O_DIRECT))
    yield fds, data
    for fd in fds:
        os.close(fd)


def _io(fds, depth=4):
    io = native.NativeIO(depth)
    stats = [DriveStats(f"d{d}") for d in range(len(fds))]
    for d, fd in enumerate(fds):
        io.attach(d, fd, stats[d])
    return io, stats


def _reads(data, drive, idx):
    """Arrays for verified reads of extents idx on drives drive: expected headers (the first 56 bytes),
    payload after 64 bytes, its xxh3."""
    n = len(idx)
    want = np.frombuffer(b"".join(data[d][i * SZ:i * SZ + HDR] for d, i in zip(drive, idx)), np.uint8).copy()
    sums = np.array([xxhash.xxh3_64_intdigest(data[d][i * SZ + 64:(i + 1) * SZ]) for d, i in zip(drive, idx)],
                    np.uint64)
    return (np.array(drive, np.int64), np.array(idx, np.int64) * SZ, np.full(n, SZ, np.int64),
            np.arange(n, dtype=np.int64) * SZ, want, np.full(n, 64, np.int64), np.full(n, SZ - 64, np.int64), sums)


def test_reads_are_verified_and_scattered_with_a_verdict_each(files):
    fds, data = files
    io, stats = _io(fds)
    pool = BufferPool(1 << 20)
    drive, idx = [0, 1] * 20, list(range(40))
    d, off, ln, at, want, poff, plen, sums = _reads(data, drive, idx)
    sums[3] ^= 1  # a stale checksum
    want[5 * HDR + 10] ^= 1  # a header that differs
    d[7] = 9  # a drive without a file: EIO, no I/O
    into = [bytearray(SZ - 64) for _ in idx]
    into[8] = None  # verified, copied nowhere
    runs = np.array([0, 5000], np.int64), np.array([5000, SZ - 64 - 5000], np.int64)
    into[9] = (bytearray(2 * SZ), *runs)  # scattered over two runs
    b = io.submit(Op.READ, pool.array, d, off, ln, at, want, poff, plen, sums, into)
    io.wait(b)
    assert b.verdict[3] == native.BAD_CHECKSUM and b.verdict[5] == native.BAD_HEADER
    assert b.verdict[7] == native.ERRNO and b.res[7] == -5
    good = [i for i in range(40) if i not in (3, 5, 7)]
    assert (b.verdict[good] == native.OK).all() and (b.res[good] == SZ).all()
    for i in good:
        src = data[drive[i]][idx[i] * SZ + 64:(idx[i] + 1) * SZ]
        if i == 9:
            base = into[9][0]
            assert bytes(base[:5000]) + bytes(base[5000:SZ - 64]) == src
        elif i != 8:
            assert bytes(into[i]) == src
    assert bytes(into[3]) == bytes(SZ - 64)  # a failed read is copied nowhere
    io.fold_stats()
    assert stats[0].ops[0] + stats[1].ops[0] == 39 and stats[0].bytes[0] + stats[1].bytes[0] == 39 * SZ
    assert io.inflight() == 0 and io.completions == 39
    io.close()


def test_a_short_read_and_writes(files, tmp_path):
    fds, data = files
    io, stats = _io(fds)
    pool = BufferPool(1 << 20)
    arr = pool.array
    arr[:4 * SZ] = np.frombuffer(data[0][:4 * SZ], np.uint8)[::-1]
    n = 4
    b = io.submit(Op.WRITE, arr, np.ones(n, np.int64), np.arange(n, dtype=np.int64) * SZ + 64 * SZ,
                  np.full(n, SZ, np.int64), np.arange(n, dtype=np.int64) * SZ)
    io.wait(b)
    io.fold_stats()
    assert (b.verdict == native.OK).all() and stats[1].ops[1] == n
    os.fdatasync(fds[1])
    with open(tmp_path / "d1", "rb") as f:
        f.seek(64 * SZ)
        assert f.read(4 * SZ) == bytes(arr[:4 * SZ])
    # Past the end of drive 0's file: a short read (0 bytes), not data.
    d, off, ln, at, want, poff, plen, sums = _reads(data, [0], [0])
    off[0] = 64 * SZ
    b = io.submit(Op.READ, arr, d, off, ln, at, want, poff, plen, sums)
    io.wait(b)
    assert b.verdict[0] == native.SHORT and b.res[0] == 0
    io.close()


def _random_writes(io, drive, offset):
    """A write batch of random SZ extents to ``drive[i]`` at ``offset[i]``, from a new buffer pool's
    first ``len(drive)`` extents; (the batch, the pool: its array holds what was written)."""
    n = len(drive)
    pool = BufferPool(4 << 20)
    pool.array[:n * SZ] = np.frombuffer(os.urandom(n * SZ), np.uint8)
    return io.submit(Op.WRITE, pool.array, drive, offset, np.full(n, SZ, np.int64),
                     np.arange(n, dtype=np.int64) * SZ), pool


@pytest.mark.parametrize("helper", ["1", "0"])
def test_writes_complete_while_the_caller_does_not_poll(files, monkeypatch, helper):
    """Where a core is spare a thread of its own drives the writes' ring: a write batch deeper than
    the drives' depth completes while the caller is busy elsewhere (no poll); without one (one CPU,
    KVSWARM_IO_HELPER=0) the caller's polls drive it.  Either way every byte lands."""
    monkeypatch.setenv("KVSWARM_IO_HELPER", helper)
    fds, _ = files
    io, stats = _io(fds, depth=2)
    n = 32
    w, pool = _random_writes(io, np.arange(n, dtype=np.int64) % 2, np.arange(n, dtype=np.int64) // 2 * SZ)
    arr = pool.array
    driven = helper == "1" and (os.cpu_count() or 1) >= 2
    deadline = time.monotonic() + 5
    while not w.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.done == driven
    io.wait(w)
    assert (w.verdict == native.OK).all() and io.inflight() == 0
    io.fold_stats()
    assert stats[0].ops[1] + stats[1].ops[1] == n
    for d in range(2):
        os.fdatasync(fds[d])
        with open(os.open(os.readlink(f"/proc/self/fd/{fds[d]}"), os.O_RDONLY), "rb") as f:
            got = f.read(n // 2 * SZ)
        assert got == b"".join(bytes(arr[i * SZ:(i + 1) * SZ]) for i in range(d, n, 2))
    io.close()


def test_reads_do_not_wait_for_ring_slots_held_by_writes(files):
    """A drive's depth bounds its reads and its writes apart: with the depth taken by a write batch
    still in flight, a read batch queued after it goes into the ring at once, and both complete."""
    fds, data = files
    io, _ = _io(fds, depth=2)
    n = 16
    w, pool = _random_writes(io, np.zeros(n, np.int64), np.arange(n, dtype=np.int64) * SZ + 64 * SZ)
    arr = pool.array
    deadline = time.monotonic() + 5
    while io.busy(0, Op.WRITE) < 2 and time.monotonic() < deadline:  # the writes' driver thread fills its ring
        time.sleep(0.001)
    assert io.busy(0, Op.WRITE) == 2 and io.busy(0, Op.READ) == 0
    d, off, ln, at, want, poff, plen, sums = _reads(data, [0, 0], [3, 5])
    r = io.submit(Op.READ, arr, d, off, ln, at + n * SZ, want, poff, plen, sums)
    assert io.busy(0, Op.READ) == 2 and io.busy(0, Op.WRITE) == 2
    io.wait(r)
    io.wait(w)
    assert (r.verdict == native.OK).all() and (w.verdict == native.OK).all()
    os.fdatasync(fds[0])
    with open(os.open(os.readlink(f"/proc/self/fd/{fds[0]}"), os.O_RDONLY), "rb") as f:
        f.seek(64 * SZ)
        assert f.read(n * SZ) == bytes(arr[:n * SZ])
    io.close()


def test_bad_arrays_are_refused_before_any_io(files):
    fds, data = files
    io, _ = _io(fds)
    pool = BufferPool(1 << 20)
    d, off, ln, at, want, poff, plen, sums = _reads(data, [0, 1], [0, 1])
    bad_at = at.copy()
    bad_at[1] = len(pool.array) - 100  # past the end of the buffer
    with pytest.raises(ValueError, match="outside its buffer"):
        io.submit(Op.READ, pool.array, d, off, ln, bad_at, want, poff, plen, sums)
    with pytest.raises(ValueError, match="expected 2 items"):
        io.submit(Op.READ, pool.array, d, off[:1], ln, at, want, poff, plen, sums)
    with pytest.raises(ValueError, match="payload 0 lies outside"):
        io.submit(Op.READ, pool.array, d, off, ln, at, want, poff + SZ, plen, sums)
    with pytest.raises(ValueError, match="buffer 1 holds"):
        io.submit(Op.READ, pool.array, d, off, ln, at, want, poff, plen, sums, [None, bytearray(3)])
    assert io.inflight() == 0
    io.close()


def test_depth_per_drive_and_many_batches_from_several_threads(files):
    """Each drive has at most `depth` I/Os in the ring; batches from four threads sharing one ring all
    finish, each extent verified once."""
    fds, data = files
    io, stats = _io(fds, depth=2)
    pool = BufferPool(16 << 20)
    seen = []
    errors = []

    def worker(t):
        try:
            for k in range(10):
                drive = [(t + i) % 2 for i in range(32)]
                idx = [(t * 7 + k * 3 + i) % 64 for i in range(32)]
                d, off, ln, at, want, poff, plen, sums = _reads(data, drive, idx)
                at += (t * 10 + k) * 32 * SZ  # each batch its own part of the pool
                b = io.submit(Op.READ, pool.array, d, off, ln, at, want, poff, plen, sums)
                seen.append(max(io.busy(0, Op.READ), io.busy(1, Op.READ)))
                io.wait(b)
                assert (b.verdict == native.OK).all()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert max(seen) <= 2
    io.fold_stats()
    assert stats[0].ops[0] + stats[1].ops[0] == 4 * 10 * 32 and io.inflight() == 0
    io.close()


def test_the_env_var_turns_the_path_off(monkeypatch):
    assert native.available(), "kvswarm.io._batchio was not built, or io_uring is refused"
    assert native.enabled()
    monkeypatch.setenv(native.ENV, "0")
    assert not native.enabled()
    monkeypatch.delenv(native.ENV)
    assert not native.enabled(False)


@pytest.mark.parametrize("helper", ["1", "0"])
def test_a_helper_thread_verifies_half_of_a_large_pass(files, monkeypatch, helper):
    """A pass that takes in at least 512 KiB of payloads is verified on two threads (where the machine
    has two CPUs): every verdict and copy the same as on one."""
    monkeypatch.setenv("KVSWARM_IO_HELPER", helper)
    fds, data = files
    io, _ = _io(fds, depth=64)
    pool = BufferPool(4 << 20)
    drive, idx = [0, 1] * 64, [i // 2 for i in range(128)]
    d, off, ln, at, want, poff, plen, sums = _reads(data, drive, idx)
    bad_sum, bad_header = (5, 100), (20, 120)  # in both halves of the pass
    for i in bad_sum:
        sums[i] ^= 1
    for i in bad_header:
        want[i * HDR + 3] ^= 1
    into = [bytearray(SZ - 64) for _ in idx]
    b = io.submit(Op.READ, pool.array, d, off, ln, at, want, poff, plen, sums, into)
    deadline = time.monotonic() + 5
    while io.inflight() and time.monotonic() < deadline:  # every read back before one pass takes them in
        time.sleep(0.05)
        io.poll(0)
    io.wait(b)
    assert all(b.verdict[i] == native.BAD_CHECKSUM for i in bad_sum)
    assert all(b.verdict[i] == native.BAD_HEADER for i in bad_header)
    good = [i for i in range(128) if i not in bad_sum + bad_header]
    assert (b.verdict[good] == native.OK).all()
    assert all(bytes(into[i]) == data[drive[i]][idx[i] * SZ + 64:(idx[i] + 1) * SZ] for i in good)
    if helper == "0" or (os.cpu_count() or 1) < 2:
        assert io.helped == 0
    else:
        assert io.helped > 0
    io.close()


def test_pack_lays_out_every_extent_of_a_large_batch_on_two_threads():
    """A pack of at least 512 KiB of payloads is split with the helper thread (where the machine has
    two CPUs): every extent's header, payload, padding and checksum as the Python format makes them."""
    rng = np.random.default_rng(3)
    n, ext = 96, 3 * 4096  # two sector-payload extents among 12 KiB ones: 96 x ~8 KiB > 512 KiB
    plens = [8000 + 40 * i for i in range(n)]
    plens[10] = plens[70] = 4096  # a payload of whole sectors starts on the extent's second one
    payloads = [rng.bytes(p) for p in plens]
    poff = np.array([4096 if p == 4096 else HDR + 8 for p in plens], np.int64)
    digests = rng.bytes(16 * n)
    pool = BufferPool(n * ext)
    pool.array[:] = 0xEE  # stale bytes the padding must overwrite
    before = native.pack_helped()
    sums = native.pack(pool.array, np.arange(n, dtype=np.int64) * ext, np.full(n, ext, np.int64), poff,
                       np.array(plens, np.int64), [memoryview(p) for p in payloads], digests,
                       np.array(plens, np.int64), np.zeros(n, np.int64), np.ones(n, np.int64),
                       np.arange(n, dtype=np.int64) + 100)
    mem = pool.array.tobytes()
    for i, (p, po) in enumerate(zip(payloads, poff.tolist())):
        e = mem[i * ext:(i + 1) * ext]
        want = pack_header(digests[16 * i:16 * i + 16], len(p), 0, 1, 100 + i, xxhash.xxh3_64_intdigest(p),
                           po == 4096)
        assert e[:64] == want and int(sums[i]) == xxhash.xxh3_64_intdigest(p)
        assert e[po:po + len(p)] == p
        assert e[64:po] == bytes(po - 64) and e[po + len(p):] == bytes(ext - po - len(p))
    if (os.cpu_count() or 1) >= 2 and os.environ.get("KVSWARM_IO_HELPER") != "0":
        assert native.pack_helped() > before
