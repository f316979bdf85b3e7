"""Prefix keys: chained, namespaced by layout and tenant, stable across processes; block headers."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswarm.layout import KVLayout
from kvswarm.prefix import BlockHeader, PrefixKeyer, header_bytes, longest_prefix, matches, new_block, read_header

LAYOUT = KVLayout(30, 3, 64, "float32", tokens_per_block=16, model_id="SmolLM2-135M-Instruct")


@settings(max_examples=50, deadline=None)
@given(a=st.lists(st.integers(0, 49_151), min_size=0, max_size=80),
       b=st.lists(st.integers(0, 49_151), min_size=0, max_size=80))
def test_block_keys_are_equal_exactly_on_shared_prefixes(a, b):
    k = PrefixKeyer(LAYOUT)
    ka, kb = k.block_keys(a), k.block_keys(b)
    assert len(ka) == len(a) // 16
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (common >= (i + 1) * 16)


def test_keys_cover_the_whole_prefix():
    k = PrefixKeyer(LAYOUT)
    base = list(range(64))
    changed = [999] + base[1:]  # only the first token differs
    assert all(x != y for x, y in zip(k.block_keys(base), k.block_keys(changed)))
    assert k.block_keys(base, max_blocks=2) == k.block_keys(base)[:2]
    assert k.block_keys(base[:15]) == []


def test_layout_model_and_tenant_namespaces_never_cross():
    ids = list(range(160))
    variants = [LAYOUT, replace(LAYOUT, dtype="bfloat16"), replace(LAYOUT, num_kv_heads=4),
                replace(LAYOUT, model_id="another"), replace(LAYOUT, tokens_per_block=32)]
    keys = [set(PrefixKeyer(lay).block_keys(ids)) for lay in variants]
    keys += [set(PrefixKeyer(LAYOUT, tenant=t).block_keys(ids)) for t in ("alice", "bob", b"bob\x00")]
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            assert not keys[i] & keys[j], (i, j)
    assert PrefixKeyer(LAYOUT, tenant="").namespace == PrefixKeyer(LAYOUT).namespace


def test_keys_are_stable_across_processes():
    code = ("from kvswarm.layout import KVLayout; from kvswarm.prefix import PrefixKeyer;"
            "print(PrefixKeyer(KVLayout(30, 3, 64, 'float32', 16, 'SmolLM2-135M-Instruct'), 'acme')"
            ".block_keys(list(range(48)))[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=s),
                           capture_output=True, text=True, check=True).stdout.strip() for s in ("1", "2")}
    assert outs == {PrefixKeyer(LAYOUT, "acme").block_keys(list(range(48)))[-1].hex()}


def test_external_ids_and_longest_prefix():
    k = PrefixKeyer(LAYOUT)
    ext = k.external_keys([0, 5, 7])
    assert len(set(ext)) == 3 and ext == k.external_keys(np.array([0, 5, 7]))
    have = {ext[0], ext[2]}
    assert longest_prefix(ext, have.__contains__) == 1  # block 2 is useless without block 1


def test_block_header_round_trip_and_checks():
    key = b"k" * 16
    ns = PrefixKeyer(LAYOUT).namespace
    buf, kv = new_block(key, ns, 16, 3, 100)
    kv[:] = b"x" * 100
    h = read_header(buf)
    assert h == BlockHeader(key, ns, 16, 3, 100)
    assert bytes(buf[:64]) == header_bytes(h)
    assert matches(buf, key, ns, 100)
    assert not matches(buf, b"j" * 16)
    assert not matches(buf, key, PrefixKeyer(LAYOUT, "other").namespace)
    assert not matches(buf, key, ns, 99)
    assert read_header(buf[:-1]) is None  # truncated
    assert read_header(b"\0" * 64) is None
