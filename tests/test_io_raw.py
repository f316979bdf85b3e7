"""The raw baselines (kvswarm.io.raw): which tuning sample of a setting counts, and reads into buffers of
their own."""

import mmap
import os

import numpy as np
import pytest

from kvswarm.io.raw import run_threads, run_uring, tune_passes
from kvswarm.io import Op, uring_available


def _sampler(samples: dict[str, list[float]], order: list[str]):
    def sample(s: str) -> float:
        order.append(s)
        return samples[s].pop(0)
    return sample


def test_two_passes_keep_each_settings_better_sample_in_alternating_order():
    order: list[str] = []
    got = tune_passes(["a", "b", "c"], _sampler({"a": [1.0, 3.0], "b": [2.0, 1.0], "c": [1.5, 1.5]}, order))
    assert got == {"a": 3.0, "b": 2.0, "c": 1.5}
    assert order == ["a", "b", "c", "c", "b", "a"]  # the second pass runs backwards: drift favours neither end


def test_three_passes_keep_the_median_so_one_lucky_sample_does_not_pick():
    """"shallow" was lucky once; with the better of two passes it would win, and then run at its
    usual speed when it is measured again."""
    samples = {"shallow": [1.5, 2.4, 1.5], "deep": [1.9, 1.9, 1.8]}
    two = tune_passes(["shallow", "deep"], _sampler({k: v[:2] for k, v in samples.items()}, []))
    assert max(two, key=two.get) == "shallow"
    three = tune_passes(["shallow", "deep"], _sampler(samples, []), passes=3)
    assert three == {"shallow": 1.5, "deep": 1.9}


@pytest.mark.parametrize("engine", ["threads", "uring"])
def test_reads_into_buffers_of_their_own_land_each_io_where_it_is_asked(tmp_path, engine):
    """``into``: I/O i reads into into[i], as a load lands each block in its own chunk (the raw landed
    reference); without it the few reused buffers say nothing of where the data went."""
    if engine == "uring" and not uring_available():
        pytest.skip("io_uring is not available here")
    size, n = 8192, 12
    data = np.random.default_rng(0).integers(0, 256, size * n, np.uint8).tobytes()
    path = tmp_path / "data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        region = mmap.mmap(-1, size * n)
        into = [memoryview(region)[i * size:(i + 1) * size] for i in range(n)]
        order = list(np.random.default_rng(1).permutation(n))
        ios = [(0, int(i) * size) for i in order]  # I/O k reads block order[k] into into[k]
        run = run_threads if engine == "threads" else run_uring
        res = run([fd], ios, size, Op.READ, 3, 10.0, into=into)
        assert res.ops == n
        for k, i in enumerate(order):
            assert bytes(into[k]) == data[i * size:(i + 1) * size], k
        for v in into:
            v.release()
        region.close()
    finally:
        os.close(fd)
