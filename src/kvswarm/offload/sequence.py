"""An offloaded prompt: its KV entries on the drives (or in memory), fetched by position.

After prefill, the entries of positions ``[sinks, prompt_len - window)`` of every layer move
to an ``EntrySource``; the first ``sinks`` and last ``window`` positions stay resident in DRAM
(the attention sinks and the recent window carry ~half the attention mass and are read
every step).  ``StoreSequence`` writes the offloaded entries as pages (see grouping.py) into
a ``KVStore`` striped over the drives, plus the resident entries and a manifest, so a later
process can reopen it; ``MemorySequence`` keeps them in tensors for I/O-free experiments
(traces, quality sweeps).  Both answer the same submit-then-wait ``fetch``.

Store keys: ``b"kvsw/sparse/1/" + layout fingerprint + salt + sequence id + (layer, page)``
for pages and residents; the manifest key leaves the fingerprint out so that opening a
sequence with another model's layout is *refused* (``LayoutMismatch``) rather than missed.
"""

from __future__ import annotations

import abc
import io
import json
import logging
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from functools import partial
from typing import ClassVar

import numpy as np
import torch
import xxhash

from kvswarm.buffers import BufferPoolExhausted
from kvswarm.entry_source import EntrySource, Fetched, FetchHandle, Geometry, KVMissing, LayerKV
from kvswarm.errors import DriveError, KVSwarmError, LayoutMismatch
from kvswarm.layout import KVLayout
from kvswarm.offload.grouping import (
    Grouping,
    PageTable,
    entries_per_page,
    make_grouping,
)
from kvswarm.store import KVStore

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StoreRead(FetchHandle):
    """A fetch that submits one store read of ``keys`` at once; ``wait`` builds its result once
    (``_finish``), timing ``io_s`` from ``t0``, taken before the keys are built."""

    def __init__(self, store: KVStore, keys: Iterable[bytes]) -> None:
        self.t0 = time.perf_counter()
        keys = list(keys)
        try:
            self.handle = store.submit_get(keys) if keys else None
        except BufferPoolExhausted:  # more than the store's read buffers hold at once: all misses, recomputed
            log.warning("kvswarm offload: a read of %d objects does not fit the store's buffer pool (%d B): "
                        "recomputed instead; raise buffer_pool_bytes", len(keys), store.buffer_bytes)
            self.handle = None
        self._result: Fetched | None = None

    def poll(self) -> bool:
        return self.handle is None or self.handle.poll()

    def wait(self) -> Fetched:
        if self._result is None:
            self._result = self._finish()
        return self._result

    @abc.abstractmethod
    def _finish(self) -> Fetched: ...


def payload_entries(view: memoryview | None, n: int, lay: KVLayout) -> np.ndarray | None:
    """A read's payload as its ``n`` entries [n, 2, kv_heads, head_dim] over the buffer (no copy);
    None when it is missing or of the wrong size (as bad as a checksum failure: a miss)."""
    if view is None or len(view) != n * lay.entry_bytes:
        return None
    return np.frombuffer(view, lay.numpy_dtype()).reshape(n, 2, lay.num_kv_heads, lay.head_dim)


class StoredSequenceKeys:
    """Store keys of a sequence kept on a KVStore: its entries under ``KEY_PREFIX`` + the
    model/layout fingerprint + the tenant salt + the sequence id, its manifest under
    ``MANIFEST_PREFIX`` + salt + id (found again without knowing the layout)."""

    KEY_PREFIX: ClassVar[bytes]
    MANIFEST_PREFIX: ClassVar[bytes]
    _prefix: bytes

    def _set_key_prefix(self, layout: KVLayout, salt: bytes, seq_id: bytes) -> None:
        self._prefix = self.KEY_PREFIX + layout.fingerprint() + struct.pack("<H", len(salt)) + salt + seq_id

    def resident_key(self, layer: int) -> bytes:
        return self._prefix + b"r" + struct.pack("<H", layer)

    @classmethod
    def manifest_key(cls, salt: bytes, seq_id: bytes) -> bytes:
        return cls.MANIFEST_PREFIX + struct.pack("<H", len(salt)) + salt + seq_id


# ---- helpers ------------------------------------------------------------------------------
def check_kv(kv: Sequence[LayerKV], layout: KVLayout, n: int) -> None:
    if len(kv) != layout.num_layers:
        raise LayoutMismatch(f"{len(kv)} layers of KV for a {layout.num_layers}-layer layout")
    want = TORCH_DTYPES.get(layout.dtype)
    for i, (k, v) in enumerate(kv):
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[1] != layout.num_kv_heads or k.shape[2] < n \
                or k.shape[3] != layout.head_dim or k.shape != v.shape or k.dtype != want:
            raise LayoutMismatch(f"layer {i} KV {tuple(k.shape)} {k.dtype} does not match {layout} "
                                 f"(need [1, {layout.num_kv_heads}, >={n}, {layout.head_dim}] {want})")


def entries_array(k: torch.Tensor, v: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    """Entries of ``positions`` as [n, 2, kv_heads, head_dim] raw (numpy) in storage order."""
    idx = torch.from_numpy(positions)
    e = torch.stack([k[0].index_select(1, idx), v[0].index_select(1, idx)]).permute(2, 0, 1, 3).contiguous()
    return e.view(torch.int16).numpy().view(np.uint16) if e.dtype == torch.bfloat16 else e.numpy()


def put_layer(store: KVStore, layer: int, ent: np.ndarray, pages: Iterable[tuple[np.ndarray, Sequence[object]]],
              page_key: Callable[[int, int], bytes], resident_key: bytes, resident: np.ndarray, what: str) -> None:
    """Write one layer in one batch: each page's entries ``ent[positions]`` once per copy, with that
    copy's drive hint (``page_key(page, copy)``), then the resident entries; DriveError if any failed."""
    items, hints = [], []
    for i, (positions, copy_hints) in enumerate(pages):
        data = np.ascontiguousarray(ent[positions])
        for c, h in enumerate(copy_hints):
            items.append((page_key(i, c), data))
            hints.append(h)
    items.append((resident_key, np.ascontiguousarray(ent[resident])))
    stored = store.put_many(items, hints + [None])
    if not all(stored):
        raise DriveError(f"layer {layer}: {stored.count(False)} of {len(items)} {what} failed to write")


def entries_to_kv(rows: np.ndarray, layout: KVLayout) -> LayerKV:
    """Inverse of entries_array: [n, 2, h, d] raw -> K, V [h, n, d] tensors of the layout dtype."""
    t = torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16) if layout.dtype == "bfloat16" \
        else torch.from_numpy(rows)
    t = t.permute(1, 2, 0, 3)
    return t[0], t[1]


def kv_from_cache(cache) -> list[LayerKV]:
    """(K, V) per layer of a transformers DynamicCache (or any Cache with .layers[i].keys)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


# ---- in memory ----------------------------------------------------------------------------
class _Done(FetchHandle):
    def __init__(self, f: Fetched) -> None:
        self._f = f

    def poll(self) -> bool:
        return True

    def wait(self) -> Fetched:
        return self._f


class MemorySequence(EntrySource):
    """Offloaded entries kept in DRAM tensors: same interface, no I/O (traces, quality sweeps)."""

    def __init__(self, kv: Sequence[LayerKV], token_ids: Sequence[int], layout: KVLayout, sinks: int = 4,
                 window: int = 64) -> None:
        n = len(token_ids)
        check_kv(kv, layout, n)
        self.layout, self.geometry = layout, Geometry(n, sinks, window)
        self.token_ids = np.asarray(token_ids, np.int64)
        self._kv = [(k[0, :, :n].clone(), v[0, :, :n].clone()) for k, v in kv]

    def resident(self, layer):
        idx = torch.from_numpy(self.geometry.resident)
        k, v = self._kv[layer]
        return k.index_select(1, idx), v.index_select(1, idx)

    def submit(self, layer, positions):
        k, v = self._kv[layer]
        idx = torch.from_numpy(np.asarray(positions, np.int64))
        return _Done(Fetched(k.index_select(1, idx), v.index_select(1, idx), np.zeros(0, np.int64)))

    def offloaded_keys(self, layer):
        return self._kv[layer][0][:, self.geometry.off_start:self.geometry.off_end]


# ---- on the drives ------------------------------------------------------------------------
class _StoreFetch(StoreRead):
    def __init__(self, seq: StoreSequence, layer: int, positions: np.ndarray) -> None:
        self.seq, self.layer, self.positions = seq, layer, positions
        table = seq.tables[layer]
        pg = table.page_of[positions]
        if len(positions) and (pg < 0).any():
            raise ValueError(f"layer {layer}: positions {positions[pg < 0][:5]} are not offloaded")
        self.pages, self.inv = np.unique(pg, return_inverse=True)
        self.copy = seq.choose_copies(layer, self.pages)
        super().__init__(seq.store, (seq.copy_key(layer, int(p), int(c)) for p, c in zip(self.pages, self.copy)))

    def _finish(self) -> Fetched:
        seq, lay = self.seq, self.seq.layout
        shape = (2, lay.num_kv_heads, lay.head_dim)
        dtype = lay.numpy_dtype()
        table = seq.tables[self.layer]
        m = len(self.positions)
        ok = np.zeros(len(self.pages), bool)
        base = np.zeros(len(self.pages), np.int64)
        arrays, off = [], 0
        if self.handle is not None:
            with self.handle.wait() as res:
                for i, (p, view) in enumerate(zip(self.pages, res.views)):
                    if (e := payload_entries(view, len(table.pages[p]), lay)) is None:
                        continue
                    arrays.append(e)
                    ok[i], base[i] = True, off
                    off += len(e)
                rows = np.concatenate(arrays) if arrays else np.zeros((0, *shape), dtype)  # copies out of the lease
                arrays.clear()  # drop the exports of the lease's views before it is released
        else:
            rows = np.zeros((0, *shape), dtype)
        if table.extra is not None and not ok.all():
            rows = self._other_copies(ok, base, rows)
        io_s = time.perf_counter() - self.t0
        hit = ok[self.inv] if m else np.zeros(0, bool)
        out = np.zeros((m, *shape), dtype)
        out[hit] = rows[(base[self.inv] + table.slot_of[self.positions])[hit]]
        k, v = entries_to_kv(out, lay)
        return Fetched(k, v, np.flatnonzero(~hit), len(self.pages), int((~ok).sum()), len(rows) * lay.entry_bytes, io_s)

    def _other_copies(self, ok: np.ndarray, base: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Read the pages whose chosen copy was missing or corrupt from their other copies (in
        place in ``ok``/``base``); returns ``rows`` with what arrived appended."""
        seq, lay, table = self.seq, self.seq.layout, self.seq.tables[self.layer]
        for attempt in range(1, 256):
            todo = [i for i in np.flatnonzero(~ok) if attempt < table.copies(int(self.pages[i]))]
            if not todo:
                break
            keys = [seq.copy_key(self.layer, int(self.pages[i]), (int(self.copy[i]) + attempt)
                                 % table.copies(int(self.pages[i]))) for i in todo]
            got = []
            end = len(rows)  # where the next arriving page's rows start
            with seq.store.get_many(keys) as res:
                for i, view in zip(todo, res.views):
                    if (e := payload_entries(view, len(table.pages[self.pages[i]]), lay)) is not None:
                        got.append(e.copy())
                        ok[i], base[i] = True, end
                        end += len(e)
            if got:
                rows = np.concatenate([rows, *got])
        return rows


class StoreSequence(StoredSequenceKeys, EntrySource):
    """A prompt's KV offloaded to a KVStore: pages of entries striped over the drives."""

    KEY_PREFIX, MANIFEST_PREFIX = b"kvsw/sparse/1/", b"kvsw/seqman/1/"

    def __init__(self, store: KVStore, layout: KVLayout, geometry: Geometry, token_ids: np.ndarray,
                 tables: list[PageTable], page_bytes: int, grouping: str, salt: bytes, seq_id: bytes) -> None:
        self.store, self.layout, self.geometry = store, layout, geometry
        self.token_ids, self.tables, self.page_bytes, self.grouping = token_ids, tables, page_bytes, grouping
        self.salt, self.seq_id = salt, seq_id
        self._set_key_prefix(layout, salt, seq_id)
        self._index_keys: list[torch.Tensor] | None = None
        self._resident: list[LayerKV] | None = None

    # ---- keys ----
    def page_key(self, layer: int, page: int) -> bytes:
        return self._prefix + struct.pack("<HI", layer, page)

    def copy_key(self, layer: int, page: int, copy: int) -> bytes:
        """Copy 0 is the page's own key (sequences without replicas are unchanged)."""
        return self.page_key(layer, page) + (struct.pack("<B", copy) if copy else b"")

    def choose_copies(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """Copy to read per page: for replicated pages, the copy on a healthy drive with the
        fewest bytes already assigned in this batch (the drive of each copy from the catalog)."""
        table = self.tables[layer]
        copy = np.zeros(len(pages), np.int64)
        if table.extra is None or not len(pages):
            return copy
        load = np.zeros(self.store.num_drives)
        healthy = self.store.drive_health()
        nbytes = [table.extent_bytes(int(p), self.layout.entry_bytes) for p in pages]
        for i in sorted(range(len(pages)), key=lambda j: table.copies(int(pages[j]))):  # fixed pages first
            best, best_drive, best_load = 0, -1, np.inf
            located = self.store.locate([self.copy_key(layer, int(pages[i]), c)
                                         for c in range(table.copies(int(pages[i])))])
            for c, e in enumerate(located):
                d = e.extents[0].drive if e is not None else -1
                here = load[d] if d >= 0 and healthy[d] else np.inf
                if here < best_load:
                    best, best_drive, best_load = c, d, here
            copy[i] = best
            if best_drive >= 0:
                load[best_drive] += nbytes[i]
        return copy

    # ---- create / open ----
    @classmethod
    def create(cls, store: KVStore, kv: Sequence[LayerKV], token_ids: Sequence[int], layout: KVLayout, *,
               sinks: int = 4, window: int = 64, page_bytes: int = 4096, grouping: str | Grouping = "contiguous",
               salt: bytes = b"", seq_id: bytes | None = None, keep_index_keys: bool = True) -> StoreSequence:
        """Write the offloadable entries of ``kv`` (prefill KV of ``token_ids``) to ``store``."""
        tokens = np.asarray(token_ids, np.int64)
        n = len(tokens)
        check_kv(kv, layout, n)
        geo = Geometry(n, sinks, window)
        grouper = make_grouping(grouping)
        cap = entries_per_page(page_bytes, layout.entry_bytes)
        if seq_id is None:  # the layout too: the manifest's key has no fingerprint of its own
            seq_id = xxhash.xxh3_128_digest(tokens.tobytes() + layout.fingerprint() + json.dumps(
                [asdict(geo), page_bytes, grouper.describe()]).encode())
        off = geo.offloaded
        tables = []
        seq = cls(store, layout, geo, tokens, tables, page_bytes, grouper.describe(), salt, seq_id)
        index_keys = []
        for layer, (k, v) in enumerate(kv):
            keys = k[0, :, geo.off_start:geo.off_end]
            groups = grouper.group(layer, off, keys, cap)
            table = PageTable.from_groups(groups, n, cap)
            if len(off) and (table.page_of[off] < 0).any():
                raise ValueError(f"grouping {grouper.describe()} left layer {layer} entries unplaced")
            tables.append(table)
            put_layer(store, layer, entries_array(k, v, np.arange(n, dtype=np.int64)),
                      [(g.positions, [g.hint, *g.copies]) for g in groups],
                      partial(seq.copy_key, layer), seq.resident_key(layer), geo.resident, "pages")
            if keep_index_keys:
                index_keys.append(keys.clone())
        seq._index_keys = index_keys if keep_index_keys else None
        if not store.put(cls.manifest_key(salt, seq_id), seq._manifest()):
            raise DriveError("the sequence manifest failed to write")
        store.flush()
        return seq

    def _manifest(self) -> bytes:
        meta = {"layout": asdict(self.layout), "fingerprint": self.layout.fingerprint().hex(),
                "geometry": asdict(self.geometry), "page_bytes": self.page_bytes, "grouping": self.grouping}
        buf = io.BytesIO()
        extra = {}
        if any(t.extra is not None for t in self.tables):  # older manifests have no copies: all single
            extra = {"extra": np.concatenate([t.extra if t.extra is not None else np.zeros(len(t.pages), np.int16)
                                              for t in self.tables]),
                     "npages": np.array([len(t.pages) for t in self.tables], np.int64)}
        np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), tokens=self.token_ids,
                 page_of=np.stack([t.page_of for t in self.tables]), slot_of=np.stack([t.slot_of for t in self.tables]),
                 **extra)
        return buf.getvalue()

    @classmethod
    def open(cls, store: KVStore, layout: KVLayout, seq_id: bytes, salt: bytes = b"") -> StoreSequence:
        """Reopen a stored sequence; refuses (LayoutMismatch) a layout other than the one it was written with."""
        raw = store.get(cls.manifest_key(salt, seq_id))
        if raw is None:
            raise KeyError(f"no offloaded sequence {seq_id.hex()} in this store")
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            tokens, page_of, slot_of = z["tokens"], z["page_of"], z["slot_of"]
            extras = np.split(z["extra"], np.cumsum(z["npages"])[:-1]) if "extra" in z.files else None
        if meta["fingerprint"] != layout.fingerprint().hex():
            raise LayoutMismatch(f"sequence {seq_id.hex()} was stored for {KVLayout(**meta['layout'])}, "
                                 f"not {layout}")
        tables = []
        for layer, (po, so) in enumerate(zip(page_of, slot_of)):
            pos = np.flatnonzero(po >= 0)
            order = pos[np.lexsort((so[pos], po[pos]))]
            counts = np.bincount(po[order]) if len(order) else np.zeros(0, np.int64)
            ex = extras[layer] if extras is not None and extras[layer].any() else None
            tables.append(PageTable(po, so, np.split(order.astype(np.int64), np.cumsum(counts)[:-1])
                                    if len(order) else [], ex))
        return cls(store, layout, Geometry(**meta["geometry"]), tokens, tables, meta["page_bytes"],
                   meta["grouping"], salt, seq_id)

    # ---- reads ----
    def resident(self, layer):
        if self._resident is None:
            self._resident = []
            with self.store.get_many([self.resident_key(i) for i in range(self.layout.num_layers)]) as res:
                r = len(self.geometry.resident)
                for i, view in enumerate(res.views):
                    if (rows := payload_entries(view, r, self.layout)) is None:
                        raise KVMissing(f"resident entries of layer {i} are missing or corrupt")
                    self._resident.append(entries_to_kv(rows.copy(), self.layout))
        return self._resident[layer]

    def submit(self, layer, positions):
        return _StoreFetch(self, layer, np.asarray(positions, np.int64))

    def offloaded_keys(self, layer):
        if self._index_keys is not None:
            return self._index_keys[layer]
        f = self.fetch(layer, self.geometry.offloaded)
        if len(f.missing):
            raise KVMissing(f"layer {layer}: {len(f.missing)} offloaded entries unreadable while indexing")
        return f.keys

    def repair(self, layer, positions, kv):
        table = self.tables[layer]
        pages = np.unique(table.page_of[positions])
        k, v = kv
        items = [(self.copy_key(layer, int(p), c), entries_array(k, v, table.pages[p])) for p in pages
                 for c in range(table.copies(int(p)))]
        try:
            return sum(self.store.put_many(items))
        except KVSwarmError as e:  # no healthy drive with room: the recomputed KV still serves this step
            log.warning("kvswarm offload: layer %d: %d pages not repaired (%s)", layer, len(pages), e)
            return 0

    def groups(self, layer):
        return self.tables[layer].pages

    def expand(self, layer, positions):
        table = self.tables[layer]
        pages = np.unique(table.page_of[positions])
        return np.sort(np.concatenate([table.pages[p] for p in pages])) if len(pages) else positions

    def object_count(self) -> int:
        return sum(len(t.pages) + (int(t.extra.sum()) if t.extra is not None else 0) for t in self.tables)

    def delete(self) -> None:
        """Remove this sequence's objects from the store."""
        for layer, t in enumerate(self.tables):
            for p in range(len(t.pages)):
                for c in range(t.copies(p)):
                    self.store.delete(self.copy_key(layer, p, c))
            self.store.delete(self.resident_key(layer))
        self.store.delete(self.manifest_key(self.salt, self.seq_id))


def offload(kv: Sequence[LayerKV], token_ids: Sequence[int], layout: KVLayout, store: KVStore | None = None,
            **kw) -> EntrySource:
    """Offload a prompt's prefill KV: to ``store`` (a StoreSequence) or, without one, to memory."""
    if store is None:
        return MemorySequence(kv, token_ids, layout, kw.get("sinks", 4), kw.get("window", 64))
    return StoreSequence.create(store, kv, token_ids, layout, **kw)
