"""Run a test folder inside .venv-vllm (vLLM and SGLang pin their own torch/transformers there).

scripts/setup-vllm.sh makes the venv; without it the calling test skips, except under
CI=true, where .ci/run must have made it.
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
                          timeout=2400)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last and "deselected" not in last, last
