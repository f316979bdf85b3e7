"""The raw baselines' tuning (kvswarm.bench.raw.tune_passes): which sample of a setting counts."""

from kvswarm.bench.raw import tune_passes


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
