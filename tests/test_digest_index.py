"""The catalog's digest -> row index: the native table and the dict answer alike."""

import random

import numpy as np
import pytest

from kvswarm.digest_index import DictDigestIndex, NativeDigestIndex, new_digest_index
from kvswarm.format import key_digest

KINDS = [DictDigestIndex] + ([NativeDigestIndex] if NativeDigestIndex is not None else [])


@pytest.fixture(params=KINDS, ids=lambda k: k.__name__)
def kind(request):
    return request.param


def _d(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


def test_the_native_table_is_built_here():
    # setup.py builds it wherever the other native modules build; CI must test it, not only the dict
    assert NativeDigestIndex is not None and isinstance(new_digest_index(), NativeDigestIndex)


def test_mapping_calls(kind):
    x = kind()
    x[_d(1)] = 10
    x.update([(_d(2), 20), (_d(3), 30)])
    assert len(x) == 3 and _d(2) in x and _d(9) not in x
    assert x[_d(1)] == 10 and x.get(_d(3)) == 30 and x.get(_d(9)) is None and x.get(_d(9), -1) == -1
    assert x.pop(_d(2)) == 20 and x.pop(_d(2), None) is None and _d(2) not in x
    with pytest.raises(KeyError):
        x.pop(_d(2))
    with pytest.raises(KeyError):
        x[_d(2)]
    x[_d(1)] = 11  # overwrite
    assert sorted(x) == sorted([_d(1), _d(3)]) and x[_d(1)] == 11
    del x[_d(3)]
    assert list(x) == [_d(1)]
    x.clear()
    assert len(x) == 0 and list(x) == [] and _d(1) not in x


def test_batched_lookup(kind):
    x = kind()
    x.update((_d(i), i * 3) for i in range(100))
    ask = [_d(5), _d(1000), _d(99), b"short", _d(0)]
    out = np.empty(len(ask), np.int64)
    x.lookup(ask, out)
    assert out.tolist() == [15, -1, 297, -1, 0]


def test_a_random_workload_matches_a_dict(kind):
    """Growth, deletes (tombstones) and re-inserts over many rehashes, checked against a plain dict."""
    rng = random.Random(7)
    x, model = kind(), {}
    for step in range(60_000):
        k = _d(rng.randrange(5000))
        op = rng.random()
        if op < 0.55:
            model[k] = step
            x[k] = step
        elif op < 0.9:
            assert x.pop(k, None) == model.pop(k, None)
        else:
            assert (k in x) == (k in model) and x.get(k) == model.get(k)
    assert len(x) == len(model) and sorted(x) == sorted(model)
    keys = [_d(i) for i in range(5000)]
    out = np.empty(len(keys), np.int64)
    x.lookup(keys, out)
    assert out.tolist() == [model.get(k, -1) for k in keys]


@pytest.mark.skipif(NativeDigestIndex is None, reason="the native table is not built")
def test_native_refuses_what_it_cannot_hold():
    x = NativeDigestIndex()
    with pytest.raises(TypeError):
        x[b"not sixteen"] = 1
    with pytest.raises(ValueError):
        x[_d(1)] = -1
    assert b"not sixteen" not in x and x.get("text") is None
    with pytest.raises(ValueError):
        x.lookup([_d(1)], np.empty(2, np.int64))  # one row per digest
    with pytest.raises(ValueError):
        x.lookup([_d(1)], np.empty(1, np.int32))


def test_lookup_keys_makes_the_store_s_digests_on_the_way(kind):
    keys = [b"alpha", b"", b"b" * 1000, bytearray(b"delta"), b"absent"]
    x = kind()
    x.update([(key_digest(bytes(k)), i) for i, k in enumerate(keys[:4])])
    out, digests = np.empty(5, np.int64), np.empty(5, "V16")
    x.lookup_keys(keys, out, digests)
    assert out.tolist() == [0, 1, 2, 3, -1]
    assert digests.tobytes() == b"".join(key_digest(bytes(k)) for k in keys)
    with pytest.raises(ValueError):
        x.lookup_keys(keys, np.empty(4, np.int64), digests)
