"""The cluster's value format: a block's payload framed with its key digest and checksum.

A block crosses the network (and sits in other nodes' DRAM) as one Mooncake object whose
value is a 40-byte frame header followed by the payload::

    magic "KVCW" | version u16 | flags u16 | key digest 16s | payload length u64 | xxh3-64 u64

The checksum is xxh3-64 of the payload seeded with the key digest, so a payload stored
under another key fails it too.  :func:`unpack` checks magic, version, digest, length and
checksum before it returns the payload (version 1 defines no flags: they must be 0): a flipped
bit anywhere is a miss, never KV.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"KVCW"
VERSION = 1
_HDR = struct.Struct("<4sHH16sQQ")
FRAME_BYTES = _HDR.size
assert FRAME_BYTES == 40


def _checksum(digest: bytes, payload) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=int.from_bytes(digest[:8], "little"))


def pack(digest: bytes, payload) -> bytearray:
    """One framed value: a copy of ``payload`` after its header (the caller may reuse its buffer)."""
    n = len(payload)
    out = bytearray(FRAME_BYTES + n)
    _HDR.pack_into(out, 0, MAGIC, VERSION, 0, digest, n, _checksum(digest, payload))
    out[FRAME_BYTES:] = payload
    return out


def unpack(digest: bytes, value) -> memoryview | None:
    """The payload of ``value`` when it is an intact frame of ``digest``, else None."""
    if len(value) < FRAME_BYTES:
        return None
    magic, version, flags, dg, n, check = _HDR.unpack_from(value)
    if magic != MAGIC or version != VERSION or flags or dg != digest or len(value) != FRAME_BYTES + n:
        return None
    payload = memoryview(value)[FRAME_BYTES:]
    return payload if _checksum(digest, payload) == check else None
