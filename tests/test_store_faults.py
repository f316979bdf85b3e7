"""Store-side faults: bad configuration, damaged metadata, full and failing drives, degraded open.

Every case ends in exact bytes, a counted miss or a clear error of kvswarm's own classes, and a
refused call leaves the store (and the files behind it) as they were.
"""

from __future__ import annotations

import gc
import json
import mmap
import os

import numpy as np
import pytest

from kvswarm import KVStore
from kvswarm.drive import DATA_FILE
from kvswarm.errors import ConfigError, DriveError, KVSwarmError
from kvswarm.store import StoreConfig

MiB = 1 << 20


def _open(paths, backend="threads", **kw):
    kw.setdefault("capacity_per_drive", 16 * MiB)
    kw.setdefault("buffer_pool_bytes", 16 * MiB)
    return KVStore.open(paths, backend=backend, **kw)


def _payload(i: int, n: int = 5000) -> bytes:
    return np.random.default_rng(i).bytes(n)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("queue_depth", 0), ("queue_depth", -3), ("buffer_pool_bytes", 0),
                                         ("capacity_per_drive", 4096), ("capacity_per_drive", 5000),
                                         ("stripe_unit", 0), ("checkpoint_every", 0), ("error_threshold", -1),
                                         ("backend", "bogus"), ("queue_depth", 2.5)])
def test_nonsensical_config_is_refused_before_anything_is_touched(drive_dirs, field, value):
    paths = drive_dirs(1)
    with pytest.raises(ConfigError, match=field if field != "backend" else "backend"):
        KVStore(StoreConfig(drives=paths, **{field: value}))
    assert os.listdir(paths[0]) == []  # no data file, manifest, lock or journal


def test_queue_depth_zero_with_uring_does_not_hang(drive_dirs):
    """``auto`` picks uring, which with a depth cap of 0 never submitted and waited forever."""
    with pytest.raises(ConfigError, match="queue_depth"):
        StoreConfig(drives=drive_dirs(1), backend="auto", queue_depth=0)


def test_absurd_buffer_pool_is_a_clear_error_and_holds_nothing(drive_dirs):
    paths = drive_dirs(1)
    fds = _fds()
    with pytest.raises(ConfigError, match="buffer pool"):
        _open(paths, buffer_pool_bytes=10**18)
    assert _fds() == fds
    _open(paths).close()  # the corrected retry opens


def test_an_object_of_too_many_parts_is_refused_and_nothing_is_stored(drive_dirs):
    with _open(drive_dirs(1), stripe_unit=4096, capacity_per_drive=64 * MiB,
               buffer_pool_bytes=64 * MiB) as s:
        free = s.drives[0].free_bytes
        with pytest.raises(ConfigError, match="parts"):
            s.put(b"big", bytes(65536 * (4096 - 64)))
        assert len(s) == 0 and s.drives[0].free_bytes == free and s.pool.in_use == 0
        assert s.put(b"small", b"x" * 100) and s.get(b"small") == b"x" * 100


# ---- reads in place ----------------------------------------------------------------------------
def test_a_missed_in_place_read_lets_go_of_the_callers_buffer(drive_dirs, overwrite):
    """threads backend: an idle worker held its last chunk of requests, so a caller's buffer read
    in place stayed exported after release() and could not be unmapped."""
    paths = drive_dirs(1)
    with _open(paths) as s:
        s.put(b"k", _payload(1, 8192))
        s.flush()
        entry = next(iter(s.catalog))[1]
        overwrite(paths[0], entry.extents[0][1] + 4096, b"\xff" * 16)  # the payload, past its header sector
        buf = mmap.mmap(-1, 8192)
        view = memoryview(buf)
        r = s.submit_get([b"k"], into=[view], in_place=True).wait()
        assert r.views[0] is None and r.misses == 1
        r.release()
        del r
        view.release()
        gc.collect()
        buf.close()  # BufferError while anything still exports it
