"""Prefix reuse: chained block keys over token ids, and the self-describing block payload.

The tiers that hold the blocks are in :mod:`kvswarm.tiers`; the transformers adapter that
turns blocks back into a model's KV cache is :mod:`kvswarm.integrations.transformers_prefix`.
"""

from kvswarm.prefix.block import HEADER_BYTES, BlockHeader, block_key, header_bytes, matches, new_block, read_header
from kvswarm.prefix.keys import KEY_BYTES, PrefixKeyer, longest_prefix, namespace

__all__ = ["HEADER_BYTES", "KEY_BYTES", "BlockHeader", "PrefixKeyer", "block_key", "header_bytes",
           "longest_prefix", "matches", "namespace", "new_block", "read_header"]
