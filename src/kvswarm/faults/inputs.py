"""Bad input to the API and the CLI.  A case ends well if it raises one of kvswarm's errors, or does
what it must for a legal edge case, and leaves the store as it was; for an argument of the wrong
type or shape (a str for bytes, a 1-tuple for a (key, data) pair) Python's own TypeError or
ValueError counts as clear too.  The CLI's: one line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvswarm.errors import KVSwarmError
from kvswarm.faults.payloads import key, payload
from kvswarm.store import KVStore, StoreConfig

_CAP = 1 << 20


def _store(root: str, **kw) -> KVStore:
    drives = [os.path.join(root, "d0"), os.path.join(root, "d1")]
    for p in drives:
        os.makedirs(p, exist_ok=True)
    return KVStore(StoreConfig(drives=drives, capacity_per_drive=_CAP, buffer_pool_bytes=4 << 20, **kw))


def _drives(root: str) -> list[str]:
    return [os.path.join(root, "d0"), os.path.join(root, "d1")]


def _open(root: str, **kw) -> None:
    KVStore(StoreConfig(drives=kw.pop("drives", _drives(root)), capacity_per_drive=kw.pop("capacity", _CAP),
                        buffer_pool_bytes=kw.pop("pool", 4 << 20), **kw)).close()


def _use(root: str, **kw) -> None:
    """Open a new store with ``kw``, write, read and close it."""
    new = os.path.join(root, "use")
    os.makedirs(new, exist_ok=True)
    s = KVStore(StoreConfig(drives=[new], capacity_per_drive=_CAP, buffer_pool_bytes=4 << 20, **kw))
    try:
        s.put(b"u", b"v")
        s.get(b"u")
    finally:
        s.close()


def _file(root: str, name: str = "f") -> str:
    p = os.path.join(root, name)
    with open(p, "w") as f:
        f.write("not a drive")
    return p


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[KVStore, str], object]  # (an open store of keys 0-4, its root)
    wrong_type: bool = False  # an argument of the wrong type or shape: TypeError / ValueError are clear answers
    on_closed: bool = False  # called after the store is closed


_C = Case
API_CASES: list[Case] = [
    # configurations that cannot work (a store of keys 0-4 exists at root)
    *[_C(f"queue_depth={q}", lambda s, r, q=q: _open(r, queue_depth=q)) for q in (0, -1, -64)],
    *[_C(f"queue_depth={q} {b}, used", lambda s, r, q=q, b=b: _use(r, queue_depth=q, backend=b))
      for q in (0, -1) for b in ("uring", "auto", "threads")],
    *[_C(f"stripe_unit={u}", lambda s, r, u=u: _open(r, stripe_unit=u)) for u in (0, -4096, 100, 4097, 64)],
    *[_C(f"capacity={c}", lambda s, r, c=c: _open(os.path.join(r, "new"), capacity=c,
                                                  drives=[os.path.join(r, "new")]))
      for c in (0, -1, 1000, 4097)],
    *[_C(f"buffer_pool_bytes={b}", lambda s, r, b=b: _open(r, pool=b)) for b in (0, -1, 10**18)],
    _C("checkpoint_every=0", lambda s, r: _open(r, checkpoint_every=0)),
    _C("error_threshold=-1", lambda s, r: _open(r, error_threshold=-1)),
    _C("backend=nosuch", lambda s, r: _open(r, backend="nosuch")),
    _C("backend=''", lambda s, r: _open(r, backend="")),
    _C("placement=nosuch", lambda s, r: _open(r, placement="nosuch")),
    _C("drives=[]", lambda s, r: _open(r, drives=[])),
    _C("drives=str", lambda s, r: _open(r, drives=os.path.join(r, "d0")), wrong_type=True),
    _C("drive missing", lambda s, r: _open(r, drives=[os.path.join(r, "nope")])),
    _C("drive a file", lambda s, r: _open(r, drives=[_file(r)])),
    _C("drive twice", lambda s, r: _open(r, drives=[_drives(r)[0], _drives(r)[0]])),
    _C("drives reordered", lambda s, r: _open(r, drives=_drives(r)[::-1])),
    _C("drive left out", lambda s, r: _open(r, drives=_drives(r)[:1])),
    _C("drive_kinds wrong length", lambda s, r: _open(r, drive_kinds=["ssd"])),
    _C("meta_dir a file", lambda s, r: _open(r, meta_dir=_file(r, "m"))),
    _C("meta_dir under a file", lambda s, r: _open(r, meta_dir=os.path.join(_file(r, "m2"), "x"))),
    _C("create=False, no store", lambda s, r: _open(os.path.join(r, "e"), create=False,
                                                     drives=[os.makedirs(os.path.join(r, "e"), exist_ok=True)
                                                             or os.path.join(r, "e")])),
    _C("second writer", lambda s, r: _open(r)),
    # puts
    *[_C(f"put key {t}", lambda s, r, k=k: s.put(k, b"x"), wrong_type=True)
      for t, k in (("None", None), ("int", 7), ("float", 1.5), ("list", [1]), ("object", object()))],
    *[_C(f"put data {t}", lambda s, r, d=d: s.put(b"k-data", d), wrong_type=True)
      for t, d in (("None", None), ("str", "text"), ("int", 5), ("float", 2.0), ("object", object()),
                   ("list", [1, 2]), ("dict", {}))],
    _C("put noncontiguous array", lambda s, r: s.put(b"k-nc", np.arange(64, dtype=np.uint8)[::2])),
    _C("put too large for the pool", lambda s, r: s.put(b"k-big", bytes(3 << 20))),
    _C("put_many None", lambda s, r: s.put_many(None), wrong_type=True),
    _C("put_many int", lambda s, r: s.put_many(5), wrong_type=True),
    _C("put_many bad tuple", lambda s, r: s.put_many([(b"k",)]), wrong_type=True),
    _C("put_many triple", lambda s, r: s.put_many([(b"k", b"v", b"x")]), wrong_type=True),
    _C("put_many hints too short", lambda s, r: s.put_many([(b"h1", b"v"), (b"h2", b"v")], hints=[None])),
    _C("put pool full", lambda s, r: [s.put(b"fill%d" % i, bytes(200_000)) for i in range(40)]),
    # reads and deletes
    *[_C(f"get key {t}", lambda s, r, k=k: s.get(k), wrong_type=True)
      for t, k in (("None", None), ("int", 3), ("list", [b"a"]))],
    _C("get_many None", lambda s, r: s.get_many(None), wrong_type=True),
    _C("get_many int", lambda s, r: s.get_many(3), wrong_type=True),
    _C("get_many [None]", lambda s, r: s.get_many([None]), wrong_type=True),
    _C("submit_get into wrong length", lambda s, r: s.submit_get([key(0), key(1)], into=[None]).wait(),
       wrong_type=True),
    _C("submit_get into bytes", lambda s, r: s.submit_get([key(0)], into=[bytes(40_000)]).wait()),
    _C("submit_get into too small", lambda s, r: s.submit_get([key(0)], into=[bytearray(8)]).wait()),
    *[_C(f"delete key {t}", lambda s, r, k=k: s.delete(k), wrong_type=True)
      for t, k in (("None", None), ("int", 4), ("float", 0.5))],
    _C("delete_digest short", lambda s, r: s.delete_digest(b"abc")),
    _C("verify garbage digests", lambda s, r: s.verify([b"x" * 16, b"y"])),
    _C("fail_drive 99", lambda s, r: s.fail_drive(99)),
    _C("fail_drive -5", lambda s, r: s.fail_drive(-5)),
    # after close
    _C("put after close", lambda s, r: s.put(b"late", b"v"), on_closed=True),
    _C("get after close", lambda s, r: s.get(key(0)), on_closed=True),
    _C("flush after close", lambda s, r: s.flush(), on_closed=True),
    _C("delete after close", lambda s, r: s.delete(key(0)), on_closed=True),
    _C("checkpoint after close", lambda s, r: s.checkpoint(), on_closed=True),
]


def run_api_case(i: int, root: str) -> tuple[str, str, bool]:
    """Case ``i`` against a store of keys 0-4 under ``root``: (outcome, error, store unchanged), outcome
    one of "clear", "accepted", "raw" (sandbox side)."""
    case = API_CASES[i]
    s = _store(root)
    s.put_many([(key(k), payload(k, 1)) for k in range(5)])
    s.flush()
    if case.on_closed:
        s.close()
    outcome, err = "accepted", ""
    try:
        case.call(s, root)
    except KVSwarmError as e:
        outcome, err = "clear", str(e)
    except (TypeError, ValueError) as e:
        outcome, err = ("clear" if case.wrong_type else "raw"), f"{type(e).__qualname__}: {e}"
    except Exception as e:  # noqa: BLE001 - what the campaign counts
        outcome, err = "raw", f"{type(e).__module__}.{type(e).__qualname__}: {e}"
    if not case.on_closed:
        with contextlib.suppress(Exception):
            s.close()
    try:  # the store is as it was: its objects, exact (a legal put may have added one)
        s = _store(root)
        try:
            unchanged = all(s.get(key(k)) == payload(k, 1) for k in range(5))
        finally:
            s.close()
    except Exception:  # noqa: BLE001
        unchanged = False
    return outcome, err[:300], unchanged


class CliFixtures:
    """Paths for bad invocations: a store, an empty directory, a regular file, a block device."""

    def __init__(self, root: str) -> None:
        from kvswarm.faults.loopfs import LoopDevice

        os.makedirs(root, exist_ok=True)
        self.root = root
        self.drives = [os.path.join(root, f"d{i}") for i in range(2)]
        for p in self.drives:
            os.makedirs(p)
        s = KVStore(StoreConfig(drives=self.drives, capacity_per_drive=_CAP, buffer_pool_bytes=4 << 20))
        s.put(b"k", b"v")
        s.close()
        self.empty = os.path.join(root, "empty")
        os.makedirs(self.empty)
        self.file = _file(root)
        img = os.path.join(root, "blk.img")
        with open(img, "wb") as f:
            f.truncate(4 << 20)
        self.dev: LoopDevice | None = None
        with contextlib.suppress(Exception):  # not root, no loop driver: the other cases still run
            self.dev = LoopDevice(img)

    def close(self) -> None:
        if self.dev is not None:
            self.dev.close()


def cli_fixtures(root: str) -> CliFixtures:
    return CliFixtures(root)


def cli_cases(fx: CliFixtures) -> list[list[str]]:
    """Invocations that must each fail cleanly (and fast: nothing long runs before the check)."""
    d0, d1 = fx.drives
    nowhere = os.path.join(fx.root, "nowhere")
    cases = [
        ["stats", nowhere], ["stats", fx.empty], ["stats", fx.file], ["stats", d1, d0], ["stats", d0],
        ["stats", d0, d1, fx.empty], ["stats", "--scrub", "-5", d0, d1], ["stats", "--scrub", "x", d0, d1],
        ["stats", "--meta-dir", nowhere, d0, d1], ["stats", "--meta-dir", fx.file, d0, d1],
        ["stats", "--backend", "nosuch", d0, d1], ["stats"], ["stats", "/dev/null"], ["stats", d0, d0],
        ["stats", "--meta-dir", fx.empty, d0, d1], ["stats", ""],
        ["bench", "io", "--sizes", "abc"], ["bench", "io", "--sizes", "0"], ["bench", "io", "--sizes", "-4k"],
        ["bench", "io", "--sizes", "4097"], ["bench", "io", "--sizes", ""], ["bench", "io", "--sizes", "1e999"],
        ["bench", "io", "--sizes", "4k,,x"], ["bench", "io", "--reopen", "lots"], ["bench", "io", "--reopen", "0"],
        ["bench", "io", "--reopen", "-1k"], ["bench", "io", "--rounds", "-1"], ["bench", "io", "--rounds", "0"],
        ["bench", "io", "--rounds", "x"], ["bench", "io", "--dir", nowhere], ["bench", "io", "--dir", fx.file],
        ["bench", "io", "--dirs", "0"], ["bench", "io", "--dirs", "-2"], ["bench", "io", "--dirs", "many"],
        ["bench", "io", "--drives", "-1"], ["bench", "io", "--cap-mbps", "0"], ["bench", "io", "--cap-mbps", "nan"],
        ["bench", "io", "--cap-iops", "-5"], ["bench", "io", "--seconds", "0"], ["bench", "io", "--seconds", "inf"],
        ["bench", "io", "--data-mib", "0"], ["bench", "io", "--backends", "foo"], ["bench", "io", "--backends", ","],
        ["bench", "io", "--emulation", "magic"], ["bench", "io", "--nosuch"], ["bench", "nosuch"], ["bench"],
        ["plan", "--model", "nosuch"], ["plan", "--users", "-3"], ["plan", "--dram-gb", "x"],
        ["plan", "--ssd-counts", "-2"], ["plan", "--budget", "-5"], ["plan", "--gpu", "tpu9"],
        ["plan", "--eviction", "mru"], ["plan", "--trace", nowhere], ["plan", "--catalog", nowhere],
        ["plan", "--catalog", fx.file], ["plan", "--block-tokens", "0"], ["plan", "--finalists", "0"],
        ["plan", "scale", "--model", "nosuch"], ["nosuch"], ["--nosuch"], ["stats", "--nosuch", d0],
        ["bench", "faults", "--crashes", "-1"], ["bench", "faults", "--corruptions", "x"],
        ["fsck", nowhere], ["fsck", fx.file], ["fsck", "--stripe-unit", "-1", d0, d1], ["fsck"],
        ["fsck", "--meta-dir", nowhere, d0, d1],
    ]
    if fx.dev is not None:
        cases += [["stats", fx.dev.path], ["stats", fx.dev.path, "--meta-dir", fx.empty]]
    return cases


def run_cli(argv: list[str]) -> tuple[int, str, bool]:
    """``kvswarm argv`` in this process, its output captured: (exit status, stderr, a traceback escaped)
    (sandbox side: what escapes main() is what would print a traceback)."""
    from kvswarm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile("w+") as fd2, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        saved = os.dup(2)
        os.dup2(fd2.fileno(), 2)  # what native code or a subprocess writes to fd 2
        try:
            rc, tb = int(main(argv) or 0), False
        except SystemExit as e:
            rc, tb = (e.code if isinstance(e.code, int) else 1), False
        except BaseException as e:  # noqa: BLE001 - this is the traceback the CLI must never print
            rc, tb = 1, True
            err.write(f"Traceback: {type(e).__name__}: {e}\n")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        fd2.seek(0)
        raw = fd2.read()
    return rc, err.getvalue() + raw, tb
