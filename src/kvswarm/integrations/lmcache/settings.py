"""The plugin's settings, read from LMCache's ``extra_config`` (YAML or ``LMCACHE_EXTRA_CONFIG``).

Every key sits under ``storage_plugin.kvswarm.``, beside the ``module_path`` / ``class_name``
keys LMCache's plugin launcher reads for the plugin named ``kvswarm``.  No LMCache import here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvswarm.codec import Compression

PREFIX = "storage_plugin.kvswarm."
GiB, MiB = 1 << 30, 1 << 20


def _drives(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    return tuple(p.strip() for p in value or () if p and p.strip())


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@dataclass(frozen=True)
class PluginSettings:
    drives: tuple[str, ...]  # one directory per drive; the store is striped over all of them
    tenant: str = ""  # salts every key: tenants sharing drives never read each other's chunks
    durable: bool = True  # a chunk is reported stored (LMCache's callback) only once flushed
    capacity_per_drive: int = 64 * GiB  # the store's data file on each drive
    io_backend: str = "auto"  # "threads", "uring" or "auto"
    queue_depth: int = 32  # per drive
    buffer_pool_bytes: int = 256 * MiB  # the store's aligned staging buffers (writes, unaligned reads)
    close_timeout: float = 10.0  # close() returns within this many seconds, whatever the drives do
    compression: Compression = Compression.NONE  # ZSTD: chunks stored as Blosc2 frames (kvswarm.codec), for drive-bound tiers

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> PluginSettings:
        """Settings from ``extra_config``; ``drives`` falls back to ``KVSWARM_DRIVES`` (comma-separated)."""
        extra = extra or {}

        def get(name: str, default: Any = None) -> Any:
            return extra.get(PREFIX + name, default)

        drives = _drives(get("drives")) or _drives(os.environ.get("KVSWARM_DRIVES", ""))
        if not drives:
            raise ValueError(f"kvswarm LMCache plugin: set '{PREFIX}drives' in extra_config (or KVSWARM_DRIVES)")
        s = cls(drives=drives, tenant=str(get("tenant", "")), durable=_flag(get("durable", True)),
                capacity_per_drive=int(get("capacity_per_drive", cls.capacity_per_drive)),
                io_backend=str(get("io_backend", cls.io_backend)),
                queue_depth=int(get("queue_depth", cls.queue_depth)),
                buffer_pool_bytes=int(get("buffer_pool_bytes", cls.buffer_pool_bytes)),
                close_timeout=float(get("close_timeout", cls.close_timeout)),
                compression=Compression.parse(get("compression", cls.compression.value)))
        for name in ("capacity_per_drive", "queue_depth", "buffer_pool_bytes", "close_timeout"):
            if getattr(s, name) <= 0:
                raise ValueError(f"kvswarm LMCache plugin: {PREFIX}{name} must be positive, not {getattr(s, name)}")
        return s
