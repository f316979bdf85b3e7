"""Run a test folder inside a venv of its own: .venv-vllm (vLLM and SGLang pin their own
torch/transformers there) or .venv-lmcache (LMCache's pins).

scripts/setup-vllm.sh and scripts/setup-lmcache.sh make them; without one the calling test
skips, except under CI=true, where .ci/run must have made it.
"""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_suite(folder: str, venv: str = ".venv-vllm", setup: str = "scripts/setup-vllm.sh") -> None:
    venv_py = os.path.join(ROOT, venv, "bin", "python")
    if not os.path.exists(venv_py):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: {venv} missing; .ci/run must run {setup} first")
        pytest.skip(f"no {venv}: run {setup}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.run([venv_py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
                           os.path.join("tests", folder)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=2400)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last and "deselected" not in last, last
