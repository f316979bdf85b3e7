"""Extent allocator: invariants under random alloc/free sequences, and rebuild from live extents."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswarm.allocator import ExtentAllocator
from kvswarm.errors import UnalignedBuffer

U = 4096


def _check(a: ExtentAllocator, live: dict[int, int]) -> None:
    spans = sorted(live.items()) + a.free_runs()
    spans.sort()
    pos = a.start
    for off, ln in spans:  # live and free runs tile the space exactly, with no overlap
        assert off == pos
        pos = off + ln
    assert pos == a.end
    assert a.used == sum(live.values())
    assert a.largest_free == max((ln for _, ln in a.free_runs()), default=0)  # the largest alloc that succeeds


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 8), st.integers(0, 10**6)), max_size=120), st.booleans())
def test_random_ops_keep_space_tiled(ops, lowest_first):
    a = ExtentAllocator(64 * U, start=U, lowest_first=lowest_first)
    live: dict[int, int] = {}
    for do_alloc, units, pick in ops:
        if do_alloc or not live:
            free_before = a.free_runs()
            off = a.alloc(units * U)
            if off is None:
                assert max((ln for _, ln in a.free_runs()), default=0) < units * U
                continue
            assert off % U == 0 and off not in live
            if lowest_first:  # the lowest run that fits
                assert off == min(s for s, ln in free_before if ln >= units * U)
            live[off] = units * U
        else:
            off = sorted(live)[pick % len(live)]
            a.release(off, live.pop(off))
        _check(a, live)
    for off, ln in list(live.items()):
        a.release(off, ln)
    assert a.used == 0 and a.free_runs() == [(U, 64 * U)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=40), st.data())
def test_rebuild_from_used_matches(sizes, data):
    a = ExtentAllocator(256 * U)
    live = {}
    for s in sizes:
        off = a.alloc(s * U)
        if off is not None:
            live[off] = s * U
    for off in data.draw(st.lists(st.sampled_from(sorted(live)), unique=True)):
        a.release(off, live.pop(off))
    b = ExtentAllocator.from_used(256 * U, live.items())
    _check(b, live)
    assert b.free == a.free


def test_full_and_bad_input():
    a = ExtentAllocator(4 * U)
    assert a.alloc(4 * U) == 0
    assert a.alloc(U) is None
    with pytest.raises(UnalignedBuffer):
        a.alloc(100)
    with pytest.raises(UnalignedBuffer):
        a.release(U + 1, U)
    with pytest.raises(UnalignedBuffer):
        ExtentAllocator(1000)
    with pytest.raises(ValueError):
        ExtentAllocator.from_used(8 * U, [(0, 2 * U), (U, U)])


@pytest.mark.parametrize("lowest_first", [False, True])
def test_alloc_many_makes_the_choices_of_alloc_one_by_one(lowest_first):
    a, b = (ExtentAllocator(64 * 4096, lowest_first=lowest_first) for _ in range(2))
    for x in (a, b):  # free runs of several sizes below the bump pointer
        offs = [x.alloc(4096 * n) for n in (1, 2, 1, 3, 1)]
        x.release(offs[0], 4096)
        x.release(offs[3], 3 * 4096)
    sizes = [4096, 8192, 4096, 4096, 12288, 40 * 4096, 4096]
    assert a.alloc_many(sizes) == [b.alloc(n) for n in sizes]
    assert a.alloc_many([4096 * 64]) == [None] and a.used == b.used
    with pytest.raises(UnalignedBuffer):
        a.alloc_many([100])

