"""The fault campaign: each ``run_*`` injects one kind of fault some number of times and counts the
outcomes in a :class:`~kvswarm.faults.outcome.Tally`.  ``run_campaign`` runs them all (the tests
run each with small counts; ``kvswarm bench faults`` with the counts of its options)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import xxhash

from kvswarm.drive import DATA_FILE
from kvswarm.faults import corrupt, inputs, scenarios
from kvswarm.faults.crash import Writer, crash_series
from kvswarm.faults.loopfs import LoopDevice, LoopFS
from kvswarm.faults.outcome import Tally, read_back
from kvswarm.faults.sandbox import Sandbox, child_env
from kvswarm.faults.writer import STEPS
from kvswarm.store import WRITER_LOCK

CALL_S = 60.0  # the bound on one sandboxed step; past it, a hang


@dataclass(frozen=True)
class Plan:
    """How many injections of each kind."""

    crashes: int = 30  # kill -9 at random moments and at named steps
    power_cuts: int = 10  # kill -9, then the file system shut down without its log flushed
    corruptions: int = 200
    enospc: int = 6
    eio: int = 6
    race_s: float = 3.0  # seconds of each race (threads, follower)
    seed: int = 0


def _errors(tally: Tally, errors: list, what: str) -> None:
    for step, err, clear in errors:
        tally.add("clear_errors" if clear else "raw_exceptions", example=f"{what}: {step}: {err}")


def _fingerprint(root: str) -> dict[str, int]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f != WRITER_LOCK:
                p = os.path.join(d, f)
                with open(p, "rb") as fh:
                    out[p] = xxhash.xxh64_intdigest(fh.read())
    return out


# ---- crashes ----------------------------------------------------------------------------------
def run_crashes(root: str, sb: Sandbox, tally: Tally, n: int, rng: random.Random) -> None:
    points = (None, *STEPS)
    crash_series(os.path.join(root, "crash"), sb, tally, n, rng, points=points)


def run_power_cuts(root: str, sb: Sandbox, tally: Tally, n: int, rng: random.Random) -> None:
    with LoopFS(os.path.join(root, "powercut"), size_mib=96) as fs:
        crash_series(fs.mnt, sb, tally, n, rng, points=(None, "put", "flush", "checkpointed", "checkpoint"),
                     power_cut=fs.power_cut, label="power_cut")


# ---- corruption --------------------------------------------------------------------------------
NKEYS, OVERWRITE, DELETE = 48, 24, 8


def _expected(lossy: bool) -> list[set[int | None]]:
    """Keys' versions in the corruption template (see scenarios.build); lossy: or any older state."""
    out = []
    for k in range(NKEYS):
        final = None if k >= NKEYS - DELETE else 2 if k < OVERWRITE else 1
        out.append({final, 1} if lossy else {final})
    return out


def run_corruptions(root: str, sb: Sandbox, tally: Tally, n: int, rng: random.Random) -> None:
    store, pristine = os.path.join(root, "corrupt", "store"), os.path.join(root, "corrupt", "pristine")
    drives = [os.path.join(store, f"d{i}") for i in range(3)]
    for p in drives:
        os.makedirs(p)
    cfg = {"drives": drives, "capacity": 2 << 20}
    # Built by a process that dies after its last flush, so the journal holds the changes after the checkpoint.
    subprocess.run([sys.executable, "-c", "import json, sys; from kvswarm.faults.scenarios import build; "
                    "build(json.loads(sys.argv[1]), %d, %d, %d, close=False)" % (NKEYS, OVERWRITE, DELETE),
                    json.dumps(cfg)], check=True, env=child_env(), timeout=300)
    shutil.copytree(store, pristine)
    layout = corrupt.Layout(drives, drives[0])
    kinds = list(corrupt.KINDS)
    done = 0
    for i in range(n * 3):
        if done >= n:
            break
        kind = kinds[i % len(kinds)]
        shutil.rmtree(store)
        shutil.copytree(pristine, store)
        what = corrupt.KINDS[kind](layout, rng)
        if what is None:
            continue
        done += 1
        tally.injected(f"corrupt:{kind}")
        before = _fingerprint(store)
        res = sb.call(read_back, cfg, NKEYS, timeout=CALL_S)
        if tally.call(res, f"{kind}: {what}"):
            tally.judge(res.value, _expected(kind in corrupt.LOSSY), f"{kind}: {what}", lossy=kind in corrupt.LOSSY)
        elif res.clear and _fingerprint(store) != before:
            tally.add("refused_changed", example=f"{kind}: {what}: {res.error}")


# ---- full file systems -------------------------------------------------------------------------
def _dig_holes(path: str) -> None:
    """Make a preallocated data file sparse where it holds zeros (as a sparse copy of a store does)."""
    subprocess.run(["fallocate", "--dig-holes", path], check=True, capture_output=True)


def _reopened(sb: Sandbox, tally: Tally, cfg: dict, allowed: list[set[int | None]], what: str) -> None:
    res = sb.call(read_back, cfg, len(allowed), timeout=CALL_S)
    if tally.call(res, what + " (reopened)"):
        tally.judge(res.value, allowed, what + " (reopened)")


def _data_full(base: str, fs: LoopFS, sb: Sandbox, tally: Tally, what: str) -> None:
    """Data files made sparse on a full file system: puts there are refused, the rest stays readable."""
    drives = [os.path.join(fs.mnt, f"d{j}") for j in range(2)]
    # the catalog elsewhere: only the data writes meet the full file system
    cfg = {"drives": drives, "meta_dir": os.path.join(base, "meta"), "capacity": 8 << 20}
    for p in drives:
        os.makedirs(p)
    if not tally.call(sb.call(scenarios.build, cfg, 24, 0, 0, False), what):
        return
    for p in drives:
        _dig_holes(os.path.join(p, DATA_FILE))
    filler = fs.fill()
    res = sb.call(scenarios.write_until_full, cfg, 24, 400, timeout=CALL_S)
    os.unlink(filler)
    if not tally.call(res, what):
        return
    _errors(tally, res.value["errors"], what)
    tally.judge(res.value["reads"], [{1}] * 24, what + " (still open)")
    if res.value["unhealthy"]:
        tally.add("full_drive_failed", example=what)
    stored = set(res.value["stored"])
    _reopened(sb, tally, cfg, [{1} if k < 24 or k in stored else {1, None} for k in range(424)], what)


def _meta_full(base: str, fs: LoopFS, sb: Sandbox, tally: Tally, what: str) -> None:
    """The catalog's file system full: put, flush, checkpoint and close are clear errors, nothing lost."""
    drives = [os.path.join(base, f"d{j}") for j in range(2)]
    cfg = {"drives": drives, "meta_dir": os.path.join(fs.mnt, "meta"), "capacity": 8 << 20}
    for p in drives:
        os.makedirs(p)
    if not tally.call(sb.call(scenarios.build, cfg, 24, 0, 0, False), what):
        return
    filler = fs.fill()
    res = sb.call(scenarios.meta_full, cfg, 24, 40, timeout=CALL_S)
    os.unlink(filler)
    if tally.call(res, what):
        _errors(tally, res.value["errors"], what)
        tally.judge(res.value["reads"], [{1}] * 24, what + " (still open)")
    _reopened(sb, tally, cfg, [{1} if k < 24 else {1, None} for k in range(64)], what)


def _create_full(base: str, fs: LoopFS, sb: Sandbox, tally: Tally, what: str) -> None:
    """A new store larger than its file system is refused, and the corrected retry works."""
    drives = [os.path.join(fs.mnt, f"d{j}") for j in range(2)]
    cfg = {"drives": drives, "capacity": 4 << 20}
    for p in drives:
        os.makedirs(p)
    res = sb.call(scenarios.create_retry, cfg, 64 << 20, timeout=CALL_S)
    if not tally.call(res, what):
        return
    _errors(tally, res.value["errors"], what)
    if not res.value["refused"]:
        tally.add("oversized_accepted", example=what)
    tally.judge(res.value["reads"], [{1}] * len(res.value["reads"]), what)
    if res.value["reads"]:
        _reopened(sb, tally, cfg, [{1}] * 8, what)


def run_enospc(root: str, sb: Sandbox, tally: Tally, n: int, rng: random.Random) -> None:
    kinds = {"data_full": _data_full, "meta_full": _meta_full, "create_full": _create_full}
    for i in range(n):
        kind = list(kinds)[i % len(kinds)]
        base = os.path.join(root, f"enospc{i}")
        os.makedirs(base)
        tally.injected(f"enospc:{kind}")
        with LoopFS(base, size_mib=24) as fs:
            kinds[kind](base, fs, sb, tally, f"enospc {kind} #{i}")


# ---- failing devices ---------------------------------------------------------------------------
def run_eio(root: str, sb: Sandbox, tally: Tally, n: int, rng: random.Random) -> None:
    kinds = ("block_device_at_open", "block_device_while_open", "directory_while_open")
    for i in range(n):
        kind = kinds[i % len(kinds)]
        base = os.path.join(root, f"eio{i}")
        healthy = os.path.join(base, "d0")
        os.makedirs(healthy)
        tally.injected(f"eio:{kind}")
        what = f"eio {kind} #{i}"
        with LoopFS(os.path.join(base, "outer"), size_mib=48) as fs:
            dev = None
            try:
                if kind.startswith("block_device"):
                    backing = os.path.join(fs.mnt, "blk.img")
                    with open(backing, "wb") as f:
                        f.truncate(16 << 20)
                    dev = LoopDevice(backing)
                    bad = dev.path
                else:
                    bad = os.path.join(fs.mnt, "d1")
                    os.makedirs(bad)
                cfg = {"drives": [healthy, bad], "capacity": 8 << 20}
                nk = 24
                if kind == "block_device_at_open":
                    if not tally.call(sb.call(scenarios.build, cfg, nk, 0, 0, False), what):
                        continue
                    fs.shutdown()
                    for attempt in range(2):  # twice: a refused open leaks nothing
                        res = sb.call(read_back, cfg, nk, timeout=CALL_S)
                        if tally.call(res, f"{what} open {attempt}"):
                            tally.judge(res.value, [{1}] * nk, what)
                else:
                    res = sb.call(scenarios.eio_while_open, cfg, nk, fs.mnt, timeout=CALL_S)
                    if tally.call(res, what):
                        _errors(tally, res.value["errors"], what)
                        tally.judge(res.value["reads"], [{1}] * nk, what)
                        tally.judge(res.value["again"], [{1}] * nk, what + " (after writes)")
            finally:
                if dev is not None:
                    dev.close()


# ---- races -------------------------------------------------------------------------------------
def run_races(root: str, sb: Sandbox, tally: Tally, seconds: float) -> None:
    drives = [os.path.join(root, "race", f"d{i}") for i in range(3)]
    for p in drives:
        os.makedirs(p)
    cfg = {"drives": drives, "capacity": 32 << 20}
    tally.injected("race:threads")
    res = sb.call(scenarios.thread_race, cfg, 32, 4, seconds, timeout=CALL_S + seconds)
    if tally.call(res, "thread race"):
        v = res.value
        tally.add("race_reads", v["reads"])
        tally.add("wrong_bytes", v["wrong"], example="thread race: a read of no written version")
        for err, clear in v["errors"]:
            tally.add("clear_errors" if clear else "raw_exceptions", example=f"thread race: {err}")
        tally.judge(v["final"], [set()] * 32, "thread race (final)", lossy=True)
    fdrives = [os.path.join(root, "follow", f"d{i}") for i in range(3)]
    for p in fdrives:
        os.makedirs(p)
    fcfg = {"drives": fdrives, "nkeys": 40, "capacity": 16 << 20, "start": 0, "checkpoint_every": 50}
    tally.injected("race:follower")
    w = Writer(fcfg)
    try:
        if not w.wait_for(lambda s: s.startswith("FLUSHED"), 120):
            tally.add("raw_exceptions", example=f"follower race: writer did not start: {w.kill()[-300:]}")
            return
        res = sb.call(scenarios.follow_race, fcfg, 40, seconds, timeout=CALL_S + seconds)
    finally:
        err = w.kill()
    if err:
        tally.add("raw_exceptions", example=f"follower race: writer died: {err.strip().splitlines()[-1][:200]}")
    if tally.call(res, "follower race"):
        tally.add("race_reads", res.value["reads"])
        tally.add("wrong_bytes", res.value["wrong"], example="follower race: a read of no written version")


# ---- bad input ---------------------------------------------------------------------------------
def run_bad_inputs(root: str, sb: Sandbox, tally: Tally) -> None:
    base = os.path.join(root, "inputs")
    os.makedirs(base)
    for i, case in enumerate(inputs.API_CASES):
        tally.injected("bad_input:api")
        res = sb.call(inputs.run_api_case, i, os.path.join(base, f"api{i}"), timeout=CALL_S)
        if tally.call(res, f"api {case.name}"):
            outcome, err, unchanged = res.value
            if outcome == "raw":
                tally.add("raw_exceptions", example=f"api {case.name}: {err}")
            else:
                tally.add(f"api_{outcome}")
            if not unchanged:
                tally.add("refused_changed", example=f"api {case.name}: the store changed")
    fixtures = inputs.cli_fixtures(os.path.join(base, "cli"))
    try:
        for argv in inputs.cli_cases(fixtures):
            tally.injected("bad_input:cli")
            res = sb.call(inputs.run_cli, argv, timeout=CALL_S)
            if not tally.call(res, f"cli {argv}"):
                continue
            rc, err, traceback = res.value
            if traceback:
                tally.add("cli_tracebacks", example=f"kvswarm {' '.join(argv)}: {err[-300:]}")
            elif rc == 0:
                tally.add("cli_accepted", example=f"kvswarm {' '.join(argv)}")
            elif len(err.strip().splitlines()) != 1:
                tally.add("cli_unclear", example=f"kvswarm {' '.join(argv)}: {err[-300:]}")
            else:
                tally.add("cli_clear_errors")
    finally:
        fixtures.close()


def run_campaign(root: str, plan: Plan, progress=None) -> tuple[Tally, dict[str, float]]:
    """Every kind of fault, as many times as ``plan`` says; returns the tally and seconds per part."""
    rng = random.Random(plan.seed)
    tally = Tally()
    seconds: dict[str, float] = {}
    parts = [
        ("crashes", lambda sb: run_crashes(root, sb, tally, plan.crashes, rng)),
        ("power_cuts", lambda sb: run_power_cuts(root, sb, tally, plan.power_cuts, rng)),
        ("corruptions", lambda sb: run_corruptions(root, sb, tally, plan.corruptions, rng)),
        ("enospc", lambda sb: run_enospc(root, sb, tally, plan.enospc, rng)),
        ("eio", lambda sb: run_eio(root, sb, tally, plan.eio, rng)),
        ("races", lambda sb: run_races(root, sb, tally, plan.race_s)),
        ("bad_inputs", lambda sb: run_bad_inputs(root, sb, tally)),
    ]
    with Sandbox() as sb:
        for name, part in parts:
            if progress:
                progress(name)
            t0 = time.perf_counter()
            part(sb)
            seconds[name] = time.perf_counter() - t0
    return tally, seconds
