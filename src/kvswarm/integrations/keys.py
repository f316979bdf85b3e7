"""Store keys for engine blocks.

A key is ``namespace | layout fingerprint | tenant salt | engine block id``: the
fingerprint (:meth:`KVLayout.fingerprint`, 16 B) keeps a block of one model or
layout from ever being read as another's, the salt keeps tenants apart, and the
engine's own block id (vLLM's block hash + group, SGLang's page hash) is content
derived, so a restarted engine finds what an earlier process wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import xxhash

from kvswarm.layout import KVLayout


def tenant_salt(tenant: str | None) -> bytes:
    """16-byte salt of a tenant name; the empty/None tenant has a salt too."""
    return xxhash.xxh3_128_digest(b"kvswarm-tenant:" + (tenant or "").encode())


@dataclass(frozen=True)
class KeySpace:
    namespace: bytes
    fingerprint: bytes
    salt: bytes

    @classmethod
    def of(cls, namespace: str, layout: KVLayout, tenant: str | None = None) -> KeySpace:
        return cls(namespace.encode(), layout.fingerprint(), tenant_salt(tenant))

    @cached_property
    def prefix(self) -> bytes:
        return self.namespace + b"\0" + self.fingerprint + self.salt

    def key(self, block_id: bytes | str) -> bytes:
        if isinstance(block_id, str):
            block_id = block_id.encode()
        return self.prefix + block_id


# KVLayout dtype names for the dtype strings engines report.
_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
           "bfloat16": "bfloat16", "int8": "int8", "uint8": "int8"}


def layout_dtype(name: str) -> str:
    """KVLayout dtype for an engine dtype string (fp8 variants map to float8)."""
    name = name.removeprefix("torch.").lower()
    if name.startswith(("float8", "fp8")):
        return "float8"
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"KV dtype {name!r} has no KVLayout equivalent") from None
