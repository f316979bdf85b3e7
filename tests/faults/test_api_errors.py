"""API misuse the campaign found: calls on a closed store, a drive index out of range, placement
hints that do not match the items are kvswarm errors; a strided array is stored like any buffer."""

import numpy as np
import pytest

from kvswarm import KVStore, KVSwarmError
from kvswarm.errors import ConfigError


@pytest.fixture
def store(drive_dirs):
    s = KVStore.open(drive_dirs(2), capacity_per_drive=1 << 20, buffer_pool_bytes=4 << 20)
    yield s
    s.close()


def test_closed_store_refuses_calls(drive_dirs):
    s = KVStore.open(drive_dirs(1), capacity_per_drive=1 << 20, buffer_pool_bytes=4 << 20)
    s.put(b"k", b"v")
    s.close()
    for call in (lambda: s.put(b"k2", b"v"), lambda: s.get(b"k"), s.flush, lambda: s.delete(b"k"), s.checkpoint):
        with pytest.raises(KVSwarmError, match="closed"):
            call()
    s.close()  # twice is fine


def test_fail_drive_out_of_range_and_hints_mismatch(store):
    for i in (2, -1, 99):
        with pytest.raises(ConfigError):
            store.fail_drive(i)
    with pytest.raises(ConfigError):
        store.put_many([(b"a", b"1"), (b"b", b"2")], hints=[None])
    assert all(d["healthy"] for d in store.stats()["drives"]) and len(store) == 0


def test_strided_array_is_stored(store):
    a = np.arange(256, dtype=np.uint8)[::2]
    assert store.put(b"strided", a)
    assert store.get(b"strided") == a.tobytes()
