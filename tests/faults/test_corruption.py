"""Every kind of damage to data, headers, superblocks, data files, checkpoint, journal and manifest:
exact bytes, a counted miss, or a clear kvswarm error that leaves the store as it was."""

from faultcheck import assert_clean

from kvswarm.faults import corrupt
from kvswarm.faults.campaign import run_corruptions


def test_each_kind_of_corruption(tmp_path, sandbox, tally, rng):
    run_corruptions(str(tmp_path), sandbox, tally, len(corrupt.KINDS), rng)
    assert_clean(tally, refused_changed=0, fd_leaks=0)
    assert {k.split(":")[1] for k in tally.injections} == set(corrupt.KINDS)
    assert tally.counts["counted_misses"] > 0 and tally.counts["clear_errors"] > 0


def test_extents_found_by_their_headers(tmp_path):
    from kvswarm import KVStore

    drives = [str(tmp_path / "a"), str(tmp_path / "b")]
    for p in drives:
        (tmp_path / p).mkdir()
    with KVStore.open(drives, capacity_per_drive=1 << 20, stripe_unit=16384) as s:
        s.put_many([(b"k%d" % i, bytes(5000 + i)) for i in range(10)])
        s.put(b"big", bytes(40_000))  # 3 parts
    found = corrupt.extents(corrupt.Layout(drives, drives[0]))
    assert len(found) == 13

