"""One vLLM engine process with the kvswarm offloading spec; prints a JSON report.

    python engine_run.py --model DIR --drives D0,D1 --phase write|read|serve|follow --out FILE [--stop FILE]
                         [--huge-first] [--cluster JSON] [--go FILE]

``write``: generate a real-text prompt (reference logprobs), wait until its blocks are
in kvswarm, reset vLLM's prefix cache and its CPU tier, generate again (must be served
by kvswarm).  ``read``: a fresh process generates the same prompt once.  ``serve``: like
``write`` without the second pass, then report and keep the engine (and its store) open
until ``--stop`` exists.  ``follow``: ``read`` with the tier following the live store.
``--cluster``: the tier's ``cluster`` section (its counters are reported under ``"cluster"``).
``--go``: the engine starts, then waits until this file exists before its first request.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: tier reachable

BLOCK = 32


def prompt_text() -> str:
    import pydoc_data.topics

    return pydoc_data.topics.topics["assert"][:1500]


def tier_of(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector.connector_scheduler.manager.secondary_tiers[0]


def generate(llm, prompt, sp):
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids),
            "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in out.outputs[0].logprobs],
            "cached_tokens": out.num_cached_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--drives", required=True)
    ap.add_argument("--phase", choices=["write", "read", "serve", "follow"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop", help="serve: exit once this file exists")
    ap.add_argument("--huge-first", action="store_true",
                    help="read: the tier backs vLLM's region with 2 MiB pages before the first load (loads in place)")
    ap.add_argument("--cluster", help="the tier's cluster section (JSON)")
    ap.add_argument("--go", help="wait for this file before the first request")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={
        "spec_name": "KVSwarmOffloadingSpec", "spec_module_path": "kvswarm.integrations.vllm",
        "cpu_bytes_to_use": 16 << 20,
        "kvswarm": {"drives": args.drives.split(","), "capacity_per_drive": 32 << 20, "tenant": "tests",
                    "follow": args.phase == "follow"} | ({"cluster": json.loads(args.cluster)} if args.cluster else {})})
    llm = LLM(model=args.model, enforce_eager=True, block_size=BLOCK, dtype="float32", max_model_len=1024,
              kv_transfer_config=ktc, max_num_seqs=2, kv_cache_memory_bytes=16 << 20, seed=0)
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    tok = llm.get_tokenizer()
    ids = tok(prompt_text())["input_ids"][:8 * BLOCK + 7]  # 8 full blocks and a partial one
    prompt = {"prompt_token_ids": ids}
    tier = tier_of(llm)
    if args.huge_first:
        tier.start_huge_pages()
        tier.region_ready.wait(120)
    deadline = time.time() + 900
    while args.go and not os.path.exists(args.go) and time.time() < deadline:
        time.sleep(0.1)
    report = {"prompt_tokens": len(ids), "objects_before": len(tier.store), "in_place_at_start": tier.in_place}
    report["first"] = generate(llm, prompt, sp)
    if args.phase in ("write", "serve"):
        # Stores reach kvswarm a step or two after a request ends: drive steps with 1-token requests.
        deadline = time.time() + 60
        filler = SamplingParams(max_tokens=1, temperature=0)
        n = 0
        while len(tier.store) < len(ids) // BLOCK and time.time() < deadline:
            llm.generate([{"prompt_token_ids": [3 + n % 50]}], filler, use_tqdm=False)
            n += 1
        tier.drain_jobs()
        if tier.cluster is not None:
            tier.cluster.pool.drain(30)  # publications land in the cluster
        report["objects_after_write"] = len(tier.store)
    if tier.cluster is not None:
        report["cluster"] = dict(tier.cluster.pool.counters)
    if args.phase == "serve":  # report, then stay up (store open, nothing checkpointed) until told to stop
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(args.out + ".tmp", args.out)
        deadline = time.time() + 900
        while not os.path.exists(args.stop) and time.time() < deadline:
            time.sleep(0.1)
        return
    if args.phase == "write":
        llm.reset_prefix_cache(reset_connector=True)  # drop the GPU prefix cache and the CPU tier
        before = dict(tier.store.counters)
        report["second"] = generate(llm, prompt, sp)
        report["second_store_hits"] = tier.store.counters["hits"] - before["hits"]
    tier.drain_jobs()  # promotions from the cluster
    report["counters"] = dict(tier.store.counters)
    report["objects_after"] = len(tier.store)
    if tier.cluster is not None:
        report["cluster"] = dict(tier.cluster.pool.counters)
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
