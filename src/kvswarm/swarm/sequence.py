"""A prompt's KV on the drives as cluster pieces with replicas, read through the Swarm retrieval.

``SwarmSequence`` is an ``EntrySource`` (the offload package's interface), so the same
``OffloadedKVCache`` decodes from it; it differs from ``StoreSequence`` in what a read does:
each layer's request goes through a :class:`~kvswarm.swarm.retrieval.Retriever` (dedup
against the DRAM cache, replica choice per drive) and is submitted to the store as one batch
across all drives.  Pieces are written with drive hints for :class:`SwarmPlacement`; the
drive of every copy is then read from the store's catalog, so the plan follows where the
data actually is (spills, failed drives).

Store keys: ``b"kvsw/swarm/1/" + layout fingerprint + salt + sequence id + (layer, piece, copy)``,
the resident entries (sinks, window) per layer under the same prefix + ``b"r"``, and a manifest
(geometry, tokens, clusters and pieces with their drive hints) under ``b"kvsw/swarmman/1/" +
salt + sequence id``, so :meth:`SwarmSequence.open` finds the sequence again after a restart.
The default sequence id hashes the tokens, sinks, window, the layouts' fingerprint and the
model/layout fingerprint, so two layouts of one prompt, or two models, never share keys and the
same layout always finds the same ones.
A copy that is missing or fails its checksum is a miss (the cache recomputes), never data.
"""

from __future__ import annotations

import io
import json
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch
import xxhash

from kvswarm.entry_source import EntrySource, Fetched, Geometry, KVMissing, LayerKV
from kvswarm.errors import DriveError, LayoutMismatch
from kvswarm.layout import KVLayout
from kvswarm.offload.sequence import (
    StoredSequenceKeys,
    StoreRead,
    check_kv,
    entries_array,
    entries_to_kv,
    payload_entries,
    put_layer,
)
from kvswarm.store import KVStore
from kvswarm.swarm.cluster import Clusters
from kvswarm.swarm.layout import (
    NO_HINT,
    STRIPE,
    STRIPE_HINT,
    LayerLayout,
    Piece,
    copy_hints,
    hint_codes,
    layout_fingerprint,
)
from kvswarm.swarm.retrieval import DriveModel, ReadPlan, Retriever, UnitCache

@dataclass
class LayerStats:
    """What one layer read cost (for benchmarks)."""

    plan: ReadPlan
    io_s: float


class _SwarmFetch(StoreRead):
    def __init__(self, seq: SwarmSequence, layer: int, positions: np.ndarray, plan: ReadPlan,
                 prefetch: bool = False) -> None:
        self.seq, self.layer, self.positions, self.plan, self.is_prefetch = seq, layer, positions, plan, prefetch
        self.reads = list(plan.reads)
        super().__init__(seq.store, (seq.key(layer, p, c) for p, c in self.reads))

    def _finish(self) -> Fetched:
        seq, lay = self.seq, self.seq.layout
        shape = (2, lay.num_kv_heads, lay.head_dim)
        dtype = lay.numpy_dtype()
        pieces = seq.layouts[self.layer].pieces
        got: dict[int, np.ndarray] = {}
        missing_pieces = 0
        if self.handle is not None:
            with self.handle.wait() as res:
                for (p, _), view in zip(self.reads, res.views):
                    if (e := payload_entries(view, len(pieces[p].positions), lay)) is None:
                        missing_pieces += 1
                        continue
                    got[p] = e.copy()
        io_s = time.perf_counter() - self.t0  # submit -> verified entries in DRAM
        nbytes = sum(len(pieces[p].positions) for p in got) * lay.entry_bytes
        if self.is_prefetch:
            for p, rows in got.items():
                seq.dram[(self.layer, p)] = rows
                seq.prefetched.add((self.layer, p))
            return Fetched(torch.zeros(0), torch.zeros(0), np.zeros(0, np.int64), len(self.reads),
                           missing_pieces, nbytes, io_s)
        seq.last = LayerStats(self.plan, io_s)
        sources = list(got.items()) + [(p, seq.dram[(self.layer, p)]) for p in self.plan.cached_used.tolist()
                                       if (self.layer, p) in seq.dram]
        if seq.cache is not None:  # the plan booked its reads in the cache; keep the data it took
            mask = seq.cache.mask(self.layer, len(pieces))
            for p, _ in self.plan.reads:
                if p in got:
                    if mask[p]:
                        seq.dram[(self.layer, p)] = got[p]
                elif mask[p]:  # admitted but never arrived: not in DRAM after all
                    seq.cache.policy.remove((self.layer, p))
                    mask[p] = False
            for key in seq._evicted.pop(self.layer, []):
                if key not in seq.prefetched and not seq.cache.mask(key[0], len(seq.layouts[key[0]].pieces))[key[1]]:
                    seq.dram.pop(key, None)
        m = len(self.positions)
        out = np.zeros((m, *shape), dtype)
        have = np.zeros(m, bool)
        if m and sources:
            slot = np.full(seq.geometry.prompt_len, -1, np.int64)
            slot[self.positions] = np.arange(m)
            pos = np.concatenate([pieces[p].positions for p, _ in sources])
            rows = np.concatenate([r for _, r in sources])
            dst = slot[pos]
            keep = dst >= 0
            out[dst[keep]] = rows[keep]
            have[dst[keep]] = True
        k, v = entries_to_kv(out, lay)
        return Fetched(k, v, np.flatnonzero(~have), len(self.reads), missing_pieces, nbytes, io_s)


class SwarmSequence(StoredSequenceKeys, EntrySource):
    KEY_PREFIX, MANIFEST_PREFIX = b"kvsw/swarm/1/", b"kvsw/swarmman/1/"

    def __init__(self, store: KVStore, layout: KVLayout, geometry: Geometry, token_ids: np.ndarray,
                 layouts: list[LayerLayout], salt: bytes, seq_id: bytes, *, assign: str = "makespan",
                 dedup: bool = True, cache: UnitCache | None = None, model: DriveModel | None = None) -> None:
        self.store, self.layout, self.geometry, self.token_ids = store, layout, geometry, token_ids
        self.layouts, self.salt, self.seq_id = layouts, salt, seq_id
        self._set_key_prefix(layout, salt, seq_id)
        self.cache = cache
        self.dram: dict[tuple[int, int], np.ndarray] = {}  # cached and prefetched pieces' rows
        self.prefetched: set[tuple[int, int]] = set()
        self._evicted: dict[int, list[tuple[int, int]]] = {}  # by the layer whose plan evicted them
        self.last: LayerStats | None = None
        self._keys: list[torch.Tensor] = []
        self._resident: list[LayerKV] = []
        self.retrievers: list[Retriever] = []
        self.assign, self.dedup, self.model = assign, dedup, model or DriveModel()

    def key(self, layer: int, piece: int, copy: int) -> bytes:
        return self._prefix + struct.pack("<HIB", layer, piece, copy)

    @classmethod
    def create(cls, store: KVStore, kv: Sequence[LayerKV], token_ids: Sequence[int], layout: KVLayout,
               layouts: list[LayerLayout], *, sinks: int = 4, window: int = 64, salt: bytes = b"",
               seq_id: bytes | None = None, **kw) -> SwarmSequence:
        tokens = np.asarray(token_ids, np.int64)
        check_kv(kv, layout, len(tokens))
        geo = Geometry(len(tokens), sinks, window)
        # The same prompt with another layout (re-clustered), or of another model, must not share keys
        # (the manifest's key has no model/layout fingerprint of its own).
        seq_id = seq_id or xxhash.xxh3_128_digest(tokens.tobytes() + repr((sinks, window)).encode()
                                                  + layout_fingerprint(layouts) + layout.fingerprint())
        layouts = list(layouts)  # the sequence's own: copies that found no drive of their own are dropped
        seq = cls(store, layout, geo, tokens, layouts, salt, seq_id, **kw)
        off = geo.offloaded
        for layer, (k, v) in enumerate(kv):
            lay = layouts[layer]
            held = np.zeros(len(tokens), bool)
            for p in lay.pieces:
                held[p.positions] = True
            if not held[off].all():
                raise ValueError(f"layer {layer}: the layout leaves offloaded entries without a piece")
            put_layer(store, layer, entries_array(k, v, np.arange(len(tokens), dtype=np.int64)),
                      [(p.positions, copy_hints(p.drives)) for p in lay.pieces],
                      partial(seq.key, layer), seq.resident_key(layer), geo.resident, "pieces")
            layouts[layer] = seq._drop_shared_copies(layer, lay)
            seq._keys.append(k[0, :, geo.off_start:geo.off_end].clone())
            seq._resident.append((k[0][:, geo.resident].clone(), v[0][:, geo.resident].clone()))
        if not store.put(cls.manifest_key(salt, seq_id), seq._manifest()):
            raise DriveError("the sequence manifest failed to write")
        store.flush()
        seq._build_retrievers()
        return seq

    def _drop_shared_copies(self, layer: int, lay: LayerLayout) -> LayerLayout:
        """``lay`` without the trailing copies of a piece that went to a drive already holding an
        earlier copy (no other drive was available): deleted from the store and not counted as
        copies.  Returns ``lay`` itself when every copy has a drive of its own."""
        pieces, dropped = [], False
        for i, p in enumerate(lay.pieces):
            where = self._copy_drives(layer, i, len(p.drives))
            n = len(where)
            while n > 1 and where[n - 1] in where[:n - 1]:
                n -= 1
                self.store.delete(self.key(layer, i, n))
            if n < len(where):
                dropped = True
                p = Piece(p.cluster, p.positions, list(p.drives[:n]))
            pieces.append(p)
        return LayerLayout(lay.clusters, pieces, lay.cluster_pieces) if dropped else lay

    def _manifest(self) -> bytes:
        meta = {"layout": asdict(self.layout), "fingerprint": self.layout.fingerprint().hex(),
                "geometry": asdict(self.geometry)}
        arrays: dict[str, np.ndarray] = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
                                         "tokens": self.token_ids}
        for i, lay in enumerate(self.layouts):
            cl = lay.clusters
            hints = [hint_codes(p.drives) for p in lay.pieces]
            arrays.update(cl.to_arrays("c", str(i)))
            arrays.update({
                f"pc{i}": np.array([p.cluster for p in lay.pieces], np.int64),
                f"pp{i}": np.concatenate([p.positions for p in lay.pieces]) if lay.pieces else np.zeros(0, np.int64),
                f"ps{i}": np.array([len(p.positions) for p in lay.pieces], np.int64),
                f"ph{i}": np.array([h for hs in hints for h in hs], np.int64),
                f"pn{i}": np.array([len(hs) for hs in hints], np.int64)})
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def open(cls, store: KVStore, layout: KVLayout, seq_id: bytes, salt: bytes = b"", **kw) -> SwarmSequence:
        """Reopen a stored sequence (after a restart); refuses (LayoutMismatch) another layout.
        Offloaded keys and resident entries are read back from the drives when first needed."""
        raw = store.get(cls.manifest_key(salt, seq_id))
        if raw is None:
            raise KeyError(f"no co-activation sequence {seq_id.hex()} in this store")
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta["fingerprint"] != layout.fingerprint().hex():
                raise LayoutMismatch(f"sequence {seq_id.hex()} was stored for {KVLayout(**meta['layout'])}, "
                                     f"not {layout}")
            layouts = []
            split = lambda a, n: np.split(a, np.cumsum(n)[:-1]) if len(n) else []  # noqa: E731
            for i in range(layout.num_layers):
                cl = Clusters.from_arrays(z, "c", str(i))
                hints = [[STRIPE if h == STRIPE_HINT else None if h == NO_HINT else int(h) for h in hs.tolist()]
                         for hs in split(z[f"ph{i}"], z[f"pn{i}"])]
                pieces = [Piece(int(c), pos, hs) for c, pos, hs in
                          zip(z[f"pc{i}"].tolist(), split(z[f"pp{i}"], z[f"ps{i}"]), hints)]
                layouts.append(LayerLayout(cl, pieces))
            tokens = z["tokens"]
        seq = cls(store, layout, Geometry(**meta["geometry"]), tokens, layouts, salt, seq_id, **kw)
        seq._build_retrievers()
        return seq

    def _load(self) -> None:
        """Resident entries and offloaded keys of a reopened sequence, from the drives."""
        geo, lay = self.geometry, self.layout
        r = len(geo.resident)
        with self.store.get_many([self.resident_key(i) for i in range(lay.num_layers)]) as res:
            rows = []
            for i, view in enumerate(res.views):
                if (e := payload_entries(view, r, lay)) is None:
                    raise KVMissing(f"resident entries of layer {i} are missing or corrupt")
                rows.append(e.copy())
        self._resident = [entries_to_kv(x, lay) for x in rows]
        self._keys = []
        for layer, ret in enumerate(self.retrievers):
            f = _SwarmFetch(self, layer, geo.offloaded, ret.plan(geo.offloaded))
            got = f.wait()
            if len(got.missing):
                raise KVMissing(f"layer {layer}: {len(got.missing)} offloaded entries unreadable while indexing")
            self._keys.append(got.keys)

    def _copy_drives(self, layer: int, piece: int, copies: int) -> list[int]:
        """The drive each copy of a piece is on (its first extent's: a piece is one extent)."""
        return [e.extents[0].drive for e in self.store.locate([self.key(layer, piece, c) for c in range(copies)])]

    def _build_retrievers(self) -> None:
        """Retrievers over where each copy actually is (the store's catalog)."""
        self.retrievers = []
        for layer, lay in enumerate(self.layouts):
            drives = [self._copy_drives(layer, i, len(p.drives)) for i, p in enumerate(lay.pieces)]
            self.retrievers.append(Retriever(lay.holders(self.geometry.prompt_len),
                                             np.array([len(p.positions) for p in lay.pieces]), drives,
                                             self.layout.entry_bytes, self.store.num_drives, self.model,
                                             self.assign, self.dedup))

    def view(self, *, assign: str | None = None, dedup: bool | None = None, cache: UnitCache | None = None,
             model: DriveModel | None = None) -> SwarmSequence:
        """The same stored pieces read with another retrieval (replica choice, dedup, DRAM cache)."""
        v = SwarmSequence(self.store, self.layout, self.geometry, self.token_ids, self.layouts, self.salt,
                          self.seq_id, assign=assign or self.assign, dedup=self.dedup if dedup is None else dedup,
                          cache=cache, model=model or self.model)
        v._keys, v._resident = self._keys, self._resident
        v._build_retrievers()
        return v

    # ---- EntrySource ----
    def resident(self, layer):
        if not self._resident:
            self._load()
        return self._resident[layer]

    def offloaded_keys(self, layer):
        if not self._keys:
            self._load()
        return self._keys[layer]

    def plan(self, layer: int, positions: np.ndarray) -> ReadPlan:
        """The reads for ``positions`` of ``layer``, booked in the DRAM cache (see ``book``)."""
        self.retrievers[layer].down = set(self.store.failed_drives())
        avail = np.array(sorted(p for (lay, p) in self.prefetched if lay == layer), np.int64) \
            if self.prefetched else None
        plan = self.retrievers[layer].plan(positions, self.cache if self.dedup else None, layer, available=avail)
        self.book(layer, plan)
        return plan

    def book(self, layer: int, plan: ReadPlan) -> None:
        """Tell the DRAM cache about a plan's reads before the next layer plans (its admissions and
        evictions take effect now; the data of evicted pieces is dropped once the read is done)."""
        if self.cache is not None:
            self._evicted.setdefault(layer, []).extend(
                self.cache.after_read(layer, [p for p, _ in plan.reads], plan.cached_used))

    def submit(self, layer, positions):
        positions = np.asarray(positions, np.int64)
        return _SwarmFetch(self, layer, positions, self.plan(layer, positions))

    def prefetch(self, layer: int, pieces: np.ndarray) -> _SwarmFetch:
        """Start reading ``pieces`` of ``layer`` ahead of its step (cached ones are skipped); once
        waited for, the next ``plan`` of that layer counts them as in DRAM."""
        r = self.retrievers[layer]
        held = self.cache.mask(layer, len(r.sizes)) if self.cache is not None else np.zeros(len(r.sizes), bool)
        plan = r.plan_pieces(np.asarray([p for p in pieces if not held[p]], np.int64))
        return _SwarmFetch(self, layer, np.zeros(0, np.int64), plan, prefetch=True)

    def load_cached(self) -> int:
        """Read the pieces the DRAM cache was preloaded with (``UnitCache.preload``) into DRAM, all
        layers in one batch each; a piece that cannot be read leaves the cache.  Returns the
        pieces loaded."""
        if self.cache is None:
            return 0
        fetches = []
        for layer, r in enumerate(self.retrievers):
            held = np.flatnonzero(self.cache.mask(layer, len(r.sizes)))
            fetches.append((layer, held, _SwarmFetch(self, layer, np.zeros(0, np.int64), r.plan_pieces(held),
                                                     prefetch=True)))
        loaded = 0
        for layer, held, f in fetches:
            f.wait()
            for p in held.tolist():
                self.prefetched.discard((layer, p))
                if (layer, p) in self.dram:
                    loaded += 1
                else:
                    self.cache.policy.remove((layer, p))
                    self.cache.mask(layer, len(self.retrievers[layer].sizes))[p] = False
        return loaded

    def release_prefetched(self, layer: int) -> None:
        """Forget prefetched pieces of ``layer`` that the cache did not keep."""
        for key in [k for k in self.prefetched if k[0] == layer]:
            self.prefetched.discard(key)
            if self.cache is None or not self.cache.mask(layer, len(self.layouts[layer].pieces))[key[1]]:
                self.dram.pop(key, None)

    def submit_plan(self, layer: int, positions: np.ndarray, plan: ReadPlan) -> _SwarmFetch:
        """Read a plan made by ``plan`` (or booked with ``book``): benchmarks time planning and I/O apart."""
        return _SwarmFetch(self, layer, np.asarray(positions, np.int64), plan)

    def read_step(self, plans: list[tuple[int, np.ndarray, ReadPlan]], together: bool = True) -> float:
        """Read one decode step's planned layers (``(layer, positions, plan)``, made by ``plan``) and
        return the seconds until the last is verified in DRAM: all layers in flight at once
        (``together``, as with cross-layer prefetch) or layer after layer."""
        t0 = time.perf_counter()
        if together:
            for h in [self.submit_plan(layer, pos, plan) for layer, pos, plan in plans]:
                h.wait()
        else:
            for layer, pos, plan in plans:
                self.submit_plan(layer, pos, plan).wait()
        return time.perf_counter() - t0

    def groups(self, layer: int) -> list[np.ndarray]:
        return [p.positions for p in self.layouts[layer].pieces]

    def expand(self, layer: int, positions: np.ndarray) -> np.ndarray:
        plan = self.retrievers[layer].plan(np.asarray(positions, np.int64))
        pieces = self.layouts[layer].pieces
        return np.unique(np.concatenate([np.asarray(positions, np.int64)] + [pieces[p].positions
                                                                            for p, _ in plan.reads]))

    def object_count(self) -> int:
        return sum(lay.copies() for lay in self.layouts)

