"""The vLLM integration suite (tests/vllm_engine/: the tier through vLLM's interfaces, the
worker, and the real vLLM CPU engine), run inside .venv-vllm as part of the normal test run."""

from engine_venv import run_suite


def test_vllm_suite_in_vllm_venv() -> None:
    run_suite("vllm_engine")
