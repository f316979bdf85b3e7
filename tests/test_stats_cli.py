"""`kvswarm stats`: opens an existing store as a follower (it writes nothing, so it is safe on a live
store), scrubs it, reports corruption."""

import json
import os

from kvswarm import KVStore
from kvswarm.cli import main


def test_stats_scrub_reports_corruption(drive_dirs, capsys, overwrite):
    paths = drive_dirs(2)
    with KVStore.open(paths, capacity_per_drive=8 << 20) as s:
        s.put_many([(b"k%d" % i, os.urandom(6000)) for i in range(40)])
        off = s.catalog.get(next(iter(s.catalog.entries))).extents[0]
    overwrite(paths[off[0]], off[1] + 200, b"\x00\xff" * 8)
    before = {(p, f): os.stat(os.path.join(p, f)).st_mtime_ns for p in paths for f in os.listdir(p)}
    assert main(["stats", *paths, "--scrub", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objects"] == 40
    assert out["scrub"] == {"verified": 40, "corrupt": 1, "seconds": out["scrub"]["seconds"]}
    assert sum(d["misses"] for d in out["drives"]) == 1
    assert all(0 < d["free_bytes"] < d["capacity"] for d in out["drives"])
    assert before == {(p, f): os.stat(os.path.join(p, f)).st_mtime_ns for p in paths for f in os.listdir(p)}
    assert main(["stats", *paths, "--prometheus"]) == 0
    assert "kvswarm_drive_ops_total" in capsys.readouterr().out
