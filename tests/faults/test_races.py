"""Threads writing, deleting and reading the same keys, and a follower beside its writer process:
every read is a whole version of its key or a miss."""

from faultcheck import assert_clean

from kvswarm.faults.campaign import run_races


def test_thread_and_follower_races(tmp_path, sandbox, tally):
    run_races(str(tmp_path), sandbox, tally, 2.0)
    assert_clean(tally)
    assert tally.counts["race_reads"] > 100
