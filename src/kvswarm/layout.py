"""KV layout: the one place that knows how many bytes a token's K/V takes."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import xxhash

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's KV cache.

    An *entry* is one token's K and V in one layer (all KV heads); a *block* is
    ``tokens_per_block`` consecutive tokens' entries in every layer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    tokens_per_block: int = 16
    model_id: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(_DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def entry_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V over all layers."""
        return self.entry_bytes * self.num_layers

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.tokens_per_block

    def fingerprint(self) -> bytes:
        """Stable 16-byte digest of model id and layout; part of every stored key."""
        text = ";".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return xxhash.xxh3_128_digest(text.encode())

    def numpy_dtype(self) -> np.dtype:
        # bfloat16 has no numpy dtype: its raw bytes travel as uint16.
        return np.dtype({"float32": "f4", "float16": "f2", "bfloat16": "u2", "float8": "u1", "int8": "i1"}[self.dtype])
