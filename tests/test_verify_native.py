"""The native verify worker (kvswarm.store._verify) on its own: checksums, copies, bounds, waiting."""

import os

import numpy as np
import pytest
import xxhash
from kvswarm.store._verify import assist, drain, submit

L, SPAN = 8192, 12288


def _batch(n=6, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n * SPAN, np.uint8)
    offs = np.arange(n, dtype=np.int64) * SPAN + 4096
    lens = np.full(n, L, np.int64)
    sums = np.array([xxhash.xxh3_64_intdigest(src[o:o + L]) for o in offs], np.uint64)
    return src, offs, lens, sums


def test_good_payloads_are_copied_bad_ones_left_alone():
    src, offs, lens, sums = _batch()
    sums[1] ^= 1  # a wrong checksum
    ok = np.ones(len(offs), np.uint8)
    ok[2] = 0  # failed before hashing (a bad header): neither hashed nor copied
    bufs = [bytearray(b"\x5a" * L) for _ in offs]
    into = [memoryview(b) for b in bufs]
    into[3] = None  # nowhere to copy: verified only
    job = submit(src, offs, lens, sums, ok, into)
    assert job.wait() is True and job.done
    assert ok.tolist() == [1, 0, 0, 1, 1, 1]
    for i in (0, 4, 5):
        assert bytes(bufs[i]) == src[offs[i]:offs[i] + L].tobytes()
    for i in (1, 2, 3):
        assert bytes(bufs[i]) == b"\x5a" * L
    for m in into:  # a finished job holds no exports: the caller can release its views
        if m is not None:
            m.release()


def test_runs_of_a_base_buffer_receive_the_payload_scattered_in_order():
    src, offs, lens, sums = _batch(n=3)
    sums[2] ^= 1
    base = bytearray(b"\x5a" * 3 * 3 * L)
    run_lens = np.array([4096, 1000, 3096], np.int64)
    runs = [(np.array([8000, 0, 2000], np.int64) + 3 * L * i, run_lens) for i in range(3)]
    ok = np.ones(len(offs), np.uint8)
    assert submit(src, offs, lens, sums, ok, [(base, o, n) for o, n in runs]).wait()
    assert ok.tolist() == [1, 1, 0]
    for i in (0, 1):
        got = b"".join(bytes(base[a:a + n]) for a, n in zip(*runs[i]))
        assert got == src[offs[i]:offs[i] + L].tobytes()
    assert base[3 * L * 2:] == b"\x5a" * 3 * L  # a bad payload is scattered nowhere


def test_without_a_source_each_buffer_is_verified_where_it_lies_and_left_as_it_is():
    """src None: payloads read straight into their buffers (O_DIRECT into an engine's chunks)."""
    src, offs, lens, sums = _batch(n=4)
    bufs = [bytearray(src[o:o + L].tobytes()) for o in offs]
    bufs[2][100] ^= 0xFF  # a torn read
    sums[3] ^= 1  # a stale checksum
    ok = np.ones(len(offs), np.uint8)
    assert submit(None, np.zeros(4, np.int64), lens, sums, ok, [memoryview(b) for b in bufs]).wait()
    assert ok.tolist() == [1, 1, 0, 0]
    for i in range(4):  # nothing copied anywhere, the bad bytes included
        want = bytearray(src[offs[i]:offs[i] + L].tobytes())
        if i == 2:
            want[100] ^= 0xFF
        assert bufs[i] == want


@pytest.mark.parametrize("kind", ["none", "runs", "short"])
def test_in_place_needs_one_whole_buffer_per_payload(kind):
    src, offs, lens, sums = _batch(n=1)
    buf = bytearray(L)
    into = {"none": [None], "runs": [(buf, np.zeros(1, np.int64), np.full(1, L, np.int64))],
            "short": [memoryview(buf)[:4096]]}[kind]
    with pytest.raises(ValueError):
        submit(None, np.zeros(1, np.int64), lens, sums, np.ones(1, np.uint8), into)


@pytest.mark.parametrize("n", [0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 1025, 65_536, 1_000_003])
def test_checksums_agree_with_xxhash_at_every_length(n):
    """The worker picks an AVX2 hash loop where the CPU has one: it must give XXH3-64 exactly, for
    inputs of every size class (short, mid-size and long ones take different paths)."""
    src = np.random.default_rng(n).integers(0, 256, n + 7, np.uint8)
    offs, lens = np.array([7], np.int64), np.array([n], np.int64)
    good = np.array([xxhash.xxh3_64_intdigest(src[7:])], np.uint64)
    ok = np.ones(1, np.uint8)
    assert submit(src, offs, lens, good, ok, None).wait() and ok[0] == 1
    ok[0] = 1
    assert submit(src, offs, lens, good ^ np.uint64(1 << 40), ok, None).wait() and ok[0] == 0


def test_large_runs_at_any_alignment_are_copied_exactly():
    """Runs of 64 KiB and more are copied with streaming stores (16-byte aligned, 64 bytes a step):
    heads and tails around them, at odd offsets and lengths, must land byte for byte, and nothing
    next to a run may be touched."""
    n = 300_001  # odd: no run length is a multiple of 16
    src = np.random.default_rng(3).integers(0, 256, n + 4096, np.uint8)
    offs, lens = np.array([4096], np.int64), np.array([n], np.int64)
    sums = np.array([xxhash.xxh3_64_intdigest(src[4096:4096 + n])], np.uint64)
    base = np.full(3 * n, 0x5A, np.uint8)
    run_offs = np.array([7, 70_000, 400_003], np.int64)
    run_lens = np.array([65_537, 100, n - 65_637], np.int64)  # a streamed run, a short one, a streamed one
    ok = np.ones(1, np.uint8)
    assert submit(src, offs, lens, sums, ok, [(base, run_offs, run_lens)]).wait()
    assert ok[0] == 1
    got = np.concatenate([base[a:a + m] for a, m in zip(run_offs, run_lens)])
    assert np.array_equal(got, src[4096:4096 + n])
    outside = np.ones(len(base), bool)
    for a, m in zip(run_offs, run_lens):
        outside[a:a + m] = False
    assert (base[outside] == 0x5A).all()


@pytest.mark.parametrize("case", ["short", "long", "outside", "negative", "int32", "sizes_differ", "two_items"])
def test_runs_that_do_not_fit_raise(case):
    src, offs, lens, sums = _batch(n=2)
    base = bytearray(2 * L)
    o, n = np.array([0, 4096], np.int64), np.array([4096, 4096], np.int64)
    if case == "short":
        n[1] -= 1
    elif case == "long":
        n[1] += 1
    elif case == "outside":
        o[1] = 2 * L - 100
    elif case == "negative":
        o[0] = -1
    elif case == "int32":
        o = o.astype(np.int32)
    elif case == "sizes_differ":
        o = np.array([0, 4096, 0], np.int64)
    into = [None, (base, o, n) if case != "two_items" else (base, o)]
    with pytest.raises(ValueError, match="into\\[1\\]|buffer 1"):
        submit(src, offs, lens, sums, np.ones(2, np.uint8), into)


def test_verify_only_and_empty_batches():
    src, offs, lens, sums = _batch()
    ok = np.ones(len(offs), np.uint8)
    assert submit(src, offs, lens, sums, ok, None).wait(5.0)
    assert ok.all()
    empty = np.zeros(0, np.int64)
    assert submit(src, empty, empty, empty.astype(np.uint64), np.zeros(0, np.uint8), []).wait()


@pytest.mark.parametrize("case", ["outside", "short_buffer", "readonly_buffer", "wrong_count", "ok_not_writable"])
def test_bad_input_raises_before_anything_runs(case):
    src, offs, lens, sums = _batch()
    ok = np.ones(len(offs), np.uint8)
    into = [bytearray(L) for _ in offs]
    if case == "outside":
        offs = offs.copy()
        offs[-1] = len(src) - L + 1
    elif case == "short_buffer":
        into[2] = bytearray(L - 1)
    elif case == "readonly_buffer":
        into[2] = bytes(L)
    elif case == "wrong_count":
        into = into[:-1]
    else:
        ok.flags.writeable = False
    with pytest.raises((ValueError, TypeError, BufferError)):
        submit(src, offs, lens, sums, ok, into)
    assert all(b == bytearray(L) for b in into if isinstance(b, bytearray) and len(b) == L)


def test_many_jobs_all_finish_and_drain_waits_for_all():
    src, offs, lens, sums = _batch(n=64, seed=1)
    oks = [np.ones(len(offs), np.uint8) for _ in range(20)]
    jobs = [submit(src, offs, lens, sums, ok, None) for ok in oks]
    assert all(j.wait(10.0) for j in jobs)
    assert all(ok.all() for ok in oks)
    assert jobs[0].wait(0.0) is True  # finished: returns at once
    more = [submit(src, offs, lens, sums, np.ones(len(offs), np.uint8), None) for _ in range(5)]
    drain()
    assert all(j.done for j in more)


def test_threads_that_help_run_queued_jobs_alongside_the_worker():
    """assist() runs the oldest queued job on the calling thread; with nothing queued it returns False."""
    import threading

    src, offs, lens, sums = _batch(n=64, seed=2)
    sums[5] ^= 1
    oks = [np.ones(len(offs), np.uint8) for _ in range(200)]
    dst = [[bytearray(L) for _ in offs] for _ in oks]
    jobs = [submit(src, offs, lens, sums, ok, [memoryview(b) for b in d]) for ok, d in zip(oks, dst)]
    ran = [0] * 12  # more helpers than helper slots: the extra ones find no slot and return False

    def helper(k):
        while assist():
            ran[k] += 1

    threads = [threading.Thread(target=helper, args=(k,)) for k in range(len(ran))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    drain()
    assert assist() is False  # nothing queued
    assert all(j.done for j in jobs)
    want = [i != 5 for i in range(len(offs))]
    assert all(ok.astype(bool).tolist() == want for ok in oks)
    assert all(bytes(d[i]) == src[offs[i]:offs[i] + L].tobytes() for d in dst for i in range(len(offs)) if want[i])
    assert sum(ran) <= len(jobs)


@pytest.mark.parametrize("threads", ["1", "3"])
def test_any_number_of_workers_gives_the_same_outcome(threads):
    """KVSWARM_VERIFY_THREADS sets the workers of a fresh process; jobs may then finish out of order."""
    import subprocess
    import sys

    code = (
        "import numpy as np, xxhash\n"
        "from kvswarm.store._verify import submit, drain\n"
        "rng = np.random.default_rng(3); src = rng.integers(0, 256, 40 * 12288, np.uint8)\n"
        "offs = np.arange(40, dtype=np.int64) * 12288; lens = np.full(40, 8192, np.int64)\n"
        "sums = np.array([xxhash.xxh3_64_intdigest(src[o:o + 8192]) for o in offs], np.uint64); sums[::7] ^= 1\n"
        "oks = [np.ones(40, np.uint8) for _ in range(30)]\n"
        "dst = [[bytearray(8192) for _ in range(40)] for _ in oks]\n"
        "jobs = [submit(src, offs, lens, sums, ok, [memoryview(b) for b in d]) for ok, d in zip(oks, dst)]\n"
        "drain()\n"
        "want = [i % 7 != 0 for i in range(40)]\n"
        "assert all(j.done for j in jobs) and all(ok.astype(bool).tolist() == want for ok in oks)\n"
        "assert all(bytes(d[i]) == src[offs[i]:offs[i] + 8192].tobytes() for d in dst for i in range(40) if want[i])\n"
    )
    env = dict(os.environ, KVSWARM_VERIFY_THREADS=threads)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_a_forked_child_verifies_with_a_worker_of_its_own():
    src, offs, lens, sums = _batch()
    assert submit(src, offs, lens, sums, np.ones(len(offs), np.uint8), None).wait()  # the parent's worker runs
    pid = os.fork()
    if pid == 0:  # the child has no worker thread until it submits
        ok = np.ones(len(offs), np.uint8)
        os._exit(0 if submit(src, offs, lens, sums, ok, None).wait(10.0) and ok.all() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
