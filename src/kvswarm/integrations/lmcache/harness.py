"""LMCache's own objects, set up the way its cache engine sets them up for a worker, for the tests
and ``kvswarm bench lmcache``: an engine config with kvswarm as a storage plugin (or LMCache's local
disk back end), a worker's metadata for a model's KV geometry, chunk keys from LMCache's token
database, and chunks allocated from LMCache's CPU allocator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.token_database import ChunkedTokenDatabase

from kvswarm.integrations.lmcache.backend import CLASS_NAME, MODULE_PATH
from kvswarm.integrations.lmcache.settings import PREFIX


@dataclass(frozen=True)
class Geometry:
    """A model's KV cache as LMCache's vLLM connector describes it (``kv_shape``)."""

    name: str
    tag: str  # in benchmark keys
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def chunk_bytes(self, tokens: int) -> int:
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * self.dtype.itemsize


SMOLLM2 = Geometry("SmolLM2-135M-Instruct", "smollm2", 30, 3, 64)
LLAMA3_8B = Geometry("Meta-Llama-3-8B-Instruct", "llama3_8b", 32, 8, 128)


def metadata(geo: Geometry, chunk_size: int = 256, worker_id: int = 0, world_size: int = 1) -> LMCacheMetadata:
    return LMCacheMetadata(model_name=geo.name, world_size=world_size, local_world_size=world_size,
                           worker_id=worker_id, local_worker_id=worker_id, kv_dtype=geo.dtype,
                           kv_shape=(geo.layers, 2, chunk_size, geo.kv_heads, geo.head_dim), chunk_size=chunk_size)


def kvswarm_config(drives: Sequence[str], chunk_size: int = 256, cpu_gb: float = 0.5, local_cpu: bool = True,
                   **plugin: Any) -> LMCacheEngineConfig:
    """LMCache's config with kvswarm loaded as the storage plugin ``kvswarm`` (``plugin``: its settings,
    e.g. ``capacity_per_drive``, ``durable``)."""
    extra = {f"{PREFIX}module_path": MODULE_PATH, f"{PREFIX}class_name": CLASS_NAME, f"{PREFIX}drives": list(drives)}
    extra.update({PREFIX + k: v for k, v in plugin.items()})
    return LMCacheEngineConfig.from_defaults(chunk_size=chunk_size, local_cpu=local_cpu, max_local_cpu_size=cpu_gb,
                                             storage_plugins=["kvswarm"], extra_config=extra)


def local_disk_config(path: str, chunk_size: int = 256, cpu_gb: float = 0.5, disk_gb: float = 64.0,
                      local_cpu: bool = True, **extra: Any) -> LMCacheEngineConfig:
    """LMCache's config with its own local disk back end at ``path`` (``extra``: e.g. ``use_odirect``)."""
    return LMCacheEngineConfig.from_defaults(chunk_size=chunk_size, local_cpu=local_cpu, max_local_cpu_size=cpu_gb,
                                             local_disk=path, max_local_disk_size=disk_gb,
                                             extra_config=dict(extra) or None)


def chunk_keys(config: LMCacheEngineConfig, meta: LMCacheMetadata, tokens: Sequence[int]) -> list:
    """LMCache's keys of the whole chunks of ``tokens`` (its prefix-chained chunk hashes)."""
    db = ChunkedTokenDatabase(config, meta)
    out = [key for start, end, key in db.process_tokens(tokens=torch.tensor(list(tokens), dtype=torch.long))
           if end - start == meta.chunk_size]
    return out


def text_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids from real English text (Python's own pydoc topics, one byte a token), from an
    offset that ``seed`` picks: requests that share no prefix."""
    from pydoc_data.topics import topics

    text = "".join(topics.values()).encode()
    start = (seed * 7919 * 64) % max(1, len(text) - n)
    return list(text[start:start + n])


def chunk_bytes(index: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes of chunk ``index`` (what a test or benchmark stores and checks)."""
    return np.random.default_rng(index).integers(0, 256, nbytes, dtype=np.uint8)


def allocate_chunk(allocator: Any, meta: LMCacheMetadata, data: np.ndarray, tokens: int | None = None):
    """A memory object from LMCache's CPU allocator (as its cache engine allocates a chunk to store),
    filled with ``data``."""
    obj = allocator.allocate(meta.get_shapes(tokens or meta.chunk_size), meta.get_dtypes())
    if obj is None:
        raise MemoryError("LMCache's CPU allocator is full")
    np.frombuffer(obj.byte_array, np.uint8)[:] = data
    return obj


def obj_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(obj.byte_array, np.uint8)
