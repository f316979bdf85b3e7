"""kvswarm inside vLLM: a secondary offloading tier and an offloading spec (see docs/integrations.md).

- ``KVSwarmOffloadingSpec`` (``spec_name`` + ``spec_module_path="kvswarm.integrations.vllm"``):
  vLLM's tiered offloading with kvswarm as the SSD tier and a worker for CPU and CUDA.
- ``KVSwarmTierManager`` (``{"type": "KVSwarmTierManager", "module_path":
  "kvswarm.integrations.vllm.tier", ...}`` in ``secondary_tiers``): the tier alone, under
  vLLM's own ``TieringOffloadingSpec`` on GPU servers.
"""

from kvswarm.integrations.vllm.spec import KVSwarmOffloadingSpec
from kvswarm.integrations.vllm.tier import KVSwarmTierManager

__all__ = ["KVSwarmOffloadingSpec", "KVSwarmTierManager"]
