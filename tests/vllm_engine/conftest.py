"""Tests that need vLLM run inside .venv-vllm (scripts/setup-vllm.sh); the main venv skips this folder.

tests/test_vllm_engine.py runs them from the main test suite.
"""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]
