"""Decoding from KV offloaded to the drives: pages, sequences, the transformers Cache, the loop."""

from kvswarm.entry_source import EntrySource, Fetched, Geometry, KVMissing
from kvswarm.offload.attention import kvswarm_attention
from kvswarm.offload.cache import OffloadedKVCache, StepObserver, StepStats
from kvswarm.offload.decode import DecodeResult, DriveMeter, Prefill, decode, make_recompute, prefill
from kvswarm.offload.grouping import ContiguousPages, Group, Grouping, PageTable, make_grouping
from kvswarm.offload.sequence import MemorySequence, StoreSequence, offload

__all__ = [
    "ContiguousPages", "DecodeResult", "DriveMeter", "EntrySource", "Fetched", "Geometry", "Group", "Grouping",
    "KVMissing", "MemorySequence", "OffloadedKVCache", "PageTable", "Prefill", "StepObserver", "StepStats",
    "StoreSequence", "decode", "kvswarm_attention", "make_grouping", "make_recompute", "offload", "prefill",
]
