"""kill -9 of a writer at random moments and at each named step, and power cuts: every flushed
write survives (exact bytes), later ones are there exact or not at all."""

from faultcheck import assert_clean

from kvswarm.faults.campaign import run_crashes
from kvswarm.faults.crash import crash_series
from kvswarm.faults.loopfs import LoopFS


def test_kill_at_random_and_named_steps(tmp_path, sandbox, tally, rng):
    run_crashes(str(tmp_path), sandbox, tally, 5, rng)  # random, put, delete, flush, checkpoint
    assert_clean(tally)
    assert set(tally.injections) == {f"crash:{p}" for p in ("random", "put", "delete", "flush", "checkpoint")}
    assert tally.counts["exact_reads"] > 0


def test_power_cut_keeps_what_flush_and_checkpoint_made_durable(tmp_path, sandbox, tally, rng):
    """The file system shut down without its log flushed right after a checkpoint returned (and at
    other moments): the checkpoint and the journal it started must be on disk whole."""
    with LoopFS(str(tmp_path / "fs"), size_mib=96) as fs:
        crash_series(fs.mnt, sandbox, tally, 4, rng, points=("checkpointed", None, "checkpointed", "flush"),
                     power_cut=fs.power_cut, label="power_cut")
    assert_clean(tally, clear_errors=0)
    assert sum(tally.injections.values()) == 4 and tally.counts["exact_reads"] > 0
