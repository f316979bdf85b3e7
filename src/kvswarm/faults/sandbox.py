"""Run risky calls in a child process with a time bound: a call that does not return in time is a
hang (the child is killed and replaced), an exception comes back as its class and message.

``Sandbox.call(fn, *args, timeout=...)`` takes a module-level function (it is pickled by name) and
returns a :class:`Result`.  The child also counts the file descriptors a call leaves open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import kvswarm
from kvswarm.errors import KVSwarmError


@dataclass(frozen=True)
class Result:
    value: Any = None
    error: str | None = None  # "module.Class: message" of an exception the call raised
    clear: bool = False  # that exception is one of kvswarm's own (kvswarm.errors)
    hang: bool = False  # the call did not return within its time bound
    fds_leaked: int = 0  # descriptors open after the call that were not before

    @property
    def ok(self) -> bool:
        return self.error is None and not self.hang


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _serve(conn) -> None:
    logging.disable(logging.CRITICAL)  # the store logs the faults it meets; the campaign counts them
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        before = _fds()
        try:
            out = Result(value=fn(*args))
        except BaseException as e:  # noqa: BLE001 - every outcome is reported, raw ones counted
            out = Result(error=f"{type(e).__module__}.{type(e).__qualname__}: {e}"[:500],
                         clear=isinstance(e, KVSwarmError))
        leaked = _fds() - before
        if leaked > 0:
            out = Result(out.value, out.error, out.clear, False, leaked)
        conn.send(out)


def child_env() -> dict[str, str]:
    """The environment of a child that must import this very kvswarm."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(kvswarm.__file__)))
    path = os.environ.get("PYTHONPATH", "")
    return os.environ | {"PYTHONPATH": src + (os.pathsep + path if path else "")}


class Sandbox:
    """One worker process at a time (a fresh interpreter, ``python -m kvswarm.faults.sandbox``, talking
    over a pipe pair); ``close()`` (or ``with``) ends it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.restarts = 0

    def _start(self) -> None:
        child_r, parent_w = os.pipe()
        parent_r, child_w = os.pipe()
        self._proc = subprocess.Popen([sys.executable, "-m", "kvswarm.faults.sandbox", str(child_r), str(child_w)],
                                      pass_fds=(child_r, child_w), env=child_env(), stdin=subprocess.DEVNULL)
        os.close(child_r)
        os.close(child_w)
        self._conn = _Duplex(Connection(parent_r, writable=False), Connection(parent_w, readable=False))

    def call(self, fn, *args, timeout: float = 30.0) -> Result:
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                self.restarts += 1
            self._start()
        try:
            self._conn.send((fn, args))
            if self._conn.poll(timeout):
                return self._conn.recv()
        except (EOFError, OSError):  # the worker died (the interpreter itself crashed)
            self._stop()
            return Result(error="the worker process died", clear=False)
        self._stop()
        return Result(hang=True)

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
            self._proc = None

    def close(self) -> None:
        if self._proc is not None:
            self._conn.close()  # the worker sees EOF and returns
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            self._stop()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Duplex:
    """A read end and a write end as one connection."""

    def __init__(self, rx: Connection, tx: Connection) -> None:
        self.rx, self.tx = rx, tx

    def send(self, obj: object) -> None:
        self.tx.send(obj)

    def recv(self) -> Any:
        return self.rx.recv()

    def poll(self, timeout: float) -> bool:
        return self.rx.poll(timeout)

    def close(self) -> None:
        for c in (self.rx, self.tx):
            with contextlib.suppress(OSError):
                c.close()


if __name__ == "__main__":  # the worker: its results must pickle as this module's, not __main__'s
    from kvswarm.faults import sandbox

    sandbox._serve(sandbox._Duplex(sandbox.Connection(int(sys.argv[1]), writable=False),
                                   sandbox.Connection(int(sys.argv[2]), readable=False)))
