"""SGLang backend tests; they run inside .venv-vllm (scripts/setup-vllm.sh installs the sglang wheel
without its CUDA dependencies) and are skipped by the main venv; tests/test_sglang_backend.py runs them.
SGLang's modules are imported through :mod:`kvswarm.integrations.sglang_cpu` (no torchvision here);
everything the tests exercise (HiCacheStorage, the backend factory, the MHA host pools) is SGLang's
real code.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]
else:
    from kvswarm.integrations.sglang_cpu import allow_cpu_import

    allow_cpu_import()
