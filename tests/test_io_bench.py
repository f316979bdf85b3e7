"""`kvswarm bench io` end to end, on small data: it runs both sides and writes every summary figure."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from kvswarm.bench import io_bench
from kvswarm.drive import DATA_FILE
from kvswarm.store import KVStore, StoreConfig
from kvswarm.testbed import kernel_support

SIZES = ("4k", "16k", "64k", "1m")


def main(argv: list[str]) -> int:
    """``kvswarm bench io ARGS`` (the module's own parser, as the CLI builds it)."""
    assert argv[:2] == ["bench", "io"]
    p = argparse.ArgumentParser()
    io_bench.add_arguments(p)
    return io_bench.run(p.parse_args(argv[2:]))


def _run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "io.json"
    rc = main(["bench", "io", "--quick", "--data-mib", "8", "--seconds", "0.1", "--reopen", "2k",
               "--backends", "threads", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_io_quick_writes_all_summary_keys(tmp_path):
    pytest.importorskip("uring_api")
    out = tmp_path / "io.json"
    assert main(["bench", "io", "--quick", "--data-mib", "8", "--seconds", "0.1", "--reopen", "2k",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    for name in SIZES:
        for key in ("ratio", "raw_gbps", "raw_iops", "raw_cpu_s_per_gb", "store_gbps", "store_iops",
                    "store_cpu_s_per_gb", "raw_write_gbps", "store_write_gbps", "write_ratio",
                    "store_threads_gbps", "store_uring_gbps", "store_native_gbps", "cpu_ratio",
                    "cpu_ratio_native", "native_vs_python"):
            v = s[f"{key}_{name}"]
            assert isinstance(v, float) and v > 0, (key, name, v)
        assert s[f"ratio_of_medians_{name}"] == pytest.approx(s[f"store_gbps_{name}"] / s[f"raw_gbps_{name}"])
        # The headline ratio pairs each round's store sample with that round's raw sample.
        size = res["sizes"][name]
        best = size["store_best_backend"]
        raw_m = max(size["raw_samples"], key=lambda m: sorted(x["gbps"] for x in size["raw_samples"][m])[
            len(size["raw_samples"][m]) // 2])
        rounds = len(size["store_samples"][best])  # raw samples: each backend's rounds in turn
        first = list(size["store_samples"]).index(best) * rounds
        raw_rounds = size["raw_samples"][raw_m][first:first + rounds]
        per_round = [st["gbps"] / rw["gbps"] for st, rw in zip(size["store_samples"][best], raw_rounds)]
        assert min(per_round) <= s[f"ratio_{name}"] <= max(per_round)
        # Each read path's shape is the store's own (KVStore.read_shape), not tuned by the bench.
        depth, drives = res["config"]["store_queue_depth_per_drive"], res["drives"]["drives"]
        for b, (batch, inflight) in size["store_shape"].items():
            assert size["store_samples"][b][0]["method"] == f"submit_get {batch} keys x {inflight} in flight"
            # Twice every drive's depth outstanding, unless half the bench's 512 MiB pool bounds it.
            assert 4 <= batch <= 256 and (batch * inflight >= 2 * drives * depth
                                          or (inflight + 1) * batch * size["extent_bytes"] > 256 << 20)
        assert s[f"cpu_ratio_{name}"] == pytest.approx(s[f"store_cpu_s_per_gb_{name}"] / s[f"raw_cpu_s_per_gb_{name}"])
        assert s[f"native_vs_python_{name}"] == pytest.approx(s[f"store_native_gbps_{name}"] / max(
            s[f"store_threads_gbps_{name}"], s[f"store_uring_gbps_{name}"]))
    for key in ("reopen_s_2k", "replay_s_2k", "reopen_cpu_s_2k", "follow_refresh_s_2k", "follow_reload_s_2k"):
        assert s[key] > 0
    assert res["drives"]["emulation"] == "none"
    assert res["config"]["precondition_s"] > 0
    # Both sides write the same number of objects over the same blocks.
    for name, region in res["config"]["write_regions"].items():
        assert region["raw"] == region["store"], name
    for name in SIZES:  # as many write samples per side (one per raw method), each side's best counts
        size = res["sizes"][name]
        assert len(size["store_write_samples"]) == len(size["raw_write_samples"]) == 3
        assert size["store_write"]["gbps"] == max(x["gbps"] for x in size["store_write_samples"])
        assert size["raw_write"]["gbps"] == max(x["gbps"] for x in size["raw_write_samples"])
    assert res["sizes"]["4k"]["payload_bytes"] == 4096 - 64
    assert (tmp_path / "io.png").stat().st_size > 0


def test_bench_io_on_a_testbed(tmp_path):
    mode = "kernel" if kernel_support() is None else "user-space"
    res = _run(tmp_path, "--sizes", "64k", "--drives", "2", "--cap-mbps", "200", "--cap-iops", "4000",
               "--emulation", mode)
    assert res["drives"]["emulation"] == mode
    assert res["drives"]["caps"]["read_mbps"] == 200
    assert res["summary"]["ratio_64k"] > 0 and res["summary"]["store_write_gbps_64k"] > 0


def test_preconditioning_writes_every_data_block_and_keeps_the_store(tmp_path):
    """Every block of a new store's data region is written once; the superblock stays, so the store
    still opens and takes objects."""
    dirs = [tmp_path / f"d{i}" for i in range(2)]
    for d in dirs:
        d.mkdir()
    cfg = dict(drives=[str(d) for d in dirs], meta_dir=str(tmp_path / "meta"), capacity_per_drive=4 << 20)
    store = KVStore(StoreConfig(**cfg))
    fds = [os.open(d / DATA_FILE, os.O_RDWR | os.O_DIRECT) for d in dirs]
    try:
        assert io_bench.precondition(store, fds, chunk=1 << 20) > 0
    finally:
        for fd in fds:
            os.close(fd)
    for d, drive in zip(dirs, store.drives):
        data = (d / DATA_FILE).read_bytes()
        assert data[drive.data_start:].count(0) < len(data) // 100  # random bytes, not unwritten zeros
        assert len(data) == drive.capacity
    assert store.put(b"k", b"v" * 5000)
    store.close()
    with KVStore(StoreConfig(**cfg)) as again:
        assert again.get(b"k") == b"v" * 5000
