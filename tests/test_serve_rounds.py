"""`kvswarm bench serve --rounds`: rounds of one configuration pool into one run, and the summary's
second-half figures take every round's second half (no engine: records as the benchmark writes them)."""

from __future__ import annotations

from kvswarm.bench.serve_bench import pool_rounds, summarize


def phase(ttfts: list[float], rid0: int) -> dict:
    reqs = [{"rid": rid0 + i, "ttft_s": t, "e2e_s": t + 1, "tokens": [1, 2], "prompt_tokens": 64}
            for i, t in enumerate(ttfts)]
    return {"requests": reqs, "replay_s": 10.0, "tiers": [],
            "cache": {"local_queries": 100, "local_hits": 10, "connector_hits": 0}}


def run(first: list[float], second: list[float], read: int, load: tuple[float, float]) -> dict:
    return {"config": "no_offload", "restart": False, "drives": 1, "phases": [phase(first, 0), phase(second, 100)],
            "per_drive": [{"read_bytes": read, "written_bytes": 2 * read}], "load_avg": [(load[0],), (load[1],)],
            "engine_start_s": [1.0], "buffers_ready_s": [0.5], "region_ready_s": [0.0], "prefill_tokens_per_s": 200.0}


def test_rounds_pool_into_one_run_and_the_second_halves_pool_in_the_summary():
    pooled = pool_rounds([run([1.0, 2.0], [3.0], 10, (0.5, 1.0)), run([1.5, 2.5], [9.0], 20, (1.0, 2.0))])
    assert len(pooled["phases"]) == 4
    assert pooled["per_drive"] == [{"read_bytes": 30, "written_bytes": 60}]
    assert pooled["load_avg"] == [(0.5,), (2.0,)]
    assert pooled["prefill_tokens_per_s"] == [200.0, 200.0]
    assert pooled["buffers_ready_s"] == [0.5, 0.5]
    s = summarize({"engine": {"block_size": 32}, "runs": {"no_offload": pooled}})
    m = s["no_offload"]
    assert m["requests"] == 6 and s["wrong_outputs"] == 0
    assert m["second_half_ttft_p50_s"] == 6.0  # the median of 3.0 and 9.0: both rounds' second halves
    assert m["req_per_s"] == 6 / 40.0
