"""Full file systems (data and metadata) and failing devices (EIO from a loop block device whose
backing file system was shut down; a directory drive whose file system fails while open)."""

from faultcheck import assert_clean

from kvswarm.faults.campaign import run_eio, run_enospc


def test_enospc(tmp_path, sandbox, tally, rng):
    run_enospc(str(tmp_path), sandbox, tally, 3, rng)
    assert_clean(tally, full_drive_failed=0, oversized_accepted=0)
    assert len(tally.injections) == 3 and tally.counts["exact_reads"] > 0


def test_eio(tmp_path, sandbox, tally, rng):
    run_eio(str(tmp_path), sandbox, tally, 3, rng)
    assert_clean(tally, fd_leaks=0)
    assert len(tally.injections) == 3
    assert tally.counts["counted_misses"] > 0 and tally.counts["exact_reads"] > 0
