"""Argument types and argument groups shared by `kvswarm plan` and its subcommands."""

from __future__ import annotations

import argparse


def floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative numbers, got {text!r}")
    return vals


def ints(text: str) -> list[int]:
    vals = floats(text)
    if any(v != int(v) for v in vals):
        raise argparse.ArgumentTypeError(f"expected whole numbers, got {text!r}")
    return [int(v) for v in vals]


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--catalog", metavar="TOML", help="hardware catalog file (default: the shipped "
                   "kvswarm/data/hardware.toml; copy and edit it to use your prices and drives)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here (plots go next to it)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    from kvswarm.planner.models import PRESETS

    g = p.add_argument_group("model KV layout (a preset, optionally overridden, or all fields for a custom model)")
    g.add_argument("--model", default="Llama-3.1-70B", metavar="NAME",
                   help=f"model preset, one of: {', '.join(PRESETS)} (default %(default)s)")
    g.add_argument("--layers", type=int, help="transformer layers")
    g.add_argument("--kv-heads", type=int, help="KV heads per layer (GQA groups)")
    g.add_argument("--head-dim", type=int, help="dimension of one head")
    g.add_argument("--q-heads", type=int, help="query heads per layer (for attention FLOPs)")
    g.add_argument("--params-b", type=float, help="parameters in billions (for prefill FLOPs)")
    g.add_argument("--dtype", help="KV dtype: bfloat16, float16, float32, float8, int8 (default bfloat16)")
