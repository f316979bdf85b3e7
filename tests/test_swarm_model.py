"""The Swarm core on the real model: capture a short decode, cluster its activations, store the KV
as cluster pieces on a real store and decode from it through the offloaded cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvswarm.offload import MemorySequence, OffloadedKVCache, decode
from kvswarm.store import KVStore, StoreConfig
from kvswarm.bench.capture import record
from kvswarm.bench.experiment import TextData, build_layouts, coactivation_clusters, default_strategies
from kvswarm.swarm.index import ClusterSelector
from kvswarm.swarm.layout import SwarmPlacement
from kvswarm.swarm.retrieval import DriveModel
from kvswarm.swarm.sequence import SwarmSequence

pytestmark = pytest.mark.model
PROFILE, STEPS = 3, 6


@pytest.fixture(scope="module")
def captured(lm):
    from kvswarm.corpus import make_document

    doc = make_document(lm.tokenizer, 192, seed=0, source="pydoc", chat=True)
    return record(lm.model, list(doc.prompt_ids), STEPS, seed=0)


def test_capture_matches_dense_attention(captured):
    cap = captured
    assert cap.q.shape == (STEPS, cap.layers, 9, 64) and cap.dk.shape[2] == STEPS
    m, off = cap.dense_mass(3, 1, 4, 64)
    assert len(m) == cap.prompt_len - 68 and 0 < off <= 9.0001  # mass summed over 9 query heads


def test_decode_from_cluster_pieces_on_a_store(lm, captured, tmp_path):
    cap = captured
    td = TextData(cap, "pydoc#0@192", profile_steps=PROFILE)
    clusters = coactivation_clusters(td, "partition", size=8)
    st = next(s for s in default_strategies() if s.name == "kvswarm")
    layouts = build_layouts(st, td, clusters, 2, lm.layout.entry_bytes, DriveModel())
    drives = [tmp_path / "d0", tmp_path / "d1"]
    for d in drives:
        d.mkdir()
    store = KVStore(StoreConfig([str(d) for d in drives], capacity_per_drive=64 << 20, placement=SwarmPlacement()))
    try:
        # the profile steps' tokens join the resident window, as in the benchmark's agreement runs
        kv = [(torch.from_numpy(np.concatenate([cap.k[i], cap.dk[i, :, :PROFILE]], 1))[None],
               torch.from_numpy(np.concatenate([cap.v[i], cap.dv[i, :, :PROFILE]], 1))[None])
              for i in range(cap.layers)]
        tokens = np.concatenate([cap.tokens, cap.fed[:PROFILE]])
        seq = SwarmSequence.create(store, kv, tokens, lm.layout, layouts, sinks=4, window=64 + PROFILE)
        forced = cap.fed[PROFILE:].tolist()
        # every cluster selected: exactly the dense model's predictions
        full = OffloadedKVCache(seq, "sparse", ClusterSelector(), budget=td.n)
        res = decode(lm.model, full, torch.zeros(1), len(forced), forced=forced)
        assert res.predicted == cap.pred[PROFILE:].tolist()
        assert full.totals().pages > 0 and full.totals().misses == 0
        # a 25% budget through the same path: fewer entries read, still mostly the same tokens
        mem = MemorySequence(kv, tokens, lm.layout, 4, 64 + PROFILE)
        sparse = OffloadedKVCache(mem, "sparse", ClusterSelector(clusters), budget=td.n // 4)
        res = decode(lm.model, sparse, torch.zeros(1), len(forced), forced=forced)
        assert np.mean(np.asarray(res.predicted) == cap.pred[PROFILE:]) >= 0.5
        assert sparse.totals().entries < full.totals().entries
    finally:
        store.close()
