"""Store-side halves of the campaign's scenarios: module-level functions a :class:`Sandbox` worker
runs (they return plain data: reads and the errors met, by step).  The file systems and devices
they run on are made and removed by the parent (:mod:`kvswarm.faults.campaign`)."""

from __future__ import annotations

import os
import random
import threading
import time

from kvswarm.errors import KVSwarmError
from kvswarm.faults.loopfs import shutdown
from kvswarm.faults.outcome import read_open
from kvswarm.faults.payloads import key, payload, version_of
from kvswarm.faults.writer import store_config
from kvswarm.store import KVStore


def _step(errors: list, name: str, fn, *args):
    """Run one step; an exception is noted as (step, "module.Class: message", clear) and None returned."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - classified by the parent
        errors.append((name, f"{type(e).__module__}.{type(e).__qualname__}: {e}"[:300], isinstance(e, KVSwarmError)))
        return None


def build(cfg: dict, nkeys: int, overwrite: int = 0, delete: int = 0, checkpoint: bool = True,
          close: bool = True) -> None:
    """A store of keys 0..nkeys-1 at version 1; then keys below ``overwrite`` at version 2 and the last
    ``delete`` keys deleted, after a checkpoint (so those changes are in the journal)."""
    s = KVStore(store_config(cfg))
    s.put_many([(key(k), payload(k, 1)) for k in range(nkeys)])
    if checkpoint:
        s.checkpoint()
    s.put_many([(key(k), payload(k, 2)) for k in range(overwrite)])
    for k in range(nkeys - delete, nkeys):
        s.delete(key(k))
    s.flush()
    if close:
        s.close()
    else:
        os._exit(0)  # a crash right after the flush: the journal keeps what followed the checkpoint


def write_until_full(cfg: dict, nkeys: int, extra: int) -> dict:
    """Open, read the flushed keys, put more until the pool is full, flush, read again, close."""
    errors: list = []
    s = KVStore(store_config(cfg))
    stored = []
    try:
        for k in range(nkeys, nkeys + extra):
            ok = _step(errors, "put", s.put, key(k), payload(k, 1))
            if ok:
                stored.append(k)
            elif ok is False or errors:
                break
        flushed = _step(errors, "flush", s.flush) is None and not any(e[0] == "flush" for e in errors)
        reads = read_open(s, nkeys)
        unhealthy = sum(not d["healthy"] for d in s.stats()["drives"])
    finally:
        _step(errors, "close", s.close)
    return {"reads": reads, "stored": stored if flushed else [], "unhealthy": unhealthy, "errors": errors}


def meta_full(cfg: dict, nkeys: int, extra: int) -> dict:
    """With the catalog's file system full: put, flush, checkpoint, read, close."""
    errors: list = []
    s = KVStore(store_config(cfg))
    try:
        _step(errors, "put", s.put_many, [(key(k), payload(k, 1)) for k in range(nkeys, nkeys + extra)])
        _step(errors, "flush", s.flush)
        _step(errors, "checkpoint", s.checkpoint)
        reads = read_open(s, nkeys)
    finally:
        _step(errors, "close", s.close)
    return {"reads": reads, "errors": errors}


def create_retry(cfg: dict, too_big: int) -> dict:
    """A new store refused for a capacity its file system cannot hold, then made with one it can."""
    errors: list = []
    _step(errors, "open_too_big", lambda: KVStore(store_config(cfg | {"capacity": too_big})).close())
    s = _step(errors, "open_retry", KVStore, store_config(cfg))
    reads = []
    if s is not None:
        try:
            _step(errors, "put", s.put_many, [(key(k), payload(k, 1)) for k in range(8)])
            _step(errors, "flush", s.flush)
            reads = read_open(s, 8)
        finally:
            _step(errors, "close", s.close)
    return {"reads": reads, "errors": errors, "refused": any(e[0] == "open_too_big" for e in errors)}


def eio_while_open(cfg: dict, nkeys: int, fs_dir: str) -> dict:
    """Write and flush, then the file system under one drive fails (EIO): read, write, flush, close."""
    errors: list = []
    s = KVStore(store_config(cfg))
    try:
        s.put_many([(key(k), payload(k, 1)) for k in range(nkeys)])
        s.flush()
        shutdown(fs_dir)
        reads = read_open(s, nkeys)
        _step(errors, "put", s.put_many, [(key(k), payload(k, 2)) for k in range(nkeys, nkeys + 10)])
        _step(errors, "flush", s.flush)
        again = read_open(s, nkeys)
    finally:
        _step(errors, "close", s.close)
    return {"reads": reads, "again": again, "errors": errors}


def thread_race(cfg: dict, nkeys: int, threads: int, seconds: float) -> dict:
    """Threads put, overwrite, delete and read the same keys at once; every read is checked."""
    s = KVStore(store_config(cfg))
    counts = {"reads": 0, "wrong": 0, "errors": []}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def work(t: int) -> None:
        rng = random.Random(t)
        n = 0
        while time.monotonic() < end:
            k = rng.randrange(nkeys)
            op = rng.random()
            try:
                if op < 0.4:
                    n += 1
                    s.put(key(k), payload(k, t * 1_000_000 + n))
                elif op < 0.5:
                    s.delete(key(k))
                else:
                    ks = rng.sample(range(nkeys), 4)
                    with s.get_many([key(x) for x in ks]) as r:
                        bad = sum(v is not None and version_of(x, v) is None for x, v in zip(ks, r.views))
                    with lock:
                        counts["reads"] += 4
                        counts["wrong"] += bad
            except Exception as e:  # noqa: BLE001
                with lock:
                    counts["errors"].append((f"{type(e).__module__}.{type(e).__qualname__}: {e}"[:200],
                                             isinstance(e, KVSwarmError)))
                return

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    s.flush()
    final = read_open(s, nkeys)
    s.close()
    counts["final"] = final
    return counts


def follow_race(cfg: dict, nkeys: int, seconds: float) -> dict:
    """A follower reads while its writer (another process) writes, deletes and checkpoints."""
    s = KVStore(store_config(cfg | {"follow": True}))
    reads = wrong = refreshes = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            refreshes += s.refresh()
            got = read_open(s, nkeys)
            reads += len(got)
            wrong += sum(r.kind == "wrong" for r in got)
    finally:
        s.close()
    return {"reads": reads, "wrong": wrong, "refreshes": refreshes}
