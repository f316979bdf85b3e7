"""Offloaded decoding when the store fails under it (no model needed: random prompt KV): the
recomputed KV serves the step, and nothing raises into the decode loop."""

import torch

from kvswarm import KVStore, StoreConfig
from kvswarm.layout import KVLayout
from kvswarm.offload import OffloadedKVCache, StoreSequence
from kvswarm.offload.cache import StepStats

LAYOUT = KVLayout(2, 2, 8, "float32", 16)
N = 100  # prompt tokens: 4 sinks, 8 in the window, 88 offloaded


def _prompt_kv() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 2, N, 8, generator=g), torch.randn(1, 2, N, 8, generator=g)) for _ in range(2)]


def test_the_last_drive_failing_recomputes_and_does_not_raise(drive_dirs):
    kv = _prompt_kv()
    with KVStore(StoreConfig(drive_dirs(1), capacity_per_drive=8 << 20, buffer_pool_bytes=4 << 20)) as store:
        seq = StoreSequence.create(store, kv, list(range(N)), LAYOUT, sinks=4, window=8)
        cache = OffloadedKVCache(seq, "dense", recompute=lambda: kv)
        store.fail_drive(0)  # its pages are misses, and their repair has no drive to go to
        f = cache._fetch(0, seq.geometry.offloaded, StepStats(0))
        assert len(f.missing) == len(seq.geometry.offloaded)
        assert torch.equal(f.keys, kv[0][0][0][:, 4:N - 8]) and torch.equal(f.values, kv[0][1][0][:, 4:N - 8])


def test_a_read_larger_than_the_buffer_pool_is_recomputed(drive_dirs):
    kv = _prompt_kv()
    with KVStore(StoreConfig(drive_dirs(1), capacity_per_drive=8 << 20, buffer_pool_bytes=4 << 20)) as store:
        seq = StoreSequence.create(store, kv, list(range(N)), LAYOUT, sinks=4, window=8)
        cache = OffloadedKVCache(seq, "dense", recompute=lambda: kv)
        store.pool = type(store.pool)(4096)  # a pool too small for the layer's pages
        f = cache._fetch(1, seq.geometry.offloaded, StepStats(0))
        assert torch.equal(f.keys, kv[1][0][0][:, 4:N - 8])


def test_two_models_offloading_the_same_tokens_keep_their_own_manifests(drive_dirs):
    """Same tokens, geometry and salt, two models: each sequence reopens as its own, never as a
    LayoutMismatch over the other's manifest."""
    from dataclasses import replace

    kv = _prompt_kv()
    other = replace(LAYOUT, model_id="another-model")
    with KVStore(StoreConfig(drive_dirs(1), capacity_per_drive=8 << 20, buffer_pool_bytes=4 << 20)) as store:
        a = StoreSequence.create(store, kv, list(range(N)), LAYOUT, sinks=4, window=8)
        b = StoreSequence.create(store, kv, list(range(N)), other, sinks=4, window=8)
        assert a.seq_id != b.seq_id
        for seq, lay in ((a, LAYOUT), (b, other)):
            again = StoreSequence.open(store, lay, seq.seq_id)
            f = again.fetch(0, again.geometry.offloaded)
            assert not len(f.missing) and torch.equal(f.keys, kv[0][0][0][:, 4:N - 8])


def test_a_manifest_that_fails_to_write_fails_the_create(drive_dirs, monkeypatch):
    """Without its manifest the sequence cannot be reopened: create says so, as the Swarm one does."""
    import pytest

    from kvswarm.errors import DriveError

    kv = _prompt_kv()
    with KVStore(StoreConfig(drive_dirs(1), capacity_per_drive=8 << 20, buffer_pool_bytes=4 << 20)) as store:
        put = store.put
        manifest = StoreSequence.MANIFEST_PREFIX
        monkeypatch.setattr(store, "put",
                            lambda key, data, hint=None: not key.startswith(manifest) and put(key, data, hint))
        with pytest.raises(DriveError, match="manifest"):
            StoreSequence.create(store, kv, list(range(N)), LAYOUT, sinks=4, window=8)
