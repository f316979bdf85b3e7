"""`kvswarm` command line: each subcommand lives in its own module with add_arguments/run.

Bad input is one line on stderr and exit status 2, never a traceback: argparse rejects bad option
values, and :func:`main` turns kvswarm's own errors (and the OSError / ValueError a bad path or
number raises) into ``kvswarm: error: ...``; ``-v`` keeps the traceback for debugging.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvswarm.errors import KVSwarmError

# name -> (module, one-line help). Modules define add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvswarm.demo", "run the main job on an embedded default (temp drives, real model)"),
    "stats": ("kvswarm.stats_cli", "print a store's per-drive metrics (table, JSON or prometheus text)"),
    "trace": ("kvswarm.traces", "record activation traces of the real model decoding real texts"),
    "plan": ("kvswarm.planner.cli", "project performance and cost; recommend a DRAM/SSD/HDD mix"),
    "fsck": ("kvswarm.fsck_cli", "check a store's catalog against its drives; --repair rebuilds it from them"),
    "cluster": ("kvswarm.cluster.cli", "a Mooncake master for a one-machine cluster (up), what a master holds (status)"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "io": ("kvswarm.bench.io_bench", "raw O_DIRECT ceiling vs the store's batched get/put"),
    "io-layers": ("kvswarm.bench.io_layers", "the store's reads against the raw ceiling one layer at a time: "
                  "raw into the store's buffer span, the native ring, its checks, the store"),
    "sparse": ("kvswarm.bench.sparse_bench", "sparse decode from offloaded KV: selectors and placements"),
    "prefix": ("kvswarm.bench.prefix_bench", "prefix reuse: trace replay and real TTFT per tier"),
    "vllm": ("kvswarm.bench.vllm_bench", "vLLM's fs offloading tier vs kvswarm's tier"),
    "serve": ("kvswarm.bench.serve_bench", "a vLLM CPU engine serving the Mooncake trace: TTFT with no offload, "
              "vLLM's fs tier, kvswarm's tier, and after a restart"),
    "sglang": ("kvswarm.bench.sglang_bench", "SGLang's file HiCache backend vs kvswarm's backend"),
    "lmcache": ("kvswarm.bench.lmcache_bench", "LMCache's local disk back end vs kvswarm's storage plugin"),
    "faults": ("kvswarm.bench.faults_bench", "fault campaign: crashes, power cuts, corruption, ENOSPC, EIO, "
               "races and bad input; counts wrong bytes, lost objects, hangs and raw errors"),
    "cluster": ("kvswarm.bench.cluster_bench", "across nodes on Mooncake Store: TTFT, fetch, offload, restart"),
}
# What bad input raises below the CLI: reported in one line, like argparse's own errors.
INPUT_ERRORS = (KVSwarmError, OSError, ValueError)


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str, group: str = "",
         load: bool = True) -> None:
    """Add subcommand ``name``; ``load=False`` lists it without importing its module (some import
    torch, seconds of start-up that a command not run should not cost)."""
    if not load:
        sub.add_parser(name, help=help_, add_help=False)
        return
    options = argparse.ArgumentParser(add_help=False)  # the subcommand's, taken in below as a parent
    try:
        mod = importlib.import_module(module)
        mod.add_arguments(options)  # some import their options' sources lazily
    except ModuleNotFoundError as e:
        if not e.name or module.startswith(e.name):
            return  # subcommand not built in this checkout
        # An optional dependency is missing in this environment (e.g. scipy in the vLLM venv): the
        # other subcommands still work, and this one says what to install.
        missing = e.name
        p = sub.add_parser(name, help=f"{help_} (unavailable here: needs {missing})")
        p.set_defaults(_run=lambda _args: _unavailable(f"{group}{name}", missing))
        return
    p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip(), parents=[options])
    p.set_defaults(_run=mod.run)


def _unavailable(name: str, missing: str) -> int:
    print(f"kvswarm {name}: this environment lacks the Python package {missing!r} "
          f"(install kvswarm with its extras, e.g. pip install 'kvswarm[model,sim]')", file=sys.stderr)
    return 2


def _selected(argv: list[str]) -> tuple[str | None, str | None]:
    """The subcommand (and bench) that ``argv`` names: the top level's only option, -v, takes no value,
    so they are its first two words that are not options."""
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words else None
    return command, (words[1] if command == "bench" and len(words) > 1 else None)


class Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (no usage block), as every other kvswarm error; its
    subcommands' parsers are of this class too."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given ``argv``, only the subcommand it names imports its module."""
    command, bench_name = _selected(argv) if argv is not None else (None, None)
    parser = Parser(prog="kvswarm", description="Many drives as one fast, persistent KV-cache tier.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        _add(sub, name, module, help_, load=argv is None or name == command)
    bench = sub.add_parser("bench", help="benchmarks: baseline and kvswarm side by side, with ratios")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_) in BENCHES.items():
        _add(bsub, name, module, help_, "bench ", load=argv is None or (command == "bench" and name == bench_name))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except INPUT_ERRORS as e:
        if args.verbose:
            raise
        print(f"kvswarm: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
