"""Online maintenance of one layer's clusters while decoding.

* New tokens live in the DRAM window.  Each step, the maintainer counts, for every window
  token, the steps in which it was active together with each cluster's medoid.  After
  ``window_steps`` steps a token leaves the window and joins the cluster(s) whose medoid it
  was most often co-activated with (``max_join``; a token never co-activated with any medoid
  joins the hottest cluster it was active with, else a cold block) and is written to that
  cluster's next drive (:func:`next_drive`).
* Drift: the efficiency of the current clustering (share of the fetched entries that the step
  actually needed) is tracked as an exponential average; when it falls below ``1 - drift`` of
  its level right after the last (re)clustering, the clusters are rebuilt from the recent
  activations (:class:`~kvswarm.swarm.coact.CoActivation` keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvswarm.swarm.cluster import Clusters, Clusterer, cluster_heat
from kvswarm.swarm.coact import CoActivation
from kvswarm.swarm.layout import LayerLayout, Piece


@dataclass
class _Pending:
    position: int
    entered: int
    with_medoid: dict[int, int] = field(default_factory=dict)  # cluster -> co-active steps
    active_steps: int = 0


class OnlineMaintainer:
    def __init__(self, clusters: Clusters, positions: np.ndarray, clusterer: Clusterer, *, window_steps: int = 16,
                 history: int = 64, drift: float = 0.2, ema: float = 0.2, max_join: int = 1,
                 warmup: int = 4) -> None:
        self.clusters, self.positions, self.clusterer = clusters, np.asarray(positions, np.int64), clusterer
        self.window_steps, self.drift, self.ema, self.max_join, self.warmup = window_steps, drift, ema, max_join, warmup
        universe = int(self.positions.max()) + 1 if len(self.positions) else 0
        self.coact = CoActivation(universe, history)
        self.pending: dict[int, _Pending] = {}
        self.efficiency: float | None = None
        self.reference: float | None = None
        self._since = 0
        self.reclusters = 0
        self.joined: list[tuple[int, list[int]]] = []  # (position, clusters) for tokens that left the window

    def _medoid_cluster(self) -> dict[int, int]:
        return {int(m): c for c, m in enumerate(self.clusters.medoids)}

    def new_token(self, position: int, step: int) -> None:
        """A decoded token entered the window."""
        self.pending[position] = _Pending(position, step)

    def observe(self, step: int, active: np.ndarray, fetched: int, needed_fetched: int) -> list[tuple[int, list[int]]]:
        """One step: ``active`` positions (offloaded and window) the step needed; ``fetched``
        entries read and ``needed_fetched`` of them actually needed.  Returns the tokens that
        left the window this step with the clusters they joined."""
        active = np.asarray(active, np.int64)
        self.coact.add(active)
        eff = needed_fetched / fetched if fetched else 1.0
        self.efficiency = eff if self.efficiency is None else (1 - self.ema) * self.efficiency + self.ema * eff
        self._since += 1
        if self._since == self.warmup:
            self.reference = self.efficiency
        med = self._medoid_cluster()
        act_set = set(active.tolist())
        hot_medoids = [med[m] for m in act_set if m in med]
        out = []
        for pos, p in list(self.pending.items()):
            if pos in act_set:
                p.active_steps += 1
                for c in hot_medoids:
                    p.with_medoid[c] = p.with_medoid.get(c, 0) + 1
            if step - p.entered >= self.window_steps:
                del self.pending[pos]
                out.append((pos, self._join(p)))
        self.joined += out
        return out

    def _join(self, p: _Pending) -> list[int]:
        # a re-clustering since the token was seen may have renumbered clusters: only current ids count
        known = [c for c in p.with_medoid if c < len(self.clusters.heat)]
        if known:
            best = sorted(known, key=lambda c: (-p.with_medoid[c], -self.clusters.heat[c]))[:self.max_join]
        elif p.active_steps and (~self.clusters.cold).any():
            best = [int(np.flatnonzero(~self.clusters.cold)[np.argmax(self.clusters.heat[~self.clusters.cold])])]
        else:
            best = [int(np.flatnonzero(self.clusters.cold)[-1])] if self.clusters.cold.any() else [len(self.clusters) - 1]
        for c in best:
            self.clusters.members[c] = np.union1d(self.clusters.members[c], [p.position])
        self.positions = np.union1d(self.positions, [p.position])
        return best

    def drifted(self) -> bool:
        return self.reference is not None and self.efficiency is not None and \
            self.efficiency < (1 - self.drift) * self.reference

    def recluster(self) -> Clusters:
        """Rebuild the clusters from the recent activations (positions that left the window included)."""
        self.coact.grow(int(self.positions.max()) + 1)
        x = self.coact.incidence()
        g = self.coact.graph()
        self.clusters = self.clusterer.cluster(g, x, self.positions)
        self.clusters.heat = np.maximum(self.clusters.heat, cluster_heat(x, self.clusters.members))
        self.efficiency, self.reference, self._since = None, None, 0
        self.reclusters += 1
        return self.clusters


def next_drive(layout: LayerLayout, cluster: int, drives: int) -> int:
    """The drive after the one holding the cluster's last piece (round robin within the cluster)."""
    ids = layout.cluster_pieces[cluster] if cluster < len(layout.cluster_pieces) else []
    if not len(ids):
        return cluster % drives
    last = layout.pieces[int(ids[-1])].drives[0]
    return (int(last) + 1) % drives if isinstance(last, (int, np.integer)) else cluster % drives


def append_entry(layout: LayerLayout, cluster: int, position: int, drives: int) -> int:
    """Add a one-entry piece for ``position`` to ``cluster`` on its next drive; returns the piece id."""
    d = next_drive(layout, cluster, drives)
    layout.pieces.append(Piece(cluster, np.array([position], np.int64), [d]))
    pid = len(layout.pieces) - 1
    while len(layout.cluster_pieces) <= cluster:
        layout.cluster_pieces.append(np.zeros(0, np.int64))
    layout.cluster_pieces[cluster] = np.append(layout.cluster_pieces[cluster], pid)
    return pid
