"""The SGLang HiCache backend suite (tests/sglang_backend/, SGLang's real storage interfaces and
host pools), run inside .venv-vllm as part of the normal test run."""

from engine_venv import run_suite


def test_sglang_suite_in_vllm_venv() -> None:
    run_suite("sglang_backend")
