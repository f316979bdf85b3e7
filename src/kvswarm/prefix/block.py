"""Prefix block payload: a 64-byte self-describing header, then the block's KV bytes.

The store already checksums every extent; this header makes a block *self-identifying*:
a reader checks that it holds the key, namespace (model/layout/tenant) and size it asked
for, so a hash collision or a block written for another layout is a miss, never wrong KV.
The key in the header also lets a block be moved between pools (demotion, write-back)
by whoever holds only its bytes, e.g. after a restart, when only key digests are known.

Layout (little-endian): magic ``KVPB`` | version u16 | flags u16 | key 16s | namespace 16s |
tokens u32 | block index u32 | KV bytes u64 | reserved 8 bytes.  The KV bytes that follow
are laid out by their producer (the transformers integration: per layer, K then V, each
``[kv_heads, tokens, head_dim]``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"KVPB"
VERSION = 1
_HDR = struct.Struct("<4sHH16s16sIIQ8x")
HEADER_BYTES = _HDR.size
assert HEADER_BYTES == 64


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: bytes
    namespace: bytes
    tokens: int
    index: int
    kv_bytes: int


def pack_header(buf, h: BlockHeader) -> None:
    """Write ``h`` into the first 64 bytes of ``buf``."""
    _HDR.pack_into(buf, 0, MAGIC, VERSION, 0, h.key, h.namespace, h.tokens, h.index, h.kv_bytes)


def header_bytes(h: BlockHeader) -> bytes:
    buf = bytearray(HEADER_BYTES)
    pack_header(buf, h)
    return bytes(buf)


def new_block(key: bytes, namespace: bytes, tokens: int, index: int, kv_bytes: int) -> tuple[bytearray, memoryview]:
    """A payload buffer with its header written, and a view of its KV part for the caller to fill."""
    buf = bytearray(HEADER_BYTES + kv_bytes)
    pack_header(buf, BlockHeader(key, namespace, tokens, index, kv_bytes))
    return buf, memoryview(buf)[HEADER_BYTES:]


def read_header(view) -> BlockHeader | None:
    """The header of a block payload, or None when it is not one."""
    if len(view) < HEADER_BYTES:
        return None
    magic, version, _flags, key, ns, tokens, index, kv = _HDR.unpack_from(view)
    if magic != MAGIC or version != VERSION or len(view) != HEADER_BYTES + kv:
        return None
    return BlockHeader(key, ns, tokens, index, kv)


def block_key(view) -> bytes | None:
    h = read_header(view)
    return h.key if h else None


def matches(view, key: bytes, namespace: bytes | None = None, kv_bytes: int | None = None) -> bool:
    """Does ``view`` hold the block ``key`` (of ``namespace`` and ``kv_bytes`` KV bytes, when given)?"""
    h = read_header(view)
    return (h is not None and h.key == key and (namespace is None or h.namespace == namespace)
            and (kv_bytes is None or h.kv_bytes == kv_bytes))
