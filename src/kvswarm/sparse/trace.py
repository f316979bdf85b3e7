"""Activation traces: the entries each decode step and layer selected, in a compact file.

File format (``.npz``, numpy's zip of ``.npy`` arrays; read with ``allow_pickle=False``):

==============  ==================  ==========================================================
array           dtype / shape       meaning
==============  ==================  ==========================================================
``format``      int64 [1]           format version (``1``)
``meta``        uint8 [m]           UTF-8 JSON object: model_id, layout fingerprint (hex),
                                    selector, budget, prompt_tokens, sinks, window, source,
                                    titles, ... (free-form, documented keys in docs/sparse.md)
``shape``       int64 [2]           (steps, layers)
``offsets``     int64 [S*L+1]       record r = step * layers + layer holds
                                    ``ids[offsets[r]:offsets[r+1]]``
``ids``         int32 [total]       selected entry ids (token positions), sorted per record
``scores``      float16 [total]     optional: the selector's score of each id
``mass``        float32 [S*L]       optional: exact attention mass the selection captured
==============  ==================  ==========================================================

A record is one (step, layer); steps and layers are dense (every step records every layer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1


@dataclass
class ActivationTrace:
    meta: dict
    steps: int
    layers: int
    offsets: np.ndarray
    ids: np.ndarray
    scores: np.ndarray | None = None
    mass: np.ndarray | None = None

    def _rec(self, step: int, layer: int) -> slice:
        if not (0 <= step < self.steps and 0 <= layer < self.layers):
            raise IndexError(f"(step {step}, layer {layer}) outside a {self.steps}x{self.layers} trace")
        r = step * self.layers + layer
        return slice(int(self.offsets[r]), int(self.offsets[r + 1]))

    def selected(self, step: int, layer: int) -> np.ndarray:
        """Entry ids selected at (step, layer)."""
        return self.ids[self._rec(step, layer)]

    def selected_scores(self, step: int, layer: int) -> np.ndarray | None:
        return None if self.scores is None else self.scores[self._rec(step, layer)]

    def __iter__(self) -> Iterator[tuple[int, int, np.ndarray]]:
        for s in range(self.steps):
            for layer in range(self.layers):
                yield s, layer, self.selected(s, layer)

    def incidence(self, layer: int, universe: int | None = None):
        """scipy CSR matrix [steps, universe] of 0/1: which entry was active at which step."""
        from scipy.sparse import csr_matrix

        n = universe or int(self.meta.get("prompt_tokens", int(self.ids.max(initial=0)) + 1))
        rows, cols = [], []
        for s in range(self.steps):
            ids = self.selected(s, layer)
            rows.append(np.full(len(ids), s, np.int64))
            cols.append(ids.astype(np.int64))
        r, c = np.concatenate(rows), np.concatenate(cols)
        return csr_matrix((np.ones(len(r), np.uint8), (r, c)), shape=(self.steps, n))

    def save(self, path: str | Path) -> None:
        arrays = {
            "format": np.array([FORMAT_VERSION], np.int64),
            "meta": np.frombuffer(json.dumps(self.meta, sort_keys=True).encode(), np.uint8),
            "shape": np.array([self.steps, self.layers], np.int64),
            "offsets": self.offsets.astype(np.int64),
            "ids": self.ids.astype(np.int32),
        }
        if self.scores is not None:
            arrays["scores"] = self.scores.astype(np.float16)
        if self.mass is not None:
            arrays["mass"] = self.mass.astype(np.float32)
        # Write to a temporary name first so a crash never leaves a half-written trace.
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> ActivationTrace:
        with np.load(path, allow_pickle=False) as z:
            version = int(z["format"][0])
            if version != FORMAT_VERSION:
                raise ValueError(f"{path}: trace format {version}, this kvswarm reads {FORMAT_VERSION}")
            steps, layers = (int(x) for x in z["shape"])
            offsets = z["offsets"]
            if len(offsets) != steps * layers + 1:
                raise ValueError(f"{path}: {len(offsets)} offsets for a {steps}x{layers} trace")
            return cls(json.loads(bytes(z["meta"]).decode()), steps, layers, offsets, z["ids"],
                       z["scores"] if "scores" in z else None, z["mass"] if "mass" in z else None)


@dataclass
class TraceRecorder:
    """Step observer that collects each (step, layer) selection into an ActivationTrace.

    Plug it into an ``OffloadedKVCache`` (``observers=[recorder]``).  By default it records what
    the cache's selector chose.  With ``oracle`` (a built ``OracleTopK``) and ``budget`` it records
    the exact top-``budget`` entries instead, plus the attention mass they hold: run it on a
    dense decode to get ground-truth activations.
    """

    layers: int
    meta: dict = field(default_factory=dict)
    keep_scores: bool = True
    oracle: object = None  # a built Selector whose choice replaces the cache's
    budget: int = 0
    _ids: list[np.ndarray] = field(default_factory=list)
    _scores: list[np.ndarray] = field(default_factory=list)
    _mass: list[float] = field(default_factory=list)
    _keys: list[tuple[int, int]] = field(default_factory=list)

    def on_select(self, q, sel) -> None:  # q: StepQuery, sel: Selection
        mass = np.nan
        if self.oracle is not None:
            sel = self.oracle.select(q, self.budget)
            mass = float(sel.scores.sum()) / q.query.shape[0]
        self._keys.append((q.step, q.layer))
        self._ids.append(np.asarray(sel.positions, np.int32))
        if self.keep_scores:
            sc = sel.scores if sel.scores is not None else np.zeros(len(sel.positions), np.float32)
            self._scores.append(sc.astype(np.float16))
        self._mass.append(mass)

    def trace(self) -> ActivationTrace:
        n = len(self._keys)
        if n % self.layers:
            raise ValueError(f"{n} records is not a whole number of {self.layers}-layer steps")
        steps = n // self.layers
        order = sorted(range(n), key=lambda i: self._keys[i])
        keys = [self._keys[i] for i in order]
        base = keys[0][0] if n else 0
        if keys != [(base + s, lay) for s in range(steps) for lay in range(self.layers)]:
            raise ValueError("trace records are not one per (step, layer)")
        ids = [self._ids[i] for i in order]
        offsets = np.zeros(n + 1, np.int64)
        offsets[1:] = np.cumsum([len(x) for x in ids])
        scores = np.concatenate([self._scores[i] for i in order]) if self.keep_scores and n else None
        mass = np.array([self._mass[i] for i in order], np.float32)
        return ActivationTrace(dict(self.meta), steps, self.layers, offsets,
                               np.concatenate(ids) if n else np.zeros(0, np.int32), scores,
                               None if np.isnan(mass).all() else mass)

    def save(self, path: str | Path) -> ActivationTrace:
        t = self.trace()
        t.save(path)
        return t


def load_trace(path: str | Path) -> ActivationTrace:
    return ActivationTrace.load(path)
