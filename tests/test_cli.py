"""The command line: subcommands listed; one whose optional dependency is missing says so
instead of breaking every other subcommand."""

from __future__ import annotations

import argparse

from kvswarm import cli


def test_missing_optional_dependency_hides_nothing_else(tmp_path, monkeypatch, capsys):
    # A subcommand module whose options need a package this environment lacks.
    (tmp_path / "needs_missing_pkg.py").write_text(
        "def add_arguments(p):\n    import kvswarm_no_such_pkg  # noqa: F401\n\ndef run(args):\n    return 0\n")
    (tmp_path / "fine_cmd.py").write_text(
        "def add_arguments(p):\n    p.add_argument('--x', type=int)\n\ndef run(args):\n    return args.x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parser = argparse.ArgumentParser(prog="kvswarm")
    sub = parser.add_subparsers(dest="command")
    cli._add(sub, "broken", "needs_missing_pkg", "needs a package", "bench ")
    cli._add(sub, "fine", "fine_cmd", "works")
    cli._add(sub, "absent", "kvswarm_module_not_in_this_checkout", "not built")
    args = parser.parse_args(["fine", "--x", "7"])
    assert args._run(args) == 7
    args = parser.parse_args(["broken"])
    assert args._run(args) == 2
    assert "kvswarm bench broken: this environment lacks the Python package 'kvswarm_no_such_pkg'" \
        in capsys.readouterr().err
    assert "absent" not in parser.format_help()
