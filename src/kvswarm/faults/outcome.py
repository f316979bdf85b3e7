"""What a fault ended in, counted: exact bytes, a counted miss, a clear error, or one of the five
failures that must never happen (wrong bytes, a lost flushed object, a hang, a raw exception, a CLI
traceback)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvswarm.faults.payloads import key, version_of
from kvswarm.faults.sandbox import Result
from kvswarm.faults.writer import store_config
from kvswarm.store import KVStore

# Counters that must stay 0 on a correct store.
MUST_BE_ZERO = ("wrong_bytes", "lost_flushed", "hangs", "raw_exceptions", "cli_tracebacks")


@dataclass(frozen=True)
class Read:
    """One key read back: ``kind`` is "data" (``version`` is what it holds), "wrong" (bytes of no
    version of it), "counted" (a miss the store counted as failed) or "miss" (not there).

    A version older than a flush made durable (or a key whose delete was flushed) is a lost flushed
    write, not wrong bytes: the bytes are exactly what an earlier write wrote."""

    kind: str
    version: int | None = None


def read_back(cfg: dict, nkeys: int) -> list[Read]:
    """Open the store of ``cfg`` (see :func:`kvswarm.faults.writer.store_config`), read keys
    0..nkeys-1 and close it (sandbox side)."""
    s = KVStore(store_config(cfg))
    try:
        return read_open(s, nkeys)
    finally:
        s.close()


def read_open(s: KVStore, nkeys: int, keys: list[int] | None = None) -> list[Read]:
    ks = list(range(nkeys)) if keys is None else keys
    with s.get_many([key(k) for k in ks]) as r:
        failed = set(r.failed)
        out = []
        for i, (k, v) in enumerate(zip(ks, r.views)):
            if v is None:
                out.append(Read("counted" if i in failed else "miss"))
            else:
                ver = version_of(k, v)
                out.append(Read("data", ver) if ver is not None else Read("wrong"))
        return out


class Tally:
    """Counts per outcome and injections per kind; ``summary()`` is what the campaign reports."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.injections: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}  # a few descriptions per failure, for the report

    def add(self, what: str, n: int = 1, example: str | None = None) -> None:
        self.counts[what] += n
        if example and what in MUST_BE_ZERO + ("refused_changed", "fd_leaks") and n:
            self.examples.setdefault(what, [])
            if len(self.examples[what]) < 5:
                self.examples[what].append(example)

    def injected(self, kind: str) -> None:
        self.injections[kind] += 1

    def call(self, res: Result, what: str) -> bool:
        """Count a sandboxed call's failure modes; True if it returned normally."""
        if res.hang:
            self.add("hangs", example=what)
        elif res.error is not None:
            self.add("clear_errors" if res.clear else "raw_exceptions", example=f"{what}: {res.error}")
        if res.fds_leaked:
            self.add("fd_leaks", res.fds_leaked, example=what)
        return res.ok

    def judge(self, reads: list[Read], allowed: list[set[int | None]], what: str, lossy: bool = False) -> None:
        """Compare each key read back with the versions it may hold (None: absent)."""
        for k, (r, ok) in enumerate(zip(reads, allowed)):
            if r.kind == "wrong":
                self.add("wrong_bytes", example=f"{what}: key {k} read bytes of no version of it")
            elif r.kind == "data" and r.version not in ok and not lossy:  # an older write, or a deleted key back
                self.add("lost_flushed", example=f"{what}: key {k} read version {r.version}, "
                                                 f"allowed {sorted(ok, key=str)}")
            elif r.kind == "data":
                self.add("exact_reads")
            elif r.kind == "counted":
                self.add("counted_misses")
            elif None in ok or lossy:
                self.add("expected_misses")
            else:
                self.add("lost_flushed", example=f"{what}: key {k} missing, allowed {sorted(ok, key=str)}")

    def merge(self, other: Tally) -> None:
        self.counts.update(other.counts)
        self.injections.update(other.injections)
        for k, v in other.examples.items():
            self.examples.setdefault(k, []).extend(v[: 5 - len(self.examples.get(k, []))])

    def summary(self) -> dict:
        out = {k: self.counts.get(k, 0) for k in MUST_BE_ZERO}
        out |= {k: v for k, v in sorted(self.counts.items()) if k not in out}
        return out
