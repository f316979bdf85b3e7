"""Bad input: hypothesis fuzz of KVStore's public calls and of the CLI's arguments (the campaign's
fixed API and CLI cases run in test_bench_faults)."""

from __future__ import annotations

import contextlib
import io
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvswarm import KVStore, KVSwarmError
from kvswarm.cli import build_parser, main


keys = st.one_of(st.binary(max_size=40), st.binary(min_size=1, max_size=3), st.text(max_size=5), st.integers(),
                 st.none())
datas = st.one_of(st.binary(max_size=70_000), st.binary(max_size=10), st.text(max_size=5), st.integers(), st.none())
ops = st.lists(st.tuples(st.sampled_from(["put", "get", "delete", "flush", "get_many"]), keys, datas),
               min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_fuzz_public_api(tmp_path_factory, ops):
    root = tmp_path_factory.mktemp("fuzz")
    drives = [str(root / "a"), str(root / "b")]
    for p in drives:
        os.makedirs(p)
    model: dict[bytes, bytes] = {}
    with KVStore.open(drives, capacity_per_drive=2 << 20, buffer_pool_bytes=4 << 20, stripe_unit=16384) as s:
        for op, k, d in ops:
            valid_key, valid_data = isinstance(k, bytes), isinstance(d, bytes)
            try:
                if op == "put":
                    if s.put(k, d) and valid_key and valid_data:
                        model[k] = d
                elif op == "get":
                    got = s.get(k)
                    if valid_key:
                        assert got == model.get(k)
                elif op == "get_many":
                    with s.get_many([k, k]) as r:
                        if valid_key:
                            assert [None if v is None else bytes(v) for v in r.views] == [model.get(k)] * 2
                elif op == "delete":
                    s.delete(k)
                    if valid_key:
                        model.pop(k, None)
                else:
                    s.flush()
            except KVSwarmError:
                pass
            except TypeError:
                assert not (valid_key and (valid_data or op != "put")), "TypeError for arguments of the right type"
        s.flush()
    with KVStore.open(drives, capacity_per_drive=2 << 20, buffer_pool_bytes=4 << 20, stripe_unit=16384) as s:
        for k, d in model.items():
            assert s.get(k) == d


BENCH_IO_OPTS = ["--sizes", "--data-mib", "--seconds", "--rounds", "--backends", "--dirs", "--dir", "--drives",
                 "--cap-mbps", "--cap-iops", "--emulation", "--reopen", "--seed"]
values = st.one_of(st.sampled_from(["0", "-1", "abc", "4k", "4097", "1e999", "nan", "inf", "", ",", "threads",
                                    "uring,foo", "/nonexistent", "/etc/hostname", "lots", "1m", "-4k"]),
                   st.text(max_size=6))


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(st.sampled_from(BENCH_IO_OPTS), values), min_size=1, max_size=4))
def test_fuzz_bench_io_arguments_never_traceback(pairs):
    """Parsing only (a valid set would start the benchmark): accepted, or exit 2 with one line."""
    argv = ["bench", "io"] + [f"{o}={v}" for o, v in pairs]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as e:
            assert e.code == 2
            assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_stats_arguments(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("stats")
    drives = [str(root / "a"), str(root / "b")]
    for p in drives:
        os.makedirs(p)
    with KVStore.open(drives, capacity_per_drive=1 << 20, buffer_pool_bytes=4 << 20) as s:
        s.put(b"k", b"v")
    (root / "f").write_text("x")
    pool = drives + [str(root / "f"), str(root / "none"), str(root), ""]
    paths = data.draw(st.lists(st.sampled_from(pool), max_size=3))
    opts = data.draw(st.lists(st.sampled_from([["--json"], ["--prometheus"], ["--scrub", "0"], ["--scrub", "-1"],
                                               ["--scrub", "x"], ["--backend", "uring"], ["--backend", "x"],
                                               ["--meta-dir", str(root / "none")], ["--meta-dir", drives[0]]]),
                                max_size=3))
    argv = ["stats", *paths, *[a for o in opts for a in o]]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    if rc != 0:
        assert len(err.getvalue().strip().splitlines()) == 1, (argv, err.getvalue())
