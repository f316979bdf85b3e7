"""argparse ``type=`` validators shared by the subcommands: a bad value is argparse's one-line
error before anything runs."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable


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
