"""On-disk extent format (see docs/format.md).

An extent is one 4 KiB-aligned run on a drive: a 64-byte header, then the payload,
then zero padding up to the next 4 KiB boundary.  The header is self-describing so
that a read can be verified without trusting the catalog.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

ALIGN = 4096
HEADER_SIZE = 64
MAGIC = 0x4B565357  # "KVSW"
VERSION = 1

# magic u32, version u16, flags u16, key digest 16s, payload length u32, part u16,
# parts u16, generation u64, payload xxh3-64 u64, reserved 8s | header xxh32 (of bytes 0-55) u32, pad 4s
HEADER_BODY = struct.Struct("<IHH16sIHHQQ8s")  # the part the header checksum covers
HEADER_TAIL = struct.Struct("<I4x")
_HEADER = struct.Struct("<IHH16sIHHQQ8sI4x")
assert HEADER_BODY.size + HEADER_TAIL.size == _HEADER.size == HEADER_SIZE
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


def max_payload(extent_bytes: int) -> int:
    """Largest payload that fits an extent of ``extent_bytes`` (a multiple of 4 KiB)."""
    return extent_bytes - HEADER_SIZE


KEY_DIGEST = xxhash.xxh3_128_digest  # key_digest itself, for hot loops that skip the Python call


def key_digest(key: bytes) -> bytes:
    """16-byte digest that identifies a key in headers and the catalog."""
    return KEY_DIGEST(key)


PAYLOAD_CHECKSUM = xxhash.xxh3_64_intdigest  # payload_checksum itself, for hot loops


def payload_checksum(payload) -> int:
    return PAYLOAD_CHECKSUM(payload)


@dataclass(frozen=True, slots=True)
class ExtentHeader:
    digest: bytes
    payload_len: int
    part: int
    parts: int
    generation: int
    checksum: int


def header_bytes(digest: bytes, payload_len: int, part: int, parts: int, generation: int, checksum: int,
                 _body=HEADER_BODY.pack, _tail=HEADER_TAIL.pack, _h32=xxhash.xxh32_intdigest) -> bytes:
    """The exact 64 header bytes of an extent (the read path compares them byte for byte)."""
    body = _body(MAGIC, VERSION, 0, digest, payload_len, part, parts, generation, checksum, RESERVED)
    return body + _tail(_h32(body))


def pack_header(buf, h: ExtentHeader) -> None:
    """Write ``h`` into the first 64 bytes of ``buf``."""
    buf[:HEADER_SIZE] = header_bytes(h.digest, h.payload_len, h.part, h.parts, h.generation, h.checksum)


def unpack_header(buf) -> ExtentHeader | None:
    """Parse and self-check a header; ``None`` when it is not a valid kvswarm header."""
    raw = bytes(buf[:HEADER_SIZE])
    magic, version, _flags, digest, plen, part, parts, gen, csum, _res, hcrc = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or xxhash.xxh32_intdigest(raw[:HEADER_BODY.size]) != hcrc:
        return None
    return ExtentHeader(digest, plen, part, parts, gen, csum)
