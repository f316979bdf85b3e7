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
coherent.  The copies of one piece are written with :func:`copy_hints`, so a copy whose hinted
drive is unavailable avoids the drives its other copies went to.  :class:`CoactivationGrouping`
exposes the pieces through the offload package's ``Grouping`` interface (each entry in one
group; a piece's replicas as the group's copies); its ``describe()`` fingerprints the layout
(:func:`layout_fingerprint`), so two layouts of one prompt are stored under different ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash
from scipy import sparse

from kvswarm.offload.grouping import Group, Grouping, register as register_grouping
from kvswarm.placement import DriveView, PlacementStrategy, register as register_placement
from kvswarm.swarm.cluster import Clusters


@dataclass(frozen=True)
class StripeHint:
    """Place on the next drive of the global round-robin pointer."""


STRIPE = StripeHint()


@dataclass(eq=False)
class CopyHint:
    """The hint of one copy of a piece (``copy_hints``): ``hint`` as for :class:`SwarmPlacement`,
    and ``placed``, shared by the piece's copies, the drives the copies written before it went to
    (filled in by the placement; the store places a batch's objects in order)."""

    hint: object
    placed: list[int]


def copy_hints(hints: Sequence[object]) -> list[object]:
    """Placement hints for the copies of one piece (its ``drives``, the primary first): plain
    hints for a single copy, else :class:`CopyHint` sharing where the earlier copies went."""
    if len(hints) < 2:
        return list(hints)
    placed: list[int] = []
    return [CopyHint(h, placed) for h in hints]


def _is_drive(hint: object) -> bool:
    return isinstance(hint, (int, np.integer)) and not isinstance(hint, bool)


@register_placement
class SwarmPlacement(PlacementStrategy):
    """Honours a drive number as hint, ``StripeHint`` takes the global pointer's next drive,
    no hint stripes round robin (RAID-0).  An unavailable drive falls to an available one.

    A :class:`CopyHint` (one copy of a replicated piece) never goes to a drive that holds an
    earlier copy of the same piece while another drive is available; with no other drive it
    shares one (the store must write it; ``SwarmSequence.create`` then drops it)."""

    name = "swarm"

    def __init__(self) -> None:
        self._ptr = itertools.count()

    def place(self, digest, parts, drives: Sequence[DriveView], hint=None):
        if isinstance(hint, CopyHint):
            out = self._place(parts, drives, hint.hint, set(hint.placed))
            hint.placed.extend(out)
            return out
        return self._place(parts, drives, hint, set())

    def _place(self, parts: int, drives: Sequence[DriveView], hint, avoid: set[int]) -> list[int]:
        n = len(drives)
        free = {v.index for v in drives} - avoid or {v.index for v in drives}

        def walk(start: int) -> int:  # the first drive from ``start`` on that no sibling holds
            return next(drives[(start + i) % n].index for i in range(n) if drives[(start + i) % n].index in free)

        if _is_drive(hint):
            want = int(hint)
            return [want if want in free else walk(want)] * parts
        return [walk(next(self._ptr)) for _ in range(parts)]


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
    placement (and is needed to replicate); ``cost(nbytes)`` is one read's drive time (default:
    bytes).  ``max_piece_entries`` caps a piece (the store's page capacity): no piece is larger.
    """
    if mode not in ("stripe", "balanced", "raid0"):
        raise ValueError(f"layout mode must be stripe, balanced or raid0, got {mode!r}")
    if mode == "balanced" and replicate > 0 and activity is None:
        raise ValueError("balanced replication (replicate > 0) needs the profile's activity [steps, clusters]")
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
        # Near piece_bytes per I/O on distinct drives, but never above the cap.
        parts = max(min(drives, -(-len(m) // per_piece)), -(-len(m) // cap))
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
            score[taken[len(taken) - len(taken) % drives:]] = np.inf  # more pieces than drives: rounds
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
    """Second copies for the clusters with the most reads per byte, on the drives that overlap least.
    A replica never shares a drive with another copy of its piece: a piece whose copies already
    cover every drive gets none (and spends no budget)."""
    cl = layout.clusters
    total = sum(len(p.positions) for p in layout.pieces)
    budget = share * total
    benefit = cl.heat / np.maximum(cl.sizes, 1)
    for c in np.argsort(-benefit, kind="stable"):
        if cl.heat[c] <= 0 or budget < cl.sizes[c]:
            continue
        a = np.zeros(max(1, steps))
        a[act[:, c].indices] = 1.0
        used = {p.drives[0] for p in (layout.pieces[i] for i in layout.cluster_pieces[c])}
        for i in layout.cluster_pieces[c]:
            p = layout.pieces[i]
            own = [d for d in p.drives if _is_drive(d)]
            if len(set(own)) >= drives:
                continue
            score = load @ a + 1e-9 * load.sum(1)
            score[list(used | set(own))] = np.inf
            if np.isinf(score).all():
                score = load @ a
                score[own] = np.inf
            d = int(np.argmin(score))
            used.add(d)
            budget -= len(p.positions)
            # A replica takes half the expected reads of its piece from the primary's drive.
            w = 0.5 * cost(len(p.positions) * entry_bytes)
            load[d] += w * a
            load[p.drives[0]] -= w * a
            p.drives.append(d)


NO_HINT, STRIPE_HINT = -1, -2  # drive hints that are not drive numbers, as integers


def hint_codes(hints: Sequence[object]) -> list[int]:
    """Drive hints as integers (``STRIPE_HINT`` for the stripe pointer, ``NO_HINT`` for none)."""
    return [STRIPE_HINT if h is STRIPE else NO_HINT if h is None else int(h) for h in hints]


def layout_fingerprint(layouts: Mapping[int, LayerLayout] | Sequence[LayerLayout]) -> bytes:
    """16 bytes that identify per-layer layouts as stored: every piece's cluster, positions in
    storage order and copies' drive hints, per layer.  Equal layouts give equal fingerprints."""
    items = layouts.items() if isinstance(layouts, Mapping) else enumerate(layouts)
    h = xxhash.xxh3_128()
    for layer, lay in sorted(items, key=lambda kv: kv[0]):
        pieces = lay.pieces
        hints = [hint_codes(p.drives) for p in pieces]
        h.update(np.array([layer, len(pieces)], np.int64).tobytes())
        for arr in (np.array([p.cluster for p in pieces], np.int64),
                    np.array([len(p.positions) for p in pieces], np.int64),
                    np.concatenate([np.asarray(p.positions, np.int64) for p in pieces]) if pieces
                    else np.zeros(0, np.int64),
                    np.array([len(x) for x in hints], np.int64),
                    np.array([c for x in hints for c in x], np.int64)):
            h.update(np.array([len(arr)], np.int64).tobytes())
            h.update(arr.tobytes())
    return h.digest()


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

    def describe(self) -> str:
        """The name and a fingerprint of the layouts (pieces, their order and drive hints): the
        sequence id of a ``StoreSequence`` includes it, so another layout of the same prompt
        (after re-clustering) does not overwrite this one's pages, and the same layout keys the same."""
        return f"{self.name}/{layout_fingerprint(self.layouts).hex()}"

    def group(self, layer, positions, keys, capacity):
        seen = np.zeros(int(positions.max()) + 1 if len(positions) else 0, bool)
        out = []
        for p in self.layouts[layer].pieces:
            pos = p.positions[~seen[p.positions]]
            seen[pos] = True
            for i in range(0, len(pos), capacity):
                hints = copy_hints(p.drives)
                out.append(Group(pos[i:i + capacity], hints[0], hints[1:]))
        rest = positions[~seen[positions]]
        out += [Group(rest[i:i + capacity]) for i in range(0, len(rest), capacity)]
        return out
