"""The Mooncake trace scaled for `kvswarm bench serve`: same block id, same tokens; conversations
kept whole; arrivals compressed (to an offered load); prompts and outputs capped."""

from __future__ import annotations

from dataclasses import replace

from kvswarm.bench.serve_trace import (TRACE, Scaling, build_requests, compression_for_load, load_records, reuse,
                                      select)

S = Scaling(window_s=300, conversation_sample=30, time_compression=3, block_tokens=8, max_blocks=6, max_output=4)


def test_same_block_id_gives_the_same_tokens_and_prefixes_stay_shared():
    records = load_records(TRACE)
    pool = list(range(10_000))  # token ids stand-in: only positions matter here
    reqs = build_requests(records, S, pool)
    chunk: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        assert len(r.prompt) == S.block_tokens * len(r.blocks) and len(r.blocks) <= S.max_blocks
        assert 1 <= r.max_tokens <= S.max_output
        for i, b in enumerate(r.blocks):
            tokens = r.prompt[i * S.block_tokens:(i + 1) * S.block_tokens]
            assert chunk.setdefault(b, tokens) == tokens
    assert all(r.blocks[0] == 0 for r in reqs)  # the shared system-prompt block
    assert 0.2 < reuse(reqs) < 1.0


def test_conversations_are_kept_whole_and_arrivals_compressed():
    records = load_records(TRACE)
    kept = select(records, S)
    window = [r for r in records if r["timestamp"] < S.window_s * 1000]
    conv = {r["hash_ids"][1] for r in kept if len(r["hash_ids"]) > 1}
    assert conv and all(c % S.conversation_sample == 0 for c in conv)
    assert [r for r in window if len(r["hash_ids"]) > 1 and r["hash_ids"][1] in conv] == \
        [r for r in kept if len(r["hash_ids"]) > 1]  # every turn of a kept conversation
    reqs = build_requests(records, S, list(range(10_000)))
    span = (kept[-1]["timestamp"] - kept[0]["timestamp"]) / 1000
    assert reqs[0].arrival_s == 0 and abs(reqs[-1].arrival_s - span / S.time_compression) < 1e-9
    assert len(reqs) == len(kept) and "1 in 30 conversations" in S.describe()


def test_the_compression_for_a_load_offers_that_share_of_the_prefill_rate():
    records = load_records(TRACE)
    pool = list(range(10_000))
    at_pace = build_requests(records, replace(S, time_compression=1), pool)
    c = compression_for_load(at_pace, 0.8, 500.0)
    reqs = build_requests(records, replace(S, time_compression=c), pool)
    offered = sum(len(r.prompt) for r in reqs) / reqs[-1].arrival_s
    assert abs(offered - 0.8 * 500.0) < 1e-6
    assert compression_for_load(at_pace[:1], 0.8, 500.0) == 1.0  # one arrival: nothing to compress
