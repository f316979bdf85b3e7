"""The store: objects striped over a set of drives, verified on every read, durable on flush.

``config`` (StoreConfig), ``store`` (KVStore), ``handles`` (batches in flight and a read's outcome),
``verify`` (a read batch's verification), ``runs`` (an object's bytes as one buffer or runs of one),
``meta_dir`` (the manifest and the writer's lock), ``space`` (free space rebuilt from the catalog at
open), ``shape`` (how callers cut streams of reads and writes into batches), ``quarantine`` (batches
nobody will finish, held until their I/O is over).
"""

from kvswarm.store.config import StoreConfig
from kvswarm.store.handles import GetHandle, GetResult, NativeGetHandle, PutHandle
from kvswarm.store.meta_dir import MANIFEST, WRITER_LOCK, write_manifest
from kvswarm.store.runs import Bufs, Runs
from kvswarm.store.shape import BatchShape
from kvswarm.store.store import DriveHealth, KVStore
from kvswarm.store.verify import verify_submit

__all__ = ["MANIFEST", "WRITER_LOCK", "BatchShape", "Bufs", "DriveHealth", "GetHandle", "GetResult", "KVStore",
           "NativeGetHandle", "PutHandle", "Runs", "StoreConfig", "verify_submit", "write_manifest"]
