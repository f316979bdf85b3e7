"""kvswarm as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``); see docs/integrations.md."""

from kvswarm.integrations.sglang.backend import KVSwarmHiCacheStorage

__all__ = ["KVSwarmHiCacheStorage"]
