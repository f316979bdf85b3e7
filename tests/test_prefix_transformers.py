"""Prefix reuse on the real SmolLM2: restored KV is exact, generation matches from-scratch, faults are misses."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from kvswarm.errors import LayoutMismatch
from kvswarm.format import key_digest
from kvswarm.prefix import HEADER_BYTES
from kvswarm.tiers import Tier
from kvswarm.tiers.manager import TierConfig, TierManager
from kvswarm.tiers.pools import PoolConfig

pytestmark = pytest.mark.model
torch = pytest.importorskip("torch")
tp = pytest.importorskip("kvswarm.integrations.transformers_prefix")


def tiers(tmp_path, layout, name="t", dram_mb=16) -> TierManager:
    drives = []
    for i in range(2):
        p = tmp_path / f"{name}-ssd{i}"
        p.mkdir()
        drives.append(str(p))
    return TierManager(TierConfig(block_bytes=HEADER_BYTES + layout.block_bytes, dram_bytes=dram_mb << 20,
                                  ssd=PoolConfig(drives, capacity_per_drive=32 << 20, buffer_pool_bytes=16 << 20)))


@pytest.fixture(scope="module")
def prompt(lm):
    from kvswarm.corpus import make_document

    return list(make_document(lm.tokenizer, 70, seed=3).prompt_ids)  # 4 full blocks + 6 tokens


def scratch(model, ids, n):
    """Greedy decoding with a plain in-memory cache, no kvswarm."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        logits = out.logits[0, -1].clone()
        toks = [int(logits.argmax())]
        cache = out.cache
        while len(toks) < n:
            out = model(input_ids=torch.tensor([[toks[-1]]]), cache=cache, use_cache=True)
            cache = out.cache
            toks.append(int(out.logits[0, -1].argmax()))
    return toks, logits


def test_restored_kv_is_exact_and_generation_matches_scratch(tmp_path, lm, prompt):
    tm = tiers(tmp_path, lm.layout)
    pc = tp.PrefixCache(lm.model, lm.layout, tm)
    ref_tokens, ref_logits = scratch(lm.model, prompt, 6)
    first = pc.generate(prompt, 6)
    assert first.reused_tokens == 0 and first.tokens == ref_tokens
    tm.flush()
    tm.clear_dram()  # the next turn must come from the SSD pool, through O_DIRECT reads
    again = pc.generate(prompt, 6)
    assert again.reused_tokens == 64 and again.hit_tiers == [Tier.SSD] * 4
    assert again.tokens == ref_tokens
    # From scratch, the prefix's KV came from one big prefill: logits agree to float rounding.
    diff = (again.first_logits - ref_logits).abs().max().item()
    assert diff < 1e-3, diff

    # Bit-exact against the same computation with the original in-memory KV.
    with torch.inference_mode():
        mem = lm.model(input_ids=torch.tensor([prompt[:64]]), use_cache=True).cache
        with tm.lookup(pc.reusable_keys(prompt)) as hit:
            restored, n = pc.restore(hit)
        assert n == 64
        for a, b in zip(mem.layers, restored.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        rest = torch.tensor([prompt[64:]])
        la = lm.model(input_ids=rest, cache=mem, use_cache=True).logits
        lb = lm.model(input_ids=rest, cache=restored, use_cache=True).logits
    assert torch.equal(la, lb)
    tm.close()


def test_multi_turn_chat_reuses_previous_turns(tmp_path, lm):
    tm = tiers(tmp_path, lm.layout)
    chat = tp.ChatSession(tp.PrefixCache(lm.model, lm.layout, tm), lm.tokenizer)
    chat.say("Name one planet.", max_new_tokens=8)
    first_prompt = chat.turns[0].prompt_tokens
    chat.messages.append({"role": "user", "content": "And one more?"})
    prompt2 = chat.prompt_ids()
    chat.messages.pop()  # (the prompt turn 2 will see, for the from-scratch reference)
    reply = chat.say("And one more?", max_new_tokens=8)
    t2 = chat.turns[1]
    assert t2.reused_tokens >= first_prompt // 16 * 16 > 0  # the whole first turn's full blocks
    ref, _ = scratch(lm.model, prompt2, len(t2.tokens))
    assert t2.tokens == ref and reply
    tm.close()


def test_foreign_layout_model_or_tenant_never_served(tmp_path, lm, prompt):
    tm = tiers(tmp_path, lm.layout)
    tp.PrefixCache(lm.model, lm.layout, tm, tenant="alice").generate(prompt, 1)
    bob = tp.PrefixCache(lm.model, lm.layout, tm, tenant="bob")
    assert bob.generate(prompt, 1, store=False).reused_tokens == 0
    other_model = tp.PrefixCache(lm.model, replace(lm.layout, model_id="SmolLM2-360M"), tm)
    assert other_model.generate(prompt, 1, store=False).reused_tokens == 0
    with pytest.raises(LayoutMismatch):
        tp.PrefixCache(lm.model, replace(lm.layout, dtype="bfloat16"), tm)  # not the model's dtype
    with pytest.raises(LayoutMismatch):
        tp.PrefixCache(lm.model, replace(lm.layout, tokens_per_block=32), tm)  # not the tiers' block size
    assert tp.PrefixCache(lm.model, lm.layout, tm, tenant="alice").generate(prompt, 1).reused_tokens == 64
    tm.close()


def test_corrupt_block_is_recomputed_and_output_unchanged(tmp_path, lm, prompt):
    tm = tiers(tmp_path, lm.layout, dram_mb=0)
    pc = tp.PrefixCache(lm.model, lm.layout, tm)
    ref = pc.generate(prompt, 4).tokens
    tm.flush()
    ssd = tm.stores[Tier.SSD]
    drv, off, _, _ = ssd.catalog.entries[key_digest(pc.reusable_keys(prompt)[1])].extents[0]
    with open(os.path.join(ssd.drives[drv].path, "kvswarm.data"), "r+b") as f:
        f.seek(off + 4096)
        f.write(b"\x7f" * 64)  # garbage in block 1's KV
    g = pc.generate(prompt, 4)
    assert g.reused_tokens == 16 and g.tokens == ref  # block 0 reused, the rest recomputed
    assert tm.counters["rejected"] == 1
    assert pc.generate(prompt, 4).reused_tokens == 64  # the recomputed blocks were stored again
    tm.close()


def test_a_failed_forward_pass_gives_back_the_restored_prefix(tmp_path, lm, prompt):
    """The model raising after the prefix was restored must leave neither the hit's DRAM blocks pinned
    nor its pool read buffers taken."""

    class Failing:
        config = lm.model.config

        def __call__(self, **kw):
            raise RuntimeError("forward pass failed")

    tm = tiers(tmp_path, lm.layout)
    pc = tp.PrefixCache(lm.model, lm.layout, tm)
    pc.generate(prompt, 1)  # the prefix's four blocks: in DRAM and on the SSD pool
    tm.flush()
    pc.model = Failing()
    with pytest.raises(RuntimeError, match="forward pass"):
        pc.generate(prompt, 1)  # served from DRAM
    assert sum(s.pins for s in tm.dram._slots.values()) == 0
    tm.clear_dram()
    with pytest.raises(RuntimeError, match="forward pass"):
        pc.generate(prompt, 1)  # served from the SSD pool
    assert tm.stores[Tier.SSD].pool.in_use == 0
    pc.model = lm.model
    assert pc.generate(prompt, 1, store=False).reused_tokens == 64
    tm.close()
