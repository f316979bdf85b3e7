"""A store read by another process than its writer (``StoreConfig.follow``): the writer runs in a
subprocess, the follower here.  The follower writes nothing, takes in new and deleted objects on
``refresh()``, follows the writer's checkpoints (reloading only when more than one went by), and a
stale view of an extent the writer has since reused reads as a miss, never as the new object's
bytes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvswarm.catalog import JOURNAL, Catalog, Entry
from kvswarm.errors import KVSwarmError
from kvswarm.format import key_digest
from kvswarm.store import KVStore, StoreConfig

SIZE = 60_000  # one 60 KiB extent per object
WRITER = r"""
import sys
from kvswarm.errors import DriveFull
from kvswarm.store import KVStore, StoreConfig

store = KVStore(StoreConfig(drives=sys.argv[1].split(","), capacity_per_drive=int(sys.argv[2]), checkpoint_every=10**9))
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "put":  # put NAME FILL
        ok = store.put(args[0].encode(), bytes([int(args[1])]) * %d)
    elif cmd == "many":  # many N: N small objects, s0 .. s<N-1>
        ok = all(store.put_many([(b"s%%d" %% i, b"%%d" %% i) for i in range(int(args[0]))]))
    elif cmd == "delete":
        ok = store.delete(args[0].encode())
    elif cmd == "fill":  # write objects until the pool is full: every free extent is reused
        n = 0
        try:
            while True:
                store.put(b"fill%%d" %% n, bytes([200]) * %d)
                n += 1
        except DriveFull:
            ok = n
    elif cmd == "flush":
        ok = store.flush()
    elif cmd == "checkpoint":
        ok = store.checkpoint()
    elif cmd == "count":
        ok = len(store)
    print(ok, flush=True)
store.close()
""" % (SIZE, SIZE)


class Writer:
    """The store's one writer, in a process of its own, driven a command at a time."""

    def __init__(self, drives: list[str], capacity: int = 1 << 20) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", WRITER, ",".join(drives), str(capacity)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, *cmd: object) -> str:
        self.p.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline().strip()
        assert out, f"writer died on {cmd}"
        return out

    def close(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(timeout=60) == 0


def fingerprint(paths: list[str]) -> dict[str, str]:
    """Every file of the store, hashed: what a follower must leave as it found it."""
    out = {}
    for root in paths:
        for name in sorted(os.listdir(root)):
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.join(root, name)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def drives(drive_dirs):
    return drive_dirs(1)


def test_follower_sees_the_writers_objects_and_writes_nothing(drives):
    w = Writer(drives)
    for i in range(4):
        w("put", f"a{i}", i)
    w("flush")
    before = fingerprint(drives)
    f = KVStore(StoreConfig(drives=drives, follow=True))
    assert len(f) == 4 and f.get(b"a2") == bytes([2]) * SIZE
    with pytest.raises(KVSwarmError):
        f.put(b"mine", b"x")
    assert f.refresh() is False  # nothing new
    assert fingerprint(drives) == before  # opening, reading, refreshing: the follower wrote nothing
    w("put", "b0", 7)
    w("delete", "a1")
    assert f.refresh() is False  # not flushed: the writer has journaled nothing yet
    w("flush")
    assert f.refresh() is True
    assert f.get(b"b0") == bytes([7]) * SIZE and f.get(b"a1") is None and len(f) == 4
    w("checkpoint")  # a new journal epoch: the follower finishes the old journal, then reads the new one
    w("put", "c0", 9)
    w("flush")
    assert f.refresh() is True
    assert len(f) == int(w("count")) == 5 and f.get(b"c0") == bytes([9]) * SIZE
    before = fingerprint(drives)
    assert f.delete(b"a0") and f.get(b"a0") is None  # forgotten here only
    f.flush()
    f.close()
    assert fingerprint(drives) == before  # deleting, flushing, closing: nothing written either
    assert w("count") == "5"
    w.close()


def test_stale_follower_reads_a_reused_extent_as_a_miss(drives):
    w = Writer(drives)
    for i in range(4):
        w("put", f"a{i}", i)
    w("flush")
    f = KVStore(StoreConfig(drives=drives, follow=True))
    w("delete", "a2")
    w("flush")  # a2's extent is free now ...
    assert int(w("fill")) > 0  # ... and holds another object
    w("flush")
    with f.get_many([b"a2", b"a3"]) as r:  # the follower has not refreshed: it still locates a2 there
        assert r.views[0] is None and bytes(r.views[1]) == bytes([3]) * SIZE
        assert r.failed == [0] and r.corrupt == 1
    assert f.refresh() is True and f.get(b"a2") is None and f.get(b"fill0") == bytes([200]) * SIZE
    f.close()
    w.close()


def test_follower_needs_an_existing_store(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(KVSwarmError):
        KVStore(StoreConfig(drives=[str(tmp_path / "empty")], follow=True))
    assert os.listdir(tmp_path / "empty") == []


def test_reads_during_the_followers_reloads_are_hits_or_misses(drives):
    """A reader thread keeps reading while the writer checkpoints again and again, each time twice,
    so that the follower, two epochs behind, reloads its whole catalog (a fresh, at first smaller,
    row table under the reader's feet): every read is the right bytes or a miss, none fails."""
    w = Writer(drives, capacity=16 << 20)
    n = 3000  # rows beyond the 1024 an emptied table starts with
    w("many", n)
    w("flush")
    f = KVStore(StoreConfig(drives=drives, follow=True))
    keys = [b"s%d" % i for i in range(n)]
    stop, seen, errors = threading.Event(), [0, 0], []

    digests = [key_digest(k) for k in keys]

    def reader() -> None:
        while not stop.is_set():
            try:
                for _ in range(20):  # mostly the lookup, where a read meets the reload
                    f.catalog.locate(digests)
                with f.get_many(keys) as r:
                    for i, v in enumerate(r.views):
                        if v is not None:
                            assert bytes(v) == b"%d" % i
                            seen[0] += 1
                        else:
                            seen[1] += 1
            except Exception as e:  # noqa: BLE001 - any failure is the finding
                errors.append(e)
                return

    t = threading.Thread(target=reader)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns between any two steps of a read
    try:
        t.start()
        for _ in range(15):
            w("checkpoint")
            w("checkpoint")
            assert f.refresh() is True
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    assert seen[0] > 0
    f.close()
    w.close()


def test_follower_waits_out_an_append_in_progress(tmp_path):
    """The writer's journal append seen half-done: not applied, not cut off; applied once whole."""
    writer = Catalog(str(tmp_path))
    writer.put(b"a" * 16, Entry(writer.new_generation(), 10, ((0, 4096, 4096, 1),)))
    writer.sync()
    follower = Catalog(str(tmp_path), follow=True)
    assert b"a" * 16 in follower and len(follower) == 1
    writer.put(b"b" * 16, Entry(writer.new_generation(), 10, ((0, 8192, 4096, 2),)))
    record = b"".join(writer._pending)
    writer._pending.clear()  # appended by hand below, in two halves
    path = os.path.join(str(tmp_path), JOURNAL)
    with open(path, "ab") as f:
        f.write(record[:20])
    assert follower.refresh() is False and len(follower) == 1
    with open(path, "ab") as f:
        f.write(record[20:])
    assert follower.refresh() is True and follower.get(b"b" * 16).extents == ((0, 8192, 4096, 2),)
    assert os.path.getsize(path) > 20  # the follower cut nothing off
    writer.close()


def _put(cat: Catalog, name: bytes, offset: int) -> None:
    cat.put(name.ljust(16, b"."), Entry(cat.new_generation(), 10, ((0, offset, 4096, offset),)))


def _state(cat: Catalog) -> dict[bytes, Entry]:
    return {d: cat.get(d) for d in list(cat.entries)}


def _counting_loads(cat: Catalog) -> list[int]:
    """Counts the follower's checkpoint loads (each one is a whole reload)."""
    calls = [0]
    load = cat._load_checkpoint

    def counted(path: str) -> None:
        calls[0] += 1
        load(path)

    cat._load_checkpoint = counted  # type: ignore[method-assign]
    return calls


def test_follower_goes_on_across_a_checkpoint_without_reloading(tmp_path):
    """One checkpoint of the writer's between two refreshes: the follower applies the rest of the
    journal the checkpoint replaced (kept open), then the new epoch's journal, and ends in the
    writer's state without reading the checkpoint."""
    writer = Catalog(str(tmp_path))
    _put(writer, b"a", 4096)
    _put(writer, b"b", 8192)
    writer.sync()
    follower = Catalog(str(tmp_path), follow=True)
    loads = _counting_loads(follower)
    _put(writer, b"c", 12288)
    writer.delete(b"a".ljust(16, b"."))
    writer.sync()  # journaled, not yet seen by the follower
    _put(writer, b"d", 16384)  # pending: the checkpoint writes it to the old journal first
    writer.checkpoint()
    _put(writer, b"e", 20480)
    writer.sync()
    assert follower.refresh() is True
    assert loads == [0] and follower.epoch == writer.epoch
    assert _state(follower) == _state(writer) and len(follower) == 4
    writer.checkpoint()  # nothing new since: the follower moves to the next epoch, nothing to apply
    assert follower.refresh() is False and loads == [0] and follower.epoch == writer.epoch
    _put(writer, b"f", 24576)
    writer.sync()
    assert follower.refresh() is True and _state(follower) == _state(writer) and loads == [0]
    writer.close()
    follower.close()


def test_follower_reloads_when_it_cannot_follow_exactly(tmp_path):
    """Two checkpoints since the last refresh (the journal between them is gone), or a journal whose
    end the follower cannot read whole: the follower reloads, and ends in the writer's state."""
    writer = Catalog(str(tmp_path))
    _put(writer, b"a", 4096)
    writer.sync()
    follower = Catalog(str(tmp_path), follow=True)
    loads = _counting_loads(follower)
    _put(writer, b"b", 8192)
    writer.checkpoint()
    _put(writer, b"c", 12288)
    writer.checkpoint()
    assert follower.refresh() is True and loads == [1] and _state(follower) == _state(writer)
    with open(os.path.join(str(tmp_path), JOURNAL), "ab") as f:
        f.write(b"\x40" + bytes(30))  # not a whole record: replay of this journal stops here
    _put(writer, b"d", 16384)
    writer.checkpoint()  # "d" goes into the old journal after the bad bytes; the checkpoint has it
    assert follower.refresh() is True and loads == [2] and _state(follower) == _state(writer)
    writer.close()
    follower.close()


def test_a_second_writer_is_refused_while_the_first_is_open(drives):
    w = Writer(drives)
    w("put", "a0", 1)
    with pytest.raises(KVSwarmError, match="follow=True"):
        KVStore(StoreConfig(drives=drives))
    w.close()  # the writer's process is gone: so is its lock
    with KVStore(StoreConfig(drives=drives)) as s:
        assert s.get(b"a0") == bytes([1]) * SIZE
        with pytest.raises(KVSwarmError):  # one writer per store within a process too
            KVStore(StoreConfig(drives=drives))


def test_a_read_meeting_a_half_reloaded_table_is_a_miss(drives):
    """The state a reader can meet in the middle of a follower's reload: the index still holds the
    old rows, the table is the fresh (smaller) one.  Reads of it are misses, not an IndexError."""
    n = 1500
    with KVStore(StoreConfig(drives=drives, capacity_per_drive=8 << 20)) as w:
        w.put_many([(b"s%d" % i, b"%d" % i) for i in range(n)])
        w.flush()
        f = KVStore(StoreConfig(drives=drives, follow=True))
        f.catalog._rows = np.zeros(1024, f.catalog._rows.dtype)  # as Catalog._clear leaves it
        with f.get_many([b"s%d" % i for i in range(n)]) as r:
            assert all(v is None or bytes(v) == b"%d" % i for i, v in enumerate(r.views))
            assert r.misses == n
        f.close()
