import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswarm.sparse import StepQuery, budget_for, make_selector, selector_names
from kvswarm.sparse.base import attention_mass, gqa_logits, head_lse

KVH, G, D = 3, 3, 16


def _setup(n=200, seed=0, r=6):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(KVH, n, D, generator=g)
    q = StepQuery(0, 0, torch.randn(KVH * G, D, generator=g), torch.randn(KVH, r, D, generator=g), D ** -0.5)
    return keys, np.arange(4, 4 + n, dtype=np.int64), q


def _exact_mass(keys, q):
    # Brute force: per head softmax over offloaded + resident keys, GQA by repeating KV heads.
    k = torch.cat([keys, q.resident_keys], 1).repeat_interleave(G, 0)
    p = torch.softmax((q.query[:, None, :] * k).sum(-1) * q.scale, -1)
    return p[:, :keys.shape[1]].sum(0)


def _built(name, keys, pos, **kw):
    s = make_selector(name, **kw)
    s.build(0, keys, pos)
    return s


def test_registry_and_budget():
    assert {"oracle", "blocks", "kmeans"} <= set(selector_names())
    with pytest.raises(ValueError):
        make_selector("nope")
    assert budget_for(0.1, 1000) == 100 and budget_for(0.001, 10) == 1 and budget_for(1.0, 7) == 7
    with pytest.raises(ValueError):
        budget_for(0, 10)


def test_oracle_is_exact_topk():
    keys, pos, q = _setup()
    sel = _built("oracle", keys, pos).select(q, 20)
    mass = _exact_mass(keys, q)
    want = np.sort(pos[torch.topk(mass, 20).indices.numpy()])
    assert np.array_equal(sel.positions, want)
    assert np.allclose(sel.scores, mass.numpy()[want - 4], atol=1e-5)
    # the helpers agree with the brute force
    off, res = gqa_logits(q.query, keys, q.scale), gqa_logits(q.query, q.resident_keys, q.scale)
    assert torch.allclose(attention_mass(off, head_lse(off, res)), mass, atol=1e-5)


@pytest.mark.parametrize("name,kw", [("oracle", {}), ("blocks", {"block_tokens": 16}),
                                     ("blocks", {"block_tokens": 7, "rep": "mean"}), ("kmeans", {"centroids": 16})])
def test_full_budget_selects_everything_sorted(name, kw):
    keys, pos, q = _setup(n=101)
    s = _built(name, keys, pos, **kw)
    sel = s.select(q, 101)
    assert np.array_equal(sel.positions, pos)
    small = s.select(q, 10)
    assert np.all(np.diff(small.positions) > 0) and np.isin(small.positions, pos).all()
    assert len(small.scores) == len(small) and s.index_bytes() > 0
    assert 10 <= len(small) <= 10 + kw.get("block_tokens", 1)


@pytest.mark.parametrize("name,kw", [("oracle", {}), ("blocks", {"rep": "quest"}), ("blocks", {"rep": "mean"}),
                                     ("kmeans", {})])
def test_selectors_find_a_hot_entry(name, kw):
    keys, pos, q = _setup(n=300, seed=1)
    hot = 137
    keys[:, hot] = q.query.reshape(KVH, G, D).sum(1) * 3  # aligned with every query head of its group
    s = _built(name, keys, pos, **kw)
    assert pos[hot] in s.select(q, 16).positions


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40))
def test_quest_bound_never_below_a_member(seed, block):
    keys, pos, q = _setup(n=97, seed=seed)
    s = _built("blocks", keys, pos, block_tokens=block)
    bound = s._block_logits(q)  # [q_heads, blocks]
    exact = gqa_logits(q.query, keys, q.scale)
    for b, members in enumerate(s._blocks[0]):
        assert torch.all(bound[:, b] >= exact[:, members - 4].max(1).values - 1e-4)


def test_kmeans_with_a_codeword_per_key_is_exact():
    keys, pos, q = _setup(n=40)
    s = _built("kmeans", keys, pos, centroids=256, subspaces=1, iters=1)
    assert torch.allclose(s.approx_logits(q), gqa_logits(q.query, keys, q.scale), atol=1e-4)
    assert np.array_equal(s.select(q, 8).positions, _built("oracle", keys, pos).select(q, 8).positions)


def test_kmeans_recall_beats_random_on_real_structure():
    # Keys drawn around a few directions (as real keys cluster): PQ scores must track exact ones.
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(8, D, generator=g) * 3
    keys = (centers[torch.randint(0, 8, (KVH, 400), generator=g)] + 0.3 * torch.randn(KVH, 400, D, generator=g))
    pos = np.arange(400)
    q = StepQuery(0, 0, torch.randn(KVH * G, D, generator=g), torch.randn(KVH, 4, D, generator=g), D ** -0.5)
    mass = _exact_mass(keys, q)
    got = mass[_built("kmeans", keys, pos, centroids=32).select(q, 40).positions].sum()
    best = torch.topk(mass, 40).values.sum()
    assert got / best > 0.8
