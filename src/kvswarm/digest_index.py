"""The catalog's index, 16-byte key digest -> row: native where it was built, a dict otherwise.

Both kinds answer the same calls: ``get``, ``pop``, ``[]``, ``in``, ``len``, ``update`` with
``(digest, row)`` pairs, ``clear``, iteration over the digests, ``lookup(digests, out)``, which
writes each digest's row (-1: not held) into an int64 array, a batched read's whole batch in one
call, and ``lookup_keys(keys, out, digests)``, which also makes the keys' digests (16 bytes each,
into ``digests``) on the way.  The native table (``kvswarm._digest_index``,
native/digest_index.c) keeps each digest beside its row in one open-addressing array: a lookup
touches one slot instead of a dict's slot, entry, key object and int object, which is most of a
verified 4 KiB read's catalog time.
``KVSWARM_NATIVE_INDEX=0`` takes the dict.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kvswarm.format import KEY_DIGEST

try:
    from kvswarm._digest_index import DigestIndex as NativeDigestIndex
except ImportError:  # built without a C compiler
    NativeDigestIndex = None


class DictDigestIndex(dict):
    """The index as a dict (no compiler, or ``KVSWARM_NATIVE_INDEX=0``)."""

    def lookup(self, digests: Sequence[bytes], out: np.ndarray) -> None:
        get = self.get
        out[:] = [get(d, -1) for d in digests]

    def lookup_keys(self, keys: Sequence[bytes], out: np.ndarray, digests: np.ndarray) -> None:
        ds = [KEY_DIGEST(k) for k in keys]
        digests.view(np.uint8)[:] = np.frombuffer(b"".join(ds), np.uint8)
        self.lookup(ds, out)


def new_digest_index() -> NativeDigestIndex | DictDigestIndex:
    """An empty index of the kind this process uses."""
    if NativeDigestIndex is not None and os.environ.get("KVSWARM_NATIVE_INDEX", "1") != "0":
        return NativeDigestIndex()
    return DictDigestIndex()
