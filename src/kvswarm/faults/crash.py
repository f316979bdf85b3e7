"""kill -9 of a writer process (at a random moment or at a named step), optionally followed by a
power cut of the file system it wrote to; then the store is reopened and every key checked against
what may have survived: every flushed write, and of later writes the old value or the new one."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from kvswarm.faults.outcome import Read, Tally, read_back
from kvswarm.faults.sandbox import Sandbox, child_env
from kvswarm.faults.writer import ops

START_S = 120.0  # a writer's start-up (imports) on a busy machine


class Writer:
    """A running :mod:`kvswarm.faults.writer` child whose output lines are read as they come."""

    def __init__(self, cfg: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvswarm.faults.writer", json.dumps(cfg)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_for(self, match: Callable[[str], bool], timeout: float) -> bool:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    return False
                continue
            self.seen.append(line)
            if match(line):
                return True
        return False

    def kill(self) -> str:
        """SIGKILL it; returns its stderr if it had died by itself first."""
        died = self.proc.poll() is not None
        if not died:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._reader.join(10)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        err = self.proc.stderr.read()
        self.proc.stderr.close()
        return err if died else ""

    def rounds(self) -> tuple[int | None, int | None]:
        """(last round begun, last round flushed) by what it printed."""
        begun = [int(s.split()[2]) for s in self.seen if s.startswith("AT ")]
        flushed = [int(s.split()[1]) for s in self.seen if s.startswith("FLUSHED ")]
        return (max(begun) if begun else None), (max(flushed) if flushed else None)


class History:
    """Which values each key may hold after a crash: it starts from what the last check read (durable,
    as the check closed the store); rounds up to the last flushed one are durable; later ones may or
    may not have landed, each key on its own."""

    def __init__(self, nkeys: int) -> None:
        self.nkeys = nkeys
        self.known: list[int | None] = [None] * nkeys

    def allowed(self, start: int, last: int | None, durable: int | None) -> list[set[int | None]]:
        seqs: list[list[tuple[int, int | None]]] = [[(start - 1, v)] for v in self.known]
        for r in range(start, (last if last is not None else start - 1) + 1):
            for k, op in ops(r, self.nkeys):
                seqs[k].append((r, r if op == "put" else None))
        out = []
        for seq in seqs:
            first = 0
            if durable is not None:
                first = max(i for i, (r, _) in enumerate(seq) if r <= durable)
            out.append({v for _, v in seq[first:]})
        return out

    def observe(self, reads: list[Read]) -> None:
        self.known = [r.version if r.kind == "data" else None for r in reads]


def crash_series(root: str, sandbox: Sandbox, tally: Tally, kills: int, rng: random.Random,
                 points: tuple[str | None, ...] = (None,), backend: str = "threads",
                 power_cut: Callable[[], None] | None = None, label: str = "crash") -> None:
    """``kills`` writer crashes on one store under ``root``: at a random moment (None), at the named
    steps of :data:`kvswarm.faults.writer.STEPS` (within 3 ms of starting one) or "checkpointed" (as
    soon as a checkpoint returned), in turn; ``power_cut`` (if given) runs after each kill, before the
    check."""
    drives = [os.path.join(root, f"d{i}") for i in range(3)]
    for p in drives:
        os.makedirs(p, exist_ok=True)
    nkeys = 40
    cfg = {"drives": drives, "nkeys": nkeys, "backend": backend, "capacity": 16 << 20}
    hist = History(nkeys)
    start = 0
    for i in range(kills):
        point = points[i % len(points)]
        w = Writer(cfg | {"start": start})
        what = f"{label} {i} at {point or 'random'} from round {start}"
        try:
            if not w.wait_for(lambda s: s == "OPEN", START_S):
                tally.add("raw_exceptions", example=f"{what}: writer did not start: {w.kill()[-300:]}")
                return
            if point is None:
                time.sleep(rng.uniform(0.0, 0.8))
            else:
                line = "CHECKPOINTED " if point == "checkpointed" else f"AT {point} "
                for _ in range(1 + rng.randrange(3)):  # its 1st, 2nd or 3rd time there
                    if not w.wait_for(lambda s: s.startswith(line), 30.0):
                        break
                if point != "checkpointed":
                    time.sleep(rng.uniform(0.0, 0.003))
        finally:
            err = w.kill()
        if err:
            cls = "clear_errors" if "kvswarm.errors" in err else "raw_exceptions"
            tally.add(cls, example=f"{what}: writer died: {err.strip().splitlines()[-1][:200]}")
        tally.injected(f"{label}:{point or 'random'}")
        if power_cut is not None:
            power_cut()
        last, durable = w.rounds()
        res = sandbox.call(read_back, cfg, nkeys, timeout=60)
        if not tally.call(res, what):
            if res.clear:  # a store that no longer opens after a crash has lost every flushed object
                tally.add("lost_flushed", sum(v is not None for v in hist.known), example=f"{what}: {res.error}")
            return
        tally.judge(res.value, hist.allowed(start, last, durable), what)
        hist.observe(res.value)
        start = (last if last is not None else start - 1) + 1
