"""kvswarm inside vLLM: a secondary offloading tier and an offloading spec (see docs/integrations.md).

- ``KVSwarmOffloadingSpec`` (``spec_name`` + ``spec_module_path="kvswarm.integrations.vllm"``):
  vLLM's tiered offloading with kvswarm as the SSD tier and a worker for CPU and CUDA.
- ``KVSwarmTierManager`` (``{"type": "KVSwarmTierManager", "module_path":
  "kvswarm.integrations.vllm.tier", ...}`` in ``secondary_tiers``): the tier alone, under
  vLLM's own ``TieringOffloadingSpec`` on GPU servers.
- ``CPUTieringOffloadingSpec``: vLLM's tiered offloading with its own secondary tiers (``fs``)
  and kvswarm's worker, so they run on vLLM's CPU backend too.

Imported lazily, so the engine-free parts (``copier``) load without vLLM installed.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"KVSwarmOffloadingSpec": "kvswarm.integrations.vllm.spec",
            "CPUTieringOffloadingSpec": "kvswarm.integrations.vllm.spec",
            "KVSwarmTierManager": "kvswarm.integrations.vllm.tier"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
