"""Tests that need vLLM run inside .venv-vllm (scripts/setup-vllm.sh); the main venv skips this folder.

tests/test_vllm_engine.py runs them from the main test suite.
"""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama (tiny_model.py), built once for the engine tests."""
    from tiny_model import build

    return build(str(tmp_path_factory.mktemp("tiny-llama")))
