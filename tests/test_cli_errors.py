"""Every bad invocation of the CLI: one line on stderr, a non-zero exit, no traceback (each in its
own process, as an operator would run it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvswarm import KVStore
from kvswarm.faults.sandbox import child_env


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    drives = [str(root / "d0"), str(root / "d1")]
    for p in drives:
        os.makedirs(p)
    with KVStore.open(drives, capacity_per_drive=1 << 20, buffer_pool_bytes=4 << 20) as s:
        s.put(b"k", b"v")
    (root / "empty").mkdir()
    (root / "file").write_text("x")
    return {"d0": drives[0], "d1": drives[1], "empty": str(root / "empty"), "file": str(root / "file"),
            "nowhere": str(root / "nowhere")}


CASES = [
    ["stats", "{nowhere}"],
    ["stats", "{empty}"],
    ["stats", "{file}"],
    ["stats", "--meta-dir", "{nowhere}", "{d0}", "{d1}"],
    ["stats", "{d1}", "{d0}"],  # reordered
    ["stats", "--scrub", "-5", "{d0}", "{d1}"],
    ["bench", "io", "--sizes", "abc"],
    ["bench", "io", "--sizes", "0"],
    ["bench", "io", "--dir", "{nowhere}"],
    ["bench", "io", "--reopen", "lots"],
    ["bench", "io", "--rounds", "-1"],
    ["bench", "io", "--dirs", "0"],
    ["plan", "--model", "nosuch"],
    ["plan", "--budget", "-5"],
    ["bench", "faults", "--crashes", "-1"],
    ["fsck", "{nowhere}"],
    ["fsck", "{file}"],
]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c) for c in CASES])
def test_bad_invocation_is_one_line(paths, argv):
    args = [a.format(**paths) for a in argv]
    p = subprocess.run([sys.executable, "-m", "kvswarm.cli", *args], capture_output=True, text=True,
                       env=child_env(), timeout=120)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "error" in p.stderr
    assert p.stdout == ""


def test_regular_file_is_named_not_called_a_block_device(paths):
    from kvswarm.faults.inputs import run_cli

    rc, err, tb = run_cli(["stats", paths["file"]])
    assert (rc, tb) == (2, False) and "neither a directory nor a block device" in err


def test_dirs_help_says_it_is_a_count(capsys):
    from kvswarm.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "io", "--help"])
    assert "how many temp drive directories" in " ".join(capsys.readouterr().out.split())
