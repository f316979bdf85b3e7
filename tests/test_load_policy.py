"""The vLLM tier's load policies: load everything, or recompute a block that would arrive too late."""

from __future__ import annotations

import pytest

from kvswarm.integrations.vllm.load_policy import LOAD_POLICIES, AlwaysLoad, DeadlineLoad, make_load_policy

MB = 1_000_000


def test_always_loads_whatever_is_queued():
    p = make_load_policy("always")
    assert isinstance(p, AlwaysLoad)
    p.observe(MB, 10.0)
    assert p.worth_loading(10**12, MB, 1)


def test_deadline_loads_until_a_rate_is_measured_then_compares_arrival_with_recompute():
    p = make_load_policy("deadline", recompute_tokens_per_s=1000)  # 16 tokens: 16 ms to recompute
    assert isinstance(p, DeadlineLoad)
    assert p.worth_loading(10**12, MB, 16)  # no load has finished: nothing to estimate with
    p.observe(100 * MB, 1.0)  # 100 MB/s: one 1 MB block arrives in 10 ms
    assert p.worth_loading(0, MB, 16)
    assert not p.worth_loading(MB, MB, 16)  # 20 ms behind one queued block: recomputing is sooner
    assert p.worth_loading(MB, MB, 32)  # a deeper block: recomputing up to it costs 32 ms


def test_deadline_rate_is_smoothed_and_ignores_empty_jobs():
    p = DeadlineLoad(1000, smoothing=0.5)
    p.observe(100 * MB, 1.0)
    p.observe(0, 1.0)
    p.observe(MB, 0.0)
    assert p.bytes_per_s == 100 * MB
    p.observe(300 * MB, 1.0)
    assert p.bytes_per_s == pytest.approx(200 * MB)


def test_deadline_needs_a_prefill_rate_and_names_are_checked():
    with pytest.raises(ValueError, match="recompute_tokens_per_s"):
        make_load_policy("deadline")
    with pytest.raises(ValueError, match="unknown load policy"):
        make_load_policy("sometimes")
    assert LOAD_POLICIES.names() == ["always", "deadline"]


def test_deadline_probes_a_stale_estimate_so_one_slow_load_does_not_decline_forever():
    now = [0.0]
    p = DeadlineLoad(1000, smoothing=0.5, probe_interval_s=1.0, clock=lambda: now[0])
    p.observe(MB, 10.0)  # a cold first read: 0.1 MB/s, a block would take 10 s
    assert not p.worth_loading(0, MB, 64)
    now[0] = 0.9
    assert not p.worth_loading(0, MB, 64)  # news is recent: declined
    now[0] = 1.2
    assert p.worth_loading(0, MB, 64)  # no load for 1.2 s: this block is loaded as a probe
    assert p.probes == 1
    assert not p.worth_loading(0, MB, 64)  # one probe per interval
    p.observe(MB, 0.01)  # the probe's job: 100 MB/s
    p.observe(MB, 0.01)
    assert p.worth_loading(0, MB, 64)  # the refreshed estimate loads again
    assert p.probes == 1
