"""Batched asynchronous I/O engines (submit, then poll)."""

from kvswarm.io.base import IOEngine, IORequest, Op, make_engine

__all__ = ["IOEngine", "IORequest", "Op", "make_engine"]
