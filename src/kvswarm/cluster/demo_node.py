"""One node of ``kvswarm demo --cluster``: a transformers ChatSession (real SmolLM2) on a TierManager
whose cluster level is the demo's Mooncake master.

    python -m kvswarm.cluster.demo_node prefill|decode DRIVE_DIR CLUSTER_JSON TOKENS

``prefill``: answers a message carrying a real document (its prompt's KV computed, stored on the
node's drive and published), prints one JSON line, and stays in the cluster (its DRAM segment holds
what it published) until stdin closes.  ``decode``: a node on an empty drive answers the same
message, then prefills the prompt from scratch for reference; prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvswarm.cluster.config import ClusterConfig
from kvswarm.corpus import make_document
from kvswarm.integrations.transformers_prefix import ChatSession, PrefixCache
from kvswarm.model import load_default_model
from kvswarm.prefix import HEADER_BYTES
from kvswarm.tiers.manager import TierConfig, TierManager
from kvswarm.tiers.pools import PoolConfig


def main(role: str, drive_dir: str, cluster: str, tokens: str) -> None:
    torch.set_num_threads(1)  # the same kernels as the reference prefill: bit-exact first logits
    lm = load_default_model()
    tm = TierManager(TierConfig(block_bytes=HEADER_BYTES + lm.layout.block_bytes, dram_bytes=16 << 20,
                                ssd=PoolConfig([drive_dir], capacity_per_drive=256 << 20, buffer_pool_bytes=32 << 20),
                                cluster=ClusterConfig.from_dict(json.loads(cluster))))
    try:
        doc = make_document(lm.tokenizer, int(tokens), seed=11)
        text = lm.tokenizer.decode(doc.prompt_ids, skip_special_tokens=True)
        chat = ChatSession(PrefixCache(lm.model, lm.layout, tm), lm.tokenizer, system="Answer briefly.")
        reply = chat.say(f"{text}\n\nWhat is this text about?", max_new_tokens=12)
        g = chat.turns[0]
        out = {"role": role, "reply": reply, "first_token": g.tokens[0], "prompt_tokens": g.prompt_tokens,
               "reused_tokens": g.reused_tokens, "ttft_s": g.ttft_s, "load_s": g.load_s,
               "tiers": sorted({t.name.lower() for t in g.hit_tiers})}
        if role == "decode":
            with torch.inference_mode():
                ids = chat.prompt_ids()[:g.prompt_tokens]  # this turn's prompt (the reply is appended since)
                t0 = time.perf_counter()
                ref = lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
                out["recompute_s"] = time.perf_counter() - t0
            out["max_logit_diff"] = float((g.first_logits - ref).abs().max())
            out["recompute_first_token"] = int(ref.argmax())
        tm.flush()
        out["cluster"] = tm.cluster.stats()["counters"]
        print(json.dumps(out), flush=True)
        if role == "prefill":
            sys.stdin.read()
    finally:
        tm.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
