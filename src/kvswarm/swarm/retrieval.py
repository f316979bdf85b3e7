"""Retrieval: turn a step's wanted entries into one batch of reads, balanced over the drives.

1. *Dedup*: entries already in DRAM (the hot-unit cache) are not read; the remaining entries
   are covered by pieces -- a piece that alone holds a wanted entry is read, and an entry held
   by several pieces (overlapping clusters) uses a piece already chosen, else the holder on
   the drive that would finish first.
2. *Replica choice*: every chosen piece has one or more copies on different drives.  Copies are
   assigned so that the drives finish together:
   ``assign="bucket"`` (the paper): in request order, each piece goes to the copy whose drive
   would finish earliest; ``assign="makespan"`` (kvswarm): largest pieces first (LPT), then
   moves off the slowest drive while that shortens the step; ``assign="primary"``: always the
   first copy (the no-balance ablation).
3. All drives' reads go to the store in one ``submit_get`` batch (the caller does that).

A drive's time for a batch is ``max(bytes / bandwidth, reads / IOPS)`` (plus a per-batch
latency): the form of the kernel's throttle and of real SSDs at queue depth.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse

from kvswarm.format import extent_size


@dataclass(frozen=True)
class DriveModel:
    """Per-drive read capability used for planning (not for pacing)."""

    read_bps: float = 100e6
    read_iops: float = 5000.0

    def finish(self, nbytes: np.ndarray, nreads: np.ndarray) -> np.ndarray:
        return np.maximum(nbytes / self.read_bps, nreads / self.read_iops)


@dataclass
class ReadPlan:
    """One layer's reads: (piece, copy) pairs and what they cost per drive."""

    reads: list[tuple[int, int]]  # (piece, copy index)
    drive_of: list[int]  # drive of each read
    nbytes: list[int]  # extent bytes of each read
    wanted: int = 0  # offloaded entries requested
    dram_hits: int = 0  # of those, served from the DRAM cache
    entries_read: int = 0  # entries in the pieces read
    per_drive_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    per_drive_reads: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cached_used: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # DRAM pieces that served

    def makespan(self, model: DriveModel) -> float:
        return float(model.finish(self.per_drive_bytes, self.per_drive_reads).max(initial=0.0))


class Retriever:
    """Plans one layer's reads over a layout's pieces (see module docstring)."""

    def __init__(self, holders: sparse.csr_matrix, piece_sizes: np.ndarray, copy_drives: list[list[int]],
                 entry_bytes: int, drives: int, model: DriveModel | None = None, assign: str = "makespan",
                 dedup: bool = True) -> None:
        if assign not in ("bucket", "makespan", "primary"):
            raise ValueError(f"assign must be bucket, makespan or primary, got {assign!r}")
        self.holders = holders.tocsr()  # [universe, pieces]
        self.sizes = np.asarray(piece_sizes, np.int64)
        self.copy_drives = copy_drives
        self.extent = np.array([extent_size(int(s) * entry_bytes) for s in self.sizes], np.int64)
        self.drives, self.model = drives, model or DriveModel()
        self.assign, self.dedup = assign, dedup
        self.down: set[int] = set()  # drives out of service: their copies are avoided
        self._members = self.holders.T.tocsr()  # [pieces, universe]

    def positions_of(self, pieces: np.ndarray) -> np.ndarray:
        """The positions ``pieces`` hold (sorted, each once)."""
        return np.unique(self._members[np.asarray(pieces, np.int64)].indices)

    def pieces_for(self, wanted: np.ndarray) -> np.ndarray:
        """Pieces to read so that every ``wanted`` position is covered (all holders without dedup).

        A piece that alone holds a wanted entry is read; an entry held by several pieces
        (overlapping clusters) is left to a piece already chosen when one holds it, else to
        the holder whose drive would finish first (``primary``: the first holder).
        """
        h = self.holders[wanted]
        if not self.dedup:
            return np.unique(h.indices)
        counts = np.diff(h.indptr)
        if (counts == 0).any():
            raise ValueError(f"positions {wanted[counts == 0][:5]} are held by no piece")
        chosen = np.zeros(len(self.sizes), bool)
        chosen[h.indices[h.indptr[:-1][counts == 1]]] = True
        multi = np.flatnonzero(counts > 1)
        if len(multi):
            b = np.zeros(self.drives)
            r = np.zeros(self.drives)
            first = np.array([d[0] for d in self.copy_drives], np.int64) if self.assign != "primary" else None
            if first is not None:
                idx = np.flatnonzero(chosen)
                np.add.at(b, first[idx], self.extent[idx])
                np.add.at(r, first[idx], 1)
            m = self.model
            for i in multi.tolist():
                hs = h.indices[h.indptr[i]:h.indptr[i + 1]]
                if chosen[hs].any():
                    continue
                if first is None:
                    p = int(hs.min())
                else:
                    d = first[hs]
                    p = int(hs[np.argmin(np.maximum((b[d] + self.extent[hs]) / m.read_bps, (r[d] + 1) / m.read_iops))])
                    b[first[p]] += self.extent[p]
                    r[first[p]] += 1
                chosen[p] = True
        return np.flatnonzero(chosen)

    def plan(self, wanted: np.ndarray, cache: UnitCache | None = None, layer: int = 0,
             order: np.ndarray | None = None, available: np.ndarray | None = None) -> ReadPlan:
        """Reads for ``wanted`` positions of ``layer``; ``order`` is the request order of pieces,
        ``available`` pieces already in DRAM outside the cache (prefetched)."""
        wanted = np.asarray(wanted, np.int64)
        n_wanted = len(wanted)
        hits = 0
        used = np.zeros(0, np.int64)
        if self.dedup and (cache is not None or available is not None):
            cached = np.flatnonzero(cache.mask(layer, len(self.sizes))) if cache is not None \
                else np.zeros(0, np.int64)
            if available is not None:
                cached = np.union1d(cached, available)
            if len(cached):
                hc = self.holders[wanted][:, cached]
                in_dram = np.diff(hc.indptr) > 0
                hits = int(in_dram.sum())
                used = cached[np.unique(hc.indices)]
                wanted = wanted[~in_dram]
        pieces = self.pieces_for(wanted) if len(wanted) else np.zeros(0, np.int64)
        if order is not None:  # the caller's request order (the bucket scheduler follows it)
            rank = np.full(len(self.sizes), len(order), np.int64)
            rank[order] = np.arange(len(order))
            pieces = pieces[np.argsort(rank[pieces], kind="stable")]
        copy = self._assign(pieces)
        drive_of = [self.copy_drives[p][c] for p, c in zip(pieces, copy)]
        nb = self.extent[pieces]
        pdb = np.bincount(drive_of, weights=nb, minlength=self.drives) if len(pieces) else np.zeros(self.drives)
        pdr = np.bincount(drive_of, minlength=self.drives).astype(float) if len(pieces) else np.zeros(self.drives)
        return ReadPlan(list(zip(pieces.tolist(), copy)), drive_of, nb.tolist(), n_wanted, hits,
                        int(self.sizes[pieces].sum()), pdb, pdr, used)

    def plan_pieces(self, pieces: np.ndarray) -> ReadPlan:
        """Reads of whole ``pieces`` (a prefetch), copies assigned like any plan."""
        pieces = np.asarray(pieces, np.int64)
        copy = self._assign(pieces)
        drive_of = [self.copy_drives[p][c] for p, c in zip(pieces, copy)]
        nb = self.extent[pieces]
        return ReadPlan(list(zip(pieces.tolist(), copy)), drive_of, nb.tolist(), 0, 0, int(self.sizes[pieces].sum()),
                        np.bincount(drive_of, weights=nb, minlength=self.drives) if len(pieces) else np.zeros(self.drives),
                        np.bincount(drive_of, minlength=self.drives).astype(float) if len(pieces)
                        else np.zeros(self.drives))

    # ---- replica assignment ----
    def _assign(self, pieces: np.ndarray) -> list[int]:
        n = len(pieces)
        copy = [0] * n
        if self.down:  # a copy on a live drive when there is one (else the read is a counted miss)
            for i, p in enumerate(pieces):
                ds = self.copy_drives[p]
                live = [c for c, d in enumerate(ds) if d not in self.down]
                copy[i] = live[0] if live else 0
        if self.assign == "primary" or not n:
            return copy
        b = np.zeros(self.drives)
        r = np.zeros(self.drives)
        m = self.model
        flex = []
        for i, p in enumerate(pieces):
            ds = self.copy_drives[p]
            if sum(d not in self.down for d in ds) <= 1:
                b[ds[copy[i]]] += self.extent[p]
                r[ds[copy[i]]] += 1
            else:
                flex.append(i)
        if self.assign == "makespan":
            flex.sort(key=lambda i: -self.extent[pieces[i]])
        for i in flex:
            p = pieces[i]
            ds = self.copy_drives[p]
            e = self.extent[p]
            t = [max((b[d] + e) / m.read_bps, (r[d] + 1) / m.read_iops) if d not in self.down else np.inf
                 for d in ds]
            c = int(np.argmin(t))
            copy[i] = c
            b[ds[c]] += e
            r[ds[c]] += 1
        if self.assign == "makespan" and flex:
            self._improve(pieces, copy, flex, b, r)
        return copy

    def _improve(self, pieces, copy, flex, b, r, rounds: int = 64) -> None:
        m = self.model
        for _ in range(rounds):
            fin = m.finish(b, r)
            worst = int(np.argmax(fin))
            best = None
            for i in flex:
                p = pieces[i]
                ds = self.copy_drives[p]
                if ds[copy[i]] != worst:
                    continue
                e = self.extent[p]
                for c, d in enumerate(ds):
                    if d == worst or d in self.down:
                        continue
                    new_d = max((b[d] + e) / m.read_bps, (r[d] + 1) / m.read_iops)
                    new_w = max((b[worst] - e) / m.read_bps, (r[worst] - 1) / m.read_iops)
                    gain = fin[worst] - max(new_d, new_w)
                    if gain > 1e-12 and (best is None or gain > best[0]):
                        best = (gain, i, c, d)
            if best is None:
                return
            _, i, c, d = best
            e = self.extent[pieces[i]]
            b[worst] -= e
            r[worst] -= 1
            b[d] += e
            r[d] += 1
            copy[i] = c


class UnitCache:
    """DRAM cache of whole pieces under an eviction policy (sizes in entries)."""

    def __init__(self, policy, sizes: dict[int, np.ndarray]) -> None:
        self.policy = policy  # SizedLRU or CostBenefit (swarm.cache)
        self.sizes = sizes  # layer -> entries per piece
        self._mask: dict[int, np.ndarray] = {}
        self.hits = 0
        self.wanted = 0

    def mask(self, layer: int, pieces: int) -> np.ndarray:
        m = self._mask.get(layer)
        if m is None:
            m = self._mask[layer] = np.zeros(pieces, bool)
        return m

    def _key(self, layer: int, piece: int) -> Hashable:
        return (layer, piece)

    def preload(self, layer: int, pieces: np.ndarray, reads: np.ndarray | None = None) -> None:
        """Make ``pieces`` of ``layer`` resident (their data is the caller's to provide), with
        ``reads`` past reads each (the cost-benefit policy's frequencies); stops at capacity."""
        pol = self.policy
        m = self.mask(layer, len(self.sizes[layer]))
        for i, p in enumerate(np.asarray(pieces, np.int64).tolist()):
            s = int(self.sizes[layer][p])
            k = self._key(layer, p)
            if not pol.fits(k, s):
                continue
            if reads is not None and hasattr(pol, "record"):
                pol.record(k, float(reads[i]))
            pol.insert(k, s)
            m[p] = True

    def after_read(self, layer: int, read: list[int], used_cached: np.ndarray) -> list[tuple[int, int]]:
        """Record the step's accesses (pieces read and cached pieces used), admit what the policy
        takes; returns the (layer, piece) units evicted."""
        pol = self.policy
        evicted: list[tuple[int, int]] = []
        for p in used_cached.tolist():
            pol.touch(self._key(layer, p))
        m = self.mask(layer, len(self.sizes[layer]))
        for p in read:
            k = self._key(layer, p)
            if hasattr(pol, "record"):
                pol.record(k)
            s = int(self.sizes[layer][p])
            if pol.admit(k, s):
                for ev in pol.insert(k, s):
                    if ev != k:
                        self._mask[ev[0]][ev[1]] = False
                        evicted.append(ev)
                m[p] = k in pol
        return evicted
