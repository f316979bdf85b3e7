"""Runs the vLLM tests (tests/vllm_engine/) inside .venv-vllm, where vLLM is installed.

vLLM pins its own torch/transformers, so it lives in a separate venv made by
scripts/setup-vllm.sh; this test makes its suite part of the normal pytest run.
Without the venv it skips (fails under CI=true, where setup-vllm.sh must have run).
"""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")


def run_suite(folder: str) -> None:
    if not os.path.exists(VENV_PY):
        if os.environ.get("CI") == "true":
            pytest.fail("CI: .venv-vllm missing; .ci/run must run scripts/setup-vllm.sh first")
        pytest.skip("no .venv-vllm: run scripts/setup-vllm.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.run([VENV_PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
                           os.path.join("tests", folder)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1]


def test_vllm_suite_in_vllm_venv() -> None:
    run_suite("vllm_engine")
