"""Placement strategies: a batch placed at once goes where one-by-one placement sends it."""

from kvswarm.placement import DriveView, HashPlacement, RoundRobinStriping


def test_place_many_makes_the_choices_of_place_one_by_one():
    drives = [DriveView(i, 1 << 30, True) for i in (0, 2, 3)]
    digests = [bytes([i]) * 16 for i in range(20)]
    for make in (RoundRobinStriping, HashPlacement):
        a, b = make(), make()
        assert a.place_many(digests, drives) == [b.place(d, 1, drives)[0] for d in digests]
