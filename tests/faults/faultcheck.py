"""Assertions of the fault suite."""

from __future__ import annotations

from kvswarm.faults.outcome import MUST_BE_ZERO, Tally


def assert_clean(t: Tally, **extra_zero: int) -> None:
    """The five must-be-zero counters (and any named others) are 0; the examples say why not."""
    s = t.summary()
    bad = {k: s.get(k, 0) for k in (*MUST_BE_ZERO, *extra_zero) if s.get(k, 0)}
    assert not bad, (bad, t.examples)
