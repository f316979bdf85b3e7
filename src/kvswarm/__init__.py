"""kvswarm: many drives as one fast, persistent KV-cache tier."""

from kvswarm.errors import (
    CorruptExtent,
    DriveError,
    DriveFull,
    FlushError,
    KVSwarmError,
    LayoutMismatch,
    UnalignedBuffer,
)
from kvswarm.layout import KVLayout
from kvswarm.store import KVStore, StoreConfig

__all__ = [
    "CorruptExtent",
    "DriveError",
    "DriveFull",
    "FlushError",
    "KVLayout",
    "KVStore",
    "KVSwarmError",
    "LayoutMismatch",
    "StoreConfig",
    "UnalignedBuffer",
]
