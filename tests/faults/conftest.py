"""Fixtures of the fault suite: a sandbox worker (calls with a time bound), a tally, a seeded rng."""

from __future__ import annotations

import random

import pytest

from kvswarm.faults.loopfs import support
from kvswarm.faults.outcome import Tally
from kvswarm.faults.sandbox import Sandbox


@pytest.fixture(scope="session")
def sandbox():
    with Sandbox() as sb:
        yield sb


@pytest.fixture
def rng():
    return random.Random(7)


@pytest.fixture
def tally():
    t = Tally()
    yield t


@pytest.fixture(scope="session", autouse=True)
def _loop_support():
    why = support()
    assert why is None, f"the fault suite needs loop-mounted file systems (root): {why}"
