"""Sparse attention over offloaded KV: selectors (strategies), quality metrics, activation traces."""

from kvswarm.sparse import blocks, kmeans, oracle  # noqa: F401  (register the built-in selectors)
from kvswarm.sparse.base import (
    Selection,
    Selector,
    StepQuery,
    budget_for,
    make_selector,
    register,
    selector_names,
)
from kvswarm.sparse.trace import ActivationTrace, TraceRecorder, load_trace

__all__ = [
    "ActivationTrace", "Selection", "Selector", "StepQuery", "TraceRecorder", "budget_for", "load_trace",
    "make_selector", "register", "selector_names",
]
