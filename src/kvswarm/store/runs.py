"""An object's bytes as one buffer or as runs of one (an engine's page spread over its KV pool)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from kvswarm.errors import ConfigError


class Runs(NamedTuple):
    """An object's bytes as runs of one buffer, in order: ``base[off[k]:off[k] + lens[k]]`` (an
    engine's page in its KV pool).  A few arrays per object rather than a Python object per run:
    SGLang's process holds millions of objects, and a thousand runs per call set off full garbage
    collections that stalled its restores 300 ms every third call."""

    base: memoryview
    off: np.ndarray  # int64
    lens: np.ndarray  # int64


Bufs = memoryview | Runs  # one buffer, or runs an object spans in order


def as_bufs(obj: object, into: bool = False) -> Bufs:
    """An object's bytes (``into``: a buffer to read into) as one flat view, or its Runs.  Data in a
    strided (non-contiguous) array is stored as a copy in C order; a strided buffer cannot be read into."""
    if isinstance(obj, Runs):
        return Runs(memoryview(obj.base).cast("B"), np.ascontiguousarray(obj.off, np.int64),
                    np.ascontiguousarray(obj.lens, np.int64))  # the native worker reads them as C arrays
    try:
        mv = memoryview(obj)
    except TypeError as e:
        raise ConfigError(f"{type(obj).__name__} is not a bytes-like object") from e
    if not mv.c_contiguous:
        if into:
            raise ConfigError("a buffer to read into must be contiguous")
        mv = memoryview(mv.tobytes())
    return mv.cast("B")


def bufs_len(d: Bufs) -> int:
    return int(d.lens.sum()) if isinstance(d, Runs) else len(d)


def sized(into: list[Bufs | None], lengths: np.ndarray) -> list[Bufs | None]:
    """The caller's buffers that fit their payloads exactly; None for the others."""
    return [b if b is not None and bufs_len(b) == n else None for b, n in zip(into, lengths.tolist())]


def part_of(d: Bufs, start: int, n: int) -> Bufs:
    """Bytes [start, start + n) of an object's buffer or runs: one extent's share of it."""
    if not isinstance(d, Runs):
        return d[start:start + n]
    ends = np.cumsum(d.lens)
    n = min(n, int(ends[-1]) - start)  # like a slice, the last part may be short
    first, last = int(np.searchsorted(ends, start, "right")), int(np.searchsorted(ends, start + n, "left"))
    off, lens = d.off[first:last + 1].copy(), d.lens[first:last + 1].copy()
    cut = start - int(ends[first] - d.lens[first])  # bytes of the first run before start
    off[0] += cut
    lens[0] -= cut
    lens[-1] -= int(ends[last]) - (start + n)  # bytes of the last run after the end
    return Runs(d.base, off, lens)


def runs_of(d: Bufs) -> Iterable[tuple[np.ndarray, int]]:
    """``(uint8 array, length)`` of each run, in order."""
    if isinstance(d, Runs):
        base = np.frombuffer(d.base, np.uint8)
        return ((base[o:o + n], n) for o, n in zip(d.off.tolist(), d.lens.tolist()))
    return ((np.frombuffer(d, np.uint8), len(d)),)


