"""The Swarm core: co-activation statistics, clustering, cluster index, layout, retrieval, cache,
prefetch, online maintenance, and reads through a real store (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvswarm.errors import LayoutMismatch
from kvswarm.format import key_digest
from kvswarm.layout import KVLayout
from kvswarm.placement import DriveView
from kvswarm.sparse.base import StepQuery
from kvswarm.store import KVStore, StoreConfig
from kvswarm.swarm.cache import CostBenefit, SizedLRU
from kvswarm.swarm.cluster import Clusters, contiguous, make_clusterer
from kvswarm.swarm.coact import CoActivation, cograph, incidence, jaccard
from kvswarm.swarm.index import ClusterSelector
from kvswarm.swarm.layout import STRIPE, CoactivationGrouping, Piece, LayerLayout, SwarmPlacement, plan_layout
from kvswarm.swarm.online import OnlineMaintainer, append_entry
from kvswarm.swarm.prefetch import CrossLayerPrefetch, precision_recall
from kvswarm.swarm.retrieval import DriveModel, Retriever, UnitCache
from kvswarm.swarm.sequence import SwarmSequence


def planted(steps: int = 40, universe: int = 200, seed: int = 0) -> list[np.ndarray]:
    """Activation sets with three planted groups that switch on together, plus noise."""
    rng = np.random.default_rng(seed)
    groups = [np.arange(10, 20), np.arange(50, 58), np.arange(120, 135)]
    sets = []
    for _ in range(steps):
        on = [g for g in groups if rng.random() < 0.5]
        noise = rng.choice(np.arange(150, universe), 3, replace=False)
        sets.append(np.unique(np.concatenate(on + [noise])))
    return sets


# ---- co-activation -------------------------------------------------------------------------
def test_cograph_jaccard_and_bounded_neighbours():
    sets = [np.array([1, 2, 3]), np.array([1, 2]), np.array([2, 4])]
    g = cograph(incidence(sets, 8), neighbours=8)
    assert g.freq.tolist() == [0, 2, 3, 1, 1, 0, 0, 0]
    assert g.p[1, 2] == pytest.approx(2 / 3)  # together twice; 1 twice, 2 three times
    assert g.p[2, 1] == g.p[1, 2]
    assert g.p[3, 4] == 0 and g.p[1, 1] == 0
    dense = cograph(incidence(planted(), 200), neighbours=0)
    small = cograph(incidence(planted(), 200), neighbours=4)
    assert small.p.nnz <= 2 * 4 * 200  # top-k per row, symmetrised: O(n k), never n x n
    assert small.p.nnz < dense.p.nnz
    assert jaccard(np.array([1, 2]), np.array([2, 3])) == pytest.approx(1 / 3)


def test_online_coactivation_window():
    ca = CoActivation(10, history=2)
    for s in ([1, 2], [1, 2], [3, 4]):
        ca.add(np.array(s))
    g = ca.graph()
    assert g.steps == 2 and g.freq[1] == 1 and g.freq[3] == 1
    ca.add(np.array([12]))  # a decoded token beyond the universe grows it
    assert ca.universe == 13


# ---- clustering ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kw", [("greedy", {"tau": 0.5}), ("greedy", {"tau": 0.5, "max_size": 6, "min_size": 3}),
                                     ("frequency", {"size": 8}), ("partition", {"size": 8})])
def test_clusterers_cover_every_position(name, kw):
    sets = planted()
    x = incidence(sets, 200)
    positions = np.arange(4, 190)
    cl = make_clusterer(name, **kw).cluster(cograph(x), x, positions)
    copies = cl.copies(200)
    assert (copies[positions] >= 1).all() and (copies[:4] == 0).all()
    assert copies.max() <= kw.get("max_copies", 2)
    assert all(np.isin(m, positions).all() for m in cl.members)
    for c, m in enumerate(cl.members):
        assert cl.medoids[c] in m
    if name in ("frequency", "partition"):
        assert cl.sizes[~cl.cold].max() <= kw["size"]
    if "max_size" in kw:
        assert cl.sizes[~cl.cold].max() <= kw["max_size"]


def test_greedy_finds_planted_groups():
    x = incidence(planted(), 200)
    cl = make_clusterer("greedy", tau=0.3).cluster(cograph(x), x, np.arange(4, 190))
    memb = cl.membership(200)
    for g in (np.arange(10, 20), np.arange(50, 58)):
        homes = [set(memb[i].indices.tolist()) for i in g]
        assert set.intersection(*homes), f"group {g[0]}.. was split"
    # never-active positions are cold blocks of consecutive positions
    cold = [m for m, c in zip(cl.members, cl.cold) if c]
    assert cold and all((np.diff(m) >= 1).all() for m in cold)
    assert (cl.heat[cl.cold] == 0).all() and (cl.heat[~cl.cold] > 0).all()


def test_clusters_round_trip_through_arrays(tmp_path):
    x = incidence(planted(), 200)
    cl = make_clusterer("greedy", tau=0.3, max_copies=2).cluster(cograph(x), x, np.arange(4, 190))
    np.savez(tmp_path / "c.npz", **cl.to_arrays("c", "3"), **Clusters([], *(np.zeros(0),) * 3).to_arrays("e"))
    with np.load(tmp_path / "c.npz") as z:
        back, empty = Clusters.from_arrays(z, "c", "3"), Clusters.from_arrays(z, "e")
    assert len(back) == len(cl) and all((a == b).all() for a, b in zip(back.members, cl.members))
    assert (back.medoids == cl.medoids).all() and (back.cold == cl.cold).all() and (back.heat == cl.heat).all()
    assert len(empty) == 0


# ---- the cluster index -----------------------------------------------------------------------
def synthetic_keys(n: int = 64, kvh: int = 1, d: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(kvh, n, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("score", ["medoid", "pq"])
def test_cluster_selector_picks_whole_clusters(score):
    positions = np.arange(4, 68)
    cl = contiguous(positions, 8)
    keys = synthetic_keys()
    sel = ClusterSelector({0: cl}, score=score, centroids=8)
    sel.build(0, keys, positions)
    # a query aligned with position 30's key: its cluster (24..31) must be among the first picked
    q = StepQuery(0, 0, keys[0, 30 - 4][None] * 4, synthetic_keys(4, seed=1), 1.0)
    s = sel.select(q, 16)
    assert len(s) >= 16 and 30 in s.positions
    chosen = sel.last[0]
    assert sorted(np.concatenate([cl.members[c] for c in chosen]).tolist()) == s.positions.tolist()
    assert sel.index_bytes() > 0


# ---- placement and layout ---------------------------------------------------------------------
def views(n: int) -> list[DriveView]:
    return [DriveView(i, 1 << 30, True) for i in range(n)]


def test_swarm_placement_hints():
    pl = SwarmPlacement()
    assert pl.place(b"", 2, views(4), 3) == [3, 3]
    assert pl.place(b"", 1, views(4)[:2], 3) in ([0], [1])  # drive 3 unavailable: another one
    a = [pl.place(b"", 1, views(4), STRIPE)[0] for _ in range(8)]
    assert a == [(a[0] + i) % 4 for i in range(8)]  # the global pointer walks the drives


def test_stripe_layout_spreads_each_cluster():
    cl = contiguous(np.arange(0, 64), 16)
    lay = plan_layout(cl, 4, 1536, mode="stripe")
    assert len(lay.pieces) == 16 and all(len(p.positions) == 4 for p in lay.pieces)
    pl = SwarmPlacement()
    drives = [pl.place(b"", 1, views(4), p.drives[0])[0] for p in lay.pieces]
    for c in range(4):
        assert sorted(drives[i] for i in lay.cluster_pieces[c]) == [0, 1, 2, 3]


def test_balanced_layout_separates_coactivated_clusters_and_replicates():
    members = [np.arange(i * 8, i * 8 + 8) for i in range(4)]
    cl = Clusters(members, np.array([0, 8, 16, 24]), np.zeros(4, bool), np.array([1.0, 1.0, 0.5, 0.5]))
    from scipy import sparse

    # clusters 0 and 1 are always active together; 2 and 3 alternate
    act = sparse.csr_matrix(np.array([[1, 1, 1, 0], [1, 1, 0, 1]] * 4, bool))
    lay = plan_layout(cl, 2, 1536, mode="balanced", piece_bytes=64 << 10, activity=act, replicate=0.3)
    primary = {p.cluster: p.drives[0] for p in lay.pieces}
    assert primary[0] != primary[1]
    replicated = [p for p in lay.pieces if len(p.drives) > 1]
    assert replicated and all(p.drives[0] != p.drives[1] for p in replicated)
    assert lay.stored_entries() > 32
    groups = CoactivationGrouping({0: lay}).group(0, np.arange(32), None, 5)
    assert sorted(np.concatenate([g.positions for g in groups]).tolist()) == list(range(32))
    assert max(len(g.positions) for g in groups) <= 5


# ---- retrieval ------------------------------------------------------------------------------
def make_retriever(pieces: list[Piece], drives: int, assign: str = "makespan", dedup: bool = True) -> Retriever:
    cl = Clusters([p.positions for p in pieces], np.array([p.positions[0] for p in pieces]),
                  np.zeros(len(pieces), bool), np.zeros(len(pieces)))
    lay = LayerLayout(cl, pieces)
    return Retriever(lay.holders(64), np.array([len(p.positions) for p in pieces]), [p.drives for p in pieces],
                     1536, drives, DriveModel(100e6, 5000), assign, dedup)


def test_replica_assignment_balances_drives():
    # four single-copy pieces on drive 0, four replicated pieces on drives (0, 1)
    pieces = [Piece(i, np.array([i]), [0]) for i in range(4)] + [Piece(4 + i, np.array([4 + i]), [0, 1])
                                                                 for i in range(4)]
    wanted = np.arange(8)
    spans = {a: make_retriever(pieces, 2, a).plan(wanted).makespan(DriveModel(100e6, 5000))
             for a in ("primary", "bucket", "makespan")}
    assert spans["makespan"] <= spans["bucket"] < spans["primary"]
    plan = make_retriever(pieces, 2).plan(wanted)
    assert plan.per_drive_reads.tolist() == [4, 4]


def test_dedup_overlap_and_dram_cache():
    # entry 5 is held by two pieces (overlapping clusters)
    pieces = [Piece(0, np.array([1, 5]), [0]), Piece(1, np.array([5, 9]), [1]), Piece(2, np.array([20]), [0])]
    r = make_retriever(pieces, 2)
    assert sorted(p for p, _ in r.plan(np.array([5])).reads) in ([0], [1])  # one holder is enough
    assert sorted(p for p, _ in r.plan(np.array([1, 5, 9])).reads) == [0, 1]
    nodedup = make_retriever(pieces, 2, dedup=False)
    assert sorted(p for p, _ in nodedup.plan(np.array([5])).reads) == [0, 1]
    cache = UnitCache(SizedLRU(10), {0: np.array([2, 2, 1])})
    plan = r.plan(np.array([1, 5, 20]), cache, 0)
    cache.after_read(0, [p for p, _ in plan.reads], plan.cached_used)
    again = r.plan(np.array([1, 5, 20]), cache, 0)
    assert again.reads == [] and again.dram_hits == 3 and again.wanted == 3


# ---- DRAM cache policies ---------------------------------------------------------------------
def test_cost_benefit_keeps_small_hot_units():
    cb = CostBenefit(10, t_base=1.0, t_transfer=0.01)
    for _ in range(5):
        cb.record("hot")
    cb.insert("hot", 2)
    cb.record("big")
    assert not cb.admit("big", 10)  # read once, would evict a unit read five times
    for _ in range(3):
        cb.record("warm")
    assert cb.admit("warm", 4)
    cb.insert("warm", 4)
    assert "hot" in cb and "warm" in cb and len(cb) == 6
    cb.tick()
    assert list(cb)[0] == "warm"  # lowest score first


@settings(max_examples=40, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 20), hs.integers(1, 6)), max_size=80), hs.integers(1, 12))
def test_sized_policies_never_exceed_capacity(ops, cap):
    for pol in (SizedLRU(cap), CostBenefit(cap)):
        sizes = {}
        for key, size in ops:
            size = sizes.setdefault(key, size)
            pol.touch(key)
            if pol.admit(key, size):
                pol.insert(key, size)
            assert len(pol) <= cap
            assert len(pol) == sum(sizes[k] for k in pol)


# ---- prefetch and online maintenance -----------------------------------------------------------
def test_cross_layer_prefetch_prediction():
    l0 = make_retriever([Piece(0, np.arange(0, 8), [0]), Piece(1, np.arange(8, 16), [1])], 2).holders
    l1 = make_retriever([Piece(0, np.arange(0, 4), [0]), Piece(1, np.arange(4, 16), [1])], 2).holders
    pf = CrossLayerPrefetch([l0, l1], min_votes=2)
    assert pf.predict(0, np.array([1, 2, 5])).tolist() == [0]  # piece 0 of layer 1 holds 2 of them
    assert pf.fit(np.array([3, 1, 2]), 2.0, len).tolist() == [3, 1]
    assert pf.predict(1, np.array([1, 2])).tolist() == []  # no layer after the last
    assert precision_recall(np.array([0, 1]), np.array([1])) == (0.5, 1.0)


def test_online_maintenance_joins_and_reclusters():
    sets = planted(20)
    x = incidence(sets, 200)
    clusterer = make_clusterer("partition", size=8)
    cl = clusterer.cluster(cograph(x), x, np.arange(4, 190))
    om = OnlineMaintainer(cl, np.arange(4, 190), clusterer, window_steps=2, warmup=2, drift=0.2)
    medoid = int(cl.medoids[0])
    om.new_token(200, 0)
    joined = []
    for s in range(3):
        joined += om.observe(s, np.array([medoid, 200]), 10, 9)
    assert joined and joined[0][0] == 200 and 0 in joined[0][1]
    assert 200 in cl.members[0] or 200 in om.clusters.members[joined[0][1][0]]
    for s in range(3, 8):
        om.observe(s, np.array([medoid]), 10, 2)  # efficiency collapses
    assert om.drifted()
    new = om.recluster()
    assert om.reclusters == 1 and 200 in np.concatenate(new.members)
    lay = plan_layout(contiguous(np.arange(8), 4), 2, 1536, mode="balanced", piece_bytes=1536 * 4)
    pid = append_entry(lay, 0, 9, 2)
    assert lay.pieces[pid].positions.tolist() == [9] and pid in lay.cluster_pieces[0]


# ---- reads through a real store ----------------------------------------------------------------
@pytest.fixture
def store(drive_dirs):
    s = KVStore(StoreConfig(drive_dirs(3), capacity_per_drive=64 << 20, placement=SwarmPlacement(),
                            buffer_pool_bytes=16 << 20))
    yield s
    s.close()


ENTRY_LAYOUT = KVLayout(2, 2, 8, "float32")


def balanced_layouts() -> list:
    """Two layers' balanced layouts of 8-entry clusters over 3 drives (offloaded positions 4-83)."""
    return [plan_layout(contiguous(np.arange(4, 84), 8), 3, ENTRY_LAYOUT.entry_bytes, mode="balanced",
                        piece_bytes=4096) for _ in range(2)]


def kv(layers: int = 2, n: int = 100, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)) for _ in range(layers)]


def test_swarm_sequence_reads_exact_entries_with_replicas_and_faults(store):
    lay = KVLayout(2, 2, 8, "float32")
    data = kv()
    sinks, window = 4, 16
    off = np.arange(sinks, 100 - window)
    x = incidence([a[(a >= sinks) & (a < 100 - window)] for a in planted(20)], 100)
    cl = make_clusterer("partition", size=6).cluster(cograph(x), x, off)
    act = (x @ cl.membership(100)) > 0
    layouts = [plan_layout(cl, 3, lay.entry_bytes, mode="balanced", piece_bytes=4096, activity=act, replicate=0.5)
               for _ in range(2)]
    seq = SwarmSequence.create(store, data, list(range(100)), lay, layouts, sinks=sinks, window=window)
    want = np.array([5, 17, 40, 41, 70])
    f = seq.fetch(1, want)
    assert len(f.missing) == 0
    torch.testing.assert_close(f.keys, data[1][0][0][:, want])
    torch.testing.assert_close(f.values, data[1][1][0][:, want])
    # reopened after a restart (manifest, resident entries and keys read back from the drives)
    again = SwarmSequence.open(store, lay, seq.seq_id)
    assert [p.positions.tolist() for p in again.layouts[1].pieces] == [p.positions.tolist() for p in layouts[1].pieces]
    assert [p.drives for p in again.layouts[0].pieces] == [p.drives for p in layouts[0].pieces]
    torch.testing.assert_close(again.offloaded_keys(1), seq.offloaded_keys(1))
    torch.testing.assert_close(again.resident(0)[1], seq.resident(0)[1])
    torch.testing.assert_close(again.fetch(1, want).values, data[1][1][0][:, want])
    with pytest.raises(LayoutMismatch):
        SwarmSequence.open(store, KVLayout(2, 2, 8, "bfloat16"), seq.seq_id)
    # a failed drive: replicated pieces are read from their other copy, the rest are counted misses
    store.fail_drive(0)
    seq2 = seq.view()
    f2 = seq2.fetch(1, off)
    ok = np.setdiff1d(np.arange(len(off)), f2.missing)
    torch.testing.assert_close(f2.keys[:, ok], data[1][0][0][:, off[ok]])
    assert (f2.keys[:, f2.missing] == 0).all()


def test_swarm_sequence_dram_cache_and_prefetch(store):
    lay = KVLayout(2, 2, 8, "float32")
    data = kv(seed=1)
    off = np.arange(4, 84)
    layouts = [plan_layout(contiguous(off, 8), 3, lay.entry_bytes, mode="stripe") for _ in range(2)]
    cache = UnitCache(CostBenefit(40), {i: np.array([len(p.positions) for p in layouts[i].pieces])
                                        for i in range(2)})
    seq = SwarmSequence.create(store, data, list(range(100)), lay, layouts, cache=cache)
    want = np.array([10, 11, 12, 50])
    seq.fetch(0, want)
    f = seq.fetch(0, want)  # now from DRAM
    assert seq.last.plan.dram_hits == 4 and not seq.last.plan.reads
    torch.testing.assert_close(f.keys, data[0][0][0][:, want])
    h = seq.prefetch(1, np.array([0, 1]))
    h.wait()
    plan = seq.plan(1, layouts[1].pieces[0].positions)
    assert plan.reads == [] and plan.dram_hits == len(layouts[1].pieces[0].positions)
    f = seq.fetch(1, layouts[1].pieces[0].positions)
    torch.testing.assert_close(f.keys, data[1][0][0][:, layouts[1].pieces[0].positions])
    seq.release_prefetched(1)
    assert not seq.prefetched


# ---- the benchmark machinery on a small synthetic capture --------------------------------------
def synthetic_capture(layers: int = 2, t: int = 160, steps: int = 12, seed: int = 0):
    from kvswarm.bench.capture import DecodeCapture

    g = np.random.default_rng(seed)
    f = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    return DecodeCapture({"version": 1}, np.arange(t), f(layers, 3, t, 64), f(layers, 3, t, 64),
                         f(steps, layers, 9, 64) * 3, f(layers, 3, steps, 64), f(layers, 3, steps, 64),
                         np.arange(steps), np.arange(steps))


def test_bench_strategies_estimate_and_replay(store):
    from kvswarm.bench.experiment import CACHE_POLICIES, TextData, default_strategies
    from kvswarm.bench.swarm_bench import TextRun, estimate, interp_io, replay, write_sequence

    td = TextData(synthetic_capture(), "synthetic", profile_steps=6)
    run = TextRun(td)
    strategies = default_strategies({"kvswarm": {"size": 8}, "token": {"block": 2}})
    by = {s.name: s for s in strategies}
    model = DriveModel(40e6, 2000)
    steps = range(6, 10)
    written: dict = {}
    for st in strategies:
        for pol in CACHE_POLICIES:
            for warm in (False, True):
                v = st.variant(pol, warm)
                est = estimate(run, v, by, 0.2, steps, 3, model, 0.05)
                assert 0 < est["recall"] <= 1 and est["io_ms"] > 0 and est["reads_per_step"] > 0
                sel = run.select(v, by, 0.2, steps)
                seq, _ = write_sequence(store, run, v, 3, model, 0.05, written)
                r = replay(seq, sel, model, td)
                assert len(r.io_s) == len(steps) - 1 and (r.io_s > 0).all() and (r.model_s > 0).all()
                assert r.nbytes.sum() > 0
                # every entry fetched is attended: recall never below the selection's own
                assert (r.recall >= sel.recall[1:].mean(1) - 1e-9).all()
    # strategies that share a layout share the stored sequence
    assert len(written) == 5  # token (2-token pages), blocks (= raid0's 16-token stripe), kmeans, swarm, kvswarm
    assert interp_io([(0.5, 10.0), (0.9, 40.0)], 0.7)[0] == pytest.approx(20.0)
    assert interp_io([(0.5, 10.0), (0.6, 40.0)], 0.7)[1].startswith("not reached")


def test_per_layer_lru_keeps_each_layer_within_its_share():
    from kvswarm.swarm.cache import PerLayerLRU

    pol = PerLayerLRU(30, layers=3)  # 10 entries per layer
    for p in range(8):
        pol.insert((0, p), 4)  # layer 0 alone churns through its own share
    pol.insert((1, 0), 6)
    assert (1, 0) in pol and len(pol) == 8 + 6 and pol.fits((2, 0), 10) and not pol.fits((1, 1), 5)
    assert pol.insert((2, 0), 11) == [(2, 0)]  # larger than a layer's share: never resident


def test_preloaded_cache_serves_from_dram_after_load(store):
    lay, data, layouts = ENTRY_LAYOUT, kv(seed=2), balanced_layouts()
    sizes = {i: np.array([len(p.positions) for p in layouts[i].pieces]) for i in range(2)}
    cache = UnitCache(CostBenefit(20), sizes)
    cache.preload(1, np.array([0, 1, 2]), np.array([5, 5, 5]))  # the third does not fit (capacity 20)
    assert cache.mask(1, len(sizes[1])).sum() == 2 and len(cache.policy) == 16
    assert cache.policy.freq((1, 0)) == pytest.approx(5)
    seq = SwarmSequence.create(store, data, list(range(100)), lay, layouts, cache=cache)
    assert seq.load_cached() == 2
    want = np.concatenate([layouts[1].pieces[0].positions, layouts[1].pieces[1].positions[:3]])
    f = seq.fetch(1, want)
    assert seq.last.plan.reads == [] and seq.last.plan.dram_hits == len(want)
    torch.testing.assert_close(f.keys, data[1][0][0][:, want])


def test_layer_allocation_gives_concentrated_layers_less():
    from kvswarm.swarm.index import LayerAllocation

    n = 100
    mass = np.ones((4, 2, n))
    mass[:, 0, :5] = 1000.0  # layer 0: five entries hold almost everything
    al = LayerAllocation.from_profile(mass, floor=0.25)
    b = al.budgets(20)
    assert b.sum() == pytest.approx(40, abs=1) and b[0] < 20 < b[1]
    assert b[0] >= 5  # the floor (0.25 * 20)
    assert al.budget(5, 20) == 20  # a layer the profile never saw keeps the plain budget


def test_warm_cache_takes_the_profile_hottest_pieces():
    from kvswarm.bench.experiment import TextData, build_layouts, make_cache, position_blocks
    from kvswarm.bench.experiment import default_strategies

    td = TextData(synthetic_capture(), "synthetic", profile_steps=6)
    st = next(s for s in default_strategies() if s.name == "kvswarm").variant("cost_benefit", True)
    model = DriveModel(40e6, 2000)
    eb = 2 * 3 * 64 * 4
    blocks = position_blocks(td, 8)
    lays = build_layouts(st, td, blocks, 2, eb, model)
    cap = int(0.1 * td.n * td.layers)
    cache = make_cache(st, cap, lays, model, eb, td)
    assert 0 < len(cache.policy) <= cap
    share = td.mass[:6] / td.mass[:6].sum(2, keepdims=True)
    for layer, lay in enumerate(lays):
        held = cache.mask(layer, len(lay.pieces))
        dens = np.array([share[:, layer, p.positions - td.base].mean(0).sum() / len(p.positions) for p in lay.pieces])
        if held.any() and (~held).any():  # every cached piece is at least as hot as the hottest left out
            assert dens[held].min() >= np.sort(dens[~held])[-1] - 1e-9 or len(cache.policy) + 8 > cap
    assert len(make_cache(st.variant("cost_benefit", False), cap, lays, model, eb, td).policy) == 0
    lru = make_cache(st.variant("per_layer_lru", True), cap, lays, model, eb, td)
    assert 0 < len(lru.policy) <= cap and all(len(p) <= cap // td.layers for p in lru.policy.parts)


def test_store_sequence_keeps_replicas_as_page_copies(store):
    """The offload package's StoreSequence stores a co-activation layout's replicas as extra
    copies of a page (Group.copies): reads spread over copies, fall back to another copy when
    one is missing or corrupt or its drive failed, and a reopened sequence keeps them."""
    from kvswarm.offload import StoreSequence
    from kvswarm.offload.grouping import PageTable

    lay = KVLayout(2, 2, 8, "float32")
    data = kv(seed=3)
    off = np.arange(4, 84)
    cl = contiguous(off, 8)
    layouts = {i: plan_layout(cl, 3, lay.entry_bytes, mode="balanced", piece_bytes=4096) for i in range(2)}
    for lay_ in layouts.values():  # every piece gets a replica on the next drive
        for p in lay_.pieces:
            p.drives.append((p.drives[0] + 1) % 3)
    groups = CoactivationGrouping(layouts).group(0, off, None, 10)
    assert all(len(g.copies) == 1 for g in groups)
    with pytest.raises(ValueError):  # repeats are still refused
        PageTable.from_groups(groups + groups[:1], 100, 10)
    seq = StoreSequence.create(store, data, list(range(100)), lay, sinks=4, window=16, page_bytes=16384,
                               grouping=CoactivationGrouping(layouts))
    assert seq.object_count() == 2 * 2 * len(groups)
    t = seq.tables[1]
    assert t.copies(0) == 2
    drives = {store.catalog.entries[key_digest(seq.copy_key(1, 0, c))].extents[0][0] for c in range(2)}
    assert len(drives) == 2  # the copies are on different drives
    drive0 = lambda p: store.catalog.entries[key_digest(seq.copy_key(1, p, 0))].extents[0][0]  # noqa: E731
    same = np.array([p for p in range(len(t.pages)) if drive0(p) == drive0(0)])
    assert len(same) >= 2
    copy = seq.choose_copies(1, same)
    assert 0 < copy.sum() < len(copy)  # pages whose first copies share a drive are spread over both
    want = np.array([5, 17, 40, 41, 70])
    f = seq.fetch(1, want)
    assert not len(f.missing)
    torch.testing.assert_close(f.keys, data[1][0][0][:, want])
    # copy 0 of every page gone: the other copies serve, nothing is missing
    for p in range(len(t.pages)):
        store.delete(seq.copy_key(1, p, 0))
    f = seq.fetch(1, off)
    assert not len(f.missing) and f.pages_missing == 0
    torch.testing.assert_close(f.values, data[1][1][0][:, off])
    again = StoreSequence.open(store, lay, seq.seq_id)
    assert again.tables[0].copies(3) == 2 and again.object_count() == seq.object_count()
    torch.testing.assert_close(again.fetch(0, want).keys, data[0][0][0][:, want])
    # a failed drive: copies on the others are chosen
    store.fail_drive(2)
    f = seq.fetch(0, off)
    assert not len(f.missing)
    torch.testing.assert_close(f.keys, data[0][0][0][:, off])


# ---- layouts that differ key apart; placement, cache and layout edge cases -------------------------
def test_reclustered_layout_does_not_overwrite_the_old_one(store):
    """Two co-activation layouts of the same prompt are stored under different ids (the grouping's
    describe() fingerprints the layout); an identical layout keys the same."""
    from kvswarm.offload import StoreSequence

    lay = KVLayout(2, 2, 8, "float32")
    data = kv(seed=4)
    off = np.arange(4, 84)

    def layouts(seed):  # one clustering per seed (as after a re-clustering)
        order = np.random.default_rng(seed).permutation(off) if seed else off
        return {i: plan_layout(contiguous(order, 8), 3, lay.entry_bytes, mode="balanced", piece_bytes=4096)
                for i in range(2)}

    a, b = CoactivationGrouping(layouts(0)), CoactivationGrouping(layouts(1))
    args = (store, data, list(range(100)), lay)
    seq_a = StoreSequence.create(*args, sinks=4, window=16, page_bytes=16384, grouping=a)
    seq_b = StoreSequence.create(*args, sinks=4, window=16, page_bytes=16384, grouping=b)
    want = np.arange(4, 36)
    for seq in (seq_a, seq_b):  # B's pages did not overwrite A's
        f = seq.fetch(0, want)
        assert not len(f.missing)
        torch.testing.assert_close(f.keys, data[0][0][0][:, want])
    assert seq_a.seq_id != seq_b.seq_id
    assert a.describe() != b.describe() and a.describe() == CoactivationGrouping(layouts(0)).describe()
    again = StoreSequence.create(*args, sinks=4, window=16, page_bytes=16384,
                                 grouping=CoactivationGrouping(layouts(0)))
    assert again.seq_id == seq_a.seq_id
    # the replica assignment is part of the layout too
    c = layouts(0)
    c[1].pieces[0].drives.append((c[1].pieces[0].drives[0] + 1) % 3)
    assert CoactivationGrouping(c).describe() != a.describe()


def test_swarm_sequence_default_id_follows_the_layout(store):
    lay = KVLayout(2, 2, 8, "float32")
    data = kv(seed=5)
    off = np.arange(4, 84)

    def layouts(seed):
        order = np.random.default_rng(seed).permutation(off) if seed else off
        return [plan_layout(contiguous(order, 8), 3, lay.entry_bytes, mode="balanced", piece_bytes=4096)
                for _ in range(2)]

    a = SwarmSequence.create(store, data, list(range(100)), lay, layouts(0))
    b = SwarmSequence.create(store, data, list(range(100)), lay, layouts(1))
    assert a.seq_id != b.seq_id
    assert SwarmSequence.create(store, data, list(range(100)), lay, layouts(0)).seq_id == a.seq_id
    want = np.arange(4, 36)
    torch.testing.assert_close(a.fetch(0, want).keys, data[0][0][0][:, want])
    torch.testing.assert_close(SwarmSequence.open(store, lay, a.seq_id).fetch(1, want).values,
                               data[1][1][0][:, want])


def test_cost_benefit_ghosts_trim_terminates_and_keeps_residents():
    cb = CostBenefit(100, ghosts=4)
    for k in range(8):  # residents beyond the ghost limit: their counts stay, nothing spins
        cb.record(k)
        cb.insert(k, 1)
    assert all(cb.freq(k) == pytest.approx(1.0) for k in range(8))
    for g in ("g0", "g1", "g2", "g3", "g4"):
        cb.record(g)
    assert cb.freq("g4") == pytest.approx(1.0)  # the newest ghost is kept ...
    assert cb.freq("g0") == 0.0 and cb.freq("g1") == pytest.approx(1.0)  # ... the oldest one goes
    cb.remove(0)  # a resident that leaves becomes a ghost (its count kept, the oldest ghost goes)
    assert cb.freq(0) == pytest.approx(1.0) and cb.freq("g1") == 0.0
    cb.record("g2")  # a ghost read again is the newest
    cb.record("g5")
    assert cb.freq("g2") == pytest.approx(2.0) and cb.freq("g3") == 0.0
    cb.insert("g4", 1)  # admitted: no longer a ghost
    for g in range(10, 14):
        cb.record(f"x{g}")
    assert cb.freq("g4") == pytest.approx(1.0) and cb.freq(0) == 0.0
    assert len([k for k in cb._fref if k not in cb]) <= 4
    none = CostBenefit(10, ghosts=0)
    none.insert("r", 1)
    none.record("r")
    none.record("x")
    assert none.freq("r") == 1.0 and none.freq("x") == 0.0


@pytest.mark.parametrize("decay", [0.5, 0.1, 1e-300])
def test_cost_benefit_small_decay_does_not_overflow(decay):
    cb = CostBenefit(10, decay=decay)
    cb.insert("a", 1)
    cb.insert("b", 2)
    for _ in range(5000):
        cb.record("a")
        cb.tick()
    cb.record("b", 3.0)
    assert cb.freq("b") == pytest.approx(3.0)
    assert cb.freq("a") == pytest.approx(decay / (1 - decay), rel=1e-6)  # sum of decay**k, k >= 1
    assert list(cb) == (["a", "b"] if cb.score("a", 1) < cb.score("b", 2) else ["b", "a"])
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            CostBenefit(10, decay=bad)


def test_replica_never_lands_on_its_primary_drive(store):
    """A replica whose hinted drive is unavailable goes to another drive than its primary's."""
    lay, data, layouts = ENTRY_LAYOUT, kv(seed=6), balanced_layouts()
    for lay_ in layouts:  # primary on drive 0, replica hinted to drive 2 (failed: 2 % 2 -> drive 0)
        for p in lay_.pieces:
            p.drives[:] = [0, 2]
    store.fail_drive(2)
    seq = SwarmSequence.create(store, data, list(range(100)), lay, layouts)
    ents = store.catalog.entries
    for layer in range(2):
        for i in range(len(layouts[layer].pieces)):
            d = [ents[key_digest(seq.key(layer, i, c))].extents[0][0] for c in range(2)]
            assert d == [0, 1]
    # the primary's own hint unavailable: it moves, and its replica avoids where it went
    pl = SwarmPlacement()
    from kvswarm.swarm.layout import copy_hints

    h = copy_hints([3, 0])
    first = pl.place(b"", 1, views(3), h[0])
    assert pl.place(b"", 1, views(3), h[1]) != first
    h = copy_hints([2, 0])
    assert pl.place(b"", 1, views(2), h[0]) != pl.place(b"", 1, views(2), h[1])


def test_swarm_sequence_drops_a_replica_with_no_other_drive(store):
    """Only one drive left: a replica would share its primary's drive, so it is not kept."""
    lay, data, layouts = ENTRY_LAYOUT, kv(seed=7), balanced_layouts()
    for lay_ in layouts:
        for p in lay_.pieces:
            p.drives[:] = [0, 1]
    store.fail_drive(1)
    store.fail_drive(2)
    seq = SwarmSequence.create(store, data, list(range(100)), lay, layouts)
    assert all(p.drives == [0] for lay_ in seq.layouts for p in lay_.pieces)
    assert all(p.drives == [0, 1] for lay_ in layouts for p in lay_.pieces)  # the caller's layout is untouched
    assert seq.object_count() == sum(len(lay_.pieces) for lay_ in layouts)
    assert not store.contains(seq.key(0, 0, 1))
    want = np.arange(4, 84)
    torch.testing.assert_close(seq.fetch(1, want).keys, data[1][0][0][:, want])
    again = SwarmSequence.open(store, lay, seq.seq_id)
    assert all(p.drives == [0] for lay_ in again.layouts for p in lay_.pieces)


def test_replicate_skips_a_piece_with_no_free_drive():
    from scipy import sparse

    from kvswarm.swarm.layout import _replicate

    members = [np.arange(0, 8), np.arange(8, 16)]
    cl = Clusters(members, np.array([0, 8]), np.zeros(2, bool), np.array([1.0, 1.0]))
    act = sparse.csr_matrix(np.ones((4, 2), bool))
    lay = LayerLayout(cl, [Piece(0, members[0], [0, 1]), Piece(1, members[1], [1])])
    _replicate(lay, 2, 1536, 1.0, np.zeros((2, 4)), act.tocsc(), 4, lambda b: float(b))
    assert lay.pieces[0].drives == [0, 1]  # both drives hold it already: no third copy
    assert lay.pieces[1].drives == [1, 0]


def test_balanced_layout_respects_max_piece_entries():
    cl = Clusters([np.arange(3000)], np.array([1500]), np.zeros(1, bool), np.array([1.0]))
    lay = plan_layout(cl, 2, 8, mode="balanced", piece_bytes=1 << 20, max_piece_entries=1365)
    sizes = [len(p.positions) for p in lay.pieces]
    assert max(sizes) <= 1365 and sum(sizes) == 3000 and len(sizes) == 3
    assert {p.drives[0] for p in lay.pieces} == {0, 1}
    small = plan_layout(contiguous(np.arange(64), 16), 4, 8, mode="balanced", piece_bytes=1 << 20)
    assert [len(p.positions) for p in small.pieces] == [16] * 4  # small clusters stay whole


def test_balanced_replication_needs_activity():
    with pytest.raises(ValueError, match="activity"):
        plan_layout(contiguous(np.arange(64), 16), 2, 8, mode="balanced", replicate=0.2)
    plan_layout(contiguous(np.arange(64), 16), 2, 8, mode="balanced")  # no replication: fine


def test_cluster_cache_key_covers_geometry_and_profile(tmp_path, monkeypatch):
    from kvswarm.bench import capture
    from kvswarm.bench.experiment import TextData, coactivation_clusters

    monkeypatch.setattr(capture, "capture_dir", lambda: tmp_path)
    cap = synthetic_capture()
    cap.meta["cache_key"] = "synthetic"
    for kw in ({}, {"window": 32}, {"sinks": 8}, {"profile_sparsity": 0.3}):
        td = TextData(cap, "synthetic", profile_steps=6, **kw)
        fresh = TextData(cap, "synthetic", profile_steps=6, **kw)
        fresh.cap = synthetic_capture()  # no cache key: computed, not read back
        got = coactivation_clusters(td, "partition", size=8)
        want = coactivation_clusters(fresh, "partition", size=8)
        for layer in range(td.layers):
            assert sorted(np.concatenate(got[layer].members).tolist()) == td.off.tolist()
            assert all((x == y).all() for x, y in zip(got[layer].members, want[layer].members))
