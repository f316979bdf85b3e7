"""InlinePromotionManager through vLLM's scheduler-side manager interface (no engine): a chunk found
in the kvswarm tier is a HIT within its lookup, verified; a corrupt one is a MISS; with
``inline_wait_s: 0`` and for vLLM's fs tier, promotion is deferred as in vLLM's own manager."""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from kvswarm.drive import DATA_FILE
from kvswarm.format import key_digest, payload_offset
from kvswarm.integrations.vllm.harness import keys_for, offloading_config
from kvswarm.integrations.vllm.promotion import InlinePromotionManager
from kvswarm.integrations.vllm.spec import CPUTieringOffloadingSpec, KVSwarmOffloadingSpec
from kvswarm.integrations.vllm.tier import MODULE_PATH, TIER_TYPE
from kvswarm.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", tokens_per_block=32,
                  model_id="promotion-test")  # 64 KiB chunks
CHUNKS = 16
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_ids = itertools.count()


@pytest.fixture
def drives(drive_dirs):
    return drive_dirs(2)


def manager(tiers: list[dict], spec_cls=CPUTieringOffloadingSpec, chunks: int = CHUNKS, **extra):
    config = offloading_config(LAYOUT, chunks * LAYOUT.block_bytes, f"promotion-{os.getpid()}-{next(_ids)}",
                               {"secondary_tiers": tiers, **extra})
    return spec_cls(config).get_manager()


def kvswarm_tier(drives, **kw) -> dict:
    # A wait far above a read's milliseconds: a fresh tier's first load also warms its buffers, and CI's
    # machine is busy; a wait that runs out only defers the promotion (vLLM's way).
    return {"type": TIER_TYPE, "module_path": MODULE_PATH, "drives": drives, "capacity_per_drive": 16 << 20,
            "inline_wait_s": 30.0, **kw}


def chunks(m) -> np.ndarray:
    return np.asarray(m.primary_tier.get_kv_memoryview()).view(np.uint8)  # (num_chunks, row stride) bytes


def store(m, keys, seed: int = 0) -> list[np.ndarray]:
    """Store ``keys`` as an engine does (GPU -> primary -> cascade to the tiers), then empty the primary."""
    rng = np.random.default_rng(seed)
    data = [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in keys]
    ctx = ReqContext(req_id=f"writer-{seed}")
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    rows = chunks(m)
    for key, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
        rows[c, :LAYOUT.block_bytes] = data[list(keys).index(key)]
    m.complete_store(keys, ctx)
    for tier in m.secondary_tiers:
        tier.drain_jobs()
    m.on_schedule_end(END)  # the cascades' completions
    m.on_request_finished(ctx)
    m.reset_cache()  # the primary tier forgets them; the drives keep them
    return data


def read_back(m, keys, ctx) -> list[np.ndarray]:
    spec = m.prepare_load(keys, ctx)
    rows = chunks(m)
    out = [rows[c, :LAYOUT.block_bytes].copy() for c in spec.chunk_ids]
    m.complete_load(keys, ctx)
    return out


def test_kvswarm_spec_uses_the_inline_manager(drives):
    m = manager([], KVSwarmOffloadingSpec, kvswarm={"drives": drives, "capacity_per_drive": 16 << 20})
    try:
        assert isinstance(m, InlinePromotionManager)
    finally:
        m.shutdown()


def test_a_chunk_on_the_drives_is_a_verified_hit_within_its_lookup(drives):
    keys = keys_for(6)
    m = manager([kvswarm_tier(drives)])
    try:
        data = store(m, keys)
        ctx = ReqContext(req_id="reader")
        m.on_new_request(ctx)
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 6
        assert m.inline_promotions == 6 and m.inline_timeouts == 0
        assert all(np.array_equal(a, b) for a, b in zip(read_back(m, keys, ctx), data))
        m.on_request_finished(ctx)
    finally:
        m.shutdown()


def test_the_first_lookup_promotes_the_requests_following_chunks_as_one_job(drives):
    """With the request's chunk keys recorded (as vLLM's scheduler does), the lookup that finds the first
    one in the tier promotes it and the following ones the tier holds, up to the first it lacks, in one
    load job; the scheduler's lookups of those then hit the primary tier, pinned until the step ends."""
    keys = keys_for(6)
    m = manager([kvswarm_tier(drives)])
    tier = m.secondary_tiers[0]
    try:
        data = store(m, keys[:2], seed=1) + store(m, keys[3:], seed=2)  # keys[2] is not stored
        submitted = []
        submit = tier.submit_load
        tier.submit_load = lambda job: (submitted.append(list(job.keys)), submit(job))
        ctx = ReqContext(req_id="reader")
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * LAYOUT.tokens_per_block)
        m.on_new_request(ctx)
        assert [m.lookup(k, ctx) for k in keys[:3]] == [LookupResult.HIT] * 2 + [LookupResult.MISS]
        assert submitted == [keys[:2]] and m.inline_promotions == 2
        assert all(np.array_equal(a, b) for a, b in zip(read_back(m, keys[:2], ctx), data[:2]))
        m.on_schedule_end(END)
        # A request whose prefix resumes after the gap: its first lookup brings the remaining three.
        assert [m.lookup(k, ctx) for k in keys[3:]] == [LookupResult.HIT] * 3
        assert submitted[1:] == [keys[3:]] and m.inline_promotions == 5
        assert all(np.array_equal(a, b) for a, b in zip(read_back(m, keys[3:], ctx), data[2:]))
        m.on_schedule_end(END)
        m.on_request_finished(ctx)
    finally:
        m.shutdown()


def test_a_hit_stays_in_the_primary_tier_until_the_step_ends(drives):
    """A two-chunk primary tier: the third block's promotion finds no chunk to evict (the first two are
    HITs this step, held for their load), so it is a MISS and the two HITs load intact; next step the
    pins are gone and the third block can be promoted."""
    keys = keys_for(3)
    m = manager([kvswarm_tier(drives)], chunks=2)
    try:
        data = store(m, keys[:2], seed=1) + store(m, keys[2:], seed=2)
        ctx = ReqContext(req_id="reader")
        m.on_new_request(ctx)
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
        assert all(np.array_equal(a, b) for a, b in zip(read_back(m, keys[:2], ctx), data[:2]))
        m.on_schedule_end(END)
        assert m.lookup(keys[2], ctx) is LookupResult.HIT
        assert np.array_equal(read_back(m, keys[2:], ctx)[0], data[2])
        m.on_request_finished(ctx)
    finally:
        m.shutdown()


def test_a_corrupt_chunk_is_a_miss_within_its_lookup(drives):
    keys = keys_for(4)
    m = manager([kvswarm_tier(drives)])
    tier = m.secondary_tiers[0]
    try:
        data = store(m, keys)
        entry = tier.store.catalog.entries[key_digest(tier.keyspace.key(keys[2]))]
        drv, off, _, _ = entry.extents[0]
    finally:
        m.shutdown()
    with open(os.path.join(drives[drv], DATA_FILE), "r+b") as f:
        f.seek(off + payload_offset(entry.payload_len) + 7)
        f.write(b"\x55\xaa")
    m = manager([kvswarm_tier(drives)])
    try:
        ctx = ReqContext(req_id="reader")
        m.on_new_request(ctx)
        # The scheduler stops at the first miss: blocks 0-1 come from the drives, 2-3 are recomputed.
        assert [m.lookup(k, ctx) for k in keys[:3]] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
        assert all(np.array_equal(a, b) for a, b in zip(read_back(m, keys[:2], ctx), data))
        assert m.secondary_tiers[0].store.counters["corrupt"] == 1
        assert m.lookup(keys[2], ctx) is LookupResult.MISS  # forgotten: no promotion loop
        m.on_request_finished(ctx)
    finally:
        m.shutdown()


def test_a_lookup_does_not_wait_for_loads_that_would_outlast_its_bound(drives, monkeypatch):
    """Once a load has been timed, a promotion whose bytes would take longer than ``inline_wait_s`` at
    the measured rate is not waited for (here 1 us, below any read): HIT_PENDING at once, completed at
    a later step as vLLM does, bytes intact."""
    keys = keys_for(2)
    m = manager([kvswarm_tier(drives, inline_wait_s=1e-6)])
    tier = m.secondary_tiers[0]
    try:
        data = store(m, keys)
        # Each load is held at its read until its lookup has answered: a thread switch on a busy machine
        # could otherwise let a load finish before a 1 us wait starts, and the lookup then rightly says HIT.
        gate = threading.Event()
        submit_get = tier.store.submit_get
        monkeypatch.setattr(tier.store, "submit_get", lambda *a, **kw: gate.wait(30) and submit_get(*a, **kw))
        ctx = ReqContext(req_id="reader")
        m.on_new_request(ctx)
        got = []
        for k in keys:
            gate.clear()
            assert m.lookup(k, ctx) is LookupResult.HIT_PENDING
            gate.set()
            tier.drain_jobs()
            m.on_schedule_end(END)  # the promotion's completion
            assert m.lookup(k, ctx) is LookupResult.HIT
            got += read_back(m, [k], ctx)
            m.on_schedule_end(END)
        # The first wait (no load timed yet) ran out; the second was not waited for.
        assert m.inline_timeouts == 2 and tier.load_stats()["inline_skips"] == 1
        assert all(np.array_equal(a, b) for a, b in zip(got, data))
        m.on_request_finished(ctx)
    finally:
        m.shutdown()


@pytest.mark.parametrize("tier", ["kvswarm_no_wait", "fs"])
def test_without_an_inline_wait_promotion_is_deferred_as_in_vllm(drives, tier):
    config = kvswarm_tier(drives, inline_wait_s=0) if tier != "fs" else {"type": "fs", "root_dir": drives[0]}
    keys = keys_for(3)
    m = manager([config])
    try:
        data = store(m, keys)
        ctx = ReqContext(req_id="reader")
        m.on_new_request(ctx)
        found = [m.lookup(k, ctx) for k in keys]
        while LookupResult.RETRY in found:  # the fs tier answers lookups from a thread: asked again next step
            m.on_schedule_end(END)
            time.sleep(0.01)
            found = [m.lookup(k, ctx) for k in keys]
        assert found == [LookupResult.HIT_PENDING] * 3
        m.on_schedule_end(END)  # vLLM submits the step's promotions here
        m.secondary_tiers[0].drain_jobs()
        m.on_schedule_end(END)
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
        assert m.inline_promotions == 0
        assert all(np.array_equal(a, b) for a, b in zip(read_back(m, keys, ctx), data))
        m.on_request_finished(ctx)
    finally:
        m.shutdown()


def test_a_negative_inline_wait_is_refused(drives):
    with pytest.raises(ValueError, match="inline_wait_s"):
        manager([kvswarm_tier(drives, inline_wait_s=-1)])
