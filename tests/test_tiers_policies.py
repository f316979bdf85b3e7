"""Pure tier policies: eviction strategies, write/demotion policies, the director's actions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswarm.tiers import (
    ARC,
    LRU,
    S3FIFO,
    TIERS,
    AlwaysDemote,
    BlockInfo,
    ComputeModel,
    Copy,
    CostAware,
    DriveCost,
    Drop,
    NeverDemote,
    PrefetchPolicy,
    Selective,
    Tier,
    TierDirector,
    make_eviction,
    make_write_policy,
)

POLICIES = [LRU, ARC, S3FIFO]
ops = st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove"]), st.integers(0, 30)), max_size=300)


@pytest.mark.parametrize("cls", POLICIES)
@settings(max_examples=60, deadline=None)
@given(cap=st.integers(0, 12), seq=ops)
def test_eviction_residency_matches_model(cls, cap, seq):
    """Residency = inserted - evicted - removed, never above capacity, for any op sequence."""
    pol = cls(cap)
    model: set[int] = set()
    for op, k in seq:
        if op == "insert":
            out = pol.insert(k)
            model.add(k)
            assert len(out) == len(set(out))
            model -= set(out)
            if cap == 0:
                assert out == [k]
        elif op == "touch":
            assert pol.touch(k) == (k in model)
        else:
            assert pol.remove(k) == (k in model)
            model.discard(k)
        assert len(pol) <= cap
        assert set(pol) == model
        assert all(x in pol for x in model)
    evicted = pol.resize(cap // 2)
    assert len(pol) <= cap // 2 and not set(evicted) & set(pol)


def test_lru_order():
    p = LRU(3)
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert p.insert("d") == ["b"]
    assert list(p) == ["c", "a", "d"]


def test_arc_and_s3fifo_resist_a_scan():
    """A hot set survives a one-pass scan under ARC and S3-FIFO, not under LRU."""
    hot = list(range(8))
    kept = {}
    for cls in POLICIES:
        pol = cls(10)
        for k in hot * 5 + [f"scan{i}" for i in range(40)]:
            if not pol.touch(k):
                pol.insert(k)
        kept[cls.name] = sum(k in pol for k in hot)
    assert kept["lru"] == 0
    assert kept["arc"] >= 6 and kept["s3fifo"] >= 6, kept


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo"])
def test_a_key_kept_back_displaces_nothing_and_goes_first_next_time(name):
    """keep: a victim whose move down failed comes back without evicting another; the tier is one over
    its capacity until its next insertion, which evicts that key first (retrying its move)."""
    p = make_eviction(name, 4)
    for k in "abcd":
        assert p.insert(k) == []
    v, = p.insert("e")
    p.keep(v)
    assert v in p and len(p) == 5
    out = p.insert("f")
    assert out[0] == v and len(p) == 4


def test_director_keeps_a_block_whose_move_failed():
    d = TierDirector([0, 2, 4])
    for k in "abc":
        d.admit(k)
    assert d.locate("a") == Tier.CAPACITY  # demoted when c came in
    d.lost("a", Tier.CAPACITY)  # its write there failed...
    d.keep("a", Tier.SSD)  # ...so it stays on the SSDs, over their capacity
    assert d.locate("a") == Tier.SSD and d.resident(Tier.SSD) == 3 and d.counters["kept_ssd"] == 1
    acts = d.admit("x")
    assert acts[:2] == [Copy("a", Tier.SSD, Tier.CAPACITY), Drop("a", Tier.SSD)]  # its move is tried again
    assert d.resident(Tier.SSD) == 2


def test_make_eviction_names():
    assert isinstance(make_eviction("s3fifo", 4), S3FIFO)
    with pytest.raises(ValueError):
        make_eviction("nope", 4)


def test_write_policies():
    assert make_write_policy("write-through").write_on_admit(1)
    wb = make_write_policy("write-back")
    assert not wb.write_on_admit(5) and wb.write_on_evict(1)
    sel = make_write_policy("selective:3")
    assert isinstance(sel, Selective) and sel.k == 3
    assert not sel.write_on_admit(2) and sel.write_on_admit(3) and not sel.write_on_evict(1)
    with pytest.raises(ValueError):
        make_write_policy("write-sideways")


def test_prefetch_policy_deadlines():
    assert PrefetchPolicy("wait_complete").deadline(5.0) == math.inf
    assert PrefetchPolicy("best_effort").deadline(5.0) == -math.inf
    assert PrefetchPolicy.parse("timeout:0.25").deadline(5.0) == 5.25
    with pytest.raises(ValueError):
        PrefetchPolicy("sometimes")


def test_compute_model_fit():
    true = ComputeModel(1e-3, 2e-7)
    m = ComputeModel.fit([(n, true.prefill_seconds(n)) for n in (256, 1024, 4096)])
    assert m.a == pytest.approx(1e-3, rel=1e-6) and m.b == pytest.approx(2e-7, rel=1e-6)
    assert m.block_seconds(4096, 16) > m.block_seconds(0, 16)


def _cost_aware(recompute_a: float) -> CostAware:
    hdd = DriveCost("hdd", 200, 200, 10e-3, 10e-3)
    ssd = DriveCost("ssd", 2000, 2000, 1e-4, 1e-4)
    return CostAware(ComputeModel(recompute_a), 16, 1 << 20, ssd, hdd, ghost_size=100)


def test_cost_aware_learns_return_rates():
    # Recompute of a block (16 tokens x 2 ms = 32 ms) vs ~26 ms of HDD+SSD traffic to keep it.
    pol = _cost_aware(2e-3)
    once, hot = BlockInfo(sightings=1), BlockInfo(sightings=4)
    for i in range(50):  # blocks seen once never return; blocks seen 4+ times always do
        pol.demote(("once", i), once)
        pol.demote(("hot", i), hot)
        pol.on_sighting(("hot", i), hot)
    assert pol.p_return(once) < 0.05 and pol.p_return(hot) > 0.95
    assert not pol.demote("x", once)
    assert pol.demote("y", hot)
    # Free recompute: never worth a demotion.
    assert not _cost_aware(0.0).demote("z", hot)


class ByteModel:
    """Replays actions on sets of keys: a Copy must find its source; in the end, the bytes
    each tier holds must be exactly what the director believes it holds."""

    def __init__(self) -> None:
        self.have: dict[Tier, set] = {t: set() for t in TIERS}

    def run(self, acts) -> None:
        for a in acts:
            if isinstance(a, Copy):
                assert a.src is None or a.key in self.have[a.src], (a, acts)
                self.have[a.dst].add(a.key)
            else:
                assert a.key in self.have[a.tier], (a, acts)
                self.have[a.tier].discard(a.key)

    def check(self, d: TierDirector) -> None:
        for t in TIERS:
            assert self.have[t] == set(d.tiers[t]), t


@pytest.mark.parametrize("write", ["write-through", "write-back", "selective:2"])
@pytest.mark.parametrize("eviction", ["lru", "arc", "s3fifo"])
@settings(max_examples=15, deadline=None)
@given(reqs=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), max_size=60))
def test_director_invariants(write, eviction, reqs):
    d = TierDirector([3, 6, 10], eviction=eviction, write=write)
    m = ByteModel()
    for keys in reqs:
        tiers = d.lookup(keys)
        acts = []
        for k, t in zip(keys, tiers):
            acts += d.admit(k, t)
        for k in keys[len(tiers):]:
            acts += d.admit(k, None)
        m.run(acts)
        m.check(d)
        for t in TIERS:
            assert d.resident(t) <= d.capacity(t)
        assert d.locate(keys[-1]) == Tier.DRAM
    m.run(d.flush())
    m.check(d)


def test_director_cascade_write_back_and_demotion():
    d = TierDirector([1, 1, 1], write="write-back", demotion=AlwaysDemote())
    assert d.admit("a") == [Copy("a", None, Tier.DRAM)]  # write-back: no SSD write yet
    acts = d.admit("b")
    assert acts == [Copy("a", Tier.DRAM, Tier.SSD), Drop("a", Tier.DRAM), Copy("b", None, Tier.DRAM)]
    acts = d.admit("c")  # b goes to SSD, a is demoted to the capacity pool
    assert acts == [Copy("a", Tier.SSD, Tier.CAPACITY), Drop("a", Tier.SSD), Copy("b", Tier.DRAM, Tier.SSD),
                    Drop("b", Tier.DRAM), Copy("c", None, Tier.DRAM)]
    assert d.lookup(["a"]) == [Tier.CAPACITY]
    # flush writes c back; the SSD pool (1 block) demotes b, which pushes a out of the capacity pool
    assert d.flush() == [Drop("a", Tier.CAPACITY), Copy("b", Tier.SSD, Tier.CAPACITY), Drop("b", Tier.SSD),
                         Copy("c", Tier.DRAM, Tier.SSD)]


def test_director_never_demote_drops():
    d = TierDirector([0, 1, 4], demotion=NeverDemote())
    d.admit("a")
    assert d.admit("b") == [Drop("a", Tier.SSD), Copy("b", None, Tier.SSD)]
    assert d.locate("a") is None


def test_director_selective_admission_counts_sightings():
    d = TierDirector([0, 8, 0], write="selective:2")
    d.lookup(["a"])
    assert d.admit("a") == []  # seen once: not worth an SSD write
    d.lookup(["a"])
    assert d.admit("a") == [Copy("a", None, Tier.SSD)]


def test_director_lost_resize_restore_evict():
    d = TierDirector([2, 4, 4])
    for k in "abcd":
        d.admit(k)
    d.lost("a", Tier.SSD)
    assert d.locate("a") is None and d.counters["lost_ssd"] == 1
    acts = d.resize(Tier.SSD, 1)
    assert sum(isinstance(a, Drop) and a.tier == Tier.SSD for a in acts) == 2
    assert d.resident(Tier.SSD) == 1
    d2 = TierDirector([0, 2, 0])
    assert d2.restore(Tier.SSD, ["x", "y", "z"]) == [Drop("x", Tier.SSD)]
    assert d2.evict("y", Tier.SSD) == [Drop("y", Tier.SSD)] and d2.locate("y") is None
    with pytest.raises(ValueError):
        TierDirector([1, 0, 4])
