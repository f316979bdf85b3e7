"""kvswarm as LMCache's disk tier: a storage plugin loaded by LMCache's plugin launcher (see docs/lmcache.md).

``storage_plugins: ["kvswarm"]`` with ``storage_plugin.kvswarm.module_path: kvswarm.integrations.lmcache``
and ``storage_plugin.kvswarm.class_name: KVSwarmLMCacheBackend`` in ``extra_config``.
"""

from kvswarm.integrations.lmcache.backend import CLASS_NAME, MODULE_PATH, KVSwarmLMCacheBackend

__all__ = ["CLASS_NAME", "MODULE_PATH", "KVSwarmLMCacheBackend"]
