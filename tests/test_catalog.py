"""Catalog persistence: journal replay, checkpoints, epochs, torn tails (property-based)."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswarm.catalog import CHECKPOINT, JOURNAL, Catalog, CatalogCorrupt, Entry

digests = st.binary(min_size=16, max_size=16)
ops = st.lists(st.tuples(st.sampled_from(["put", "del", "dels", "ckpt"]), st.integers(0, 15), st.integers(1, 4)),
               max_size=60)


def _apply(cat: Catalog, model: dict, keys: list[bytes], op: str, k: int, parts: int) -> None:
    d = keys[k % len(keys)]
    if op == "put":
        e = Entry(cat.new_generation(), parts * 100, tuple((i % 3, 4096 * (k * 8 + i), 4096, k + i)
                                                            for i in range(parts)))
        cat.put(d, e)
        model[d] = e
    elif op == "del":
        assert cat.delete(d) == model.pop(d, None)
    elif op == "dels":  # a batch, a digest repeated in it too: held the first time only
        batch = [keys[(k + i) % len(keys)] for i in range(parts)] + [d]
        assert cat.delete_many(batch) == [model.pop(x, None) for x in batch]
    else:
        cat.checkpoint()


@settings(max_examples=40, deadline=None)
@given(st.lists(digests, min_size=1, max_size=16, unique=True), ops)
def test_reopen_after_sync_restores_exactly(tmp_path_factory, keys, seq):
    path = str(tmp_path_factory.mktemp("cat"))
    cat = Catalog(path)
    model: dict = {}
    for op, k, parts in seq:
        _apply(cat, model, keys, op, k, parts)
    cat.sync()
    os.close(cat._jfd)  # simulate a crash: no close(), no final checkpoint
    again = Catalog(path)
    assert again.entries == model
    assert again.next_generation > max((e.generation for e in model.values()), default=0)


def test_torn_tail_is_cut_and_appends_continue(tmp_path):
    cat = Catalog(str(tmp_path))
    for i in range(5):
        cat.put(bytes([i]) * 16, Entry(cat.new_generation(), 10, ((0, 4096 * i, 4096, i),)))
    cat.sync()
    os.close(cat._jfd)
    jp = tmp_path / JOURNAL
    size = jp.stat().st_size
    with open(jp, "r+b") as f:  # tear the last record in half
        f.truncate(size - 20)
    cat = Catalog(str(tmp_path))
    assert cat.torn_tail and len(cat) == 4
    cat.put(b"x" * 16, Entry(cat.new_generation(), 1, ((1, 0, 4096, 7),)))
    cat.sync()
    os.close(cat._jfd)
    assert len(Catalog(str(tmp_path))) == 5


def test_stale_journal_after_checkpoint_is_not_replayed(tmp_path):
    cat = Catalog(str(tmp_path))
    d = b"k" * 16
    cat.put(d, Entry(cat.new_generation(), 1, ((0, 0, 4096, 1),)))
    cat.sync()
    old_journal = (tmp_path / JOURNAL).read_bytes()
    cat.delete(d)
    cat.checkpoint()
    os.close(cat._jfd)
    # A crash between the checkpoint rename and the journal reset leaves the old epoch's journal.
    (tmp_path / JOURNAL).write_bytes(old_journal)
    assert d not in Catalog(str(tmp_path)).entries


def test_corrupt_checkpoint_raises(tmp_path):
    cat = Catalog(str(tmp_path))
    cat.put(b"a" * 16, Entry(cat.new_generation(), 1, ((0, 0, 4096, 1),)))
    cat.checkpoint()
    cat.close()
    p = tmp_path / CHECKPOINT
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(CatalogCorrupt):
        Catalog(str(tmp_path))


def test_same_digest_twice_in_one_batch_keeps_one_row(tmp_path):
    cat = Catalog(str(tmp_path))
    d = b"d" * 16
    g = cat.new_generations(3)
    e0, e1, e2 = (Entry(g + i, 10, ((0, 4096 * i, 4096, i),)) for i in range(3))
    assert cat.put_many([(d, e0), (d, e2), (d, e1)]) == [None, e0, e1]  # e1 is older than e2: it loses
    assert cat.get(d) == e2 and len(cat) == 1
    cat.checkpoint()
    cat.close()
    again = Catalog(str(tmp_path))
    assert dict(again.entries) == {d: e2}


def test_rows_are_reused_after_deletes(tmp_path):
    cat = Catalog(str(tmp_path))
    keys = [bytes([i]) * 16 for i in range(50)]
    for k in keys:
        cat.put(k, Entry(cat.new_generation(), 1, ((0, 0, 4096, 1),)))
    used = cat._used
    for k in keys[:25]:
        cat.delete(k)
    for k in keys[:25]:
        cat.put(k, Entry(cat.new_generation(), 2, ((1, 4096, 4096, 2), (1, 8192, 4096, 3))))
    assert cat._used == used and len(cat) == 50
    found, ext = cat.locate([keys[0], b"missing" * 2 + b"xx", keys[30]])
    assert found == [0, 2] and ext.obj.tolist() == [0, 0, 1] and ext.part.tolist() == [0, 1, 0]
    assert ext.offset.tolist() == [4096, 8192, 0]


def test_locate_skips_a_row_deleted_under_it(tmp_path):
    """A lookup that raced a delete (index probed, row freed before the gather) reads it as a miss."""
    cat = Catalog(str(tmp_path))
    keys = [bytes([i]) * 16 for i in range(4)]
    g = cat.new_generations(4)
    for i, k in enumerate(keys):  # two-extent objects: the lookup takes the multi-extent path
        cat.put(k, Entry(g + i, 5000, ((0, 8192 * i, 4096, i), (1, 8192 * i, 4096, i))))
    cat._rows["parts"][cat._index[keys[1]]] = 0  # freed after the probe, as a concurrent delete does
    found, ext = cat.locate(keys)
    assert found == [0, 2, 3] and ext.obj.tolist() == [0, 0, 1, 1, 2, 2]
    assert ext.offset.tolist() == [0, 0, 16384, 16384, 24576, 24576]


def test_a_failed_journal_write_leaves_no_torn_record_and_loses_nothing(tmp_path, monkeypatch):
    """A full metadata disk takes part of a write, then fails: the journal is cut back to its last
    whole record, the records stay pending, the sync that was to make them durable says so, and the
    next one puts them all down once."""
    import kvswarm.catalog as catalog_mod
    from kvswarm.errors import MetadataError

    cat = Catalog(str(tmp_path))
    keys = [i.to_bytes(16, "little") for i in range(5000)]
    entries = [Entry(cat.new_generation(), 1, ((0, 4096 * i, 4096, i),)) for i in range(len(keys))]
    real_write, calls = os.write, []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:1000]))  # a short write, then no space
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(catalog_mod.os, "write", full_disk)
    cat.put_many(list(zip(keys, entries)))  # 5000 records: written out at once, which fails
    assert calls and cat.get(keys[-1]) == entries[-1]  # applied in memory, as the pending records say
    with pytest.raises(MetadataError, match="journal .*No space left"):  # names the file and the cause
        cat.sync()
    assert os.path.getsize(os.path.join(str(tmp_path), JOURNAL)) < 1000  # cut back: no torn record
    monkeypatch.setattr(catalog_mod.os, "write", real_write)
    cat.sync()
    cat.close()
    again = Catalog(str(tmp_path))
    assert len(again) == len(keys) and again.get(keys[1234]) == entries[1234]


def test_written_before_lists_only_older_live_objects(tmp_path):
    cat = Catalog(str(tmp_path))
    old = [i.to_bytes(16, "little") for i in range(5000)]  # more than one 4096-row chunk
    cat.put_many([(k, Entry(cat.new_generation(), 1, ((0, 0, 4096, 1),))) for k in old])
    cut = cat.next_generation
    cat.delete(old[3])
    cat.put(old[7], Entry(cat.new_generation(), 1, ((0, 0, 4096, 2),)))  # rewritten: newer now
    cat.put(b"n" * 16, Entry(cat.new_generation(), 1, ((0, 0, 4096, 3),)))  # new, in row 3 reused
    assert list(cat.written_before(cut)) == [k for i, k in enumerate(old) if i not in (3, 7)]


def test_a_batch_of_new_objects_replays_like_its_puts_one_by_one(tmp_path):
    """A put batch of new one-extent objects is journaled as one block of records: replayed, it gives
    the same entries as the same puts made one at a time, and mixed batches after it still replay."""
    items = [(os.urandom(16), Entry(i + 1, 1000 + i, ((i % 4, 4096 * i, 4096, 2**63 + i),))) for i in range(50)]
    one, batch = Catalog(str(tmp_path / "one")), Catalog(str(tmp_path / "batch"))
    for d, e in items:
        one.put_many([(d, e)])
    batch.put_many(items)
    mixed = [(items[0][0], Entry(60, 7, ((1, 1 << 20, 8192, 5), (2, 1 << 20, 4096, 6)))), (os.urandom(16),
             Entry(61, 9, ((3, 2 << 20, 4096, 7),)))]
    for cat in (one, batch):
        cat.put_many(mixed)
        cat.sync()
        os.close(cat._jfd)  # a crash: the journal alone is replayed
    want = dict(items) | dict(mixed)
    assert Catalog(str(tmp_path / "one")).entries == want
    assert Catalog(str(tmp_path / "batch")).entries == want
    assert os.path.getsize(tmp_path / "one" / JOURNAL) == os.path.getsize(tmp_path / "batch" / JOURNAL)


def test_put_new_singles_records_columns_or_nothing(tmp_path):
    """A batch of new, distinct one-extent objects is recorded from its columns (rows, journal,
    index); a batch with a held or repeated digest records nothing, for put_many to handle."""
    import numpy as np

    from kvswarm.catalog import Extent

    cat = Catalog(str(tmp_path))
    cols = lambda n, base: (np.arange(n, dtype=np.int64) + base, np.full(n, 4000, np.int64),  # noqa: E731
                            np.arange(n, dtype=np.int64) % 2, np.arange(n, dtype=np.int64) * 4096,
                            np.full(n, 4096, np.int64), np.arange(n, dtype=np.uint64) + 7)
    digests = [bytes([i]) * 16 for i in range(5)]
    assert cat.put_new_singles(digests, *cols(5, 10))
    assert not cat.put_new_singles([digests[0], b"z" * 16], *cols(2, 20))  # held already
    assert not cat.put_new_singles([b"y" * 16, b"y" * 16], *cols(2, 30))  # twice in one batch
    assert cat.get(b"z" * 16) is None and cat.get(b"y" * 16) is None
    cat.sync()
    cat.close()
    again = Catalog(str(tmp_path))
    for i, d in enumerate(digests):
        assert again.get(d) == Entry(10 + i, 4000, (Extent(i % 2, i * 4096, 4096, 7 + i),))
    again.close()
