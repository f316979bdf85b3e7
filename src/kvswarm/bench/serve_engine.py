"""One vLLM CPU engine serving part of a replayed trace (a child process of ``kvswarm bench serve``).

    python -m kvswarm.bench.serve_engine JOB.json OUT.json

The job gives the engine settings, the offloading connector's config (none: vLLM's own prefix cache
only) and the requests with their arrival times.  The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as in vLLM's async engine's core loop: requests are added
when their arrival time comes, and the engine steps while any is unfinished, so requests that
arrive together are batched and queue for the engine as they would behind a server.  TTFT is the
time from a request's arrival to the step that returns its first token.

Before the replay kvswarm's tier finishes faulting its buffer pool in (``buffers_ready_s``), two
warm-up requests (text outside the trace) run alone: the first warms the engine
up, the others time its prefill rate (the fastest of them); then kvswarm's tier backs vLLM's CPU region with 2 MiB pages
(it does so at its first load otherwise, beside the engine: ``KVSwarmTierManager.start_huge_pages``).
After the replay, 1-token filler requests drive the engine until the offloading tiers have no pending
work (stores reach the tiers a few steps after a request ends), so an engine
stopped there has handed every block to its tiers.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: tiers reachable


def make_engine(job: dict, stats):
    from vllm import EngineArgs
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    e = job["engine"]
    ktc = None
    if job.get("connector"):
        ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                               kv_connector_extra_config=job["connector"])
    args = EngineArgs(model=job["model"], enforce_eager=True, block_size=e["block_size"], dtype=e["dtype"],
                      max_model_len=e["max_model_len"], max_num_seqs=e["max_num_seqs"],
                      kv_cache_memory_bytes=e["kv_cache_bytes"], seed=0, enable_prefix_caching=True,
                      kv_transfer_config=ktc, disable_log_stats=False)
    return LLMEngine.from_engine_args(args, stat_loggers=[stats])


class CacheStats:
    """A vLLM stat logger summing the scheduler's prefix-cache counters (tokens queried / hit), local
    (vLLM's own KV blocks) and through the connector (the offloading tiers)."""

    totals = {"local_queries": 0, "local_hits": 0, "connector_queries": 0, "connector_hits": 0}

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        p, c = scheduler_stats.prefix_cache_stats, scheduler_stats.connector_prefix_cache_stats
        if p is not None:
            self.totals["local_queries"] += p.queries
            self.totals["local_hits"] += p.hits
        if c is not None:
            self.totals["connector_queries"] += c.queries
            self.totals["connector_hits"] += c.hits

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def tiering_manager(engine):
    """The scheduler-side tiering manager of the offloading connector, or None without one."""
    connector = engine.engine_core.engine_core.scheduler.connector
    if connector is None:
        return None
    return connector.connector_scheduler.manager


class LoadCounter:
    """Counts the blocks a secondary tier is asked to load (its lookup hits that became promotions)."""

    def __init__(self, tier) -> None:
        self.blocks = 0
        self._submit = tier.submit_load
        tier.submit_load = self

    def __call__(self, job) -> None:
        self.blocks += len(job.keys)
        self._submit(job)


def run_requests(engine, requests: list[dict], t_start: float, steps: list) -> list[dict]:
    """Add each request at its arrival time, step while any is unfinished; per-request records.
    ``steps`` gets one ``(end_s, seconds, running, waiting)`` row per engine step."""
    from vllm import SamplingParams

    scheduler = engine.engine_core.engine_core.scheduler
    pending = sorted(requests, key=lambda r: r["arrival_s"])
    info: dict[str, dict] = {}
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - t_start
        while i < len(pending) and pending[i]["arrival_s"] <= now:
            r = pending[i]
            sp = SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True)
            engine.add_request(r["rid"], {"prompt_token_ids": r["prompt"]}, sp)
            info[r["rid"]] = {"rid": r["rid"], "arrival_s": r["arrival_s"], "prompt_tokens": len(r["prompt"]),
                              "added_s": now}
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, pending[i]["arrival_s"] - now)))
            continue
        t_step = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter() - t_start
        steps.append((round(now, 4), round(time.perf_counter() - t_step, 4), len(scheduler.running),
                      len(scheduler.waiting)))
        for o in outs:
            rec = info[o.request_id]
            if "first_token_s" not in rec and o.outputs and o.outputs[0].token_ids:
                rec["first_token_s"] = now
            if o.finished:
                rec["done_s"] = now
                rec["tokens"] = list(o.outputs[0].token_ids)
                rec["cached_tokens"] = o.num_cached_tokens
    out = []
    for r in info.values():
        r["ttft_s"] = r["first_token_s"] - r["arrival_s"]
        r["e2e_s"] = r["done_s"] - r["arrival_s"]
        out.append(r)
    return out


def settle(engine, manager, seconds: float = 30.0) -> int:
    """Drive steps with 1-token fillers until the tiers have no pending work; fillers used."""
    from vllm import SamplingParams

    if manager is None:
        return 0
    sp = SamplingParams(max_tokens=1, temperature=0)
    n = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        engine.add_request(f"filler-{n}", {"prompt_token_ids": [5 + n % 50]}, sp)
        while engine.has_unfinished_requests():
            engine.step()
        n += 1
        if not manager.has_pending_work():
            break
        time.sleep(0.01)
    return n


def tier_stats(manager, counters: list[LoadCounter]) -> list[dict]:
    """Per secondary tier: blocks loaded so far, and the tier's own load counters (kvswarm's), with the
    manager's promotions completed within their lookup and waits that ran out (one inline tier per engine)."""
    out = []
    if manager is None:
        return out
    for t, c in zip(manager.secondary_tiers, counters):
        row = {"type": type(t).__name__, "loaded_blocks": c.blocks}
        stats = getattr(t, "load_stats", None)
        if stats is not None:
            row |= stats()
        if getattr(t, "inline_wait_s", 0) > 0:
            row |= {"inline_promotions": manager.inline_promotions, "inline_timeouts": manager.inline_timeouts}
        out.append(row)
    return out


def main(argv: list[str]) -> int:
    job_path, out_path = argv
    with open(job_path) as f:
        job = json.load(f)
    t0 = time.perf_counter()
    engine = make_engine(job, CacheStats)
    start_s = time.perf_counter() - t0
    manager = tiering_manager(engine)
    counters = [LoadCounter(t) for t in manager.secondary_tiers] if manager is not None else []
    t_buffers = time.perf_counter()
    for tier in manager.secondary_tiers if manager is not None else ():
        if hasattr(tier, "buffers_ready"):  # kvswarm's pool faulted in at start-up, not beside the warm-up
            tier.buffers_ready.wait(120)
    buffers_s = time.perf_counter() - t_buffers
    from vllm import SamplingParams

    rates = []
    for n, warm in enumerate(job["warmup_prompts"]):  # the first warms the engine up, the others are timed
        tw = time.perf_counter()
        engine.add_request(f"warmup-{n}", {"prompt_token_ids": warm}, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        rates.append(len(warm) / (time.perf_counter() - tw))
    t_region = time.perf_counter()
    for tier in manager.secondary_tiers if manager is not None else ():
        if hasattr(tier, "start_huge_pages"):  # kvswarm's: the region in 2 MiB pages before, not during, the replay
            tier.start_huge_pages()
            tier.region_ready.wait(120)
    region_s = time.perf_counter() - t_region
    phases = []
    for requests in job["phases"]:
        before = dict(CacheStats.totals)
        tiers_before = tier_stats(manager, counters)
        t_start = time.perf_counter()
        steps: list = []
        records = run_requests(engine, requests, t_start, steps)
        replay_s = time.perf_counter() - t_start
        fillers = settle(engine, manager)
        phases.append({"replay_s": replay_s, "fillers": fillers, "requests": records, "steps": steps,
                       "cache": {k: v - before[k] for k, v in CacheStats.totals.items()},
                       "tiers": [{k: (v - b[k] if isinstance(v, int) else v) for k, v in a.items()}
                                 for a, b in zip(tier_stats(manager, counters), tiers_before)]})
    result = {"engine_start_s": start_s, "buffers_ready_s": buffers_s, "region_ready_s": region_s, "warmup_prompt_tokens": len(warm),
              "warmup_rates": rates, "prefill_tokens_per_s": max(rates[1:] or rates), "phases": phases}
    engine.engine_core.shutdown()
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
