"""`kvswarm` command line: each subcommand lives in its own module with add_arguments/run."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help). Modules define add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvswarm.demo", "run the main job on an embedded default (temp drives, real model)"),
    "stats": ("kvswarm.stats_cli", "print a store's per-drive metrics (table, JSON or prometheus text)"),
    "trace": ("kvswarm.traces", "record activation traces of the real model decoding real texts"),
    "plan": ("kvswarm.planner.cli", "project performance and cost; recommend a DRAM/SSD/HDD mix"),
    "cluster": ("kvswarm.cluster.cli", "a Mooncake master for a one-machine cluster (up), what a master holds (status)"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "io": ("kvswarm.bench.io_bench", "raw O_DIRECT ceiling vs the store's batched get/put"),
    "sparse": ("kvswarm.bench.sparse_bench", "sparse decode from offloaded KV: selectors and placements"),
    "prefix": ("kvswarm.bench.prefix_bench", "prefix reuse: trace replay and real TTFT per tier"),
    "vllm": ("kvswarm.bench.vllm_bench", "vLLM's fs offloading tier vs kvswarm's tier"),
    "sglang": ("kvswarm.bench.sglang_bench", "SGLang's file HiCache backend vs kvswarm's backend"),
    "cluster": ("kvswarm.bench.cluster_bench", "across nodes on Mooncake Store: TTFT, fetch, offload, restart"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str, group: str = "") -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvswarm", description="Many drives as one fast, persistent KV-cache tier.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        _add(sub, name, module, help_)
    bench = sub.add_parser("bench", help="benchmarks: baseline and kvswarm side by side, with ratios")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_) in BENCHES.items():
        _add(bsub, name, module, help_, "bench ")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
