"""Checks of command-line input shared by the subcommands: argparse ``type=`` validators (a bad value
is argparse's one-line error before anything runs) and :func:`check_drive_paths`."""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Callable

from kvswarm.errors import DriveError, KVSwarmError


def _number(kind: Callable[[str], float], text: str, what: str) -> float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    n = int(_number(int, text, "a whole number"))
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return n


def non_negative_int(text: str) -> int:
    n = int(_number(int, text, "a whole number"))
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def positive_float(text: str) -> float:
    x = _number(float, text, "a number")
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return x


def existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory")
    return text


def comma_list(parse: Callable[[str], int], allow_empty: bool = False) -> Callable[[str], list[int]]:
    """A type for comma-separated values, each checked by ``parse`` (empty items are skipped)."""

    def parse_all(text: str) -> list[int]:
        values = [parse(s) for s in text.split(",") if s.strip()]
        if not values and not allow_empty:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values

    parse_all.__name__ = f"list of {parse.__name__}"
    return parse_all


def check_drive_paths(drives: list[str], meta_dir: str | None) -> None:
    """Say which drive path is wrong, in the terms of the command's options, before a store is opened."""
    for p in drives:
        if not os.path.exists(p):
            raise DriveError(f"drive path {p!r} does not exist")
        if not (os.path.isdir(p) or stat.S_ISBLK(os.stat(p).st_mode)):
            raise DriveError(f"drive path {p!r} is neither a directory nor a block device")
    if meta_dir is not None and not os.path.isdir(meta_dir):
        raise KVSwarmError(f"--meta-dir {meta_dir!r} is not a directory")
    if meta_dir is None and not any(os.path.isdir(p) for p in drives):
        raise KVSwarmError("every drive is a block device: give --meta-dir, the directory of the store's catalog")
