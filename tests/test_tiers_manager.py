"""TierManager on real pools (temp-dir drives, O_DIRECT): hits per tier, moves, faults, restart."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvswarm.errors import DriveFull, KVSwarmError
from kvswarm.format import key_digest
from kvswarm.io import native
from kvswarm.io.base import IOEngine
from kvswarm.layout import KVLayout
from kvswarm.prefix import PrefixKeyer, new_block
from kvswarm.tiers import TIERS, PrefetchPolicy, Tier
from kvswarm.tiers.manager import TierConfig, TierManager
from kvswarm.tiers.pools import PoolConfig

LAYOUT = KVLayout(2, 1, 8, "float32", tokens_per_block=16, model_id="test")  # 2 KiB of KV per block
KV = LAYOUT.block_bytes
BLOCK = KV + 64
KEYER = PrefixKeyer(LAYOUT)


def payload(key: bytes, index: int = 0) -> bytearray:
    buf, kv = new_block(key, KEYER.namespace, 16, index, KV)
    kv[:] = np.frombuffer((key * (KV // 16 + 1))[:KV], np.uint8)
    return buf


def keys_of(seed: int, n: int) -> list[bytes]:
    return KEYER.block_keys(np.arange(n * 16) + seed * 100_000)


def pool(tmp_path, name: str, drives: int, blocks_per_drive: int, kind: str = "ssd") -> PoolConfig:
    paths = []
    for i in range(drives):
        p = tmp_path / f"{name}{i}"
        p.mkdir(exist_ok=True)
        paths.append(str(p))
    return PoolConfig(paths, kind=kind, capacity_per_drive=4096 * (1 + blocks_per_drive), buffer_pool_bytes=4 << 20)


def manager(tmp_path, dram_blocks=4, ssd=(2, 8), cap=(1, 16), **kw) -> TierManager:
    return TierManager(TierConfig(
        block_bytes=BLOCK, dram_bytes=dram_blocks * BLOCK, ssd=pool(tmp_path, "ssd", *ssd) if ssd else None,
        capacity=pool(tmp_path, "cap", *cap, kind="hdd") if cap else None, **kw))


def serve(tm: TierManager, keys: list[bytes], promote: bool = True) -> list[Tier]:
    """One request: use the cached prefix (checking every byte), compute and insert the rest."""
    hit = tm.lookup(keys)
    for k, v, i in zip(keys, hit.views, range(len(hit))):
        assert bytes(v) == bytes(payload(k, i)), "served bytes differ from what was stored"
    tiers = list(hit.tiers)
    hit.release(promote=promote)
    tm.insert(keys[len(tiers):], [payload(k, i) for i, k in enumerate(keys) if i >= len(tiers)])
    return tiers


def test_hits_move_down_and_come_back(tmp_path):
    with manager(tmp_path) as tm:
        ks = keys_of(0, 4)
        assert serve(tm, ks) == []
        assert serve(tm, ks) == [Tier.DRAM] * 4
        tm.clear_dram()
        assert serve(tm, ks) == [Tier.SSD] * 4  # promoted on use...
        assert serve(tm, ks) == [Tier.DRAM] * 4  # ...so the next turn hits DRAM
        for s in range(1, 5):  # push ks out of DRAM and the SSD pool (12 blocks) to the capacity pool (14)
            serve(tm, keys_of(s, 4))
        st = tm.stats()
        assert st["director"]["demotions"] > 0
        assert serve(tm, ks) == [Tier.CAPACITY] * 4
        assert tm.counters["hit_capacity"] == 4


def test_request_blocks_are_striped_over_all_ssds(tmp_path):
    with manager(tmp_path, dram_blocks=0, ssd=(4, 8), cap=None) as tm:
        serve(tm, keys_of(0, 8))
        tm.flush()
        writes = [d["write_ops"] for d in tm.stores[Tier.SSD].stats()["drives"]]
        assert writes == [2, 2, 2, 2]


@pytest.mark.parametrize("eviction", ["lru", "arc", "s3fifo"])
def test_full_pools_evict_never_crash(tmp_path, eviction):
    with manager(tmp_path, eviction=eviction) as tm:
        for s in range(30):  # 120 blocks through 4 + ~12 + ~14 block tiers
            serve(tm, keys_of(s % 12, 4))
        tm.flush()
        for t in TIERS:
            assert tm.director.resident(t) <= tm.director.capacity(t)
        for t, s in tm.stores.items():
            assert len(s) == tm.director.resident(t)  # the pools hold exactly what the director believes
        assert tm.counters["put_failures"] == 0


def test_write_back_writes_on_eviction_and_flush(tmp_path):
    with manager(tmp_path, write="write-back", cap=None) as tm:
        serve(tm, keys_of(0, 3))
        assert len(tm.stores[Tier.SSD]) == 0  # still only in DRAM
        serve(tm, keys_of(1, 2))  # DRAM holds 4: one block of the first request is written back
        tm.flush()
        assert len(tm.stores[Tier.SSD]) == 5


def test_selective_admission_spares_the_ssds(tmp_path):
    with manager(tmp_path, dram_blocks=0, write="selective:2", cap=None) as tm:
        ks = keys_of(0, 3)
        serve(tm, ks)
        assert len(tm.stores[Tier.SSD]) == 0  # seen once: recomputed next time, never written
        assert serve(tm, ks) == []
        tm.flush()
        assert len(tm.stores[Tier.SSD]) == 3  # seen twice: admitted
        assert serve(tm, ks) == [Tier.SSD] * 3


def _extent_of(store, key):
    drv, off, ln, _ = store.catalog.entries[key_digest(key)].extents[0]
    return os.path.join(store.drives[drv].path, "kvswarm.data"), off, ln


def _stored_with_block_corrupt(tm: TierManager, ks: list[bytes], bad: int):
    """Serve ``ks`` (stored on the SSDs), flush, clear DRAM, then flip KV bytes of block ``bad``
    behind the store's back; returns the SSD pool's store."""
    serve(tm, ks)
    tm.flush()
    tm.clear_dram()
    ssd = tm.stores[Tier.SSD]
    path, off, _ = _extent_of(ssd, ks[bad])
    with open(path, "r+b") as f:
        f.seek(off + 64 + 64 + 100)
        f.write(b"\xff" * 8)
    return ssd


def test_corrupt_and_truncated_blocks_are_misses_then_recomputed(tmp_path):
    with manager(tmp_path, cap=None) as tm:
        ks = keys_of(0, 4)
        ssd = _stored_with_block_corrupt(tm, ks, 2)
        assert serve(tm, ks) == [Tier.SSD] * 2  # block 2 fails its checksum: the prefix stops there
        assert tm.counters["rejected"] == 1 and ssd.counters["corrupt"] == 1
        tm.clear_dram()
        assert serve(tm, ks) == [Tier.SSD] * 4  # recomputed and stored again
        tm.flush()
        tm.clear_dram()
        path, off, _ = _extent_of(ssd, ks[3])
        os.truncate(path, off + 2048)  # the data file ends inside block 3: a short read
        assert serve(tm, ks) == [Tier.SSD] * 3


def test_wrong_block_under_a_key_is_never_served(tmp_path):
    """A payload whose header names another key or namespace (collision, foreign writer) is a miss."""
    with manager(tmp_path, dram_blocks=0, cap=None) as tm:
        ks = keys_of(0, 2)
        other = PrefixKeyer(KVLayout(2, 1, 8, "float32", 16, model_id="another-model"))
        forged, kv = new_block(ks[1], other.namespace, 16, 1, KV)
        tm.stores[Tier.SSD].put_many([(ks[0], payload(ks[0])), (ks[1], bytes(forged[:-1]))])  # wrong size
        tm.director.restore(Tier.SSD, [key_digest(k) for k in ks])
        assert serve(tm, ks) == [Tier.SSD]
        assert tm.counters["rejected"] == 1


def test_failed_drive_blocks_become_misses_service_continues(tmp_path):
    with manager(tmp_path, dram_blocks=0, ssd=(2, 8), cap=None) as tm:
        ks = keys_of(0, 6)
        serve(tm, ks)
        tm.flush()
        ssd = tm.stores[Tier.SSD]
        on_drive1 = [i for i, k in enumerate(ks) if ssd.catalog.entries[key_digest(k)].extents[0][0] == 1]
        cap_before = tm.director.capacity(Tier.SSD)
        ssd.fail_drive(1)
        assert serve(tm, ks) == [Tier.SSD] * min(on_drive1)
        assert tm.director.capacity(Tier.SSD) < cap_before
        for s in range(1, 6):  # keeps serving and writing to the surviving drive
            serve(tm, keys_of(s, 4))
        assert serve(tm, keys_of(5, 4)) == [Tier.SSD] * 4
        assert all(e.extents[0][0] == 0 for e in ssd.catalog.entries.values())


@pytest.mark.usefixtures("python_engine")
def test_real_io_error_drive_degrades(tmp_path):
    """A drive whose I/O fails in the kernel (not a flag we set) is taken out; service continues."""
    with manager(tmp_path, dram_blocks=0, ssd=(2, 8), cap=None) as tm:
        ks = keys_of(0, 6)
        serve(tm, ks)
        tm.flush()
        ssd = tm.stores[Tier.SSD]
        ssd.config = dataclasses.replace(ssd.config, error_threshold=1)
        bad = ssd.drives[1]
        os.close(bad.fd)
        bad.fd = ssd.engine.fds[1] = os.open(bad.path, os.O_RDONLY)  # a directory: every pread fails EISDIR
        got = serve(tm, ks)
        assert len(got) < 6 and not bad.healthy
        assert serve(tm, ks) == [Tier.SSD] * 6  # recomputed blocks went to the surviving drive


@pytest.fixture
def python_engine(monkeypatch):
    """Stores opened by the test use the Python engine, which the test slows or breaks by hand (the store's
    own fault handling is tested on the native path too, in test_store.py)."""
    monkeypatch.setenv(native.ENV, "0")


class SlowEngine(IOEngine):
    """Delays every completion by ``delay`` seconds: a slow drive for deadline tests."""

    def __init__(self, inner: IOEngine, delay: float) -> None:
        super().__init__(inner.queue_depth)
        self.inner, self.delay, self.fds, self.stats = inner, delay, inner.fds, inner.stats
        self._ready: list = []

    def attach(self, drive, fd, stats):
        self.inner.attach(drive, fd, stats)

    def _submit(self, reqs):
        self._due = time.perf_counter() + self.delay
        self.inner._submit(reqs)

    def poll(self, timeout=0.0):
        wait = max(0.0, self._due - time.perf_counter())
        if wait > 0:
            time.sleep(wait if timeout is None else min(wait, timeout))
            if time.perf_counter() < self._due:
                return []
        return self.inner.poll(timeout)

    def inflight(self):
        return self.inner.inflight()

    def close(self):
        self.inner.close()


@pytest.mark.usefixtures("python_engine")
@pytest.mark.parametrize("mode, expect", [("best_effort", 0), ("timeout", 0), ("wait_complete", 4)])
def test_prefetch_deadline_policies(tmp_path, mode, expect):
    with manager(tmp_path, cap=None) as tm:
        ks = keys_of(0, 4)
        serve(tm, ks)
        tm.flush()
        tm.clear_dram()
        ssd = tm.stores[Tier.SSD]
        ssd.engine = SlowEngine(ssd.engine, 0.3)
        t0 = time.perf_counter()
        pf = tm.prefetch(ks, policy=PrefetchPolicy(mode, 0.05))
        hit = pf.result()
        took = time.perf_counter() - t0
        assert len(hit) == expect
        assert hit.late == 4 - expect
        assert took < 0.25 if mode != "wait_complete" else took >= 0.3
        hit.release()
        ssd.engine = ssd.engine.inner
        # Late blocks stay cached: once the reads land, the next request gets them.
        assert serve(tm, ks) == [Tier.SSD] * 4 or mode == "wait_complete"


def test_prefetch_overlaps_reads_with_other_work(tmp_path):
    with manager(tmp_path, cap=None) as tm:
        ks = keys_of(0, 4)
        serve(tm, ks)
        tm.clear_dram()
        pf = tm.prefetch(ks)
        while not pf.poll():  # the caller does other work meanwhile
            time.sleep(0.001)
        with pf.result() as hit:
            assert hit.tiers == [Tier.SSD] * 4


_RESTART_CHILD = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_tiers_manager import KEYER, manager, keys_of, payload
from kvswarm.tiers import Tier
import pathlib
tm = manager(pathlib.Path({tmp!r}))
hit = tm.lookup(keys_of(0, 5) + keys_of(1, 1))
ok = all(bytes(v) == bytes(payload(k, i)) for i, (k, v) in enumerate(zip(hit.keys, hit.views)))
print(len(hit), [t.name for t in hit.tiers][:1], ok, round(tm.reopen_seconds, 4))
hit.release()
tm.close()
"""


def test_warm_restart_finds_every_flushed_block(tmp_path):
    tm = manager(tmp_path, write="write-back")
    serve(tm, keys_of(0, 5))  # write-back: only in DRAM until the flush
    tm.flush()
    tm.close()
    # A fresh interpreter with another hash seed: keys and residency must not depend on it.
    env = dict(os.environ, PYTHONHASHSEED="12345")
    code = _RESTART_CHILD.format(tests=os.path.dirname(__file__), tmp=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n, first, ok, reopen = out.stdout.split(maxsplit=3)[0], *out.stdout.split()[1:4]
    assert n == "5" and "SSD" in first and ok == "True"
    assert float(reopen) < 5


def test_prefix_larger_than_read_buffers_is_cut_not_crashed(tmp_path):
    cfg = pool(tmp_path, "ssd", 2, 8)
    cfg = dataclasses.replace(cfg, buffer_pool_bytes=4 * 4096)  # room for 4 blocks in flight
    with TierManager(TierConfig(block_bytes=BLOCK, dram_bytes=0, ssd=cfg, chunk_blocks=2)) as tm:
        ks = keys_of(0, 8)
        serve(tm, ks)
        tm.flush()
        assert serve(tm, ks) == [Tier.SSD] * 4  # the rest recomputed; next time the buffers are free again
        assert tm.counters["buffer_exhausted"] == 1


def test_blocks_demoted_past_the_ssds_before_their_write_back_keep_their_bytes(tmp_path):
    """Write-back with a small SSD pool: one insert pushes blocks from DRAM to the SSDs and on to the
    capacity pool while their SSD writes are still queued.  Their bytes come from DRAM slots already
    dropped, which must stay pinned until the capacity pool's write has copied them."""
    with manager(tmp_path, dram_blocks=4, ssd=(1, 6), cap=(1, 64), write="write-back") as tm:
        ks = keys_of(0, 20)
        tm.insert(ks, [payload(k, i) for i, k in enumerate(ks)])
        tm.flush()
        cap = tm.stores[Tier.CAPACITY]
        held = [(i, k) for i, k in enumerate(ks) if key_digest(k) in cap.catalog.entries]
        assert held
        for i, k in held:
            assert cap.get(k) == bytes(payload(k, i))


def test_a_block_read_back_corrupt_leaves_its_pool_too(tmp_path):
    """The director forgets a rejected block, and so does its store: its extents are not left taken,
    counted by nobody (a restart would count it again, and fail it again)."""
    with manager(tmp_path, cap=None) as tm:
        ks = keys_of(0, 4)
        ssd = _stored_with_block_corrupt(tm, ks, 2)
        hit = tm.lookup(ks)  # looked up only: nothing is recomputed and written again
        assert len(hit) == 2
        hit.release()
        assert key_digest(ks[2]) not in ssd.catalog.entries and len(ssd) == 3


@pytest.mark.usefixtures("python_engine")
def test_a_demoted_block_leaves_the_ssds_only_once_the_capacity_pool_holds_it_durably(tmp_path):
    """Demotion writes the block below and then drops it above: until the write below is back and
    flushed, the copy above stays, so a failed write or a crash in between loses nothing."""
    with manager(tmp_path, dram_blocks=0, ssd=(1, 16), cap=(1, 64)) as tm:
        tm.director.resize(Tier.SSD, 4)  # the pool keeps 4 blocks; its drive has room for more
        old, new = keys_of(0, 4), keys_of(1, 4)
        serve(tm, old)
        tm.flush()
        ssd, cap = tm.stores[Tier.SSD], tm.stores[Tier.CAPACITY]
        cap.engine = SlowEngine(cap.engine, 0.5)  # the capacity pool's writes are still out below
        flushes = []
        real_flush = cap.flush
        cap.flush = lambda: (flushes.append(time.perf_counter()), real_flush())
        serve(tm, new)  # the SSD pool (4 blocks) demotes the 4 old ones
        assert all(key_digest(k) in ssd.catalog.entries for k in old)  # still above, write below in flight
        t0 = time.perf_counter()
        tm.flush()
        assert flushes and flushes[0] >= t0
        assert not any(key_digest(k) in ssd.catalog.entries for k in old)
        cap.engine = cap.engine.inner
        assert serve(tm, old) == [Tier.CAPACITY] * 4


def _drain(store) -> None:
    while store.engine.inflight():
        store.engine.poll(0.01)


def _writes_fail_on(store, drive: int):
    """Every I/O ``store``'s engine does on ``drive`` fails (a directory's read-only fd), below the error
    threshold that would take the drive out; returns ``heal()``, which waits for the I/O in flight first."""
    good, bad = store.engine.fds[drive], os.open(store.drives[drive].path, os.O_RDONLY)
    store.engine.fds[drive] = bad

    def heal() -> None:
        _drain(store)
        store.engine.fds[drive] = good
        os.close(bad)

    return heal


def _demoting(tmp_path) -> tuple[TierManager, list[bytes], list[bytes]]:
    """A 4-block SSD pool holding 4 flushed blocks (``old``) over a 2-drive capacity pool: serving
    ``new`` demotes the old ones, half of them onto each capacity drive."""
    tm = manager(tmp_path, dram_blocks=0, ssd=(1, 16), cap=(2, 32))
    tm.director.resize(Tier.SSD, 4)
    old, new = keys_of(0, 4), keys_of(1, 4)
    serve(tm, old)
    tm.flush()
    return tm, old, new


def test_blocks_demoted_onto_a_drive_failing_its_flush_stay_on_the_ssds(tmp_path, fdatasync_fails):
    """The capacity pool's flush that was to make demoted blocks durable fails on one drive: the blocks
    written there keep their SSD copies (nothing raised, nothing lost), the others move down."""
    tm, old, new = _demoting(tmp_path)
    with tm:
        cap = tm.stores[Tier.CAPACITY]
        fdatasync_fails(cap.drives[1].fd)
        serve(tm, new)
        tm.flush()
        assert not cap.drives[1].healthy
        got = serve(tm, old)
        assert len(got) == 4 and got.count(Tier.SSD) == 2 and got.count(Tier.CAPACITY) == 2


def test_a_pool_drive_failing_its_flush_costs_its_blocks_not_the_call(tmp_path, fdatasync_fails):
    """A drive failing its fdatasync in TierManager.flush: the cache degrades (the blocks written there are
    forgotten, as any failed drive's) and the flush does not raise."""
    with manager(tmp_path, dram_blocks=0, ssd=(2, 8), cap=None) as tm:
        ssd = tm.stores[Tier.SSD]
        fdatasync_fails(ssd.drives[1].fd)
        ks = keys_of(0, 6)
        serve(tm, ks)
        tm.flush()
        assert not ssd.drives[1].healthy
        assert len(ssd) == 3 and all(e.extents[0][0] == 0 for e in ssd.catalog.entries.values())
        assert tm.director.resident(Tier.SSD) == 3
        assert serve(tm, ks) == [Tier.SSD]  # block 1 went to drive 1: the prefix stops there


@pytest.mark.usefixtures("python_engine")
def test_a_block_whose_write_below_fails_stays_on_the_ssds(tmp_path):
    tm, old, new = _demoting(tmp_path)
    with tm:
        heal = _writes_fail_on(tm.stores[Tier.CAPACITY], 1)
        serve(tm, new)  # the writes of the old blocks onto capacity drive 1 fail
        heal()
        got = serve(tm, old)
        assert len(got) == 4 and got.count(Tier.SSD) == 2
        assert tm.counters["put_failures"] == 2 and tm.counters["moves_kept"] == 2
        tm.flush()
        for t, s in tm.stores.items():  # every block the director holds is in its pool, and no other
            assert set(s.catalog.entries) == set(tm.director.tiers[t])


def test_a_block_a_full_capacity_pool_refuses_stays_on_the_ssds(tmp_path):
    """The capacity pool has no room left (filled behind the director's back): its puts fail at once,
    and the blocks being demoted stay where they were."""
    tm, old, new = _demoting(tmp_path)
    with tm:
        cap = tm.stores[Tier.CAPACITY]
        with pytest.raises(DriveFull):
            for i in range(100):
                assert cap.put(b"other%d" % i, b"x" * BLOCK)
        serve(tm, new)
        assert serve(tm, old) == [Tier.SSD] * 4
        assert tm.counters["moves_kept"] == 4 and tm.counters["moves_lost"] == 0


@pytest.mark.usefixtures("python_engine")
def test_a_write_back_that_fails_leaves_the_block_in_dram(tmp_path):
    with manager(tmp_path, dram_blocks=4, ssd=(1, 16), cap=None, write="write-back") as tm:
        old, new = keys_of(0, 4), keys_of(1, 4)
        serve(tm, old)  # in DRAM only
        ssd = tm.stores[Tier.SSD]
        heal = _writes_fail_on(ssd, 0)
        serve(tm, new)  # DRAM evicts the old blocks: their write-backs fail
        heal()
        assert serve(tm, old) == [Tier.DRAM] * 4
        assert tm.counters["moves_kept"] == 4
        tm.flush()
        assert len(ssd) == 8  # written back, now that the drive works


@pytest.mark.usefixtures("python_engine")
def test_a_block_whose_move_fails_again_is_let_go_and_counted(tmp_path):
    """A block kept after a failed move is its tier's next victim; if the retried move fails too, it goes
    (counted), so a tier below that keeps failing costs a block per eviction, not a growing backlog."""
    with manager(tmp_path, dram_blocks=4, ssd=(1, 16), cap=None, write="write-back") as tm:
        old, new = keys_of(0, 4), keys_of(1, 4)
        serve(tm, old)
        ssd = tm.stores[Tier.SSD]
        heal = _writes_fail_on(ssd, 0)
        serve(tm, new)  # the old blocks' write-backs fail: they stay in DRAM, as its next victims
        _drain(ssd)
        serve(tm, keys_of(2, 1))  # DRAM evicts them again (and one new block): those write-backs fail too
        heal()
        assert serve(tm, old) == []  # let go
        assert tm.counters["moves_kept"] == 5 and tm.counters["moves_lost"] == 4
        assert len(tm.dram) == tm.director.resident(Tier.DRAM)


def _pins(tm: TierManager) -> int:
    return sum(s.pins for s in tm.dram._slots.values())


def _ssd_then_dram(tm: TierManager) -> list[bytes]:
    """Six blocks on the SSD pool, the last four in DRAM too: a prefetch of them reads two and pins four."""
    ks = keys_of(0, 6)
    serve(tm, ks)
    tm.flush()
    pf = tm.prefetch(ks)
    assert _pins(tm) == 4 and tm.stores[Tier.SSD].pool.in_use > 0
    pf.result().release(promote=False)
    return ks


def test_a_cancelled_prefetch_gives_back_its_pins_and_read_buffers(tmp_path):
    with manager(tmp_path, cap=None) as tm:
        ks = _ssd_then_dram(tm)
        ssd = tm.stores[Tier.SSD]
        pf = tm.prefetch(ks)
        pf.cancel()  # the caller moved on: the reads may still be in flight
        pf.cancel()
        assert _pins(tm) == 0
        with pytest.raises(KVSwarmError, match="cancelled"):
            pf.result()
        tm.flush()  # the abandoned reads are reaped once back
        assert ssd.pool.in_use == 0
        assert key_digest(ks[0]) not in tm.dram  # nothing was promoted from the abandoned reads
        tm.clear_dram()
        assert tm.dram.pool.in_use == 0  # no slot stayed pinned after its block left DRAM
        assert serve(tm, ks) == [Tier.SSD] * 6


def test_a_prefetch_left_by_an_exception_or_dropped_gives_back_its_pins(tmp_path):
    with manager(tmp_path, cap=None) as tm:
        ks = _ssd_then_dram(tm)
        with pytest.raises(RuntimeError):
            with tm.prefetch(ks):
                raise RuntimeError("the caller failed before it needed the prefix")
        assert _pins(tm) == 0
        with tm.prefetch(ks) as pf:
            hit = pf.result()
        assert [bytes(v) for v in hit.views] == [bytes(payload(k, i)) for i, k in enumerate(ks)]  # still valid
        hit.release(promote=False)
        pf = tm.prefetch(ks)
        del pf  # never consumed: unpinned at the next request
        assert serve(tm, keys_of(1, 2)) == []
        assert _pins(tm) == 0
        tm.clear_dram()
        tm.flush()
        assert tm.dram.pool.in_use == 0 and tm.stores[Tier.SSD].pool.in_use == 0


def _fail_once(monkeypatch, obj, name: str) -> None:
    orig, calls = getattr(obj, name), []

    def flaky(*a, **kw):
        if not calls:
            calls.append(1)
            raise OSError(5, "injected")
        return orig(*a, **kw)

    monkeypatch.setattr(obj, name, flaky)


@pytest.mark.usefixtures("python_engine")
def test_a_prefetch_whose_read_fails_gives_back_its_pins_and_buffers(tmp_path, monkeypatch):
    with manager(tmp_path, cap=None, chunk_blocks=1) as tm:
        ks = _ssd_then_dram(tm)
        ssd = tm.stores[Tier.SSD]
        pf = tm.prefetch(ks)  # two one-block reads, four pins
        _fail_once(monkeypatch, ssd.engine, "wait")
        with pytest.raises(OSError, match="injected"):
            pf.result()
        assert _pins(tm) == 0
        tm.flush()
        assert ssd.pool.in_use == 0
        assert serve(tm, ks) == [Tier.SSD] * 2 + [Tier.DRAM] * 4


@pytest.mark.usefixtures("python_engine")
def test_an_abandoned_read_that_fails_does_not_fail_the_next_request(tmp_path, monkeypatch):
    with manager(tmp_path, cap=None) as tm:
        ks = _ssd_then_dram(tm)
        ssd = tm.stores[Tier.SSD]
        pf = tm.prefetch(ks)
        while not pf.poll():  # read and verified: the next request reaps it first
            time.sleep(0.001)
        pf.cancel()
        _fail_once(monkeypatch, ssd.engine, "wait")  # the abandoned read fails when reaped
        assert serve(tm, ks) == [Tier.SSD] * 2 + [Tier.DRAM] * 4
        tm.flush()
        assert ssd.pool.in_use == 0


def test_a_hit_whose_promotion_fails_still_gives_back_its_pins_and_buffers(tmp_path, monkeypatch):
    with manager(tmp_path, cap=None) as tm:
        ks = _ssd_then_dram(tm)
        hit = tm.lookup(ks)
        _fail_once(monkeypatch, tm, "_execute")
        with pytest.raises(OSError, match="injected"):
            hit.release()  # promoting the two SSD blocks fails
        assert _pins(tm) == 0 and tm.stores[Tier.SSD].pool.in_use == 0
        hit.release()
        serve(tm, ks)  # right bytes (the director counted the promotion as done: the blocks are recomputed)
        assert len(serve(tm, ks)) == 6


def test_keys_and_payloads_of_the_wrong_size_are_refused(tmp_path):
    """A 14-byte key was taken silently: its block header could not carry it, so the block missed
    once it left DRAM.  Every entry point refuses it, and a refused insert stores nothing."""
    from kvswarm.errors import ConfigError

    tm = manager(tmp_path)
    ks = keys_of(7, 2)
    with pytest.raises(ConfigError, match="16 bytes"):
        tm.insert([ks[0][:14]], [payload(ks[0])])
    with pytest.raises(ConfigError, match="16 bytes"):
        tm.lookup([ks[0] + b"xx"])
    with pytest.raises(ConfigError, match="16 bytes"):
        tm.evict(["not bytes"], Tier.DRAM)
    with pytest.raises(ConfigError, match="B"):
        tm.insert([ks[0]], [payload(ks[0])[:-1]])
    with pytest.raises(ConfigError, match="payloads"):
        tm.insert(ks, [payload(ks[0])])
    assert tm.director.resident(Tier.DRAM) == 0
    assert serve(tm, ks) == []  # the right keys go in and come back
    assert serve(tm, ks) == [Tier.DRAM, Tier.DRAM]
