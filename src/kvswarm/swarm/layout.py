"""Where clusters live: pieces per drive, drive choice, replicas.

A *piece* is one store object: the members of one cluster that sit on one drive, laid out
contiguously so that reading a cluster costs at most one I/O per drive it spans.

* ``mode="stripe"`` (the Swarm paper): every cluster is cut into ``min(drives, size)`` pieces
  that go to consecutive drives from a global pointer (``StripeHint``; the placement strategy
  keeps the pointer), so any cluster is read by all drives at once.
* ``mode="balanced"`` (kvswarm): a cluster is cut into as few pieces as keep each I/O near
  ``piece_bytes`` (small clusters stay whole: one I/O), and each piece goes to the drive whose
  load over the profile steps overlaps least with the cluster's own activity (co-activated
  clusters land on different drives; expected load evens out).  Then the hottest clusters per
  byte get a replica on another drive until ``replicate`` (share of bytes) is spent, so the
  retrieval can move their reads to whichever drive finishes first.

Drive numbers are hints to :class:`SwarmPlacement` (registered as ``"swarm"``); the actual
drive of every copy is read back from the store's catalog, so spills and failed drives stay
coherent.  :class:`CoactivationGrouping` exposes the pieces through the offload package's
``Grouping`` interface (each entry in one group; a piece's replicas as the group's copies).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse

from kvswarm.offload.grouping import Group, Grouping, register as register_grouping
from kvswarm.placement import DriveView, PlacementStrategy, register as register_placement
from kvswarm.swarm.cluster import Clusters


@dataclass(frozen=True)
class StripeHint:
    """Place on the next drive of the global round-robin pointer."""


STRIPE = StripeHint()


@register_placement
class SwarmPlacement(PlacementStrategy):
    """Honours a drive number as hint, ``StripeHint`` takes the global pointer's next drive,
    no hint stripes round robin (RAID-0).  An unavailable drive falls to the next available one."""

    name = "swarm"

    def __init__(self) -> None:
        self._ptr = itertools.count()

    def place(self, digest, parts, drives: Sequence[DriveView], hint=None):
        n = len(drives)
        if isinstance(hint, (int, np.integer)) and not isinstance(hint, bool):
            want = int(hint)
            if any(v.index == want for v in drives):
                return [want] * parts
            return [drives[want % n].index] * parts
        start = next(self._ptr)
        out = [drives[(start + i) % n].index for i in range(parts)]
        for _ in range(parts - 1):
            next(self._ptr)
        return out


@dataclass
class Piece:
    cluster: int
    positions: np.ndarray  # int64, the order the entries are stored in
    drives: list  # hint per copy: the primary first, then replicas


@dataclass
class LayerLayout:
    clusters: Clusters
    pieces: list[Piece]
    cluster_pieces: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.cluster_pieces:
            by: list[list[int]] = [[] for _ in range(len(self.clusters))]
            for i, p in enumerate(self.pieces):
                by[p.cluster].append(i)
            self.cluster_pieces = [np.array(b, np.int64) for b in by]

    def holders(self, universe: int) -> sparse.csr_matrix:
        """[universe, pieces] 0/1: the pieces holding each position."""
        sizes = np.array([len(p.positions) for p in self.pieces], np.int64)
        rows = np.concatenate([p.positions for p in self.pieces]) if self.pieces else np.zeros(0, np.int64)
        cols = np.repeat(np.arange(len(self.pieces)), sizes)
        return sparse.csr_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(universe, len(self.pieces)))

    def copies(self) -> int:
        return sum(len(p.drives) for p in self.pieces)

    def stored_entries(self) -> int:
        return sum(len(p.positions) * len(p.drives) for p in self.pieces)


def _split(members: np.ndarray, parts: int) -> list[np.ndarray]:
    return [a for a in np.array_split(members, parts) if len(a)]


def plan_layout(clusters: Clusters, drives: int, entry_bytes: int, *, mode: str = "balanced",
                piece_bytes: int = 32 << 10, max_piece_entries: int | None = None, replicate: float = 0.0,
                activity: sparse.csr_matrix | None = None, cost=None) -> LayerLayout:
    """Pieces and drive hints for one layer's clusters.

    ``activity`` [steps, clusters] (0/1: cluster active at a profile step) drives the balanced
    placement; ``cost(nbytes)`` is one read's drive time (default: bytes).  ``max_piece_entries``
    caps a piece (the store's page capacity).
    """
    if mode not in ("stripe", "balanced", "raid0"):
        raise ValueError(f"layout mode must be stripe, balanced or raid0, got {mode!r}")
    cap = max_piece_entries or 1 << 30
    pieces: list[Piece] = []
    if mode in ("stripe", "raid0"):
        hint = STRIPE if mode == "stripe" else None
        for c, m in enumerate(clusters.members):
            parts = max(min(drives, len(m)), -(-len(m) // cap)) if mode == "stripe" else -(-len(m) // cap)
            pieces += [Piece(c, p, [hint]) for p in _split(m, parts)]
        return LayerLayout(clusters, pieces)
    cost = cost or (lambda b: float(b))
    per_piece = max(1, min(cap, piece_bytes // entry_bytes))
    steps = activity.shape[0] if activity is not None else 0
    act = activity.tocsc() if activity is not None else None
    # Expected drive load per profile step; clusters never active count as a uniform trickle.
    load = np.zeros((drives, max(1, steps)))
    order = np.argsort(-(clusters.heat * clusters.sizes), kind="stable")
    for c in order:
        m = clusters.members[c]
        parts = min(drives, -(-len(m) // per_piece))
        chunks = _split(m, parts)
        if act is not None and clusters.heat[c] > 0:
            a = np.zeros(max(1, steps))
            a[act[:, c].indices] = 1.0
        else:
            a = np.full(max(1, steps), 1.0 / max(1, steps))
        taken: list[int] = []
        for ch in sorted(chunks, key=len, reverse=True):
            w = cost(len(ch) * entry_bytes)
            score = load @ a + 1e-9 * load.sum(1)
            score[taken] = np.inf
            d = int(np.argmin(score))
            taken.append(d)
            load[d] += w * a
            pieces.append(Piece(int(c), ch, [d]))
    layout = LayerLayout(clusters, pieces)
    if replicate > 0 and drives > 1:
        _replicate(layout, drives, entry_bytes, replicate, load, act, steps, cost)
    return layout


def _replicate(layout: LayerLayout, drives: int, entry_bytes: int, share: float, load: np.ndarray, act,
               steps: int, cost) -> None:
    """Second copies for the clusters with the most reads per byte, on the drives that overlap least."""
    cl = layout.clusters
    total = sum(len(p.positions) for p in layout.pieces)
    budget = share * total
    benefit = cl.heat / np.maximum(cl.sizes, 1)
    for c in np.argsort(-benefit, kind="stable"):
        if cl.heat[c] <= 0 or budget < cl.sizes[c]:
            continue
        budget -= cl.sizes[c]
        a = np.zeros(max(1, steps))
        a[act[:, c].indices] = 1.0
        used = {p.drives[0] for p in (layout.pieces[i] for i in layout.cluster_pieces[c])}
        for i in layout.cluster_pieces[c]:
            p = layout.pieces[i]
            score = load @ a + 1e-9 * load.sum(1)
            score[list(used | set(p.drives))] = np.inf
            if np.isinf(score).all():
                score = load @ a
                score[p.drives] = np.inf
            d = int(np.argmin(score))
            used.add(d)
            # A replica takes half the expected reads of its piece from the primary's drive.
            w = 0.5 * cost(len(p.positions) * entry_bytes)
            load[d] += w * a
            load[p.drives[0]] -= w * a
            p.drives.append(d)


@register_grouping
class CoactivationGrouping(Grouping):
    """The pieces of a co-activation layout as offload groups: each position in the first piece
    that holds it (overlapping clusters' repeats are dropped), a piece's replicas as the group's
    extra ``copies`` (drive hints).

    Built from per-layer layouts (``plan_layout``); positions outside the clusters (there are
    none when the clusters cover the offloaded range) are appended as contiguous pages.
    """

    name = "coactivation"

    def __init__(self, layouts: dict[int, LayerLayout] | None = None) -> None:
        if layouts is None:
            raise ValueError("CoactivationGrouping needs per-layer layouts (swarm.layout.plan_layout)")
        self.layouts = layouts

    def group(self, layer, positions, keys, capacity):
        seen = np.zeros(int(positions.max()) + 1 if len(positions) else 0, bool)
        out = []
        for p in self.layouts[layer].pieces:
            pos = p.positions[~seen[p.positions]]
            seen[pos] = True
            out += [Group(pos[i:i + capacity], p.drives[0], list(p.drives[1:])) for i in range(0, len(pos), capacity)]
        rest = positions[~seen[positions]]
        out += [Group(rest[i:i + capacity]) for i in range(0, len(rest), capacity)]
        return out
