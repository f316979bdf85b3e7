"""Prefix block keys: a chained hash of token ids, namespaced by model, layout and tenant.

Block ``i`` of a prompt covers tokens ``[i*B, (i+1)*B)``; its key is

    key_0 = xxh3_128(namespace || tokens_0)
    key_i = xxh3_128(key_{i-1} || tokens_i)

so a key names the *whole prefix* up to the end of its block, and two prompts share
block ``i``'s key only if their first ``(i+1)*B`` tokens are equal.  The namespace is
``xxh3_128("kvswarm-prefix-v1" || KVLayout.fingerprint() || tenant salt)``: KV of
another model, layout, block size or tenant can never be found under these keys.
Token ids are hashed as little-endian int64 bytes and xxhash is seedless here, so keys
are the same in every process and after every restart (Python's ``hash()`` is not).

Only full blocks are keyed; the tail of a prompt shorter than a block is always
recomputed.  Traces that already carry prefix-chained block ids (Mooncake's
``hash_ids``) map them into the same namespace with :meth:`PrefixKeyer.external_keys`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvswarm.layout import KVLayout

VERSION = b"kvswarm-prefix-v1"
KEY_BYTES = 16


def namespace(layout: KVLayout, tenant: str | bytes | None = None) -> bytes:
    """16-byte namespace of a model/layout and tenant (None and "" are the same, shared tenant)."""
    salt = tenant.encode() if isinstance(tenant, str) else (tenant or b"")
    return xxhash.xxh3_128_digest(VERSION + layout.fingerprint() + len(salt).to_bytes(4, "little") + salt)


class PrefixKeyer:
    """Keys of a prompt's full blocks for one layout (``layout.tokens_per_block`` tokens each) and tenant."""

    def __init__(self, layout: KVLayout, tenant: str | bytes | None = None) -> None:
        self.layout = layout
        self.tenant = tenant
        self.block_tokens = layout.tokens_per_block
        self.namespace = namespace(layout, tenant)

    def num_blocks(self, n_tokens: int) -> int:
        return n_tokens // self.block_tokens

    def block_keys(self, token_ids: Sequence[int] | np.ndarray, max_blocks: int | None = None) -> list[bytes]:
        """One key per full block of ``token_ids`` (at most ``max_blocks``)."""
        ids = np.asarray(token_ids, dtype="<i8").ravel()
        n = self.num_blocks(len(ids)) if max_blocks is None else min(max_blocks, self.num_blocks(len(ids)))
        raw = ids[:n * self.block_tokens].tobytes()
        step = self.block_tokens * 8
        h = self.namespace
        out = []
        digest = xxhash.xxh3_128_digest
        for i in range(n):
            h = digest(h + raw[i * step:(i + 1) * step])
            out.append(h)
        return out

    def external_keys(self, block_ids: Sequence[int]) -> list[bytes]:
        """Keys for block ids that are already prefix-chained (e.g. a trace's hash ids)."""
        ns = self.namespace
        return [xxhash.xxh3_128_digest(ns + int(b).to_bytes(8, "little", signed=True)) for b in block_ids]


def longest_prefix(keys: Sequence[bytes], cached: Callable[[bytes], bool]) -> int:
    """Number of leading keys for which ``cached(key)`` holds (a later block is useless without
    every block before it, so the scan stops at the first miss)."""
    n = 0
    for k in keys:
        if not cached(k):
            break
        n += 1
    return n
