"""Simulator: device models, links, the simulated store's reuse of the store's placement, replay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswarm.format import HEADER_SIZE, key_digest
from kvswarm.sim import DriveSpec, LinkModel, Request, SimStore, SystemModel, measure, pcie_link, replay
from kvswarm.store import KVStore, StoreConfig

MiB = 1 << 20
SSD = DriveSpec("ssd", 2e9, 1e9, 100_000, 50_000, 100e-6, 20e-6, queue_depth=32)
HDD = DriveSpec("hdd", 200e6, 200e6, 200, 400, 12e-3, 12e-3, queue_depth=16, kind="hdd")


def _store(drives, **kw) -> SimStore:
    kw.setdefault("capacity_per_drive", 1 << 34)
    return SimStore(SystemModel(drives, **kw))


def _keys(n: int, prefix: str = "k") -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def test_models_reject_bad_numbers():
    with pytest.raises(ValueError, match="read_bw"):
        DriveSpec("x", -1, 1, 1, 1, 0, 0)
    with pytest.raises(ValueError, match="kind"):
        DriveSpec("x", 1, 1, 1, 1, 0, 0, kind="tape")
    with pytest.raises(ValueError, match="bandwidth"):
        LinkModel("l", 0)
    with pytest.raises(ValueError, match="generation"):
        pcie_link(2, 16)
    with pytest.raises(ValueError, match="at least one drive"):
        SystemModel([])


def test_pcie_link_bandwidth():
    assert pcie_link(4, 16, efficiency=1.0).bandwidth == pytest.approx(31.5e9, rel=0.01)
    assert pcie_link(5, 16, efficiency=1.0).bandwidth == pytest.approx(63.0e9, rel=0.01)


def test_qd1_latency_is_fixed_latency_plus_transfer():
    s = _store([SSD], engine_depth=1)
    s.preload([(b"a", 4096 - HEADER_SIZE)])
    r = replay(s, [Request("get", (b"a",))])
    assert r["mean_io_time_s"] == pytest.approx(SSD.qd1_latency(4096))


@pytest.mark.parametrize("size,limit", [(MiB - HEADER_SIZE, "bw"), (4096 - HEADER_SIZE, "iops")])
def test_ssd_saturates_at_bandwidth_or_iops(size, limit):
    s = _store([SSD], engine_depth=32)
    keys = _keys(2000)
    s.preload([(k, size) for k in keys])
    r = replay(s, [Request("get", tuple(keys[i:i + 200])) for i in range(0, 2000, 200)])
    got = r["throughput_Bps"] if limit == "bw" else r["ops"] / r["elapsed_s"]
    assert got == pytest.approx(SSD.read_bw if limit == "bw" else SSD.read_iops, rel=0.05)


def test_hdd_sequential_reads_skip_positioning():
    keys = _keys(64)
    times = {}
    for order in ("placed", "shuffled"):
        s = _store([HDD], engine_depth=1)
        s.preload([(k, MiB - HEADER_SIZE) for k in keys])  # contiguous on the one drive, in this order
        seq = keys if order == "placed" else keys[::2] + keys[1::2]
        times[order] = replay(s, [Request("get", (k,)) for k in seq])["elapsed_s"]
    xfer = 64 * MiB / HDD.read_bw
    # In placement order only the first read positions; out of order nearly every read does.
    assert times["placed"] == pytest.approx(64 * HDD.fixed_latency(False) + 1 / HDD.read_iops + xfer, rel=0.01)
    assert times["shuffled"] == pytest.approx(times["placed"] + 62 / HDD.read_iops, rel=0.01)


def test_hdd_coalesced_run_positions_once():
    s = _store([HDD], coalesce=True)
    s.preload([(b"big", 64 * MiB)])  # 65 contiguous extents on one drive, read as one op
    t = replay(s, [Request("get", (b"big",))])["mean_io_time_s"]
    assert t == pytest.approx(HDD.fixed_latency(False) + 1 / HDD.read_iops + (64 * MiB + 65 * 4096) / HDD.read_bw,
                              rel=0.01)


def test_host_link_caps_many_drives():
    link = LinkModel("uplink", 5e9)
    thr = []
    for n in (1, 2, 8):
        s = _store([SSD] * n, host_link=link, engine_depth=32, coalesce=True)
        keys = _keys(64 * n)
        s.preload([(k, MiB - HEADER_SIZE) for k in keys])
        thr.append(replay(s, [Request("get", tuple(keys))] * 3)["throughput_Bps"])
    assert thr[0] == pytest.approx(2e9, rel=0.05) and thr[1] == pytest.approx(4e9, rel=0.05)
    assert thr[2] == pytest.approx(5e9, rel=0.05)  # 8 x 2 GB/s of drives behind a 5 GB/s link
    assert s.utilisation()["host_link"] > 0.9


def test_coalesced_matches_per_extent_for_deep_ssd_queues():
    out = []
    for coalesce in (False, True):
        s = _store([SSD] * 4, engine_depth=32, coalesce=coalesce)
        keys = _keys(400)
        s.preload([(k, 256 * 1024 - HEADER_SIZE) for k in keys])
        out.append(replay(s, [Request("get", tuple(keys[i:i + 100])) for i in range(0, 400, 100)]))
    assert out[1]["throughput_Bps"] == pytest.approx(out[0]["throughput_Bps"], rel=0.05)


def test_paced_drive_follows_the_throttle_slices():
    """blk-throttle: each 100 ms window's budget is granted at its start; an idle group starts afresh."""
    d = DriveSpec("thr", 100e6, 100e6, 1e6, 1e6, 0.0, 0.0, queue_depth=64, paced=True, slice_s=0.1)
    s = _store([d], engine_depth=64)
    keys = _keys(35)
    s.preload([(k, MiB - HEADER_SIZE) for k in keys])  # one 1 MiB extent each: 9 fit in a 10 MB window
    r = replay(s, [Request("get", tuple(keys))])
    assert r["elapsed_s"] == pytest.approx(0.3)  # 36.7 MB: the 4th window opens at 0.3 s
    assert sorted(s.op_latencies)[8] == pytest.approx(0.0) and sorted(s.op_latencies)[9] == pytest.approx(0.1)
    s.env.run(until=s.env.now + 1.0)  # idle past the slice end: a fresh slice, a fresh window
    r = replay(s, [Request("get", tuple(keys[:4]))])
    assert r["elapsed_s"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="slice_s"):
        DriveSpec("x", 1, 1, 1, 1, 0, 0, paced=True, slice_s=0)


def test_chunked_engine_runs_a_chunks_ops_in_turn():
    s = _store([SSD], engine_depth=2, chunked=True)
    keys = _keys(4)
    s.preload([(k, 4096 - HEADER_SIZE) for k in keys])
    replay(s, [Request("get", tuple(keys))])
    lat = sorted(s.op_latencies)
    # Two chunks of two ops: a chunk's ops run one after another, each op's latency is its own
    # service time (as the thread engine stamps it), and the batch takes two ops' time.
    assert lat[-1] < 1.5 * lat[0]
    assert s.records[-1].seconds >= 2 * lat[0]


def test_misses_cost_nothing_and_failed_drive_objects_are_misses():
    s = _store([SSD, SSD])
    s.preload([(k, 8192) for k in _keys(4)])
    s.fail_drive(0)
    proc = s.env.process(s.get(_keys(4) + [b"absent"]))
    s.env.run(proc)
    assert proc.value.hits == 2 and proc.value.misses == 3


@pytest.mark.parametrize("placement", ["round_robin", "hash"])
def test_placement_and_extents_match_the_real_store(drive_dirs, placement):
    """The simulator runs the store's own strategy: same drive and extent sizes for every part."""
    drives = drive_dirs(3)
    sizes = [100, 4096, 5000, 300_000, 2 * MiB + 17, 64]
    items = [(f"obj{i}".encode(), n) for i, n in enumerate(sizes)]
    with KVStore(StoreConfig(drives=drives, capacity_per_drive=64 * MiB, stripe_unit=MiB,
                             placement=placement)) as real:
        assert all(real.put_many([(k, bytes(n)) for k, n in items]))
        real_ext = {k: [(d, ln) for d, _, ln, _ in real.catalog.entries[key_digest(k)].extents] for k, _ in items}
    sim = _store([SSD] * 3, capacity_per_drive=64 * MiB, stripe_unit=MiB, placement=placement)
    sim.preload(items)
    sim_ext = {k: [(d, ln) for d, _, ln in sim.catalog[key_digest(k)].extents] for k, _ in items}
    assert sim_ext == real_ext


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3 * MiB), min_size=1, max_size=20), st.integers(1, 6))
def test_simulated_bytes_are_the_extents_on_disk(sizes, n):
    s = _store([SSD] * n, stripe_unit=MiB)
    keys = _keys(len(sizes))
    s.preload(list(zip(keys, sizes)))
    r = replay(s, [Request("get", tuple(keys))])
    unit = MiB - HEADER_SIZE
    want = sum(-(-(HEADER_SIZE + min(unit, x - p * unit)) // 4096) * 4096
               for x in sizes for p in range(max(1, -(-x // unit))))
    assert r["bytes"] == want


def test_measure_and_replay_report_the_same_metrics(drive_dirs):
    drives = drive_dirs(2)
    keys = _keys(16)
    stream = [Request("put", tuple(keys), (8192,) * 16), Request("get", tuple(keys[:8])), Request("get", tuple(keys))]
    with KVStore(StoreConfig(drives=drives, capacity_per_drive=16 * MiB)) as real:
        m = measure(real, stream)
    sim = _store([SSD, SSD])
    s = replay(sim, stream)
    assert set(m) == set(s)
    assert m["bytes"] == s["bytes"] and m["ops"] == s["ops"] and m["batches"] == s["batches"] == 3


def test_empty_stream_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        replay(_store([SSD]), [])
    with pytest.raises(ValueError, match="one size per key"):
        Request("put", (b"a",), ())


def test_sim_times_the_swarm_retrieval_strategies_plans():
    """The retrieval planner's replica choice, timed by the simulator: balancing beats 'primary'."""
    np = pytest.importorskip("numpy")
    sparse = pytest.importorskip("scipy.sparse")
    from kvswarm.swarm.retrieval import DriveModel as PlanModel
    from kvswarm.swarm.retrieval import Retriever

    holders = sparse.identity(12, format="csr")  # entry i lives in piece i
    copies = [[0, 1 + i % 3] for i in range(12)]  # every primary copy on drive 0
    times = {}
    for assign in ("primary", "makespan"):
        r = Retriever(holders, np.full(12, 64), copies, entry_bytes=4096, drives=4,
                      model=PlanModel(SSD.read_bw, SSD.read_iops), assign=assign)
        plan = r.plan(np.arange(12))
        s = _store([SSD] * 4, engine_depth=32)
        proc = s.env.process(s.read(list(zip(plan.drive_of, plan.nbytes))))
        s.env.run(proc)
        times[assign] = proc.value.seconds
        assert proc.value.nbytes == sum(plan.nbytes)
    assert times["makespan"] < 0.5 * times["primary"]


def test_host_cpu_binds_on_one_core_and_spreads_over_several():
    """A CPU-bound store: 20 us per op on one core caps 4 KiB reads at 50k/s whatever the drives do;
    on four cores (the native path's reaping threads) the drives bind again."""
    def rate(cores: int) -> tuple[float, float]:
        s = _store([SSD] * 4, engine_depth=32, cpu_per_op=20e-6, cpu_cores=cores)
        keys = _keys(4000)
        s.preload([(k, 4096 - HEADER_SIZE) for k in keys])
        r = replay(s, [Request("get", tuple(keys[i:i + 100])) for i in range(0, 4000, 100)], concurrency=8)
        return r["ops"] / r["elapsed_s"], s.utilisation()["cpu"]

    one, util1 = rate(1)
    four, util4 = rate(4)
    assert one == pytest.approx(50_000, rel=0.05) and util1 > 0.95
    assert four > 3 * one and util4 <= 1.0
    with pytest.raises(ValueError, match="cpu_cores"):
        SystemModel([SSD], cpu_cores=0)
