"""Self-describing payloads: any bytes read back can be checked without knowing which write they
came from.  A payload starts with its key number, version and length, and the rest is a pure
function of those, so a read is exact, or it is wrong bytes."""

from __future__ import annotations

import struct

import numpy as np

_HEAD = struct.Struct("<4sIIQ")  # magic, key number, version, length
_MAGIC = b"KVFP"


def key(k: int) -> bytes:
    return b"fault-key-%d" % k


def payload(k: int, version: int, size: int | None = None) -> bytes:
    """The payload of key ``k`` at ``version`` (``size`` default: 1-40,000 B, a function of both)."""
    rng = np.random.default_rng(k * 1_000_003 + version)
    drawn = int(rng.integers(1, 40_000))  # drawn either way: the bytes after it are the same
    n = drawn if size is None else size
    n = max(n, _HEAD.size)
    return _HEAD.pack(_MAGIC, k, version, n) + rng.bytes(n - _HEAD.size)


def version_of(k: int, data: bytes | memoryview) -> int | None:
    """The version of key ``k`` that ``data`` is exactly, or None (wrong bytes)."""
    if len(data) < _HEAD.size:
        return None
    magic, kk, version, n = _HEAD.unpack_from(data)
    if magic != _MAGIC or kk != k or n != len(data):
        return None
    return version if bytes(data) == payload(k, version, n) else None
