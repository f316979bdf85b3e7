"""kvswarm inside the real vLLM engine (CPU backend, tiny random Llama, block size 32).

One engine process per phase, as a user would run it: (1) write + same-process reuse
after vLLM's prefix cache and CPU tier are reset, (2) a fresh process reuses the
blocks, (3) corrupted block extents are misses and the output stays exact, (4) an
engine following another, live engine's store reads its blocks (prefill writes, decode reads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvswarm.drive import DATA_FILE
from kvswarm.format import payload_offset
from kvswarm.store import KVStore

HERE = os.path.dirname(__file__)
BLOCKS = 8  # full blocks in the prompt (engine_run.py)


def engine_command(model: str, drives: list[str], phase: str, out: str) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # each process its own str hash seed
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return [sys.executable, os.path.join(HERE, "engine_run.py"), "--model", model, "--drives", ",".join(drives),
            "--phase", phase, "--out", out], env


def run_engine(model: str, drives: list[str], phase: str, out: str, *extra: str) -> dict:
    cmd, env = engine_command(model, drives, phase, out)
    cmd += extra
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def written(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("kvswarm-drives")
    drives = [str(root / f"d{i}") for i in range(2)]
    for d in drives:
        os.makedirs(d)
    return drives, run_engine(model_dir, drives, "write", str(root / "write.json"))


def test_same_process_reuse_after_prefix_cache_reset(written):
    _, r = written
    assert r["first"]["cached_tokens"] == 0
    assert r["objects_after_write"] == BLOCKS  # one object per full block, prompt only
    assert r["second_store_hits"] == BLOCKS  # served by kvswarm, not vLLM's caches
    assert r["second"]["cached_tokens"] == BLOCKS * 32
    assert r["second"]["tokens"] == r["first"]["tokens"]
    assert r["second"]["logprobs"] == r["first"]["logprobs"]


def test_fresh_process_reuses_persisted_blocks(written, model_dir, tmp_path):
    drives, w = written
    r = run_engine(model_dir, drives, "read", str(tmp_path / "read.json"))
    assert r["objects_before"] == BLOCKS
    assert r["counters"]["hits"] == BLOCKS and r["counters"]["corrupt"] == 0
    assert r["first"]["cached_tokens"] == BLOCKS * 32
    assert r["first"]["logprobs"] == w["first"]["logprobs"]
    assert r["objects_after"] == BLOCKS  # nothing rewritten


@pytest.mark.parametrize("huge_first", [False, True], ids=["copied", "in_place"])
def test_corrupted_blocks_are_misses_and_output_stays_exact(written, model_dir, tmp_path, huge_first):
    """Loads copied through the pool (the first ones, before vLLM's region is in 2 MiB pages), and loads
    read straight into vLLM's chunks (once it is): a corrupt block is a miss either way, never wrong KV."""
    drives, w = written
    with KVStore.open(drives, create=False) as store:
        entries = [e for _, e in sorted(store.catalog.entries.items())][:3]
    for e in entries:  # flip one payload byte of three blocks' extents
        drv, off, _, _ = e.extents[0]
        at = off + payload_offset(e.payload_len) + 100
        with open(os.path.join(drives[drv], DATA_FILE), "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
    r = run_engine(model_dir, drives, "read", str(tmp_path / "corrupt.json"), *(["--huge-first"] if huge_first else []))
    if huge_first and not r["in_place_at_start"]:
        pytest.skip("this kernel does not collapse shared memory into huge pages (MADV_COLLAPSE)")
    assert r["in_place_at_start"] == huge_first  # without it the first loads copy, while the region is collapsed
    # The scheduler looks blocks up in prefix order and stops at the first miss; the manager promotes each
    # within its lookup, so the first bad block is read and the blocks after it are recomputed, not read.
    assert 1 <= r["counters"]["corrupt"] <= 3
    assert r["counters"]["hits"] <= BLOCKS - 1
    assert r["first"]["cached_tokens"] < BLOCKS * 32  # recomputed from the first bad block on
    assert r["first"]["tokens"] == w["first"]["tokens"]
    assert r["first"]["logprobs"] == w["first"]["logprobs"]
    assert r["objects_after"] == BLOCKS  # the bad blocks read were dropped and written again


def test_follower_engine_reads_a_live_writer_engines_blocks(model_dir, tmp_path, drive_dirs):
    drives = drive_dirs(2)
    ready, stop = str(tmp_path / "serve.json"), str(tmp_path / "stop")
    cmd, env = engine_command(model_dir, drives, "serve", ready)
    with open(tmp_path / "serve.log", "w") as log:
        writer = subprocess.Popen(cmd + ["--stop", stop], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 900
            while not os.path.exists(ready) and writer.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert os.path.exists(ready), (tmp_path / "serve.log").read_text()[-6000:]
            with open(ready) as f:
                w = json.load(f)
            assert w["objects_after_write"] == BLOCKS
            r = run_engine(model_dir, drives, "follow", str(tmp_path / "follow.json"))  # the writer still up
            assert r["objects_before"] == BLOCKS
            assert r["counters"]["hits"] == BLOCKS and r["counters"]["puts"] == 0
            assert r["first"]["cached_tokens"] == BLOCKS * 32
            assert r["first"]["logprobs"] == w["first"]["logprobs"]
        finally:
            open(stop, "w").close()
            writer.wait(timeout=300)
    assert writer.returncode == 0
