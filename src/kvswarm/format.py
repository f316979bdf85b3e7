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
from typing import NamedTuple

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


# ---- the extent header codec: what the store writes, verifies against and recovery parses ----
class Header(NamedTuple):
    """An extent header's fields (the reserved bytes and the header checksum left out)."""

    flags: int
    digest: bytes  # the key's 16-byte digest
    payload_len: int  # the whole object's payload bytes
    part: int
    parts: int
    generation: int
    checksum: int  # this part's payload xxh3-64


_BODY_PACK, _TAIL_PACK, _H32 = HEADER_BODY.pack, HEADER_TAIL.pack, xxhash.xxh32_intdigest
HEADER_COLUMNS = np.arange(HEADER_BODY.size)  # byte columns of the part a batched read compares


def pack_header(digest: bytes, payload_len: int, part: int, parts: int, generation: int, checksum: int,
                sector: bool) -> bytes:
    """The 64 header bytes of one part (``sector``: its payload starts on the extent's second sector)."""
    h = _BODY_PACK(MAGIC, VERSION, FLAG_SECTOR_PAYLOAD if sector else 0, digest, payload_len, part, parts,
                   generation, checksum, RESERVED)
    return h + _TAIL_PACK(_H32(h))


def header_fields(buf, offset: int = 0) -> Header:
    """The fields of the header at ``buf[offset:]``, its checksum not checked (see :func:`parse_header`)."""
    _, _, flags, digest, plen, part, parts, gen, csum, _ = HEADER_BODY.unpack_from(buf, offset)
    return Header(flags, digest, plen, part, parts, gen, csum)


def parse_header(h) -> Header | None:
    """The fields of the 64-byte header ``h``; None unless its magic, version and checksum hold."""
    h = bytes(h[:HEADER_SIZE])
    if len(h) < HEADER_SIZE or _H32(h[:HEADER_BODY.size]) != HEADER_TAIL.unpack_from(h, HEADER_BODY.size)[0]:
        return None
    magic, version, flags, digest, plen, part, parts, gen, csum, _ = HEADER_BODY.unpack_from(h)
    if magic != MAGIC or version != VERSION:
        return None
    return Header(flags, digest, plen, part, parts, gen, csum)


def header_candidates(sectors: np.ndarray) -> np.ndarray:
    """Indexes of the rows of ``sectors`` (uint8, one 4 KiB sector a row) that begin with an extent
    header's magic and version: where a scan parses a header."""
    heads = sectors[:, :8].copy().view("<u4")
    return np.flatnonzero((heads[:, 0] == MAGIC) & ((heads[:, 1] & 0xFFFF) == VERSION))


def expected_headers(digest: np.ndarray, payload_len: np.ndarray, part: np.ndarray, parts: np.ndarray,
                     generation: np.ndarray, checksum: np.ndarray, sector: np.ndarray) -> np.ndarray:
    """The header bodies (checksum tail left out) a batch of extents must carry, one uint8 row of
    ``HEADER_BODY.size`` bytes each, built at once: a read compares them byte for byte.  Arguments are
    per extent; ``sector`` (:func:`sector_payload` of each part's own payload bytes) sets the flag."""
    want = np.zeros(len(part), HEADER_BODY_DTYPE)
    want["magic"], want["version"] = MAGIC, VERSION
    want["flags"] = sector * FLAG_SECTOR_PAYLOAD
    want["digest"], want["payload_len"], want["generation"] = digest, payload_len, generation
    want["part"], want["parts"], want["checksum"] = part, parts, checksum
    return want.view(np.uint8).reshape(len(part), HEADER_BODY.size)
