"""On-disk extent format (see docs/format.md).

An extent is one 4 KiB-aligned run on a drive: a 64-byte header, then the payload,
then zero padding up to the next 4 KiB boundary.  A payload of whole 4 KiB sectors
starts on the extent's second sector instead (the header sector is zero-padded), at
no cost in space, so that the payload alone is a valid O_DIRECT target (the store itself
reads extents whole, see ``KVStore.submit_get``).  The header is self-describing so that
a read can be verified without trusting the catalog.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

ALIGN = 4096
HEADER_SIZE = 64
MAGIC = 0x4B565357  # "KVSW"
VERSION = 1
FLAG_SECTOR_PAYLOAD = 1  # header flag: the payload starts at ALIGN, not right after the header

# magic u32, version u16, flags u16, key digest 16s, payload length u32, part u16,
# parts u16, generation u64, payload xxh3-64 u64, reserved 8s | header xxh32 (of bytes 0-55) u32, pad 4s
HEADER_BODY = struct.Struct("<IHH16sIHHQQ8s")  # the part the header checksum covers
HEADER_TAIL = struct.Struct("<I4x")
assert HEADER_BODY.size + HEADER_TAIL.size == HEADER_SIZE
RESERVED = bytes(8)
# HEADER_BODY as a numpy record: a batched read builds every expected header at once.
HEADER_BODY_DTYPE = np.dtype([("magic", "<u4"), ("version", "<u2"), ("flags", "<u2"), ("digest", "V16"),
                              ("payload_len", "<u4"), ("part", "<u2"), ("parts", "<u2"), ("generation", "<u8"),
                              ("checksum", "<u8"), ("reserved", "V8")])
assert HEADER_BODY_DTYPE.itemsize == HEADER_BODY.size


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def extent_size(payload_len: int) -> int:
    """Bytes an extent holding ``payload_len`` payload bytes takes on disk."""
    return align_up(HEADER_SIZE + payload_len)


def sector_payload(payload_len):
    """Whether a part of ``payload_len`` bytes is laid out with its payload on its own sectors
    (an int, or a numpy array of lengths for a batch's extents)."""
    return (payload_len > 0) & (payload_len % ALIGN == 0)


def payload_offset(payload_len: int) -> int:
    """Where a part's payload starts in its extent."""
    return ALIGN if sector_payload(payload_len) else HEADER_SIZE


KEY_DIGEST = xxhash.xxh3_128_digest  # key_digest itself, for hot loops that skip the Python call


def key_digest(key: bytes) -> bytes:
    """16-byte digest that identifies a key in headers and the catalog."""
    return KEY_DIGEST(key)


PAYLOAD_CHECKSUM = xxhash.xxh3_64_intdigest  # payload_checksum itself, for hot loops


def payload_checksum(payload) -> int:
    return PAYLOAD_CHECKSUM(payload)
