"""One turn of a transformers ChatSession on a cluster node (for tests/test_cluster_chat.py).

``prefill``: the node answers the user's message, storing and publishing the prompt's blocks, prints
its JSON line and stays in the cluster (its DRAM segment holds what it published) until stdin closes.
``decode``: a node with empty drives answers the same message; it reports where each reused
block came from, its first-token logits, and the logits of a from-scratch prefill of the prompt.
Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

from kvswarm.cluster import ClusterConfig
from kvswarm.corpus import make_document
from kvswarm.integrations.transformers_prefix import ChatSession, PrefixCache
from kvswarm.model import load_default_model
from kvswarm.prefix import HEADER_BYTES
from kvswarm.tiers.manager import TierConfig, TierManager
from kvswarm.tiers.pools import PoolConfig


def main(role: str, drive_dir: str, cluster: str) -> None:
    torch.set_num_threads(1)  # bit-exact against the from-scratch prefill (see transformers_prefix)
    lm = load_default_model()
    cfg = ClusterConfig.from_dict(json.loads(cluster))
    tm = TierManager(TierConfig(block_bytes=HEADER_BYTES + lm.layout.block_bytes, dram_bytes=16 << 20,
                                ssd=PoolConfig([drive_dir], capacity_per_drive=64 << 20,
                                               buffer_pool_bytes=16 << 20), cluster=cfg))
    try:
        text = lm.tokenizer.decode(make_document(lm.tokenizer, 150, seed=11).prompt_ids, skip_special_tokens=True)
        chat = ChatSession(PrefixCache(lm.model, lm.layout, tm), lm.tokenizer, system="Answer briefly.")
        reply = chat.say(text, max_new_tokens=4)
        g = chat.turns[0]
        out = {"reply": reply, "tokens": g.tokens, "reused": g.reused_tokens, "prompt": g.prompt_tokens,
               "tiers": sorted({t.name.lower() for t in g.hit_tiers})}
        if role == "decode":
            with torch.inference_mode():
                ids = chat.prompt_ids()[:g.prompt_tokens]  # this turn's prompt (the reply is appended since)
                ref = lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
            out["max_logit_diff"] = float((g.first_logits - ref).abs().max())
            out["ref_first_token"] = int(ref.argmax())
        tm.flush()
        print(json.dumps(out), flush=True)
        if role == "prefill":
            sys.stdin.read()
    finally:
        tm.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
